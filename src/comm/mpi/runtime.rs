//! The process-wide MPI state: initialisation (once, `MPI_THREAD_MULTIPLE`), error codes, the
//! failure channel between ranks, polling waits with a deadline, and finalisation at exit.
//!
//! # Failures
//!
//! MPI's default on an error is to abort the job, and a collective whose peer never arrives
//! waits forever. Here:
//! - every communicator returns error codes (`MPI_ERRORS_RETURN`), turned into [`Error::Mpi`];
//! - every wait polls (`MPI_Testall`) with a deadline, so nothing blocks inside MPI;
//! - a rank that fails ([`Runtime::abort`]) sends its reason to every other rank on a control
//!   communicator of its own. Every poll also tests the one receive each rank keeps posted there;
//!   once a failure arrived, pending and later collectives fail with [`Error::PeerFailed`]
//!   naming the failed rank (its `MPI_COMM_WORLD` rank) and its reason;
//! - a wait that gives up (failure or timeout) leaves its requests pending, nothing cancelled
//!   (see [`Runtime::poison`]), and its buffers allocated for the rest of the process (a late
//!   message must never land in freed memory); the runtime is then *poisoned*: `MPI_Finalize` is skipped at exit (it could wait for the
//!   abandoned operations), the process is expected to exit non-zero, and `mpirun` tears down
//!   whatever is left of the job.

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant};

use mpi::ffi;
use parking_lot::Mutex;

use crate::comm::bootstrap::cut_reason;
use crate::comm::engine::peer_failed;
pub(super) use crate::comm::engine::run::deadline_after;
use crate::error::{Error, Result};

/// An MPI communicator handle (an opaque pointer in OpenMPI) that may cross threads: MPI is
/// initialised with `MPI_THREAD_MULTIPLE`, so any thread may use it.
#[derive(Clone, Copy)]
pub(super) struct Comm(pub ffi::MPI_Comm);

// SAFETY: with MPI_THREAD_MULTIPLE (checked at initialisation) a communicator may be used from
// any thread; the handle itself is a plain pointer that we never dereference.
unsafe impl Send for Comm {}
// SAFETY: as above.
unsafe impl Sync for Comm {}

/// Tag of failure notices on the control communicator.
const TAG_ABORT: c_int = 77;
/// Largest failure notice (bytes); longer reasons are cut.
const ABORT_MSG_MAX: usize = 4096;
/// How long [`Runtime::abort`] keeps pushing its notices out before returning.
const ABORT_SEND_GRACE: Duration = Duration::from_secs(2);

/// The failure channel: one receive always posted, and the notices this rank sent.
struct Control {
    comm: Comm,
    recv: ffi::MPI_Request,
    recv_buf: Box<[u8; ABORT_MSG_MAX]>,
    /// Notices in flight (request, buffer); their buffers live until the process ends.
    sends: Vec<(ffi::MPI_Request, Box<[u8]>)>,
}

// SAFETY: the request handles are plain pointers we never dereference, used under the
// runtime's mutex only; with MPI_THREAD_MULTIPLE (checked at initialisation) any thread may
// complete them.
unsafe impl Send for Control {}

impl Control {
    /// Posts the receive of the next notice into `recv_buf`.
    ///
    /// # Safety
    ///
    /// The request slot is free (no receive in flight), and this `Control` lives until the
    /// process ends (the runtime's, kept in its static, is never dropped).
    unsafe fn post_recv(&mut self) -> c_int {
        // SAFETY: the boxed buffer does not move with `self`, which lives on (the contract).
        unsafe {
            ffi::MPI_Irecv(
                self.recv_buf.as_mut_ptr().cast(),
                ABORT_MSG_MAX as c_int,
                ffi::RSMPI_UINT8_T,
                ffi::RSMPI_ANY_SOURCE,
                TAG_ABORT,
                self.comm.0,
                &mut self.recv,
            )
        }
    }
}

