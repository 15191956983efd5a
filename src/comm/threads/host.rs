//! The host data path of the thread backend: its collectives on CPU tensors, access to each
//! tensor's storage through Candle's in-place ops, around the rendezvous and the copy loops of
//! [`copy`] (the GPU data path is `super::cuda`).
//!
//! The output (or in-place buffer) is written through [`Tensor::inplace_op1`] /
//! [`Tensor::inplace_op2`], which hand us `&mut CpuStorage` under the tensor's storage write lock
//! and the input's `&CpuStorage` under its read lock; the whole collective (rendezvous, copy,
//! second barrier) runs inside that call, so both locks are held for as long as peers may touch
//! the buffers. Candle refuses an output that shares storage with its input before calling us;
//! that, and every other local problem (device, shape, layout, dtype), is posted to the
//! rendezvous so that every rank fails with the same [`crate::Error::BadBuffer`].

use candle_core::Tensor;

use super::rendezvous::{AbortOnUnwind, Ctx};
use crate::comm::buffer::{check, validate, with_raw_bufs, Kind, Problem, RawBuf};
use crate::comm::engine::copy::{self, with_elem};
use crate::comm::{Call, OpKind, ReduceOp};
use crate::error::Result;

impl Ctx<'_> {
    /// Runs collective `call` on host buffers: `out` is the output (or in-place buffer), `input`
    /// the input of all-gather and reduce-scatter.
    pub(super) fn run_call(&self, call: Call, out: &Tensor, input: Option<&Tensor>) -> Result<()> {
        match (call, input) {
            (Call::AllGather, Some(input)) => self.all_gather(input, out),
            (Call::ReduceScatter(op), Some(input)) => self.reduce_scatter(input, out, op),
            (Call::AllReduce(op), _) => self.all_reduce(out, op),
            (Call::Broadcast(root), _) => self.broadcast(out, root),
            (Call::Reduce(root, op), _) => self.reduce(out, root, op),
            (Call::AllGather | Call::ReduceScatter(_), None) => {
                unreachable!("all-gather and reduce-scatter are issued with an input")
            }
        }
    }

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
        // Refused: Candle refused before calling `body`, i.e. the output shares storage with the
        // input (layouts and devices were checked above).
        match with_raw_bufs(dst, src, body) {
            Ok(result) => result,
            Err(_refused) => Err(self.fail_with(kind_, Problem::Aliased)),
        }
    }

    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<()> {
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
            with_elem!(out.dtype, T => unsafe { copy::gather::<T>(out, &srcs, src.len) });
            self.sync(generation + 1);
            Ok(())
        })
    }

    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()> {
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
                copy::reduce_shard::<T>(out, &srcs, start, op, ws)
            });
            self.sync(generation + 1);
            Ok(())
        })
    }

    fn all_reduce(&self, buf: &Tensor, op: ReduceOp) -> Result<()> {
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
                copy::all_reduce_phase_a::<T>(&bufs, rank, op, ws)
            });
            self.sync(generation + 1);
            // SAFETY: every rank finished phase A.
            with_elem!(mine.dtype, T => unsafe {
                copy::all_reduce_phase_b::<T>(&bufs, rank, ws)
            });
            self.sync(generation + 2);
            Ok(())
        })
    }

    fn broadcast(&self, buf: &Tensor, root: usize) -> Result<()> {
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
                with_elem!(mine.dtype, T => unsafe { copy::copy_from::<T>(mine, src) });
            }
            self.sync(generation + 1);
            Ok(())
        })
    }

    fn reduce(&self, buf: &Tensor, root: usize, op: ReduceOp) -> Result<()> {
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
                    copy::reduce_to_root::<T>(&bufs, root, op, ws)
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
