//! The launch wrappers of the kernels of [`crate::kernels`] over Candle tensors (feature
//! `cuda`): the GPU side of [`crate::ops`].
//!
//! **Arguments.** The wrappers behind an op of [`crate::ops`] (`adamw_`, `sgd_`, `scale_`,
//! `scale_check_finite_`, `check_finite_`, `add_`, `cast_checked`) take arguments that `ops`
//! has already checked (dtype, contiguity, device, element counts, distinct storages) and check
//! nothing again. The public ones with no `ops` front ([`cast`] with a stream, [`cast_into`],
//! [`copy_in`], [`copy_out`], [`sum_squares_into`], [`update_scale_`]) check their arguments
//! with the same helpers of `ops`.
//!
//! **Wrappers.** One function per kernel. Tensors are flat: any shape, but contiguous (a start
//! offset is fine: the optimizers pass narrowed views), on one GPU. In-place updates go through
//! Candle's in-place op API (`crate::device::with_storage_mut`), which holds each written
//! tensor's storage write lock during the launch; new outputs are fresh allocations wrapped
//! with [`Tensor::from_storage`]. This file holds the helpers and the wrappers of kernel modules
//! `cast` and `copy`; `update.rs` those of `ops` and `optim`. Kernels run on the
//! device's compute stream ([`CudaDevice::cuda_stream`]) unless a wrapper takes a `stream`.
//! Every buffer is passed to the launch through cudarc's views (or, for the per-parameter
//! pointers that `copy_in`/`copy_out` pass by value, through [`DevicePtr::device_ptr`] guards
//! held across the launch), so cudarc's stream-event tracking orders the kernel after the
//! buffers' producers on other streams and records its reads and writes for their consumers.
//! No wrapper copies anything between host and device, and none waits for the GPU.
//!
//! Launch configurations: element-wise kernels 1-D, [`THREADS`] threads,
//! [`kernels::elementwise_blocks`]`(n)` blocks (grid-stride); the sum of squares
//! [`kernels::sum_squares_blocks`]`(n)` blocks then one; `copy_in`/`copy_out` a 2-D grid, `y` =
//! the parameters of a batch (at most [`kernels::COPY_MAX_PARAMS`]), `x` = blocks over the
//! largest parameter (at most [`kernels::MAX_BLOCKS`]); `update_scale` one thread.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDType, CudaStorageSlice};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Storage, Tensor};
use cudarc::driver::{
    CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, LaunchArgs, LaunchConfig,
    PushKernelArg, SyncOnDrop,
};
use half::{bf16, f16};

mod update;

pub(super) use self::update::{adamw_, add_, check_finite_, scale_, scale_check_finite_, sgd_};
pub use self::update::{sum_squares_into, update_scale_};

use super::ScaleFactor;
use crate::device::{with_storage_mut, StorageMut, StorageRef};
use crate::error::{Error, Result};
use crate::flat_param::FlatParamLayout;
use crate::kernels::nvrtc::func;
use crate::kernels::plan;
use crate::kernels::{self, dtype_code, THREADS};

fn grid_config(grid: plan::Grid) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

// ---- helpers -------------------------------------------------------------------------------

fn launch_err(op: &str, e: impl std::fmt::Debug) -> Error {
    Error::Cuda(format!("launching {op}: {e:?}"))
}

