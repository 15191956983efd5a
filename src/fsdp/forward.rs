//! The forwards of an [`FsdpModel`]: the [`Forward`] handle through which any Rust code calls
//! units, the chain forwards, and one unit call cut into FSDP2's steps:
//! - `pre_forward`: reshard the previous call's groups (FULL_SHARD), unshard this call's
//!   (issuing the predicted next call's gathers first: forward prefetch), wait for them;
//! - `bind`: the unit's module over the groups' parameters and buffers — one binding for the
//!   training call, the eval call and the backward's recompute ([`Params`]);
//! - `run`: the unit's own forward, as a compute span;
//! - `post_forward`: guard outputs that view a parameter, check that autograd connects the
//!   outputs to the unit's parameters and inputs (`check_connected`), stitch the call into
//!   the caller's graph ([`super::call`]), free the unit's copies of its outputs, and record
//!   the call for the backward.
//!
//! The algorithm (design/fsdp.md):
//! - each [`Forward::call`] unshards the unit's groups just in time (the next call's gather is
//!   issued before this one computes, predicted from the previous step's call sequence), runs
//!   the unit with autograd on the step's parameter variables and on a variable copy of each
//!   input that carries gradient, and joins it to the caller's graph as one node. The groups of
//!   a call are resharded when the next call starts (FULL_SHARD), so the last call's parameters
//!   stay for the backward that follows;
//! - an eval call gathers, runs with `train = false` and frees at once.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use candle_core::{DType, Tensor, TensorId, Var};

