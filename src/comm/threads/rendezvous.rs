//! The rendezvous of the thread backend: communicators shared by the ranks, the posts ranks
//! publish for a collective, their validation, and the shared abort slot; and its host data
//! path, [`Ctx`] as the shared-memory family's [`Board`] (`comm::engine::board`): the peers read
//! each other's tensors through the posted addresses (the GPU data path is `super::cuda`).
//!
//! The output (or in-place buffer) is written under the tensor's storage write lock and the
//! input read under its read lock (`comm::buffer::with_checked_bufs`, through Candle's in-place
//! ops); the whole collective (rendezvous, copy, second barrier) runs inside that call, so both
//! locks are held for as long as peers may touch the buffers. Candle refuses an output that
//! shares storage with its input before calling us; that, and every other local problem
//! (device, shape, layout, dtype), is posted to the rendezvous so that every rank fails with the
//! same [`crate::Error::BadBuffer`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::comm::work::YIELD_BEFORE_SLEEP;
use crate::comm::DEFAULT_STREAM;

#[cfg(feature = "cuda")]
use crate::comm::buffer::{report, Kind, Problem};
use crate::comm::buffer::{validate, Post, RawBuf};
use crate::comm::engine::board::{Board, Expose};
use crate::comm::engine::group::Operation;
use crate::comm::engine::peer_failed;
use crate::error::{Error, Result};

/// Rendezvous state of one communicator, shared by all ranks.
struct CommState {
    /// Barrier arrivals of each rank (monotonic except for the retraction of a failed first
    /// barrier, see `Ctx::rendezvous`). Acts as the generation counter.
    arrivals: Vec<u64>,
    /// Posts, double-buffered by the parity of the generation at which they were made, so that a
    /// fast rank posting its next collective never overwrites a post a slow rank has yet to read.
    posts: [Vec<Option<Post>>; 2],
    /// Tokens ranks publish with an arrival (the CUDA path: raw event handles), double-buffered
    /// like `posts`; 0 when the barrier carries none.
    tokens: [Vec<usize>; 2],
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
                tokens: [vec![0; world_size], vec![0; world_size]],
                finished: vec![false; world_size],
            }),
            cv: Condvar::new(),
        }
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
    /// Sub-groups being created: setup sequence number, shared state, members that took it
    /// (the last one removes the entry).
    pub forming: Mutex<Vec<(u64, Arc<Shared>, usize)>>,
}

impl Shared {
    /// A root group of `world_size` ranks.
    ///
    /// Errors: [`Error::Value`] when `world_size == 0`.
    pub(super) fn root(timeout: Duration, world_size: usize) -> Result<Arc<Shared>> {
        if world_size == 0 {
            let what = "a process group's world_size";
            return Err(Error::value(what, "at least 1", 0));
        }
        Ok(Shared::new(timeout, (0..world_size).collect(), None))
    }

