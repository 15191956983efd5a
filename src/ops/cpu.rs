//! The CPU side of [`crate::ops`]: each op over tensors that `ops` has already checked (f32,
//! contiguous, on the CPU, one element count, distinct storages), and the loops under them.
//!
//! Storage access (`crate::device`'s one accessor): inputs are read under their storage's read
//! lock (`with_storage`), outputs written through Candle's in-place op API (`with_storage_mut`,
//! nested once per written tensor): no copy, no allocation.
//!
//! The loops take their slices as arguments, so the compiler knows that `&mut` slices alias
//! nothing (and vectorises without run-time overlap checks), and their constants by value. They
//! are not inlined into the lock-taking closures, which would lose that knowledge. The
//! arithmetic is the kernels' (same f32 operations in the same order, no fused multiply-add):
//! `tests/optim/kernels.rs` checks these loops against the references of [`crate::kernels`].

use std::cell::Cell;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Tensor};

use super::{AdamWHyper, ScaleFactor, SgdHyper, Unscale};
use crate::device::{with_storage, with_storage_mut, StorageMut, StorageRef};
use crate::error::{Error, Result};
use crate::kernels::{flush_second_moment, flush_subnormal};

// ---- the ops over checked tensors (`super` checked dtype, layout, device, counts, aliasing) --

/// [`super::adamw_step_fused`] on the CPU.
pub(super) fn adamw_(
    op: &'static str,
    param: &Tensor,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    h: &AdamWHyper,
    u: &Unscale<'_>,
) -> Result<()> {
    let Some(inv) = cpu_unscale(u)? else {
        return Ok(());
    };
    let h = *h;
    with_cpu_f32(grad, |g| {
        with_mut(param, op, |p| {
            with_mut(exp_avg, op, |m| {
                with_mut(exp_avg_sq, op, |v| {
                    if inv == 1.0 {
                        adamw(p, g, m, v, h);
                    } else {
                        adamw_unscaled(p, g, m, v, h, inv);
                    }
                    Ok(())
                })
            })
        })
    })??;
    Ok(())
}

/// [`super::adamw_step_bf16_state`] on the CPU.
#[allow(clippy::too_many_arguments)]
pub(super) fn adamw_bf16_(
    op: &'static str,
    param: &Tensor,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    h: &AdamWHyper,
    seed: u64,
    offset: u64,
) -> Result<()> {
    let h = *h;
    with_cpu_f32(grad, |g| {
        with_mut(param, op, |p| {
            with_mut_as::<half::bf16>(exp_avg, op, |m| {
                with_mut_as::<half::bf16>(exp_avg_sq, op, |v| {
                    adamw_bf16(p, g, m, v, h, seed, offset);
                    Ok(())
                })
            })
        })
    })??;
    Ok(())
}

/// `x` rounded to bf16 stochastically with the random bits `r` (the low 16 are used): up with
/// probability equal to the dropped fraction of the f32 mantissa. Non-finite values keep
/// their bf16 (round-to-nearest) value.
#[inline(always)]
pub(crate) fn bf16_stochastic(x: f32, r: u64) -> half::bf16 {
    if !x.is_finite() {
        return half::bf16::from_f32(x);
    }
    let b = x.to_bits().wrapping_add((r & 0xFFFF) as u32);
    half::bf16::from_bits((b >> 16) as u16)
}

