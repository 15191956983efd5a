//! Device kernels over flat f32 tensors: the optimizer updates, the arithmetic of gradient
//! clipping and loss scaling, and in-place accumulation of gradient shards.
//!
//! This module is the one dispatching API of the in-place ops (the role `storage.rs` plays in
//! Candle): each public function checks its arguments **once** here (dtype, contiguity,
//! device, element counts, distinct storages, the scaler tensors), then goes to the device's
//! side, which checks nothing again: `ops::cpu` (private) on the CPU, `ops::cuda` (feature
//! `cuda`) on a GPU. The kernels themselves (CUDA C sources, NVRTC loading, argument structs,
//! launch plans and CPU references) are the leaf module [`crate::kernels`].
//!
//! Every kernel updates its destination tensors **in place** (their storage is written, no new
//! tensor is made), so a caller that holds a `&Tensor` (a [`crate::ShardView`]) can step a
//! shard. Tensors are flat: any shape is accepted, but they must be contiguous and the tensors of
//! one call must have the same element count.
//!
//! **CPU.** Each kernel is one pass over `&mut [f32]` / `&[f32]` slices of the tensors' own
//! storage, obtained through Candle's in-place op API: [`Tensor::inplace_op1`] with an
//! `InplaceOp1` whose `cpu_fwd` receives `&mut CpuStorage` (nested once per tensor that is
//! written: distinct storages are locked separately) and [`Tensor::storage_and_layout`] (a read
//! lock) for inputs. The kernels allocate nothing; Candle's in-place entry point allocates a few
//! bytes for its overlap check per tensor, independent of the tensor's size. The element-wise
//! arithmetic is written exactly as the host loops it replaced (same f32 operations in the same
//! order, no fused multiply-add), so results are bit-identical to them.
//!
//! **CUDA** (feature `cuda`). A tensor on a GPU goes to the NVRTC kernels of `kernels/`
//! (launch wrappers in `ops::cuda`), launched on the device's compute stream with the same
//! arithmetic (IEEE operations in the same order, no fused multiply-add: bit-identical results,
//! NaN payloads aside). The functions that return a host value ([`scale_and_check_finite_`],
//! [`all_finite`], [`sum_squares`]) read it back, which waits for the GPU; the step path uses
//! their device-side forms instead: [`unscale_check_finite_`] and [`check_finite_`] set a
//! `found_inf` flag on the device, which [`adamw_step_fused`] and [`sgd_step_fused`] read to
//! skip the step without a host sync (PyTorch's fused optimizers with `found_inf`). The fused
//! entry points work on the CPU too, with the CPU loops, so callers need not care where the
//! tensors are. Any other device is an [`Error::Device`] naming the kernel and the
//! device.
//!
//! Aliasing: the tensors written by one call must not share storage with each other, with its
//! inputs or with its scaler tensors (checked; an error names the two tensors).

use candle_core::{DType, Device, Tensor};

use crate::device::same_storage;
use crate::error::{Error, Result};
use crate::kernels::plan::{AdamWArgs, SgdArgs};

mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

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

/// A gradient unscale factor (`1 / scale` of a grad scaler) for the fused steps: a host value,
/// or a one-element f32 tensor on the tensors' device (a scale that lives on the GPU, read by
/// the kernel: no host read).
#[derive(Debug, Clone, Copy)]
pub enum ScaleFactor<'a> {
    /// A host value (1 for an unscaled gradient).
    Value(f32),
    /// A one-element f32 tensor on the device of the tensors it scales.
    Device(&'a Tensor),
}

impl Default for ScaleFactor<'_> {
    fn default() -> Self {
        ScaleFactor::Value(1.0)
    }
}

