//! [`FsdpModel`]: construction, the training and eval forwards (any Rust code that calls units
//! through [`Forward`]), and the backward. The schedules only call group transitions
//! (`unshard`, `unshard_wait`, `reshard`, `finish_backward_call`) and ask the [`Scheduler`] what
//! may be prefetched.
//!
//! The algorithm (design/architecture.md, "Any forward"):
//! - **forward**: each [`Forward::call`] unshards the unit's groups just in time (the next call's
//!   gather is issued before this one computes: forward prefetch, predicted from the previous
//!   step's call sequence), runs the unit with autograd on the step's parameter variables and
//!   on a variable copy of each input that carries gradient, and joins it to the caller's
//!   graph as one node ([`super::call`]). The groups of a call are resharded when the next call
//!   starts (FULL_SHARD), so the last call's parameters stay for the backward that follows.
//! - **backward**: one `loss.backward()` of Candle over the caller's graph; each call's node runs
//!   the unit's backward when the gradients of all its outputs are complete — refill (the gather
//!   was prefetched one call ahead in reverse call order), back-propagate through the unit's
//!   own graph, copy the gradients into the group's flat gradient — and, after the group's last
//!   call, issues its reduce-scatter without waiting. The reductions are waited for at the end.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use candle_core::{DType, Tensor, Var};
use candle_nn::ModuleT;

use super::call::{self, StepHook};
use super::collectives::{self, CommContext};
use super::config::{BackwardPrefetch, FsdpConfig, ShardingStrategy};
use super::memory::{MemoryAccount, MemoryStats};
use super::scheduler::Scheduler;
use super::unit_state::FsdpUnit;
use crate::comm::{CommObserver, ProcessGroup, ProcessGroupExt, ReduceOp};
use crate::error::{Error, Phase, Result};
use crate::flat_param::{FlatParamLayout, FlatParameter};
use crate::init::init_values;
use crate::mixed_precision::MixedPrecision;
use crate::trace::{Lane, SpanKind, Tracer};
use crate::unit::{record_unit, RecordedParam, UnitSpec};

/// What a model is built from: groups of units in order, and the freeze patterns. Built by
/// [`FsdpModelBuilder`]; a `Vec<UnitSpec>` converts into a chain of single-unit groups.
#[derive(Clone, Default)]
pub struct ModelSpec {
    groups: Vec<GroupSpec>,
    freeze: Vec<String>,
}

#[derive(Clone)]
struct GroupSpec {
    /// The prefix of the members' parameter names.
    name: String,
    members: Vec<UnitSpec>,
}

impl From<Vec<UnitSpec>> for ModelSpec {
    fn from(specs: Vec<UnitSpec>) -> Self {
        let mut m = ModelSpec::default();
        for s in specs {
            m.push_unit(s);
        }
        m
    }
}

impl ModelSpec {
    /// An empty model.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a unit of its own (its parameters are named `<unit name>.<path>`).
    pub fn push_unit(&mut self, spec: UnitSpec) {
        self.groups.push(GroupSpec {
            name: spec.name.clone(),
            members: vec![spec],
        });
    }

    /// Adds a group (see [`FsdpModelBuilder::group`]).
    pub fn push_group(&mut self, name: impl Into<String>, members: Vec<UnitSpec>) {
        self.groups.push(GroupSpec {
            name: name.into(),
            members,
        });
    }

    /// Adds freeze patterns (see [`FsdpModelBuilder::freeze`]).
    pub fn push_freeze(&mut self, patterns: impl IntoIterator<Item = impl Into<String>>) {
        self.freeze.extend(patterns.into_iter().map(Into::into));
    }

    /// Every tensor the constructors create (parameters and buffers, each once), in build
    /// order: what a full state dict of this model holds.
    ///
    /// Errors: a constructor that fails.
    pub fn record(&self, device: &candle_core::Device) -> Result<Vec<RecordedParam>> {
        let mut out: Vec<RecordedParam> = Vec::new();
        for g in &self.groups {
            for m in &g.members {
                for p in record_unit(m, &g.name, DType::F32, device)? {
                    if !out.iter().any(|q| q.name == p.name) {
                        out.push(p);
                    }
                }
            }
        }
        Ok(out)
    }
}

/// A callable unit: a constructor bound under its group's prefix to the parameters of its
/// groups (its own or its tied group's, plus a frozen twin when some are frozen).
pub(crate) struct Member {
    pub(crate) spec: UnitSpec,
    pub(crate) prefix: String,
    /// Indices into `FsdpModel::units`: the group holding the trainable parameters and buffers
    /// first, then the frozen twin if any.
    pub(crate) groups: Vec<usize>,
    /// The full names of the tensors its constructor asks for.
    params: HashSet<String>,
}

/// A parameter group laid out but not allocated yet (see [`FsdpModel::build_with`]).
struct PlannedUnit {
    name: String,
    recorded: Vec<RecordedParam>,
    layout: FlatParamLayout,
    buffers: Vec<(String, Var)>,
    policy: MixedPrecision,
    frozen: bool,
    reshard: bool,
}

/// A training or eval forward in progress, and what its backward needs.
struct StepState {
    train: bool,
    hook: Arc<StepHook>,
    /// The scalar variable every call node hangs from.
    anchor: Tensor,
    calls: Vec<CallRecord>,
    /// Groups of the latest call (resharded when the next call starts).
    last_groups: Vec<usize>,
    /// The output nodes with zero elements handed to the caller (a rank whose batch is empty):
    /// the backward adds their sums (exactly 0) to the loss, so that every such call's backward
    /// runs, in graph order, whatever loss the caller computed from them (see
    /// [`FsdpModel::backward`]).
    empty_outputs: Vec<Tensor>,
}

/// One call of a unit in a training forward.
struct CallRecord {
    member: usize,
    groups: Vec<usize>,
    /// Activation checkpointing: recompute in backward from `saved_inputs`.
    checkpoint: bool,
    /// The unit's inputs as it received them (cast, detached): kept for a recompute.
    saved_inputs: Vec<Tensor>,
    /// Which inputs carry gradient (indices into the call's inputs), and their dtypes as the
    /// caller passed them.
    tracked: Vec<(usize, DType)>,
    /// The unit graph's variables of the tracked inputs (empty when checkpointed).
    input_vars: Vec<Tensor>,
    /// The unit's outputs attached to its graph (`None`: not differentiable, or checkpointed).
    outputs: Vec<Option<Tensor>>,
    /// For each output whose storage was freed after the forward: the output node holding the
    /// same values, to refill it from before the backward.
    refill_from: Vec<Option<Tensor>>,
    /// Gradients of the outputs, stored by the output nodes.
    out_grads: Vec<Option<Tensor>>,
    /// Gradients of the tracked inputs, handed out by the input nodes.
    in_grads: Vec<Option<Tensor>>,
    done: bool,
}

/// A model whose units' parameters are sharded over a process group.
///
/// Every method that communicates (`forward`, `forward_with`, `forward_eval`, `backward`,
/// `gather_full_params`) is a collective: all ranks must call it, and call the same units in
/// the same order. Errors raised during a step name the unit, the phase and the step
/// ([`Error::InStep`]).
pub struct FsdpModel {
    pub(super) pg: Arc<dyn ProcessGroup>,
    /// The comm streams of this model's all-gathers and reductions.
    pub(super) comm: CommContext,
    pub(super) config: FsdpConfig,
    /// Parameter groups, in build order (what checkpoints and optimizers see as units).
    pub(crate) units: Vec<FsdpUnit>,
    pub(crate) members: Vec<Member>,
    by_name: HashMap<String, usize>,
    pub(super) mem: MemoryAccount,
    scheduler: Scheduler,
    requires_gradient_sync: bool,
    tracer: Option<Arc<Tracer>>,
    /// Training forwards started (the step number of errors and traces is `steps_started - 1`
    /// during a step).
    steps_started: u64,
    step: Option<StepState>,
    /// The members called by the previous training and eval forwards, in order (the forward
    /// prefetch's prediction).
    prev_tape: [Vec<usize>; 2],
    /// The members called so far by the current forward.
    tape_now: Vec<usize>,
    /// The groups all-gathered so far by the current forward, in issue order.
    gathered_now: Vec<usize>,
}

/// Builder of an [`FsdpModel`]: add units (and groups) in build order, then
/// [`FsdpModelBuilder::build`].
pub struct FsdpModelBuilder {
    pg: Arc<dyn ProcessGroup>,
    config: FsdpConfig,
    spec: ModelSpec,
}

