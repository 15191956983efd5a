//! The causal softmax of attention scores, as one graph node with a hand-written CPU kernel.

use candle_core::{
    backend::BackendStorage, bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape,
    Tensor, D,
};

use crate::cpu::{contiguous, dot16, max16, sum16, Elem};

/// The causal softmax of attention scores, differentiable: for scores `s` of shape `(…, T, T)`
/// (queries along the second-to-last dimension, keys along the last), row `i` of each `T × T`
/// matrix becomes
///
/// ```text
///     y_ij = exp(scale · s_ij) / Σ_{k ≤ i} exp(scale · s_ik)    for j ≤ i
///     y_ij = 0                                                  for j > i
/// ```
///
/// query `i` attending to keys `j ≤ i` only: the values of
/// `candle_nn::ops::softmax(scale · s + mask, D::Minus1)` with `mask` 0 on and below the
/// diagonal and −∞ above it, in one op instead of four (and a backward of one op instead of a
/// dozen). With `g` the output's gradient, the input's gradient is, per row,
///
/// ```text
///     dx_ij = scale · y_ij · (g_ij − Σ_k g_ik · y_ik)
/// ```
///
/// Shapes: input of rank ≥ 2 whose last two dimensions are equal (`T_q == T_k`), any layout;
/// output of the input's shape and dtype, contiguous. Dtypes: on the CPU, f32, bf16 and f16
/// run a hand-written kernel (one pass per row, the maximum, exponentials and sum in f32,
/// half-precision outputs rounded once) whose backward is a second kernel (not itself
/// differentiable: no second derivatives on that path). They run on the calling thread. Other dtypes (f64) and devices, and empty
/// inputs, compose the masked softmax of Candle ops ([`causal_softmax_composed`]), with the
/// same values up to rounding.
///
/// Errors: a rank below 2 or a non-square last pair of dimensions; Candle's.
pub fn causal_softmax(scores: &Tensor, scale: f64) -> Result<Tensor> {
    check_causal_scores(scores)?;
    let kernel = scores.device().is_cpu()
        && matches!(scores.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && scores.elem_count() > 0;
    if !kernel {
        return causal_softmax_composed(scores, scale);
    }
    scores.contiguous()?.apply_op1(CausalSoftmaxOp {
        scale: scale as f32,
    })
}

/// [`causal_softmax`] composed of differentiable Candle ops: `scale · s`, plus a `(T, T)` mask
/// (0 where key ≤ query, −∞ above the diagonal) in the scores' dtype, then
/// `candle_nn::ops::softmax` over the last dimension. Candle's autograd differentiates it, to
/// any order. Same shapes as [`causal_softmax`], any dtype and device.
///
/// Errors: a rank below 2 or a non-square last pair of dimensions; Candle's.
pub fn causal_softmax_composed(scores: &Tensor, scale: f64) -> Result<Tensor> {
    check_causal_scores(scores)?;
    let t = scores.dim(D::Minus1)?;
    let mask: Vec<f32> = (0..t)
        .flat_map(|q| (0..t).map(move |k| if k <= q { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), scores.device())?.to_dtype(scores.dtype())?;
    candle_nn::ops::softmax(&(scores * scale)?.broadcast_add(&mask)?, D::Minus1)
}

/// Rank ≥ 2 and `T_q == T_k`.
fn check_causal_scores(scores: &Tensor) -> Result<()> {
    let dims = scores.dims();
    if dims.len() < 2 || dims[dims.len() - 1] != dims[dims.len() - 2] {
        bail!(
            "causal_softmax: scores must be (…, T, T), found {:?}",
            scores.shape()
        )
    }
    Ok(())
}

/// `max a_i` with 16 independent lanes (vectorisable, as [`sum16`]); −∞ for an empty slice.
#[inline(always)]
/// The forward of [`causal_softmax`] on the CPU over contiguous `(…, T, T)` data.
fn causal_softmax_fwd<T: Elem>(x: &[T], t: usize, scale: f32) -> Vec<T> {
    let zero = T::from_f32(0.0);
    let mut y = Vec::with_capacity(x.len());
    let (mut buf, mut e) = (vec![0f32; t], vec![0f32; t]);
    for (r, row) in x.chunks_exact(t).enumerate() {
        let n = r % t + 1; // keys 0..=i
        let row = T::load(&row[..n], &mut buf[..n]);
        let e = &mut e[..n];
        for (e, &v) in e.iter_mut().zip(row) {
            *e = scale * v;
        }
        let m = max16(e);
        for v in e.iter_mut() {
            *v = (*v - m).exp();
        }
        let inv = sum16(e, |v| v).recip();
        y.extend(e.iter().map(|&v| T::from_f32(v * inv)));
        y.extend(std::iter::repeat_n(zero, t - n));
    }
    y
}

/// The backward of [`causal_softmax`] on the CPU: `dx` for the output `y` and its gradient `g`,
/// both contiguous `(…, T, T)`.
fn causal_softmax_bwd<T: Elem>(y: &[T], g: &[T], t: usize, scale: f32) -> Vec<T> {
    let zero = T::from_f32(0.0);
    let mut dx = Vec::with_capacity(y.len());
    let (mut y_buf, mut g_buf) = (vec![0f32; t], vec![0f32; t]);
    for (r, (ys, gs)) in y.chunks_exact(t).zip(g.chunks_exact(t)).enumerate() {
        let n = r % t + 1;
        let ys = T::load(&ys[..n], &mut y_buf[..n]);
        let gs = T::load(&gs[..n], &mut g_buf[..n]);
        let dot = dot16(ys, gs);
        dx.extend(
            ys.iter()
                .zip(gs)
                .map(|(&y, &g)| T::from_f32(scale * y * (g - dot))),
        );
        dx.extend(std::iter::repeat_n(zero, t - n));
    }
    dx
}

/// The forward custom op of [`causal_softmax`]; its backward is [`CausalSoftmaxBwdOp`].
#[derive(Clone, Copy, Debug)]
struct CausalSoftmaxOp {
    scale: f32,
}

impl CustomOp1 for CausalSoftmaxOp {
    fn name(&self) -> &'static str {
        "causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        fn run<T: Elem + candle_core::WithDType>(
            scale: f32,
            s: &CpuStorage,
            l: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            let xs = contiguous(s.as_slice::<T>()?, l, "scores")?;
            let t = l.dims()[l.dims().len() - 1];
            let y = causal_softmax_fwd(xs, t, scale);
            Ok((T::to_cpu_storage_owned(y), l.shape().clone()))
        }
        match s.dtype() {
            DType::F32 => run::<f32>(self.scale, s, l),
            DType::BF16 => run::<half::bf16>(self.scale, s, l),
            DType::F16 => run::<half::f16>(self.scale, s, l),
            dt => bail!("causal-softmax: no CPU kernel for {dt:?}"),
        }
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let op = CausalSoftmaxBwdOp { scale: self.scale };
        Ok(Some(res.apply_op2_no_bwd(&grad_res.contiguous()?, &op)?))
    }
}

