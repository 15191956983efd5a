//! The backward of an [`FsdpModel`]: [`FsdpModel::backward`] runs one `loss.backward()` of
//! Candle over the caller's graph, whose call nodes ([`super::call`]) run each call's backward
//! in FSDP2's steps when the gradients of all its outputs are complete:
//! - `pre_backward`: unshard the call's groups and wait (the gather was prefetched one call
//!   ahead in reverse call order, [`super::scheduler`]);
//! - `backward_compute`: refill the outputs freed after the forward (or `recompute` a
//!   checkpointed call), back-propagate `sum_j sum(o_j · g_j)` through the unit's own graph,
//!   add the parameter gradients into the groups' flat gradients, keep the inputs' gradients
//!   for the input nodes;
//! - `post_backward`: after a group's last call, drop its variables and `issue_reduction`
//!   (the reduce-scatter, without waiting); otherwise reshard it (FULL_SHARD).
//!
//! The reductions are waited for at the end and added into the f32 gradient shards.

use candle_core::{Tensor, Var};

use super::call::CallBackward;
use super::collectives;
use super::config::BackwardPrefetch;
use super::fingerprint::{self, FingerprintPhase};
use super::forward::Params;
use super::model::FsdpModel;
use super::scheduler;
use crate::error::{Error, Phase, Result};
use crate::trace::SpanKind;

