//! TCP backend: CPU ranks in separate processes on one or several machines, as torchrun + gloo
//! runs them, with no MPI install: chosen for a torchrun-style start (`fsdp-run`, `torchrun`)
//! with `--device cpu` whose ranks span machines (`LOCAL_WORLD_SIZE < WORLD_SIZE`; one
//! machine's ranks use [`crate::comm::shm`]).
//!
//! [`TcpProcessGroup::connect`] joins a job through its TCP store (`MASTER_ADDR:MASTER_PORT`,
//! served by rank 0): every rank listens on an ephemeral port of the address its peers reach it
//! by (the interface of the route toward `MASTER_ADDR`; `FSDP_TCP_ADDR` names the address,
//! `FSDP_TCP_IFNAME` an interface), publishes `host:port` in the store, reads everybody's, and
//! connects to every other rank (see `net`). The store is used only for this rendezvous;
//! [`crate::launch::Launcher::Tcp`] runs a job on it.
//!
//! # Streams
//!
//! As in the shared-memory and MPI backends: every [`CommStream`] is one thread of this process
//! (named `tcp-{rank}-{stream}`) with its own connection to every peer, so an all-gather and a
//! reduce-scatter are in flight together and each stream keeps issue order. Stream and
//! sub-group creation run on the caller's thread over a setup communicator.
//!
//! # Algorithm and guarantees
//!
//! Direct exchange (see `ops`): every collective first exchanges descriptors, validated by
//! every rank with the thread backend's code (the same [`Error::CollectiveMismatch`] /
//! [`Error::BadBuffer`] on every rank; the group stays usable), then every rank sends what each
//! peer needs and reduces what it receives in rank order with the thread backend's kernel:
//! reductions are **bitwise identical to the thread backend's** (and the shm and MPI
//! backends') for every dtype and op. Each rank sends and receives `(ws - 1) · n` elements per
//! all-gather or reduce-scatter, in `ws - 1` connections (suited to the few-to-tens of CPU
//! processes this backend targets).
//!
//! # Failures
//!
//! [`ProcessGroup::abort`] sends `(rank, reason)` to every process of the job over the control
//! plane: their pending and later collectives fail with [`Error::PeerFailed`] naming the failed
//! rank. A rank whose connection ends without a goodbye (a `kill -9`, a machine gone) is
//! reported the same way by every rank, at once (the connections break) or within the
//! collective's wait; a rank whose group was dropped gives [`Error::PeerExited`]; a wait longer
//! than [`TcpConfig::timeout`] gives [`Error::Timeout`] (which aborts the job too).

mod net;
mod ops;

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use parking_lot::Mutex;

use self::net::{mesh, Net};
pub use self::net::{ADDR_VAR, IFNAME_VAR};
use self::ops::{Comm, Ctx};
use super::buffer::{Kind, Post, RawBytes};
use super::engine::check_ranks;
use super::engine::streams::{self as host_stream, HostStreams, StreamComm};
use super::store::TcpStore;
use super::{host_collectives, CommObserver, CommStream, OpKind, ProcessGroup, ReduceOp, Work};
use crate::error::{Error, Result};

/// Configuration of a TCP process group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpConfig {
    /// How long a rank waits in a collective for its peers before failing with
    /// [`Error::Timeout`] (which also aborts the job); also bounds the rendezvous and each
    /// connection setup. Default: 300 s.
    pub timeout: Duration,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            timeout: Duration::from_secs(300),
        }
    }
}

/// What every handle and stream of one group shares.
pub(super) struct Core {
    rank: usize,
    world_size: usize,
    /// Rank in the job (the root group) of each rank of this group.
    root_ranks: Vec<usize>,
    timeout: Duration,
    net: Arc<Net>,
    /// Prefix of this group's connection keys.
    prefix: String,
}

impl Core {
    /// Connects communicator `index` of this group (every member calls it, in the same order).
    fn connect(&self, index: usize) -> Result<Comm> {
        let key = format!("{}c{index}", self.prefix);
        let deadline = Instant::now() + self.timeout;
        let peers = mesh(&self.net, &key, &self.root_ranks, self.rank, deadline)?;
        Ok(Comm {
            peers,
            scratch: Vec::new(),
        })
    }
}

/// Setup operations of one handle: their sequence number, the setup communicator, and how many
/// communicators the group has (setup and streams).
struct Setup {
    seq: u64,
    comm: Comm,
    comms: usize,
}

