//! The NCCL process group (feature `nccl`): one process per GPU, collectives enqueued on CUDA
//! comm streams, ordered against Candle's compute stream with CUDA events.
//!
//! [`NcclGroup`] is this process's rank; [`crate::launch::Launcher::Nccl`] runs a job on it.
//! NCCL refuses two ranks on one GPU: several ranks on one GPU use the thread backend on CUDA
//! ([`crate::comm::threads::new_group_on_gpu`]).
//!
//! # Streams and communicators
//!
//! An NCCL communicator has no stream of its own in the C API, but this backend keeps one
//! communicator per comm stream, as cudarc's `Comm` does (it enqueues on the stream it was
//! created with): operations of one communicator run in issue order, so an all-gather and a
//! reduce-scatter on one communicator could not overlap. The default stream's communicator is
//! made at creation (`ncclCommInitRank`, its unique id carried by the bootstrap); every
//! [`ProcessGroup::new_stream`] makes a CUDA stream on Candle's context
//! ([`crate::device::cuda::new_stream`]) and a communicator `ncclCommSplit` from the default one (a
//! collective of the group, no bootstrap needed). [`ProcessGroup::new_group`] splits the same
//! way (non-members pass `NCCL_SPLIT_NOCOLOR`). Operations of different streams may run at
//! the same time on the GPU; as NCCL requires of concurrent communicators (and FSDP does),
//! every rank issues them in the same order.
//!
//! # One collective
//!
//! On the caller's thread, without blocking it:
//!
//! 1. the buffers are checked locally (the thread backend's wording: [`Error::BadBuffer`] names
//!    this rank; NCCL cannot check peers' arguments, so ranks that disagree hang until the
//!    watchdog's timeout, as with NCCL in PyTorch);
//! 2. the comm stream waits for an event recorded on the compute stream (the inputs as of the
//!    call: the gradients copied in before a reduce-scatter);
//! 3. the NCCL call is enqueued on the comm stream, then a completion event recorded after it;
//! 4. the [`Work`] (built with [`Work::with_completion`]) holds that event:
//!    [`Work::wait_compute`] makes the compute stream wait for it (`cuStreamWaitEvent`: the
//!    forward waits for the all-gather's event, the host does not), [`Work::wait`] polls it.
//!
//! # Event tracking versus explicit ordering
//!
//! The streams are ordered by the events above only, never by cudarc's per-slice event
//! tracking (which keeps one read event per slice and cannot see peers' raw-address reads):
//! the reasons are decision 41 of `design/decisions.md`. The buffers are still accessed through
//! `device_ptr`/`device_ptr_mut` on the comm stream, so that cudarc's own bookkeeping stays
//! true when tracking is on.
//!
//! # Buffer lifetime and failures
//!
//! FSDP2's rule (design/gpu.md, "When memory is freed"): every operation keeps clones of its
//! tensors until the compute stream waited for its completion event (`KeepAlive` in
//! `engine::cuda`). The root communicator's unique id travels over the job's TCP store
//! ([`crate::comm::bootstrap`]) or `MPI_Bcast` (features `nccl` and `mpi`, under `mpirun`);
//! the watchdog (`watchdog`) turns a timeout, an NCCL asynchronous error,
//! [`ProcessGroup::abort`] or a peer's failure notice (store bootstrap only; under `mpirun`
//! NCCL's error or the timeout) into `ncclCommAbort` on every communicator of the group, and
//! every pending and later operation fails naming it (`all_gather #12 (stream all_gather)`).
//!
//! # Differences from the thread backend
//!
//! Reductions are NCCL's (order and rounding are NCCL's choice: not bitwise the CPU
//! backend's); `Avg` is NCCL's `ncclAvg`; i16 buffers move (all-gather, broadcast) but are not
//! reduced (NCCL has no 16-bit integer type); mismatched arguments across ranks are not
//! detected (a hang until the timeout). [`ProcessGroup::barrier`] is an all-reduce of one
//! element on the stream.

mod meet;
mod raw;
mod watchdog;

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use candle_core::cuda_backend::CudaStorage;
use candle_core::{CudaDevice, DType, Device, Layout, Tensor};
use cudarc::driver::{CudaEvent, CudaStream};
use cudarc::nccl::{result, sys};
use parking_lot::Mutex;

