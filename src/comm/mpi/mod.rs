//! MPI backend (feature `mpi`): one rank per process, started by `mpirun`, over the system's MPI
//! (OpenMPI 4.1 tested) through rsmpi's bindings.
//!
//! [`MpiProcessGroup::world`] is this process's rank of `MPI_COMM_WORLD`;
//! [`crate::launch::Launcher::Mpi`] runs a job on it. MPI is initialised once per process with
//! `MPI_THREAD_MULTIPLE` (an error names the level the library provides if it is less) and
//! finalised at exit.
//!
//! # Streams
//!
//! Every [`CommStream`] is one thread of this process (named `mpi-{rank}-{stream}`) with a
//! communicator of its own, duplicated from the group's (`MPI_Comm_idup`): an all-gather and a
//! reduce-scatter on different streams are in flight together, and operations on one stream run
//! in issue order, as the [`crate::comm`] contract says. Stream and sub-group creation run on
//! the caller's thread over a setup communicator.
//!
//! # Algorithm and guarantees
//!
//! Every collective first exchanges a small descriptor with every peer and validates all of them
//! with the thread backend's code (same [`Error::CollectiveMismatch`] / [`Error::BadBuffer`] on
//! every rank, group still usable), then moves data with non-blocking point-to-point messages
//! and reduces locally in rank order (see `ops`): reductions are **bitwise identical to the
//! thread backend's** for every dtype (bf16/f16 accumulate in f32 and round once; they travel at
//! 16 bits, nothing is widened on the wire and no MPI reduction op is used).
//!
//! # Failures
//!
//! Communicators return errors ([`Error::Mpi`]) instead of aborting; every wait polls with a
//! deadline ([`MpiConfig::timeout`], [`Error::Timeout`]); [`ProcessGroup::abort`] sends the
//! reason to every rank of the job, whose pending and later collectives fail with
//! [`Error::PeerFailed`] naming the failed rank (its `MPI_COMM_WORLD` rank). A process in a
//! failed job skips `MPI_Finalize`; see `runtime` for the details.

mod ops;
mod runtime;

use std::ffi::c_int;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use candle_core::{Device, Tensor};
use crossbeam::channel::{unbounded, Sender};
use mpi::ffi;
use parking_lot::Mutex;

use self::ops::OpCtx;
use self::runtime::{check, deadline_after, runtime, wait_all, Comm, Runtime, WaitFor};
use super::buffer::{Kind, Post, RawBytes};
use super::engine::{check_ranks, run_stream_op};
use super::wire;
use super::{
    foreign_stream, host_collectives, join_stream_threads, CommObserver, CommStream, Instrumented,
    OpKind, ProcessGroup, ReduceOp, Work, DEFAULT_STREAM,
};
use crate::error::{Error, Result};

/// Largest setup descriptor (a stream name or a sub-group's rank list), bytes.
const SETUP_DESC_MAX: usize = 1 << 16;

/// How long a rank of a failed job waits for the others to report their own failure before its
/// process exits (see [`run`]).
pub const LINGER: Duration = Duration::from_secs(10);

/// Configuration of an MPI process group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MpiConfig {
    /// How long a rank waits in a collective for its peers before failing with
    /// [`Error::Timeout`] (which also aborts the job). Default: 300 s.
    pub timeout: Duration,
}

impl Default for MpiConfig {
    fn default() -> Self {
        MpiConfig {
            timeout: Duration::from_secs(300),
        }
    }
}

/// This process's rank and the job's size in `MPI_COMM_WORLD`, initialising MPI if needed.
///
/// Errors: MPI cannot be initialised, or provides less than `MPI_THREAD_MULTIPLE`.
pub fn world_rank_and_size() -> Result<(usize, usize)> {
    let rt = runtime()?;
    Ok((rt.world_rank, rt.world_size))
}

type Job = Box<dyn FnOnce(&mut Vec<u64>) + Send>;

struct StreamSlot {
    seq: u64,
    tx: Option<Sender<Job>>,
}

/// The MPI backend's state behind a [`CommStream`].
struct MpiStream {
    owner: u64,
    name: Arc<str>,
    comm: Comm,
    slot: Mutex<StreamSlot>,
}

