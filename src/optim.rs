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

use std::collections::BTreeMap;
use std::fmt;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Phase, Result};
use crate::fsdp::FsdpModel;
use crate::fsdp::ShardView;
use crate::ops::{self, AdamWHyper, SgdHyper};

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

/// A parameter group: the parameters whose full name matches one of `patterns` (glob: `*`
/// matches any run of characters, `?` one character; the whole name must match), stepped with
/// `config`. Groups are tried in order; parameters no group matches belong to the default
/// group (index 0, named `default`, whose patterns are empty).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamGroup<C> {
    /// Name of the group (in errors and checkpoints).
    pub name: String,
    /// Name patterns selecting the group's parameters.
    pub patterns: Vec<String>,
    /// The group's hyper-parameters.
    pub config: C,
}

/// Group `group` of `groups`, or an error naming how many there are.
fn group_mut<C>(groups: &mut [ParamGroup<C>], group: usize) -> Result<&mut ParamGroup<C>> {
    let n = groups.len();
    groups.get_mut(group).ok_or_else(|| {
        Error::InvalidArgument(format!("no parameter group {group}: the optimizer has {n}"))
    })
}

impl<C> ParamGroup<C> {
    /// A group named `name` of the parameters matching any of `patterns`.
    pub fn new(
        name: impl Into<String>,
        patterns: impl IntoIterator<Item = impl Into<String>>,
        config: C,
    ) -> Self {
        Self {
            name: name.into(),
            patterns: patterns.into_iter().map(Into::into).collect(),
            config,
        }
    }

    /// Whether `param` (a full parameter name) matches one of the group's patterns.
    pub fn matches(&self, param: &str) -> bool {
        self.patterns.iter().any(|p| glob_match(p, param))
    }
}

/// Glob match of the whole of `name` against `pattern` (`*`: any run, `?`: one character,
/// `[abc]`: a class), with the `glob` crate's syntax, as `FsdpModelBuilder::freeze`. An invalid
/// pattern matches nothing.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    glob::Pattern::new(pattern).is_ok_and(|p| p.matches(name))
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
}

/// The error of a buffer asked for that the optimizer does not hold.
fn missing_buffer(unit: usize, kind: BufferKind) -> Error {
    Error::InvalidArgument(format!(
        "optimizer state: unit {unit} has no {} buffer",
        kind.name()
    ))
}

/// Checks that `state` may be loaded into an optimizer of `kind` with `ours` groups.
pub(crate) fn check_loadable(
    kind: OptimizerKind,
    ours: &OptimizerHyper,
    state: &OptimizerHyper,
) -> Result<()> {
    if state.kind() != kind {
        return Err(Error::InvalidArgument(format!(
            "optimizer state of kind {} cannot be loaded into an optimizer of kind {kind} \
             (expected {kind}, found {})",
            state.kind(),
            state.kind()
        )));
    }
    let (a, b) = (ours.group_names(), state.group_names());
    if a != b {
        return Err(Error::InvalidArgument(format!(
            "optimizer parameter groups differ: this {kind} optimizer has {a:?}, the state has \
             {b:?} (name, patterns)"
        )));
    }
    Ok(())
}

/// The default group index 0 followed by `groups`.
fn with_default<C>(default: C, groups: Vec<ParamGroup<C>>) -> Vec<ParamGroup<C>> {
    let mut all = vec![ParamGroup {
        name: "default".into(),
        patterns: Vec::new(),
        config: default,
    }];
    all.extend(groups);
    all
}

/// The group of parameter `name`: the first group after the default whose patterns match it,
/// else 0.
fn group_of<C>(groups: &[ParamGroup<C>], name: &str) -> usize {
    groups
        .iter()
        .enumerate()
        .skip(1)
        .find(|(_, g)| g.matches(name))
        .map_or(0, |(i, _)| i)
}

/// One unit's device state.
#[derive(Debug)]
struct UnitSlot {
    /// Per parameter: updates taken.
    steps: Vec<u64>,
    /// Per parameter: its group.
    group: Vec<usize>,
    /// Buffers in the optimizer's kinds order (`shard_numel` elements each). A frozen twin
    /// holds them only when its parameters were stepped before they were frozen (loaded from a
    /// checkpoint with nonzero step counts): then they are kept unchanged while frozen, with
    /// the step counts, so that unfreezing resumes as a continuation. None otherwise.
    bufs: Vec<Tensor>,
    /// A frozen twin's `shard_numel` (without buffers its state exports as zeros, see
    /// [`ShardState::export`]).
    frozen_numel: Option<usize>,
}