#[cfg(feature = "mpi")]
use self::meet::mpi_unique_id;
use self::meet::watch_store;
pub use self::raw::UniqueId;
use self::raw::{move_dtype, reduce_dtype, RawComm};
use self::watchdog::{Failure, Family, NcclOp};
use super::buffer::{problem, rank_list, shortened, validate, Kind, Post, Problem};
use super::engine::check_ranks;
use super::engine::cuda::{addr, raw_read, raw_write, with_cuda_storage, CudaDone, KeepAlive};
use super::{Call, CommObserver, CommStream, OpKind, ProcessGroup, ReduceOp, Work, DEFAULT_STREAM};
use crate::comm::bootstrap;
use crate::comm::store::TcpStore;
use crate::error::{Error, Result};

/// Configuration of an NCCL process group: [`crate::comm::GroupConfig`].
pub type NcclConfig = crate::comm::GroupConfig;

/// How the ranks of an NCCL job get their communicator's unique id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NcclBootstrap {
    /// A job of one rank: the id is made here.
    Single,
    /// Through the job's TCP store at `addr:port` (`MASTER_ADDR`, `MASTER_PORT`), served by
    /// rank 0 ([`TcpStore`]); failures are also published there.
    Store {
        /// Rank 0's host.
        addr: &'static str,
        /// The store's port.
        port: u16,
    },
    /// Broadcast over `MPI_COMM_WORLD` from rank 0 (a job started by `mpirun`).
    #[cfg(feature = "mpi")]
    Mpi,
}

static NEXT_GROUP_ID: AtomicU64 = AtomicU64::new(1);

/// The backend's state behind a [`CommStream`]: a CUDA stream and its communicator.
struct NcclStream {
    owner: u64,
    name: Arc<str>,
    stream: Arc<CudaStream>,
    comm: Arc<RawComm>,
    /// Sequence number of the last operation issued (held from numbering to enqueue, so that
    /// the enqueue order is the numbering order).
    seq: Mutex<u64>,
    /// The one f32 that barriers all-reduce.
    scratch: Tensor,
}

/// One process's rank of an NCCL group; see the [module docs](self).
pub struct NcclGroup {
    id: u64,
    rank: usize,
    world_size: usize,
    device: Device,
    cuda: CudaDevice,
    compute: Arc<CudaStream>,
    family: Arc<Family>,
    default_comm: Arc<RawComm>,
    default_stream: CommStream,
    /// Sequence number of the last setup operation (`new_stream`, `new_group`).
    setup: Mutex<u64>,
    observer: Mutex<Option<Arc<dyn CommObserver>>>,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device", &self.device)
            .finish()
    }
}

impl Call {
    /// The NCCL function of the collective.
    fn nccl_name(self) -> &'static str {
        match self {
            Call::AllGather => "ncclAllGather",
            Call::ReduceScatter(_) => "ncclReduceScatter",
            Call::AllReduce(_) => "ncclAllReduce",
            Call::Broadcast(_) => "ncclBroadcast",
            Call::Reduce(..) => "ncclReduce",
        }
    }
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
    }
}

/// A [`Error::BadBuffer`] from validating this rank's post alone names rank 0 (its index):
/// name this rank instead.
fn as_rank(mut e: Error, rank: usize) -> Error {
    if let Error::BadBuffer { rank: r, .. } = &mut e {
        *r = rank;
    }
    e
}