fn config_1d(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (kernels::elementwise_blocks(n), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The GPU of `t`, or an error naming the op and the tensor.
fn device_of(op: &str, what: &str, t: &Tensor) -> Result<CudaDevice> {
    Ok(crate::device::cuda::cuda_device(t.device(), &format!("{op} ({what})"))?.clone())
}

/// Checks tensors for an f32 kernel: contiguous, f32, on one GPU (the first's), the same element
/// count (the first's, returned).
fn check_f32(op: &str, tensors: &[(&str, &Tensor)]) -> Result<usize> {
    let (first_name, first) = tensors[0];
    let dev = device_of(op, first_name, first)?;
    let n = first.elem_count();
    for &(what, t) in tensors {
        check_one(op, what, t, &dev, &[DType::F32])?;
        if t.elem_count() != n {
            return Err(super::bad(
                op,
                what,
                format!(
                    "has {} elements, expected {n} (those of {first_name})",
                    t.elem_count()
                ),
            ));
        }
    }
    Ok(n)
}

/// Checks one tensor: on `dev`, contiguous, of one of `dtypes`.
fn check_one(op: &str, what: &str, t: &Tensor, dev: &CudaDevice, dtypes: &[DType]) -> Result<()> {
    let d = device_of(op, what, t)?;
    if d.id() != dev.id() {
        return Err(Error::device(
            format!("{op}: {what}"),
            "the GPU of the other tensors",
            t.device().location(),
        ));
    }
    super::check_dtype_contiguous(op, what, t, dtypes)
}

/// Checks a one-element f32 tensor (a scale, a flag) on `dev`.
fn check_scalar(op: &str, what: &str, t: &Tensor, dev: &CudaDevice) -> Result<()> {
    check_one(op, what, t, dev, &[DType::F32])?;
    if t.elem_count() != 1 {
        return Err(super::bad(
            op,
            what,
            format!("must hold one element, found shape {:?}", t.dims()),
        ));
    }
    Ok(())
}

/// The CUDA storage inside a storage guard.
fn cuda_storage<'a>(s: &'a Storage, op: &str, what: &str) -> Result<&'a CudaStorage> {
    match s {
        Storage::Cuda(c) => Ok(c),
        _ => Err(super::bad(op, what, "is not on a GPU".to_string())),
    }
}

fn range(l: &Layout, op: &str, what: &str) -> Result<(usize, usize)> {
    l.contiguous_offsets().ok_or_else(|| {
        super::bad(
            op,
            what,
            format!(
                "must be contiguous, found shape {:?} with strides {:?}",
                l.dims(),
                l.stride()
            ),
        )
    })
}

/// The f32 elements of a tensor's storage, read-only.
fn f32_view<'a>(s: &'a CudaStorage, l: &Layout, op: &str, what: &str) -> Result<CudaView<'a, f32>> {
    let (start, end) = range(l, op, what)?;
    Ok(s.as_cuda_slice::<f32>()?.slice(start..end))
}

/// The f32 elements of a tensor's storage, writable.
fn f32_view_mut<'a>(
    s: &'a mut CudaStorage,
    l: &Layout,
    op: &str,
    what: &str,
) -> Result<CudaViewMut<'a, f32>> {
    let (start, end) = range(l, op, what)?;
    Ok(s.as_cuda_slice_mut::<f32>()?.slice_mut(start..end))
}

