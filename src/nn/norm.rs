//! Differentiable LayerNorm and RMSNorm layers.
//!
//! candle-nn 0.11's [`candle_nn::LayerNorm`] (with a bias and mean removal, on a contiguous input)
//! and [`candle_nn::RmsNorm`] (on a contiguous input) run fused kernels applied with
//! `apply_op*_no_bwd`: the output has no backward, so after `loss.backward()` the norm's weight
//! and bias, and every parameter *below* the norm, silently get no gradient at all. The layers
//! here are drop-ins with the same constructors, the same parameter names and init (so
//! checkpoints and `VarMap`s are interchangeable with candle-nn's) whose forward has a real
//! backward: `loss.backward()` gives the gradients of the input, the weight and the bias.
//!
//! # Formulas
//!
//! Over the last dimension, of size `D`, of each row `x` of the input:
//!
//! ```text
//! LayerNorm (Ba, Kiros & Hinton 2016, "Layer Normalization", arXiv:1607.06450):
//!     μ = mean(x)     σ = sqrt(mean((x − μ)²) + eps)     x̂ = (x − μ) / σ
//!     y = x̂ · w + b
//! RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", arXiv:1910.07467):
//!     r = sqrt(mean(x²) + eps)                            x̂ = x / r
//!     y = x̂ · w
//! ```
//!
//! (the variance is the biased one, as in PyTorch and candle-nn). With `g` the gradient of the
//! output and `ĝ = g · w`, the backward is, per row (`σ` standing for `r` in RMSNorm, where the
//! `mean(ĝ)` term is absent because no mean is removed):
//!
//! ```text
//!     dx = (ĝ − mean(ĝ) − x̂ · mean(ĝ · x̂)) / σ
//!     dw = Σ_rows g · x̂          db = Σ_rows g
//! ```
//!
//! # Implementation
//!
//! On the CPU, for f32, bf16 and f16, the forward is one custom op (a hand-written kernel: per
//! row, two passes for the mean and the centred variance, one to write the output) whose backward
//! is a second hand-written kernel computing `dx`, `dw` and `db` of the formulas above in one
//! sweep over the rows (each row's statistics are recomputed from the input, which is cheaper
//! than storing them). Statistics and sums are in f32 for every dtype; half-precision outputs and
//! gradients are rounded once, at the end. The kernels work in tiles of 32 rows split over the
//! rank's threads under the rule of the [`crate::nn`] module documentation (on the calling
//! thread when a rank has one core); the backward's `dw` and `db` are per-tile partial sums added
//! in tile order, so the result does not depend on the thread count. Elsewhere (f64, non-CPU devices, empty tensors) the forward is composed of
//! differentiable Candle ops ([`LayerNorm::forward_composed`]), with candle-nn's non-fused
//! arithmetic (statistics in f32 for half types, cast back before the affine part), and Candle's
//! autograd differentiates it. Both paths give the same gradients up to rounding; the CPU
//! kernel's backward is not itself differentiable (no second derivatives through a norm on that
//! path). `benches/norms.rs` times both paths against candle-nn's fused forward.

use candle_core::{
    backend::BackendStorage, bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Module, Result,
    Shape, Tensor, D,
};
use candle_nn::{Init, LayerNormConfig, VarBuilder};

use crate::cpu::{contiguous, dot16, filled, parallel_chunks_map, sum16, with_simd, Elem};

/// Layer normalisation over the last dimension, with a backward.
///
/// `y = (x − mean(x)) / sqrt(var(x) + eps) · weight + bias` (Ba et al. 2016), each statistic over
/// the last dimension; with `remove_mean` false (see [`LayerNorm::rms_norm`]) no mean is removed
/// and it is RMSNorm (Zhang & Sennrich 2019); without a bias the `+ bias` is absent. See the
/// module documentation (`src/nn/norm.rs`) for the backward formulas and why this exists: candle-nn's
/// `LayerNorm` runs a fused kernel with no backward, so nothing at or below it trains.
///
/// Shapes: input `(…, D)` of any rank ≥ 1, output the input's shape; `weight` and `bias` are
/// `(D,)`. Dtypes: f32, bf16, f16 and f64, the weight and bias of the input's dtype; the
/// statistics of half-precision inputs are computed in f32 and the output cast back.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Option<Tensor>,
    remove_mean: bool,
    eps: f64,
}

