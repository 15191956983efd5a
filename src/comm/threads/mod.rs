//! In-process thread backend: `world_size` ranks as threads of one process, exchanging data
//! through shared memory.
//!
//! [`new_group`] creates one [`ThreadProcessGroup`] handle per rank; [`run_ranks`] /
//! [`run_ranks_ok`] run a closure on every rank in its own thread (named `rank-{r}`), each with
//! its handle wrapped in [`crate::comm::Instrumented`] (statistics), and collect the results
//! ([`crate::launch::Launcher::Threads`] is the same launcher behind the common API).
//!
//! # Streams
//!
//! Every stream of a rank is one OS thread (named `rank-{r}-{stream name}`, at raised priority:
//! see `raise_priority`) fed through a channel of jobs and executing them in issue order. The
//! default stream exists from the handle's creation; [`ProcessGroup::new_stream`] starts another
//! one. Every collective enqueues a job on the stream it is given and returns a [`Work`] at once;
//! the job runs the collective on the stream's thread and completes the `Work`. A stream's thread
//! exits when every [`CommStream`] handle on it is dropped, or when its group handle is dropped;
//! only the latter tells the peers that the rank left (a rank that merely dropped a stream is
//! still alive: peers waiting for it on that stream wait for its abort, its departure or the
//! timeout).
//!
//! # Algorithm
//!
//! The k-th stream created by each rank (0: the default stream) shares one *communicator* with
//! the k-th streams of the other ranks: a rendezvous (mutex, condition variable, per-rank arrival
//! counters and posts). A collective runs in the stream thread of every rank:
//!
//! 1. **Post** (barrier 1): the rank publishes raw pointers, lengths and dtypes of its tensors'
//!    storage (plus the reduce op and root) and waits until every rank posted. The tensors'
//!    storage locks are held from here to the end (Candle's in-place op API, see `host`).
//! 2. **Validate**: every rank checks *all* posts with the same deterministic code.
//! 3. **Copy**: each rank does its own share of the data movement by reading its peers' buffers
//!    through the posted pointers (bandwidth-optimal: every byte is read once per destination):
//!    - all-gather: rank r copies every rank j's input into `output[j*n..(j+1)*n]`;
//!    - reduce-scatter: rank r reduces `input_j[r*n..(r+1)*n]` over ranks j = 0, 1, … in order;
//!    - all-reduce (in place, two phases): rank r reduces chunk r of all buffers into chunk r of
//!      its own buffer; barrier; rank r copies chunk j from rank j for every j ≠ r;
//!    - broadcast: non-roots copy the root's buffer; reduce: the root reduces into its buffer.
//! 4. **Done** (barrier 2): nobody returns — and so nobody frees or reuses a buffer a peer may
//!    still read — until every rank finished copying.
//!
//! # Guarantees beyond the portable contract (shared memory only)
//!
//! - **Bitwise identical, rank-ordered reductions**: every reduction runs over ranks 0, 1, …,
//!   world_size-1 in order; f32, bf16 and f16 accumulate in f32 and round once, f64 in f64,
//!   integers exactly (sums wrap); `Avg` is the sum times `1 / world_size` (world size 1: an
//!   exact identity). Max and Min propagate NaN. Every rank gets the same bits.
//! - **Mismatches are errors on every rank, never hangs**: ranks read each other's arguments,
//!   so a call that disagrees (another collective, length, dtype, reduce op, root, stream name,
//!   sub-group list) is the same [`Error::CollectiveMismatch`] on every rank, and a buffer that
//!   is wrong on one rank (length, dtype, not a 1-D contiguous CPU tensor, output sharing the
//!   input's storage) is the same [`Error::BadBuffer`] naming that rank on every rank. The group
//!   stays usable afterwards. Stream and sub-group creation are validated the same way (they
//!   rendezvous on a setup communicator of their own, on the caller's thread).
//! - **A shared abort slot**: the first failure (rank, reason) is recorded once for the root
//!   group and every sub-group created from it. Waits for barrier 1 wake up on every event of
//!   the group and fail with [`Error::PeerFailed`] once a rank called [`ProcessGroup::abort`]
//!   (`failed_rank` is that rank's number in the root group), [`Error::PeerExited`] when a
//!   missing rank's handle was dropped (or its stream stopped), and [`Error::Timeout`] after
//!   [`ThreadGroupConfig::timeout`] (which also aborts the group, so the other ranks stop
//!   promptly too). A collective issued after the abort fails at once. Once every rank passed
//!   barrier 1 the collective always completes: the remaining waits only cover the bounded copy
//!   phase and must not be abandoned, since a peer may still be reading this rank's buffers.
//!
//! Sub-groups ([`ProcessGroup::new_group`]) are groups of their own (communicators, default
//! stream, ranks renumbered by position) sharing the abort slot of their root group.
//!
//! # On CUDA tensors (feature `cuda`)
//!
//! `new_group_on_gpu` / `run_ranks_on_gpu` (and `crate::launch::Launcher::ThreadsOnGpu`; cargo feature `cuda`)
//! put every rank on one GPU, each with a Candle device of its own (its own compute stream;
//! [`ProcessGroup::device`] returns it) and one CUDA comm stream per stream of the group. The
//! host side above is unchanged; the data movement is enqueued on the comm streams and ordered
//! with CUDA events, so that the host never waits for the device (see `cuda` for the
//! algorithm and the buffer-lifetime rule). Reductions are bitwise those of the CPU path.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
pub(in crate::comm) mod host;
mod rendezvous;
mod run;

