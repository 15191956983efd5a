//! The collectives of the MPI backend, run on a comm stream's thread: descriptor exchange and
//! validation, then the data movement as non-blocking point-to-point messages on the stream's
//! own communicator, completed by a polling wait with a deadline ([`super::runtime::wait_all`]).
//!
//! Algorithms (`ws` ranks, `n` elements per rank's share, this rank `r`):
//! - **all-gather**: every rank sends its input to every other rank, received straight into
//!   `output[j*n..]`; its own part is a local copy.
//! - **reduce-scatter**: every rank sends `input[j*n..(j+1)*n]` to rank `j` and receives its own
//!   share from every peer, then reduces the `ws` shares *in rank order* with the thread
//!   backend's kernel ([`crate::comm::reduce::reduce_into`]): f32, bf16 and f16 accumulate in f32
//!   and round once. It runs in segments of 256 KiB per peer (lockstep rounds): the scratch
//!   space is one segment per peer whatever the buffer size, and each segment is reduced while
//!   it is still in cache. bf16/f16 travel at their own width; nothing is widened on
//!   the wire and no MPI reduction op is involved, so the result is bitwise the thread
//!   backend's, for every dtype and op.
//! - **all-reduce**: the reduce-scatter above on `ws` nearly equal chunks, in place, then the
//!   all-gather of the chunks.
//! - **broadcast**: the root sends to every rank. **reduce**: every rank sends to the root, which
//!   reduces in rank order into its buffer (segmented like reduce-scatter). **barrier**: the descriptor exchange alone.
//!
//! Each rank sends and receives `(ws - 1) · n` elements per reduce-scatter or all-gather, as the
//! ring algorithms do (bandwidth-optimal), in `ws - 1` messages each way (latency grows with the
//! world size, which suits the few-to-tens of processes this backend targets). Messages larger
//! than 1 GiB are split (MPI counts are 32-bit).

use std::ffi::c_int;
use std::time::{Duration, Instant};

use candle_core::Tensor;
use mpi::ffi;

use super::runtime::{abandon, check, deadline_after, wait_all, Comm, Runtime, WaitFor};
use crate::comm::buffer::{
    check as check_buf, validate, with_raw_bufs, Kind, Post, Problem, RawBuf,
};
use crate::comm::reduce::{chunk, reduce_into, with_elem};
use crate::comm::wire;
use crate::comm::{OpKind, ReduceOp};
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
pub(super) struct OpCtx<'a> {
    pub rt: &'static Runtime,
    pub comm: Comm,
    pub rank: usize,
    pub world_size: usize,
    pub seq: u64,
    pub op: &'a str,
    pub timeout: Duration,
    /// Reused receive space of the stream (8-byte aligned for every element type).
    pub scratch: &'a mut Vec<u64>,
    /// Largest descriptor expected from a peer.
    pub desc_max: usize,
}

/// Messages posted and not yet waited for, with the peer of each.
struct Pending {
    reqs: Vec<ffi::MPI_Request>,
    peers: Vec<usize>,
}

/// A message to post: peer, address, length in bytes.
struct Msg {
    peer: usize,
    ptr: *mut u8,
    bytes: usize,
}

