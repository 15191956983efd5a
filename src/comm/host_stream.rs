//! The comm streams of the process-per-rank host backends (shared memory, TCP): one thread per
//! stream that runs its communicator's operations in issue order, and the `issue` path that
//! numbers an operation, reports it to the observer, turns a panic into an error (aborting the
//! job through the backend's hook) and completes its [`Work`].

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::{self, JoinHandle};

use crossbeam::channel::{unbounded, Sender};
use parking_lot::Mutex;

use super::threads::panic_message;
use super::threads::run_one;
use super::{
    foreign_stream, join_stream_threads, CommObserver, CommStream, Instrumented, OpKind,
    ProcessGroup, Work,
};
use crate::error::{Error, Result};

/// A communicator a stream thread owns.
pub(crate) trait StreamComm: Send + 'static {
    /// Tells the peers that rank `rank` left this communicator (its group is being dropped).
    fn leave(&mut self, rank: usize);
}

type Job<C> = Box<dyn FnOnce(&mut C) + Send>;

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
    pub(crate) fn start(
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
            .name(format!("{backend}-{rank}-{name}"))
            .spawn(move || {
                let mut comm = comm;
                for job in rx.iter() {
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

/// Enqueues `body(comm, seq, op)` as an operation of `kind` on `stream`, which must be a
/// stream of group `owner` (rank `rank`); `on_panic(message)` runs on the stream's thread
/// when the body panics (the backend aborts the job), and the operation then fails with
/// [`Error::RankPanicked`].
pub(crate) fn issue<C, T, F>(
    stream: &CommStream,
    owner: u64,
    rank: usize,
    kind: OpKind,
    observer: Option<Arc<dyn CommObserver>>,
    on_panic: impl FnOnce(&str) + Send + 'static,
    body: F,
) -> Work<T>
where
    C: StreamComm,
    T: Send + 'static,
    F: FnOnce(&mut C, u64, &str) -> Result<T> + Send + 'static,
{
    let Some(hs) = stream
        .backend_state::<HostStream<C>>()
        .filter(|s| s.owner == owner)
    else {
        return Work::ready(Err(foreign_stream(kind, rank, stream)));
    };
    let mut slot = hs.slot.lock();
    slot.seq += 1;
    let seq = slot.seq;
    let op = format!("{} #{seq} (stream {})", kind.name(), hs.name);
    let (work, completer) = Work::pending(op.clone(), rank, &*hs.name);
    let stream_name = Arc::clone(&hs.name);
    let job: Job<C> = Box::new(move |comm| {
        let observed = observer
            .as_ref()
            .and_then(|o| o.op_started(&stream_name, kind, &op));
        let result = match catch_unwind(AssertUnwindSafe(|| body(comm, seq, &op))) {
            Ok(r) => r,
            Err(payload) => {
                let message = format!("{op}: {}", panic_message(payload.as_ref()));
                on_panic(&message);
                Err(Error::RankPanicked { rank, message })
            }
        };
        drop(observed);
        completer.complete(result);
    });
    if let Some(tx) = &slot.tx {
        // A send error means the stream thread is gone: `wait` reports StreamStopped.
        let _ = tx.send(job);
    }
    work
}

/// Closes the streams of a group being dropped: sets `closing` (each thread then leaves its
/// communicator), closes every queue, and joins the threads after the work already queued.
pub(crate) fn close_streams<C: StreamComm>(
    closing: &AtomicBool,
    streams: &mut Vec<Weak<HostStream<C>>>,
    threads: &mut Vec<JoinHandle<()>>,
) {
    closing.store(true, Ordering::Release);
    for stream in streams.drain(..) {
        if let Some(stream) = stream.upgrade() {
            stream.close();
        }
    }
    join_stream_threads(threads);
}

/// Runs `f` on this process's rank `rank` of a process-per-rank job, given the group its
/// backend connected (wrapped in [`Instrumented`]) or why it could not; returns its result
/// (one element). When `f` fails or panics, the job is aborted with the error's text.
pub(crate) fn run_process_rank<G, T, F>(rank: usize, group: Result<Arc<G>>, f: F) -> Vec<Result<T>>
where
    G: ProcessGroup + 'static,
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
