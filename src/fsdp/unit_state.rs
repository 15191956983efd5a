//! One unit of an FSDP model (FSDP2's `FSDPParamGroup`): its constructor, its FlatParameter shard,
//! its buffers, and the small state machine that moves its parameters between sharded and
//! unsharded form.
//!
//! Parameter states and the transitions between them:
//!
//! ```text
//!            unshard()                wait_for_unshard()
//! Sharded ──────────────▶ Unsharding ───────────────────▶ Unsharded ──┐
//!    ▲        (all-gather issued,       (gathered buffer               │ reshard()
//!    │         output allocated)         handed out once)              │ (free the parameters'
//!    └─────────────────────────────────────────────────────────────────┘  storage, drop guard)
//! ```
//!
//! Training states (explicit, FSDP2's `TrainingState`): `Idle` → `Forward` (its forward ran and
//! left [`Saved`] state) → `PreBackward` (parameters present again: refilled, kept, or recomputed)
//! → `Idle` after `post_backward` (gradients copied into the flat gradient, parameters freed).
//!
//! How a unit's forward keeps what its backward needs ([`ForwardMode`]):
//! - `Free` (FULL_SHARD, the default): forward runs with autograd on per-parameter variables;
//!   `reshard` then frees their storage in place while the graph keeps referencing it, and
//!   `pre_backward` refills it from a new all-gather ([`super::storage`]). No recompute.
//! - `Keep` (SHARD_GRAD_OP, NO_SHARD, the last unit, `reshard_after_forward = false`): the
//!   variables keep their values until the unit's backward.
//! - `Checkpoint` (activation checkpointing, [`crate::unit::UnitSpec::with_activation_checkpointing`]):
//!   forward runs without autograd on views of the gathered buffer and keeps only the unit's
//!   input; `pre_backward` gathers again (FULL_SHARD) and recomputes the forward with autograd.

use std::collections::HashMap;

use candle_core::{Device, Tensor, Var};
use candle_nn::ModuleT;

use super::collectives;
use super::memory::{MemoryAccount, UnshardGuard};
use crate::comm::{CommStream, ProcessGroup, Work};
use crate::error::{Error, Result};
use crate::flat_param::FlatParameter;
use crate::mixed_precision::MixedPrecision;
use crate::unit::{RecordedParam, UnitSpec};

/// How a unit's forward keeps what its backward needs (see the module docs): `Free` is
/// `reshard` without `checkpoint`, `Keep` neither, `Checkpoint` is `checkpoint` (resharded or
/// not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ForwardMode {
    /// Run without autograd and recompute in backward (activation checkpointing).
    pub checkpoint: bool,
    /// Free the unsharded parameters after forward (gather them again for backward).
    pub reshard: bool,
}

/// Where a unit's parameters are (see the module docs).
enum ParamState {
    Sharded,
    Unsharding {
        work: Work<Tensor>,
        guard: UnshardGuard,
    },
    /// The guard is held (not read) until reshard.
    Unsharded {
        _guard: UnshardGuard,
    },
}

/// A unit's place in a training step (FSDP2's `TrainingState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TrainingState {
    /// No step in progress for this unit.
    Idle,
    /// Its training forward ran; [`Saved`] holds what backward needs.
    Forward,
    /// Its parameters are present for its backward.
    PreBackward,
}

/// What a training forward kept of a unit for its backward.
pub(crate) enum Saved {
    /// The unit ran with autograd; its graph is alive.
    Graph {
        /// The unit's input as an autograd variable (its gradient is the previous unit's output
        /// gradient); `None` for the first unit.
        input_var: Option<Tensor>,
        /// The unit's output, attached to its graph.
        output: Tensor,
        /// The unit's parameter variables, in layout order.
        params: Vec<Tensor>,
        /// Whether `params`' storage is freed (to be refilled before backward).
        freed: bool,
    },
    /// The unit ran without autograd and is recomputed from `input`; `kept` is the gathered flat
    /// buffer when the parameters were not resharded.
    Checkpoint { input: Tensor, kept: Option<Tensor> },
}

