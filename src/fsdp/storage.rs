//! Free and refill a tensor's storage in place, under a live autograd graph: FSDP1's
//! `storage.resize_(0)` / `resize_(n)` + copy, in Candle.
//!
//! Candle's autograd graph holds `Arc`s to the tensors an op used (e.g. a Linear's weight for the
//! backward of its matmul), so dropping our handles never frees a parameter the graph still
//! references. These two in-place ops work on the storage *behind* those `Arc`s instead:
//! - [`free`] swaps the storage's buffer for an empty one: the memory is returned at once, while
//!   every tensor of the graph still points at the (now empty) storage;
//! - [`refill`] moves a new buffer with the parameter's values into that same storage just before
//!   the unit's backward, so the graph reads the right values again.
//!
//! Measured with Candle 0.11 (tests/fsdp/refill.rs): gradients after free + refill are bit-identical
//! to plain Candle's, for Linear, Conv2d, Embedding, a parameter used twice, and bf16.
//!
//! Only the storage of the tensor itself is affected: copies the forward made of a parameter
//! (a dtype cast, a `contiguous()` of a non-contiguous view) are separate storages that the graph
//! keeps alive until backward; `design/step.md` lists the bytes that stay per unit type.
//!
//! A freed tensor must not be read until it is refilled (a CPU kernel would index an empty
//! buffer): the unit state machine (`super::param_group`) guarantees it.
//!
//! **CUDA** (feature `cuda`): the same swap on a [`candle_core::CudaStorage`]'s slice. The old
//! `CudaSlice` is dropped, which (cudarc's event tracking, on for every context with more than
//! one stream) makes its stream wait for the slice's last read and write events and then frees
//! it stream-ordered (`cuMemFreeAsync`): the memory returns to the pool only after every kernel
//! that read it, on whatever stream, has run — FSDP2's rule, without a host sync. The
//! placeholder is a one-element slice (a zero-byte `cuMemAllocAsync` is not portable). A refill
//! is one device-to-device copy on the compute stream.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Tensor};

use crate::error::{Error, Result};

/// Empties a storage's buffer (keeps its dtype).
struct Free;

impl candle_core::InplaceOp1 for Free {
    fn name(&self) -> &'static str {
        "fsdp-free-storage"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, _layout: &Layout) -> candle_core::Result<()> {
        match storage {
            CpuStorage::F32(v) => *v = Vec::new(),
            CpuStorage::BF16(v) => *v = Vec::new(),
            CpuStorage::F16(v) => *v = Vec::new(),
            CpuStorage::F64(v) => *v = Vec::new(),
            CpuStorage::U8(v) => *v = Vec::new(),
            CpuStorage::U32(v) => *v = Vec::new(),
            CpuStorage::I64(v) => *v = Vec::new(),
            other => candle_core::bail!("fsdp-free-storage: unsupported dtype {:?}", other.dtype()),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &mut candle_core::CudaStorage,
        _layout: &Layout,
    ) -> candle_core::Result<()> {
        cuda::free(storage)
    }
}

/// Empties a storage's buffer when the tensor covers all of it (contiguous, from offset 0, as
/// many elements as the buffer): a view of part of a larger buffer is left alone.
struct FreeWhole {
    freed: std::sync::atomic::AtomicBool,
}

fn buffer_len(storage: &CpuStorage) -> Option<usize> {
    Some(match storage {
        CpuStorage::F32(v) => v.len(),
        CpuStorage::BF16(v) => v.len(),
        CpuStorage::F16(v) => v.len(),
        CpuStorage::F64(v) => v.len(),
        _ => return None,
    })
}