/// Per-parameter steps and per-unit buffers of one optimizer: allocated at the first step,
/// loaded from host copies, checked against the model before every step.
#[derive(Debug)]
struct ShardState {
    kinds: &'static [BufferKind],
    units: Vec<UnitSlot>,
    /// Loaded state not yet checked against a model.
    pending: Option<Vec<UnitOptimState>>,
}

impl ShardState {
    fn new(kinds: &'static [BufferKind]) -> Self {
        Self {
            kinds,
            units: Vec::new(),
            pending: None,
        }
    }

    fn bytes(&self) -> usize {
        let dev: usize = self
            .units
            .iter()
            .flat_map(|u| &u.bufs)
            .map(Tensor::elem_count)
            .sum();
        let host: usize = self
            .pending
            .iter()
            .flatten()
            .flat_map(|u| u.buffers.values())
            .map(Vec::len)
            .sum();
        4 * (dev + host)
    }

    fn clear(&mut self) {
        self.units.clear();
        self.pending = None;
    }

    fn export(&self) -> Result<Vec<UnitOptimState>> {
        if let Some(p) = &self.pending {
            return Ok(p.clone());
        }
        self.units
            .iter()
            .map(|u| {
                // A frozen twin that was never stepped holds no state; it exports zeros so
                // that every unit of a checkpoint has every buffer kind (the format's
                // invariant).
                let buffers = match u.frozen_numel {
                    Some(n) if u.bufs.is_empty() => {
                        self.kinds.iter().map(|k| (*k, vec![0.0; n])).collect()
                    }
                    _ => self
                        .kinds
                        .iter()
                        .zip(&u.bufs)
                        .map(|(k, b)| Ok((*k, ops::with_host_f32(b, <[f32]>::to_vec)?)))
                        .collect::<Result<_>>()?,
                };
                Ok(UnitOptimState {
                    steps: u.steps.clone(),
                    buffers,
                })
            })
            .collect()
    }

    /// Steps of every unit, buffers left out, and the kinds every unit holds.
    fn header(&self) -> (Vec<UnitOptimState>, Vec<BufferKind>) {
        if let Some(p) = &self.pending {
            let kinds = p
                .first()
                .map(|u| u.buffers.keys().copied().collect())
                .unwrap_or_default();
            let units = p
                .iter()
                .map(|u| UnitOptimState {
                    steps: u.steps.clone(),
                    buffers: BTreeMap::new(),
                })
                .collect();
            return (units, kinds);
        }
        let kinds = if self.units.is_empty() {
            Vec::new()
        } else {
            self.kinds.to_vec()
        };
        let units = self
            .units
            .iter()
            .map(|u| UnitOptimState {
                steps: u.steps.clone(),
                buffers: BTreeMap::new(),
            })
            .collect();
        (units, kinds)
    }

    /// See [`ShardedOptimizer::with_buffer`].
    fn with_buffer(
        &self,
        unit: usize,
        kind: BufferKind,
        f: &mut dyn FnMut(&[f32]) -> Result<()>,
    ) -> Result<()> {
        if let Some(p) = &self.pending {
            let b = p
                .get(unit)
                .and_then(|u| u.buffers.get(&kind))
                .ok_or_else(|| missing_buffer(unit, kind))?;
            return f(b);
        }
        let u = self
            .units
            .get(unit)
            .ok_or_else(|| missing_buffer(unit, kind))?;
        let i = self
            .kinds
            .iter()
            .position(|k| *k == kind)
            .ok_or_else(|| missing_buffer(unit, kind))?;
        match u.frozen_numel {
            Some(n) if u.bufs.is_empty() => f(&vec![0.0; n]),
            _ => ops::with_host_f32(&u.bufs[i], |v| f(v))?,
        }
    }

    fn import(&mut self, units: Vec<UnitOptimState>) {
        self.units.clear();
        self.pending = (!units.is_empty()).then_some(units);
    }

