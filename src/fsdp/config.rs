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
    /// FULL_SHARD inside *shard groups* of `shard_size` consecutive ranks, replicated across
    /// them (PyTorch's `HYBRID_SHARD`, FSDP2's 2-D mesh): parameters are all-gathered inside
    /// the shard group, gradients reduce-scattered inside it and then all-reduced across the
    /// replicas (the ranks of equal position in every shard group), optimizer state sharded
    /// inside the group. `shard_size` must divide the world size; `None` takes the ranks of
    /// one machine (`LOCAL_WORLD_SIZE`, or mpirun's local size; the whole world when the job
    /// runs on one machine), resolved at build (the model's `config()` shows the size). See
    /// `design/fsdp.md`.
    HybridShard {
        /// Ranks of one shard group (`None`: ranks per machine).
        shard_size: Option<usize>,
    },
    /// [`ShardingStrategy::HybridShard`] with SHARD_GRAD_OP inside the shard group (FSDP1's
    /// `_HYBRID_SHARD_ZERO2`): parameters kept unsharded from forward to backward.
    HybridShardGradOp {
        /// Ranks of one shard group (`None`: ranks per machine).
        shard_size: Option<usize>,
    },
}

impl ShardingStrategy {
    /// True for the two hybrid strategies.
    pub fn is_hybrid(self) -> bool {
        matches!(
            self,
            ShardingStrategy::HybridShard { .. } | ShardingStrategy::HybridShardGradOp { .. }
        )
    }

    /// The requested shard-group size of a hybrid strategy (`None` otherwise, or when it
    /// defaults to the ranks per machine).
    pub fn shard_size(self) -> Option<usize> {
        match self {
            ShardingStrategy::HybridShard { shard_size }
            | ShardingStrategy::HybridShardGradOp { shard_size } => shard_size,
            _ => None,
        }
    }

    /// The same strategy with the shard-group size set to `n` (a no-op for the non-hybrid
    /// strategies).
    pub fn with_shard_size(self, n: Option<usize>) -> Self {
        match self {
            ShardingStrategy::HybridShard { .. } => ShardingStrategy::HybridShard { shard_size: n },
            ShardingStrategy::HybridShardGradOp { .. } => {
                ShardingStrategy::HybridShardGradOp { shard_size: n }
            }
            s => s,
        }
    }

    /// True when parameters are freed after forward and gathered again for backward
    /// (FULL_SHARD, HYBRID_SHARD).
    pub fn reshards_after_forward(self) -> bool {
        matches!(
            self,
            ShardingStrategy::FullShard | ShardingStrategy::HybridShard { .. }
        )
    }
}

impl std::str::FromStr for ShardingStrategy {
    type Err = Error;

    /// Parses `full-shard`, `shard-grad-op`, `no-shard`, `hybrid-shard` or
    /// `hybrid-shard-grad-op` (PyTorch's `FULL_SHARD`, `SHARD_GRAD_OP`, `NO_SHARD`,
    /// `HYBRID_SHARD`, `_HYBRID_SHARD_ZERO2` also accepted, in any case); a hybrid name may end
    /// with `:N`, the shard-group size (`hybrid-shard:4`).
    fn from_str(s: &str) -> Result<Self> {
        let norm = s.to_ascii_lowercase().replace('_', "-");
        let (name, size) = match norm.split_once(':') {
            Some((n, k)) => {
                let k: usize = k.trim().parse().ok().filter(|&k| k > 0).ok_or_else(|| {
                    Error::value(
                        format!("sharding strategy {s:?}: the shard size after ':'"),
                        "a positive integer",
                        format!("{:?}", k.trim()),
                    )
                })?;
                (n.trim().to_string(), Some(k))
            }
            None => (norm, None),
        };
        let strategy = match name.trim_start_matches('-') {
            "full-shard" => ShardingStrategy::FullShard,
            "shard-grad-op" => ShardingStrategy::ShardGradOp,
            "no-shard" => ShardingStrategy::NoShard,
            "hybrid-shard" => ShardingStrategy::HybridShard { shard_size: size },
            "hybrid-shard-grad-op" | "hybrid-shard-zero2" => {
                ShardingStrategy::HybridShardGradOp { shard_size: size }
            }
            _ => {
                return Err(Error::value(
                    "sharding strategy",
                    "full-shard, shard-grad-op, no-shard, hybrid-shard or hybrid-shard-grad-op",
                    format!("{s:?}"),
                ))
            }
        };
        if size.is_some() && !strategy.is_hybrid() {
            return Err(Error::conflict(
                format!("sharding strategy {s:?}"),
                "a shard size",
                "only hybrid-shard and hybrid-shard-grad-op take one",
            ));
        }
        Ok(strategy)
    }
}