impl candle_core::InplaceOp1 for FreeWhole {
    fn name(&self) -> &'static str {
        "fsdp-free-whole-storage"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let n = layout.shape().elem_count();
        if n > 0
            && layout.is_contiguous()
            && layout.start_offset() == 0
            && buffer_len(storage) == Some(n)
        {
            Free.cpu_fwd(storage, layout)?;
            self.freed.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &mut candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<()> {
        let n = layout.shape().elem_count();
        if n > 0
            && layout.is_contiguous()
            && layout.start_offset() == 0
            && cuda::buffer_len(storage) == Some(n)
        {
            cuda::free(storage)?;
            self.freed.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }
}

/// Replaces the destination's buffer with a copy of the source's elements (the source layout's
/// contiguous range). The destination must have a contiguous layout starting at offset 0 (a
/// variable) and the same dtype and element count as the source.
struct Refill;

fn copy_range<T: Copy>(src: &[T], l: &Layout, n: usize) -> candle_core::Result<Vec<T>> {
    match l.contiguous_offsets() {
        Some((start, end)) if end - start == n => Ok(src[start..end].to_vec()),
        _ => {
            candle_core::bail!("fsdp-refill: the source must be a contiguous range of {n} elements")
        }
    }
}

impl candle_core::InplaceOp2 for Refill {
    fn name(&self) -> &'static str {
        "fsdp-refill-storage"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        src: &CpuStorage,
        src_l: &Layout,
    ) -> candle_core::Result<()> {
        let n = dst_l.shape().elem_count();
        if dst_l.start_offset() != 0 || !dst_l.is_contiguous() {
            candle_core::bail!("fsdp-refill: the destination must be a whole contiguous tensor");
        }
        match (dst, src) {
            (CpuStorage::F32(d), CpuStorage::F32(s)) => *d = copy_range(s, src_l, n)?,
            (CpuStorage::BF16(d), CpuStorage::BF16(s)) => *d = copy_range(s, src_l, n)?,
            (CpuStorage::F16(d), CpuStorage::F16(s)) => *d = copy_range(s, src_l, n)?,
            (CpuStorage::F64(d), CpuStorage::F64(s)) => *d = copy_range(s, src_l, n)?,
            (d, s) => candle_core::bail!(
                "fsdp-refill: dtype {:?} cannot be refilled from {:?}",
                d.dtype(),
                s.dtype()
            ),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        src: &candle_core::CudaStorage,
        src_l: &Layout,
    ) -> candle_core::Result<()> {
        let n = dst_l.shape().elem_count();
        if dst_l.start_offset() != 0 || !dst_l.is_contiguous() {
            candle_core::bail!("fsdp-refill: the destination must be a whole contiguous tensor");
        }
        cuda::refill(dst, src, src_l, n)
    }
}

/// The CUDA halves of the ops above.
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::CudaStorageSlice as S;
    use candle_core::{CudaStorage, Layout};

    /// Elements of a float storage's slice (`None` for other dtypes).
    pub(super) fn buffer_len(storage: &CudaStorage) -> Option<usize> {
        Some(match &storage.slice {
            S::F32(v) => v.len(),
            S::BF16(v) => v.len(),
            S::F16(v) => v.len(),
            S::F64(v) => v.len(),
            _ => return None,
        })
    }

    /// Swaps the slice for a one-element placeholder; dropping the old slice frees it
    /// stream-ordered after its last use (see the module docs).
    pub(super) fn free(storage: &mut CudaStorage) -> candle_core::Result<()> {
        let stream = storage.device.cuda_stream();
        let w = |e: cudarc::driver::DriverError| {
            candle_core::Error::Msg(format!("fsdp-free-storage: {e:?}"))
        };
        match &mut storage.slice {
            S::F32(v) => *v = stream.alloc_zeros(1).map_err(w)?,
            S::BF16(v) => *v = stream.alloc_zeros(1).map_err(w)?,
            S::F16(v) => *v = stream.alloc_zeros(1).map_err(w)?,
            S::F64(v) => *v = stream.alloc_zeros(1).map_err(w)?,
            S::U8(v) => *v = stream.alloc_zeros(1).map_err(w)?,
            S::U32(v) => *v = stream.alloc_zeros(1).map_err(w)?,
            S::I64(v) => *v = stream.alloc_zeros(1).map_err(w)?,
            other => candle_core::bail!(
                "fsdp-free-storage: unsupported dtype {:?} on CUDA",
                slice_dtype(other)
            ),
        }
        Ok(())
    }

    fn slice_dtype(s: &S) -> &'static str {
        match s {
            S::U8(_) => "u8",
            S::U32(_) => "u32",
            S::I16(_) => "i16",
            S::I32(_) => "i32",
            S::I64(_) => "i64",
            S::BF16(_) => "bf16",
            S::F16(_) => "f16",
            S::F32(_) => "f32",
            S::F64(_) => "f64",
            _ => "an 8-bit or smaller float",
        }
    }

