//! Host-value helpers over any [`ProcessGroup`]: small blocking collectives of `Vec`s on the
//! default stream, for callers that agree on a few numbers (clipping's norm, the grad scaler's
//! inf flag, checkpoint metadata) and want a one-line call.
//!
//! Each helper moves the values into a 1-D tensor on the group's device, runs the collective on
//! [`ProcessGroup::default_stream`], waits for it and moves the result back out (on the CPU
//! without a copy: the vector is taken out of the tensor's storage, so a helper holds at most
//! its input and its output). All are collectives: every rank calls the same helper with the
//! same length, in the same order relative to the other collectives of the default stream.

use std::cell::RefCell;

use candle_core::{CpuStorage, InplaceOp1, Layout, Tensor, WithDType};

use super::{ProcessGroup, ReduceOp};
use crate::error::{Error, Result};

/// Takes the vector out of a CPU storage when the layout covers exactly all of it (leaving the
/// storage empty).
struct TakeVec<T>(RefCell<Option<Vec<T>>>);

impl<T: WithDType> InplaceOp1 for TakeVec<T> {
    fn name(&self) -> &'static str {
        "take-vec"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        if layout.start_offset() != 0 || !layout.is_contiguous() {
            return Ok(());
        }
        let taken = std::mem::replace(storage, T::to_cpu_storage_owned(Vec::new()));
        let v = T::cpu_storage_data(taken)?;
        if v.len() == layout.shape().elem_count() {
            *self.0.borrow_mut() = Some(v);
        } else {
            *storage = T::to_cpu_storage_owned(v);
        }
        Ok(())
    }
}

/// The elements of `t`, a 1-D tensor a helper created and got back from its collective (so no
/// other handle shares its storage, and `t` is dropped here): moved out of a CPU storage that
/// holds exactly them, copied otherwise.
fn into_vec<T: WithDType>(t: Tensor) -> Result<Vec<T>> {
    if t.device().is_cpu() && t.dtype() == T::DTYPE {
        let take = TakeVec(RefCell::new(None));
        t.inplace_op1(&take)?;
        if let Some(v) = take.0.into_inner() {
            return Ok(v);
        }
    }
    Ok(t.to_vec1()?)
}

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
        into_vec(self.all_reduce(&self.default_stream(), t, op).wait()?)
    }

    /// All-reduce of i64 values (exact; `Sum` wraps on overflow, `Avg` is an error).
    fn all_reduce_i64s(&self, values: Vec<i64>, op: ReduceOp) -> Result<Vec<i64>> {
        let t = to_tensor(self, values)?;
        into_vec(self.all_reduce(&self.default_stream(), t, op).wait()?)
    }

    /// All-reduce of u64 values, carried as i64: exact for values and results below 2⁶³.
    ///
    /// Errors: a value ≥ 2⁶³ ([`Error::Value`], on this rank only, before any
    /// communication), a sum ≥ 2⁶³ (wrapped negative), `Avg`.
    fn all_reduce_u64s(&self, values: Vec<u64>, op: ReduceOp) -> Result<Vec<u64>> {
        let signed = values
            .iter()
            .map(|&v| {
                i64::try_from(v).map_err(|_| {
                    Error::value(
                        "all_reduce_u64s: a value",
                        "below 2^63 (u64 values are carried as i64)",
                        format_args!("{v}, which does not fit"),
                    )
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
        into_vec(self.broadcast(&self.default_stream(), t, root).wait()?)
    }

    /// Broadcast of u64 values from `root` (exact for every value); returns the root's values.
    fn broadcast_u64s(&self, values: Vec<u64>, root: usize) -> Result<Vec<u64>> {
        let t = to_tensor(self, u64_bits(values))?;
        let out: Vec<i64> = into_vec(self.broadcast(&self.default_stream(), t, root).wait()?)?;
        Ok(out.into_iter().map(|v| v as u64).collect())
    }

    /// Reduce of f32 values to `root`: the root gets the reduced values, the others their own
    /// values back.
    fn reduce_f32s(&self, values: Vec<f32>, root: usize, op: ReduceOp) -> Result<Vec<f32>> {
        let t = to_tensor(self, values)?;
        into_vec(self.reduce(&self.default_stream(), t, root, op).wait()?)
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
        into_vec(
            self.all_gather(&self.default_stream(), &input, output)
                .wait()?,
        )
    }

    /// Barrier on the default stream, waited for.
    fn barrier_wait(&self) -> Result<()> {
        self.barrier(&self.default_stream()).wait()
    }
}

impl<P: ProcessGroup + ?Sized> ProcessGroupExt for P {}
