//! Batches assembled ahead of time on a background thread.
//!
//! [`BatchLoader`] plays the role of PyTorch's `DataLoader(dataset, batch_size, sampler=…)` with
//! one worker: it walks a fixed index list (typically [`DistributedSampler::indices`]) in
//! order, gathers each batch into tensors on a background thread and hands it over through a
//! bounded channel, so that the next batches are ready while the current step runs.
//!
//! [`DistributedSampler::indices`]: crate::data::DistributedSampler::indices

use std::sync::Arc;
use std::thread::JoinHandle;

use candle_core::{Device, Tensor};
use crossbeam::channel::{bounded, Receiver};

use crate::error::{Error, Result};

/// Default number of batches prepared ahead of the consumer.
pub const DEFAULT_PREFETCH_DEPTH: usize = 2;

/// One mini-batch.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Images, shape `(B, C, H, W)`, dtype `f32`, on the CPU; values copied unchanged from the
    /// source vector (for [`Mnist`](crate::data::Mnist): pixel / 255 in `[0, 1]`).
    pub images: Tensor,
    /// Labels, shape `(B,)`, dtype `u32`, on the CPU.
    pub labels: Tensor,
    /// Dataset index of each row of the batch, in order (`B` entries).
    pub indices: Vec<usize>,
}

impl Batch {
    /// Number of items `B` in the batch.
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    /// True for a batch with no items (never produced by [`BatchLoader`]).
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }
}

/// Iterator over the batches of a fixed index list, prefetched on a background thread.
///
/// Batches cover `indices` in order, `batch_size` at a time; the last, partial batch is yielded
/// unless `drop_last`. Up to `depth` finished batches wait in a bounded channel (plus one being
/// built). Dropping the loader before the end disconnects the channel, which wakes and stops the
/// thread, and joins it: no thread is leaked and the drop does not wait for the remaining
/// batches.
pub struct BatchLoader {
    rx: Option<Receiver<Result<Batch>>>,
    handle: Option<JoinHandle<()>>,
    num_batches: usize,
    yielded: usize,
}

impl std::fmt::Debug for BatchLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchLoader")
            .field("num_batches", &self.num_batches)
            .field("yielded", &self.yielded)
            .finish()
    }
}

impl BatchLoader {
    /// Starts a loader with the default prefetch depth ([`DEFAULT_PREFETCH_DEPTH`] = 2).
    ///
    /// `images` holds `N × C × H × W` `f32` values (item-major, then C, H, W), `labels` holds
    /// `N` labels, `item_shape` is `(C, H, W)` (for MNIST `(1, 28, 28)`), and `indices` lists
    /// the dataset items to visit, in order (repeats allowed).
    ///
    /// # Errors
    /// [`Error::Value`] if `batch_size == 0` or `C × H × W == 0`, [`Error::Shape`] if
    /// `images.len() != labels.len() × C × H × W` (expected vs found), [`Error::OutOfRange`] if an index is
    /// `>= labels.len()` (naming the index, its position and the dataset length).
    pub fn new(
        images: Arc<Vec<f32>>,
        labels: Arc<Vec<u8>>,
        item_shape: (usize, usize, usize),
        indices: Vec<usize>,
        batch_size: usize,
        drop_last: bool,
    ) -> Result<Self> {
        Self::with_depth(
            images,
            labels,
            item_shape,
            indices,
            batch_size,
            drop_last,
            DEFAULT_PREFETCH_DEPTH,
        )
    }

