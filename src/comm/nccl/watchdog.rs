//! Failure handling of the NCCL backend: the in-flight operations, their completion (the
//! [`Completion`] of every [`Work`](crate::comm::Work)), and the watchdog thread.
//!
//! A *family* is a root group and every sub-group made from it: they share one failure slot,
//! one list of communicators and one watchdog. The watchdog polls, every
//! [`POLL`] while operations are in flight:
//!
//! - each operation's completion event (`cuEventQuery`): completed operations leave the list;
//!   one still pending past its deadline (issue time + the group timeout) fails the family
//!   with a timeout naming it;
//! - every [`ASYNC_POLL`], each communicator's asynchronous error (`ncclCommGetAsyncError`:
//!   e.g. a peer's connection closed).
//!
//! A failure — a timeout, an NCCL or CUDA error, [`ProcessGroup::abort`]
//! (crate::comm::ProcessGroup::abort) on this rank, or a peer's failure notice (the store
//! bootstrap's inbox) — is recorded once: every operation still pending is marked failed
//! *before* the communicators are aborted (an aborted operation's event completes with
//! garbage in its buffers, so the mark must be visible first), then `ncclCommAbort` runs on
//! every communicator of the family, then the failure is published to the peers (when it
//! arose here). Every pending and later collective fails with an error naming its operation:
//! [`Error::Timeout`] for the operation that timed out, [`Error::PeerFailed`] after an abort
//! (naming the failed rank, as the thread backend does), [`Error::Nccl`] otherwise.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::thread;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaStream};
use parking_lot::{Condvar, Mutex};

use super::raw::{abort_all, RawComm};
use crate::comm::bootstrap;
use crate::comm::engine::cuda::{cuda_err, KeepAlive};
use crate::comm::engine::peer_failed;
use crate::comm::store::TcpStore;
use crate::comm::work::Completion;
use crate::error::{Error, Result};

/// How often the watchdog polls the in-flight operations' events.
pub(super) const POLL: Duration = Duration::from_millis(2);
/// How often it polls the communicators' asynchronous errors.
pub(super) const ASYNC_POLL: Duration = Duration::from_millis(100);
/// How long it sleeps when nothing is in flight (it is woken by new operations).
const IDLE: Duration = Duration::from_millis(200);

static NEXT_OP_ID: AtomicU64 = AtomicU64::new(1);

/// The first failure of a family.
#[derive(Debug, Clone)]
pub(super) enum Failure {
    /// Operation `op` (id `op_id`) did not complete within `timeout`.
    Timeout {
        op_id: u64,
        op: String,
        timeout: Duration,
    },
    /// An NCCL call or the communicators' asynchronous error.
    Nccl { call: String, message: String },
    /// A rank (rank in the root group) failed: this one through `abort`, or a peer.
    Rank { failed_rank: usize, reason: String },
    /// A CUDA error while polling or enqueuing.
    Cuda { message: String },
}

impl Failure {
    /// The error of operation `op` (id `op_id`, 0 at issue) on `rank` after this failure.
    pub(super) fn error_for(&self, op_id: u64, op: &str, rank: usize) -> Error {
        match self {
            Failure::Timeout {
                op_id: id,
                op: _,
                timeout,
            } if *id == op_id => Error::Timeout {
                op: op.to_string(),
                rank,
                timeout: *timeout,
                // NCCL does not say which ranks are missing.
                missing: Vec::new(),
            },
            Failure::Timeout {
                op: timed_out,
                timeout,
                ..
            } => Error::Nccl {
                call: op.to_string(),
                rank,
                message: format!(
                    "aborted by the watchdog: {timed_out} did not complete within {timeout:?}, \
                     so every communicator of the group was aborted"
                ),
            },
            Failure::Nccl { call, message } => Error::Nccl {
                call: op.to_string(),
                rank,
                message: format!("aborted: {call} failed: {message}"),
            },
            Failure::Rank {
                failed_rank,
                reason,
            } => peer_failed(op, rank, (*failed_rank, reason.clone())),
            Failure::Cuda { message } => Error::Cuda(format!("{op} on rank {rank}: {message}")),
        }
    }

