//! One parameter group of an FSDP model (FSDP2's `FSDPParamGroup`): one FlatParameter shard, the
//! buffers, the mixed-precision policy, and the small state machine that moves the parameters
//! between sharded and unsharded form.
//!
//! A group is what is gathered and reduced as one: the parameters of one unit, of several units
//! that share a tensor ([`crate::FsdpModelBuilder::group`], tied weights), or the frozen
//! parameters of a unit (a *frozen twin*: gathered with the unit, never reduced).
//!
//! Parameter states and the transitions between them:
//!
//! ```text
//!            unshard()                wait_for_unshard()
//! Sharded ──────────────▶ Unsharding ───────────────────▶ Present ─────┐
//!    ▲        (all-gather issued,       (copy-out into the             │ reshard()
//!    │         output allocated)         step's variables)             │ (free the variables'
//!    └─────────────────────────────────────────────────────────────────┘  storage, drop guard)
//! ```
//!
//! The step's variables (one per parameter, [`collectives::param_vars`]) are created by the
//! first unshard of a training step and **kept for the whole step**: every call of the group's
//! units binds the same variables, `reshard` empties their storage in place while the autograd
//! graphs keep referencing them, and the next unshard refills that storage
//! ([`super::storage`]). No unit is recomputed to get its parameters back. The variables are
//! dropped when the last call of the group in the step has run its backward
//! ([`ParamGroup::post_backward`]).

use std::collections::HashMap;

use candle_core::{DType, Tensor, Var};

use super::collectives::{self, CommContext};
use super::memory::{MemoryAccount, UnshardGuard};
use crate::comm::Work;
use crate::error::{Error, Result};
use crate::flat_param::FlatParameter;
use crate::mixed_precision::MixedPrecision;

/// Where a group's parameters are (see the module docs).
enum ParamState {
    Sharded,
    Unsharding {
        work: Work<Tensor>,
        guard: UnshardGuard,
    },
    /// The step's variables hold the values; the guard is held (not read) until reshard.
    Present {
        _guard: UnshardGuard,
    },
}

/// How the step's parameter tensors are bound (see [`ParamGroup::binds_views`]); `Unbound`
/// outside a step and before its first unshard. The tensors are created by the step's first
/// unshard and kept for the whole step.
enum Binding {
    Unbound,
    /// Autograd variables (a trainable group): refilled in place at each unshard, their
    /// storage emptied at reshard.
    Variables(Vec<Tensor>),
    /// Plain tensors without gradient (a frozen twin), refilled and emptied like variables.
    Copies(Vec<Tensor>),
    /// Views of the cast shard, which is the unsharded buffer (a group that does not gather,
    /// read only by fused nodes): nothing to refill or free.
    ShardViews(Vec<Tensor>),
    /// Views of the gathered buffer `unsharded` (read only by fused nodes): `reshard` frees its
    /// storage in place, the next gather's buffer moves into it ([`super::storage::adopt`]).
    GatheredViews {
        views: Vec<Tensor>,
        unsharded: Tensor,
    },
}

impl Binding {
    /// The step's parameter tensors (layout order), once bound.
    fn tensors(&self) -> Option<&[Tensor]> {
        match self {
            Binding::Unbound => None,
            Binding::Variables(t) | Binding::Copies(t) | Binding::ShardViews(t) => Some(t),
            Binding::GatheredViews { views, .. } => Some(views),
        }
    }
}