/// The MPI state of this process; see the [module docs](self).
pub(crate) struct Runtime {
    /// Rank in `MPI_COMM_WORLD`.
    pub world_rank: usize,
    /// Size of `MPI_COMM_WORLD`.
    pub world_size: usize,
    /// A duplicate of `MPI_COMM_WORLD` (errors return) from which groups are made.
    pub world: Comm,
    control: Mutex<Control>,
    /// First failure known to this process: (world rank, reason).
    failure: OnceLock<(usize, String)>,
    /// Ranks (world) known to have failed: they sent a notice, or this rank sent its own.
    notified: Mutex<Vec<bool>>,
    /// Some wait gave up on pending operations: `MPI_Finalize` must not run.
    poisoned: AtomicBool,
    finalized: AtomicBool,
    /// Jobs (`comm::mpi::run`) running now.
    runs_active: AtomicUsize,
    /// Some job completed successfully on this rank.
    run_ok: AtomicBool,
}

static RUNTIME: OnceLock<std::result::Result<Runtime, String>> = OnceLock::new();

/// Turns an MPI return code into a result, naming `call`.
pub(crate) fn check(rc: c_int, call: impl FnOnce() -> String, rank: usize) -> Result<()> {
    if rc == ffi::MPI_SUCCESS as c_int {
        return Ok(());
    }
    Err(Error::Mpi {
        call: call(),
        rank,
        code: rc,
        message: error_string(rc),
    })
}

/// Whether `req` (one of ours) completed (`MPI_Test`; a completed request is null, and tests
/// complete again).
fn test(req: &mut ffi::MPI_Request) -> bool {
    let mut flag: c_int = 0;
    // SAFETY: our own request, posted on a buffer its owner keeps alive.
    unsafe { ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
    flag != 0
}

/// `MPI_Error_string` of `code`.
fn error_string(code: c_int) -> String {
    let mut buf = vec![0u8; 1024];
    let mut len: c_int = 0;
    // SAFETY: MPI_MAX_ERROR_STRING is 256 in OpenMPI and MPICH; the buffer is larger.
    let rc = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr().cast(), &mut len) };
    if rc != ffi::MPI_SUCCESS as c_int {
        return format!("unknown MPI error {code}");
    }
    buf.truncate(len.max(0) as usize);
    String::from_utf8_lossy(&buf).into_owned()
}

/// The process's MPI runtime, initialising MPI on first use.
///
/// Errors ([`Error::InvalidArgument`] with the reason): MPI could not be initialised, or the
/// library provides less than `MPI_THREAD_MULTIPLE` (comm streams call MPI from several threads).
pub(crate) fn runtime() -> Result<&'static Runtime> {
    match RUNTIME.get_or_init(init) {
        Ok(rt) => Ok(rt),
        Err(e) => Err(Error::InvalidArgument(e.clone())),
    }
}

/// Name of an MPI thread level.
fn level_name(level: c_int) -> &'static str {
    // SAFETY: reading link-time constants of the MPI library.
    let levels = unsafe {
        [
            (ffi::RSMPI_THREAD_SINGLE, "MPI_THREAD_SINGLE"),
            (ffi::RSMPI_THREAD_FUNNELED, "MPI_THREAD_FUNNELED"),
            (ffi::RSMPI_THREAD_SERIALIZED, "MPI_THREAD_SERIALIZED"),
            (ffi::RSMPI_THREAD_MULTIPLE, "MPI_THREAD_MULTIPLE"),
        ]
    };
    let named = levels.into_iter().find(|&(l, _)| l == level);
    named.map_or("an unknown thread level", |(_, name)| name)
}

