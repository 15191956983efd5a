//! Shared-memory backend: the ranks of one machine in separate processes (started by
//! `fsdp-run` or `torchrun` with `--device cpu`), exchanging data through shared segments in
//! `/dev/shm`, with the thread backend's algorithms and bit-exact reductions.
//!
//! [`connect`] joins a job through its TCP store (`MASTER_ADDR:MASTER_PORT`, served by rank 0),
//! which is used only for this rendezvous; [`crate::launch::Launcher::Shm`] runs a job on it.
//! How the ranks meet, their segments, the shared arena from which peers read a collective's
//! input in place ([`crate::alloc::SharedLarge`], [`crate::alloc::in_shared`]), the streams and
//! the waits: `design/comm.md`, "Shared-memory backend". The collectives are those of
//! `comm::engine::board` over this backend's segments (`ops`).
//!
//! # Guarantees
//!
//! Reductions are **bitwise identical to the thread backend's** (and to the TCP and MPI
//! backends') for every dtype and op; a mismatch is the same [`Error::CollectiveMismatch`] /
//! [`Error::BadBuffer`] on every rank, and the group stays usable.
//!
//! [`ProcessGroup::abort`] records `(rank, reason)` in the job's abort slot: every wait of every
//! rank then fails with [`Error::PeerFailed`] naming the failed rank. A wait also fails with
//! [`Error::PeerExited`] when a missing rank dropped its group, with [`Error::PeerFailed`] when
//! a missing rank's process is gone without a word (a `kill -9`; recorded in the abort slot, so
//! every rank stops), and with [`Error::Timeout`] after [`ShmConfig::timeout`] (which aborts the
//! job too). Unlike the thread backend, every barrier may fail, also after the data phase (a
//! rank that fails mid-collective never arrives at the last barrier).

mod ops;
mod segment;

use std::path::PathBuf;
use std::sync::Arc;

use self::ops::{Comm, Ctx};
use self::segment::{shm_dir, AbortSlot, PeerMap, Segment};
use super::bootstrap;
use super::buffer::Post;
use super::engine::board;
use super::engine::group::{Collective, HostGroup, Member, Op, Place, Transport};
use super::engine::run::run_process_rank;
use super::store::TcpStore;
use super::ProcessGroup;
use crate::alloc::shared::{self as arena, PeerArena};
use crate::error::{Error, Result};

/// Configuration of a shared-memory process group: [`crate::comm::GroupConfig`].
pub type ShmConfig = crate::comm::GroupConfig;

/// Store key of the job's segment name prefix (shared by rank 0).
const PREFIX_KEY: &str = "candle-fsdp/shm/prefix";

/// The shared-memory transport of one rank of one group: what every handle and stream of the
/// group shares.
pub(crate) struct Shm {
    place: Place,
    /// Rank in the root group of each rank of this group.
    root_ranks: Vec<usize>,
    /// Process id of each rank.
    pids: Vec<u32>,
    abort: Arc<AbortSlot>,
    /// Path prefix of this group's segment files.
    prefix: String,
    /// The peers' arenas mapped here, by rank of the root group (`None`: this process's, or
    /// not mapped); see `crate::alloc::shared`.
    arenas: Arc<Vec<Option<PeerArena>>>,
    /// Every rank of the job has an arena and mapped every peer's: a buffer in this rank's
    /// arena is read in place instead of copied into its segment.
    in_place: bool,
}

impl Shm {
    fn path(&self, comm: usize, rank: usize) -> PathBuf {
        PathBuf::from(format!("{}-c{comm}-r{rank}", self.prefix))
    }

    /// Creates this rank's segment of communicator `comm`.
    fn create(&self, comm: usize) -> Result<Segment> {
        Segment::create(self.path(comm, self.place.rank))
    }

    /// Maps the peers' segments of communicator `comm`.
    fn map_peers(&self, comm: usize, own: Segment) -> Result<Comm> {
        let peers = (0..self.place.world_size)
            .map(|j| match j == self.place.rank {
                true => Ok(None),
                false => PeerMap::open(self.path(comm, j)).map(Some),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Comm { own, peers })
    }

    /// This rank's communicators `indices`: creates its segments, `sync` (every rank created
    /// its own), maps the peers', `sync` again (every rank mapped them), and removes its files.
    fn comms<const N: usize>(
        &self,
        indices: [usize; N],
        mut sync: impl FnMut() -> Result<()>,
    ) -> Result<[Comm; N]> {
        let owns = (indices.iter().map(|&i| self.create(i)))
            .collect::<Result<Vec<_>>>()
            .map_err(|e| self.stop_job(e))?;
        sync()?;
        let comms = (indices.into_iter().zip(owns))
            .map(|(i, own)| self.map_peers(i, own))
            .collect::<Result<Vec<_>>>()
            .map_err(|e| self.stop_job(e))?;
        sync()?;
        comms.iter().for_each(|c| c.own.unlink());
        Ok(comms.try_into().ok().expect("N communicators"))
    }

    /// Records `e`, a failure of this rank alone (a segment cannot be made, grown or mapped),
    /// as the job's failure: the peers would otherwise wait at a barrier this rank never
    /// reaches, or pass one it reached early, until the timeout.
    fn stop_job(&self, e: Error) -> Error {
        self.abort(&e.message());
        e
    }
}

impl Transport for Shm {
    type Comm = Comm;
    const BACKEND: &'static str = "shm";

