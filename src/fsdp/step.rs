//! The training state of an `FsdpModel` across one step (FSDP2's `TrainingState`, beside each
//! group's parameter state in `super::param_group`):
//!
//! ```text
//!          forward_with                backward
//!   Idle ───────────────▶ Forward ───────────────▶ Backward ──┐
//!    ▲ ▲                     │ discard_forward, an error,     │ (done or failed)
//!    │ │                     │ the next forward (no call yet) │
//!    │ └─────────────────────┘                                │
//!    │     forward_eval_with                                  │
//!    ├──────────────────────▶ Eval ──(returns)──▶ Idle         │
//!    └────────────────────────────────────────────────────────┘
//! ```
//!
//! Every state but `Idle` carries the [`Step`]: the calls recorded by the forward
//! ([`CallRecord`]) and the [`StepHook`] through which their graph nodes reach the model in
//! backward. Leaving a step (the model's `release_step`) marks its hook over, so nodes kept
//! from it fail with an error instead of touching a later step.

use std::sync::Arc;

use candle_core::{DType, Tensor, Var};

use super::call::StepHook;
use crate::error::{Phase, Result};

/// Where the model is in a step (see the module docs).
pub(super) enum TrainingState {
    /// No forward in progress and none awaiting its backward.
    Idle,
    /// A training forward ran (or runs): its calls await `FsdpModel::backward`.
    Forward(Step),
    /// An eval forward runs (nothing is kept for a backward).
    Eval(Step),
    /// `FsdpModel::backward` runs the step's backward.
    Backward(Step),
}

impl TrainingState {
    /// The step in progress, in any state but `Idle`.
    pub(super) fn step(&self) -> Option<&Step> {
        match self {
            TrainingState::Idle => None,
            TrainingState::Forward(s) | TrainingState::Eval(s) | TrainingState::Backward(s) => {
                Some(s)
            }
        }
    }

    /// The step in progress, mutably.
    pub(super) fn step_mut(&mut self) -> Option<&mut Step> {
        match self {
            TrainingState::Idle => None,
            TrainingState::Forward(s) | TrainingState::Eval(s) | TrainingState::Backward(s) => {
                Some(s)
            }
        }
    }

    /// True in a training forward.
    pub(super) fn is_training_forward(&self) -> bool {
        matches!(self, TrainingState::Forward(_))
    }

    /// True when a training forward called units and its backward has not run yet.
    pub(super) fn awaits_backward(&self) -> bool {
        matches!(self, TrainingState::Forward(s) if !s.calls.is_empty())
    }

    /// The phase errors of a unit call are reported in.
    pub(super) fn call_phase(&self) -> Phase {
        match self {
            TrainingState::Eval(_) => Phase::Eval,
            _ => Phase::Forward,
        }
    }
}

/// A training or eval forward in progress, and what its backward needs.
pub(super) struct Step {
    pub(super) hook: Arc<StepHook>,
    /// The scalar variable every call node hangs from.
    pub(super) anchor: Tensor,
    pub(super) calls: Vec<CallRecord>,
    /// Groups of the latest call (resharded when the next call starts).
    pub(super) last_groups: Vec<usize>,
    /// The output nodes with zero elements handed to the caller (a rank whose batch is empty):
    /// the backward adds their sums (exactly 0) to the loss, so that every such call's backward
    /// runs, in graph order, whatever loss the caller computed from them (see
    /// `FsdpModel::backward`).
    pub(super) empty_outputs: Vec<Tensor>,
}

impl Step {
    pub(super) fn new(device: &candle_core::Device) -> Result<Self> {
        Ok(Step {
            hook: Arc::new(StepHook::default()),
            anchor: Var::zeros((), DType::F32, device)?.into_inner(),
            calls: Vec::new(),
            last_groups: Vec::new(),
            empty_outputs: Vec::new(),
        })
    }
}

/// One call of a unit in a training forward.
pub(super) struct CallRecord {
    pub(super) member: usize,
    pub(super) groups: Vec<usize>,
    /// Activation checkpointing: recompute in backward from `saved_inputs`.
    pub(super) checkpoint: bool,
    /// The unit's inputs as it received them (cast, detached): kept for a recompute.
    pub(super) saved_inputs: Vec<Tensor>,
    /// Which inputs carry gradient (indices into the call's inputs), and their dtypes as the
    /// caller passed them.
    pub(super) tracked: Vec<(usize, DType)>,
    /// The unit graph's variables of the tracked inputs (empty when checkpointed).
    pub(super) input_vars: Vec<Tensor>,
    /// The unit's outputs attached to its graph (`None`: not differentiable, or checkpointed).
    pub(super) outputs: Vec<Option<Tensor>>,
    /// For each output whose storage was freed after the forward: the output node holding the
    /// same values, to refill it from before the backward.
    pub(super) refill_from: Vec<Option<Tensor>>,
    /// Gradients of the outputs, stored by the output nodes.
    pub(super) out_grads: Vec<Option<Tensor>>,
    /// Gradients of the tracked inputs, handed out by the input nodes.
    pub(super) in_grads: Vec<Option<Tensor>>,
    /// Its backward has run.
    pub(super) done: bool,
}
