//! [`FsdpModel`]: construction and the step's schedules. `forward`, `forward_eval` and `backward`
//! only call unit transitions (`unshard`, `wait_for_unshard`, `reshard`, `pre_backward`,
//! `post_backward`) and ask the [`Scheduler`] what to prefetch.

use std::sync::Arc;

use candle_core::{DType, Tensor, Var};
use candle_nn::ModuleT;

use super::collectives::{self, CommContext};
use super::config::{BackwardPrefetch, FsdpConfig, ShardingStrategy};
use super::memory::{MemoryAccount, MemoryStats};
use super::scheduler::Scheduler;
use super::unit_state::{ForwardMode, FsdpUnit, TrainingState};
use crate::comm::{CommObserver, ProcessGroup, ProcessGroupExt, ReduceOp};
use crate::error::{Error, Phase, Result};
use crate::flat_param::{FlatParamLayout, FlatParameter};
use crate::init::init_values;
use crate::mixed_precision::MixedPrecision;
use crate::trace::{Lane, SpanGuard, SpanKind, Tracer};
use crate::unit::{record_unit, RecordedParam, UnitSpec};

/// A model whose units' parameters are sharded over a process group.
///
/// Every method that communicates (`forward`, `forward_eval`, `backward`, `gather_full_params`)
/// is a collective: all ranks must call it, in the same order. Errors raised during a step name
/// the unit, the phase and the step ([`Error::InStep`]).
pub struct FsdpModel {
    pub(super) pg: Arc<dyn ProcessGroup>,
    /// The comm streams of this model's all-gathers and reductions.
    pub(super) comm: CommContext,
    pub(super) config: FsdpConfig,
    pub(crate) units: Vec<FsdpUnit>,
    pub(super) mem: MemoryAccount,
    scheduler: Scheduler,
    requires_gradient_sync: bool,
    tracer: Option<Arc<Tracer>>,
    /// Training forwards started (the step number of errors and traces is `steps_started - 1`
    /// during a step).
    steps_started: u64,
}

/// Builder of an [`FsdpModel`]: add units in forward order, then [`FsdpModelBuilder::build`].
pub struct FsdpModelBuilder {
    pg: Arc<dyn ProcessGroup>,
    config: FsdpConfig,
    specs: Vec<UnitSpec>,
}

impl FsdpModelBuilder {
    /// Adds a unit built by a candle-nn style constructor, e.g.
    /// `.unit("fc1", |vb| candle_nn::linear(784, 128, vb))`. Its parameters are named
    /// `<name>.<path>`. Units run in the order they are added, each taking the previous one's
    /// output.
    pub fn unit<M, F>(mut self, name: impl Into<String>, ctor: F) -> Self
    where
        M: ModuleT + 'static,
        F: Fn(candle_nn::VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
    {
        self.specs.push(UnitSpec::new(name, ctor));
        self
    }

    /// Adds an already wrapped unit.
    pub fn unit_spec(mut self, spec: UnitSpec) -> Self {
        self.specs.push(spec);
        self
    }

    /// Adds several wrapped units, in order (e.g. `models::mnist_mlp`).
    pub fn units(mut self, specs: impl IntoIterator<Item = UnitSpec>) -> Self {
        self.specs.extend(specs);
        self
    }

    /// Records every unit, lays out and initialises its shard, one unit at a time (the peak is
    /// one unit's largest parameter, never the model).
    ///
    /// Errors: no unit, duplicate unit names, a constructor that fails.
    pub fn build(self) -> Result<FsdpModel> {
        let FsdpModelBuilder { pg, config, specs } = self;
        let seed = config.seed;
        FsdpModel::build_with(pg, config, specs, |p, range, out| {
            let values = init_values(&p.name, &p.shape, p.hint, seed);
            out.copy_from_slice(&values[range]);
            Ok(())
        })
    }
}

impl FsdpModel {
    /// Starts a builder for a model on `pg` with `config`.
    pub fn builder(pg: Arc<dyn ProcessGroup>, config: FsdpConfig) -> FsdpModelBuilder {
        FsdpModelBuilder {
            pg,
            config,
            specs: Vec::new(),
        }
    }

