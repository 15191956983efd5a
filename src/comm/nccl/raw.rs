//! NCCL at the level of its C API (cudarc's `nccl::result` and `nccl::sys`): communicators
//! that can be aborted from another thread, the process-wide lock every NCCL call takes, the
//! unique id, dtypes and error messages.
//!
//! cudarc's safe `nccl::Comm` is not used: it cannot be split (`ncclCommSplit`), its handle
//! cannot be aborted from a watchdog thread, and its collectives take cudarc slices rather than
//! the offsets into Candle's storage this backend works with.

use std::ffi::{c_int, CStr};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::time::Duration;

use candle_core::DType;
use cudarc::driver::CudaContext;
use cudarc::nccl::{result, sys};
use parking_lot::Mutex;

use crate::error::{Error, Result};

/// Every NCCL call of the process holds this lock: NCCL forbids issuing operations to
/// communicators of one device from several threads at once ("Thread Safety" in NCCL's user
/// guide), and a process drives one device. The watchdog's abort is the one call that may
/// proceed without it (see [`RawComm::abort`]).
static NCCL_LOCK: Mutex<()> = Mutex::new(());

/// How long an abort waits for the NCCL lock before aborting without it.
const ABORT_LOCK_PATIENCE: Duration = Duration::from_secs(5);

/// `ncclSplit`'s "not a member" colour (`NCCL_SPLIT_NOCOLOR`).
const SPLIT_NOCOLOR: c_int = -1;

/// The 128 bytes every rank of a communicator must share before creating it
/// (`ncclUniqueId`); rank 0 makes it with [`UniqueId::new`], the bootstrap carries it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId(pub [u8; 128]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId(..)")
    }
}

impl UniqueId {
    /// A fresh id (`ncclGetUniqueId`: it also opens the bootstrap socket rank 0 listens on).
    ///
    /// Errors: NCCL cannot be loaded or fails ([`Error::Nccl`]).
    pub fn new() -> Result<UniqueId> {
        let _lock = NCCL_LOCK.lock();
        let id = result::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", 0, e, None))?;
        Ok(UniqueId(id.internal.map(|c| c as u8)))
    }

    /// The id from the bytes a bootstrap carried.
    ///
    /// Errors: not 128 bytes ([`Error::Shape`], naming `source`).
    pub fn from_bytes(bytes: &[u8], source: &str) -> Result<UniqueId> {
        let arr: [u8; 128] = bytes.try_into().map_err(|_| {
            Error::shape(
                format_args!("{source}: an NCCL unique id"),
                "128 bytes",
                format_args!("{} bytes", bytes.len()),
            )
        })?;
        Ok(UniqueId(arr))
    }

    fn to_sys(self) -> sys::ncclUniqueId {
        let internal = self.0.map(|b| b as std::ffi::c_char);
        sys::ncclUniqueId { internal }
    }
}

/// NCCL's description of `code`, plus the communicator's last error when there is one.
pub(super) fn describe(code: sys::ncclResult_t, comm: Option<sys::ncclComm_t>) -> String {
    /// The text of `p`, a NUL-terminated string alive for the call (`None`: null).
    unsafe fn text(p: *const std::ffi::c_char) -> Option<String> {
        // SAFETY: per the function contract.
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }
    // SAFETY: ncclGetErrorString returns a pointer to a static NUL-terminated string.
    let base = unsafe { text(sys::ncclGetErrorString(code)) };
    let base = base.unwrap_or_else(|| format!("{code:?}"));
    // SAFETY: ncclGetLastError takes a live communicator (or null) and returns a pointer to a
    // NUL-terminated string owned by NCCL, valid until the next NCCL call on this thread; it is
    // copied at once.
    let last = unsafe { text(sys::ncclGetLastError(comm.unwrap_or(std::ptr::null_mut()))) };
    let last = last.unwrap_or_default();
    if last.is_empty() {
        format!("{base} ({code:?})")
    } else {
        format!("{base} ({code:?}): {last}")
    }
}

/// [`Error::Nccl`] for `call` failing with `e` on `rank`.
pub(super) fn nccl_error(
    call: impl Into<String>,
    rank: usize,
    e: result::NcclError,
    comm: Option<sys::ncclComm_t>,
) -> Error {
    Error::Nccl {
        call: call.into(),
        rank,
        message: describe(e.0, comm),
    }
}