/// One process's rank of a TCP group; see the [module docs](self).
///
/// Dropping the handle closes its streams (after the work queued on them) and tells the peers
/// it left: those still waiting for it fail with [`Error::PeerExited`].
pub struct TcpProcessGroup {
    core: Arc<Core>,
    device: Device,
    setup: Mutex<Setup>,
    streams: HostStreams<Comm>,
}

impl std::fmt::Debug for TcpProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpProcessGroup")
            .field("rank", &self.core.rank)
            .field("world_size", &self.core.world_size)
            .field("timeout", &self.core.timeout)
            .finish()
    }
}

/// Store key of rank `j`'s address.
fn addr_key(j: usize) -> String {
    format!("candle-fsdp/tcp/addr/{j}")
}

impl TcpProcessGroup {
    /// Joins the job of `world_size` processes as `rank`, through the TCP store at `addr:port`
    /// (rank 0 serves it; see [`TcpStore::connect`]). Every rank calls it. A job of one rank
    /// needs no store (`addr` and `port` are ignored).
    ///
    /// Errors: the store's ([`Error::Store`]: a rank missing, the port taken); this rank's
    /// address cannot be found or listened on ([`Error::InvalidArgument`] naming the address
    /// and the variables that choose it); a peer cannot be connected to (naming its rank and
    /// address) or failed meanwhile ([`Error::PeerFailed`]); a thread cannot be started.
    pub fn connect(
        rank: usize,
        world_size: usize,
        addr: &str,
        port: u16,
        config: TcpConfig,
    ) -> Result<Arc<TcpProcessGroup>> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "tcp group: rank {rank} of {world_size} ranks"
            )));
        }
        let deadline = || Instant::now() + config.timeout;
        if world_size == 1 {
            let (local, listening) = Net::listen(std::net::Ipv4Addr::LOCALHOST.into())?;
            let net = listening.join(0, vec![net::show(local)], deadline())?;
            return TcpProcessGroup::root(net, config);
        }
        let store = TcpStore::connect(addr, port, rank, world_size, config.timeout)?;
        let listened = net::local_ip(addr, port).and_then(Net::listen);
        let published = match &listened {
            Ok((local, _)) => format!("\u{0}{}", net::show(*local)),
            Err(e) => format!("\u{1}{e}"),
        };
        store.set(&addr_key(rank), published.as_bytes())?;
        let (_, listening) = listened?;
        let mut addrs = Vec::with_capacity(world_size);
        for j in 0..world_size {
            let value = String::from_utf8_lossy(&store.get(&addr_key(j))?).into_owned();
            match value.split_at_checked(1) {
                Some(("\u{0}", a)) => addrs.push(a.to_string()),
                Some(("\u{1}", reason)) => {
                    return Err(Error::PeerFailed {
                        op: "tcp group creation".into(),
                        rank,
                        failed_rank: j,
                        reason: reason.to_string(),
                    })
                }
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "store key {:?}: not a value of this version",
                        addr_key(j)
                    )))
                }
            }
        }
        let net = listening.join(rank, addrs, deadline())?;
        let group = TcpProcessGroup::root(net, config)?;
        store.barrier("candle-fsdp/tcp/connected")?;
        Ok(group)
    }

    /// The root group over the job's `net`.
    fn root(net: Arc<Net>, config: TcpConfig) -> Result<Arc<TcpProcessGroup>> {
        let ws = net.addrs.len();
        let core = Core {
            rank: net.rank,
            world_size: ws,
            root_ranks: (0..ws).collect(),
            timeout: config.timeout,
            net,
            prefix: "g-".into(),
        };
        let setup = core.connect(0)?;
        let default = core.connect(1)?;
        TcpProcessGroup::create(Arc::new(core), setup, default)
    }

    fn create(core: Arc<Core>, setup: Comm, default: Comm) -> Result<Arc<TcpProcessGroup>> {
        Ok(Arc::new(TcpProcessGroup {
            device: Device::Cpu,
            setup: Mutex::new(Setup {
                seq: 0,
                comm: setup,
                comms: 2,
            }),
            streams: HostStreams::new("tcp", core.rank, default)?,
            core,
        }))
    }

    /// The configured collective timeout.
    pub fn timeout(&self) -> Duration {
        self.core.timeout
    }

    /// Enqueues `body` as an operation of `kind` on `stream`.
    fn issue<T, F>(&self, stream: &CommStream, kind: OpKind, body: F) -> Work<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Ctx<'_>) -> Result<T> + Send + 'static,
    {
        let (core, on_panic) = (Arc::clone(&self.core), Arc::clone(&self.core));
        self.streams.issue(
            stream,
            kind,
            move |message: &str| {
                on_panic.net.abort(
                    on_panic.root_ranks[on_panic.rank],
                    &format!("comm stream panicked: {message}"),
                )
            },
            move |comm: &mut Comm, seq, op: &str| {
                body(&mut Ctx {
                    core: &core,
                    comm,
                    seq,
                    op,
                })
            },
        )
    }

    /// Records `e` as this rank's failure (a setup step failed half-way: peers must not wait).
    fn abort_self(&self, e: &Error) {
        self.core
            .net
            .abort(self.core.root_ranks[self.core.rank], &e.message());
    }
}

