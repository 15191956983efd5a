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
