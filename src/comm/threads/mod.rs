//! In-process thread backend: `world_size` ranks as threads of one process, exchanging data
//! through shared memory.
//!
//! [`new_group`] creates one handle per rank (an `Arc<dyn ProcessGroup>`); [`run_ranks`] /
//! [`run_ranks_ok`] run a closure on every rank in its own thread (named `rank-{r}`), each with
//! its handle wrapped in [`crate::comm::Instrumented`] (statistics), and collect the results
//! ([`crate::launch::Launcher::Threads`] is the same launcher behind the common API).
//!
//! # Streams and algorithm
//!
//! Every stream of a rank is one OS thread (named `rank-{r}-{stream name}`, at raised priority:
//! see `raise_priority`) running its operations in issue order; the k-th stream created by each
//! rank (0: the default stream) shares one *communicator* (a rendezvous: mutex, condition
//! variable, per-rank arrivals and posts) with the k-th streams of the other ranks. A stream's
//! thread exits when every [`crate::comm::CommStream`] on it is dropped, or when its group
//! handle is dropped; only the latter tells the peers that the rank left (its peers on a
//! stream it merely dropped wait for its abort, its departure or the timeout). A collective
//! runs as the shared-memory family's collectives do (`comm::engine::board`; design: `design/comm.md`,
//! "Thread backend"), the peers reading this rank's tensors themselves through the posted
//! pointers, under the tensors' storage locks throughout (see `rendezvous`).
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

use std::sync::atomic::Ordering;
use std::sync::Arc;

use candle_core::Device;
#[cfg(feature = "cuda")]
use candle_core::Tensor;

use self::rendezvous::{Communicator, Ctx, Shared};
use super::buffer::Post;
use super::engine::board;
use super::engine::group::{Collective, HostGroup, Member, Op, Place, Transport};
use super::engine::streams::StreamComm;
#[cfg(feature = "cuda")]
use super::{Call, CommStream, OpKind, Work};
use super::{ProcessGroup, DEFAULT_STREAM};
// `Error` is named by the docs above, and used by the GPU path.
#[cfg_attr(not(feature = "cuda"), allow(unused_imports))]
use crate::error::{Error, Result};

/// Configuration of a thread process group: [`crate::comm::GroupConfig`].
pub type ThreadGroupConfig = super::GroupConfig;

/// One communicator of a rank as its thread holds it: a stream's rendezvous (`None`: the
/// group's setup rendezvous) and, on a GPU, the stream's CUDA stream.
pub(crate) struct ThreadComm {
    shared: Arc<Shared>,
    comm: Option<Arc<Communicator>>,
    /// The CUDA stream the stream's data movement is enqueued on (groups on a GPU).
    #[cfg(feature = "cuda")]
    device_stream: Option<Arc<cudarc::driver::CudaStream>>,
}

impl ThreadComm {
    fn communicator(&self) -> &Communicator {
        self.comm.as_deref().unwrap_or(&self.shared.setup)
    }
}

impl StreamComm for ThreadComm {
    /// A stream's thread marks the rank as finished on its communicator, so that peers waiting
    /// there stop waiting while the handle still joins its other streams; the setup
    /// communicator's departure marks the rank as departed from the group. (When the last
    /// [`crate::comm::CommStream`] of a stream is dropped instead, its thread ends without
    /// this: the rank is still alive and may yet fail.)
    fn leave(&mut self, rank: usize) {
        match &self.comm {
            Some(comm) => comm.finish(rank),
            None => {
                self.shared.departed[rank].store(true, Ordering::Release);
                self.shared.notify_all();
            }
        }
    }

    fn thread_name(_backend: &str, rank: usize, stream: &str) -> String {
        format!("rank-{rank}-{stream}")
    }

    fn on_thread_start() {
        raise_priority();
    }
}

/// The thread backend's transport of one rank of one group: the group's shared rendezvous
/// state and, on a GPU, the rank's CUDA state.
pub(crate) struct Threads {
    rank: usize,
    shared: Arc<Shared>,
    #[cfg(feature = "cuda")]
    cuda: Option<Arc<cuda::RankCuda>>,
}