impl LayerNorm {
    /// A LayerNorm with `weight` and `bias` (both `(D,)`) and mean removal.
    pub fn new(weight: Tensor, bias: Tensor, eps: f64) -> Self {
        Self {
            weight,
            bias: Some(bias),
            remove_mean: true,
            eps,
        }
    }

    /// A LayerNorm with mean removal and `weight` (`(D,)`) but no bias.
    pub fn new_no_bias(weight: Tensor, eps: f64) -> Self {
        Self {
            weight,
            bias: None,
            remove_mean: true,
            eps,
        }
    }

    /// An RMSNorm as a LayerNorm: no mean removal, no bias (see [`RmsNorm`]).
    pub fn rms_norm(weight: Tensor, eps: f64) -> Self {
        Self {
            weight,
            bias: None,
            remove_mean: false,
            eps,
        }
    }

    /// The scale `weight`, `(D,)`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The shift `bias`, `(D,)`, if the layer has one.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The `eps` added to the variance (or mean square) under the square root.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// Whether the mean is removed (LayerNorm) or not (RMSNorm).
    pub fn remove_mean(&self) -> bool {
        self.remove_mean
    }

    /// The forward composed of differentiable Candle ops only (candle-nn's non-fused arithmetic:
    /// statistics in f32 for half types, the normalised input cast back to the input's dtype
    /// before the weight and bias are applied); Candle's autograd differentiates it, to any order.
    /// [`Module::forward`] uses it for f64, non-CPU devices and empty inputs, and a faster
    /// custom op with a hand-written backward otherwise; both give the same values and gradients
    /// up to rounding.
    pub fn forward_composed(&self, x: &Tensor) -> Result<Tensor> {
        self.check(x)?;
        let x_dtype = x.dtype();
        let internal = match x_dtype {
            DType::F16 | DType::BF16 => DType::F32,
            d => d,
        };
        let size = x.dim(D::Minus1)?;
        let x = x.to_dtype(internal)?;
        let x = if self.remove_mean {
            let mean = (x.sum_keepdim(D::Minus1)? / size as f64)?;
            x.broadcast_sub(&mean)?
        } else {
            x
        };
        let mean_sq = (x.sqr()?.sum_keepdim(D::Minus1)? / size as f64)?;
        let x_hat = x.broadcast_div(&(mean_sq + self.eps)?.sqrt()?)?;
        let y = x_hat.to_dtype(x_dtype)?.broadcast_mul(&self.weight)?;
        match &self.bias {
            Some(bias) => y.broadcast_add(bias),
            None => Ok(y),
        }
    }

    /// Shapes and dtypes of the input against the parameters.
    fn check(&self, x: &Tensor) -> Result<()> {
        let size = x.dim(D::Minus1)?;
        let params =
            std::iter::once(("weight", &self.weight)).chain(self.bias.iter().map(|b| ("bias", b)));
        for (name, p) in params {
            if p.dims() != [size] {
                bail!(
                    "norm: {name} of shape {:?} for an input of shape {:?} (expected ({size},))",
                    p.shape(),
                    x.shape()
                )
            }
            if p.dtype() != x.dtype() {
                bail!(
                    "norm: {name} is {:?} but the input is {:?}",
                    p.dtype(),
                    x.dtype()
                )
            }
        }
        Ok(())
    }
}

impl Module for LayerNorm {
    /// Normalises `x` (`(…, D)`) over its last dimension; differentiable in `x`, the weight and
    /// the bias. CPU f32/bf16/f16: the custom op with a hand-written backward; otherwise
    /// [`LayerNorm::forward_composed`].
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.check(x)?;
        let kernel = x.device().is_cpu()
            && matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
            && x.elem_count() > 0;
        if !kernel {
            return self.forward_composed(x);
        }
        let op = NormOp {
            eps: self.eps as f32,
            remove_mean: self.remove_mean,
        };
        let x = x.contiguous()?;
        let weight = self.weight.contiguous()?;
        match &self.bias {
            Some(bias) => x.apply_op3(&weight, &bias.contiguous()?, op),
            None => x.apply_op2(&weight, op),
        }
    }
}

