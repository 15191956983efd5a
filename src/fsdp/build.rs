//! Construction of an [`FsdpModel`] (FSDP2's `_fsdp_init.py`): [`FsdpModelBuilder`], and
//! [`FsdpModel::build_with`] as five named steps:
//! 1. `check_device`: the config's device is the process group's;
//! 2. `record_groups`: every member's constructor is recorded under its group's prefix; a
//!    tensor two members of a group ask for is one tensor (tied weights), and two groups that
//!    create one name are an error;
//! 3. `classify`: buffers (by suffix), frozen parameters (by pattern), the group's
//!    mixed-precision policy, buffer values;
//! 4. `plan_groups`: one flat layout per group (and per frozen twin), the callable members,
//!    the memory budget check, before anything is allocated;
//! 5. `allocate`: the shards, filled piece by piece; the ranks' agreement on the model; the
//!    comm streams.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use candle_core::{DType, Tensor, Var};
use candle_nn::ModuleT;

use super::agreement::agree_on_model;
use super::collectives::CommContext;
use super::config::{FsdpConfig, ShardingStrategy};
use super::fingerprint::Recorder;
use super::mesh::Mesh;
use super::model::FsdpModel;
use super::param_group::ParamGroup;
use super::spec::{GroupSpec, Member, ModelSpec};
use crate::comm::ProcessGroup;
use crate::error::{Error, Result};
use crate::flat_param::{FlatParamLayout, FlatParameter};
use crate::init::init_values;
use crate::mixed_precision::MixedPrecision;
use crate::unit::{record_unit, RecordedParam, UnitSpec};

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

    /// Freezes every parameter whose full name matches none of `patterns` (glob syntax as
    /// [`FsdpModelBuilder::freeze`]): only the matching ones train (e.g. LoRA's adapters,
    /// `"*.lora_A.weight"`, `"*.lora_B.weight"`; see [`crate::lora`]). Combines with
    /// [`FsdpModelBuilder::freeze`] (a parameter matching a freeze pattern is frozen either way).
    ///
    /// [`FsdpModelBuilder::build`] fails on an invalid pattern or one that matches nothing.
    pub fn train_only(mut self, patterns: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.spec.push_train_only(patterns);
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
    /// A collective: it creates the model's comm streams ("all_gather", and "reduce_scatter"
    /// unless [`super::CommStreams`] shares the first) on the group, so every rank builds its
    /// models in the same order; under the hybrid strategies it first creates the shard and
    /// replica groups (`super::mesh`) and the replica group's stream ("all_reduce_replicas"),
    /// and the shards are laid out over the shard group.
    ///
    /// Errors: a hybrid shard size that does not divide the world size (or differs between
    /// ranks); no unit; two units of one name; two units (not in one group) that create a tensor
    /// of one name; members of a group that ask for one tensor with two shapes; an invalid
    /// freeze pattern or one that matches no parameter; a constructor that fails; an invalid
    /// mixed-precision policy; ranks that built different models; a stream that cannot be
    /// created.
    pub fn build_with(
        pg: Arc<dyn ProcessGroup>,
        mut config: FsdpConfig,
        spec: impl Into<ModelSpec>,
        mut fill: impl FnMut(&RecordedParam, std::ops::Range<usize>, &mut [f32]) -> Result<()>,
    ) -> Result<FsdpModel> {
        let spec: ModelSpec = spec.into();
        check_device(&config, pg.as_ref())?;
        let mesh = Mesh::new(
            &pg,
            config.sharding_strategy,
            config.reshard_after_forward_ranks,
        )?;
        // A hybrid strategy's default shard size, resolved (what `config()` then shows).
        if config.sharding_strategy.is_hybrid() {
            config.sharding_strategy = config
                .sharding_strategy
                .with_shard_size(Some(mesh.shard_size()));
        }
        let mut freeze = FreezePatterns::new(&spec.freeze, &spec.train_only, &spec.groups)?;
        let recorded = record_groups(spec.groups, &config)?;
        let classified = recorded
            .into_iter()
            .map(|g| classify(g, &config, &mut freeze))
            .collect::<Result<Vec<_>>>()?;
        let (planned, members) = plan_groups(classified, &config, mesh.shard.as_ref(), &freeze)?;
        let units = allocate(planned, &config, mesh.shard.as_ref(), &mut fill)?;
        // `Auto` decided here, so that the agreement compares what each rank will do.
        config.comm_streams = config.comm_streams.resolve(pg.as_ref());
        agree_on_model(pg.as_ref(), &units, &config)?;
        let comm = CommContext::new(mesh, config.comm_streams)?;
        let fingerprint = config
            .fingerprint
            .as_deref()
            .map(|p| Recorder::new(p, pg.rank(), pg.world_size()))
            .transpose()?;
        let mut model = FsdpModel::assemble(pg, config, comm, units, members);
        model.fingerprint = fingerprint;
        Ok(model)
    }
}

