//! The collectives of the shared-memory backend, run on a comm stream's thread (setup
//! operations on the caller's): the thread backend's algorithm over the ranks' segments.
//!
//! A collective copies this rank's input into its own segment, writes its descriptor (the
//! [`Post`] the thread and MPI backends validate, encoded by `comm::wire`) into the segment
//! header and arrives at barrier 1; once every rank arrived, every rank validates every
//! descriptor (the same verdict everywhere) and does its own share of the copying straight from
//! the peers' segments with the thread backend's copy loops and reduction kernel
//! (`engine::copy`): all-gather copies every peer's input into its output; reduce-scatter
//! reduces its own chunk across the peers' inputs in rank order; all-reduce reduces chunk r into
//! its segment, then (after a barrier) copies every other chunk from its owner's segment;
//! broadcast copies the root's segment; reduce has the root reduce every segment into its
//! buffer. Barrier 2 keeps every segment unchanged until every rank finished reading it.
//! Reductions are therefore bitwise the thread backend's.

use candle_core::Tensor;

use super::segment::{wait_for, Header, PeerMap, Segment, Stop, DESC_MAX};
use super::Shm;
use crate::comm::buffer::{with_checked_bufs, Kind, Post, Problem, RawBuf};
use crate::comm::engine::copy::{self, with_elem};
use crate::comm::engine::group::Collective;
use crate::comm::engine::messages::decode_and_validate;
use crate::comm::{wire, Call, OpKind, ReduceOp};
use crate::error::{Error, Result};

/// One communicator of one rank: its own segment and its mappings of the peers' (index =
/// rank of the group; `None` at this rank's index).
pub(crate) struct Comm {
    pub(super) own: Segment,
    pub(super) peers: Vec<Option<PeerMap>>,
}

impl Comm {
    /// This rank's segment and its mappings of the peers' (`peers[rank]` is `None`).
    pub(super) fn new(own: Segment, peers: Vec<Option<PeerMap>>) -> Comm {
        Comm { own, peers }
    }

    pub(super) fn header(&self, j: usize) -> Header {
        match &self.peers[j] {
            Some(p) => Header(p.header()),
            None => Header(self.own.header()),
        }
    }

    /// Marks this rank as gone on this communicator.
    pub(super) fn depart(&self, rank: usize) {
        self.header(rank).set_departed();
    }
}

impl crate::comm::engine::streams::StreamComm for Comm {
    fn leave(&mut self, rank: usize) {
        self.depart(rank);
    }
}

/// One collective (or setup operation) on one rank.
pub(super) struct Ctx<'a> {
    pub core: &'a Shm,
    pub comm: &'a mut Comm,
    pub seq: u64,
    pub op: &'a str,
}

