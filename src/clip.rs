//! Gradient clipping by the total p-norm over all shards of all ranks (PyTorch's
//! `torch.nn.utils.clip_grad_norm_` / `FSDP.clip_grad_norm_`: `norm_type` any p > 0 or
//! infinity, `error_if_nonfinite`).
//!
//! The gradients are read and scaled through the model's accessor ([`FsdpModel::shards`]) with
//! the kernels of [`crate::ops`], in place on their device. Padding and the zeros standing for
//! absent gradients add nothing to any norm.

use crate::comm::{ProcessGroup, ProcessGroupExt, ReduceOp};
use crate::error::{Error, Phase, Result};
use crate::fsdp::{FsdpModel, ShardingStrategy};
use crate::ops;

/// Options of [`clip_grad_norm_with`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClipOptions {
    /// The p of the norm: any p > 0, or `f64::INFINITY` for the max-norm (default 2).
    pub norm_type: f64,
    /// Return an error, and leave the gradients alone, when the total norm is NaN or infinite
    /// (default `false`: return the norm and leave the gradients alone).
    pub error_if_nonfinite: bool,
}

impl Default for ClipOptions {
    fn default() -> Self {
        Self {
            norm_type: 2.0,
            error_if_nonfinite: false,
        }
    }
}

/// This rank's part of the norm: the sum of `|g|^p` (f64 accumulation; the L2 case sums
/// squares with [`ops::sum_squares`], each unit's sum then the units in order), or the max of
/// `|g|` for the infinity norm. Under the hybrid strategies every replica holds the same
/// shards: only replica 0's ranks contribute to a sum (the others add 0, so the reduction over
/// the whole world equals one over a single replica, bit for bit).
fn local_part(model: &FsdpModel, p: f64) -> Result<f64> {
    let mut s = 0f64;
    if model.replica_index() != 0 && !p.is_infinite() {
        return Ok(s);
    }
    for v in model.shards() {
        let Some(g) = v.grad else { continue };
        if p == 2.0 {
            s += ops::sum_squares(g)?;
        } else if p.is_infinite() {
            let m = ops::with_host_f32(g, |x| {
                x.iter().fold(0f32, |m, v| {
                    if v.abs() > m || v.is_nan() {
                        v.abs()
                    } else {
                        m
                    }
                })
            })?;
            // NaN counts as infinite: a max all-reduce would drop a NaN.
            s = if m.is_nan() {
                f64::INFINITY
            } else {
                s.max(f64::from(m))
            };
        } else {
            s += ops::with_host_f32(g, |x| {
                x.iter().map(|v| f64::from(v.abs()).powf(p)).sum::<f64>()
            })?;
        }
    }
    Ok(s)
}

fn all_reduce(pg: &dyn ProcessGroup, v: f32, op: ReduceOp) -> Result<f32> {
    Ok(pg.all_reduce_f32s(vec![v], op)?[0])
}

/// The error of clipping or measuring a partial gradient.
fn check_synced(model: &FsdpModel) -> Result<()> {
    if !model.requires_gradient_sync() {
        return Err(Error::Misuse {
            call: "gradient norm",
            state: "requested while gradient sync is off",
            fix: "the gradients are this rank's unsynchronised partial sums, not the model's; \
                  turn sync on (set_requires_gradient_sync(true)) and run the last micro-batch's \
                  backward first"
                .into(),
        });
    }
    Ok(())
}

/// Total L2 norm of all gradients of the model (see [`total_grad_norm_p`]).
///
/// Errors: as [`total_grad_norm_p`].
pub fn total_grad_norm(model: &FsdpModel) -> Result<f32> {
    total_grad_norm_p(model, 2.0)
}

/// Total `norm_type`-norm of all gradients of the model, over every rank's shards (a
/// collective over the whole world: one all-reduce of one f32, sum of `|g|^p` or max of `|g|`
/// for `f64::INFINITY`; under the hybrid strategies one replica's shards count). Under NO_SHARD every rank holds the whole gradient, so no reduction is
/// needed and none is done.
///
/// Errors: gradient sync is off (the gradients would be partial); `norm_type` not > 0 (or
/// NaN); a collective error; a gradient the kernels cannot read (see [`ops::sum_squares`]).
pub fn total_grad_norm_p(model: &FsdpModel, norm_type: f64) -> Result<f32> {
    model.in_phase(Phase::Optimizer, None, check_synced)?;
    if norm_type.is_nan() || norm_type <= 0.0 {
        return Err(Error::value(
            "gradient norm_type",
            "> 0 or infinity",
            norm_type,
        ));
    }
    let local = local_part(model, norm_type)? as f32;
    let op = if norm_type.is_infinite() {
        ReduceOp::Max
    } else {
        ReduceOp::Sum
    };
    let total = if model.config().sharding_strategy == ShardingStrategy::NoShard
        || model.process_group().world_size() == 1
    {
        local
    } else {
        model.in_phase(Phase::Optimizer, None, |m| {
            all_reduce(m.process_group().as_ref(), local, op)
        })?
    };
    Ok(if norm_type.is_infinite() {
        total
    } else if norm_type == 2.0 {
        total.sqrt()
    } else {
        (f64::from(total).powf(1.0 / norm_type)) as f32
    })
}

/// Clips gradients so that their total L2 norm is at most `max_norm` and returns the total
/// norm before clipping (a collective); [`clip_grad_norm_with`] with the default options.
///
/// Errors: as [`clip_grad_norm_with`].
pub fn clip_grad_norm(model: &mut FsdpModel, max_norm: f32) -> Result<f32> {
    clip_grad_norm_with(model, max_norm, ClipOptions::default())
}

/// Clips gradients so that their total `opts.norm_type`-norm is at most `max_norm` and returns
/// the total norm before clipping (a collective), as PyTorch's `clip_grad_norm_`:
/// `coef = max_norm / (norm + 1e-6)`, and when `coef < 1` every gradient is multiplied by it
/// ([`ops::scale_`], in place). A non-finite norm leaves the gradients alone and is returned
/// (the grad scaler then skips the step), or is an error with `opts.error_if_nonfinite`.
///
/// Errors: gradient sync is off (called between no-sync micro-batches, the gradient is
/// partial); a non-finite norm with `error_if_nonfinite` (naming the norm and p); as
/// [`total_grad_norm_p`].
pub fn clip_grad_norm_with(model: &mut FsdpModel, max_norm: f32, opts: ClipOptions) -> Result<f32> {
    let norm = total_grad_norm_p(model, opts.norm_type)?;
    if !norm.is_finite() {
        if opts.error_if_nonfinite {
            let e = Error::InvalidArgument(format!(
                "the total gradient {}-norm is {norm}: non-finite, gradients not clipped \
                 (error_if_nonfinite)",
                opts.norm_type
            ));
            return model.in_phase(Phase::Optimizer, None, |_| Err(e));
        }
        return Ok(norm);
    }
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        for v in model.shards() {
            if let Some(g) = v.grad {
                ops::scale_(g, coef)?;
            }
        }
    }
    Ok(norm)
}