    /// Makes the state match `model` (allocating zeroed buffers at the first step, moving
    /// loaded ones to the shards' device) and assigns each parameter its group.
    fn ensure(&mut self, model: &FsdpModel, group: impl Fn(&str) -> usize) -> Result<()> {
        let n_units = model.shards().len();
        if let Some(loaded) = self.pending.take() {
            let units = self.adopt(model, loaded)?;
            self.units = units;
        }
        if self.units.is_empty() {
            self.units = model
                .shards()
                .map(|v| {
                    Ok(UnitSlot {
                        frozen_numel: v.frozen.then_some(v.layout.shard_numel),
                        steps: vec![0; v.layout.params.len()],
                        group: Vec::new(),
                        // Frozen parameters that were never stepped get no optimizer state.
                        bufs: if v.frozen {
                            Vec::new()
                        } else {
                            self.kinds
                                .iter()
                                .map(|_| {
                                    Tensor::zeros(
                                        v.layout.shard_numel,
                                        DType::F32,
                                        v.param.device(),
                                    )
                                })
                                .collect::<candle_core::Result<_>>()?
                        },
                    })
                })
                .collect::<Result<_>>()?;
        }
        if self.units.len() != n_units {
            return Err(Error::InvalidArgument(format!(
                "optimizer state covers {} units, the model has {n_units}",
                self.units.len()
            )));
        }
        for (v, u) in model.shards().zip(&mut self.units) {
            if u.group.len() != v.layout.params.len() {
                u.group = v.layout.params.iter().map(|p| group(&p.name)).collect();
            }
        }
        Ok(())
    }

    /// Checks loaded host state against the model and moves it to the shards' device.
    fn adopt(&self, model: &FsdpModel, loaded: Vec<UnitOptimState>) -> Result<Vec<UnitSlot>> {
        if loaded.len() != model.shards().len() {
            return Err(Error::InvalidArgument(format!(
                "optimizer state covers {} units, the model has {}",
                loaded.len(),
                model.shards().len()
            )));
        }
        model
            .shards()
            .zip(loaded)
            .map(|(v, mut u)| {
                if u.steps.len() != v.layout.params.len() {
                    return Err(Error::InvalidArgument(format!(
                        "optimizer state of unit {} has step counts for {} parameters, the unit \
                         has {}",
                        v.unit_name,
                        u.steps.len(),
                        v.layout.params.len()
                    )));
                }
                let max_step = u.steps.iter().copied().max().unwrap_or(0);
                if v.frozen && max_step == 0 {
                    // Never stepped: no state to keep (zeros on export).
                    return Ok(UnitSlot {
                        frozen_numel: Some(v.layout.shard_numel),
                        steps: u.steps,
                        group: Vec::new(),
                        bufs: Vec::new(),
                    });
                }
                let bufs =
                    self.kinds
                        .iter()
                        .map(|k| match u.buffers.remove(k) {
                            None if max_step > 0 => Err(Error::InvalidArgument(format!(
                            "optimizer at step {max_step} has no {k} state for unit {} (loaded \
                             from a checkpoint without it?)",
                            v.unit_name
                        ))),
                            None => Ok(Tensor::zeros(
                                v.layout.shard_numel,
                                DType::F32,
                                v.param.device(),
                            )?),
                            Some(b) if b.len() != v.layout.shard_numel => {
                                Err(Error::InvalidArgument(format!(
                                    "optimizer state {k} of unit {} has {} elements, its shard {}",
                                    v.unit_name,
                                    b.len(),
                                    v.layout.shard_numel
                                )))
                            }
                            Some(b) => {
                                let n = b.len();
                                Ok(Tensor::from_vec(b, n, &Device::Cpu)?
                                    .to_device(v.param.device())?)
                            }
                        })
                        .collect::<Result<_>>()?;
                if let Some(k) = u.buffers.keys().next() {
                    return Err(Error::InvalidArgument(format!(
                        "optimizer state of unit {} has a {k} buffer, which this optimizer does \
                         not use",
                        v.unit_name
                    )));
                }
                // A frozen twin whose parameters were stepped keeps their state, unchanged while
                // frozen (see `UnitSlot::bufs`).
                Ok(UnitSlot {
                    frozen_numel: v.frozen.then_some(v.layout.shard_numel),
                    steps: u.steps,
                    group: Vec::new(),
                    bufs,
                })
            })
            .collect()
    }
}

/// The error of a step without any gradient.
fn no_gradient() -> Error {
    Error::Misuse {
        call: "optimizer step",
        state: "without any gradient",
        fix: "no parameter received a gradient since the last zero_grad (was gradient sync left \
              off for every micro-batch?); nothing was changed"
            .into(),
    }
}