/// One unit of an [`super::FsdpModel`]: constructor, this rank's FlatParameter shard, buffers,
/// mixed-precision policy, and its parameter and training states.
pub(crate) struct FsdpUnit {
    spec: UnitSpec,
    recorded: Vec<RecordedParam>,
    flat: FlatParameter,
    buffers: Vec<(String, Var)>,
    policy: MixedPrecision,
    /// Unsharded f32 gradient accumulated while gradient sync is off (`no_sync`), padded flat
    /// layout; reduced together with the next synchronised backward.
    unsharded_grad: Option<Tensor>,
    params: ParamState,
    pub(crate) saved: Option<Saved>,
    training: TrainingState,
}

impl FsdpUnit {
    pub(crate) fn new(
        spec: UnitSpec,
        recorded: Vec<RecordedParam>,
        flat: FlatParameter,
        buffers: Vec<(String, Var)>,
        policy: MixedPrecision,
    ) -> Self {
        Self {
            spec,
            recorded,
            flat,
            buffers,
            policy,
            unsharded_grad: None,
            params: ParamState::Sharded,
            saved: None,
            training: TrainingState::Idle,
        }
    }

    /// The unit's name (prefix of its parameter names).
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// The constructor and per-unit options.
    pub fn spec(&self) -> &UnitSpec {
        &self.spec
    }

    /// Recorded parameters (names, shapes, init hints), in layout order.
    pub fn recorded(&self) -> &[RecordedParam] {
        &self.recorded
    }

    /// This rank's FlatParameter (layout, master shard, gradient shard).
    pub fn flat(&self) -> &FlatParameter {
        &self.flat
    }

    /// Bytes of the unsynchronised accumulated gradient (no_sync), f32.
    pub(crate) fn unsharded_grad_bytes(&self) -> usize {
        4 * self.unsharded_grad.as_ref().map_or(0, Tensor::elem_count)
    }

    /// Mutable FlatParameter (loading).
    pub(crate) fn flat_mut(&mut self) -> &mut FlatParameter {
        &mut self.flat
    }

    /// Buffers: full values in the policy's `buffer_dtype`, replicated, updated in place by
    /// training forwards.
    pub fn buffers(&self) -> &[(String, Var)] {
        &self.buffers
    }

    /// The mixed-precision policy this unit runs under.
    pub fn policy(&self) -> &MixedPrecision {
        &self.policy
    }

    /// True when this unit's unshard is a real all-gather (it has parameters and is sharded over
    /// more than one rank); otherwise the cast shard is the unsharded buffer. The one place that
    /// decides it.
    pub(crate) fn gathers(&self) -> bool {
        let layout = self.flat.layout();
        layout.world_size > 1 && layout.padded_numel > 0
    }

    pub(crate) fn training_state(&self) -> TrainingState {
        self.training
    }

    /// True when the parameters are only sharded (no gather in flight, nothing unsharded).
    pub(crate) fn is_sharded(&self) -> bool {
        matches!(self.params, ParamState::Sharded)
    }

    /// Transition `Sharded → Unsharding`: issues the all-gather in `param_dtype` on `stream`.
    /// A no-op when not sharded.
    pub(crate) fn unshard(
        &mut self,
        pg: &dyn ProcessGroup,
        stream: &CommStream,
        acct: &MemoryAccount,
    ) {
        if !self.is_sharded() {
            return;
        }
        let dtype = self.policy.param_dtype;
        let guard = acct.unshard(self.flat.layout().padded_numel * dtype.size_in_bytes());
        let work = collectives::all_gather_shard(pg, stream, &self.flat, dtype, self.gathers());
        self.params = ParamState::Unsharding { work, guard };
    }

