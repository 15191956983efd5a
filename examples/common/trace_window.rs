//! Which steps `--trace` records (no dependencies: the tests include this file by path).

use std::ops::Range;

/// Steps trained before tracing starts (`--trace`), when the run is long enough.
pub const TRACE_WARMUP_STEPS: usize = 8;

/// The steps traced (indices from the first step of the run, or of the epoch, that is traced)
/// among `steps`: `trace_steps` of them after [`TRACE_WARMUP_STEPS`] warm-up steps, fewer
/// warm-up steps when the run is shorter, so that a short run still traces its last
/// `trace_steps` steps (all of them when it has no more); empty only when `steps` is 0.
pub fn trace_window(steps: usize, trace_steps: usize) -> Range<usize> {
    let warmup = TRACE_WARMUP_STEPS.min(steps.saturating_sub(trace_steps));
    warmup..(warmup + trace_steps).min(steps)
}
