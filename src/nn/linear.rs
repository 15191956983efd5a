//! A linear layer as one graph node: one gemm forward into a buffer holding the bias (no
//! zero-fill, no separate bias pass), one backward node of one gemm for each of `dx` and
//! `dweight` and a vectorised row sweep for `dbias`.

use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Module, Result, Shape,
    Tensor, D,
};

use crate::cpu::{contiguous, filled, gemm_f32, with_simd};

/// `y = x · weightᵀ + bias` over the last dimension of `x`, differentiable in `x`, `weight` and
/// `bias`: [`candle_nn::Linear`]'s forward as one graph node.
///
/// Shapes: `x` `(…, in)` of any rank ≥ 1 and layout, `weight` `(out, in)`, `bias` `(out,)`;
/// output `(…, out)`, contiguous. With `N` the number of rows of `x` (the product of its
/// leading dimensions), the CPU f32 path is one `(N, in) × (in, out)` gemm (the `gemm` crate,
/// called directly: the weight read through its strides, transposed without a copy) into an
/// output buffer that already holds the bias in every row (`y = bias + x·Wᵀ`, no zero-filled
/// output, no second pass for the bias); its backward is one node computing three pieces:
/// `dx = g · weight` (one gemm), `dweight = gᵀ · x` (one gemm of inner size `N`, where a
/// batched matmul would run one per batch element and sum them) and `dbias = Σ_rows g` (a
/// vectorised row sweep, where Candle's broadcast backward runs a strided reduction). The
/// gemms split over the rank's threads as Candle's matmul does (see the
/// [module documentation](super)). Candle's autograd then sees one node instead of the
/// reshape, matmul, reshape and broadcast-add of `candle_nn::Linear` (each of which costs a
/// zero-filled accumulator and an addition in Candle's backward).
///
/// Dtypes: all three of one dtype. Other dtypes than f32 and other devices run
/// `candle_nn::Linear::forward`, the same values up to rounding.
///
/// Gradients: the backward computes the gradient of an operand only when it tracks (a
/// variable, or a tensor computed from one): a plain input (a first layer's data) gets none,
/// nor does a frozen weight, and their gemms are skipped. Candle keeps gradients only for
/// tracking tensors anyway; `candle_nn::Linear`'s composed backward also returned (unused) ones
/// for the others.
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

/// candle-nn's [`candle_nn::Linear`] whose forward is [`linear_forward`] (one graph node):
/// the same parameters (`weight` `(out, in)`, `bias` `(out,)`), the same values up to rounding.
/// Inside an FSDP unit, [`crate::fsdp::fused::Linear`] is the same layer whose parameters'
/// gradients bypass Candle's graph, so the runtime need not copy its parameters each step.
#[derive(Clone, Debug)]
pub struct Linear(candle_nn::Linear);

impl Linear {
    /// A layer of the given weight `(out, in)` and optional bias `(out,)`.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self(candle_nn::Linear::new(weight, bias))
    }

    /// The weight, `(out, in)`.
    pub fn weight(&self) -> &Tensor {
        self.0.weight()
    }

    /// The bias, `(out,)`, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.0.bias()
    }
}

impl From<candle_nn::Linear> for Linear {
    fn from(l: candle_nn::Linear) -> Self {
        Self(l)
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        linear_forward(x, self.0.weight(), self.0.bias())
    }
}

/// A [`Linear`] of `in_dim → out_dim` with a bias, parameters from `vb`: candle-nn's
/// [`candle_nn::linear()`] (same names, same init), with the one-node forward.
///
/// Errors: Candle's (a parameter of another shape in `vb`).
pub fn linear(in_dim: usize, out_dim: usize, vb: candle_nn::VarBuilder) -> Result<Linear> {
    Ok(Linear(candle_nn::linear(in_dim, out_dim, vb)?))
}

/// A [`Linear`] of `in_dim → out_dim` whose weight `(out, in)` is drawn from N(0, `std`) and
/// whose bias `(out,)`, when `bias`, starts at 0 (GPT-2's and transformers' initialisation of
/// transformer projections); parameters `weight`, `bias` from `vb`.
///
/// Errors: Candle's (a parameter of another shape in `vb`).
pub fn linear_normal(
    in_dim: usize,
    out_dim: usize,
    std: f64,
    bias: bool,
    vb: candle_nn::VarBuilder,
) -> Result<Linear> {
    let w = vb.get_with_hints(
        (out_dim, in_dim),
        "weight",
        candle_nn::Init::Randn {
            mean: 0.0,
            stdev: std,
        },
    )?;
    let b = if bias {
        Some(vb.get_with_hints(out_dim, "bias", candle_nn::Init::Const(0.0))?)
    } else {
        None
    };
    Ok(Linear::new(w, b))
}

