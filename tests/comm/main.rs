//! Process groups: collectives against a reference, failures (a rank that dies, times out or exits), the TCP store, the GPU path's host-side pieces.
//!
//! One test binary per area (a binary links the whole crate once); one module per topic.

#[path = "../common/mod.rs"]
mod common;

mod collectives;
mod failure;
mod gpu_comm_host;
mod shm;
mod store;
mod tcp;

// The shared-memory backend's ranks (this binary, re-executed) read each other's large
// tensors in place from their arenas (`candle_fsdp::alloc::SharedLarge`); smaller ones, and
// tensors made before the group, through the segments.
#[global_allocator]
static GLOBAL: candle_fsdp::alloc::SharedLarge =
    candle_fsdp::alloc::SharedLarge(std::alloc::System);
