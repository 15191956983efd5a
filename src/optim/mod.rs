//! Sharded optimizers: each rank steps only its f32 master shards with its reduced gradient
//! shards, and keeps optimizer state for those shards alone (ZeRO stage 1+).
//!
//! **Per-parameter state** (as `torch.optim` and FSDP2): every parameter has its own step
//! count `t` (AdamW's bias corrections, SGD's first-step momentum set-up) and its own moments.
//! Moments are stored per unit shard: one f32 tensor per unit and [`BufferKind`] on the shard's
//! device, laid out like the shard (a parameter's moments sit at its elements), allocated at
//! the first step and updated in place, with the parameter shard, by the kernels of
//! [`crate::ops`]. Step counts are kept for every parameter on every rank (they are equal on
//! all ranks).
//!
//! **Parameters without a gradient are skipped.** The gradient store tells "absent" from
//! "zero" ([`crate::ShardView::grad_present`], agreed over the ranks in backward): a parameter
//! that received no gradient since the last `zero_grad` is not stepped at all: no weight decay,
//! no moment update, no step count. A step when no parameter of the model has a gradient is an
//! error ([`Error::Misuse`], "optimizer step without any gradient") that changes
//! nothing, neither parameters nor counters.
//!
//! **Parameter groups** ([`ParamGroup`]): each parameter belongs to the first group whose name
//! pattern matches its full name (`*` any run of characters, `?` one), else to the default
//! group (index 0); each group has its own hyper-parameters (lr, weight decay, betas,
//! momentum, …), as `torch.optim`'s `param_groups`. The usual case, no weight decay on biases
//! and norm weights: `ParamGroup::new("no_decay", ["*.bias", "*norm*.weight"], cfg)` with
//! `weight_decay: 0.0`.
//!
//! A step sees the model only through its accessor ([`FsdpModel::shards`]). Host copies are
//! made only for checkpoints ([`OptimizerState`], a typed contract: kinds and units, no names
//! to parse back).
//!
//! When every parameter of a unit shard has a gradient, the same step count and the same group,
//! the whole shard is stepped by one kernel call; padding and alignment gaps have zero
//! parameter and zero gradient, so they stay zero. Otherwise each present parameter's range of
//! the shard is stepped on its own with its own constants; the arithmetic per element is the
//! same, so both paths give bit-identical parameters.
//!
//! One concept a file: `groups` (parameter groups and glob matching), `state` (the per-unit
//! device state shared by both algorithms), `adamw` ([`AdamW`]), `sgd` ([`Sgd`]).

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::fsdp::FsdpModel;

/// The state accessors of [`ShardedOptimizer`] for an optimizer whose local state is a
/// [`state::ShardState`] in field `state` and whose step count is `steps_taken` (AdamW, SGD).
macro_rules! shard_state_access {
    () => {
        fn state(&self) -> Result<OptimizerState> {
            Ok(OptimizerState {
                hyper: self.hyper(),
                step: self.steps_taken,
                units: self.state.export()?,
            })
        }

        fn state_header(&self) -> Result<(OptimizerState, Vec<BufferKind>)> {
            let (units, kinds) = self.state.header();
            let st = OptimizerState {
                hyper: self.hyper(),
                step: self.steps_taken,
                units,
            };
            Ok((st, kinds))
        }

        fn with_buffer(
            &self,
            unit: usize,
            kind: BufferKind,
            f: &mut dyn FnMut(&[f32]) -> Result<()>,
        ) -> Result<()> {
            self.state.with_buffer(unit, kind, f)
        }
    };
}

mod adamw;
mod groups;
mod sgd;
mod state;

pub use adamw::{AdamW, AdamWConfig};
pub use groups::{glob_match, ParamGroup};
pub use sgd::{Sgd, SgdConfig};

/// Which optimizer algorithm ([`ShardedOptimizer::kind`]); saved in checkpoints, where loading
/// into another kind is an error naming both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum OptimizerKind {
    /// [`AdamW`].
    AdamW,
    /// [`Sgd`].
    Sgd,
}

impl fmt::Display for OptimizerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OptimizerKind::AdamW => "AdamW",
            OptimizerKind::Sgd => "SGD",
        })
    }
}

