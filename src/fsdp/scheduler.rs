//! The prefetcher: decides when each group's all-gather is issued ahead of need (forward
//! prefetch, [`BackwardPrefetch`], the `limit_all_gathers` rate limiter), keeps the call
//! sequences the forward prefetch predicts from (the *tapes*), and owns the gradient reductions
//! in flight until backward ends.
//!
//! Gathers in flight live in the groups' own state (`Unsharding`); the scheduler only chooses
//! *which* group to unshard *when*, from the groups' states and the memory account:
//! - **forward**: before call number `pos` (member `m`) computes, its groups are unsharded and
//!   the groups of the member predicted to come next ([`Scheduler::predicted_next`]: the
//!   previous forward's next call while the sequence matches it, the next unit in build order
//!   without a previous forward) are issued too ([`FsdpConfig::forward_prefetch`]);
//! - **backward**: when call `c`'s backward starts (`BackwardPre`) or ends (`BackwardPost`), the
//!   groups of the latest earlier call whose backward has not run ([`next_backward_call`]) are
//!   issued; the first gather of backward ([`next_gathering_call`]) is issued before the loss's
//!   own backward.

use candle_core::Tensor;

use super::config::{BackwardPrefetch, FsdpConfig};
use super::memory::MemoryAccount;
use crate::comm::Work;

/// Prefetch policy, the tapes, and the reductions in flight.
pub(crate) struct Scheduler {
    backward_prefetch: BackwardPrefetch,
    forward_prefetch: bool,
    limit: Option<usize>,
    /// Gradient reductions issued by this backward, in issue order (group index, work, whether
    /// this rank had every parameter's gradient).
    reductions: Vec<(usize, Work<Tensor>, bool)>,
    /// Hybrid: how many of `reductions` (a prefix) have been passed on to the replica
    /// all-reduce ([`Scheduler::advance_reductions`]).
    passed_on: usize,
    /// The members called by the previous training and eval forwards, in order (the forward
    /// prefetch's prediction).
    prev_tape: [Vec<usize>; 2],
    /// The members called so far by the current forward.
    tape_now: Vec<usize>,
    /// The groups all-gathered so far by the current step, in issue order.
    gathered_now: Vec<usize>,
}

impl Scheduler {
    pub(crate) fn new(config: &FsdpConfig) -> Self {
        Self {
            backward_prefetch: config.backward_prefetch,
            forward_prefetch: config.forward_prefetch,
            limit: config.limit_all_gathers,
            reductions: Vec::new(),
            passed_on: 0,
            prev_tape: [Vec::new(), Vec::new()],
            tape_now: Vec::new(),
            gathered_now: Vec::new(),
        }
    }

    /// True when one more group may be unsharded ahead of need (the rate limiter,
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
    pub(crate) fn push_reduction(&mut self, group: usize, work: Work<Tensor>, all_local: bool) {
        self.reductions.push((group, work, all_local));
    }

    /// Takes every reduction in flight, in issue order.
    pub(crate) fn take_reductions(&mut self) -> Vec<(usize, Work<Tensor>, bool)> {
        self.passed_on = 0;
        std::mem::take(&mut self.reductions)
    }

    /// Hybrid's second stage: replaces each reduction not passed on yet, in issue order, by
    /// `next(its result)` (the replica all-reduce of the reduced chunk), from the oldest on;
    /// stops at the first one still running unless `all` (then it waits for each). Issue order
    /// is the same on every rank, so the ranks of a replica group issue their all-reduces in
    /// the same order whatever finished first where.
    ///
    /// Errors: the first failing reduction's or `next`'s error, with its group index.
    pub(crate) fn advance_reductions(
        &mut self,
        all: bool,
        mut next: impl FnMut(Tensor) -> Work<Tensor>,
    ) -> std::result::Result<(), Box<(usize, crate::error::Error)>> {
        while let Some((g, work, _)) = self.reductions.get_mut(self.passed_on) {
            if !all && !work.is_completed() {
                break;
            }
            let moved = Work::ready(Err(crate::error::Error::Internal(
                "a reduction was passed on twice".into(),
            )));
            let reduced = std::mem::replace(work, moved)
                .wait()
                .map_err(|e| Box::new((*g, e)))?;
            *work = next(reduced);
            self.passed_on += 1;
        }
        Ok(())
    }

    /// A forward starts: its tape and gather record start empty.
    pub(crate) fn begin_forward(&mut self) {
        self.tape_now.clear();
        self.gathered_now.clear();
    }

    /// Records a call of member `m` in the current forward's tape.
    pub(crate) fn record_call(&mut self, m: usize) {
        self.tape_now.push(m);
    }

    /// Records the issue of group `g`'s all-gather in the current step.
    pub(crate) fn record_gather(&mut self, g: usize) {
        self.gathered_now.push(g);
    }

    /// The members called so far by the current forward (kept until the next forward).
    pub(crate) fn tape_now(&self) -> &[usize] {
        &self.tape_now
    }

    /// The number of calls of the current forward so far.
    pub(crate) fn calls_now(&self) -> usize {
        self.tape_now.len()
    }

