//! A global allocator that counts live and peak heap bytes of the whole test process. A test
//! binary opts in with
//! `#[global_allocator] static GLOBAL: counting_alloc::Counting = counting_alloc::Counting;`.

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
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above with this `layout`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::SeqCst);
    }
}