#[cfg(feature = "cuda")]
pub use self::cuda::MAX_CUDA_RANKS;
use self::run::raise_priority;
pub use self::run::{
    new_group, run_ranks, run_ranks_ok, set_intra_op_threads, BARRIER_POOL_SPIN_LIMIT,
};
#[cfg(feature = "cuda")]
pub use self::run::{new_group_on_gpu, run_ranks_on_gpu};
use super::engine::{check_ranks, run_stream_op};

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use candle_core::{Device, Tensor};
use crossbeam::channel::{unbounded, Sender};
use parking_lot::Mutex;

use self::rendezvous::{Communicator, Ctx, Shared};
use super::{Call, CommObserver, CommStream, OpKind, ProcessGroup, ReduceOp, Work, DEFAULT_STREAM};
use crate::comm::buffer::{validate, Kind, RawBytes};
use crate::error::{Error, Result};

/// Configuration of a thread process group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadGroupConfig {
    /// How long a rank waits, in a collective, for the other ranks to join it before failing with
    /// [`Error::Timeout`] (measured from the moment the collective starts running on the rank's
    /// comm stream). Default: 300 s.
    pub timeout: Duration,
}

impl Default for ThreadGroupConfig {
    fn default() -> Self {
        ThreadGroupConfig {
            timeout: Duration::from_secs(300),
        }
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// Issue side of one stream of one rank: the sequence number of the last operation issued and
/// the channel to the stream's thread (`None` once the group handle closed it).
struct StreamSlot {
    seq: u64,
    tx: Option<Sender<Job>>,
}

/// The thread backend's state behind a [`CommStream`].
struct ThreadStream {
    /// Id of the [`ThreadProcessGroup`] that created it.
    owner: u64,
    name: Arc<str>,
    comm: Arc<Communicator>,
    slot: Mutex<StreamSlot>,
    /// The CUDA stream the stream's data movement is enqueued on (groups on a GPU).
    #[cfg(feature = "cuda")]
    device_stream: Option<Arc<cudarc::driver::CudaStream>>,
}

/// The CUDA state of a rank of a group on a GPU (`None` on the CPU).
#[cfg(feature = "cuda")]
type RankDevice = Option<Arc<cuda::RankCuda>>;

/// Setup operations issued by one rank handle.
struct SetupState {
    /// Sequence number of the last setup operation.
    seq: u64,
    /// Streams created so far (the default stream included): the index of the next one.
    streams: usize,
}

static NEXT_GROUP_ID: AtomicU64 = AtomicU64::new(1);

/// One rank's handle on an in-process group; see the [module docs](self).
///
/// Dropping the handle closes its comm streams, waits for the work already queued on them to
/// finish, then marks the rank as departed: peers still waiting for it fail with
/// [`Error::PeerExited`].
pub struct ThreadProcessGroup {
    id: u64,
    rank: usize,
    device: Device,
    shared: Arc<Shared>,
    default_stream: CommStream,
    streams: Mutex<Vec<Weak<ThreadStream>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    setup: Mutex<SetupState>,
    observer: Mutex<Option<Arc<dyn CommObserver>>>,
    /// Set when the handle is dropped, before its streams are closed.
    closing: Arc<AtomicBool>,
    /// This rank's GPU state (groups on a GPU).
    #[cfg(feature = "cuda")]
    cuda: RankDevice,
}

impl std::fmt::Debug for ThreadProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.shared.world_size)
            .field("timeout", &self.shared.timeout)
            .finish()
    }
}

