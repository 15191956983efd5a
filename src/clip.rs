//! Gradient clipping by total L2 norm over all shards of all ranks.
//!
//! The gradients are read and scaled through the model's accessor ([`FsdpModel::shards`]) with
//! the kernels of [`crate::ops`], in place on their device.

use crate::comm::{ProcessGroup, ProcessGroupExt, ReduceOp};
use crate::error::{Phase, Result};
use crate::fsdp::{FsdpModel, ShardingStrategy};
use crate::ops;

/// Sum of squared gradient elements held by this rank's shards, accumulated in f64 (each
/// unit's sum, then the units in order) and returned as f32 (padding elements are zero and add
/// nothing).
fn local_sq_norm(model: &FsdpModel) -> Result<f32> {
    let mut s = 0f64;
    for v in model.shards() {
        if let Some(g) = v.grad {
            s += ops::sum_squares(g)?;
        }
    }
    Ok(s as f32)
}

/// Sum all-reduce of one f32 across the group (the one collective of clipping).
fn all_reduce_sum(pg: &dyn ProcessGroup, v: f32) -> Result<f32> {
    Ok(pg.all_reduce_f32s(vec![v], ReduceOp::Sum)?[0])
}

/// Total L2 norm of all gradients of the model, over every rank's shards (a collective: one
/// all-reduce of one f32). Under NO_SHARD every rank holds the whole gradient, so no
/// reduction is needed and none is done.
///
/// Errors: a collective error; a gradient the kernels cannot read (see [`ops::sum_squares`]).
pub fn total_grad_norm(model: &FsdpModel) -> Result<f32> {
    let local = local_sq_norm(model)?;
    let sq = if model.config().sharding_strategy == ShardingStrategy::NoShard
        || model.process_group().world_size() == 1
    {
        local
    } else {
        all_reduce_sum(model.process_group().as_ref(), local)
            .map_err(|e| model.at(e, None, Phase::Optimizer))?
    };
    Ok(sq.sqrt())
}

/// Clips gradients so that their total L2 norm is at most `max_norm` and returns the total norm
/// before clipping (a collective), as PyTorch's `FSDP.clip_grad_norm_` /
/// `torch.nn.utils.clip_grad_norm_`: `coef = max_norm / (norm + 1e-6)`, and when `coef < 1`
/// every gradient is multiplied by it ([`ops::scale_`], in place). A non-finite norm is
/// returned unchanged and the gradients are left alone (the grad scaler then skips the step).
///
/// Errors: as [`total_grad_norm`].
pub fn clip_grad_norm(model: &mut FsdpModel, max_norm: f32) -> Result<f32> {
    let norm = total_grad_norm(model)?;
    let coef = max_norm / (norm + 1e-6);
    if norm.is_finite() && coef < 1.0 {
        for v in model.shards() {
            if let Some(g) = v.grad {
                ops::scale_(g, coef)?;
            }
        }
    }
    Ok(norm)
}
