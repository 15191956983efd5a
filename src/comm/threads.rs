//! In-process thread backend: `world_size` ranks as threads of one process, exchanging data
//! through shared memory.
//!
//! [`new_group`] creates one [`ThreadProcessGroup`] handle per rank; [`run_ranks`] /
//! [`run_ranks_ok`] run a closure on every rank in its own thread (named `rank-{r}`) and collect
//! the results.
//!
//! # Streams
//!
//! Each rank handle owns one OS thread per [`Stream`] (named `rank-{r}-{stream}`), fed through a
//! channel of jobs and executing them in issue order. Every collective method enqueues a job and
//! returns a [`Work`] at once; the job runs the collective on the comm thread and completes the
//! `Work`.
//!
//! # Algorithm
//!
//! For each stream the group shares one *communicator* (a rendezvous: mutex, condition variable,
//! per-rank arrival counters and posts). A collective runs in the comm thread of every rank:
//!
//! 1. **Post** (barrier 1): the rank publishes raw pointers, lengths and dtypes of its buffers (plus
//!    the reduce op and root) and waits until every rank posted.
//! 2. **Validate**: every rank checks *all* posts with the same deterministic code, so an
//!    inconsistent call yields the same [`Error::CollectiveMismatch`] / [`Error::BadBuffer`] on
//!    every rank (and nobody hangs).
//! 3. **Copy**: each rank does its own share of the data movement by reading its peers' buffers
//!    through the posted pointers (bandwidth-optimal: every byte is read once per destination):
//!    - all-gather: rank r copies every rank j's input into `output[j*n..(j+1)*n]`;
//!    - reduce-scatter: rank r reduces `input_j[r*n..(r+1)*n]` over ranks j = 0, 1, … in order,
//!      accumulating in f32 and rounding once;
//!    - all-reduce (in place, two phases): rank r reduces chunk r of all buffers into chunk r of
//!      its own buffer; barrier; rank r copies chunk j from rank j for every j ≠ r;
//!    - broadcast: non-roots copy the root's buffer; reduce: the root reduces into its buffer.
//! 4. **Done** (barrier 2): nobody returns — and so nobody frees or reuses a buffer a peer may
//!    still read — until every rank finished copying.
//!
//! # Failures
//!
//! Waits for barrier 1 wake up on every event of the group and fail with
//! [`Error::PeerFailed`] once a rank called [`ProcessGroup::abort`] (the first failure wins),
//! [`Error::PeerExited`] when a missing rank's handle was dropped (or its stream stopped), and
//! [`Error::Timeout`] after [`ThreadGroupConfig::timeout`] (which also aborts the group, so the
//! other ranks stop promptly too). A collective issued after the group was aborted fails at once.
//! Once every rank passed barrier 1 the collective always completes: the remaining waits only
//! cover the bounded copy phase and must not be abandoned, since a peer may still be reading
//! this rank's buffers.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::slice;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use candle_core::DType;
use crossbeam::channel::{unbounded, Sender};
use half::{bf16, f16};
use parking_lot::{Condvar, Mutex};

use super::{CommBuffer, CommStats, CommStatsSnapshot, ProcessGroup, ReduceOp, Stream, Work};
use crate::error::{Error, Result};
use crate::trace::{Lane, SpanKind, Tracer};

/// Configuration of a thread process group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadGroupConfig {
    /// How long a rank waits, in a collective, for the other ranks to join it before failing with
    /// [`Error::Timeout`] (measured from the moment the collective starts running on the rank's
    /// comm stream). Default: 300 s.
    pub timeout: Duration,
}

impl Default for ThreadGroupConfig {
    fn default() -> Self {
        ThreadGroupConfig {
            timeout: Duration::from_secs(300),
        }
    }
}

/// Kind of collective (names used in op names and errors).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    AllGather,
    ReduceScatter,
    AllReduce,
    Broadcast,
    Reduce,
    Barrier,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::AllGather => "all_gather",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::AllReduce => "all_reduce",
            Kind::Broadcast => "broadcast",
            Kind::Reduce => "reduce",
            Kind::Barrier => "barrier",
        }
    }

    fn stream(self) -> Stream {
        match self {
            Kind::AllGather => Stream::AllGather,
            Kind::ReduceScatter => Stream::ReduceScatter,
            _ => Stream::Collective,
        }
    }
}

/// Address, length and dtype of one rank's buffer, as posted to the communicator.
#[derive(Debug, Clone, Copy)]
struct RawBuf {
    ptr: *mut u8,
    len: usize,
    dtype: DType,
}

// SAFETY: a `RawBuf` is a plain address; it is only dereferenced by the collective code below,
// under the rendezvous protocol that keeps the buffer alive, unmoved and free of conflicting
// accesses while peers use it (see `Ctx::rendezvous` and the SAFETY comments at each read).
unsafe impl Send for RawBuf {}
// SAFETY: as above; sharing the address itself is harmless.
unsafe impl Sync for RawBuf {}

impl RawBuf {
    /// Address of a buffer that peers only read (or only whose length/dtype matter).
    fn of(buf: &CommBuffer) -> RawBuf {
        let ptr = match buf {
            CommBuffer::F32(v) => v.as_ptr() as *mut u8,
            CommBuffer::BF16(v) => v.as_ptr() as *mut u8,
            CommBuffer::F16(v) => v.as_ptr() as *mut u8,
        };
        RawBuf {
            ptr,
            len: buf.len(),
            dtype: buf.dtype(),
        }
    }