/// A read-only view of the elements of one of the kernels' dtypes.
enum AnyView<'a> {
    F32(CudaView<'a, f32>),
    BF16(CudaView<'a, bf16>),
    F16(CudaView<'a, f16>),
}

impl<'a> AnyView<'a> {
    fn new(s: &'a CudaStorage, l: &Layout, op: &str, what: &str) -> Result<Self> {
        let (start, end) = range(l, op, what)?;
        Ok(match &s.slice {
            CudaStorageSlice::F32(v) => AnyView::F32(v.slice(start..end)),
            CudaStorageSlice::BF16(v) => AnyView::BF16(v.slice(start..end)),
            CudaStorageSlice::F16(v) => AnyView::F16(v.slice(start..end)),
            _ => {
                return Err(Error::dtype(
                    format!("{op}: {what}"),
                    "f32, bf16 or f16",
                    s.dtype(),
                ))
            }
        })
    }

    fn push<'b, 's: 'b>(&'s self, b: &mut LaunchArgs<'b>) {
        match self {
            AnyView::F32(v) => b.arg(v),
            AnyView::BF16(v) => b.arg(v),
            AnyView::F16(v) => b.arg(v),
        };
    }
}

/// A writable view of the elements of one of the kernels' dtypes.
enum AnyViewMut<'a> {
    F32(CudaViewMut<'a, f32>),
    BF16(CudaViewMut<'a, bf16>),
    F16(CudaViewMut<'a, f16>),
}

impl<'a> AnyViewMut<'a> {
    fn new(s: &'a mut CudaStorage, l: &Layout, op: &str, what: &str) -> Result<Self> {
        let (start, end) = range(l, op, what)?;
        let dtype = s.dtype();
        Ok(match &mut s.slice {
            CudaStorageSlice::F32(v) => AnyViewMut::F32(v.slice_mut(start..end)),
            CudaStorageSlice::BF16(v) => AnyViewMut::BF16(v.slice_mut(start..end)),
            CudaStorageSlice::F16(v) => AnyViewMut::F16(v.slice_mut(start..end)),
            _ => {
                return Err(Error::dtype(
                    format!("{op}: {what}"),
                    "f32, bf16 or f16",
                    dtype,
                ))
            }
        })
    }

    fn push<'b, 's: 'b>(&'s mut self, b: &mut LaunchArgs<'b>) {
        match self {
            AnyViewMut::F32(v) => b.arg(v),
            AnyViewMut::BF16(v) => b.arg(v),
            AnyViewMut::F16(v) => b.arg(v),
        };
    }
}

/// Runs `f` on `t`'s CUDA storage under its write lock ([`crate::device::with_storage_mut`]).
fn with_mut(
    t: &Tensor,
    name: &'static str,
    f: impl FnOnce(&mut CudaStorage, &Layout) -> Result<()>,
) -> Result<()> {
    with_storage_mut(t, None, name, |s, l, _| match s {
        StorageMut::Cuda(s) => f(s, l),
        StorageMut::Cpu(_) => Err(Error::device(
            format!("{name}: a tensor of a CUDA kernel"),
            "a GPU",
            candle_core::DeviceLocation::Cpu,
        )),
    })?
}

/// Runs `f` on `dst`'s CUDA storage under its write lock and `src`'s under its read lock
/// ([`crate::device::with_storage_mut`]).
fn with_mut2(
    dst: &Tensor,
    src: &Tensor,
    name: &'static str,
    f: impl FnOnce(&mut CudaStorage, &Layout, &CudaStorage, &Layout) -> Result<()>,
) -> Result<()> {
    with_storage_mut(dst, Some(src), name, |d, dl, s| match (d, s) {
        (StorageMut::Cuda(d), Some((StorageRef::Cuda(s), sl))) => f(d, dl, s, sl),
        _ => Err(Error::device(
            format!("{name}: a tensor of a CUDA kernel"),
            "a GPU",
            candle_core::DeviceLocation::Cpu,
        )),
    })?
}

/// A new tensor of `shape` over a fresh device allocation.
fn wrap<T: CudaDType>(
    slice: cudarc::driver::CudaSlice<T>,
    dev: &CudaDevice,
    shape: impl Into<candle_core::Shape>,
    is_variable: bool,
) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, dev.clone()));
    Tensor::from_storage(storage, shape, BackpropOp::none(), is_variable)
}

/// A fresh device allocation of `n` elements of `dtype` on `stream`, unset (at least one element:
/// the driver refuses empty allocations).
///
/// # Safety
///
/// The memory is uninitialised: the caller must write every element a reader will see.
unsafe fn alloc_any(stream: &Arc<CudaStream>, dtype: DType, n: usize) -> Result<AnyOwned> {
    let n = n.max(1);
    let err = |e| Error::Cuda(format!("allocating {n} elements of {dtype:?}: {e:?}"));
    // SAFETY: forwarded to the caller (uninitialised memory).
    unsafe {
        Ok(match dtype {
            DType::F32 => AnyOwned::F32(stream.alloc::<f32>(n).map_err(err)?),
            DType::BF16 => AnyOwned::BF16(stream.alloc::<bf16>(n).map_err(err)?),
            DType::F16 => AnyOwned::F16(stream.alloc::<f16>(n).map_err(err)?),
            other => return Err(Error::dtype("a GPU buffer", "f32, bf16 or f16", other)),
        })
    }
}

/// A fresh allocation of one of the kernels' dtypes.
enum AnyOwned {
    F32(cudarc::driver::CudaSlice<f32>),
    BF16(cudarc::driver::CudaSlice<bf16>),
    F16(cudarc::driver::CudaSlice<f16>),
}

