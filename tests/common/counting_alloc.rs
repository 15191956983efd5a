//! The one counting global allocator of the tests that measure allocations (`memory.rs`,
//! `checkpoint_memory.rs`, `ops.rs`, `retention.rs`): the crate's own
//! [`candle_fsdp::alloc::Counting`] (live and peak heap bytes of the whole process: [`live`],
//! [`peak`], [`reset_peak`], as `candle_fsdp::alloc::{live_bytes, peak_bytes, reset_peak}`),
//! wrapped around [`PerThread`], which also counts each thread's own net allocations
//! ([`thread_reset_peak`], [`thread_peak`]): with thread ranks, what one rank holds. A test
//! binary opts in with
//! `#[global_allocator] static GLOBAL: counting_alloc::Counting = counting_alloc::COUNTING;`.
#![allow(dead_code)] // not every binary including this file uses every counter

use std::alloc::{GlobalAlloc, Layout, System};

/// The process-wide counter of the crate around the per-thread one.
pub type Counting = candle_fsdp::alloc::Counting<PerThread>;

/// The value of the `#[global_allocator]` static.
pub const COUNTING: Counting = candle_fsdp::alloc::Counting(PerThread);

/// The system allocator, counting each thread's own allocations.
pub struct PerThread;

unsafe impl GlobalAlloc for PerThread {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged to the system allocator.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            thread_add(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above with this `layout`.
        unsafe { System.dealloc(ptr, layout) };
        thread_add(-(layout.size() as isize));
    }
}

/// Bytes allocated now (the whole process).
pub fn live() -> isize {
    candle_fsdp::alloc::live_bytes() as isize
}

/// Highest [`live`] since the last [`reset_peak`].
pub fn peak() -> isize {
    candle_fsdp::alloc::peak_bytes() as isize
}

/// Resets [`peak`] to [`live`] and returns that count: a baseline for [`peak`].
pub fn reset_peak() -> isize {
    candle_fsdp::alloc::reset_peak();
    live()
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
pub fn thread_reset_peak() -> isize {
    let live = THREAD_LIVE.with(|l| l.get());
    THREAD_PEAK.with(|p| p.set(live));
    live
}

/// This thread's highest live count since [`thread_reset_peak`].
pub fn thread_peak() -> isize {
    THREAD_PEAK.with(|p| p.get())
}
