//! candle-fsdp: FSDP-style sharded-parameter data-parallel training for Candle.
//!
//! A model is a sequence of *units*, each an ordinary candle-nn constructor
//! (`Fn(VarBuilder) -> candle::Result<M>`). [`FsdpModel`] records each unit's parameters,
//! flattens them into one padded FlatParameter ([`flat_param`]) and keeps only this rank's
//! shard; [`FsdpModel::forward`] / [`FsdpModel::backward`] all-gather a unit's parameters before
//! it runs, free them after, and reduce-scatter its gradients on a dedicated comm stream
//! ([`comm`]). Sharded optimizers ([`optim`]) then step the local shards.
//!
//! See `design/README.md` for the architecture (one file per topic; `design/step.md`: the life of one training step).
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use candle_fsdp::launch::{launch, Launcher};
//! use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, FsdpModel, ShardedOptimizer};
//!
//! // Two ranks as two threads of this process; each runs the closure with its process group.
//! let losses = launch(&Launcher::threads(2), |pg| {
//!     let mut model = FsdpModel::builder(pg.clone(), FsdpConfig::default())
//!         .unit("fc1", |vb| candle_nn::linear(8, 16, vb))
//!         .unit("fc2", |vb| candle_nn::linear(16, 4, vb))
//!         .build()?;
//!     let mut opt = AdamW::new(AdamWConfig::default());
//!     // This rank's part of the global batch.
//!     let x = Tensor::ones((3, 8), candle_core::DType::F32, &Device::Cpu)?;
//!     let y = Tensor::new(&[0u32, 1, 2], &Device::Cpu)?;
//!     let mut losses = Vec::new();
//!     for _ in 0..3 {
//!         let logits = model.forward(&x)?; // all-gathers each unit just in time
//!         let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
//!         model.backward(&loss)?; // reduce-scatters (averages) the gradients
//!         opt.step(&mut model)?; // steps this rank's shards only
//!         model.zero_grad();
//!         losses.push(loss.to_scalar::<f32>()?);
//!     }
//!     Ok(losses)
//! })?;
//! assert!(losses[0][2] < losses[0][0]);
//! # Ok::<(), candle_fsdp::Error>(())
//! ```

#![warn(missing_docs)]

pub mod alloc;
pub mod base;
pub mod checkpoint;
pub mod clip;
pub mod comm;
#[cfg(feature = "cli")]
pub mod config_file;
pub(crate) mod cpu;
pub mod data;
pub mod device;
pub mod error;
pub mod flat_param;
pub mod fsdp;
pub mod grad_scaler;
pub mod hf;
pub mod init;
pub mod kernels;
pub mod launch;
pub mod lora;
pub mod lr_scheduler;
#[cfg(feature = "mnist")]
pub mod metrics;
pub mod mixed_precision;
#[cfg(any(feature = "mnist", feature = "gpt", feature = "llama"))]
pub mod models;
pub mod nn;
pub mod ops;
pub mod optim;
pub mod quant;
pub mod sync_batch_norm;
#[cfg(feature = "timeline")]
pub mod timeline;
pub mod trace;
pub mod unit;

pub use error::{Error, Result};
pub use fsdp::{
    BackwardPrefetch, CommStreams, Forward, FsdpConfig, FsdpModel, FsdpModelBuilder, FullModel,
    MemoryBudget, MemoryPlan, MemoryStats, ModelSpec, ShardView, ShardingStrategy,
};
pub use lr_scheduler::{LrSchedule, LrScheduler, LrSchedulerState};
pub use mixed_precision::MixedPrecision;
pub use optim::{
    AdamW, AdamWConfig, BufferKind, OptimizerHyper, OptimizerKind, OptimizerState, ParamGroup, Sgd,
    SgdConfig, ShardedOptimizer, UnitOptimState,
};
pub use sync_batch_norm::{sync_batch_norm, SyncBatchNorm};
pub use unit::{UnitModule, UnitSpec};
