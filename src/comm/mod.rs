//! Process groups: ranks, world size and asynchronous collectives.
//!
//! A [`ProcessGroup`] is one rank's handle on a group of `world_size` ranks. Every collective is
//! *asynchronous*: it is enqueued on one of the rank's **comm streams** and returns a [`Work`]
//! handle at once; [`Work::wait`] blocks until the collective finished and hands back the buffer.
//! Buffers move into the collective and come back out of `wait`, so a preallocated output is
//! reused with no copy and no aliasing while the operation is in flight.
//!
//! Streams (the same contract as a CUDA stream: ops on one stream run in issue order, ops on
//! different streams may overlap):
//! - [`Stream::AllGather`]: parameter all-gathers (unshard).
//! - [`Stream::ReduceScatter`]: gradient reduce-scatters, so they never queue behind an all-gather.
//! - [`Stream::Collective`]: all-reduce, broadcast, reduce and barrier.
//!
//! Every rank must issue the same collectives in the same order on each stream. Backends:
//! [`threads`] (N ranks as N threads of one process, shared memory).

pub mod threads;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::DType;
use half::{bf16, f16};
use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};

/// A flat, typed buffer exchanged by collectives (1-D, `len()` elements).
#[derive(Debug, Clone, PartialEq)]
pub enum CommBuffer {
    /// 32-bit floats (master shards, f32 gradients).
    F32(Vec<f32>),
    /// bfloat16 (mixed-precision all-gather / reduce-scatter).
    BF16(Vec<bf16>),
    /// IEEE half (mixed-precision all-gather / reduce-scatter).
    F16(Vec<f16>),
}

impl CommBuffer {
    /// A zero-filled buffer of `len` elements of `dtype` (F32, BF16 or F16; others are an error).
    pub fn zeros(dtype: DType, len: usize) -> Result<Self> {
        Ok(match dtype {
            DType::F32 => CommBuffer::F32(vec![0.0; len]),
            DType::BF16 => CommBuffer::BF16(vec![bf16::ZERO; len]),
            DType::F16 => CommBuffer::F16(vec![f16::ZERO; len]),
            other => {
                return Err(Error::InvalidArgument(format!(
                    "collectives support f32, bf16 and f16 buffers, not {other:?}"
                )))
            }
        })
    }

    /// Converts f32 values to a buffer of `dtype` (round to nearest even for the half types).
    pub fn from_f32(values: &[f32], dtype: DType) -> Result<Self> {
        Ok(match dtype {
            DType::F32 => CommBuffer::F32(values.to_vec()),
            DType::BF16 => CommBuffer::BF16(values.iter().map(|&v| bf16::from_f32(v)).collect()),
            DType::F16 => CommBuffer::F16(values.iter().map(|&v| f16::from_f32(v)).collect()),
            other => {
                return Err(Error::InvalidArgument(format!(
                    "collectives support f32, bf16 and f16 buffers, not {other:?}"
                )))
            }
        })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            CommBuffer::F32(v) => v.len(),
            CommBuffer::BF16(v) => v.len(),
            CommBuffer::F16(v) => v.len(),
        }
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element dtype.
    pub fn dtype(&self) -> DType {
        match self {
            CommBuffer::F32(_) => DType::F32,
            CommBuffer::BF16(_) => DType::BF16,
            CommBuffer::F16(_) => DType::F16,
        }
    }

    /// Size in bytes (`len() * dtype.size_in_bytes()`).
    pub fn nbytes(&self) -> usize {
        self.len() * self.dtype().size_in_bytes()
    }

    /// Element `i` widened to f32.
    pub fn get_f32(&self, i: usize) -> f32 {
        match self {
            CommBuffer::F32(v) => v[i],
            CommBuffer::BF16(v) => v[i].to_f32(),
            CommBuffer::F16(v) => v[i].to_f32(),
        }
    }

    /// All elements widened to f32 (a copy).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self {
            CommBuffer::F32(v) => v.clone(),
            CommBuffer::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
            CommBuffer::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// The f32 vector inside, or an error naming the dtype found.
    pub fn into_f32(self) -> Result<Vec<f32>> {
        match self {
            CommBuffer::F32(v) => Ok(v),
            other => Err(Error::InvalidArgument(format!(
                "expected an f32 buffer, found {:?}",
                other.dtype()
            ))),
        }
    }
}