    /// What the peers are told.
    pub(super) fn reason(&self) -> String {
        match self {
            Failure::Timeout { op, timeout, .. } => {
                format!("{op} timed out after {timeout:?} (NCCL watchdog)")
            }
            Failure::Nccl { call, message } => format!("{call} failed: {message}"),
            Failure::Rank { reason, .. } => reason.clone(),
            Failure::Cuda { message } => format!("CUDA error: {message}"),
        }
    }
}

/// State shared by the groups of a family and its watchdog.
#[derive(Default)]
pub(super) struct Family {
    /// This process's rank in the root group.
    pub world_rank: usize,
    pub timeout: Duration,
    /// The first failure.
    failure: OnceLock<Failure>,
    comms: Mutex<Vec<Weak<RawComm>>>,
    inflight: Mutex<Vec<Arc<NcclOp>>>,
    wake: Condvar,
    /// Group handles alive; the watchdog stops once none is left and nothing is in flight.
    live_groups: AtomicUsize,
    /// The job's store (store bootstrap): this rank's failures are published there, and its
    /// inbox is closed when the last group handle is dropped (stopping its notice watcher).
    pub store: OnceLock<Arc<TcpStore>>,
    /// The watchdog thread was started (by the first group handle).
    started: AtomicBool,
}

impl Family {
    /// A new family; its watchdog starts with its first group handle
    /// ([`Family::group_opened`]).
    pub(super) fn new(world_rank: usize, timeout: Duration) -> Arc<Family> {
        Arc::new(Family {
            world_rank,
            timeout,
            ..Family::default()
        })
    }

    /// A group handle of the family was created; the first one starts the watchdog thread
    /// (named `nccl-watchdog-{world_rank}`).
    ///
    /// Errors: the thread cannot be started ([`Error::SpawnFailed`]; the handle is then not
    /// counted).
    pub(super) fn group_opened(self: &Arc<Self>) -> Result<()> {
        self.live_groups.fetch_add(1, Ordering::AcqRel);
        if self.started.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let family = Arc::clone(self);
        let spawned = thread::Builder::new()
            .name(format!("nccl-watchdog-{}", self.world_rank))
            .spawn(move || watchdog(family));
        if let Err(error) = spawned {
            self.started.store(false, Ordering::Release);
            self.live_groups.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::SpawnFailed {
                what: format!("the NCCL watchdog of rank {}", self.world_rank),
                error,
            });
        }
        Ok(())
    }

    /// A group handle was dropped; the last one closes the family's peer channel and lets
    /// the watchdog stop once the operations in flight are done.
    pub(super) fn group_closed(&self) {
        if self.live_groups.fetch_sub(1, Ordering::AcqRel) == 1 {
            if let Some(store) = self.store.get() {
                if let Err(e) = bootstrap::close_inbox(&**store) {
                    tracing::debug!("closing this rank's inbox: {e}");
                }
            }
            let _guard = self.inflight.lock();
            self.wake.notify_all();
        }
    }

    fn closing(&self) -> bool {
        self.live_groups.load(Ordering::Acquire) == 0
    }

    /// Registers a communicator: the watchdog polls its asynchronous errors and a failure
    /// aborts it.
    pub(super) fn register(&self, comm: &Arc<RawComm>) {
        let mut comms = self.comms.lock();
        comms.retain(|c| c.strong_count() > 0);
        comms.push(Arc::downgrade(comm));
        if self.failure.get().is_some() {
            comm.abort();
        }
    }

    /// The family's failure, if any.
    pub(super) fn failure(&self) -> Option<Failure> {
        self.failure.get().cloned()
    }

    /// Watches `op` until it completes.
    pub(super) fn track(&self, op: Arc<NcclOp>) {
        let mut inflight = self.inflight.lock();
        if let Some(f) = self.failure() {
            // Failed between the issue-time check and now: the communicators are aborted.
            op.mark_failed(f);
        }
        inflight.push(op);
        self.wake.notify_all();
    }

    /// Records `failure` (the first one wins): marks every pending operation failed, aborts
    /// every communicator, and publishes the failure to the peers when `publish`.
    pub(super) fn fail(&self, failure: Failure, publish: bool) {
        if self.failure.set(failure.clone()).is_err() {
            return;
        }
        tracing::error!(
            rank = self.world_rank,
            "NCCL process group failed: {}; aborting its communicators",
            failure.reason()
        );
        // Mark first: an aborted operation's event completes, with garbage in its buffers.
        for op in self.inflight.lock().iter() {
            if !op.event.is_complete() {
                op.mark_failed(failure.clone());
            }
        }
        let comms: Vec<Arc<RawComm>> = self.comms.lock().iter().filter_map(Weak::upgrade).collect();
        abort_all(&comms);
        if let Some(store) = self.store.get().filter(|_| publish) {
            let rank = self.world_rank;
            if let Err(e) = bootstrap::publish_failure(&**store, rank, &failure.reason()) {
                tracing::warn!("rank {rank}: could not tell the peers it failed: {e}");
            }
        }
        let _guard = self.inflight.lock();
        self.wake.notify_all();
    }
}

