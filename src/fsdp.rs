//! The FSDP runtime: a model made of units, each holding only this rank's shard of its
//! FlatParameter, driven through sharded forward and backward passes.
//!
//! Life of one training step under FULL_SHARD (see `design/architecture.md` for the diagram):
//! 1. [`FsdpModel::forward`]: for each unit k in order, all-gather its flat parameter (the
//!    all-gather of unit k+1 is issued before unit k computes: forward prefetch), bind the
//!    constructor to views of the gathered buffer, run it *without* autograd on the detached
//!    input, keep only the input (an activation checkpoint at the unit boundary) and drop the
//!    gathered buffer (reshard). The last unit is not resharded: it runs with autograd
//!    variables and keeps its graph, since its backward follows at once.
//! 2. The caller computes a loss from the output.
//! 3. [`FsdpModel::backward`]: `loss.backward()` covers the last unit; then for each earlier
//!    unit in reverse: all-gather again (issued one unit ahead: backward prefetch), bind the
//!    constructor to fresh autograd variables, recompute the unit's forward from the saved input
//!    and back-propagate `sum(output * grad_output)`, which yields the parameter gradients and the
//!    gradient of the unit's input. The parameter gradients are copied once into one flat buffer,
//!    whose reduce-scatter (average over ranks) is issued on the reduce-scatter stream without
//!    waiting; the unsharded parameters are dropped. At the end, every pending reduce-scatter is
//!    waited for and accumulated into the f32 gradient shards.
//!
//! Why recompute: Candle's autograd graph holds references to every tensor a forward used, and
//! offers no way to release a tensor's storage in place, so the only way to really free a unit's
//! unsharded parameters after its forward is not to record a graph through them. The recompute
//! costs one extra forward of each unit but no extra communication beyond what FULL_SHARD
//! already does (it gathers again for backward anyway). SHARD_GRAD_OP and NO_SHARD keep the
//! parameters and the graph from forward to backward instead.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::ModuleT;

use crate::comm::{CommObserver, CommStream, ProcessGroup, ReduceOp, Work};
use crate::error::{Error, Result};
use crate::flat_param::{FlatParamLayout, FlatParameter};
use crate::init::init_values;
use crate::mixed_precision::MixedPrecision;
use crate::trace::{Lane, SpanGuard, SpanKind, Tracer};
use crate::unit::{record_unit, RecordedParam, UnitSpec};

/// How parameters, gradients and optimizer state are sharded (PyTorch's `ShardingStrategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ShardingStrategy {
    /// Parameters, gradients and optimizer state sharded; parameters resharded after forward
    /// (gathered again for backward). ZeRO-3.
    #[default]
    FullShard,
    /// Parameters kept unsharded from forward to the end of that unit's backward; gradients and
    /// optimizer state sharded. ZeRO-2.
    ShardGradOp,
    /// Nothing sharded: every rank holds all parameters; gradients all-reduced (DDP).
    NoShard,
}

impl std::str::FromStr for ShardingStrategy {
    type Err = Error;

    /// Parses `full-shard`, `shard-grad-op` or `no-shard` (PyTorch's `FULL_SHARD`,
    /// `SHARD_GRAD_OP`, `NO_SHARD` also accepted, in any case).
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "full-shard" => Ok(ShardingStrategy::FullShard),
            "shard-grad-op" => Ok(ShardingStrategy::ShardGradOp),
            "no-shard" => Ok(ShardingStrategy::NoShard),
            _ => Err(Error::InvalidArgument(format!(
                "unknown sharding strategy {s:?}: expected full-shard, shard-grad-op or no-shard"
            ))),
        }
    }
}

/// When the backward pass issues the all-gather of the next unit to run backward (PyTorch's
/// `BackwardPrefetch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackwardPrefetch {
    /// Before the current unit's backward computes (more overlap, one more unit unsharded).
    #[default]
    BackwardPre,
    /// After the current unit's gradients are computed and its parameters freed.
    BackwardPost,
    /// Only when the unit is needed (no overlap of backward all-gathers).
    None,
}

