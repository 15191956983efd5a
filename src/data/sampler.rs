//! Splits a dataset's indices between data-parallel ranks.
//!
//! [`DistributedSampler`] follows the semantics of PyTorch's
//! [`torch.utils.data.DistributedSampler`](https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler)
//! (`torch/utils/data/distributed.py`): every rank computes the same global index list (a
//! permutation seeded with `seed + epoch`, or `0..len`), pads or truncates it to a multiple of
//! the world size, and takes every `world_size`-th entry starting at its rank. The permutation
//! itself comes from Rust's `rand` (`StdRng`, Fisher–Yates), so it is not the same permutation as
//! `torch.randperm` for the same seed; all other arithmetic is identical.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// One rank's view of a dataset split across `world_size` data-parallel ranks.
///
/// Semantics (as PyTorch's `DistributedSampler`):
/// - **Order.** With `shuffle`, the global list is a Fisher–Yates permutation of `0..len` drawn
///   from `StdRng::seed_from_u64(seed + epoch)` (wrapping add), identical on every rank given the
///   same `seed` and epoch; without `shuffle` it is `0..len`.
/// - **`drop_last = false`.** `num_samples = ceil(len / world_size)`,
///   `total_size = num_samples × world_size`, and the list is padded to `total_size` by wrapping
///   around to its start, repeating it as often as needed when the padding exceeds `len`
///   (PyTorch: `indices += (indices * ceil(padding / len))[:padding]`). Some samples are then
///   seen twice per epoch.
/// - **`drop_last = true`.** If `len % world_size != 0`,
///   `num_samples = ceil((len - world_size) / world_size)` (which equals `floor(len /
///   world_size)`, and 0 when `len < world_size`), `total_size = num_samples × world_size`, and
///   the list is truncated to `total_size` (the tail of the permuted list is dropped).
/// - **Split.** Rank `r` takes positions `r, r + world_size, r + 2·world_size, …` of the list,
///   so the ranks' lists are disjoint (up to the padding) and each has `num_samples` entries.
///
/// Extension over PyTorch: [`set_start`](Self::set_start) skips this rank's first entries for a
/// mid-epoch resume.
#[derive(Debug, Clone)]
pub struct DistributedSampler {
    dataset_len: usize,
    world_size: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
    start: usize,
    num_samples: usize,
    total_size: usize,
}