    fn place(&self) -> Place {
        self.place
    }

    fn run(&self, comm: &mut Comm, op: Op<'_>, collective: Collective<'_>) -> Result<()> {
        board::run(&mut Ctx::new(self, comm, op), collective)
    }

    fn agree(&self, setup: &mut Comm, op: Op<'_>, post: &Post) -> Result<()> {
        Ctx::new(self, setup, op).exchange(post).map(|_| ())
    }

    /// Every rank creates its segment, then maps the others', then removes its file.
    fn open(&self, setup: &mut Comm, op: Op<'_>, index: usize, _name: &str) -> Result<Comm> {
        let ctx = Ctx::new(self, setup, op);
        let [comm] = self.comms([index], || ctx.sync_next())?;
        Ok(comm)
    }

    /// Members create the sub-group's segments, map each other's, then remove their files;
    /// every rank of this group takes part in the barriers.
    fn split(&self, setup: &mut Comm, op: Op<'_>, ranks: &[usize]) -> Result<Option<Member<Shm>>> {
        let sub = ranks
            .iter()
            .position(|&r| r == self.place.rank)
            .map(|local| Shm {
                place: Place::new(local, ranks.len(), self.place.timeout),
                root_ranks: ranks.iter().map(|&r| self.root_ranks[r]).collect(),
                pids: ranks.iter().map(|&r| self.pids[r]).collect(),
                abort: Arc::clone(&self.abort),
                prefix: format!("{}{}-g", self.prefix, op.seq),
                arenas: Arc::clone(&self.arenas),
                in_place: self.in_place,
            });
        let ctx = Ctx::new(self, setup, op);
        let Some(sub) = sub else {
            ctx.sync_next()?;
            ctx.sync_next()?;
            return Ok(None);
        };
        let [setup, default] = sub.comms([0, 1], || ctx.sync_next())?;
        Ok(Some((sub, setup, default)))
    }

