//! Process groups: ranks, world size, comm streams and asynchronous collectives over device
//! buffers.
//!
//! A [`ProcessGroup`] is one rank's handle on a group of `world_size` ranks. Buffers are Candle
//! [`Tensor`]s on the group's [`ProcessGroup::device`]: 1-D, contiguous, of a supported dtype
//! (f32, bf16, f16, f64 for data; u8, u32, i16, i32, i64 for metadata that ranks must agree on).
//!
//! Every collective is *asynchronous*: it is enqueued on a **comm stream** ([`CommStream`]) and
//! returns a [`Work`] at once. Output and in-place buffers are *moved into* the collective and
//! handed back, filled, by [`Work::wait`] (or [`Work::wait_compute`]): a preallocated output is
//! reused with no copy, and nothing aliases it while the operation is in flight. Inputs are
//! borrowed at issue; the collective keeps its own reference until it completed, and the caller
//! must not write them in place meanwhile.
//!
//! Streams have the semantics of CUDA streams with one communicator each (NCCL's model):
//! operations on one stream run in issue order, operations on different streams are independent
//! and may overlap. The runtime creates the streams it wants with [`ProcessGroup::new_stream`]
//! (FSDP: `"all_gather"` and `"reduce_scatter"`) and chooses the stream of every collective;
//! [`ProcessGroup::default_stream`] (named [`DEFAULT_STREAM`]) serves callers that do not choose
//! one (clipping, the grad scaler, checkpoints, SyncBatchNorm; [`ProcessGroupExt`] wraps it in
//! one-line host helpers).
//!
//! # The contract every backend keeps
//!
//! - Every rank issues the same collectives, in the same order, on each stream, with the same
//!   element counts, dtypes, reduce ops and roots; stream creation ([`ProcessGroup::new_stream`])
//!   and sub-group creation ([`ProcessGroup::new_group`]) are collectives too, called by every
//!   rank in the same order. What happens when ranks disagree is backend-defined (an error or a
//!   hang until a timeout).
//! - `all_gather(input, output)`: `output.len() == world_size * input.len()`; rank r's input lands
//!   at `output[r*n .. (r+1)*n]`.
//! - `reduce_scatter(input, output, op)`: `input.len() == world_size * output.len()`; rank r gets
//!   `op` over ranks of `input[r*n .. (r+1)*n]`.
//! - `all_reduce(buf, op)` and `broadcast(buf, root)` are in place; `reduce(buf, root, op)`
//!   leaves the non-root buffers unchanged.
//! - Output and input must not share storage.
//! - [`ReduceOp::Avg`] is defined for floating-point dtypes only; on integers it is an error.
//!   Integer sums wrap on overflow.
//! - A failure on one rank, reported with [`ProcessGroup::abort`], makes the pending and later
//!   collectives of the other ranks fail instead of hanging (how promptly is backend-defined).
//!
//! Backends: [`threads`] (N ranks as N threads of one process, shared memory; its docs list the
//! stronger guarantees only shared memory can give), [`shm`] (one rank per process on one
//! machine, started by `fsdp-run`/torchrun, through segments in `/dev/shm`; the thread
//! backend's algorithms and bitwise its reductions), [`tcp`] (one rank per process on several
//! machines, started the same way, over TCP connections; bitwise the same reductions) and `mpi` (feature `mpi`: one rank per
//! process, started by `mpirun`; bitwise the same reductions as `threads`). Statistics are counted once for every
//! backend by the [`stats::Instrumented`] wrapper that launchers put around it.

pub mod bootstrap;
pub(crate) mod buffer;
pub(crate) mod engine;
pub mod host;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
pub(crate) mod reduce;
pub mod shm;
pub mod stats;
pub mod store;
pub mod tcp;
pub mod threads;
pub(crate) mod wire;
pub mod work;

use std::any::Any;
use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::error::{Error, Result};

pub use host::ProcessGroupExt;
pub use stats::{CommStatsSnapshot, Instrumented};
pub use work::{Completion, Work, WorkCompleter};

/// Which collective, with its scalar arguments: what [`ProcessGroup::issue_call`] receives
/// (for backend implementations).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// [`ProcessGroup::all_gather`].
    AllGather,
    /// [`ProcessGroup::reduce_scatter`] with its reduction.
    ReduceScatter(ReduceOp),
    /// [`ProcessGroup::all_reduce`] with its reduction.
    AllReduce(ReduceOp),
    /// [`ProcessGroup::broadcast`] from a root.
    Broadcast(usize),
    /// [`ProcessGroup::reduce`] into a root, with its reduction.
    Reduce(usize, ReduceOp),
}