/// One parameter group of an [`super::FsdpModel`]: this rank's FlatParameter shard, buffers,
/// mixed-precision policy, and its parameter state.
pub(crate) struct ParamGroup {
    name: String,
    flat: FlatParameter,
    buffers: Vec<(String, Var)>,
    policy: MixedPrecision,
    /// Frozen twin: parameters without gradient (plain tensors, never reduced).
    frozen: bool,
    /// Free the parameters after each forward call (FULL_SHARD and the unit's
    /// `reshard_after_forward`).
    pub(crate) reshard_after_forward: bool,
    /// Unsharded f32 gradient accumulated while gradient sync is off (`no_sync`), padded flat
    /// layout; reduced together with the next synchronised backward.
    unsharded_grad: Option<Tensor>,
    params: ParamState,
    /// The step's parameter tensors (layout order) and how they are bound.
    binding: Binding,
    /// Training calls of this step whose backward has not run.
    pending_calls: usize,
    /// The step's flat gradient (the [`collectives::flatten_grads`] form), summed over the
    /// calls whose backward ran.
    grad_acc: Option<Tensor>,
    /// This rank's own gradient presence (layout order) in the gradient not reduced yet (the
    /// step's calls, and the `no_sync` accumulation): OR-ed as gradients are added.
    local_present: Vec<bool>,
    /// Partial reshard after forward: this rank's piece of the step's gathered parameters
    /// (`param_dtype`, `1/k` of the flat buffer), kept from the step's first gather to the
    /// group's last backward, with its memory guard; later unshards gather it inside the
    /// secondary group instead of the shard group.
    secondary: Option<(Tensor, UnshardGuard)>,
    /// Whether every parameter of the group is read only by fused nodes that send their
    /// gradients through the runtime's sink (`fsdp::fused`): promised by a fused node and
    /// reached by no autograd edge, in every training call of the first step that ran with
    /// variables (`None` until that step ends). See [`ParamGroup::binds_views`].
    fused_only: Option<bool>,
    /// This step's observations for [`ParamGroup::fused_only`] (AND over its calls).
    step_fused: Option<bool>,
}

impl ParamGroup {
    pub(crate) fn new(
        name: String,
        flat: FlatParameter,
        buffers: Vec<(String, Var)>,
        policy: MixedPrecision,
        frozen: bool,
    ) -> Self {
        Self {
            name,
            flat,
            buffers,
            policy,
            frozen,
            reshard_after_forward: true,
            unsharded_grad: None,
            params: ParamState::Sharded,
            binding: Binding::Unbound,
            pending_calls: 0,
            grad_acc: None,
            local_present: Vec::new(),
            secondary: None,
            fused_only: None,
            step_fused: None,
        }
    }

    /// Records one training call's observation for [`ParamGroup::fused_only`]: whether every
    /// parameter of the group was promised by a fused node and reached by no autograd edge.
    pub(crate) fn note_call_fusion(&mut self, fused: bool) {
        self.step_fused = Some(self.step_fused.unwrap_or(true) && fused);
    }

    /// Whether the step's parameter tensors are bound as views of the unsharded buffer instead
    /// of variable copies: every parameter is read only by fused nodes
    /// ([`ParamGroup::fused_only`], learned on the first step), which need no autograd
    /// variable, on the CPU. A group that does not gather (world size 1, NO_SHARD) views its
    /// cast shard, which *is* the unsharded buffer (`param_dtype` = the shard's dtype); a
    /// gathering group views its gathered buffer, freed in place at reshard and refilled by
    /// moving the next gather's buffer in. Saves the copy-out and the refill at each unshard
    /// (decision 66).
    fn binds_views(&self) -> bool {
        self.fused_only == Some(true)
            && !self.frozen
            && self.flat.shard().device().is_cpu()
            && (self.gathers() || self.policy.param_dtype == self.flat.shard().dtype())
    }

    /// Whether the step's parameter tensors are views bound for fused nodes (see
    /// [`ParamGroup::binds_views`]).
    pub(crate) fn binds_views_now(&self) -> bool {
        matches!(
            self.binding,
            Binding::ShardViews(_) | Binding::GatheredViews { .. }
        )
    }

    /// The step ended for this group: a first step's observations decide
    /// [`ParamGroup::fused_only`] once.
    fn end_step_observation(&mut self) {
        if let Some(fused) = self.step_fused.take() {
            if self.fused_only.is_none() {
                self.fused_only = Some(fused);
            } else if !fused {
                self.fused_only = Some(false);
            }
        }
    }