    fn abort(&self, reason: &str) {
        self.abort.set(self.root_ranks[self.place.rank], reason);
    }
}

/// This process's rank of a shared-memory group: joins the job of `world_size` processes on this machine as `rank`, through the TCP store
/// at `addr:port` (rank 0 serves it; see [`TcpStore::connect`]). Every rank calls it.
/// A job of one rank needs no store (`addr` and `port` are ignored).
///
/// Errors: the store's ([`Error::Store`]: a rank missing, the port taken); a rank on
/// another machine (it cannot open the job's segments: [`Error::InvalidArgument`] saying
/// that CPU ranks on several machines use the TCP backend, [`crate::comm::tcp`]);
/// `/dev/shm` full or not writable; a thread cannot be started.
pub fn connect(
    rank: usize,
    world_size: usize,
    addr: &str,
    port: u16,
    config: ShmConfig,
) -> Result<Arc<dyn ProcessGroup>> {
    crate::comm::engine::run::check_rank("shared-memory group", rank, world_size)?;
    // Before the store: a bad `FSDP_SHM_ARENA` fails here, not half-way through the setup.
    let own_arena = arena::enable()?;
    let fresh = || {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!(
            "{}/candle-fsdp-{}-{nanos}",
            shm_dir().display(),
            std::process::id()
        )
    };
    if world_size == 1 {
        let core = Shm {
            place: Place::new(rank, world_size, config.timeout),
            root_ranks: vec![0],
            pids: vec![std::process::id()],
            abort: Arc::new(AbortSlot::private()?),
            prefix: fresh(),
            arenas: Arc::new(vec![None]),
            in_place: own_arena.is_some(),
        };
        let [setup, default] = core.comms([0, 1], || Ok(()))?;
        return Ok(HostGroup::new(core, setup, default)?);
    }
    let store = TcpStore::connect(addr, port, rank, world_size, config.timeout)?;
    // Rank 0 makes the job's prefix and its abort slot (kept in `slot`) and shares the prefix.
    let mut slot = None;
    let prefix = bootstrap::share(&store, PREFIX_KEY, "shared-memory group creation", || {
        let prefix = fresh();
        slot = Some(AbortSlot::create(&PathBuf::from(format!(
            "{prefix}-abort"
        )))?);
        Ok(prefix.into_bytes())
    })?;
    let prefix = String::from_utf8_lossy(&prefix).into_owned();
    let abort = match slot {
        Some(slot) => slot,
        None => AbortSlot::open(&PathBuf::from(format!("{prefix}-abort"))).map_err(|e| {
            Error::InvalidArgument(format!(
                "rank {rank} cannot open the job's shared memory ({e}): either rank 0 failed \
                     while setting the job up (its own error says why), or this rank runs on \
                     another machine: the shared-memory \
                     backend connects the ranks of one machine; CPU ranks on several machines \
                     use the TCP backend (chosen when LOCAL_WORLD_SIZE < WORLD_SIZE, as \
                     `fsdp-run --nnodes N` sets them) or MPI (`mpirun --hostfile HOSTS`)"
            ))
        })?,
    };
    let core = Shm {
        place: Place::new(rank, world_size, config.timeout),
        root_ranks: (0..world_size).collect(),
        pids: Vec::new(),
        abort: Arc::new(abort),
        prefix: format!("{prefix}-g"),
        arenas: Arc::new(Vec::new()),
        in_place: false,
    };
    let owns = core
        .create(0)
        .and_then(|setup| Ok((setup, core.create(1)?)));
    let (setup, default) = owns.map_err(|e| core.stop_job(e))?;
    setup.header().set_arena(own_arena);
    store.barrier("candle-fsdp/shm/created")?;
    let setup = core.map_peers(0, setup)?;
    let default = core.map_peers(1, default)?;
    let arenas = map_arenas(&setup, rank);
    let mapped_all = own_arena.is_some() && arenas.iter().flatten().count() == world_size - 1;
    store.set(&arena_key(rank), &[u8::from(mapped_all)])?;
    store.barrier("candle-fsdp/shm/mapped")?;
    let mut in_place = true;
    for j in 0..world_size {
        in_place &= store.get(&arena_key(j))? == [1];
    }
    setup.own.unlink();
    default.own.unlink();
    if rank == 0 {
        let _ = std::fs::remove_file(format!("{prefix}-abort"));
    }
    // A peer whose process this one cannot see (another PID namespace sharing /dev/shm) is
    // not watched: 0 (its failures still arrive through the abort slot and the timeout).
    let pids = (setup.peers.iter())
        .map(|p| p.as_ref().map_or(std::process::id(), |p| p.pid))
        .map(|pid| if segment::alive(pid) { pid } else { 0 })
        .collect();
    let core = Shm {
        pids,
        arenas: Arc::new(arenas),
        in_place,
        ..core
    };
    Ok(HostGroup::new(core, setup, default)?)
}

fn arena_key(rank: usize) -> String {
    format!("candle-fsdp/shm/arena/{rank}")
}

/// Maps every peer's arena that its setup segment's header names (`None` where a peer has
/// none, or this process cannot open it: then the group copies, as without arenas).
fn map_arenas(setup: &Comm, rank: usize) -> Vec<Option<PeerArena>> {
    (0..setup.peers.len())
        .map(|j| {
            let peer = setup.peers[j].as_ref().filter(|_| j != rank)?;
            let id = setup.header(j).arena()?;
            PeerArena::open(peer.pid, id)
                .inspect_err(|e| {
                    tracing::warn!(
                        "shm: rank {rank} cannot map rank {j}'s arena ({e}); the group copies \
                         each collective's input into its segments instead of reading it in place"
                    )
                })
                .ok()
        })
        .collect()
}

/// Runs `f` on this process's rank of a shared-memory job of `world_size` processes that meet
/// through the store at `addr:port` ([`connect`]; the group wrapped in
/// [`super::Instrumented`]) and returns its result (one element). When `f` fails or panics, the job is
/// aborted with the error's text: every other rank's collectives fail with
/// [`Error::PeerFailed`].
pub fn run<T, F>(
    rank: usize,
    world_size: usize,
    addr: &str,
    port: u16,
    config: ShmConfig,
    f: F,
) -> Vec<Result<T>>
where
    F: Fn(Arc<dyn ProcessGroup>) -> Result<T>,
{
    let group = connect(rank, world_size, addr, port, config);
    run_process_rank(rank, group, f)
}