/// NCCL's type for `dtype` in reductions; `None` for i16, which NCCL does not have.
pub(super) fn reduce_dtype(dtype: DType) -> Option<sys::ncclDataType_t> {
    use sys::ncclDataType_t as D;
    Some(match dtype {
        DType::F32 => D::ncclFloat32,
        DType::F64 => D::ncclFloat64,
        DType::F16 => D::ncclFloat16,
        DType::BF16 => D::ncclBfloat16,
        DType::U8 => D::ncclUint8,
        DType::U32 => D::ncclUint32,
        DType::I32 => D::ncclInt32,
        DType::I64 => D::ncclInt64,
        _ => return None,
    })
}

/// NCCL's type and element count for moving `len` elements of `dtype` without arithmetic
/// (all-gather, broadcast): the reduction type, or bytes for i16.
pub(super) fn move_dtype(dtype: DType, len: usize) -> (sys::ncclDataType_t, usize) {
    match reduce_dtype(dtype) {
        Some(d) => (d, len),
        None => (sys::ncclDataType_t::ncclUint8, len * dtype.size_in_bytes()),
    }
}

/// One NCCL communicator. It enqueues on the stream the caller passes (the raw API takes
/// one per call); this backend always passes the stream the communicator was made for.
pub(super) struct RawComm {
    /// The handle; null once aborted.
    comm: AtomicPtr<sys::ncclComm>,
    /// This rank in the communicator.
    pub rank: usize,
}

// SAFETY: the handle is only used under `NCCL_LOCK` (or by the abort, see `abort`), and NCCL
// communicators may be used from any thread one at a time.
unsafe impl Send for RawComm {}
// SAFETY: as above; shared references only read the handle atomically.
unsafe impl Sync for RawComm {}

impl RawComm {
    /// `ncclCommInitRank`: rank `rank` of a communicator of `world_size` ranks on the GPU of
    /// `ctx` (bound to this thread first). Blocks until every rank joined.
    ///
    /// Errors: NCCL's ([`Error::Nccl`]: e.g. two ranks on one GPU, a rank missing), or the
    /// context cannot be bound ([`Error::Cuda`]).
    pub(super) fn init(
        ctx: &CudaContext,
        id: UniqueId,
        rank: usize,
        world_size: usize,
    ) -> Result<RawComm> {
        let _lock = NCCL_LOCK.lock();
        ctx.bind_to_thread()
            .map_err(|e| Error::Cuda(format!("binding the GPU before ncclCommInitRank: {e:?}")))?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; `id` was made by ncclGetUniqueId on rank 0 and every
        // rank passes the same one with its own rank; the current device is this rank's GPU.
        unsafe {
            result::comm_init_rank(&mut comm, world_size as c_int, id.to_sys(), rank as c_int)
        }
        .map_err(|e| {
            nccl_error(
                format!("ncclCommInitRank (rank {rank} of {world_size})"),
                rank,
                e,
                None,
            )
        })?;
        Ok(RawComm::new(comm, rank))
    }

    fn new(comm: sys::ncclComm_t, rank: usize) -> RawComm {
        RawComm {
            comm: AtomicPtr::new(comm),
            rank,
        }
    }

    /// `ncclCommSplit` of this communicator (a collective of all its ranks): members pass
    /// `Some(key)` (their rank in the new communicator follows the keys' order), the others
    /// `None` and get `None`. The new communicator inherits this one's configuration.
    ///
    /// Errors: NCCL's, this communicator was aborted, or NCCL returned no communicator for a
    /// member (which must fail: its peers would wait for it in the new communicator).
    pub(super) fn split(
        &self,
        ctx: &CudaContext,
        key: Option<usize>,
        what: &str,
    ) -> Result<Option<RawComm>> {
        let mut new: sys::ncclComm_t = std::ptr::null_mut();
        let color = if key.is_some() { 0 } else { SPLIT_NOCOLOR };
        let call = format!("ncclCommSplit ({what})");
        // SAFETY: one NCCL call on the live communicator `call` passes; out-pointer to a local;
        // a null config makes the child inherit the parent's configuration.
        unsafe {
            self.call(ctx, &call, |comm| {
                let key = key.unwrap_or(0) as c_int;
                sys::ncclCommSplit(comm, color, key, &mut new, std::ptr::null_mut()).result()
            })
        }?;
        match key {
            None => Ok(None),
            Some(_) if new.is_null() => Err(Error::Nccl {
                call,
                rank: self.rank,
                message: "NCCL returned no communicator for a member".into(),
            }),
            Some(key) => Ok(Some(RawComm::new(new, key))),
        }
    }

