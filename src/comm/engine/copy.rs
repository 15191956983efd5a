//! Data movement of the shared-memory family (`board`: threads, shm): typed copies and
//! rank-ordered reductions over the raw buffers the ranks can read.
//!
//! Floating-point types accumulate in a wider type and round once: f32, bf16 and f16 in f32,
//! f64 in f64. Integer types reduce exactly in their own type (sums wrap on overflow). Reductions
//! run over ranks 0, 1, …, world_size-1 in order, so every rank gets bitwise identical results.

use crate::comm::buffer::RawBuf;
use crate::comm::reduce::{chunk, reduce_into, Elem};
use crate::comm::ReduceOp;

pub(in crate::comm) use crate::comm::reduce::with_elem;

/// All-gather copy: `out[j*n..(j+1)*n] = input of rank j`.
///
/// # Safety
///
/// Every post validated (same dtype `T`, `n` elements each, `out.len == ws * n`); `out` is this
/// rank's own output, accessed by nobody else; every input stays alive and unmodified until the
/// second barrier (nobody writes inputs during an all-gather).
pub(in crate::comm) unsafe fn gather<T: Elem>(out: RawBuf, srcs: &[RawBuf], n: usize) {
    for (j, src) in srcs.iter().enumerate() {
        // SAFETY: rank j posted its input (n elements of T, validated) and keeps it alive and
        // unmodified until it passes barrier 2, which needs this rank's arrival there; the
        // destination range lies in this rank's own output, distinct from every input.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.typed::<T>() as *const T,
                out.typed::<T>().add(j * n),
                n,
            )
        };
    }
}

/// Reduce-scatter: `out[i] = op over ranks j of input_j[start + i]`.
///
/// # Safety
///
/// As [`gather`]: validated posts (`ws * out.len` elements per input), inputs alive until
/// barrier 2, `out` this rank's own, written by nobody else and either disjoint from every
/// input or exactly `input_r[start..start + out.len]` of this rank's own (an all-reduce's phase
/// A, where no other rank touches chunk `r` of any buffer).
pub(in crate::comm) unsafe fn reduce_shard<T: Elem>(
    out: RawBuf,
    srcs: &[RawBuf],
    start: usize,
    op: ReduceOp,
    ws: usize,
) {
    let ptrs: Vec<*const T> = srcs
        .iter()
        // In bounds: each input holds ws * out.len elements (validated) and
        // start + out.len <= ws * out.len.
        .map(|s| (s.typed::<T>() as *const T).wrapping_add(start))
        .collect();
    // SAFETY: per the function contract.
    unsafe { reduce_into(&ptrs, out.typed::<T>(), out.len, op, ws) }
}

/// All-reduce phase B: rank `rank` copies chunk `j` of rank `j`'s buffer, for every `j != rank`.
///
/// # Safety
///
/// Validated posts (same length and dtype), all buffers alive and unmoved until the last
/// barrier, every rank finished phase A (the barrier between the phases: chunk `j` of rank
/// `j`'s buffer is final), and `bufs[rank]` is this rank's own buffer, which only it writes.
pub(in crate::comm) unsafe fn all_reduce_phase_b<T: Elem>(bufs: &[RawBuf], rank: usize, ws: usize) {
    let dst = bufs[rank].typed::<T>();
    for (j, src) in bufs.iter().enumerate() {
        if j == rank {
            continue;
        }
        let (start, n) = chunk(src.len, ws, j);
        // SAFETY: after the phase-A barrier, chunk j of rank j's buffer is final and only read
        // (by everybody) until barrier 2; chunk j of this rank's buffer is written only by this
        // rank in phase B and read by nobody (rank j reads its own chunk j, the others read chunk
        // j only from rank j). Distinct allocations, so the ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (src.typed::<T>() as *const T).add(start),
                dst.add(start),
                n,
            )
        };
    }
}

/// Reduce: the root reduces every buffer into its own, in place.
///
/// # Safety
///
/// Validated posts, all buffers alive and unmoved until barrier 2; during a reduce only the root
/// reads any buffer and only the root writes (its own).
pub(in crate::comm) unsafe fn reduce_to_root<T: Elem>(
    bufs: &[RawBuf],
    root: usize,
    op: ReduceOp,
    ws: usize,
) {
    let ptrs: Vec<*const T> = bufs.iter().map(|b| b.typed::<T>() as *const T).collect();
    // SAFETY: per the function contract; the destination is exactly the root's source.
    unsafe { reduce_into(&ptrs, ptrs[root] as *mut T, bufs[root].len, op, ws) }
}

/// Broadcast: a non-root copies the root's buffer into its own.
///
/// # Safety
///
/// Validated posts (same length and dtype); the root's buffer is read-only during a broadcast
/// and alive until barrier 2; `out` is this rank's own buffer, which nobody else reads during a
/// broadcast.
pub(in crate::comm) unsafe fn copy_from<T: Elem>(out: RawBuf, src: RawBuf) {
    // SAFETY: per the function contract; distinct allocations.
    unsafe {
        std::ptr::copy_nonoverlapping(src.typed::<T>() as *const T, out.typed::<T>(), out.len)
    };
}
