//! What users run beside the library: fsdp-ckpt, fsdp-run, the timeline pictures, the data loaders and metrics.
//!
//! One test binary per area (a binary links the whole crate once); one module per former file.

#[path = "../common/mod.rs"]
mod common;

#[cfg(feature = "cli")]
mod ckpt_tool;
mod data;
#[cfg(feature = "cli")]
mod fsdp_run;
#[cfg(feature = "mnist")]
mod metrics;
#[cfg(feature = "timeline")]
mod timeline;
