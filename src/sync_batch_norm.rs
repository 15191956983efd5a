//! Synchronised batch normalisation: statistics over the global batch of a process group.
//!
//! [`SyncBatchNorm`] is a drop-in for candle-nn's [`candle_nn::BatchNorm`] (same
//! [`BatchNormConfig`], same parameter and buffer names, same init hints, so checkpoints and the
//! plain layer are interchangeable) whose training-mode statistics are those of the
//! *concatenation* of every rank's batch, as PyTorch's `torch.nn.SyncBatchNorm` computes them.
//! Formulas (Ioffe & Szegedy 2015, "Batch Normalization", arXiv:1502.03167; PyTorch
//! `SyncBatchNorm`), per channel `c`, with `n` the global count of values of the channel (batch
//! × spatial positions, summed over ranks):
//!
//! ```text
//! mean_c = Σ x / n            var_c = Σ (x − mean_c)² / n                       (biased)
//! y      = (x − mean_c) / sqrt(var_c + eps) · weight_c + bias_c
//! running_mean_c ← (1 − momentum) · running_mean_c + momentum · mean_c
//! running_var_c  ← (1 − momentum) · running_var_c  + momentum · var_c · n / (n − 1)   (unbiased)
//! ```
//!
//! One training forward issues **one** all-reduce (sum, f32, on the process group's
//! [default stream](crate::comm::ProcessGroup::default_stream)) of each rank's per-channel count, sum and
//! centred sum of squares, each rank in its own row of a `(world_size, 2C + 1)` buffer; every
//! rank combines the rows with the parallel-variance formula, as PyTorch's SyncBatchNorm does
//! with its gathered per-rank statistics (this avoids the cancellation of `E[x²] − E[x]²`; see
//! `SyncBatchNorm::global_stats`). The all-reduce is a differentiable Candle op
//! ([`all_reduce_sum`]) whose backward is again a sum all-reduce (the adjoint of a sum over ranks
//! is a sum over ranks), so autograd through these formulas all-reduces the per-channel gradient
//! sums (the `Σ dy` and `Σ dy · x̂` of the BatchNorm backward, reached through the gathered sums
//! and centred sums of squares) and the input, weight and bias gradients are exactly those of one
//! `BatchNorm` over the global batch (weight and bias gradients: this rank's share, which the
//! FSDP gradient reduction sums over ranks). Every training-mode SyncBatchNorm call is therefore
//! a collective, forward and backward: all ranks must run it, in the same order (eval mode never
//! communicates). Counts travel as f32: exact up to 2²⁴ values per channel and rank.
//!
//! Ranks may hold different batch sizes, including 0 or 1, as long as the global count per
//! channel is above 1; a global count of 0 or 1 in training is an error on every rank (PyTorch's
//! "Expected more than 1 value per channel when training").

use std::sync::Arc;

use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, Var};
use candle_nn::{BatchNormConfig, Init, ModuleT, VarBuilder};

use crate::comm::{ProcessGroup, ReduceOp};
use crate::error::Error;

/// The global count of values per channel: read to the host (CPU path, or a rank whose own
/// batch cannot guarantee `n > 1`), or kept on the device as a scalar f32 tensor (GPU path).
enum Count {
    Host(f64),
    Device(Tensor),
}

/// A Candle custom op that sums a tensor over every rank of a process group (a blocking
/// all-reduce on the group's default stream); its backward sums the incoming gradient over the
/// ranks in the same way. Use it through [`all_reduce_sum`].
///
/// f32, contiguous, on the CPU or (feature `cuda`) a GPU, where the all-reduce does not block
/// the host; Metal is Candle's "no implementation" error. A communication error comes back out of the Candle op as our own variant (it travels
/// through Candle wrapped by [`Error::into_candle`]; `Error::from` unwraps it), e.g.
/// [`Error::PeerFailed`].
#[derive(Clone)]
pub struct AllReduceSum {
    pg: Arc<dyn ProcessGroup>,
}

impl AllReduceSum {
    /// The op over `pg`.
    pub fn new(pg: Arc<dyn ProcessGroup>) -> Self {
        Self { pg }
    }
}