impl FsdpModelBuilder {
    /// Adds a unit built by a candle-nn style constructor of a module of one input and one
    /// output tensor, e.g. `.unit("fc1", |vb| candle_nn::linear(784, 128, vb))`. Its parameters
    /// are named `<name>.<path>`. [`FsdpModel::forward`] runs the units in the order they are
    /// added, each taking the previous one's output; [`FsdpModel::forward_with`] calls them by
    /// name in any order.
    pub fn unit<M, F>(mut self, name: impl Into<String>, ctor: F) -> Self
    where
        M: ModuleT + 'static,
        F: Fn(candle_nn::VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
    {
        self.spec.push_unit(UnitSpec::new(name, ctor));
        self
    }

    /// Adds an already wrapped unit (e.g. [`UnitSpec::multi`], several inputs and outputs).
    pub fn unit_spec(mut self, spec: UnitSpec) -> Self {
        self.spec.push_unit(spec);
        self
    }

    /// Adds several wrapped units, in order (e.g. `models::mnist_mlp`).
    pub fn units(mut self, specs: impl IntoIterator<Item = UnitSpec>) -> Self {
        specs.into_iter().for_each(|s| self.spec.push_unit(s));
        self
    }

    /// Adds units that share parameters, as one group (FSDP2's `fully_shard([emb, head])`):
    /// one FlatParameter, gathered for each member's call and reduced once per step with the sum
    /// of every call's gradient. Each member's constructor gets the *group's* prefix, so a
    /// tensor both ask for by the same name is one tensor: with group `"wte"`, an embedding
    /// member and an LM-head member that both call `vb.get((vocab, d), "weight")` share
    /// `wte.weight` (GPT-2's tied weights). Members are called by their own names; a tensor asked
    /// for twice must have one shape. The group takes its mixed-precision policy,
    /// `reshard_after_forward` and buffers from its first member.
    pub fn group(
        mut self,
        name: impl Into<String>,
        members: impl IntoIterator<Item = UnitSpec>,
    ) -> Self {
        self.spec.push_group(name, members.into_iter().collect());
        self
    }

    /// Freezes the parameters whose full name matches one of `patterns` (glob syntax: `*` any
    /// run of characters, `?` one, `[abc]` a class; e.g. `"wpe.*"`, `"blk*.ln1.weight"`).
    /// Frozen parameters get no gradient and no optimizer state, never change, and take no part
    /// in the reduce-scatter: a unit's frozen parameters form a group of their own (its
    /// *frozen twin*, named `<unit>[frozen]` in checkpoints), gathered with the unit and never
    /// reduced.
    ///
    /// [`FsdpModelBuilder::build`] fails on an invalid pattern or one that matches nothing.
    pub fn freeze(mut self, patterns: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.spec.push_freeze(patterns);
        self
    }

    /// Sets [`FsdpConfig::memory_budget`]: [`FsdpModelBuilder::build`] then fails before any
    /// shard is allocated when the model's plan exceeds it.
    pub fn memory_budget(mut self, budget: super::MemoryBudget) -> Self {
        self.config.memory_budget = Some(budget);
        self
    }

    /// Records every unit, lays out and initialises its shard, one group at a time (the peak is
    /// one unit's largest parameter, never the model).
    ///
    /// Errors: see [`FsdpModel::build_with`].
    pub fn build(self) -> Result<FsdpModel> {
        let FsdpModelBuilder { pg, config, spec } = self;
        let seed = config.seed;
        FsdpModel::build_with(pg, config, spec, |p, range, out| {
            let values = init_values(&p.name, &p.shape, p.hint, seed);
            out.copy_from_slice(&values[range]);
            Ok(())
        })
    }
}

/// The handle through which a forward calls units (see [`FsdpModel::forward_with`]).
pub struct Forward<'a> {
    model: &'a mut FsdpModel,
}

impl Forward<'_> {
    /// Calls every unit in build order, each on the previous one's output (the chain of
    /// [`FsdpModel::forward`] / [`FsdpModel::forward_eval`]); returns the last output.
    fn call_chain(&mut self, x: Tensor) -> Result<Tensor> {
        (0..self.model.members.len()).try_fold(x, |h, m| self.model.call1(m, &h))
    }

    /// Calls unit `unit` on `xs` and returns its outputs: all-gathers its parameters (if they
    /// are not already there), runs it, and — in a training forward — joins it to the autograd
    /// graph so that [`FsdpModel::backward`] runs its backward when its outputs' gradients are
    /// complete. Float outputs carry gradients; integer outputs come back as they are. Float
    /// inputs are cast to the unit's `param_dtype` (when its policy says so); those with
    /// autograd history receive gradients.
    ///
    /// Errors ([`Error::InStep`] naming the unit): no unit of that name; the unit's own error;
    /// any collective error; an output not connected by autograd to the unit's parameters or
    /// inputs (an operation without backward inside, e.g. candle-nn 0.11's fused `layer_norm`:
    /// use [`crate::nn`]'s).
    pub fn call(&mut self, unit: &str, xs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let m = self.model.member_index(unit)?;
        self.model.call(m, xs)
    }

    /// [`Forward::call`] of a unit of one input and one output (e.g. any candle-nn module).
    ///
    /// Errors: as [`Forward::call`]; the unit returned another number of outputs.
    pub fn call1(&mut self, unit: &str, x: &Tensor) -> Result<Tensor> {
        let m = self.model.member_index(unit)?;
        self.model.call1(m, x)
    }

    /// True in a training forward ([`FsdpModel::forward_with`]), false in an eval forward.
    pub fn is_training(&self) -> bool {
        self.model.step.as_ref().is_some_and(|s| s.train)
    }

    /// The model's process group (e.g. for the rank in a data-dependent forward).
    pub fn process_group(&self) -> &Arc<dyn ProcessGroup> {
        &self.model.pg
    }
}

impl FsdpModel {
    /// Starts a builder for a model on `pg` with `config`.
    pub fn builder(pg: Arc<dyn ProcessGroup>, config: FsdpConfig) -> FsdpModelBuilder {
        FsdpModelBuilder {
            pg,
            config,
            spec: ModelSpec::default(),
        }
    }