/// Runtime configuration.
#[derive(Debug, Clone)]
pub struct FsdpConfig {
    /// Sharding strategy.
    pub sharding_strategy: ShardingStrategy,
    /// Seed of the deterministic initialisation ([`crate::init`]).
    pub seed: u64,
    /// Device of compute (the CPU in this version).
    pub device: Device,
    /// Issue unit k+1's all-gather before unit k's forward computes.
    pub forward_prefetch: bool,
    /// When backward issues the next unit's all-gather (PyTorch's `BackwardPrefetch`).
    pub backward_prefetch: BackwardPrefetch,
    /// Rate limiter (PyTorch's `limit_all_gathers`): at most this many units hold unsharded
    /// parameters at once because of prefetching; a prefetch that would exceed it is issued
    /// later, when the unit is needed. `None` disables the limit. The limit bounds prefetching
    /// only: under SHARD_GRAD_OP every unit stays unsharded from its forward to its backward by
    /// definition. Default `Some(2)`.
    pub limit_all_gathers: Option<usize>,
    /// Tensors whose name ends with `.<suffix>` for one of these suffixes are **buffers**, not
    /// parameters: replicated on every rank (not sharded), never given gradients, updated in
    /// place by the module (e.g. BatchNorm's running statistics). Default: `running_mean`,
    /// `running_var`, `num_batches_tracked`.
    pub buffer_suffixes: Vec<String>,
    /// Mixed-precision policy of every unit that sets none of its own
    /// ([`UnitSpec::with_mixed_precision`]). Units holding batch-norm statistics
    /// (a `running_mean` buffer) keep f32 compute unless they set their own policy, as PyTorch
    /// FSDP does for batch norm.
    pub mixed_precision: MixedPrecision,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        Self {
            sharding_strategy: ShardingStrategy::FullShard,
            seed: 0,
            device: Device::Cpu,
            forward_prefetch: true,
            backward_prefetch: BackwardPrefetch::BackwardPre,
            limit_all_gathers: Some(2),
            buffer_suffixes: ["running_mean", "running_var", "num_batches_tracked"]
                .map(String::from)
                .to_vec(),
            mixed_precision: MixedPrecision::default(),
        }
    }
}

/// One unit of an [`FsdpModel`]: its constructor and this rank's FlatParameter.
pub struct FsdpUnit {
    /// The constructor.
    pub spec: UnitSpec,
    /// Recorded parameters (names, shapes, init hints), in layout order.
    pub recorded: Vec<RecordedParam>,
    /// This rank's FlatParameter.
    pub flat: FlatParameter,
    /// Buffers (see [`FsdpConfig::buffer_suffixes`]): full values in the policy's
    /// `buffer_dtype`, replicated, updated in place by training forwards.
    pub buffers: Vec<(String, Var)>,
    /// The mixed-precision policy this unit runs under.
    pub policy: MixedPrecision,
    /// Unsharded f32 gradient accumulated while gradient sync is off (`no_sync`), padded flat
    /// layout; reduced together with the next synchronised backward.
    pub unsharded_grad: Option<Vec<f32>>,
}

impl FsdpUnit {
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
}

/// What forward keeps of a unit for its backward.
enum Saved {
    /// The unit ran with autograd variables; its graph is alive.
    Graph {
        input_var: Option<Tensor>,
        output: Tensor,
        params: Vec<Tensor>,
        unsharded_bytes: usize,
    },
    /// The unit ran without autograd; backward recomputes it from `input`.
    Recompute { input: Tensor },
}

/// Counters of unsharded-parameter memory on this rank (bytes of f32 flat buffers).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes of master and gradient shards held now.
    pub sharded_bytes: usize,
    /// Bytes of unsharded (gathered) parameters alive now.
    pub unsharded_bytes: usize,
    /// Highest `unsharded_bytes` since the last [`FsdpModel::reset_peak`].
    pub peak_unsharded_bytes: usize,
    /// Highest number of units unsharded at once.
    pub peak_unsharded_units: usize,
    /// Units unsharded now.
    pub unsharded_units: usize,
}

/// A model whose units' parameters are sharded over a process group.
///
/// Every method that communicates (`forward`, `forward_eval`, `backward`, `gather_full_params`)
/// is a collective: all ranks must call it, in the same order.
pub struct FsdpModel {
    pg: Arc<dyn ProcessGroup>,
    /// Comm stream of the parameter all-gathers.
    ag_stream: CommStream,
    /// Comm stream of the gradient reductions (reduce-scatter, or all-reduce under NO_SHARD).
    rs_stream: CommStream,
    config: FsdpConfig,
    units: Vec<FsdpUnit>,
    saved: Vec<Option<Saved>>,
    mem: MemoryStats,
    requires_gradient_sync: bool,
    tracer: Option<Arc<Tracer>>,
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

    /// Adds several wrapped units, in order (e.g. [`crate::models::mnist_mlp`]).
    pub fn units(mut self, specs: impl IntoIterator<Item = UnitSpec>) -> Self {
        self.specs.extend(specs);
        self
    }

