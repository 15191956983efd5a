//! Gradient clipping by total L2 norm over all shards of all ranks.

use crate::comm::{ProcessGroupExt, ReduceOp};
use crate::error::Result;
use crate::fsdp::{FsdpModel, ShardingStrategy};

/// Sum of squared gradient elements held by this rank's shards, accumulated in f64 and
/// returned as f32 (padding elements are zero and add nothing).
fn local_sq_norm(model: &FsdpModel) -> f32 {
    let mut s = 0f64;
    for u in model.units() {
        if let Some(g) = &u.flat.grad {
            s += g.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
        }
    }
    s as f32
}

/// Total L2 norm of all gradients of the model, over every rank's shards (a collective: one
/// all-reduce of one f32). Under NO_SHARD every rank holds the whole gradient, so no
/// reduction is needed and none is done.
pub fn total_grad_norm(model: &FsdpModel) -> Result<f32> {
    let local = local_sq_norm(model);
    let sq = if model.config().sharding_strategy == ShardingStrategy::NoShard
        || model.process_group().world_size() == 1
    {
        local
    } else {
        model
            .process_group()
            .all_reduce_f32s(vec![local], ReduceOp::Sum)?[0]
    };
    Ok(sq.sqrt())
}

/// Clips gradients so that their total L2 norm is at most `max_norm` and returns the total norm
/// before clipping (a collective), as PyTorch's `FSDP.clip_grad_norm_` /
/// `torch.nn.utils.clip_grad_norm_`: `coef = max_norm / (norm + 1e-6)`, and when `coef < 1`
/// every gradient is multiplied by it. A non-finite norm is returned unchanged and the
/// gradients are left alone (the grad scaler then skips the step).
pub fn clip_grad_norm(model: &mut FsdpModel, max_norm: f32) -> Result<f32> {
    let norm = total_grad_norm(model)?;
    let coef = max_norm / (norm + 1e-6);
    if norm.is_finite() && coef < 1.0 {
        for u in model.units_mut() {
            if let Some(g) = &mut u.flat.grad {
                g.iter_mut().for_each(|x| *x *= coef);
            }
        }
    }
    Ok(norm)
}
