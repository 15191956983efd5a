//! What the examples share: the training loop's pieces, its command-line flags and the MNIST
//! data.
//!
//! An example supplies only what is its own: its model's units, its optimizer and learning-rate
//! schedule, its evaluation, its banner and final line. Everything else lives here and uses the
//! crate's public API only:
//!
//! - [`args`]: [`TrainArgs`], the flags every example takes (world size, seed, batch, learning
//!   rate, strategy, precision, accumulation, clipping, prefetch, trace, checkpoints), [`parse`]
//!   with per-example defaults, and [`setup`], which checks every flag and output path before
//!   any work and splits the cores between the ranks;
//! - [`trainer`]: what any loop needs, [`trainer::Trainer`] (one rank's model, optimizer, grad
//!   scaler, tracer and step, with resume, micro-batch, optimizer step, save and report),
//!   [`trainer::run_job`] (ranks + trace) and [`print_checkpoint`], the last lines (the newest
//!   checkpoint and the `fsdp-ckpt export` command for it);
//! - [`train`](mod@train): the MNIST examples' epoch loop, [`Job`] (the example's part) and
//!   [`train()`], which returns rank 0's [`train::Outcome`];
//! - [`data`]: [`load_mnist`], MNIST as the loop and the evaluation want it;
//! - [`trace_window`]: which steps `--trace` records (shorter warm-up in a short run).
//!
//! The MNIST examples include this folder with `mod common;`, the GPT example (a folder itself)
//! with `#[path = "../common/mod.rs"]`.

pub mod alloc;
pub mod args;
pub mod data;
pub mod trace_window;
pub mod train;
pub mod trainer;

pub use args::{parse, setup, Defaults, TrainArgs};
pub use data::load_mnist;
pub use train::{train, Job};
pub use trainer::{print_checkpoint, print_peak_rss};

// Every step allocates and frees MB-sized buffers (gathered parameters, gradients); glibc's
// malloc returns them to the kernel and pays page faults on each reuse, mimalloc keeps them
// (design/decisions.md, decision 10).
// Counted, so that the GPT example can measure its activation estimate (`candle_fsdp::alloc`),
// each thread counting into its own stripe and comparing with the peak once per 64 KiB of
// growth (exact per-allocation counting cost the MNIST step about 8 %); large blocks from the
// shared arena under the shared-memory backend (`fsdp-run --nproc-per-node N`), whose
// collectives then read peers' tensors in place.
#[global_allocator]
static GLOBAL: candle_fsdp::alloc::Counting<
    candle_fsdp::alloc::SharedLarge<mimalloc::MiMalloc>,
    65536,
> = candle_fsdp::alloc::Counting(candle_fsdp::alloc::SharedLarge(mimalloc::MiMalloc));