/// The grad scaler's part in a fused optimizer step ([`adamw_step_fused`],
/// [`sgd_step_fused`]): the gradient is multiplied by `inv_scale` as it is read (in registers;
/// the stored gradient is not written), and the whole step is skipped when `found_inf` holds a
/// non-zero value. [`Unscale::default`] is neither (`inv_scale` 1, no flag): a plain step.
#[derive(Debug, Clone, Copy, Default)]
pub struct Unscale<'a> {
    /// Multiplier of the gradient.
    pub inv_scale: ScaleFactor<'a>,
    /// A one-element f32 tensor on the tensors' device, set non-zero by
    /// [`unscale_check_finite_`] / [`check_finite_`] (and max-reduced over ranks) when some
    /// gradient is infinite or NaN: the step is then skipped, decided on the device.
    pub found_inf: Option<&'a Tensor>,
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

impl From<&AdamWHyper> for AdamWArgs {
    /// The kernel's argument struct of `h`, field for field.
    fn from(h: &AdamWHyper) -> Self {
        Self {
            beta1: h.beta1,
            beta2: h.beta2,
            one_minus_beta1: h.one_minus_beta1,
            one_minus_beta2: h.one_minus_beta2,
            bias_correction1: h.bias_correction1,
            bias_correction2: h.bias_correction2,
            decay: h.decay,
            lr: h.lr,
            eps: h.eps,
        }
    }
}

impl From<&SgdHyper> for SgdArgs {
    /// The kernel's argument struct of `h` (the bools as 0/1).
    fn from(h: &SgdHyper) -> Self {
        Self {
            lr: h.lr,
            momentum: h.momentum,
            one_minus_dampening: h.one_minus_dampening,
            weight_decay: h.weight_decay,
            nesterov: u32::from(h.nesterov),
            first_step: u32::from(h.first_step),
        }
    }
}

/// One AdamW update (Loshchilov & Hutter, ICLR 2019; operation by operation as candle-nn's
/// `AdamW` and PyTorch's `torch.optim.AdamW`), element-wise, in f32:
/// `m ← β1·m + (1 − β1)·g`, `v ← β2·v + (1 − β2)·g²`, `θ ← θ·(1 − lr·λ)`,
/// `θ ← θ − lr · (m·c1) / (sqrt(v·c2) + ε)` with `c1`, `c2` the bias corrections of `h`; an
/// `m` below f32's smallest normal number is stored (and used) as `+0`, and so is such a `v`
/// once `m` is 0 ([`crate::kernels::flush_subnormal`], [`crate::kernels::flush_second_moment`]:
/// subnormal arithmetic costs the CPU up to 17×; PyTorch keeps them).
///
/// `param`, `exp_avg`, `exp_avg_sq` are written in place; `grad` is read. All four: f32,
/// contiguous, the same element count, the same device, four distinct storages.
///
/// Errors ([`Error::BadTensor`], naming the kernel and the tensor): a dtype other than f32,
/// a non-contiguous tensor, different element counts, tensors on different devices, shared
/// storage, a device other than the CPU or (feature `cuda`) a GPU; on a GPU, a failed launch
/// ([`Error::Cuda`]).
pub fn adamw_step(
    param: &Tensor,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    h: &AdamWHyper,
) -> Result<()> {
    adamw_with(
        "adamw_step",
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        h,
        &Unscale::default(),
    )
}

/// [`adamw_step`] with a grad scaler's unscale and skip ([`Unscale`]), the entry point of a
/// step that never waits for the GPU: `g = grad · inv_scale` in registers (the stored gradient
/// is not written), then [`adamw_step`]'s update, bit for bit; nothing at all when
/// `u.found_inf` holds a non-zero value (on a GPU the kernel reads the flag; on the CPU it is
/// read here). With [`Unscale::default`] this is [`adamw_step`].
///
/// Errors: as [`adamw_step`]; a scaler tensor that is not one f32 element on the tensors'
/// device, or shares storage with one of them.
pub fn adamw_step_fused(
    param: &Tensor,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    h: &AdamWHyper,
    u: &Unscale<'_>,
) -> Result<()> {
    adamw_with("adamw_step_fused", param, grad, exp_avg, exp_avg_sq, h, u)
}

