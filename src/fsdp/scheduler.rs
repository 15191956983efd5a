//! The prefetcher: decides when each unit's all-gather is issued ahead of need (forward prefetch,
//! [`BackwardPrefetch`], the `limit_all_gathers` rate limiter) and owns the gradient reductions in
//! flight until backward ends.
//!
//! Gathers in flight live in the units' own state (`Unsharding`); the scheduler only chooses
//! *which* unit to unshard *when*, from the units' states and the memory account.

use super::config::{BackwardPrefetch, FsdpConfig};
use super::memory::MemoryAccount;
use super::unit_state::FsdpUnit;
use candle_core::Tensor;

use crate::comm::Work;

/// Prefetch policy plus the reductions in flight.
pub(crate) struct Scheduler {
    forward_prefetch: bool,
    backward_prefetch: BackwardPrefetch,
    limit: Option<usize>,
    /// Gradient reductions issued by this backward, in issue order (unit index, work).
    reductions: Vec<(usize, Work<Tensor>)>,
}

impl Scheduler {
    pub(crate) fn new(config: &FsdpConfig) -> Self {
        Self {
            forward_prefetch: config.forward_prefetch,
            backward_prefetch: config.backward_prefetch,
            limit: config.limit_all_gathers,
            reductions: Vec::new(),
        }
    }

    /// True when one more unit may be unsharded ahead of need (the rate limiter,
    /// [`FsdpConfig::limit_all_gathers`]).
    fn may_prefetch(&self, acct: &MemoryAccount) -> bool {
        self.limit
            .is_none_or(|limit| acct.unsharded_units() < limit)
    }

    /// The unit whose gather forward should issue now, ahead of unit `k`'s compute: `k + 1`
    /// when forward prefetch is on, the limiter allows it and it is still sharded.
    pub(crate) fn forward_prefetch(
        &self,
        units: &[FsdpUnit],
        k: usize,
        acct: &MemoryAccount,
    ) -> Option<usize> {
        let j = k + 1;
        (self.forward_prefetch
            && j < units.len()
            && units[j].is_sharded()
            && self.may_prefetch(acct))
        .then_some(j)
    }

    /// The next unit below `from` (exclusive) whose backward needs an all-gather and whose gather
    /// is not issued yet, if the mode `when` is the configured one and the limiter allows it.
    /// `when` is `BackwardPre` before a unit's backward computes and `BackwardPost` after its
    /// gradients exist; the loss's own backward counts as `BackwardPre` of the last unit.
    pub(crate) fn backward_prefetch(
        &self,
        units: &[FsdpUnit],
        from: usize,
        when: BackwardPrefetch,
        acct: &MemoryAccount,
    ) -> Option<usize> {
        if self.backward_prefetch != when || when == BackwardPrefetch::None {
            return None;
        }
        let j = (0..from)
            .rev()
            .find(|&j| units[j].needs_gather_for_backward())?;
        (units[j].is_sharded() && self.may_prefetch(acct)).then_some(j)
    }

    /// The configured [`BackwardPrefetch`] mode.
    pub(crate) fn backward_mode(&self) -> BackwardPrefetch {
        self.backward_prefetch
    }

    /// Records a gradient reduction in flight.
    pub(crate) fn push_reduction(&mut self, unit: usize, work: Work<Tensor>) {
        self.reductions.push((unit, work));
    }

    /// Takes every reduction in flight, in issue order.
    pub(crate) fn take_reductions(&mut self) -> Vec<(usize, Work<Tensor>)> {
        std::mem::take(&mut self.reductions)
    }
}