/// Starts the thread of the `index`-th stream of `rank`, named `name`, owned by group `owner`.
///
/// The thread runs until its channel closes. When the group handle closed it (`closing` set),
/// the thread marks the rank as finished on its communicator, so that peers waiting there stop
/// waiting while the handle is still joining its other streams. When the last [`CommStream`] on
/// it was dropped instead, the rank is still alive and may yet fail: peers waiting on the stream
/// then learn of the rank's fate from its abort or its handle's departure.
fn start_stream(
    owner: u64,
    rank: usize,
    shared: &Shared,
    closing: &Arc<AtomicBool>,
    index: usize,
    name: &str,
    #[cfg(feature = "cuda")] cuda: &RankDevice,
) -> Result<(Arc<ThreadStream>, JoinHandle<()>)> {
    #[cfg(feature = "cuda")]
    let device_stream = match cuda {
        Some(c) => Some(crate::device::cuda::new_stream(&c.cuda)?),
        None => None,
    };
    let comm = shared.communicator(index, name);
    let (tx, rx) = unbounded::<Job>();
    let thread_comm = Arc::clone(&comm);
    let closing = Arc::clone(closing);
    let handle = thread::Builder::new()
        .name(format!("rank-{rank}-{name}"))
        .spawn(move || {
            raise_priority();
            for job in rx.iter() {
                job();
            }
            if closing.load(Ordering::Acquire) {
                thread_comm.finish(rank);
            }
        })
        .map_err(|error| Error::SpawnFailed {
            what: format!("comm stream {name} of rank {rank}"),
            error,
        })?;
    let stream = Arc::new(ThreadStream {
        owner,
        name: name.into(),
        comm,
        slot: Mutex::new(StreamSlot {
            seq: 0,
            tx: Some(tx),
        }),
        #[cfg(feature = "cuda")]
        device_stream,
    });
    Ok((stream, handle))
}

impl ThreadProcessGroup {
    /// The handle of `rank` on `shared`, with its default stream running.
    fn create(
        shared: Arc<Shared>,
        rank: usize,
        #[cfg(feature = "cuda")] cuda: RankDevice,
    ) -> Result<Arc<ThreadProcessGroup>> {
        let id = NEXT_GROUP_ID.fetch_add(1, Ordering::Relaxed);
        let closing = Arc::new(AtomicBool::new(false));
        let started = start_stream(
            id,
            rank,
            &shared,
            &closing,
            0,
            DEFAULT_STREAM,
            #[cfg(feature = "cuda")]
            &cuda,
        );
        let (default, thread) = match started {
            Ok(started) => started,
            Err(e) => {
                // No handle will ever join: peers waiting for this rank must not hang.
                shared.departed[rank].store(true, Ordering::Release);
                shared.notify_all();
                return Err(e);
            }
        };
        #[cfg(feature = "cuda")]
        let device = cuda.as_ref().map_or(Device::Cpu, |c| c.device.clone());
        #[cfg(not(feature = "cuda"))]
        let device = Device::Cpu;
        Ok(Arc::new(ThreadProcessGroup {
            id,
            rank,
            device,
            shared,
            streams: Mutex::new(vec![Arc::downgrade(&default)]),
            default_stream: CommStream::new(DEFAULT_STREAM, default),
            threads: Mutex::new(vec![thread]),
            setup: Mutex::new(SetupState { seq: 0, streams: 1 }),
            observer: Mutex::new(None),
            closing,
            #[cfg(feature = "cuda")]
            cuda,
        }))
    }

