//! Host-value helpers over any [`ProcessGroup`]: small blocking collectives of `Vec`s on the
//! default stream, for callers that agree on a few numbers (clipping's norm, the grad scaler's
//! inf flag, checkpoint metadata) and want a one-line call.
//!
//! Each helper copies the values into a 1-D tensor on the group's device, runs the collective on
//! [`ProcessGroup::default_stream`], waits for it and copies the result back. All are
//! collectives: every rank calls the same helper with the same length, in the same order
//! relative to the other collectives of the default stream.

use candle_core::{Tensor, WithDType};

use super::{ProcessGroup, ReduceOp};
use crate::error::{Error, Result};

fn to_tensor<T: WithDType>(pg: &(impl ProcessGroup + ?Sized), values: Vec<T>) -> Result<Tensor> {
    let n = values.len();
    Ok(Tensor::from_vec(values, n, pg.device())?)
}

/// `u64`s carried in `i64` lanes for order-free collectives (broadcast, all-gather): the bits
/// are kept, so every value round-trips.
fn u64_bits(values: Vec<u64>) -> Vec<i64> {
    values.into_iter().map(|v| v as i64).collect()
}

/// Blocking host helpers on the default stream, for every [`ProcessGroup`] (blanket impl).
pub trait ProcessGroupExt: ProcessGroup {
    /// All-reduce of f32 values (same length on every rank); returns the reduced values.
    fn all_reduce_f32s(&self, values: Vec<f32>, op: ReduceOp) -> Result<Vec<f32>> {
        let t = to_tensor(self, values)?;
        Ok(self
            .all_reduce(&self.default_stream(), t, op)
            .wait()?
            .to_vec1()?)
    }

    /// All-reduce of i64 values (exact; `Sum` wraps on overflow, `Avg` is an error).
    fn all_reduce_i64s(&self, values: Vec<i64>, op: ReduceOp) -> Result<Vec<i64>> {
        let t = to_tensor(self, values)?;
        Ok(self
            .all_reduce(&self.default_stream(), t, op)
            .wait()?
            .to_vec1()?)
    }

    /// All-reduce of u64 values, carried as i64: exact for values and results below 2⁶³.
    ///
    /// Errors: a value ≥ 2⁶³ ([`Error::InvalidArgument`], on this rank only, before any
    /// communication), a sum ≥ 2⁶³ (wrapped negative), `Avg`.
    fn all_reduce_u64s(&self, values: Vec<u64>, op: ReduceOp) -> Result<Vec<u64>> {
        let signed = values
            .iter()
            .map(|&v| {
                i64::try_from(v).map_err(|_| {
                    Error::InvalidArgument(format!(
                        "all_reduce_u64s carries u64 values as i64: {v} does not fit"
                    ))
                })
            })
            .collect::<Result<Vec<i64>>>()?;
        let out = self.all_reduce_i64s(signed, op)?;
        out.into_iter()
            .map(|v| {
                u64::try_from(v).map_err(|_| {
                    Error::InvalidArgument(format!(
                        "all_reduce_u64s: the {op:?} overflowed 2^63 (wrapped to {v})"
                    ))
                })
            })
            .collect()
    }

    /// Broadcast of f32 values from `root`; returns the root's values on every rank.
    fn broadcast_f32s(&self, values: Vec<f32>, root: usize) -> Result<Vec<f32>> {
        let t = to_tensor(self, values)?;
        Ok(self
            .broadcast(&self.default_stream(), t, root)
            .wait()?
            .to_vec1()?)
    }

    /// Broadcast of u64 values from `root` (exact for every value); returns the root's values.
    fn broadcast_u64s(&self, values: Vec<u64>, root: usize) -> Result<Vec<u64>> {
        let t = to_tensor(self, u64_bits(values))?;
        let out: Vec<i64> = self
            .broadcast(&self.default_stream(), t, root)
            .wait()?
            .to_vec1()?;
        Ok(out.into_iter().map(|v| v as u64).collect())
    }

    /// Reduce of f32 values to `root`: the root gets the reduced values, the others their own
    /// values back.
    fn reduce_f32s(&self, values: Vec<f32>, root: usize, op: ReduceOp) -> Result<Vec<f32>> {
        let t = to_tensor(self, values)?;
        Ok(self
            .reduce(&self.default_stream(), t, root, op)
            .wait()?
            .to_vec1()?)
    }

    /// All-gather of every rank's `shard` (same length everywhere); returns the concatenation in
    /// rank order (`world_size * shard.len()` values).
    fn all_gather_f32s(&self, shard: &[f32]) -> Result<Vec<f32>> {
        let input = Tensor::from_slice(shard, shard.len(), self.device())?;
        let output = Tensor::zeros(
            shard.len() * self.world_size(),
            candle_core::DType::F32,
            self.device(),
        )?;
        Ok(self
            .all_gather(&self.default_stream(), &input, output)
            .wait()?
            .to_vec1()?)
    }

    /// Barrier on the default stream, waited for.
    fn barrier_wait(&self) -> Result<()> {
        self.barrier(&self.default_stream()).wait()
    }
}

impl<P: ProcessGroup + ?Sized> ProcessGroupExt for P {}
