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
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};

/// A global allocator that forwards to the allocator it wraps (the system's by default) and
/// counts live and peak bytes.
pub struct Counting<A = System>(pub A);

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);
static USED: AtomicBool = AtomicBool::new(false);

// SAFETY: every call is forwarded unchanged to the system allocator; the counters are atomics.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Counting<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged.
        let p = unsafe { self.0.alloc(layout) };
        if !p.is_null() {
            let size = layout.size() as isize;
            let now = LIVE.fetch_add(size, Ordering::Relaxed) + size;
            PEAK.fetch_max(now, Ordering::Relaxed);
            USED.store(true, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` with this `layout`.
        unsafe { self.0.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }
}

/// True when [`Counting`] is the process's global allocator (it has counted something).
pub fn is_counting() -> bool {
    USED.load(Ordering::Relaxed)
}

/// Heap bytes allocated now through [`Counting`] (0 when it is not installed).
pub fn live_bytes() -> usize {
    LIVE.load(Ordering::Relaxed).max(0) as usize
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
