//! Device kernels over flat f32 tensors: the optimizer updates, the arithmetic of gradient
//! clipping and loss scaling, and in-place accumulation of gradient shards.
//!
//! Every kernel updates its destination tensors **in place** (their storage is written, no new
//! tensor is made), so a caller that holds a `&Tensor` (a [`crate::ShardView`]) can step a
//! shard. Tensors are flat: any shape is accepted, but they must be contiguous and the tensors of
//! one call must have the same element count.
//!
//! **CPU.** Each kernel is one pass over `&mut [f32]` / `&[f32]` slices of the tensors' own
//! storage, obtained through Candle's in-place op API: [`Tensor::inplace_op1`] with an
//! [`InplaceOp1`] whose `cpu_fwd` receives `&mut CpuStorage` (nested once per tensor that is
//! written: distinct storages are locked separately) and [`Tensor::storage_and_layout`] (a read
//! lock) for inputs. The kernels allocate nothing; Candle's in-place entry point allocates a few
//! bytes for its overlap check per tensor, independent of the tensor's size. The element-wise
//! arithmetic is written exactly as the host loops it replaced (same f32 operations in the same
//! order, no fused multiply-add), so results are bit-identical to them.
//!
//! **Other devices.** The CUDA kernels come with the GPU path; until then a tensor on another
//! device is an [`Error::InvalidArgument`] naming the kernel and the device.
//!
//! Aliasing: the tensors written by one call must not share storage with each other or with its
//! inputs (checked; an error names the two tensors).

use std::cell::Cell;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Storage, Tensor};

use crate::error::{Error, Result};

/// Per-step constants of one AdamW update, all f32 (see [`adamw_step`]). The optimizer computes
/// them in f64 from its configuration and the step count `t`, then rounds once to f32.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWHyper {
    /// β1, first-moment decay.
    pub beta1: f32,
    /// β2, second-moment decay.
    pub beta2: f32,
    /// `1 − β1`.
    pub one_minus_beta1: f32,
    /// `1 − β2`.
    pub one_minus_beta2: f32,
    /// `1 / (1 − β1ᵗ)`: first-moment bias correction.
    pub bias_correction1: f32,
    /// `1 / (1 − β2ᵗ)`: second-moment bias correction.
    pub bias_correction2: f32,
    /// `1 − lr·λ`: decoupled weight decay factor.
    pub decay: f32,
    /// Learning rate.
    pub lr: f32,
    /// ε, added to the denominator.
    pub eps: f32,
}

/// Per-step constants of one SGD update, all f32 (see [`sgd_step`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdHyper {
    /// Learning rate.
    pub lr: f32,
    /// Momentum factor μ (0: no momentum buffer is read or written).
    pub momentum: f32,
    /// `1 − τ`, τ the dampening.
    pub one_minus_dampening: f32,
    /// L2 penalty λ added to the gradient (0: none).
    pub weight_decay: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// First step of the optimizer: the momentum buffer is set to the gradient, not blended.
    pub first_step: bool,
}

/// One AdamW update (Loshchilov & Hutter, ICLR 2019; operation by operation as candle-nn's
/// `AdamW` and PyTorch's `torch.optim.AdamW`), element-wise, in f32:
/// `m ← β1·m + (1 − β1)·g`, `v ← β2·v + (1 − β2)·g²`, `θ ← θ·(1 − lr·λ)`,
/// `θ ← θ − lr · (m·c1) / (sqrt(v·c2) + ε)` with `c1`, `c2` the bias corrections of `h`.
///
/// `param`, `exp_avg`, `exp_avg_sq` are written in place; `grad` is read. All four: f32,
/// contiguous, the same element count, the same device, four distinct storages.
///
/// Errors ([`Error::InvalidArgument`], naming the kernel and the tensor): a dtype other than f32,
/// a non-contiguous tensor, different element counts, shared storage, a device other than the
/// CPU (the CUDA kernels come with the GPU path).
pub fn adamw_step(
    param: &Tensor,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    h: &AdamWHyper,
) -> Result<()> {
    const OP: &str = "adamw_step";
    let n = check_all(
        OP,
        &[
            ("param", param),
            ("grad", grad),
            ("exp_avg", exp_avg),
            ("exp_avg_sq", exp_avg_sq),
        ],
    )?;
    if n == 0 {
        return Ok(());
    }
    check_distinct(
        OP,
        &[
            ("param", param),
            ("grad", grad),
            ("exp_avg", exp_avg),
            ("exp_avg_sq", exp_avg_sq),
        ],
    )?;
    let h = *h;
    with_cpu_f32(grad, |g| {
        with_mut(param, OP, |p| {
            with_mut(exp_avg, OP, |m| {
                with_mut(exp_avg_sq, OP, |v| {
                    cpu::adamw(p, g, m, v, h);
                    Ok(())
                })
            })
        })
    })??;
    Ok(())
}