impl AnyOwned {
    fn push<'b, 's: 'b>(&'s mut self, b: &mut LaunchArgs<'b>) {
        match self {
            AnyOwned::F32(v) => b.arg(v),
            AnyOwned::BF16(v) => b.arg(v),
            AnyOwned::F16(v) => b.arg(v),
        };
    }

    /// Device address for a kernel argument passed by value, and the guard that records the
    /// write on `stream` when dropped (after the launch).
    fn ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        match self {
            AnyOwned::F32(v) => v.device_ptr_mut(stream),
            AnyOwned::BF16(v) => v.device_ptr_mut(stream),
            AnyOwned::F16(v) => v.device_ptr_mut(stream),
        }
    }

    fn into_tensor(
        self,
        dev: &CudaDevice,
        shape: impl Into<candle_core::Shape>,
        is_variable: bool,
    ) -> Tensor {
        match self {
            AnyOwned::F32(v) => wrap(v, dev, shape, is_variable),
            AnyOwned::BF16(v) => wrap(v, dev, shape, is_variable),
            AnyOwned::F16(v) => wrap(v, dev, shape, is_variable),
        }
    }
}

/// Optional one-element f32 inputs of a kernel (a device scale, a found-inf flag), read-only:
/// the storage guard, then a view of it.
type Guard<'a> = Option<(candle_core::StorageRef<'a>, &'a Layout)>;

fn guard(t: Option<&Tensor>) -> Guard<'_> {
    t.map(|t| t.storage_and_layout())
}

fn guard_view<'a>(g: &'a Guard<'_>, op: &str, what: &str) -> Result<Option<CudaView<'a, f32>>> {
    match g {
        None => Ok(None),
        Some((s, l)) => Ok(Some(f32_view(cuda_storage(s, op, what)?, l, op, what)?)),
    }
}

/// Pushes an optional device pointer: the view, or a null pointer (`null` must outlive the
/// launch).
fn push_opt<'b, 's: 'b>(b: &mut LaunchArgs<'b>, v: &'s Option<CudaView<'_, f32>>, null: &'s u64) {
    match v {
        Some(v) => b.arg(v),
        None => b.arg(null),
    };
}

/// The host value and optional device tensor of an unscale factor.
fn factor_parts<'a>(f: &ScaleFactor<'a>) -> (f32, Option<&'a Tensor>) {
    match *f {
        ScaleFactor::Value(v) => (v, None),
        ScaleFactor::Device(t) => (1.0, Some(t)),
    }
}

// ---- module `cast` -------------------------------------------------------------------------

/// `src` converted to `dtype` (f32, bf16 or f16; round to nearest even, as
/// [`kernels::cast_reference`]): a new contiguous tensor of `src`'s shape on `src`'s GPU, computed
/// on `stream` (default: the compute stream). A non-contiguous `src` is made contiguous first
/// (Candle's copy).
///
/// Errors: `src` not on a GPU or not f32/bf16/f16; `dtype` not f32/bf16/f16; a failed
/// allocation or launch.
pub fn cast(src: &Tensor, dtype: DType, stream: Option<&Arc<CudaStream>>) -> Result<Tensor> {
    const OP: &str = "cast";
    let dev = device_of(OP, "src", src)?;
    dtype_code(dtype)
        .ok_or_else(|| Error::dtype(format!("{OP}: target"), "f32, bf16 or f16", dtype))?;
    let fl = [DType::F32, DType::BF16, DType::F16];
    if !fl.contains(&src.dtype()) {
        // The message of the contiguous case (the check after a copy, before this version).
        check_one(OP, "src", src, &dev, &fl)?;
    }
    cast_checked(src, dtype, stream)
}