/// `gelu(x · weightᵀ + bias)`: [`linear_forward`] followed by [`super::gelu`] (tanh
/// approximation) as one graph node, the first half of a transformer MLP.
///
/// On the CPU in f32 the forward writes the pre-activation `h` once (the linear layer's gemm
/// into a buffer holding the bias) and `y = gelu(h)` once; the op keeps `h` for its backward
/// (the composed pair keeps it too, as the GELU node's input), which computes `dh = g ⊙
/// gelu'(h)` in one vectorised pass and then the linear layer's three gradients from `dh`. Against
/// the composed pair this saves the GELU node's zero-filled gradient accumulator and the
/// addition into it (two passes over `h`'s size per step). Shapes and errors as
/// [`linear_forward`]; other dtypes and devices compose [`linear_forward`] and [`super::gelu`].
pub fn linear_gelu(x: &Tensor, weight: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let kernel = x.device().is_cpu()
        && x.dtype() == DType::F32
        && weight.dtype() == DType::F32
        && bias.dtype() == DType::F32
        && x.elem_count() > 0
        && weight.elem_count() > 0;
    let (out, inp) = weight.dims2()?;
    if !kernel || x.dim(D::Minus1)? != inp || bias.dims() != [out] {
        return super::gelu(&linear_forward(x, weight, Some(bias))?);
    }
    x.contiguous()?.apply_op3(
        weight,
        &bias.contiguous()?,
        LinearGeluOp {
            pre: std::sync::Mutex::new(None),
        },
    )
}

/// The forward of [`linear_gelu`]; `pre` holds the pre-activation `h` (`(N, out)`, f32) from
/// the forward for the backward.
struct LinearGeluOp {
    pre: std::sync::Mutex<Option<Vec<f32>>>,
}

impl CustomOp3 for LinearGeluOp {
    fn name(&self) -> &'static str {
        "linear-gelu"
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
        let (h, shape) = linear_cpu((s1, l1), (s2, l2), Some((s3, l3)))?;
        let CpuStorage::F32(h) = h else {
            bail!("linear-gelu: the pre-activation is not f32")
        };
        let y = super::activation::gelu_fwd(&h);
        *self.pre.lock().map_err(|_| poisoned())? = Some(h);
        Ok((CpuStorage::F32(y), shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let pre = self.pre.lock().map_err(|_| poisoned())?;
        let Some(h) = pre.as_ref() else {
            bail!("linear-gelu backward: the forward's pre-activation is missing")
        };
        // dh = g ⊙ gelu'(h), read straight from the gradient's storage.
        let dh = g.contiguous()?.apply_op1_no_bwd(&GeluGradOfPre(h))?;
        let want = [x.track_op(), w.track_op(), b.track_op()];
        linear_grads(x, w, &dh, want)
    }
}

fn poisoned() -> candle_core::Error {
    candle_core::Error::Msg("linear-gelu: a panic poisoned the pre-activation's lock".into())
}

/// `g ↦ g ⊙ gelu'(h)` for the pre-activation `h` of a [`linear_gelu`] forward (f32, no
/// backward): [`super::gelu`]'s backward kernel.
struct GeluGradOfPre<'a>(&'a [f32]);

impl CustomOp1 for GeluGradOfPre<'_> {
    fn name(&self) -> &'static str {
        "linear-gelu-bwd"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = contiguous(s.as_slice::<f32>()?, l, "output gradient")?;
        if g.len() != self.0.len() {
            bail!(
                "linear-gelu backward: gradient of {} elements for an output of {}",
                g.len(),
                self.0.len()
            )
        }
        let dh = super::activation::gelu_bwd(self.0, g);
        Ok((CpuStorage::F32(dh), l.shape().clone()))
    }
}

/// The forward of [`linear_forward`] (CustomOp2 without a bias, CustomOp3 with one).
#[derive(Clone, Copy, Debug)]
struct LinearOp;