    /// Address of a buffer that its owner writes through this pointer (in-place collectives).
    fn of_mut(buf: &mut CommBuffer) -> RawBuf {
        let len = buf.len();
        let dtype = buf.dtype();
        let ptr = match buf {
            CommBuffer::F32(v) => v.as_mut_ptr() as *mut u8,
            CommBuffer::BF16(v) => v.as_mut_ptr() as *mut u8,
            CommBuffer::F16(v) => v.as_mut_ptr() as *mut u8,
        };
        RawBuf { ptr, len, dtype }
    }

    fn typed<T>(self) -> *mut T {
        self.ptr as *mut T
    }
}

/// What one rank published for one collective.
#[derive(Debug, Clone, Copy)]
struct Post {
    kind: Kind,
    seq: u64,
    input: Option<RawBuf>,
    output: Option<RawBuf>,
    op: Option<ReduceOp>,
    root: Option<usize>,
}

/// Rendezvous state of one stream, shared by all ranks.
struct CommState {
    /// Barrier arrivals of each rank on this stream (monotonic except for the retraction of a
    /// failed first barrier, see `Ctx::rendezvous`). Acts as the generation counter.
    arrivals: Vec<u64>,
    /// Posts, double-buffered by the parity of the generation at which they were made, so that a
    /// fast rank posting its next collective never overwrites a post a slow rank has yet to read.
    posts: [Vec<Option<Post>>; 2],
    /// Ranks whose comm thread for this stream exited (no further arrival will come).
    finished: Vec<bool>,
}

struct Communicator {
    stream: Stream,
    state: Mutex<CommState>,
    cv: Condvar,
}

/// State shared by all rank handles of one group.
struct Shared {
    world_size: usize,
    timeout: Duration,
    comms: [Communicator; 3],
    /// First failure: `(failed_rank, reason)`.
    abort: Mutex<Option<(usize, String)>>,
    /// Ranks whose handle was dropped.
    departed: Vec<AtomicBool>,
}

impl Shared {
    fn new(world_size: usize, timeout: Duration) -> Shared {
        let comm = |stream| Communicator {
            stream,
            state: Mutex::new(CommState {
                arrivals: vec![0; world_size],
                posts: [vec![None; world_size], vec![None; world_size]],
                finished: vec![false; world_size],
            }),
            cv: Condvar::new(),
        };
        Shared {
            world_size,
            timeout,
            comms: Stream::ALL.map(comm),
            abort: Mutex::new(None),
            departed: (0..world_size).map(|_| AtomicBool::new(false)).collect(),
        }
    }

    fn aborted(&self) -> Option<(usize, String)> {
        self.abort.lock().clone()
    }

    /// Records the first failure and wakes every waiter.
    fn abort(&self, rank: usize, reason: &str) {
        {
            let mut slot = self.abort.lock();
            if slot.is_none() {
                *slot = Some((rank, reason.to_string()));
            }
        }
        self.notify_all();
    }

    /// Wakes every waiter of every communicator. Taking each lock orders the notification after
    /// any waiter's check of the state that changed (no lost wake-up).
    fn notify_all(&self) {
        for comm in &self.comms {
            let _guard = comm.state.lock();
            comm.cv.notify_all();
        }
    }
}

/// Aborts the process if dropped during a panic: used while peers may read this rank's buffers,
/// where unwinding (and freeing the buffers) would be a use-after-free for them.
struct AbortOnUnwind<'a>(&'a str);

impl Drop for AbortOnUnwind<'_> {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!(
                "candle-fsdp: panic in the shared-memory phase of {}; aborting the process",
                self.0
            );
            std::process::abort();
        }
    }
}

/// Element types of communication buffers.
trait Elem: Copy + Send + Sync + 'static {
    fn widen(self) -> f32;
    fn narrow(v: f32) -> Self;
}

impl Elem for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
    #[inline(always)]
    fn narrow(v: f32) -> Self {
        v
    }
}

