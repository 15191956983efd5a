//! A global allocator that counts live and peak heap bytes of the whole test process. A test
//! binary opts in with
//! `#[global_allocator] static GLOBAL: counting_alloc::Counting = counting_alloc::Counting;`.
//! Each thread's own net allocations are counted too ([`thread_reset_peak`], [`thread_peak`]):
//! with thread ranks, what one rank holds.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

/// Counts every allocation of the process into [`LIVE`] and [`PEAK`].
pub struct Counting;

/// Bytes allocated now.
pub static LIVE: AtomicIsize = AtomicIsize::new(0);
/// Highest [`LIVE`] since it was last reset (`PEAK.store(LIVE.load())`).
pub static PEAK: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged to the system allocator.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now =
                LIVE.fetch_add(layout.size() as isize, Ordering::SeqCst) + layout.size() as isize;
            PEAK.fetch_max(now, Ordering::SeqCst);
            thread_add(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above with this `layout`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::SeqCst);
        thread_add(-(layout.size() as isize));
    }
}

thread_local! {
    /// Bytes allocated minus bytes freed by this thread (memory one thread allocates and
    /// another frees stays counted here: an over-estimate, never an under-estimate of what the
    /// thread holds).
    static THREAD_LIVE: std::cell::Cell<isize> = const { std::cell::Cell::new(0) };
    /// Highest [`THREAD_LIVE`] since [`thread_reset_peak`].
    static THREAD_PEAK: std::cell::Cell<isize> = const { std::cell::Cell::new(0) };
}

/// Adds `delta` to this thread's live count (a no-op while the thread's locals are torn down).
fn thread_add(delta: isize) {
    let _ = THREAD_LIVE.try_with(|l| {
        let now = l.get() + delta;
        l.set(now);
        let _ = THREAD_PEAK.try_with(|p| p.set(p.get().max(now)));
    });
}

/// Resets this thread's peak to its live count and returns that count: a baseline for
/// [`thread_peak`]. With thread ranks, what one rank's thread holds (its shards, its buffers).
#[allow(dead_code)] // not every binary including this file measures threads
pub fn thread_reset_peak() -> isize {
    let live = THREAD_LIVE.with(|l| l.get());
    THREAD_PEAK.with(|p| p.set(live));
    live
}

/// This thread's highest live count since [`thread_reset_peak`].
#[allow(dead_code)] // not every binary including this file measures threads
pub fn thread_peak() -> isize {
    THREAD_PEAK.with(|p| p.get())
}
