//! The collectives of the thread backend on tensors: access to each tensor's CPU storage through
//! Candle's in-place ops, around the rendezvous and the kernels.
//!
//! The output (or in-place buffer) is written through [`Tensor::inplace_op1`] /
//! [`Tensor::inplace_op2`], which hand us `&mut CpuStorage` under the tensor's storage write lock
//! and the input's `&CpuStorage` under its read lock; the whole collective (rendezvous, copy,
//! second barrier) runs inside that call, so both locks are held for as long as peers may touch
//! the buffers. Candle refuses an output that shares storage with its input before calling us;
//! that, and every other local problem (device, shape, layout, dtype), is posted to the
//! rendezvous so that every rank fails with the same [`crate::Error::BadBuffer`].

use std::cell::RefCell;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DeviceLocation, InplaceOp1, InplaceOp2, Layout, Tensor};

use super::kernels::{self, with_elem};
use super::rendezvous::{supported, validate, AbortOnUnwind, Ctx, Kind, Problem, RawBuf};
use crate::comm::{OpKind, ReduceOp};
use crate::error::Result;

/// The first reason `t` cannot be posted as `which`, if any.
fn check(t: &Tensor, which: &'static str) -> Option<Problem> {
    let location = t.device().location();
    if location != DeviceLocation::Cpu {
        return Some(Problem::NotOnCpu {
            which,
            found: location,
        });
    }
    if t.rank() != 1 {
        return Some(Problem::NotOneD {
            which,
            dims: t.rank(),
        });
    }
    if !t.is_contiguous() {
        return Some(Problem::NotContiguous { which });
    }
    if !supported(t.dtype()) {
        return Some(Problem::Dtype {
            which,
            dtype: t.dtype(),
        });
    }
    None
}

/// Start address and length (elements) of a storage's vector.
macro_rules! storage_vec {
    ($storage:expr, $as_ptr:ident) => {
        match $storage {
            CpuStorage::U8(v) => (v.$as_ptr() as *mut u8, v.len()),
            CpuStorage::U32(v) => (v.$as_ptr() as *mut u8, v.len()),
            CpuStorage::I16(v) => (v.$as_ptr() as *mut u8, v.len()),
            CpuStorage::I32(v) => (v.$as_ptr() as *mut u8, v.len()),
            CpuStorage::I64(v) => (v.$as_ptr() as *mut u8, v.len()),
            CpuStorage::BF16(v) => (v.$as_ptr() as *mut u8, v.len()),
            CpuStorage::F16(v) => (v.$as_ptr() as *mut u8, v.len()),
            CpuStorage::F32(v) => (v.$as_ptr() as *mut u8, v.len()),
            CpuStorage::F64(v) => (v.$as_ptr() as *mut u8, v.len()),
            // Refused by `check` (unsupported dtypes) before any storage access.
            _ => (std::ptr::null_mut(), 0),
        }
    };
}

/// The tensor's elements inside `storage`: the address of element `layout.start_offset()`.
fn raw(base: *mut u8, vec_len: usize, storage: &CpuStorage, layout: &Layout) -> RawBuf {
    let dtype = storage.dtype();
    let (start, end) = layout
        .contiguous_offsets()
        .expect("contiguity checked before the storage is accessed");
    assert!(
        end <= vec_len,
        "layout {start}..{end} beyond storage {vec_len}"
    );
    RawBuf {
        // In bounds of the allocation (start <= end <= vec_len).
        ptr: base.wrapping_add(start * dtype.size_in_bytes()),
        len: end - start,
        dtype,
    }
}

/// A buffer this rank only reads (and peers read).
fn raw_read(storage: &CpuStorage, layout: &Layout) -> RawBuf {
    let (base, len) = storage_vec!(storage, as_ptr);
    raw(base, len, storage, layout)
}

/// A buffer this rank writes.
fn raw_write(storage: &mut CpuStorage, layout: &Layout) -> RawBuf {
    let (base, len) = storage_vec!(&mut *storage, as_mut_ptr);
    raw(base, len, storage, layout)
}

