//! Completion of asynchronous collectives: [`Work`] handles and the [`Completion`] trait.
//!
//! A host backend (threads, MPI) completes a [`Work`] through its [`WorkCompleter`] when the
//! operation finished on the comm stream, delivering the result (the filled buffer or the error).
//! A device backend (NCCL) knows the output at issue and signals completion with a device event:
//! it builds the `Work` with [`Work::with_completion`] and implements [`Completion`], whose
//! [`Completion::wait_compute`] makes the compute stream wait for the event without blocking the
//! host (`cudaStreamWaitEvent`), while [`Completion::wait_host`] blocks the host
//! (`cudaEventSynchronize`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};

/// How a device backend reports that an operation finished.
pub trait Completion: Send + Sync {
    /// True once the operation finished (successfully or not); never blocks.
    fn is_completed(&self) -> bool;
    /// Blocks the calling host thread until the operation finished.
    ///
    /// Errors: the operation's failure.
    fn wait_host(&self) -> Result<()>;
    /// Makes later work on the compute stream wait for the operation, without blocking the host
    /// where the device allows it. The default blocks the host ([`Completion::wait_host`]), which
    /// is what a CPU backend needs: its compute "stream" is the calling thread.
    ///
    /// Errors: the operation's failure (when known at this point).
    fn wait_compute(&self) -> Result<()> {
        self.wait_host()
    }
}

/// State shared by a host-completed [`Work`] and its [`WorkCompleter`].
struct Slot<T> {
    result: Mutex<Option<Result<T>>>,
    cv: Condvar,
    done: AtomicBool,
}

enum Inner<T> {
    /// Completed at creation.
    Ready(Result<T>),
    /// Completed by a [`WorkCompleter`].
    Host(Arc<Slot<T>>),
    /// Output known at issue, completion signalled by the device.
    Device {
        value: T,
        completion: Arc<dyn Completion>,
    },
}

/// Handle on an asynchronous collective; `wait` returns its result (the output buffer).
///
/// Dropping a `Work` without waiting is allowed: the operation still runs to completion on its
/// stream (it must, since the other ranks take part in it).
pub struct Work<T> {
    inner: Inner<T>,
}

/// The completing side of a host-completed [`Work`], held by the stream that executes the
/// operation.
///
/// If it is dropped without [`WorkCompleter::complete`] (the stream stopped), the waiter gets
/// [`Error::StreamStopped`] instead of hanging.
pub struct WorkCompleter<T> {
    slot: Option<Arc<Slot<T>>>,
    op: String,
    rank: usize,
    stream: String,
}

impl<T> Work<T> {
    /// A pending operation and the completer that finishes it; `op`, `rank` and `stream` name it
    /// in the error of a completer dropped unused.
    pub fn pending(
        op: impl Into<String>,
        rank: usize,
        stream: impl Into<String>,
    ) -> (Work<T>, WorkCompleter<T>) {
        let slot = Arc::new(Slot {
            result: Mutex::new(None),
            cv: Condvar::new(),
            done: AtomicBool::new(false),
        });
        (
            Work {
                inner: Inner::Host(slot.clone()),
            },
            WorkCompleter {
                slot: Some(slot),
                op: op.into(),
                rank,
                stream: stream.into(),
            },
        )
    }

    /// An already completed operation.
    pub fn ready(result: Result<T>) -> Self {
        Work {
            inner: Inner::Ready(result),
        }
    }

    /// An operation whose result `value` is known at issue and becomes valid once `completion`
    /// reports the operation finished (device backends).
    pub fn with_completion(value: T, completion: Arc<dyn Completion>) -> Self {
        Work {
            inner: Inner::Device { value, completion },
        }
    }

    /// True once the operation finished (successfully or not); never blocks.
    pub fn is_completed(&self) -> bool {
        match &self.inner {
            Inner::Ready(_) => true,
            Inner::Host(slot) => slot.done.load(Ordering::Acquire),
            Inner::Device { completion, .. } => completion.is_completed(),
        }
    }

    /// Blocks the host until the operation finished and returns its result.
    ///
    /// Errors: whatever the collective reported ([`Error::PeerFailed`], [`Error::Timeout`],
    /// [`Error::StreamStopped`], …).
    pub fn wait(self) -> Result<T> {
        match self.inner {
            Inner::Ready(r) => r,
            Inner::Host(slot) => {
                yield_until(|| slot.done.load(Ordering::Acquire));
                let mut guard = slot.result.lock();
                loop {
                    if let Some(r) = guard.take() {
                        return r;
                    }
                    slot.cv.wait(&mut guard);
                }
            }
            Inner::Device { value, completion } => completion.wait_host().map(|()| value),
        }
    }

    /// Returns the result once work queued afterwards on the compute stream is ordered after the
    /// operation: on a device backend without blocking the host ([`Completion::wait_compute`]);
    /// on a host backend this is [`Work::wait`].
    ///
    /// Errors: as [`Work::wait`] (a device backend may report some failures only later).
    pub fn wait_compute(self) -> Result<T> {
        match self.inner {
            Inner::Device { value, completion } => completion.wait_compute().map(|()| value),
            inner => Work { inner }.wait(),
        }
    }
}

impl<T> WorkCompleter<T> {
    /// Publishes the result and wakes the waiter.
    pub fn complete(mut self, result: Result<T>) {
        if let Some(slot) = self.slot.take() {
            publish(&slot, result);
        }
    }
}

/// How long a waiter keeps yielding its core before it sleeps on a condition variable.
///
/// A collective of the thread backend hands its operation to the comm stream's thread and its
/// completion back; each sleeping waiter costs a futex wake-up and a reschedule (tens of
/// microseconds on a 2-core VM), which is most of a small collective's time (the MNIST MLP's
/// step waited 45 % of its time on them). Yielding instead lets the thread that will complete
/// the operation run at once on the same core, and sees the completion as soon as it happens;
/// past this bound (a long collective) the waiter sleeps as before, so no core spins for long.
/// An idle comm stream thread waits for its next operation the same way
/// (`comm::engine::streams`).
pub(crate) const YIELD_BEFORE_SLEEP: std::time::Duration = std::time::Duration::from_micros(200);

/// Yields the core (`sched_yield`) until `ready()` holds or [`YIELD_BEFORE_SLEEP`] passed;
/// returns whether `ready()` held.
pub(crate) fn yield_until(ready: impl Fn() -> bool) -> bool {
    let start = std::time::Instant::now();
    loop {
        if ready() {
            return true;
        }
        if start.elapsed() >= YIELD_BEFORE_SLEEP {
            return false;
        }
        std::thread::yield_now();
    }
}

fn publish<T>(slot: &Slot<T>, result: Result<T>) {
    *slot.result.lock() = Some(result);
    slot.done.store(true, Ordering::Release);
    slot.cv.notify_all();
}

impl<T> Drop for WorkCompleter<T> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            publish(
                &slot,
                Err(Error::StreamStopped {
                    op: std::mem::take(&mut self.op),
                    rank: self.rank,
                    stream: std::mem::take(&mut self.stream),
                }),
            );
        }
    }
}
