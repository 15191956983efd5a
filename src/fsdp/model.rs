//! [`FsdpModel`]: the struct, its accessors and setters, and the context helpers of the step's
//! modules (spans, NVTX ranges, error context). The step itself lives beside it, one concept a
//! file: [`super::build`] (construction), [`super::forward`] (the forwards),
//! [`super::backward`] (the backward), `super::step` (the training state), `super::scheduler`
//! (prefetch decisions), `super::agreement` (rank agreement).

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::Tensor;

use super::collectives::CommContext;
use super::config::FsdpConfig;
use super::fingerprint::{FingerprintPhase, Recorder};
use super::memory::{MemoryAccount, MemoryStats};
use super::param_group::ParamGroup;
use super::scheduler::Scheduler;
use super::spec::Member;
use super::step::{CallRecord, Step, TrainingState};
use crate::base::BaseIdentity;
use crate::comm::{CommObserver, ProcessGroup};
use crate::error::{Error, Phase, Result};
use crate::trace::{Lane, SpanKind, Tracer};

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
    pub(super) units: Vec<ParamGroup>,
    /// The callable units, in build order.
    pub(super) members: Vec<Member>,
    by_name: HashMap<String, usize>,
    pub(super) mem: MemoryAccount,
    pub(super) scheduler: Scheduler,
    pub(super) requires_gradient_sync: bool,
    tracer: Option<Arc<Tracer>>,
    /// Training forwards started (the step number of errors and traces is `steps_started - 1`
    /// during a step).
    pub(super) steps_started: u64,
    /// Where the model is in a step (`super::step`).
    pub(super) state: TrainingState,
    /// The frozen base the model was built from ([`FsdpModel::set_base`]).
    base: Option<Arc<BaseIdentity>>,
    /// Run fingerprints ([`FsdpConfig::fingerprint`]).
    pub(super) fingerprint: Option<Recorder>,
}

impl FsdpModel {
    /// A model of built `units` and `members`, idle, with no step started.
    pub(super) fn assemble(
        pg: Arc<dyn ProcessGroup>,
        config: FsdpConfig,
        comm: CommContext,
        units: Vec<ParamGroup>,
        members: Vec<Member>,
    ) -> Self {
        let by_name = members
            .iter()
            .enumerate()
            .map(|(i, m)| (m.spec.name.clone(), i))
            .collect();
        FsdpModel {
            scheduler: Scheduler::new(&config),
            comm,
            pg,
            config,
            units,
            members,
            by_name,
            mem: MemoryAccount::default(),
            requires_gradient_sync: true,
            base: None,
            tracer: None,
            steps_started: 0,
            state: TrainingState::Idle,
            fingerprint: None,
        }
    }

    /// Records the frozen base the model's frozen parameters were read from (what
    /// [`crate::hf::decoder::build_from_hf_with`] does for a LoRA run). From then on
    /// sharded checkpoints are adapter-only: units that are frozen and were never stepped are
    /// not stored, the base's identity is (decision 75), and loading one checks the model's
    /// base against it. `None` stores every unit again.
    pub fn set_base(&mut self, base: Option<BaseIdentity>) {
        self.base = base.map(Arc::new);
    }

    /// The frozen base recorded by [`FsdpModel::set_base`].
    pub fn base(&self) -> Option<&BaseIdentity> {
        self.base.as_deref()
    }

    /// The process group (the whole world: clipping, the grad scaler and checkpoints reduce
    /// over it).
    pub fn process_group(&self) -> &Arc<dyn ProcessGroup> {
        &self.pg
    }

    /// The group the parameters are sharded over: the world, or under the hybrid strategies
    /// this rank's shard group (its shards' `layout.world_size` ranks; its rank there is the
    /// shards' `shard_index`).
    pub fn shard_group(&self) -> &Arc<dyn ProcessGroup> {
        &self.comm.mesh.shard
    }

    /// Under the hybrid strategies with more than one replica, the group of the ranks that hold
    /// the same shards as this one (one per shard group); `None` otherwise.
    pub fn replica_group(&self) -> Option<&Arc<dyn ProcessGroup>> {
        self.comm.mesh.replica.as_ref()
    }

    /// Calls and bytes this rank issued, summed over every group the model uses: the world
    /// group ([`FsdpModel::process_group`], which also carries the caller's own collectives) and,
    /// when it has them, its shard, replica and secondary (partial reshard) groups. See
    /// [`ProcessGroup::stats`].
    pub fn comm_stats(&self) -> crate::comm::CommStatsSnapshot {
        let mesh = &self.comm.mesh;
        let mut groups: Vec<&Arc<dyn ProcessGroup>> = vec![&self.pg];
        for g in [
            Some(&mesh.shard),
            mesh.replica.as_ref(),
            mesh.secondary.as_ref(),
        ]
        .into_iter()
        .flatten()
        {
            if !groups.iter().any(|h| Arc::ptr_eq(h, g)) {
                groups.push(g);
            }
        }
        groups.iter().fold(
            Default::default(),
            |acc: crate::comm::CommStatsSnapshot, g| acc.zip_with(g.stats(), u64::wrapping_add),
        )
    }