    /// As [`new`](Self::new) with `depth` batches prefetched (channel capacity).
    ///
    /// # Errors
    /// As [`new`](Self::new), plus [`Error::Value`] if `depth == 0`.
    pub fn with_depth(
        images: Arc<Vec<f32>>,
        labels: Arc<Vec<u8>>,
        item_shape: (usize, usize, usize),
        indices: Vec<usize>,
        batch_size: usize,
        drop_last: bool,
        depth: usize,
    ) -> Result<Self> {
        if batch_size == 0 {
            return Err(Error::value("BatchLoader: batch_size", "> 0", 0));
        }
        if depth == 0 {
            return Err(Error::value("BatchLoader: prefetch depth", "> 0", 0));
        }
        let (c, h, w) = item_shape;
        let item_len = c * h * w;
        if item_len == 0 {
            return Err(Error::value(
                "BatchLoader: item_shape",
                "a shape with elements",
                format!("{item_shape:?}"),
            ));
        }
        let n = labels.len();
        if Some(images.len()) != n.checked_mul(item_len) {
            return Err(Error::shape(
                format!("BatchLoader: {n} labels of shape {item_shape:?}"),
                format!("{} image values", n.saturating_mul(item_len)),
                images.len(),
            ));
        }
        if let Some((pos, &idx)) = indices.iter().enumerate().find(|(_, &i)| i >= n) {
            return Err(Error::out_of_range(
                format!("BatchLoader: position {pos} of the index list: index"),
                idx,
                "a dataset of len",
                n,
            ));
        }

        let num_batches = if drop_last {
            indices.len() / batch_size
        } else {
            indices.len().div_ceil(batch_size)
        };
        let (tx, rx) = bounded::<Result<Batch>>(depth);
        let handle = std::thread::Builder::new()
            .name("batch-loader".into())
            .spawn(move || {
                for chunk in indices.chunks(batch_size).take(num_batches) {
                    let batch = build_batch(&images, &labels, item_shape, chunk);
                    let failed = batch.is_err();
                    // A send error means the loader was dropped: stop.
                    if tx.send(batch).is_err() || failed {
                        return;
                    }
                }
            })
            .map_err(|e| Error::SpawnFailed {
                what: "BatchLoader's loader thread".to_string(),
                error: e,
            })?;
        Ok(Self {
            rx: Some(rx),
            handle: Some(handle),
            num_batches,
            yielded: 0,
        })
    }

    /// Total number of batches this loader yields: `ceil(len / batch_size)`, or
    /// `floor(len / batch_size)` with `drop_last`, where `len` is the index-list length.
    pub fn num_batches(&self) -> usize {
        self.num_batches
    }

    /// Joins the worker, re-raising its panic on this thread if it panicked.
    fn join_worker(&mut self) {
        if let Some(h) = self.handle.take() {
            if let Err(payload) = h.join() {
                std::panic::resume_unwind(payload);
            }
        }
    }
}

fn build_batch(
    images: &[f32],
    labels: &[u8],
    (c, h, w): (usize, usize, usize),
    chunk: &[usize],
) -> Result<Batch> {
    let item_len = c * h * w;
    let mut data = Vec::with_capacity(chunk.len() * item_len);
    let mut labs = Vec::with_capacity(chunk.len());
    for &i in chunk {
        data.extend_from_slice(&images[i * item_len..(i + 1) * item_len]);
        labs.push(u32::from(labels[i]));
    }
    let b = chunk.len();
    Ok(Batch {
        images: Tensor::from_vec(data, (b, c, h, w), &Device::Cpu)?,
        labels: Tensor::from_vec(labs, b, &Device::Cpu)?,
        indices: chunk.to_vec(),
    })
}

impl Iterator for BatchLoader {
    type Item = Result<Batch>;

    /// Blocks until the next batch is ready. Returns `None` after the last batch, or after an
    /// error has been yielded (the worker stops at its first error).
    fn next(&mut self) -> Option<Self::Item> {
        let rx = self.rx.as_ref()?;
        match rx.recv() {
            Ok(item) => {
                self.yielded += 1;
                Some(item)
            }
            Err(_) => {
                // Worker finished (or panicked): release it.
                self.rx = None;
                self.join_worker();
                None
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        if self.rx.is_none() {
            return (0, Some(0));
        }
        (0, Some(self.num_batches - self.yielded))
    }
}

impl Drop for BatchLoader {
    fn drop(&mut self) {
        // Disconnect first so a worker blocked on a full channel wakes up and exits.
        self.rx = None;
        if let Some(h) = self.handle.take() {
            // Do not re-raise a worker panic from drop (could abort during unwinding).
            let _ = h.join();
        }
    }
}