/// AdamW over bf16 moments ([`super::adamw_step_bf16_state`]): elements `offset + i`.
#[inline(never)]
fn adamw_bf16(
    p: &mut [f32],
    g: &[f32],
    m: &mut [half::bf16],
    v: &mut [half::bf16],
    h: AdamWHyper,
    seed: u64,
    offset: u64,
) {
    use crate::cpu::{threads, with_simd};
    const CHUNK: usize = 1 << 16;
    let run = |c: usize, p: &mut [f32], g: &[f32], m: &mut [half::bf16], v: &mut [half::bf16]| {
        let AdamWHyper {
            beta1,
            beta2,
            one_minus_beta1,
            one_minus_beta2,
            bias_correction1,
            bias_correction2,
            decay,
            lr,
            eps,
        } = h;
        let base = offset + (c * CHUNK) as u64;
        for (i, (((p, &g), m), v)) in p.iter_mut().zip(g).zip(m).zip(v).enumerate() {
            let m32 = flush_subnormal(m.to_f32() * beta1 + g * one_minus_beta1);
            let v32 = flush_second_moment(v.to_f32() * beta2 + (g * g) * one_minus_beta2, m32);
            let m_hat = m32 * bias_correction1;
            let v_hat = v32 * bias_correction2;
            *p *= decay;
            *p -= (m_hat / (v_hat.sqrt() + eps)) * lr;
            let r = crate::fsdp::fused::mix64(seed ^ (base + i as u64));
            *m = bf16_stochastic(m32, r);
            *v = bf16_stochastic(v32, r >> 16);
        }
    };
    if p.len() >= 4 * CHUNK && threads() > 1 {
        use rayon::prelude::*;
        p.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .enumerate()
            .for_each(|(c, (((p, g), m), v))| {
                with_simd(
                    #[inline(always)]
                    || run(c, p, g, m, v),
                )
            });
    } else {
        with_simd(
            #[inline(always)]
            || run(0, p, g, m, v),
        )
    }
}

/// [`super::sgd_step_fused`] on the CPU (`buf` present exactly when momentum is not 0).
pub(super) fn sgd_(
    op: &'static str,
    param: &Tensor,
    grad: &Tensor,
    buf: Option<&Tensor>,
    h: SgdHyper,
    u: &Unscale<'_>,
) -> Result<()> {
    let Some(inv) = cpu_unscale(u)? else {
        return Ok(());
    };
    with_cpu_f32(grad, |g| {
        with_mut(param, op, |p| match (buf, inv == 1.0) {
            (None, true) => {
                sgd(p, g, h);
                Ok(())
            }
            (None, false) => {
                sgd_unscaled(p, g, h, inv);
                Ok(())
            }
            (Some(buf), unscaled) => with_mut(buf, op, |b| {
                if unscaled {
                    sgd_momentum(p, g, b, h);
                } else {
                    sgd_momentum_unscaled(p, g, b, h, inv);
                }
                Ok(())
            }),
        })
    })??;
    Ok(())
}

/// [`super::scale_`] on the CPU.
pub(super) fn scale_(op: &'static str, t: &Tensor, s: f32) -> Result<()> {
    with_mut(t, op, |x| {
        scale(x, s);
        Ok(())
    })
}

/// [`super::scale_and_check_finite_`] on the CPU.
pub(super) fn scale_check_finite_(op: &'static str, t: &Tensor, s: f32) -> Result<bool> {
    let finite = Cell::new(true);
    with_mut(t, op, |x| {
        finite.set(scale_check_finite(x, s));
        Ok(())
    })?;
    Ok(finite.get())
}

/// [`super::all_finite`] on the CPU.
pub(super) fn all_finite(t: &Tensor) -> Result<bool> {
    with_cpu_f32(t, |x| x.iter().all(|x| x.is_finite()))
}

/// [`super::unscale_check_finite_`] on the CPU.
pub(super) fn unscale_check_finite_(
    op: &'static str,
    t: &Tensor,
    factor: ScaleFactor<'_>,
    found_inf: &Tensor,
) -> Result<()> {
    let s = match factor {
        ScaleFactor::Value(v) => v,
        ScaleFactor::Device(d) => with_cpu_f32(d, |v| v[0])?,
    };
    if !scale_check_finite_(op, t, s)? {
        set_flag(op, found_inf)?;
    }
    Ok(())
}

/// [`super::check_finite_`] on the CPU.
pub(super) fn check_finite_(op: &'static str, t: &Tensor, found_inf: &Tensor) -> Result<()> {
    if !all_finite(t)? {
        set_flag(op, found_inf)?;
    }
    Ok(())
}

/// `found_inf[0] = 1`.
fn set_flag(op: &'static str, found_inf: &Tensor) -> Result<()> {
    with_mut(found_inf, op, |f| {
        f[0] = 1.0;
        Ok(())
    })
}

/// [`super::sum_squares`] on the CPU: f64, element order.
pub(super) fn sum_squares(t: &Tensor) -> Result<f64> {
    with_cpu_f32(t, |x| {
        x.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>()
    })
}

