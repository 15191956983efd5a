//! The comm streams of the host backends (threads, shared memory, TCP, MPI): one thread per
//! stream that runs its communicator's operations in issue order, and the `issue` path that
//! numbers an operation, reports it to the observer, turns a panic into an error (aborting the
//! job through the backend's hook) and completes its [`Work`].

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::{self, JoinHandle};

use crossbeam::channel::{unbounded, Sender, TryRecvError};
use parking_lot::Mutex;

use super::{run_one, run_stream_op};
use crate::comm::work::yield_until;
use crate::comm::{
    foreign_stream, CommObserver, CommStream, Instrumented, OpKind, ProcessGroup, Work,
    DEFAULT_STREAM,
};
use crate::error::{Error, Result};

/// A communicator a stream thread owns.
pub(crate) trait StreamComm: Send + 'static {
    /// Tells the peers that rank `rank` left this communicator (its group is being dropped).
    fn leave(&mut self, rank: usize);

    /// The name of the thread of stream `stream` of rank `rank` of backend `backend`.
    fn thread_name(backend: &str, rank: usize, stream: &str) -> String {
        format!("{backend}-{rank}-{stream}")
    }

    /// Runs first on every stream thread (e.g. to raise its priority).
    fn on_thread_start() {}
}

/// An operation as a stream thread runs it, on the stream's communicator.
pub(crate) type Job<C> = Box<dyn FnOnce(&mut C) + Send>;

/// What [`HostStreams::issue_job`] hands the maker of an operation's job.
pub(crate) struct Issued {
    /// Sequence number on the stream.
    pub seq: u64,
    /// The operation's name, e.g. `all_gather #12 (stream all_gather)`.
    pub op: String,
    /// The stream's name.
    pub stream: Arc<str>,
    /// The observer of the group when the operation was issued.
    pub observer: Option<Arc<dyn CommObserver>>,
}

struct StreamSlot<C> {
    seq: u64,
    tx: Option<Sender<Job<C>>>,
}

/// A host backend's state behind a [`CommStream`]: the group that owns it, its name, the
/// sequence number of its last operation and the queue of its thread.
pub(crate) struct HostStream<C> {
    owner: u64,
    /// The stream's name.
    pub name: Arc<str>,
    slot: Mutex<StreamSlot<C>>,
}

impl<C: StreamComm> HostStream<C> {
    /// Starts the thread (named `{backend}-{rank}-{name}`) of a stream of group `owner` on
    /// `comm`; when the thread ends while `closing` is set, it leaves the communicator.
    fn start(
        backend: &str,
        owner: u64,
        rank: usize,
        comm: C,
        name: &str,
        closing: &Arc<AtomicBool>,
    ) -> Result<(Arc<HostStream<C>>, JoinHandle<()>)> {
        let (tx, rx) = unbounded::<Job<C>>();
        let closing = Arc::clone(closing);
        let handle = thread::Builder::new()
            .name(C::thread_name(backend, rank, name))
            .spawn(move || {
                C::on_thread_start();
                let mut comm = comm;
                loop {
                    // Yield first, as a waiter does (`comm::work::yield_until`): the next
                    // operation usually follows within microseconds, and an issuer that
                    // finds this thread awake enqueues without a futex wake-up. A queue
                    // already closed ends the loop without the wait.
                    let job = match rx.try_recv() {
                        Ok(job) => job,
                        Err(TryRecvError::Disconnected) => break,
                        Err(TryRecvError::Empty) => {
                            yield_until(|| !rx.is_empty());
                            match rx.recv() {
                                Ok(job) => job,
                                Err(_) => break,
                            }
                        }
                    };
                    job(&mut comm);
                }
                if closing.load(Ordering::Acquire) {
                    comm.leave(rank);
                }
            })
            .map_err(|error| Error::SpawnFailed {
                what: format!("comm stream {name} of rank {rank}"),
                error,
            })?;
        Ok((
            Arc::new(HostStream {
                owner,
                name: name.into(),
                slot: Mutex::new(StreamSlot {
                    seq: 0,
                    tx: Some(tx),
                }),
            }),
            handle,
        ))
    }

    /// Closes the queue: the thread ends after the operations already queued.
    pub(crate) fn close(&self) {
        self.slot.lock().tx = None;
    }
}

/// Identifies a group's streams: a stream handed to another group's collective is refused.
static NEXT_GROUP_ID: AtomicU64 = AtomicU64::new(1);

/// The comm streams of one group handle of a host backend (`backend` names it in thread
/// names): its default stream, the streams created since (their threads are joined when the
/// group is dropped, see [`HostStreams::close`]) and the observer its operations report to.
pub(crate) struct HostStreams<C> {
    id: u64,
    backend: &'static str,
    rank: usize,
    default: CommStream,
    streams: Mutex<Vec<Weak<HostStream<C>>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    observer: Mutex<Option<Arc<dyn CommObserver>>>,
    closing: Arc<AtomicBool>,
}

