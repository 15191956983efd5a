//! Evaluation metrics of a gathered model (cargo feature `mnist`): application code the examples
//! share, not part of the sharded runtime.
//!
//! A metric runs on a [`FullModel`] (see [`crate::FsdpModel::gather_full_model`]): a plain
//! unsharded copy, so it needs no communication and may run on rank 0 alone.

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};
use crate::fsdp::FullModel;

/// Classification accuracy in percent of the eval-mode `model` on `images` (first dimension N)
/// against `labels` ((N,) u32), `batch` items at a time: the share of rows whose argmax over the
/// last output dimension equals the label. 0 when N is 0.
///
/// # Errors
/// [`Error::Value`] for `batch == 0`, [`Error::Shape`] for labels that are not `(N,)`; a unit's
/// error.
pub fn accuracy(model: &FullModel, images: &Tensor, labels: &Tensor, batch: usize) -> Result<f64> {
    let n = images.dim(0)?;
    if batch == 0 {
        return Err(Error::value("accuracy: batch", "at least 1", 0));
    }
    if labels.dims() != [n] {
        return Err(Error::shape(
            format_args!("accuracy: the labels of {n} images"),
            format_args!("[{n}] (one per image)"),
            format_args!("{:?}", labels.dims()),
        ));
    }
    let mut correct = 0f64;
    for start in (0..n).step_by(batch) {
        let len = batch.min(n - start);
        let x = images.narrow(0, start, len)?.to_device(model.device())?;
        let logits = model.forward_t(&x, false)?;
        correct += logits
            .argmax(candle_core::D::Minus1)?
            .eq(&labels.narrow(0, start, len)?.to_device(model.device())?)?
            .to_dtype(DType::F32)?
            .sum_all()?
            .to_scalar::<f32>()? as f64;
    }
    Ok(if n == 0 {
        0.0
    } else {
        100.0 * correct / n as f64
    })
}