impl Elem for bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn narrow(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn narrow(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// Elements reduced per tile (the f32 accumulator stays in L1).
const TILE: usize = 2048;

#[inline(always)]
fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || a >= b {
        a
    } else {
        b
    }
}

#[inline(always)]
fn nan_min(a: f32, b: f32) -> f32 {
    if a.is_nan() || a <= b {
        a
    } else {
        b
    }
}

/// `dst[i] = op over j in 0..srcs.len() (in order) of srcs[j][i]`, accumulated in f32 and
/// rounded once; `Avg` multiplies the sum by `1 / world_size` (skipped when `world_size == 1`).
///
/// # Safety
///
/// Every `srcs[j]` must be valid for reads of `len` elements and `dst` valid for writes of `len`
/// elements for the whole call; no other thread may write any of these ranges nor access the
/// `dst` range meanwhile. `dst` may be *equal* to one of the sources (in place) but must not
/// partially overlap any source.
unsafe fn reduce_into<T: Elem>(
    srcs: &[*const T],
    dst: *mut T,
    len: usize,
    op: ReduceOp,
    world_size: usize,
) {
    let scale = (op == ReduceOp::Avg && world_size > 1).then(|| 1.0 / world_size as f32);
    let mut tile = [0f32; TILE];
    let mut off = 0;
    while off < len {
        let n = TILE.min(len - off);
        let acc = &mut tile[..n];
        // The shared slices below live only inside their loop iteration and the mutable `dst`
        // slice is created after the last of them is gone, so even in place they never coexist.
        // SAFETY: in bounds (off + n <= len) and readable per the function contract.
        let first = unsafe { slice::from_raw_parts(srcs[0].add(off), n) };
        for (a, &x) in acc.iter_mut().zip(first) {
            *a = x.widen();
        }
        for &src in &srcs[1..] {
            // SAFETY: as above.
            let s = unsafe { slice::from_raw_parts(src.add(off), n) };
            match op {
                ReduceOp::Sum | ReduceOp::Avg => {
                    for (a, &x) in acc.iter_mut().zip(s) {
                        *a += x.widen();
                    }
                }
                ReduceOp::Max => {
                    for (a, &x) in acc.iter_mut().zip(s) {
                        *a = nan_max(*a, x.widen());
                    }
                }
                ReduceOp::Min => {
                    for (a, &x) in acc.iter_mut().zip(s) {
                        *a = nan_min(*a, x.widen());
                    }
                }
            }
        }
        if let Some(k) = scale {
            for a in acc.iter_mut() {
                *a *= k;
            }
        }
        // SAFETY: in bounds, writable and not accessed by anyone else per the function contract;
        // no shared slice of this range is alive any more.
        let out = unsafe { slice::from_raw_parts_mut(dst.add(off), n) };
        for (o, &a) in out.iter_mut().zip(acc.iter()) {
            *o = T::narrow(a);
        }
        off += n;
    }
}

/// Start and length of chunk `j` when `len` elements are split into `world_size` nearly-equal
/// chunks (the first `len % world_size` chunks are one element longer; chunks may be empty).
fn chunk(len: usize, world_size: usize, j: usize) -> (usize, usize) {
    let base = len / world_size;
    let rem = len % world_size;
    (j * base + j.min(rem), base + usize::from(j < rem))
}

fn describe_call(p: &Post) -> String {
    format!("{} #{}", p.kind.name(), p.seq)
}

fn describe_len(what: &str, b: &RawBuf) -> String {
    format!("{what} of {} elements", b.len)
}

/// Checks every rank's post; deterministic, so every rank reaches the same verdict.
fn validate(op: &str, world_size: usize, posts: &[Post]) -> Result<()> {
    let p0 = &posts[0];
    let mismatch = |rank: usize, found: String, expected: String| Error::CollectiveMismatch {
        op: op.to_string(),
        rank,
        found,
        other_rank: 0,
        expected,
    };
    for (j, p) in posts.iter().enumerate().skip(1) {
        if p.kind != p0.kind || p.seq != p0.seq {
            return Err(mismatch(j, describe_call(p), describe_call(p0)));
        }
    }
    for (j, p) in posts.iter().enumerate() {
        // This rank's own buffers must be consistent with each other.
        if let (Some(input), Some(output)) = (&p.input, &p.output) {
            let what = p.kind.name();
            if output.dtype != input.dtype {
                return Err(Error::BadBuffer {
                    op: op.to_string(),
                    rank: j,
                    what: format!("{what} output dtype"),
                    expected: format!("{:?} (the input dtype)", input.dtype),
                    found: format!("{:?}", output.dtype),
                });
            }
            let (whole, shard, whole_name, shard_name) = match p.kind {
                Kind::AllGather => (output, input, "output", "input"),
                _ => (input, output, "input", "output"),
            };
            if world_size.checked_mul(shard.len) != Some(whole.len) {
                return Err(Error::BadBuffer {
                    op: op.to_string(),
                    rank: j,
                    what: format!("{what} {whole_name} length"),
                    expected: format!(
                        "{} elements (world_size {world_size} x {shard_name} {})",
                        world_size.saturating_mul(shard.len),
                        shard.len
                    ),
                    found: format!("{} elements", whole.len),
                });
            }
        }
        if j == 0 {
            continue;
        }
        // ... and agree with rank 0's.
        if let (Some(a), Some(b)) = (&p.input, &p0.input) {
            if a.dtype != b.dtype {
                return Err(mismatch(
                    j,
                    format!("{:?} buffers", a.dtype),
                    format!("{:?} buffers", b.dtype),
                ));
            }
            if a.len != b.len {
                return Err(mismatch(
                    j,
                    describe_len("an input", a),
                    describe_len("an input", b),
                ));
            }
        }
        if p.op != p0.op {
            return Err(mismatch(
                j,
                format!("ReduceOp::{:?}", p.op),
                format!("ReduceOp::{:?}", p0.op),
            ));
        }
        if p.root != p0.root {
            return Err(mismatch(
                j,
                format!("root {:?}", p.root),
                format!("root {:?}", p0.root),
            ));
        }
    }
    if let Some(root) = p0.root {
        if root >= world_size {
            return Err(Error::InvalidArgument(format!(
                "{op}: root {root} is out of range for world size {world_size}"
            )));
        }
    }
    Ok(())
}

/// Context of one collective running on a rank's comm thread.
struct Ctx<'a> {
    shared: &'a Shared,
    comm: &'a Communicator,
    rank: usize,
    seq: u64,
    op: &'a str,
}