impl NcclGroup {
    /// This process's rank `rank` of a group of `world_size` ranks on `device` (a CUDA device:
    /// its stream is the compute stream), the unique id obtained through `bootstrap`. Every
    /// rank calls it.
    ///
    /// Errors: `device` is not CUDA ([`Error::Device`]); the bootstrap's (the store
    /// naming missing ranks, MPI's); NCCL's ([`Error::Nccl`], e.g. two ranks on one GPU);
    /// the driver's ([`Error::Cuda`]).
    pub fn new(
        device: &Device,
        rank: usize,
        world_size: usize,
        bootstrap: NcclBootstrap,
        config: NcclConfig,
    ) -> Result<Arc<NcclGroup>> {
        match bootstrap {
            NcclBootstrap::Single => {
                if world_size != 1 || rank != 0 {
                    return Err(Error::value(
                        "the world size of NcclBootstrap::Single",
                        "1 (a job of one rank, rank 0)",
                        format_args!("rank {rank} of {world_size}"),
                    ));
                }
                NcclGroup::from_unique_id(device, 0, 1, UniqueId::new()?, config)
            }
            NcclBootstrap::Store { addr, port } => {
                let store = Arc::new(TcpStore::connect(
                    addr,
                    port,
                    rank,
                    world_size,
                    config.timeout,
                )?);
                let id =
                    bootstrap::share_from_rank0(&*store, bootstrap::UNIQUE_ID_KEY, 128, || {
                        UniqueId::new().map(|id| id.0.to_vec())
                    })?;
                let id = UniqueId::from_bytes(&id, bootstrap::UNIQUE_ID_KEY)?;
                let group = NcclGroup::from_unique_id(device, rank, world_size, id, config)?;
                watch_store(&group.family, store)?;
                Ok(group)
            }
            #[cfg(feature = "mpi")]
            NcclBootstrap::Mpi => {
                let id = mpi_unique_id(rank, world_size)?;
                NcclGroup::from_unique_id(device, rank, world_size, id, config)
            }
        }
    }

    /// A group whose root communicator is made from `id` (every rank passes the same id, made
    /// by [`UniqueId::new`] on one of them and carried by any means). No peer notices: failures
    /// reach the peers through NCCL or their timeout.
    ///
    /// Errors: as [`NcclGroup::new`].
    pub fn from_unique_id(
        device: &Device,
        rank: usize,
        world_size: usize,
        id: UniqueId,
        config: NcclConfig,
    ) -> Result<Arc<NcclGroup>> {
        crate::comm::engine::run::check_rank("NCCL group", rank, world_size)?;
        let cuda = crate::device::cuda::cuda_device(device, "NCCL process group")?.clone();
        let family = Family::new(rank, config.timeout);
        let ctx = crate::device::cuda::context(&cuda);
        let comm = Arc::new(RawComm::init(&ctx, id, rank, world_size)?);
        NcclGroup::create(device, cuda, rank, world_size, family, comm)
    }

    /// The handle over `comm` (this rank's `rank` of `world_size`) in `family`.
    fn create(
        device: &Device,
        cuda: CudaDevice,
        rank: usize,
        world_size: usize,
        family: Arc<Family>,
        comm: Arc<RawComm>,
    ) -> Result<Arc<NcclGroup>> {
        family.register(&comm);
        let id = NEXT_GROUP_ID.fetch_add(1, Ordering::Relaxed);
        let stream = new_nccl_stream(id, &cuda, DEFAULT_STREAM, Arc::clone(&comm))?;
        family.group_opened()?;
        Ok(Arc::new(NcclGroup {
            id,
            rank,
            world_size,
            device: device.clone(),
            compute: cuda.cuda_stream(),
            cuda,
            family,
            default_comm: comm,
            default_stream: stream,
            setup: Mutex::new(0),
            observer: Mutex::new(None),
        }))
    }

    /// The configured timeout.
    pub fn timeout(&self) -> Duration {
        self.family.timeout
    }

    /// Issues `call` as an operation of kind `kind` on `stream` (a barrier: an all-reduce of the
    /// stream's one-element scratch, `output` `None`): `output` is the output or in-place
    /// buffer, `input` the input of all-gather and reduce-scatter; the work returns `value`.
    fn issue<V>(
        &self,
        stream: &CommStream,
        kind: OpKind,
        call: Call,
        output: Option<&Tensor>,
        input: Option<&Tensor>,
        value: V,
    ) -> Work<V> {
        let issued = (stream.backend_state::<NcclStream>())
            .filter(|s| s.owner == self.id)
            .ok_or_else(|| crate::comm::foreign_stream(kind, self.rank, stream))
            .and_then(|ns| {
                // The stream's order lock is held until the operation is enqueued.
                let mut seq = ns.seq.lock();
                *seq += 1;
                let op = format!("{} #{} (stream {})", kind.name(), *seq, shortened(&ns.name));
                self.enqueue(ns, kind, call, &op, output, input)
            });
        match issued {
            Ok(done) => Work::with_completion(value, done),
            Err(e) => Work::ready(Err(e)),
        }
    }

