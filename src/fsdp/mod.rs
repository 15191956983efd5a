//! The FSDP runtime: a model whose parameter groups each hold only this rank's shard of their
//! FlatParameter, driven through sharded forward and backward passes.
//!
//! One concept a file (FSDP2's `_fully_shard/` split); design notes in `design/fsdp.md`:
//! - [`config`]: sharding strategy, prefetch modes, [`FsdpConfig`] — plain data;
//! - `spec`: what a model is built from ([`ModelSpec`]) and its callable units (`Member`);
//! - `build`: [`FsdpModelBuilder`] and `FsdpModel::build_with` as named steps (`check_device`
//!   → `record_groups` → `classify` → `plan_groups` → `allocate`; FSDP2's `_fsdp_init.py`);
//! - `model`: the [`FsdpModel`] struct, accessors, setters and context helpers;
//! - `step`: the step's `TrainingState` (`Idle`, `Forward`, `Eval`, `Backward`) and the
//!   calls a training forward records for its backward;
//! - `forward`: the [`Forward`] handle and the forwards; one call is `pre_forward` → `bind`
//!   → `run` → `post_forward`;
//! - `backward`: [`FsdpModel::backward`]; one call's backward is `pre_backward` →
//!   `backward_compute` (or `recompute`) → `post_backward` → `issue_reduction`;
//! - [`fused`]: the fused-node seam — a unit's forward as one graph node whose parameters'
//!   gradients are sent to the runtime past Candle's graph (public: users' own fused units);
//! - `call`: how unit calls join the caller's autograd graph (Candle custom ops), reaching the
//!   model only through the `CallBackward` trait;
//! - `scheduler`: the prefetcher — what to gather when (forward prefetch predicted from the
//!   previous step's call sequence, [`BackwardPrefetch`], `limit_all_gathers`) and the
//!   reductions in flight;
//! - `agreement`: the ranks agree on the model at build and on the gathers of every forward;
//! - `param_group`: one parameter group (`ParamGroup`, FSDP2's `FSDPParamGroup`) and its
//!   explicit state machine: `unshard`, `wait_for_unshard`, `reshard`, `pre_forward`,
//!   `post_backward`, `finalize`;
//! - `mesh`: HYBRID_SHARD's 2-D layout (shard groups × replica groups) over `new_group`;
//! - `collectives`: copy-in / all-gather / copy-out / reduce-scatter over buffers, the only
//!   place that turns gathered buffers into parameters and gradients into a reduce buffer;
//! - `storage`: free and refill a parameter's storage in place under a live autograd graph;
//! - [`memory`]: unsharded-memory accounting as guards tied to buffer lifetimes;
//! - [`budget`]: the per-rank memory plan and its check at build;
//! - `shard_view`: [`ShardView`] and [`FsdpModel::shards`], the accessor through which
//!   optimizers, clipping, the grad scaler and checkpoints see the shards (with
//!   [`FsdpModel::in_phase`], all they need of the model);
//! - `state_dict`: full-parameter gathering ([`FullModel`]);
//! - [`fingerprint`]: run fingerprints (a CRC-32C per step, unit, phase and rank) and their
//!   diff.
//!
//! Life of one training step under FULL_SHARD (see `design/fsdp.md`):
//! 1. [`FsdpModel::forward_with`] (or [`FsdpModel::forward`] for a chain): each
//!    [`Forward::call`] unshards the unit's groups just in time (the predicted next call's
//!    all-gather is issued before this one computes: forward prefetch), runs the unit with
//!    autograd on the step's parameter variables and joins it to the caller's graph as one
//!    node; a call's groups are resharded (their storage freed in place: the graph keeps its
//!    references, the memory is gone) when the next call starts, so the last call's
//!    parameters stay for the backward.
//! 2. The caller computes a loss from the outputs.
//! 3. [`FsdpModel::backward`]: one `loss.backward()` of Candle over the caller's graph. Each
//!    call's node runs the unit's backward when the gradients of all its outputs are complete:
//!    refill its parameters (the all-gather was prefetched one call ahead in reverse call
//!    order), back-propagate through the unit's own graph, add the gradients into the group's
//!    flat gradient, and after the group's last call issue its reduce-scatter (average over
//!    ranks) on the reduce-scatter stream (the all-gathers' with [`CommStreams::Shared`])
//!    without waiting. At the end every reduction is waited for and added into the f32
//!    gradient shards.
//!
//! SHARD_GRAD_OP and NO_SHARD keep the parameters from forward to backward instead; a unit with
//! activation checkpointing runs its forward without autograd and is recomputed in backward.

mod agreement;
mod backward;
pub mod budget;
mod build;
mod call;
mod collectives;
pub mod config;
pub mod fingerprint;
mod forward;
pub mod fused;
pub mod memory;
mod mesh;
mod model;
mod param_group;
mod scheduler;
mod shard_view;
mod spec;
mod state_dict;
mod step;
mod storage;

pub use budget::{MemoryBudget, MemoryPlan};
pub use build::FsdpModelBuilder;
pub use config::{BackwardPrefetch, CommStreams, FsdpConfig, ShardingStrategy};
pub use forward::Forward;
pub use memory::MemoryStats;
pub use model::FsdpModel;
pub use shard_view::ShardView;
pub use spec::ModelSpec;
pub use state_dict::FullModel;