static NEXT_GROUP_ID: AtomicU64 = AtomicU64::new(1);

/// One process's rank of an MPI group; see the [module docs](self).
pub struct MpiProcessGroup {
    id: u64,
    rank: usize,
    world_size: usize,
    device: Device,
    rt: &'static Runtime,
    config: MpiConfig,
    /// Communicator the streams are duplicated from.
    base: Comm,
    /// Communicator of setup operations (stream and sub-group creation).
    setup_comm: Comm,
    default_stream: CommStream,
    streams: Mutex<Vec<Weak<MpiStream>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Sequence number of the last setup operation.
    setup: Mutex<u64>,
    observer: Mutex<Option<Arc<dyn CommObserver>>>,
    /// Communicators this group created (freed on drop unless the runtime is poisoned).
    comms: Mutex<Vec<Comm>>,
}

impl std::fmt::Debug for MpiProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("timeout", &self.config.timeout)
            .finish()
    }
}

/// `MPI_Comm_idup` of `comm`, waited for with a deadline.
fn dup(
    rt: &Runtime,
    comm: Comm,
    (rank, size): (usize, usize),
    what: &str,
    timeout: Duration,
) -> Result<Comm> {
    // SAFETY: out-pointers to locals; `comm` is a live communicator.
    let mut new: ffi::MPI_Comm = unsafe { std::mem::zeroed() };
    let mut req: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
    let rc = unsafe { ffi::MPI_Comm_idup(comm.0, &mut new, &mut req) };
    check(rc, || format!("MPI_Comm_idup ({what})"), rt.world_rank)?;
    let op = format!("MPI_Comm_idup ({what})");
    let others: Vec<usize> = (0..size).filter(|&r| r != rank).collect();
    wait_all(
        rt,
        &mut [req],
        &others,
        &WaitFor {
            op: &op,
            rank,
            deadline: deadline_after(timeout),
            timeout,
        },
    )?;
    // SAFETY: `new` is the communicator the completed idup created.
    unsafe { ffi::MPI_Comm_set_errhandler(new, ffi::RSMPI_ERRORS_RETURN) };
    Ok(Comm(new))
}

impl MpiProcessGroup {
    /// This process's rank of a group over every process of the job (`MPI_COMM_WORLD`), with
    /// its default stream running. Every process calls it (it is collective).
    ///
    /// Errors: MPI cannot be initialised or lacks `MPI_THREAD_MULTIPLE`
    /// ([`Error::InvalidArgument`]); an MPI call fails ([`Error::Mpi`]); a thread cannot be
    /// started ([`Error::SpawnFailed`]).
    pub fn world(config: MpiConfig) -> Result<Arc<MpiProcessGroup>> {
        let rt = runtime()?;
        MpiProcessGroup::create(rt, rt.world, rt.world_rank, rt.world_size, config)
    }

    fn create(
        rt: &'static Runtime,
        parent: Comm,
        rank: usize,
        world_size: usize,
        config: MpiConfig,
    ) -> Result<Arc<MpiProcessGroup>> {
        let base = dup(rt, parent, (rank, world_size), "group", config.timeout)?;
        let setup_comm = dup(rt, base, (rank, world_size), "setup", config.timeout)?;
        let id = NEXT_GROUP_ID.fetch_add(1, Ordering::Relaxed);
        let (stream, thread) = start_stream(
            rt,
            id,
            (rank, world_size),
            base,
            DEFAULT_STREAM,
            config.timeout,
        )?;
        Ok(Arc::new(MpiProcessGroup {
            id,
            rank,
            world_size,
            device: Device::Cpu,
            rt,
            config,
            base,
            setup_comm,
            streams: Mutex::new(vec![Arc::downgrade(&stream)]),
            comms: Mutex::new(vec![base, setup_comm, stream.comm]),
            default_stream: CommStream::new(DEFAULT_STREAM, stream),
            threads: Mutex::new(vec![thread]),
            setup: Mutex::new(0),
            observer: Mutex::new(None),
        }))
    }

    /// The configured collective timeout.
    pub fn timeout(&self) -> Duration {
        self.config.timeout
    }