impl Threads {
    /// The handle of `rank` on `shared`, with its default stream running.
    fn group(
        shared: Arc<Shared>,
        rank: usize,
        #[cfg(feature = "cuda")] cuda: Option<Arc<cuda::RankCuda>>,
    ) -> Result<Arc<dyn ProcessGroup>> {
        let threads = Threads {
            rank,
            shared,
            #[cfg(feature = "cuda")]
            cuda,
        };
        let (threads, setup, default) = threads.open_member()?;
        Ok(HostGroup::new(threads, setup, default)?)
    }

    /// This rank's member of its group: its setup rendezvous and its default stream's.
    fn open_member(self) -> Result<Member<Threads>> {
        let mut setup = self.comm(None)?;
        let default = self.comm(Some(self.shared.communicator(0, DEFAULT_STREAM)));
        // On an error no handle will ever join: peers waiting for this rank must not hang.
        let default = default.inspect_err(|_| setup.leave(self.rank))?;
        Ok((self, setup, default))
    }

    /// This rank's side of `comm` (`None`: the setup rendezvous), with a CUDA stream of its
    /// own on a GPU.
    fn comm(&self, comm: Option<Arc<Communicator>>) -> Result<ThreadComm> {
        #[cfg(feature = "cuda")]
        let device_stream = match (&self.cuda, &comm) {
            (Some(c), Some(_)) => Some(crate::device::cuda::new_stream(&c.cuda)?),
            _ => None,
        };
        Ok(ThreadComm {
            shared: Arc::clone(&self.shared),
            comm,
            #[cfg(feature = "cuda")]
            device_stream,
        })
    }

    fn ctx<'a>(&'a self, comm: &'a ThreadComm, op: Op<'a>) -> Ctx<'a> {
        Ctx {
            shared: &self.shared,
            comm: comm.communicator(),
            rank: self.rank,
            seq: op.seq,
            op: op.name,
            posts: Vec::new(),
        }
    }
}

impl Transport for Threads {
    type Comm = ThreadComm;
    const BACKEND: &'static str = "threads";

    fn place(&self) -> Place {
        Place::new(self.rank, self.shared.world_size, self.shared.timeout)
    }

    fn device(&self) -> Device {
        #[cfg(feature = "cuda")]
        if let Some(c) = &self.cuda {
            return c.device.clone();
        }
        Device::Cpu
    }

    fn run(&self, comm: &mut ThreadComm, op: Op<'_>, collective: Collective<'_>) -> Result<()> {
        board::run(&mut self.ctx(comm, op), collective)
    }

    /// A setup rendezvous on the caller's thread: posts `post` and validates every rank's post
    /// (each rank reads copies of them).
    fn agree(&self, setup: &mut ThreadComm, op: Op<'_>, post: &Post) -> Result<()> {
        self.ctx(setup, op).agree(post).map(|_| ())
    }

    /// The `index`-th communicator of the group is its stream `index - 1` (0: the default
    /// stream; the setup rendezvous has a place of its own).
    fn open(
        &self,
        _setup: &mut ThreadComm,
        _op: Op<'_>,
        index: usize,
        name: &str,
    ) -> Result<ThreadComm> {
        self.comm(Some(self.shared.communicator(index - 1, name)))
    }

    /// Members take the sub-group's shared state (the first one creates it, the last one to
    /// take it removes it from the forming list).
    fn split(
        &self,
        _setup: &mut ThreadComm,
        op: Op<'_>,
        ranks: &[usize],
    ) -> Result<Option<Member<Threads>>> {
        let Some(local) = ranks.iter().position(|&r| r == self.rank) else {
            return Ok(None);
        };
        let shared = {
            let mut forming = self.shared.forming.lock();
            let at = forming.iter().position(|(s, _, _)| *s == op.seq);
            let at = at.unwrap_or_else(|| {
                let root_ranks = ranks.iter().map(|&r| self.shared.root_ranks[r]).collect();
                let family = Some(Arc::clone(self.shared.family()));
                let s = Shared::new(self.shared.timeout, root_ranks, family);
                forming.push((op.seq, s, 0));
                forming.len() - 1
            });
            forming[at].2 += 1;
            let shared = Arc::clone(&forming[at].1);
            if forming[at].2 == ranks.len() {
                forming.remove(at);
            }
            shared
        };
        let sub = Threads {
            rank: local,
            shared,
            #[cfg(feature = "cuda")]
            cuda: self.cuda.clone(),
        };
        sub.open_member().map(Some)
    }

