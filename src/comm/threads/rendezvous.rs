//! The rendezvous of the thread backend: communicators shared by the ranks, the posts ranks
//! publish for a collective, their validation, and the shared abort slot.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread;
use std::time::{Duration, Instant};

use candle_core::{DType, DeviceLocation};
use parking_lot::{Condvar, Mutex};

use crate::comm::{OpKind, ReduceOp};
use crate::error::{Error, Result};

/// Kind of a rendezvous: a collective, or one of the setup operations run on the caller's thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Op(OpKind),
    NewStream,
    NewGroup,
}

impl Kind {
    pub(super) fn name(self) -> &'static str {
        match self {
            Kind::Op(k) => k.name(),
            Kind::NewStream => "new_stream",
            Kind::NewGroup => "new_group",
        }
    }
}

/// Address, length and dtype of one rank's buffer, as posted to the communicator.
#[derive(Debug, Clone, Copy)]
pub(super) struct RawBuf {
    pub ptr: *mut u8,
    pub len: usize,
    pub dtype: DType,
}

// SAFETY: a `RawBuf` is a plain address; it is only dereferenced by the collective code, under
// the rendezvous protocol that keeps the buffer alive, unmoved and free of conflicting accesses
// while peers use it (see `Ctx::rendezvous` and the SAFETY comments at each access).
unsafe impl Send for RawBuf {}
// SAFETY: as above; sharing the address itself is harmless.
unsafe impl Sync for RawBuf {}

impl RawBuf {
    pub(super) fn typed<T>(self) -> *mut T {
        self.ptr as *mut T
    }
}

/// Address and length in bytes of a setup argument (a stream name, a list of ranks).
#[derive(Debug, Clone, Copy)]
pub(super) struct RawBytes {
    ptr: *const u8,
    len: usize,
}

// SAFETY: as for `RawBuf`: read by peers only between the two barriers of a setup rendezvous,
// while the posting rank keeps the bytes alive.
unsafe impl Send for RawBytes {}
// SAFETY: as above.
unsafe impl Sync for RawBytes {}

impl RawBytes {
    pub(super) fn of<T: Copy>(values: &[T]) -> RawBytes {
        RawBytes {
            ptr: values.as_ptr() as *const u8,
            len: std::mem::size_of_val(values),
        }
    }

    /// # Safety
    ///
    /// The posting rank must keep the bytes alive and unmodified (it does until the second
    /// barrier of the setup rendezvous).
    unsafe fn bytes<'a>(self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: per the function contract.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// A buffer this rank cannot take part with, detected locally and reported through the
/// rendezvous so that every rank fails the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Problem {
    NotOnCpu {
        which: &'static str,
        found: DeviceLocation,
    },
    NotOneD {
        which: &'static str,
        dims: usize,
    },
    NotContiguous {
        which: &'static str,
    },
    Dtype {
        which: &'static str,
        dtype: DType,
    },
    /// Candle refused in-place access: the output shares storage with the input.
    Aliased,
}

impl Problem {
    /// (buffer, expected, found) for [`Error::BadBuffer`].
    fn describe(self) -> (&'static str, String, String) {
        match self {
            Problem::NotOnCpu { which, found } => {
                (which, "a tensor on the CPU".into(), format!("{found:?}"))
            }
            Problem::NotOneD { which, dims } => (
                which,
                "a 1-D tensor".into(),
                format!("a tensor of {dims} dimensions"),
            ),
            Problem::NotContiguous { which } => {
                (which, "a contiguous tensor".into(), "a strided view".into())
            }
            Problem::Dtype { which, dtype } => (
                which,
                "f32, bf16, f16, f64, u8, u32, i16, i32 or i64".into(),
                format!("{dtype:?}"),
            ),
            Problem::Aliased => (
                "output",
                "storage distinct from the input's".into(),
                "the input's storage".into(),
            ),
        }
    }
}

/// What one rank published for one rendezvous.
#[derive(Debug, Clone, Copy)]
pub(super) struct Post {
    pub kind: Kind,
    pub seq: u64,
    pub input: Option<RawBuf>,
    pub output: Option<RawBuf>,
    pub op: Option<ReduceOp>,
    pub root: Option<usize>,
    /// Setup argument: the stream name (`NewStream`) or the ranks (`NewGroup`).
    pub bytes: Option<RawBytes>,
    /// `NewStream`: index of the stream among the streams this rank created.
    pub index: Option<usize>,
    pub problem: Option<Problem>,
}

impl Post {
    pub(super) fn new(kind: Kind, seq: u64) -> Post {
        Post {
            kind,
            seq,
            input: None,
            output: None,
            op: None,
            root: None,
            bytes: None,
            index: None,
            problem: None,
        }
    }
}