    /// Ors `present` into this rank's gradient presence.
    fn note_present(&mut self, present: &[bool]) {
        if self.local_present.len() != present.len() {
            self.local_present = vec![false; present.len()];
        }
        for (have, &new) in self.local_present.iter_mut().zip(present) {
            *have |= new;
        }
    }

    /// Whether this rank had a gradient for every parameter of the gradient being reduced now,
    /// and a fresh start for the next one.
    pub(crate) fn take_all_present_locally(&mut self) -> bool {
        let all = !self.local_present.is_empty() && self.local_present.iter().all(|&p| p);
        self.local_present.clear();
        all
    }

    /// The group's name (a unit's name, a tied group's, or `<unit>[frozen]`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// This rank's FlatParameter (layout, master shard, gradient shard).
    pub fn flat(&self) -> &FlatParameter {
        &self.flat
    }

    /// Mutable FlatParameter (loading, gradient accumulation).
    pub(crate) fn flat_mut(&mut self) -> &mut FlatParameter {
        &mut self.flat
    }

    /// Whether this is a frozen twin (no gradient, no reduction, no optimizer state).
    pub(crate) fn is_frozen(&self) -> bool {
        self.frozen
    }

    /// Bytes of the unsynchronised accumulated gradient (no_sync), f32.
    pub(crate) fn unsharded_grad_bytes(&self) -> usize {
        4 * self.unsharded_grad.as_ref().map_or(0, Tensor::elem_count)
    }

    /// Buffers: full values in the policy's `buffer_dtype`, replicated, updated in place by
    /// training forwards.
    pub fn buffers(&self) -> &[(String, Var)] {
        &self.buffers
    }

    /// The mixed-precision policy this group runs under.
    pub fn policy(&self) -> &MixedPrecision {
        &self.policy
    }

    /// True when this group's unshard is a real all-gather (it has parameters and is sharded
    /// over more than one rank); otherwise the cast shard is the unsharded buffer. The one place
    /// that decides it.
    pub(crate) fn gathers(&self) -> bool {
        let layout = self.flat.layout();
        layout.world_size > 1 && layout.padded_numel > 0
    }

    /// True when the parameters are only sharded (no gather in flight, nothing present).
    pub(crate) fn is_sharded(&self) -> bool {
        matches!(self.params, ParamState::Sharded)
    }

    /// True when the step's parameter tensors hold their values.
    pub(crate) fn is_present(&self) -> bool {
        matches!(self.params, ParamState::Present { .. })
    }

    /// True while a step holds state of this group (variables, calls awaiting backward).
    pub(crate) fn in_step(&self) -> bool {
        !matches!(self.binding, Binding::Unbound) || self.pending_calls > 0
    }

    /// Transition `Sharded → Unsharding`: issues the all-gather in `param_dtype` on the shard
    /// group's all-gather stream, or, when the step keeps a secondary piece (partial reshard
    /// after forward), inside the secondary group. A no-op unless sharded.
    pub(crate) fn unshard(&mut self, comm: &CommContext, acct: &MemoryAccount) {
        if !self.is_sharded() {
            return;
        }
        let dtype = self.policy.param_dtype;
        let padded = self.flat.layout().padded_numel;
        // A packed shard also holds its gathered packed bytes until they are dequantised.
        let packed_bytes = self
            .flat
            .packed()
            .map_or(0, |p| p.format.packed_bytes(padded));
        let guard =
            acct.unshard_counted(padded * dtype.size_in_bytes() + packed_bytes, !self.frozen);
        let work = match (&self.secondary, comm.secondary(), self.flat.packed()) {
            (Some((piece, _)), Some((pg, stream)), _) => {
                collectives::all_gather_secondary(pg, stream, piece)
            }
            (_, _, Some(p)) => collectives::all_gather_packed(
                comm.shard_pg(),
                &comm.all_gather,
                &p.bytes,
                self.gathers(),
            ),
            _ => collectives::all_gather_shard(
                comm.shard_pg(),
                &comm.all_gather,
                &self.flat,
                dtype,
                self.gathers(),
            ),
        };
        // A packed shard's bytes are dequantised as soon as they arrive, beside the compute
        // (as the f32 gather's copy runs on its comm thread), not at the wait.
        let work = match self.flat.packed() {
            Some(p) => collectives::unpack_when_gathered(
                work,
                p.format,
                self.flat.layout().clone(),
                dtype,
                comm.shard_pg().rank(),
            ),
            None => work,
        };
        self.params = ParamState::Unsharding { work, guard };
    }

