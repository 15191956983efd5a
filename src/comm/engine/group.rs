//! [`HostGroup`]: the one [`ProcessGroup`] of the host backends (threads, shared memory, TCP,
//! MPI), over a [`Transport`] that each backend provides.
//!
//! The group owns what every such backend does the same way: the rank's streams (one thread
//! each, [`HostStreams`]), the numbering and naming of operations, the setup communicator on
//! which stream and sub-group creation are agreed (a descriptor exchange validated on every
//! rank, then the rank list checked by [`check_ranks`]), the observer, panics turned into a job
//! abort, and the departure of a dropped handle. A transport only moves bytes: it runs one
//! collective on one of its communicators, agrees on a setup descriptor, opens a communicator,
//! splits off a sub-group and aborts the job (and, for the thread backend on a GPU, issues a
//! device operation). The collectives themselves are written once per family: over messages
//! ([`super::messages`]: tcp, MPI) and over shared buffers ([`super::board`]: threads, shm).

use std::sync::Arc;
use std::time::Duration;

use candle_core::{Device, Tensor};
use parking_lot::Mutex;

use super::check_ranks;
use super::streams::{HostStreams, StreamComm};
use crate::comm::buffer::{Kind, Post, RawBytes};
use crate::comm::{Call, CommObserver, CommStream, OpKind, ProcessGroup, ReduceOp, Work};
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

    /// This rank in the group.
    fn rank(&self) -> usize;
    /// Ranks of the group.
    fn world_size(&self) -> usize;
    /// How long a rank waits for its peers.
    fn timeout(&self) -> Duration;
    /// The device of the group's buffers ([`ProcessGroup::device`]).
    fn device(&self) -> Device {
        Device::Cpu
    }
    /// Runs `collective` as operation `op` on `comm` (every rank of the group runs the same
    /// ones, in the same order, on the same stream). Argument problems are reported through the
    /// descriptor exchange, so every rank fails the same way.
    fn run(&self, comm: &mut Self::Comm, op: Op<'_>, collective: Collective<'_>) -> Result<()>;
    /// Exchanges `post` (a setup operation's descriptor; `bytes` its argument) over the setup
    /// communicator and validates every rank's (the same verdict on every rank).
    fn agree(&self, setup: &mut Self::Comm, op: Op<'_>, post: &Post, bytes: &[u8]) -> Result<()>;
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
        streams: &HostStreams<Self::Comm>,
        stream: &CommStream,
        kind: OpKind,
        value: V,
        collective: Option<(Call, Tensor, Option<Tensor>)>,
    ) -> Work<V> {
        let _ = (streams, stream, kind, value, collective);
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

/// One rank's handle on a group of a host backend: the [`ProcessGroup`] of shared memory, TCP
/// and MPI (see their module docs for their algorithms and failure handling).
///
/// Dropping the handle closes its streams (after the work already queued on them) and leaves
/// its communicators: peers still waiting for it fail with [`crate::Error::PeerExited`].
pub(crate) struct HostGroup<T: Transport> {
    transport: Arc<T>,
    device: Device,
    setup: Mutex<Setup<T::Comm>>,
    streams: HostStreams<T::Comm>,
}

impl<T: Transport> std::fmt::Debug for HostGroup<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostGroup")
            .field("backend", &T::BACKEND)
            .field("rank", &self.transport.rank())
            .field("world_size", &self.transport.world_size())
            .field("timeout", &self.transport.timeout())
            .finish()
    }
}

impl<T: Transport> HostGroup<T> {
    /// A group over `transport`, its setup communicator and the communicator of its default
    /// stream (whose thread starts now).
    ///
    /// Errors: the default stream's thread cannot be started (the rank then leaves the setup
    /// communicator, so peers waiting for it fail instead of hanging).
    pub(crate) fn new(transport: T, mut setup: T::Comm, default: T::Comm) -> Result<Arc<Self>> {
        let streams = match HostStreams::new(T::BACKEND, transport.rank(), default) {
            Ok(streams) => streams,
            Err(e) => {
                setup.leave(transport.rank());
                return Err(e);
            }
        };
        Ok(Arc::new(HostGroup {
            streams,
            device: transport.device(),
            transport: Arc::new(transport),
            setup: Mutex::new(Setup {
                seq: 0,
                comm: setup,
                comms: 2,
            }),
        }))
    }

