//! Choosing the device a model runs on: `--device cpu|cuda|cuda:N` in the examples, and
//! `LOCAL_RANK` picking the GPU when several processes share a machine.
//!
//! - `cpu`: [`Device::Cpu`].
//! - `cuda:N`: GPU `N` (feature `cuda`).
//! - `cuda`: GPU `LOCAL_RANK` when that variable is set (torchrun-style launches, `fsdp-run`),
//!   else `OMPI_COMM_WORLD_LOCAL_RANK` (under `mpirun`), else GPU 0.
//!
//! A CUDA device made here has a stream of its own ([`candle_core::CudaDevice::new_with_stream`]),
//! Candle's *compute stream*; the comm streams of the process groups are created on the same
//! context and ordered against it with CUDA events (see `design/gpu.md`).
//!
//! This module is also the crate's one seam to a tensor's storage (`design/devices.md`):
//!
//! - [`cuda`]: the CUDA plumbing (opening a GPU, streams, events, pool counters, small reads).
//!   Without feature `cuda` it is a stub module of the same names (`dummy_cuda.rs`, as
//!   candle-core's `dummy_cuda_backend.rs`) whose functions report "no GPU path in this build",
//!   so call sites need no `cfg` twins.
//! - `with_storage` / `with_storage_mut`: a tensor's storage and layout handed to a closure under
//!   Candle's read or write lock (the write side through Candle's in-place op API, one adapter
//!   for the CPU and CUDA), used by the kernels of [`crate::ops`] and the collectives of
//!   [`crate::comm`].
//! - `same_storage`: whether two tensors share one storage, with one definition.

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "dummy_cuda.rs"]
pub mod cuda;
mod storage;

pub(crate) use storage::{
    same_storage, with_storage, with_storage_mut, Refused, StorageMut, StorageRef,
};

use candle_core::Device;

use crate::error::{Error, Result};

/// A parsed `--device` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The host.
    Cpu,
    /// A GPU; `None`: the one `LOCAL_RANK` names (see [`local_gpu_ordinal`]).
    Cuda(Option<usize>),
}

impl std::str::FromStr for DeviceSpec {
    type Err = Error;

    /// Parses `cpu`, `cuda` or `cuda:N`.
    ///
    /// Errors: anything else, as [`Error::Value`] naming the value.
    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::value(
                "device",
                "`cpu`, `cuda` or `cuda:N` (N a GPU ordinal)",
                format!("{s:?}"),
            )
        };
        match s {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(None)),
            _ => match s.strip_prefix("cuda:") {
                Some(n) => n
                    .parse()
                    .map(|n| DeviceSpec::Cuda(Some(n)))
                    .map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Cpu => write!(f, "cpu"),
            DeviceSpec::Cuda(None) => write!(f, "cuda"),
            DeviceSpec::Cuda(Some(n)) => write!(f, "cuda:{n}"),
        }
    }
}

/// The GPU ordinal of this process: `LOCAL_RANK`, else `OMPI_COMM_WORLD_LOCAL_RANK`, else 0.
///
/// Errors: a variable that is set but not a non-negative integer, naming it and its value.
pub fn local_gpu_ordinal() -> Result<usize> {
    for var in ["LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"] {
        if let Ok(v) = std::env::var(var) {
            return v.trim().parse().map_err(|_| {
                Error::env(
                    var,
                    format!("{v:?}"),
                    "is not a non-negative integer (the GPU of this process)",
                )
            });
        }
    }
    Ok(0)
}

impl DeviceSpec {
    /// The GPU ordinal this spec selects (`None` for the CPU).
    ///
    /// Errors: see [`local_gpu_ordinal`].
    pub fn ordinal(&self) -> Result<Option<usize>> {
        match self {
            DeviceSpec::Cpu => Ok(None),
            DeviceSpec::Cuda(Some(n)) => Ok(Some(*n)),
            DeviceSpec::Cuda(None) => local_gpu_ordinal().map(Some),
        }
    }

    /// Opens the device: the CPU, or the GPU with a compute stream of its own.
    ///
    /// Errors: a CUDA spec in a build without the `cuda` feature ("rebuild with `--features
    /// cuda`"); no CUDA driver or no such GPU (the driver's error, naming the ordinal).
    pub fn open(&self) -> Result<Device> {
        match self.ordinal()? {
            None => Ok(Device::Cpu),
            Some(n) => cuda::open_device(n),
        }
    }
}

/// True for a CUDA device.
pub fn is_cuda(device: &Device) -> bool {
    matches!(device.location(), candle_core::DeviceLocation::Cuda { .. })
}

/// Reads a small 1-D tensor to the host: `to_vec1` on the CPU; on a GPU a copy on a stream of
/// its own that does not wait for the compute stream (`cuda::read_small`).
///
/// Errors: Candle's or the driver's.
pub(crate) fn read_small<T>(t: &candle_core::Tensor) -> Result<Vec<T>>
where
    T: candle_core::WithDType + cuda::SmallElem,
{
    if is_cuda(t.device()) {
        cuda::read_small(t)
    } else {
        Ok(t.to_vec1::<T>()?)
    }
}