    /// Builds the model, filling each shard piece with `fill(param, range_in_param, out)`.
    ///
    /// A collective: it creates the model's comm streams ("all_gather", "reduce_scatter") on the
    /// group, so every rank builds its models in the same order.
    ///
    /// Errors: no unit, two units of one name, two tensors of one name, a constructor that
    /// fails, an invalid mixed-precision policy, a stream that cannot be created.
    pub fn build_with(
        pg: Arc<dyn ProcessGroup>,
        config: FsdpConfig,
        specs: Vec<UnitSpec>,
        mut fill: impl FnMut(&RecordedParam, std::ops::Range<usize>, &mut [f32]) -> Result<()>,
    ) -> Result<FsdpModel> {
        if specs.is_empty() {
            return Err(Error::InvalidArgument(
                "a model needs at least one unit".into(),
            ));
        }
        let (shard_world, shard_index) = match config.sharding_strategy {
            ShardingStrategy::NoShard => (1, 0),
            _ => (pg.world_size(), pg.rank()),
        };
        let mut units: Vec<FsdpUnit> = Vec::with_capacity(specs.len());
        for spec in specs {
            if units.iter().any(|u| u.name() == spec.name) {
                return Err(Error::InvalidArgument(format!(
                    "two units are named {}",
                    spec.name
                )));
            }
            let all_recorded = record_unit(&spec, DType::F32, &config.device)?;
            for p in &all_recorded {
                let clash = units.iter().find(|u| {
                    u.recorded().iter().any(|q| q.name == p.name)
                        || u.buffers().iter().any(|(b, _)| b == &p.name)
                });
                if let Some(other) = clash {
                    return Err(Error::InvalidArgument(format!(
                        "units {} and {} both create a tensor named {}: full names must be unique \
                         (checkpoints and state dicts are keyed by them)",
                        other.name(),
                        spec.name,
                        p.name
                    )));
                }
            }
            let (buffer_recs, recorded): (Vec<_>, Vec<_>) =
                all_recorded.into_iter().partition(|p| {
                    config
                        .buffer_suffixes
                        .iter()
                        .any(|s| p.name.rsplit('.').next() == Some(s.as_str()))
                });
            let policy = match spec.mixed_precision {
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
            let named: Vec<_> = recorded
                .iter()
                .map(|p| (p.name.clone(), p.shape.clone()))
                .collect();
            let layout = FlatParamLayout::new(&named, shard_world)?;
            let flat =
                FlatParameter::from_fn(layout, shard_index, &config.device, |i, range, out| {
                    fill(&recorded[i], range, out)
                })?;
            units.push(FsdpUnit::new(spec, recorded, flat, buffers, policy));
        }
        agree_on_model(pg.as_ref(), &units, config.sharding_strategy)?;
        let comm = CommContext::new(pg.as_ref())?;
        Ok(FsdpModel {
            scheduler: Scheduler::new(&config),
            comm,
            pg,
            config,
            units,
            mem: MemoryAccount::default(),
            requires_gradient_sync: true,
            tracer: None,
            steps_started: 0,
        })
    }

    /// The process group.
    pub fn process_group(&self) -> &Arc<dyn ProcessGroup> {
        &self.pg
    }

    /// The configuration.
    pub fn config(&self) -> &FsdpConfig {
        &self.config
    }

    /// Memory counters of this rank.
    pub fn memory_stats(&self) -> MemoryStats {
        let mut m = self.mem.snapshot();
        m.sharded_bytes = self.units.iter().map(|u| u.flat().sharded_bytes()).sum();
        m.unsharded_grad_bytes = self.units.iter().map(FsdpUnit::unsharded_grad_bytes).sum();
        m
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

    /// A compute-lane span named lazily (`name` runs only when tracing is on).
    pub(crate) fn span(&self, kind: SpanKind, name: impl FnOnce() -> String) -> Option<SpanGuard> {
        self.tracer
            .as_ref()
            .filter(|t| t.is_enabled())
            .and_then(|t| t.span(Lane::Compute, kind, name()))
    }

    /// A zero-length issue marker on the compute lane.
    fn mark_issue(&self, name: impl FnOnce() -> String) {
        if let Some(t) = self.tracer.as_ref().filter(|t| t.is_enabled()) {
            t.instant(Lane::Compute, SpanKind::Issue, name());
        }
    }

    /// Wraps an error with unit `k`, `phase` and the current step ([`Error::InStep`]).
    pub(crate) fn at(&self, e: Error, k: Option<usize>, phase: Phase) -> Error {
        e.in_step(k.map(|k| self.units[k].name()), phase, self.step())
    }

    /// Unshards unit `k` (issues its all-gather) and marks the issue in the trace.
    fn unshard(&mut self, k: usize) {
        if self.units[k].gathers() && self.units[k].is_sharded() {
            self.mark_issue(|| format!("FSDP::all_gather {}", self.units[k].name()));
        }
        self.units[k].unshard(self.pg.as_ref(), &self.comm.all_gather, &self.mem);
    }

    /// Waits for unit `k`'s all-gather (issuing it if needed), recording the wait as exposed
    /// communication, and returns the gathered flat buffer.
    fn wait_for_unshard(&mut self, k: usize) -> Result<Tensor> {
        self.unshard(k);
        let _w = self.units[k].gathers().then(|| {
            self.span(SpanKind::Wait, || {
                format!("FSDP::wait all_gather {}", self.units[k].name())
            })
        });
        self.units[k].wait_for_unshard(self.pg.as_ref(), &self.comm.all_gather, &self.mem)
    }

    /// How unit `k`'s forward keeps what its backward needs (see `unit_state`).
    fn forward_mode(&self, k: usize) -> ForwardMode {
        let spec = self.units[k].spec();
        let last = k + 1 == self.units.len();
        ForwardMode {
            // The last unit's output feeds the caller's loss, whose backward must reach the
            // unit's graph: it is never checkpointed (nor resharded, its backward comes next).
            checkpoint: spec.activation_checkpointing && !last,
            reshard: self.config.sharding_strategy == ShardingStrategy::FullShard
                && !last
                && spec.reshard_after_forward,
        }
    }

    /// Drops whatever a previous step left (saved graphs, gathers in flight, reductions):
    /// afterwards every unit is sharded and idle, and the memory guards are released.
    fn release_step(&mut self) {
        self.units.iter_mut().for_each(FsdpUnit::release);
        drop(self.scheduler.take_reductions());
    }

    /// True when a training forward ran and its backward has not.
    fn forward_pending(&self) -> bool {
        self.units
            .iter()
            .all(|u| u.training_state() == TrainingState::Forward)
    }

    /// Drops what the last training forward kept for its backward (to run another training
    /// forward without back-propagating the previous one).
    pub fn discard_forward(&mut self) {
        self.release_step();
    }

    /// Sharded training forward (a collective). Returns the last unit's output, attached to the
    /// autograd graph of the last unit so that a loss computed from it can be passed to
    /// [`FsdpModel::backward`]. The output is in the last unit's `param_dtype`.
    ///
    /// `x`: the first unit's input, any shape the first unit accepts.
    ///
    /// Under FULL_SHARD each unit's parameters are freed right after its forward (their storage
    /// is emptied in place under the live autograd graph) and refilled by an all-gather just
    /// before its backward: no unit is recomputed, unless it asks for activation checkpointing
    /// ([`UnitSpec::with_activation_checkpointing`]).
    ///
    /// Errors ([`Error::InStep`] with phase forward, the unit and the step): the previous
    /// training forward was not back-propagated (call [`FsdpModel::backward`] or
    /// [`FsdpModel::discard_forward`] first); a unit's error; any collective error.
    pub fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
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
        let result = self.forward_units(x);
        if result.is_err() {
            self.release_step();
        }
        result
    }

    fn forward_units(&mut self, x: &Tensor) -> Result<Tensor> {
        let n = self.units.len();
        let mut h = x.clone();
        for k in 0..n {
            let flat = self
                .wait_for_unshard(k)
                .map_err(|e| self.at(e, Some(k), Phase::Forward))?;
            // Forward prefetch: unit k+1's all-gather runs while unit k computes.
            if let Some(j) = self.scheduler.forward_prefetch(&self.units, k, &self.mem) {
                self.unshard(j);
            }
            let mode = self.forward_mode(k);
            let _span = self.span(SpanKind::Forward, || {
                format!("FSDP::forward {}", self.units[k].name())
            });
            let device = self.config.device.clone();
            h = self.units[k]
                .forward(&h, flat, mode, k == 0, &device)
                .map_err(|e| self.at(e, Some(k), Phase::Forward))?;
        }
        Ok(h)
    }

    /// Sharded inference forward (a collective): every unit gathered, run with `train = false`
    /// and resharded; nothing kept for backward.
    ///
    /// Errors ([`Error::InStep`], phase eval): a unit's error; any collective error.
    pub fn forward_eval(&mut self, x: &Tensor) -> Result<Tensor> {
        if self.forward_pending() {
            return Err(Error::InvalidArgument(
                "forward_eval called while a training forward awaits its backward: it would \
                 drop that forward's saved state; call backward first, or discard_forward() \
                 to drop it"
                    .into(),
            ));
        }
        self.release_step();
        let n = self.units.len();
        let mut h = x.detach();
        for k in 0..n {
            let result = (|| {
                let flat = self.wait_for_unshard(k)?;
                if let Some(j) = self.scheduler.forward_prefetch(&self.units, k, &self.mem) {
                    self.unshard(j);
                }
                let _span = self.span(SpanKind::Forward, || {
                    format!("FSDP::forward_eval {}", self.units[k].name())
                });
                let out = self.units[k].forward_eval(h.clone(), &flat, &self.config.device)?;
                drop(flat);
                self.units[k].reshard()?;
                Ok(out)
            })();
            match result {
                Ok(out) => h = out,
                Err(e) => {
                    self.release_step();
                    return Err(self.at(e, Some(k), Phase::Eval));
                }
            }
        }
        Ok(h)
    }

    /// Sharded backward (a collective) of `loss`, a scalar computed from the output of the last
    /// [`FsdpModel::forward`]. On return every unit's gradient shard holds the gradient averaged
    /// over ranks (added to what it held, so calling forward/backward several times accumulates).
    ///
    /// For each unit from the last: `pre_backward` (refill its freed parameters from an
    /// all-gather issued one unit ahead — backward prefetch — or recompute a checkpointed unit),
    /// its gradients (`loss.backward()` for the last unit, `sum(output · grad_output)` for the
    /// others), `post_backward` (flat gradient, parameters freed), then its reduce-scatter is
    /// issued on the reduce-scatter stream without waiting. All reductions are waited for at the
    /// end and added into the f32 gradient shards.
    ///
    /// Errors ([`Error::InStep`], phase backward): no forward to back-propagate; any collective
    /// error.
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        if self
            .units
            .iter()
            .any(|u| u.training_state() != TrainingState::Forward)
        {
            return Err(Error::InvalidArgument(
                "backward called without a preceding training forward".into(),
            ));
        }
        let result = self.backward_units(loss);
        if result.is_err() {
            self.release_step();
        }
        result
    }

