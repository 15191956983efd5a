//! The thread backend on CUDA tensors (feature `cuda`): `world_size` ranks as threads sharing
//! one GPU, each with a Candle device of its own (its own compute stream), collectives done as
//! device-to-device copies and one reduction kernel (`kernels/comm.cu`) on each rank's comm
//! streams.
//!
//! # Algorithm
//!
//! The host side is the CPU backend's: each comm stream is a thread, the k-th streams of the
//! ranks meet at a rendezvous, every rank validates every rank's post with the same code (same
//! [`Error::BadBuffer`] / [`Error::CollectiveMismatch`] on every rank). What changes is that the
//! posts carry *device* addresses and that the data movement is only *enqueued* on the rank's
//! CUDA comm stream `S_r`; the ordering the CPU backend gets from its host barriers comes from
//! CUDA events exchanged as rendezvous tokens:
//!
//! 1. At issue, on the caller's thread: record `ready_r` on the rank's compute stream (its
//!    inputs as of the call).
//! 2. On the stream thread: `S_r` waits for `ready_r`, records `pre_r`, and posts it with the
//!    buffers (barrier 1). After validation, `S_r` waits for every peer's `pre_j`: no rank reads a
//!    peer's buffer before the peer's producer finished writing it.
//! 3. `S_r` enqueues this rank's share of the data movement (the CPU backend's split: rank `r`
//!    writes only its own buffers and reads its peers'). The in-place all-reduce has two phases
//!    with an event exchange between them (`A_j`), as the CPU backend has a barrier.
//! 4. `S_r` records `done_r`; the ranks exchange them; `S_r` waits for every `done_j` and records
//!    `final_r`: once `final_r` completes, nobody reads or writes this rank's buffers any more.
//! 5. A last host barrier: every peer has enqueued its waits on this rank's events, which may
//!    now be destroyed (`cuStreamWaitEvent` captures an event's state at the call).
//!
//! The [`Work`](crate::comm::Work) is built with [`Work::with_completion`]
//! (crate::comm::Work::with_completion): `wait_compute` blocks the host only until step 4 was
//! *enqueued* (the host rendezvous), then makes the compute stream wait for `final_r`;
//! `wait_host` synchronizes `final_r`.
//!
//! # Buffer lifetime
//!
//! FSDP2's rule (design/gpu.md, "When memory is freed"): the operation keeps clones of its
//! tensors ([`KeepAlive`]) until the compute stream waited for `final_r`. Ordering is explicit,
//! not cudarc's per-slice event tracking, which cannot see the peers' raw-address reads (see
//! [`crate::comm::nccl`]).
//!
//! # Reductions
//!
//! One launch per reduction: element `i` of the destination is the reduce op over the ranks'
//! sources `0, 1, …, world_size-1` in order, f32/bf16/f16 accumulated in f32 and rounded once
//! (the `half` crate's round-to-nearest-even, bit for bit), f64 in f64, integers exactly (sums
//! wrap), `Avg` as the sum times `1 / world_size` computed on the host as the CPU backend does:
//! the results are bitwise those of the CPU thread backend for the same inputs. At most
//! [`MAX_CUDA_RANKS`] ranks (the sources travel as one kernel argument).

use std::sync::Arc;

use candle_core::cuda_backend::CudaStorage;
use candle_core::{CudaDevice, DType, Device, Layout, Tensor};
use cudarc::driver::{CudaEvent, CudaStream, LaunchConfig, PushKernelArg};
use parking_lot::{Condvar, Mutex};

use super::rendezvous::{AbortOnUnwind, Ctx};
use crate::comm::buffer::{problem, validate, Kind, Post, Problem, RawBuf};
use crate::comm::engine::cuda::{
    addr, cuda_err, raw_read, raw_write, with_cuda_storage, CudaDone, KeepAlive,
};
use crate::comm::reduce::chunk;
use crate::comm::work::Completion;
use crate::comm::{Call, OpKind, ReduceOp};
use crate::error::{Error, Result};

/// Most ranks the thread backend on CUDA runs (the reduction kernel takes the ranks' source
/// addresses as one argument of this many slots; `kernels/comm.cu` has the same constant).
pub const MAX_CUDA_RANKS: usize = 64;

/// Kernel module of `kernels/comm.cu` (registered in [`crate::kernels::SOURCES`]).
const MODULE: &str = "comm";