fn any_gradient(model: &FsdpModel) -> bool {
    model
        .shards()
        .any(|v| v.grad.is_some() && v.grad_present.iter().any(|&p| p))
}

/// Calls `f(param range of the shard, param index)` for every parameter that has a gradient:
/// once for the whole shard (index `None`) when every parameter has one and `same(i, j)` holds
/// for all of them, else once per piece of a present parameter in this rank's shard. Then
/// returns the indices of the present parameters (the ones whose counts advance).
fn for_present(
    v: &ShardView<'_>,
    same: impl Fn(usize, usize) -> bool,
    mut f: impl FnMut(std::ops::Range<usize>, usize) -> Result<()>,
) -> Result<Vec<usize>> {
    let n = v.layout.params.len();
    let present: Vec<usize> = (0..n).filter(|&i| v.grad_present[i]).collect();
    if present.is_empty() {
        return Ok(present);
    }
    if present.len() == n && (1..n).all(|i| same(0, i)) {
        f(0..v.layout.shard_numel, 0)?;
    } else {
        for e in v.layout.shard_table(v.shard_index) {
            if v.grad_present[e.param_index] && e.numel_in_shard > 0 {
                let r = e.offset_in_shard..e.offset_in_shard + e.numel_in_shard;
                f(r, e.param_index)?;
            }
        }
    }
    Ok(present)
}

fn narrow(t: &Tensor, r: &std::ops::Range<usize>) -> Result<Tensor> {
    if r.start == 0 && r.len() == t.elem_count() {
        Ok(t.clone())
    } else {
        Ok(t.narrow(0, r.start, r.len())?)
    }
}

/// AdamW hyper-parameters (defaults as PyTorch's `torch.optim.AdamW`, except weight decay 0).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay (0 gives Adam).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

impl AdamWConfig {
    /// The f32 constants of update number `t` (counted from 1), computed in f64 and rounded
    /// once, as candle-nn's `AdamW` does.
    fn hyper(&self, t: u64) -> AdamWHyper {
        AdamWHyper {
            beta1: self.beta1 as f32,
            beta2: self.beta2 as f32,
            one_minus_beta1: (1.0 - self.beta1) as f32,
            one_minus_beta2: (1.0 - self.beta2) as f32,
            bias_correction1: (1.0 / (1.0 - self.beta1.powi(t as i32))) as f32,
            bias_correction2: (1.0 / (1.0 - self.beta2.powi(t as i32))) as f32,
            decay: (1.0 - self.lr * self.weight_decay) as f32,
            lr: self.lr as f32,
            eps: self.eps as f32,
        }
    }
}

const ADAMW_BUFFERS: &[BufferKind] = &[BufferKind::ExpAvg, BufferKind::ExpAvgSq];
const SGD_BUFFERS: &[BufferKind] = &[BufferKind::MomentumBuffer];

/// Sharded AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019),
/// computed as candle-nn's `AdamW` and PyTorch's `torch.optim.AdamW` (docs: "Algorithm"):
/// per parameter, with its own update count `t`,
/// `θ ← θ(1 − lr·λ)`, `m ← β1 m + (1 − β1) g`, `v ← β2 v + (1 − β2) g²`,
/// `θ ← θ − lr · (m / (1 − β1ᵗ)) / (sqrt(v / (1 − β2ᵗ)) + ε)`, all in f32 ([`ops::adamw_step`]),
/// with the hyper-parameters of the parameter's group. Moments `m`, `v`: one f32 tensor per
/// unit shard on its device (8 bytes per shard element).
///
/// Not `Clone`: a clone would share the moment tensors, which steps update in place.
#[derive(Debug)]
pub struct AdamW {
    groups: Vec<ParamGroup<AdamWConfig>>,
    steps_taken: u64,
    state: ShardState,
}

impl AdamW {
    /// An optimizer with one group (every parameter); state is allocated at the first step.
    pub fn new(config: AdamWConfig) -> Self {
        Self::with_groups(config, Vec::new())
    }

    /// An optimizer with a default group (`default`, index 0) and `groups` (indices 1…), see
    /// [`ParamGroup`].
    pub fn with_groups(default: AdamWConfig, groups: Vec<ParamGroup<AdamWConfig>>) -> Self {
        Self {
            groups: with_default(default, groups),
            steps_taken: 0,
            state: ShardState::new(ADAMW_BUFFERS),
        }
    }

    /// The groups (index 0 the default).
    pub fn groups(&self) -> &[ParamGroup<AdamWConfig>] {
        &self.groups
    }