fn init() -> std::result::Result<Runtime, String> {
    // SAFETY: plain MPI calls with valid out-pointers; MPI_Init_thread runs at most once per
    // process (the OnceLock), and not at all when the program initialised MPI itself.
    unsafe {
        let mut initialized: c_int = 0;
        ffi::MPI_Initialized(&mut initialized);
        let mut provided: c_int = 0;
        if initialized == 0 {
            let rc = ffi::MPI_Init_thread(
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                ffi::RSMPI_THREAD_MULTIPLE,
                &mut provided,
            );
            if rc != ffi::MPI_SUCCESS as c_int {
                return Err(format!(
                    "MPI_Init_thread failed: MPI error {rc}: {}",
                    error_string(rc)
                ));
            }
        } else {
            ffi::MPI_Query_thread(&mut provided);
        }
        if provided < ffi::RSMPI_THREAD_MULTIPLE {
            return Err(format!(
                "the MPI library provides {} but candle-fsdp needs MPI_THREAD_MULTIPLE (its comm \
                 streams call MPI from several threads); use an MPI built with thread support \
                 (OpenMPI: `ompi_info | grep MPI_THREAD_MULTIPLE` must say yes)",
                level_name(provided)
            ));
        }
        let world = ffi::RSMPI_COMM_WORLD;
        ffi::MPI_Comm_set_errhandler(world, ffi::RSMPI_ERRORS_RETURN);
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        ffi::MPI_Comm_rank(world, &mut rank);
        ffi::MPI_Comm_size(world, &mut size);
        let rank_u = rank as usize;
        let dup = |what: &str| -> std::result::Result<Comm, String> {
            let mut c: ffi::MPI_Comm = std::mem::zeroed();
            let rc = ffi::MPI_Comm_dup(world, &mut c);
            check(rc, || format!("MPI_Comm_dup ({what})"), rank_u).map_err(|e| e.to_string())?;
            ffi::MPI_Comm_set_errhandler(c, ffi::RSMPI_ERRORS_RETURN);
            Ok(Comm(c))
        };
        let base = dup("base communicator")?;
        let mut control = Control {
            comm: dup("failure channel")?,
            recv: ffi::RSMPI_REQUEST_NULL,
            recv_buf: Box::new([0u8; ABORT_MSG_MAX]),
            sends: Vec::new(),
        };
        check(
            // (In this `unsafe` block: the slot is fresh; `control` goes into the runtime,
            // whose static keeps it for the process, nothing failing between here and there.)
            control.post_recv(),
            || "MPI_Irecv (failure channel)".into(),
            rank_u,
        )
        .map_err(|e| e.to_string())?;
        libc::atexit(finalize_at_exit);
        Ok(Runtime {
            world_rank: rank_u,
            world_size: size as usize,
            world: base,
            control: Mutex::new(control),
            failure: OnceLock::new(),
            notified: Mutex::new(vec![false; size as usize]),
            poisoned: AtomicBool::new(false),
            finalized: AtomicBool::new(false),
            runs_active: AtomicUsize::new(0),
            run_ok: AtomicBool::new(false),
        })
    }
}

/// At process exit: finalises MPI when this rank's part of the job ended well (a job completed
/// and none is running, nothing was abandoned). Otherwise the process is ending in the middle of
/// the job (an error before, between or inside `run`, with peers possibly waiting in a
/// collective for it, where `MPI_Finalize` would wait for them forever): it reports its end to
/// every rank as a failure, lingers for their reports, and skips `MPI_Finalize`, so that
/// `mpirun` sees it exit without finalising and ends the job.
extern "C" fn finalize_at_exit() {
    let Some(Ok(rt)) = RUNTIME.get() else {
        return;
    };
    let clean = !rt.is_poisoned()
        && rt.runs_active.load(Ordering::Acquire) == 0
        && rt.run_ok.load(Ordering::Acquire);
    if clean {
        rt.finalize();
        return;
    }
    if !rt.is_poisoned() {
        // Not reported yet (a failed job was reported, and waited for, by `run`).
        rt.abort(&format!(
            "the process of rank {} exited before its part of the job completed (an error \
             outside the collectives; see that rank's output)",
            rt.world_rank
        ));
        rt.linger(EXIT_LINGER, &[]);
    }
}

/// How long a process ending in the middle of a job waits for the other ranks' reports.
const EXIT_LINGER: Duration = Duration::from_secs(10);

impl Runtime {
    /// Calls `MPI_Finalize` once (skipped when poisoned): cancels the failure channel's receive
    /// and waits for the notices this rank sent.
    pub(crate) fn finalize(&self) {
        if self.poisoned.load(Ordering::Acquire) || self.finalized.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut control = self.control.lock();
        let received = test(&mut control.recv);
        // SAFETY: the requests are ours, posted on live buffers (owned by `control`).
        unsafe {
            if !received {
                ffi::MPI_Cancel(&mut control.recv);
                ffi::MPI_Wait(&mut control.recv, ffi::RSMPI_STATUS_IGNORE);
            }
            for (req, _) in control.sends.iter_mut() {
                ffi::MPI_Wait(req, ffi::RSMPI_STATUS_IGNORE);
            }
            ffi::MPI_Finalize();
        }
    }

