//! Cross-entropy from logits as one graph node: one pass per row forward (no log-probability
//! tensor), one pass per row backward.

use candle_core::{
    backend::BackendStorage, bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape,
    Tensor,
};

use crate::cpu::{contiguous, exp_fast, max16, parallel_chunks, parallel_map, sum16, with_simd};

/// Rows per task of the kernels. Fixed (not derived from the thread count), so that the loss
/// sums the same partial sums in the same order whatever the number of threads.
const ROWS: usize = 64;

/// The mean cross-entropy of `logits` against class indices `targets`: `(1/N) Σ_i (log Σ_j
/// exp(x_ij) − x_{i,t_i})`, the value of [`candle_nn::loss::cross_entropy`] (= [`cross_entropy_composed`]).
///
/// Shapes: `logits` `(N, V)`, `targets` `(N,)` (u32, u8 or i64, each in `[0, V)`); the result a
/// scalar of the logits' dtype. On the CPU with f32 logits it is one op: per row the maximum,
/// `log Σ exp` (vectorised `crate::cpu::exp_fast`) and the target's logit, partial sums in f64
/// over tiles of 64 rows; its backward is `(softmax(x_i) − onehot(t_i)) · g / N` per row, one
/// pass. Candle's composes a log-softmax (an `(N, V)` tensor kept for backward), a gather, a sum
/// and a division: four graph nodes. Other dtypes and devices, and `N = 0` (whose mean is NaN),
/// run [`cross_entropy_composed`].
///
/// Errors: mismatched shapes; a target outside `[0, V)` (naming the row and the value);
/// Candle's.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (n, v) = logits.dims2()?;
    if targets.dims() != [n] {
        bail!(
            "cross_entropy: targets {:?} do not fit logits {:?} (expected ({n},))",
            targets.shape(),
            logits.shape()
        )
    }
    let kernel = logits.device().is_cpu()
        && logits.dtype() == DType::F32
        && matches!(targets.dtype(), DType::U32 | DType::U8 | DType::I64)
        && n > 0
        && v > 0;
    if !kernel {
        return cross_entropy_composed(logits, targets);
    }
    logits
        .contiguous()?
        .apply_op2(&targets.contiguous()?, CrossEntropyOp)
}

/// Mean next-token cross-entropy of language-model logits `(B, T, V)` (any float dtype,
/// widened to f32 first) against targets `(B, T)` u32, as an f32 scalar: [`cross_entropy`] over
/// the `B·T` rows. The loss of both decoders (`models::gpt`, `models::llama`).
///
/// Errors: mismatched shapes; Candle's.
pub fn lm_loss(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logits = logits.flatten_to(1)?.to_dtype(DType::F32)?;
    cross_entropy(&logits, &targets.flatten_all()?)
}

/// The target that contributes nothing to [`lm_loss_sum`] (a prompt or padding position of a
/// supervised example): `u32::MAX` (PyTorch's `ignore_index=-100` for u32 targets).
pub const IGNORE_INDEX: u32 = u32::MAX;

/// The summed (not averaged) next-token cross-entropy of logits `(B, T, V)` against targets
/// `(B, T)` u32 over the positions whose target is not [`IGNORE_INDEX`], and their count:
/// `(Σ_{t_i ≠ ignore} (log Σ_j exp(x_ij) − x_{i,t_i}), k)`, an f32 scalar and `k`.
///
/// The per-token loss of supervised fine-tuning (Megatron's, transformers'
/// `num_items_in_batch`): divide by the number of target tokens over every rank and
/// micro-batch of the step, not per batch, so that gradients equal one process's over the
/// same global batch whatever the split ([`crate::data::sft::token_scale`]). With `k = 0` the
/// sum is a zero that still depends on the logits (its gradient is zero), so a rank without
/// target tokens takes part in the backward like the others.
///
/// Errors: mismatched shapes; a target outside `[0, V)` other than the ignore index; Candle's.
pub fn lm_loss_sum(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, usize)> {
    let logits = logits.flatten_to(1)?.to_dtype(DType::F32)?;
    let targets = targets.flatten_all()?.to_dtype(DType::U32)?;
    let (n, _) = logits.dims2()?;
    if targets.dims() != [n] {
        bail!(
            "lm_loss_sum: targets {:?} do not fit logits {:?}",
            targets.shape(),
            logits.shape()
        )
    }
    let t = targets.to_vec1::<u32>()?;
    let rows: Vec<u32> = (0..n as u32)
        .filter(|&i| t[i as usize] != IGNORE_INDEX)
        .collect();
    let k = rows.len();
    if k == 0 {
        // Times a zero tensor, not `affine(0, 0)`: Candle's backward prunes an affine by 0, and
        // the rank's backward must still reach the model.
        let zero = Tensor::zeros((), DType::F32, logits.device())?;
        return Ok(((logits.sum_all()? * zero)?, 0));
    }
    let kept: Vec<u32> = rows.iter().map(|&i| t[i as usize]).collect();
    let idx = Tensor::new(rows, logits.device())?;
    let picked = logits.index_select(&idx, 0)?;
    let kept = Tensor::new(kept, logits.device())?;
    Ok((cross_entropy(&picked, &kept)?.affine(k as f64, 0.0)?, k))
}

