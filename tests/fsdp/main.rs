//! The FSDP runtime: parity with single-process Candle, any forward, tied and frozen parameters,
//! mixed precision, dropout, prefetch and streams, memory budget, buffers, misuse and step
//! errors, SyncBatchNorm, the GPT model.
//!
//! One test binary per area (a binary links the whole crate once); one module per feature.
//! `user_gpt` (tests/common/user_gpt.rs): a GPT written the way Candle users write it and the
//! harness comparing it trained with candle-fsdp against plain Candle, shared by the modules.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/user_gpt.rs"]
mod user_gpt;

mod any_forward;
mod budget;
mod buffers;
mod dropout;
mod empty_batch;
mod fingerprint;
mod flat_param;
mod frozen;
mod fused_linear;
mod fused_unit;
#[cfg(feature = "gpt")]
mod gpt;
mod hybrid;
mod misuse;
mod mixed_precision;
mod overlap;
mod parity;
mod refill;
mod step_errors;
mod streams;
mod sync_batch_norm;
