//! The prefetcher: decides when each unit's all-gather is issued ahead of need (forward prefetch,
//! [`BackwardPrefetch`], the `limit_all_gathers` rate limiter) and owns the gradient reductions in
//! flight until backward ends.
//!
//! Gathers in flight live in the units' own state (`Unsharding`); the scheduler only chooses
//! *which* unit to unshard *when*, from the units' states and the memory account.

use super::config::{BackwardPrefetch, FsdpConfig};
use super::memory::MemoryAccount;
use candle_core::Tensor;

use crate::comm::Work;

/// Prefetch policy plus the reductions in flight.
pub(crate) struct Scheduler {
    backward_prefetch: BackwardPrefetch,
    limit: Option<usize>,
    /// Gradient reductions issued by this backward, in issue order (unit index, work, whether
    /// this rank had every parameter's gradient).
    reductions: Vec<(usize, Work<Tensor>, bool)>,
}

impl Scheduler {
    pub(crate) fn new(config: &FsdpConfig) -> Self {
        Self {
            backward_prefetch: config.backward_prefetch,
            limit: config.limit_all_gathers,
            reductions: Vec::new(),
        }
    }

    /// True when one more unit may be unsharded ahead of need (the rate limiter,
    /// [`FsdpConfig::limit_all_gathers`]).
    pub(crate) fn may_prefetch(&self, acct: &MemoryAccount) -> bool {
        self.limit
            .is_none_or(|limit| acct.unsharded_units() < limit)
    }

    /// The configured [`BackwardPrefetch`] mode.
    pub(crate) fn backward_mode(&self) -> BackwardPrefetch {
        self.backward_prefetch
    }

    /// Records a gradient reduction in flight.
    pub(crate) fn push_reduction(&mut self, unit: usize, work: Work<Tensor>, all_local: bool) {
        self.reductions.push((unit, work, all_local));
    }

    /// Takes every reduction in flight, in issue order.
    pub(crate) fn take_reductions(&mut self) -> Vec<(usize, Work<Tensor>, bool)> {
        std::mem::take(&mut self.reductions)
    }
}
