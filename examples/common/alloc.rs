//! The allocator every example and benchmark runs on: mimalloc, counted
//! (`candle_fsdp::alloc::Counting`), with freed memory kept instead of returned to the kernel.

/// `mi_option_purge_delay` in mimalloc's `mi_option_t` (`include/mimalloc.h`, v2 and v3: the
/// 16th option, after `mi_option_deprecated_eager_commit_delay` = 14 which libmimalloc-sys
/// names); libmimalloc-sys 0.1.49 has no constant for it.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Tells mimalloc never to return freed pages to the kernel (`purge_delay = -1`; by default it
/// purges 10 ms (v2) to 1 s (v3) after a free).
///
/// A training step frees and reallocates the same MB-sized activations, gradients and gathered
/// parameters every step; once purged, each reuse costs a page fault and the kernel's page
/// zeroing (`clear_page_erms` was 9–15 % of a GPT step's CPU samples under `perf`; 5 % with this
/// setting). The cost: the process keeps its peak heap resident between steps, which it needs
/// again at the next step anyway. Call it first thing in `main`, before the allocations it
/// should cover.
pub fn keep_freed_memory() {
    // SAFETY: `mi_option_set` only stores an option value (a plain integer option of mimalloc's
    // option table); any value is valid for `purge_delay`, -1 meaning never.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) }
}