/// A [`LayerNorm`] with the given size and config, parameters from `vb`: candle-nn's
/// [`candle_nn::layer_norm()`] with a backward.
///
/// Same signature, names and init as candle-nn's: `weight` (`(size,)`, init 1; an existing
/// `gamma` is used instead when `vb` holds one) and, when `config.affine`, `bias` (`(size,)`,
/// init 0; or an existing `beta`). `config.remove_mean` false gives RMSNorm, `config.eps` is added
/// to the variance. An `f64` converts into a config with mean removal and a bias.
pub fn layer_norm<C: Into<LayerNormConfig>>(
    size: usize,
    config: C,
    vb: VarBuilder,
) -> Result<LayerNorm> {
    let config = config.into();
    let weight_name = ["weight", "gamma"]
        .into_iter()
        .find(|name| vb.contains_tensor(name))
        .unwrap_or("weight");
    let weight = vb.get_with_hints(size, weight_name, Init::Const(1.))?;
    let bias = if config.affine {
        let bias_name = ["bias", "beta"]
            .into_iter()
            .find(|name| vb.contains_tensor(name))
            .unwrap_or("bias");
        Some(vb.get_with_hints(size, bias_name, Init::Const(0.))?)
    } else {
        None
    };
    Ok(LayerNorm {
        weight,
        bias,
        remove_mean: config.remove_mean,
        eps: config.eps,
    })
}

/// A [`LayerNorm`] with mean removal and a `weight` but no bias: candle-nn's
/// [`candle_nn::layer_norm_no_bias`] with a backward.
pub fn layer_norm_no_bias(size: usize, eps: f64, vb: VarBuilder) -> Result<LayerNorm> {
    let config = LayerNormConfig {
        eps,
        remove_mean: true,
        affine: false,
    };
    layer_norm(size, config, vb)
}

/// RMS normalisation over the last dimension, with a backward.
///
/// `y = x / sqrt(mean(x²) + eps) · weight` (Zhang & Sennrich 2019), the mean over the last
/// dimension. candle-nn's [`candle_nn::RmsNorm`] runs a fused kernel with no backward on
/// contiguous inputs, so nothing at or below it trains; this one has one (see the
/// module documentation (`src/nn/norm.rs`) for the formulas).
///
/// Shapes: input `(…, D)` of any rank ≥ 1, output the input's shape, `weight` `(D,)`. Dtypes: f32,
/// bf16, f16 and f64, the weight of the input's dtype; half-precision statistics in f32.
#[derive(Clone, Debug)]
pub struct RmsNorm(LayerNorm);

impl RmsNorm {
    /// An RMSNorm with `weight` (`(D,)`).
    pub fn new(weight: Tensor, eps: f64) -> Self {
        Self(LayerNorm::rms_norm(weight, eps))
    }

    /// The same layer as a [`LayerNorm`] without mean removal or bias.
    pub fn into_inner(self) -> LayerNorm {
        self.0
    }

    /// The scale `weight`, `(D,)`.
    pub fn weight(&self) -> &Tensor {
        self.0.weight()
    }

    /// The `eps` added to the mean square under the square root.
    pub fn eps(&self) -> f64 {
        self.0.eps()
    }

    /// The forward composed of differentiable Candle ops only; see
    /// [`LayerNorm::forward_composed`].
    pub fn forward_composed(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward_composed(x)
    }
}

impl Module for RmsNorm {
    /// Normalises `x` (`(…, D)`) over its last dimension; differentiable in `x` and the weight.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward(x)
    }
}

/// An [`RmsNorm`] of the given size, parameter from `vb`: candle-nn's [`candle_nn::rms_norm`]
/// with a backward. Same signature, name and init: `weight` (`(size,)`, init 1; an existing
/// `gamma` is used instead when `vb` holds one).
pub fn rms_norm(size: usize, eps: f64, vb: VarBuilder) -> Result<RmsNorm> {
    let config = LayerNormConfig {
        eps,
        remove_mean: false,
        affine: false,
    };
    Ok(RmsNorm(layer_norm(size, config, vb)?))
}

// ---------------------------------------------------------------------------------------------
// CPU kernels.

/// Mean (0 without mean removal) and `1 / σ` of one row, in f32, two passes.
#[inline(always)]
fn row_stats(x: &[f32], eps: f32, remove_mean: bool) -> (f32, f32) {
    let n = x.len() as f32;
    let mean = if remove_mean {
        sum16(x, |v| v) / n
    } else {
        0.0
    };
    let var = sum16(x, |v| (v - mean) * (v - mean)) / n;
    (mean, (var + eps).sqrt().recip())
}

/// Rows per task of the norm kernels; fixed, so that the backward's `dw`, `db` partial sums
/// are added in the same order whatever the number of threads.
const ROWS: usize = 32;