    /// The configured collective timeout.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    /// Enqueues `body` as an operation of `kind` on `stream`.
    /// Issues collective `call` on `stream`, on the rank's data path: its GPU's (`cuda.rs`,
    /// feature `cuda`) when the group was made on one, else the host's (`host.rs`). `out` is the
    /// output (or in-place buffer), `input` the input of all-gather and reduce-scatter.
    fn issue_call(
        &self,
        stream: &CommStream,
        call: Call,
        out: Tensor,
        input: Option<&Tensor>,
    ) -> Work<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(rc) = &self.cuda {
            return self.issue_cuda(stream, rc, call, out, input);
        }
        let input = input.cloned();
        self.issue(stream, call.kind(), move |ctx| {
            ctx.run_call(call, &out, input.as_ref())?;
            Ok(out)
        })
    }

    fn issue<T, F>(&self, stream: &CommStream, kind: OpKind, body: F) -> Work<T>
    where
        T: Send + 'static,
        F: FnOnce(&Ctx) -> Result<T> + Send + 'static,
    {
        let Some(ts) = stream
            .backend_state::<ThreadStream>()
            .filter(|s| s.owner == self.id)
        else {
            return Work::ready(Err(crate::comm::foreign_stream(kind, self.rank, stream)));
        };
        // Holding the slot from the sequence number to the send keeps both in the same order.
        let mut slot = ts.slot.lock();
        slot.seq += 1;
        let seq = slot.seq;
        let op = format!("{} #{seq} (stream {})", kind.name(), ts.name);
        let (work, completer) = Work::pending(op.clone(), self.rank, &*ts.name);
        let shared = Arc::clone(&self.shared);
        let comm = Arc::clone(&ts.comm);
        let stream_name = Arc::clone(&ts.name);
        let rank = self.rank;
        let observer = self.observer.lock().clone();
        let job: Job = Box::new(move || {
            let observed = observer
                .as_ref()
                .and_then(|o| o.op_started(&stream_name, kind, &op));
            let ctx = Ctx {
                shared: &shared,
                comm: &comm,
                rank,
                seq,
                op: &op,
            };
            let result = run_stream_op(
                &op,
                rank,
                || body(&ctx),
                |message| shared.abort(rank, &format!("comm stream panicked: {message}")),
            );
            drop(observed);
            completer.complete(result);
        });
        if let Some(tx) = &slot.tx {
            // A send error means the stream thread is gone: the job, and with it the completer,
            // is dropped, and `wait` reports `Error::StreamStopped`.
            let _ = tx.send(job);
        }
        work
    }

    /// Runs a setup rendezvous (`new_stream`, `new_group`) on the calling thread: posts `post`,
    /// validates every rank's post, runs `then` on the validated outcome while peers still
    /// keep their arguments alive, and leaves after the second barrier.
    fn setup_rendezvous<T>(
        &self,
        ctx: &Ctx,
        post: crate::comm::buffer::Post,
        then: impl FnOnce(Result<()>) -> Result<T>,
    ) -> Result<T> {
        let (generation, posts) = ctx.rendezvous(post)?;
        let outcome = then(validate(ctx.op, self.shared.world_size, &posts));
        // Peers read this rank's argument while validating: every rank leaves together.
        ctx.sync(generation + 1);
        outcome
    }

    /// Issues a collective on CUDA buffers: `output` is the output or in-place buffer, `input`
    /// the input of all-gather and reduce-scatter.
    #[cfg(feature = "cuda")]
    fn issue_cuda(
        &self,
        stream: &CommStream,
        rc: &Arc<cuda::RankCuda>,
        call: Call,
        output: Tensor,
        input: Option<&Tensor>,
    ) -> Work<Tensor> {
        let input = input.cloned();
        let mut keep = vec![output.clone()];
        keep.extend(input.iter().cloned());
        let dst = output.clone();
        let kind = call.kind();
        self.issue_cuda_job(stream, rc, kind, output, keep, move |ctx, job| {
            ctx.cuda_collective(job, call, &dst, input.as_ref())
        })
    }

    /// Enqueues `body` as a CUDA operation of `kind` on `stream`: records the compute stream's
    /// "inputs ready" event now (on the caller's thread), runs `body` on the stream's thread,
    /// and returns a [`Work`] whose value `value` is valid once the operation's final event
    /// completed; `keep` (the buffers) is released only after the compute stream waited on it.
    #[cfg(feature = "cuda")]
    fn issue_cuda_job<T, F>(
        &self,
        stream: &CommStream,
        rc: &Arc<cuda::RankCuda>,
        kind: OpKind,
        value: T,
        keep: Vec<Tensor>,
        body: F,
    ) -> Work<T>
    where
        T: Send + 'static,
        F: FnOnce(&Ctx, &cuda::CudaJob) -> crate::comm::engine::cuda::CudaDone + Send + 'static,
    {
        let Some((ts, device_stream)) = stream
            .backend_state::<ThreadStream>()
            .filter(|s| s.owner == self.id)
            .and_then(|s| s.device_stream.clone().map(|d| (s, d)))
        else {
            return Work::ready(Err(crate::comm::foreign_stream(kind, self.rank, stream)));
        };
        let mut slot = ts.slot.lock();
        slot.seq += 1;
        let seq = slot.seq;
        let op = format!("{} #{seq} (stream {})", kind.name(), ts.name);
        let (completion, completer) =
            cuda::CudaOp::pending(Arc::clone(&rc.compute), &op, self.rank, &ts.name);
        // The inputs as of this call: recorded now, on the compute stream.
        let ready = crate::device::cuda::record(&rc.compute, false);
        let shared = Arc::clone(&self.shared);
        let comm = Arc::clone(&ts.comm);
        let stream_name = Arc::clone(&ts.name);
        let rank = self.rank;
        let observer = self.observer.lock().clone();
        let rc = Arc::clone(rc);
        let job: Job = Box::new(move || {
            let observed = observer
                .as_ref()
                .and_then(|o| o.op_started(&stream_name, kind, &op));
            let timing = observer.as_ref().is_some_and(|o| o.times_device_ops());
            let ctx = Ctx {
                shared: &shared,
                comm: &comm,
                rank,
                seq,
                op: &op,
            };
            let done = run_stream_op(
                &op,
                rank,
                || {
                    Ok(match &ready {
                        Ok(ready) => {
                            let job = cuda::CudaJob {
                                stream: &device_stream,
                                cuda: &rc.cuda,
                                device: &rc.device,
                                ready,
                                timing,
                            };
                            body(&ctx, &job)
                        }
                        Err(e) => {
                            let e = Error::Cuda(format!("{op} on rank {rank}: {e}"));
                            shared.abort(rank, &e.to_string());
                            crate::comm::engine::cuda::CudaDone::failed(e)
                        }
                    })
                },
                |message| shared.abort(rank, &format!("comm stream panicked: {message}")),
            )
            .unwrap_or_else(crate::comm::engine::cuda::CudaDone::failed);
            drop(observed);
            let crate::comm::engine::cuda::CudaDone {
                final_event,
                timing,
                result,
            } = done;
            if let (Some(o), Some((start, end))) = (&observer, timing) {
                o.device_op(&stream_name, kind, &op, start, end);
            }
            completer.complete(
                crate::comm::engine::cuda::CudaDone {
                    final_event,
                    timing: None,
                    result,
                },
                keep,
            );
        });
        if let Some(tx) = &slot.tx {
            // As in `issue`: a send error drops the job and its completer, which fails the
            // operation with `Error::StreamStopped`.
            let _ = tx.send(job);
        }
        Work::with_completion(value, completion)
    }
}