/// The backward kernel of [`causal_softmax`] as a (no-backward) custom op on `(y, grad_y)`.
#[derive(Clone, Copy, Debug)]
struct CausalSoftmaxBwdOp {
    scale: f32,
}

impl CustomOp2 for CausalSoftmaxBwdOp {
    fn name(&self) -> &'static str {
        "causal-softmax-bwd"
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
                "causal-softmax backward: output {:?} {:?} and gradient {:?} {:?} differ",
                l1.shape(),
                s1.dtype(),
                l2.shape(),
                s2.dtype()
            );
        }
        fn run<T: Elem + candle_core::WithDType>(
            scale: f32,
            y: (&CpuStorage, &Layout),
            g: (&CpuStorage, &Layout),
        ) -> Result<(CpuStorage, Shape)> {
            let ys = contiguous(y.0.as_slice::<T>()?, y.1, "softmax output")?;
            let gs = contiguous(g.0.as_slice::<T>()?, g.1, "output gradient")?;
            let t = y.1.dims()[y.1.dims().len() - 1];
            let dx = causal_softmax_bwd(ys, gs, t, scale);
            Ok((T::to_cpu_storage_owned(dx), y.1.shape().clone()))
        }
        match s1.dtype() {
            DType::F32 => run::<f32>(self.scale, (s1, l1), (s2, l2)),
            DType::BF16 => run::<half::bf16>(self.scale, (s1, l1), (s2, l2)),
            DType::F16 => run::<half::f16>(self.scale, (s1, l1), (s2, l2)),
            dt => bail!("causal-softmax-bwd: no CPU kernel for {dt:?}"),
        }
    }
}
