//! [`super::attention`]'s kernel as Candle custom ops: the forward on `qkv` and, as its
//! backward, a second op on `(qkv, y, grad_y)` giving `grad_qkv`.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, Layout, Result, Shape, Tensor};

use super::*;
use crate::cpu::contiguous;

/// The forward custom op of [`attention`]; its backward is [`AttentionBwdOp`].
#[derive(Clone, Debug)]
pub(super) struct AttentionOp {
    pub(super) n_head: usize,
    pub(super) n_kv_head: usize,
    pub(super) scores: Scores<'static>,
    /// The segment starts of every position (`B·T`, [`attention_packed`]), or one segment.
    pub(super) starts: Option<Arc<[u32]>>,
}

impl CustomOp1 for AttentionOp {
    fn name(&self) -> &'static str {
        "causal-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        fn run<T: Elem + candle_core::WithDType>(
            op: &AttentionOp,
            s: &CpuStorage,
            l: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            let dims = Dims::of(l, op.n_head, op.n_kv_head)?;
            let x = contiguous(s.as_slice::<T>()?, l, "qkv")?;
            let y = attention_fwd_with(x, None, dims, op.scores, op.starts.as_deref());
            Ok((
                T::to_cpu_storage_owned(y),
                Shape::from((dims.b, dims.t, dims.d())),
            ))
        }
        match s.dtype() {
            DType::F32 => run::<f32>(self, s, l),
            DType::BF16 => run::<half::bf16>(self, s, l),
            DType::F16 => run::<half::f16>(self, s, l),
            dt => bail!("causal-attention: no CPU kernel for {dt:?}"),
        }
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let op = AttentionBwdOp {
            n_head: self.n_head,
            n_kv_head: self.n_kv_head,
            scores: self.scores,
            starts: self.starts.clone(),
        };
        Ok(Some(arg.apply_op3_no_bwd(
            res,
            &grad_res.contiguous()?,
            &op,
        )?))
    }
}

/// The backward kernel of [`attention`] as a (no-backward) custom op on `(qkv, y, grad_y)`,
/// giving `grad_qkv`.
#[derive(Clone, Debug)]
struct AttentionBwdOp {
    n_head: usize,
    n_kv_head: usize,
    scores: Scores<'static>,
    starts: Option<Arc<[u32]>>,
}

impl CustomOp3 for AttentionBwdOp {
    fn name(&self) -> &'static str {
        "causal-attention-bwd"
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
        let dims = Dims::of(l1, self.n_head, self.n_kv_head)?;
        let out = [dims.b, dims.t, dims.d()];
        if l2.dims() != out || l3.dims() != out || s2.dtype() != s1.dtype() {
            bail!(
                "causal-attention backward: qkv {:?} {:?}, output {:?} {:?}, gradient {:?} do not fit",
                l1.shape(),
                s1.dtype(),
                l2.shape(),
                s2.dtype(),
                l3.shape()
            );
        }
        fn run<T: Elem + candle_core::WithDType>(
            op: &AttentionBwdOp,
            dims: Dims,
            x: (&CpuStorage, &Layout),
            y: (&CpuStorage, &Layout),
            g: (&CpuStorage, &Layout),
        ) -> Result<(CpuStorage, Shape)> {
            let xs = contiguous(x.0.as_slice::<T>()?, x.1, "qkv")?;
            let ys = contiguous(y.0.as_slice::<T>()?, y.1, "attention output")?;
            let gs = contiguous(g.0.as_slice::<T>()?, g.1, "output gradient")?;
            let dx = attention_bwd_with(xs, None, ys, gs, dims, op.scores, op.starts.as_deref());
            Ok((T::to_cpu_storage_owned(dx), x.1.shape().clone()))
        }
        match s1.dtype() {
            DType::F32 => run::<f32>(self, dims, (s1, l1), (s2, l2), (s3, l3)),
            DType::BF16 => run::<half::bf16>(self, dims, (s1, l1), (s2, l2), (s3, l3)),
            DType::F16 => run::<half::f16>(self, dims, (s1, l1), (s2, l2), (s3, l3)),
            dt => bail!("causal-attention-bwd: no CPU kernel for {dt:?}"),
        }
    }
}