/// The watchdog loop (see the module docs); idles while nothing is in flight (woken by new
/// operations), failed or not, and ends once no group handle is left and nothing is in flight.
fn watchdog(family: Arc<Family>) {
    let mut last_async = Instant::now();
    loop {
        let ops: Vec<Arc<NcclOp>> = {
            let mut inflight = family.inflight.lock();
            if inflight.is_empty() {
                if family.closing() {
                    return;
                }
                family.wake.wait_for(&mut inflight, IDLE);
            }
            inflight.clone()
        };
        let now = Instant::now();
        let mut finished: Vec<u64> = Vec::new();
        for op in &ops {
            match op.event.try_is_complete() {
                Ok(true) => finished.push(op.id),
                Ok(false) if op.deadline.is_some_and(|d| now >= d) => family.fail(
                    Failure::Timeout {
                        op_id: op.id,
                        op: op.op.clone(),
                        timeout: family.timeout,
                    },
                    true,
                ),
                Ok(false) => {}
                Err(e) => family.fail(
                    Failure::Cuda {
                        message: format!("querying the completion of {}: {e:?}", op.op),
                    },
                    true,
                ),
            }
        }
        if now.duration_since(last_async) >= ASYNC_POLL {
            last_async = now;
            let comms: Vec<Arc<RawComm>> = family
                .comms
                .lock()
                .iter()
                .filter_map(Weak::upgrade)
                .collect();
            for comm in comms {
                if comm.is_aborted() {
                    continue;
                }
                if let Some(message) = comm.async_error() {
                    family.fail(
                        Failure::Nccl {
                            call: "ncclCommGetAsyncError".to_string(),
                            message,
                        },
                        true,
                    );
                }
            }
        }
        {
            let failed = family.failure.get().is_some();
            let mut inflight = family.inflight.lock();
            // Failed operations leave the list too: their buffers are released only after the
            // compute stream waited on their events (`KeepAlive`), whoever drops them.
            inflight.retain(|op| !finished.contains(&op.id) && !failed);
        }
        if !ops.is_empty() {
            thread::sleep(POLL);
        }
    }
}

/// One in-flight NCCL operation: its completion event, deadline and buffers; the
/// [`Completion`] of its [`Work`](crate::comm::Work).
pub(super) struct NcclOp {
    id: u64,
    /// Name, e.g. `all_gather #12 (stream all_gather)`.
    pub op: String,
    /// This rank in the operation's group.
    pub rank: usize,
    /// Recorded on the comm stream right after the NCCL call.
    pub event: Arc<CudaEvent>,
    /// The compute stream `wait_compute` orders.
    compute: Arc<CudaStream>,
    /// Issue time + the timeout (`None`: a timeout too large for the clock, never).
    deadline: Option<Instant>,
    failure: OnceLock<Failure>,
    /// The buffers, released after the compute stream waited on `event`.
    _keep: KeepAlive,
    /// Keeps the communicator alive (not aborted by a drop) while the operation runs.
    _comm: Arc<RawComm>,
}