    /// Transition `→ Present`: waits for the all-gather (issuing it if nobody did) and copies
    /// the gathered buffer into the step's parameter tensors (created on the first unshard of
    /// the step, refilled in place afterwards). A no-op when present.
    ///
    /// With a secondary group (partial reshard after forward), the step's first gather also
    /// keeps this rank's piece of the gathered buffer for the later ones.
    ///
    /// Errors: the collective's; a refill error.
    pub(crate) fn wait_for_unshard(
        &mut self,
        comm: &CommContext,
        acct: &MemoryAccount,
    ) -> Result<()> {
        if self.is_present() {
            return Ok(());
        }
        self.unshard(comm, acct);
        let ParamState::Unsharding { work, guard } =
            std::mem::replace(&mut self.params, ParamState::Sharded)
        else {
            unreachable!("unshard leaves the parameters unsharding")
        };
        let flat = collectives::wait_gathered(work)?;
        if let Some((pg, _)) = comm.secondary() {
            if self.secondary.is_none() && self.reshard_after_forward && self.gathers() {
                let piece = collectives::secondary_piece(pg, &flat)?;
                let bytes = piece.elem_count() * piece.dtype().size_in_bytes();
                self.secondary = Some((piece, acct.unshard_counted(bytes, false)));
            }
        }
        let layout = self.flat.layout();
        let flat = self.unpacked(flat)?;
        match &self.binding {
            // Views of the shard already hold the values.
            Binding::ShardViews(_) => {}
            // Views of a gathered buffer get the new gather's buffer moved into the storage
            // they share.
            Binding::GatheredViews { unsharded, .. } => super::storage::adopt(unsharded, &flat)?,
            Binding::Variables(t) | Binding::Copies(t) => {
                collectives::refill_params(layout, &flat, t)?
            }
            Binding::Unbound => {
                self.binding = match (self.binds_views(), self.gathers(), self.frozen) {
                    (true, true, _) => Binding::GatheredViews {
                        views: collectives::param_detached_views(layout, &flat)?,
                        unsharded: flat.clone(),
                    },
                    (true, false, _) => {
                        Binding::ShardViews(collectives::param_detached_views(layout, &flat)?)
                    }
                    (false, _, true) => Binding::Copies(collectives::param_copies(layout, &flat)?),
                    (false, _, false) => {
                        Binding::Variables(collectives::param_vars(layout, &flat)?)
                    }
                }
            }
        }
        self.params = ParamState::Present { _guard: guard };
        Ok(())
    }

    /// The unsharded flat buffer of a gather: a packed shard's gathered bytes dequantised
    /// into `param_dtype` ([`collectives::unpack_gathered`]) unless
    /// [`collectives::unpack_when_gathered`] did already, else the gathered buffer itself.
    fn unpacked(&self, gathered: Tensor) -> Result<Tensor> {
        match self.flat.packed() {
            // Still bytes when the gather's work did not dequantise them (no gather, or off
            // the CPU).
            Some(p) if gathered.dtype() == candle_core::DType::U8 => collectives::unpack_gathered(
                p.format,
                &gathered,
                self.flat.layout(),
                self.policy.param_dtype,
            ),
            _ => Ok(gathered),
        }
    }