/// Reduction applied by reduce-scatter, all-reduce and reduce.
///
/// Sums are accumulated in f32 in rank order 0, 1, …, world_size-1 (deterministic, the same on
/// every rank) and rounded once to the buffer's dtype. `Avg` is the sum multiplied by
/// `1 / world_size` (so world size 1 is an exact identity).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over ranks.
    Avg,
    /// Element-wise maximum (NaN propagates).
    Max,
    /// Element-wise minimum (NaN propagates).
    Min,
}

/// The comm stream an operation runs on; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Stream {
    /// Parameter all-gathers.
    AllGather,
    /// Gradient reduce-scatters.
    ReduceScatter,
    /// All-reduce, broadcast, reduce, barrier.
    Collective,
}

impl Stream {
    /// All streams, in index order.
    pub const ALL: [Stream; 3] = [Stream::AllGather, Stream::ReduceScatter, Stream::Collective];

    /// Dense index (0..3).
    pub fn index(self) -> usize {
        match self {
            Stream::AllGather => 0,
            Stream::ReduceScatter => 1,
            Stream::Collective => 2,
        }
    }

    /// Stable name used in errors and traces.
    pub fn name(self) -> &'static str {
        match self {
            Stream::AllGather => "all_gather",
            Stream::ReduceScatter => "reduce_scatter",
            Stream::Collective => "collective",
        }
    }
}

/// Counters of what a rank sent through its process group.
///
/// `*_bytes` count the bytes this rank *contributed* (its input buffer), the quantity NCCL's
/// "algorithm bandwidth" is based on (nccl-tests `PERFORMANCE.md`).
#[derive(Debug, Default)]
pub struct CommStats {
    /// Number of all-gathers issued.
    pub all_gather_calls: AtomicU64,
    /// Bytes of all-gather inputs (this rank's shards).
    pub all_gather_bytes: AtomicU64,
    /// Number of reduce-scatters issued.
    pub reduce_scatter_calls: AtomicU64,
    /// Bytes of reduce-scatter inputs (this rank's unsharded gradients).
    pub reduce_scatter_bytes: AtomicU64,
    /// Number of all-reduce / broadcast / reduce / barrier calls.
    pub other_calls: AtomicU64,
    /// Bytes of all-reduce / broadcast / reduce buffers.
    pub other_bytes: AtomicU64,
}

/// A plain copy of [`CommStats`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommStatsSnapshot {
    /// Number of all-gathers issued.
    pub all_gather_calls: u64,
    /// Bytes of all-gather inputs.
    pub all_gather_bytes: u64,
    /// Number of reduce-scatters issued.
    pub reduce_scatter_calls: u64,
    /// Bytes of reduce-scatter inputs.
    pub reduce_scatter_bytes: u64,
    /// Number of other collectives.
    pub other_calls: u64,
    /// Bytes of other collectives.
    pub other_bytes: u64,
}

impl CommStats {
    /// Reads all counters.
    pub fn snapshot(&self) -> CommStatsSnapshot {
        CommStatsSnapshot {
            all_gather_calls: self.all_gather_calls.load(Ordering::Relaxed),
            all_gather_bytes: self.all_gather_bytes.load(Ordering::Relaxed),
            reduce_scatter_calls: self.reduce_scatter_calls.load(Ordering::Relaxed),
            reduce_scatter_bytes: self.reduce_scatter_bytes.load(Ordering::Relaxed),
            other_calls: self.other_calls.load(Ordering::Relaxed),
            other_bytes: self.other_bytes.load(Ordering::Relaxed),
        }
    }
}

struct WorkState<T> {
    result: Mutex<Option<Result<T>>>,
    cv: Condvar,
    done: AtomicBool,
}

/// Handle on an asynchronous collective; `wait` returns its result (the output buffer).
///
/// Dropping a `Work` without waiting is allowed: the operation still runs to completion on its
/// stream (it must, since the other ranks take part in it).
pub struct Work<T> {
    state: Arc<WorkState<T>>,
}

/// The completing side of a [`Work`], held by the stream that executes the operation.
///
/// If it is dropped without [`WorkCompleter::complete`] (the stream thread died), the waiter
/// gets an error naming the operation instead of hanging.
pub struct WorkCompleter<T> {
    state: Option<Arc<WorkState<T>>>,
    op: String,
}