/// One kind of per-element optimizer buffer, laid out like a unit's shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BufferKind {
    /// AdamW's first moment `m`.
    ExpAvg,
    /// AdamW's second moment `v`.
    ExpAvgSq,
    /// SGD's momentum buffer `b`.
    MomentumBuffer,
}

impl BufferKind {
    /// The `torch.optim` name (`exp_avg`, `exp_avg_sq`, `momentum_buffer`); checkpoint files
    /// store the buffer of unit `k` as tensor `optim.<name>.<k>`.
    pub fn name(self) -> &'static str {
        match self {
            BufferKind::ExpAvg => "exp_avg",
            BufferKind::ExpAvgSq => "exp_avg_sq",
            BufferKind::MomentumBuffer => "momentum_buffer",
        }
    }
}

impl fmt::Display for BufferKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The hyper-parameters of every group of an optimizer, tagged with its kind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "groups")]
pub enum OptimizerHyper {
    /// AdamW groups (index 0 the default group).
    AdamW(Vec<ParamGroup<AdamWConfig>>),
    /// SGD groups (index 0 the default group).
    Sgd(Vec<ParamGroup<SgdConfig>>),
}

impl OptimizerHyper {
    /// The optimizer kind.
    pub fn kind(&self) -> OptimizerKind {
        match self {
            OptimizerHyper::AdamW(_) => OptimizerKind::AdamW,
            OptimizerHyper::Sgd(_) => OptimizerKind::Sgd,
        }
    }

    /// `(name, patterns)` of each group.
    pub fn group_names(&self) -> Vec<(String, Vec<String>)> {
        fn names<C>(g: &[ParamGroup<C>]) -> Vec<(String, Vec<String>)> {
            g.iter()
                .map(|g| (g.name.clone(), g.patterns.clone()))
                .collect()
        }
        match self {
            OptimizerHyper::AdamW(g) => names(g),
            OptimizerHyper::Sgd(g) => names(g),
        }
    }

    /// The learning rate of each group.
    pub fn learning_rates(&self) -> Vec<f64> {
        match self {
            OptimizerHyper::AdamW(g) => g.iter().map(|g| g.config.lr).collect(),
            OptimizerHyper::Sgd(g) => g.iter().map(|g| g.config.lr).collect(),
        }
    }
}

/// One unit's optimizer state on this rank, as host copies.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UnitOptimState {
    /// Updates taken by each parameter of the unit (layout order); 0 for a parameter never
    /// stepped.
    pub steps: Vec<u64>,
    /// Buffers laid out like the unit's shard (`shard_numel` elements each).
    pub buffers: BTreeMap<BufferKind, Vec<f32>>,
}

/// An optimizer's local state as host copies, for checkpoints: kind and hyper-parameters of
/// every group, steps taken, and per unit the per-parameter step counts and buffers.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerState {
    /// Kind and per-group hyper-parameters.
    pub hyper: OptimizerHyper,
    /// Optimizer steps taken (calls of [`ShardedOptimizer::step`] that stepped something).
    pub step: u64,
    /// Per unit in model order; empty before the first step.
    pub units: Vec<UnitOptimState>,
}