    /// Transition `Unsharding → Unsharded`: waits for the all-gather and returns the gathered flat
    /// buffer (`padded_numel` elements). Issues the gather first if nobody did.
    ///
    /// Errors: the collective's; called while already unsharded (a schedule bug).
    pub(crate) fn wait_for_unshard(
        &mut self,
        pg: &dyn ProcessGroup,
        stream: &CommStream,
        acct: &MemoryAccount,
    ) -> Result<Tensor> {
        self.unshard(pg, stream, acct);
        match std::mem::replace(&mut self.params, ParamState::Sharded) {
            ParamState::Unsharding { work, guard } => {
                let flat = collectives::wait_gathered(work)?;
                self.params = ParamState::Unsharded { _guard: guard };
                Ok(flat)
            }
            other => {
                self.params = other;
                Err(Error::InvalidArgument(format!(
                    "unit {}: wait_for_unshard while its parameters are already unsharded",
                    self.spec.name
                )))
            }
        }
    }

    /// Transition `→ Sharded`: frees whatever unsharded form the parameters have (the storage of
    /// graph-held variables is emptied in place) and releases the memory guard. Idempotent.
    pub(crate) fn reshard(&mut self) -> Result<()> {
        if let Some(Saved::Graph { params, freed, .. }) = &mut self.saved {
            if !*freed {
                collectives::free_params(params)?;
                *freed = true;
            }
        }
        if let Some(Saved::Checkpoint { kept, .. }) = &mut self.saved {
            *kept = None;
        }
        self.params = ParamState::Sharded;
        Ok(())
    }

    /// Drops any step state (saved graph, gathers in flight, guards): back to `Sharded`/`Idle`.
    pub(crate) fn release(&mut self) {
        self.saved = None;
        self.params = ParamState::Sharded;
        self.training = TrainingState::Idle;
    }

    /// Casts a floating-point input to `param_dtype` when the policy says so.
    pub(crate) fn cast_input(&self, h: Tensor) -> Result<Tensor> {
        let p = &self.policy;
        if p.cast_forward_inputs && h.dtype().is_float() && h.dtype() != p.param_dtype {
            Ok(h.to_dtype(p.param_dtype)?)
        } else {
            Ok(h)
        }
    }

    /// Adds the buffers to a binding map: the live variables (updated in place by a training
    /// forward), or copies whose updates are discarded (for a recompute).
    fn add_buffers(&self, map: &mut HashMap<String, Tensor>, live: bool) -> Result<()> {
        for (name, var) in &self.buffers {
            let t = if live {
                var.as_tensor().clone()
            } else {
                Var::from_tensor(&var.as_tensor().detach())?.into_inner()
            };
            map.insert(name.clone(), t);
        }
        Ok(())
    }

    /// Binds the constructor to `params` (keyed by name) and the buffers.
    fn bind(
        &self,
        mut map: HashMap<String, Tensor>,
        live_buffers: bool,
        device: &Device,
    ) -> Result<Box<dyn ModuleT>> {
        self.add_buffers(&mut map, live_buffers)?;
        let names = self.buffers.iter().map(|(n, _)| n.clone()).collect();
        self.spec
            .bind_with_buffers(map, &names, self.policy.param_dtype, device)
    }

    fn var_map(&self, params: &[Tensor]) -> HashMap<String, Tensor> {
        self.flat
            .layout()
            .params
            .iter()
            .zip(params)
            .map(|(p, t)| (p.name.clone(), t.clone()))
            .collect()
    }