/// One rank's CUDA state: its Candle device (with a compute stream of its own) and that stream.
pub(crate) struct RankCuda {
    pub device: Device,
    pub cuda: CudaDevice,
    pub compute: Arc<CudaStream>,
}

impl RankCuda {
    /// Opens GPU `ordinal` as a new Candle device (a compute stream of its own).
    ///
    /// Errors: no driver, no such GPU ([`Error::Cuda`]).
    pub(crate) fn open(ordinal: usize) -> Result<RankCuda> {
        let device = crate::device::cuda::open_device(ordinal)?;
        let cuda = crate::device::cuda::cuda_device(&device, "thread backend on CUDA")?.clone();
        let compute = cuda.cuda_stream();
        Ok(RankCuda {
            device,
            cuda,
            compute,
        })
    }
}

// ------------------------------------------------------------------------------------------
// Completion of a thread-backend operation on CUDA.

enum OpState {
    /// The stream thread has not finished enqueuing the operation.
    Pending,
    /// Enqueued: complete once `event` completes.
    Enqueued {
        event: Arc<CudaEvent>,
        _keep: KeepAlive,
    },
    /// Failed (the error is handed to the first waiter).
    Failed {
        error: Option<Error>,
        _keep: Option<KeepAlive>,
    },
}

/// The [`Completion`] of one operation: filled by the stream thread once the operation is
/// enqueued (or failed), waited for by the rank's thread.
pub(super) struct CudaOp {
    state: Mutex<OpState>,
    cv: Condvar,
    compute: Arc<CudaStream>,
    op: String,
    rank: usize,
}

impl CudaOp {
    /// A pending operation named `op` of `rank`, whose waiter's compute stream is `compute`.
    pub(super) fn pending(
        compute: Arc<CudaStream>,
        op: &str,
        rank: usize,
        stream: &str,
    ) -> (Arc<CudaOp>, CudaOpCompleter) {
        let op_state = Arc::new(CudaOp {
            state: Mutex::new(OpState::Pending),
            cv: Condvar::new(),
            compute,
            op: op.to_string(),
            rank,
        });
        let completer = CudaOpCompleter {
            op: Some(Arc::clone(&op_state)),
            stream: stream.to_string(),
        };
        (op_state, completer)
    }

    /// Blocks until the stream thread filled the state; returns the event or the error.
    fn enqueued(&self) -> Result<Arc<CudaEvent>> {
        let mut st = self.state.lock();
        loop {
            match &mut *st {
                OpState::Pending => self.cv.wait(&mut st),
                OpState::Enqueued { event, .. } => return Ok(Arc::clone(event)),
                OpState::Failed { error, .. } => {
                    return Err(error.take().unwrap_or_else(|| {
                        Error::InvalidArgument(format!(
                            "{} on rank {}: its failure was already reported to an earlier \
                             wait",
                            self.op, self.rank
                        ))
                    }))
                }
            }
        }
    }
}

impl Completion for CudaOp {
    fn is_completed(&self) -> bool {
        match &*self.state.lock() {
            OpState::Pending => false,
            OpState::Enqueued { event, .. } => event.is_complete(),
            OpState::Failed { .. } => true,
        }
    }

    fn wait_host(&self) -> Result<()> {
        let event = self.enqueued()?;
        event.synchronize().map_err(|e| {
            cuda_err(
                format!("{} on rank {}: synchronizing", self.op, self.rank),
                e,
            )
        })
    }

    fn wait_compute(&self) -> Result<()> {
        let event = self.enqueued()?;
        self.compute.wait(&event).map_err(|e| {
            cuda_err(
                format!("{} on rank {}: compute stream wait", self.op, self.rank),
                e,
            )
        })
    }
}

/// The stream thread's side of a [`CudaOp`]; dropped unused (the stream stopped), it fails the
/// operation with [`Error::StreamStopped`].
pub(super) struct CudaOpCompleter {
    op: Option<Arc<CudaOp>>,
    stream: String,
}