    /// Transition `Present → Sharded`: frees the step's parameter tensors' storage in place
    /// (graphs keep referencing them; the next unshard refills them) and releases the memory
    /// guard. A gather in flight is left alone. Idempotent.
    ///
    /// Errors: the in-place free's (a device without an implementation).
    pub(crate) fn reshard(&mut self) -> Result<()> {
        if self.is_present() {
            match &self.binding {
                Binding::Variables(t) | Binding::Copies(t) => collectives::free_params(t)?,
                // Views of the gathered buffer: free the buffer they share.
                Binding::GatheredViews { unsharded, .. } => super::storage::free(unsharded)?,
                // Views alias the master shard: there is nothing of the step's own to free.
                Binding::ShardViews(_) | Binding::Unbound => {}
            }
            self.params = ParamState::Sharded;
        }
        Ok(())
    }

    /// Drops any step state (variables, gathers in flight, guards, the step's gradient): back
    /// to `Sharded`.
    pub(crate) fn finalize(&mut self) {
        self.end_step_observation();
        self.binding = Binding::Unbound;
        self.secondary = None;
        self.params = ParamState::Sharded;
        self.pending_calls = 0;
        self.grad_acc = None;
    }

    /// Adds this group's tensors to a binding map: the step's parameter tensors (detached when
    /// `detached`, for forwards without autograd) and the buffers (the live variables, or
    /// copies whose in-place updates are discarded, for a recompute).
    ///
    /// Errors: called while the parameters are not present (a schedule bug).
    pub(crate) fn add_to_map(
        &self,
        map: &mut HashMap<String, Tensor>,
        detached: bool,
        live_buffers: bool,
    ) -> Result<()> {
        let vars = match (self.binding.tensors(), self.is_present()) {
            (Some(vars), true) => vars,
            _ => {
                return Err(Error::Internal(format!(
                    "unit {}: its parameters are not present (a schedule bug)",
                    self.name
                )))
            }
        };
        for (p, t) in self.flat.layout().params.iter().zip(vars) {
            map.insert(
                p.name.clone(),
                if detached { t.detach() } else { t.clone() },
            );
        }
        for (name, var) in &self.buffers {
            let t = if live_buffers {
                var.as_tensor().clone()
            } else {
                Var::from_tensor(&var.as_tensor().detach())?.into_inner()
            };
            map.insert(name.clone(), t);
        }
        Ok(())
    }

    /// Adds this group's parameters as views of a gathered flat buffer, and its live buffers,
    /// to a binding map (eval forwards: no variables).
    pub(crate) fn add_views_to_map(
        &self,
        map: &mut HashMap<String, Tensor>,
        gathered: &Tensor,
    ) -> Result<()> {
        map.extend(collectives::param_views(self.flat.layout(), gathered)?);
        for (name, var) in &self.buffers {
            map.insert(name.clone(), var.as_tensor().clone());
        }
        Ok(())
    }

    /// Waits for the eval gather (issuing it if needed) and returns the gathered flat buffer;
    /// the group is `Sharded` again afterwards (the buffer's lifetime is the caller's).
    pub(crate) fn gather_for_eval(
        &mut self,
        comm: &CommContext,
        acct: &MemoryAccount,
    ) -> Result<(Tensor, UnshardGuard)> {
        self.unshard(comm, acct);
        match std::mem::replace(&mut self.params, ParamState::Sharded) {
            ParamState::Unsharding { work, guard } => {
                let flat = collectives::wait_gathered(work)?;
                Ok((self.unpacked(flat)?, guard))
            }
            other => {
                self.params = other;
                Err(Error::Internal(format!(
                    "unit {}: gathered twice in one eval call (a schedule bug)",
                    self.name
                )))
            }
        }
    }

    /// The step's parameter tensors (layout order), when the step has created them.
    pub(crate) fn param_tensors(&self) -> Option<&[Tensor]> {
        self.binding.tensors()
    }