/// Step 1: the config's device is the one the process group's buffers live on.
fn check_device(config: &FsdpConfig, pg: &dyn ProcessGroup) -> Result<()> {
    if !config.device.same_device(pg.device()) {
        return Err(Error::device("FsdpConfig::device", format!("{:?}, where the process group's buffers live (rank {}): set `device: pg.device().clone()` (on a GPU each rank's Candle device, with its own compute stream, is the group's)", pg.device().location(), pg.rank()), config.device.location()));
    }
    Ok(())
}

/// The freeze patterns, and which of them matched a parameter so far.
struct FreezePatterns {
    source: Vec<String>,
    patterns: Vec<glob::Pattern>,
    used: Vec<bool>,
    /// `train_only`'s patterns (the parameters matching none of them are frozen), by index
    /// into `source` / `used` from `first_keep` on.
    keep: Vec<glob::Pattern>,
    first_keep: usize,
}

impl FreezePatterns {
    /// Parses `source` (after checking that the model has a unit, the error that comes first).
    fn new(source: &[String], keep: &[String], groups: &[GroupSpec]) -> Result<Self> {
        if groups.iter().all(|g| g.members.is_empty()) {
            return Err(Error::missing(
                "unit in the model",
                "a model needs at least one",
            ));
        }
        let patterns = source
            .iter()
            .map(|p| {
                glob::Pattern::new(p).map_err(|e| {
                    Error::value(
                        "freeze pattern",
                        format!("a valid glob ({e})"),
                        format!("{p:?}"),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let keep_patterns = keep
            .iter()
            .map(|p| {
                glob::Pattern::new(p).map_err(|e| {
                    Error::value(
                        "train-only pattern",
                        format!("a valid glob ({e})"),
                        format!("{p:?}"),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(FreezePatterns {
            source: source.iter().chain(keep).cloned().collect(),
            used: vec![false; patterns.len() + keep_patterns.len()],
            first_keep: patterns.len(),
            patterns,
            keep: keep_patterns,
        })
    }

    /// True when `name` matches a pattern (every matching pattern is marked used).
    fn matches(&mut self, name: &str) -> bool {
        let mut hit = false;
        for (i, pat) in self.patterns.iter().enumerate() {
            if pat.matches(name) {
                self.used[i] = true;
                hit = true;
            }
        }
        let mut kept = false;
        for (i, pat) in self.keep.iter().enumerate() {
            if pat.matches(name) {
                self.used[self.first_keep + i] = true;
                kept = true;
            }
        }
        hit || (!self.keep.is_empty() && !kept)
    }

    /// The first pattern that matched no parameter, and its kind (`"freeze"` or
    /// `"train-only"`).
    fn unused(&self) -> Option<(&'static str, &str)> {
        self.used.iter().position(|u| !u).map(|i| {
            let kind = if i < self.first_keep {
                "freeze"
            } else {
                "train-only"
            };
            (kind, self.source[i].as_str())
        })
    }
}

/// A group whose members' constructors were recorded.
struct RecordedGroup {
    spec: GroupSpec,
    /// Every tensor of the group, once, in the order first asked for.
    recorded: Vec<RecordedParam>,
    /// Per member: the full names its constructor asks for.
    member_names: Vec<HashSet<String>>,
}

/// Step 2: records every member of every group under the group's prefix. A name asked for by
/// two members of a group is one tensor (of one shape); a name created by two groups is an
/// error that says how to tie it.
fn record_groups(groups: Vec<GroupSpec>, config: &FsdpConfig) -> Result<Vec<RecordedGroup>> {
    let mut out: Vec<RecordedGroup> = Vec::with_capacity(groups.len());
    // Which unit created each tensor name (for the clash error).
    let mut creator: HashMap<String, String> = HashMap::new();
    for g in groups {
        if g.members.is_empty() {
            return Err(Error::missing(
                format!("unit in group {}", g.name),
                "a group needs at least one",
            ));
        }
        for m in &g.members {
            if out
                .iter()
                .flat_map(|o| &o.spec.members)
                .any(|o| o.name == m.name)
            {
                return Err(Error::value(
                    "unit names",
                    "unique",
                    format!("{} twice", m.name),
                ));
            }
        }
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
        out.push(RecordedGroup {
            spec: g,
            recorded: all_recorded,
            member_names,
        });
    }
    Ok(out)
}

/// A recorded group sorted into buffers, trainable and frozen parameters, with its policy.
struct ClassifiedGroup {
    group: RecordedGroup,
    trainable: Vec<RecordedParam>,
    frozen: Vec<RecordedParam>,
    /// The buffers, initialised, in the policy's `buffer_dtype`.
    buffers: Vec<(String, Var)>,
    policy: MixedPrecision,
    /// Free the parameters after each forward call.
    reshard: bool,
}

/// Step 3: buffers by suffix ([`FsdpConfig::buffer_suffixes`]), frozen parameters by pattern,
/// the policy of the group's first member (a group with batch-norm running statistics computes
/// in f32 unless its member sets a policy), and the buffers' initial values.
fn classify(
    mut group: RecordedGroup,
    config: &FsdpConfig,
    freeze: &mut FreezePatterns,
) -> Result<ClassifiedGroup> {
    let recorded = std::mem::take(&mut group.recorded);
    let (buffer_recs, params): (Vec<_>, Vec<_>) = recorded.into_iter().partition(|p| {
        config
            .buffer_suffixes
            .iter()
            .any(|s| p.name.rsplit('.').next() == Some(s.as_str()))
    });
    let (frozen, trainable): (Vec<_>, Vec<_>) =
        params.into_iter().partition(|p| freeze.matches(&p.name));
    let first = &group.spec.members[0];
    let policy = match first.mixed_precision {
        Some(p) => p,
        None if buffer_recs.iter().any(|b| b.name.ends_with("running_mean")) => MixedPrecision {
            buffer_dtype: config.mixed_precision.buffer_dtype,
            ..MixedPrecision::full_f32()
        },
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
    let reshard = config.sharding_strategy.reshards_after_forward() && first.reshard_after_forward;
    Ok(ClassifiedGroup {
        group,
        trainable,
        frozen,
        buffers,
        policy,
        reshard,
    })
}

/// A parameter group laid out but not allocated yet.
struct PlannedGroup {
    name: String,
    recorded: Vec<RecordedParam>,
    layout: FlatParamLayout,
    buffers: Vec<(String, Var)>,
    policy: MixedPrecision,
    frozen: bool,
    reshard: bool,
}

/// Step 4: one flat layout per group and per frozen twin (`<group>[frozen]`, right after its
/// group), the members bound to them, and the checks that need the whole plan: every freeze
/// pattern matched, the memory budget holds. `pg` is the shard group.
fn plan_groups(
    groups: Vec<ClassifiedGroup>,
    config: &FsdpConfig,
    pg: &dyn ProcessGroup,
    freeze: &FreezePatterns,
) -> Result<(Vec<PlannedGroup>, Vec<Member>)> {
    let shard_world = match config.sharding_strategy {
        ShardingStrategy::NoShard => 1,
        _ => pg.world_size(),
    };
    let mut planned: Vec<PlannedGroup> = Vec::new();
    let mut members: Vec<Member> = Vec::new();
    for g in groups {
        let base = planned.len();
        let name = g.group.spec.name.clone();
        let mut plan = |name: String,
                        recorded: Vec<RecordedParam>,
                        buffers: Vec<(String, Var)>,
                        frozen: bool|
         -> Result<()> {
            let named: Vec<_> = recorded
                .iter()
                .map(|p| (p.name.clone(), p.shape.clone()))
                .collect();
            // A packed frozen twin's shards hold whole quantisation blocks.
            let multiple = if frozen {
                config.frozen_storage.block()
            } else {
                1
            };
            planned.push(PlannedGroup {
                layout: FlatParamLayout::with_shard_multiple(&named, shard_world, multiple)?,
                name,
                recorded,
                buffers,
                policy: g.policy,
                frozen,
                reshard: g.reshard,
            });
            Ok(())
        };
        let has_frozen = !g.frozen.is_empty();
        plan(name.clone(), g.trainable, g.buffers, false)?;
        if has_frozen {
            plan(format!("{name}[frozen]"), g.frozen, Vec::new(), true)?;
        }
        let group_units: Vec<usize> = (base..base + 1 + usize::from(has_frozen)).collect();
        for (m, names) in g.group.spec.members.into_iter().zip(g.group.member_names) {
            members.push(Member {
                spec: m,
                prefix: name.clone(),
                groups: group_units.clone(),
                params: names,
            });
        }
    }
    if let Some((kind, pattern)) = freeze.unused() {
        let mut names: Vec<&str> = planned
            .iter()
            .flat_map(|u| u.layout.params.iter().map(|p| p.name.as_str()))
            .collect();
        names.sort_unstable();
        return Err(Error::no_match(
            format!("{kind} pattern"),
            format!("{pattern:?}"),
            "parameter",
            format!("the parameters are: {}", names.join(", ")),
        ));
    }
    if let Some(budget) = &config.memory_budget {
        let sizes: Vec<super::budget::GroupSize> = planned
            .iter()
            .map(|u| {
                super::budget::GroupSize::of(
                    &u.layout,
                    &u.policy,
                    u.frozen,
                    if u.frozen {
                        config.frozen_storage
                    } else {
                        crate::quant::BaseDType::F32
                    },
                )
            })
            .collect();
        super::budget::check(&sizes, config, pg.world_size(), budget)?;
    }
    Ok((planned, members))
}

/// Step 5: allocates each group's shard and fills it piece by piece with
/// `fill(param, range_in_param, out)` (one group at a time); `pg` is the shard group.
fn allocate(
    planned: Vec<PlannedGroup>,
    config: &FsdpConfig,
    pg: &dyn ProcessGroup,
    fill: &mut impl FnMut(&RecordedParam, std::ops::Range<usize>, &mut [f32]) -> Result<()>,
) -> Result<Vec<ParamGroup>> {
    let shard_index = match config.sharding_strategy {
        ShardingStrategy::NoShard => 0,
        _ => pg.rank(),
    };
    planned
        .into_iter()
        .map(|u| {
            let recorded = u.recorded;
            let mut flat =
                FlatParameter::from_fn(u.layout, shard_index, &config.device, |i, range, out| {
                    fill(&recorded[i], range, out)
                })?;
            // Packed at once, one group at a time: the f32 shard of one frozen group at most.
            if u.frozen {
                flat.pack(config.frozen_storage)?;
            }
            let mut unit = ParamGroup::new(u.name, flat, u.buffers, u.policy, u.frozen);
            unit.reshard_after_forward = u.reshard;
            Ok(unit)
        })
        .collect()
}
