//! TCP backend: CPU ranks in separate processes on one or several machines, as torchrun + gloo
//! runs them, with no MPI install: chosen for a torchrun-style start (`fsdp-run`, `torchrun`)
//! with `--device cpu` whose ranks span machines (`LOCAL_WORLD_SIZE < WORLD_SIZE`; one
//! machine's ranks use [`crate::comm::shm`]).
//!
//! [`connect`] joins a job through its TCP store (`MASTER_ADDR:MASTER_PORT`, served by rank 0),
//! which is used only for this rendezvous: every rank listens on the address its peers reach it
//! by (the interface of the route toward `MASTER_ADDR`; [`ADDR_VAR`] names the address,
//! [`IFNAME_VAR`] an interface) and connects to every other rank (`net`);
//! [`crate::launch::Launcher::Tcp`] runs a job on it. The connections, the descriptor frames,
//! the control plane and the costs: `design/comm.md`, "The TCP backend". The collectives are
//! those of `comm::engine::messages` over this backend's connections (`ops`).
//!
//! # Guarantees
//!
//! Reductions are **bitwise identical to the thread backend's** (and the shm and MPI
//! backends') for every dtype and op; a mismatch is the same [`Error::CollectiveMismatch`] /
//! [`Error::BadBuffer`] on every rank, and the group stays usable.
//!
//! [`ProcessGroup::abort`] sends `(rank, reason)` to every process of the job over the control
//! plane: their pending and later collectives fail with [`Error::PeerFailed`] naming the failed
//! rank. A rank whose connection ends without a goodbye (a `kill -9`, a machine gone) is
//! reported the same way by every rank; a rank whose group was dropped gives
//! [`Error::PeerExited`]; a wait longer than [`TcpConfig::timeout`] gives [`Error::Timeout`]
//! (which aborts the job too).

mod net;
mod ops;

use std::sync::Arc;

use self::net::{mesh, Net};
pub use self::net::{ADDR_VAR, IFNAME_VAR};
use self::ops::{Comm, Ctx};
use super::bootstrap;
use super::buffer::Post;
use super::engine::group::{Collective, HostGroup, Member, Op, Place, Transport};
use super::engine::messages::{self, Link};
use super::engine::run::{deadline_after, run_process_rank};
use super::store::TcpStore;
use super::ProcessGroup;
use crate::error::Result;

/// Configuration of a TCP process group: [`crate::comm::GroupConfig`].
pub type TcpConfig = crate::comm::GroupConfig;

/// The TCP transport of one rank of one group: what every handle and stream of the group
/// shares.
pub(crate) struct Tcp {
    place: Place,
    /// Rank in the job (the root group) of each rank of this group.
    root_ranks: Vec<usize>,
    net: Arc<Net>,
    /// Prefix of this group's connection keys.
    prefix: String,
}

impl Tcp {
    /// Connects communicator `index` of this group (every member calls it, in the same order).
    fn connect(&self, index: usize) -> Result<Comm> {
        let key = format!("{}c{index}", self.prefix);
        let deadline = deadline_after(self.place.timeout);
        let peers = mesh(&self.net, &key, &self.root_ranks, self.place.rank, deadline)?;
        Ok(Comm {
            peers,
            scratch: Vec::new(),
        })
    }
}

impl Transport for Tcp {
    type Comm = Comm;
    const BACKEND: &'static str = "tcp";

    fn place(&self) -> Place {
        self.place
    }

    fn run(&self, comm: &mut Comm, op: Op<'_>, collective: Collective<'_>) -> Result<()> {
        messages::run(&mut Ctx::new(self, comm, op), collective)
    }

    fn agree(&self, setup: &mut Comm, op: Op<'_>, post: &Post) -> Result<()> {
        Ctx::new(self, setup, op).exchange(post)
    }

    fn open(&self, _setup: &mut Comm, _op: Op<'_>, index: usize, _name: &str) -> Result<Comm> {
        self.connect(index)
            .inspect_err(|e| self.abort(&e.message()))
    }