impl Ctx<'_> {
    fn peer_failed(&self, failed_rank: usize, reason: String) -> Error {
        Error::PeerFailed {
            op: self.op.to_string(),
            rank: self.rank,
            failed_rank,
            reason,
        }
    }

    fn post(
        &self,
        kind: Kind,
        input: Option<RawBuf>,
        output: Option<RawBuf>,
        op: Option<ReduceOp>,
        root: Option<usize>,
    ) -> Post {
        Post {
            kind,
            seq: self.seq,
            input,
            output,
            op,
            root,
        }
    }

    /// Barrier 1: publishes `post` and waits until every rank posted; returns the generation
    /// reached and every rank's post (index = rank).
    ///
    /// Fails (and retracts this rank's arrival, so that no peer can ever pass this barrier and
    /// read this rank's buffers) on abort, on a departed missing rank, or at the deadline.
    /// Once every rank arrived, the barrier is passed regardless of any later abort: peers may
    /// already be reading this rank's buffers.
    fn rendezvous(&self, post: Post) -> Result<(u64, Vec<Post>)> {
        let ws = self.shared.world_size;
        let start = Instant::now();
        let deadline = start.checked_add(self.shared.timeout);
        let mut st = self.comm.state.lock();
        if let Some((failed_rank, reason)) = self.shared.aborted() {
            return Err(self.peer_failed(failed_rank, reason));
        }
        let target = st.arrivals[self.rank] + 1;
        let parity = (target % 2) as usize;
        st.arrivals[self.rank] = target;
        st.posts[parity][self.rank] = Some(post);
        self.comm.cv.notify_all();
        loop {
            let missing: Vec<usize> = (0..ws).filter(|&j| st.arrivals[j] < target).collect();
            if missing.is_empty() {
                // Copy the posts under the same lock hold that observed the arrivals: no rank
                // can reach generation `target + 2` (same parity) before this rank arrives at
                // `target + 1`, so these slots are stable here.
                let posts = st.posts[parity]
                    .iter()
                    .map(|p| p.expect("every arrived rank posted"))
                    .collect();
                return Ok((target, posts));
            }
            let error = if let Some((failed_rank, reason)) = self.shared.aborted() {
                Some(self.peer_failed(failed_rank, reason))
            } else if let Some(&departed) = missing
                .iter()
                .find(|&&j| st.finished[j] || self.shared.departed[j].load(Ordering::Acquire))
            {
                Some(Error::PeerExited {
                    op: self.op.to_string(),
                    rank: self.rank,
                    departed,
                })
            } else if deadline.is_some_and(|d| Instant::now() >= d) {
                Some(Error::Timeout {
                    op: self.op.to_string(),
                    rank: self.rank,
                    timeout: self.shared.timeout,
                    missing,
                })
            } else {
                None
            };
            if let Some(error) = error {
                st.arrivals[self.rank] = target - 1;
                st.posts[parity][self.rank] = None;
                drop(st);
                if matches!(error, Error::Timeout { .. }) {
                    self.shared
                        .abort(self.rank, &format!("timed out in {}", self.op));
                }
                return Err(error);
            }
            match deadline {
                Some(d) => {
                    self.comm.cv.wait_until(&mut st, d);
                }
                None => self.comm.cv.wait(&mut st),
            }
        }
    }

    /// A barrier after barrier 1 (generation `target`). It cannot fail: every rank passed
    /// barrier 1, so each one is in the bounded copy phase and will arrive; leaving early would
    /// let the caller free buffers that peers still read. Waits are still bounded by the group
    /// timeout, after which a warning is logged and the wait continues.
    fn sync(&self, target: u64) {
        let mut st = self.comm.state.lock();
        st.arrivals[self.rank] = target;
        self.comm.cv.notify_all();
        let mut warned = false;
        while st.arrivals.iter().any(|&a| a < target) {
            match Instant::now().checked_add(self.shared.timeout) {
                Some(deadline) => {
                    if self.comm.cv.wait_until(&mut st, deadline).timed_out() && !warned {
                        warned = true;
                        tracing::warn!(
                            op = self.op,
                            rank = self.rank,
                            stream = self.comm.stream.name(),
                            "peers slow to finish the copy phase; still waiting"
                        );
                    }
                }
                None => self.comm.cv.wait(&mut st),
            }
        }
    }

    fn all_gather(&self, input: &CommBuffer, mut output: CommBuffer) -> Result<CommBuffer> {
        let post = self.post(
            Kind::AllGather,
            Some(RawBuf::of(input)),
            Some(RawBuf::of(&output)),
            None,
            None,
        );
        let (generation, posts) = self.rendezvous(post)?;
        validate(self.op, self.shared.world_size, &posts)?;
        let _guard = AbortOnUnwind(self.op);
        let n = input.len();
        let srcs: Vec<RawBuf> = posts.iter().map(|p| p.input.expect("input")).collect();
        match &mut output {
            CommBuffer::F32(out) => gather(out, &srcs, n),
            CommBuffer::BF16(out) => gather(out, &srcs, n),
            CommBuffer::F16(out) => gather(out, &srcs, n),
        }
        self.sync(generation + 1);
        Ok(output)
    }

    fn reduce_scatter(
        &self,
        input: &CommBuffer,
        mut output: CommBuffer,
        op: ReduceOp,
    ) -> Result<CommBuffer> {
        let post = self.post(
            Kind::ReduceScatter,
            Some(RawBuf::of(input)),
            Some(RawBuf::of(&output)),
            Some(op),
            None,
        );
        let (generation, posts) = self.rendezvous(post)?;
        validate(self.op, self.shared.world_size, &posts)?;
        let _guard = AbortOnUnwind(self.op);
        let n = output.len();
        let start = self.rank * n;
        let srcs: Vec<RawBuf> = posts.iter().map(|p| p.input.expect("input")).collect();
        let ws = self.shared.world_size;
        match &mut output {
            CommBuffer::F32(out) => reduce_shard(out, &srcs, start, op, ws),
            CommBuffer::BF16(out) => reduce_shard(out, &srcs, start, op, ws),
            CommBuffer::F16(out) => reduce_shard(out, &srcs, start, op, ws),
        }
        self.sync(generation + 1);
        Ok(output)
    }

    fn all_reduce(&self, mut buf: CommBuffer, op: ReduceOp) -> Result<CommBuffer> {
        // From here until the end the buffer is only accessed through `mine` (and by peers
        // through the posted copy of it); `buf` itself is not touched until it is returned.
        let mine = RawBuf::of_mut(&mut buf);
        let post = self.post(Kind::AllReduce, Some(mine), None, Some(op), None);
        let (generation, posts) = self.rendezvous(post)?;
        validate(self.op, self.shared.world_size, &posts)?;
        let _guard = AbortOnUnwind(self.op);
        let bufs: Vec<RawBuf> = posts.iter().map(|p| p.input.expect("buffer")).collect();
        let ws = self.shared.world_size;
        let rank = self.rank;
        match mine.dtype {
            DType::F32 => all_reduce_phase_a::<f32>(&bufs, rank, op, ws),
            DType::BF16 => all_reduce_phase_a::<bf16>(&bufs, rank, op, ws),
            _ => all_reduce_phase_a::<f16>(&bufs, rank, op, ws),
        }
        self.sync(generation + 1);
        match mine.dtype {
            DType::F32 => all_reduce_phase_b::<f32>(&bufs, rank, ws),
            DType::BF16 => all_reduce_phase_b::<bf16>(&bufs, rank, ws),
            _ => all_reduce_phase_b::<f16>(&bufs, rank, ws),
        }
        self.sync(generation + 2);
        Ok(buf)
    }

    fn broadcast(&self, mut buf: CommBuffer, root: usize) -> Result<CommBuffer> {
        let post = self.post(
            Kind::Broadcast,
            Some(RawBuf::of(&buf)),
            None,
            None,
            Some(root),
        );
        let (generation, posts) = self.rendezvous(post)?;
        validate(self.op, self.shared.world_size, &posts)?;
        let _guard = AbortOnUnwind(self.op);
        if self.rank != root {
            let src = posts[root].input.expect("buffer");
            match &mut buf {
                CommBuffer::F32(out) => copy_from(out, src),
                CommBuffer::BF16(out) => copy_from(out, src),
                CommBuffer::F16(out) => copy_from(out, src),
            }
        }
        self.sync(generation + 1);
        Ok(buf)
    }

    fn reduce(&self, mut buf: CommBuffer, root: usize, op: ReduceOp) -> Result<CommBuffer> {
        // As in `all_reduce`, the root's buffer is only accessed through `mine` until returned.
        let mine = RawBuf::of_mut(&mut buf);
        let post = self.post(Kind::Reduce, Some(mine), None, Some(op), Some(root));
        let (generation, posts) = self.rendezvous(post)?;
        validate(self.op, self.shared.world_size, &posts)?;
        let _guard = AbortOnUnwind(self.op);
        if self.rank == root {
            let bufs: Vec<RawBuf> = posts.iter().map(|p| p.input.expect("buffer")).collect();
            let ws = self.shared.world_size;
            match mine.dtype {
                DType::F32 => reduce_to_root::<f32>(&bufs, root, op, ws),
                DType::BF16 => reduce_to_root::<bf16>(&bufs, root, op, ws),
                _ => reduce_to_root::<f16>(&bufs, root, op, ws),
            }
        }
        self.sync(generation + 1);
        Ok(buf)
    }

    fn barrier(&self) -> Result<()> {
        let post = self.post(Kind::Barrier, None, None, None, None);
        let (_generation, posts) = self.rendezvous(post)?;
        // No buffer is shared, so no second barrier is needed (posts are double-buffered).
        validate(self.op, self.shared.world_size, &posts)
    }
}