/// [`cast`] of arguments already checked ([`super::cast`]: `src` on a GPU, both dtypes f32,
/// bf16 or f16); `src` may be non-contiguous (copied first).
///
/// Errors: a failed allocation or launch.
pub(super) fn cast_checked(
    src: &Tensor,
    dtype: DType,
    stream: Option<&Arc<CudaStream>>,
) -> Result<Tensor> {
    const OP: &str = "cast";
    let dev = device_of(OP, "src", src)?;
    let out_code = dtype_code(dtype).expect("checked by the caller");
    let src = if src.is_contiguous() {
        src.clone()
    } else {
        src.contiguous()?
    };
    let n = src.elem_count();
    let stream = stream.cloned().unwrap_or_else(|| dev.cuda_stream());
    // SAFETY: the launch below writes all n elements (n == 0: nothing to read).
    let mut out = unsafe { alloc_any(&stream, dtype, n)? };
    if n > 0 {
        let (s, l) = src.storage_and_layout();
        let input = AnyView::new(cuda_storage(&s, OP, "src")?, l, OP, "src")?;
        let src_code = dtype_code(src.dtype()).expect("checked above");
        let f = func(&dev, "cast", "cast")?;
        let n64 = n as u64;
        let mut b = stream.launch_builder(&f);
        input.push(&mut b);
        b.arg(&src_code);
        out.push(&mut b);
        b.arg(&out_code);
        b.arg(&n64);
        // SAFETY: `cast(const void*, u32, void*, u32, u64)`: the argument types and order match;
        // the input view and the output allocation hold n elements of the dtypes whose codes are
        // passed; they are distinct allocations.
        unsafe { b.launch(config_1d(n)) }.map_err(|e| launch_err("cast::cast", e))?;
    }
    Ok(out.into_tensor(&dev, src.shape().clone(), false))
}

/// Converts `src` into the existing tensor `dst` (same element count, both contiguous,
/// f32/bf16/f16, distinct storages, one GPU), on the compute stream.
///
/// Errors: as [`cast`]; element counts or devices differing.
pub fn cast_into(src: &Tensor, dst: &Tensor) -> Result<()> {
    const OP: &str = "cast_into";
    let dev = device_of(OP, "dst", dst)?;
    let fl = [DType::F32, DType::BF16, DType::F16];
    check_one(OP, "src", src, &dev, &fl)?;
    check_one(OP, "dst", dst, &dev, &fl)?;
    let n = dst.elem_count();
    if src.elem_count() != n {
        return Err(super::bad(
            OP,
            "src",
            format!("has {} elements, dst {n}", src.elem_count()),
        ));
    }
    super::check_distinct(OP, &[("src", src), ("dst", dst)])?;
    if n == 0 {
        return Ok(());
    }
    let (src_code, dst_code) = (
        dtype_code(src.dtype()).expect("checked"),
        dtype_code(dst.dtype()).expect("checked"),
    );
    let f = func(&dev, "cast", "cast")?;
    let cs = dev.cuda_stream();
    with_mut2(dst, src, OP, |ds, dl, ss, sl| {
        let input = AnyView::new(ss, sl, OP, "src")?;
        let mut out = AnyViewMut::new(ds, dl, OP, "dst")?;
        let n64 = n as u64;
        let mut b = cs.launch_builder(&f);
        input.push(&mut b);
        b.arg(&src_code);
        out.push(&mut b);
        b.arg(&dst_code);
        b.arg(&n64);
        // SAFETY: as in `cast`: matching argument list, n elements in both views,
        // distinct storages (checked).
        unsafe { b.launch(config_1d(n)) }.map_err(|e| launch_err("cast::cast", e))?;
        Ok(())
    })?;
    Ok(())
}

// ---- module `copy` -------------------------------------------------------------------------