    fn backward_units(&mut self, loss: &Tensor) -> Result<()> {
        let n = self.units.len();
        // The first gather of backward is issued before the loss's own backward (any prefetch
        // mode but None), so that it runs during it.
        // (`backward_prefetch` answers None under `BackwardPrefetch::None`.)
        let mode = self.scheduler.backward_mode();
        if let Some(j) = self
            .scheduler
            .backward_prefetch(&self.units, n, mode, &self.mem)
        {
            self.unshard(j);
        }
        let mut grad_out: Option<Tensor> = None;
        for k in (0..n).rev() {
            let phase = Phase::Backward;
            let grads = self
                .backward_unit(k, loss, grad_out.take())
                .map_err(|e| self.at(e, Some(k), phase))?;
            let (flat_grad, grad_in) = self.units[k]
                .post_backward(grads.as_ref())
                .map_err(|e| self.at(e, Some(k), phase))?;
            drop(grads);
            grad_out = grad_in;
            if let Some(j) = self.scheduler.backward_prefetch(
                &self.units,
                k,
                BackwardPrefetch::BackwardPost,
                &self.mem,
            ) {
                self.unshard(j);
            }
            if let Some(fg) = flat_grad {
                let sync = self.requires_gradient_sync;
                let merged = self.units[k]
                    .merge_unsynced(fg, sync)
                    .map_err(|e| self.at(e, Some(k), phase))?;
                if let Some(fg) = merged {
                    self.mark_issue(|| format!("FSDP::reduce_scatter {}", self.units[k].name()));
                    let u = &self.units[k];
                    let work = collectives::reduce_grads(
                        self.pg.as_ref(),
                        &self.comm.reduce_scatter,
                        u.flat().layout(),
                        fg,
                        u.policy().reduce_dtype,
                    );
                    self.scheduler.push_reduction(k, work);
                }
            }
        }
        for (k, work) in self.scheduler.take_reductions() {
            let _w = self.span(SpanKind::Wait, || {
                format!("FSDP::wait reduce_scatter {}", self.units[k].name())
            });
            // The reduced chunk carries each parameter's presence flag, summed over the ranks
            // (`collectives::flatten_grads`): a parameter has a gradient when some rank
            // produced one.
            let result = collectives::wait_reduced(work).and_then(|reduced| {
                let (grad, present) =
                    collectives::split_reduced(self.units[k].flat().layout(), reduced)?;
                self.units[k].flat_mut().accumulate_grad_of(grad, &present)
            });
            result.map_err(|e| self.at(e, Some(k), Phase::Backward))?;
        }
        Ok(())
    }