    /// A group of `root_ranks.len()` ranks in `family` (a new family for a root group).
    pub(super) fn new(
        timeout: Duration,
        root_ranks: Vec<usize>,
        family: Option<Arc<Family>>,
    ) -> Arc<Shared> {
        let world_size = root_ranks.len();
        let family = family.unwrap_or_default();
        let shared = Arc::new(Shared {
            world_size,
            timeout,
            root_ranks,
            family: Arc::clone(&family),
            comms: Mutex::new(vec![Arc::new(Communicator::new(
                DEFAULT_STREAM,
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

/// Context of one rendezvous on one rank: a collective on its comm stream's thread, or a setup
/// operation on the caller's thread.
pub(super) struct Ctx<'a> {
    pub shared: &'a Shared,
    pub comm: &'a Communicator,
    pub rank: usize,
    pub seq: u64,
    pub op: &'a str,
    /// Every rank's post, after [`Board::publish`].
    pub posts: Vec<Post>,
}

impl Ctx<'_> {
    /// Barrier 1: publishes `post` (and `token`, when given) and waits until every rank posted;
    /// returns the generation reached, every rank's post (index = rank) and, when this rank gave
    /// a token, every rank's token (else none), read under the same lock hold as the posts (the
    /// double-buffering argument there covers them too). The CUDA path publishes the raw handle
    /// of an event as its token.
    ///
    /// Fails (and retracts this rank's arrival, so that no peer can ever pass this barrier and
    /// read this rank's buffers) on abort, on a departed missing rank, or at the deadline.
    /// Once every rank arrived, the barrier is passed regardless of any later abort: peers may
    /// already be reading this rank's buffers.
    pub(super) fn rendezvous(
        &self,
        post: Post,
        token: Option<usize>,
    ) -> Result<(u64, Vec<Post>, Vec<usize>)> {
        let ws = self.shared.world_size;
        let start = Instant::now();
        let deadline = start.checked_add(self.shared.timeout);
        let mut st = self.comm.state.lock();
        if let Some(failure) = self.shared.aborted() {
            return Err(peer_failed(self.op, self.rank, failure));
        }
        let target = st.arrivals[self.rank] + 1;
        let parity = (target % 2) as usize;
        st.arrivals[self.rank] = target;
        st.posts[parity][self.rank] = Some(post);
        st.tokens[parity][self.rank] = token.unwrap_or(0);
        self.comm.cv.notify_all();
        loop {
            let missing: Vec<usize> = (0..ws).filter(|&j| st.arrivals[j] < target).collect();
            if missing.is_empty() {
                // Copy the posts under the same lock hold that observed the arrivals: no rank
                // can reach generation `target + 2` (same parity) before this rank arrives at
                // `target + 1`, so these slots are stable here.
                let posts = st.posts[parity]
                    .iter()
                    .map(|p| p.clone().expect("every arrived rank posted"))
                    .collect();
                let tokens = token.map_or_else(Vec::new, |_| st.tokens[parity].clone());
                return Ok((target, posts, tokens));
            }
            let error = if let Some(failure) = self.shared.aborted() {
                Some(peer_failed(self.op, self.rank, failure))
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
            if start.elapsed() < YIELD_BEFORE_SLEEP {
                // The peers are usually microseconds away: give them the core, then look again
                // (see `comm::work::YIELD_BEFORE_SLEEP`).
                MutexGuard::unlocked(&mut st, thread::yield_now);
                continue;
            }
            match deadline {
                Some(d) => {
                    self.comm.cv.wait_until(&mut st, d);
                }
                None => self.comm.cv.wait(&mut st),
            }
        }
    }

    /// [`Ctx::rendezvous`] without a token, then [`validate`] of every rank's post.
    pub(super) fn agree(&self, post: &Post) -> Result<(u64, Vec<Post>)> {
        let (generation, posts, _) = self.rendezvous(post.clone(), None)?;
        validate(self.op, self.shared.world_size, &posts)?;
        Ok((generation, posts))
    }

    /// A barrier after barrier 1 (generation `target`). It cannot fail: every rank passed
    /// barrier 1, so each one is in the bounded copy phase and will arrive; leaving early would
    /// let the caller free buffers that peers still read. Waits are still bounded by the group
    /// timeout, after which a warning is logged and the wait continues.
    ///
    /// With a `token`, also publishes it and returns every rank's token (index = rank; else
    /// none). A rank cannot reach generation `target + 2` (same slot) before every rank arrived
    /// at `target + 1`, which each does only after reading the slots of `target`.
    pub(super) fn sync_all(&self, target: u64, token: Option<usize>) -> Vec<usize> {
        let mut st = self.comm.state.lock();
        st.arrivals[self.rank] = target;
        if let Some(token) = token {
            st.tokens[(target % 2) as usize][self.rank] = token;
        }
        self.comm.cv.notify_all();
        let mut warned = false;
        let start = Instant::now();
        while st.arrivals.iter().any(|&a| a < target) {
            if start.elapsed() < YIELD_BEFORE_SLEEP {
                MutexGuard::unlocked(&mut st, thread::yield_now);
                continue;
            }
            match Instant::now().checked_add(self.shared.timeout) {
                Some(deadline) => {
                    if self.comm.cv.wait_until(&mut st, deadline).timed_out() && !warned {
                        warned = true;
                        tracing::warn!(
                            op = self.op,
                            rank = self.rank,
                            stream = self.comm.name.as_str(),
                            "peers slow to finish the copy phase; still waiting"
                        );
                    }
                }
                None => self.comm.cv.wait(&mut st),
            }
        }
        token.map_or_else(Vec::new, |_| st.tokens[(target % 2) as usize].clone())
    }

    /// A rendezvous in which this rank takes part only to report `problem`: fails on every
    /// rank with the same error (see [`validate`]), never a hang. As after any refused post, no
    /// rank runs the second barrier (nobody reads anybody's buffers).
    #[cfg(feature = "cuda")]
    pub(super) fn fail_with(&self, kind: Kind, problem: Problem) -> Error {
        report(kind, self.seq, problem, |post| self.agree(post).map(|_| ()))
    }
}

impl Operation for Ctx<'_> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn seq(&self) -> u64 {
        self.seq
    }
}

impl Board for Ctx<'_> {
    /// The peers read this rank's tensor itself (through the posted address), so nothing is
    /// copied before the rendezvous.
    fn publish(&mut self, post: &Post, _buf: RawBuf, _expose: Expose) -> Result<u64> {
        let (generation, posts) = self.agree(post)?;
        self.posts = posts;
        Ok(generation)
    }

    fn readable(&self, j: usize, _like: RawBuf, _len: usize) -> Result<RawBuf> {
        Ok(self.posts[j]
            .input
            .expect("a collective's post has its buffer"))
    }

    /// Cannot fail: every rank passed barrier 1 (see [`Ctx::sync_all`]).
    fn sync(&self, target: u64) -> Result<()> {
        self.sync_all(target, None);
        Ok(())
    }

    fn data_phase(&self) -> impl Sized + '_ {
        AbortOnUnwind(self.op)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::buffer::Kind;
    use crate::comm::OpKind;

    fn token(rank: usize, round: u64, phase: u64) -> usize {
        1 + rank + 16 * (phase as usize + 4 * round as usize)
    }

    fn expected(ws: usize, round: u64, phase: u64) -> Vec<usize> {
        (0..ws).map(|r| token(r, round, phase)).collect()
    }

    /// The CUDA path's protocol: tokens published with barrier 1 and with the later barriers
    /// of a collective reach every rank unchanged, round after round, while fast ranks run
    /// ahead into the next collective (the double-buffered slots are never overwritten early).
    #[test]
    fn tokens_reach_every_rank_through_every_barrier() {
        let ws = 4;
        let shared = Shared::new(Duration::from_secs(60), (0..ws).collect(), None);
        let comm = shared.communicator(0, "s");
        thread::scope(|s| {
            for rank in 0..ws {
                let (shared, comm) = (&shared, &comm);
                s.spawn(move || {
                    for round in 0..400u64 {
                        let ctx = Ctx {
                            shared,
                            comm,
                            rank,
                            seq: round + 1,
                            op: "test",
                            posts: Vec::new(),
                        };
                        let post = Post::new(Kind::Op(OpKind::AllReduce), ctx.seq);
                        let (mut generation, posts, tokens) =
                            ctx.rendezvous(post, Some(token(rank, round, 0))).unwrap();
                        assert!(posts.iter().all(|p| p.seq == round + 1));
                        assert_eq!(tokens, expected(ws, round, 0), "rank {rank} round {round}");
                        // 1 to 3 token barriers (as the collectives have), then a plain one.
                        for phase in 1..=(1 + round % 3) {
                            if (rank as u64 + round).is_multiple_of(5) {
                                thread::yield_now();
                            }
                            generation += 1;
                            let got = ctx.sync_all(generation, Some(token(rank, round, phase)));
                            assert_eq!(
                                got,
                                expected(ws, round, phase),
                                "rank {rank} round {round}"
                            );
                        }
                        ctx.sync_all(generation + 1, None);
                    }
                });
            }
        });
    }
}
