//! candle-fsdp: FSDP-style sharded-parameter data-parallel training for Candle.
//!
//! A model is a sequence of *units*, each an ordinary candle-nn constructor
//! (`Fn(VarBuilder) -> candle::Result<M>`). [`FsdpModel`] records each unit's parameters,
//! flattens them into one padded FlatParameter ([`flat_param`]) and keeps only this rank's
//! shard; [`FsdpModel::forward`] / [`FsdpModel::backward`] all-gather a unit's parameters before
//! it runs, free them after, and reduce-scatter its gradients on a dedicated comm stream
//! ([`comm`]). Sharded optimizers ([`optim`]) then step the local shards.
//!
//! See `design/architecture.md` for the architecture and the life of one training step.

#![warn(missing_docs)]

pub mod checkpoint;
pub mod clip;
pub mod comm;
pub mod data;
pub mod error;
pub mod flat_param;
pub mod fsdp;
pub mod grad_scaler;
pub mod init;
pub mod mixed_precision;
pub mod models;
pub mod optim;
pub mod sync_batch_norm;
pub mod timeline;
pub mod trace;
pub mod unit;

pub use error::{Error, Result};
pub use fsdp::{BackwardPrefetch, FsdpConfig, FsdpModel, FullModel, MemoryStats, ShardingStrategy};
pub use mixed_precision::MixedPrecision;
pub use optim::{AdamW, AdamWConfig, OptimizerState, Sgd, SgdConfig, ShardedOptimizer};
pub use sync_batch_norm::{sync_batch_norm, SyncBatchNorm};