impl Ctx<'_> {
    pub(super) fn rank(&self) -> usize {
        self.core.rank
    }

    pub(super) fn ws(&self) -> usize {
        self.core.world_size
    }

    /// Runs `collective` (`None`: a barrier) on this communicator.
    pub(super) fn run(&mut self, collective: Collective<'_>) -> Result<()> {
        match collective {
            None => self.barrier(),
            Some((Call::AllGather, out, Some(input))) => self.all_gather(input, out),
            Some((Call::ReduceScatter(op), out, Some(input))) => {
                self.reduce_scatter(input, out, op)
            }
            Some((Call::AllReduce(op), buf, _)) => self.all_reduce(buf, op),
            Some((Call::Broadcast(root), buf, _)) => self.broadcast(buf, root),
            Some((Call::Reduce(root, op), buf, _)) => self.reduce(buf, root, op),
            Some(_) => unreachable!("all-gather and reduce-scatter have an input"),
        }
    }

    /// Arrives at the barrier after this rank's last one and waits for every rank to arrive.
    pub(super) fn sync_next(&self) -> Result<()> {
        self.sync(self.comm.header(self.rank()).arrivals() + 1)
    }

    /// Arrives at `target` and waits for every rank to arrive.
    pub(super) fn sync(&self, target: u64) -> Result<()> {
        let headers: Vec<Header> = (0..self.ws()).map(|j| self.comm.header(j)).collect();
        headers[self.rank()].arrive(target);
        self.wait(&headers, target)
    }

    fn wait(&self, headers: &[Header], target: u64) -> Result<()> {
        let deadline = std::time::Instant::now().checked_add(self.core.timeout);
        let stop = match wait_for(headers, &self.core.pids, target, &self.core.abort, deadline) {
            Ok(()) => return Ok(()),
            Err(stop) => stop,
        };
        let (rank, op) = (self.rank(), self.op.to_string());
        let error = match stop {
            Stop::Failed(failed_rank, reason) => Error::PeerFailed {
                op,
                rank,
                failed_rank,
                reason,
            },
            Stop::Departed(departed) => Error::PeerExited { op, rank, departed },
            Stop::Died(j, pid) => {
                let reason = format!(
                    "its process (pid {pid}) ended without reporting an error (killed by a \
                     signal, or it exited in the middle of the job)"
                );
                let failed_rank = self.core.root_ranks[j];
                self.core.abort.set(failed_rank, &reason);
                Error::PeerFailed {
                    op,
                    rank,
                    failed_rank,
                    reason,
                }
            }
            Stop::Timeout(missing) => {
                self.core
                    .abort
                    .set(self.core.root_ranks[rank], &format!("timed out in {op}"));
                Error::Timeout {
                    op,
                    rank,
                    timeout: self.core.timeout,
                    missing,
                }
            }
        };
        Err(error)
    }

    /// Barrier 1: publishes `post` (with `setup_bytes`, the setup argument) and waits for every
    /// rank; then maps grown peer segments and validates every rank's post (the same verdict
    /// on every rank). Returns the generation reached.
    pub(super) fn exchange(&mut self, post: &Post, setup_bytes: &[u8]) -> Result<u64> {
        if let Some((failed_rank, reason)) = self.core.abort.get() {
            return Err(Error::PeerFailed {
                op: self.op.to_string(),
                rank: self.rank(),
                failed_rank,
                reason,
            });
        }
        let desc = wire::encode(post, setup_bytes);
        if desc.len() > DESC_MAX {
            return Err(Error::InvalidArgument(format!(
                "{}: argument of {} bytes, the shared-memory backend takes at most {}",
                self.op,
                setup_bytes.len(),
                DESC_MAX - 64
            )));
        }
        let headers: Vec<Header> = (0..self.ws()).map(|j| self.comm.header(j)).collect();
        let me = headers[self.rank()];
        let target = me.arrivals() + 1;
        me.write_desc(target, &desc);
        me.arrive(target);
        self.wait(&headers, target)?;
        let descs: Vec<Vec<u8>> = headers.iter().map(|h| h.read_desc(target)).collect();
        for p in self.comm.peers.iter_mut().flatten() {
            p.refresh()?;
        }
        decode_and_validate(self.op, self.rank(), &descs)?;
        Ok(target)
    }

    /// Reports a local `problem` through the exchange (every rank fails the same way).
    fn fail_with(&mut self, kind: Kind, problem: Problem) -> Error {
        let mut post = Post::new(kind, self.seq);
        post.problem = Some(problem);
        match self.exchange(&post, &[]) {
            Err(e) => e,
            Ok(_) => unreachable!("validation fails on a post with a problem"),
        }
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
            return Err(Error::InvalidArgument(format!(
                "{}: rank {j}'s segment holds {have} bytes, {bytes} needed",
                self.op
            )));
        }
        Ok(RawBuf {
            ptr,
            len,
            dtype: like.dtype,
        })
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

    /// Runs collective `kind` on `dst` (written; `which` names it) and `src` (read), both
    /// locked for the whole call; a buffer this rank cannot use takes part in the exchange
    /// only to report why.
    fn with_storage(
        &mut self,
        kind: OpKind,
        dst: &Tensor,
        which: &'static str,
        src: Option<&Tensor>,
        body: impl FnOnce(&mut Self, RawBuf, Option<RawBuf>) -> Result<()>,
    ) -> Result<()> {
        with_checked_bufs(self, kind, dst, which, src, Self::fail_with, body)
    }

    fn post(&self, kind: OpKind) -> Post {
        Post::new(Kind::Op(kind), self.seq)
    }

    fn all_gather(&mut self, input: &Tensor, output: &Tensor) -> Result<()> {
        let kind = OpKind::AllGather;
        self.with_storage(kind, output, "output", Some(input), |ctx, out, src| {
            let src = src.expect("all-gather has an input");
            ctx.copy_in(src, 0..0)?;
            let mut post = ctx.post(kind);
            post.input = Some(src);
            post.output = Some(out);
            let generation = ctx.exchange(&post, &[])?;
            let srcs = (0..ctx.ws())
                .map(|j| match j == ctx.rank() {
                    true => Ok(src),
                    false => ctx.seg(j, src, src.len),
                })
                .collect::<Result<Vec<RawBuf>>>()?;
            // SAFETY: validated posts; `out` is this rank's locked output; every segment holds
            // its rank's input and stays unchanged until barrier 2.
            with_elem!(out.dtype, T => unsafe { copy::gather::<T>(out, &srcs, src.len) });
            ctx.sync(generation + 1)
        })
    }

    fn reduce_scatter(&mut self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()> {
        let kind = OpKind::ReduceScatter;
        self.with_storage(kind, output, "output", Some(input), |ctx, out, src| {
            let src = src.expect("reduce-scatter has an input");
            // This rank's own chunk is read from its tensor by itself only.
            let own = ctx.rank() * out.len..(ctx.rank() + 1) * out.len;
            ctx.copy_in(src, own)?;
            let mut post = ctx.post(kind);
            post.input = Some(src);
            post.output = Some(out);
            post.op = Some(op);
            let generation = ctx.exchange(&post, &[])?;
            let srcs = (0..ctx.ws())
                .map(|j| match j == ctx.rank() {
                    true => Ok(src),
                    false => ctx.seg(j, src, src.len),
                })
                .collect::<Result<Vec<RawBuf>>>()?;
            let (start, ws) = (ctx.rank() * out.len, ctx.ws());
            // SAFETY: as in `all_gather`; `out` is disjoint from every input.
            with_elem!(out.dtype, T => unsafe {
                copy::reduce_shard::<T>(out, &srcs, start, op, ws)
            });
            ctx.sync(generation + 1)
        })
    }

    fn all_reduce(&mut self, buf: &Tensor, op: ReduceOp) -> Result<()> {
        let kind = OpKind::AllReduce;
        self.with_storage(kind, buf, "buffer", None, |ctx, mine, _| {
            ctx.copy_in(mine, 0..0)?;
            let mut post = ctx.post(kind);
            post.input = Some(mine);
            post.op = Some(op);
            let generation = ctx.exchange(&post, &[])?;
            let (ws, rank) = (ctx.ws(), ctx.rank());
            let segs = (0..ws)
                .map(|j| ctx.seg(j, mine, mine.len))
                .collect::<Result<Vec<RawBuf>>>()?;
            // SAFETY: validated posts; in phase A rank r reads and writes only chunk r of the
            // segments (its own segment's chunk r is the destination).
            with_elem!(mine.dtype, T => unsafe {
                copy::all_reduce_phase_a::<T>(&segs, rank, op, ws)
            });
            // Phase B reads every chunk from its owner's segment into this rank's buffer, its
            // own chunk included.
            let mut dsts = segs.clone();
            dsts[rank] = mine;
            let (start, n) = crate::comm::reduce::chunk(mine.len, ws, rank);
            let size = mine.dtype.size_in_bytes();
            // SAFETY: chunk r of this rank's segment is final; `mine` is locked by this rank.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    segs[rank].ptr.add(start * size),
                    mine.ptr.add(start * size),
                    n * size,
                )
            };
            ctx.sync(generation + 1)?;
            // SAFETY: every rank finished phase A; segments stay unchanged until barrier 3.
            with_elem!(mine.dtype, T => unsafe {
                copy::all_reduce_phase_b::<T>(&dsts, rank, ws)
            });
            ctx.sync(generation + 2)
        })
    }

    fn broadcast(&mut self, buf: &Tensor, root: usize) -> Result<()> {
        let kind = OpKind::Broadcast;
        self.with_storage(kind, buf, "buffer", None, |ctx, mine, _| {
            if ctx.rank() == root {
                ctx.copy_in(mine, 0..0)?;
            }
            let mut post = ctx.post(kind);
            post.input = Some(mine);
            post.root = Some(root);
            let generation = ctx.exchange(&post, &[])?;
            if ctx.rank() != root {
                let src = ctx.seg(root, mine, mine.len)?;
                // SAFETY: validated posts; the root's segment is unchanged until barrier 2.
                with_elem!(mine.dtype, T => unsafe { copy::copy_from::<T>(mine, src) });
            }
            ctx.sync(generation + 1)
        })
    }

    fn reduce(&mut self, buf: &Tensor, root: usize, op: ReduceOp) -> Result<()> {
        let kind = OpKind::Reduce;
        self.with_storage(kind, buf, "buffer", None, |ctx, mine, _| {
            if ctx.rank() != root {
                ctx.copy_in(mine, 0..0)?;
            }
            let mut post = ctx.post(kind);
            post.input = Some(mine);
            post.op = Some(op);
            post.root = Some(root);
            let generation = ctx.exchange(&post, &[])?;
            if ctx.rank() == root {
                let ws = ctx.ws();
                let bufs = (0..ws)
                    .map(|j| match j == root {
                        true => Ok(mine),
                        false => ctx.seg(j, mine, mine.len),
                    })
                    .collect::<Result<Vec<RawBuf>>>()?;
                // SAFETY: validated posts; the root writes only its own buffer.
                with_elem!(mine.dtype, T => unsafe {
                    copy::reduce_to_root::<T>(&bufs, root, op, ws)
                });
            }
            ctx.sync(generation + 1)
        })
    }

    fn barrier(&mut self) -> Result<()> {
        let post = self.post(OpKind::Barrier);
        // No data is shared: no second barrier (descriptors are double-buffered).
        self.exchange(&post, &[]).map(|_| ())
    }
}