impl OpCtx<'_> {
    fn wait_for(&self, deadline: Instant) -> WaitFor<'_> {
        WaitFor {
            op: self.op,
            rank: self.rank,
            deadline,
            timeout: self.timeout,
        }
    }

    /// Posts `recvs` then `sends` (split into messages of at most 1 GiB). On an error the
    /// messages already posted are abandoned (see [`abandon`]).
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
            while off < m.bytes {
                let len = (m.bytes - off).min(MAX_MESSAGE);
                // SAFETY: a null request before the call; filled by MPI.
                let mut req: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
                // SAFETY: `m.ptr[off..off + len]` lies in a buffer the caller keeps alive (and,
                // for receives, writable and otherwise untouched) until the wait returns, or
                // forever if it gives up.
                let rc = unsafe {
                    let ptr = m.ptr.add(off);
                    if is_send {
                        ffi::MPI_Isend(
                            ptr as *const _,
                            len as c_int,
                            ffi::RSMPI_UINT8_T,
                            m.peer as c_int,
                            tag,
                            self.comm.0,
                            &mut req,
                        )
                    } else {
                        ffi::MPI_Irecv(
                            ptr.cast(),
                            len as c_int,
                            ffi::RSMPI_UINT8_T,
                            m.peer as c_int,
                            tag,
                            self.comm.0,
                            &mut req,
                        )
                    }
                };
                let checked = check(
                    rc,
                    || {
                        format!(
                            "{} to rank {} ({})",
                            if is_send { "MPI_Isend" } else { "MPI_Irecv" },
                            m.peer,
                            self.op
                        )
                    },
                    self.rt.world_rank,
                );
                if let Err(e) = checked {
                    abandon(self.rt, &mut p.reqs);
                    return Err(e);
                }
                p.reqs.push(req);
                p.peers.push(m.peer);
                off += len;
            }
        }
        Ok(p)
    }

    /// Waits for every message of `p` (see [`wait_all`]).
    fn complete(&self, p: &mut Pending, deadline: Instant) -> Result<()> {
        if p.reqs.is_empty() {
            return Ok(());
        }
        wait_all(self.rt, &mut p.reqs, &p.peers, &self.wait_for(deadline))
    }

    /// Posts `recvs` then `sends` and waits for all.
    fn transfer(&self, recvs: &[Msg], sends: &[Msg], tag: c_int, deadline: Instant) -> Result<()> {
        let mut p = self.post(recvs, sends, tag)?;
        self.complete(&mut p, deadline)
    }

    /// Sends this rank's descriptor to every peer, receives theirs, and validates all of them
    /// (the same verdict on every rank). Returns the posts (index = rank).
    pub(super) fn exchange(&self, post: Post, setup_bytes: &[u8], deadline: Instant) -> Result<()> {
        let ws = self.world_size;
        self.rt.poll_failures();
        if let Some((failed_rank, reason)) = self.rt.failure() {
            return Err(crate::error::Error::PeerFailed {
                op: self.op.to_string(),
                rank: self.rank,
                failed_rank,
                reason,
            });
        }
        let mine = wire::encode(&post, setup_bytes);
        let mut bufs: Vec<Vec<u8>> = (0..ws).map(|_| vec![0u8; self.desc_max]).collect();
        let recvs: Vec<Msg> = (0..ws)
            .filter(|&j| j != self.rank)
            .map(|j| Msg {
                peer: j,
                ptr: bufs[j].as_mut_ptr(),
                bytes: self.desc_max,
            })
            .collect();
        // Receives of `desc_max` bytes accept shorter descriptors; the actual length is the
        // descriptor's own business (it is self-delimiting), trailing zeros are ignored.
        let sends: Vec<Msg> = (0..ws)
            .filter(|&j| j != self.rank)
            .map(|j| Msg {
                peer: j,
                ptr: mine.as_ptr() as *mut u8,
                bytes: mine.len(),
            })
            .collect();
        if let Err(e) = self.transfer(&recvs, &sends, TAG_DESC, deadline) {
            // Abandoned receives may still land: keep their buffers.
            std::mem::forget(bufs);
            std::mem::forget(mine);
            return Err(e);
        }
        let mut posts = Vec::with_capacity(ws);
        for (j, buf) in bufs.iter().enumerate() {
            if j == self.rank {
                let mut own = post;
                if post.bytes.is_some() {
                    own.bytes = Some(crate::comm::buffer::RawBytes::of(setup_bytes));
                }
                posts.push(own);
                continue;
            }
            let Some(p) = wire::decode(buf) else {
                return Err(crate::error::Error::CollectiveMismatch {
                    op: self.op.to_string(),
                    rank: j,
                    found: "a descriptor this version cannot read".into(),
                    other_rank: self.rank,
                    expected: "a candle-fsdp collective descriptor".into(),
                });
            };
            posts.push(p);
        }
        validate(self.op, ws, &posts)
    }

    fn deadline(&self) -> Instant {
        deadline_after(self.timeout)
    }

    /// Reports a local `problem` through the exchange (every rank fails the same way).
    fn fail_with(&self, kind: Kind, problem: Problem) -> crate::error::Error {
        let mut post = Post::new(kind, self.seq);
        post.problem = Some(problem);
        match self.exchange(post, &[], self.deadline()) {
            Err(e) => e,
            Ok(()) => unreachable!("validation fails on a post with a problem"),
        }
    }

    /// Runs collective `kind` on `dst` (written; `which` names it) and `src` (read): locks
    /// both for the whole call, exchanges and validates the descriptors (buffers, `op`, `root`;
    /// `src` is the input when given, else `dst` is), then runs `body(ctx, dst, src, deadline)`.
    /// A buffer this rank cannot use takes part in the exchange only to report why.
    #[allow(clippy::too_many_arguments)]
    fn with_storage(
        &mut self,
        kind: OpKind,
        dst: &Tensor,
        which: &'static str,
        src: Option<&Tensor>,
        op: Option<ReduceOp>,
        root: Option<usize>,
        body: impl FnOnce(&mut Self, RawBuf, Option<RawBuf>, Instant) -> Result<()>,
    ) -> Result<()> {
        if let Some(problem) = src
            .and_then(|s| check_buf(s, "input"))
            .or_else(|| check_buf(dst, which))
        {
            return Err(self.fail_with(Kind::Op(kind), problem));
        }
        let this = std::cell::RefCell::new(&mut *self);
        let result = with_raw_bufs(dst, src, |d, s: Option<RawBuf>| {
            let ctx = &mut **this.borrow_mut();
            let mut post = Post::new(Kind::Op(kind), ctx.seq);
            post.input = Some(s.unwrap_or(d));
            post.output = s.map(|_| d);
            post.op = op;
            post.root = root;
            let deadline = ctx.deadline();
            ctx.exchange(post, &[], deadline)?;
            body(ctx, d, s, deadline)
        });
        let result = match result {
            Ok(r) => r,
            Err(_refused) => Err(self.fail_with(Kind::Op(kind), Problem::Aliased)),
        };
        if result.is_err() && self.rt.is_poisoned() {
            // Abandoned messages may still read or write these buffers.
            std::mem::forget(dst.clone());
            std::mem::forget(src.cloned());
            std::mem::forget(std::mem::take(self.scratch));
        }
        result
    }

    /// Scratch space for `slots` buffers of `bytes` bytes each, 8-byte aligned; returns the
    /// address of slot 0 and the slot stride in bytes.
    fn scratch(&mut self, slots: usize, bytes: usize) -> (*mut u8, usize) {
        let stride = bytes.div_ceil(8) * 8;
        let words = slots * stride / 8;
        if self.scratch.len() < words {
            self.scratch.resize(words, 0);
        }
        (self.scratch.as_mut_ptr() as *mut u8, stride)
    }

    pub(super) fn all_gather(&mut self, input: &Tensor, output: &Tensor) -> Result<()> {
        let kind = OpKind::AllGather;
        self.with_storage(
            kind,
            output,
            "output",
            Some(input),
            None,
            None,
            |ctx, out, src, deadline| {
                let src = src.expect("all-gather has an input");
                let bytes = src.len * src.dtype.size_in_bytes();
                let peers = (0..ctx.world_size).filter(|&j| j != ctx.rank);
                let recvs: Vec<Msg> = peers
                    .clone()
                    .map(|j| Msg {
                        peer: j,
                        ptr: out.ptr.wrapping_add(j * bytes),
                        bytes,
                    })
                    .collect();
                let sends: Vec<Msg> = peers
                    .map(|j| Msg {
                        peer: j,
                        ptr: src.ptr,
                        bytes,
                    })
                    .collect();
                ctx.transfer(&recvs, &sends, TAG_DATA, deadline)?;
                // SAFETY: validated lengths (out holds ws * n elements); distinct storages.
                unsafe {
                    std::ptr::copy_nonoverlapping(src.ptr, out.ptr.add(ctx.rank * bytes), bytes)
                };
                Ok(())
            },
        )
    }

    /// The reduction exchange behind reduce-scatter, all-reduce and reduce, in segments of
    /// [`SEGMENT_BYTES`]: in round k every rank sends segment k of each `sends` entry to its peer
    /// and receives segment k of its own share (`recv_elems` elements) from every rank in
    /// `recv_from`, then reduces segment k over all ranks in rank order (its own contribution
    /// read at `own`) into `dst`. Round k+1's messages are posted before segment k is reduced
    /// (two scratch buffers of one segment per peer), so peers are never held up by this rank's
    /// arithmetic, and a segment is reduced while it is still in cache. Every rank runs the same
    /// number of rounds (the longest share's segments), so the rounds cannot deadlock.
    #[allow(clippy::too_many_arguments)]
    fn reduce_exchange(
        &mut self,
        sends: &[(usize, *const u8, usize)],
        recv_from: &[usize],
        recv_elems: usize,
        own: *const u8,
        dst: *mut u8,
        dtype: candle_core::DType,
        op: ReduceOp,
        deadline: Instant,
    ) -> Result<()> {
        let es = dtype.size_in_bytes();
        let seg = (SEGMENT_BYTES / es).max(1);
        let longest = sends
            .iter()
            .map(|s| s.2)
            .chain(std::iter::once(recv_elems))
            .max()
            .unwrap_or(0);
        let rounds = longest.div_ceil(seg);
        let ws = self.world_size;
        let (scratch, stride) = self.scratch(2 * ws, seg * es);
        // Scratch slot of peer `j` for round `k` (two buffers, alternating).
        let slot = |k: usize, j: usize| scratch.wrapping_add(((k % 2) * ws + j) * stride);
        let piece = |k: usize, elems: usize| elems.saturating_sub(k * seg).min(seg);
        let post_round = |ctx: &Self, k: usize| -> Result<Pending> {
            let recv_n = piece(k, recv_elems);
            let recvs: Vec<Msg> = recv_from
                .iter()
                .filter(|_| recv_n > 0)
                .map(|&j| Msg {
                    peer: j,
                    ptr: slot(k, j),
                    bytes: recv_n * es,
                })
                .collect();
            let sends: Vec<Msg> = sends
                .iter()
                .filter(|s| piece(k, s.2) > 0)
                .map(|&(peer, ptr, elems)| Msg {
                    peer,
                    ptr: ptr.wrapping_add(k * seg * es) as *mut u8,
                    bytes: piece(k, elems) * es,
                })
                .collect();
            ctx.post(&recvs, &sends, TAG_DATA)
        };
        let mut next = if rounds > 0 {
            Some(post_round(self, 0)?)
        } else {
            None
        };
        for k in 0..rounds {
            let mut current = next.take().expect("round k was posted");
            self.complete(&mut current, deadline)?;
            if k + 1 < rounds {
                next = Some(post_round(self, k + 1)?);
            }
            let recv_n = piece(k, recv_elems);
            if recv_n == 0 {
                continue;
            }
            let srcs: Vec<*const u8> = (0..ws)
                .map(|j| {
                    if j == self.rank {
                        own.wrapping_add(k * seg * es)
                    } else {
                        slot(k, j) as *const u8
                    }
                })
                .collect();
            let out = dst.wrapping_add(k * seg * es);
            with_elem!(dtype, T => {
                let srcs: Vec<*const T> = srcs.iter().map(|&p| p as *const T).collect();
                // SAFETY: each source holds `recv_n` elements of T (a received segment in an
                // 8-byte aligned scratch slot that round k+1 does not touch, or this rank's own
                // share at an element boundary); `out` is this rank's write-locked destination,
                // equal to its own source or disjoint from every source, and disjoint from the
                // scratch and from every segment round k+1 sends.
                unsafe { reduce_into::<T>(&srcs, out as *mut T, recv_n, op, ws) }
            });
        }
        Ok(())
    }

    pub(super) fn reduce_scatter(
        &mut self,
        input: &Tensor,
        output: &Tensor,
        op: ReduceOp,
    ) -> Result<()> {
        let kind = OpKind::ReduceScatter;
        let r = Some(op);
        self.with_storage(
            kind,
            output,
            "output",
            Some(input),
            r,
            None,
            |ctx, out, src, deadline| {
                let src = src.expect("reduce-scatter has an input");
                let (n, es) = (out.len, out.dtype.size_in_bytes());
                let (ws, rank) = (ctx.world_size, ctx.rank);
                let peers: Vec<usize> = (0..ws).filter(|&j| j != rank).collect();
                let sends: Vec<(usize, *const u8, usize)> = peers
                    .iter()
                    .map(|&j| (j, src.ptr.wrapping_add(j * n * es) as *const u8, n))
                    .collect();
                let own = src.ptr.wrapping_add(rank * n * es) as *const u8;
                ctx.reduce_exchange(&sends, &peers, n, own, out.ptr, out.dtype, op, deadline)
            },
        )
    }

    pub(super) fn all_reduce(&mut self, buf: &Tensor, op: ReduceOp) -> Result<()> {
        let kind = OpKind::AllReduce;
        self.with_storage(
            kind,
            buf,
            "buffer",
            None,
            Some(op),
            None,
            |ctx, mine, _, deadline| {
                let es = mine.dtype.size_in_bytes();
                let (ws, rank) = (ctx.world_size, ctx.rank);
                let (my_start, my_n) = chunk(mine.len, ws, rank);
                let peers: Vec<usize> = (0..ws).filter(|&j| j != rank).collect();
                let at = |start: usize| mine.ptr.wrapping_add(start * es);
                // Phase 1: reduce-scatter of the chunks, in place.
                let sends: Vec<(usize, *const u8, usize)> = peers
                    .iter()
                    .map(|&j| {
                        let (s, n) = chunk(mine.len, ws, j);
                        (j, at(s) as *const u8, n)
                    })
                    .collect();
                let own = at(my_start);
                ctx.reduce_exchange(&sends, &peers, my_n, own, own, mine.dtype, op, deadline)?;
                // Phase 2: all-gather of the reduced chunks.
                let recvs: Vec<Msg> = peers
                    .iter()
                    .map(|&j| {
                        let (s, n) = chunk(mine.len, ws, j);
                        Msg {
                            peer: j,
                            ptr: at(s),
                            bytes: n * es,
                        }
                    })
                    .collect();
                let sends: Vec<Msg> = peers
                    .iter()
                    .map(|&j| Msg {
                        peer: j,
                        ptr: own,
                        bytes: my_n * es,
                    })
                    .collect();
                ctx.transfer(&recvs, &sends, TAG_DATA, deadline)
            },
        )
    }

    pub(super) fn broadcast(&mut self, buf: &Tensor, root: usize) -> Result<()> {
        let kind = OpKind::Broadcast;
        self.with_storage(
            kind,
            buf,
            "buffer",
            None,
            None,
            Some(root),
            |ctx, mine, _, deadline| {
                let bytes = mine.len * mine.dtype.size_in_bytes();
                let msg = |peer| Msg {
                    peer,
                    ptr: mine.ptr,
                    bytes,
                };
                if ctx.rank == root {
                    let sends: Vec<Msg> = (0..ctx.world_size)
                        .filter(|&j| j != root)
                        .map(msg)
                        .collect();
                    ctx.transfer(&[], &sends, TAG_DATA, deadline)
                } else {
                    ctx.transfer(&[msg(root)], &[], TAG_DATA, deadline)
                }
            },
        )
    }

    pub(super) fn reduce(&mut self, buf: &Tensor, root: usize, op: ReduceOp) -> Result<()> {
        let kind = OpKind::Reduce;
        let (r, at) = (Some(op), Some(root));
        self.with_storage(
            kind,
            buf,
            "buffer",
            None,
            r,
            at,
            |ctx, mine, _, deadline| {
                let (ws, len) = (ctx.world_size, mine.len);
                if ctx.rank != root {
                    let sends = [(root, mine.ptr as *const u8, len)];
                    return ctx.reduce_exchange(
                        &sends,
                        &[],
                        0,
                        mine.ptr,
                        mine.ptr,
                        mine.dtype,
                        op,
                        deadline,
                    );
                }
                let peers: Vec<usize> = (0..ws).filter(|&j| j != root).collect();
                let own = mine.ptr as *const u8;
                ctx.reduce_exchange(&[], &peers, len, own, mine.ptr, mine.dtype, op, deadline)
            },
        )
    }

    pub(super) fn barrier(&mut self) -> Result<()> {
        let post = Post::new(Kind::Op(OpKind::Barrier), self.seq);
        self.exchange(post, &[], self.deadline())
    }
}