use super::call;
use super::model::FsdpModel;
use super::step::CallRecord;
use crate::comm::ProcessGroup;
use crate::error::{Error, Phase, Result};
use crate::mixed_precision::MixedPrecision;
use crate::trace::SpanKind;
use crate::unit::UnitModule;

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
        self.model.state.is_training_forward()
    }

    /// The model's process group (e.g. for the rank in a data-dependent forward).
    pub fn process_group(&self) -> &Arc<dyn ProcessGroup> {
        &self.model.pg
    }
}
impl FsdpModel {
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
            return Err(Error::Misuse {
                call: "forward(x)",
                state: "called on a model with a group of several units (tied weights)",
                fix: "forward(x) runs the units as a chain; write the forward with \
                      forward_with(|f| ...) and f.call(unit, inputs)"
                    .into(),
            });
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
    /// for the backward that follows). See `design/step.md`, "Any forward".
    ///
    /// Errors ([`Error::InStep`] with phase forward and the unit): the previous training forward
    /// was not back-propagated (call [`FsdpModel::backward`] or [`FsdpModel::discard_forward`]
    /// first); whatever `f` returns; a unit's error; any collective error.
    pub fn forward_with<T>(&mut self, f: impl FnOnce(&mut Forward<'_>) -> Result<T>) -> Result<T> {
        if self.state.awaits_backward() {
            return Err(Error::Misuse {
                call: "forward",
                state: "called while the previous training forward was not back-propagated",
                fix: "its saved state would be lost and a loss using both outputs would get wrong \
                      gradients; call backward first, or discard_forward() to drop it"
                    .into(),
            });
        }
        self.release_step();
        if let Some(t) = self.tracer() {
            t.set_step(self.steps_started);
        }
        self.steps_started += 1;
        self.begin_step(true)?;
        let result = f(&mut Forward { model: self });
        match result {
            Ok(v) => {
                // The call sequence stays current for the backward's agreement check.
                self.scheduler.finish_train_forward();
                Ok(v)
            }
            Err(e) => {
                self.release_step();
                Err(self.at_phase(e, Phase::Forward))
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
        if self.state.awaits_backward() {
            return Err(Error::Misuse {
                call: "forward_eval",
                state: "called while a training forward awaits its backward",
                fix: "it would drop that forward's saved state; call backward first, or \
                      discard_forward() to drop it"
                    .into(),
            });
        }
        self.release_step();
        self.begin_step(false)?;
        let result = f(&mut Forward { model: self });
        let result = result.and_then(|v| {
            let agreement = self.issue_agreement();
            self.finish_agreement(agreement, Phase::Eval).map(|()| v)
        });
        let tape = self.scheduler.take_tape();
        self.release_step();
        match result {
            Ok(v) => {
                self.scheduler.finish_eval_forward(tape);
                Ok(v)
            }
            Err(e) => Err(self.at_phase(e, Phase::Eval)),
        }
    }

    /// One call of member `m` with one input and one output.
    fn call1(&mut self, m: usize, x: &Tensor) -> Result<Tensor> {
        let mut out = self.call(m, &[x])?;
        match out.len() {
            1 => Ok(out.pop().expect("one output")),
            n => Err(self.at_name(
                Error::shape("call1: the unit's outputs", "one (use call for several)", n),
                &self.members[m].spec.name.clone(),
                self.state.call_phase(),
            )),
        }
    }

    /// One call of member `m` (see [`Forward::call`]).
    fn call(&mut self, m: usize, xs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let train = match self.state.step() {
            None => {
                return Err(Error::Internal(
                    "a unit was called outside forward_with or forward_eval_with".into(),
                ))
            }
            Some(_) => self.state.is_training_forward(),
        };
        let result = if train {
            self.call_train(m, xs)
        } else {
            self.call_eval(m, xs)
        };
        self.scheduler.record_call(m);
        result.map_err(|e| {
            let name = self.members[m].spec.name.clone();
            self.at_name(e, &name, self.state.call_phase())
        })
    }

    /// A training call: `pre_forward` → `bind` → `run` → `post_forward`.
    fn call_train(&mut self, m: usize, xs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let pos = self.step_mut().calls.len();
        let groups = self.pre_forward(m, pos)?;
        let checkpoint = self.members[m].spec.activation_checkpointing;
        let policy = *self.units[groups[0]].policy();
        let inputs = TrackedInputs::new(&policy, xs, checkpoint)?;
        let module = self.bind(
            m,
            &groups,
            Params::Train {
                detached: checkpoint,
            },
        )?;
        // Fused nodes built by this call send their parameters' gradients to the sink its
        // backward opens (`fsdp::fused`); armed through the connectivity check, which counts
        // the parameters they promised as reached.
        let (params, frozen) = self.call_param_ids(&groups);
        let _armed = super::fused::arm_call(params, frozen, self.call_seed(pos), !checkpoint);
        let outs = self.run(m, module.as_ref(), &inputs.inputs, true)?;
        drop(module);
        self.post_forward(m, pos, groups, checkpoint, inputs, outs)
    }

    /// The seed of training call `pos` of this step ([`super::fused::call_seed`]): the
    /// config's seed, the step, `pos` and the rank, mixed ([`super::fused::mix64`]).
    pub(super) fn call_seed(&self, pos: usize) -> u64 {
        let mix = super::fused::mix64;
        let step = self.steps_started.saturating_sub(1);
        mix(mix(mix(self.config.seed ^ mix(step)) ^ pos as u64) ^ self.pg.rank() as u64)
    }

    /// Group `g`'s parameters that member `m`'s unit asked for: (name, the step's tensor).
    pub(super) fn asked_params(
        &self,
        m: usize,
        g: usize,
    ) -> impl Iterator<Item = (&str, &Tensor)> + '_ {
        let asked = &self.members[m].params;
        let u = &self.units[g];
        u.flat()
            .layout()
            .params
            .iter()
            .zip(u.param_tensors().unwrap_or(&[]))
            .filter(move |(p, _)| asked.contains(&p.name))
            .map(|(p, v)| (p.name.as_str(), v))
    }

    /// The ids of the step's parameter tensors of `groups`, and of those of the frozen groups
    /// among them (for fused nodes: [`super::fused::is_call_param`], [`super::fused::trains`]),
    /// as iterators: [`super::fused::arm_call`] copies them into the thread's own lists.
    pub(super) fn call_param_ids<'a>(
        &'a self,
        groups: &'a [usize],
    ) -> (
        impl Iterator<Item = TensorId> + 'a,
        impl Iterator<Item = TensorId> + 'a,
    ) {
        let ids = move |frozen_only: bool| {
            (groups.iter())
                .filter(move |&&g| !frozen_only || self.units[g].is_frozen())
                .flat_map(move |&g| self.units[g].param_tensors().unwrap_or(&[]).iter())
                .map(Tensor::id)
        };
        (ids(false), ids(true))
    }

    /// Before a training call of member `m` (call number `pos`) computes: reshards the previous
    /// call's groups that this call does not use (FULL_SHARD), unshards this call's groups (and
    /// prefetches the predicted next call's), waits for them, and counts the call in each group.
    fn pre_forward(&mut self, m: usize, pos: usize) -> Result<Vec<usize>> {
        let last = std::mem::take(&mut self.step_mut().last_groups);
        let own = self.members[m].groups.clone();
        // The previous call's groups are freed now that the next call starts (FULL_SHARD).
        for g in last {
            if !own.contains(&g) && self.units[g].reshard_after_forward {
                self.units[g].reshard()?;
            }
        }
        let pre_forward =
            self.nvtx_range(|| format!("FSDP::pre_forward {}", self.members[m].spec.name));
        let groups = self.gather_for_call(m, pos, true);
        for &g in &groups {
            self.wait_for_unshard(g)?;
        }
        drop(pre_forward);
        for &g in &groups {
            self.units[g].pre_forward();
            if let Some(rec) = &mut self.fingerprint {
                rec.params(g, self.units[g].param_tensors().unwrap_or(&[]))?;
            }
        }
        Ok(groups)
    }

    /// Binds member `m`'s module to the parameters and buffers of its `groups` (see
    /// [`Params`]), in the first group's `param_dtype`.
    pub(super) fn bind(
        &self,
        m: usize,
        groups: &[usize],
        params: Params<'_>,
    ) -> Result<Box<dyn UnitModule>> {
        let mut map = HashMap::new();
        for (i, &g) in groups.iter().enumerate() {
            match params {
                Params::Train { detached } => self.units[g].add_to_map(&mut map, detached, true)?,
                // The forward already updated the buffers: the recompute's updates are made on
                // copies and discarded.
                Params::Recompute => self.units[g].add_to_map(&mut map, false, false)?,
                Params::Gathered(flats) => self.units[g].add_views_to_map(&mut map, &flats[i])?,
            }
        }
        let policy = *self.units[groups[0]].policy();
        let buffers = self.buffer_names(groups);
        let member = &self.members[m];
        member.spec.bind_with_buffers(
            &member.prefix,
            map,
            &buffers,
            policy.param_dtype,
            &self.config.device,
        )
    }

    /// Runs member `m`'s bound module on `inputs`, as a compute span.
    fn run(
        &self,
        m: usize,
        module: &dyn UnitModule,
        inputs: &[Tensor],
        train: bool,
    ) -> Result<Vec<Tensor>> {
        let _span = self.span(SpanKind::Forward, || {
            let what = if train { "forward" } else { "forward_eval" };
            format!("FSDP::{what} {}", self.members[m].spec.name)
        });
        Ok(module.forward_t(inputs, train)?)
    }

    /// After a training call of member `m` (call number `pos`) computed `outs`: guards outputs
    /// that view a parameter, checks autograd connectivity, stitches the call into the caller's
    /// graph, frees the unit's copies of its outputs and records the call. Returns the outputs
    /// handed to the caller.
    fn post_forward(
        &mut self,
        m: usize,
        pos: usize,
        groups: Vec<usize>,
        checkpoint: bool,
        inputs: TrackedInputs,
        outs: Vec<Tensor>,
    ) -> Result<Vec<Tensor>> {
        let TrackedInputs {
            inputs,
            tracked,
            tracked_orig,
            input_vars,
        } = inputs;
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
        let step = self.step_mut();
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
        let step = self.step_mut();
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

    /// A float input cast to the policy's `param_dtype` when the policy says so.
    pub(super) fn cast_input(policy: &MixedPrecision, x: &Tensor) -> Result<Tensor> {
        if policy.cast_forward_inputs && x.dtype().is_float() && x.dtype() != policy.param_dtype {
            Ok(x.to_dtype(policy.param_dtype)?)
        } else {
            Ok(x.clone())
        }
    }

    pub(super) fn buffer_names(&self, groups: &[usize]) -> HashSet<String> {
        groups
            .iter()
            .flat_map(|&g| self.units[g].buffers().iter().map(|(n, _)| n.clone()))
            .collect()
    }

    /// Fails when a unit that has trainable parameters or inputs with gradient returned float
    /// outputs none of which autograd connects to them: an operation without backward inside
    /// (candle-nn 0.11's fused `layer_norm` / `rms_norm`) would give every unit below a silent
    /// zero gradient.
    pub(super) fn check_connected(
        &mut self,
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
            let mut observed = Vec::with_capacity(groups.len());
            for &g in groups {
                let u = &self.units[g];
                if u.is_frozen() {
                    continue;
                }
                let vars = u.param_tensors().unwrap_or(&[]);
                // Every parameter read only by fused nodes (promised, no autograd edge): the
                // group may bind views instead of variables from the next step on.
                observed.push((
                    g,
                    !vars.is_empty()
                        && vars
                            .iter()
                            .all(|v| super::fused::promised(v) && !reached.contains(&v.id())),
                ));
                for (name, v) in self.asked_params(m, g) {
                    if !reached.contains(&v.id()) && !super::fused::promised(v) {
                        if u.binds_views_now() {
                            return Err(Error::Disconnected {
                                unit: member.spec.name.clone(),
                                what: format!(
                                    "unit {}: parameter {} was bound as a view for fused nodes \
                                     (every call of the first step read it only through one, \
                                     e.g. nn's GPT block), but this call did not consume it \
                                     through a fused node, so it would get no gradient: the \
                                     unit must take the same path in every training step",
                                    member.spec.name, name
                                ),
                            });
                        }
                        return Err(Error::Disconnected {
                            unit: member.spec.name.clone(),
                            what: format!(
                                "unit {}: parameter {} is not connected by autograd to the \
                                 unit's outputs, so it would silently get no gradient: an \
                                 operation without backward consumed it (candle-nn 0.11's fused \
                                 layer_norm, rms_norm, softmax_last_dim and rotary embeddings \
                                 have none: use candle_fsdp::nn::layer_norm / rms_norm and \
                                 candle_nn::ops::softmax), or the unit does not use it in this \
                                 call (then say so with UnitSpec::with_unused_parameters(true))",
                                member.spec.name, name
                            ),
                        });
                    }
                }
            }
            for (g, fused) in observed {
                self.units[g].note_call_fusion(fused);
            }
        }
        if (trainable || !input_vars.is_empty())
            && !floats.is_empty()
            && !floats.iter().any(|o| o.track_op())
        {
            let unit = self.members[m].spec.name.clone();
            return Err(Error::Disconnected {
                what: format!(
                    "unit {unit}: none of its outputs is connected by autograd to its parameters \
                     or inputs, so they and every unit before it would silently get no \
                     gradient: an operation inside has no backward (candle-nn 0.11's layer_norm \
                     and rms_norm are fused ops without one: use candle_fsdp::nn::layer_norm / \
                     rms_norm)"
                ),
                unit,
            });
        }
        Ok(())
    }

    /// An eval call: gather (prefetching the predicted next call's), `bind` to the gathered
    /// buffers, `run` with `train = false`; the gathered buffers are freed on return.
    fn call_eval(&mut self, m: usize, xs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let pos = self.scheduler.calls_now();
        let groups = self.gather_for_call(m, pos, false);
        let mut gathered = Vec::with_capacity(groups.len());
        let mut guards = Vec::with_capacity(groups.len());
        for &g in &groups {
            let _w = self.units[g].gathers().then(|| {
                self.span(SpanKind::Wait, || {
                    format!("FSDP::wait all_gather {}", self.units[g].name())
                })
            });
            let (flat, guard) = self.units[g].gather_for_eval(&self.comm, &self.mem)?;
            gathered.push(flat);
            guards.push(guard);
        }
        let policy = *self.units[groups[0]].policy();
        let inputs = xs
            .iter()
            .map(|&x| Ok(Self::cast_input(&policy, x)?.detach()))
            .collect::<Result<Vec<_>>>()?;
        let module = self.bind(m, &groups, Params::Gathered(&gathered))?;
        let outs = self.run(m, module.as_ref(), &inputs, false)?;
        Ok(outs.into_iter().map(|o| o.detach()).collect())
    }
}

/// Where [`FsdpModel::bind`] takes a group's parameters from.
#[derive(Clone, Copy)]
pub(super) enum Params<'a> {
    /// The step's parameter variables (detached: a checkpointed call, run without autograd)
    /// and the live buffers.
    Train { detached: bool },
    /// The step's parameter variables, and copies of the buffers (the backward's recompute).
    Recompute,
    /// Views of each group's gathered flat buffer (an eval call), and the live buffers.
    Gathered(&'a [Tensor]),
}

/// A training call's inputs as the unit receives them (cast to its `param_dtype`), and which
/// of them carry gradient.
struct TrackedInputs {
    /// The unit's inputs: a variable copy of each tracked input (detached when checkpointed),
    /// the others detached.
    inputs: Vec<Tensor>,
    /// Which inputs carry gradient (index, dtype as the caller passed it).
    tracked: Vec<(usize, DType)>,
    /// The caller's tracked inputs (the call's node hangs from them).
    tracked_orig: Vec<Tensor>,
    /// The unit graph's variables of the tracked inputs (empty when checkpointed).
    input_vars: Vec<Tensor>,
}

impl TrackedInputs {
    fn new(policy: &MixedPrecision, xs: &[&Tensor], checkpoint: bool) -> Result<Self> {
        let mut t = TrackedInputs {
            inputs: Vec::with_capacity(xs.len()),
            tracked: Vec::new(),
            tracked_orig: Vec::new(),
            input_vars: Vec::new(),
        };
        for (i, &x) in xs.iter().enumerate() {
            let xc = FsdpModel::cast_input(policy, x)?;
            if x.dtype().is_float() && x.track_op() {
                t.tracked.push((i, x.dtype()));
                t.tracked_orig.push(x.clone());
                if checkpoint {
                    t.inputs.push(xc.detach());
                } else {
                    let v = Var::from_tensor(&xc)?.into_inner();
                    t.input_vars.push(v.clone());
                    t.inputs.push(v);
                }
            } else {
                t.inputs.push(xc.detach());
            }
        }
        Ok(t)
    }
}

/// Execution: making a call's groups present (the scheduler answers which to gather when; the
/// groups hold the gathers in flight).
impl FsdpModel {
    /// Unshards group `g` (issues its all-gather) and marks the issue in the trace.
    pub(super) fn unshard(&mut self, g: usize) {
        if self.units[g].gathers() && self.units[g].is_sharded() {
            self.mark_issue(|| format!("FSDP::all_gather {}", self.units[g].name()));
            if self.state.step().is_some() {
                self.scheduler.record_gather(g);
            }
        }
        self.units[g].unshard(&self.comm, &self.mem);
    }

