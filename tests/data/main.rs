//! The data side: the distributed sampler and batch loader, the MNIST IDX reader, the text
//! corpus, and the classification metric.
//!
//! One test binary per area (a binary links the whole crate once); one module per topic.
//! Apart from `tools` because these tests hold the MNIST data set in this process (see
//! `tests/tools/main.rs`).

mod data;
#[cfg(feature = "mnist")]
mod metrics;
#[cfg(feature = "gpt")]
mod text;
