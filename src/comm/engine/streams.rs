//! The comm streams of the host backends (threads, shared memory, TCP, MPI): one thread per
//! stream that runs its communicator's operations in issue order. Their group
//! ([`super::group::HostGroup`]) numbers an operation, reports it to the observer, turns a panic
//! into an error (aborting the job) and completes its [`crate::comm::Work`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};

use crossbeam::channel::{unbounded, Sender, TryRecvError};
use parking_lot::Mutex;

use crate::comm::work::yield_until;
use crate::comm::CommObserver;
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

/// What [`super::group::HostGroup::issue_job`] hands the maker of an operation's job.
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

pub(crate) struct StreamSlot<C> {
    /// Sequence number of the stream's last operation.
    pub seq: u64,
    /// The queue of the stream's thread; `None` once closed.
    pub tx: Option<Sender<Job<C>>>,
}

/// A host backend's state behind a [`CommStream`]: the group that owns it, its name, the
/// sequence number of its last operation and the queue of its thread.
pub(crate) struct HostStream<C> {
    /// The id of the group that made it.
    pub owner: u64,
    /// The stream's name.
    pub name: Arc<str>,
    /// Its last sequence number and queue.
    pub slot: Mutex<StreamSlot<C>>,
}

impl<C: StreamComm> HostStream<C> {
    /// Starts the thread (named `{backend}-{rank}-{name}`) of a stream of group `owner` on
    /// `comm`; when the thread ends while `closing` is set, it leaves the communicator. When the
    /// thread cannot start, this rank leaves `comm` at once (peers fail instead of waiting).
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
        // Handed to the thread through a slot, so that a thread that cannot start leaves it.
        let handed = Arc::new(Mutex::new(Some(comm)));
        let theirs = Arc::clone(&handed);
        let spawned = thread::Builder::new()
            // A thread's name may not hold a NUL; the stream's may.
            .name(C::thread_name(backend, rank, name).replace('\0', "\\0"))
            .spawn(move || {
                C::on_thread_start();
                let mut comm = theirs.lock().take().expect("handed to this thread");
                drop(theirs);
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
            });
        let handle = spawned.map_err(|error| {
            if let Some(mut comm) = handed.lock().take() {
                comm.leave(rank);
            }
            Error::SpawnFailed {
                what: format!("comm stream {name} of rank {rank}"),
                error,
            }
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