/// One SGD update, PyTorch's algorithm (`torch.optim.SGD` docs), element-wise, in f32:
/// `d ← g + λθ` (when λ ≠ 0); with momentum μ ≠ 0: `b ← d` at the first step, else
/// `b ← μ·b + (1 − τ)·d`, then `d ← d + μ·b` (Nesterov) or `d ← b`; finally `θ ← θ − lr·d`.
///
/// `param` and `momentum_buffer` are written in place (the buffer is required when
/// `h.momentum ≠ 0` and ignored otherwise); `grad` is read. Same requirements and errors as
/// [`adamw_step`]; a missing buffer with momentum is an error too.
pub fn sgd_step(
    param: &Tensor,
    grad: &Tensor,
    momentum_buffer: Option<&Tensor>,
    h: &SgdHyper,
) -> Result<()> {
    const OP: &str = "sgd_step";
    let h = *h;
    let buf = match (h.momentum != 0.0, momentum_buffer) {
        (false, _) => None,
        (true, Some(b)) => Some(b),
        (true, None) => {
            return Err(Error::InvalidArgument(format!(
                "{OP}: momentum {} needs a momentum buffer, none given",
                h.momentum
            )))
        }
    };
    let all = [
        ("param", param),
        ("grad", grad),
        ("momentum_buffer", buf.unwrap_or(param)),
    ];
    let tensors = if buf.is_some() { &all[..] } else { &all[..2] };
    let n = check_all(OP, tensors)?;
    if n == 0 {
        return Ok(());
    }
    check_distinct(OP, tensors)?;
    with_cpu_f32(grad, |g| {
        with_mut(param, OP, |p| match buf {
            None => {
                cpu::sgd(p, g, h);
                Ok(())
            }
            Some(buf) => with_mut(buf, OP, |b| {
                cpu::sgd_momentum(p, g, b, h);
                Ok(())
            }),
        })
    })??;
    Ok(())
}

/// Multiplies every element of `t` (f32, contiguous) by `s`, in place.
///
/// Errors: as [`adamw_step`].
pub fn scale_(t: &Tensor, s: f32) -> Result<()> {
    const OP: &str = "scale_";
    if check_all(OP, &[("tensor", t)])? == 0 {
        return Ok(());
    }
    with_mut(t, OP, |x| {
        cpu::scale(x, s);
        Ok(())
    })?;
    Ok(())
}

/// Multiplies every element of `t` (f32, contiguous) by `s` in place and returns whether every
/// result is finite: the grad scaler's unscale and inf/NaN check in one pass (PyTorch's
/// `_amp_foreach_non_finite_check_and_unscale_`).
///
/// Errors: as [`adamw_step`].
pub fn scale_and_check_finite_(t: &Tensor, s: f32) -> Result<bool> {
    const OP: &str = "scale_and_check_finite_";
    if check_all(OP, &[("tensor", t)])? == 0 {
        return Ok(true);
    }
    let finite = Cell::new(true);
    with_mut(t, OP, |x| {
        finite.set(cpu::scale_check_finite(x, s));
        Ok(())
    })?;
    Ok(finite.get())
}

/// Whether every element of `t` (f32, contiguous) is finite (no inf, no NaN).
///
/// Errors: as [`adamw_step`].
pub fn all_finite(t: &Tensor) -> Result<bool> {
    check_all("all_finite", &[("tensor", t)])?;
    with_cpu_f32(t, |x| x.iter().all(|x| x.is_finite()))
}

/// Sum of the squares of the elements of `t` (f32, contiguous), each widened to f64 and summed
/// in f64 in element order: the local part of a total L2 norm
/// (`torch.nn.utils.clip_grad_norm_`'s norm, accumulated more precisely than f32).
///
/// Errors: as [`adamw_step`].
pub fn sum_squares(t: &Tensor) -> Result<f64> {
    check_all("sum_squares", &[("tensor", t)])?;
    with_cpu_f32(t, |x| {
        x.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>()
    })
}

