//! The FSDP runtime: parity with single-process Candle, any forward, tied and frozen parameters, mixed precision, prefetch and streams, memory budget, buffers, misuse and step errors, SyncBatchNorm, the GPT model.
//!
//! One test binary per area (a binary links the whole crate once); one module per former file.

#[path = "../common/mod.rs"]
mod common;

mod any_forward;
mod budget;
mod buffers;
mod empty_batch;
mod fingerprint;
mod flat_param;
mod fused_unit;
#[cfg(feature = "gpt")]
mod gpt;
mod hybrid;
mod misuse;
mod mixed_precision;
mod new_user;
mod overlap;
mod parity;
mod refill;
mod step_errors;
mod streams;
mod sync_batch_norm;