    fn abort(&self, reason: &str) {
        self.shared.abort(self.rank, reason);
    }

    #[cfg(feature = "cuda")]
    fn on_device(&self) -> bool {
        self.cuda.is_some()
    }

    /// Records the compute stream's "inputs ready" event now (on the caller's thread), runs
    /// the collective on the stream's thread (`cuda`), and returns a [`Work`] whose value is
    /// valid once the operation's final event completed; the buffers are released only after
    /// the compute stream waited on it.
    #[cfg(feature = "cuda")]
    fn issue_device<V: Send + 'static>(
        &self,
        group: &HostGroup<Self>,
        stream: &CommStream,
        kind: OpKind,
        value: V,
        collective: Option<(Call, Tensor, Option<Tensor>)>,
    ) -> Work<V> {
        use crate::comm::engine::cuda::CudaDone;
        let rc = Arc::clone(self.cuda.as_ref().expect("a group on a GPU"));
        let (rank, shared) = (self.rank, Arc::clone(&self.shared));
        let issued = group.issue_job(stream, kind, move |is| {
            let (completion, completer) =
                cuda::CudaOp::pending(Arc::clone(&rc.compute), &is.op, rank, &is.stream);
            // The inputs as of this call: recorded now, on the compute stream.
            let ready = crate::device::cuda::record(&rc.compute, false);
            let job: crate::comm::engine::streams::Job<ThreadComm> = Box::new(move |comm| {
                let op = &is.op;
                let observer = is.observer.as_ref();
                let observed = observer.and_then(|o| o.op_started(&is.stream, kind, op));
                let timing = observer.is_some_and(|o| o.times_device_ops());
                let ctx = Ctx {
                    shared: &shared,
                    comm: comm.communicator(),
                    rank,
                    seq: is.seq,
                    op,
                    posts: Vec::new(),
                };
                // The buffers move into `keep`, which the completer releases only once the
                // compute stream waited on the operation: no other reference of the job's
                // outlives it.
                let (call, keep): (Option<Call>, Vec<Tensor>) = match collective {
                    Some((call, out, input)) => {
                        (Some(call), std::iter::once(out).chain(input).collect())
                    }
                    None => (None, Vec::new()),
                };
                let run = || {
                    let (ready, device_stream) = match (&ready, &comm.device_stream) {
                        (Ok(ready), Some(stream)) => (ready, stream),
                        (Err(e), _) => {
                            let e = Error::Cuda(format!("{op} on rank {rank}: {e}"));
                            shared.abort(rank, &e.to_string());
                            return Ok(CudaDone::failed(e));
                        }
                        (_, None) => unreachable!("every stream of a group on a GPU has one"),
                    };
                    let job = cuda::CudaJob {
                        stream: device_stream,
                        cuda: &rc.cuda,
                        device: &rc.device,
                        ready,
                        timing,
                    };
                    Ok(match call {
                        Some(call) => ctx.cuda_collective(&job, call, &keep[0], keep.get(1)),
                        None => ctx.cuda_barrier(&job),
                    })
                };
                let on_panic =
                    |message: &str| shared.abort(rank, &format!("comm stream panicked: {message}"));
                let mut done = crate::comm::engine::run_stream_op(op, rank, run, on_panic)
                    .unwrap_or_else(CudaDone::failed);
                drop(observed);
                if let (Some(o), Some((start, end))) = (observer, done.timing.take()) {
                    o.device_op(&is.stream, kind, op, start, end);
                }
                completer.complete(done, keep);
            });
            (completion, job)
        });
        match issued {
            Ok(completion) => Work::with_completion(value, completion),
            Err(e) => Work::ready(Err(e)),
        }
    }
}