/// All-gather copy: `out[j*n..(j+1)*n] = input of rank j`.
///
/// Requires every post validated (same dtype `T`, `n` elements each, `out.len() == ws * n`).
fn gather<T: Elem>(out: &mut [T], srcs: &[RawBuf], n: usize) {
    for (j, src) in srcs.iter().enumerate() {
        // SAFETY: rank j posted its input (n elements of T, validated) and keeps it alive and
        // unmodified until it passes barrier 2, which needs this rank's arrival there; nobody
        // writes inputs during an all-gather. `out` is this rank's own, unshared output.
        let s = unsafe { slice::from_raw_parts(src.typed::<T>() as *const T, n) };
        out[j * n..(j + 1) * n].copy_from_slice(s);
    }
}

/// Reduce-scatter: `out[i] = op over ranks j of input_j[start + i]`.
fn reduce_shard<T: Elem>(out: &mut [T], srcs: &[RawBuf], start: usize, op: ReduceOp, ws: usize) {
    let ptrs: Vec<*const T> = srcs
        .iter()
        // In bounds: each input holds ws * out.len() elements (validated) and
        // start + out.len() <= ws * out.len().
        .map(|s| (s.typed::<T>() as *const T).wrapping_add(start))
        .collect();
    // SAFETY: every input is alive, unmoved and read-only until barrier 2 (see `gather`); `out`
    // is this rank's own output, disjoint from all inputs and accessed by nobody else.
    unsafe { reduce_into(&ptrs, out.as_mut_ptr(), out.len(), op, ws) }
}

/// All-reduce phase A: rank `rank` reduces chunk `rank` of every buffer into its own chunk.
fn all_reduce_phase_a<T: Elem>(bufs: &[RawBuf], rank: usize, op: ReduceOp, ws: usize) {
    let (start, n) = chunk(bufs[rank].len, ws, rank);
    // In bounds: all buffers have the same validated length and start + n <= len.
    let ptrs: Vec<*const T> = bufs
        .iter()
        .map(|b| (b.typed::<T>() as *const T).wrapping_add(start))
        .collect();
    // SAFETY: in phase A only rank `rank` reads or writes chunk `rank` of any buffer (every
    // other rank works on its own chunk index), all buffers stay alive and unmoved until
    // barrier 2, and the destination (own chunk) is exactly one of the sources, not a partial
    // overlap.
    unsafe { reduce_into(&ptrs, ptrs[rank] as *mut T, n, op, ws) }
}