/// [`cross_entropy`] as candle-nn computes it: [`candle_nn::loss::cross_entropy`]. Any dtype
/// and device, differentiable to any order.
///
/// Errors: Candle's.
pub fn cross_entropy_composed(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    candle_nn::loss::cross_entropy(logits, targets)
}

/// The targets as `usize`, each checked against `v`.
fn targets_of(s: &CpuStorage, l: &Layout, v: usize) -> Result<Vec<usize>> {
    let t: Vec<usize> = match s {
        CpuStorage::U32(d) => contiguous(d, l, "targets")?
            .iter()
            .map(|&t| t as usize)
            .collect(),
        CpuStorage::U8(d) => contiguous(d, l, "targets")?
            .iter()
            .map(|&t| t as usize)
            .collect(),
        CpuStorage::I64(d) => contiguous(d, l, "targets")?
            .iter()
            .map(|&t| if t < 0 { usize::MAX } else { t as usize })
            .collect(),
        s => bail!(
            "cross_entropy: targets must be u32, u8 or i64, found {:?}",
            s.dtype()
        ),
    };
    if let Some((i, &t)) = t.iter().enumerate().find(|(_, &t)| t >= v) {
        bail!("cross_entropy: target of row {i} is {t}, outside the {v} classes [0, {v})")
    }
    Ok(t)
}

/// `log Σ_j exp(x_j)` of one row, with its maximum removed first.
#[inline(always)]
fn log_sum_exp(row: &[f32], buf: &mut [f32]) -> f32 {
    let m = max16(row);
    for (e, &x) in buf.iter_mut().zip(row) {
        *e = exp_fast(x - m);
    }
    m + sum16(buf, |e| e).ln()
}

/// The forward custom op of [`cross_entropy`] on `(logits, targets)`.
#[derive(Clone, Copy, Debug)]
struct CrossEntropyOp;

impl CustomOp2 for CrossEntropyOp {
    fn name(&self) -> &'static str {
        "cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, v) = l1.shape().dims2()?;
        let x = contiguous(s1.as_slice::<f32>()?, l1, "logits")?;
        let t = targets_of(s2, l2, v)?;
        let partial = parallel_map(n.div_ceil(ROWS), |c| {
            with_simd(
                #[inline(always)]
                || {
                    let mut buf = vec![0f32; v];
                    let rows = c * ROWS..((c + 1) * ROWS).min(n);
                    rows.map(|i| {
                        let row = &x[i * v..(i + 1) * v];
                        (log_sum_exp(row, &mut buf) - row[t[i]]) as f64
                    })
                    .sum::<f64>()
                },
            )
        });
        let loss = partial.iter().sum::<f64>() / n as f64;
        Ok((CpuStorage::F32(vec![loss as f32]), Shape::from(())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad_res.to_dtype(DType::F32)?.contiguous()?;
        let d = logits.apply_op3_no_bwd(targets, &g, &CrossEntropyBwdOp)?;
        Ok((Some(d), None))
    }
}

/// The backward kernel of [`cross_entropy`] as a (no-backward) custom op on
/// `(logits, targets, grad_loss)`: `(softmax(x_i) − onehot(t_i)) · g / N`.
#[derive(Clone, Copy, Debug)]
struct CrossEntropyBwdOp;

impl CustomOp3 for CrossEntropyBwdOp {
    fn name(&self) -> &'static str {
        "cross-entropy-bwd"
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
        let (n, v) = l1.shape().dims2()?;
        let x = contiguous(s1.as_slice::<f32>()?, l1, "logits")?;
        let t = targets_of(s2, l2, v)?;
        let g = contiguous(s3.as_slice::<f32>()?, l3, "loss gradient")?;
        if g.len() != 1 {
            bail!(
                "cross_entropy backward: the loss gradient must be a scalar, found {:?}",
                l3.shape()
            )
        }
        let k = g[0] / n as f32;
        let mut out = vec![0f32; n * v];
        parallel_chunks(&mut out, ROWS * v, |c, out| {
            with_simd(
                #[inline(always)]
                || {
                    for (r, o) in out.chunks_exact_mut(v).enumerate() {
                        let i = c * ROWS + r;
                        let row = &x[i * v..(i + 1) * v];
                        let m = max16(row);
                        for (e, &x) in o.iter_mut().zip(row) {
                            *e = exp_fast(x - m);
                        }
                        let scale = k / sum16(o, |e| e);
                        for e in o.iter_mut() {
                            *e *= scale;
                        }
                        o[t[i]] -= k;
                    }
                },
            )
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}
