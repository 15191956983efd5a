//! A linear layer as a fused node: under the runtime its weight's and bias's gradients go to
//! the sink instead of through Candle's graph, so a unit made of linear layers binds its
//! parameters as views of the gathered buffer (no copy-out at each unshard, no refill before
//! backward) and Candle's backward keeps no zero-filled accumulator for them.

use candle_core::{
    bail, CpuStorage, CustomOp2, DType, Device, Layout, Module, Result, Shape, Storage, Tensor,
    Var, D,
};

use crate::nn;

/// candle-nn's [`candle_nn::Linear`] (the same parameters: `weight` `(out, in)`, `bias`
/// `(out,)`) whose forward is [`linear_forward`]: [`crate::nn::Linear`]'s one-node kernels,
/// and inside a training call of the FSDP runtime a fused node whose parameters' gradients go
/// to the runtime's sink ([`super`]). The values and gradients are those of
/// [`crate::nn::Linear`], bit for bit; outside the runtime it is [`crate::nn::Linear`].
///
/// Two differences inside the runtime, both from the gradients going around Candle's graph:
/// where a parameter is read in one call by a composed op *and* by two or more fused layers,
/// the sum of its gradient's terms is taken in another order (last-bit differences); and an
/// empty batch gives every parameter a zero gradient (PyTorch's behaviour; Candle's composed
/// layer drops its bias from the graph there). Like every fused node ([`super`]), the unit must
/// read its parameters the same way in every step: a parameter that only fused layers read in
/// the first step is bound as a view, and a composed read of it added in a later step gets no
/// gradient, which the runtime cannot see (decision 66). A fused layer whose result the unit
/// drops is an error at the call's backward.
#[derive(Clone, Debug)]
pub struct Linear(nn::Linear);

impl Linear {
    /// A layer of the given weight `(out, in)` and optional bias `(out,)`.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self(nn::Linear::new(weight, bias))
    }
}

/// The parameters (`weight()`, `bias()`) are [`crate::nn::Linear`]'s.
impl std::ops::Deref for Linear {
    type Target = nn::Linear;

    fn deref(&self) -> &nn::Linear {
        &self.0
    }
}

impl From<nn::Linear> for Linear {
    fn from(l: nn::Linear) -> Self {
        Self(l)
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        linear_forward(x, self.0.weight(), self.0.bias())
    }
}

/// A [`Linear`] of `in_dim → out_dim` with a bias, parameters from `vb`: candle-nn's
/// [`candle_nn::linear()`] (same names, same init).
///
/// Errors: Candle's (a parameter of another shape in `vb`).
pub fn linear(in_dim: usize, out_dim: usize, vb: candle_nn::VarBuilder) -> Result<Linear> {
    Ok(Linear(nn::linear(in_dim, out_dim, vb)?))
}

/// A [`Linear`] of `in_dim → out_dim` without a bias, its weight from `vb`: candle-nn's
/// [`candle_nn::linear_no_bias()`] (same name, same init).
///
/// Errors: Candle's (a parameter of another shape in `vb`).
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: candle_nn::VarBuilder) -> Result<Linear> {
    let l = candle_nn::linear_no_bias(in_dim, out_dim, vb)?;
    Ok(Linear(nn::Linear::from(l)))
}