    /// The first failure known to this process, (world rank, reason).
    pub(crate) fn failure(&self) -> Option<(usize, String)> {
        self.failure.get().cloned()
    }

    /// A job (`comm::mpi::run`) starts on this rank.
    pub(crate) fn run_started(&self) {
        self.runs_active.fetch_add(1, Ordering::AcqRel);
    }

    /// The job started last ended, successfully or not.
    pub(crate) fn run_ended(&self, ok: bool) {
        if ok {
            self.run_ok.store(true, Ordering::Release);
        }
        self.runs_active.fetch_sub(1, Ordering::AcqRel);
    }

    /// Marks pending operations as abandoned: `MPI_Finalize` will not run. A wait that gives
    /// up leaves its requests pending: nothing is cancelled (`MPI_Cancel` is erroneous on
    /// collective requests, `MPI_Comm_idup`, and was seen to deadlock inside OpenMPI); the
    /// caller keeps the buffers, and the process is expected to end.
    pub(crate) fn poison(&self) {
        self.poisoned.store(true, Ordering::Release);
    }

    /// True once some wait abandoned operations.
    pub(crate) fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }

    /// Tests the failure channel (non-blocking; skipped if another thread is at it): records
    /// every notice that arrived and posts the receive again.
    pub(crate) fn poll_failures(&self) {
        let Some(mut control) = self.control.try_lock() else {
            return;
        };
        loop {
            // A receive that could not be posted again leaves the slot null, which `MPI_Test`
            // reports as complete with an empty status (a "failure" of rank 0): the channel is
            // then closed.
            // SAFETY: reading the MPI library's constant.
            if control.recv == unsafe { ffi::RSMPI_REQUEST_NULL } {
                return;
            }
            let mut flag: c_int = 0;
            // SAFETY: MPI_Status is plain data; the request is ours, posted on `recv_buf`.
            let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
            let rc = unsafe { ffi::MPI_Test(&mut control.recv, &mut flag, &mut status) };
            if rc != ffi::MPI_SUCCESS as c_int || flag == 0 {
                return;
            }
            let mut count: c_int = 0;
            // SAFETY: `status` was filled by the completed receive.
            unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut count) };
            let len = (count.max(0) as usize).min(ABORT_MSG_MAX);
            let reason = String::from_utf8_lossy(&control.recv_buf[..len]).into_owned();
            let source = status.MPI_SOURCE.max(0) as usize;
            if let Some(n) = self.notified.lock().get_mut(source) {
                *n = true;
            }
            let _ = self.failure.set((source, reason));
            // SAFETY: the slot is free (the previous receive completed); the runtime's
            // `Control` lives in its static.
            let rc = unsafe { control.post_recv() };
            if rc != ffi::MPI_SUCCESS as c_int {
                return;
            }
        }
    }

    /// Waits (polling, at most `limit`) until every other rank of the job but `hung` (world
    /// ranks presumed stuck, which will never report) has reported its own failure, so that a
    /// failed job ends together: each rank gets to report its error before the first one exits
    /// and `mpirun` tears the job down.
    pub(crate) fn linger(&self, limit: Duration, hung: &[usize]) {
        let deadline = deadline_after(limit);
        while Instant::now() < deadline {
            self.poll_failures();
            let notified = self.notified.lock();
            if notified
                .iter()
                .enumerate()
                .all(|(r, &n)| n || hung.contains(&r))
            {
                return;
            }
            drop(notified);
            thread::sleep(Duration::from_millis(1));
        }
    }

    /// Reports this rank's failure to every rank of the job: records it locally, then sends
    /// `reason` on the failure channel to every other rank and keeps pushing the notices out for
    /// up to two seconds. Only the first call sends; it also poisons the runtime (the job
    /// failed: `MPI_Finalize` is skipped).
    pub(crate) fn abort(&self, reason: &str) {
        {
            let mut notified = self.notified.lock();
            if std::mem::replace(&mut notified[self.world_rank], true) {
                return;
            }
        }
        // The job failed: nobody will finalize with this rank.
        self.poison();
        let _ = self.failure.set((self.world_rank, reason.to_string()));
        let bytes = cut_reason(reason, ABORT_MSG_MAX).as_bytes();
        let mut control = self.control.lock();
        let comm = control.comm;
        for peer in (0..self.world_size).filter(|&p| p != self.world_rank) {
            let buf: Box<[u8]> = bytes.into();
            let mut req: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
            // SAFETY: `buf` is kept in `control.sends` until the process ends.
            let rc = unsafe {
                ffi::MPI_Isend(
                    buf.as_ptr().cast(),
                    buf.len() as c_int,
                    ffi::RSMPI_UINT8_T,
                    peer as c_int,
                    TAG_ABORT,
                    comm.0,
                    &mut req,
                )
            };
            if rc == ffi::MPI_SUCCESS as c_int {
                control.sends.push((req, buf));
            }
        }
        let deadline = Instant::now() + ABORT_SEND_GRACE;
        while Instant::now() < deadline {
            let tested: Vec<bool> = control.sends.iter_mut().map(|(req, _)| test(req)).collect();
            if tested.iter().all(|&done| done) {
                break;
            }
            thread::sleep(Duration::from_micros(200));
        }
    }
}