impl<C: StreamComm> HostStreams<C> {
    /// Starts the default stream ([`DEFAULT_STREAM`]) of a new group handle of rank `rank` on
    /// communicator `default`.
    pub(crate) fn new(backend: &'static str, rank: usize, default: C) -> Result<Self> {
        let id = NEXT_GROUP_ID.fetch_add(1, Ordering::Relaxed);
        let closing = Arc::new(AtomicBool::new(false));
        let (stream, thread) =
            HostStream::start(backend, id, rank, default, DEFAULT_STREAM, &closing)?;
        Ok(HostStreams {
            id,
            backend,
            rank,
            streams: Mutex::new(vec![Arc::downgrade(&stream)]),
            default: CommStream::new(DEFAULT_STREAM, stream),
            threads: Mutex::new(vec![thread]),
            observer: Mutex::new(None),
            closing,
        })
    }

    /// The default stream.
    pub(crate) fn default_stream(&self) -> CommStream {
        self.default.clone()
    }

    /// Starts a stream named `name` on communicator `comm` (already agreed with the peers).
    pub(crate) fn add(&self, comm: C, name: &str) -> Result<CommStream> {
        let (stream, thread) =
            HostStream::start(self.backend, self.id, self.rank, comm, name, &self.closing)?;
        let mut threads = self.threads.lock();
        threads.retain(|t| !t.is_finished());
        threads.push(thread);
        let mut streams = self.streams.lock();
        streams.retain(|s| s.strong_count() > 0);
        streams.push(Arc::downgrade(&stream));
        Ok(CommStream::new(Arc::clone(&stream.name), stream))
    }

    /// Sets the observer of the operations issued from now on.
    pub(crate) fn set_observer(&self, observer: Option<Arc<dyn CommObserver>>) {
        *self.observer.lock() = observer;
    }

    /// Enqueues the job `make` returns (with the value handed back, e.g. the operation's
    /// [`Work`]) as an operation of `kind` on `stream`, numbered and named under the stream's
    /// lock, so operations run in issue order.
    ///
    /// Errors: `stream` was not created by this group.
    pub(crate) fn issue_job<W>(
        &self,
        stream: &CommStream,
        kind: OpKind,
        make: impl FnOnce(Issued) -> (W, Job<C>),
    ) -> Result<W> {
        let Some(hs) = stream
            .backend_state::<HostStream<C>>()
            .filter(|s| s.owner == self.id)
        else {
            return Err(foreign_stream(kind, self.rank, stream));
        };
        let mut slot = hs.slot.lock();
        slot.seq += 1;
        let issued = Issued {
            seq: slot.seq,
            op: format!("{} #{} (stream {})", kind.name(), slot.seq, hs.name),
            stream: Arc::clone(&hs.name),
            observer: self.observer.lock().clone(),
        };
        let (value, job) = make(issued);
        if let Some(tx) = &slot.tx {
            // A send error means the stream thread is gone: the job, and with it its
            // completer, is dropped, and `wait` reports StreamStopped.
            let _ = tx.send(job);
        }
        Ok(value)
    }

    /// Enqueues `body(comm, seq, op)` as an operation of `kind` on `stream`, reported to the
    /// current observer; `on_panic(message)` runs on the stream's thread when the body panics
    /// (the backend aborts the job), and the operation then fails with
    /// [`Error::RankPanicked`].
    pub(crate) fn issue<T, F>(
        &self,
        stream: &CommStream,
        kind: OpKind,
        on_panic: impl FnOnce(&str) + Send + 'static,
        body: F,
    ) -> Work<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut C, u64, &str) -> Result<T> + Send + 'static,
    {
        let rank = self.rank;
        let issued = self.issue_job(stream, kind, |is: Issued| {
            let (work, completer) = Work::pending(is.op.clone(), rank, &*is.stream);
            let job: Job<C> = Box::new(move |comm| {
                let observed = is
                    .observer
                    .as_ref()
                    .and_then(|o| o.op_started(&is.stream, kind, &is.op));
                let result = run_stream_op(&is.op, rank, || body(comm, is.seq, &is.op), on_panic);
                drop(observed);
                completer.complete(result);
            });
            (work, job)
        });
        issued.unwrap_or_else(|e| Work::ready(Err(e)))
    }

    /// Closes the streams of a group being dropped: sets `closing` (each thread then leaves
    /// its communicator), closes every queue, and joins the threads after the work already
    /// queued, except the current thread (a handle dropped on one of its own streams' threads).
    pub(crate) fn close(&mut self) {
        self.closing.store(true, Ordering::Release);
        for stream in self.streams.get_mut().drain(..) {
            if let Some(stream) = stream.upgrade() {
                stream.close();
            }
        }
        let me = std::thread::current().id();
        for handle in self.threads.get_mut().drain(..) {
            if handle.thread().id() != me {
                let _ = handle.join();
            }
        }
    }
}

/// Runs `f` on this process's rank `rank` of a process-per-rank job, given the group its
/// backend connected (wrapped in [`Instrumented`]) or why it could not; returns its result
/// (one element). When `f` fails or panics, the job is aborted with the error's text.
pub(crate) fn run_process_rank<G, T, F>(rank: usize, group: Result<Arc<G>>, f: F) -> Vec<Result<T>>
where
    G: ProcessGroup + ?Sized + 'static,
    F: Fn(Arc<dyn ProcessGroup>) -> Result<T>,
{
    match group {
        Ok(group) => {
            let pg: Arc<dyn ProcessGroup> = Arc::new(Instrumented::new(group));
            vec![run_one(rank, pg, &f)]
        }
        Err(e) => vec![Err(e)],
    }
}
