//! Checkpoints: sharded save/load at any world size, full state dicts, resume, what is saved and restored.
//!
//! One test binary per area (a binary links the whole crate once); one module per topic.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/user_gpt.rs"]
mod user_gpt;

mod async_save;
mod full;
mod resume;
mod semantics;
mod sharded;
