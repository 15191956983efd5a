//! A linear layer as one graph node: one gemm forward with the bias added in place, a backward
//! of one gemm for each of `dx` and `dweight` and a row sweep for `dbias`.

use candle_core::{
    backend::BackendStorage, bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout,
    Module, Result, Shape, Tensor, D,
};

use super::cpu::contiguous;

/// `y = x · weightᵀ + bias` over the last dimension of `x`, differentiable in `x`, `weight` and
/// `bias`: [`candle_nn::Linear`]'s forward as one graph node.
///
/// Shapes: `x` `(…, in)` of any rank ≥ 1 and layout, `weight` `(out, in)`, `bias` `(out,)`;
/// output `(…, out)`, contiguous. With `N` the number of rows of `x` (the product of its
/// leading dimensions), the CPU f32 path is one `(N, in) × (in, out)` gemm with the bias added
/// in place, and its backward three pieces: `dx = g · weight` (one gemm), `dweight = gᵀ · x`
/// (one gemm of inner size `N`, where a batched matmul would run one per batch element and
/// sum them) and `dbias = Σ_rows g` (a row sweep on the calling thread, where Candle's
/// broadcast backward runs a strided reduction). Candle's autograd then sees one node
/// instead of the reshape, matmul, reshape and broadcast-add of `candle_nn::Linear` (each of
/// which costs a zero-filled accumulator and an addition in Candle's backward).
///
/// Dtypes: all three of one dtype. Other dtypes than f32 and other devices run
/// `candle_nn::Linear::forward`, the same values up to rounding.
///
/// Errors: mismatched shapes or dtypes; Candle's.
pub fn linear_forward(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (out, inp) = weight.dims2()?;
    let x_in = x.dim(D::Minus1)?;
    if x_in != inp || bias.is_some_and(|b| b.dims() != [out]) {
        bail!(
            "linear: input {:?}, weight {:?}, bias {:?} do not fit",
            x.shape(),
            weight.shape(),
            bias.map(|b| b.shape().clone())
        )
    }
    let kernel = x.device().is_cpu()
        && x.dtype() == DType::F32
        && weight.dtype() == DType::F32
        && bias.is_none_or(|b| b.dtype() == DType::F32)
        && x.elem_count() > 0
        && out > 0;
    if !kernel {
        return Module::forward(&candle_nn::Linear::new(weight.clone(), bias.cloned()), x);
    }
    let x = x.contiguous()?;
    match bias {
        Some(b) => x.apply_op3(weight, &b.contiguous()?, LinearOp),
        None => x.apply_op2(weight, LinearOp),
    }
}

/// The forward of [`linear_forward`] (CustomOp2 without a bias, CustomOp3 with one).
#[derive(Clone, Copy, Debug)]
struct LinearOp;

impl LinearOp {
    fn cpu(
        x: (&CpuStorage, &Layout),
        w: (&CpuStorage, &Layout),
        b: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        let (out, inp) = w.1.shape().dims2()?;
        let n = x.1.shape().elem_count() / inp;
        if !x.1.is_contiguous() {
            bail!("linear: the input has to be contiguous")
        }
        let lhs = Layout::contiguous_with_offset((n, inp), x.1.start_offset());
        let rhs = w.1.transpose(0, 1)?; // (in, out)
        let mut y = x.0.matmul(w.0, (1, n, out, inp), &lhs, &rhs)?;
        if let Some((bs, bl)) = b {
            let bias = contiguous(bs.as_slice::<f32>()?, bl, "bias")?;
            match &mut y {
                CpuStorage::F32(v) => {
                    for row in v.chunks_exact_mut(out) {
                        for (y, &b) in row.iter_mut().zip(bias) {
                            *y += b;
                        }
                    }
                }
                _ => bail!("linear: no CPU kernel for {:?}", y.dtype()),
            }
        }
        let mut dims = x.1.dims().to_vec();
        *dims.last_mut().expect("rank ≥ 1") = out;
        Ok((y, Shape::from(dims)))
    }

    /// `(dx, dweight, dbias)` for the output gradient `g`.
    fn grads(x: &Tensor, w: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (out, inp) = w.dims2()?;
        let n = x.elem_count() / inp;
        let g = g.contiguous()?.reshape((n, out))?;
        let x2 = x.reshape((n, inp))?;
        let dx = g.matmul(w)?.reshape(x.shape())?;
        let dw = g.t()?.matmul(&x2)?;
        let db = g.apply_op1_no_bwd(&ColumnSumOp)?;
        Ok((dx, dw, db))
    }
}

impl CustomOp2 for LinearOp {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Self::cpu((s1, l1), (s2, l2), None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = Self::grads(x, w, g)?;
        Ok((Some(dx), Some(dw)))
    }
}

impl CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        "linear-bias"
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
        Self::cpu((s1, l1), (s2, l2), Some((s3, l3)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = Self::grads(x, w, g)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// Column sums of a contiguous f32 `(N, C)` matrix: `(C,)` (no backward).
#[derive(Clone, Copy, Debug)]
struct ColumnSumOp;

impl CustomOp1 for ColumnSumOp {
    fn name(&self) -> &'static str {
        "column-sum"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, c) = l.shape().dims2()?;
        let g = contiguous(s.as_slice::<f32>()?, l, "gradient")?;
        let mut acc = vec![0f32; c];
        for row in g.chunks_exact(c) {
            for (a, &v) in acc.iter_mut().zip(row) {
                *a += v;
            }
        }
        Ok((CpuStorage::F32(acc), Shape::from(c)))
    }
}