    fn split(&self, _setup: &mut Comm, op: Op<'_>, ranks: &[usize]) -> Result<Option<Member<Tcp>>> {
        let Some(local) = ranks.iter().position(|&r| r == self.place.rank) else {
            return Ok(None);
        };
        let sub = Tcp {
            place: Place::new(local, ranks.len(), self.place.timeout),
            root_ranks: ranks.iter().map(|&r| self.root_ranks[r]).collect(),
            net: Arc::clone(&self.net),
            prefix: format!("{}s{}-", self.prefix, op.seq),
        };
        let (setup, default) = sub
            .connect(0)
            .and_then(|s| Ok((s, sub.connect(1)?)))
            .inspect_err(|e| self.abort(&e.message()))?;
        Ok(Some((sub, setup, default)))
    }

    fn abort(&self, reason: &str) {
        self.net.abort(self.root_ranks[self.place.rank], reason);
    }
}

/// Store key of rank `j`'s address.
fn addr_key(j: usize) -> String {
    format!("candle-fsdp/tcp/addr/{j}")
}

/// This process's rank of a TCP group: joins the job of `world_size` processes as `rank`, through the TCP store at `addr:port`
/// (rank 0 serves it; see [`TcpStore::connect`]). Every rank calls it. A job of one rank
/// needs no store (`addr` and `port` are ignored).
///
/// Errors: the store's ([`Error::Store`]: a rank missing, the port taken); this rank's
/// address cannot be found or listened on ([`Error::Env`] or [`Error::InvalidArgument`] naming
/// the address and the variables that choose it); a peer cannot be connected to (naming its rank and
/// address) or failed meanwhile ([`Error::PeerFailed`]); a thread cannot be started.
pub fn connect(
    rank: usize,
    world_size: usize,
    addr: &str,
    port: u16,
    config: TcpConfig,
) -> Result<Arc<dyn ProcessGroup>> {
    crate::comm::engine::run::check_rank("tcp group", rank, world_size)?;
    let deadline = || deadline_after(config.timeout);
    if world_size == 1 {
        let (local, listening) = Net::listen(std::net::Ipv4Addr::LOCALHOST.into())?;
        let net = listening.join(0, vec![local.to_string()], deadline())?;
        return root(net, config);
    }
    let store = TcpStore::connect(addr, port, rank, world_size, config.timeout)?;
    let listened = net::local_ip(addr, port).and_then(Net::listen);
    let local = listened.as_ref().map(|(local, _)| local.to_string());
    bootstrap::publish(&store, &addr_key(rank), local)?;
    let (_, listening) = listened?;
    let mut addrs = Vec::with_capacity(world_size);
    for j in 0..world_size {
        let value = bootstrap::read_published(&store, &addr_key(j), j, "tcp group creation")?;
        addrs.push(String::from_utf8_lossy(&value).into_owned());
    }
    let net = listening.join(rank, addrs, deadline())?;
    let group = root(net, config)?;
    store.barrier("candle-fsdp/tcp/connected")?;
    Ok(group)
}

/// The root group over the job's `net`.
fn root(net: Arc<Net>, config: TcpConfig) -> Result<Arc<dyn ProcessGroup>> {
    let ws = net.addrs.len();
    let tcp = Tcp {
        place: Place::new(net.rank, ws, config.timeout),
        root_ranks: (0..ws).collect(),
        net,
        prefix: "g-".into(),
    };
    let setup = tcp.connect(0)?;
    let default = tcp.connect(1)?;
    Ok(HostGroup::new(tcp, setup, default)?)
}

/// Runs `f` on this process's rank of a TCP job of `world_size` processes that meet through
/// the store at `addr:port` ([`connect`]; the group wrapped in
/// [`super::Instrumented`]) and returns its result (one element). When `f` fails or panics, the job is
/// aborted with the error's text: every other rank's collectives fail with
/// [`Error::PeerFailed`].
pub fn run<T, F>(
    rank: usize,
    world_size: usize,
    addr: &str,
    port: u16,
    config: TcpConfig,
    f: F,
) -> Vec<Result<T>>
where
    F: Fn(Arc<dyn ProcessGroup>) -> Result<T>,
{
    let group = connect(rank, world_size, addr, port, config);
    run_process_rank(rank, group, f)
}