    /// Checks, orders and enqueues one operation of kind `kind` (`call`; a barrier: an
    /// all-reduce of the stream's one-element scratch, `output` `None`); see the module docs.
    fn enqueue(
        &self,
        ns: &NcclStream,
        kind: OpKind,
        call: Call,
        op: &str,
        output: Option<&Tensor>,
        input: Option<&Tensor>,
    ) -> Result<Arc<NcclOp>> {
        let output = output.unwrap_or(&ns.scratch);
        if let Some(f) = self.family.failure() {
            return Err(f.error_for(0, op, self.rank));
        }
        if let Some(problem) = problem(output, input, &self.device) {
            return Err(problem.to_error(op, self.rank, Kind::Op(kind)));
        }
        let which = if input.is_some() { "output" } else { "buffer" };
        if call.op().is_some() && reduce_dtype(output.dtype()).is_none() {
            return Err(Error::BadBuffer {
                op: op.to_string(),
                rank: self.rank,
                what: format!("{} {which} dtype", kind.name()),
                expected: "a dtype NCCL reduces: f32, bf16, f16, f64, u8, u32, i32 or i64".into(),
                found: format!("{:?}", output.dtype()),
            });
        }
        let ready = crate::device::cuda::record(&self.compute, false)?;
        let observer = self.observer.lock().clone();
        let observed = observer
            .as_ref()
            .and_then(|o| o.op_started(&ns.name, kind, op));
        let timing =
            kind != OpKind::Barrier && observer.as_ref().is_some_and(|o| o.times_device_ops());
        let done = with_cuda_storage(output, input, |dst, dst_l, src| {
            self.enqueue_body(ns, call, op, &ready, timing, dst, dst_l, src)
        })
        .unwrap_or_else(|| {
            CudaDone::failed(Problem::Aliased.to_error(op, self.rank, Kind::Op(kind)))
        });
        drop(observed);
        let CudaDone {
            final_event,
            timing,
            result,
        } = done;
        result?;
        let event = final_event.ok_or_else(|| {
            Error::Cuda(format!("{op} on rank {}: no completion event", self.rank))
        })?;
        if let (Some(o), Some((start, end))) = (&observer, timing) {
            o.device_op(&ns.name, kind, op, start, end);
        }
        let mut tensors = vec![output.clone()];
        tensors.extend(input.cloned());
        Ok(self.track(ns, op, event, tensors))
    }

    /// Operation `op` on `ns`, enqueued up to `event`, watched by the family; `tensors` are
    /// released once the compute stream waited on `event`.
    fn track(
        &self,
        ns: &NcclStream,
        op: &str,
        event: Arc<CudaEvent>,
        tensors: Vec<Tensor>,
    ) -> Arc<NcclOp> {
        let keep = KeepAlive {
            event: Some(Arc::clone(&event)),
            consumer: Arc::clone(&self.compute),
            tensors,
        };
        let pending = NcclOp::new(
            op.to_string(),
            self.rank,
            event,
            Arc::clone(&self.compute),
            self.family.timeout,
            keep,
            Arc::clone(&ns.comm),
        );
        self.family.track(Arc::clone(&pending));
        pending
    }