/// [`super::add_`] on the CPU.
pub(super) fn add_(op: &'static str, dst: &Tensor, src: &Tensor) -> Result<()> {
    with_storage(src, |storage, layout| {
        let (start, end) = layout
            .contiguous_offsets()
            .expect("checked contiguous above");
        let StorageRef::Cpu(cpu) = storage else {
            unreachable!("checked on the CPU above")
        };
        with_mut(dst, op, |d| {
            match cpu {
                CpuStorage::F32(s) => add(d, &s[start..end]),
                CpuStorage::BF16(s) => add_widened(d, &s[start..end]),
                CpuStorage::F16(s) => add_widened(d, &s[start..end]),
                _ => unreachable!("dtype checked above"),
            }
            Ok(())
        })
    })?
}

/// The CPU side of [`Unscale`]: `None` when the step is skipped, else the gradient factor.
fn cpu_unscale(u: &Unscale<'_>) -> Result<Option<f32>> {
    if let Some(f) = u.found_inf {
        if with_cpu_f32(f, |v| v[0])? != 0.0 {
            return Ok(None);
        }
    }
    Ok(Some(match u.inv_scale {
        ScaleFactor::Value(v) => v,
        ScaleFactor::Device(t) => with_cpu_f32(t, |v| v[0])?,
    }))
}

/// The storage range `[start, end)` of a contiguous layout.
///
/// Errors: the layout is not contiguous (naming its shape and strides).
fn contiguous_range(layout: &candle_core::Layout) -> Result<(usize, usize)> {
    layout.contiguous_offsets().ok_or_else(|| {
        super::bad(
            "reading a tensor",
            "the tensor",
            format!(
                "must be contiguous, found shape {:?} with strides {:?}",
                layout.dims(),
                layout.stride()
            ),
        )
    })
}

/// Calls `f` with the values of a contiguous f32 CPU tensor, borrowed under its read lock.
pub(super) fn with_cpu_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    with_storage(t, |storage, layout| {
        let (start, end) = contiguous_range(layout)?;
        match storage {
            StorageRef::Cpu(CpuStorage::F32(v)) => Ok(f(&v[start..end])),
            StorageRef::Cpu(other) => Err(Error::dtype(
                "a tensor read on the host",
                "F32",
                other.dtype(),
            )),
            StorageRef::Cuda(_) => Err(super::not_on_cpu("reading a tensor", t.device())),
        }
    })
    .and_then(|r| r)
}

/// [`with_cpu_f32`] for u8 bytes (a packed frozen shard's, [`crate::quant`]).
pub(super) fn with_cpu_u8<R>(t: &Tensor, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
    with_storage(t, |storage, layout| {
        let (start, end) = contiguous_range(layout)?;
        match storage {
            StorageRef::Cpu(CpuStorage::U8(v)) => Ok(f(&v[start..end])),
            StorageRef::Cpu(other) => Err(Error::dtype(
                "a tensor read on the host",
                "U8",
                other.dtype(),
            )),
            StorageRef::Cuda(_) => Err(super::not_on_cpu("reading a tensor", t.device())),
        }
    })
    .and_then(|r| r)
}

/// Runs `f` on the bytes of contiguous CPU tensor `t` (its elements, little-endian, in its own
/// dtype), borrowed under its read lock.
///
/// Errors: `t` not contiguous or not on the CPU.
pub(super) fn with_cpu_bytes<R>(t: &Tensor, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
    fn bytes<T>(v: &[T]) -> &[u8] {
        // SAFETY: every element type of a CPU storage is plain old data (integers, IEEE floats,
        // `half`'s and `float8`'s `repr(transparent)` integers): any `T` is valid as bytes, the
        // slice covers exactly `v`'s memory, and `u8` has alignment 1. x86 and the GPUs' hosts
        // are little-endian, the byte order checkpoints use.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
    }
    with_storage(t, |storage, layout| {
        let (start, end) = contiguous_range(layout)?;
        let StorageRef::Cpu(storage) = storage else {
            return Err(super::not_on_cpu("reading a tensor", t.device()));
        };
        let b = match storage {
            CpuStorage::U8(v)
            | CpuStorage::F6E2M3(v)
            | CpuStorage::F6E3M2(v)
            | CpuStorage::F4(v)
            | CpuStorage::F8E8M0(v) => bytes(&v[start..end]),
            CpuStorage::U32(v) => bytes(&v[start..end]),
            CpuStorage::I16(v) => bytes(&v[start..end]),
            CpuStorage::I32(v) => bytes(&v[start..end]),
            CpuStorage::I64(v) => bytes(&v[start..end]),
            CpuStorage::BF16(v) => bytes(&v[start..end]),
            CpuStorage::F16(v) => bytes(&v[start..end]),
            CpuStorage::F32(v) => bytes(&v[start..end]),
            CpuStorage::F64(v) => bytes(&v[start..end]),
            CpuStorage::F8E4M3(v) => bytes(&v[start..end]),
        };
        Ok(f(b))
    })
    .and_then(|r| r)
}