    /// `pre_backward` of unit `k`, then its gradients: `loss.backward()` for the last unit, the
    /// surrogate `sum(output · grad_out)` for the others. `None` when there is nothing to
    /// differentiate.
    fn backward_unit(
        &mut self,
        k: usize,
        loss: &Tensor,
        grad_out: Option<Tensor>,
    ) -> Result<Option<candle_core::backprop::GradStore>> {
        let n = self.units.len();
        let gathered = if self.units[k].needs_gather_for_backward() {
            Some(self.wait_for_unshard(k)?)
        } else {
            None
        };
        let device = self.config.device.clone();
        self.units[k].pre_backward(gathered, k == 0, &device)?;
        // BACKWARD_PRE: the next gather is issued before this unit computes.
        if let Some(j) = self.scheduler.backward_prefetch(
            &self.units,
            k,
            BackwardPrefetch::BackwardPre,
            &self.mem,
        ) {
            self.unshard(j);
        }
        let _span = self.span(SpanKind::Backward, || {
            if k + 1 == n {
                format!("FSDP::backward {} (loss)", self.units[k].name())
            } else {
                format!("FSDP::backward {}", self.units[k].name())
            }
        });
        if k + 1 == n {
            let grads = loss.backward()?;
            if !self.units[k].reached_by(&grads) {
                return Err(Error::InvalidArgument(
                    "the loss passed to backward does not depend on the output of the last \
                     training forward (no gradient reaches the model)"
                        .into(),
                ));
            }
            return Ok(Some(grads));
        }
        match (grad_out, self.units[k].saved_output()) {
            (Some(go), Some(output)) if self.units[k].has_backward() => Ok(Some(
                (output * go.to_dtype(output.dtype())?)?
                    .sum_all()?
                    .backward()?,
            )),
            _ => Ok(None),
        }
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