/// An optimizer over the local shards of an [`FsdpModel`].
pub trait ShardedOptimizer {
    /// One update of every parameter that has a gradient ([`crate::ShardView::grad_present`]);
    /// parameters without one are skipped entirely (no decay, no moment update, no step
    /// count), as PyTorch skips parameters whose `.grad` is `None`. In place on the shards'
    /// device; local: no communication. Reads the model through [`FsdpModel::shards`] only.
    ///
    /// Errors ([`Error::InStep`], phase optimizer): no parameter has a gradient (nothing is
    /// changed); state that does not match the model (loaded from another model).
    fn step(&mut self, model: &mut FsdpModel) -> Result<()>;
    /// The algorithm.
    fn kind(&self) -> OptimizerKind;
    /// Learning rate of the default group (group 0).
    fn learning_rate(&self) -> f64;
    /// Sets the learning rate of every group to `lr` (see
    /// [`ShardedOptimizer::set_group_learning_rate`] for one group).
    fn set_learning_rate(&mut self, lr: f64);
    /// Learning rate of each group, in group order.
    fn group_learning_rates(&self) -> Vec<f64>;
    /// Sets group `group`'s learning rate.
    ///
    /// Errors: no such group.
    fn set_group_learning_rate(&mut self, group: usize, lr: f64) -> Result<()>;
    /// Kind and hyper-parameters of every group.
    fn hyper(&self) -> OptimizerHyper;
    /// Copies out the local state (hyper-parameters, step counts and buffers) to the host.
    ///
    /// Errors: a failed device-to-host copy.
    fn state(&self) -> Result<OptimizerState>;
    /// [`ShardedOptimizer::state`] without the buffers (every unit's `buffers` empty), and the
    /// buffer kinds every unit holds (none before the first step): what a writer that streams
    /// the buffers one at a time ([`ShardedOptimizer::with_buffer`]) needs, so that a
    /// checkpoint costs no second copy of the optimizer state (8 bytes a parameter for AdamW).
    ///
    /// The provided version copies the state once ([`ShardedOptimizer::state`]); this crate's
    /// optimizers copy nothing.
    ///
    /// Errors: as [`ShardedOptimizer::state`].
    fn state_header(&self) -> Result<(OptimizerState, Vec<BufferKind>)> {
        let mut st = self.state()?;
        let kinds = st
            .units
            .first()
            .map(|u| u.buffers.keys().copied().collect())
            .unwrap_or_default();
        for u in &mut st.units {
            u.buffers.clear();
        }
        Ok((st, kinds))
    }
    /// Calls `f` with unit `unit`'s buffer of `kind` (`shard_numel` f32 values, laid out like
    /// the unit's shard), borrowed where it is a contiguous host tensor, otherwise a host copy
    /// of that one buffer. A frozen twin's buffers are the state its parameters had when they
    /// were frozen (kept unchanged while frozen), zeros when they were never stepped.
    ///
    /// The provided version copies the whole state ([`ShardedOptimizer::state`]) on every call.
    ///
    /// Errors: no such unit or buffer (the message names both); a failed device-to-host copy;
    /// `f`'s.
    fn with_buffer(
        &self,
        unit: usize,
        kind: BufferKind,
        f: &mut dyn FnMut(&[f32]) -> Result<()>,
    ) -> Result<()> {
        let st = self.state()?;
        let b = st
            .units
            .get(unit)
            .and_then(|u| u.buffers.get(&kind))
            .ok_or_else(|| missing_buffer(unit, kind))?;
        f(b)
    }
    /// Replaces the hyper-parameters and the local state. Buffer lengths are checked against
    /// the model, and buffers moved to the shards' device, at the next step.
    ///
    /// Errors (the optimizer is then unchanged): `state` is of another optimizer kind (the
    /// message names both), or its groups differ from this optimizer's (names or patterns).
    fn load_state(&mut self, state: OptimizerState) -> Result<()>;
    /// Drops the local state (step counts and buffers), keeping the hyper-parameters.
    fn clear_state(&mut self);
    /// Bytes of optimizer state held by this rank (f32: 4 bytes an element).
    fn state_bytes(&self) -> usize;
    /// The dtype the buffers are kept in (f32, or bf16 for [`crate::AdamW::with_state_dtype`]):
    /// checkpoints write them in it. The provided version: f32.
    fn state_dtype(&self) -> candle_core::DType {
        candle_core::DType::F32
    }
}

/// The error of a buffer asked for that the optimizer does not hold.
fn missing_buffer(unit: usize, kind: BufferKind) -> Error {
    Error::missing(
        format!("{} buffer for unit {unit}", kind.name()),
        "the optimizer state does not hold it",
    )
}

/// Checks that `state` may be loaded into an optimizer of `kind` with `ours` groups.
pub(crate) fn check_loadable(
    kind: OptimizerKind,
    ours: &OptimizerHyper,
    state: &OptimizerHyper,
) -> Result<()> {
    if state.kind() != kind {
        return Err(Error::value(
            format!("the kind of an optimizer state loaded into an optimizer of kind {kind}"),
            kind,
            state.kind(),
        ));
    }
    let (a, b) = (ours.group_names(), state.group_names());
    if a != b {
        return Err(Error::shape(format!("optimizer parameter groups (name, patterns) of the state for this {kind} optimizer"), format!("{a:?}"), format!("{b:?}")));
    }
    Ok(())
}