/// `y = x · weightᵀ + bias` over the last dimension of `x` (shapes, dtypes and errors as
/// [`crate::nn::linear_forward`]; an empty batch gives zero gradients, as a composed layer's). In a training call of the FSDP runtime that records autograd
/// ([`super::records`]), on the CPU in f32, when `weight` (and `bias`) are the call's own
/// parameter tensors ([`super::is_call_param`]), the layer is one fused node: it promises its
/// parameters, and its backward computes `dweight` and `dbias` only for trained parameters
/// ([`super::trains`]; a frozen base weight costs no gemm) and `dx` only when `x` carries
/// gradient, sending the parameters' to the sink. The node hangs from `x` and, when `x` carries
/// no gradient (a first layer), from a one-element variable of this thread, so that the
/// backward reaches it. Anywhere else: [`crate::nn::linear_forward`].
///
/// Errors: as [`crate::nn::linear_forward`].
pub fn linear_forward(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let f32_cpu = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32;
    let node = super::records()
        && f32_cpu(x)
        && f32_cpu(weight)
        && weight.rank() == 2
        && weight.elem_count() > 0
        && super::is_call_param(weight)
        && bias.is_none_or(|b| f32_cpu(b) && b.is_contiguous() && super::is_call_param(b))
        && x.dim(D::Minus1)? == weight.dim(1)?
        && bias.is_none_or(|b| b.dims() == [weight.dim(0).unwrap_or(0)]);
    if !node {
        return nn::linear_forward(x, weight, bias);
    }
    let trains = [super::trains(weight), bias.is_some_and(super::trains)];
    if !x.track_op() && !trains.contains(&true) {
        // Nothing to differentiate: the forward alone.
        return nn::linear_forward(x, weight, bias);
    }
    super::promise(std::iter::once(weight).chain(bias));
    let op = LinearNode {
        weight: weight.clone(),
        bias: bias.cloned(),
        trains,
    };
    x.contiguous()?.apply_op2(&anchor()?, op)
}

thread_local! {
    /// The one-element variable a [`LinearNode`] whose input carries no gradient hangs from.
    static ANCHOR: std::cell::OnceCell<Tensor> = const { std::cell::OnceCell::new() };
}

/// This thread's anchor variable (made on first use): one f32 zero on the CPU, never given a
/// gradient.
fn anchor() -> Result<Tensor> {
    ANCHOR.with(|a| {
        if let Some(t) = a.get() {
            return Ok(t.clone());
        }
        let t = Var::zeros(1, DType::F32, &Device::Cpu)?.into_inner();
        Ok(a.get_or_init(|| t).clone())
    })
}

/// The node of [`linear_forward`] under the runtime: a `CustomOp2` over `(x, anchor)` holding
/// the parameter tensors (read through their storages in the forward, sent their gradients in
/// the backward).
struct LinearNode {
    weight: Tensor,
    bias: Option<Tensor>,
    /// Whether the weight and the bias are trained (their gradients sent).
    trains: [bool; 2],
}

impl CustomOp2 for LinearNode {
    fn name(&self) -> &'static str {
        "fused-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if l1.shape().elem_count() == 0 {
            // An empty batch: no rows out (the backward sends zero gradients).
            let mut dims = l1.dims().to_vec();
            *dims.last_mut().expect("rank ≥ 1") = self.weight.dim(0)?;
            return Ok((CpuStorage::F32(Vec::new()), Shape::from(dims)));
        }
        let (ws, wl) = self.weight.storage_and_layout();
        let Storage::Cpu(ws) = &*ws else {
            bail!("fused-linear: the weight left the CPU")
        };
        match &self.bias {
            Some(b) => {
                let (bs, bl) = b.storage_and_layout();
                let Storage::Cpu(bs) = &*bs else {
                    bail!("fused-linear: the bias left the CPU")
                };
                nn::linear_cpu((s1, l1), (ws, wl), Some((bs, bl)))
            }
            None => nn::linear_cpu((s1, l1), (ws, wl), None),
        }
    }

    fn bwd(
        &self,
        x: &Tensor,
        _anchor: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let want = [
            x.track_op(),
            self.trains[0],
            self.trains[1] && self.bias.is_some(),
        ];
        let (dx, dw, db) = if x.elem_count() == 0 {
            // An empty batch: zero gradients, as Candle gives a composed layer's variables.
            let zeros = |t: &Tensor, wanted: bool| wanted.then(|| t.zeros_like()).transpose();
            let db = match &self.bias {
                Some(b) => zeros(b, want[2])?,
                None => None,
            };
            (zeros(x, want[0])?, zeros(&self.weight, want[1])?, db)
        } else {
            nn::linear_grads(x, &self.weight, g, want)?
        };
        if let Some(dw) = dw {
            super::send(&self.weight, dw)?;
        }
        if let (Some(b), Some(db)) = (&self.bias, db) {
            super::send(b, db)?;
        }
        Ok((dx, None))
    }
}
