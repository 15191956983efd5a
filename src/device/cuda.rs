//! The GPU path's CUDA plumbing (feature `cuda`; `dummy_cuda.rs` stands in without it): opening
//! a GPU, the comm streams and events that order them against Candle's compute stream, and raw
//! access to a tensor's device buffer.
//!
//! Streams: Candle's [`CudaDevice::cuda_stream`] is the compute stream. Comm streams are
//! created on the same [`cudarc::driver::CudaContext`] ([`new_stream`]). A consumer never
//! reads a buffer before it waited on the producer's event, and memory is released only after
//! the consuming stream waited on the producer's event (FSDP2's rule); see
//! `design/gpu.md`.

use std::sync::Arc;

use candle_core::{CudaDevice, Device, Tensor};
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
    cudarc::driver::result::init().map_err(|e| Error::Cuda(format!("cuInit: {:?}", e.0)))?;
    let n = cudarc::driver::result::device::get_count()
        .map_err(|e| Error::Cuda(format!("cuDeviceGetCount: {e:?}")))?;
    Ok(n as usize)
}

/// Checks that GPU `ordinal` exists, before any work is done on it.
///
/// Errors ([`Error::Cuda`]): no usable driver or no GPU at all ("no CUDA GPU is available",
/// with the driver's code), or no GPU `ordinal` (naming it and the number of GPUs).
pub fn check_ordinal(ordinal: usize) -> Result<()> {
    let n = gpu_count().map_err(|e| {
        Error::Cuda(format!(
            "no CUDA GPU is available on this machine (GPU {ordinal} requested): {e}"
        ))
    })?;
    if ordinal >= n {
        return Err(Error::Cuda(format!(
            "GPU {ordinal} requested, but the driver reports {n} GPU(s) (ordinals 0..{n})"
        )));
    }
    Ok(())
}

/// Opens GPU `ordinal` as a Candle device with a compute stream of its own.
///
/// Errors: no driver, or no GPU `ordinal` (see [`check_ordinal`]).
pub fn open_device(ordinal: usize) -> Result<Device> {
    check_ordinal(ordinal)?;
    let dev = CudaDevice::new_with_stream(ordinal)
        .map_err(|e| Error::Cuda(format!("opening GPU {ordinal}: {e}")))?;
    Ok(Device::Cuda(dev))
}

/// The CUDA device of `device`, or an error naming `what` and the device found.
pub fn cuda_device<'a>(device: &'a Device, what: &str) -> Result<&'a CudaDevice> {
    match device {
        Device::Cuda(d) => Ok(d),
        other => Err(Error::device(what, "a CUDA device", other.location())),
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
/// The flags are always given: cudarc's `record_event(None)` creates the event with
/// `CU_EVENT_DISABLE_TIMING`, whose `elapsed_ms` fails (`CUDA_ERROR_INVALID_HANDLE`).
///
/// Errors: the driver's.
pub fn record(stream: &CudaStream, timing: bool) -> Result<CudaEvent> {
    stream
        .record_event(Some(event_flags(timing)))
        .map_err(|e| Error::Cuda(format!("recording an event: {e:?}")))
}

/// Event creation flags: `CU_EVENT_DEFAULT` (timing on, for `elapsed_ms`) when `timing`, else
/// `CU_EVENT_DISABLE_TIMING` (cheaper; for waits and completion only).
pub fn event_flags(timing: bool) -> cudarc::driver::sys::CUevent_flags {
    use cudarc::driver::sys::CUevent_flags;
    if timing {
        CUevent_flags::CU_EVENT_DEFAULT
    } else {
        CUevent_flags::CU_EVENT_DISABLE_TIMING
    }
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

/// Bytes in use in `device`'s default memory pool (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT`): the
/// stream-ordered allocations Candle and cudarc make (`cuMemAllocAsync`) that are not freed yet.
/// A `cuMemFreeAsync` counts once its stream reached it: synchronise the stream first for a
/// settled figure.
///
/// Errors: the driver's.
pub fn pool_used_bytes(device: &CudaDevice) -> Result<u64> {
    use cudarc::driver::sys;
    let ctx = context(device);
    ctx.bind_to_thread()
        .map_err(|e| Error::Cuda(format!("binding the context: {e:?}")))?;
    let mut pool = std::mem::MaybeUninit::<sys::CUmemoryPool>::uninit();
    let mut used: u64 = 0;
    // SAFETY: both out-pointers are valid for writes of their types; the device handle comes
    // from a live context; the attribute's value is a `cuuint64_t` per the driver API.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), ctx.cu_device())
            .result()
            .map_err(|e| Error::Cuda(format!("cuDeviceGetDefaultMemPool: {e:?}")))?;
        sys::cuMemPoolGetAttribute(
            pool.assume_init(),
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
            (&mut used as *mut u64).cast(),
        )
        .result()
        .map_err(|e| Error::Cuda(format!("cuMemPoolGetAttribute: {e:?}")))?;
    }
    Ok(used)
}

/// Reads a small contiguous 1-D tensor to the host **without synchronising the compute
/// stream** (Candle's `to_vec1` copies on the compute stream and waits for everything queued
/// there): the copy runs on a stream of its own, after the producer's write event (cudarc's
/// event tracking), and only that stream is waited for. For the few values the runtime reads
/// back during a step (the gather-agreement check).
///
/// Errors: a tensor that is not a contiguous 1-D `T` on a GPU; the driver's.
pub fn read_small<T: SmallElem>(t: &Tensor) -> Result<Vec<T>> {
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cuda(s) = &*storage else {
        return Err(Error::device(
            "read_small: the tensor",
            "a GPU",
            t.device().location(),
        ));
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(Error::value(
            "read_small: the tensor",
            "contiguous",
            "a strided layout",
        ));
    };
    let slice = s.as_cuda_slice::<T>()?;
    let stream = new_stream(&s.device)?;
    let out = stream
        .clone_dtoh(&slice.slice(start..end))
        .map_err(|e| Error::Cuda(format!("reading {} values back: {e:?}", end - start)))?;
    stream
        .synchronize()
        .map_err(|e| Error::Cuda(format!("reading values back: {e:?}")))?;
    Ok(out)
}

/// An element type [`read_small`] can read back (a Candle CUDA dtype cudarc can copy).
pub trait SmallElem:
    candle_core::cuda_backend::CudaDType + cudarc::driver::DeviceRepr + Default + Clone
{
}

impl<T> SmallElem for T where
    T: candle_core::cuda_backend::CudaDType + cudarc::driver::DeviceRepr + Default + Clone
{
}