    /// Runs the unit's training forward on `h` with the gathered buffer `flat`, keeping what its
    /// backward needs according to `mode`, and reshards when the mode says so. `first`: the unit
    /// has no input gradient to compute. Returns the output.
    pub(crate) fn forward(
        &mut self,
        h: &Tensor,
        flat: Tensor,
        mode: ForwardMode,
        first: bool,
        device: &Device,
    ) -> Result<Tensor> {
        let output = if mode.checkpoint {
            {
                let input = self.cast_input(h.detach())?;
                let module = self.bind(
                    collectives::param_views(self.flat.layout(), &flat)?,
                    true,
                    device,
                )?;
                let output = module.forward_t(&input, true)?;
                drop(module);
                // The gathered buffer is kept for backward unless the unit reshards.
                let kept = (!mode.reshard).then_some(flat);
                self.saved = Some(Saved::Checkpoint { input, kept });
                if mode.reshard {
                    self.reshard()?;
                }
                output.detach()
            }
        } else {
            {
                let input_var = if first {
                    None
                } else {
                    let x = self.cast_input(h.detach())?;
                    Some(Var::from_tensor(&x)?.into_inner())
                };
                let input = match &input_var {
                    Some(v) => v.clone(),
                    None => self.cast_input(h.clone())?,
                };
                let params = collectives::param_vars(self.flat.layout(), &flat)?;
                drop(flat);
                let module = self.bind(self.var_map(&params), true, device)?;
                let mut output = module.forward_t(&input, true)?;
                drop(module);
                if mode.reshard
                    && params
                        .iter()
                        .any(|p| super::storage::same_storage(p, &output))
                {
                    // The output is a view of a parameter: give it storage of its own before
                    // the parameter is freed.
                    output = output.copy()?;
                }
                self.saved = Some(Saved::Graph {
                    input_var,
                    output: output.clone(),
                    params,
                    freed: false,
                });
                if mode.reshard {
                    self.reshard()?;
                }
                output
            }
        };
        self.training = TrainingState::Forward;
        Ok(output)
    }

    /// Whether this unit's backward needs an all-gather first (its parameters were resharded
    /// after forward and it has any).
    pub(crate) fn needs_gather_for_backward(&self) -> bool {
        match &self.saved {
            Some(Saved::Graph { freed, params, .. }) => *freed && !params.is_empty(),
            Some(Saved::Checkpoint { kept, .. }) => kept.is_none(),
            None => false,
        }
    }

    /// `Forward → PreBackward`: makes the parameters present for the unit's backward — refills
    /// freed variables from a (possibly prefetched) all-gather, or recomputes a checkpointed
    /// forward with autograd. Afterwards `saved` is a `Graph` with live parameters.
    ///
    /// `gathered`: the unit's gathered flat buffer when [`Self::needs_gather_for_backward`].
    pub(crate) fn pre_backward(
        &mut self,
        gathered: Option<Tensor>,
        first: bool,
        device: &Device,
    ) -> Result<()> {
        let missing = || {
            Error::InvalidArgument(format!(
                "unit {}: pre_backward needs the gathered parameters",
                self.spec.name
            ))
        };
        match self.saved.take() {
            Some(Saved::Graph {
                input_var,
                output,
                params,
                freed,
            }) => {
                if freed && !params.is_empty() {
                    let flat = gathered.ok_or_else(missing)?;
                    collectives::refill_params(self.flat.layout(), &flat, &params)?;
                }
                self.saved = Some(Saved::Graph {
                    input_var,
                    output,
                    params,
                    freed: false,
                });
            }
            Some(Saved::Checkpoint { input, kept }) => {
                let flat = match kept {
                    Some(flat) => flat,
                    None => gathered.ok_or_else(missing)?,
                };
                let params = collectives::param_vars(self.flat.layout(), &flat)?;
                drop(flat);
                let input_var = if first {
                    None
                } else {
                    Some(Var::from_tensor(&input)?.into_inner())
                };
                // The forward already updated the buffers: the recompute's updates are made on
                // copies and discarded.
                let module = self.bind(self.var_map(&params), false, device)?;
                let output = module.forward_t(input_var.as_ref().unwrap_or(&input), true)?;
                self.saved = Some(Saved::Graph {
                    input_var,
                    output,
                    params,
                    freed: false,
                });
            }
            None => {
                return Err(Error::InvalidArgument(format!(
                    "unit {}: backward without a saved forward",
                    self.spec.name
                )))
            }
        }
        self.training = TrainingState::PreBackward;
        Ok(())
    }

