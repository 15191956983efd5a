//! The one way into a tensor's storage: [`with_storage`] (read lock), [`with_storage_mut`]
//! (write lock, optionally with a second tensor read-locked), and [`same_storage`].
//!
//! Candle keeps a tensor's storage behind a lock shared by every view of it. Reading takes the
//! read lock ([`Tensor::storage_and_layout`]). Writing in place goes through Candle's in-place
//! op API ([`Tensor::inplace_op1`] / [`Tensor::inplace_op2`]), which takes the write lock (and
//! the second tensor's read lock) and calls the op's `cpu_fwd` or `cuda_fwd`; the adapter here
//! is that op, for both devices, handing the storage to a closure as [`StorageMut`]. The
//! closure runs at most once, and its value comes back as it is (no round trip through
//! Candle's error type). Candle's `CudaStorage` exists in every build (a stub without feature
//! `cuda`), so the enums below need no `cfg`.

use std::cell::Cell;

use candle_core::{CpuStorage, CudaStorage, InplaceOp1, InplaceOp2, Layout, Storage, Tensor};

use crate::error::{Error, Result};

/// A tensor's storage, write-locked.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum StorageMut<'a> {
    /// On the host.
    Cpu(&'a mut CpuStorage),
    /// On a GPU (only in a build with feature `cuda`).
    Cuda(&'a mut CudaStorage),
}

/// A tensor's storage, read-locked.
#[derive(Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum StorageRef<'a> {
    /// On the host.
    Cpu(&'a CpuStorage),
    /// On a GPU (only in a build with feature `cuda`).
    Cuda(&'a CudaStorage),
}

/// Candle refused the in-place op before calling the closure: the output shares storage with
/// the input, or a device without an in-place implementation (Metal). Candle's own error.
#[derive(Debug)]
pub(crate) struct Refused(pub(crate) candle_core::Error);

impl From<Refused> for Error {
    fn from(r: Refused) -> Self {
        Error::from(r.0)
    }
}

/// Calls `f` with `t`'s storage and layout under its read lock. The lock is held while `f`
/// runs: `f` must not write `t` (or any view of its storage).
///
/// Errors: `t` on a device other than the CPU or a GPU.
pub(crate) fn with_storage<R>(
    t: &Tensor,
    f: impl FnOnce(StorageRef<'_>, &Layout) -> R,
) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let s = match &*storage {
        Storage::Cpu(c) => StorageRef::Cpu(c),
        Storage::Cuda(c) => StorageRef::Cuda(c),
        _ => {
            return Err(Error::device(
                "a tensor",
                "the CPU or a CUDA GPU (only CPU and CUDA storage is supported)",
                t.device().location(),
            ))
        }
    };
    Ok(f(s, layout))
}

/// The closure of one in-place op and its value, run at most once.
struct Op<'s, F, R> {
    name: &'static str,
    f: Cell<Option<F>>,
    out: &'s Cell<Option<R>>,
}

impl<F, R> Op<'_, F, R>
where
    F: FnOnce(StorageMut<'_>, &Layout, Option<(StorageRef<'_>, &Layout)>) -> R,
{
    fn run(&self, s: StorageMut<'_>, l: &Layout, src: Option<(StorageRef<'_>, &Layout)>) {
        if let Some(f) = self.f.take() {
            self.out.set(Some(f(s, l, src)));
        }
    }
}

impl<F, R> InplaceOp1 for Op<'_, F, R>
where
    F: FnOnce(StorageMut<'_>, &Layout, Option<(StorageRef<'_>, &Layout)>) -> R,
{
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        self.run(StorageMut::Cpu(s), l, None);
        Ok(())
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        self.run(StorageMut::Cuda(s), l, None);
        Ok(())
    }
}

impl<F, R> InplaceOp2 for Op<'_, F, R>
where
    F: FnOnce(StorageMut<'_>, &Layout, Option<(StorageRef<'_>, &Layout)>) -> R,
{
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        self.run(StorageMut::Cpu(s1), l1, Some((StorageRef::Cpu(s2), l2)));
        Ok(())
    }

    fn cuda_fwd(
        &self,
        s1: &mut CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        self.run(StorageMut::Cuda(s1), l1, Some((StorageRef::Cuda(s2), l2)));
        Ok(())
    }
}

/// Calls `f` with `dst`'s storage and layout under its write lock and, when given, `src`'s under
/// its read lock (Candle's in-place op API, named `name`), and returns `f`'s value.
///
/// Errors ([`Refused`], Candle's error): Candle refused before calling `f` (`dst` and `src`
/// share storage or sit on different devices; a device without in-place ops).
pub(crate) fn with_storage_mut<R>(
    dst: &Tensor,
    src: Option<&Tensor>,
    name: &'static str,
    f: impl FnOnce(StorageMut<'_>, &Layout, Option<(StorageRef<'_>, &Layout)>) -> R,
) -> std::result::Result<R, Refused> {
    let out = Cell::new(None);
    let op = Op {
        name,
        f: Cell::new(Some(f)),
        out: &out,
    };
    let ran = match src {
        Some(s) => dst.inplace_op2(s, &op),
        None => dst.inplace_op1(&op),
    };
    match (out.take(), ran) {
        (Some(r), _) => Ok(r),
        (None, Err(e)) => Err(Refused(e)),
        (None, Ok(())) => Err(Refused(candle_core::Error::Msg(format!(
            "{name}: Candle did not run the in-place op"
        )))),
    }
}

/// Whether `a` and `b` share one storage (views of one tensor, or the same tensor): their
/// `Storage` objects, inside Candle's shared lock, are one. Holds for every device and dtype,
/// and for empty tensors.
pub(crate) fn same_storage(a: &Tensor, b: &Tensor) -> bool {
    let addr = |t: &Tensor| {
        let (s, _) = t.storage_and_layout();
        std::ptr::from_ref::<Storage>(&*s) as usize
    };
    addr(a) == addr(b)
}