/// The body of [`adamw_step`] and [`adamw_step_fused`], naming `op` in errors. With
/// [`Unscale::default`] nothing is read and the plain update runs (`inv_scale` 1).
fn adamw_with(
    op: &'static str,
    param: &Tensor,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    h: &AdamWHyper,
    u: &Unscale<'_>,
) -> Result<()> {
    let n = check_all(
        op,
        &[
            ("param", param),
            ("grad", grad),
            ("exp_avg", exp_avg),
            ("exp_avg_sq", exp_avg_sq),
        ],
    )?;
    check_unscale(op, param.device(), u)?;
    if n == 0 {
        return Ok(());
    }
    check_distinct(
        op,
        &with_unscale(
            &[
                ("param", param),
                ("grad", grad),
                ("exp_avg", exp_avg),
                ("exp_avg_sq", exp_avg_sq),
            ],
            u,
        ),
    )?;
    #[cfg(feature = "cuda")]
    if param.device().is_cuda() {
        return cuda::adamw_(param, grad, exp_avg, exp_avg_sq, h, u);
    }
    cpu::adamw_(op, param, grad, exp_avg, exp_avg_sq, h, u)
}

/// [`adamw_step`] with the moments stored in bf16 (`exp_avg`, `exp_avg_sq` bf16; `param`,
/// `grad` f32): each element's moments are read into f32, updated and used for the parameter's
/// update in f32 exactly as [`adamw_step`] does, then rounded once to bf16 **stochastically**:
/// the f32 bits plus 16 random bits, truncated (round up with probability equal to the dropped
/// fraction; unbiased). Round-to-nearest would freeze `v`: with `β2 = 0.999` a step moves `v`
/// by 0.1 % of its distance to `g²`, below half a bf16 ulp (0.2–0.4 %) unless `g²` exceeds
/// about 5 `v`, so `v` would stop decaying (Zamirai et al. 2020, "Revisiting BFloat16 Training",
/// arXiv:2010.06192, on the same effect in weights). The random bits are a hash
/// (`fsdp::fused::mix64`) of `seed` and the element's index `offset + i`: a step is a
/// pure function of its inputs (a resumed run draws the same bits).
///
/// Errors: as [`adamw_step`] (the moments bf16 instead of f32); a GPU device (CPU only).
pub fn adamw_step_bf16_state(
    param: &Tensor,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    h: &AdamWHyper,
    seed: u64,
    offset: u64,
) -> Result<()> {
    let op = "adamw_step_bf16_state";
    let n = check_all(op, &[("param", param), ("grad", grad)])?;
    for (what, t) in [("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)] {
        check_layout(op, what, t, &[DType::BF16])?;
        if !t.device().is_cpu() {
            return Err(bad(
                op,
                what,
                "is on a GPU: bf16 optimizer state runs on the CPU only (use f32 state there)"
                    .into(),
            ));
        }
        if t.elem_count() != n {
            return Err(bad(
                op,
                what,
                format!(
                    "has {} elements, expected {n} (those of param)",
                    t.elem_count()
                ),
            ));
        }
    }
    if n == 0 {
        return Ok(());
    }
    check_distinct(
        op,
        &[
            ("param", param),
            ("grad", grad),
            ("exp_avg", exp_avg),
            ("exp_avg_sq", exp_avg_sq),
        ],
    )?;
    cpu::adamw_bf16_(op, param, grad, exp_avg, exp_avg_sq, h, seed, offset)
}

/// One SGD update, PyTorch's algorithm (`torch.optim.SGD` docs), element-wise, in f32:
/// `d ← g + λθ` (when λ ≠ 0); with momentum μ ≠ 0: `b ← d` at the first step, else
/// `b ← μ·b + (1 − τ)·d` (a `b` below f32's smallest normal stored and used as `+0`,
/// [`crate::kernels::flush_subnormal`]), then `d ← d + μ·b` (Nesterov) or `d ← b`; finally
/// `θ ← θ − lr·d`.
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
    sgd_with(
        "sgd_step",
        param,
        grad,
        momentum_buffer,
        h,
        &Unscale::default(),
    )
}