    /// The part of [`NcclGroup::enqueue`] that runs under Candle's storage locks.
    #[allow(clippy::too_many_arguments)]
    fn enqueue_body(
        &self,
        ns: &NcclStream,
        call: Call,
        op: &str,
        ready: &cudarc::driver::CudaEvent,
        timing: bool,
        dst: &mut CudaStorage,
        dst_l: &Layout,
        src: Option<(&CudaStorage, &Layout)>,
    ) -> CudaDone {
        let stream = &ns.stream;
        if let Err(e) = stream.wait(ready) {
            return CudaDone::failed(Error::Cuda(format!(
                "{op} on rank {}: comm stream waiting for the compute stream: {e:?}",
                self.rank
            )));
        }
        let (out, _out_guard) = raw_write(dst, dst_l, stream);
        let input = src.map(|(s, l)| raw_read(s, l, stream));
        let post = Post::of_call(call, 0, out, input.as_ref().map(|(i, _)| *i));
        if let Err(e) = validate(op, self.world_size, &[post]) {
            return CudaDone::failed(as_rank(e, self.rank));
        }
        let timing_start = timing
            .then(|| crate::device::cuda::record(stream, true).ok())
            .flatten();
        let cu_stream = stream.cu_stream() as sys::cudaStream_t;
        let buf = addr(out, 0);
        // The input of all-gather and reduce-scatter, else the in-place buffer.
        let (src, src_len) = input
            .as_ref()
            .map_or((buf, out.len), |(i, _)| (addr(*i, 0), i.len));
        let (dt, count) = match call {
            Call::AllGather => move_dtype(out.dtype, src_len),
            Call::Broadcast(_) => move_dtype(out.dtype, out.len),
            _ => (reduce_dtype(out.dtype).expect("checked at issue"), out.len),
        };
        let (src, buf) = (src as *const c_void, buf as *mut c_void);
        let ctx = stream.context();
        let name = format!("{} ({op})", call.nccl_name());
        // SAFETY: every address is a live Candle buffer of this rank's GPU whose lengths and
        // dtypes were validated above (all-gather: output = world_size * input; reduce-scatter:
        // input = world_size * output); the comm stream waited for the compute stream that
        // produced them, the tensors are kept alive until the compute stream waited for the
        // completion event (`KeepAlive`), and `cu_stream` is the communicator's own stream.
        let enqueued = unsafe {
            ns.comm.call(ctx, &name, |comm| match call {
                Call::AllGather => result::all_gather(src, buf, count, dt, comm, cu_stream),
                Call::ReduceScatter(rop) => {
                    result::reduce_scatter(src, buf, count, dt, nccl_op(rop), comm, cu_stream)
                }
                Call::AllReduce(rop) => {
                    result::all_reduce(src, buf, count, dt, nccl_op(rop), comm, cu_stream)
                }
                Call::Broadcast(root) => {
                    result::broadcast(src, buf, count, dt, root as i32, comm, cu_stream)
                }
                Call::Reduce(root, rop) => {
                    let rop = nccl_op(rop);
                    result::reduce(src, buf, count, dt, rop, root as i32, comm, cu_stream)
                }
            })
        };
        if let Err(e) = enqueued {
            self.fail_on(&e);
            return CudaDone::failed(e);
        }
        let timing = timing_start
            .and_then(|start| Some((start, crate::device::cuda::record(stream, true).ok()?)));
        match crate::device::cuda::record(stream, false) {
            Ok(ev) => CudaDone {
                final_event: Some(Arc::new(ev)),
                timing,
                result: Ok(()),
            },
            Err(e) => {
                self.family.fail(
                    Failure::Cuda {
                        message: e.to_string(),
                    },
                    true,
                );
                CudaDone::failed(e)
            }
        }
    }

    /// Fails the family after an NCCL or CUDA error of an enqueue.
    fn fail_on(&self, e: &Error) {
        let failure = match e {
            Error::Nccl { call, message, .. } => Failure::Nccl {
                call: call.clone(),
                message: message.clone(),
            },
            other => Failure::Cuda {
                message: other.to_string(),
            },
        };
        self.family.fail(failure, true);
    }
}

/// A comm stream named `name` of group `owner`: a CUDA stream on `cuda`'s context and `comm`.
fn new_nccl_stream(
    owner: u64,
    cuda: &CudaDevice,
    name: &str,
    comm: Arc<RawComm>,
) -> Result<CommStream> {
    let stream = crate::device::cuda::new_stream(cuda)?;
    let scratch = Tensor::zeros(1, DType::F32, &Device::Cuda(cuda.clone())).map_err(|e| {
        Error::Cuda(format!(
            "allocating the barrier buffer of stream {name}: {e:?}"
        ))
    })?;
    let ns = Arc::new(NcclStream {
        owner,
        name: name.into(),
        stream,
        comm,
        seq: Mutex::new(0),
        scratch,
    });
    Ok(CommStream::new(Arc::clone(&ns.name), ns))
}

