//! The per-rank memory plan of a model and the budget check (`FsdpConfig::memory_budget`,
//! `--max-memory-per-rank`): the runtime's own accounting of what one training step holds on a
//! rank, checked before any shard is allocated so that a configuration that cannot fit fails
//! fast, with the numbers.
//!
//! The formula (bytes per rank at world size W, FULL_SHARD; `shard = ceil(numel / W)` per
//! group, `padded = W · shard`):
//! - sharded state: `4 · Σ shard` (f32 master shards; a packed frozen group's packed bytes) `+ 4 · Σ' shard` (f32 gradient shards)
//!   `+ b_opt · Σ' shard` (optimizer: 8 for AdamW's two moments), Σ' over trainable groups —
//!   PyTorch FSDP's `(params + grads + optimizer state) / world size`, 16 bytes per parameter
//!   for f32 AdamW (Rajbhandari et al., *ZeRO*, 2020, §3);
//! - unsharded in flight: for the `limit_all_gathers` (default 2) largest groups, the gathered
//!   buffer and the step's parameter variables, `2 · padded · bytes(param_dtype)` each; plus,
//!   for the largest trainable group in backward, its f32 flat gradient, its `reduce_dtype` cast
//!   and the parameter gradients, `padded · (4 + bytes(reduce_dtype) + bytes(param_dtype))`.
//!   SHARD_GRAD_OP and NO_SHARD keep every group unsharded from forward to backward:
//!   `Σ padded · bytes(param_dtype)` plus one gathered buffer and the backward part;
//! - activations: what the caller measured for one step on one rank (e.g. a probe forward of
//!   one block under [`crate::alloc::Counting`], times the number of blocks).

use std::fmt;

use super::config::{FsdpConfig, ShardingStrategy};
use crate::error::{Error, Result};
use crate::flat_param::FlatParamLayout;
use crate::mixed_precision::MixedPrecision;
use crate::quant::BaseDType;

/// A per-rank memory budget, checked by [`crate::FsdpModelBuilder::build`] before any shard is
/// allocated (see the module docs for the formula).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryBudget {
    /// Bytes one rank may hold for training.
    pub max_bytes_per_rank: usize,
    /// Optimizer state per trainable parameter element, bytes: 8 for AdamW (two f32 moments),
    /// 4 for SGD with momentum, 0 for plain SGD.
    pub optimizer_bytes_per_element: usize,
    /// Activations one training step keeps on one rank, bytes (measured by the caller).
    pub activation_bytes: usize,
}

/// What one rank holds in one training step, by part (bytes; see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryPlan {
    /// The world size the plan is for.
    pub world_size: usize,
    /// f32 master shards of every group.
    pub param_shard_bytes: usize,
    /// f32 gradient shards of the trainable groups.
    pub grad_shard_bytes: usize,
    /// Optimizer state of the trainable groups.
    pub optimizer_bytes: usize,
    /// Unsharded parameters, variables and flat gradients in flight.
    pub unsharded_bytes: usize,
    /// Activations (the caller's measurement).
    pub activation_bytes: usize,
}

impl MemoryPlan {
    /// Sharded state: parameters, gradients and optimizer state.
    pub fn sharded_bytes(&self) -> usize {
        self.param_shard_bytes + self.grad_shard_bytes + self.optimizer_bytes
    }

    /// Everything.
    pub fn total_bytes(&self) -> usize {
        self.sharded_bytes() + self.unsharded_bytes + self.activation_bytes
    }
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} B per rank at world size {} = parameter shards {} + gradient shards {} + \
             optimizer state {} + unsharded in flight {} + activations {}",
            self.total_bytes(),
            self.world_size,
            self.param_shard_bytes,
            self.grad_shard_bytes,
            self.optimizer_bytes,
            self.unsharded_bytes,
            self.activation_bytes
        )
    }
}

/// The sizes of one parameter group that the plan needs (independent of the world size).
#[derive(Debug, Clone, Copy)]
pub(crate) struct GroupSize {
    /// Elements of parameters and alignment gaps, before padding.
    unpadded: usize,
    param_bytes: usize,
    reduce_bytes: usize,
    frozen: bool,
    /// Storage of the shard and of the all-gather (`F32` unless a frozen group is packed).
    storage: BaseDType,
}