impl CustomOp1 for AllReduceSum {
    fn name(&self) -> &'static str {
        "all-reduce-sum"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(data) = storage else {
            bail!("all-reduce-sum: expects an f32 tensor")
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("all-reduce-sum: expects a contiguous tensor")
        };
        let buf = Tensor::from_slice(&data[start..end], end - start, self.pg.device())?;
        let out = self
            .pg
            .all_reduce(&self.pg.default_stream(), buf, ReduceOp::Sum)
            .wait()
            .map_err(Error::into_candle)?
            .to_vec1::<f32>()?;
        Ok((CpuStorage::F32(out), layout.shape().clone()))
    }

    /// On a GPU: the statistics stay on the device. A device copy of the input goes to the
    /// group's all-reduce on its default stream; the compute stream waits for it by an event
    /// ([`crate::comm::Work::wait_compute`]), so the host never blocks (NCCL); the result is
    /// copied into the op's own output storage on the compute stream.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("all-reduce-sum: expects a contiguous tensor")
        };
        let n = end - start;
        let candle_core::cuda_backend::CudaStorageSlice::F32(data) = &storage.slice else {
            bail!("all-reduce-sum: expects an f32 tensor")
        };
        let stream = storage.device.cuda_stream();
        let copy = stream
            .clone_dtod(&data.slice(start..end))
            .map_err(|e| candle_core::Error::Msg(format!("all-reduce-sum: {e:?}")))?;
        let buf = Tensor::from_storage(
            candle_core::Storage::Cuda(candle_core::CudaStorage::wrap_cuda_slice(
                copy,
                storage.device.clone(),
            )),
            n,
            candle_core::op::BackpropOp::none(),
            false,
        );
        let out = self
            .pg
            .all_reduce(&self.pg.default_stream(), buf, ReduceOp::Sum)
            .wait_compute()
            .map_err(Error::into_candle)?;
        let (out_storage, out_layout) = out.storage_and_layout();
        let candle_core::Storage::Cuda(out_storage) = &*out_storage else {
            bail!("all-reduce-sum: the group returned a buffer off the GPU")
        };
        Ok((out_storage.try_clone(out_layout)?, layout.shape().clone()))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let g = grad_res.to_dtype(DType::F32)?.contiguous()?;
        Ok(Some(g.apply_op1_no_bwd(self)?))
    }
}

/// Differentiable sum all-reduce: returns `Σ_ranks x` (f32, the shape of `x`) on every rank; the
/// gradient flowing back into `x` is `Σ_ranks` of the gradients of the result.
///
/// `x` is cast to f32 (differentiably) and made contiguous. A collective: every rank must call it
/// with the same shape, in the same order (forward and backward alike). World size 1 returns the
/// f32 input unchanged, with no communication.
///
/// Errors: a collective failure (a peer failed, timed out, or passed another length), wrapped in
/// a Candle error that `crate::Error::from` turns back into the collective's own variant.
pub fn all_reduce_sum(x: &Tensor, pg: &Arc<dyn ProcessGroup>) -> candle_core::Result<Tensor> {
    let x = x.to_dtype(DType::F32)?;
    if pg.world_size() == 1 {
        return Ok(x);
    }
    x.contiguous()?.apply_op1(AllReduceSum::new(pg.clone()))
}

/// Batch normalisation over the global batch of a process group (PyTorch's
/// `torch.nn.SyncBatchNorm`); see the [module docs](self) for the formulas.
///
/// Input: `(N, C)` or `(N, C, d1, d2, …)` (e.g. `(N, C, H, W)`), any float dtype; the output has
/// the input's shape and dtype. Statistics are accumulated and all-reduced in f32 whatever the
/// compute dtype (f64 inputs are normalised in f64 with f32 statistics); the running statistics
/// keep whatever dtype they were given in (the FSDP runtime keeps buffers in f32 by default) and
/// are updated in place.
///
/// Training mode is a collective over the process group (one all-reduce in forward, one in
/// backward); eval mode normalises with the running statistics and never communicates.
#[derive(Clone)]
pub struct SyncBatchNorm {
    running_mean: Var,
    running_var: Var,
    weight_and_bias: Option<(Tensor, Tensor)>,
    remove_mean: bool,
    eps: f64,
    momentum: f64,
    num_features: usize,
    pg: Arc<dyn ProcessGroup>,
}

impl std::fmt::Debug for SyncBatchNorm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SyncBatchNorm")
            .field("num_features", &self.num_features)
            .field("affine", &self.weight_and_bias.is_some())
            .field("remove_mean", &self.remove_mean)
            .field("eps", &self.eps)
            .field("momentum", &self.momentum)
            .field("rank", &self.pg.rank())
            .field("world_size", &self.pg.world_size())
            .finish()
    }
}