/// Runs `f` on the f32 values of `t`, mutably, under `t`'s write lock (no copy, no allocation;
/// [`crate::device::with_storage_mut`]).
pub(super) fn with_mut(
    t: &Tensor,
    name: &'static str,
    f: impl FnOnce(&mut [f32]) -> Result<()>,
) -> Result<()> {
    with_mut_as(t, name, f)
}

/// An element type [`with_mut_as`] reads a CPU storage as.
trait StorageElem: Sized {
    fn slice(s: &mut CpuStorage) -> Option<&mut [Self]>;
}

impl StorageElem for f32 {
    fn slice(s: &mut CpuStorage) -> Option<&mut [Self]> {
        match s {
            CpuStorage::F32(v) => Some(v),
            _ => None,
        }
    }
}

impl StorageElem for half::bf16 {
    fn slice(s: &mut CpuStorage) -> Option<&mut [Self]> {
        match s {
            CpuStorage::BF16(v) => Some(v),
            _ => None,
        }
    }
}

/// [`with_mut`] for values of type `T` (f32, or bf16 optimizer state).
fn with_mut_as<T: StorageElem>(
    t: &Tensor,
    name: &'static str,
    f: impl FnOnce(&mut [T]) -> Result<()>,
) -> Result<()> {
    let r = with_storage_mut(t, None, name, |storage, layout, _| {
        let StorageMut::Cpu(storage) = storage else {
            return Err(Error::Candle(candle_core::Error::Msg(format!(
                "{name}: expected a tensor on the CPU"
            ))));
        };
        let dtype = storage.dtype();
        let Some(v) = T::slice(storage) else {
            return Err(Error::Candle(candle_core::Error::Msg(format!(
                "{name}: expected a {} tensor, found {dtype:?}",
                std::any::type_name::<T>().rsplit("::").next().unwrap_or("")
            ))));
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            return Err(Error::Candle(candle_core::Error::Msg(format!(
                "{name}: expected a contiguous tensor"
            ))));
        };
        f(&mut v[start..end])
    })?;
    r
}

// ---- the loops ------------------------------------------------------------------------------

#[inline(never)]
fn adamw(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], h: AdamWHyper) {
    split4(p, g, m, v, |p, g, m, v| {
        adamw_impl::<false>(p, g, m, v, h, 1.0)
    });
}

/// `f` over matching chunks of the four slices: split over rayon's pool when Candle's
/// intra-op thread count is above 1 and there are at least 256 Ki elements, else on this thread,
/// each chunk compiled for the CPU's widest vectors (`crate::cpu::with_simd`). Every element's
/// update is the same arithmetic whatever the split, so the result is bit-identical.
#[inline(always)]
fn split4(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    f: impl Fn(&mut [f32], &[f32], &mut [f32], &mut [f32]) + Send + Sync,
) {
    use crate::cpu::{threads, with_simd};
    // 64 Ki elements a task; below four tasks' worth (1 MiB of parameters, ~0.1 ms on one
    // core) waking the pool costs more than it saves.
    const CHUNK: usize = 1 << 16;
    if p.len() >= 4 * CHUNK && threads() > 1 {
        use rayon::prelude::*;
        p.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .for_each(|(((p, g), m), v)| {
                with_simd(
                    #[inline(always)]
                    || f(p, g, m, v),
                )
            });
    } else {
        with_simd(
            #[inline(always)]
            || f(p, g, m, v),
        )
    }
}