impl Call {
    /// The kind of collective.
    pub(crate) fn kind(self) -> OpKind {
        match self {
            Call::AllGather => OpKind::AllGather,
            Call::ReduceScatter(_) => OpKind::ReduceScatter,
            Call::AllReduce(_) => OpKind::AllReduce,
            Call::Broadcast(_) => OpKind::Broadcast,
            Call::Reduce(..) => OpKind::Reduce,
        }
    }

    /// The reduction of a reducing collective.
    pub(crate) fn op(self) -> Option<ReduceOp> {
        match self {
            Call::ReduceScatter(op) | Call::AllReduce(op) | Call::Reduce(_, op) => Some(op),
            Call::AllGather | Call::Broadcast(_) => None,
        }
    }
}

/// The error of a collective of kind `kind` on `rank` given a stream another group created
/// (every backend's wording).
pub(crate) fn foreign_stream(kind: OpKind, rank: usize, stream: &CommStream) -> Error {
    Error::value(
        format_args!("{} on rank {rank}: stream {:?}", kind.name(), stream.name()),
        "one of this process group's streams",
        "a stream not created by this process group",
    )
}

/// Configuration of a process group, the same for every backend (named by each:
/// [`threads::ThreadGroupConfig`], [`shm::ShmConfig`], [`tcp::TcpConfig`], `mpi::MpiConfig`,
/// `nccl::NcclConfig`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupConfig {
    /// How long a rank waits for its peers before failing with [`Error::Timeout`]. Default:
    /// 300 s. On each backend:
    /// - threads: how long a rank waits, in a collective, for the other ranks to join it
    ///   (measured from the moment the collective starts running on the rank's comm stream);
    /// - shm: how long a rank waits in a collective (the timeout also aborts the job); also
    ///   bounds the store rendezvous;
    /// - tcp: as shm; also bounds the rendezvous and each connection setup;
    /// - MPI: how long a rank waits in a collective (the timeout also aborts the job);
    /// - NCCL: how long an operation may stay incomplete (from its issue) before the watchdog
    ///   aborts the group, and how long the bootstrap waits for the other ranks.
    pub timeout: std::time::Duration,
}

impl Default for GroupConfig {
    fn default() -> Self {
        GroupConfig {
            timeout: std::time::Duration::from_secs(300),
        }
    }
}

/// Name of the stream every group has from its creation ([`ProcessGroup::default_stream`]).
pub const DEFAULT_STREAM: &str = "collective";

/// Reduction applied by reduce-scatter, all-reduce and reduce.
///
/// Serialize/Deserialize: by variant name in self-describing formats; in the process
/// backends' collective descriptors (postcard, `comm::wire`) by variant index, so the order of
/// the variants is part of that format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ReduceOp {
    /// Element-wise sum (integers wrap on overflow).
    Sum,
    /// Element-wise mean over ranks: the sum times `1 / world_size` (floating-point dtypes only).
    Avg,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

/// Kind of a collective, as reported to a [`CommObserver`] and counted by [`stats`].
///
/// Serialize/Deserialize: as [`ReduceOp`]'s (the variant name, or its index in the process
/// backends' descriptors); [`OpKind::name`] is the snake-case name traces and errors use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum OpKind {
    /// [`ProcessGroup::all_gather`].
    AllGather,
    /// [`ProcessGroup::reduce_scatter`].
    ReduceScatter,
    /// [`ProcessGroup::all_reduce`].
    AllReduce,
    /// [`ProcessGroup::broadcast`].
    Broadcast,
    /// [`ProcessGroup::reduce`].
    Reduce,
    /// [`ProcessGroup::barrier`].
    Barrier,
}

impl OpKind {
    /// Stable name used in operation names and errors (`all_gather`, `reduce_scatter`,
    /// `all_reduce`, `broadcast`, `reduce`, `barrier`).
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllReduce => "all_reduce",
            OpKind::Broadcast => "broadcast",
            OpKind::Reduce => "reduce",
            OpKind::Barrier => "barrier",
        }
    }
}

/// An opaque handle on one comm stream of one rank's process group (cheap to clone).
///
/// Created by [`ProcessGroup::new_stream`] or [`ProcessGroup::default_stream`] and usable only
/// with the group that created it (anything else is an error of the collective). The handle
/// carries the stream's name and the backend's own state, which only the backend reads.
#[derive(Clone)]
pub struct CommStream {
    name: Arc<str>,
    backend: Arc<dyn Any + Send + Sync>,
}