    /// A setup operation's context on the caller's thread.
    fn setup_ctx<'a>(&self, seq: u64, op: &'a str, scratch: &'a mut Vec<u64>) -> OpCtx<'a> {
        OpCtx {
            rt: self.rt,
            comm: self.setup_comm,
            rank: self.rank,
            world_size: self.world_size,
            seq,
            op,
            timeout: self.config.timeout,
            scratch,
            desc_max: SETUP_DESC_MAX,
        }
    }

    /// Enqueues `body` as an operation of `kind` on `stream`.
    fn issue<T, F>(&self, stream: &CommStream, kind: OpKind, body: F) -> Work<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut OpCtx<'_>) -> Result<T> + Send + 'static,
    {
        let Some(ms) = stream
            .backend_state::<MpiStream>()
            .filter(|s| s.owner == self.id)
        else {
            return Work::ready(Err(foreign_stream(kind, self.rank, stream)));
        };
        let mut slot = ms.slot.lock();
        slot.seq += 1;
        let seq = slot.seq;
        let op = format!("{} #{seq} (stream {})", kind.name(), ms.name);
        let (work, completer) = Work::pending(op.clone(), self.rank, &*ms.name);
        let (rt, comm, rank, ws) = (self.rt, ms.comm, self.rank, self.world_size);
        let timeout = self.config.timeout;
        let stream_name = Arc::clone(&ms.name);
        let observer = self.observer.lock().clone();
        let job: Job = Box::new(move |scratch| {
            let observed = observer
                .as_ref()
                .and_then(|o| o.op_started(&stream_name, kind, &op));
            let mut ctx = OpCtx {
                rt,
                comm,
                rank,
                world_size: ws,
                seq,
                op: &op,
                timeout,
                scratch,
                desc_max: wire::OP_DESC_MAX,
            };
            let result = run_stream_op(
                &op,
                rank,
                || body(&mut ctx),
                |message| rt.abort(&format!("rank {rank}: comm stream panicked: {message}")),
            );
            drop(observed);
            completer.complete(result);
        });
        if let Some(tx) = &slot.tx {
            let _ = tx.send(job);
        }
        work
    }
}

/// Starts a stream named `name` on a duplicate of `base`.
fn start_stream(
    rt: &'static Runtime,
    owner: u64,
    (rank, size): (usize, usize),
    base: Comm,
    name: &str,
    timeout: Duration,
) -> Result<(Arc<MpiStream>, JoinHandle<()>)> {
    let comm = dup(rt, base, (rank, size), &format!("stream {name}"), timeout)?;
    let (tx, rx) = unbounded::<Job>();
    let handle = thread::Builder::new()
        .name(format!("mpi-{rank}-{name}"))
        .spawn(move || {
            let mut scratch = Vec::new();
            for job in rx.iter() {
                job(&mut scratch);
            }
        })
        .map_err(|error| Error::SpawnFailed {
            what: format!("comm stream {name} of rank {rank}"),
            error,
        })?;
    Ok((
        Arc::new(MpiStream {
            owner,
            name: name.into(),
            comm,
            slot: Mutex::new(StreamSlot {
                seq: 0,
                tx: Some(tx),
            }),
        }),
        handle,
    ))
}