/// The forward of [`LayerNorm`] on the CPU: `y = (x − μ)/σ · w (+ b)` per row of size `w.len()`,
/// tiles of [`ROWS`] rows split over the rank's threads.
pub(super) fn norm_fwd<T: Elem>(
    x: &[T],
    w: &[T],
    b: Option<&[T]>,
    eps: f32,
    remove_mean: bool,
) -> Vec<T> {
    let d = w.len();
    let w: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
    let b: Vec<f32> = match b {
        Some(b) => b.iter().map(|v| v.to_f32()).collect(),
        None => vec![0.0; d],
    };
    // SAFETY: each tile of whole rows is written element by element (zip over its rows).
    unsafe {
        filled(x.len(), ROWS * d, |i, out| {
            with_simd(
                #[inline(always)]
                || {
                    let mut buf = vec![0f32; d];
                    let x = &x[i * ROWS * d..i * ROWS * d + out.len()];
                    for (xs, ys) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
                        let row = T::load(xs, &mut buf);
                        let (mean, rstd) = row_stats(row, eps, remove_mean);
                        for (((y, &v), &w), &b) in ys.iter_mut().zip(row).zip(&w).zip(&b) {
                            y.write(T::from_f32((v - mean) * rstd * w + b));
                        }
                    }
                },
            )
        })
    }
}

/// The backward of [`LayerNorm`] on the CPU, for the output gradient `g`: `dx` (the input's
/// size) followed by `dw` and `db` (each `w.len()`), in one buffer. Tiles of [`ROWS`] rows run
/// over the rank's threads, each with its own `dw`, `db` partial sums, added in tile order.
pub(super) fn norm_bwd<T: Elem>(x: &[T], w: &[T], g: &[T], eps: f32, remove_mean: bool) -> Vec<T> {
    let d = w.len();
    let w: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
    let mut out: Vec<std::mem::MaybeUninit<T>> = Vec::with_capacity(x.len() + 2 * d);
    // SAFETY: `MaybeUninit` needs no initialisation; the capacity is the length.
    unsafe { out.set_len(x.len() + 2 * d) };
    let (dx, params) = out.split_at_mut(x.len());
    let partials = parallel_chunks_map(dx, ROWS * d, |i, dx| {
        with_simd(
            #[inline(always)]
            || {
                let (mut dw, mut db) = (vec![0f32; d], vec![0f32; d]);
                let (mut x_buf, mut g_buf) = (vec![0f32; d], vec![0f32; d]);
                let (mut xh, mut gh) = (vec![0f32; d], vec![0f32; d]);
                let r = i * ROWS * d..i * ROWS * d + dx.len();
                let (x, g) = (&x[r.clone()], &g[r]);
                for ((xs, gs), dxs) in x
                    .chunks_exact(d)
                    .zip(g.chunks_exact(d))
                    .zip(dx.chunks_exact_mut(d))
                {
                    let xs = T::load(xs, &mut x_buf);
                    let gs = T::load(gs, &mut g_buf);
                    let (mean, rstd) = row_stats(xs, eps, remove_mean);
                    let params = w.iter().zip(dw.iter_mut()).zip(db.iter_mut());
                    let row = xh.iter_mut().zip(gh.iter_mut()).zip(xs).zip(gs);
                    for ((((xh, gh), &x), &g), ((&w, dw), db)) in row.zip(params) {
                        let h = (x - mean) * rstd;
                        *xh = h;
                        *gh = g * w;
                        *dw += g * h;
                        *db += g;
                    }
                    let mean_gh = if remove_mean {
                        sum16(&gh, |v| v) / d as f32
                    } else {
                        0.0
                    };
                    let mean_ghxh = dot16(&gh, &xh) / d as f32;
                    for ((o, &gh), &xh) in dxs.iter_mut().zip(&gh).zip(&xh) {
                        o.write(T::from_f32((gh - mean_gh - xh * mean_ghxh) * rstd));
                    }
                }
                (dw, db)
            },
        )
    });
    let (mut dw, mut db) = (vec![0f32; d], vec![0f32; d]);
    for (pw, pb) in &partials {
        for (a, &v) in dw.iter_mut().zip(pw) {
            *a += v;
        }
        for (a, &v) in db.iter_mut().zip(pb) {
            *a += v;
        }
    }
    for (o, v) in params.iter_mut().zip(dw.into_iter().chain(db)) {
        o.write(T::from_f32(v));
    }
    let mut out = std::mem::ManuallyDrop::new(out);
    // SAFETY: every element was written above (the tiles cover `dx`, the last loop `dw` and
    // `db`); `MaybeUninit<T>` has `T`'s layout; the allocation is handed over whole.
    unsafe { Vec::from_raw_parts(out.as_mut_ptr() as *mut T, out.len(), out.capacity()) }
}