/// [`adamw`] of `g · inv` (the fused step's unscale, in registers).
#[inline(never)]
fn adamw_unscaled(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], h: AdamWHyper, inv: f32) {
    split4(p, g, m, v, |p, g, m, v| {
        adamw_impl::<true>(p, g, m, v, h, inv)
    });
}

/// The AdamW loop; with `UNSCALE` each gradient is multiplied by `inv` first.
#[inline(always)]
fn adamw_impl<const UNSCALE: bool>(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    h: AdamWHyper,
    inv: f32,
) {
    let AdamWHyper {
        beta1,
        beta2,
        one_minus_beta1,
        one_minus_beta2,
        bias_correction1,
        bias_correction2,
        decay,
        lr,
        eps,
    } = h;
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m).zip(v) {
        let g = if UNSCALE { g * inv } else { g };
        *m = flush_subnormal(*m * beta1 + g * one_minus_beta1);
        *v = flush_second_moment(*v * beta2 + (g * g) * one_minus_beta2, *m);
        let m_hat = *m * bias_correction1;
        let v_hat = *v * bias_correction2;
        *p *= decay;
        *p -= (m_hat / (v_hat.sqrt() + eps)) * lr;
    }
}

#[inline(never)]
fn sgd(p: &mut [f32], g: &[f32], h: SgdHyper) {
    sgd_impl::<false>(p, g, h, 1.0);
}

/// [`sgd`] of `g · inv`.
#[inline(never)]
fn sgd_unscaled(p: &mut [f32], g: &[f32], h: SgdHyper, inv: f32) {
    sgd_impl::<true>(p, g, h, inv);
}

#[inline(always)]
fn sgd_impl<const UNSCALE: bool>(p: &mut [f32], g: &[f32], h: SgdHyper, inv: f32) {
    let (lr, wd) = (h.lr, h.weight_decay);
    for (p, &g) in p.iter_mut().zip(g) {
        let mut d = if UNSCALE { g * inv } else { g };
        if wd != 0.0 {
            d += wd * *p;
        }
        *p -= lr * d;
    }
}

#[inline(never)]
fn sgd_momentum(p: &mut [f32], g: &[f32], b: &mut [f32], h: SgdHyper) {
    sgd_momentum_impl::<false>(p, g, b, h, 1.0);
}

/// [`sgd_momentum`] of `g · inv`.
#[inline(never)]
fn sgd_momentum_unscaled(p: &mut [f32], g: &[f32], b: &mut [f32], h: SgdHyper, inv: f32) {
    sgd_momentum_impl::<true>(p, g, b, h, inv);
}

#[inline(always)]
fn sgd_momentum_impl<const UNSCALE: bool>(
    p: &mut [f32],
    g: &[f32],
    b: &mut [f32],
    h: SgdHyper,
    inv: f32,
) {
    let SgdHyper {
        lr,
        momentum: mu,
        one_minus_dampening: damp,
        weight_decay: wd,
        nesterov,
        first_step,
    } = h;
    for ((p, &g), b) in p.iter_mut().zip(g).zip(b) {
        let mut d = if UNSCALE { g * inv } else { g };
        if wd != 0.0 {
            d += wd * *p;
        }
        *b = flush_subnormal(if first_step { d } else { mu * *b + damp * d });
        d = if nesterov { d + mu * *b } else { *b };
        *p -= lr * d;
    }
}

#[inline(never)]
fn scale(x: &mut [f32], s: f32) {
    x.iter_mut().for_each(|x| *x *= s);
}

/// Returns whether every scaled value is finite.
#[inline(never)]
fn scale_check_finite(x: &mut [f32], s: f32) -> bool {
    let mut non_finite = false;
    for x in x.iter_mut() {
        *x *= s;
        non_finite |= !x.is_finite();
    }
    !non_finite
}

#[inline(never)]
fn add(d: &mut [f32], s: &[f32]) {
    d.iter_mut().zip(s).for_each(|(a, b)| *a += b);
}

#[inline(never)]
fn add_widened<T: Copy + Into<f32>>(d: &mut [f32], s: &[T]) {
    d.iter_mut().zip(s).for_each(|(a, &b)| *a += b.into());
}