/// [`sgd_step`] with a grad scaler's unscale and skip ([`Unscale`]), as [`adamw_step_fused`]:
/// `d = grad · inv_scale` in registers, then [`sgd_step`]'s update bit for bit, nothing when
/// `u.found_inf` holds a non-zero value. With [`Unscale::default`] this is [`sgd_step`].
///
/// Errors: as [`sgd_step`] and [`adamw_step_fused`].
pub fn sgd_step_fused(
    param: &Tensor,
    grad: &Tensor,
    momentum_buffer: Option<&Tensor>,
    h: &SgdHyper,
    u: &Unscale<'_>,
) -> Result<()> {
    sgd_with("sgd_step_fused", param, grad, momentum_buffer, h, u)
}

/// The body of [`sgd_step`] and [`sgd_step_fused`], naming `op` in errors.
fn sgd_with(
    op: &'static str,
    param: &Tensor,
    grad: &Tensor,
    momentum_buffer: Option<&Tensor>,
    h: &SgdHyper,
    u: &Unscale<'_>,
) -> Result<()> {
    let h = *h;
    let buf = match (h.momentum != 0.0, momentum_buffer) {
        (false, _) => None,
        (true, Some(b)) => Some(b),
        (true, None) => {
            return Err(bad(
                op,
                "momentum",
                format!("{} needs a momentum buffer, none given", h.momentum),
            ))
        }
    };
    let all = [
        ("param", param),
        ("grad", grad),
        ("momentum_buffer", buf.unwrap_or(param)),
    ];
    let tensors = if buf.is_some() { &all[..] } else { &all[..2] };
    let n = check_all(op, tensors)?;
    check_unscale(op, param.device(), u)?;
    if n == 0 {
        return Ok(());
    }
    check_distinct(op, &with_unscale(tensors, u))?;
    #[cfg(feature = "cuda")]
    if param.device().is_cuda() {
        return cuda::sgd_(param, grad, buf, &h, u);
    }
    cpu::sgd_(op, param, grad, buf, h, u)
}

