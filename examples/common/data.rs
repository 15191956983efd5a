//! MNIST as the examples use it: the training split shared by the rank threads, the test split
//! as tensors for the evaluation.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use candle_core::{Device, Tensor};
use candle_fsdp::data::Mnist;

use super::train::TrainData;

/// MNIST loaded for training and evaluation.
pub struct MnistData {
    /// Training images and labels (shared by the ranks without a copy).
    pub train: TrainData,
    /// Test images, `(N, 1, rows, cols)` f32 in `[0, 1]`.
    pub test_x: Tensor,
    /// Test labels, `(N,)` u32.
    pub test_y: Tensor,
}

impl MnistData {
    /// Number of training images.
    pub fn train_len(&self) -> usize {
        self.train.labels.len()
    }

    /// Number of test images.
    pub fn test_len(&self) -> usize {
        self.test_y.dims()[0]
    }
}

/// Loads the four MNIST IDX files of `dir` (see [`Mnist::load`]); both examples' models take
/// 28×28 images, so another size is an error here rather than a shape error in the first step.
pub fn load_mnist(dir: &Path) -> anyhow::Result<MnistData> {
    let mnist =
        Mnist::load(dir).with_context(|| format!("loading MNIST from {}", dir.display()))?;
    let test_len = mnist.test_len();
    let Mnist {
        train_images,
        train_labels,
        test_images,
        test_labels,
        rows,
        cols,
    } = mnist;
    anyhow::ensure!(
        (rows, cols) == (28, 28),
        "{}: expected 28×28 images, found {rows}×{cols}",
        dir.display()
    );
    let test_x = Tensor::from_vec(test_images, (test_len, 1, rows, cols), &Device::Cpu)?;
    let test_y = Tensor::from_vec(
        test_labels.iter().map(|&l| l as u32).collect::<Vec<_>>(),
        test_len,
        &Device::Cpu,
    )?;
    Ok(MnistData {
        train: TrainData {
            images: Arc::new(train_images),
            labels: Arc::new(train_labels),
            item_shape: (1, rows, cols),
        },
        test_x,
        test_y,
    })
}
