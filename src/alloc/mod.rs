//! Measuring host memory: a counting global allocator (live and peak heap bytes of the
//! process) and the process's peak resident set size.
//!
//! A binary opts in to the counter with
//! `#[global_allocator] static A: candle_fsdp::alloc::Counting = candle_fsdp::alloc::Counting(std::alloc::System);`
//! (it forwards to the allocator it wraps, e.g. `Counting(mimalloc::MiMalloc)`). Without it, [`live_bytes`] and [`peak_bytes`] stay 0
//! and [`is_counting`] is false. The GPT example measures its activation estimate with it
//! ([`crate::fsdp::MemoryBudget`]).
//!
//! [`SharedLarge`] (module `shared`) serves the collectives' large inputs (made inside
//! [`in_shared`]) from memory the other processes of a shared-memory job map, so that its
//! collectives read peers' tensors in place.

pub(crate) mod shared;

pub use shared::{in_shared, is_shared_enabled, release_shared, shared_bytes, SharedLarge};

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};

/// A global allocator that forwards to the allocator it wraps (the system's by default) and
/// counts live and peak bytes.
///
/// `SLACK` (bytes, default 0) trades exactness for speed: with 0 every allocation and free
/// updates the process-wide counters (exact; what the tests that measure allocations use). With
/// `SLACK > 0` each thread gathers its own allocations and frees and adds them to the counters
/// only once their sum since its last addition reaches `±SLACK` bytes: the shared counters'
/// cache line then moves between cores once per `SLACK` bytes instead of twice per allocation
/// (with two thread ranks the exact counters cost the MNIST example about 8 % of its step,
/// measured with and without the counter). [`live_bytes`] and [`peak_bytes`] then miss at most
/// `SLACK` bytes per other thread; [`live_bytes`] includes the calling thread's own share, so
/// what one thread allocates between two of its readings is exact. The examples install
/// `Counting<SharedLarge<MiMalloc>, 65536>`.
pub struct Counting<A = System, const SLACK: usize = 0>(pub A);

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);
static USED: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// This thread's allocations minus frees not yet added to [`LIVE`] (a [`Counting`] with
    /// `SLACK > 0`).
    static PENDING: Cell<isize> = const { Cell::new(0) };
}

/// Adds `delta` bytes to the live count (and raises the peak).
#[inline]
fn add_live(delta: isize) {
    let now = LIVE.fetch_add(delta, Ordering::Relaxed) + delta;
    // Read before writing: a store or read-modify-write takes the cache line from the other
    // threads every time (under `perf`, the unconditional `fetch_max` and store were a third of
    // the allocator's own cost with two ranks), a load only when it changed. `fetch_max` keeps
    // the peak exact against a concurrent raise.
    if delta > 0 && now > PEAK.load(Ordering::Relaxed) {
        PEAK.fetch_max(now, Ordering::Relaxed);
    }
}

/// Counts `delta` bytes: at once with `slack` 0, else through this thread's pending sum.
#[inline]
fn count(delta: isize, slack: usize) {
    if slack == 0 {
        add_live(delta);
        return;
    }
    let due = PENDING
        .try_with(|p| {
            let sum = p.get() + delta;
            if sum.unsigned_abs() >= slack {
                p.set(0);
                sum
            } else {
                p.set(sum);
                0
            }
        })
        // The thread's locals are being destroyed: count directly.
        .unwrap_or(delta);
    if due != 0 {
        add_live(due);
    }
}

// SAFETY: every call is forwarded unchanged to the wrapped allocator; the counters are atomics
// and a thread-local without destructor.
unsafe impl<A: GlobalAlloc, const SLACK: usize> GlobalAlloc for Counting<A, SLACK> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged.
        let p = unsafe { self.0.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as isize, SLACK);
            if !USED.load(Ordering::Relaxed) {
                USED.store(true, Ordering::Relaxed);
            }
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` with this `layout`.
        unsafe { self.0.dealloc(ptr, layout) };
        count(-(layout.size() as isize), SLACK);
    }
}

/// True when [`Counting`] is the process's global allocator (it has counted something).
pub fn is_counting() -> bool {
    USED.load(Ordering::Relaxed)
}

/// Heap bytes allocated now through [`Counting`] (0 when it is not installed), with the calling
/// thread's share not yet added to the shared count (see `SLACK`).
pub fn live_bytes() -> usize {
    let own = PENDING.try_with(Cell::get).unwrap_or(0);
    (LIVE.load(Ordering::Relaxed) + own).max(0) as usize
}

/// Highest [`live_bytes`] since the last [`reset_peak`] (bytes).
pub fn peak_bytes() -> usize {
    PEAK.load(Ordering::Relaxed).max(0) as usize
}

/// Resets [`peak_bytes`] to [`live_bytes`].
pub fn reset_peak() {
    PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// The process's peak resident set size in bytes (`VmHWM` of `/proc/self/status`, Linux);
/// `None` where it cannot be read.
pub fn peak_rss_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With a slack, a thread's allocations reach the shared count once their sum passes it
    /// (either way), the thread's own reading includes what is pending, and the peak follows
    /// what was added. (This test binary installs no counting allocator: only these calls move
    /// the counters.)
    #[test]
    fn a_slack_counter_adds_a_threads_share_once_it_reaches_the_slack() {
        std::thread::spawn(|| {
            let base = LIVE.load(Ordering::Relaxed);
            count(1000, 4096);
            assert_eq!(
                LIVE.load(Ordering::Relaxed),
                base,
                "below the slack: pending"
            );
            assert_eq!(
                live_bytes() as isize,
                (base + 1000).max(0),
                "own share counted"
            );
            count(4000, 4096);
            assert_eq!(
                LIVE.load(Ordering::Relaxed),
                base + 5000,
                "the sum passed the slack"
            );
            assert!(PEAK.load(Ordering::Relaxed) >= base + 5000);
            assert_eq!(PENDING.with(Cell::get), 0);
            count(-3000, 4096);
            assert_eq!(LIVE.load(Ordering::Relaxed), base + 5000, "frees wait too");
            count(-2000, 4096);
            assert_eq!(
                LIVE.load(Ordering::Relaxed),
                base,
                "and pass the slack downwards"
            );
            count(7, 0);
            assert_eq!(LIVE.load(Ordering::Relaxed), base + 7, "no slack: exact");
            count(-7, 0);
        })
        .join()
        .unwrap();
    }
}
