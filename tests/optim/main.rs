//! Optimizers and their kernels: torch.optim semantics per parameter, the CPU kernels against their references.
//!
//! One test binary per area (a binary links the whole crate once); one module per topic.

#[path = "../common/mod.rs"]
mod common;

mod bf16_state;
mod kernels;
mod optim_semantics;
