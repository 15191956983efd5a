//! MPI backend (feature `mpi`): one rank per process, started by `mpirun`, over the system's MPI
//! (OpenMPI 4.1 tested) through rsmpi's bindings.
//!
//! [`world`] is this process's rank of `MPI_COMM_WORLD`; [`crate::launch::Launcher::Mpi`] runs
//! a job on it. MPI is initialised once per process with `MPI_THREAD_MULTIPLE` (an error names
//! the level the library provides if it is less) and finalised at exit. Each stream has a
//! communicator of its own (`MPI_Comm_idup` of the group's); the collectives are those of
//! `comm::engine::messages` over non-blocking point-to-point messages (`ops`; design:
//! `design/comm.md`, "MPI backend"): reductions are **bitwise identical to the thread
//! backend's** for every dtype (no MPI reduction op is used), and a mismatch is the same
//! [`Error::CollectiveMismatch`] / [`Error::BadBuffer`] on every rank, the group still usable.
//!
//! Failures: communicators return errors ([`Error::Mpi`]) instead of aborting; every wait polls
//! with a deadline ([`MpiConfig::timeout`], [`Error::Timeout`]); [`ProcessGroup::abort`] sends
//! the reason to every rank of the job, whose pending and later collectives fail with
//! [`Error::PeerFailed`] naming the failed rank (its `MPI_COMM_WORLD` rank). A process in a
//! failed job skips `MPI_Finalize`; see `runtime` for the details.

mod ops;
mod runtime;

use std::ffi::c_int;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mpi::ffi;
use parking_lot::Mutex;

use self::ops::Ctx;
/// An MPI return code as a result naming the call (NCCL's bootstrap over MPI uses it too).
pub(crate) use self::runtime::check;
use self::runtime::{deadline_after, runtime, wait_all, Comm, Runtime, WaitFor};
use super::buffer::Post;
use super::engine::group::{Collective, HostGroup, Member, Op, Place, Transport};
use super::engine::messages::{self, Link};
use super::engine::streams::StreamComm;
use super::wire;
use super::{Instrumented, ProcessGroup};
use crate::error::{Error, Result};

/// Largest setup descriptor (a stream name or a sub-group's rank list), bytes.
const SETUP_DESC_MAX: usize = 1 << 16;

/// How long a rank of a failed job waits for the others to report their own failure before its
/// process exits (see [`run`]).
pub const LINGER: Duration = Duration::from_secs(10);

/// Configuration of an MPI process group: [`crate::comm::GroupConfig`].
pub type MpiConfig = crate::comm::GroupConfig;

/// This process's rank and the job's size in `MPI_COMM_WORLD`, initialising MPI if needed.
///
/// Errors: MPI cannot be initialised, or provides less than `MPI_THREAD_MULTIPLE`.
pub fn world_rank_and_size() -> Result<(usize, usize)> {
    let rt = runtime()?;
    Ok((rt.world_rank, rt.world_size))
}

/// One communicator of a group as its thread holds it: the MPI handle, the stream's reused
/// receive space, the largest descriptor a peer may send on it, and when the waits of its
/// current operation give up.
pub(crate) struct MpiComm {
    comm: Comm,
    scratch: Vec<u64>,
    desc_max: usize,
    deadline: Instant,
}

impl MpiComm {
    fn new(comm: Comm, desc_max: usize) -> MpiComm {
        MpiComm {
            comm,
            scratch: Vec::new(),
            desc_max,
            deadline: Instant::now(),
        }
    }
}

impl StreamComm for MpiComm {
    /// Nothing to tell: a rank that left is found by the peers' deadlines and the failure
    /// channel.
    fn leave(&mut self, _rank: usize) {}
}

/// The MPI transport of one rank of one group.
pub(crate) struct Mpi {
    rt: &'static Runtime,
    place: Place,
    /// Communicator the streams are duplicated from.
    base: Comm,
    /// Communicators this group created (freed on drop unless the runtime is poisoned).
    comms: Mutex<Vec<Comm>>,
}

impl Mpi {
    /// The transport of this rank (at `place`) over a duplicate of `parent`, with its setup
    /// communicator and its default stream's.
    fn create(rt: &'static Runtime, parent: Comm, place: Place) -> Result<Member<Mpi>> {
        let base = dup(rt, parent, place, "group")?;
        let setup = dup(rt, base, place, "setup")?;
        let default = dup(rt, base, place, "stream collective")?;
        let mpi = Mpi {
            rt,
            place,
            base,
            comms: Mutex::new(vec![base, setup, default]),
        };
        let (setup, default) = (
            MpiComm::new(setup, SETUP_DESC_MAX),
            MpiComm::new(default, wire::OP_DESC_MAX),
        );
        Ok((mpi, setup, default))
    }

