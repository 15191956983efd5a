//! The GPU path's CUDA plumbing (feature `cuda`): opening a GPU, the comm streams and events
//! that order them against Candle's compute stream, and raw access to a tensor's device buffer.
//!
//! Streams: Candle's [`CudaDevice::cuda_stream`] is the compute stream. Comm streams are
//! created on the same [`cudarc::driver::CudaContext`] ([`new_stream`]). A consumer never
//! reads a buffer before it waited on the producer's event, and memory is released only after
//! the consuming stream waited on the producer's event (FSDP2's rule); see
//! `design/architecture.md`, "The GPU path".

use std::sync::Arc;

use candle_core::{CudaDevice, Device};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use crate::error::{Error, Result};

/// True when a CUDA driver is present and reports at least one GPU. Never panics (cudarc's
/// `CudaContext::new` panics without a driver; this checks first).
pub fn is_available() -> bool {
    gpu_count().is_ok_and(|n| n > 0)
}

/// Number of GPUs the driver reports.
///
/// Errors: no driver, or the driver fails to initialise ([`Error::Cuda`] with its message).
pub fn gpu_count() -> Result<usize> {
    cudarc::driver::result::init().map_err(|e| Error::Cuda(format!("cuInit: {e:?}")))?;
    let n = cudarc::driver::result::device::get_count()
        .map_err(|e| Error::Cuda(format!("cuDeviceGetCount: {e:?}")))?;
    Ok(n as usize)
}

/// Opens GPU `ordinal` as a Candle device with a compute stream of its own.
///
/// Errors: no driver, or no GPU `ordinal` (naming it and the number of GPUs).
pub fn open_device(ordinal: usize) -> Result<Device> {
    let n = gpu_count()?;
    if ordinal >= n {
        return Err(Error::Cuda(format!(
            "GPU {ordinal} requested, but the driver reports {n} GPU(s) (ordinals 0..{n})"
        )));
    }
    let dev = CudaDevice::new_with_stream(ordinal)
        .map_err(|e| Error::Cuda(format!("opening GPU {ordinal}: {e}")))?;
    Ok(Device::Cuda(dev))
}

/// The CUDA device of `device`, or an error naming `what` and the device found.
pub fn cuda_device<'a>(device: &'a Device, what: &str) -> Result<&'a CudaDevice> {
    match device {
        Device::Cuda(d) => Ok(d),
        other => Err(Error::InvalidArgument(format!(
            "{what}: expected a CUDA device, found {:?}",
            other.location()
        ))),
    }
}

/// A new stream on `device`'s context (a comm stream), non-blocking with respect to the
/// legacy default stream.
///
/// Errors: the driver's.
pub fn new_stream(device: &CudaDevice) -> Result<Arc<CudaStream>> {
    device
        .cuda_stream()
        .context()
        .new_stream()
        .map_err(|e| Error::Cuda(format!("creating a comm stream: {e:?}")))
}

/// The context of `device`.
pub fn context(device: &CudaDevice) -> Arc<CudaContext> {
    device.cuda_stream().context().clone()
}

/// Records an event on `stream` (timing disabled unless `timing`).
///
/// Errors: the driver's.
pub fn record(stream: &CudaStream, timing: bool) -> Result<CudaEvent> {
    let flags = if timing {
        None
    } else {
        Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
    };
    stream
        .record_event(flags)
        .map_err(|e| Error::Cuda(format!("recording an event: {e:?}")))
}

/// Makes `consumer` wait (on the device, the host does not block) for everything issued on
/// `producer` so far.
///
/// Errors: the driver's.
pub fn stream_wait_stream(consumer: &CudaStream, producer: &CudaStream) -> Result<()> {
    let ev = record(producer, false)?;
    consumer
        .wait(&ev)
        .map_err(|e| Error::Cuda(format!("stream wait: {e:?}")))
}