    /// The live handle, or the error of a call on an aborted communicator.
    fn handle(&self, what: &str) -> Result<sys::ncclComm_t> {
        let comm = self.comm.load(Ordering::Acquire);
        if comm.is_null() {
            return Err(Error::Nccl {
                call: what.to_string(),
                rank: self.rank,
                message: "the communicator was aborted".to_string(),
            });
        }
        Ok(comm)
    }

    /// Runs one NCCL call on this communicator under the process's NCCL lock, with `ctx`
    /// bound to the thread; `call` names it in errors (e.g. `ncclAllGather (all_gather #3
    /// (stream all_gather))`).
    ///
    /// # Safety
    ///
    /// `f` must make one NCCL call on the communicator it is given, with buffers and a stream
    /// that are valid for the enqueued operation (the caller's contract with its events).
    pub(super) unsafe fn call(
        &self,
        ctx: &CudaContext,
        call: &str,
        f: impl FnOnce(sys::ncclComm_t) -> std::result::Result<result::NcclStatus, result::NcclError>,
    ) -> Result<()> {
        let _lock = NCCL_LOCK.lock();
        let comm = self.handle(call)?;
        ctx.bind_to_thread()
            .map_err(|e| Error::Cuda(format!("binding the GPU before {call}: {e:?}")))?;
        f(comm).map_err(|e| nccl_error(call, self.rank, e, Some(comm)))?;
        Ok(())
    }

    /// `ncclCommGetAsyncError`: the asynchronous error NCCL recorded on this communicator
    /// (e.g. a peer's connection closed), if any. Skipped (`None`) while another thread holds
    /// the NCCL lock, or once aborted.
    pub(super) fn async_error(&self) -> Option<String> {
        let _lock = NCCL_LOCK.try_lock()?;
        let comm = self.handle("").ok()?;
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: live communicator (checked under the lock); out-pointer to a local.
        let rc = unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
        if rc != sys::ncclResult_t::ncclSuccess {
            return Some(describe(rc, Some(comm)));
        }
        match state {
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => None,
            other => Some(describe(other, Some(comm))),
        }
    }

    /// True once [`RawComm::abort`] ran.
    pub(super) fn is_aborted(&self) -> bool {
        self.comm.load(Ordering::Acquire).is_null()
    }

    /// `ncclCommAbort`, once: stops the communicator's pending operations on the device and
    /// frees it; later calls fail with "the communicator was aborted".
    ///
    /// It takes the NCCL lock, waiting at most a few seconds for it: if another thread is
    /// stuck inside an NCCL call on a hung peer, the abort proceeds without the lock, since
    /// aborting the communicator is the only way to release that thread (NCCL's abort flag is
    /// what its blocking loops poll) and waiting would hang the process for good.
    pub(super) fn abort(&self) {
        abort_all(std::slice::from_ref(&self));
    }

    /// The abort itself, the NCCL lock held (or given up on) by the caller.
    fn abort_unlocked(&self) {
        let comm = self.comm.swap(std::ptr::null_mut(), Ordering::AcqRel);
        if comm.is_null() {
            return;
        }
        // SAFETY: a live communicator, aborted exactly once (the swap); no call starts on it
        // afterwards (`handle` checks the pointer under the lock).
        if let Err(e) = unsafe { result::comm_abort(comm) } {
            tracing::warn!(
                "rank {}: ncclCommAbort failed: {}",
                self.rank,
                describe(e.0, None)
            );
        }
    }
}

/// [`RawComm::abort`] of every communicator of `comms`, taking (or giving up on) the NCCL lock
/// once for all of them.
pub(super) fn abort_all<C: std::ops::Deref<Target = RawComm>>(comms: &[C]) {
    if comms.iter().all(|c| c.is_aborted()) {
        return;
    }
    let lock = NCCL_LOCK.try_lock_for(ABORT_LOCK_PATIENCE);
    if lock.is_none() {
        tracing::warn!(
            "another thread holds the NCCL lock (stuck in an NCCL call?); aborting the \
             communicators without it"
        );
    }
    for c in comms {
        c.abort_unlocked();
    }
}

impl Drop for RawComm {
    /// Frees the communicator with `ncclCommAbort` (local, never waits for peers; the group
    /// waits for its operations to complete before dropping it, see the watchdog).
    fn drop(&mut self) {
        self.abort();
    }
}