impl ProcessGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn new_stream(&self, name: &str) -> Result<CommStream> {
        let mut setup = self.setup.lock();
        *setup += 1;
        let op = format!("new_stream #{} ({:?})", *setup, shortened(name));
        if let Some(f) = self.family.failure() {
            return Err(f.error_for(0, &op, self.rank));
        }
        let ctx = crate::device::cuda::context(&self.cuda);
        // A failed split fails the family: the peers are inside the same collective split.
        let comm = (self.default_comm.split(&ctx, Some(self.rank), &op))
            .inspect_err(|e| self.fail_on(e))?;
        let comm = Arc::new(comm.expect("a member gets a communicator (or an error)"));
        self.family.register(&comm);
        new_nccl_stream(self.id, &self.cuda, name, comm)
    }

    fn default_stream(&self) -> CommStream {
        self.default_stream.clone()
    }

    fn issue_call(
        &self,
        stream: &CommStream,
        call: Call,
        buf: Tensor,
        input: Option<&Tensor>,
    ) -> Work<Tensor> {
        self.issue(stream, call.kind(), call, Some(&buf), input, buf.clone())
    }

    /// An all-reduce (sum) of one f32 on the stream: complete once every rank's comm stream
    /// reached it, and (through the comm stream's wait) every rank's compute stream as of the
    /// call.
    fn barrier(&self, stream: &CommStream) -> Work<()> {
        let call = Call::AllReduce(ReduceOp::Sum);
        self.issue(stream, OpKind::Barrier, call, None, None, ())
    }

    fn new_group(&self, ranks: &[usize]) -> Result<Option<Arc<dyn ProcessGroup>>> {
        let mut setup = self.setup.lock();
        *setup += 1;
        let op = format!("new_group #{} ({})", *setup, rank_list(ranks));
        if let Some(f) = self.family.failure() {
            return Err(f.error_for(0, &op, self.rank));
        }
        // Every rank passes the same list (the contract), so every rank fails here alike.
        check_ranks(&op, ranks, self.world_size)?;
        let position = ranks.iter().position(|&r| r == self.rank);
        let ctx = crate::device::cuda::context(&self.cuda);
        let sub =
            (self.default_comm.split(&ctx, position, &op)).inspect_err(|e| self.fail_on(e))?;
        match (sub, position) {
            (Some(comm), Some(local)) => {
                let group = NcclGroup::create(
                    &self.device,
                    self.cuda.clone(),
                    local,
                    ranks.len(),
                    Arc::clone(&self.family),
                    Arc::new(comm),
                )?;
                Ok(Some(group as Arc<dyn ProcessGroup>))
            }
            _ => Ok(None),
        }
    }

    fn abort(&self, reason: &str) {
        self.family.fail(
            Failure::Rank {
                failed_rank: self.family.world_rank,
                reason: reason.to_string(),
            },
            true,
        );
    }

    fn set_observer(&self, observer: Option<Arc<dyn CommObserver>>) {
        *self.observer.lock() = observer;
    }

    /// The watchdog's timeout ([`NcclConfig::timeout`]).
    fn timeout(&self) -> Option<Duration> {
        Some(self.family.timeout)
    }
}

impl Drop for NcclGroup {
    /// Does not block: the watchdog keeps watching the operations still in flight, and the
    /// communicators are freed (`ncclCommAbort`, local) once their last operation and stream
    /// handle are gone.
    fn drop(&mut self) {
        self.family.group_closed();
    }
}

/// Runs `f` on this process's rank of an NCCL job on GPU `gpu` (the handle wrapped in
/// [`Instrumented`](super::Instrumented)) and returns its result (one element). When `f` fails or panics, the group
/// is aborted with the error's text: the peers' pending and later collectives fail (through
/// the store's notices, NCCL, or their timeout).
///
/// Errors (the single element): the GPU cannot be opened; the group cannot be made (see
/// [`NcclGroup::new`]); `f`'s.
pub fn run<T, F>(
    rank: usize,
    world_size: usize,
    gpu: usize,
    bootstrap: NcclBootstrap,
    config: NcclConfig,
    f: F,
) -> Vec<Result<T>>
where
    F: Fn(Arc<dyn ProcessGroup>) -> Result<T>,
{
    let group = crate::device::cuda::open_device(gpu)
        .and_then(|device| NcclGroup::new(&device, rank, world_size, bootstrap, config));
    super::engine::run::run_process_rank(rank, group, f)
}