impl std::fmt::Display for ShardingStrategy {
    /// The name [`std::str::FromStr`] parses back: `full-shard`, `shard-grad-op`, `no-shard`,
    /// `hybrid-shard[:N]`, `hybrid-shard-grad-op[:N]`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            ShardingStrategy::FullShard => "full-shard",
            ShardingStrategy::ShardGradOp => "shard-grad-op",
            ShardingStrategy::NoShard => "no-shard",
            ShardingStrategy::HybridShard { .. } => "hybrid-shard",
            ShardingStrategy::HybridShardGradOp { .. } => "hybrid-shard-grad-op",
        };
        match self.shard_size() {
            Some(n) => write!(f, "{name}:{n}"),
            None => f.write_str(name),
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

/// Whether a unit's reduce-scatters get a comm stream of their own or share the all-gathers'
/// ([`FsdpConfig::comm_streams`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CommStreams {
    /// PyTorch FSDP's layout: one stream (on the CPU, one thread a rank) for the all-gathers
    /// and one for the reduce-scatters, so that the next unit's gather in backward never waits
    /// behind a reduction.
    Separate,
    /// The reduce-scatters run on the all-gathers' stream, in issue order: one comm thread a
    /// rank fewer. Where every core already runs a rank, the second thread could only take
    /// time from the compute and the first (BENCHMARKS §22: the MNIST MLP at world size 2 on 2
    /// cores, 0.90–1.20 → 0.67–0.87 s an epoch; the GPT step unchanged).
    Shared,
    /// `Shared` for the thread backend on the CPU when the cores this rank may use
    /// (`std::thread::available_parallelism()`) are no more than the job's ranks (all threads
    /// of this process); `Separate` otherwise, and for the other backends. Decided by each rank
    /// when the model is built and compared in the build's agreement (ranks pinned to
    /// different core counts fail there, naming the field, rather than at the streams).
    #[default]
    Auto,
}

impl CommStreams {
    /// `Separate` or `Shared`: what `Auto` means for a rank of the world group `world` (see
    /// [`CommStreams::Auto`]); the others as they are.
    pub fn resolve(self, world: &dyn crate::comm::ProcessGroup) -> CommStreams {
        if self != CommStreams::Auto {
            return self;
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = world.backend() == "threads" && world.device().is_cpu();
        match threads && cores <= world.world_size() {
            true => CommStreams::Shared,
            false => CommStreams::Separate,
        }
    }
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
    /// Partial reshard after forward (FSDP2's `reshard_after_forward=int`, ZeRO++'s hpZ), for
    /// the strategies that reshard after forward (FULL_SHARD, HYBRID_SHARD): `Some(k)` keeps,
    /// between a unit's forward and its backward, the unit's gathered parameters sharded over
    /// groups of `k` consecutive ranks of the shard group (each rank holds `1/k` of them,
    /// copied from the forward's all-gather) instead of freeing them, so that the backward's
    /// all-gather runs inside that smaller group (one machine, or one switch). Memory between
    /// FULL_SHARD's (nothing kept) and SHARD_GRAD_OP's (everything kept): `1/k` of every unit
    /// waiting for its backward. `k` must divide the shard group's size; `k` = the shard group's
    /// size is plain FULL_SHARD; `None` (default) too. Ignored by SHARD_GRAD_OP, NO_SHARD and
    /// units with `reshard_after_forward` off.
    pub reshard_after_forward_ranks: Option<usize>,
    /// A per-rank memory budget checked before any shard is allocated (`None`: no check). See
    /// [`super::MemoryBudget`] and [`super::FsdpModel::memory_plan`].
    pub memory_budget: Option<super::MemoryBudget>,
    /// Storage of frozen parameters (the frozen twins of [`crate::FsdpModelBuilder::freeze`] and
    /// [`crate::FsdpModelBuilder::train_only`], e.g. a LoRA run's base; `--base-dtype`): `F32`
    /// (default) keeps f32 shards; `Bf16`, `Int8` and `Nf4` ([`crate::quant`]) quantise each
    /// rank's shard once when the model is built (or a shard is loaded), keep it packed, move
    /// the packed bytes in the all-gather, and dequantise after the gather into the unit's
    /// `param_dtype` — 1/2, about 1/3.8 and about 1/7 of f32's shard memory and wire bytes.
    /// Frozen twins of the packed formats are padded so that each shard holds whole
    /// quantisation blocks (64 elements).
    pub frozen_storage: crate::quant::BaseDType,
    /// Run fingerprints ([`super::fingerprint`]): when set, every training step records a
    /// CRC-32C of each unit's gathered parameters, reduction input and output and shard after
    /// the optimizer step, and rank 0 writes them to this file (truncated at build), for
    /// `fsdp-ckpt diff`. `None` (default): nothing is recorded.
    pub fingerprint: Option<std::path::PathBuf>,
    /// The comm streams of the all-gathers and reduce-scatters ([`CommStreams`]). Default:
    /// `Auto`.
    pub comm_streams: CommStreams,
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
            reshard_after_forward_ranks: None,
            memory_budget: None,
            frozen_storage: crate::quant::BaseDType::F32,
            fingerprint: None,
            comm_streams: CommStreams::Auto,
        }
    }
}
