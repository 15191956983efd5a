//! The shared-memory backend's [`Board`]: a rank's segment of one communicator (setup
//! operations on the caller's thread, collectives on a stream's), over which the shared-memory
//! family's collectives run (`comm::engine::board`, the thread backend's algorithm).
//!
//! Before barrier 1 a rank makes what its peers will read of its buffer readable: it posts the
//! buffer's offset in its shared arena when the buffer lies there (`crate::alloc::shared`), else
//! copies it into its own segment (growing it if needed); and it writes its descriptor (the
//! [`Post`] every backend validates, encoded by `comm::wire`) into the segment header. Then every
//! rank validates every descriptor (the same verdict everywhere) and reads the peers' arenas or
//! segments in place. Reductions are therefore bitwise the thread backend's.

use std::time::Instant;

use super::segment::{alive, Header, PeerMap, Segment, DESC_MAX, LIVENESS_EVERY};
use super::Shm;
use crate::alloc::shared as arena;
use crate::comm::buffer::{Post, RawBuf};
use crate::comm::engine::board::{Board, Expose};
use crate::comm::engine::group::{OpCtx, Operation};
use crate::comm::engine::messages::decode_and_validate;
use crate::comm::engine::peer_failed;
use crate::comm::wire;
use crate::error::{Error, Result};

/// One communicator of one rank: its own segment and its mappings of the peers' (index =
/// rank of the group; `None` at this rank's index).
pub(crate) struct Comm {
    pub(super) own: Segment,
    pub(super) peers: Vec<Option<PeerMap>>,
}

impl Comm {
    pub(super) fn header(&self, j: usize) -> Header {
        match &self.peers[j] {
            Some(p) => p.header(),
            None => self.own.header(),
        }
    }
}

impl crate::comm::engine::streams::StreamComm for Comm {
    /// Marks this rank as gone on this communicator.
    fn leave(&mut self, rank: usize) {
        self.header(rank).set_departed();
    }
}

/// One collective (or setup operation) on one rank.
pub(super) type Ctx<'a> = OpCtx<'a, Shm>;

impl Ctx<'_> {
    /// Arrives at the barrier after this rank's last one and waits for every rank to arrive.
    pub(super) fn sync_next(&self) -> Result<()> {
        let target = self.comm.header(self.rank()).arrivals() + 1;
        self.arrive_and_wait(target).map(|_| ())
    }

    /// Arrives at `target` and waits for every rank to arrive; returns every rank's header.
    fn arrive_and_wait(&self, target: u64) -> Result<Vec<Header>> {
        let headers: Vec<Header> = (0..self.world_size())
            .map(|j| self.comm.header(j))
            .collect();
        headers[self.rank()].arrive(target);
        self.wait(&headers, target)?;
        Ok(headers)
    }

    /// Waits until every rank of `headers` arrived at `target`: yields the core for
    /// [`crate::comm::work::YIELD_BEFORE_SLEEP`], then sleeps 50 µs between looks; fails on a
    /// recorded failure, a departed missing peer, a missing peer whose process is gone (checked
    /// every [`LIVENESS_EVERY`], recorded as its failure), or at the timeout (which aborts the
    /// job).
    fn wait(&self, headers: &[Header], target: u64) -> Result<()> {
        let (rank, pids) = (self.rank(), &self.core.pids);
        let start = Instant::now();
        let deadline = start.checked_add(self.core.place.timeout);
        let mut checked = start;
        let missing = || (0..headers.len()).filter(move |&j| headers[j].arrivals() < target);
        loop {
            if missing().next().is_none() {
                return Ok(());
            }
            if let Some(failure) = self.core.abort.get() {
                return Err(peer_failed(self.op, rank, failure));
            }
            if let Some(departed) = missing().find(|&j| headers[j].departed()) {
                let op = self.op.to_string();
                return Err(Error::PeerExited { op, rank, departed });
            }
            let now = Instant::now();
            if now.duration_since(checked) >= LIVENESS_EVERY {
                checked = now;
                if let Some(j) = missing().find(|&j| pids[j] != 0 && !alive(pids[j])) {
                    let reason = format!(
                        "its process (pid {}) ended without reporting an error (killed by a \
                         signal, or it exited in the middle of the job)",
                        pids[j]
                    );
                    let failed_rank = self.core.root_ranks[j];
                    self.core.abort.set(failed_rank, &reason);
                    return Err(peer_failed(self.op, rank, (failed_rank, reason)));
                }
            }
            if deadline.is_some_and(|d| now >= d) {
                let op = self.op.to_string();
                (self.core.abort).set(self.core.root_ranks[rank], &format!("timed out in {op}"));
                let timeout = self.core.place.timeout;
                let missing = missing().collect();
                return Err(Error::Timeout {
                    op,
                    rank,
                    timeout,
                    missing,
                });
            }
            if now.duration_since(start) < crate::comm::work::YIELD_BEFORE_SLEEP {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }

    /// Barrier 1: publishes `post` and waits for every rank; then maps grown peer segments and
    /// validates every rank's post (the same verdict on every rank). Returns the generation
    /// reached.
    pub(super) fn exchange(&mut self, post: &Post) -> Result<u64> {
        let desc = wire::encode_within(post, DESC_MAX);
        if let Some(failure) = self.core.abort.get() {
            return Err(peer_failed(self.op, self.rank(), failure));
        }
        let me = self.comm.header(self.rank());
        let target = me.arrivals() + 1;
        me.write_desc(target, &desc);
        let headers = self.arrive_and_wait(target)?;
        let descs: Vec<Vec<u8>> = headers.iter().map(|h| h.read_desc(target)).collect();
        let refreshed = (self.comm.peers.iter_mut().flatten()).try_for_each(|p| p.refresh());
        refreshed.map_err(|e| self.core.stop_job(e))?;
        decode_and_validate(self.op, self.rank(), &descs)?;
        Ok(target)
    }

    /// Rank `j`'s data area as a buffer of `len` elements of `like`'s dtype (this rank's own
    /// segment at its own index).
    fn seg(&self, j: usize, like: RawBuf, len: usize) -> Result<RawBuf> {
        let bytes = len * like.dtype.size_in_bytes();
        let (ptr, have) = match &self.comm.peers[j] {
            Some(p) => (p.data(), p.data_len()),
            None => (self.comm.own.data(), usize::MAX),
        };
        if bytes > have {
            return Err(Error::shape(
                format_args!("{}: rank {j}'s segment", self.op),
                format_args!("{bytes} bytes (needed)"),
                format_args!("{have} bytes (what it holds)"),
            ));
        }
        Ok(RawBuf { ptr, len, ..like })
    }

    /// Copies `src` into this rank's segment (growing it if needed), except the elements
    /// `skip` (which no peer reads).
    fn copy_in(&mut self, src: RawBuf, skip: std::ops::Range<usize>) -> Result<()> {
        let size = src.dtype.size_in_bytes();
        self.comm.own.ensure(src.len * size)?;
        for (start, end) in [
            (0, skip.start.min(src.len)),
            (skip.end.min(src.len), src.len),
        ] {
            if start < end {
                // SAFETY: `src` is this rank's locked buffer; the segment holds `src.len`
                // elements (ensured) and no peer reads it before this rank's next arrival.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src.ptr.add(start * size) as *const u8,
                        self.comm.own.data().add(start * size),
                        (end - start) * size,
                    )
                };
            }
        }
        Ok(())
    }
}