/// `dst += src` element-wise, in place: `dst` f32, `src` f32, bf16 or f16 (widened exactly to
/// f32 on the fly, no temporary), both contiguous with the same element count and distinct
/// storages.
///
/// Errors: as [`adamw_step`]; a `src` dtype other than f32, bf16, f16.
pub fn add_(dst: &Tensor, src: &Tensor) -> Result<()> {
    const OP: &str = "add_";
    let n = check_all(OP, &[("dst", dst)])?;
    check_layout(OP, "src", src, &[DType::F32, DType::BF16, DType::F16])?;
    if src.elem_count() != n {
        return Err(Error::InvalidArgument(format!(
            "{OP}: src has {} elements, expected {n} (those of dst)",
            src.elem_count()
        )));
    }
    if n == 0 {
        return Ok(());
    }
    check_distinct(OP, &[("dst", dst), ("src", src)])?;
    let (storage, layout) = src.storage_and_layout();
    let (start, end) = layout
        .contiguous_offsets()
        .expect("checked contiguous above");
    let Storage::Cpu(cpu) = &*storage else {
        unreachable!("checked on the CPU above")
    };
    with_mut(dst, OP, |d| {
        match cpu {
            CpuStorage::F32(s) => cpu::add(d, &s[start..end]),
            CpuStorage::BF16(s) => cpu::add_widened(d, &s[start..end]),
            CpuStorage::F16(s) => cpu::add_widened(d, &s[start..end]),
            _ => unreachable!("dtype checked above"),
        }
        Ok(())
    })?;
    Ok(())
}

/// The CPU loops. Each takes its slices as arguments, so the compiler knows that `&mut` slices
/// alias nothing (and vectorises without run-time overlap checks), and its constants by value.
/// Not inlined into the lock-taking closures, which would lose that knowledge.
mod cpu {
    use super::{AdamWHyper, SgdHyper};

    #[inline(never)]
    pub(super) fn adamw(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], h: AdamWHyper) {
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
            *m = *m * beta1 + g * one_minus_beta1;
            *v = *v * beta2 + (g * g) * one_minus_beta2;
            let m_hat = *m * bias_correction1;
            let v_hat = *v * bias_correction2;
            *p *= decay;
            *p -= (m_hat / (v_hat.sqrt() + eps)) * lr;
        }
    }

    #[inline(never)]
    pub(super) fn sgd(p: &mut [f32], g: &[f32], h: SgdHyper) {
        let (lr, wd) = (h.lr, h.weight_decay);
        for (p, &g) in p.iter_mut().zip(g) {
            let mut d = g;
            if wd != 0.0 {
                d += wd * *p;
            }
            *p -= lr * d;
        }
    }

    #[inline(never)]
    pub(super) fn sgd_momentum(p: &mut [f32], g: &[f32], b: &mut [f32], h: SgdHyper) {
        let SgdHyper {
            lr,
            momentum: mu,
            one_minus_dampening: damp,
            weight_decay: wd,
            nesterov,
            first_step,
        } = h;
        for ((p, &g), b) in p.iter_mut().zip(g).zip(b) {
            let mut d = g;
            if wd != 0.0 {
                d += wd * *p;
            }
            *b = if first_step { d } else { mu * *b + damp * d };
            d = if nesterov { d + mu * *b } else { *b };
            *p -= lr * d;
        }
    }

    #[inline(never)]
    pub(super) fn scale(x: &mut [f32], s: f32) {
        x.iter_mut().for_each(|x| *x *= s);
    }

    /// Returns whether every scaled value is finite.
    #[inline(never)]
    pub(super) fn scale_check_finite(x: &mut [f32], s: f32) -> bool {
        let mut non_finite = false;
        for x in x.iter_mut() {
            *x *= s;
            non_finite |= !x.is_finite();
        }
        !non_finite
    }

    #[inline(never)]
    pub(super) fn add(d: &mut [f32], s: &[f32]) {
        d.iter_mut().zip(s).for_each(|(a, b)| *a += b);
    }

    #[inline(never)]
    pub(super) fn add_widened<T: Copy + Into<f32>>(d: &mut [f32], s: &[T]) {
        d.iter_mut().zip(s).for_each(|(a, &b)| *a += b.into());
    }
}

/// Calls `f` with the f32 values of `t` (row-major): borrowed from the storage for a contiguous
/// tensor on the CPU (the storage's read lock is held while `f` runs, so `f` must not write
/// `t`), otherwise a host copy. For checkpoint IO and the host collectives of this version.
///
/// Errors: `t` is not f32; a failed copy.
pub(crate) fn with_host_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    if t.dtype() != DType::F32 {
        return Err(Error::InvalidArgument(format!(
            "expected an f32 tensor, found {:?}",
            t.dtype()
        )));
    }
    if t.device().is_cpu() && t.is_contiguous() {
        return with_cpu_f32(t, f);
    }
    let v = t.flatten_all()?.to_vec1::<f32>()?;
    Ok(f(&v))
}