    /// Which replica (shard group) this rank belongs to: `world rank / shard size` under the
    /// hybrid strategies, 0 otherwise. Replica 0 alone writes sharded checkpoints and counts in
    /// gradient norms.
    pub fn replica_index(&self) -> usize {
        self.comm.mesh.replica_index
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
        m.unsharded_grad_bytes = self
            .units
            .iter()
            .map(ParamGroup::unsharded_grad_bytes)
            .sum();
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
            .map(|u| {
                super::budget::GroupSize::of(
                    u.flat().layout(),
                    u.policy(),
                    u.is_frozen(),
                    u.flat()
                        .packed()
                        .map_or(crate::quant::BaseDType::F32, |p| p.format),
                )
            })
            .collect();
        let budget = super::MemoryBudget {
            max_bytes_per_rank: usize::MAX,
            optimizer_bytes_per_element,
            activation_bytes,
        };
        super::budget::plan(&groups, &self.config, self.comm.mesh.shard_size(), &budget)
    }

    /// Resets the peak counters to the current values.
    pub fn reset_peak(&mut self) {
        self.mem.reset_peak();
    }

    /// Drops every gradient shard and any unsynchronised accumulated gradient (PyTorch's
    /// `zero_grad(set_to_none=True)`).
    pub fn zero_grad(&mut self) {
        self.units.iter_mut().for_each(ParamGroup::zero_grad);
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
        let observer = tracer.clone().map(|t| t as Arc<dyn CommObserver>);
        self.pg.set_observer(observer.clone());
        if self.comm.mesh.replica.is_some() {
            self.comm.mesh.shard.set_observer(observer.clone());
        }
        for g in [&self.comm.mesh.replica, &self.comm.mesh.secondary]
            .into_iter()
            .flatten()
        {
            g.set_observer(observer.clone());
        }
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

    /// Closes the current step of the run fingerprint ([`FsdpConfig::fingerprint`]): records
    /// every trainable unit's f32 master shard, then brings every rank's records of the step to
    /// rank 0, which writes them under the step's number (0 for the first step after the build,
    /// or the step [`FsdpModel::set_fingerprint_step`] set) and counts on. The crate's
    /// optimizers call it after their update and [`crate::grad_scaler::ShardedGradScaler::step`] when it
    /// skips a step; an optimizer of one's own calls it the same way, once per step. Nothing
    /// without a fingerprint file.
    ///
    /// A collective over the whole world (two all-reduces of integers): every rank calls it.
    ///
    /// Errors: a failed host copy of a GPU shard; the collectives'; rank 0's write (naming the
    /// file).
    pub fn fingerprint_step(&mut self) -> Result<()> {
        let Some(mut rec) = self.fingerprint.take() else {
            return Ok(());
        };
        let result = (|| {
            for u in self.shards() {
                if !u.frozen {
                    rec.tensor(u.unit_index, FingerprintPhase::Shard, u.param)?;
                }
            }
            let names: Vec<&str> = self.units.iter().map(|u| u.name()).collect();
            rec.finish_step(self.pg.as_ref(), &names)
        })();
        self.fingerprint = Some(rec);
        result.map_err(|e| self.at(e, None, Phase::Optimizer))
    }

    /// Sets the number the run fingerprint gives the next step it closes: a run resumed from a
    /// checkpoint continues at that checkpoint's `TrainState::step`
    /// ([`crate::checkpoint::load_sharded`] calls it), so its records line up with the
    /// uninterrupted run's. Nothing without a fingerprint file.
    pub fn set_fingerprint_step(&mut self, step: u64) {
        if let Some(rec) = &mut self.fingerprint {
            rec.set_step(step);
        }
    }

    /// Records `t` as unit `g`'s `phase` in the run fingerprint (nothing without one).
    pub(super) fn fingerprint_tensor(
        &mut self,
        g: usize,
        phase: FingerprintPhase,
        t: &Tensor,
    ) -> Result<()> {
        match &mut self.fingerprint {
            Some(rec) => rec.tensor(g, phase, t),
            None => Ok(()),
        }
    }

    /// A compute-lane span named lazily (`name` runs only when tracing is on or with the `nvtx`
    /// feature, where it is also an NVTX range for `nsys`).
    pub(super) fn span(
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
    pub(super) fn nvtx_range(&self, name: impl FnOnce() -> String) -> crate::trace::NvtxRange {
        crate::trace::NvtxRange::new(name)
    }

    /// A zero-length issue marker on the compute lane (and an NVTX marker).
    pub(super) fn mark_issue(&self, name: impl FnOnce() -> String) {
        if let Some(t) = self.tracer.as_ref().filter(|t| t.is_enabled()) {
            let name = name();
            crate::trace::nvtx_mark(|| name.clone());
            t.instant(Lane::Compute, SpanKind::Issue, name);
        } else {
            crate::trace::nvtx_mark(name);
        }
    }

    /// Runs `f` as one phase of work on this model beside the step's schedule (the optimizer
    /// step, gradient clipping, the grad scaler): as a compute span named `name` of the phase's
    /// kind when `name` is given and tracing is on (the optimizer's is
    /// `"FSDP::optimizer_step"`), and with an error of `f` that carries no place yet wrapped
    /// with `phase` and the current step ([`Error::InStep`], unit none); an error that already
    /// names its place is returned as it is.
    ///
    /// Errors: whatever `f` returns.
    pub fn in_phase<T>(
        &self,
        phase: Phase,
        name: Option<&str>,
        f: impl FnOnce(&Self) -> Result<T>,
    ) -> Result<T> {
        let _span = name.and_then(|n| self.span(span_kind(phase), || n.to_string()));
        f(self).map_err(|e| match e {
            e @ Error::InStep { .. } => e,
            e => self.at(e, None, phase),
        })
    }

    /// Wraps an error with unit (group) `k`, `phase` and the current step ([`Error::InStep`]).
    pub(super) fn at(&self, e: Error, k: Option<usize>, phase: Phase) -> Error {
        e.in_step(k.map(|k| self.units[k].name()), phase, self.step())
    }

    /// Wraps an error with the unit called `name`, `phase` and the current step.
    pub(super) fn at_name(&self, e: Error, name: &str, phase: Phase) -> Error {
        e.in_step(Some(name), phase, self.step())
    }

    /// The index of the unit called `name`.
    pub(super) fn member_index(&self, name: &str) -> Result<usize> {
        self.by_name.get(name).copied().ok_or_else(|| {
            let names: Vec<&str> = self.unit_names().collect();
            Error::missing(
                format!("unit named {name:?}"),
                format!("the model's units are: {}", names.join(", ")),
            )
        })
    }
}

/// The compute-span kind of work done in `phase` outside the schedule.
fn span_kind(phase: Phase) -> SpanKind {
    match phase {
        Phase::Forward | Phase::Eval => SpanKind::Forward,
        Phase::Backward => SpanKind::Backward,
        _ => SpanKind::OptimizerStep,
    }
}

/// The step's state transitions (`super::step`'s `TrainingState`).
impl FsdpModel {
    /// Drops whatever a previous step left (saved graphs, gathers in flight, reductions):
    /// afterwards the model is `Idle`, every group is sharded and idle, and the memory guards
    /// are released.
    pub(super) fn release_step(&mut self) {
        if let Some(s) = std::mem::replace(&mut self.state, TrainingState::Idle).step() {
            s.hook.end();
        }
        self.units.iter_mut().for_each(ParamGroup::finalize);
        drop(self.scheduler.take_reductions());
    }

    /// Drops what the last training forward kept for its backward (to run another training
    /// forward without back-propagating the previous one).
    pub fn discard_forward(&mut self) {
        self.release_step();
    }

    /// Transition `Idle → Forward` (`train`) or `Idle → Eval`: a new step with no call yet.
    pub(super) fn begin_step(&mut self, train: bool) -> Result<()> {
        let step = Step::new(&self.config.device)?;
        self.state = if train {
            TrainingState::Forward(step)
        } else {
            TrainingState::Eval(step)
        };
        self.scheduler.begin_forward();
        Ok(())
    }

    /// Transition `Forward → Backward`.
    pub(super) fn begin_backward(&mut self) {
        self.state = match std::mem::replace(&mut self.state, TrainingState::Idle) {
            TrainingState::Forward(s) => TrainingState::Backward(s),
            other => other,
        };
    }

    /// The calls of the step in progress (none when `Idle`).
    pub(super) fn step_calls(&self) -> &[CallRecord] {
        self.state.step().map_or(&[], |s| &s.calls)
    }

    /// The step in progress; only called where one is.
    pub(super) fn step_mut(&mut self) -> &mut Step {
        self.state.step_mut().expect("a step in progress")
    }

    /// Wraps an error of a forward closure that carries no place yet (the caller's own
    /// operations) with the phase and step.
    pub(super) fn at_phase(&self, e: Error, phase: Phase) -> Error {
        e.in_step(None, phase, self.step())
    }
}
