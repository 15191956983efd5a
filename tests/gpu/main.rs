//! GPU tests (feature `cuda`): every test here needs a GPU and is `#[ignore]`d so that
//! `cargo test` passes on machines without one; `scripts/gpu-check.sh` runs them with
//! `--ignored` on a CUDA machine.
//!
//! - `kernels`: each kernel of `kernels/` against its CPU reference;
//! - `comm`: the thread backend on CUDA tensors (2 and 4 ranks on one GPU) and the NCCL group
//!   at world size 1;
//! - `fsdp`: FSDP at world size 1 against plain Candle CUDA, multi-rank sharding on one GPU,
//!   parameters freed after each unit's forward (the CUDA allocator's counters), host↔device
//!   copies on the step path.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/parity.rs"]
mod parity;

mod comm;
mod fsdp;
mod kernels;

/// The GPU the tests use: `CANDLE_FSDP_TEST_GPU` (default 0).
pub fn gpu() -> usize {
    std::env::var("CANDLE_FSDP_TEST_GPU")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}