impl ProcessGroup for ThreadProcessGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn backend(&self) -> &'static str {
        "threads"
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn new_stream(&self, name: &str) -> Result<CommStream> {
        let mut setup = self.setup.lock();
        setup.seq += 1;
        let index = setup.streams;
        let op = format!("new_stream #{} ({name:?})", setup.seq);
        let ctx = Ctx {
            shared: &self.shared,
            comm: &self.shared.setup,
            rank: self.rank,
            seq: setup.seq,
            op: &op,
        };
        let mut post = ctx.post(Kind::NewStream);
        post.bytes = Some(RawBytes::of(name.as_bytes()));
        post.index = Some(index);
        self.setup_rendezvous(&ctx, post, |verdict| verdict)?;
        setup.streams += 1;
        let (stream, thread) = start_stream(
            self.id,
            self.rank,
            &self.shared,
            &self.closing,
            index,
            name,
            #[cfg(feature = "cuda")]
            &self.cuda,
        )?;
        let mut threads = self.threads.lock();
        threads.retain(|t| !t.is_finished());
        threads.push(thread);
        let mut streams = self.streams.lock();
        streams.retain(|s| s.strong_count() > 0);
        streams.push(Arc::downgrade(&stream));
        Ok(CommStream::new(Arc::clone(&stream.name), stream))
    }

    fn default_stream(&self) -> CommStream {
        self.default_stream.clone()
    }

    fn all_gather(&self, stream: &CommStream, input: &Tensor, output: Tensor) -> Work<Tensor> {
        self.issue_call(stream, Call::AllGather, output, Some(input))
    }

    fn reduce_scatter(
        &self,
        stream: &CommStream,
        input: &Tensor,
        output: Tensor,
        op: ReduceOp,
    ) -> Work<Tensor> {
        self.issue_call(stream, Call::ReduceScatter(op), output, Some(input))
    }

    fn all_reduce(&self, stream: &CommStream, buf: Tensor, op: ReduceOp) -> Work<Tensor> {
        self.issue_call(stream, Call::AllReduce(op), buf, None)
    }

    fn broadcast(&self, stream: &CommStream, buf: Tensor, root: usize) -> Work<Tensor> {
        self.issue_call(stream, Call::Broadcast(root), buf, None)
    }

    fn reduce(&self, stream: &CommStream, buf: Tensor, root: usize, op: ReduceOp) -> Work<Tensor> {
        self.issue_call(stream, Call::Reduce(root, op), buf, None)
    }

    fn barrier(&self, stream: &CommStream) -> Work<()> {
        #[cfg(feature = "cuda")]
        if let Some(rc) = &self.cuda {
            return self.issue_cuda_job(stream, rc, OpKind::Barrier, (), Vec::new(), |ctx, job| {
                ctx.cuda_barrier(job)
            });
        }
        self.issue(stream, OpKind::Barrier, |ctx| ctx.barrier())
    }

    fn new_group(&self, ranks: &[usize]) -> Result<Option<Arc<dyn ProcessGroup>>> {
        let mut setup = self.setup.lock();
        setup.seq += 1;
        let seq = setup.seq;
        let op = format!("new_group #{seq} ({ranks:?})");
        let ctx = Ctx {
            shared: &self.shared,
            comm: &self.shared.setup,
            rank: self.rank,
            seq,
            op: &op,
        };
        let mut post = ctx.post(Kind::NewGroup);
        post.bytes = Some(RawBytes::of(ranks));
        let position = ranks.iter().position(|&r| r == self.rank);
        let sub = self.setup_rendezvous(&ctx, post, |verdict| {
            verdict?;
            check_ranks(&op, ranks, self.shared.world_size)?;
            // Members take the sub-group's shared state; the first one creates it.
            Ok(position.map(|_| {
                let mut forming = self.shared.forming.lock();
                if let Some((_, s)) = forming.iter().find(|(s, _)| *s == seq) {
                    return Arc::clone(s);
                }
                let root_ranks = ranks.iter().map(|&r| self.shared.root_ranks[r]).collect();
                let s = Shared::new(
                    self.shared.timeout,
                    root_ranks,
                    Some(Arc::clone(self.shared.family())),
                    DEFAULT_STREAM,
                );
                forming.push((seq, Arc::clone(&s)));
                s
            }))
        });
        if self.rank == 0 {
            // Every member took its state before the second barrier.
            self.shared.forming.lock().retain(|(s, _)| *s != seq);
        }
        match (sub?, position) {
            (Some(shared), Some(local)) => Ok(Some(ThreadProcessGroup::create(
                shared,
                local,
                #[cfg(feature = "cuda")]
                self.cuda.clone(),
            )? as Arc<dyn ProcessGroup>)),
            _ => Ok(None),
        }
    }

    fn abort(&self, reason: &str) {
        self.shared.abort(self.rank, reason);
    }

    fn set_observer(&self, observer: Option<Arc<dyn CommObserver>>) {
        *self.observer.lock() = observer;
    }
}

impl Drop for ThreadProcessGroup {
    fn drop(&mut self) {
        // Close every channel first so the streams drain concurrently, then join them.
        self.closing.store(true, Ordering::Release);
        for stream in self.streams.get_mut().drain(..) {
            if let Some(stream) = stream.upgrade() {
                stream.slot.lock().tx = None;
            }
        }
        crate::comm::join_stream_threads(self.threads.get_mut());
        self.shared.departed[self.rank].store(true, Ordering::Release);
        self.shared.notify_all();
    }
}
