//! The MPI backend's [`Link`]: one rank's non-blocking point-to-point messages on one
//! communicator (a stream's own, or the setup one), over which the collectives of
//! `comm::engine::messages` run, completed by a polling wait with a deadline
//! ([`super::runtime::wait_all`]). Messages larger than 1 GiB are split (MPI counts are
//! 32-bit); descriptors and data travel under different tags.

use std::ffi::c_int;

use candle_core::Tensor;
use mpi::ffi;

use super::runtime::{check, deadline_after, wait_all, WaitFor};
use super::Mpi;
use crate::comm::buffer::Post;
use crate::comm::engine::group::{OpCtx, Operation};
use crate::comm::engine::messages::{decode_and_validate, Link, Msg};
use crate::comm::engine::peer_failed;
use crate::comm::wire;
use crate::error::Result;

/// Tag of descriptors.
const TAG_DESC: c_int = 1;
/// Tag of data messages.
const TAG_DATA: c_int = 2;
/// Largest single message (bytes).
const MAX_MESSAGE: usize = 1 << 30;
/// Segment of the reduction exchanges (bytes per peer and round). Measured (2 processes on 2
/// cores, 64 MiB reduce-scatter): 4.8 GB/s with 256 KiB, 4.1 GB/s with 1 MiB, 3.4 GB/s with
/// 4 MiB; one segment per peer and round must stay in cache while it is reduced.
const SEGMENT_BYTES: usize = 256 << 10;

/// One collective (or setup operation) on one rank.
pub(super) type Ctx<'a> = OpCtx<'a, Mpi>;

/// Messages posted and not yet waited for, with the peer of each.
pub(crate) struct Pending {
    reqs: Vec<ffi::MPI_Request>,
    peers: Vec<usize>,
}

impl Ctx<'_> {
    /// Posts `recvs` then `sends` (split into messages of at most 1 GiB). On an error the
    /// messages already posted are abandoned (see [`super::runtime::Runtime::poison`]).
    fn post(&self, recvs: &[Msg], sends: &[Msg], tag: c_int) -> Result<Pending> {
        let mut p = Pending {
            reqs: Vec::new(),
            peers: Vec::new(),
        };
        for (is_send, m) in recvs
            .iter()
            .map(|m| (false, m))
            .chain(sends.iter().map(|m| (true, m)))
        {
            let mut off = 0;
            while off < m.len {
                let len = (m.len - off).min(MAX_MESSAGE);
                // SAFETY: a null request before the call; filled by MPI.
                let mut req: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
                // SAFETY: `m.ptr[off..off + len]` lies in a buffer the caller keeps alive (and,
                // for receives, writable and otherwise untouched) until the wait returns, or
                // forever if it gives up.
                let rc = unsafe {
                    let ptr = m.ptr.add(off);
                    let (n, peer, comm) = (len as c_int, m.peer as c_int, self.comm.comm.0);
                    let byte = ffi::RSMPI_UINT8_T;
                    match is_send {
                        true => ffi::MPI_Isend(ptr as *const _, n, byte, peer, tag, comm, &mut req),
                        false => ffi::MPI_Irecv(ptr.cast(), n, byte, peer, tag, comm, &mut req),
                    }
                };
                let call = if is_send { "MPI_Isend" } else { "MPI_Irecv" };
                let what = || format!("{call} to rank {} ({})", m.peer, self.op);
                check(rc, what, self.core.rt.world_rank).inspect_err(|_| self.core.rt.poison())?;
                p.reqs.push(req);
                p.peers.push(m.peer);
                off += len;
            }
        }
        Ok(p)
    }

    /// Waits for every message of `p` until the operation's deadline (see [`wait_all`]).
    fn complete(&self, p: &mut Pending) -> Result<()> {
        if p.reqs.is_empty() {
            return Ok(());
        }
        let wait = WaitFor {
            op: self.op,
            rank: self.core.place.rank,
            deadline: self.comm.deadline,
            timeout: self.core.place.timeout,
        };
        wait_all(self.core.rt, &mut p.reqs, &p.peers, &wait)
    }
}

impl Link for Ctx<'_> {
    type Pending = Pending;
    const SEGMENT_BYTES: usize = SEGMENT_BYTES;
    /// Receives are posted at the start: round k+1's land while segment k is reduced.
    const ROUNDS_IN_FLIGHT: usize = 2;

    /// The operation's one deadline starts once its buffers are locked.
    fn start_clock(&mut self) {
        self.comm.deadline = deadline_after(self.core.place.timeout);
    }

    /// Sends this rank's descriptor to every peer, receives theirs, and validates all of them
    /// (the same verdict on every rank).
    fn exchange(&mut self, post: &Post) -> Result<()> {
        let (ws, rank) = (self.world_size(), self.rank());
        // No longer than the peers' receives.
        let mine = wire::encode_within(post, self.comm.desc_max);
        self.core.rt.poll_failures();
        if let Some(failure) = self.core.rt.failure() {
            return Err(peer_failed(self.op, rank, failure));
        }
        let mut bufs: Vec<Vec<u8>> = (0..ws).map(|_| vec![0u8; self.comm.desc_max]).collect();
        let peers = self.peers();
        // Receives of `desc_max` bytes accept shorter descriptors; the actual length is the
        // descriptor's own business (it is self-delimiting), trailing zeros are ignored.
        let recvs = Msg::each(&peers, |j| (bufs[j].as_mut_ptr(), bufs[j].len()));
        let sends = Msg::each(&peers, |_| (mine.as_ptr() as *mut u8, mine.len()));
        let sent = self
            .post(&recvs, &sends, TAG_DESC)
            .and_then(|mut p| self.complete(&mut p));
        if let Err(e) = sent {
            // Abandoned receives may still land: keep their buffers.
            std::mem::forget(bufs);
            std::mem::forget(mine);
            return Err(e);
        }
        bufs[rank] = mine;
        decode_and_validate(self.op, rank, &bufs)
    }

    fn start(&mut self, sends: &[Msg], recvs: &[Msg]) -> Result<Pending> {
        self.post(recvs, sends, TAG_DATA)
    }

    fn finish(&mut self, mut pending: Pending) -> Result<()> {
        self.complete(&mut pending)
    }

    fn scratch(&mut self, bytes: usize) -> *mut u8 {
        let words = bytes.div_ceil(8);
        if self.comm.scratch.len() < words {
            self.comm.scratch.resize(words, 0);
        }
        self.comm.scratch.as_mut_ptr() as *mut u8
    }

    /// Abandoned messages may still read or write the buffers: when the runtime is poisoned,
    /// they stay allocated for the rest of the process.
    fn failed(&mut self, dst: &Tensor, src: Option<&Tensor>) {
        if self.core.rt.is_poisoned() {
            std::mem::forget(dst.clone());
            std::mem::forget(src.cloned());
            std::mem::forget(std::mem::take(&mut self.comm.scratch));
        }
    }
}