impl DistributedSampler {
    /// Creates the sampler of `rank` among `world_size` ranks over a dataset of `dataset_len`
    /// items, at epoch 0 and start position 0.
    ///
    /// `seed` must be the same on every rank (PyTorch's default is 0).
    ///
    /// # Errors
    /// [`Error::OutOfRange`] naming both values if `world_size == 0` or
    /// `rank >= world_size`.
    pub fn new(
        dataset_len: usize,
        world_size: usize,
        rank: usize,
        shuffle: bool,
        seed: u64,
        drop_last: bool,
    ) -> Result<Self> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::out_of_range(
                "DistributedSampler: rank",
                rank,
                "world_size",
                world_size,
            ));
        }
        let num_samples = if drop_last && !dataset_len.is_multiple_of(world_size) {
            // ceil((len - ws) / ws) in Python, with a negative numerator giving 0.
            dataset_len.saturating_sub(world_size).div_ceil(world_size)
        } else {
            dataset_len.div_ceil(world_size)
        };
        Ok(Self {
            dataset_len,
            world_size,
            rank,
            shuffle,
            seed,
            drop_last,
            epoch: 0,
            start: 0,
            num_samples,
            total_size: num_samples * world_size,
        })
    }

    /// Where this sampler stands after this rank consumed `consumed` more entries of its
    /// current list (the position adds to the sampler's own start, so a resumed epoch stays
    /// exact): what a checkpoint stores to continue the epoch there.
    pub fn state(&self, consumed: usize) -> SamplerState {
        SamplerState {
            epoch: self.epoch(),
            position: self.start() + consumed,
            world_size: self.world_size(),
        }
    }

    /// Puts this sampler at `state`: `set_epoch(state.epoch)` then
    /// `set_start(state.position_for(world_size))`.
    ///
    /// Errors: a position past the end of the epoch (a corrupt or foreign checkpoint), naming
    /// both numbers; the sampler is then unchanged.
    pub fn restore(&mut self, state: &SamplerState) -> Result<()> {
        let position = state.position_for(self.world_size());
        if position > self.num_samples() {
            return Err(Error::value(
                format!(
                    "checkpoint sampler position (world size {})",
                    state.world_size
                ),
                format!(
                    "at most the end of the epoch: {} samples per rank at world size {}",
                    self.num_samples(),
                    self.world_size()
                ),
                state.position,
            ));
        }
        self.set_epoch(state.epoch);
        self.set_start(position);
        Ok(())
    }

    /// Sets the epoch, which seeds the shuffle (`seed + epoch`), as PyTorch's `set_epoch`: call
    /// it at the start of every epoch, on every rank, before [`indices`](Self::indices), or every
    /// epoch uses the same order.
    ///
    /// Also resets the start position to 0 (see [`set_start`](Self::set_start)), so a resume
    /// offset applies only to the epoch it was set for: call `set_epoch` first, then `set_start`.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
        self.start = 0;
    }

    /// Current epoch (0 until [`set_epoch`](Self::set_epoch) is called).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Makes [`indices`](Self::indices) return only this rank's entries from `position` onward,
    /// for resuming in the middle of an epoch (not part of PyTorch's sampler).
    ///
    /// `position` counts entries of *this rank's* list, i.e. samples this rank already
    /// consumed in the current epoch (`batches_done × batch_size`); positions past
    /// [`num_samples`](Self::num_samples) are clamped, giving an empty list. The permutation is
    /// unchanged, so the resumed epoch sees exactly the samples the interrupted one had left.
    /// [`set_epoch`](Self::set_epoch) resets it to 0.
    pub fn set_start(&mut self, position: usize) {
        self.start = position.min(self.num_samples);
    }

    /// Current start position within this rank's list (see [`set_start`](Self::set_start)).
    pub fn start(&self) -> usize {
        self.start
    }

    /// The global list for the current epoch, before the per-rank split: a permutation (or
    /// `0..len`) padded or truncated to [`total_size`](Self::total_size). Identical on all ranks.
    pub fn global_indices(&self) -> Vec<usize> {
        let mut indices: Vec<usize> = (0..self.dataset_len).collect();
        if self.shuffle {
            let mut rng = StdRng::seed_from_u64(self.seed.wrapping_add(self.epoch));
            // rand's `shuffle` is Durstenfeld's Fisher–Yates.
            indices.shuffle(&mut rng);
        }
        if self.total_size <= indices.len() {
            indices.truncate(self.total_size);
        } else if !indices.is_empty() {
            // Wrap around, repeating the list as often as needed (PyTorch's padding).
            let len = indices.len();
            for i in len..self.total_size {
                indices.push(indices[i % len]);
            }
        }
        indices
    }

    /// This rank's dataset indices for the current epoch: positions `rank, rank + world_size, …`
    /// of [`global_indices`](Self::global_indices), skipping the first
    /// [`start`](Self::start) of them. Has `num_samples() - start()` entries.
    pub fn indices(&self) -> Vec<usize> {
        self.global_indices()
            .into_iter()
            .skip(self.rank)
            .step_by(self.world_size)
            .skip(self.start)
            .collect()
    }

    /// Number of samples this rank gets per epoch (PyTorch's `num_samples`), ignoring
    /// [`set_start`](Self::set_start).
    pub fn num_samples(&self) -> usize {
        self.num_samples
    }

    /// Size of the padded or truncated global list, `num_samples × world_size`.
    pub fn total_size(&self) -> usize {
        self.total_size
    }

    /// Same as [`num_samples`](Self::num_samples), like PyTorch's `__len__`.
    pub fn len(&self) -> usize {
        self.num_samples
    }

    /// True when this rank gets no samples per epoch.
    pub fn is_empty(&self) -> bool {
        self.num_samples == 0
    }

    /// Dataset length the sampler was built for.
    pub fn dataset_len(&self) -> usize {
        self.dataset_len
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Whether the global list is shuffled each epoch.
    pub fn shuffle(&self) -> bool {
        self.shuffle
    }

    /// Base seed of the shuffle.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Whether the tail is dropped (instead of padding) to make the list divisible.
    pub fn drop_last(&self) -> bool {
        self.drop_last
    }
}

/// Where a [`DistributedSampler`] stands: enough to continue an epoch where it stopped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    /// Epoch the sampler is in (its shuffle is seeded with `seed + epoch`).
    pub epoch: u64,
    /// Entries of *each rank's* list already consumed in `epoch` (`batches done × batch size`).
    pub position: usize,
    /// World size the position counts in (per-rank lists depend on it).
    pub world_size: usize,
}

impl SamplerState {
    /// The state of `sampler` after this rank consumed `consumed` more entries of its current
    /// list: [`DistributedSampler::state`].
    pub fn new(sampler: &DistributedSampler, consumed: usize) -> Self {
        sampler.state(consumed)
    }

    /// The per-rank start position for a group of `world_size` ranks. At the saved world size it
    /// is `position`. At another one, the `position × saved world size` entries of the global
    /// list consumed so far are split over the new ranks, rounded down (a few samples may then
    /// be seen twice; the padding of the global list also depends on the world size).
    pub fn position_for(&self, world_size: usize) -> usize {
        if world_size == self.world_size || self.world_size == 0 || world_size == 0 {
            return self.position;
        }
        self.position * self.world_size / world_size
    }

    /// Puts `sampler` at this state: [`DistributedSampler::restore`].
    ///
    /// Errors: as [`DistributedSampler::restore`].
    pub fn apply(&self, sampler: &mut DistributedSampler) -> Result<()> {
        sampler.restore(self)
    }
}
