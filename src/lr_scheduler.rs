//! Learning-rate schedulers: objects that set every parameter group's learning rate from the
//! number of scheduler steps taken, and whose state is saved and restored with checkpoints
//! ([`crate::checkpoint::TrainState::lr_scheduler`]).
//!
//! Each group `g` keeps its own base learning rate `base_g` (its lr when the scheduler was
//! made); after `t` calls of [`LrScheduler::step`] its lr is `base_g · factor(t)`, as the
//! `torch.optim.lr_scheduler` classes do per `param_group` (closed forms of their docs):
//! - [`LrSchedule::Constant`]: `factor = 1`.
//! - [`LrSchedule::Linear`] (`LinearLR`): `factor = s + (e − s)·min(t, T)/T` from
//!   `start_factor` `s` to `end_factor` `e` over `T = total_steps`; a linear warm-up is
//!   `s < 1, e = 1` ([`LrSchedule::linear_warmup`]).
//! - [`LrSchedule::Cosine`] (`CosineAnnealingLR`, Loshchilov & Hutter 2017, SGDR without
//!   restarts): `factor = m + (1 − m)·(1 + cos(π·min(t, T)/T))/2` with `m = min_factor`
//!   (`eta_min / base`).

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::optim::ShardedOptimizer;

/// The shape of a schedule (see the module docs for the formulas).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LrSchedule {
    /// The base learning rates, unchanged.
    Constant,
    /// Linear from `start_factor` to `end_factor` over `total_steps`, then `end_factor`.
    Linear {
        /// Factor at step 0.
        start_factor: f64,
        /// Factor from step `total_steps` on.
        end_factor: f64,
        /// Steps of the ramp (at least 1).
        total_steps: u64,
    },
    /// Cosine from 1 to `min_factor` over `total_steps`, then `min_factor`.
    Cosine {
        /// Steps of the decay (at least 1).
        total_steps: u64,
        /// Final factor (`eta_min / base lr`).
        min_factor: f64,
    },
}

impl LrSchedule {
    /// A linear warm-up from `start_factor` to 1 over `steps` steps.
    pub fn linear_warmup(start_factor: f64, steps: u64) -> Self {
        LrSchedule::Linear {
            start_factor,
            end_factor: 1.0,
            total_steps: steps,
        }
    }

    /// The factor after `t` scheduler steps.
    pub fn factor(&self, t: u64) -> f64 {
        match *self {
            LrSchedule::Constant => 1.0,
            LrSchedule::Linear {
                start_factor,
                end_factor,
                total_steps,
            } => {
                let p = t.min(total_steps) as f64 / total_steps.max(1) as f64;
                start_factor + (end_factor - start_factor) * p
            }
            LrSchedule::Cosine {
                total_steps,
                min_factor,
            } => {
                let p = t.min(total_steps) as f64 / total_steps.max(1) as f64;
                min_factor + (1.0 - min_factor) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
            }
        }
    }

    fn validate(&self) -> Result<()> {
        let ok = match *self {
            LrSchedule::Constant => true,
            LrSchedule::Linear {
                start_factor,
                end_factor,
                total_steps,
            } => {
                total_steps >= 1
                    && start_factor.is_finite()
                    && end_factor.is_finite()
                    && start_factor >= 0.0
                    && end_factor >= 0.0
            }
            LrSchedule::Cosine {
                total_steps,
                min_factor,
            } => total_steps >= 1 && min_factor.is_finite() && min_factor >= 0.0,
        };
        if ok {
            Ok(())
        } else {
            Err(Error::value(
                "the learning-rate schedule",
                "one with total_steps at least 1 and factors finite and >= 0",
                format_args!("{self:?}"),
            ))
        }
    }
}

/// What a checkpoint stores of an [`LrScheduler`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LrSchedulerState {
    /// The schedule.
    pub schedule: LrSchedule,
    /// Base learning rate of each parameter group.
    pub base_lrs: Vec<f64>,
    /// Scheduler steps taken.
    pub step: u64,
}

/// A learning-rate scheduler over an optimizer's parameter groups (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct LrScheduler {
    state: LrSchedulerState,
}

impl LrScheduler {
    /// A scheduler whose base rates are `optim`'s current group learning rates; sets them to
    /// step 0's values.
    ///
    /// Errors: a schedule with `total_steps` 0 or a negative or non-finite factor.
    pub fn new(schedule: LrSchedule, optim: &mut dyn ShardedOptimizer) -> Result<Self> {
        schedule.validate()?;
        let s = Self {
            state: LrSchedulerState {
                schedule,
                base_lrs: optim.group_learning_rates(),
                step: 0,
            },
        };
        s.apply(optim)?;
        Ok(s)
    }

    /// Advances one step (call it after each optimizer step, as PyTorch) and sets the new
    /// rates.
    ///
    /// Errors: the optimizer has another number of groups than the scheduler's base rates.
    pub fn step(&mut self, optim: &mut dyn ShardedOptimizer) -> Result<()> {
        self.state.step += 1;
        self.apply(optim)
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.state.step
    }

    /// The current factor.
    pub fn factor(&self) -> f64 {
        self.state.schedule.factor(self.state.step)
    }

    /// Sets every group's learning rate to `base_g · factor`.
    ///
    /// Errors: as [`LrScheduler::step`].
    pub fn apply(&self, optim: &mut dyn ShardedOptimizer) -> Result<()> {
        let n = optim.group_learning_rates().len();
        if n != self.state.base_lrs.len() {
            return Err(Error::shape(
                "learning-rate scheduler: base rates",
                format!("{n} (one per parameter group of the optimizer)"),
                self.state.base_lrs.len(),
            ));
        }
        let f = self.factor();
        for (g, base) in self.state.base_lrs.iter().enumerate() {
            optim.set_group_learning_rate(g, base * f)?;
        }
        Ok(())
    }

    /// The state to save.
    pub fn state(&self) -> LrSchedulerState {
        self.state.clone()
    }

    /// Restores a saved state and sets the optimizer's rates from it.
    ///
    /// Errors (nothing changed): an invalid schedule; base rates for another number of groups
    /// than the optimizer has.
    pub fn load_state(
        &mut self,
        state: LrSchedulerState,
        optim: &mut dyn ShardedOptimizer,
    ) -> Result<()> {
        state.schedule.validate()?;
        let restored = Self { state };
        restored.apply(optim)?;
        *self = restored;
        Ok(())
    }

    /// A scheduler made from a saved state (sets the optimizer's rates).
    ///
    /// Errors: as [`LrScheduler::load_state`].
    pub fn from_state(state: LrSchedulerState, optim: &mut dyn ShardedOptimizer) -> Result<Self> {
        state.schedule.validate()?;
        let s = Self { state };
        s.apply(optim)?;
        Ok(s)
    }
}