/// Asks for a buffer so that the tensor returned is the live variable when there is one: under
/// mixed precision the module may be bound in bf16/f16 while its buffers are kept as f32
/// variables, and a dtype-converted copy would silently drop the running-statistics updates.
fn get_buffer(vb: &VarBuilder, n: usize, name: &str, init: Init) -> candle_core::Result<Tensor> {
    let t = vb.get_with_hints(n, name, init)?;
    if t.is_variable() || vb.dtype() == DType::F32 {
        return Ok(t);
    }
    let t32 = vb.get_with_hints_dtype(n, name, init, DType::F32)?;
    Ok(if t32.is_variable() { t32 } else { t })
}

/// Builds a [`SyncBatchNorm`] over `num_features` channels from a `VarBuilder`, exactly as
/// [`candle_nn::batch_norm()`] does: `running_mean` (init 0), `running_var` (init 1) and, when
/// `config.affine`, `weight` (init 1) and `bias` (init 0), each of shape `(num_features,)`.
///
/// In an FSDP unit the closure captures the process group:
/// `.unit("bn", move |vb| sync_batch_norm(16, Default::default(), pg.clone(), vb))`. The runtime
/// treats `running_mean` / `running_var` as buffers (replicated, updated in place).
///
/// Errors: negative `eps`, `momentum` outside `[0, 1]`, tensors of another shape.
pub fn sync_batch_norm<C: Into<BatchNormConfig>>(
    num_features: usize,
    config: C,
    pg: Arc<dyn ProcessGroup>,
    vb: VarBuilder,
) -> candle_core::Result<SyncBatchNorm> {
    let config = config.into();
    if config.eps < 0. {
        bail!("sync-batch-norm eps cannot be negative {}", config.eps)
    }
    let running_mean = get_buffer(&vb, num_features, "running_mean", Init::Const(0.))?;
    let running_var = get_buffer(&vb, num_features, "running_var", Init::Const(1.))?;
    let weight_and_bias = if config.affine {
        let weight = vb.get_with_hints(num_features, "weight", Init::Const(1.))?;
        let bias = vb.get_with_hints(num_features, "bias", Init::Const(0.))?;
        Some((weight, bias))
    } else {
        None
    };
    SyncBatchNorm::new(
        num_features,
        running_mean,
        running_var,
        weight_and_bias,
        config,
        pg,
    )
}

impl SyncBatchNorm {
    /// A SyncBatchNorm from tensors, each of shape `(num_features,)`. `running_mean` and
    /// `running_var` are updated in place when they are variables (`Var::from_tensor` shares
    /// their storage), otherwise copied into new variables. `config.affine` is ignored: the layer
    /// is affine exactly when `weight_and_bias` is given.
    ///
    /// Errors: negative `eps`, `momentum` outside `[0, 1]`, a tensor of another shape.
    pub fn new(
        num_features: usize,
        running_mean: Tensor,
        running_var: Tensor,
        weight_and_bias: Option<(Tensor, Tensor)>,
        config: BatchNormConfig,
        pg: Arc<dyn ProcessGroup>,
    ) -> candle_core::Result<Self> {
        if config.eps < 0. {
            bail!("sync-batch-norm eps cannot be negative {}", config.eps)
        }
        if !(0.0..=1.0).contains(&config.momentum) {
            bail!(
                "sync-batch-norm momentum must be between 0 and 1, is {}",
                config.momentum
            )
        }
        let check = |what: &str, t: &Tensor| -> candle_core::Result<()> {
            if t.dims() != [num_features] {
                bail!(
                    "sync-batch-norm {what} has shape {:?}, expected [{num_features}]",
                    t.shape()
                )
            }
            Ok(())
        };
        check("running mean", &running_mean)?;
        check("running variance", &running_var)?;
        if let Some((w, b)) = &weight_and_bias {
            check("weight", w)?;
            check("bias", b)?;
        }
        Ok(Self {
            running_mean: Var::from_tensor(&running_mean)?,
            running_var: Var::from_tensor(&running_var)?,
            weight_and_bias,
            remove_mean: config.remove_mean,
            eps: config.eps,
            momentum: config.momentum,
            num_features,
            pg,
        })
    }