    /// Enqueues `collective` (of kind `kind`) on `stream`; the work returns `value`.
    fn issue<V: Send + 'static>(
        &self,
        stream: &CommStream,
        kind: OpKind,
        value: V,
        body: impl FnOnce(&T, &mut T::Comm, Op<'_>, &V) -> Result<()> + Send + 'static,
    ) -> Work<V> {
        let (transport, on_panic) = (Arc::clone(&self.transport), Arc::clone(&self.transport));
        self.streams.issue(
            stream,
            kind,
            move |message: &str| on_panic.abort(&format!("comm stream panicked: {message}")),
            move |comm: &mut T::Comm, seq, name: &str| {
                body(&transport, comm, Op { seq, name }, &value)?;
                Ok(value)
            },
        )
    }

    /// Enqueues collective `call` on `stream`: `buf` is the output (or in-place buffer), handed
    /// back by the work, `input` the input of all-gather and reduce-scatter.
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
            let streams = &self.streams;
            return (self.transport).issue_device(streams, stream, call.kind(), buf, collective);
        }
        self.issue(stream, call.kind(), buf, move |t, comm, op, buf| {
            t.run(comm, op, Some((call, buf, input.as_ref())))
        })
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
        post.bytes = Some(RawBytes::of(bytes));
        post.index = new_index.then_some(setup.comms);
        self.transport.agree(&mut setup.comm, op, &post, bytes)?;
        then(&self.transport, &mut setup, op)
    }
}

impl<T: Transport> ProcessGroup for HostGroup<T> {
    fn rank(&self) -> usize {
        self.transport.rank()
    }

    fn world_size(&self) -> usize {
        self.transport.world_size()
    }

    fn backend(&self) -> &'static str {
        T::BACKEND
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn new_stream(&self, name: &str) -> Result<CommStream> {
        let stream_op = |seq| format!("new_stream #{seq} ({name:?})");
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
        self.streams.add(comm, name)
    }

    fn default_stream(&self) -> CommStream {
        self.streams.default_stream()
    }

    fn all_gather(&self, stream: &CommStream, input: &Tensor, output: Tensor) -> Work<Tensor> {
        self.issue_call(stream, Call::AllGather, output, Some(input))
    }

    fn reduce_scatter(
        &self,
        stream: &CommStream,
        input: &Tensor,
        output: Tensor,
        op: ReduceOp,
    ) -> Work<Tensor> {
        self.issue_call(stream, Call::ReduceScatter(op), output, Some(input))
    }

    fn all_reduce(&self, stream: &CommStream, buf: Tensor, op: ReduceOp) -> Work<Tensor> {
        self.issue_call(stream, Call::AllReduce(op), buf, None)
    }

    fn broadcast(&self, stream: &CommStream, buf: Tensor, root: usize) -> Work<Tensor> {
        self.issue_call(stream, Call::Broadcast(root), buf, None)
    }

    fn reduce(&self, stream: &CommStream, buf: Tensor, root: usize, op: ReduceOp) -> Work<Tensor> {
        self.issue_call(stream, Call::Reduce(root, op), buf, None)
    }

    fn barrier(&self, stream: &CommStream) -> Work<()> {
        #[cfg(feature = "cuda")]
        if self.transport.on_device() {
            let streams = &self.streams;
            return (self.transport).issue_device(streams, stream, OpKind::Barrier, (), None);
        }
        self.issue(stream, OpKind::Barrier, (), |t, comm, op, _| {
            t.run(comm, op, None)
        })
    }

    fn new_group(&self, ranks: &[usize]) -> Result<Option<Arc<dyn ProcessGroup>>> {
        let bytes: Vec<u8> = ranks.iter().flat_map(|r| r.to_ne_bytes()).collect();
        let group_op = |seq| format!("new_group #{seq} ({ranks:?})");
        let sub = self.setup(Kind::NewGroup, group_op, &bytes, false, |t, setup, op| {
            check_ranks(op.name, ranks, t.world_size())?;
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
        self.streams.set_observer(observer);
    }

    fn timeout(&self) -> Option<Duration> {
        Some(self.transport.timeout())
    }
}

impl<T: Transport> Drop for HostGroup<T> {
    fn drop(&mut self) {
        self.streams.close();
        let rank = self.transport.rank();
        self.setup.get_mut().comm.leave(rank);
    }
}