/// Multiplies every element of `t` (f32, contiguous) by `s`, in place.
///
/// Errors: as [`adamw_step`].
pub fn scale_(t: &Tensor, s: f32) -> Result<()> {
    const OP: &str = "scale_";
    if check_all(OP, &[("tensor", t)])? == 0 {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    if t.device().is_cuda() {
        return cuda::scale_(t, s);
    }
    cpu::scale_(OP, t, s)
}

/// Multiplies every element of `t` (f32, contiguous) by `s` in place and returns whether every
/// result is finite: the grad scaler's unscale and inf/NaN check in one pass (PyTorch's
/// `_amp_foreach_non_finite_check_and_unscale_`). On a GPU the answer is read back (a host
/// wait); [`unscale_check_finite_`] keeps it on the device.
///
/// Errors: as [`adamw_step`].
pub fn scale_and_check_finite_(t: &Tensor, s: f32) -> Result<bool> {
    const OP: &str = "scale_and_check_finite_";
    if check_all(OP, &[("tensor", t)])? == 0 {
        return Ok(true);
    }
    #[cfg(feature = "cuda")]
    if t.device().is_cuda() {
        let flag = Tensor::zeros(1, DType::F32, t.device())?;
        cuda::scale_check_finite_(t, ScaleFactor::Value(s), &flag)?;
        return Ok(flag.to_vec1::<f32>()?[0] == 0.0);
    }
    cpu::scale_check_finite_(OP, t, s)
}

/// Whether every element of `t` (f32, contiguous) is finite (no inf, no NaN).
///
/// Errors: as [`adamw_step`].
pub fn all_finite(t: &Tensor) -> Result<bool> {
    check_all("all_finite", &[("tensor", t)])?;
    #[cfg(feature = "cuda")]
    if t.device().is_cuda() {
        if t.elem_count() == 0 {
            return Ok(true);
        }
        let flag = Tensor::zeros(1, DType::F32, t.device())?;
        cuda::check_finite_(t, &flag)?;
        return Ok(flag.to_vec1::<f32>()?[0] == 0.0);
    }
    cpu::all_finite(t)
}

/// Multiplies every element of `t` (f32, contiguous) by `factor` in place and sets `found_inf`
/// (a one-element f32 tensor on `t`'s device) to 1 when some result is infinite or NaN, leaving
/// it alone otherwise: the device-side form of [`scale_and_check_finite_`] (PyTorch's
/// `_amp_foreach_non_finite_check_and_unscale_`). On a GPU nothing is read back; zero the flag
/// before a step's first call, max-reduce it over ranks, and pass it to [`adamw_step_fused`] /
/// [`sgd_step_fused`] as [`Unscale::found_inf`].
///
/// Errors: as [`adamw_step`]; `found_inf` (or a device factor) not one f32 element on `t`'s
/// device, or sharing `t`'s storage.
pub fn unscale_check_finite_(
    t: &Tensor,
    factor: ScaleFactor<'_>,
    found_inf: &Tensor,
) -> Result<()> {
    const OP: &str = "unscale_check_finite_";
    let n = check_all(OP, &[("tensor", t)])?;
    let u = Unscale {
        inv_scale: factor,
        found_inf: Some(found_inf),
    };
    check_unscale(OP, t.device(), &u)?;
    check_distinct(OP, &with_unscale(&[("tensor", t)], &u))?;
    if n == 0 {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    if t.device().is_cuda() {
        return cuda::scale_check_finite_(t, factor, found_inf);
    }
    cpu::unscale_check_finite_(OP, t, factor, found_inf)
}

/// Sets `found_inf` (a one-element f32 tensor on `t`'s device) to 1 when some element of `t`
/// (f32, contiguous; read only) is infinite or NaN, leaving it alone otherwise: the
/// device-side form of [`all_finite`], for a check without unscaling (PyTorch's fused path
/// checks the scaled gradients, then unscales inside the step with [`Unscale::inv_scale`]).
///
/// Errors: as [`unscale_check_finite_`].
pub fn check_finite_(t: &Tensor, found_inf: &Tensor) -> Result<()> {
    const OP: &str = "check_finite_";
    let n = check_all(OP, &[("tensor", t)])?;
    check_unscale(
        OP,
        t.device(),
        &Unscale {
            inv_scale: ScaleFactor::Value(1.0),
            found_inf: Some(found_inf),
        },
    )?;
    check_distinct(OP, &[("tensor", t), ("found_inf", found_inf)])?;
    if n == 0 {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    if t.device().is_cuda() {
        return cuda::check_finite_(t, found_inf);
    }
    cpu::check_finite_(OP, t, found_inf)
}

/// Sum of the squares of the elements of `t` (f32, contiguous), each widened to f64 and summed
/// in f64 in element order: the local part of a total L2 norm
/// (`torch.nn.utils.clip_grad_norm_`'s norm, accumulated more precisely than f32). On a GPU the
/// f64 sum runs in the kernels' fixed tree order (equal up to rounding) and is read back;
/// `cuda::sum_squares_into` (cargo feature `cuda`) keeps it on the device.
///
/// Errors: as [`adamw_step`].
pub fn sum_squares(t: &Tensor) -> Result<f64> {
    check_all("sum_squares", &[("tensor", t)])?;
    #[cfg(feature = "cuda")]
    if t.device().is_cuda() {
        // The kernels' fixed tree order (`kernels::sum_squares_reference`), read back.
        let acc = Tensor::zeros(1, DType::F64, t.device())?;
        cuda::sum_squares_into(t, &acc, false)?;
        return Ok(acc.to_vec1::<f64>()?[0]);
    }
    cpu::sum_squares(t)
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
        return Err(bad(
            OP,
            "src",
            format!(
                "has {} elements, expected {n} (those of dst)",
                src.elem_count()
            ),
        ));
    }
    if n == 0 {
        return Ok(());
    }
    check_distinct(OP, &[("dst", dst), ("src", src)])?;
    #[cfg(feature = "cuda")]
    if dst.device().is_cuda() {
        return cuda::add_(dst, src);
    }
    cpu::add_(OP, dst, src)
}

/// `t` converted to `dtype` (f32, bf16 or f16): a new contiguous tensor on `t`'s device, round to
/// nearest even with the `half` crate's NaN and subnormal handling on both devices (CPU:
/// Candle's `to_dtype`, which converts with `half`; GPU: the `cast` kernel, bit-identical,
/// [`crate::kernels::cast_reference`]).
///
/// Errors: `t` or `dtype` not f32/bf16/f16; a device other than the CPU or a GPU.
pub fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    const OP: &str = "cast";
    let fl = [DType::F32, DType::BF16, DType::F16];
    if !fl.contains(&t.dtype()) || !fl.contains(&dtype) {
        return Err(bad(
            OP,
            "the conversion",
            format!(
                "must be between f32, bf16 and f16, asked {:?} -> {dtype:?}",
                t.dtype()
            ),
        ));
    }
    #[cfg(feature = "cuda")]
    if t.device().is_cuda() {
        return cuda::cast_checked(t, dtype, None);
    }
    if !t.device().is_cpu() {
        return Err(not_on_cpu(OP, t.device()));
    }
    Ok(t.to_dtype(dtype)?.contiguous()?)
}

/// Calls `f` with the f32 values of `t` (row-major): borrowed from the storage for a contiguous
/// tensor on the CPU (the storage's read lock is held while `f` runs, so `f` must not write
/// `t`), otherwise a host copy. For checkpoint IO and the host collectives of this version.
///
/// Errors: `t` is not f32; a failed copy.
pub(crate) fn with_host_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    if t.dtype() != DType::F32 {
        return Err(Error::dtype("a tensor read on the host", "F32", t.dtype()));
    }
    if t.device().is_cpu() && t.is_contiguous() {
        return cpu::with_cpu_f32(t, f);
    }
    let v = t.flatten_all()?.to_vec1::<f32>()?;
    Ok(f(&v))
}