    /// Records every unit, lays out and initialises its shard, one unit at a time (the peak is
    /// one unit's largest parameter, never the model), then creates the model's comm streams
    /// (`"all_gather"`, `"reduce_scatter"`: a collective, so every rank builds its models in the
    /// same order).
    ///
    /// Errors: no unit, duplicate unit names, a constructor that fails, stream creation.
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
        let mut units = Vec::with_capacity(specs.len());
        for spec in specs {
            if units.iter().any(|u: &FsdpUnit| u.spec.name == spec.name) {
                return Err(Error::InvalidArgument(format!(
                    "two units are named {}",
                    spec.name
                )));
            }
            let all_recorded = record_unit(&spec, DType::F32, &config.device)?;
            for p in &all_recorded {
                let clash = units.iter().find(|u: &&FsdpUnit| {
                    u.recorded.iter().any(|q| q.name == p.name)
                        || u.buffers.iter().any(|(b, _)| b == &p.name)
                });
                if let Some(other) = clash {
                    return Err(Error::InvalidArgument(format!(
                        "units {} and {} both create a tensor named {}: full names must be unique \
                         (checkpoints and state dicts are keyed by them)",
                        other.spec.name, spec.name, p.name
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
            let flat = FlatParameter::from_fn(layout, shard_index, |i, range, out| {
                fill(&recorded[i], range, out)
            })?;
            units.push(FsdpUnit {
                spec,
                recorded,
                flat,
                buffers,
                policy,
                unsharded_grad: None,
            });
        }
        let n = units.len();
        let ag_stream = pg.new_stream("all_gather")?;
        let rs_stream = pg.new_stream("reduce_scatter")?;
        let mut model = FsdpModel {
            pg,
            ag_stream,
            rs_stream,
            config,
            units,
            saved: (0..n).map(|_| None).collect(),
            mem: MemoryStats::default(),
            requires_gradient_sync: true,
            tracer: None,
            steps_started: 0,
        };
        model.mem.sharded_bytes = model.units.iter().map(|u| u.flat.sharded_bytes()).sum();
        Ok(model)
    }

    /// The process group.
    pub fn process_group(&self) -> &Arc<dyn ProcessGroup> {
        &self.pg
    }

    /// The configuration.
    pub fn config(&self) -> &FsdpConfig {
        &self.config
    }

    /// The units, in forward order.
    pub fn units(&self) -> &[FsdpUnit] {
        &self.units
    }

    /// Mutable access to the units (optimizers step their shards through it).
    pub fn units_mut(&mut self) -> &mut [FsdpUnit] {
        &mut self.units
    }

    /// Memory counters of this rank.
    pub fn memory_stats(&self) -> MemoryStats {
        let mut m = self.mem;
        m.sharded_bytes = self.units.iter().map(|u| u.flat.sharded_bytes()).sum();
        m
    }

    /// Resets the peak counters to the current values.
    pub fn reset_peak(&mut self) {
        self.mem.peak_unsharded_bytes = self.mem.unsharded_bytes;
        self.mem.peak_unsharded_units = self.mem.unsharded_units;
    }

    /// Drops every gradient shard and any unsynchronised accumulated gradient (PyTorch's
    /// `zero_grad(set_to_none=True)`).
    pub fn zero_grad(&mut self) {
        for u in &mut self.units {
            u.flat.grad = None;
            u.unsharded_grad = None;
        }
    }

    /// Turns gradient synchronisation off or on (FSDP2's `set_requires_gradient_sync`, FSDP1's
    /// `no_sync`). While off, [`FsdpModel::backward`] issues no reduce-scatter: each unit's
    /// gradient is added into an unsharded f32 buffer on this rank (memory: one f32 copy of
    /// every unit's parameters). The first backward with sync on reduces that sum together with
    /// its own gradient, in one reduce-scatter per unit.
    pub fn set_requires_gradient_sync(&mut self, sync: bool) {
        self.requires_gradient_sync = sync;
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

    /// Whether backward reduces gradients (see [`FsdpModel::set_requires_gradient_sync`]).
    pub fn requires_gradient_sync(&self) -> bool {
        self.requires_gradient_sync
    }

    fn note_unshard(&mut self, bytes: usize) {
        self.mem.unsharded_bytes += bytes;
        self.mem.unsharded_units += 1;
        self.mem.peak_unsharded_bytes = self.mem.peak_unsharded_bytes.max(self.mem.unsharded_bytes);
        self.mem.peak_unsharded_units = self.mem.peak_unsharded_units.max(self.mem.unsharded_units);
    }

    fn note_reshard(&mut self, bytes: usize) {
        self.mem.unsharded_bytes -= bytes;
        self.mem.unsharded_units -= 1;
    }

    /// Issues the all-gather of unit `k` in its `param_dtype` (or completes at once when nothing
    /// needs gathering). The unsharded buffer counts as alive from here on (it is allocated now).
    fn issue_unshard(&mut self, k: usize) -> Work<Tensor> {
        self.issue_unshard_as(k, self.units[k].policy.param_dtype)
    }

    /// [`Self::issue_unshard`] in an explicit dtype (f32 for exact state dicts).
    fn issue_unshard_as(&mut self, k: usize, dtype: DType) -> Work<Tensor> {
        let n = self.units[k].flat.layout.padded_numel;
        self.note_unshard(n * dtype.size_in_bytes());
        let flat = &self.units[k].flat;
        let dev = &self.config.device;
        // Cast the local shard to param_dtype before the gather: the wire carries param_dtype.
        let input = match Tensor::from_slice(&flat.shard, flat.shard.len(), dev)
            .and_then(|t| t.to_dtype(dtype))
        {
            Ok(t) => t,
            Err(e) => return Work::ready(Err(e.into())),
        };
        if !self.gathers(k) {
            return Work::ready(Ok(input));
        }
        match Tensor::zeros(n, dtype, dev) {
            Ok(out) => self.pg.all_gather(&self.ag_stream, &input, out),
            Err(e) => Work::ready(Err(e.into())),
        }
    }

    /// Waits for a gathered buffer and returns it as one flat tensor of `param_dtype`
    /// (`padded_numel` elements; the buffer moves into the tensor, no copy) and its size in
    /// bytes.
    fn finish_unshard(&self, k: usize, work: Work<Tensor>) -> Result<(Tensor, usize)> {
        let full = work.wait()?;
        debug_assert_eq!(full.elem_count(), self.units[k].flat.layout.padded_numel);
        let bytes = full.elem_count() * full.dtype().size_in_bytes();
        Ok((full, bytes))
    }

    /// Views of each parameter inside the gathered flat tensor (no copy, no autograd).
    fn param_views(&self, k: usize, flat: &Tensor) -> Result<HashMap<String, Tensor>> {
        let layout = &self.units[k].flat.layout;
        layout
            .params
            .iter()
            .map(|p| {
                Ok((
                    p.name.clone(),
                    flat.narrow(0, p.offset, p.numel)?
                        .reshape(p.shape.clone())?,
                ))
            })
            .collect()
    }

    /// Fresh autograd variables holding each parameter (one copy out of the gathered buffer).
    fn param_vars(
        &self,
        k: usize,
        flat: &Tensor,
    ) -> Result<(HashMap<String, Tensor>, Vec<Tensor>)> {
        let layout = &self.units[k].flat.layout;
        let mut map = HashMap::with_capacity(layout.params.len());
        let mut list = Vec::with_capacity(layout.params.len());
        for p in &layout.params {
            let view = flat
                .narrow(0, p.offset, p.numel)?
                .reshape(p.shape.clone())?;
            let v = Var::from_tensor(&view)?.into_inner();
            map.insert(p.name.clone(), v.clone());
            list.push(v);
        }
        Ok((map, list))
    }

    /// Casts a floating-point unit input to the unit's `param_dtype` when its policy says so.
    fn cast_input(&self, k: usize, h: Tensor) -> Result<Tensor> {
        let policy = &self.units[k].policy;
        if policy.cast_forward_inputs && h.dtype().is_float() && h.dtype() != policy.param_dtype {
            Ok(h.to_dtype(policy.param_dtype)?)
        } else {
            Ok(h)
        }
    }

    /// Whether unit `k` keeps its parameters and autograd graph from forward to its backward
    /// (otherwise it is resharded after forward and recomputed in backward).
    fn keeps_graph(&self, k: usize) -> bool {
        self.config.sharding_strategy != ShardingStrategy::FullShard
            || k + 1 == self.units.len()
            || !self.units[k].spec.reshard_after_forward
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

    /// True when one more unit may be unsharded ahead of need (the rate limiter,
    /// [`FsdpConfig::limit_all_gathers`]).
    fn may_prefetch(&self) -> bool {
        self.config
            .limit_all_gathers
            .is_none_or(|limit| self.mem.unsharded_units < limit)
    }

    /// Issues unit `k`'s all-gather and marks the issue in the trace.
    fn issue_traced(&mut self, k: usize) -> Work<Tensor> {
        if self.gathers(k) {
            self.mark_issue(|| format!("FSDP::all_gather {}", self.units[k].spec.name));
        }
        self.issue_unshard(k)
    }

    /// True when unit `k`'s unshard is a real all-gather (it has parameters and is sharded).
    fn gathers(&self, k: usize) -> bool {
        let layout = &self.units[k].flat.layout;
        layout.world_size > 1 && layout.padded_numel > 0
    }

    /// Waits for unit `k`'s all-gather, recording the wait as exposed communication.
    fn wait_traced(&self, k: usize, work: Work<Tensor>) -> Result<(Tensor, usize)> {
        if !self.gathers(k) {
            return self.finish_unshard(k, work);
        }
        let _w = self.span(SpanKind::Wait, || {
            format!("FSDP::wait all_gather {}", self.units[k].spec.name)
        });
        self.finish_unshard(k, work)
    }

    /// Sharded training forward (a collective). Returns the last unit's output, attached to the
    /// autograd graph of the last unit so that a loss computed from it can be passed to
    /// [`FsdpModel::backward`]. The output is in the last unit's `param_dtype`.
    ///
    /// `x`: the first unit's input, any shape the first unit accepts.
    ///
    /// Under FULL_SHARD every unit but the last (and those with
    /// [`UnitSpec::reshard_after_forward`] off) is recomputed in backward, so a unit with a random
    /// forward (dropout) must turn resharding off.
    ///
    /// Errors: the previous training forward was not back-propagated (call
    /// [`FsdpModel::backward`] or [`FsdpModel::discard_forward`] first); a unit's error; any
    /// collective error.
    pub fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        if self.saved.iter().all(|s| s.is_some()) {
            return Err(Error::InvalidArgument(
                "forward called while the previous training forward was not back-propagated: \
                 its saved state would be lost and a loss using both outputs would get wrong \
                 gradients; call backward first, or discard_forward() to drop it"
                    .into(),
            ));
        }
        self.release_saved();
        if let Some(t) = &self.tracer {
            t.set_step(self.steps_started);
        }
        self.steps_started += 1;
        let n = self.units.len();
        let mut h = x.clone();
        let mut next = Some(self.issue_traced(0));
        for k in 0..n {
            let work = next.take().expect("gather issued");
            let (full, bytes) = self.wait_traced(k, work)?;
            // Forward prefetch: unit k+1's all-gather runs while unit k computes.
            if k + 1 < n && self.config.forward_prefetch && self.may_prefetch() {
                next = Some(self.issue_traced(k + 1));
            }
            let spec = self.units[k].spec.clone();
            let dtype = self.units[k].policy.param_dtype;
            let span = self.span(SpanKind::Forward, || format!("FSDP::forward {}", spec.name));
            if self.keeps_graph(k) {
                let input_var = if k > 0 {
                    let x = self.cast_input(k, h.detach())?;
                    Some(Var::from_tensor(&x)?.into_inner())
                } else {
                    None
                };
                let input = match &input_var {
                    Some(v) => v.clone(),
                    None => self.cast_input(k, h.clone())?,
                };
                let (mut map, params) = self.param_vars(k, &full)?;
                drop(full);
                self.units[k].add_buffers(&mut map, true)?;
                let module = spec.bind(map, dtype, &self.config.device)?;
                let output = module.forward_t(&input, true)?;
                self.saved[k] = Some(Saved::Graph {
                    input_var,
                    output: output.clone(),
                    params,
                    unsharded_bytes: bytes,
                });
                h = output;
            } else {
                let input = self.cast_input(k, h.detach())?;
                let mut map = self.param_views(k, &full)?;
                drop(full);
                self.units[k].add_buffers(&mut map, true)?;
                let module = spec.bind(map, dtype, &self.config.device)?;
                let output = module.forward_t(&input, true)?;
                // Reshard: the module held the only views of the gathered buffer.
                drop(module);
                self.note_reshard(bytes);
                self.saved[k] = Some(Saved::Recompute { input });
                h = output;
            }
            drop(span);
            if next.is_none() && k + 1 < n {
                next = Some(self.issue_traced(k + 1));
            }
        }
        Ok(h)
    }

    /// Sharded inference forward (a collective): every unit gathered, run with `train = false`
    /// and resharded; nothing kept for backward.
    pub fn forward_eval(&mut self, x: &Tensor) -> Result<Tensor> {
        self.release_saved();
        let n = self.units.len();
        let mut h = x.detach();
        let mut next = Some(self.issue_traced(0));
        for k in 0..n {
            let (full, bytes) = self.wait_traced(k, next.take().expect("gather issued"))?;
            if k + 1 < n && self.config.forward_prefetch && self.may_prefetch() {
                next = Some(self.issue_traced(k + 1));
            }
            let spec = self.units[k].spec.clone();
            let _span = self.span(SpanKind::Forward, || {
                format!("FSDP::forward_eval {}", spec.name)
            });
            let mut map = self.param_views(k, &full)?;
            drop(full);
            self.units[k].add_buffers(&mut map, true)?;
            let module = spec.bind(map, self.units[k].policy.param_dtype, &self.config.device)?;
            h = module.forward_t(&self.cast_input(k, h)?, false)?;
            drop(module);
            self.note_reshard(bytes);
            if next.is_none() && k + 1 < n {
                next = Some(self.issue_traced(k + 1));
            }
        }
        Ok(h)
    }

    /// Drops what the last training forward kept for its backward (to run another training
    /// forward without back-propagating the previous one).
    pub fn discard_forward(&mut self) {
        self.release_saved();
    }

    /// Drops whatever a previous forward kept. Afterwards nothing is unsharded, so the counters
    /// are reset too (a forward or backward that failed half way leaves gathers it never
    /// released; their buffers were freed with the error).
    fn release_saved(&mut self) {
        for s in &mut self.saved {
            *s = None;
        }
        self.mem.unsharded_bytes = 0;
        self.mem.unsharded_units = 0;
    }

    /// The next unit below `from` whose backward needs an all-gather (a recomputed unit).
    fn next_recompute(&self, from: usize) -> Option<usize> {
        (0..from)
            .rev()
            .find(|&j| matches!(self.saved[j], Some(Saved::Recompute { .. })))
    }

    /// Sharded backward (a collective) of `loss`, a scalar computed from the output of the last
    /// [`FsdpModel::forward`]. On return every unit's gradient shard holds the gradient averaged
    /// over ranks (added to what it held, so calling forward/backward several times accumulates).
    ///
    /// Errors: no forward to back-propagate; any collective error.
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        let n = self.units.len();
        if self.saved.iter().any(|s| s.is_none()) {
            return Err(Error::InvalidArgument(
                "backward called without a preceding training forward".into(),
            ));
        }
        // The all-gather of the next unit to recompute, issued ahead (backward prefetch): the
        // first one before the loss's own backward, so that it runs during it.
        let mut prefetched: Option<(usize, Work<Tensor>)> = None;
        let prefetch_mode = self.config.backward_prefetch;
        if prefetch_mode != BackwardPrefetch::None && self.may_prefetch() {
            if let Some(j) = self.next_recompute(n) {
                prefetched = Some((j, self.issue_traced(j)));
            }
        }
        let mut loss_grads = {
            let _span = self.span(SpanKind::Backward, || {
                format!("FSDP::backward {} (loss)", self.units[n - 1].spec.name)
            });
            Some(loss.backward()?)
        };
        let mut grad_out: Option<Tensor> = None;
        let mut pending: Vec<(usize, Work<Tensor>)> = Vec::with_capacity(n);
        for k in (0..n).rev() {
            let saved = self.saved[k].take().expect("checked above");
            let name = self.units[k].spec.name.clone();
            let (grads, params, input_var, unsharded_bytes) = match saved {
                Saved::Graph {
                    input_var,
                    output,
                    params,
                    unsharded_bytes,
                } => {
                    let _span = self.span(SpanKind::Backward, || format!("FSDP::backward {name}"));
                    let grads = match (loss_grads.take(), &grad_out) {
                        (Some(g), _) if k + 1 == n => Some(g),
                        (_, Some(go)) => Some(
                            (&output * go.to_dtype(output.dtype())?)?
                                .sum_all()?
                                .backward()?,
                        ),
                        (_, None) => None,
                    };
                    (grads, params, input_var, unsharded_bytes)
                }
                Saved::Recompute { input } => {
                    let work = match prefetched.take() {
                        Some((j, w)) if j == k => w,
                        Some(other) => {
                            prefetched = Some(other);
                            self.issue_traced(k)
                        }
                        None => self.issue_traced(k),
                    };
                    let (full, bytes) = self.wait_traced(k, work)?;
                    // BACKWARD_PRE: the next gather is issued before this unit computes.
                    if prefetch_mode == BackwardPrefetch::BackwardPre
                        && prefetched.is_none()
                        && self.may_prefetch()
                    {
                        if let Some(j) = self.next_recompute(k) {
                            prefetched = Some((j, self.issue_traced(j)));
                        }
                    }
                    let _span = self.span(SpanKind::Backward, || format!("FSDP::backward {name}"));
                    let (mut map, params) = self.param_vars(k, &full)?;
                    drop(full);
                    // The forward already updated the buffers: the recompute's updates are
                    // made on copies and discarded.
                    self.units[k].add_buffers(&mut map, false)?;
                    let input_var = if k > 0 {
                        Some(Var::from_tensor(&input)?.into_inner())
                    } else {
                        None
                    };
                    let grads = match &grad_out {
                        Some(go) if !params.is_empty() || input_var.is_some() => {
                            let module = self.units[k].spec.bind(
                                map,
                                self.units[k].policy.param_dtype,
                                &self.config.device,
                            )?;
                            let x = input_var.as_ref().unwrap_or(&input);
                            let output = module.forward_t(x, true)?;
                            Some(
                                (&output * go.to_dtype(output.dtype())?)?
                                    .sum_all()?
                                    .backward()?,
                            )
                        }
                        _ => None,
                    };
                    (grads, params, input_var, bytes)
                }
            };
            // Gradient of this unit's input becomes the next unit's output gradient. Detached:
            // Candle records the ops of a backward pass on variables like any other, so the
            // gradient would otherwise drag this unit's whole backward graph (and parameters)
            // into the next unit's backward, which would then also differentiate through it.
            grad_out = match (&grads, &input_var) {
                (Some(g), Some(v)) => g.get(v).map(Tensor::detach),
                _ => None,
            };
            let flat_span = self.span(SpanKind::Backward, || format!("FSDP::flatten_grads {name}"));
            let flat_grad = self.flatten_grads(k, grads.as_ref(), &params)?;
            drop(params);
            drop(grads);
            drop(flat_span);
            self.note_reshard(unsharded_bytes);
            // BACKWARD_POST: the next gather is issued once this unit's gradients exist.
            if prefetch_mode == BackwardPrefetch::BackwardPost
                && prefetched.is_none()
                && self.may_prefetch()
            {
                if let Some(j) = self.next_recompute(k) {
                    prefetched = Some((j, self.issue_traced(j)));
                }
            }
            if let Some(mut fg) = flat_grad {
                if let Some(acc) = self.units[k].unsharded_grad.take() {
                    fg.iter_mut().zip(acc).for_each(|(a, b)| *a += b);
                }
                if self.requires_gradient_sync {
                    self.mark_issue(|| format!("FSDP::reduce_scatter {name}"));
                    pending.push((k, self.issue_reduce(k, fg)));
                } else {
                    self.units[k].unsharded_grad = Some(fg);
                }
            }
        }
        for (k, work) in pending {
            let _w = self.span(SpanKind::Wait, || {
                format!("FSDP::wait reduce_scatter {}", self.units[k].spec.name)
            });
            let reduced = work.wait()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            self.units[k].flat.accumulate_grad(reduced);
        }
        Ok(())
    }

    /// Copies the parameter gradients of unit `k` into one padded flat f32 buffer (zeros where a
    /// parameter got no gradient). `None` for a unit without parameters.
    fn flatten_grads(
        &self,
        k: usize,
        grads: Option<&GradStore>,
        params: &[Tensor],
    ) -> Result<Option<Vec<f32>>> {
        let layout = &self.units[k].flat.layout;
        if layout.padded_numel == 0 {
            return Ok(None);
        }
        let mut flat = vec![0.0f32; layout.padded_numel];
        if let Some(grads) = grads {
            for (p, t) in layout.params.iter().zip(params) {
                if let Some(g) = grads.get(t) {
                    copy_into(g, &mut flat[p.offset..p.offset + p.numel])?;
                }
            }
        }
        Ok(Some(flat))
    }

    /// Issues the gradient reduction of unit `k`: reduce-scatter (average) when sharded,
    /// all-reduce (average) under NO_SHARD.
    fn issue_reduce(&self, k: usize, flat_grad: Vec<f32>) -> Work<Tensor> {
        let layout = &self.units[k].flat.layout;
        let dtype = self.units[k].policy.reduce_dtype;
        let dev = &self.config.device;
        // Cast to reduce_dtype before the collective: the wire carries reduce_dtype.
        let n = flat_grad.len();
        let input = match Tensor::from_vec(flat_grad, n, dev).and_then(|t| t.to_dtype(dtype)) {
            Ok(t) => t,
            Err(e) => return Work::ready(Err(e.into())),
        };
        if self.pg.world_size() == 1 {
            return Work::ready(Ok(input));
        }
        if layout.world_size == 1 {
            return self.pg.all_reduce(&self.rs_stream, input, ReduceOp::Avg);
        }
        match Tensor::zeros(layout.shard_numel, dtype, dev) {
            Ok(out) => self
                .pg
                .reduce_scatter(&self.rs_stream, &input, out, ReduceOp::Avg),
            Err(e) => Work::ready(Err(e.into())),
        }
    }

    /// Gathers every unit's full parameters (a collective, one unit at a time). With
    /// `rank0_only`, only rank 0 gets the result (`None` elsewhere).
    ///
    /// Returns (name, f32 tensor of the parameter's shape) for every parameter, followed by each
    /// unit's buffers, unit by unit.
    pub fn gather_full_params(
        &mut self,
        rank0_only: bool,
    ) -> Result<Option<Vec<(String, Tensor)>>> {
        let keep = !rank0_only || self.pg.rank() == 0;
        let mut out = Vec::new();
        for k in 0..self.units.len() {
            // Exact master values: gathered in f32 whatever the policy's param_dtype.
            let work = self.issue_unshard_as(k, DType::F32);
            let (full, bytes) = self.finish_unshard(k, work)?;
            if keep {
                for p in &self.units[k].flat.layout.params {
                    let t = full
                        .narrow(0, p.offset, p.numel)?
                        .reshape(p.shape.clone())?
                        .copy()?;
                    out.push((p.name.clone(), t));
                }
                for (name, var) in &self.units[k].buffers {
                    out.push((name.clone(), var.as_tensor().copy()?));
                }
            }
            self.note_reshard(bytes);
        }
        Ok(keep.then_some(out))
    }

    /// Gathers the full model (a collective) and returns, on rank 0 only with `rank0_only`, a
    /// plain unsharded copy that runs without communication (for evaluation or export).
    pub fn gather_full_model(&mut self, rank0_only: bool) -> Result<Option<FullModel>> {
        let Some(params) = self.gather_full_params(rank0_only)? else {
            return Ok(None);
        };
        let map: HashMap<String, Tensor> = params.into_iter().collect();
        let modules = self
            .units
            .iter()
            .map(|u| u.spec.bind(map.clone(), DType::F32, &self.config.device))
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(FullModel { modules }))
    }
}

/// An unsharded copy of a model's units (see [`FsdpModel::gather_full_model`]).
pub struct FullModel {
    modules: Vec<Box<dyn ModuleT>>,
}

impl FullModel {
    /// Runs every unit in order.
    pub fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let mut h = x.clone();
        for m in &self.modules {
            h = m.forward_t(&h, train)?;
        }
        Ok(h)
    }

    /// Classification accuracy in percent of the eval-mode model on `images` (first dimension
    /// N) against `labels` ((N,) u32), `batch` items at a time: the share of rows whose argmax
    /// over the last output dimension equals the label.
    ///
    /// Errors: `batch == 0`, N different in images and labels, or a unit's error.
    pub fn accuracy(&self, images: &Tensor, labels: &Tensor, batch: usize) -> Result<f64> {
        let n = images.dim(0)?;
        if batch == 0 || labels.dims() != [n] {
            return Err(Error::InvalidArgument(format!(
                "accuracy: {n} images need ({n},) labels and a batch > 0, found labels {:?} \
                 and batch {batch}",
                labels.dims()
            )));
        }
        let mut correct = 0f64;
        for start in (0..n).step_by(batch) {
            let len = batch.min(n - start);
            let logits = self.forward_t(&images.narrow(0, start, len)?, false)?;
            correct += logits
                .argmax(candle_core::D::Minus1)?
                .eq(&labels.narrow(0, start, len)?)?
                .to_dtype(DType::F32)?
                .sum_all()?
                .to_scalar::<f32>()? as f64;
        }
        Ok(if n == 0 {
            0.0
        } else {
            100.0 * correct / n as f64
        })
    }
}

/// Copies a tensor's values (as f32, row-major) into `out`, whose length must be its element
/// count.
pub(crate) fn copy_into(t: &Tensor, out: &mut [f32]) -> Result<()> {
    if t.elem_count() != out.len() {
        return Err(Error::InvalidArgument(format!(
            "gradient has {} elements, its parameter {}",
            t.elem_count(),
            out.len()
        )));
    }
    let t = if t.dtype() == DType::F32 {
        t.clone()
    } else {
        t.to_dtype(DType::F32)?
    };
    let t = if t.is_contiguous() {
        t
    } else {
        t.contiguous()?
    };
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(cpu) => {
            let s = cpu.as_slice::<f32>()?;
            let start = layout.start_offset();
            out.copy_from_slice(&s[start..start + out.len()]);
            Ok(())
        }
        _ => {
            drop(storage);
            let v = t.flatten_all()?.to_vec1::<f32>()?;
            out.copy_from_slice(&v);
            Ok(())
        }
    }
}