    /// Replaces `dst`'s slice with a device copy of `src`'s contiguous range of `n` elements
    /// (one `cuMemcpyDtoDAsync` on the destination's stream, the compute stream).
    pub(super) fn refill(
        dst: &mut CudaStorage,
        src: &CudaStorage,
        src_l: &Layout,
        n: usize,
    ) -> candle_core::Result<()> {
        let (start, end) = match src_l.contiguous_offsets() {
            Some((start, end)) if end - start == n => (start, end),
            _ => candle_core::bail!(
                "fsdp-refill: the source must be a contiguous range of {n} elements"
            ),
        };
        let stream = dst.device.cuda_stream();
        let w =
            |e: cudarc::driver::DriverError| candle_core::Error::Msg(format!("fsdp-refill: {e:?}"));
        match (&mut dst.slice, &src.slice) {
            (S::F32(d), S::F32(s)) => *d = stream.clone_dtod(&s.slice(start..end)).map_err(w)?,
            (S::BF16(d), S::BF16(s)) => *d = stream.clone_dtod(&s.slice(start..end)).map_err(w)?,
            (S::F16(d), S::F16(s)) => *d = stream.clone_dtod(&s.slice(start..end)).map_err(w)?,
            (S::F64(d), S::F64(s)) => *d = stream.clone_dtod(&s.slice(start..end)).map_err(w)?,
            (d, s) => candle_core::bail!(
                "fsdp-refill: dtype {} cannot be refilled from {}",
                slice_dtype(d),
                slice_dtype(s)
            ),
        }
        Ok(())
    }
}

/// Frees `t`'s storage in place (every tensor sharing it sees an empty buffer).
///
/// Errors: a device without an implementation (Metal).
pub(crate) fn free(t: &Tensor) -> Result<()> {
    t.inplace_op1(&Free).map_err(Error::from)
}

/// Frees `t`'s storage in place when `t` covers all of it (see [`FreeWhole`]); returns whether
/// it did. Used for unit outputs whose values are kept elsewhere until backward.
///
/// Errors: a device without an implementation.
pub(crate) fn free_whole(t: &Tensor) -> Result<bool> {
    let op = FreeWhole {
        freed: std::sync::atomic::AtomicBool::new(false),
    };
    t.inplace_op1(&op)?;
    Ok(op.freed.load(std::sync::atomic::Ordering::Relaxed))
}

/// Refills `t`'s storage in place with the elements of `src` (same dtype and element count,
/// contiguous; typically a narrow view of the gathered flat buffer). `t` must be a whole
/// contiguous tensor (a parameter variable).
///
/// Errors: dtype or element-count mismatch, a non-contiguous source, an unsupported device.
pub(crate) fn refill(t: &Tensor, src: &Tensor) -> Result<()> {
    if t.dtype() != src.dtype() || t.elem_count() != src.elem_count() {
        return Err(Error::shape(
            "refill: the source",
            format!(
                "{:?} x {} elements (the parameter's)",
                t.dtype(),
                t.elem_count()
            ),
            format!("{:?} x {}", src.dtype(), src.elem_count()),
        ));
    }
    t.inplace_op2(src, &Refill).map_err(Error::from)
}

/// Moves the buffer out of a storage, leaving it empty (the first half of [`adopt`]).
struct Take(std::sync::Mutex<Option<CpuStorage>>);

impl candle_core::InplaceOp1 for Take {
    fn name(&self) -> &'static str {
        "fsdp-take-storage"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let n = layout.shape().elem_count();
        if !(layout.is_contiguous() && layout.start_offset() == 0 && buffer_len(storage) == Some(n))
        {
            candle_core::bail!("fsdp-adopt: the source must be a whole f32/bf16/f16/f64 buffer")
        }
        let empty = match storage {
            CpuStorage::F32(_) => CpuStorage::F32(Vec::new()),
            CpuStorage::BF16(_) => CpuStorage::BF16(Vec::new()),
            CpuStorage::F16(_) => CpuStorage::F16(Vec::new()),
            _ => CpuStorage::F64(Vec::new()),
        };
        let taken = std::mem::replace(storage, empty);
        *self
            .0
            .lock()
            .map_err(|_| candle_core::Error::Msg("fsdp-adopt: poisoned".into()))? = Some(taken);
        Ok(())
    }
}