impl ProcessGroup for TcpProcessGroup {
    fn rank(&self) -> usize {
        self.core.rank
    }

    fn world_size(&self) -> usize {
        self.core.world_size
    }

    fn backend(&self) -> &'static str {
        "tcp"
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn new_stream(&self, name: &str) -> Result<CommStream> {
        let mut setup = self.setup.lock();
        setup.seq += 1;
        let (seq, index) = (setup.seq, setup.comms);
        let op = format!("new_stream #{seq} ({name:?})");
        let mut post = Post::new(Kind::NewStream, seq);
        post.bytes = Some(RawBytes::of(name.as_bytes()));
        post.index = Some(index);
        let core = &*self.core;
        Ctx {
            core,
            comm: &mut setup.comm,
            seq,
            op: &op,
        }
        .exchange(&post, name.as_bytes())?;
        let comm = core.connect(index).inspect_err(|e| self.abort_self(e))?;
        setup.comms += 1;
        self.streams.add(comm, name)
    }

    fn default_stream(&self) -> CommStream {
        self.streams.default_stream()
    }

    host_collectives!();

    fn new_group(&self, ranks: &[usize]) -> Result<Option<Arc<dyn ProcessGroup>>> {
        let mut setup = self.setup.lock();
        setup.seq += 1;
        let seq = setup.seq;
        let op = format!("new_group #{seq} ({ranks:?})");
        let bytes: Vec<u8> = ranks.iter().flat_map(|r| r.to_ne_bytes()).collect();
        let mut post = Post::new(Kind::NewGroup, seq);
        post.bytes = Some(RawBytes::of(&bytes));
        let core = &*self.core;
        Ctx {
            core,
            comm: &mut setup.comm,
            seq,
            op: &op,
        }
        .exchange(&post, &bytes)?;
        check_ranks(&op, ranks, core.world_size)?;
        drop(setup);
        let Some(local) = ranks.iter().position(|&r| r == core.rank) else {
            return Ok(None);
        };
        let sub = Core {
            rank: local,
            world_size: ranks.len(),
            root_ranks: ranks.iter().map(|&r| core.root_ranks[r]).collect(),
            timeout: core.timeout,
            net: Arc::clone(&core.net),
            prefix: format!("{}s{seq}-", core.prefix),
        };
        let comms = sub
            .connect(0)
            .and_then(|s| Ok((s, sub.connect(1)?)))
            .inspect_err(|e| self.abort_self(e))?;
        let group = TcpProcessGroup::create(Arc::new(sub), comms.0, comms.1)?;
        Ok(Some(group as Arc<dyn ProcessGroup>))
    }

    fn abort(&self, reason: &str) {
        self.core
            .net
            .abort(self.core.root_ranks[self.core.rank], reason);
    }

    fn set_observer(&self, observer: Option<Arc<dyn CommObserver>>) {
        self.streams.set_observer(observer);
    }
}

impl Drop for TcpProcessGroup {
    fn drop(&mut self) {
        self.streams.close();
        self.setup.get_mut().comm.leave(self.core.rank);
    }
}

/// Runs `f` on this process's rank of a TCP job of `world_size` processes that meet through
/// the store at `addr:port` ([`TcpProcessGroup::connect`]; the group wrapped in
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
    let group = TcpProcessGroup::connect(rank, world_size, addr, port, config);
    host_stream::run_process_rank(rank, group, f)
}