/// Rendezvous state of one communicator, shared by all ranks.
struct CommState {
    /// Barrier arrivals of each rank (monotonic except for the retraction of a failed first
    /// barrier, see `Ctx::rendezvous`). Acts as the generation counter.
    arrivals: Vec<u64>,
    /// Posts, double-buffered by the parity of the generation at which they were made, so that a
    /// fast rank posting its next collective never overwrites a post a slow rank has yet to read.
    posts: [Vec<Option<Post>>; 2],
    /// Ranks whose thread for this communicator exited (no further arrival will come).
    finished: Vec<bool>,
}

/// One communicator: the rendezvous of the k-th stream of every rank (or of setup operations).
pub(super) struct Communicator {
    name: String,
    state: Mutex<CommState>,
    cv: Condvar,
}

impl Communicator {
    pub(super) fn new(name: &str, world_size: usize) -> Communicator {
        Communicator {
            name: name.to_string(),
            state: Mutex::new(CommState {
                arrivals: vec![0; world_size],
                posts: [vec![None; world_size], vec![None; world_size]],
                finished: vec![false; world_size],
            }),
            cv: Condvar::new(),
        }
    }

    pub(super) fn name(&self) -> &str {
        &self.name
    }

    /// Marks `rank`'s thread of this communicator as gone and wakes the waiters.
    pub(super) fn finish(&self, rank: usize) {
        let mut st = self.state.lock();
        st.finished[rank] = true;
        self.cv.notify_all();
    }

    /// Wakes every waiter. Taking the lock orders the notification after any waiter's check of
    /// the state that changed (no lost wake-up).
    fn notify(&self) {
        let _guard = self.state.lock();
        self.cv.notify_all();
    }
}

/// The abort slot shared by a root group and every sub-group created from it.
#[derive(Default)]
pub(super) struct Family {
    /// First failure: `(failed rank in the root group, reason)`.
    abort: Mutex<Option<(usize, String)>>,
    /// Every group of the family, to wake on abort.
    groups: Mutex<Vec<Weak<Shared>>>,
}

/// State shared by all rank handles of one group.
pub(super) struct Shared {
    pub world_size: usize,
    pub timeout: Duration,
    /// Rank in the root group of each rank of this group.
    pub root_ranks: Vec<usize>,
    family: Arc<Family>,
    /// Communicator k serves the k-th stream created by every rank (0: the default stream).
    comms: Mutex<Vec<Arc<Communicator>>>,
    /// Communicator of the setup operations (`new_stream`, `new_group`).
    pub setup: Communicator,
    /// Ranks whose handle was dropped.
    pub departed: Vec<AtomicBool>,
    /// Sub-groups being created, by setup sequence number.
    pub forming: Mutex<Vec<(u64, Arc<Shared>)>>,
}

impl Shared {
    /// A group of `root_ranks.len()` ranks in `family` (a new family for a root group).
    pub(super) fn new(
        timeout: Duration,
        root_ranks: Vec<usize>,
        family: Option<Arc<Family>>,
        default_stream: &str,
    ) -> Arc<Shared> {
        let world_size = root_ranks.len();
        let family = family.unwrap_or_default();
        let shared = Arc::new(Shared {
            world_size,
            timeout,
            root_ranks,
            family: Arc::clone(&family),
            comms: Mutex::new(vec![Arc::new(Communicator::new(
                default_stream,
                world_size,
            ))]),
            setup: Communicator::new("setup", world_size),
            departed: (0..world_size).map(|_| AtomicBool::new(false)).collect(),
            forming: Mutex::new(Vec::new()),
        });
        let mut groups = family.groups.lock();
        groups.retain(|g| g.strong_count() > 0);
        groups.push(Arc::downgrade(&shared));
        shared
    }

    /// The communicator of the `index`-th stream, created (named `name`) if no rank did yet.
    pub(super) fn communicator(&self, index: usize, name: &str) -> Arc<Communicator> {
        let mut comms = self.comms.lock();
        while comms.len() <= index {
            comms.push(Arc::new(Communicator::new(name, self.world_size)));
        }
        Arc::clone(&comms[index])
    }

    pub(super) fn family(&self) -> &Arc<Family> {
        &self.family
    }

    pub(super) fn aborted(&self) -> Option<(usize, String)> {
        self.family.abort.lock().clone()
    }

    /// Records the first failure (of this group's `rank`) and wakes every waiter of every group
    /// of the family.
    pub(super) fn abort(&self, rank: usize, reason: &str) {
        {
            let mut slot = self.family.abort.lock();
            if slot.is_none() {
                *slot = Some((self.root_ranks[rank], reason.to_string()));
            }
        }
        let groups: Vec<Arc<Shared>> = self
            .family
            .groups
            .lock()
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for g in groups {
            g.notify_all();
        }
    }

    /// Wakes every waiter of every communicator of this group.
    pub(super) fn notify_all(&self) {
        let comms: Vec<Arc<Communicator>> = self.comms.lock().clone();
        for comm in comms {
            comm.notify();
        }
        self.setup.notify();
    }
}

/// Aborts the process if dropped during a panic: used while peers may read this rank's buffers,
/// where unwinding (and freeing the buffers) would be a use-after-free for them.
pub(super) struct AbortOnUnwind<'a>(pub &'a str);

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