impl CommStream {
    /// A handle named `name` around `backend`'s state (for backend implementations).
    pub fn new(name: impl Into<Arc<str>>, backend: Arc<dyn Any + Send + Sync>) -> Self {
        CommStream {
            name: name.into(),
            backend,
        }
    }

    /// The name given at creation (e.g. `"all_gather"`, or [`DEFAULT_STREAM`]).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The backend state, if it is a `T` (for backend implementations).
    pub fn backend_state<T: Any>(&self) -> Option<&T> {
        self.backend.downcast_ref::<T>()
    }
}

impl std::fmt::Debug for CommStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("CommStream").field(&self.name).finish()
    }
}

/// Receives the execution of collectives on comm streams (tracing hooks in through it).
///
/// `op_started` is called on the comm stream's own thread (or host-side worker) when the
/// operation starts running there; the returned guard, if any, is dropped on the same thread
/// when it ends. Implementations must be cheap: they sit on the communication path.
pub trait CommObserver: Send + Sync {
    /// An operation named `op` (e.g. `all_gather #12 (stream all_gather)`) of kind `kind`
    /// starts on the stream named `stream`.
    fn op_started(&self, stream: &str, kind: OpKind, op: &str) -> Option<Box<dyn Send>>;

    /// True when a device backend should time its collectives with CUDA events and report
    /// them through [`CommObserver::device_op`] (feature `cuda`; a tracer with a GPU clock).
    #[cfg(feature = "cuda")]
    fn times_device_ops(&self) -> bool {
        false
    }

    /// A collective of a device backend, enqueued on the stream named `stream` between the
    /// timing events `start` and `end` (recorded on that stream; they complete later).
    #[cfg(feature = "cuda")]
    fn device_op(
        &self,
        stream: &str,
        kind: OpKind,
        op: &str,
        start: cudarc::driver::CudaEvent,
        end: cudarc::driver::CudaEvent,
    ) {
        let _ = (stream, kind, op, start, end);
    }
}