    /// The groups all-gathered so far by the current step, in issue order.
    pub(crate) fn gathered_now(&self) -> &[usize] {
        &self.gathered_now
    }

    /// A training forward returned: its tape predicts the next one's. The tape stays current
    /// for the backward's agreement check.
    pub(crate) fn finish_train_forward(&mut self) {
        self.prev_tape[0] = self.tape_now.clone();
    }

    /// Takes the current forward's tape.
    pub(crate) fn take_tape(&mut self) -> Vec<usize> {
        std::mem::take(&mut self.tape_now)
    }

    /// An eval forward succeeded with `tape`: it predicts the next eval forward's calls.
    pub(crate) fn finish_eval_forward(&mut self, tape: Vec<usize>) {
        self.prev_tape[1] = tape;
    }

    /// The member predicted to follow call number `pos` (member `m`) of a model of `members`
    /// members: the previous forward's next call when its sequence matched so far, the next
    /// unit in build order without one. `None` when forward prefetch is off.
    pub(crate) fn predicted_next(
        &self,
        m: usize,
        pos: usize,
        train: bool,
        members: usize,
    ) -> Option<usize> {
        if !self.forward_prefetch {
            return None;
        }
        let prev = &self.prev_tape[usize::from(!train)];
        if prev.is_empty() {
            return (m + 1 < members).then_some(m + 1);
        }
        (prev.get(pos) == Some(&m))
            .then(|| prev.get(pos + 1).copied())
            .flatten()
    }
}

/// The latest call before call number `before` (of `n_calls`) whose backward has not run
/// (`pending(c)`).
pub(crate) fn next_backward_call(
    n_calls: usize,
    before: usize,
    pending: impl Fn(usize) -> bool,
) -> Option<usize> {
    (0..before.min(n_calls)).rev().find(|&c| pending(c))
}

/// The latest call before `before` whose backward has not run and that needs a gather
/// (`needs_gather(c)`: some group neither present nor in flight).
pub(crate) fn next_gathering_call(
    n_calls: usize,
    before: usize,
    pending: impl Fn(usize) -> bool,
    needs_gather: impl Fn(usize) -> bool,
) -> Option<usize> {
    next_backward_call(n_calls, before, |c| pending(c) && needs_gather(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scheduler(forward_prefetch: bool) -> Scheduler {
        Scheduler::new(&FsdpConfig {
            forward_prefetch,
            ..FsdpConfig::default()
        })
    }

    #[test]
    fn first_forward_predicts_build_order() {
        let s = scheduler(true);
        assert_eq!(s.predicted_next(0, 0, true, 3), Some(1));
        assert_eq!(s.predicted_next(1, 1, true, 3), Some(2));
        assert_eq!(s.predicted_next(2, 2, true, 3), None);
    }

    #[test]
    fn later_forward_follows_previous_tape_while_it_matches() {
        let mut s = scheduler(true);
        s.begin_forward();
        for m in [2, 0, 2, 1] {
            s.record_call(m);
        }
        s.finish_train_forward();
        assert_eq!(s.predicted_next(2, 0, true, 3), Some(0));
        assert_eq!(s.predicted_next(0, 1, true, 3), Some(2));
        assert_eq!(s.predicted_next(2, 2, true, 3), Some(1));
        // Past the end of the previous sequence, or off it: no prediction.
        assert_eq!(s.predicted_next(1, 3, true, 3), None);
        assert_eq!(s.predicted_next(1, 0, true, 3), None);
        // The eval tape is separate: still build order.
        assert_eq!(s.predicted_next(0, 0, false, 3), Some(1));
    }

    #[test]
    fn eval_tape_predicts_eval() {
        let mut s = scheduler(true);
        s.begin_forward();
        s.record_call(1);
        s.record_call(0);
        let tape = s.take_tape();
        s.finish_eval_forward(tape);
        assert_eq!(s.predicted_next(1, 0, false, 2), Some(0));
        assert_eq!(s.predicted_next(0, 0, true, 2), Some(1));
    }

    #[test]
    fn no_prediction_without_forward_prefetch() {
        let s = scheduler(false);
        assert_eq!(s.predicted_next(0, 0, true, 3), None);
    }

    #[test]
    fn backward_visits_pending_calls_in_reverse() {
        let done = [false, true, false, false];
        let pending = |c: usize| !done[c];
        assert_eq!(next_backward_call(4, 4, pending), Some(3));
        assert_eq!(next_backward_call(4, 3, pending), Some(2));
        assert_eq!(next_backward_call(4, 2, pending), Some(0));
        assert_eq!(next_backward_call(4, 0, pending), None);
        // `before` past the end is clamped.
        assert_eq!(next_backward_call(4, 9, pending), Some(3));
    }

    #[test]
    fn first_backward_gather_skips_present_groups() {
        let done = [false, false, false];
        let sharded = [true, false, false];
        let c = next_gathering_call(3, 3, |c| !done[c], |c| sharded[c]);
        assert_eq!(c, Some(0));
        assert_eq!(next_gathering_call(3, 3, |c| !done[c], |_| false), None);
    }
}
