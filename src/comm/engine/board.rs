//! The collectives of the shared-memory family (the thread backend, whose ranks read each
//! other's tensors, and the shared-memory backend, whose ranks read each other's arenas or
//! segments), written once over a [`Board`]: one rank's side of one communicator's rendezvous.
//!
//! A collective makes this rank's buffer readable by its peers (shm: posts its offset in the
//! shared arena, or copies what they will read into its segment), publishes its [`Post`] and
//! waits for every rank (barrier 1), validates every rank's post (the same verdict on every
//! rank: the group stays usable after a mismatch), then does its own share of the copying
//! straight from the peers' readable buffers (bandwidth-optimal: every byte is read once per
//! destination) with byte copies and the rank-order reduction kernel of [`reduce_raw`] (bitwise
//! the same reductions on both backends):
//! - **all-gather**: every rank's input into its place in the output;
//! - **reduce-scatter**: this rank's chunk, reduced over every rank's input in rank order;
//! - **all-reduce** (in place, two phases): chunk `r` reduced over every rank's buffer into this
//!   rank's readable buffer (and copied into its own, when those differ); barrier; every other
//!   chunk copied from its owner's readable buffer;
//! - **broadcast**: non-roots copy the root's buffer; **reduce**: the root reduces every
//!   rank's buffer into its own.
//!
//! A last barrier keeps every readable buffer unchanged (nobody returns, frees or reuses one)
//! until every rank finished reading it.
//! **barrier** is barrier 1 alone (posts are double-buffered).

use std::ops::Range;

use candle_core::Tensor;

use super::group::Operation;
use crate::comm::buffer::{with_checked_bufs, Kind, Post, RawBuf};
use crate::comm::reduce::{chunk, reduce_raw};
use crate::comm::{Call, OpKind};
use crate::error::Result;

/// What the peers read of this rank's buffer in a collective.
#[derive(Debug, Clone)]
pub(crate) enum Expose {
    /// Nothing (a barrier, a broadcast's non-root, a reduce's root).
    Nothing,
    /// The whole buffer.
    Whole,
    /// All but these elements (a reduce-scatter's own chunk, read only by this rank).
    AllBut(Range<usize>),
}

/// One rank's side of one communicator's rendezvous, for one operation: what the thread and
/// shared-memory backends implement.
pub(crate) trait Board: Operation {
    /// Makes what `expose` says of this rank's `buf` readable by the peers, publishes `post`,
    /// waits for every rank and validates every rank's post; returns the generation reached.
    fn publish(&mut self, post: &Post, buf: RawBuf, expose: Expose) -> Result<u64>;
    /// Rank `j`'s readable buffer as `len` elements of `like`'s dtype (after
    /// [`Board::publish`]; this rank's own readable buffer at its own index).
    fn readable(&self, j: usize, like: RawBuf, len: usize) -> Result<RawBuf>;
    /// Arrives at barrier `target` after the data phase and waits for every rank.
    fn sync(&self, target: u64) -> Result<()>;
    /// Held through the data phase (the thread backend aborts the process on a panic there:
    /// unwinding would free buffers peers are still reading).
    fn data_phase(&self) -> impl Sized + '_;
}