impl FsdpModel {
    /// Sharded backward (a collective) of `loss`, a scalar computed from the outputs of the last
    /// training forward ([`FsdpModel::forward`] or [`FsdpModel::forward_with`]). On return every
    /// unit's gradient shard holds the gradient averaged over ranks (added to what it held, so
    /// calling forward/backward several times accumulates).
    ///
    /// One `loss.backward()` of Candle over the whole graph; each unit call's backward runs
    /// when its outputs' gradients are complete: its parameters are refilled from an all-gather
    /// issued one call ahead (backward prefetch; the first is issued before the loss's own
    /// backward), its gradients are copied into its group's flat gradient, and after the
    /// group's last call the reduce-scatter is issued on the reduce-scatter stream (the
    /// all-gathers' under [`crate::CommStreams::Shared`]) without waiting. All reductions are
    /// waited for at the end and added into the f32 gradient shards. Gradients of variables
    /// outside the model's units are not kept.
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
        if !self.state.awaits_backward() {
            return Err(Error::Misuse {
                call: "backward",
                state: "called without a preceding training forward",
                fix: "run a training forward (forward or forward_with) and compute the loss from \
                      its outputs first"
                    .into(),
            });
        }
        self.begin_backward();
        let result = self.backward_steps(loss);
        self.release_step();
        result
    }

    /// `loss` plus the sum of every zero-element output node of the step (exactly 0): the
    /// calls of a rank with an empty batch are connected to its loss, whatever it computed
    /// (Candle drops `0 * x` and element-wise ops on zero-element tensors from the graph).
    fn attach_empty_outputs(&self, loss: &Tensor) -> Result<Tensor> {
        let empty = self.state.step().map_or(&[][..], |s| &s.empty_outputs);
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
        let n_calls = self.step_calls().len();
        if self.scheduler.backward_mode() != BackwardPrefetch::None {
            // The first gather of backward runs during the loss's own backward.
            if let Some(c) = self.next_gathering_call(n_calls) {
                let groups = self.step_calls()[c].groups.clone();
                self.prefetch_groups(&groups, &[]);
            }
        }
        let hook = self.step_mut().hook.clone();
        let result = {
            let _armed = hook.arm(self as *mut FsdpModel as *mut dyn CallBackward);
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
                Error::Misuse {
                    call: "backward",
                    state: "called with a loss that does not depend on the output of the last \
                            training forward",
                    fix: "no gradient reaches the model; compute the loss from that forward's \
                          outputs"
                        .into(),
                },
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
        self.pass_on_to_replicas(true)?;
        for (g, work, all_local) in self.scheduler.take_reductions() {
            let _w = self.span(SpanKind::Wait, || {
                format!("FSDP::wait reduce_scatter {}", self.units[g].name())
            });
            // The reduced chunk carries each parameter's presence flag, summed over the ranks
            // (`collectives::flatten_grads`): a parameter has a gradient when some rank
            // produced one.
            let result = collectives::wait_reduced(work).and_then(|reduced| {
                self.fingerprint_tensor(g, FingerprintPhase::ReduceOut, &reduced)?;
                let (grad, present) =
                    collectives::split_reduced(self.units[g].flat().layout(), reduced, all_local)?;
                self.units[g].accumulate_reduced(grad, &present)
            });
            result.map_err(|e| self.at(e, Some(g), Phase::Backward))?;
        }
        Ok(())
    }

    /// Stores the gradient of output `j` of call `c` (called by the output node).
    fn store_output_grad(&mut self, c: usize, j: usize, grad: Tensor) -> Result<()> {
        let call = self
            .state
            .step_mut()
            .and_then(|s| s.calls.get_mut(c))
            .ok_or_else(|| Error::Internal("a call node outlived its step".into()))?;
        call.out_grads[j] = Some(grad);
        Ok(())
    }

    /// Hands out the gradient of tracked input `i` of call `c` (called by the input nodes, after
    /// the call's backward).
    fn hand_out_input_grad(&mut self, c: usize, i: usize) -> Result<Option<Tensor>> {
        let call = self
            .state
            .step_mut()
            .and_then(|s| s.calls.get_mut(c))
            .ok_or_else(|| Error::Internal("a call node outlived its step".into()))?;
        Ok(call.in_grads[i].take())
    }

    /// The backward of call `c` (run by its top node, see [`super::call`]): makes its groups'
    /// parameters present, prefetches the next call's, back-propagates `sum_j sum(o_j · g_j)`
    /// through the unit's own graph (recomputed first when checkpointed), copies the parameter
    /// gradients into the groups' flat gradients, keeps the inputs' gradients for the input
    /// nodes, and finishes the groups: after a group's last call its variables are dropped and
    /// its reduction issued; otherwise FULL_SHARD frees the parameters again.
    fn backward_call(&mut self, c: usize) -> Result<()> {
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
        self.pre_backward(m, &groups)?;
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
        self.post_backward(c, m, &groups)?;
        if mode == BackwardPrefetch::BackwardPost {
            self.prefetch_backward(c, &groups);
        }
        Ok(())
    }

    /// Before call `c`'s backward (member `m`): unshards its groups and waits for them (the
    /// gathers were prefetched one call ahead when prefetch is on).
    fn pre_backward(&mut self, m: usize, groups: &[usize]) -> Result<()> {
        let _pre_backward =
            self.nvtx_range(|| format!("FSDP::pre_backward {}", self.members[m].spec.name));
        for &g in groups {
            self.unshard(g);
        }
        for &g in groups {
            self.wait_for_unshard(g)?;
        }
        Ok(())
    }

    /// After call `c`'s backward (member `m`): each group that has seen its last call's
    /// backward drops its variables and issues its reduction; otherwise FULL_SHARD reshards the
    /// group unless the next call in reverse order uses it too.
    fn post_backward(&mut self, c: usize, m: usize, groups: &[usize]) -> Result<()> {
        let next = self.next_backward_call(c);
        let _post_backward =
            self.nvtx_range(|| format!("FSDP::post_backward {}", self.members[m].spec.name));
        for &g in groups {
            let (last, grad) = self.units[g].post_backward();
            if let Some(fg) = grad {
                self.issue_reduction(g, fg)?;
            } else if !last && self.units[g].reshard_after_forward {
                let needed_next = next.is_some_and(|n| self.step_calls()[n].groups.contains(&g));
                if !needed_next {
                    self.units[g].reshard()?;
                }
            }
        }
        Ok(())
    }

    /// After a call's backward: every parameter of a group bound as views for fused nodes
    /// (only fused nodes read it, `fsdp::fused`) that the unit asked for has a gradient, sent
    /// by a fused node. One without means the node that promised it in the forward never ran
    /// its backward: its output does not reach the unit's outputs (a fused layer's result
    /// discarded), which the forward's connectivity check cannot see (a promise counts as
    /// reached there).
    ///
    /// Errors: [`Error::Disconnected`] naming the unit and the parameter.
    fn check_fused_sent(
        &self,
        m: usize,
        groups: &[usize],
        grads: &candle_core::backprop::GradStore,
        outputs: &[Option<Tensor>],
    ) -> Result<()> {
        let member = &self.members[m];
        if member.spec.unused_parameters || outputs.iter().flatten().any(|o| o.elem_count() == 0) {
            return Ok(());
        }
        for &g in groups {
            let u = &self.units[g];
            if u.is_frozen() || !u.binds_views_now() {
                continue;
            }
            for (name, v) in self.asked_params(m, g) {
                if grads.get(v).is_none() {
                    return Err(Error::Disconnected {
                        unit: member.spec.name.clone(),
                        what: format!(
                            "unit {}: parameter {} is read only by fused nodes (bound as a view                              for them), but none sent its gradient in this call's backward: the                              fused node that promised it does not reach the unit's outputs (its                              result unused?), so the parameter would silently get no gradient",
                            member.spec.name, name
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// The autograd part of call `c`'s backward (see [`FsdpModel::backward_call`]).
    fn backward_compute(&mut self, c: usize, m: usize, groups: &[usize]) -> Result<()> {
        let call = &mut self.step_mut().calls[c];
        let out_grads = std::mem::take(&mut call.out_grads);
        let refill_from = std::mem::take(&mut call.refill_from);
        let (outputs, input_vars) = if call.checkpoint {
            let saved = std::mem::take(&mut call.saved_inputs);
            let tracked: Vec<usize> = call.tracked.iter().map(|(i, _)| *i).collect();
            self.recompute(c, m, groups, saved, &tracked)?
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
            Some(s) if s.track_op() => {
                // Fused nodes (`fsdp::fused`) send their parameters' gradients here instead of
                // through Candle's graph; they join the store where Candle's would be.
                let sink = super::fused::collect();
                let mut grads = s.backward()?;
                for (p, g) in sink.finish() {
                    let g = match grads.get(&p) {
                        Some(old) => (old + g)?,
                        None => g,
                    };
                    grads.insert(&p, g);
                }
                self.check_fused_sent(m, groups, &grads, &outputs)?;
                Some(grads)
            }
            _ => None,
        };
        let call = &self.step_calls()[c];
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
                    let unit = self.members[m].spec.name.clone();
                    return Err(Error::Disconnected {
                        what: format!(
                            "input {index} of unit {unit} carries gradient, and the unit's \
                             outputs received gradients, but the input got none: an operation \
                             inside has no backward (candle-nn 0.11's layer_norm and rms_norm \
                             are fused ops without one: use candle_fsdp::nn::layer_norm / \
                             rms_norm), so every unit before it would silently get no gradient. \
                             If the unit is not meant to differentiate through this input, pass \
                             it detached (x.detach())"
                        ),
                        unit,
                    });
                }
            }
        }
        for &g in groups {
            self.units[g].add_call_grads(grads.as_ref())?;
        }
        drop(grads);
        drop(outputs);
        drop(input_vars);
        let call = &mut self.step_mut().calls[c];
        call.in_grads = in_grads;
        call.done = true;
        Ok(())
    }

    /// Recomputes checkpointed call `c` with autograd; returns its outputs and the variables of
    /// its tracked inputs.
    fn recompute(
        &mut self,
        c: usize,
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
        let module = self.bind(m, groups, Params::Recompute)?;
        let (params, frozen) = self.call_param_ids(groups);
        // The call's own seed: the recomputation draws the forward's dropout masks.
        let _armed = super::fused::arm_call(params, frozen, self.call_seed(c), true);
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
        if let Some(mut fg) = self.units[g].merge_unsynced(flat_grad, sync)? {
            if let Some((i, bit)) = fingerprint::fault::take(self.step(), self.units[g].name()) {
                fg = fingerprint::flip_bit(&fg, i, bit)?;
            }
            // The wire carries `reduce_dtype`: the fingerprint sees what enters the collective.
            let dtype = self.units[g].policy().reduce_dtype;
            let fg = crate::alloc::in_shared(|| fg.to_dtype(dtype))?;
            self.fingerprint_tensor(g, FingerprintPhase::ReduceIn, &fg)?;
            self.mark_issue(|| format!("FSDP::reduce_scatter {}", self.units[g].name()));
            let u = &self.units[g];
            let work = collectives::reduce_grads(
                self.comm.shard_pg(),
                &self.comm.reduce_scatter,
                u.flat().layout(),
                fg,
                self.comm.mesh.replica.is_some(),
            );
            let all_local = self.units[g].take_all_present_locally();
            self.scheduler.push_reduction(g, work, all_local);
            self.pass_on_to_replicas(false)?;
        }
        Ok(())
    }

    /// HYBRID_SHARD: issues the replica all-reduce (on its own stream) of every reduce-scatter
    /// that has completed, oldest first, so it overlaps the rest of the backward; with `all`,
    /// of every one, waiting for each. Nothing without a replica group.
    ///
    /// Errors: a reduce-scatter's, naming its unit.
    pub(super) fn pass_on_to_replicas(&mut self, all: bool) -> Result<()> {
        let (Some(replicas), Some(stream)) = (&self.comm.mesh.replica, &self.comm.all_reduce)
        else {
            return Ok(());
        };
        // Waiting for the remaining reduce-scatters is exposed communication.
        let _w = all
            .then(|| {
                self.span(SpanKind::Wait, || {
                    "FSDP::wait reduce_scatter (to replicas)".into()
                })
            })
            .flatten();
        self.scheduler
            .advance_reductions(all, |reduced| {
                collectives::all_reduce_replicas(replicas.as_ref(), stream, reduced)
            })
            .map_err(|b| {
                let (g, e) = *b;
                self.at(e, Some(g), Phase::Backward)
            })
    }
}

/// Backward prefetch: which call's groups to gather next, and issuing them.
impl FsdpModel {
    /// The latest call before call number `before` whose backward has not run.
    pub(super) fn next_backward_call(&self, before: usize) -> Option<usize> {
        let calls = self.step_calls();
        scheduler::next_backward_call(calls.len(), before, |c| !calls[c].done)
    }

    /// The latest call before `before`, not yet back-propagated, that needs a gather (some
    /// group neither present nor in flight).
    pub(super) fn next_gathering_call(&self, before: usize) -> Option<usize> {
        let calls = self.step_calls();
        scheduler::next_gathering_call(
            calls.len(),
            before,
            |c| !calls[c].done,
            |c| calls[c].groups.iter().any(|&g| self.units[g].is_sharded()),
        )
    }

    /// Issues the gathers of the next call in reverse call order (nothing when they are present
    /// or in flight already: one call ahead, as FSDP's backward prefetch).
    pub(super) fn prefetch_backward(&mut self, c: usize, current: &[usize]) {
        if let Some(n) = self.next_backward_call(c) {
            let groups = self.step_calls()[n].groups.clone();
            self.prefetch_groups(&groups, current);
        }
    }
}

/// The seam the call nodes of [`super::call`] reach the model through.
impl CallBackward for FsdpModel {
    fn run_call_backward(&mut self, c: usize) -> Result<()> {
        self.backward_call(c)
    }

    fn set_output_grad(&mut self, c: usize, j: usize, grad: Tensor) -> Result<()> {
        self.store_output_grad(c, j, grad)
    }

    fn take_input_grad(&mut self, c: usize, i: usize) -> Result<Option<Tensor>> {
        self.hand_out_input_grad(c, i)
    }
}
