//! GELU with the tanh approximation as one graph node with a hand-written, vectorised and
//! multi-threaded CPU kernel for its forward and its backward.

use candle_core::{
    backend::BackendStorage, bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape,
    Tensor,
};

use crate::cpu::{contiguous, exp_fast, filled, with_simd, Elem};

/// Elements per task of the kernels: 64 Ki f32 are 256 KiB, an L2-sized piece.
const CHUNK: usize = 1 << 16;

/// GELU with the tanh approximation (GPT-2's, Hendrycks & Gimpel 2016, arXiv:1606.08415),
/// `x ↦ x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))`, elementwise, any shape and layout: the
/// values of [`Tensor::gelu`] (= [`gelu_composed`]), faster.
///
/// On the CPU, for f32, bf16 and f16 (computed in f32, rounded once), the forward is one pass
/// and its backward a second one, `dx = g · (½(1 + t) + ½x(1 − t²)·√(2/π)(1 + 3·0.044715x²))`
/// with `t` the tanh above; `tanh(u)` is `1 − 2/(1 + e^{2u})` with a vectorised exponential
/// (`crate::cpu::exp_fast`), and the work is split over the rank's threads (see the
/// [module documentation](super)). Candle's own `gelu` calls libm's `tanhf` per element on one
/// thread and composes a dozen tensor ops, `powf` included, in its backward. Elsewhere it is
/// [`Tensor::gelu`]. The kernel's backward is not itself differentiable.
///
/// Errors: Candle's.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    let fused = x.device().is_cpu()
        && matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && x.elem_count() > 0;
    if fused {
        x.contiguous()?.apply_op1(GeluOp)
    } else {
        gelu_composed(x)
    }
}

/// [`gelu`] as Candle computes it ([`Tensor::gelu`]): any dtype and device, differentiable to
/// any order.
///
/// Errors: Candle's.
pub fn gelu_composed(x: &Tensor) -> Result<Tensor> {
    x.gelu()
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_C: f32 = 0.044_715;

/// `tanh(u)` as `1 − 2 / (1 + e^{2u})`: ±1 at the extremes, absolute error a few f32 ulps.
#[inline(always)]
fn tanh_fast(u: f32) -> f32 {
    1.0 - 2.0 / (1.0 + exp_fast(2.0 * u))
}

/// GELU, tanh approximation: `x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))`.
#[inline(always)]
pub fn gelu_f32(x: f32) -> f32 {
    let t = tanh_fast(SQRT_2_OVER_PI * (x + GELU_C * x * x * x));
    0.5 * x * (1.0 + t)
}

/// d gelu / dx = (1 + t)/2 + x/2 · (1 − t²) · √(2/π) · (1 + 3 · 0.044715 x²).
#[inline(always)]
pub fn gelu_grad_f32(x: f32) -> f32 {
    let t = tanh_fast(SQRT_2_OVER_PI * (x + GELU_C * x * x * x));
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x * x)
}

pub(super) fn gelu_fwd<T: Elem>(x: &[T]) -> Vec<T> {
    // SAFETY: each chunk's every element is written (zip over the chunk and its input).
    unsafe {
        filled(x.len(), CHUNK, |i, out| {
            let x = &x[i * CHUNK..i * CHUNK + out.len()];
            with_simd(
                #[inline(always)]
                || {
                    for (o, &v) in out.iter_mut().zip(x) {
                        o.write(T::from_f32(gelu_f32(v.to_f32())));
                    }
                },
            )
        })
    }
}

pub(super) fn gelu_bwd<T: Elem>(x: &[T], g: &[T]) -> Vec<T> {
    // SAFETY: as in `gelu_fwd`.
    unsafe {
        filled(x.len(), CHUNK, |i, out| {
            let r = i * CHUNK..i * CHUNK + out.len();
            let (x, g) = (&x[r.clone()], &g[r]);
            with_simd(
                #[inline(always)]
                || {
                    for ((o, &x), &g) in out.iter_mut().zip(x).zip(g) {
                        o.write(T::from_f32(g.to_f32() * gelu_grad_f32(x.to_f32())));
                    }
                },
            )
        })
    }
}

/// The forward custom op of [`gelu`]; its backward is [`GeluGradOp`].
struct GeluOp;

impl CustomOp1 for GeluOp {
    fn name(&self) -> &'static str {
        "gelu-tanh-fused"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = match s.dtype() {
            DType::F32 => CpuStorage::F32(gelu_fwd(contiguous(s.as_slice::<f32>()?, l, "input")?)),
            DType::BF16 => CpuStorage::BF16(gelu_fwd(contiguous(
                s.as_slice::<half::bf16>()?,
                l,
                "input",
            )?)),
            DType::F16 => CpuStorage::F16(gelu_fwd(contiguous(
                s.as_slice::<half::f16>()?,
                l,
                "input",
            )?)),
            dt => bail!("gelu: no CPU kernel for {dt:?}"),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(
            arg.apply_op2_no_bwd(&grad_res.contiguous()?, &GeluGradOp)?,
        ))
    }
}

/// The backward kernel of [`gelu`] as a (no-backward) custom op on `(x, grad_y)`.
struct GeluGradOp;

impl CustomOp2 for GeluGradOp {
    fn name(&self) -> &'static str {
        "gelu-tanh-fused-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if l1.shape() != l2.shape() || s1.dtype() != s2.dtype() {
            bail!(
                "gelu backward: input {:?} {:?} and gradient {:?} {:?} differ",
                l1.shape(),
                s1.dtype(),
                l2.shape(),
                s2.dtype()
            );
        }
        fn run<T: Elem + candle_core::WithDType>(
            x: (&CpuStorage, &Layout),
            g: (&CpuStorage, &Layout),
        ) -> Result<CpuStorage> {
            let xs = contiguous(x.0.as_slice::<T>()?, x.1, "input")?;
            let gs = contiguous(g.0.as_slice::<T>()?, g.1, "output gradient")?;
            Ok(T::to_cpu_storage_owned(gelu_bwd(xs, gs)))
        }
        let out = match s1.dtype() {
            DType::F32 => run::<f32>((s1, l1), (s2, l2))?,
            DType::BF16 => run::<half::bf16>((s1, l1), (s2, l2))?,
            DType::F16 => run::<half::f16>((s1, l1), (s2, l2))?,
            dt => bail!("gelu backward: no CPU kernel for {dt:?}"),
        };
        Ok((out, l1.shape().clone()))
    }
}