impl Board for Ctx<'_> {
    /// Says where the peers read this rank's buffer: in place when it lies in this process's
    /// arena (and every rank mapped every arena), else copied into this rank's segment; then
    /// barrier 1 (`exchange`).
    fn publish(&mut self, post: &Post, buf: RawBuf, expose: Expose) -> Result<u64> {
        let bytes = buf.len * buf.dtype.size_in_bytes();
        let in_place = match expose {
            Expose::Nothing => None,
            _ if self.core.in_place => arena::offset_of(buf.ptr, bytes),
            _ => None,
        };
        self.comm.header(self.rank()).set_data_at(in_place);
        let copied = match (in_place, expose) {
            (Some(_), _) | (None, Expose::Nothing) => Ok(()),
            (None, Expose::Whole) => self.copy_in(buf, 0..0),
            (None, Expose::AllBut(skip)) => self.copy_in(buf, skip),
        };
        copied.map_err(|e| self.core.stop_job(e))?;
        self.exchange(post)
    }

    /// Rank `j`'s buffer where its arena holds it, else its segment's data area.
    fn readable(&self, j: usize, like: RawBuf, len: usize) -> Result<RawBuf> {
        let Some(off) = self.comm.header(j).data_at() else {
            return self.seg(j, like, len).map_err(|e| self.core.stop_job(e));
        };
        let bytes = len * like.dtype.size_in_bytes();
        let ptr = match j == self.rank() {
            true => arena::own_at(off, bytes),
            false => (self.core.arenas.get(self.core.root_ranks[j]))
                .and_then(|a| a.as_ref()?.at(off, bytes)),
        };
        let ptr = ptr.ok_or_else(|| {
            self.core.stop_job(Error::shape(
                format_args!("{}: rank {j}'s arena", self.op),
                format_args!("{bytes} bytes from offset {off} inside it"),
                "an arena that is not mapped here, or too short",
            ))
        })?;
        Ok(RawBuf { ptr, len, ..like })
    }

    /// Arrives at barrier `target` and waits for every rank; fails when the job was aborted
    /// meanwhile even if every rank arrived: a rank that arrived and then timed out waiting
    /// may have freed a buffer this rank was still reading in place.
    fn sync(&self, target: u64) -> Result<()> {
        Ctx::arrive_and_wait(self, target)?;
        match self.core.abort.get() {
            None => Ok(()),
            Some(failure) => Err(peer_failed(self.op, self.rank(), failure)),
        }
    }

    /// Nothing to guard: what peers read lives in segments or arenas, which stay mapped
    /// whatever this rank frees, and a rank that leaves the data phase early never arrives at
    /// the last barrier, so the peers' collective fails (see [`Board::sync`] here).
    fn data_phase(&self) -> impl Sized + '_ {}
}