/// [`with_host_f32`] for u8 bytes: borrowed on the CPU, a host copy elsewhere.
///
/// Errors: `t` is not u8; a failed copy.
pub(crate) fn with_host_u8<R>(t: &Tensor, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
    if t.dtype() != DType::U8 {
        return Err(Error::dtype("a tensor read on the host", "U8", t.dtype()));
    }
    if t.device().is_cpu() && t.is_contiguous() {
        return cpu::with_cpu_u8(t, f);
    }
    let v = t.flatten_all()?.to_vec1::<u8>()?;
    Ok(f(&v))
}

/// CRC-32C (Castagnoli, the checksum of checkpoints and run fingerprints) of `t`'s elements as
/// little-endian bytes in its own dtype, row-major, appended to `crc` (0 to start): read in
/// place on the CPU (one pass over the bytes), from a host copy elsewhere or when `t` is not
/// contiguous. Returns the checksum and the bytes covered.
///
/// Errors: a failed copy.
pub(crate) fn crc32c_append(crc: u32, t: &Tensor) -> Result<(u32, u64)> {
    let hash = |b: &[u8]| (crc32c::crc32c_append(crc, b), b.len() as u64);
    if t.device().is_cpu() && t.is_contiguous() {
        return cpu::with_cpu_bytes(t, hash);
    }
    let host = t.flatten_all()?.to_device(&Device::Cpu)?.contiguous()?;
    cpu::with_cpu_bytes(&host, hash)
}

fn not_on_cpu(op: &str, device: &Device) -> Error {
    Error::device(
        format!("{op}: a tensor"),
        "the CPU or, in a build with feature `cuda`, a CUDA GPU (where the kernels run)",
        device.location(),
    )
}

/// Whether the kernels run on `device`: the CPU, and a GPU in a build with feature `cuda`.
fn supported(device: &Device) -> bool {
    device.is_cpu() || (cfg!(feature = "cuda") && device.is_cuda())
}