/// One rank's handle on a process group. Object safe; shared as `Arc<dyn ProcessGroup>`.
///
/// See the [module docs](self) for the contract (buffer rules, ordering). Collectives return
/// a [`Work`]; argument and communication errors are reported by its `wait`, e.g.
/// [`Error::BadBuffer`], [`Error::CollectiveMismatch`], [`Error::PeerFailed`],
/// [`Error::PeerExited`], [`Error::Timeout`], [`Error::StreamStopped`].
pub trait ProcessGroup: Send + Sync {
    /// This rank, `0..world_size`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Backend name: `"threads"`, `"shm"`, `"tcp"`, `"mpi"`, `"nccl"`.
    fn backend(&self) -> &'static str;
    /// Device the buffers of collectives must live on (`Device::Cpu` for `threads`).
    fn device(&self) -> &Device;
    /// Creates a comm stream named `name` (a collective: every rank creates its streams in the
    /// same order, with the same names).
    ///
    /// Errors: ranks disagree (backend-defined, see [`threads`]), the backend cannot start the
    /// stream ([`Error::SpawnFailed`]), a peer failed.
    fn new_stream(&self, name: &str) -> Result<CommStream>;
    /// The stream for collectives whose caller does not choose one, named [`DEFAULT_STREAM`];
    /// it exists from the group's creation.
    fn default_stream(&self) -> CommStream;
    /// All-gather of `input` (`n` elements) into `output` (`world_size * n` elements, same
    /// dtype) on `stream`; returns the filled `output`.
    fn all_gather(&self, stream: &CommStream, input: &Tensor, output: Tensor) -> Work<Tensor> {
        self.issue_call(stream, Call::AllGather, output, Some(input))
    }
    /// Reduce-scatter of `input` (`world_size * n` elements) into `output` (`n` elements, same
    /// dtype) on `stream`; returns the filled `output`.
    fn reduce_scatter(
        &self,
        stream: &CommStream,
        input: &Tensor,
        output: Tensor,
        op: ReduceOp,
    ) -> Work<Tensor> {
        self.issue_call(stream, Call::ReduceScatter(op), output, Some(input))
    }
    /// In-place all-reduce of `buf` on `stream`; returns it.
    fn all_reduce(&self, stream: &CommStream, buf: Tensor, op: ReduceOp) -> Work<Tensor> {
        self.issue_call(stream, Call::AllReduce(op), buf, None)
    }
    /// In-place broadcast of the root's `buf` on `stream`; returns it.
    fn broadcast(&self, stream: &CommStream, buf: Tensor, root: usize) -> Work<Tensor> {
        self.issue_call(stream, Call::Broadcast(root), buf, None)
    }
    /// In-place reduce into the root's `buf` on `stream` (other ranks' buffers unchanged);
    /// returns it.
    fn reduce(&self, stream: &CommStream, buf: Tensor, root: usize, op: ReduceOp) -> Work<Tensor> {
        self.issue_call(stream, Call::Reduce(root, op), buf, None)
    }
    /// Issues collective `call` on `stream`: `buf` is the output (all-gather, reduce-scatter)
    /// or the in-place buffer, handed back by the work, `input` the input of all-gather and
    /// reduce-scatter. What the five collectives above call (for backend implementations).
    #[doc(hidden)]
    fn issue_call(
        &self,
        stream: &CommStream,
        call: Call,
        buf: Tensor,
        input: Option<&Tensor>,
    ) -> Work<Tensor>;
    /// Barrier on `stream`: completes once every rank reached it on that stream.
    fn barrier(&self, stream: &CommStream) -> Work<()>;
    /// Creates a sub-group (PyTorch `new_group` semantics): every rank of this group calls it,
    /// in the same order, with the same list of distinct ranks of this group. Members get
    /// `Some(group)`, in which their rank is their position in `ranks`; the others get `None`.
    /// The sub-group has its own streams, starting with its default stream.
    ///
    /// Errors: an empty list ([`Error::Missing`]), a duplicate rank ([`Error::Value`]), an
    /// out-of-range rank ([`Error::OutOfRange`]),
    /// ranks passing different lists (backend-defined), a peer failure.
    fn new_group(&self, ranks: &[usize]) -> Result<Option<Arc<dyn ProcessGroup>>>;
    /// Marks this rank as failed with `reason`: the pending and later collectives of the other
    /// ranks fail (with [`Error::PeerFailed`] naming this rank, in the thread backend) instead of
    /// waiting for it.
    fn abort(&self, reason: &str);
    /// Reports every later collective's execution to `observer` (`None` stops).
    fn set_observer(&self, observer: Option<Arc<dyn CommObserver>>);
    /// How long this rank waits in a collective for its peers before failing with
    /// [`Error::Timeout`], where the backend has such a bound (`None`: it has none of its own).
    fn timeout(&self) -> Option<std::time::Duration> {
        None
    }
    /// Calls and bytes issued by this rank, counted by [`stats::Instrumented`] (which every
    /// launcher puts around the backend); a bare backend reports zeros.
    fn stats(&self) -> CommStatsSnapshot {
        CommStatsSnapshot::default()
    }
}

/// Collects the per-rank results of a run: every rank's value (index = rank), or one error, the
/// root cause of the failure rather than its echoes on the other ranks.
///
/// Errors are compared through [`Error::root_cause`] (so a failure wrapped in
/// [`Error::InStep`] is recognised) and returned whole. The error chosen is, in order of
/// preference: the error of the rank that failed first (as named by the [`Error::PeerFailed`] /
/// [`Error::PeersFailed`] echoes) when that error is not itself an echo; otherwise the lowest
/// rank's error that is neither [`Error::PeerFailed`], [`Error::PeerExited`] nor
/// [`Error::PeersFailed`]; otherwise the lowest rank's error.
pub fn collect_rank_results<T>(results: Vec<Result<T>>) -> Result<Vec<T>> {
    let is_echo = |r: &Result<T>| {
        r.as_ref().err().is_some_and(|e| {
            matches!(
                e.root_cause(),
                Error::PeerFailed { .. } | Error::PeerExited { .. } | Error::PeersFailed { .. }
            )
        })
    };
    let first_failed = results
        .iter()
        .find_map(|r| match r.as_ref().err()?.root_cause() {
            Error::PeerFailed { failed_rank, .. } => Some(*failed_rank),
            Error::PeersFailed { failed_ranks, .. } => failed_ranks.first().copied(),
            _ => None,
        });
    let chosen = first_failed
        .filter(|&f| results.get(f).is_some_and(|r| r.is_err() && !is_echo(r)))
        .or_else(|| results.iter().position(|r| r.is_err() && !is_echo(r)))
        .or_else(|| results.iter().position(|r| r.is_err()));
    match chosen {
        None => results.into_iter().collect(),
        Some(i) => match results.into_iter().nth(i) {
            Some(Err(e)) => Err(e),
            _ => unreachable!("rank {i} was chosen for its error"),
        },
    }
}
