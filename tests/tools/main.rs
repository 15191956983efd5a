//! What users run beside the library: fsdp-ckpt, fsdp-run, the timeline pictures.
//!
//! One test binary per area (a binary links the whole crate once); one module per topic.
//! No test here may allocate much in this process: `ckpt_tool` measures the peak RSS of the
//! `fsdp-ckpt` children it spawns through `ru_maxrss`, and a child started by vfork + exec
//! (Rust's `Command` on glibc) is charged the parent's high-water mark at its exec. The data
//! loaders (which hold MNIST, 180 MiB) have a binary of their own for that reason.

#[path = "../common/mod.rs"]
mod common;

#[cfg(feature = "cli")]
mod ckpt_tool;
#[cfg(feature = "cli")]
mod config_file;
#[cfg(all(feature = "cli", feature = "mnist", feature = "timeline"))]
mod elastic;
#[cfg(feature = "cli")]
mod fsdp_run;
#[cfg(feature = "timeline")]
mod timeline;