impl ProcessGroup for MpiProcessGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn new_stream(&self, name: &str) -> Result<CommStream> {
        let mut setup = self.setup.lock();
        *setup += 1;
        let index = self.streams.lock().len();
        let op = format!("new_stream #{} ({name:?})", *setup);
        let mut scratch = Vec::new();
        let ctx = self.setup_ctx(*setup, &op, &mut scratch);
        let mut post = Post::new(Kind::NewStream, *setup);
        post.bytes = Some(RawBytes::of(name.as_bytes()));
        post.index = Some(index);
        ctx.exchange(post, name.as_bytes(), deadline_after(self.config.timeout))?;
        let (stream, thread) = start_stream(
            self.rt,
            self.id,
            (self.rank, self.world_size),
            self.base,
            name,
            self.config.timeout,
        )?;
        self.comms.lock().push(stream.comm);
        let mut threads = self.threads.lock();
        threads.retain(|t| !t.is_finished());
        threads.push(thread);
        self.streams.lock().push(Arc::downgrade(&stream));
        Ok(CommStream::new(Arc::clone(&stream.name), stream))
    }

    fn default_stream(&self) -> CommStream {
        self.default_stream.clone()
    }

    host_collectives!();

    fn new_group(&self, ranks: &[usize]) -> Result<Option<Arc<dyn ProcessGroup>>> {
        let mut setup = self.setup.lock();
        *setup += 1;
        let op = format!("new_group #{} ({ranks:?})", *setup);
        let bytes: Vec<u8> = ranks.iter().flat_map(|r| r.to_ne_bytes()).collect();
        let mut scratch = Vec::new();
        let ctx = self.setup_ctx(*setup, &op, &mut scratch);
        let mut post = Post::new(Kind::NewGroup, *setup);
        post.bytes = Some(RawBytes::of(&bytes));
        ctx.exchange(post, &bytes, deadline_after(self.config.timeout))?;
        check_ranks(&op, ranks, self.world_size)?;
        let position = ranks.iter().position(|&r| r == self.rank);
        // SAFETY: reading link-time constants.
        let color = position.map_or(unsafe { ffi::RSMPI_UNDEFINED }, |_| 0);
        let key = position.unwrap_or(0) as c_int;
        // SAFETY: out-pointer to a local; every rank of `base` calls the split (validated above).
        let mut sub: ffi::MPI_Comm = unsafe { std::mem::zeroed() };
        let rc = unsafe { ffi::MPI_Comm_split(self.base.0, color, key, &mut sub) };
        check(rc, || format!("MPI_Comm_split ({op})"), self.rt.world_rank)?;
        let Some(local) = position else {
            return Ok(None);
        };
        self.comms.lock().push(Comm(sub));
        let group = MpiProcessGroup::create(self.rt, Comm(sub), local, ranks.len(), self.config)?;
        Ok(Some(group as Arc<dyn ProcessGroup>))
    }

    fn abort(&self, reason: &str) {
        self.rt.abort(reason);
    }

    fn set_observer(&self, observer: Option<Arc<dyn CommObserver>>) {
        *self.observer.lock() = observer;
    }
}

impl Drop for MpiProcessGroup {
    fn drop(&mut self) {
        for stream in self.streams.get_mut().drain(..) {
            if let Some(stream) = stream.upgrade() {
                stream.slot.lock().tx = None;
            }
        }
        join_stream_threads(self.threads.get_mut());
        if !self.rt.is_poisoned() {
            for comm in self.comms.get_mut().drain(..) {
                let mut c = comm.0;
                // SAFETY: communicators this group created; no thread uses them any more.
                unsafe { ffi::MPI_Comm_free(&mut c) };
            }
        }
    }
}

/// Runs `f` on this process's rank of `MPI_COMM_WORLD` (wrapped in [`Instrumented`]) and
/// returns its result (one element). When `f` fails or panics (or the group cannot be made), the
/// job is aborted with the error's text (every other rank's collectives fail with
/// [`Error::PeerFailed`]) and this rank waits up to [`LINGER`] (at most the timeout) for the
/// others to report their own failure, so that every process gets to print its error before
/// `mpirun` tears the job down; ranks this rank timed out waiting for are not waited for.
pub fn run<T, F>(config: MpiConfig, f: F) -> Vec<Result<T>>
where
    F: Fn(Arc<dyn ProcessGroup>) -> Result<T>,
{
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(e) => return vec![Err(e)],
    };
    rt.run_started();
    let result = match MpiProcessGroup::world(config) {
        Ok(group) => {
            let rank = group.rank;
            let pg: Arc<dyn ProcessGroup> = Arc::new(Instrumented::new(group));
            super::engine::run_one(rank, pg, &f)
        }
        Err(e) => {
            rt.abort(&e.message());
            Err(e)
        }
    };
    if let Err(e) = &result {
        // The world group: its ranks are world ranks.
        let hung = match e.root_cause() {
            Error::Timeout { missing, .. } => missing.clone(),
            _ => Vec::new(),
        };
        rt.linger(LINGER.min(config.timeout), &hung);
    }
    rt.run_ended(result.is_ok());
    vec![result]
}