    /// True when `t` shares storage with one of the step's parameter tensors.
    pub(crate) fn is_view_of_param(&self, t: &Tensor) -> bool {
        self.binding
            .tensors()
            .unwrap_or(&[])
            .iter()
            .any(|p| super::storage::same_storage(p, t))
    }

    /// A training call of this group started (its backward will come).
    pub(crate) fn pre_forward(&mut self) {
        self.pending_calls += 1;
    }

    /// Copy-in of one call's gradients: the gradients of the step's variables in `grads`, added
    /// into the step's flat gradient. Frozen twins have none.
    ///
    /// Errors: the flatten's or the add's.
    pub(crate) fn add_call_grads(
        &mut self,
        grads: Option<&candle_core::backprop::GradStore>,
    ) -> Result<()> {
        if self.frozen {
            return Ok(());
        }
        let vars = self.binding.tensors().unwrap_or(&[]);
        if let Some((fg, present)) = collectives::flatten_grads(&self.flat, grads, vars)? {
            self.note_present(&present);
            match &self.grad_acc {
                Some(acc) => crate::ops::add_(acc, &fg)?,
                None => self.grad_acc = Some(fg),
            }
        }
        Ok(())
    }

    /// One call's backward is done. Returns whether it was the group's last pending call of the
    /// step — then the step's variables are dropped (their memory returns), the group is
    /// `Sharded`, and the step's flat gradient comes with it for reduction (`None` for frozen
    /// twins and groups without parameters); otherwise the caller decides whether to reshard.
    pub(crate) fn post_backward(&mut self) -> (bool, Option<Tensor>) {
        self.pending_calls = self.pending_calls.saturating_sub(1);
        if self.pending_calls > 0 {
            return (false, None);
        }
        self.end_step_observation();
        self.binding = Binding::Unbound;
        self.secondary = None;
        self.params = ParamState::Sharded;
        (true, self.grad_acc.take())
    }

    /// The step's flat gradient of a group whose calls did not all run their backward (their
    /// outputs did not reach the loss): zeros with absent flags where nothing ran, so that every
    /// rank issues the same reductions. Drops the step state.
    ///
    /// Errors: the flatten's.
    pub(crate) fn finish_unreached(&mut self) -> Result<Option<Tensor>> {
        if self.pending_calls == 0 {
            return Ok(None);
        }
        let grad = match self.grad_acc.take() {
            Some(g) => Some(g),
            None if !self.frozen => {
                collectives::flatten_grads(&self.flat, None, &[])?.map(|(g, present)| {
                    self.note_present(&present);
                    g
                })
            }
            None => None,
        };
        self.finalize();
        Ok(if self.frozen { None } else { grad })
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

    /// Adds one reduced gradient shard into the group's gradient shard (see
    /// [`accumulate_grad_of`]).
    ///
    /// Errors: as [`accumulate_grad_of`].
    pub(crate) fn accumulate_reduced(&mut self, reduced: Tensor, present: &[bool]) -> Result<()> {
        accumulate_grad_of(&mut self.flat, reduced, present)
    }
}

/// Adds `reduced` (one reduced gradient shard: `shard_numel` elements of f32, bf16 or f16, any
/// shape, on the shard's device) into `flat`'s gradient shard, for a gradient that holds only
/// the parameters flagged in `present` (layout order; the others' elements are zeros standing
/// in for "no gradient"). Without a gradient, `reduced` (widened to f32 if needed, made
/// contiguous if needed) becomes it; otherwise it is added in place ([`crate::ops::add_`],
/// widening on the fly, no allocation). The presence flags are OR-ed into
/// [`FlatParameter::grad_present`].
///
/// Errors (nothing changed): `present` of the wrong length; wrong element count, device or
/// dtype (naming expected and found).
pub(crate) fn accumulate_grad_of(
    flat: &mut FlatParameter,
    reduced: Tensor,
    present: &[bool],
) -> Result<()> {
    let reduced = flat.check_reduced_grad(reduced, present)?;
    match flat.grad() {
        Some(g) => crate::ops::add_(g, &reduced)?,
        None => {
            let g = reduced.to_dtype(DType::F32)?;
            flat.put_grad(if g.is_contiguous() {
                g
            } else {
                g.contiguous()?
            });
        }
    }
    flat.add_grad_present(present);
    Ok(())
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Shape};