impl<T> Work<T> {
    /// A pending operation and the completer that finishes it; `op` names it in errors.
    pub fn pending(op: impl Into<String>) -> (Work<T>, WorkCompleter<T>) {
        let state = Arc::new(WorkState {
            result: Mutex::new(None),
            cv: Condvar::new(),
            done: AtomicBool::new(false),
        });
        (
            Work {
                state: state.clone(),
            },
            WorkCompleter {
                state: Some(state),
                op: op.into(),
            },
        )
    }

    /// An already completed operation.
    pub fn ready(result: Result<T>) -> Self {
        let (work, completer) = Work::pending("");
        completer.complete(result);
        work
    }

    /// True once the operation finished (successfully or not); never blocks.
    pub fn is_completed(&self) -> bool {
        self.state.done.load(Ordering::Acquire)
    }

    /// Blocks until the operation finished and returns its result.
    ///
    /// Errors: whatever the collective reported ([`Error::PeerFailed`], [`Error::Timeout`], …).
    pub fn wait(self) -> Result<T> {
        let mut guard = self.state.result.lock();
        loop {
            if let Some(r) = guard.take() {
                return r;
            }
            self.state.cv.wait(&mut guard);
        }
    }
}

impl<T> WorkCompleter<T> {
    /// Publishes the result and wakes the waiter.
    pub fn complete(mut self, result: Result<T>) {
        if let Some(state) = self.state.take() {
            *state.result.lock() = Some(result);
            state.done.store(true, Ordering::Release);
            state.cv.notify_all();
        }
    }
}

impl<T> Drop for WorkCompleter<T> {
    fn drop(&mut self) {
        if let Some(state) = self.state.take() {
            *state.result.lock() = Some(Err(Error::InvalidArgument(format!(
                "{}: the comm stream stopped before completing it",
                self.op
            ))));
            state.done.store(true, Ordering::Release);
            state.cv.notify_all();
        }
    }
}

/// One rank's handle on a process group. Object safe; shared as `Arc<dyn ProcessGroup>`.
///
/// Buffer rules (checked on every rank; a violation is [`Error::BadBuffer`] or
/// [`Error::CollectiveMismatch`] on every rank, never a hang):
/// - `all_gather(input, output)`: `output.len() == world_size * input.len()`, same dtype; rank r's
///   input lands at `output[r*n .. (r+1)*n]`.
/// - `reduce_scatter(input, output, op)`: `input.len() == world_size * output.len()`; rank r gets
///   `op` over ranks of `input[r*n .. (r+1)*n]`.
/// - `all_reduce(buf, op)`, `broadcast(buf, root)`, `reduce(buf, root, op)`: same length and dtype
///   on every rank; `reduce` leaves non-root buffers unchanged.
pub trait ProcessGroup: Send + Sync {
    /// This rank, `0..world_size`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// All-gather on [`Stream::AllGather`]; returns the filled `output`.
    fn all_gather(&self, input: CommBuffer, output: CommBuffer) -> Work<CommBuffer>;
    /// Reduce-scatter on [`Stream::ReduceScatter`]; returns the filled `output` shard.
    fn reduce_scatter(
        &self,
        input: CommBuffer,
        output: CommBuffer,
        op: ReduceOp,
    ) -> Work<CommBuffer>;
    /// In-place all-reduce on [`Stream::Collective`].
    fn all_reduce(&self, buf: CommBuffer, op: ReduceOp) -> Work<CommBuffer>;
    /// In-place broadcast from `root` on [`Stream::Collective`].
    fn broadcast(&self, buf: CommBuffer, root: usize) -> Work<CommBuffer>;
    /// In-place reduce to `root` on [`Stream::Collective`].
    fn reduce(&self, buf: CommBuffer, root: usize, op: ReduceOp) -> Work<CommBuffer>;
    /// Barrier on [`Stream::Collective`].
    fn barrier(&self) -> Work<()>;
    /// Marks this rank as failed with `reason`: every pending and later collective of every rank
    /// fails promptly with [`Error::PeerFailed`] naming this rank.
    fn abort(&self, reason: &str);
    /// Counters of calls and bytes issued by this rank.
    fn stats(&self) -> CommStatsSnapshot;
    /// Records every later collective's execution on its comm stream as a span of `tracer`
    /// (`None` stops recording). Backends without tracing ignore it.
    fn set_tracer(&self, tracer: Option<Arc<crate::trace::Tracer>>) {
        let _ = tracer;
    }
}
