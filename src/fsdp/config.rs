//! Configuration of the runtime: sharding strategy, prefetch modes and [`FsdpConfig`] (plain data,
//! like FSDP2's `_fsdp_api.py`).

use candle_core::Device;

use crate::error::{Error, Result};
use crate::mixed_precision::MixedPrecision;

/// How parameters, gradients and optimizer state are sharded (PyTorch's `ShardingStrategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ShardingStrategy {
    /// Parameters, gradients and optimizer state sharded; parameters resharded after forward
    /// (gathered again for backward). ZeRO-3.
    #[default]
    FullShard,
    /// Parameters kept unsharded from forward to the end of that unit's backward; gradients and
    /// optimizer state sharded. ZeRO-2.
    ShardGradOp,
    /// Nothing sharded: every rank holds all parameters; gradients all-reduced (DDP).
    NoShard,
}

impl std::str::FromStr for ShardingStrategy {
    type Err = Error;

    /// Parses `full-shard`, `shard-grad-op` or `no-shard` (PyTorch's `FULL_SHARD`,
    /// `SHARD_GRAD_OP`, `NO_SHARD` also accepted, in any case).
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "full-shard" => Ok(ShardingStrategy::FullShard),
            "shard-grad-op" => Ok(ShardingStrategy::ShardGradOp),
            "no-shard" => Ok(ShardingStrategy::NoShard),
            _ => Err(Error::InvalidArgument(format!(
                "unknown sharding strategy {s:?}: expected full-shard, shard-grad-op or no-shard"
            ))),
        }
    }
}

/// When the backward pass issues the all-gather of the next unit to run backward (PyTorch's
/// `BackwardPrefetch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackwardPrefetch {
    /// Before the current unit's backward computes (more overlap, one more unit unsharded).
    #[default]
    BackwardPre,
    /// After the current unit's gradients are computed and its parameters freed.
    BackwardPost,
    /// Only when the unit is needed (no overlap of backward all-gathers).
    None,
}

/// Runtime configuration.
#[derive(Debug, Clone)]
pub struct FsdpConfig {
    /// Sharding strategy.
    pub sharding_strategy: ShardingStrategy,
    /// Seed of the deterministic initialisation ([`crate::init`]).
    pub seed: u64,
    /// Device of the shards, gradients, optimizer state and compute: must be the process
    /// group's own [`crate::comm::ProcessGroup::device`] (checked at build; on a GPU, each rank's
    /// Candle device with its compute stream). Default: the CPU.
    pub device: Device,
    /// Issue unit k+1's all-gather before unit k's forward computes.
    pub forward_prefetch: bool,
    /// When backward issues the next unit's all-gather (PyTorch's `BackwardPrefetch`).
    pub backward_prefetch: BackwardPrefetch,
    /// Rate limiter (PyTorch's `limit_all_gathers`): at most this many units hold unsharded
    /// parameters at once because of prefetching; a prefetch that would exceed it is issued
    /// later, when the unit is needed. `None` disables the limit. The limit bounds prefetching
    /// only: under SHARD_GRAD_OP every unit stays unsharded from its forward to its backward by
    /// definition. Default `Some(2)`.
    pub limit_all_gathers: Option<usize>,
    /// Tensors whose name ends with `.<suffix>` for one of these suffixes are **buffers**, not
    /// parameters: replicated on every rank (not sharded), never given gradients, updated in
    /// place by the module (e.g. BatchNorm's running statistics). Default: `running_mean`,
    /// `running_var`, `num_batches_tracked`.
    pub buffer_suffixes: Vec<String>,
    /// Mixed-precision policy of every unit that sets none of its own
    /// ([`crate::unit::UnitSpec::with_mixed_precision`]). Units holding batch-norm statistics
    /// (a `running_mean` buffer) keep f32 compute unless they set their own policy, as PyTorch
    /// FSDP does for batch norm.
    pub mixed_precision: MixedPrecision,
    /// A per-rank memory budget checked before any shard is allocated (`None`: no check). See
    /// [`super::MemoryBudget`] and [`super::FsdpModel::memory_plan`].
    pub memory_budget: Option<super::MemoryBudget>,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        Self {
            sharding_strategy: ShardingStrategy::FullShard,
            seed: 0,
            device: Device::Cpu,
            forward_prefetch: true,
            backward_prefetch: BackwardPrefetch::BackwardPre,
            limit_all_gathers: Some(2),
            buffer_suffixes: ["running_mean", "running_var", "num_batches_tracked"]
                .map(String::from)
                .to_vec(),
            mixed_precision: MixedPrecision::default(),
            memory_budget: None,
        }
    }
}