/// Calls `f` with the values of a contiguous f32 CPU tensor, borrowed under its read lock.
fn with_cpu_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(Error::InvalidArgument(format!(
            "expected a contiguous tensor, found shape {:?} with strides {:?}",
            layout.dims(),
            layout.stride()
        )));
    };
    match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => Ok(f(&v[start..end])),
        Storage::Cpu(other) => Err(Error::InvalidArgument(format!(
            "expected an f32 tensor, found {:?}",
            other.dtype()
        ))),
        _ => Err(not_on_cpu("reading a tensor", t.device())),
    }
}

/// An [`InplaceOp1`] that hands the tensor's f32 values, as one mutable slice, to a closure.
struct SliceMut<F> {
    name: &'static str,
    f: Cell<Option<F>>,
}

impl<F> InplaceOp1 for SliceMut<F>
where
    F: FnOnce(&mut [f32]) -> Result<()>,
{
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let CpuStorage::F32(v) = storage else {
            return Err(candle_core::Error::Msg(format!(
                "{}: expected an f32 tensor, found {:?}",
                self.name,
                storage.dtype()
            )));
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            return Err(candle_core::Error::Msg(format!(
                "{}: expected a contiguous tensor",
                self.name
            )));
        };
        let f = self.f.take().expect("an in-place op runs its closure once");
        f(&mut v[start..end]).map_err(Error::into_candle)
    }
}

/// Runs `f` on the f32 values of `t`, mutably, under `t`'s write lock (no copy, no allocation).
fn with_mut(
    t: &Tensor,
    name: &'static str,
    f: impl FnOnce(&mut [f32]) -> Result<()>,
) -> Result<()> {
    t.inplace_op1(&SliceMut {
        name,
        f: Cell::new(Some(f)),
    })?;
    Ok(())
}

fn not_on_cpu(op: &str, device: &Device) -> Error {
    Error::InvalidArgument(format!(
        "{op}: tensor on {:?}: only CPU kernels exist in this version; the CUDA kernels come \
         with the GPU path",
        device.location()
    ))
}

/// Checks one tensor: on the CPU, contiguous, of one of `dtypes`.
fn check_layout(op: &str, what: &str, t: &Tensor, dtypes: &[DType]) -> Result<()> {
    if !t.device().is_cpu() {
        return Err(not_on_cpu(&format!("{op} ({what})"), t.device()));
    }
    if !dtypes.contains(&t.dtype()) {
        return Err(Error::InvalidArgument(format!(
            "{op}: {what} must be {}, found {:?}",
            dtypes
                .iter()
                .map(|d| format!("{d:?}"))
                .collect::<Vec<_>>()
                .join(" or "),
            t.dtype()
        )));
    }
    if !t.is_contiguous() {
        return Err(Error::InvalidArgument(format!(
            "{op}: {what} must be contiguous, found shape {:?} with strides {:?}",
            t.dims(),
            t.stride()
        )));
    }
    Ok(())
}

/// Checks f32 CPU contiguous tensors of one element count (the first's), which it returns.
fn check_all(op: &str, tensors: &[(&str, &Tensor)]) -> Result<usize> {
    let n = tensors[0].1.elem_count();
    for &(what, t) in tensors {
        check_layout(op, what, t, &[DType::F32])?;
        if t.elem_count() != n {
            return Err(Error::InvalidArgument(format!(
                "{op}: {what} has {} elements, expected {n} (those of {})",
                t.elem_count(),
                tensors[0].0
            )));
        }
    }
    Ok(n)
}

/// Address of the first element of a non-empty CPU tensor's storage: two tensors share storage
/// exactly when these are equal (a CPU storage owns its vector).
fn storage_addr(t: &Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => v.as_ptr() as usize,
        Storage::Cpu(CpuStorage::BF16(v)) => v.as_ptr() as usize,
        Storage::Cpu(CpuStorage::F16(v)) => v.as_ptr() as usize,
        _ => 0,
    }
}

/// Refuses tensors that share storage: locking one storage twice would deadlock, and the
/// element-wise loops assume distinct memory.
fn check_distinct(op: &str, tensors: &[(&str, &Tensor)]) -> Result<()> {
    let mut addrs = [0usize; 4];
    debug_assert!(tensors.len() <= addrs.len());
    for (a, &(_, t)) in addrs.iter_mut().zip(tensors) {
        *a = storage_addr(t);
    }
    for i in 0..tensors.len() {
        for j in i + 1..tensors.len() {
            if addrs[i] == addrs[j] {
                return Err(Error::InvalidArgument(format!(
                    "{op}: {} and {} share one storage; each tensor must own its own",
                    tensors[i].0, tensors[j].0
                )));
            }
        }
    }
    Ok(())
}