    /// Running mean, shape `(num_features,)`, in the dtype it was given in.
    pub fn running_mean(&self) -> &Tensor {
        self.running_mean.as_tensor()
    }

    /// Running (unbiased) variance, shape `(num_features,)`, in the dtype it was given in.
    pub fn running_var(&self) -> &Tensor {
        self.running_var.as_tensor()
    }

    /// `(weight, bias)` when affine.
    pub fn weight_and_bias(&self) -> Option<(&Tensor, &Tensor)> {
        self.weight_and_bias.as_ref().map(|(w, b)| (w, b))
    }

    /// Number of channels `C`.
    pub fn num_features(&self) -> usize {
        self.num_features
    }

    /// Epsilon added to the variance.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// Momentum of the running statistics.
    pub fn momentum(&self) -> f64 {
        self.momentum
    }

    /// The process group the statistics are reduced over.
    pub fn process_group(&self) -> &Arc<dyn ProcessGroup> {
        &self.pg
    }

    fn check_input(&self, x: &Tensor) -> candle_core::Result<()> {
        if x.rank() < 2 {
            bail!(
                "sync-batch-norm input must have at least two dimensions (N, C, …), got {:?}",
                x.shape()
            )
        }
        if x.dim(1)? != self.num_features {
            bail!(
                "sync-batch-norm input {:?} does not have {} channels in dimension 1",
                x.shape(),
                self.num_features
            )
        }
        Ok(())
    }

    /// Training forward (a collective): normalises with the global batch statistics and updates
    /// the running statistics in place (see the [module docs](self)).
    ///
    /// Errors: input of rank < 2 or with another channel count; a global count per channel of 0
    /// or 1 (on every rank); any collective failure.
    pub fn forward_train(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.check_input(x)?;
        let c = self.num_features;
        let dims = x.dims().to_vec();
        let x_dtype = x.dtype();
        let spatial: usize = dims[2..].iter().product();
        let local_count = dims[0] * spatial;
        // (N, C, L): channel statistics reduce over dims 0 and 2.
        let x3 = x.reshape((dims[0], c, spatial))?;
        let xf = x3.to_dtype(DType::F32)?;
        let (mean, var, n) = if crate::device::is_cuda(x.device()) && local_count >= 2 {
            // On a GPU the global count stays on the device (no host sync); this rank alone
            // already has more than one value per channel, so the global count does too.
            self.global_stats_on_device(&xf, local_count)?
        } else {
            let (mean, var, n) = self.global_stats(&xf, local_count)?;
            (mean, var, Count::Host(n))
        };
        if let Count::Host(n) = n {
            if n <= 1. {
                bail!(
                    "sync-batch-norm: expected more than 1 value per channel when training, the \
                 global batch has {n} (this rank's input {:?}, rank {} of {})",
                    x.shape(),
                    self.pg.rank(),
                    self.pg.world_size()
                )
            }
        }
        // candle-nn's `remove_mean: false` normalises by (and tracks) E[x²] instead.
        let var = if self.remove_mean {
            var
        } else {
            (var + mean.sqr()?)?
        };
        self.update_running_stats(&mean, &var, n)?;

        // Normalisation in f32 (f64 for f64 inputs), then back to the input dtype.
        let (internal, xi) = if x_dtype == DType::F64 {
            (DType::F64, x3)
        } else {
            (DType::F32, xf)
        };
        let xi = if self.remove_mean {
            xi.broadcast_sub(&mean.to_dtype(internal)?.reshape((1, c, 1))?)?
        } else {
            xi
        };
        let std = (var.to_dtype(internal)? + self.eps)?.sqrt()?;
        if dims[0] == 0 {
            return self.empty_output(&xi, &mean.to_dtype(internal)?, &std, &dims, x_dtype);
        }
        let y = xi
            .broadcast_div(&std.reshape((1, c, 1))?)?
            .to_dtype(x_dtype)?;
        let y = self.affine(y, &[1, c, 1])?;
        y.reshape(dims)
    }

