//! [`HostGroup`]: the one [`ProcessGroup`] of the host backends (threads, shared memory, TCP,
//! MPI), over a [`Transport`] that each backend provides (what each side owns: design/comm.md,
//! "What the backends share"). The collectives themselves are written once per family: over
//! messages ([`super::messages`]: tcp, MPI) and over shared buffers ([`super::board`]: threads,
//! shm).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use candle_core::{Device, Tensor};
use parking_lot::Mutex;

use super::streams::{HostStream, Issued, Job, StreamComm};
use super::{check_ranks, run_stream_op};
use crate::comm::buffer::{rank_list, shortened, Kind, Post};
use crate::comm::{
    foreign_stream, Call, CommObserver, CommStream, OpKind, ProcessGroup, Work, DEFAULT_STREAM,
};
use crate::error::Result;

/// One operation as a transport sees it: its sequence number on its communicator and its name
/// (e.g. `all_gather #12 (stream all_gather)`, `new_group #3 ([0, 1])`), which errors quote.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Op<'a> {
    /// Sequence number of the operation on its stream (or among the setup operations).
    pub seq: u64,
    /// The operation's name.
    pub name: &'a str,
}

/// A rank's place in its group: its rank, the group's size, and how long it waits for its
/// peers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Place {
    pub rank: usize,
    pub world_size: usize,
    pub timeout: Duration,
}

impl Place {
    pub(crate) fn new(rank: usize, world_size: usize, timeout: Duration) -> Place {
        Place {
            rank,
            world_size,
            timeout,
        }
    }
}

/// One rank's operation as the collectives of a family see it: the rank, the group's size and
/// the operation's sequence number ([`super::board::Board`] and [`super::messages::Link`] build
/// on it).
pub(crate) trait Operation {
    /// This rank in the group.
    fn rank(&self) -> usize;
    /// Ranks of the group.
    fn world_size(&self) -> usize;
    /// Sequence number of the operation.
    fn seq(&self) -> u64;

    /// The other ranks of the group, in rank order.
    fn peers(&self) -> Vec<usize> {
        let rank = self.rank();
        (0..self.world_size()).filter(|&j| j != rank).collect()
    }
}

/// Operation `op` of transport `core` on its communicator `comm`: the context the shm, TCP and
/// MPI transports run a collective or a setup operation in.
pub(crate) struct OpCtx<'a, T: Transport> {
    pub core: &'a T,
    pub comm: &'a mut T::Comm,
    /// Sequence number of the operation on its communicator.
    pub seq: u64,
    /// The operation's name, which errors quote.
    pub op: &'a str,
}

impl<'a, T: Transport> OpCtx<'a, T> {
    pub(crate) fn new(core: &'a T, comm: &'a mut T::Comm, op: Op<'a>) -> Self {
        OpCtx {
            core,
            comm,
            seq: op.seq,
            op: op.name,
        }
    }
}

impl<T: Transport> Operation for OpCtx<'_, T> {
    fn rank(&self) -> usize {
        self.core.place().rank
    }

    fn world_size(&self) -> usize {
        self.core.place().world_size
    }

    fn seq(&self) -> u64 {
        self.seq
    }
}

/// A collective as the group hands it to a transport: which one, its buffer (the output of
/// all-gather and reduce-scatter, else the in-place buffer) and the input of all-gather and
/// reduce-scatter; `None` is a barrier.
pub(crate) type Collective<'a> = Option<(Call, &'a Tensor, Option<&'a Tensor>)>;

/// A member's side of a new group: its transport, its setup communicator and its default
/// stream's.
pub(crate) type Member<T> = (T, <T as Transport>::Comm, <T as Transport>::Comm);