impl CudaOpCompleter {
    /// Publishes the outcome: `done.result` decides success; `keep` holds the buffers until
    /// `done.final_event` (if any) is waited on by the compute stream.
    pub(super) fn complete(mut self, done: CudaDone, tensors: Vec<Tensor>) {
        let Some(op) = self.op.take() else {
            return;
        };
        let keep = KeepAlive {
            event: done.final_event.clone(),
            consumer: Arc::clone(&op.compute),
            tensors,
        };
        let state = match (done.result, done.final_event) {
            (Ok(()), Some(event)) => OpState::Enqueued { event, _keep: keep },
            (Ok(()), None) => OpState::Failed {
                error: Some(Error::Cuda(format!(
                    "{} on rank {}: no completion event was recorded",
                    op.op, op.rank
                ))),
                _keep: Some(keep),
            },
            (Err(e), _) => OpState::Failed {
                error: Some(e),
                _keep: Some(keep),
            },
        };
        *op.state.lock() = state;
        op.cv.notify_all();
    }
}

impl Drop for CudaOpCompleter {
    fn drop(&mut self) {
        if let Some(op) = self.op.take() {
            *op.state.lock() = OpState::Failed {
                error: Some(Error::StreamStopped {
                    op: op.op.clone(),
                    rank: op.rank,
                    stream: std::mem::take(&mut self.stream),
                }),
                _keep: None,
            };
            op.cv.notify_all();
        }
    }
}

/// What a CUDA collective job needs on its rank.
pub(super) struct CudaJob<'a> {
    /// This rank's comm stream.
    pub stream: &'a Arc<CudaStream>,
    /// This rank's Candle device (kernels are loaded per device).
    pub cuda: &'a CudaDevice,
    /// The group's device (buffer checks).
    pub device: &'a Device,
    /// The compute stream's event recorded at issue (inputs ready).
    pub ready: &'a CudaEvent,
    /// Record timing events around the data movement.
    pub timing: bool,
}

/// The raw handle of `event`, as a rendezvous token (0: none).
fn token(event: &CudaEvent) -> usize {
    event.cu_event() as usize
}

/// Enqueued device work of one rank's collective after barrier 1: the first error is kept and
/// later steps are skipped, but the caller still takes part in every barrier (peers may be
/// reading this rank's buffers).
///
/// The events whose handles were published as tokens live as long as the `Steps`: it must be
/// dropped only after the collective's last host barrier ([`Ctx::sync_all`] after
/// [`Steps::finish`]), once every peer has enqueued its waits on them. A peer that calls
/// `cuStreamWaitEvent` on a handle already destroyed reads freed driver state (seen on a GPU as
/// `CUDA_ERROR_CONTEXT_IS_DESTROYED`, a crash, or a wait on an unrelated event that reused the
/// handle).
struct Steps<'a> {
    stream: &'a Arc<CudaStream>,
    op: &'a str,
    rank: usize,
    first_err: Option<Error>,
    events: Vec<CudaEvent>,
}

impl<'a> Steps<'a> {
    /// Binds the stream's context to this thread (the stream thread's): the waits, copies and
    /// launches that follow run in it.
    fn new(stream: &'a Arc<CudaStream>, op: &'a str, rank: usize) -> Self {
        let mut steps = Steps {
            stream,
            op,
            rank,
            first_err: None,
            events: Vec::new(),
        };
        steps.run(|| {
            (stream.context().bind_to_thread())
                .map_err(|e| cuda_err(format!("{op} on rank {rank}: binding the context"), e))
        });
        steps
    }

    fn run(&mut self, f: impl FnOnce() -> Result<()>) {
        if self.first_err.is_none() {
            if let Err(e) = f() {
                self.first_err = Some(e);
            }
        }
    }

    /// Records an event on the stream and returns its token (0 after an error).
    fn record(&mut self, what: &str) -> usize {
        if self.first_err.is_some() {
            return 0;
        }
        match crate::device::cuda::record(self.stream, false) {
            Ok(ev) => {
                let t = token(&ev);
                self.events.push(ev);
                t
            }
            Err(e) => {
                self.first_err = Some(Error::Cuda(format!(
                    "{} on rank {}: recording the {what} event: {e}",
                    self.op, self.rank
                )));
                0
            }
        }
    }