    /// The (empty) output of a rank whose batch is empty, kept attached to the statistics.
    ///
    /// Candle short-circuits element-wise ops on empty tensors (they return the left operand),
    /// which would cut this rank's graph off the all-reduce: its backward would then skip the
    /// backward all-reduce that the other ranks run, and the group would stall. So the empty
    /// output is taken as a zero-length slice of `cat([x, anchor])`, where the anchor
    /// (shape `(1, C, L)`) is computed from the global statistics, weight and bias: the
    /// backward then reaches the all-reduce (with zero gradients) and gives the input, weight and
    /// bias (zero) gradients, exactly as on the other ranks.
    fn empty_output(
        &self,
        xi: &Tensor,
        mean: &Tensor,
        std: &Tensor,
        dims: &[usize],
        x_dtype: DType,
    ) -> candle_core::Result<Tensor> {
        let (c, l) = (xi.dim(1)?, xi.dim(2)?);
        let mut anchor = (mean + std)?;
        if let Some((w, b)) = &self.weight_and_bias {
            anchor = ((anchor + w.to_dtype(mean.dtype())?)? + b.to_dtype(mean.dtype())?)?;
        }
        let anchor = anchor.reshape((1, c, 1))?.broadcast_as((1, c, l))?;
        Tensor::cat(&[xi, &anchor], 0)?
            .narrow(0, 0, 0)?
            .to_dtype(x_dtype)?
            .reshape(dims)
    }

    /// [`Self::global_stats`] without reading anything back to the host (the GPU path): the
    /// same formulas, with the global count `n` a scalar device tensor. Used when this rank
    /// holds at least two values per channel, so that `n > 1` needs no check.
    fn global_stats_on_device(
        &self,
        xf: &Tensor,
        local_count: usize,
    ) -> candle_core::Result<(Tensor, Tensor, Count)> {
        let c = self.num_features;
        let (ws, rank) = (self.pg.world_size(), self.pg.rank());
        let sum = xf.sum(2)?.sum(0)?;
        let local_mean = (&sum / local_count as f64)?;
        let m2 = xf
            .broadcast_sub(&local_mean.reshape((1, c, 1))?)?
            .sqr()?
            .sum(2)?
            .sum(0)?;
        let count = Tensor::new(&[local_count as f32], xf.device())?;
        let row = Tensor::cat(&[&sum, &m2, &count], 0)?.unsqueeze(0)?;
        let rows = all_reduce_sum(&row.pad_with_zeros(0, rank, ws - 1 - rank)?, &self.pg)?;
        let n_r = rows.narrow(1, 2 * c, 1)?.detach(); // (ws, 1)
        let n = n_r.sum_all()?; // scalar
        let sums = rows.narrow(1, 0, c)?;
        let mean = sums.sum(0)?.broadcast_div(&n)?;
        let rank_means = sums.broadcast_div(&n_r.maximum(1f32)?)?;
        let between = rank_means
            .broadcast_sub(&mean.unsqueeze(0)?)?
            .sqr()?
            .broadcast_mul(&n_r)?
            .sum(0)?;
        let m2 = (rows.narrow(1, c, c)?.sum(0)? + between)?;
        Ok((mean, m2.broadcast_div(&n)?, Count::Device(n)))
    }

    /// Global per-channel mean, biased variance (both `(C,)` f32, attached to the autograd graph)
    /// and count `n`, from this rank's `(N, C, L)` f32 input holding `local_count = N·L` values
    /// per channel.
    ///
    /// Each rank puts its count, sum and centred sum of squares `M2 = Σ (x − local mean)²` into
    /// its own row of a zeroed `(world_size, 2C + 1)` buffer, and one sum all-reduce (an
    /// all-gather, exact since the other rows are zeros) hands every rank all rows. They are
    /// combined in rank order with the parallel-variance formula (Chan, Golub & LeVeque 1979;
    /// PyTorch's `batch_norm_gather_stats_with_counts`):
    /// `mean = Σ sum_r / n`, `M2 = Σ M2_r + Σ n_r (mean_r − mean)²`, `var = M2 / n`, which is
    /// free of the cancellation of `E[x²] − E[x]²`. All ranks get bitwise identical statistics.
    fn global_stats(
        &self,
        xf: &Tensor,
        local_count: usize,
    ) -> candle_core::Result<(Tensor, Tensor, f64)> {
        let c = self.num_features;
        let (ws, rank) = (self.pg.world_size(), self.pg.rank());
        let sum = xf.sum(2)?.sum(0)?;
        let local_mean = (&sum / local_count.max(1) as f64)?;
        let m2 = xf
            .broadcast_sub(&local_mean.reshape((1, c, 1))?)?
            .sqr()?
            .sum(2)?
            .sum(0)?;
        let count = Tensor::new(&[local_count as f32], xf.device())?;
        let row = Tensor::cat(&[&sum, &m2, &count], 0)?.unsqueeze(0)?;
        let rows = all_reduce_sum(&row.pad_with_zeros(0, rank, ws - 1 - rank)?, &self.pg)?;
        let counts: Vec<f32> = rows.narrow(1, 2 * c, 1)?.flatten_all()?.to_vec1()?;
        let n: f64 = counts.iter().map(|&v| v as f64).sum();
        if n <= 1. {
            return Ok((sum, m2, n));
        }
        let dev = xf.device();
        let n_r = Tensor::from_slice(&counts, (ws, 1), dev)?;
        let n_r_or_1: Vec<f32> = counts.iter().map(|&v| v.max(1.0)).collect();
        let n_r_or_1 = Tensor::from_vec(n_r_or_1, (ws, 1), dev)?;
        let sums = rows.narrow(1, 0, c)?;
        let mean = (sums.sum(0)? / n)?;
        let rank_means = sums.broadcast_div(&n_r_or_1)?;
        let between = rank_means
            .broadcast_sub(&mean.unsqueeze(0)?)?
            .sqr()?
            .broadcast_mul(&n_r)?
            .sum(0)?;
        let m2 = (rows.narrow(1, c, c)?.sum(0)? + between)?;
        Ok((mean, (m2 / n)?, n))
    }