/// What a host backend provides to [`HostGroup`]: its communicators and how to use them.
///
/// Every method runs on one rank; the ones that take the setup communicator are collectives of
/// the whole group, called by every rank in the same order.
pub(crate) trait Transport: Send + Sync + Sized + 'static {
    /// A communicator: the group's setup one and one per stream (each owned by one thread).
    type Comm: StreamComm;
    /// Backend name ([`ProcessGroup::backend`]; stream threads are named by
    /// [`StreamComm::thread_name`], `{backend}-{rank}-{stream}` unless the backend says
    /// otherwise).
    const BACKEND: &'static str;

    /// This rank, the group's size and the timeout.
    fn place(&self) -> Place;
    /// The device of the group's buffers ([`ProcessGroup::device`]).
    fn device(&self) -> Device {
        Device::Cpu
    }
    /// Runs `collective` as operation `op` on `comm` (every rank of the group runs the same
    /// ones, in the same order, on the same stream). Argument problems are reported through the
    /// descriptor exchange, so every rank fails the same way.
    fn run(&self, comm: &mut Self::Comm, op: Op<'_>, collective: Collective<'_>) -> Result<()>;
    /// Exchanges `post` (a setup operation's descriptor, with its argument) over the setup
    /// communicator and validates every rank's (the same verdict on every rank).
    fn agree(&self, setup: &mut Self::Comm, op: Op<'_>, post: &Post) -> Result<()>;
    /// Opens communicator `index` of this group for the stream named `name`, once every rank
    /// agreed to.
    fn open(
        &self,
        setup: &mut Self::Comm,
        op: Op<'_>,
        index: usize,
        name: &str,
    ) -> Result<Self::Comm>;
    /// The sub-group of `ranks` (agreed and checked): a member gets its transport with the
    /// sub-group's setup and default communicators, the others `None`. Every rank of this
    /// group calls it.
    fn split(
        &self,
        setup: &mut Self::Comm,
        op: Op<'_>,
        ranks: &[usize],
    ) -> Result<Option<Member<Self>>>;
    /// Records this rank's failure for the whole job: every rank's pending and later
    /// collectives fail with [`crate::Error::PeerFailed`] naming it.
    fn abort(&self, reason: &str);

    /// True when the group's collectives run on a GPU ([`Transport::issue_device`]) rather
    /// than through [`Transport::run`] (feature `cuda`).
    #[cfg(feature = "cuda")]
    fn on_device(&self) -> bool {
        false
    }

    /// Issues `collective` (buffer and input owned; `None`: a barrier) of kind `kind` on
    /// `stream` as a device operation of a transport [`Transport::on_device`]; the work returns
    /// `value` (feature `cuda`).
    #[cfg(feature = "cuda")]
    fn issue_device<V: Send + 'static>(
        &self,
        group: &HostGroup<Self>,
        stream: &CommStream,
        kind: OpKind,
        value: V,
        collective: Option<(Call, Tensor, Option<Tensor>)>,
    ) -> Work<V> {
        let _ = (group, stream, kind, value, collective);
        unreachable!("only a transport on a device issues device operations")
    }
}

/// Setup operations of one handle: their sequence number, the setup communicator, and how many
/// communicators the group has (setup and streams).
struct Setup<C> {
    seq: u64,
    comm: C,
    comms: usize,
}

/// Identifies a group's streams: a stream handed to another group's collective is refused.
static NEXT_GROUP_ID: AtomicU64 = AtomicU64::new(1);

/// One rank's handle on a group of a host backend: the [`ProcessGroup`] of the thread backend,
/// shared memory, TCP and MPI (see their module docs for their algorithms and failure
/// handling). It owns its default stream, the streams created since and the observer its
/// operations report to.
///
/// Dropping the handle closes its streams (after the work already queued on them; their
/// threads are joined, except the current one) and leaves its communicators: peers still
/// waiting for it fail with [`crate::Error::PeerExited`].
pub(crate) struct HostGroup<T: Transport> {
    transport: Arc<T>,
    device: Device,
    setup: Mutex<Setup<T::Comm>>,
    id: u64,
    default: CommStream,
    streams: Mutex<Vec<Weak<HostStream<T::Comm>>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    observer: Mutex<Option<Arc<dyn CommObserver>>>,
    /// Set when the handle is dropped: each stream thread then leaves its communicator.
    closing: Arc<AtomicBool>,
}