    use super::*;
    use crate::flat_param::FlatParamLayout;

    /// One parameter of 3 elements over 2 ranks, rank 1's shard: `[12, 0]` (one padding zero).
    fn small() -> FlatParameter {
        let l = FlatParamLayout::new(&[("p0".to_string(), Shape::from(3))], 2).unwrap();
        FlatParameter::from_fn(l, 1, &Device::Cpu, |_, range, out| {
            for (o, i) in out.iter_mut().zip(range) {
                *o = 10.0 + i as f32;
            }
            Ok(())
        })
        .unwrap()
    }

    fn vec1(t: &Tensor) -> Vec<f32> {
        t.to_vec1::<f32>().unwrap()
    }

    fn acc(f: &mut FlatParameter, t: Tensor) -> Result<()> {
        accumulate_grad_of(f, t, &[true])
    }

    #[test]
    fn gradients_accumulate_in_place_and_widen_half_precision() {
        let mut f = small();
        assert_eq!(vec1(f.shard()), [12.0, 0.0]);
        assert_eq!(f.sharded_bytes(), 8);
        acc(&mut f, Tensor::new(&[0.5f32, -1.0], &Device::Cpu).unwrap()).unwrap();
        assert_eq!(f.sharded_bytes(), 16);
        assert_eq!(f.grad_present(), [true]);
        // Hold the gradient tensor: later accumulations write into its storage (no new tensor).
        let held = f.grad().unwrap().clone();
        acc(&mut f, Tensor::new(&[0.25f32, 3.0], &Device::Cpu).unwrap()).unwrap();
        assert_eq!(vec1(&held), [0.75, 2.0]);
        // bf16 and f16 are widened exactly (0.1 in bf16 is 205 / 2048).
        let bf = Tensor::new(&[0.1f32, 1.0], &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        acc(&mut f, bf).unwrap();
        assert_eq!(vec1(&held), [0.75 + (205.0 / 2048.0), 3.0]);
        let h = Tensor::new(&[1.0f32, 0.5], &Device::Cpu)
            .unwrap()
            .to_dtype(DType::F16)
            .unwrap();
        acc(&mut f, h).unwrap();
        assert_eq!(vec1(f.grad().unwrap()), [1.75 + (205.0 / 2048.0), 3.5]);
        f.clear_grad();
        assert!(f.grad().is_none());
        assert_eq!(f.sharded_bytes(), 8);
        // A first gradient in bf16 becomes an f32 gradient.
        let bf = Tensor::new(&[2.0f32, 4.0], &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        acc(&mut f, bf).unwrap();
        assert_eq!(f.grad().unwrap().dtype(), DType::F32);
        assert_eq!(vec1(f.grad().unwrap()), [2.0, 4.0]);
    }

    #[test]
    fn refused_gradients_name_expected_and_found_and_change_nothing() {
        let mut f = small();
        let e = acc(&mut f, Tensor::zeros(5, DType::F32, &Device::Cpu).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("expected 2 elements") && e.contains("found 5"),
            "{e}"
        );
        let e = acc(&mut f, Tensor::zeros(2, DType::U32, &Device::Cpu).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("U32"), "{e}");
        let e = accumulate_grad_of(
            &mut f,
            Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap(),
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("presence flags"), "{e}");
        assert_eq!(vec1(f.shard()), [12.0, 0.0]);
        assert!(f.grad().is_none());
        assert_eq!(f.grad_present(), [false]);
    }
}