/// The dtypes the thread backend moves and reduces.
pub(super) fn supported(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::F32
            | DType::BF16
            | DType::F16
            | DType::F64
            | DType::U8
            | DType::U32
            | DType::I16
            | DType::I32
            | DType::I64
    )
}

fn describe_call(p: &Post) -> String {
    format!("{} #{}", p.kind.name(), p.seq)
}

/// A setup argument as text, for mismatch errors.
fn describe_bytes(kind: Kind, b: Option<RawBytes>) -> String {
    // SAFETY: called between the barriers of a setup rendezvous, while every poster keeps its
    // argument alive and unmodified.
    let bytes = b.map_or(&[][..], |b| unsafe { b.bytes() });
    match kind {
        Kind::NewGroup => {
            let ranks: Vec<usize> = bytes
                .chunks_exact(std::mem::size_of::<usize>())
                .map(|c| usize::from_ne_bytes(c.try_into().expect("usize-sized chunk")))
                .collect();
            format!("ranks {ranks:?}")
        }
        _ => format!("name {:?}", String::from_utf8_lossy(bytes)),
    }
}

/// Checks every rank's post; deterministic, so every rank reaches the same verdict.
///
/// Must run between the two barriers of a rendezvous (it reads peers' setup arguments).
pub(super) fn validate(op: &str, world_size: usize, posts: &[Post]) -> Result<()> {
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
    // Buffers a rank could not take part with.
    if let Some((j, problem)) = posts
        .iter()
        .enumerate()
        .find_map(|(j, p)| p.problem.map(|pr| (j, pr)))
    {
        let (which, expected, found) = problem.describe();
        return Err(Error::BadBuffer {
            op: op.to_string(),
            rank: j,
            what: format!("{} {which}", p0.kind.name()),
            expected,
            found,
        });
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
                Kind::Op(OpKind::AllGather) => (output, input, "output", "input"),
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
                    format!("an input of {} elements", a.len),
                    format!("an input of {} elements", b.len),
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
        if p.index != p0.index {
            return Err(mismatch(
                j,
                format!("stream index {:?}", p.index),
                format!("stream index {:?}", p0.index),
            ));
        }
        // SAFETY: between the barriers of the rendezvous, peers keep their arguments alive.
        let same_bytes = match (p.bytes, p0.bytes) {
            (Some(a), Some(b)) => unsafe { a.bytes() == b.bytes() },
            (a, b) => a.is_none() && b.is_none(),
        };
        if !same_bytes {
            return Err(mismatch(
                j,
                describe_bytes(p.kind, p.bytes),
                describe_bytes(p0.kind, p0.bytes),
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
    if let (Some(ReduceOp::Avg), Some(b)) = (p0.op, &p0.input) {
        if !b.dtype.is_float() {
            return Err(Error::InvalidArgument(format!(
                "{op}: ReduceOp::Avg is not defined for {:?} buffers (integer dtypes support \
                 Sum, Max and Min)",
                b.dtype
            )));
        }
    }
    Ok(())
}

/// Context of one rendezvous on one rank: a collective on its comm stream's thread, or a setup
/// operation on the caller's thread.
pub(super) struct Ctx<'a> {
    pub shared: &'a Shared,
    pub comm: &'a Communicator,
    pub rank: usize,
    pub seq: u64,
    pub op: &'a str,
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

    /// A post of this rendezvous's sequence number.
    pub(super) fn post(&self, kind: Kind) -> Post {
        Post::new(kind, self.seq)
    }

    /// Barrier 1: publishes `post` and waits until every rank posted; returns the generation
    /// reached and every rank's post (index = rank).
    ///
    /// Fails (and retracts this rank's arrival, so that no peer can ever pass this barrier and
    /// read this rank's buffers) on abort, on a departed missing rank, or at the deadline.
    /// Once every rank arrived, the barrier is passed regardless of any later abort: peers may
    /// already be reading this rank's buffers.
    pub(super) fn rendezvous(&self, post: Post) -> Result<(u64, Vec<Post>)> {
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
    pub(super) fn sync(&self, target: u64) {
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
                            stream = self.comm.name(),
                            "peers slow to finish the copy phase; still waiting"
                        );
                    }
                }
                None => self.comm.cv.wait(&mut st),
            }
        }
    }

    /// A rendezvous in which this rank takes part only to report `problem`: fails on every
    /// rank with the same error (see [`validate`]), never a hang.
    pub(super) fn fail_with(&self, kind: Kind, problem: Problem) -> Error {
        let mut post = self.post(kind);
        post.problem = Some(problem);
        match self.rendezvous(post) {
            Err(e) => e,
            // Our post is refused by `validate` on every rank; as after any refused post, no rank
            // runs the second barrier (nobody reads anybody's buffers).
            Ok((_generation, posts)) => validate(self.op, self.shared.world_size, &posts)
                .err()
                .unwrap_or_else(|| Error::InvalidArgument(format!("{}: {problem:?}", self.op))),
        }
    }
}