/// A Candle in-place op that runs a collective body with the raw buffers of its tensors.
struct WithStorage<F> {
    body: RefCell<Option<F>>,
    result: RefCell<Option<Result<()>>>,
}

impl<F: FnOnce(RawBuf, Option<RawBuf>) -> Result<()>> WithStorage<F> {
    fn new(body: F) -> Self {
        WithStorage {
            body: RefCell::new(Some(body)),
            result: RefCell::new(None),
        }
    }

    fn run(&self, dst: RawBuf, src: Option<RawBuf>) {
        if let Some(body) = self.body.borrow_mut().take() {
            *self.result.borrow_mut() = Some(body(dst, src));
        }
    }
}

impl<F: FnOnce(RawBuf, Option<RawBuf>) -> Result<()>> InplaceOp1 for WithStorage<F> {
    fn name(&self) -> &'static str {
        "thread-collective"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        self.run(raw_write(storage, layout), None);
        Ok(())
    }
}

impl<F: FnOnce(RawBuf, Option<RawBuf>) -> Result<()>> InplaceOp2 for WithStorage<F> {
    fn name(&self) -> &'static str {
        "thread-collective"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        src: &CpuStorage,
        src_l: &Layout,
    ) -> candle_core::Result<()> {
        self.run(raw_write(dst, dst_l), Some(raw_read(src, src_l)));
        Ok(())
    }
}

