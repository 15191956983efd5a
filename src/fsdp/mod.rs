//! The FSDP runtime: a model made of units, each holding only this rank's shard of its
//! FlatParameter, driven through sharded forward and backward passes.
//!
//! One concept a file (FSDP2's `_fully_shard/` split):
//! - [`config`]: sharding strategy, prefetch modes, [`FsdpConfig`] — plain data;
//! - `unit_state`: one unit (`FsdpUnit`) and its explicit state machine (`unshard`,
//!   `wait_for_unshard`, `reshard`, `pre_backward`, `post_backward`);
//! - `collectives`: copy-in / all-gather / copy-out / reduce-scatter over buffers, the only
//!   place that turns gathered buffers into parameters and gradients into a reduce buffer;
//! - `storage`: free and refill a parameter's storage in place under a live autograd graph;
//! - `scheduler`: what to prefetch when (forward prefetch, [`BackwardPrefetch`],
//!   `limit_all_gathers`) and the reductions in flight;
//! - [`memory`]: unsharded-memory accounting as guards tied to buffer lifetimes;
//! - `model`: [`FsdpModel`], its builder and the short `forward` / `forward_eval` /
//!   `backward` schedules;
//! - `state_dict`: full-parameter gathering ([`FullModel`]).
//!
//! Life of one training step under FULL_SHARD (see `design/architecture.md` for the diagram):
//! 1. [`FsdpModel::forward`]: for each unit k in order, wait for its all-gather (unit k+1's is
//!    issued before unit k computes: forward prefetch), copy the gathered buffer into one
//!    autograd variable per parameter, run the unit with autograd on a detached copy of its
//!    input, then free the variables' storage in place (reshard): the graph keeps its references,
//!    the memory is gone. The last unit is not resharded: its backward follows at once.
//! 2. The caller computes a loss from the output.
//! 3. [`FsdpModel::backward`]: for each unit in reverse, refill its variables from an all-gather
//!    issued one unit ahead (backward prefetch), back-propagate (`loss.backward()` for the last
//!    unit, `sum(output · grad_output)` for the others), copy the parameter gradients into one
//!    flat buffer, free the parameters, and issue the reduce-scatter (average over ranks) on the
//!    reduce-scatter stream without waiting. At the end every reduction is waited for and added
//!    into the f32 gradient shards.
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
mod forward;
pub mod memory;
mod model;
mod scheduler;
mod spec;
mod state_dict;
mod step;
mod storage;
pub(crate) mod unit_state;

pub use budget::{MemoryBudget, MemoryPlan};
pub use build::FsdpModelBuilder;
pub use config::{BackwardPrefetch, FsdpConfig, ShardingStrategy};
pub use forward::Forward;
pub use memory::MemoryStats;
pub use model::FsdpModel;
pub use spec::ModelSpec;
pub use state_dict::FullModel;
pub(crate) use unit_state::FsdpUnit;
