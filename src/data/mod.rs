//! Data loading: a distributed sampler and a prefetching batch loader (runtime), the MNIST
//! IDX reader (cargo feature `mnist`) and the byte-level text corpus of language models
//! ([`text`], cargo feature `gpt`), and supervised fine-tuning's prompt/completion examples
//! with their per-token loss normalisation ([`sft`]).
//!
//! The pieces compose the same way as PyTorch's `Dataset` / `DistributedSampler` / `DataLoader`:
//!
//! 1. `Mnist::load` (cargo feature `mnist`) reads the four IDX files into flat `f32` / `u8`
//!    vectors (pixels scaled to `[0, 1]` by `/255`, nothing else); any other dataset in that flat
//!    form works the same.
//! 2. Every rank builds a [`DistributedSampler`] with the same `seed`, calls
//!    [`DistributedSampler::set_epoch`] at the start of each epoch and takes its own, disjoint
//!    share of the dataset with [`DistributedSampler::indices`].
//! 3. A [`BatchLoader`] turns that index list into `(B, C, H, W)` image / `(B,)` label tensors,
//!    assembling the next batches on a background thread.

#[cfg(any(feature = "mnist", feature = "gpt"))]
mod gz;
pub mod loader;
#[cfg(feature = "mnist")]
pub mod mnist;
pub mod sampler;
pub mod sft;
#[cfg(feature = "gpt")]
pub mod text;

pub use loader::{Batch, BatchLoader, DEFAULT_PREFETCH_DEPTH};
#[cfg(feature = "mnist")]
pub use mnist::{read_idx_images, read_idx_labels, Mnist};
pub use sampler::{DistributedSampler, SamplerState};