impl Ctx<'_> {
    /// Runs `body(dst, src)` with `dst` (named `which`) write-locked and `src` read-locked for
    /// the whole call, or takes part in the rendezvous only to report why it cannot.
    fn with_storage(
        &self,
        kind: OpKind,
        dst: &Tensor,
        which: &'static str,
        src: Option<&Tensor>,
        body: impl FnOnce(RawBuf, Option<RawBuf>) -> Result<()>,
    ) -> Result<()> {
        let kind_ = Kind::Op(kind);
        if let Some(problem) = src
            .and_then(|s| check(s, "input"))
            .or_else(|| check(dst, which))
        {
            return Err(self.fail_with(kind_, problem));
        }
        let op = WithStorage::new(body);
        // Our `cpu_fwd` never fails: an error here means Candle refused before calling it, i.e.
        // the output shares storage with the input (layouts and devices were checked above).
        let _refused = match src {
            Some(s) => dst.inplace_op2(s, &op),
            None => dst.inplace_op1(&op),
        };
        match op.result.into_inner() {
            Some(result) => result,
            None => Err(self.fail_with(kind_, Problem::Aliased)),
        }
    }

    pub(super) fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        let kind = OpKind::AllGather;
        self.with_storage(kind, output, "output", Some(input), |out, src| {
            let src = src.expect("all-gather has an input");
            let mut post = self.post(Kind::Op(kind));
            post.input = Some(src);
            post.output = Some(out);
            let (generation, posts) = self.rendezvous(post)?;
            validate(self.op, self.shared.world_size, &posts)?;
            let _guard = AbortOnUnwind(self.op);
            let srcs: Vec<RawBuf> = posts.iter().map(|p| p.input.expect("input")).collect();
            // SAFETY: validated posts; `out` is write-locked by this rank and read by nobody;
            // inputs stay alive and read-locked by their ranks until the second barrier.
            with_elem!(out.dtype, T => unsafe { kernels::gather::<T>(out, &srcs, src.len) });
            self.sync(generation + 1);
            Ok(())
        })
    }

    pub(super) fn reduce_scatter(
        &self,
        input: &Tensor,
        output: &Tensor,
        op: ReduceOp,
    ) -> Result<()> {
        let kind = OpKind::ReduceScatter;
        self.with_storage(kind, output, "output", Some(input), |out, src| {
            let mut post = self.post(Kind::Op(kind));
            post.input = src;
            post.output = Some(out);
            post.op = Some(op);
            let (generation, posts) = self.rendezvous(post)?;
            validate(self.op, self.shared.world_size, &posts)?;
            let _guard = AbortOnUnwind(self.op);
            let start = self.rank * out.len;
            let srcs: Vec<RawBuf> = posts.iter().map(|p| p.input.expect("input")).collect();
            let ws = self.shared.world_size;
            // SAFETY: as in `all_gather`; `out` is disjoint from every input.
            with_elem!(out.dtype, T => unsafe {
                kernels::reduce_shard::<T>(out, &srcs, start, op, ws)
            });
            self.sync(generation + 1);
            Ok(())
        })
    }

    pub(super) fn all_reduce(&self, buf: &Tensor, op: ReduceOp) -> Result<()> {
        let kind = OpKind::AllReduce;
        self.with_storage(kind, buf, "buffer", None, |mine, _| {
            let mut post = self.post(Kind::Op(kind));
            post.input = Some(mine);
            post.op = Some(op);
            let (generation, posts) = self.rendezvous(post)?;
            validate(self.op, self.shared.world_size, &posts)?;
            let _guard = AbortOnUnwind(self.op);
            let bufs: Vec<RawBuf> = posts.iter().map(|p| p.input.expect("buffer")).collect();
            let (ws, rank) = (self.shared.world_size, self.rank);
            // SAFETY: validated posts; every buffer is write-locked by its rank, which only
            // accesses it through the posted address until the last barrier; phase A works on
            // chunk `rank` only.
            with_elem!(mine.dtype, T => unsafe {
                kernels::all_reduce_phase_a::<T>(&bufs, rank, op, ws)
            });
            self.sync(generation + 1);
            // SAFETY: every rank finished phase A.
            with_elem!(mine.dtype, T => unsafe {
                kernels::all_reduce_phase_b::<T>(&bufs, rank, ws)
            });
            self.sync(generation + 2);
            Ok(())
        })
    }

    pub(super) fn broadcast(&self, buf: &Tensor, root: usize) -> Result<()> {
        let kind = OpKind::Broadcast;
        self.with_storage(kind, buf, "buffer", None, |mine, _| {
            let mut post = self.post(Kind::Op(kind));
            post.input = Some(mine);
            post.root = Some(root);
            let (generation, posts) = self.rendezvous(post)?;
            validate(self.op, self.shared.world_size, &posts)?;
            let _guard = AbortOnUnwind(self.op);
            if self.rank != root {
                let src = posts[root].input.expect("buffer");
                // SAFETY: validated posts; the root's buffer is only read during a broadcast
                // and stays alive until the second barrier; `mine` is read by nobody.
                with_elem!(mine.dtype, T => unsafe { kernels::copy_from::<T>(mine, src) });
            }
            self.sync(generation + 1);
            Ok(())
        })
    }

    pub(super) fn reduce(&self, buf: &Tensor, root: usize, op: ReduceOp) -> Result<()> {
        let kind = OpKind::Reduce;
        self.with_storage(kind, buf, "buffer", None, |mine, _| {
            let mut post = self.post(Kind::Op(kind));
            post.input = Some(mine);
            post.op = Some(op);
            post.root = Some(root);
            let (generation, posts) = self.rendezvous(post)?;
            validate(self.op, self.shared.world_size, &posts)?;
            let _guard = AbortOnUnwind(self.op);
            if self.rank == root {
                let bufs: Vec<RawBuf> = posts.iter().map(|p| p.input.expect("buffer")).collect();
                let ws = self.shared.world_size;
                // SAFETY: validated posts; only the root reads any buffer and writes its own.
                with_elem!(mine.dtype, T => unsafe {
                    kernels::reduce_to_root::<T>(&bufs, root, op, ws)
                });
            }
            self.sync(generation + 1);
            Ok(())
        })
    }

    pub(super) fn barrier(&self) -> Result<()> {
        let post = self.post(Kind::Op(OpKind::Barrier));
        let (_generation, posts) = self.rendezvous(post)?;
        // No buffer is shared, so no second barrier is needed (posts are double-buffered).
        validate(self.op, self.shared.world_size, &posts)
    }
}