    /// Builds the model, filling each shard piece with `fill(param, range_in_param, out)`.
    ///
    /// A collective: it creates the model's comm streams ("all_gather", "reduce_scatter") on the
    /// group, so every rank builds its models in the same order.
    ///
    /// Errors: no unit; two units of one name; two units (not in one group) that create a tensor
    /// of one name; members of a group that ask for one tensor with two shapes; an invalid
    /// freeze pattern or one that matches no parameter; a constructor that fails; an invalid
    /// mixed-precision policy; ranks that built different models; a stream that cannot be
    /// created.
    pub fn build_with(
        pg: Arc<dyn ProcessGroup>,
        config: FsdpConfig,
        spec: impl Into<ModelSpec>,
        mut fill: impl FnMut(&RecordedParam, std::ops::Range<usize>, &mut [f32]) -> Result<()>,
    ) -> Result<FsdpModel> {
        let spec: ModelSpec = spec.into();
        if !config.device.same_device(pg.device()) {
            return Err(Error::InvalidArgument(format!(
                "FsdpConfig::device is {:?} but the process group's buffers live on {:?} (rank                  {}): set `device: pg.device().clone()` (on a GPU each rank's Candle device,                  with its own compute stream, is the group's)",
                config.device.location(),
                pg.device().location(),
                pg.rank()
            )));
        }
        if spec.groups.iter().all(|g| g.members.is_empty()) {
            return Err(Error::InvalidArgument(
                "a model needs at least one unit".into(),
            ));
        }
        let patterns = spec
            .freeze
            .iter()
            .map(|p| {
                glob::Pattern::new(p).map_err(|e| {
                    Error::InvalidArgument(format!("freeze pattern {p:?} is not a valid glob: {e}"))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut pattern_used = vec![false; patterns.len()];
        let (shard_world, shard_index) = match config.sharding_strategy {
            ShardingStrategy::NoShard => (1, 0),
            _ => (pg.world_size(), pg.rank()),
        };
        let mut planned: Vec<PlannedUnit> = Vec::new();
        let mut members: Vec<Member> = Vec::new();
        // Which unit created each tensor name (for the clash error).
        let mut creator: HashMap<String, String> = HashMap::new();
        for g in spec.groups {
            let Some(first) = g.members.first() else {
                return Err(Error::InvalidArgument(format!(
                    "group {} has no unit",
                    g.name
                )));
            };
            for m in &g.members {
                if members.iter().any(|o| o.spec.name == m.name) {
                    return Err(Error::InvalidArgument(format!(
                        "two units are named {}",
                        m.name
                    )));
                }
            }
            // Record every member under the group's prefix; a name asked for by two members of
            // the group is one tensor.
            let mut all_recorded: Vec<RecordedParam> = Vec::new();
            let mut asked_by: HashMap<String, String> = HashMap::new();
            let mut member_names: Vec<HashSet<String>> = Vec::new();
            for m in &g.members {
                let recorded = record_unit(m, &g.name, DType::F32, &config.device)?;
                member_names.push(recorded.iter().map(|p| p.name.clone()).collect());
                for p in recorded {
                    if let Some(other) = creator.get(&p.name) {
                        return Err(Error::InvalidArgument(format!(
                            "units {other} and {} both create a tensor named {}: full names must \
                             be unique (checkpoints and state dicts are keyed by them); to share \
                             one tensor between units (tied weights), put them in one group: \
                             builder.group(\"<prefix>\", [UnitSpec::new(\"{other}\", ..), \
                             UnitSpec::new(\"{}\", ..)])",
                            m.name, p.name, m.name
                        )));
                    }
                    match all_recorded.iter().find(|q| q.name == p.name) {
                        Some(q) if q.shape != p.shape => {
                            return Err(Error::InvalidArgument(format!(
                                "units {} and {} of group {} both ask for {} but with different \
                                 shapes: {:?} and {:?}",
                                asked_by[&p.name],
                                m.name,
                                g.name,
                                p.name,
                                q.shape.dims(),
                                p.shape.dims()
                            )))
                        }
                        Some(_) => {}
                        None => {
                            asked_by.insert(p.name.clone(), m.name.clone());
                            all_recorded.push(p);
                        }
                    }
                }
            }
            for p in &all_recorded {
                creator.insert(p.name.clone(), asked_by[&p.name].clone());
            }
            let (buffer_recs, params): (Vec<_>, Vec<_>) = all_recorded.into_iter().partition(|p| {
                config
                    .buffer_suffixes
                    .iter()
                    .any(|s| p.name.rsplit('.').next() == Some(s.as_str()))
            });
            let (frozen, trainable): (Vec<_>, Vec<_>) = params.into_iter().partition(|p| {
                let mut hit = false;
                for (i, pat) in patterns.iter().enumerate() {
                    if pat.matches(&p.name) {
                        pattern_used[i] = true;
                        hit = true;
                    }
                }
                hit
            });
            let policy = match first.mixed_precision {
                Some(p) => p,
                None if buffer_recs.iter().any(|b| b.name.ends_with("running_mean")) => {
                    MixedPrecision {
                        buffer_dtype: config.mixed_precision.buffer_dtype,
                        ..MixedPrecision::full_f32()
                    }
                }
                None => config.mixed_precision,
            };
            policy.validate()?;
            let buffers = buffer_recs
                .iter()
                .map(|p| {
                    let v = init_values(&p.name, &p.shape, p.hint, config.seed);
                    let t = Tensor::from_vec(v, p.shape.clone(), &config.device)?
                        .to_dtype(policy.buffer_dtype)?;
                    Ok((p.name.clone(), Var::from_tensor(&t)?))
                })
                .collect::<Result<Vec<_>>>()?;
            let reshard = config.sharding_strategy == ShardingStrategy::FullShard
                && first.reshard_after_forward;
            // Laid out now, allocated after the budget check (below).
            let base = planned.len();
            let mut plan_unit = |name: String,
                                 recorded: Vec<RecordedParam>,
                                 buffers: Vec<(String, Var)>,
                                 is_frozen: bool|
             -> Result<()> {
                let named: Vec<_> = recorded
                    .iter()
                    .map(|p| (p.name.clone(), p.shape.clone()))
                    .collect();
                planned.push(PlannedUnit {
                    layout: FlatParamLayout::new(&named, shard_world)?,
                    name,
                    recorded,
                    buffers,
                    policy,
                    frozen: is_frozen,
                    reshard,
                });
                Ok(())
            };
            let has_frozen = !frozen.is_empty();
            plan_unit(g.name.clone(), trainable, buffers, false)?;
            if has_frozen {
                plan_unit(format!("{}[frozen]", g.name), frozen, Vec::new(), true)?;
            }
            let group_units: Vec<usize> = (base..base + 1 + usize::from(has_frozen)).collect();
            for (m, names) in g.members.into_iter().zip(member_names) {
                members.push(Member {
                    spec: m,
                    prefix: g.name.clone(),
                    groups: group_units.clone(),
                    params: names,
                });
            }
        }
        if let Some(i) = pattern_used.iter().position(|u| !u) {
            let mut names: Vec<&str> = planned
                .iter()
                .flat_map(|u| u.layout.params.iter().map(|p| p.name.as_str()))
                .collect();
            names.sort_unstable();
            return Err(Error::InvalidArgument(format!(
                "freeze pattern {:?} matches no parameter; the parameters are: {}",
                spec.freeze[i],
                names.join(", ")
            )));
        }
        if let Some(budget) = &config.memory_budget {
            let groups: Vec<super::budget::GroupSize> = planned
                .iter()
                .map(|u| super::budget::GroupSize::of(&u.layout, &u.policy, u.frozen))
                .collect();
            super::budget::check(&groups, &config, pg.world_size(), budget)?;
        }
        let units = planned
            .into_iter()
            .map(|u| {
                let recorded = u.recorded;
                let flat = FlatParameter::from_fn(
                    u.layout,
                    shard_index,
                    &config.device,
                    |i, range, out| fill(&recorded[i], range, out),
                )?;
                let mut unit = FsdpUnit::new(u.name, flat, u.buffers, u.policy, u.frozen);
                unit.reshard_after_forward = u.reshard;
                Ok(unit)
            })
            .collect::<Result<Vec<_>>>()?;
        agree_on_model(pg.as_ref(), &units, config.sharding_strategy)?;
        let comm = CommContext::new(pg.as_ref())?;
        let by_name = members
            .iter()
            .enumerate()
            .map(|(i, m)| (m.spec.name.clone(), i))
            .collect();
        Ok(FsdpModel {
            scheduler: Scheduler::new(&config),
            comm,
            pg,
            config,
            units,
            members,
            by_name,
            mem: MemoryAccount::default(),
            requires_gradient_sync: true,
            tracer: None,
            steps_started: 0,
            step: None,
            prev_tape: [Vec::new(), Vec::new()],
            tape_now: Vec::new(),
            gathered_now: Vec::new(),
        })
    }

    /// The process group.
    pub fn process_group(&self) -> &Arc<dyn ProcessGroup> {
        &self.pg
    }

    /// The device of the shards and of every unit's computation ([`FsdpConfig::device`]):
    /// inputs must be moved there.
    pub fn device(&self) -> &candle_core::Device {
        &self.config.device
    }

    /// The configuration.
    pub fn config(&self) -> &FsdpConfig {
        &self.config
    }

    /// The names of the units that can be called, in build order.
    pub fn unit_names(&self) -> impl Iterator<Item = &str> {
        self.members.iter().map(|m| m.spec.name.as_str())
    }

    /// Memory counters of this rank.
    pub fn memory_stats(&self) -> MemoryStats {
        let mut m = self.mem.snapshot();
        m.sharded_bytes = self.units.iter().map(|u| u.flat().sharded_bytes()).sum();
        m.unsharded_grad_bytes = self.units.iter().map(FsdpUnit::unsharded_grad_bytes).sum();
        m
    }

    /// This model's per-rank memory plan for one training step (see [`super::budget`]): its
    /// sharded state with `optimizer_bytes_per_element` bytes of optimizer state per trainable
    /// element (8 for AdamW), the unsharded units in flight, and `activation_bytes`.
    pub fn memory_plan(
        &self,
        optimizer_bytes_per_element: usize,
        activation_bytes: usize,
    ) -> super::MemoryPlan {
        let groups: Vec<super::budget::GroupSize> = self
            .units
            .iter()
            .map(|u| super::budget::GroupSize::of(u.flat().layout(), u.policy(), u.is_frozen()))
            .collect();
        let budget = super::MemoryBudget {
            max_bytes_per_rank: usize::MAX,
            optimizer_bytes_per_element,
            activation_bytes,
        };
        super::budget::plan(&groups, &self.config, self.pg.world_size(), &budget)
    }

    /// Resets the peak counters to the current values.
    pub fn reset_peak(&mut self) {
        self.mem.reset_peak();
    }

    /// Drops every gradient shard and any unsynchronised accumulated gradient (PyTorch's
    /// `zero_grad(set_to_none=True)`).
    pub fn zero_grad(&mut self) {
        self.units.iter_mut().for_each(FsdpUnit::zero_grad);
    }

    /// Turns gradient synchronisation off or on (FSDP2's `set_requires_gradient_sync`, FSDP1's
    /// `no_sync`). While off, [`FsdpModel::backward`] issues no reduce-scatter: each unit's
    /// gradient is added into an unsharded f32 buffer on this rank (memory: one f32 copy of
    /// every unit's parameters). The first backward with sync on reduces that sum together with
    /// its own gradient, in one reduce-scatter per unit.
    pub fn set_requires_gradient_sync(&mut self, sync: bool) {
        self.requires_gradient_sync = sync;
    }

    /// Whether backward reduces gradients (see [`FsdpModel::set_requires_gradient_sync`]).
    pub fn requires_gradient_sync(&self) -> bool {
        self.requires_gradient_sync
    }

    /// Records spans of this model's compute, waits and collectives (also on the process group's
    /// comm streams) into `tracer`; `None` stops. Each training forward starts a new step.
    pub fn set_tracer(&mut self, tracer: Option<Arc<Tracer>>) {
        // On a GPU, spans are timed with CUDA events on the compute stream (host clocks time
        // only the issue); a clock that cannot be set leaves host timing, with a warning.
        #[cfg(feature = "cuda")]
        if let (Some(t), candle_core::Device::Cuda(d)) = (&tracer, &self.config.device) {
            if let Err(e) = t.time_on_gpu(d.cuda_stream()) {
                tracing::warn!("trace: timing on the host clock: {e}");
            }
        }
        self.pg
            .set_observer(tracer.clone().map(|t| t as Arc<dyn CommObserver>));
        self.tracer = tracer;
    }

    /// The tracer set by [`FsdpModel::set_tracer`].
    pub fn tracer(&self) -> Option<&Arc<Tracer>> {
        self.tracer.as_ref()
    }

    /// The current step number (training forwards started so far, minus one; 0 before any).
    pub fn step(&self) -> u64 {
        self.steps_started.saturating_sub(1)
    }

    /// A compute-lane span named lazily (`name` runs only when tracing is on or with the `nvtx`
    /// feature, where it is also an NVTX range for `nsys`).
    pub(crate) fn span(
        &self,
        kind: SpanKind,
        name: impl FnOnce() -> String,
    ) -> Option<crate::trace::ComputeSpan> {
        use crate::trace::{ComputeSpan, NvtxRange};
        match self.tracer.as_ref().filter(|t| t.is_enabled()) {
            Some(t) => t.span(Lane::Compute, kind, name()).map(ComputeSpan::Traced),
            None if cfg!(feature = "nvtx") => Some(ComputeSpan::Nvtx(NvtxRange::new(name))),
            None => None,
        }
    }

    /// An NVTX range only (FSDP2's `FSDP::pre_forward`, `FSDP::pre_backward`,
    /// `FSDP::post_backward`): phases that are not compute spans of the Chrome trace.
    fn nvtx_range(&self, name: impl FnOnce() -> String) -> crate::trace::NvtxRange {
        crate::trace::NvtxRange::new(name)
    }

    /// A zero-length issue marker on the compute lane (and an NVTX marker).
    fn mark_issue(&self, name: impl FnOnce() -> String) {
        if let Some(t) = self.tracer.as_ref().filter(|t| t.is_enabled()) {
            let name = name();
            crate::trace::nvtx_mark(|| name.clone());
            t.instant(Lane::Compute, SpanKind::Issue, name);
        } else {
            crate::trace::nvtx_mark(name);
        }
    }

    /// Wraps an error with unit (group) `k`, `phase` and the current step ([`Error::InStep`]).
    pub(crate) fn at(&self, e: Error, k: Option<usize>, phase: Phase) -> Error {
        e.in_step(k.map(|k| self.units[k].name()), phase, self.step())
    }

    /// Wraps an error with the unit called `name`, `phase` and the current step.
    fn at_name(&self, e: Error, name: &str, phase: Phase) -> Error {
        e.in_step(Some(name), phase, self.step())
    }

    /// The index of the unit called `name`.
    fn member_index(&self, name: &str) -> Result<usize> {
        self.by_name.get(name).copied().ok_or_else(|| {
            let names: Vec<&str> = self.unit_names().collect();
            Error::InvalidArgument(format!(
                "no unit named {name:?}; the model's units are: {}",
                names.join(", ")
            ))
        })
    }

    /// Unshards group `g` (issues its all-gather) and marks the issue in the trace.
    fn unshard(&mut self, g: usize) {
        if self.units[g].gathers() && self.units[g].is_sharded() {
            self.mark_issue(|| format!("FSDP::all_gather {}", self.units[g].name()));
            if self.step.is_some() {
                self.gathered_now.push(g);
            }
        }
        self.units[g].unshard(self.pg.as_ref(), &self.comm.all_gather, &self.mem);
    }

    /// Makes group `g`'s parameters present (waiting for its all-gather, issuing it if needed),
    /// recording the wait as exposed communication.
    fn unshard_wait(&mut self, g: usize) -> Result<()> {
        if self.units[g].is_present() {
            return Ok(());
        }
        self.unshard(g);
        let _w = self.units[g].gathers().then(|| {
            self.span(SpanKind::Wait, || {
                format!("FSDP::wait all_gather {}", self.units[g].name())
            })
        });
        self.units[g].unshard_wait(self.pg.as_ref(), &self.comm.all_gather, &self.mem)
    }

    /// Issues the gathers of `groups` that are neither present nor in flight, as far as
    /// `limit_all_gathers` allows.
    fn prefetch_groups(&mut self, groups: &[usize]) {
        for &g in groups {
            if self.units[g].is_sharded() && self.scheduler.may_prefetch(&self.mem) {
                self.unshard(g);
            }
        }
    }

    /// Drops whatever a previous step left (saved graphs, gathers in flight, reductions):
    /// afterwards every group is sharded and idle, and the memory guards are released.
    fn release_step(&mut self) {
        if let Some(s) = self.step.take() {
            s.hook.end();
        }
        self.units.iter_mut().for_each(FsdpUnit::release);
        drop(self.scheduler.take_reductions());
    }

    /// True when a training forward ran and its backward has not.
    fn forward_pending(&self) -> bool {
        self.step
            .as_ref()
            .is_some_and(|s| s.train && !s.calls.is_empty())
    }

    /// Drops what the last training forward kept for its backward (to run another training
    /// forward without back-propagating the previous one).
    pub fn discard_forward(&mut self) {
        self.release_step();
    }

    /// Sharded training forward of a chain (a collective): runs every unit in build order, each
    /// on the previous one's output, and returns the last output, ready for a loss that
    /// [`FsdpModel::backward`] back-propagates. The output is in the last unit's `param_dtype`.
    /// The same as [`FsdpModel::forward_with`] calling each unit in turn.
    ///
    /// `x`: the first unit's input, any shape the first unit accepts.
    ///
    /// Errors: a model with a group of several units (call them with
    /// [`FsdpModel::forward_with`]); as [`FsdpModel::forward_with`].
    pub fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        self.check_chain()?;
        self.forward_with(|f| f.call_chain(x.clone()))
    }

    /// Sharded inference forward of a chain (a collective): every unit gathered, run with
    /// `train = false` and resharded; nothing kept for backward.
    ///
    /// Errors: as [`FsdpModel::forward`], phase eval.
    pub fn forward_eval(&mut self, x: &Tensor) -> Result<Tensor> {
        self.check_chain()?;
        self.forward_eval_with(|f| f.call_chain(x.detach()))
    }

    fn check_chain(&self) -> Result<()> {
        if self.members.len() != self.units.iter().filter(|u| !u.is_frozen()).count() {
            return Err(Error::InvalidArgument(
                "forward(x) runs the units as a chain, but this model has a group of several \
                 units (tied weights): write the forward with forward_with(|f| ...) and \
                 f.call(unit, inputs)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Sharded training forward written as ordinary Rust (a collective): `f` calls units by name
    /// through [`Forward::call`] / [`Forward::call1`], in any order and any number of times,
    /// with the caller's own tensor operations in between (residuals across units,
    /// concatenations, masks), and returns whatever it computes — typically the logits or the
    /// loss. [`FsdpModel::backward`] then back-propagates a loss computed from it.
    ///
    /// Each call all-gathers the unit's parameters just in time (the next call's gather, as
    /// predicted from the previous step's call sequence, is issued before this call computes)
    /// and, under FULL_SHARD, frees them when the next call starts (the last call keeps them
    /// for the backward that follows). See `design/architecture.md`, "Any forward".
    ///
    /// Errors ([`Error::InStep`] with phase forward and the unit): the previous training forward
    /// was not back-propagated (call [`FsdpModel::backward`] or [`FsdpModel::discard_forward`]
    /// first); whatever `f` returns; a unit's error; any collective error.
    pub fn forward_with<T>(&mut self, f: impl FnOnce(&mut Forward<'_>) -> Result<T>) -> Result<T> {
        if self.forward_pending() {
            return Err(Error::InvalidArgument(
                "forward called while the previous training forward was not back-propagated: \
                 its saved state would be lost and a loss using both outputs would get wrong \
                 gradients; call backward first, or discard_forward() to drop it"
                    .into(),
            ));
        }
        self.release_step();
        if let Some(t) = &self.tracer {
            t.set_step(self.steps_started);
        }
        self.steps_started += 1;
        self.begin_step(true)?;
        let result = f(&mut Forward { model: self });
        match result {
            Ok(v) => {
                // The call sequence stays in `tape_now` for the backward's agreement check.
                self.prev_tape[0] = self.tape_now.clone();
                Ok(v)
            }
            Err(e) => {
                self.release_step();
                Err(self.at_name_opt(e, Phase::Forward))
            }
        }
    }

    /// Sharded inference forward written as ordinary Rust (a collective): as
    /// [`FsdpModel::forward_with`], but every call gathers, runs with `train = false` and
    /// frees at once; no autograd, nothing kept.
    ///
    /// Errors ([`Error::InStep`], phase eval): a training forward awaits its backward; whatever
    /// `f` returns; a unit's error; any collective error.
    pub fn forward_eval_with<T>(
        &mut self,
        f: impl FnOnce(&mut Forward<'_>) -> Result<T>,
    ) -> Result<T> {
        if self.forward_pending() {
            return Err(Error::InvalidArgument(
                "forward_eval called while a training forward awaits its backward: it would \
                 drop that forward's saved state; call backward first, or discard_forward() \
                 to drop it"
                    .into(),
            ));
        }
        self.release_step();
        self.begin_step(false)?;
        let result = f(&mut Forward { model: self });
        let result = result.and_then(|v| {
            let agreement = self.issue_agreement();
            self.finish_agreement(agreement, Phase::Eval).map(|()| v)
        });
        let tape = self.tape();
        self.release_step();
        match result {
            Ok(v) => {
                self.prev_tape[1] = tape;
                Ok(v)
            }
            Err(e) => Err(self.at_name_opt(e, Phase::Eval)),
        }
    }

    /// Wraps an error of a forward closure that carries no place yet (the caller's own
    /// operations) with the phase and step.
    fn at_name_opt(&self, e: Error, phase: Phase) -> Error {
        e.in_step(None, phase, self.step())
    }

    fn begin_step(&mut self, train: bool) -> Result<()> {
        self.step = Some(StepState {
            train,
            hook: Arc::new(StepHook::default()),
            anchor: Var::zeros((), DType::F32, &self.config.device)?.into_inner(),
            calls: Vec::new(),
            last_groups: Vec::new(),
            empty_outputs: Vec::new(),
        });
        self.tape_now.clear();
        self.gathered_now.clear();
        Ok(())
    }

    fn tape(&mut self) -> Vec<usize> {
        std::mem::take(&mut self.tape_now)
    }

    /// The member predicted to follow call number `pos` (member `m`): the previous forward's
    /// next call when its sequence matched so far, the next unit in build order without one.
    fn predicted_next(&self, m: usize, pos: usize, train: bool) -> Option<usize> {
        let prev = &self.prev_tape[usize::from(!train)];
        if prev.is_empty() {
            return (m + 1 < self.members.len()).then_some(m + 1);
        }
        (prev.get(pos) == Some(&m))
            .then(|| prev.get(pos + 1).copied())
            .flatten()
    }

    /// One call of member `m` with one input and one output.
    fn call1(&mut self, m: usize, x: &Tensor) -> Result<Tensor> {
        let mut out = self.call(m, &[x])?;
        match out.len() {
            1 => Ok(out.pop().expect("one output")),
            n => Err(self.at_name(
                Error::InvalidArgument(format!(
                    "call1 expects one output, but the unit returned {n}: use call"
                )),
                &self.members[m].spec.name.clone(),
                self.phase(),
            )),
        }
    }

    fn phase(&self) -> Phase {
        match &self.step {
            Some(s) if !s.train => Phase::Eval,
            _ => Phase::Forward,
        }
    }

    /// One call of member `m` (see [`Forward::call`]).
    fn call(&mut self, m: usize, xs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let Some(train) = self.step.as_ref().map(|s| s.train) else {
            return Err(Error::InvalidArgument(
                "units are called inside forward_with or forward_eval_with".into(),
            ));
        };
        let result = if train {
            self.call_train(m, xs)
        } else {
            self.call_eval(m, xs)
        };
        self.tape_now.push(m);
        result.map_err(|e| {
            let name = self.members[m].spec.name.clone();
            self.at_name(e, &name, self.phase())
        })
    }

    /// Gathers the groups of call number `pos` (member `m`) and issues the predicted next
    /// call's gathers (forward prefetch) before waiting for its own.
    fn gather_for_call(&mut self, m: usize, pos: usize, train: bool) -> Result<Vec<usize>> {
        let groups = self.members[m].groups.clone();
        for &g in &groups {
            self.unshard(g);
        }
        if self.config.forward_prefetch {
            if let Some(next) = self.predicted_next(m, pos, train) {
                let next_groups: Vec<usize> = self.members[next]
                    .groups
                    .iter()
                    .copied()
                    .filter(|g| !groups.contains(g))
                    .collect();
                self.prefetch_groups(&next_groups);
            }
        }
        Ok(groups)
    }

    /// A float input cast to the policy's `param_dtype` when the policy says so.
    fn cast_input(policy: &MixedPrecision, x: &Tensor) -> Result<Tensor> {
        if policy.cast_forward_inputs && x.dtype().is_float() && x.dtype() != policy.param_dtype {
            Ok(x.to_dtype(policy.param_dtype)?)
        } else {
            Ok(x.clone())
        }
    }

    fn buffer_names(&self, groups: &[usize]) -> HashSet<String> {
        groups
            .iter()
            .flat_map(|&g| self.units[g].buffers().iter().map(|(n, _)| n.clone()))
            .collect()
    }

    fn call_train(&mut self, m: usize, xs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let step = self.step.as_mut().expect("a training step");
        let pos = step.calls.len();
        let last = std::mem::take(&mut step.last_groups);
        let own = self.members[m].groups.clone();
        // The previous call's groups are freed now that the next call starts (FULL_SHARD).
        for g in last {
            if !own.contains(&g) && self.units[g].reshard_after_forward {
                self.units[g].reshard()?;
            }
        }
        let pre_forward =
            self.nvtx_range(|| format!("FSDP::pre_forward {}", self.members[m].spec.name));
        let groups = self.gather_for_call(m, pos, true)?;
        for &g in &groups {
            self.unshard_wait(g)?;
        }
        drop(pre_forward);
        for &g in &groups {
            self.units[g].add_call();
        }
        let policy = *self.units[groups[0]].policy();
        let checkpoint = self.members[m].spec.activation_checkpointing;
        let mut tracked = Vec::new();
        let mut tracked_orig = Vec::new();
        let mut input_vars = Vec::new();
        let mut inputs = Vec::with_capacity(xs.len());
        for (i, &x) in xs.iter().enumerate() {
            let xc = Self::cast_input(&policy, x)?;
            if x.dtype().is_float() && x.track_op() {
                tracked.push((i, x.dtype()));
                tracked_orig.push(x.clone());
                if checkpoint {
                    inputs.push(xc.detach());
                } else {
                    let v = Var::from_tensor(&xc)?.into_inner();
                    input_vars.push(v.clone());
                    inputs.push(v);
                }
            } else {
                inputs.push(xc.detach());
            }
        }
        let device = self.config.device.clone();
        let mut map = HashMap::new();
        for &g in &groups {
            self.units[g].add_to_map(&mut map, checkpoint, true)?;
        }
        let buffers = self.buffer_names(&groups);
        let member = &self.members[m];
        let module = member.spec.bind_with_buffers(
            &member.prefix,
            map,
            &buffers,
            policy.param_dtype,
            &device,
        )?;
        let outs = {
            let _span = self.span(SpanKind::Forward, || {
                format!("FSDP::forward {}", self.members[m].spec.name)
            });
            module.forward_t(&inputs, true)?
        };
        drop(module);
        let inputs_for_alias = if checkpoint {
            Vec::new()
        } else {
            inputs.clone()
        };
        let saved_inputs = if checkpoint { inputs } else { Vec::new() };
        let mut outputs = Vec::with_capacity(outs.len());
        let mut values = Vec::with_capacity(outs.len());
        let mut differentiable = Vec::with_capacity(outs.len());
        for o in outs {
            let diff = o.dtype().is_float();
            let o = if diff
                && !checkpoint
                && groups.iter().any(|&g| self.units[g].is_view_of_param(&o))
            {
                // The output is a view of a parameter: give it storage of its own before the
                // parameter is freed.
                o.force_contiguous()?
            } else {
                o
            };
            outputs.push((diff && !checkpoint).then(|| o.clone()));
            differentiable.push(diff);
            values.push(o);
        }
        if !checkpoint {
            self.check_connected(m, &groups, &input_vars, &outputs)?;
        }
        let n_out = values.len();
        let step = self.step.as_mut().expect("a training step");
        let returned = call::stitch(
            &step.hook,
            pos,
            &step.anchor,
            &tracked_orig,
            values,
            &differentiable,
        )?;
        let n_in = tracked.len();
        step.empty_outputs.extend(
            returned
                .iter()
                .zip(&differentiable)
                .filter(|(o, &d)| d && o.elem_count() == 0)
                .map(|(o, _)| o.clone()),
        );
        // The outputs' values now live in the output nodes: free the unit's own copies until
        // its backward refills them (one activation less per output between forward and
        // backward). Only outputs that own their whole buffer and are no buffer of the unit.
        // An output that shares storage with an input (the caller's tensor), a buffer or
        // another output is left alone.
        let mut refill_from = Vec::with_capacity(n_out);
        for (j, (o, node)) in outputs.iter().zip(&returned).enumerate() {
            let same = super::storage::same_storage;
            let keep = match o {
                None => true,
                Some(o) => {
                    inputs_for_alias.iter().any(|x| same(x, o))
                        || outputs
                            .iter()
                            .enumerate()
                            .any(|(k, p)| k != j && p.as_ref().is_some_and(|p| same(p, o)))
                        || groups.iter().any(|&g| {
                            self.units[g]
                                .buffers()
                                .iter()
                                .any(|(_, b)| same(b.as_tensor(), o))
                        })
                }
            };
            let freed = match o {
                Some(o) if !keep => super::storage::free_whole(o)?,
                _ => false,
            };
            refill_from.push(freed.then(|| node.clone()));
        }
        let step = self.step.as_mut().expect("a training step");
        step.calls.push(CallRecord {
            member: m,
            groups: groups.clone(),
            checkpoint,
            saved_inputs,
            tracked,
            input_vars,
            outputs,
            refill_from,
            out_grads: vec![None; n_out],
            in_grads: vec![None; n_in],
            done: false,
        });
        step.last_groups = groups;
        Ok(returned)
    }

    /// Fails when a unit that has trainable parameters or inputs with gradient returned float
    /// outputs none of which autograd connects to them: an operation without backward inside
    /// (candle-nn 0.11's fused `layer_norm` / `rms_norm`) would give every unit below a silent
    /// zero gradient.
    fn check_connected(
        &self,
        m: usize,
        groups: &[usize],
        input_vars: &[Tensor],
        outputs: &[Option<Tensor>],
    ) -> Result<()> {
        let trainable = groups.iter().any(|&g| {
            !self.units[g].is_frozen() && !self.units[g].flat().layout().params.is_empty()
        });
        let floats: Vec<&Tensor> = outputs.iter().flatten().collect();
        if floats.iter().any(|o| o.elem_count() == 0) {
            // A zero-element output (a rank whose batch is empty) cannot carry gradient, and
            // Candle's element-wise ops return their left operand for zero-element results (a
            // Linear's bias drops out of the graph): "connected" means nothing here. The
            // unit's parameters get zero gradients (the backward reaches every call with an
            // empty output) and the ranks with rows check the same call.
            return Ok(());
        }
        let member = &self.members[m];
        if !member.spec.unused_parameters && floats.iter().any(|o| o.track_op()) {
            // Every trainable parameter the unit asked for must be connected by autograd to
            // its outputs: one that is not was consumed by an operation without backward.
            let mut reached = HashSet::new();
            for o in &floats {
                reached.extend(
                    o.sorted_nodes()
                        .into_iter()
                        .filter(|n| n.is_variable())
                        .map(|n| n.id()),
                );
            }
            for &g in groups {
                let u = &self.units[g];
                if u.is_frozen() {
                    continue;
                }
                let vars = u.param_tensors().unwrap_or(&[]);
                for (p, v) in u.flat().layout().params.iter().zip(vars) {
                    if member.params.contains(&p.name) && !reached.contains(&v.id()) {
                        return Err(Error::InvalidArgument(format!(
                            "unit {}: parameter {} is not connected by autograd to the unit's \
                             outputs, so it would silently get no gradient: an operation \
                             without backward consumed it (candle-nn 0.11's fused layer_norm, \
                             rms_norm, softmax_last_dim and rotary embeddings have none: use \
                             candle_fsdp::nn::layer_norm / rms_norm and candle_nn::ops::softmax), \
                             or the unit does not use it in this call (then say so with \
                             UnitSpec::with_unused_parameters(true))",
                            member.spec.name, p.name
                        )));
                    }
                }
            }
        }
        if (trainable || !input_vars.is_empty())
            && !floats.is_empty()
            && !floats.iter().any(|o| o.track_op())
        {
            return Err(Error::InvalidArgument(format!(
                "unit {}: none of its outputs is connected by autograd to its parameters or \
                 inputs, so they and every unit before it would silently get no gradient: an \
                 operation inside has no backward (candle-nn 0.11's layer_norm and rms_norm are \
                 fused ops without one: use candle_fsdp::nn::layer_norm / rms_norm)",
                self.members[m].spec.name
            )));
        }
        Ok(())
    }

    fn call_eval(&mut self, m: usize, xs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let pos = self.tape_now.len();
        let groups = self.gather_for_call(m, pos, false)?;
        let mut gathered = Vec::with_capacity(groups.len());
        for &g in &groups {
            let _w = self.units[g].gathers().then(|| {
                self.span(SpanKind::Wait, || {
                    format!("FSDP::wait all_gather {}", self.units[g].name())
                })
            });
            gathered.push(self.units[g].gather_for_eval(
                self.pg.as_ref(),
                &self.comm.all_gather,
                &self.mem,
            )?);
        }
        let policy = *self.units[groups[0]].policy();
        let mut map = HashMap::new();
        for (&g, (flat, _)) in groups.iter().zip(&gathered) {
            self.units[g].add_views_to_map(&mut map, flat)?;
        }
        let inputs = xs
            .iter()
            .map(|&x| Ok(Self::cast_input(&policy, x)?.detach()))
            .collect::<Result<Vec<_>>>()?;
        let buffers = self.buffer_names(&groups);
        let member = &self.members[m];
        let module = member.spec.bind_with_buffers(
            &member.prefix,
            map,
            &buffers,
            policy.param_dtype,
            &self.config.device,
        )?;
        let _span = self.span(SpanKind::Forward, || {
            format!("FSDP::forward_eval {}", self.members[m].spec.name)
        });
        let outs = module.forward_t(&inputs, false)?;
        Ok(outs.into_iter().map(|o| o.detach()).collect())
    }

    /// Sharded backward (a collective) of `loss`, a scalar computed from the outputs of the last
    /// training forward ([`FsdpModel::forward`] or [`FsdpModel::forward_with`]). On return every
    /// unit's gradient shard holds the gradient averaged over ranks (added to what it held, so
    /// calling forward/backward several times accumulates).
    ///
    /// One `loss.backward()` of Candle over the whole graph; each unit call's backward runs
    /// when its outputs' gradients are complete: its parameters are refilled from an all-gather
    /// issued one call ahead (backward prefetch; the first is issued before the loss's own
    /// backward), its gradients are copied into its group's flat gradient, and after the
    /// group's last call the reduce-scatter is issued on the reduce-scatter stream without
    /// waiting. All reductions are waited for at the end and added into the f32 gradient
    /// shards. Gradients of variables outside the model's units are not kept.
    ///
    /// A rank whose batch is empty (the end of an epoch with an uneven loader) takes the step
    /// like the others: every call that returned a zero-element output is back-propagated (its
    /// parameters get zero gradients) and the rank joins every reduction, whatever its loss is
    /// (`0 * logits.sum()`, a constant 0, the mean over no rows): the sums of the zero-element
    /// outputs, exactly 0, are added to the loss, which changes neither its value nor any
    /// gradient but connects those calls to it.
    ///
    /// Errors ([`Error::InStep`], phase backward): no training forward to back-propagate; a loss
    /// that depends on no output of it (and no output had zero elements); an input of a unit that received no gradient although
    /// its outputs did (an operation without backward inside the unit); any collective error.
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        if !self.forward_pending() {
            return Err(Error::InvalidArgument(
                "backward called without a preceding training forward".into(),
            ));
        }
        let result = self.backward_steps(loss);
        self.release_step();
        result
    }

    /// Issues the check that every rank all-gathered the same units in the same order in the
    /// forward that just ran (a collective: one all-reduce of two integers on the all-gather
    /// stream; [`FsdpModel::finish_agreement`] waits for it). Ranks that called different units
    /// of equal shapes would otherwise have computed on shards mixed from both. On the all-gather
    /// stream, a rank that issued more all-gathers than another meets this all-reduce with one of
    /// them, which the backends refuse at once as a mismatch instead of both waiting for the
    /// timeout. (A rank may call a unit more often than another as long as the gathers match,
    /// e.g. a second call of a unit whose parameters are still present.) `None` at world size 1
    /// and when no group is sharded (NO_SHARD): no rank can gather anything then (the ranks
    /// agreed on the layouts at build), and the check would cost a collective a step for nothing.
    fn issue_agreement(&self) -> Option<(i64, crate::comm::Work<Tensor>)> {
        if self.pg.world_size() == 1 || self.units.iter().all(|u| u.flat().layout().world_size == 1)
        {
            return None;
        }
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &g in &self.gathered_now {
            for b in (g as u64).to_le_bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        let mask = i64::MAX >> 1;
        let fp = (h & mask as u64) as i64;
        let work = match Tensor::new(&[fp, mask - fp], &candle_core::Device::Cpu)
            .and_then(|t| t.to_device(&self.config.device))
        {
            Ok(t) => self.pg.all_reduce(&self.comm.all_gather, t, ReduceOp::Max),
            Err(e) => crate::comm::Work::ready(Err(e.into())),
        };
        Some((mask, work))
    }

    /// Waits for [`FsdpModel::issue_agreement`]'s all-reduce and fails when the ranks differ.
    fn finish_agreement(
        &self,
        agreement: Option<(i64, crate::comm::Work<Tensor>)>,
        phase: Phase,
    ) -> Result<()> {
        let Some((mask, work)) = agreement else {
            return Ok(());
        };
        let r = work
            .wait()
            .and_then(|t| crate::device::read_small::<i64>(&t))
            .map_err(|e| self.at(e, None, phase))?;
        if r[0] != mask - r[1] {
            let names: Vec<&str> = self
                .tape_now
                .iter()
                .take(32)
                .map(|&m| self.members[m].spec.name.as_str())
                .collect();
            let more = if self.tape_now.len() > 32 {
                ", ..."
            } else {
                ""
            };
            return Err(self.at(
                Error::InvalidArgument(format!(
                    "the ranks all-gathered different units in this forward (every rank must \
                     call the same units in the same order): rank {} called [{}{more}]",
                    self.pg.rank(),
                    names.join(", ")
                )),
                None,
                phase,
            ));
        }
        Ok(())
    }

    /// `loss` plus the sum of every zero-element output node of the step (exactly 0): the
    /// calls of a rank with an empty batch are connected to its loss, whatever it computed
    /// (Candle drops `0 * x` and element-wise ops on zero-element tensors from the graph).
    fn attach_empty_outputs(&self, loss: &Tensor) -> Result<Tensor> {
        let empty = self.step.as_ref().map_or(&[][..], |s| &s.empty_outputs);
        let mut loss = loss.clone();
        for o in empty {
            let zero = o
                .sum_all()?
                .to_dtype(loss.dtype())?
                .to_device(loss.device())?;
            loss = loss.broadcast_add(&zero)?;
        }
        Ok(loss)
    }

    fn backward_steps(&mut self, loss: &Tensor) -> Result<()> {
        let loss = &self
            .attach_empty_outputs(loss)
            .map_err(|e| self.at(e, None, Phase::Backward))?;
        let agreement = self.issue_agreement();
        let n_calls = self.step.as_ref().map_or(0, |s| s.calls.len());
        if self.scheduler.backward_mode() != BackwardPrefetch::None {
            // The first gather of backward runs during the loss's own backward.
            if let Some(c) = self.next_gathering_call(n_calls) {
                let groups = self.step_calls()[c].groups.clone();
                self.prefetch_groups(&groups);
            }
        }
        let hook = self.step.as_ref().expect("a training step").hook.clone();
        let result = {
            let _armed = hook.arm(self as *mut FsdpModel);
            loss.backward()
        };
        if let Err(e) = result {
            return Err(match hook.take_error() {
                Some(e) => e,
                None => self.at(e.into(), None, Phase::Backward),
            });
        }
        // Before any gradient is kept: the ranks ran the same forward.
        self.finish_agreement(agreement, Phase::Backward)?;
        if !self.step_calls().iter().any(|c| c.done) {
            return Err(self.at(
                Error::InvalidArgument(
                    "the loss passed to backward does not depend on the output of the last \
                     training forward (no gradient reaches the model)"
                        .into(),
                ),
                None,
                Phase::Backward,
            ));
        }
        // Groups with calls whose outputs did not reach the loss: reduce what they have (every
        // rank issues the same reductions).
        for g in 0..self.units.len() {
            let grad = self.units[g]
                .finish_unreached()
                .map_err(|e| self.at(e, Some(g), Phase::Backward))?;
            if let Some(fg) = grad {
                self.issue_reduction(g, fg)
                    .map_err(|e| self.at(e, Some(g), Phase::Backward))?;
            }
        }
        for (g, work, all_local) in self.scheduler.take_reductions() {
            let _w = self.span(SpanKind::Wait, || {
                format!("FSDP::wait reduce_scatter {}", self.units[g].name())
            });
            // The reduced chunk carries each parameter's presence flag, summed over the ranks
            // (`collectives::flatten_grads`): a parameter has a gradient when some rank
            // produced one.
            let result = collectives::wait_reduced(work).and_then(|reduced| {
                let (grad, present) =
                    collectives::split_reduced(self.units[g].flat().layout(), reduced, all_local)?;
                self.units[g].flat_mut().accumulate_grad_of(grad, &present)
            });
            result.map_err(|e| self.at(e, Some(g), Phase::Backward))?;
        }
        Ok(())
    }

    fn step_calls(&self) -> &[CallRecord] {
        self.step.as_ref().map_or(&[], |s| &s.calls)
    }

    /// The latest call before call number `before` whose backward has not run.
    fn next_backward_call(&self, before: usize) -> Option<usize> {
        let calls = self.step_calls();
        (0..before.min(calls.len())).rev().find(|&c| !calls[c].done)
    }

    /// The latest call before `before`, not yet back-propagated, that needs a gather (some group
    /// neither present nor in flight).
    fn next_gathering_call(&self, before: usize) -> Option<usize> {
        let calls = self.step_calls();
        (0..before.min(calls.len())).rev().find(|&c| {
            !calls[c].done && calls[c].groups.iter().any(|&g| self.units[g].is_sharded())
        })
    }

    /// Stores the gradient of output `j` of call `c` (called by the output node).
    pub(crate) fn set_output_grad(&mut self, c: usize, j: usize, grad: Tensor) -> Result<()> {
        let call = self
            .step
            .as_mut()
            .and_then(|s| s.calls.get_mut(c))
            .ok_or_else(|| Error::InvalidArgument("a call node outlived its step".into()))?;
        call.out_grads[j] = Some(grad);
        Ok(())
    }

    /// Hands out the gradient of tracked input `i` of call `c` (called by the input nodes, after
    /// the call's backward).
    pub(crate) fn take_input_grad(&mut self, c: usize, i: usize) -> Result<Option<Tensor>> {
        let call = self
            .step
            .as_mut()
            .and_then(|s| s.calls.get_mut(c))
            .ok_or_else(|| Error::InvalidArgument("a call node outlived its step".into()))?;
        Ok(call.in_grads[i].take())
    }

    /// The backward of call `c` (run by its top node, see [`super::call`]): makes its groups'
    /// parameters present, prefetches the next call's, back-propagates `sum_j sum(o_j · g_j)`
    /// through the unit's own graph (recomputed first when checkpointed), copies the parameter
    /// gradients into the groups' flat gradients, keeps the inputs' gradients for the input
    /// nodes, and finishes the groups: after a group's last call its variables are dropped and
    /// its reduction issued; otherwise FULL_SHARD frees the parameters again.
    pub(crate) fn backward_call(&mut self, c: usize) -> Result<()> {
        let m = self.step_calls()[c].member;
        let name = self.members[m].spec.name.clone();
        self.backward_call_steps(c)
            .map_err(|e| self.at_name(e, &name, Phase::Backward))
    }

    fn backward_call_steps(&mut self, c: usize) -> Result<()> {
        let (m, groups) = {
            let call = &self.step_calls()[c];
            (call.member, call.groups.clone())
        };
        let pre_backward =
            self.nvtx_range(|| format!("FSDP::pre_backward {}", self.members[m].spec.name));
        for &g in &groups {
            self.unshard(g);
        }
        for &g in &groups {
            self.unshard_wait(g)?;
        }
        drop(pre_backward);
        let mode = self.scheduler.backward_mode();
        if mode == BackwardPrefetch::BackwardPre {
            self.prefetch_backward(c, &groups);
        }
        {
            let _span = self.span(SpanKind::Backward, || {
                format!("FSDP::backward {}", self.members[m].spec.name)
            });
            self.backward_compute(c, m, &groups)?;
        }
        let next = self.next_backward_call(c);
        let _post_backward =
            self.nvtx_range(|| format!("FSDP::post_backward {}", self.members[m].spec.name));
        for &g in &groups {
            let (last, grad) = self.units[g].finish_backward_call();
            if let Some(fg) = grad {
                self.issue_reduction(g, fg)?;
            } else if !last && self.units[g].reshard_after_forward {
                let needed_next = next.is_some_and(|n| self.step_calls()[n].groups.contains(&g));
                if !needed_next {
                    self.units[g].reshard()?;
                }
            }
        }
        if mode == BackwardPrefetch::BackwardPost {
            self.prefetch_backward(c, &groups);
        }
        Ok(())
    }

    /// Issues the gathers of the next call in reverse call order (nothing when they are present
    /// or in flight already: one call ahead, as FSDP's backward prefetch).
    fn prefetch_backward(&mut self, c: usize, current: &[usize]) {
        if let Some(n) = self.next_backward_call(c) {
            let groups: Vec<usize> = self.step_calls()[n]
                .groups
                .iter()
                .copied()
                .filter(|g| !current.contains(g))
                .collect();
            self.prefetch_groups(&groups);
        }
    }

    /// The autograd part of call `c`'s backward (see [`FsdpModel::backward_call`]).
    fn backward_compute(&mut self, c: usize, m: usize, groups: &[usize]) -> Result<()> {
        let call = &mut self.step.as_mut().expect("a training step").calls[c];
        let out_grads = std::mem::take(&mut call.out_grads);
        let refill_from = std::mem::take(&mut call.refill_from);
        let (outputs, input_vars) = if call.checkpoint {
            let saved = std::mem::take(&mut call.saved_inputs);
            let tracked: Vec<usize> = call.tracked.iter().map(|(i, _)| *i).collect();
            self.recompute(m, groups, saved, &tracked)?
        } else {
            (
                std::mem::take(&mut call.outputs),
                std::mem::take(&mut call.input_vars),
            )
        };
        for (o, node) in outputs.iter().zip(&refill_from) {
            if let (Some(o), Some(node)) = (o, node) {
                super::storage::refill(o, &node.detach())?;
            }
        }
        drop(refill_from);
        let mut surrogate: Option<Tensor> = None;
        for (o, g) in outputs.iter().zip(&out_grads) {
            if let (Some(o), Some(g)) = (o, g) {
                let term = super::call::grad_seed(o, g)?;
                surrogate = Some(match surrogate {
                    Some(s) => (s + term)?,
                    None => term,
                });
            }
        }
        let grads = match surrogate {
            Some(s) if s.track_op() => Some(s.backward()?),
            _ => None,
        };
        let call = &self.step.as_ref().expect("a training step").calls[c];
        let mut in_grads = Vec::with_capacity(input_vars.len());
        for (k, v) in input_vars.iter().enumerate() {
            let (index, dtype) = call.tracked[k];
            match grads.as_ref().and_then(|g| g.get(v)) {
                // Detached: the gradient would keep the unit's graph alive until taken.
                Some(g) => in_grads.push(Some(g.detach().to_dtype(dtype)?)),
                // A zero-element input (an empty batch): its gradient has no elements either,
                // and Candle's element-wise ops may have cut it from the unit's graph.
                None if v.elem_count() == 0 => {
                    in_grads.push(Some(v.zeros_like()?.to_dtype(dtype)?))
                }
                None => {
                    return Err(Error::InvalidArgument(format!(
                        "input {index} of unit {} carries gradient, and the unit's outputs \
                         received gradients, but the input got none: an operation inside has no \
                         backward (candle-nn 0.11's layer_norm and rms_norm are fused ops \
                         without one: use candle_fsdp::nn::layer_norm / rms_norm), so every unit \
                         before it would silently get no gradient. If the unit is not meant to \
                         differentiate through this input, pass it detached (x.detach())",
                        self.members[m].spec.name
                    )))
                }
            }
        }
        for &g in groups {
            self.units[g].add_call_grads(grads.as_ref())?;
        }
        drop(grads);
        drop(outputs);
        drop(input_vars);
        let call = &mut self.step.as_mut().expect("a training step").calls[c];
        call.in_grads = in_grads;
        call.done = true;
        Ok(())
    }

    /// Recomputes a checkpointed call with autograd; returns its outputs and the variables of
    /// its tracked inputs.
    fn recompute(
        &mut self,
        m: usize,
        groups: &[usize],
        saved: Vec<Tensor>,
        tracked: &[usize],
    ) -> Result<(Vec<Option<Tensor>>, Vec<Tensor>)> {
        let mut input_vars = Vec::new();
        let inputs = saved
            .into_iter()
            .enumerate()
            .map(|(i, x)| {
                if tracked.contains(&i) {
                    let v = Var::from_tensor(&x)?.into_inner();
                    input_vars.push(v.clone());
                    Ok(v)
                } else {
                    Ok(x)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let mut map = HashMap::new();
        for &g in groups {
            // The forward already updated the buffers: the recompute's updates are made on
            // copies and discarded.
            self.units[g].add_to_map(&mut map, false, false)?;
        }
        let policy = *self.units[groups[0]].policy();
        let buffers = self.buffer_names(groups);
        let member = &self.members[m];
        let module = member.spec.bind_with_buffers(
            &member.prefix,
            map,
            &buffers,
            policy.param_dtype,
            &self.config.device,
        )?;
        let outs = module.forward_t(&inputs, true)?;
        let outputs: Vec<Option<Tensor>> = outs
            .into_iter()
            .map(|o| o.dtype().is_float().then_some(o))
            .collect();
        self.check_connected(m, groups, &input_vars, &outputs)?;
        Ok((outputs, input_vars))
    }

    /// Issues the reduction of group `g`'s step gradient (merged with the no_sync accumulation;
    /// nothing while gradient sync is off).
    fn issue_reduction(&mut self, g: usize, flat_grad: Tensor) -> Result<()> {
        let sync = self.requires_gradient_sync;
        if let Some(fg) = self.units[g].merge_unsynced(flat_grad, sync)? {
            self.mark_issue(|| format!("FSDP::reduce_scatter {}", self.units[g].name()));
            let u = &self.units[g];
            let work = collectives::reduce_grads(
                self.pg.as_ref(),
                &self.comm.reduce_scatter,
                u.flat().layout(),
                fg,
                u.policy().reduce_dtype,
            );
            let all_local = self.units[g].take_all_present_locally();
            self.scheduler.push_reduction(g, work, all_local);
        }
        Ok(())
    }
}

/// Checks that every rank built the same model (a collective: one all-reduce of two integers on
/// the default stream). Ranks that disagree would otherwise issue different collectives and
/// hang until the timeout; here every rank fails at once with the same error.
///
/// The fingerprint is FNV-1a (64-bit) over the strategy and each unit's name, parameter names
/// and shapes, and buffer names, in order.
fn agree_on_model(
    pg: &dyn ProcessGroup,
    units: &[FsdpUnit],
    strategy: ShardingStrategy,
) -> Result<()> {
    if pg.world_size() == 1 {
        return Ok(());
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes.iter().chain(&[0xff]) {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(format!("{strategy:?}").as_bytes());
    for u in units {
        eat(u.name().as_bytes());
        for p in &u.flat().layout().params {
            eat(p.name.as_bytes());
            eat(format!("{:?}", p.shape.dims()).as_bytes());
        }
        for (b, _) in u.buffers() {
            eat(b.as_bytes());
        }
    }
    // Max of h and of (M - h) give the largest and the smallest fingerprint in one all-reduce.
    let m = u64::MAX >> 1;
    let fp = h & m;
    let r = pg.all_reduce_u64s(vec![fp, m - fp], ReduceOp::Max)?;
    let (max, min) = (r[0], m - r[1]);
    if max != min {
        return Err(Error::InvalidArgument(format!(
            "the ranks built different models (unit names, parameter names or shapes, buffers or \
             sharding strategy differ; rank {} has {} units): every rank must build the same model \
             in the same order",
            pg.rank(),
            units.len()
        )));
    }
    Ok(())
}
