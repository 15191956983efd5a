//! Element types of communication buffers and the reduction kernel every CPU backend uses.
//!
//! Floating-point types accumulate in a wider type and round once: f32, bf16 and f16 in f32,
//! f64 in f64. Integer types reduce exactly in their own type (sums wrap on overflow). Sources are
//! reduced in the order given, which backends make rank order (0, 1, …, world_size-1), so every
//! rank, and every backend, gets bitwise identical results.

use std::ops::Mul;
use std::slice;

use candle_core::DType;
use half::{bf16, f16};

use crate::comm::buffer::RawBuf;
use crate::comm::ReduceOp;

/// Element types of communication buffers.
trait Elem: Copy + 'static {
    /// Accumulator type of reductions.
    type Acc: Copy + Default + Mul<Output = Self::Acc>;
    fn widen(self) -> Self::Acc;
    fn narrow(a: Self::Acc) -> Self;
    fn add(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn max(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn min(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    /// `1 / world_size` for [`ReduceOp::Avg`]; `None` for integers (refused by validation, so
    /// an integer sum is never scaled).
    fn avg_factor(world_size: usize) -> Option<Self::Acc>;
}

macro_rules! float_elem {
    ($t:ty, $acc:ty, $widen:expr, $narrow:expr) => {
        impl Elem for $t {
            type Acc = $acc;
            #[inline(always)]
            fn widen(self) -> $acc {
                $widen(self)
            }
            #[inline(always)]
            fn narrow(a: $acc) -> Self {
                $narrow(a)
            }
            #[inline(always)]
            fn add(a: $acc, b: $acc) -> $acc {
                a + b
            }
            /// Maximum that propagates NaN (from either side).
            #[inline(always)]
            fn max(a: $acc, b: $acc) -> $acc {
                if a.is_nan() || a >= b {
                    a
                } else {
                    b
                }
            }
            /// Minimum that propagates NaN (from either side).
            #[inline(always)]
            fn min(a: $acc, b: $acc) -> $acc {
                if a.is_nan() || a <= b {
                    a
                } else {
                    b
                }
            }
            fn avg_factor(world_size: usize) -> Option<$acc> {
                Some(1.0 / world_size as $acc)
            }
        }
    };
}

float_elem!(f32, f32, |x| x, |a| a);
float_elem!(f64, f64, |x| x, |a| a);
float_elem!(bf16, f32, bf16::to_f32, bf16::from_f32);
float_elem!(f16, f32, f16::to_f32, f16::from_f32);

macro_rules! int_elem {
    ($t:ty) => {
        impl Elem for $t {
            type Acc = $t;
            #[inline(always)]
            fn widen(self) -> $t {
                self
            }
            #[inline(always)]
            fn narrow(a: $t) -> Self {
                a
            }
            #[inline(always)]
            fn add(a: $t, b: $t) -> $t {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn max(a: $t, b: $t) -> $t {
                Ord::max(a, b)
            }
            #[inline(always)]
            fn min(a: $t, b: $t) -> $t {
                Ord::min(a, b)
            }
            fn avg_factor(_world_size: usize) -> Option<$t> {
                None
            }
        }
    };
}

int_elem!(u8);
int_elem!(u32);
int_elem!(i16);
int_elem!(i32);
int_elem!(i64);

/// Elements reduced per tile (the accumulator stays in L1).
const TILE: usize = 2048;

/// `dst[i] = op over j in 0..srcs.len() (in order) of srcs[j][i]` for the `dst.len` elements of
/// `dst.dtype`, accumulated in a wider type and rounded once; `Avg` multiplies the sum by
/// `1 / world_size` (skipped when `world_size == 1`).
///
/// # Safety
///
/// `dst.dtype` is one of the supported dtypes (checked before any rendezvous). Every `srcs[j]`
/// must be valid for reads of `dst.len` elements of that dtype and `dst.ptr` valid for writes of
/// them for the whole call; no other thread may write any of these ranges nor access the `dst`
/// range meanwhile. `dst` may be *equal* to one of the sources (in place) but must not
/// partially overlap any source.
pub(crate) unsafe fn reduce_raw(dst: RawBuf, srcs: &[*const u8], op: ReduceOp, world_size: usize) {
    let (ptr, len) = (dst.ptr, dst.len);
    // SAFETY: per the function contract, with the element type of `dst.dtype`.
    unsafe {
        match dst.dtype {
            DType::F32 => reduce_into::<f32>(srcs, ptr, len, op, world_size),
            DType::BF16 => reduce_into::<bf16>(srcs, ptr, len, op, world_size),
            DType::F16 => reduce_into::<f16>(srcs, ptr, len, op, world_size),
            DType::F64 => reduce_into::<f64>(srcs, ptr, len, op, world_size),
            DType::U8 => reduce_into::<u8>(srcs, ptr, len, op, world_size),
            DType::U32 => reduce_into::<u32>(srcs, ptr, len, op, world_size),
            DType::I16 => reduce_into::<i16>(srcs, ptr, len, op, world_size),
            DType::I32 => reduce_into::<i32>(srcs, ptr, len, op, world_size),
            DType::I64 => reduce_into::<i64>(srcs, ptr, len, op, world_size),
            other => unreachable!("dtype {other:?} is refused before any rendezvous"),
        }
    }
}

/// [`reduce_raw`] for elements of type `T`.
///
/// # Safety
///
/// As [`reduce_raw`], with `len` elements of `T`.
unsafe fn reduce_into<T: Elem>(
    srcs: &[*const u8],
    dst: *mut u8,
    len: usize,
    op: ReduceOp,
    world_size: usize,
) {
    let dst = dst.cast::<T>();
    let scale = if op == ReduceOp::Avg && world_size > 1 {
        T::avg_factor(world_size)
    } else {
        None
    };
    let mut tile = [T::Acc::default(); TILE];
    let mut off = 0;
    while off < len {
        let n = TILE.min(len - off);
        let acc = &mut tile[..n];
        // The shared slices below live only inside their loop iteration and the mutable `dst`
        // slice is created after the last of them is gone, so even in place they never coexist.
        // SAFETY: in bounds (off + n <= len) and readable per the function contract.
        let first = unsafe { slice::from_raw_parts(srcs[0].cast::<T>().add(off), n) };
        for (a, &x) in acc.iter_mut().zip(first) {
            *a = x.widen();
        }
        for &src in &srcs[1..] {
            // SAFETY: as above.
            let s = unsafe { slice::from_raw_parts(src.cast::<T>().add(off), n) };
            match op {
                ReduceOp::Sum | ReduceOp::Avg => {
                    for (a, &x) in acc.iter_mut().zip(s) {
                        *a = T::add(*a, x.widen());
                    }
                }
                ReduceOp::Max => {
                    for (a, &x) in acc.iter_mut().zip(s) {
                        *a = T::max(*a, x.widen());
                    }
                }
                ReduceOp::Min => {
                    for (a, &x) in acc.iter_mut().zip(s) {
                        *a = T::min(*a, x.widen());
                    }
                }
            }
        }
        if let Some(k) = scale {
            for a in acc.iter_mut() {
                *a = *a * k;
            }
        }
        // SAFETY: in bounds, writable and not accessed by anyone else per the function contract;
        // no shared slice of this range is alive any more.
        let out = unsafe { slice::from_raw_parts_mut(dst.add(off), n) };
        for (o, &a) in out.iter_mut().zip(acc.iter()) {
            *o = T::narrow(a);
        }
        off += n;
    }
}

/// Start and length of chunk `j` when `len` elements are split into `world_size` nearly-equal
/// chunks (the first `len % world_size` chunks are one element longer; chunks may be empty).
pub(crate) fn chunk(len: usize, world_size: usize, j: usize) -> (usize, usize) {
    let base = len / world_size;
    let rem = len % world_size;
    (j * base + j.min(rem), base + usize::from(j < rem))
}