/// All-reduce phase B: rank `rank` copies chunk `j` of rank `j`'s buffer, for every `j != rank`.
fn all_reduce_phase_b<T: Elem>(bufs: &[RawBuf], rank: usize, ws: usize) {
    let dst = bufs[rank].typed::<T>();
    for (j, src) in bufs.iter().enumerate() {
        if j == rank {
            continue;
        }
        let (start, n) = chunk(src.len, ws, j);
        // SAFETY: after the phase-A barrier, chunk j of rank j's buffer is final and only read
        // (by everybody) until barrier 2; chunk j of this rank's buffer is written only by this
        // rank in phase B and read by nobody (rank j reads its own chunk j, the others read chunk
        // j only from rank j). Distinct allocations, so the ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (src.typed::<T>() as *const T).add(start),
                dst.add(start),
                n,
            )
        };
    }
}

/// Reduce: the root reduces every buffer into its own, in place.
fn reduce_to_root<T: Elem>(bufs: &[RawBuf], root: usize, op: ReduceOp, ws: usize) {
    let ptrs: Vec<*const T> = bufs.iter().map(|b| b.typed::<T>() as *const T).collect();
    // SAFETY: all buffers have the validated same length and stay alive and unmoved until
    // barrier 2; during a reduce, only the root writes (its own buffer) and only the root reads
    // any buffer; the destination is exactly the root's source.
    unsafe { reduce_into(&ptrs, ptrs[root] as *mut T, bufs[root].len, op, ws) }
}

/// Broadcast: a non-root copies the root's buffer into its own.
fn copy_from<T: Elem>(out: &mut [T], src: RawBuf) {
    // SAFETY: the root's buffer has `out.len()` elements of T (validated), is read-only during a
    // broadcast and stays alive until barrier 2; `out` is this rank's own buffer, which nobody
    // else reads during a broadcast.
    let s = unsafe { slice::from_raw_parts(src.typed::<T>() as *const T, out.len()) };
    out.copy_from_slice(s);
}

type Job = Box<dyn FnOnce() + Send>;

struct StreamSlot {
    seq: u64,
    tx: Option<Sender<Job>>,
}

/// One rank's handle on an in-process group; see the [module docs](self).
///
/// Dropping the handle closes its comm streams, waits for the work already queued on them to
/// finish, then marks the rank as departed: peers still waiting for it fail with
/// [`Error::PeerExited`].
pub struct ThreadProcessGroup {
    rank: usize,
    shared: Arc<Shared>,
    streams: [Mutex<StreamSlot>; 3],
    threads: Mutex<Vec<JoinHandle<()>>>,
    stats: CommStats,
    tracer: Mutex<Option<Arc<Tracer>>>,
}

impl std::fmt::Debug for ThreadProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.shared.world_size)
            .field("timeout", &self.shared.timeout)
            .finish()
    }
}

/// Creates a group of `world_size` ranks living in this process; element `r` is rank `r`'s
/// handle (each with its 3 comm-stream threads already running).
///
/// Errors: [`Error::InvalidArgument`] when `world_size == 0` or a thread cannot be spawned.
pub fn new_group(
    world_size: usize,
    config: ThreadGroupConfig,
) -> Result<Vec<Arc<ThreadProcessGroup>>> {
    if world_size == 0 {
        return Err(Error::InvalidArgument(
            "a process group needs world_size >= 1, got 0".to_string(),
        ));
    }
    let shared = Arc::new(Shared::new(world_size, config.timeout));
    let mut handles = Vec::with_capacity(world_size);
    for rank in 0..world_size {
        let mut threads = Vec::with_capacity(3);
        let mut senders = Vec::with_capacity(3);
        for stream in Stream::ALL {
            let (tx, rx) = unbounded::<Job>();
            let shared = Arc::clone(&shared);
            let thread = thread::Builder::new()
                .name(format!("rank-{rank}-{}", stream.name()))
                .spawn(move || {
                    raise_priority();
                    for job in rx.iter() {
                        job();
                    }
                    let comm = &shared.comms[stream.index()];
                    let mut st = comm.state.lock();
                    st.finished[rank] = true;
                    comm.cv.notify_all();
                })
                .map_err(|e| {
                    Error::InvalidArgument(format!("cannot spawn a comm stream thread: {e}"))
                })?;
            threads.push(thread);
            senders.push(tx);
        }
        let mut senders = senders.into_iter();
        let streams = Stream::ALL.map(|_| {
            Mutex::new(StreamSlot {
                seq: 0,
                tx: senders.next(),
            })
        });
        handles.push(Arc::new(ThreadProcessGroup {
            rank,
            shared: Arc::clone(&shared),
            streams,
            threads: Mutex::new(threads),
            stats: CommStats::default(),
            tracer: Mutex::new(None),
        }));
    }
    Ok(handles)
}