    /// Makes the stream wait for every peer's token (skipping this rank's and empty ones).
    fn wait_tokens(&mut self, tokens: &[usize], what: &str) {
        let (stream, me, op, rank) = (self.stream, self.rank, self.op, self.rank);
        self.run(|| {
            for (j, &t) in tokens.iter().enumerate() {
                if j == me || t == 0 {
                    continue;
                }
                // SAFETY: `t` is the handle of an event rank j created and keeps alive until
                // the last barrier of this collective, which this rank reaches only after this
                // call; the stream is this rank's own, alive (borrowed).
                unsafe {
                    cudarc::driver::result::stream::wait_event(
                        stream.cu_stream(),
                        t as cudarc::driver::sys::CUevent,
                        cudarc::driver::sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                    )
                }
                .map_err(|e| {
                    cuda_err(
                        format!("{op} on rank {rank}: waiting for rank {j}'s {what} event"),
                        e,
                    )
                })?;
            }
            Ok(())
        });
    }

    /// Device-to-device copy of `bytes` bytes on the stream.
    fn copy(&mut self, dst: u64, src: u64, bytes: usize) {
        if bytes == 0 {
            return;
        }
        let (stream, op, rank) = (self.stream, self.op, self.rank);
        self.run(|| {
            // SAFETY: both ranges were validated (lengths and dtypes of every post) and lie in
            // live device buffers: the source's owner keeps it alive and unwritten until every
            // rank's `done` event passed, the destination is this rank's own buffer, which no
            // peer reads or writes in the copied range meanwhile (see the module docs). The
            // copy is ordered after the producers by the events waited on before.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream())
            }
            .map_err(|e| cuda_err(format!("{op} on rank {rank}: cuMemcpyDtoDAsync"), e))
        });
    }

    /// Records the final event and returns it with the outcome. Takes `&mut self`: the events
    /// published to the peers stay alive until the caller drops the `Steps`, after the last
    /// barrier.
    fn finish(&mut self) -> (Option<Arc<CudaEvent>>, Result<()>) {
        // Recorded after a failed step too: later work is still ordered after what was
        // enqueued, if the stream allows it.
        let recorded = crate::device::cuda::record(self.stream, false);
        if let (Err(e), None) = (&recorded, &self.first_err) {
            self.first_err = Some(Error::Cuda(format!(
                "{} on rank {}: recording the final event: {e}",
                self.op, self.rank
            )));
        }
        let result = self.first_err.take().map_or(Ok(()), Err);
        (recorded.ok().map(Arc::new), result)
    }
}

/// Launches the rank-ordered reduction of `srcs` (device addresses, `n` elements each) into
/// `dst` on `job`'s stream.
///
/// # Safety
///
/// Every source must hold `n` readable elements of `dtype` and `dst` `n` writable ones for as
/// long as the kernel runs (the collective's events guarantee it); `dst` may equal one source
/// but must not partially overlap any.
unsafe fn launch_reduce(
    job: &CudaJob,
    dtype: DType,
    srcs: &[u64],
    dst: u64,
    n: usize,
    op: ReduceOp,
    world_size: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    use DType::*;
    if !matches!(dtype, F32 | F64 | BF16 | F16 | U8 | U32 | I16 | I32 | I64) {
        return Err(Error::dtype(
            "the CUDA reduction's buffers",
            "a dtype with a reduction kernel: f32, f64, bf16, f16, u8, u32, i16, i32 or i64",
            dtype,
        ));
    }
    // The kernels of kernels/comm.cu are named after Candle's dtype names.
    let name = format!("comm_reduce_{}", dtype.as_str());
    if srcs.len() > MAX_CUDA_RANKS {
        return Err(Error::value(
            "the CUDA reduction's source count",
            format_args!("at most {MAX_CUDA_RANKS}"),
            srcs.len(),
        ));
    }
    let func = crate::kernels::nvrtc::func(job.cuda, MODULE, &name)?;
    let mut table = [0u64; MAX_CUDA_RANKS];
    table[..srcs.len()].copy_from_slice(srcs);
    let nsrc = srcs.len() as u32;
    let n64 = n as u64;
    // Sum and Avg sum; the CPU backend's codes otherwise.
    let code: i32 = match op {
        ReduceOp::Sum | ReduceOp::Avg => 0,
        ReduceOp::Max => 1,
        ReduceOp::Min => 2,
    };
    // As `comm::reduce::reduce_into`: Avg scales by 1 / world_size in the accumulator type,
    // skipped at world size 1 (an exact identity).
    let use_scale: i32 = i32::from(op == ReduceOp::Avg && world_size > 1);
    let scale_f: f32 = 1.0 / world_size as f32;
    let scale_d: f64 = 1.0 / world_size as f64;
    const THREADS: u32 = 256;
    let blocks = n.div_ceil(THREADS as usize).min(4096) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = job.stream.launch_builder(&func);
    b.arg(&table);
    b.arg(&nsrc);
    b.arg(&dst);
    b.arg(&n64);
    b.arg(&code);
    b.arg(&use_scale);
    b.arg(&scale_f);
    b.arg(&scale_d);
    // SAFETY: the argument list matches the kernel's signature in kernels/comm.cu (CommSrcs by
    // value, unsigned int, T*, unsigned long long, int, int, float, double); the addresses'
    // validity is the caller's contract.
    unsafe { b.launch(cfg) }.map_err(|e| cuda_err(format!("launching {name}"), e))?;
    Ok(())
}

