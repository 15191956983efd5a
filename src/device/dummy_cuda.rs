//! The stand-in for [`super::cuda`] in a build without feature `cuda` (candle-core's
//! `dummy_cuda_backend.rs`): the same names, so that call sites need no `cfg` twins; every
//! function that would touch a GPU reports that this build has none.

use candle_core::{Device, Tensor};

use crate::error::{Error, Result};

/// The message of every stub: no GPU path in this build.
fn no_gpu_path(what: &str) -> Error {
    Error::InvalidArgument(format!(
        "{what}: this build has no GPU path; rebuild with `--features cuda` (see README, \
         \"The GPU path\")"
    ))
}

/// False: this build has no GPU path.
pub fn is_available() -> bool {
    false
}

/// Number of GPUs the driver reports.
///
/// Errors: always (no GPU path in this build).
pub fn gpu_count() -> Result<usize> {
    Err(no_gpu_path("counting GPUs"))
}

/// Opens GPU `ordinal`.
///
/// Errors: always ("device cuda:N: this build has no GPU path; rebuild with `--features
/// cuda`").
pub fn open_device(ordinal: usize) -> Result<Device> {
    Err(no_gpu_path(&format!("device cuda:{ordinal}")))
}

/// Reads a small 1-D tensor back from a GPU.
///
/// Errors: always (no tensor is on a GPU in this build).
pub fn read_small<T: SmallElem>(t: &Tensor) -> Result<Vec<T>> {
    Err(no_gpu_path(&format!(
        "read_small of a tensor on {:?}",
        t.device().location()
    )))
}

/// An element type [`read_small`] can read back: any, in this build.
pub trait SmallElem {}

impl<T> SmallElem for T {}