impl ThreadProcessGroup {
    /// The configured collective timeout.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    /// Enqueues `body` on the stream of `kind`. `body` returns the result and an optional
    /// consumed buffer, which is freed only after the `Work` was completed (so the waiter does
    /// not pay for the deallocation).
    fn issue<T, F>(&self, kind: Kind, body: F) -> Work<T>
    where
        T: Send + 'static,
        F: FnOnce(&Ctx) -> (Result<T>, Option<CommBuffer>) + Send + 'static,
    {
        let stream = kind.stream();
        let mut slot = self.streams[stream.index()].lock();
        slot.seq += 1;
        let seq = slot.seq;
        let op = format!("{} #{seq} (stream {})", kind.name(), stream.name());
        let (work, completer) = Work::pending(op.clone());
        let shared = Arc::clone(&self.shared);
        let rank = self.rank;
        let tracer = self.tracer.lock().clone();
        let span_kind = match kind {
            Kind::AllGather => SpanKind::AllGather,
            Kind::ReduceScatter => SpanKind::ReduceScatter,
            _ => SpanKind::Collective,
        };
        let job: Job = Box::new(move || {
            let span = tracer
                .as_ref()
                .and_then(|t| t.span(Lane::Comm(stream), span_kind, op.as_str()));
            let ctx = Ctx {
                shared: &shared,
                comm: &shared.comms[stream.index()],
                rank,
                seq,
                op: &op,
            };
            let (result, leftover) = match catch_unwind(AssertUnwindSafe(|| body(&ctx))) {
                Ok(r) => r,
                Err(payload) => {
                    let message = format!("{op}: {}", panic_message(payload.as_ref()));
                    shared.abort(rank, &format!("comm stream panicked: {message}"));
                    (Err(Error::RankPanicked { rank, message }), None)
                }
            };
            drop(span);
            completer.complete(result);
            drop(leftover);
        });
        if let Some(tx) = &slot.tx {
            // A send error means the stream thread is gone: the job, and with it the completer,
            // is dropped, and `wait` reports that the stream stopped.
            let _ = tx.send(job);
        }
        work
    }
}

impl ProcessGroup for ThreadProcessGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn all_gather(&self, input: CommBuffer, output: CommBuffer) -> Work<CommBuffer> {
        self.stats.all_gather_calls.fetch_add(1, Ordering::Relaxed);
        self.stats
            .all_gather_bytes
            .fetch_add(input.nbytes() as u64, Ordering::Relaxed);
        self.issue(Kind::AllGather, move |ctx| {
            (ctx.all_gather(&input, output), Some(input))
        })
    }

    fn reduce_scatter(
        &self,
        input: CommBuffer,
        output: CommBuffer,
        op: ReduceOp,
    ) -> Work<CommBuffer> {
        self.stats
            .reduce_scatter_calls
            .fetch_add(1, Ordering::Relaxed);
        self.stats
            .reduce_scatter_bytes
            .fetch_add(input.nbytes() as u64, Ordering::Relaxed);
        self.issue(Kind::ReduceScatter, move |ctx| {
            (ctx.reduce_scatter(&input, output, op), Some(input))
        })
    }

    fn all_reduce(&self, buf: CommBuffer, op: ReduceOp) -> Work<CommBuffer> {
        self.count_other(buf.nbytes());
        self.issue(Kind::AllReduce, move |ctx| (ctx.all_reduce(buf, op), None))
    }

    fn broadcast(&self, buf: CommBuffer, root: usize) -> Work<CommBuffer> {
        self.count_other(buf.nbytes());
        self.issue(Kind::Broadcast, move |ctx| (ctx.broadcast(buf, root), None))
    }

    fn reduce(&self, buf: CommBuffer, root: usize, op: ReduceOp) -> Work<CommBuffer> {
        self.count_other(buf.nbytes());
        self.issue(Kind::Reduce, move |ctx| (ctx.reduce(buf, root, op), None))
    }

    fn barrier(&self) -> Work<()> {
        self.count_other(0);
        self.issue(Kind::Barrier, |ctx| (ctx.barrier(), None))
    }

    fn abort(&self, reason: &str) {
        self.shared.abort(self.rank, reason);
    }

    fn stats(&self) -> CommStatsSnapshot {
        self.stats.snapshot()
    }

    fn set_tracer(&self, tracer: Option<Arc<Tracer>>) {
        *self.tracer.lock() = tracer;
    }
}

impl ThreadProcessGroup {
    fn count_other(&self, bytes: usize) {
        self.stats.other_calls.fetch_add(1, Ordering::Relaxed);
        self.stats
            .other_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

impl Drop for ThreadProcessGroup {
    fn drop(&mut self) {
        // Close all three channels first so the streams drain concurrently, then join them.
        for slot in &self.streams {
            slot.lock().tx = None;
        }
        let me = thread::current().id();
        for handle in self.threads.get_mut().drain(..) {
            if handle.thread().id() != me {
                let _ = handle.join();
            }
        }
        self.shared.departed[self.rank].store(true, Ordering::Release);
        self.shared.notify_all();
    }
}

/// The text of a panic payload (`&str` or `String`), or a placeholder.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "<non-string panic payload>".to_string()
    }
}