    /// One operation's context on `comm`, its deadline the timeout from now.
    fn ctx<'a>(&'a self, comm: &'a mut MpiComm, op: Op<'a>) -> Ctx<'a> {
        comm.deadline = deadline_after(self.place.timeout);
        Ctx::new(self, comm, op)
    }
}

impl Transport for Mpi {
    type Comm = MpiComm;
    const BACKEND: &'static str = "mpi";

    fn place(&self) -> Place {
        self.place
    }

    fn run(&self, comm: &mut MpiComm, op: Op<'_>, collective: Collective<'_>) -> Result<()> {
        messages::run(&mut self.ctx(comm, op), collective)
    }

    fn agree(&self, setup: &mut MpiComm, op: Op<'_>, post: &Post) -> Result<()> {
        self.ctx(setup, op).exchange(post)
    }

    fn open(
        &self,
        _setup: &mut MpiComm,
        _op: Op<'_>,
        _index: usize,
        name: &str,
    ) -> Result<MpiComm> {
        let comm = dup(self.rt, self.base, self.place, &format!("stream {name}"))?;
        self.comms.lock().push(comm);
        Ok(MpiComm::new(comm, wire::OP_DESC_MAX))
    }

    fn split(
        &self,
        _setup: &mut MpiComm,
        op: Op<'_>,
        ranks: &[usize],
    ) -> Result<Option<Member<Mpi>>> {
        let position = ranks.iter().position(|&r| r == self.place.rank);
        // SAFETY: reading link-time constants.
        let color = position.map_or(unsafe { ffi::RSMPI_UNDEFINED }, |_| 0);
        let key = position.unwrap_or(0) as c_int;
        // SAFETY: out-pointer to a local; every rank of `base` calls the split (agreed).
        let mut sub: ffi::MPI_Comm = unsafe { std::mem::zeroed() };
        let rc = unsafe { ffi::MPI_Comm_split(self.base.0, color, key, &mut sub) };
        check(
            rc,
            || format!("MPI_Comm_split ({})", op.name),
            self.rt.world_rank,
        )?;
        let Some(local) = position else {
            return Ok(None);
        };
        self.comms.lock().push(Comm(sub));
        let place = Place::new(local, ranks.len(), self.place.timeout);
        Mpi::create(self.rt, Comm(sub), place).map(Some)
    }

    fn abort(&self, reason: &str) {
        self.rt.abort(reason);
    }
}

impl Drop for Mpi {
    fn drop(&mut self) {
        if !self.rt.is_poisoned() {
            for comm in self.comms.get_mut().drain(..) {
                let mut c = comm.0;
                // SAFETY: communicators this group created; its streams' threads have ended.
                unsafe { ffi::MPI_Comm_free(&mut c) };
            }
        }
    }
}

/// `MPI_Comm_idup` of `comm` by the rank at `place`, waited for until its timeout.
fn dup(rt: &Runtime, comm: Comm, place: Place, what: &str) -> Result<Comm> {
    // SAFETY: out-pointers to locals; `comm` is a live communicator.
    let mut new: ffi::MPI_Comm = unsafe { std::mem::zeroed() };
    let mut req: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
    let rc = unsafe { ffi::MPI_Comm_idup(comm.0, &mut new, &mut req) };
    let op = format!("MPI_Comm_idup ({what})");
    check(rc, || op.clone(), rt.world_rank)?;
    let others: Vec<usize> = (0..place.world_size).filter(|&r| r != place.rank).collect();
    wait_all(
        rt,
        &mut [req],
        &others,
        &WaitFor {
            op: &op,
            rank: place.rank,
            deadline: deadline_after(place.timeout),
            timeout: place.timeout,
        },
    )?;
    // SAFETY: `new` is the communicator the completed idup created.
    unsafe { ffi::MPI_Comm_set_errhandler(new, ffi::RSMPI_ERRORS_RETURN) };
    Ok(Comm(new))
}

/// This process's rank of a group over every process of the job (`MPI_COMM_WORLD`), with its
/// default stream running. Every process calls it (it is collective).
///
/// Errors: MPI cannot be initialised or lacks `MPI_THREAD_MULTIPLE`
/// ([`Error::InvalidArgument`]); an MPI call fails ([`Error::Mpi`]); a thread cannot be started
/// ([`Error::SpawnFailed`]).
pub fn world(config: MpiConfig) -> Result<Arc<dyn ProcessGroup>> {
    let rt = runtime()?;
    let place = Place::new(rt.world_rank, rt.world_size, config.timeout);
    let (mpi, setup, default) = Mpi::create(rt, rt.world, place)?;
    Ok(HostGroup::new(mpi, setup, default)?)
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
    let result = match world(config) {
        Ok(group) => {
            let rank = group.rank();
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