/// Copy-in on the GPU: one unit's parameter gradients into a new flat reduction buffer in
/// `reduce_dtype` (f32, bf16 or f16), with exactly the layout of `fsdp::collectives::
/// flatten_grads` followed by its cast to `reduce_dtype` ([`kernels::copy_in_reference`]): 1-D,
/// `world_size × (shard_numel + F)` elements, chunk `c` holding flat `[c·S, (c+1)·S)` and then
/// the `F` presence flags (1 where the parameter has a gradient). `None` when the layout has no
/// element.
///
/// `grads[q]`: parameter `q`'s gradient (layout order; `None` or past the end: absent), any
/// shape of `numel` elements, f32/bf16/f16 (mixed dtypes are fine), on `device`; a
/// non-contiguous gradient is made contiguous first (Candle's copy). One launch per
/// [`kernels::COPY_MAX_PARAMS`] parameters, every element written exactly once (no zero-fill
/// pass); the descriptors travel by value in the kernel parameters, so there is no host→device
/// copy. Runs on `stream` (default: the compute stream), after the gradients' producers.
///
/// Errors: a gradient of the wrong element count, dtype or device; `reduce_dtype` not
/// f32/bf16/f16; a failed allocation or launch.
pub fn copy_in(
    layout: &FlatParamLayout,
    grads: &[Option<&Tensor>],
    reduce_dtype: DType,
    device: &CudaDevice,
    stream: Option<&Arc<CudaStream>>,
) -> Result<Option<Tensor>> {
    const OP: &str = "copy_in";
    if layout.padded_numel == 0 {
        return Ok(None);
    }
    let out_code = dtype_code(reduce_dtype).ok_or_else(|| {
        Error::dtype(
            format!("{OP}: reduce dtype"),
            "f32, bf16 or f16",
            reduce_dtype,
        )
    })?;
    if grads.len() > layout.params.len() {
        return Err(Error::shape(
            format!("{OP}: gradients"),
            format!("at most {} (one per parameter)", layout.params.len()),
            grads.len(),
        ));
    }
    let fl = [DType::F32, DType::BF16, DType::F16];
    let mut owned: Vec<Option<Tensor>> = Vec::with_capacity(layout.params.len());
    for (q, p) in layout.params.iter().enumerate() {
        let Some(g) = grads.get(q).copied().flatten() else {
            owned.push(None);
            continue;
        };
        let what = format!("gradient of {}", p.name);
        if g.elem_count() != p.numel {
            return Err(super::bad(
                OP,
                &what,
                format!("has {} elements, the parameter {}", g.elem_count(), p.numel),
            ));
        }
        let g = if g.is_contiguous() {
            g.clone()
        } else {
            g.contiguous()?
        };
        check_one(OP, &what, &g, device, &fl)?;
        owned.push(Some(g));
    }
    let (s, f, w) = (layout.shard_numel, layout.params.len(), layout.world_size);
    let total = w * (s + f);
    let stream = stream.cloned().unwrap_or_else(|| device.cuda_stream());
    let func = func(device, "copy", "copy_in")?;
    // Read guards of the gradients, then their addresses with cudarc's read-tracking guards,
    // held until every launch is issued.
    let guards: Vec<Option<(candle_core::StorageRef<'_>, &Layout)>> = owned
        .iter()
        .map(|g| g.as_ref().map(|g| g.storage_and_layout()))
        .collect();
    let mut syncs: Vec<SyncOnDrop<'_>> = Vec::with_capacity(f);
    let mut srcs: Vec<(u64, u32)> = Vec::with_capacity(f);
    for (q, g) in guards.iter().enumerate() {
        let Some((st, l)) = g else {
            srcs.push((0, 0));
            continue;
        };
        let what = &layout.params[q].name;
        let cs = cuda_storage(st, OP, what)?;
        let start = range(l, OP, what)?.0;
        let (base, sync, size, code) = match &cs.slice {
            CudaStorageSlice::F32(v) => {
                let (p, s) = v.device_ptr(&stream);
                (p, s, 4u64, 0u32)
            }
            CudaStorageSlice::BF16(v) => {
                let (p, s) = v.device_ptr(&stream);
                (p, s, 2, 1)
            }
            CudaStorageSlice::F16(v) => {
                let (p, s) = v.device_ptr(&stream);
                (p, s, 2, 2)
            }
            _ => unreachable!("dtype checked above"),
        };
        syncs.push(sync);
        srcs.push((base + start as u64 * size, code));
    }
    // SAFETY: the batches below write every element: each parameter's region (from its offset
    // to the next parameter's, the last one's to the end of the W·S flat elements; the first
    // parameter's offset is 0) and its W flags.
    let mut out = unsafe { alloc_any(&stream, reduce_dtype, total)? };
    for (args, grid) in plan::copy_in_plan(&layout.copy_layout(), &srcs, out_code) {
        let mut b = stream.launch_builder(&func);
        out.push(&mut b);
        b.arg(&args);
        // SAFETY: `copy_in(void*, const __grid_constant__ CopyInArgs)`: the argument list
        // matches; `out` holds W·(S+F) elements of `out_dtype`; every descriptor's source
        // address points at `numel` elements of its dtype inside a gradient whose storage stays
        // read-locked and read-tracked (`syncs`) until after the launch; regions lie in
        // [0, W·S], so every write index is below W·(S+F).
        unsafe { b.launch(grid_config(grid)) }.map_err(|e| launch_err("copy::copy_in", e))?;
    }
    drop(syncs);
    drop(guards);
    Ok(Some(out.into_tensor(device, total, false)))
}

/// Copy-out on the GPU: each parameter of `layout` (layout order) as its own new contiguous
/// tensor of its shape in `dtype` (f32/bf16/f16; a plain copy when `flat` has that dtype), the
/// elements `[offset, offset + numel)` of the gathered flat buffer `flat`
/// ([`kernels::copy_out_reference`]; `fsdp::collectives::param_copies`). With `is_variable` the
/// tensors are created as variables (for `Var::from_tensor` without a second copy). One launch
/// per [`kernels::COPY_MAX_PARAMS`] parameters, output addresses passed by value. Runs on `stream`
/// (default: the compute stream).
///
/// Where no copy is needed (a forward without autograd), views of the gathered buffer
/// (`fsdp::collectives::param_views`: `narrow` + `reshape`) cost nothing and need no kernel.
///
/// Errors: `flat` not a contiguous f32/bf16/f16 GPU tensor covering every parameter; a failed
/// allocation or launch.
pub fn copy_out(
    layout: &FlatParamLayout,
    flat: &Tensor,
    dtype: DType,
    is_variable: bool,
    stream: Option<&Arc<CudaStream>>,
) -> Result<Vec<Tensor>> {
    const OP: &str = "copy_out";
    let dev = device_of(OP, "flat", flat)?;
    check_one(
        OP,
        "flat",
        flat,
        &dev,
        &[DType::F32, DType::BF16, DType::F16],
    )?;
    let dst_code = dtype_code(dtype)
        .ok_or_else(|| Error::dtype(format!("{OP}: dtype"), "f32, bf16 or f16", dtype))?;
    let src_code = dtype_code(flat.dtype()).expect("checked");
    let need = layout
        .params
        .iter()
        .map(|p| p.offset + p.numel)
        .max()
        .unwrap_or(0);
    if flat.elem_count() < need {
        return Err(Error::shape(
            format!("{OP}: the flat buffer"),
            format!("{need} elements (those the parameters need)"),
            format!("{} elements", flat.elem_count()),
        ));
    }
    let stream = stream.cloned().unwrap_or_else(|| dev.cuda_stream());
    let mut outs: Vec<AnyOwned> = Vec::with_capacity(layout.params.len());
    for p in &layout.params {
        // SAFETY: the launches below write all `numel` elements of every output.
        outs.push(unsafe { alloc_any(&stream, dtype, p.numel)? });
    }
    if need > 0 {
        let func = func(&dev, "copy", "copy_out")?;
        let (st, l) = flat.storage_and_layout();
        let input = AnyView::new(cuda_storage(&st, OP, "flat")?, l, OP, "flat")?;
        let mut syncs = Vec::with_capacity(outs.len());
        let mut dsts = Vec::with_capacity(outs.len());
        for o in outs.iter_mut() {
            let (dst, sync) = o.ptr_mut(&stream);
            syncs.push(sync);
            dsts.push(dst);
        }
        for (args, grid) in
            plan::copy_out_plan(&layout.copy_layout().spans, &dsts, src_code, dst_code)
        {
            let mut b = stream.launch_builder(&func);
            input.push(&mut b);
            b.arg(&args);
            // SAFETY: `copy_out(const void*, const __grid_constant__ CopyOutArgs)`: the argument
            // list matches; `flat` holds at least offset + numel elements of `src_dtype` for
            // every parameter (checked); every destination is a fresh allocation of at least
            // `numel` elements of `dst_dtype`, write-tracked by `syncs` until after the launch.
            unsafe { b.launch(grid_config(grid)) }.map_err(|e| launch_err("copy::copy_out", e))?;
        }
        drop(syncs);
    }
    Ok(outs
        .into_iter()
        .zip(&layout.params)
        .map(|(o, p)| o.into_tensor(&dev, p.shape.clone(), is_variable))
        .collect())
}