    /// Makes group `g`'s parameters present (waiting for its all-gather, issuing it if needed),
    /// recording the wait as exposed communication.
    pub(super) fn wait_for_unshard(&mut self, g: usize) -> Result<()> {
        if self.units[g].is_present() {
            return Ok(());
        }
        self.unshard(g);
        let _w = self.units[g].gathers().then(|| {
            self.span(SpanKind::Wait, || {
                format!("FSDP::wait all_gather {}", self.units[g].name())
            })
        });
        self.units[g].wait_for_unshard(&self.comm, &self.mem)
    }

    /// Issues the gathers of `groups`, except those of `current` (the call that runs now, whose
    /// own gathers are not prefetches), that are neither present nor in flight, as far as
    /// `limit_all_gathers` allows.
    pub(super) fn prefetch_groups(&mut self, groups: &[usize], current: &[usize]) {
        for &g in groups.iter().filter(|g| !current.contains(g)) {
            if self.units[g].is_sharded() && self.scheduler.may_prefetch(&self.mem) {
                self.unshard(g);
            }
        }
    }

    /// Gathers the groups of call number `pos` (member `m`) and issues the predicted next
    /// call's gathers (forward prefetch) before waiting for its own.
    pub(super) fn gather_for_call(&mut self, m: usize, pos: usize, train: bool) -> Vec<usize> {
        let groups = self.members[m].groups.clone();
        for &g in &groups {
            self.unshard(g);
        }
        let next = self
            .scheduler
            .predicted_next(m, pos, train, self.members.len());
        if let Some(next) = next {
            let next_groups = self.members[next].groups.clone();
            self.prefetch_groups(&next_groups, &groups);
        }
        groups
    }
}