    /// The groups, to change hyper-parameters between steps.
    pub fn groups_mut(&mut self) -> &mut [ParamGroup<AdamWConfig>] {
        &mut self.groups
    }

    /// The default group's hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.groups[0].config
    }

    /// Bytes of optimizer state held by this rank.
    pub fn state_bytes(&self) -> usize {
        self.state.bytes()
    }

    fn step_inner(&mut self, model: &FsdpModel) -> Result<()> {
        if !any_gradient(model) {
            return Err(no_gradient());
        }
        let groups = &self.groups;
        self.state.ensure(model, |n| group_of(groups, n))?;
        for (v, u) in model.shards().zip(&mut self.state.units) {
            let Some(g) = v.grad else { continue };
            let (steps, group) = (&u.steps, &u.group);
            let present = for_present(
                &v,
                |i, j| steps[i] == steps[j] && group[i] == group[j],
                |r, i| {
                    let h = groups[group[i]].config.hyper(steps[i] + 1);
                    ops::adamw_step(
                        &narrow(v.param, &r)?,
                        &narrow(g, &r)?,
                        &narrow(&u.bufs[0], &r)?,
                        &narrow(&u.bufs[1], &r)?,
                        &h,
                    )
                    .map_err(|e| e.in_step(Some(v.unit_name), Phase::Optimizer, model.step()))
                },
            )?;
            for i in present {
                u.steps[i] += 1;
            }
        }
        self.steps_taken += 1;
        Ok(())
    }
}

/// The state accessors of [`ShardedOptimizer`] for an optimizer whose local state is a
/// [`ShardState`] in field `state` and whose step count is `steps_taken` (AdamW, SGD).
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

impl ShardedOptimizer for AdamW {
    fn state_bytes(&self) -> usize {
        Self::state_bytes(self)
    }

    fn step(&mut self, model: &mut FsdpModel) -> Result<()> {
        model.in_phase(Phase::Optimizer, Some("FSDP::optimizer_step"), |m| {
            self.step_inner(m)
        })
    }

    fn kind(&self) -> OptimizerKind {
        OptimizerKind::AdamW
    }

    fn learning_rate(&self) -> f64 {
        self.groups[0].config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.groups.iter_mut().for_each(|g| g.config.lr = lr);
    }

    fn group_learning_rates(&self) -> Vec<f64> {
        self.groups.iter().map(|g| g.config.lr).collect()
    }

    fn set_group_learning_rate(&mut self, group: usize, lr: f64) -> Result<()> {
        group_mut(&mut self.groups, group)?.config.lr = lr;
        Ok(())
    }

    fn hyper(&self) -> OptimizerHyper {
        OptimizerHyper::AdamW(self.groups.clone())
    }

    shard_state_access!();

    fn load_state(&mut self, state: OptimizerState) -> Result<()> {
        check_loadable(self.kind(), &self.hyper(), &state.hyper)?;
        let OptimizerHyper::AdamW(groups) = state.hyper else {
            unreachable!("kind checked")
        };
        self.groups = groups;
        self.steps_taken = state.step;
        self.state.import(state.units);
        Ok(())
    }

    fn clear_state(&mut self) {
        self.state.clear();
    }
}

/// SGD hyper-parameters (PyTorch's `torch.optim.SGD`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 disables the buffer).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        Self {
            lr: 1e-2,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

impl SgdConfig {
    fn hyper(&self, first_step: bool) -> SgdHyper {
        SgdHyper {
            lr: self.lr as f32,
            momentum: self.momentum as f32,
            one_minus_dampening: (1.0 - self.dampening) as f32,
            weight_decay: self.weight_decay as f32,
            nesterov: self.nesterov,
            first_step,
        }
    }
}

/// Sharded SGD with momentum, PyTorch's algorithm (`torch.optim.SGD` docs), per parameter:
/// `g ← g + λθ`; `b ← g` at the parameter's first update, else `b ← μ b + (1 − τ) g`;
/// `g ← g + μ b` if Nesterov else `g ← b`; `θ ← θ − lr · g`, in f32 ([`ops::sgd_step`]), with
/// the hyper-parameters of the parameter's group. Momentum buffers: one f32 tensor per unit
/// shard on its device.
///
/// Not `Clone`, for the reason given at [`AdamW`].
#[derive(Debug)]
pub struct Sgd {
    groups: Vec<ParamGroup<SgdConfig>>,
    steps_taken: u64,
    state: ShardState,
}