/// What a polling wait is for (named in its errors).
pub(super) struct WaitFor<'a> {
    pub op: &'a str,
    /// This rank in the group of the operation.
    pub rank: usize,
    pub deadline: Instant,
    pub timeout: Duration,
}

/// Waits until every request in `reqs` completed, polling with `MPI_Testall` and backing off
/// (spin, then yield, then short sleeps), checking the failure channel and the deadline.
///
/// `peers[i]` is the group rank `reqs[i]` exchanges with (named in a timeout); for one
/// collective request, `peers` lists every other rank of it. On failure or timeout the
/// requests are left pending (nothing cancelled), the runtime is poisoned and the caller must
/// keep every buffer of the operation allocated (see the module docs); a timeout also aborts
/// the job.
pub(super) fn wait_all(
    rt: &Runtime,
    reqs: &mut [ffi::MPI_Request],
    peers: &[usize],
    w: &WaitFor<'_>,
) -> Result<()> {
    let start = Instant::now();
    let mut polls: u64 = 0;
    loop {
        let mut flag: c_int = 0;
        // SAFETY: our own requests, posted on buffers the caller keeps alive.
        let rc = unsafe {
            ffi::MPI_Testall(
                reqs.len() as c_int,
                reqs.as_mut_ptr(),
                &mut flag,
                ffi::RSMPI_STATUSES_IGNORE,
            )
        };
        if rc != ffi::MPI_SUCCESS as c_int {
            rt.poison();
            return check(rc, || format!("MPI_Testall ({})", w.op), rt.world_rank);
        }
        if flag != 0 {
            return Ok(());
        }
        polls += 1;
        if polls.is_multiple_of(64) {
            rt.poll_failures();
            if let Some(failure) = rt.failure() {
                rt.poison();
                return Err(peer_failed(w.op, w.rank, failure));
            }
            if Instant::now() >= w.deadline {
                let missing = pending_peers(reqs, peers);
                rt.poison();
                let err = Error::Timeout {
                    op: w.op.to_string(),
                    rank: w.rank,
                    timeout: w.timeout,
                    missing,
                };
                rt.abort(&err.to_string());
                return Err(err);
            }
        }
        let waited = start.elapsed();
        if waited < Duration::from_micros(50) {
            std::hint::spin_loop();
        } else if waited < Duration::from_millis(2) {
            thread::yield_now();
        } else {
            thread::sleep(Duration::from_micros(50));
        }
    }
}

/// The peers whose requests are still pending. A collective request (`peers` not one per
/// request) names all of `peers`: which of them is missing is not known.
fn pending_peers(reqs: &mut [ffi::MPI_Request], peers: &[usize]) -> Vec<usize> {
    if peers.len() != reqs.len() {
        return peers.to_vec();
    }
    let mut missing = Vec::new();
    for (req, &peer) in reqs.iter_mut().zip(peers) {
        if !test(req) && !missing.contains(&peer) {
            missing.push(peer);
        }
    }
    missing.sort_unstable();
    missing
}