impl NcclOp {
    /// An operation named `op` of `rank`, complete once `event` completes; `keep` holds its
    /// buffers, `comm` its communicator.
    pub(super) fn new(
        op: String,
        rank: usize,
        event: Arc<CudaEvent>,
        compute: Arc<CudaStream>,
        timeout: Duration,
        keep: KeepAlive,
        comm: Arc<RawComm>,
    ) -> Arc<NcclOp> {
        Arc::new(NcclOp {
            id: NEXT_OP_ID.fetch_add(1, Ordering::Relaxed),
            op,
            rank,
            event,
            compute,
            deadline: Instant::now().checked_add(timeout),
            failure: OnceLock::new(),
            _keep: keep,
            _comm: comm,
        })
    }

    fn mark_failed(&self, failure: Failure) {
        let _ = self.failure.set(failure);
    }

    fn failed(&self) -> Option<Error> {
        (self.failure.get()).map(|f| f.error_for(self.id, &self.op, self.rank))
    }
}

impl Completion for NcclOp {
    fn is_completed(&self) -> bool {
        self.failure.get().is_some() || self.event.is_complete()
    }

    /// Polls the event (never `cuEventSynchronize`, which a hung peer would block forever):
    /// spins briefly, then sleeps with a growing pause up to 1 ms. A failure marked by the
    /// watchdog wins over a completed event (an aborted operation's event completes too).
    fn wait_host(&self) -> Result<()> {
        let mut pause = Duration::from_micros(5);
        let mut spins = 0u32;
        loop {
            if let Some(e) = self.failed() {
                return Err(e);
            }
            match self.event.try_is_complete() {
                Ok(true) => {
                    return match self.failed() {
                        Some(e) => Err(e),
                        None => Ok(()),
                    }
                }
                Ok(false) => {}
                Err(e) => {
                    return Err(cuda_err(
                        format!("{} on rank {}: querying its completion", self.op, self.rank),
                        e,
                    ))
                }
            }
            if spins < 64 {
                spins += 1;
                std::hint::spin_loop();
            } else {
                thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(1));
            }
        }
    }

    /// The compute stream waits for the event (`cuStreamWaitEvent`); the host does not block.
    /// A failure known now is returned; one detected later fails the next collective, or the
    /// next host wait.
    fn wait_compute(&self) -> Result<()> {
        if let Some(e) = self.failed() {
            return Err(e);
        }
        self.compute.wait(&self.event).map_err(|e| {
            cuda_err(
                format!("{} on rank {}: compute stream wait", self.op, self.rank),
                e,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_name_every_operation_they_fail() {
        let timeout = Duration::from_millis(300);
        let t = Failure::Timeout {
            op_id: 7,
            op: "all_gather #12 (stream all_gather)".into(),
            timeout,
        };
        assert_eq!(
            t.error_for(7, "all_gather #12 (stream all_gather)", 1)
                .to_string(),
            "all_gather #12 (stream all_gather) on rank 1 timed out after 300ms waiting for \
             ranks []"
        );
        assert_eq!(
            t.error_for(8, "reduce_scatter #3 (stream reduce_scatter)", 1)
                .to_string(),
            "reduce_scatter #3 (stream reduce_scatter) on rank 1 failed: aborted by the \
             watchdog: all_gather #12 (stream all_gather) did not complete within 300ms, so \
             every communicator of the group was aborted"
        );
        assert_eq!(
            t.reason(),
            "all_gather #12 (stream all_gather) timed out after 300ms (NCCL watchdog)"
        );
        let peer = Failure::Rank {
            failed_rank: 3,
            reason: "unit fc2: NaN".into(),
        };
        assert!(matches!(
            peer.error_for(0, "barrier #1 (stream collective)", 0),
            Error::PeerFailed { failed_rank: 3, .. }
        ));
        let nccl = Failure::Nccl {
            call: "ncclCommGetAsyncError".into(),
            message: "remote process exited or there was a network error".into(),
        };
        assert_eq!(
            nccl.error_for(0, "all_reduce #2 (stream collective)", 0)
                .to_string(),
            "all_reduce #2 (stream collective) on rank 0 failed: aborted: ncclCommGetAsyncError \
             failed: remote process exited or there was a network error"
        );
    }
}