// ------------------------------------------------------------------------------------------
// The collectives.

impl Ctx<'_> {
    /// Aborts the group (peers fail promptly instead of waiting for this rank) and returns
    /// the failure for this rank: used when this rank cannot take part in a rendezvous.
    fn cannot_join(&self, e: Error) -> CudaDone {
        self.shared.abort(self.rank, &e.to_string());
        CudaDone::failed(e)
    }

    /// Runs a collective on CUDA buffers: `dst` is the output (or in-place buffer), `src` the
    /// input of all-gather and reduce-scatter. See the module docs for the steps.
    pub(super) fn cuda_collective(
        &self,
        job: &CudaJob,
        call: Call,
        dst: &Tensor,
        src: Option<&Tensor>,
    ) -> CudaDone {
        let kind = call.kind();
        if let Some(problem) = problem(dst, src, job.device) {
            return CudaDone::failed(self.fail_with(Kind::Op(kind), problem));
        }
        let done = with_cuda_storage(dst, src, |dst_s, dst_l, src_sl| {
            self.cuda_body(job, call, dst_s, dst_l, src_sl)
        });
        match done {
            Some(done) => done,
            None => CudaDone::failed(self.fail_with(Kind::Op(kind), Problem::Aliased)),
        }
    }

    fn cuda_body(
        &self,
        job: &CudaJob,
        call: Call,
        dst_s: &mut CudaStorage,
        dst_l: &Layout,
        src_sl: Option<(&CudaStorage, &Layout)>,
    ) -> CudaDone {
        let stream = job.stream;
        let (ws, rank) = (self.shared.world_size, self.rank);
        // This rank's inputs are ready on its comm stream; `pre` tells the peers.
        if let Err(e) = stream.wait(job.ready) {
            return self.cannot_join(cuda_err(
                format!("{} on rank {rank}: waiting for the compute stream", self.op),
                e,
            ));
        }
        let (out, _out_guard) = raw_write(dst_s, dst_l, stream);
        let input = src_sl.map(|(s, l)| raw_read(s, l, stream));
        let pre = match crate::device::cuda::record(stream, false) {
            Ok(ev) => ev,
            Err(e) => return self.cannot_join(e),
        };
        let post = Post::of_call(call, self.seq, out, input.as_ref().map(|(i, _)| *i));
        let (generation, posts, pres) = match self.rendezvous(post, Some(token(&pre))) {
            Ok(r) => r,
            Err(e) => return CudaDone::failed(e),
        };
        if let Err(e) = validate(self.op, ws, &posts) {
            return CudaDone::failed(e);
        }
        let _unwind = AbortOnUnwind(self.op);
        let mut steps = Steps::new(stream, self.op, rank);
        steps.wait_tokens(&pres, "inputs-ready");
        let timing_start = job
            .timing
            .then(|| crate::device::cuda::record(stream, true).ok())
            .flatten();
        let mut generation = generation;
        let size = out.dtype.size_in_bytes();
        match call {
            Call::AllGather => {
                let n = posts[rank].input.expect("input").len;
                for (j, p) in posts.iter().enumerate() {
                    let src = p.input.expect("input");
                    steps.copy(addr(out, j * n), addr(src, 0), n * size);
                }
            }
            Call::ReduceScatter(op) => {
                let n = out.len;
                let srcs: Vec<u64> = posts
                    .iter()
                    .map(|p| addr(p.input.expect("input"), rank * n))
                    .collect();
                // SAFETY: validated posts: every input holds ws * n elements of the dtype, kept
                // alive and unwritten by its owner until every rank's `done` event; `out` is
                // this rank's own output (n elements), disjoint from every input.
                let dst = addr(out, 0);
                steps.run(|| unsafe { launch_reduce(job, out.dtype, &srcs, dst, n, op, ws) });
            }
            Call::AllReduce(op) => {
                let bufs: Vec<RawBuf> = posts.iter().map(|p| p.input.expect("buffer")).collect();
                let len = bufs[rank].len;
                let (start, n) = chunk(len, ws, rank);
                let srcs: Vec<u64> = bufs.iter().map(|b| addr(*b, start)).collect();
                // SAFETY: phase A: this rank reads chunk `rank` of every buffer and writes it
                // in its own; every other rank works on its own chunk index, and no rank writes
                // another's buffer. The destination equals this rank's source exactly.
                let dst = srcs[rank];
                steps.run(|| unsafe { launch_reduce(job, out.dtype, &srcs, dst, n, op, ws) });
                let t = steps.record("phase-A");
                generation += 1;
                let phase_a = self.sync_all(generation, Some(t));
                steps.wait_tokens(&phase_a, "phase-A");
                for (j, b) in bufs.iter().enumerate() {
                    if j == rank {
                        continue;
                    }
                    let (start, n) = chunk(b.len, ws, j);
                    // Chunk j of rank j's buffer is final (its phase A passed); this rank
                    // writes chunk j of its own buffer, which only this rank accesses in
                    // phase B (rank j read it in phase A, before its phase-A event).
                    steps.copy(addr(bufs[rank], start), addr(*b, start), n * size);
                }
            }
            Call::Broadcast(root) => {
                if rank != root {
                    let src = posts[root].input.expect("buffer");
                    steps.copy(addr(out, 0), addr(src, 0), out.len * size);
                }
            }
            Call::Reduce(root, op) => {
                if rank == root {
                    let srcs: Vec<u64> = posts
                        .iter()
                        .map(|p| addr(p.input.expect("buffer"), 0))
                        .collect();
                    let (dst, n) = (srcs[root], out.len);
                    // SAFETY: only the root reads any buffer and only the root writes (its
                    // own, which equals one source exactly).
                    steps.run(|| unsafe { launch_reduce(job, out.dtype, &srcs, dst, n, op, ws) });
                }
            }
        }
        let timing = timing_start
            .and_then(|start| Some((start, crate::device::cuda::record(stream, true).ok()?)));
        // Nobody may touch this rank's buffers until every rank finished with them.
        let t = steps.record("done");
        generation += 1;
        let dones = self.sync_all(generation, Some(t));
        steps.wait_tokens(&dones, "done");
        let (final_event, result) = steps.finish();
        // Every peer has enqueued its waits on this rank's events (`pre`, `phase-A`, `done`):
        // only now may they be destroyed. `sync` cannot fail, so no path drops them earlier.
        self.sync_all(generation + 1, None);
        drop(steps);
        drop(pre);
        if let Err(e) = &result {
            self.shared.abort(rank, &e.to_string());
        }
        CudaDone {
            final_event,
            timing,
            result,
        }
    }

    /// A barrier on CUDA streams: the host rendezvous, then this rank's comm stream waits for
    /// every rank's compute stream as of its call (a device barrier too).
    pub(super) fn cuda_barrier(&self, job: &CudaJob) -> CudaDone {
        let stream = job.stream;
        if let Err(e) = stream.wait(job.ready) {
            return self.cannot_join(cuda_err(
                format!(
                    "{} on rank {}: waiting for the compute stream",
                    self.op, self.rank
                ),
                e,
            ));
        }
        let pre = match crate::device::cuda::record(stream, false) {
            Ok(ev) => ev,
            Err(e) => return self.cannot_join(e),
        };
        let post = Post::new(Kind::Op(OpKind::Barrier), self.seq);
        let (generation, posts, pres) = match self.rendezvous(post, Some(token(&pre))) {
            Ok(r) => r,
            Err(e) => return CudaDone::failed(e),
        };
        if let Err(e) = validate(self.op, self.shared.world_size, &posts) {
            return CudaDone::failed(e);
        }
        let mut steps = Steps::new(stream, self.op, self.rank);
        steps.wait_tokens(&pres, "arrival");
        let (final_event, result) = steps.finish();
        // As in `cuda_body`: the published events outlive the peers' waits on them.
        self.sync_all(generation + 1, None);
        drop(steps);
        drop(pre);
        CudaDone {
            final_event,
            timing: None,
            result,
        }
    }
}