/// Runs `collective` (`None`: a barrier) on `board`; see the module docs.
pub(crate) fn run<B: Board>(
    board: &mut B,
    collective: Option<(Call, &Tensor, Option<&Tensor>)>,
) -> Result<()> {
    let Some((call, buf, input)) = collective else {
        return post_only(board, &Post::new(Kind::Op(OpKind::Barrier), board.seq()));
    };
    let (kind, seq) = (call.kind(), board.seq());
    with_checked_bufs(board, kind, seq, buf, input, post_only, |b, dst, src| {
        let (rank, ws) = (b.rank(), b.world_size());
        let es = dst.dtype.size_in_bytes();
        let post = Post::of_call(call, b.seq(), dst, src);
        let mine = src.unwrap_or(dst);
        // What the peers read of this rank's buffer.
        let expose = match call {
            Call::ReduceScatter(_) => Expose::AllBut(rank * dst.len..(rank + 1) * dst.len),
            Call::Broadcast(root) if root != rank => Expose::Nothing,
            Call::Reduce(root, _) if root == rank => Expose::Nothing,
            _ => Expose::Whole,
        };
        let generation = b.publish(&post, mine, expose)?;
        let guard = b.data_phase();
        let all = |b: &B, len| {
            (0..ws)
                .map(|j| b.readable(j, mine, len))
                .collect::<Result<Vec<_>>>()
        };
        // Element `i` of `buf`, as a source pointer of the reduction.
        let at = |buf: RawBuf, i: usize| buf.ptr.wrapping_add(i * es) as *const u8;
        match call {
            Call::AllGather => {
                let mut srcs = all(b, mine.len)?;
                srcs[rank] = mine;
                for (j, &src) in srcs.iter().enumerate() {
                    // SAFETY: validated posts; `dst` is this rank's locked output, distinct from
                    // every input; rank j's readable buffer holds its input and stays unchanged
                    // until the last barrier.
                    unsafe { copy(dst, j * mine.len, src, 0, mine.len) };
                }
            }
            Call::ReduceScatter(op) => {
                let mut srcs = all(b, mine.len)?;
                srcs[rank] = mine;
                let start = rank * dst.len;
                let ptrs: Vec<_> = srcs.iter().map(|&s| at(s, start)).collect();
                // SAFETY: as for all-gather; every input holds ws * dst.len elements and `dst`
                // is disjoint from every input.
                unsafe { reduce_raw(dst, &ptrs, op, ws) };
            }
            Call::AllReduce(op) => {
                let srcs = all(b, mine.len)?;
                let exposed = srcs[rank];
                let (start, n) = chunk(mine.len, ws, rank);
                let ptrs: Vec<_> = srcs.iter().map(|&s| at(s, start)).collect();
                let ptr = exposed.ptr.wrapping_add(start * es);
                let out = RawBuf {
                    ptr,
                    len: n,
                    ..exposed
                };
                // SAFETY: validated posts; in phase A rank r reads chunk r of every readable
                // buffer and writes chunk r of its own (exactly one of the sources), which no
                // other rank touches.
                unsafe { reduce_raw(out, &ptrs, op, ws) };
                if exposed.ptr != mine.ptr {
                    // SAFETY: chunk r of this rank's readable buffer is final; `mine` is locked.
                    unsafe { copy(mine, start, exposed, start, n) };
                }
                b.sync(generation + 1)?;
                for (j, &src) in srcs.iter().enumerate().filter(|&(j, _)| j != rank) {
                    let (start, n) = chunk(mine.len, ws, j);
                    // SAFETY: after the phase-A barrier chunk j of rank j's readable buffer is
                    // final and only read until the last barrier; chunk j of this rank's own
                    // buffer is written only by this rank and read by nobody (rank j reads its
                    // own, the others read chunk j only from rank j).
                    unsafe { copy(mine, start, src, start, n) };
                }
                let synced = b.sync(generation + 2);
                drop(guard);
                return synced;
            }
            Call::Broadcast(root) => {
                if rank != root {
                    let src = b.readable(root, mine, mine.len)?;
                    // SAFETY: validated posts; the root's readable buffer is unchanged until
                    // the last barrier; `mine` is read by nobody during a broadcast.
                    unsafe { copy(mine, 0, src, 0, mine.len) };
                }
            }
            Call::Reduce(root, op) => {
                if rank == root {
                    let mut srcs = all(b, mine.len)?;
                    srcs[root] = mine;
                    let ptrs: Vec<_> = srcs.iter().map(|&s| at(s, 0)).collect();
                    // SAFETY: validated posts; only the root reads any buffer, and it writes
                    // only its own (in place: the destination is exactly its source).
                    unsafe { reduce_raw(mine, &ptrs, op, ws) };
                }
            }
        }
        let synced = b.sync(generation + 1);
        drop(guard);
        synced
    })
}

/// Publishes `post` with nothing for the peers to read (a barrier, a local problem).
fn post_only<B: Board>(board: &mut B, post: &Post) -> Result<()> {
    let none = RawBuf {
        ptr: std::ptr::null_mut(),
        len: 0,
        dtype: candle_core::DType::U8,
    };
    board.publish(post, none, Expose::Nothing).map(|_| ())
}

/// Copies `n` elements of `src` from element `from` into `dst` from element `to` (`dst`'s
/// dtype, the same as `src`'s after validation).
///
/// # Safety
///
/// Both ranges in bounds, `src`'s readable and `dst`'s writable by this rank for the call (no
/// other access to `dst`'s range, no write to `src`'s), and the two ranges disjoint.
unsafe fn copy(dst: RawBuf, to: usize, src: RawBuf, from: usize, n: usize) {
    let es = dst.dtype.size_in_bytes();
    // SAFETY: per the function contract.
    unsafe { std::ptr::copy_nonoverlapping(src.ptr.add(from * es), dst.ptr.add(to * es), n * es) };
}
