//! Measuring host memory: a counting global allocator (live and peak heap bytes of the
//! process) and the process's peak resident set size.
//!
//! A binary opts in to the counter with
//! `#[global_allocator] static A: candle_fsdp::alloc::Counting = candle_fsdp::alloc::Counting(std::alloc::System);`
//! (it forwards to the allocator it wraps, e.g. `Counting(mimalloc::MiMalloc)`; with a second
//! parameter, `Counting<MiMalloc, 65536>`, the peak is compared once per 64 KiB of a thread's
//! growth instead of at every allocation, see [`Counting`]). Without it, [`live_bytes`] and [`peak_bytes`] stay 0
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
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicUsize, Ordering};

/// A global allocator that forwards to the allocator it wraps (the system's by default) and
/// counts live and peak bytes.
///
/// `SLACK` (bytes, default 0) trades the peak's exactness for speed. With 0 every allocation
/// and free updates one process-wide live count and the peak (exact; what the tests that
/// measure allocations use). With `SLACK > 0` each thread counts into one of 16 cache-line
/// stripes of the live count (its own, in practice: no line moves between cores on the hot
/// path), and compares the total with the peak only once its own count has grown by `SLACK`
/// bytes since its last comparison: with two thread ranks the exact counter cost the MNIST
/// example about 8 % of its step (measured with and without the counter, decision 89).
/// [`live_bytes`] stays exact; [`peak_bytes`] may miss at most `SLACK` bytes per thread. The
/// examples install `Counting<SharedLarge<MiMalloc>, 65536>`.
pub struct Counting<A = System, const SLACK: usize = 0>(pub A);

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);
static USED: AtomicBool = AtomicBool::new(false);

/// Stripes of the live count of a [`Counting`] with `SLACK > 0`.
const STRIPES: usize = 16;

/// One stripe, alone on its cache line.
#[repr(align(64))]
struct Stripe(AtomicIsize);

static STRIPED: [Stripe; STRIPES] = [const { Stripe(AtomicIsize::new(0)) }; STRIPES];
static NEXT_STRIPE: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's stripe plus one (0 until its first count) and its growth since its last
    /// comparison with the peak (a [`Counting`] with `SLACK > 0`). No destructor: reading it
    /// never allocates.
    static MINE: Cell<(usize, isize)> = const { Cell::new((0, 0)) };
}

/// The live count: the exact counter's and the stripes'.
fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
        + STRIPED
            .iter()
            .map(|s| s.0.load(Ordering::Relaxed))
            .sum::<isize>()
}

/// Raises the peak to `now` when it is higher. Read before writing: a read-modify-write takes
/// the cache line from the other threads every time (under `perf`, the unconditional
/// `fetch_max` and the `USED` store were a third of the allocator's own cost with two ranks),
/// a load only when it changed; `fetch_max` keeps the peak exact against a concurrent raise.
#[inline]
fn raise_peak(now: isize) {
    if now > PEAK.load(Ordering::Relaxed) {
        PEAK.fetch_max(now, Ordering::Relaxed);
    }
}

/// Counts `delta` bytes: exactly with `slack` 0, else into this thread's stripe.
#[inline]
fn count(delta: isize, slack: usize) {
    if slack == 0 {
        let now = LIVE.fetch_add(delta, Ordering::Relaxed) + delta;
        if delta > 0 {
            raise_peak(now);
        }
        return;
    }
    let (stripe, compare) = MINE
        .try_with(|m| {
            let (mut stripe, grown) = m.get();
            if stripe == 0 {
                stripe = NEXT_STRIPE.fetch_add(1, Ordering::Relaxed) % STRIPES + 1;
            }
            // Frees do not bank growth: the next allocations are compared as soon as they
            // have grown the thread's count by `slack` again.
            let grown = (grown + delta).max(0);
            let compare = grown >= slack as isize;
            m.set((stripe, if compare { 0 } else { grown }));
            (stripe - 1, compare)
        })
        // The thread's locals are gone (it is exiting): stripe 0, compared at once.
        .unwrap_or((0, delta > 0));
    STRIPED[stripe].0.fetch_add(delta, Ordering::Relaxed);
    if compare {
        raise_peak(live());
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

/// Heap bytes allocated now through [`Counting`] (0 when it is not installed).
pub fn live_bytes() -> usize {
    live().max(0) as usize
}

/// Highest [`live_bytes`] since the last [`reset_peak`] (bytes; with a `SLACK`, as of the last
/// comparison, and never below [`live_bytes`]).
pub fn peak_bytes() -> usize {
    PEAK.load(Ordering::Relaxed).max(live()).max(0) as usize
}

/// Resets [`peak_bytes`] to [`live_bytes`].
pub fn reset_peak() {
    PEAK.store(live(), Ordering::Relaxed);
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

    /// With a slack, a thread counts into its own stripe (the live count stays exact at once)
    /// and compares with the peak only once it has grown by the slack; without, every count is
    /// compared. (This test binary installs no counting allocator: only these calls move the
    /// counters.)
    #[test]
    fn a_slack_counter_is_exact_live_and_compares_the_peak_once_per_slack() {
        std::thread::spawn(|| {
            let base = live();
            reset_peak();
            count(1000, 4096);
            assert_eq!(live(), base + 1000, "live is exact at once");
            assert_eq!(
                PEAK.load(Ordering::Relaxed),
                base,
                "not compared below the slack"
            );
            assert_eq!(
                peak_bytes() as isize,
                (base + 1000).max(0),
                "peak never below live"
            );
            count(-600, 4096);
            count(3000, 4096);
            assert_eq!(PEAK.load(Ordering::Relaxed), base, "a free banks no growth");
            count(1200, 4096);
            assert_eq!(
                PEAK.load(Ordering::Relaxed),
                base + 4600,
                "compared at 4096 of growth"
            );
            count(-4600, 4096);
            assert_eq!(live(), base);
            count(7, 0);
            assert_eq!(PEAK.load(Ordering::Relaxed), base + 4600);
            assert_eq!(live(), base + 7, "no slack: exact");
            count(-7, 0);
        })
        .join()
        .unwrap();
    }
}