/// An f32 matrix operand: its storage from the layout's start, and `(rows, cols, row stride,
/// column stride)`.
struct Mat<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

impl<'a> Mat<'a> {
    /// A rank-2 view `(r, c)` of `s` through `l`'s strides (the last two dimensions).
    fn of(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<Self> {
        let st = l.stride();
        if st.len() != 2 {
            bail!("linear: the {what} must be rank 2, found {:?}", l.shape())
        }
        let data = &s.as_slice::<f32>()?[l.start_offset()..];
        let (r, c) = l.shape().dims2()?;
        let past =
            || super::kernels::last_offset(r, st[0], c, st[1]).is_none_or(|l| l >= data.len());
        if r > 0 && c > 0 && past() {
            bail!("linear: the {what}'s layout {l:?} reaches past its storage")
        }
        Ok(Self {
            data,
            rs: st[0],
            cs: st[1],
        })
    }
    /// The transposed view (no copy).
    fn t(&self) -> (&'a [f32], usize, usize) {
        (self.data, self.cs, self.rs)
    }
    fn view(&self) -> (&'a [f32], usize, usize) {
        (self.data, self.rs, self.cs)
    }
}

/// [`linear_forward`]'s CPU f32 forward kernel: `y = [bias +] x · weightᵀ` from the operands'
/// storages and layouts (`x` `(…, in)` any layout, `weight` `(out, in)` any strides, `bias`
/// `(out,)`), a fresh contiguous `(…, out)` output; for fused nodes that hold their parameters
/// outside Candle's graph (`crate::fsdp::fused::Linear`).
///
/// Errors: shapes that do not fit, a layout past its storage, a dtype other than f32.
pub(crate) fn linear_cpu(
    x: (&CpuStorage, &Layout),
    w: (&CpuStorage, &Layout),
    b: Option<(&CpuStorage, &Layout)>,
) -> Result<(CpuStorage, Shape)> {
    let (out, inp) = w.1.shape().dims2()?;
    if inp == 0 || x.1.dims().last() != Some(&inp) || b.is_some_and(|b| b.1.dims() != [out]) {
        bail!(
            "linear: input {:?}, weight {:?}, bias {:?} do not fit",
            x.1.shape(),
            w.1.shape(),
            b.map(|b| b.1.shape().clone())
        )
    }
    let n = x.1.shape().elem_count() / inp;
    let xs = contiguous(x.0.as_slice::<f32>()?, x.1, "input")?;
    let wm = Mat::of(w.0, w.1, "weight")?;
    let bias = match b {
        Some((bs, bl)) => Some(contiguous(bs.as_slice::<f32>()?, bl, "bias")?),
        None => None,
    };
    // y = [bias +] x · wᵀ, written once: the bias rows first (when there is one), then
    // the gemm reading them.
    let mut y: Vec<f32> = match bias {
        // SAFETY: the closure writes every element of each whole-row chunk.
        Some(bias) => unsafe {
            filled(n * out, 64 * out, |_, rows| {
                for row in rows.chunks_exact_mut(out) {
                    for (y, &b) in row.iter_mut().zip(bias) {
                        y.write(b);
                    }
                }
            })
        },
        None => Vec::with_capacity(n * out),
    };
    let accumulate = bias.is_some();
    // SAFETY: `xs` is the contiguous `(n, inp)` input, `wm` a checked `(out, inp)` view,
    // `y` has capacity `n · out` (initialised when `accumulate`: then it is read).
    unsafe {
        gemm_f32(
            (n, out, inp),
            y.as_mut_ptr(),
            out,
            accumulate,
            (xs, inp, 1),
            wm.t(),
            true,
        );
        if !accumulate {
            // Every element was written by the gemm (no read of the destination).
            y.set_len(n * out);
        }
    }
    let mut dims = x.1.dims().to_vec();
    *dims.last_mut().expect("rank ≥ 1") = out;
    Ok((CpuStorage::F32(y), Shape::from(dims)))
}

/// [`linear_forward`]'s backward: `(dx, dweight, dbias)` for the output gradient `g`, each
/// computed only when `want` (`[dx, dweight, dbias]`) asks for it (CPU, f32), by one
/// backward node ([`LinearBwdOp`]) whose flat result holds the wanted ones one after the
/// other. A gradient nobody keeps is not computed: the input's of a first layer (its input
/// carries no gradient: one gemm of the forward's size saved), a frozen weight's (LoRA's base).
///
/// Errors: shapes that do not fit; Candle's.
pub(crate) fn linear_grads(
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
    want: [bool; 3],
) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    let (out, inp) = w.dims2()?;
    let n = x.elem_count() / inp;
    if !want.contains(&true) {
        return Ok((None, None, None));
    }
    let g = g.contiguous()?;
    let all = x.apply_op3_no_bwd(w, &g, &LinearBwdOp { want })?;
    let mut at = 0;
    let mut take = |wanted: bool, len: usize| -> Result<Option<Tensor>> {
        if !wanted {
            return Ok(None);
        }
        let t = all.narrow(0, at, len)?;
        at += len;
        Ok(Some(t))
    };
    let dx = take(want[0], n * inp)?
        .map(|t| t.reshape(x.shape()))
        .transpose()?;
    let dw = take(want[1], out * inp)?
        .map(|t| t.reshape((out, inp)))
        .transpose()?;
    let db = take(want[2], out)?;
    Ok((dx, dw, db))
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
        linear_cpu((s1, l1), (s2, l2), None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = linear_grads(x, w, g, [x.track_op(), w.track_op(), false])?;
        Ok((dx, dw))
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
        linear_cpu((s1, l1), (s2, l2), Some((s3, l3)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        linear_grads(x, w, g, [x.track_op(), w.track_op(), b.track_op()])
    }
}

/// The backward kernel of [`linear_forward`] as a (no-backward) custom op on `(x, weight,
/// grad_y)`: one flat f32 buffer holding those of `dx` (`N · in`), `dweight` (`out · in`) and
/// `dbias` (`out`) that `want` asks for, in that order, each written once by its gemm or sweep.
#[derive(Clone, Copy, Debug)]
struct LinearBwdOp {
    want: [bool; 3],
}

impl CustomOp3 for LinearBwdOp {
    fn name(&self) -> &'static str {
        "linear-bwd"
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
        let (out, inp) = l2.shape().dims2()?;
        let n = l1.shape().elem_count() / inp;
        if l3.shape().elem_count() != n * out {
            bail!(
                "linear backward: gradient {:?} does not fit input {:?} and weight {:?}",
                l3.shape(),
                l1.shape(),
                l2.shape()
            )
        }
        let xs = contiguous(s1.as_slice::<f32>()?, l1, "input")?;
        let wm = Mat::of(s2, l2, "weight")?;
        let g = contiguous(s3.as_slice::<f32>()?, l3, "output gradient")?;
        let [want_dx, want_dw, want_db] = self.want;
        let lens = [n * inp, out * inp, out];
        let total: usize = lens
            .iter()
            .zip(self.want)
            .filter(|(_, w)| *w)
            .map(|(l, _)| l)
            .sum();
        let mut all: Vec<f32> = Vec::with_capacity(total);
        let base = all.as_mut_ptr();
        // SAFETY: the wanted destinations are disjoint consecutive ranges of `all`'s capacity
        // `total` (dx, then dweight, then dbias, each of its length in `lens`); every operand is
        // a contiguous or checked view of its full shape; no destination is read (no
        // accumulation) and each element is written once, so the length is set after.
        unsafe {
            let mut at = base;
            if want_dx {
                // dx (n × inp) = g (n × out) · w (out × inp)
                gemm_f32((n, inp, out), at, inp, false, (g, out, 1), wm.view(), true);
                at = at.add(lens[0]);
            }
            if want_dw {
                // dw (out × inp) = gᵀ (out × n) · x (n × inp)
                gemm_f32(
                    (out, inp, n),
                    at,
                    inp,
                    false,
                    (g, 1, out),
                    (xs, inp, 1),
                    true,
                );
                at = at.add(lens[1]);
            }
            if want_db {
                // db = Σ_rows g
                std::ptr::write_bytes(at, 0, out);
                let db = std::slice::from_raw_parts_mut(at, out);
                with_simd(
                    #[inline(always)]
                    || {
                        for row in g.chunks_exact(out) {
                            for (a, &v) in db.iter_mut().zip(row) {
                                *a += v;
                            }
                        }
                    },
                );
            }
            all.set_len(total);
        }
        Ok((CpuStorage::F32(all), Shape::from(total)))
    }
}