/// Checks the scaler tensors of a fused step: one f32 element each, on `device`.
fn check_unscale(op: &str, device: &Device, u: &Unscale<'_>) -> Result<()> {
    let dev_factor = match u.inv_scale {
        ScaleFactor::Device(t) => Some(t),
        ScaleFactor::Value(_) => None,
    };
    for (what, t) in [("inv_scale", dev_factor), ("found_inf", u.found_inf)] {
        let Some(t) = t else { continue };
        check_layout(op, what, t, &[DType::F32])?;
        if t.elem_count() != 1 || !t.device().same_device(device) {
            return Err(bad(
                op,
                what,
                format!(
                    "must be one f32 element on {:?}, found shape {:?} on {:?}",
                    device.location(),
                    t.dims(),
                    t.device().location()
                ),
            ));
        }
    }
    Ok(())
}

/// Checks one tensor: on the CPU or (feature `cuda`) a GPU, contiguous, of one of `dtypes`.
fn check_layout(op: &str, what: &str, t: &Tensor, dtypes: &[DType]) -> Result<()> {
    if !supported(t.device()) {
        return Err(not_on_cpu(&format!("{op} ({what})"), t.device()));
    }
    check_dtype_contiguous(op, what, t, dtypes)
}

/// Checks one tensor's dtype (one of `dtypes`) and contiguity, naming `op` and `what` (shared
/// with the CUDA launch wrappers of `ops::cuda`).
pub(crate) fn check_dtype_contiguous(
    op: &str,
    what: &str,
    t: &Tensor,
    dtypes: &[DType],
) -> Result<()> {
    if !dtypes.contains(&t.dtype()) {
        return Err(bad(
            op,
            what,
            format!(
                "must be {}, found {:?}",
                dtypes
                    .iter()
                    .map(|d| format!("{d:?}"))
                    .collect::<Vec<_>>()
                    .join(" or "),
                t.dtype()
            ),
        ));
    }
    if !t.is_contiguous() {
        return Err(bad(
            op,
            what,
            format!(
                "must be contiguous, found shape {:?} with strides {:?}",
                t.dims(),
                t.stride()
            ),
        ));
    }
    Ok(())
}

/// Checks f32 contiguous tensors on one device (the first's) of one element count (the
/// first's), which it returns.
fn check_all(op: &str, tensors: &[(&str, &Tensor)]) -> Result<usize> {
    let n = tensors[0].1.elem_count();
    let device = tensors[0].1.device();
    for &(what, t) in tensors {
        check_layout(op, what, t, &[DType::F32])?;
        if !t.device().same_device(device) {
            return Err(bad(
                op,
                what,
                format!(
                    "is on {:?}, {} on {:?}",
                    t.device().location(),
                    tensors[0].0,
                    device.location()
                ),
            ));
        }
        if t.elem_count() != n {
            return Err(bad(
                op,
                what,
                format!(
                    "has {} elements, expected {n} (those of {})",
                    t.elem_count(),
                    tensors[0].0
                ),
            ));
        }
    }
    Ok(n)
}

/// `tensors` followed by the scaler tensors of `u` (named `inv_scale`, `found_inf`), for
/// [`check_distinct`].
fn with_unscale<'a>(
    tensors: &[(&'a str, &'a Tensor)],
    u: &Unscale<'a>,
) -> Vec<(&'a str, &'a Tensor)> {
    let mut all = tensors.to_vec();
    if let ScaleFactor::Device(t) = u.inv_scale {
        all.push(("inv_scale", t));
    }
    if let Some(t) = u.found_inf {
        all.push(("found_inf", t));
    }
    all
}

/// The error of an unfit kernel argument ([`Error::BadTensor`]).
fn bad(op: &str, tensor: &str, problem: String) -> Error {
    Error::BadTensor {
        op: op.to_string(),
        tensor: tensor.to_string(),
        problem,
    }
}

/// Refuses tensors that share storage: locking one storage twice would deadlock, and the
/// element-wise loops assume distinct memory.
pub(crate) fn check_distinct(op: &str, tensors: &[(&str, &Tensor)]) -> Result<()> {
    for i in 0..tensors.len() {
        for j in i + 1..tensors.len() {
            if same_storage(tensors[i].1, tensors[j].1) {
                return Err(bad(
                    op,
                    tensors[i].0,
                    format!(
                        "and {} share one storage; each tensor must own its own",
                        tensors[j].0
                    ),
                ));
            }
        }
    }
    Ok(())
}