impl<T: Transport> HostGroup<T> {
    /// A group over `transport`, its setup communicator and the communicator of its default
    /// stream (whose thread starts now).
    ///
    /// Errors: the default stream's thread cannot be started (the rank then leaves the setup and
    /// default communicators, so peers waiting for it fail instead of hanging).
    pub(crate) fn new(transport: T, mut setup: T::Comm, default: T::Comm) -> Result<Arc<Self>> {
        let id = NEXT_GROUP_ID.fetch_add(1, Ordering::Relaxed);
        let rank = transport.place().rank;
        let closing = Arc::new(AtomicBool::new(false));
        let started = HostStream::start(T::BACKEND, id, rank, default, DEFAULT_STREAM, &closing);
        let (stream, thread) = started.inspect_err(|_| setup.leave(rank))?;
        Ok(Arc::new(HostGroup {
            device: transport.device(),
            transport: Arc::new(transport),
            setup: Mutex::new(Setup {
                seq: 0,
                comm: setup,
                comms: 2,
            }),
            id,
            streams: Mutex::new(vec![Arc::downgrade(&stream)]),
            default: CommStream::new(DEFAULT_STREAM, stream),
            threads: Mutex::new(vec![thread]),
            observer: Mutex::new(None),
            closing,
        }))
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
        make: impl FnOnce(Issued) -> (W, Job<T::Comm>),
    ) -> Result<W> {
        let Some(hs) = stream
            .backend_state::<HostStream<T::Comm>>()
            .filter(|s| s.owner == self.id)
        else {
            return Err(foreign_stream(kind, self.transport.place().rank, stream));
        };
        let mut slot = hs.slot.lock();
        slot.seq += 1;
        let issued = Issued {
            seq: slot.seq,
            op: format!(
                "{} #{} (stream {})",
                kind.name(),
                slot.seq,
                shortened(&hs.name)
            ),
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

    /// Enqueues `body` as an operation of `kind` on `stream`, reported to the current observer;
    /// the work returns `value`. A panic in the body aborts the job (on the stream's thread) and
    /// the operation then fails with [`crate::Error::RankPanicked`].
    fn issue<V: Send + 'static>(
        &self,
        stream: &CommStream,
        kind: OpKind,
        value: V,
        body: impl FnOnce(&T, &mut T::Comm, Op<'_>, &V) -> Result<()> + Send + 'static,
    ) -> Work<V> {
        let (transport, rank) = (Arc::clone(&self.transport), self.transport.place().rank);
        let issued = self.issue_job(stream, kind, |is: Issued| {
            let (work, completer) = Work::pending(is.op.clone(), rank, &*is.stream);
            let job: Job<T::Comm> = Box::new(move |comm| {
                let observer = is.observer.as_ref();
                let observed = observer.and_then(|o| o.op_started(&is.stream, kind, &is.op));
                let abort = |message: &str| {
                    transport.abort(&format!("comm stream panicked: {message}"));
                };
                let op = Op {
                    seq: is.seq,
                    name: &is.op,
                };
                let run = || body(&transport, comm, op, &value).map(|()| value);
                let result = run_stream_op(&is.op, rank, run, abort);
                drop(observed);
                completer.complete(result);
            });
            (work, job)
        });
        issued.unwrap_or_else(|e| Work::ready(Err(e)))
    }

    /// Runs a setup operation of kind `kind` with argument `bytes` (and `index`, the
    /// communicator a new stream gets) named `name`: agrees on it over the setup communicator,
    /// then runs `then` with the setup communicator still held.
    fn setup<R>(
        &self,
        kind: Kind,
        name: impl FnOnce(u64) -> String,
        bytes: &[u8],
        new_index: bool,
        then: impl FnOnce(&T, &mut Setup<T::Comm>, Op<'_>) -> Result<R>,
    ) -> Result<R> {
        let mut setup = self.setup.lock();
        setup.seq += 1;
        let seq = setup.seq;
        let name = name(seq);
        let op = Op { seq, name: &name };
        let mut post = Post::new(kind, seq);
        post.bytes = Some(bytes.to_vec());
        post.index = new_index.then_some(setup.comms);
        self.transport.agree(&mut setup.comm, op, &post)?;
        then(&self.transport, &mut setup, op)
    }
}

impl<T: Transport> ProcessGroup for HostGroup<T> {
    fn rank(&self) -> usize {
        self.transport.place().rank
    }

    fn world_size(&self) -> usize {
        self.transport.place().world_size
    }

    fn backend(&self) -> &'static str {
        T::BACKEND
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn new_stream(&self, name: &str) -> Result<CommStream> {
        let stream_op = |seq| format!("new_stream #{seq} ({:?})", shortened(name));
        let comm = self.setup(
            Kind::NewStream,
            stream_op,
            name.as_bytes(),
            true,
            |t, setup, op| {
                let comm = t.open(&mut setup.comm, op, setup.comms, name)?;
                setup.comms += 1;
                Ok(comm)
            },
        )?;
        let (id, rank) = (self.id, self.transport.place().rank);
        let (stream, thread) = HostStream::start(T::BACKEND, id, rank, comm, name, &self.closing)?;
        let mut threads = self.threads.lock();
        threads.retain(|t| !t.is_finished());
        threads.push(thread);
        let mut streams = self.streams.lock();
        streams.retain(|s| s.strong_count() > 0);
        streams.push(Arc::downgrade(&stream));
        Ok(CommStream::new(Arc::clone(&stream.name), stream))
    }

    fn default_stream(&self) -> CommStream {
        self.default.clone()
    }

    fn issue_call(
        &self,
        stream: &CommStream,
        call: Call,
        buf: Tensor,
        input: Option<&Tensor>,
    ) -> Work<Tensor> {
        let input = input.cloned();
        #[cfg(feature = "cuda")]
        if self.transport.on_device() {
            let collective = Some((call, buf.clone(), input));
            return (self.transport).issue_device(self, stream, call.kind(), buf, collective);
        }
        self.issue(stream, call.kind(), buf, move |t, comm, op, buf| {
            t.run(comm, op, Some((call, buf, input.as_ref())))
        })
    }

    fn barrier(&self, stream: &CommStream) -> Work<()> {
        #[cfg(feature = "cuda")]
        if self.transport.on_device() {
            return (self.transport).issue_device(self, stream, OpKind::Barrier, (), None);
        }
        self.issue(stream, OpKind::Barrier, (), |t, comm, op, _| {
            t.run(comm, op, None)
        })
    }

    fn new_group(&self, ranks: &[usize]) -> Result<Option<Arc<dyn ProcessGroup>>> {
        let bytes: Vec<u8> = ranks.iter().flat_map(|r| r.to_ne_bytes()).collect();
        let group_op = |seq| format!("new_group #{seq} ({})", rank_list(ranks));
        let sub = self.setup(Kind::NewGroup, group_op, &bytes, false, |t, setup, op| {
            check_ranks(op.name, ranks, t.place().world_size)?;
            t.split(&mut setup.comm, op, ranks)
        })?;
        match sub {
            Some((t, setup, default)) => Ok(Some(HostGroup::new(t, setup, default)? as _)),
            None => Ok(None),
        }
    }

    fn abort(&self, reason: &str) {
        self.transport.abort(reason);
    }

    fn set_observer(&self, observer: Option<Arc<dyn CommObserver>>) {
        *self.observer.lock() = observer;
    }

    fn timeout(&self) -> Option<Duration> {
        Some(self.transport.place().timeout)
    }
}

impl<T: Transport> Drop for HostGroup<T> {
    /// Sets `closing` (each stream thread then leaves its communicator), closes every queue,
    /// joins the threads after the work already queued, except the current thread (a handle
    /// dropped on one of its own streams' threads), then leaves the setup communicator.
    fn drop(&mut self) {
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
        let rank = self.transport.place().rank;
        self.setup.get_mut().comm.leave(rank);
    }
}