/// Runs `f` on `world_size` ranks of a fresh in-process group, one thread per rank (named
/// `rank-{r}`), and returns each rank's result (index = rank).
///
/// When `f` returns `Err(e)` on a rank, the group is aborted with `e.to_string()` as the reason;
/// when it panics, the group is aborted with `"panicked: <payload>"` and the rank's result is
/// [`Error::RankPanicked`]. Either way the other ranks' pending and later collectives fail
/// promptly with [`Error::PeerFailed`]. After `f` returns, the rank's handle is dropped (if `f`
/// kept no clone of it): its queued work finishes and the rank is marked departed.
///
/// If the group cannot be created (`world_size == 0`), the result is a single `Err`.
pub fn run_ranks<T, F>(world_size: usize, config: ThreadGroupConfig, f: F) -> Vec<Result<T>>
where
    T: Send,
    F: Fn(Arc<dyn ProcessGroup>) -> Result<T> + Send + Sync,
{
    let groups = match new_group(world_size, config) {
        Ok(groups) => groups,
        Err(e) => return vec![Err(e)],
    };
    let f = &f;
    thread::scope(|scope| {
        let mut handles = Vec::with_capacity(world_size);
        let mut spawn_error = None;
        for pg in groups {
            let rank = pg.rank;
            let spawned = thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn_scoped(scope, move || run_one(rank, pg, f));
            match spawned {
                Ok(h) => handles.push(Some(h)),
                Err(e) => {
                    // The handle moved into the failed closure and is dropped: peers see this
                    // rank as departed.
                    handles.push(None);
                    spawn_error.get_or_insert((rank, e.to_string()));
                }
            }
        }
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Some(h) => h.join().unwrap_or_else(|p| {
                    Err(Error::RankPanicked {
                        rank,
                        message: panic_message(p.as_ref()),
                    })
                }),
                None => Err(Error::InvalidArgument(format!(
                    "cannot spawn the thread of rank {rank}: {}",
                    spawn_error.as_ref().map_or("", |e| e.1.as_str())
                ))),
            })
            .collect()
    })
}

fn run_one<T, F>(rank: usize, pg: Arc<ThreadProcessGroup>, f: &F) -> Result<T>
where
    F: Fn(Arc<dyn ProcessGroup>) -> Result<T>,
{
    let dyn_pg: Arc<dyn ProcessGroup> = pg.clone();
    let result = match catch_unwind(AssertUnwindSafe(|| f(dyn_pg))) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => {
            pg.abort(&e.to_string());
            Err(e)
        }
        Err(payload) => {
            let message = panic_message(payload.as_ref());
            pg.abort(&format!("panicked: {message}"));
            Err(Error::RankPanicked { rank, message })
        }
    };
    drop(pg);
    result
}

/// Like [`run_ranks`], but returns every rank's value (index = rank) or a single error: the root
/// cause of the failure rather than its echoes on the other ranks.
///
/// The error chosen is, in order of preference: the error of the rank that failed first (as
/// named by the [`Error::PeerFailed`] / [`Error::PeersFailed`] echoes) when that error is not
/// itself an echo; otherwise
/// the lowest rank's error that is neither [`Error::PeerFailed`] nor [`Error::PeerExited`];
/// otherwise the lowest rank's error.
pub fn run_ranks_ok<T, F>(world_size: usize, config: ThreadGroupConfig, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Arc<dyn ProcessGroup>) -> Result<T> + Send + Sync,
{
    let results = run_ranks(world_size, config, f);
    let is_echo = |r: &Result<T>| {
        matches!(
            r.as_ref().map_err(Error::root_cause),
            Err(Error::PeerFailed { .. })
                | Err(Error::PeerExited { .. })
                | Err(Error::PeersFailed { .. })
        )
    };
    let first_failed = results
        .iter()
        .find_map(|r| match r.as_ref().map_err(Error::root_cause) {
            Err(Error::PeerFailed { failed_rank, .. }) => Some(*failed_rank),
            Err(Error::PeersFailed { failed_ranks, .. }) => failed_ranks.first().copied(),
            _ => None,
        });
    let chosen = first_failed
        .filter(|&f| results.get(f).is_some_and(|r| r.is_err() && !is_echo(r)))
        .or_else(|| results.iter().position(|r| r.is_err() && !is_echo(r)))
        .or_else(|| results.iter().position(|r| r.is_err()));
    match chosen {
        None => results.into_iter().collect(),
        Some(i) => match results.into_iter().nth(i) {
            Some(Err(e)) => Err(e),
            _ => unreachable!("rank {i} was chosen for its error"),
        },
    }
}

/// Splits the machine's cores between in-process ranks, as `torchrun` does with
/// `OMP_NUM_THREADS`: sets `RAYON_NUM_THREADS` (which Candle's CPU matmul reads for its
/// intra-op parallelism) to `max(1, available_parallelism / world_size)` unless the user already
/// set it, and returns the value in force.
///
/// Without it every rank's matmul asks the one shared rayon pool for all cores and the ranks
/// queue behind each other (measured on 2 cores at world size 2, MNIST MLP: 5.2 s per epoch
/// instead of 1.1 s). Call it at the start of `main`, before any thread is spawned: changing the
/// environment while other threads read it is not sound on every platform.
pub fn set_intra_op_threads(world_size: usize) -> usize {
    if let Some(n) = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
    {
        return n;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let n = (cores / world_size.max(1)).max(1);
    std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    n
}

/// Asks the kernel to run this comm-stream thread ahead of compute threads (nice -10), the CPU
/// analogue of the high-priority CUDA streams PyTorch FSDP issues its collectives on: a
/// prefetched collective then starts as soon as it is issued even when compute keeps every core
/// busy, instead of waiting until a compute thread blocks. Measured (benches/overlap.rs, 2 cores,
/// world size 2): exposed communication 12.0 % of the step without it, 6.8–9.2 % with it.
/// Needs CAP_SYS_NICE (root has it); without it the thread keeps the default priority.
fn raise_priority() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: setpriority with PRIO_PROCESS and who = 0 changes only the calling thread's
        // nice value on Linux; it reads and writes no memory of ours.
        let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, -10) };
        if rc != 0 {
            tracing::debug!(
                "comm stream {:?}: cannot raise its priority ({}); it runs at the default",
                thread::current().name(),
                std::io::Error::last_os_error()
            );
        }
    }
}