/// The forward custom op: `(x, weight)` (CustomOp2) or `(x, weight, bias)` (CustomOp3).
#[derive(Clone, Copy, Debug)]
struct NormOp {
    eps: f32,
    remove_mean: bool,
}

impl NormOp {
    fn cpu(
        &self,
        x: (&CpuStorage, &Layout),
        w: (&CpuStorage, &Layout),
        b: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: Elem + candle_core::WithDType>(
            op: &NormOp,
            x: (&CpuStorage, &Layout),
            w: (&CpuStorage, &Layout),
            b: Option<(&CpuStorage, &Layout)>,
        ) -> Result<(CpuStorage, Shape)> {
            let xs = contiguous(x.0.as_slice::<T>()?, x.1, "input")?;
            let ws = contiguous(w.0.as_slice::<T>()?, w.1, "weight")?;
            let bs = match b {
                Some((s, l)) => Some(contiguous(s.as_slice::<T>()?, l, "bias")?),
                None => None,
            };
            let y = norm_fwd(xs, ws, bs, op.eps, op.remove_mean);
            Ok((T::to_cpu_storage_owned(y), x.1.shape().clone()))
        }
        match x.0.dtype() {
            DType::F32 => run::<f32>(self, x, w, b),
            DType::BF16 => run::<half::bf16>(self, x, w, b),
            DType::F16 => run::<half::f16>(self, x, w, b),
            dt => bail!("norm: no CPU kernel for {dt:?}"),
        }
    }

    /// `(dx, dw, db)` for the output gradient `g`, through the backward kernel.
    fn grads(&self, x: &Tensor, w: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let d = w.dim(0)?;
        let n = x.elem_count();
        let g = g.contiguous()?;
        let op = NormBwdOp {
            eps: self.eps,
            remove_mean: self.remove_mean,
        };
        let all = x.apply_op3_no_bwd(w, &g, &op)?;
        let dx = all.narrow(0, 0, n)?.reshape(x.shape())?;
        let dw = all.narrow(0, n, d)?;
        let db = all.narrow(0, n + d, d)?;
        Ok((dx, dw, db))
    }
}

impl CustomOp2 for NormOp {
    fn name(&self) -> &'static str {
        "norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu((s1, l1), (s2, l2), None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = self.grads(x, w, g)?;
        Ok((Some(dx), Some(dw)))
    }
}

impl CustomOp3 for NormOp {
    fn name(&self) -> &'static str {
        "norm-bias"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu((s1, l1), (s2, l2), Some((s3, l3)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = self.grads(x, w, g)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// The backward kernel as a (no-backward) custom op on `(x, weight, grad_out)`: a flat tensor
/// holding `dx`, `dw` and `db` one after the other.
#[derive(Clone, Copy, Debug)]
struct NormBwdOp {
    eps: f32,
    remove_mean: bool,
}

impl CustomOp3 for NormBwdOp {
    fn name(&self) -> &'static str {
        "norm-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: Elem + candle_core::WithDType>(
            op: &NormBwdOp,
            x: (&CpuStorage, &Layout),
            w: (&CpuStorage, &Layout),
            g: (&CpuStorage, &Layout),
        ) -> Result<(CpuStorage, Shape)> {
            let xs = contiguous(x.0.as_slice::<T>()?, x.1, "input")?;
            let ws = contiguous(w.0.as_slice::<T>()?, w.1, "weight")?;
            let gs = contiguous(g.0.as_slice::<T>()?, g.1, "output gradient")?;
            let out = norm_bwd(xs, ws, gs, op.eps, op.remove_mean);
            let len = out.len();
            Ok((T::to_cpu_storage_owned(out), Shape::from(len)))
        }
        match s1.dtype() {
            DType::F32 => run::<f32>(self, (s1, l1), (s2, l2), (s3, l3)),
            DType::BF16 => run::<half::bf16>(self, (s1, l1), (s2, l2), (s3, l3)),
            DType::F16 => run::<half::f16>(self, (s1, l1), (s2, l2), (s3, l3)),
            dt => bail!("norm-bwd: no CPU kernel for {dt:?}"),
        }
    }
}
