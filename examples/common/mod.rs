//! What the MNIST examples share: the training loop, its command-line flags and the data.
//!
//! An example supplies only what is its own: its model's units, its optimizer and learning-rate
//! schedule, its evaluation, its banner and final line. Everything else lives here and uses the
//! crate's public API only:
//!
//! - [`args`]: [`TrainArgs`], the flags every example takes (world size, epochs, seed, batch,
//!   learning rate, strategy, precision, accumulation, clipping, prefetch, trace, checkpoints),
//!   [`parse`] with per-example defaults, and [`setup`], which checks every flag and output path
//!   before any work and splits the cores between the ranks;
//! - [`train`](mod@train): [`Job`] (the example's part) and [`train()`], the loop every rank runs,
//!   which returns rank 0's [`train::Outcome`]; [`print_checkpoint`], the last lines (the newest
//!   checkpoint and the `fsdp-ckpt export` command for it);
//! - [`data`]: [`load_mnist`], MNIST as the loop and the evaluation want it.
//!
//! Each example includes this folder with `mod common;`.

pub mod args;
pub mod data;
pub mod train;

pub use args::{parse, setup, Defaults, TrainArgs};
pub use data::load_mnist;
pub use train::{print_checkpoint, train, Job};

// Every step allocates and frees MB-sized buffers (gathered parameters, gradients); glibc's
// malloc returns them to the kernel and pays page faults on each reuse, mimalloc keeps them
// (design/architecture.md, decision 10).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