impl Sgd {
    /// An optimizer with one group (every parameter).
    pub fn new(config: SgdConfig) -> Self {
        Self::with_groups(config, Vec::new())
    }

    /// An optimizer with a default group (`default`, index 0) and `groups` (indices 1…), see
    /// [`ParamGroup`].
    pub fn with_groups(default: SgdConfig, groups: Vec<ParamGroup<SgdConfig>>) -> Self {
        Self {
            groups: with_default(default, groups),
            steps_taken: 0,
            state: ShardState::new(SGD_BUFFERS),
        }
    }

    /// The groups (index 0 the default).
    pub fn groups(&self) -> &[ParamGroup<SgdConfig>] {
        &self.groups
    }

    /// The groups, to change hyper-parameters between steps.
    pub fn groups_mut(&mut self) -> &mut [ParamGroup<SgdConfig>] {
        &mut self.groups
    }

    /// The default group's hyper-parameters.
    pub fn config(&self) -> &SgdConfig {
        &self.groups[0].config
    }

    /// Bytes of optimizer state held by this rank.
    pub fn state_bytes(&self) -> usize {
        self.state.bytes()
    }

    fn step_inner(&mut self, model: &FsdpModel) -> Result<()> {
        if !any_gradient(model) {
            return Err(no_gradient());
        }
        let groups = &self.groups;
        // Momentum buffers exist only when some group uses momentum.
        if self.state.units.is_empty() && self.state.pending.is_none() {
            self.state.kinds = if groups.iter().any(|g| g.config.momentum != 0.0) {
                SGD_BUFFERS
            } else {
                &[]
            };
        }
        self.state.ensure(model, |n| group_of(groups, n))?;
        for (v, u) in model.shards().zip(&mut self.state.units) {
            let Some(g) = v.grad else { continue };
            let (steps, group) = (&u.steps, &u.group);
            let present = for_present(
                &v,
                |i, j| (steps[i] == 0) == (steps[j] == 0) && group[i] == group[j],
                |r, i| {
                    let c = groups[group[i]].config;
                    let buf = match u.bufs.first() {
                        Some(b) if c.momentum != 0.0 => Some(narrow(b, &r)?),
                        _ => None,
                    };
                    ops::sgd_step(
                        &narrow(v.param, &r)?,
                        &narrow(g, &r)?,
                        buf.as_ref(),
                        &c.hyper(steps[i] == 0),
                    )
                    .map_err(|e| e.in_step(Some(v.unit_name), Phase::Optimizer, model.step()))
                },
            )?;
            for i in present {
                u.steps[i] += 1;
            }
        }
        self.steps_taken += 1;
        Ok(())
    }
}

impl ShardedOptimizer for Sgd {
    fn state_bytes(&self) -> usize {
        Self::state_bytes(self)
    }

    fn step(&mut self, model: &mut FsdpModel) -> Result<()> {
        model.in_phase(Phase::Optimizer, Some("FSDP::optimizer_step"), |m| {
            self.step_inner(m)
        })
    }

    fn kind(&self) -> OptimizerKind {
        OptimizerKind::Sgd
    }

    fn learning_rate(&self) -> f64 {
        self.groups[0].config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.groups.iter_mut().for_each(|g| g.config.lr = lr);
    }

    fn group_learning_rates(&self) -> Vec<f64> {
        self.groups.iter().map(|g| g.config.lr).collect()
    }

    fn set_group_learning_rate(&mut self, group: usize, lr: f64) -> Result<()> {
        group_mut(&mut self.groups, group)?.config.lr = lr;
        Ok(())
    }

    fn hyper(&self) -> OptimizerHyper {
        OptimizerHyper::Sgd(self.groups.clone())
    }

    shard_state_access!();

    fn load_state(&mut self, state: OptimizerState) -> Result<()> {
        check_loadable(self.kind(), &self.hyper(), &state.hyper)?;
        let OptimizerHyper::Sgd(groups) = state.hyper else {
            unreachable!("kind checked")
        };
        self.groups = groups;
        self.state.kinds = if self.groups.iter().any(|g| g.config.momentum != 0.0) {
            SGD_BUFFERS
        } else {
            &[]
        };
        self.steps_taken = state.step;
        self.state.import(state.units);
        Ok(())
    }

    fn clear_state(&mut self) {
        self.state.clear();
    }
}