    /// `PreBackward → Idle`: copies the parameter gradients out of `grads` into one flat f32
    /// buffer (copy-in), frees the parameters and the graph (reshard), and returns the flat
    /// gradient (`None` for a unit without parameters) and the input gradient for the previous
    /// unit (detached: Candle records backward ops on variables, so an attached gradient would
    /// drag this unit's backward graph into the previous unit's backward).
    pub(crate) fn post_backward(
        &mut self,
        grads: Option<&candle_core::backprop::GradStore>,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let Some(Saved::Graph {
            input_var, params, ..
        }) = self.saved.take()
        else {
            return Err(Error::InvalidArgument(format!(
                "unit {}: post_backward before pre_backward",
                self.spec.name
            )));
        };
        let grad_in = match (grads, &input_var) {
            (Some(g), Some(v)) => g.get(v).map(Tensor::detach),
            _ => None,
        };
        let flat_grad = collectives::flatten_grads(&self.flat, grads, &params)?;
        drop(params);
        self.params = ParamState::Sharded;
        self.training = TrainingState::Idle;
        Ok((flat_grad, grad_in))
    }

    /// The output kept by this unit's forward (for the surrogate backward).
    pub(crate) fn saved_output(&self) -> Option<&Tensor> {
        match &self.saved {
            Some(Saved::Graph { output, .. }) => Some(output),
            _ => None,
        }
    }

    /// False when `grads` holds a gradient for none of the unit's parameter and input variables
    /// although it has some: the loss did not depend on the unit's output. (Candle keeps
    /// gradients of variables only, so the output itself cannot be asked.)
    pub(crate) fn reached_by(&self, grads: &candle_core::backprop::GradStore) -> bool {
        match &self.saved {
            Some(Saved::Graph {
                input_var, params, ..
            }) => {
                let vars: Vec<&Tensor> = params.iter().chain(input_var.as_ref()).collect();
                vars.is_empty() || vars.iter().any(|v| grads.get(v).is_some())
            }
            _ => true,
        }
    }

    /// True when the unit has parameter variables or an input variable to differentiate.
    pub(crate) fn has_backward(&self) -> bool {
        match &self.saved {
            Some(Saved::Graph {
                input_var, params, ..
            }) => input_var.is_some() || !params.is_empty(),
            _ => false,
        }
    }

    /// Adds `flat_grad` to the unsynchronised accumulated gradient (or returns the sum with it
    /// when `sync`): no_sync accumulation.
    ///
    /// Errors: the in-place add's (a device without kernels).
    pub(crate) fn merge_unsynced(
        &mut self,
        flat_grad: Tensor,
        sync: bool,
    ) -> Result<Option<Tensor>> {
        if let Some(acc) = self.unsharded_grad.take() {
            crate::ops::add_(&flat_grad, &acc)?;
        }
        if sync {
            Ok(Some(flat_grad))
        } else {
            self.unsharded_grad = Some(flat_grad);
            Ok(None)
        }
    }

    /// Drops the gradient shard and any unsynchronised accumulated gradient.
    pub(crate) fn zero_grad(&mut self) {
        self.flat.clear_grad();
        self.unsharded_grad = None;
    }

    /// Binds the constructor to the views of a gathered f32/param-dtype buffer for an eval
    /// forward (no autograd) and runs it.
    pub(crate) fn forward_eval(&self, h: Tensor, flat: &Tensor, device: &Device) -> Result<Tensor> {
        let module = self.bind(
            collectives::param_views(self.flat.layout(), flat)?,
            true,
            device,
        )?;
        Ok(module.forward_t(&self.cast_input(h)?, false)?)
    }
}
