//! The CUDA buffer helpers the thread backend's CUDA path and the NCCL backend share (feature
//! `cuda`): a tensor's device address under Candle's storage locks, the lifetime rule of the
//! buffers a collective touches ([`KeepAlive`], FSDP2's rule: freed only after the consuming
//! stream waited on the operation's last event), and a rank's outcome ([`CudaDone`]).

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice};
use candle_core::{DType, Layout, Tensor};
use cudarc::driver::{CudaEvent, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};

use crate::comm::buffer::RawBuf;
use crate::device::{with_storage_mut, StorageMut, StorageRef};
use crate::error::{Error, Result};

/// `Error::Cuda` naming `what` and the driver's error.
pub(crate) fn cuda_err(what: impl std::fmt::Display, e: impl std::fmt::Debug) -> Error {
    Error::Cuda(format!("{what}: {e:?}"))
}

// ------------------------------------------------------------------------------------------
// Buffer lifetime.

/// Clones of the tensors an operation reads or writes, released only after `consumer` (the
/// stream the buffers were allocated on, which frees them) waited on `event`, the operation's
/// last event. Without an event (the operation never touched the buffers) they are released at
/// once.
pub(crate) struct KeepAlive {
    pub event: Option<Arc<CudaEvent>>,
    pub consumer: Arc<CudaStream>,
    pub tensors: Vec<Tensor>,
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        let Some(event) = &self.event else {
            return;
        };
        if let Err(e) = self.consumer.wait(event) {
            // The compute stream cannot be ordered after the operation: never free memory a
            // stream may still use (the context is broken anyway when this fails).
            tracing::warn!(
                "cannot order the compute stream after a collective ({e:?}); leaking its \
                 buffers rather than freeing memory that may still be in use"
            );
            std::mem::forget(std::mem::take(&mut self.tensors));
        }
    }
}

// ------------------------------------------------------------------------------------------
// Access to a tensor's device buffer.

/// The device address of a storage slice's vector (`$ptr`: `device_ptr` or `device_ptr_mut`)
/// on `$stream`, and its guard.
macro_rules! slice_ptr {
    ($slice:expr, $ptr:ident, $stream:expr) => {
        match $slice {
            CudaStorageSlice::U8(v) => v.$ptr($stream),
            CudaStorageSlice::U32(v) => v.$ptr($stream),
            CudaStorageSlice::I16(v) => v.$ptr($stream),
            CudaStorageSlice::I32(v) => v.$ptr($stream),
            CudaStorageSlice::I64(v) => v.$ptr($stream),
            CudaStorageSlice::BF16(v) => v.$ptr($stream),
            CudaStorageSlice::F16(v) => v.$ptr($stream),
            CudaStorageSlice::F32(v) => v.$ptr($stream),
            CudaStorageSlice::F64(v) => v.$ptr($stream),
            // Refused by `check_on` (unsupported dtypes) before any storage access.
            _ => (0, SyncOnDrop::Sync(None)),
        }
    };
}

/// Device address, length and dtype of a tensor's elements in `storage`, for reading on
/// `stream`. The guard must be dropped after the last use of the address is enqueued: with
/// cudarc's event tracking on, it records the read on `stream` (tracking then keeps Candle's own
/// later writes ordered after it); with tracking off it does nothing.
pub(crate) fn raw_read<'a>(
    storage: &'a CudaStorage,
    layout: &Layout,
    stream: &'a CudaStream,
) -> (RawBuf, SyncOnDrop<'a>) {
    let (base, guard) = slice_ptr!(&storage.slice, device_ptr, stream);
    (raw_typed(base, storage.dtype(), layout), guard)
}

/// As [`raw_read`], for writing on `stream` (with tracking on, the guard records the write).
pub(crate) fn raw_write<'a>(
    storage: &'a mut CudaStorage,
    layout: &Layout,
    stream: &'a CudaStream,
) -> (RawBuf, SyncOnDrop<'a>) {
    let dtype = storage.dtype();
    let (base, guard) = slice_ptr!(&mut storage.slice, device_ptr_mut, stream);
    (raw_typed(base, dtype, layout), guard)
}

fn raw_typed(base: u64, dtype: DType, layout: &Layout) -> RawBuf {
    let (start, end) = layout
        .contiguous_offsets()
        .expect("contiguity checked before the storage is accessed");
    RawBuf {
        // A device address, never dereferenced on the host.
        ptr: (base + (start * dtype.size_in_bytes()) as u64) as usize as *mut u8,
        len: end - start,
        dtype,
    }
}

/// The device address of a posted buffer, `offset` elements in.
pub(crate) fn addr(b: RawBuf, offset: usize) -> u64 {
    b.ptr as usize as u64 + (offset * b.dtype.size_in_bytes()) as u64
}

/// Runs `body` on `dst` (write-locked) and `src` (read-locked) under Candle's storage locks
/// ([`crate::device::with_storage_mut`]). `None` means Candle refused
/// before calling it: the output shares storage with the input (devices and layouts are
/// checked by the caller first).
pub(crate) fn with_cuda_storage<'f>(
    dst: &Tensor,
    src: Option<&Tensor>,
    body: impl FnOnce(&mut CudaStorage, &Layout, Option<(&CudaStorage, &Layout)>) -> CudaDone + 'f,
) -> Option<CudaDone> {
    with_storage_mut(dst, src, "cuda-collective", |d, dl, s| {
        let StorageMut::Cuda(d) = d else {
            return None;
        };
        let src = match s {
            None => None,
            Some((StorageRef::Cuda(s), sl)) => Some((s, sl)),
            Some((StorageRef::Cpu(_), _)) => return None,
        };
        Some(body(d, dl, src))
    })
    .ok()
    .flatten()
}

// ------------------------------------------------------------------------------------------
// Raw CUDA steps.

/// The outcome of a CUDA collective on one rank.
pub(crate) struct CudaDone {
    /// The operation's last event on the comm stream (the buffers are free once it completed),
    /// if one was recorded.
    pub final_event: Option<Arc<CudaEvent>>,
    /// Timing events around the data movement (when the observer asked for them).
    pub timing: Option<(CudaEvent, CudaEvent)>,
    pub result: Result<()>,
}

impl CudaDone {
    /// A failure before any buffer was shared.
    pub(crate) fn failed(e: Error) -> CudaDone {
        CudaDone {
            final_event: None,
            timing: None,
            result: Err(e),
        }
    }
}