    /// `running ← (1 − m) · running + m · batch`, with the unbiased variance, in the buffers'
    /// dtype (the same operation order as candle-nn's `BatchNorm::forward_train`).
    fn update_running_stats(
        &self,
        mean: &Tensor,
        var: &Tensor,
        n: Count,
    ) -> candle_core::Result<()> {
        let m = self.momentum;
        let unbiased = match n {
            Count::Host(n) => (var.detach() * (m * n / (n - 1.0)))?,
            // m · n / (n − 1) on the device (n > 1 is guaranteed by the caller).
            Count::Device(n) => var.detach().broadcast_mul(&((&n * m)? / (&n - 1.0)?)?)?,
        };
        if self.remove_mean {
            let rm = self.running_mean.as_tensor();
            let updated = ((rm.to_dtype(DType::F32)? * (1.0 - m))? + (mean.detach() * m)?)?;
            self.running_mean.set(&updated.to_dtype(rm.dtype())?)?;
        }
        let rv = self.running_var.as_tensor();
        let updated = ((rv.to_dtype(DType::F32)? * (1.0 - m))? + unbiased)?;
        self.running_var.set(&updated.to_dtype(rv.dtype())?)
    }

    /// Multiplies by the weight and adds the bias (cast to `y`'s dtype), broadcast as `shape`.
    fn affine(&self, y: Tensor, shape: &[usize]) -> candle_core::Result<Tensor> {
        match &self.weight_and_bias {
            None => Ok(y),
            Some((w, b)) => {
                let w = w.to_dtype(y.dtype())?.reshape(shape)?;
                let b = b.to_dtype(y.dtype())?.reshape(shape)?;
                y.broadcast_mul(&w)?.broadcast_add(&b)
            }
        }
    }

    /// Eval forward: `(x − running_mean) / sqrt(running_var + eps) · weight + bias`, no
    /// communication; the same operations as candle-nn's `BatchNorm` in eval mode (computed in
    /// f32 for bf16/f16 inputs).
    ///
    /// Errors: input of rank < 2 or with another channel count.
    pub fn forward_eval(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.check_input(x)?;
        let x_dtype = x.dtype();
        let internal = match x_dtype {
            DType::F16 | DType::BF16 => DType::F32,
            d => d,
        };
        let target: Vec<usize> = (0..x.rank())
            .map(|i| if i == 1 { self.num_features } else { 1 })
            .collect();
        let rm = self.running_mean.as_detached_tensor().to_dtype(internal)?;
        let rv = self.running_var.as_detached_tensor().to_dtype(internal)?;
        let y = x
            .to_dtype(internal)?
            .broadcast_sub(&rm.reshape(target.as_slice())?)?
            .broadcast_div(&(rv.reshape(target.as_slice())? + self.eps)?.sqrt()?)?
            .to_dtype(x_dtype)?;
        self.affine(y, &target)
    }
}

impl ModuleT for SyncBatchNorm {
    /// Training forward (a collective) when `train`, otherwise the eval forward.
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        if train {
            self.forward_train(x)
        } else {
            self.forward_eval(x)
        }
    }
}