/// Puts a taken buffer into a storage (the second half of [`adopt`]).
struct Put(std::sync::Mutex<Option<CpuStorage>>);

impl candle_core::InplaceOp1 for Put {
    fn name(&self) -> &'static str {
        "fsdp-put-storage"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let mut slot = self
            .0
            .lock()
            .map_err(|_| candle_core::Error::Msg("fsdp-adopt: poisoned".into()))?;
        let Some(buffer) = slot.take() else {
            candle_core::bail!("fsdp-adopt: nothing to put")
        };
        if buffer.dtype() != storage.dtype()
            || buffer_len(&buffer) != Some(layout.shape().elem_count())
        {
            candle_core::bail!("fsdp-adopt: the buffer does not fit the destination")
        }
        *storage = buffer;
        Ok(())
    }
}

/// Refills `dst`'s storage in place with `src`'s buffer itself, without a copy: `src` (a whole
/// contiguous CPU tensor of `dst`'s dtype and element count, typically a fresh all-gather
/// output that nothing else references) is left empty. Every tensor sharing `dst`'s storage
/// (the views of a group bound for fused nodes) then reads the new values.
///
/// Errors: dtype or element-count mismatch, a source that is not a whole buffer, a device other
/// than the CPU.
pub(crate) fn adopt(dst: &Tensor, src: &Tensor) -> Result<()> {
    if dst.dtype() != src.dtype() || dst.elem_count() != src.elem_count() {
        return Err(Error::shape(
            "adopt: the source",
            format!(
                "{:?} x {} elements (the destination's)",
                dst.dtype(),
                dst.elem_count()
            ),
            format!("{:?} x {}", src.dtype(), src.elem_count()),
        ));
    }
    if !dst.device().is_cpu() || !src.device().is_cpu() {
        return Err(Error::device(
            "adopt: a buffer",
            "the CPU (only CPU buffers move without a copy)",
            if dst.device().is_cpu() {
                src.device().location()
            } else {
                dst.device().location()
            },
        ));
    }
    let take = Take(std::sync::Mutex::new(None));
    src.inplace_op1(&take)?;
    let put = Put(take.0);
    dst.inplace_op1(&put).map_err(Error::from)
}

/// True when `a` and `b` share one storage (views of each other): the one definition,
/// [`crate::device::same_storage`].
pub(crate) use crate::device::same_storage;

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    /// `adopt` moves the source's buffer into the destination's storage: every view of the
    /// destination reads the new values, the source is left empty, nothing is copied; a source
    /// of another size is refused with both sizes named.
    #[test]
    fn adopt_moves_the_buffer_under_every_view() {
        let dst = Tensor::arange(0f32, 6., &Device::Cpu).unwrap();
        let view = dst.narrow(0, 2, 3).unwrap().detach();
        free(&dst).unwrap();
        let src = Tensor::arange(10f32, 16., &Device::Cpu).unwrap();
        let ptr = {
            let (s, _) = src.storage_and_layout();
            match &*s {
                candle_core::Storage::Cpu(CpuStorage::F32(v)) => v.as_ptr() as usize,
                _ => unreachable!(),
            }
        };
        adopt(&dst, &src).unwrap();
        assert_eq!(view.to_vec1::<f32>().unwrap(), [12., 13., 14.]);
        assert_eq!(
            dst.to_vec1::<f32>().unwrap(),
            [10., 11., 12., 13., 14., 15.]
        );
        let (s, _) = dst.storage_and_layout();
        match &*s {
            candle_core::Storage::Cpu(CpuStorage::F32(v)) => assert_eq!(v.as_ptr() as usize, ptr),
            _ => unreachable!(),
        }
        drop(s);
        let (s, _) = src.storage_and_layout();
        match &*s {
            candle_core::Storage::Cpu(CpuStorage::F32(v)) => assert!(v.is_empty()),
            _ => unreachable!(),
        }
        drop(s);
        let e = adopt(
            &dst,
            &Tensor::zeros(5, candle_core::DType::F32, &Device::Cpu).unwrap(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("6 elements") && e.contains("x 5"), "{e}");
    }
}