impl GroupSize {
    /// The sizes of one group; `storage` is the format its shard is kept in (a packed frozen
    /// twin's, else `F32`).
    pub(crate) fn of(
        layout: &FlatParamLayout,
        policy: &MixedPrecision,
        frozen: bool,
        storage: BaseDType,
    ) -> Self {
        Self {
            unpadded: layout.unpadded_numel,
            param_bytes: policy.param_dtype.size_in_bytes(),
            reduce_bytes: policy.reduce_dtype.size_in_bytes(),
            frozen,
            storage,
        }
    }

    /// Bytes of `numel` stored elements (whole blocks of a packed format).
    fn stored_bytes(&self, numel: usize) -> usize {
        let b = self.storage.block();
        self.storage.packed_bytes(numel.div_ceil(b) * b)
    }
}

/// The plan of `groups` at world size `ws` under `config`.
pub(crate) fn plan(
    groups: &[GroupSize],
    config: &FsdpConfig,
    ws: usize,
    budget: &MemoryBudget,
) -> MemoryPlan {
    let sharded = config.sharding_strategy != ShardingStrategy::NoShard;
    let shard = |g: &GroupSize| {
        if sharded {
            g.unpadded.div_ceil(ws)
        } else {
            g.unpadded
        }
    };
    let padded = |g: &GroupSize| {
        if sharded {
            g.unpadded.div_ceil(ws) * ws
        } else {
            g.unpadded
        }
    };
    let stored: usize = groups.iter().map(|g| g.stored_bytes(shard(g))).sum();
    let trainable: usize = groups.iter().filter(|g| !g.frozen).map(shard).sum();
    // Per group in flight: the gathered buffer and the step's parameter tensors
    // (`2 · padded · param_bytes`), plus a packed group's gathered packed bytes.
    let mut gathered: Vec<usize> = groups
        .iter()
        .map(|g| {
            let packed = match g.storage {
                BaseDType::F32 => 0,
                _ => g.stored_bytes(padded(g)),
            };
            2 * padded(g) * g.param_bytes + packed
        })
        .collect();
    gathered.sort_unstable_by(|a, b| b.cmp(a));
    let backward = groups
        .iter()
        .filter(|g| !g.frozen)
        .map(|g| padded(g) * (4 + g.reduce_bytes + g.param_bytes))
        .max()
        .unwrap_or(0);
    let in_flight = if config.sharding_strategy.reshards_after_forward() {
        let depth = config.limit_all_gathers.unwrap_or(2).max(1);
        gathered.iter().take(depth).sum::<usize>()
    } else {
        (gathered.iter().sum::<usize>() + gathered.first().copied().unwrap_or(0)) / 2
    };
    // A partial reshard after forward keeps 1/k of every group from its forward to its backward.
    let kept = match config.reshard_after_forward_ranks {
        Some(k) if k > 0 && k < ws && config.sharding_strategy.reshards_after_forward() => {
            gathered.iter().sum::<usize>() / 2 / k
        }
        _ => 0,
    };
    MemoryPlan {
        world_size: ws,
        param_shard_bytes: stored,
        grad_shard_bytes: 4 * trainable,
        optimizer_bytes: budget.optimizer_bytes_per_element * trainable,
        unsharded_bytes: in_flight + backward + kept,
        activation_bytes: budget.activation_bytes,
    }
}

/// Fails when the plan at world size `ws` exceeds the budget, with the breakdown and the
/// smallest world size that would fit (if any up to 4096).
pub(crate) fn check(
    groups: &[GroupSize],
    config: &FsdpConfig,
    ws: usize,
    budget: &MemoryBudget,
) -> Result<()> {
    let p = plan(groups, config, ws, budget);
    if p.total_bytes() <= budget.max_bytes_per_rank {
        return Ok(());
    }
    let fits = (ws + 1..=4096)
        .find(|&w| plan(groups, config, w, budget).total_bytes() <= budget.max_bytes_per_rank);
    let hint = match fits {
        Some(w) => format!("it fits from world size {w} on"),
        None => "no world size up to 4096 fits it: the unsharded units in flight and the \
                 activations alone exceed the budget (shrink the largest unit, the batch or \
                 limit_all_gathers)"
            .to_string(),
    };
    Err(Error::InvalidArgument(format!(
        "memory budget exceeded: the model needs {p}, more than the budget of {} B per rank; \
         {hint}",
        budget.max_bytes_per_rank
    )))
}
