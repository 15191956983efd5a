//! Loading a sharded checkpoint: the reader's named steps (`match_names` … `check_tensors`),
//! `load_sharded`, `load_latest`, `load_latest_of_run`.

#[allow(unused_imports)]
use super::*;

/// A contiguous range of one saved shard to copy into the new shard.
#[derive(Debug, Clone, Copy)]
pub(super) struct Piece {
    /// Saved rank (file) holding it.
    file: usize,
    /// Saved unit.
    unit: usize,
    /// Offset inside the saved shard (elements).
    offset: usize,
    /// Elements.
    len: usize,
    /// Offset inside the new shard (elements).
    out: usize,
}

/// Why a checkpoint did not load: `damaged` when its files or metadata are damaged (an older
/// checkpoint may still load), otherwise it does not fit the model or the optimizer (no other
/// checkpoint of the run would either).
#[derive(Debug)]
pub(super) struct LoadError {
    error: Box<Error>,
    damaged: bool,
}

pub(super) fn damaged(error: Error) -> LoadError {
    LoadError {
        error: Box::new(error),
        damaged: true,
    }
}

pub(super) fn mismatch(error: Error) -> LoadError {
    LoadError {
        error: Box::new(error),
        damaged: false,
    }
}

/// What the optimizer gets from the checkpoint.
pub(super) struct OptimPlan {
    /// Kind and groups (`None`: a version-1/2 checkpoint; the optimizer keeps its own).
    hyper: Option<OptimizerHyper>,
    /// Optimizer steps taken.
    step: u64,
    /// Buffer kinds, resharded like the units.
    kinds: Vec<BufferKind>,
    /// Per model unit, the step count of each parameter (layout order).
    steps: Vec<Vec<u64>>,
}

/// A checked plan for loading one checkpoint into one rank's model and optimizer.
pub(super) struct Reader {
    meta: CheckpointMeta,
    files: HashMap<usize, MappedFile>,
    /// Per model unit, the pieces of its new shard.
    plans: Vec<Option<Vec<Piece>>>,
    optim: OptimPlan,
}

pub(super) fn meta_err(dir: &Path, msg: String) -> Error {
    Error::file(dir.join(META_FILE), msg)
}

/// Whether `dir`'s metadata is from a newer format (not damage: a newer reader loads it).
pub(super) fn newer_format(dir: &Path) -> bool {
    fs::read(dir.join(META_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v.get("format_version")?.as_u64())
        .is_some_and(|v| v > u64::from(FORMAT_VERSION))
}

/// Version-1 checkpoints do not list the optimizer buffers: find their kinds in rank 0's file
/// (reading a version-1 file is the only place tensor names are parsed).
pub(crate) fn discover_kinds(file0: &MappedFile) -> Vec<BufferKind> {
    let kinds: BTreeSet<BufferKind> = file0
        .names()
        .filter_map(|n| n.strip_prefix("optim."))
        .filter_map(|n| n.rsplit_once('.'))
        .filter_map(|(k, _)| serde_json::from_value(serde_json::Value::String(k.into())).ok())
        .collect();
    kinds.into_iter().collect()
}

/// Step 1: every parameter and buffer of the model is in the checkpoint with its shape, and
/// the checkpoint has none the model lacks.
pub(super) fn match_names(dir: &Path, meta: &CheckpointMeta, model: &FsdpModel) -> Result<()> {
    let mut saved: HashMap<&str, &ParamMeta> = HashMap::new();
    let mut saved_bufs: HashMap<&str, &BufferMeta> = HashMap::new();
    for u in &meta.units {
        for p in &u.params {
            saved.insert(&p.name, p);
        }
        for b in &u.buffers {
            saved_bufs.insert(&b.name, b);
        }
    }
    let mut missing = Vec::new();
    let mut known = BTreeSet::new();
    for u in model.shards() {
        for p in &u.layout.params {
            known.insert(p.name.as_str());
            match saved.get(p.name.as_str()) {
                None => missing.push(format!(
                    "{} (unit {}, shape {:?})",
                    p.name,
                    u.unit_name,
                    p.shape.dims()
                )),
                Some(sp) if sp.shape != p.shape.dims() => {
                    return Err(meta_err(
                        dir,
                        format!(
                            "parameter {}: the model expects shape {:?}, the checkpoint has {:?}",
                            p.name,
                            p.shape.dims(),
                            sp.shape
                        ),
                    ))
                }
                Some(_) => {}
            }
        }
        for (name, var) in u.buffers {
            known.insert(name.as_str());
            match saved_bufs.get(name.as_str()) {
                None => missing.push(format!(
                    "{name} (buffer of unit {}, shape {:?})",
                    u.unit_name,
                    var.dims()
                )),
                Some(b) if b.shape != var.dims() => {
                    return Err(meta_err(
                        dir,
                        format!(
                            "buffer {name}: the model expects shape {:?}, the checkpoint has {:?}",
                            var.dims(),
                            b.shape
                        ),
                    ))
                }
                Some(_) => {}
            }
        }
    }
    if !missing.is_empty() {
        return Err(meta_err(
            dir,
            format!(
                "{} parameter(s)/buffer(s) of the model missing from the checkpoint: {}",
                missing.len(),
                missing.join(", ")
            ),
        ));
    }
    let mut extra: Vec<String> = meta
        .units
        .iter()
        .flat_map(|u| {
            let params = u
                .params
                .iter()
                .map(move |p| (p.name.as_str(), &u.name, &p.shape, "parameter"));
            let bufs = u
                .buffers
                .iter()
                .map(move |b| (b.name.as_str(), &u.name, &b.shape, "buffer"));
            params.chain(bufs)
        })
        .filter(|(n, ..)| !known.contains(n))
        .map(|(n, unit, shape, what)| format!("{n} ({what} of unit {unit}, shape {shape:?})"))
        .collect();
    if !extra.is_empty() {
        extra.sort();
        return Err(meta_err(
            dir,
            format!(
                "the checkpoint has {} parameter(s)/buffer(s) the model does not have: {}",
                extra.len(),
                extra.join(", ")
            ),
        ));
    }
    Ok(())
}

/// Step 2: the pieces of every new shard: each part of a parameter in this rank's shard, as
/// contiguous ranges of saved shards, from the saved units' layouts (names matched by
/// [`match_names`]). `None` for a unit whose parameters an adapter-only checkpoint left to the
/// base ([`UnitMeta::in_base`]): it keeps what the model read from its base.
///
/// Errors: a unit with parameters both in the files and in the base, or a unit that trains
/// whose parameters the checkpoint left to the base (naming the unit and a parameter).
pub(super) fn plan_pieces(
    dir: &Path,
    saved: &[FlatParamLayout],
    in_base: &[bool],
    model: &FsdpModel,
) -> Result<Vec<Option<Vec<Piece>>>> {
    let mut by_name: HashMap<&str, (usize, usize)> = HashMap::new();
    for (j, l) in saved.iter().enumerate() {
        for p in &l.params {
            by_name.insert(&p.name, (j, p.offset));
        }
    }
    model
        .shards()
        .map(|u| {
            let layout = u.layout;
            let from_base: Vec<&str> = layout
                .params
                .iter()
                .filter(|p| in_base[by_name[p.name.as_str()].0])
                .map(|p| p.name.as_str())
                .collect();
            if let Some(first) = from_base.first() {
                if from_base.len() != layout.params.len() || !u.frozen {
                    return Err(meta_err(
                        dir,
                        format!(
                            "unit {}: the checkpoint left {first} to its frozen base, but the \
                             model's unit {} (an adapter-only checkpoint resumes a model with \
                             the same frozen parameters)",
                            u.unit_name,
                            if u.frozen {
                                "also holds parameters the checkpoint stores"
                            } else {
                                "trains"
                            }
                        ),
                    ));
                }
                return Ok(None);
            }
            let mut pieces = Vec::new();
            for e in layout.shard_table(u.shard_index) {
                let p = &layout.params[e.param_index];
                let (j, offset) = by_name[p.name.as_str()];
                let n = saved[j].shard_numel;
                let mut flat = offset + e.range_in_param.start;
                let mut done = 0;
                while done < e.numel_in_shard {
                    let (s, off) = (flat / n, flat % n);
                    let len = (n - off).min(e.numel_in_shard - done);
                    pieces.push(Piece {
                        file: s,
                        unit: j,
                        offset: off,
                        len,
                        out: e.offset_in_shard + done,
                    });
                    flat += len;
                    done += len;
                }
            }
            Ok(Some(pieces))
        })
        .collect()
}

/// Step 2b: an adapter-only checkpoint ([`UnitMeta::in_base`]) resumes only a model built from
/// the same base ([`FsdpModel::base`], [`crate::base::BaseIdentity::check`]).
///
/// Errors: the model knows no base, or another one (naming the file that differs).
pub(super) fn check_base(dir: &Path, meta: &CheckpointMeta, model: &FsdpModel) -> Result<()> {
    if !meta.units.iter().any(|u| u.in_base) {
        return Ok(());
    }
    let Some(recorded) = &meta.train.base else {
        return Err(meta_err(
            dir,
            "units are marked as left to the frozen base, but no base is recorded".into(),
        ));
    };
    match model.base() {
        Some(found) => recorded
            .check(found)
            .map_err(|e| meta_err(dir, root_message(e))),
        None => Err(meta_err(
            dir,
            format!(
                "an adapter-only checkpoint (its frozen base is {}), and the model knows no \
                 base: build it from that directory (build_from_hf_with, --from-hf) or record \
                 it with FsdpModel::set_base",
                recorded.dir.display()
            ),
        )),
    }
}

/// Step 3: maps the files holding a piece (and rank 0's when there are buffers to read or
/// the optimizer buffers must be discovered), checking each file's size and header.
pub(super) fn open_files(
    dir: &Path,
    meta: &CheckpointMeta,
    plans: &[Option<Vec<Piece>>],
    model: &FsdpModel,
    stats: &mut ReadStats,
) -> Result<HashMap<usize, MappedFile>> {
    let mut needed: BTreeSet<usize> = plans.iter().flatten().flatten().map(|p| p.file).collect();
    let has_buffers = model
        .shards()
        .zip(plans)
        .any(|(u, p)| p.is_some() && !u.buffers.is_empty());
    if has_buffers || meta.optimizer.is_none() {
        needed.insert(0);
    }
    let mut files = HashMap::new();
    for s in needed {
        let (name, bytes) = match meta.files.get(s) {
            Some(f) => (f.name.clone(), Some(f.bytes)),
            None => (shard_file_name(s, meta.world_size), None),
        };
        let f = MappedFile::open(&dir.join(name), bytes, stats)?;
        let (r, w) = (f.metadata.get("rank"), f.metadata.get("world_size"));
        if let (Some(r), Some(w)) = (r, w) {
            if *r != s.to_string() || *w != meta.world_size.to_string() {
                return Err(Error::file(
                    &f.path,
                    format!(
                        "expected the file of rank {s} of {}, found rank {r} of {w}",
                        meta.world_size
                    ),
                ));
            }
        }
        files.insert(s, f);
    }
    Ok(files)
}

/// Step 4: what the optimizer gets: its kind and groups must be the saved ones; per model
/// parameter its step count, by name.
pub(super) fn classify_optimizer(
    dir: &Path,
    meta: &CheckpointMeta,
    files: &HashMap<usize, MappedFile>,
    model: &FsdpModel,
    optim: &dyn ShardedOptimizer,
) -> Result<OptimPlan> {
    let (hyper, step, kinds, by_name) = match &meta.optimizer {
        Some(o) => (
            o.hyper.clone(),
            o.step,
            o.buffer_kinds.clone(),
            o.param_steps.clone(),
        ),
        None => {
            // Version 1: one optimizer-wide step, the train step.
            let kinds = discover_kinds(&files[&0]);
            let step = if kinds.is_empty() { 0 } else { meta.train.step };
            let by_name = meta
                .units
                .iter()
                .flat_map(|u| &u.params)
                .filter(|_| step > 0)
                .map(|p| (p.name.clone(), step))
                .collect();
            (None, step, kinds, by_name)
        }
    };
    if let Some(h) = &hyper {
        check_loadable(optim.kind(), &optim.hyper(), h)
            .map_err(|e| meta_err(dir, root_message(e)))?;
    }
    let steps = if kinds.is_empty() && by_name.is_empty() {
        Vec::new()
    } else {
        model
            .shards()
            .map(|u| {
                u.layout
                    .params
                    .iter()
                    .map(|p| by_name.get(&p.name).copied().unwrap_or(0))
                    .collect()
            })
            .collect()
    };
    Ok(OptimPlan {
        hyper,
        step,
        kinds,
        steps,
    })
}

/// The message of an argument error without its variant's prefix.
pub(crate) fn root_message(e: Error) -> String {
    e.argument_text().unwrap_or_else(|| e.to_string())
}

/// Step 5: every tensor that will be read exists with its dtype and shape, and its data
/// matches its recorded CRC-32C (the whole tensor is checked, also where only a range is
/// copied).
pub(super) fn check_tensors(
    dir: &Path,
    meta: &CheckpointMeta,
    files: &HashMap<usize, MappedFile>,
    plans: &[Option<Vec<Piece>>],
    kinds: &[BufferKind],
    model: &FsdpModel,
) -> Result<()> {
    let mut checks: BTreeSet<(usize, String, Dtype, Vec<usize>)> = BTreeSet::new();
    let state_dtype = meta
        .optimizer
        .as_ref()
        .map_or(Dtype::F32, |o| o.state_dtype);
    for p in plans.iter().flatten().flatten() {
        let n = meta.units[p.unit].shard_numel;
        checks.insert((p.file, param_tensor(p.unit), Dtype::F32, vec![n]));
        if meta.units[p.unit].no_optim_state {
            continue;
        }
        for kind in kinds {
            checks.insert((p.file, optim_tensor(*kind, p.unit), state_dtype, vec![n]));
        }
    }
    let saved_bufs: HashMap<&str, &BufferMeta> = meta
        .units
        .iter()
        .flat_map(|u| &u.buffers)
        .map(|b| (b.name.as_str(), b))
        .collect();
    for (u, _) in model.shards().zip(plans).filter(|(_, p)| p.is_some()) {
        for (name, _) in u.buffers {
            let b = saved_bufs[name.as_str()];
            let dtype: Dtype = serde_json::from_value(serde_json::Value::String(b.dtype.clone()))
                .map_err(|_| {
                meta_err(dir, format!("buffer {name}: unknown dtype {}", b.dtype))
            })?;
            checks.insert((0, buffer_tensor(name), dtype, b.shape.clone()));
        }
    }
    for (s, name, dtype, shape) in &checks {
        let f = &files[s];
        f.check(name, *dtype, shape)?;
        if let Some(expected) = meta.files.get(*s).and_then(|m| m.crc32c.get(name)) {
            let found = f.crc32c(name)?;
            if found != *expected {
                return Err(Error::file(
                    &f.path,
                    format!(
                        "tensor {name}: data damaged: CRC-32C {found:#010x}, {} recorded \
                         {expected:#010x}",
                        META_FILE
                    ),
                ));
            }
        }
    }
    Ok(())
}

impl Reader {
    /// Reads the metadata and runs the steps: match names and shapes, plan the pieces, open
    /// the files, classify the optimizer state, check the tensors. Reads no tensor data but
    /// the checksummed bytes.
    fn prepare(
        dir: &Path,
        model: &FsdpModel,
        optim: &dyn ShardedOptimizer,
        stats: &mut ReadStats,
    ) -> std::result::Result<Self, LoadError> {
        let meta = read_meta(dir).map_err(|e| LoadError {
            error: Box::new(e),
            damaged: !newer_format(dir),
        })?;
        match_names(dir, &meta, model).map_err(mismatch)?;
        check_base(dir, &meta, model).map_err(mismatch)?;
        let saved = meta
            .units
            .iter()
            .map(UnitMeta::to_layout)
            .collect::<Result<Vec<_>>>()
            .map_err(|e| damaged(meta_err(dir, root_message(e))))?;
        let in_base: Vec<bool> = meta.units.iter().map(|u| u.in_base).collect();
        let plans = plan_pieces(dir, &saved, &in_base, model).map_err(mismatch)?;
        let files = open_files(dir, &meta, &plans, model, stats).map_err(damaged)?;
        let optim = classify_optimizer(dir, &meta, &files, model, optim).map_err(mismatch)?;
        check_tensors(dir, &meta, &files, &plans, &optim.kinds, model).map_err(damaged)?;
        Ok(Self {
            meta,
            files,
            plans,
            optim,
        })
    }

    /// Fills a buffer of one model unit's new shard length from the saved tensors
    /// `tensor(saved unit)`.
    fn fill(
        &self,
        k: usize,
        shard_numel: usize,
        tensor: impl Fn(usize) -> String,
        stats: &mut ReadStats,
    ) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; shard_numel];
        for p in self.plans[k].iter().flatten() {
            self.files[&p.file].read_f32(
                &tensor(p.unit),
                p.offset..p.offset + p.len,
                &mut out[p.out..p.out + p.len],
                stats,
            )?;
        }
        Ok(out)
    }

    /// Copies everything into the model and the optimizer.
    fn apply(
        self,
        model: &mut FsdpModel,
        optim: &mut dyn ShardedOptimizer,
        stats: &mut ReadStats,
    ) -> Result<CheckpointMeta> {
        let device = model.config().device.clone();
        // Release the old optimizer state before the new one is allocated.
        optim.clear_state();
        let shard_numels: Vec<usize> = model.shards().map(|u| u.layout.shard_numel).collect();
        let mut units = Vec::new();
        for (k, &n) in shard_numels.iter().enumerate() {
            if self.plans[k].is_none() {
                // Left to the base: the model's values are the base's; never stepped, so no
                // optimizer state.
                if !self.optim.steps.is_empty() {
                    units.push(UnitOptimState {
                        steps: self.optim.steps[k].clone(),
                        buffers: BTreeMap::new(),
                    });
                }
                continue;
            }
            let shard = self.fill(k, n, param_tensor, stats)?;
            model.set_unit_shard(k, Tensor::from_vec(shard, n, &device)?)?;
            // Saved without optimizer state (frozen, never stepped): none to read.
            let pieces = self.plans[k].as_deref().unwrap_or(&[]);
            let stateless = !pieces.is_empty()
                && pieces
                    .iter()
                    .all(|p| self.meta.units[p.unit].no_optim_state);
            if !self.optim.steps.is_empty() {
                let mut buffers = BTreeMap::new();
                for kind in self.optim.kinds.iter().filter(|_| !stateless) {
                    let v = self.fill(k, n, |j| optim_tensor(*kind, j), stats)?;
                    buffers.insert(*kind, v);
                }
                units.push(UnitOptimState {
                    steps: self.optim.steps[k].clone(),
                    buffers,
                });
            }
        }
        for (u, _) in model.shards().zip(&self.plans).filter(|(_, p)| p.is_some()) {
            for (name, var) in u.buffers {
                let t = self.files[&0].read_tensor(
                    &buffer_tensor(name),
                    var.dtype(),
                    &device,
                    stats,
                )?;
                var.set(&t)?;
            }
        }
        optim.load_state(OptimizerState {
            hyper: self.optim.hyper.clone().unwrap_or_else(|| optim.hyper()),
            step: self.optim.step,
            units,
        })?;
        model.zero_grad();
        let mut meta = self.meta;
        if meta.optimizer.is_none() {
            meta.optimizer = Some(OptimizerMeta {
                step: self.optim.step,
                hyper: None,
                buffer_kinds: self.optim.kinds.clone(),
                param_steps: BTreeMap::new(),
                buffers: Vec::new(),
                state_dtype: Dtype::F32,
            });
        }
        Ok(meta)
    }
}

/// As [`agree`] for a load: also agrees on whether any rank found the checkpoint damaged.
pub(super) fn agree_load(
    pg: &dyn crate::comm::ProcessGroup,
    dir: &Path,
    local: std::result::Result<(), LoadError>,
) -> std::result::Result<(), LoadError> {
    let (rank, ws) = (pg.rank(), pg.world_size());
    if ws == 1 {
        return local;
    }
    let mut flags = vec![0.0f32; ws];
    if let Err(e) = &local {
        flags[rank] = if e.damaged { 2.0 } else { 1.0 };
    }
    let flags = pg.all_reduce_f32s(flags, ReduceOp::Sum).map_err(mismatch)?;
    let any_damaged = flags.iter().any(|&f| f > 1.5);
    let failed: Vec<usize> = (0..ws).filter(|&r| flags[r] > 0.0).collect();
    if failed.is_empty() {
        return Ok(());
    }
    let reasons = super::super::exchange_reasons(
        pg,
        local.as_ref().err().map(|e| e.error.to_string()),
        &failed,
    )
    .map_err(mismatch)?;
    if let Err(e) = local {
        return Err(LoadError {
            error: e.error,
            damaged: any_damaged,
        });
    }
    Err(LoadError {
        error: Box::new(Error::PeersFailed {
            what: "loading the checkpoint".into(),
            path: dir.to_path_buf(),
            rank,
            failed_ranks: failed,
            reasons,
        }),
        damaged: any_damaged,
    })
}

/// One load attempt (a collective), classifying a failure.
pub(super) fn load_dir(
    dir: &Path,
    model: &mut FsdpModel,
    optim: &mut dyn ShardedOptimizer,
) -> std::result::Result<Loaded, LoadError> {
    let pg = model.process_group().clone();
    let mut stats = ReadStats::default();
    let (reader, local) = match Reader::prepare(dir, model, optim, &mut stats) {
        Ok(r) => (Some(r), Ok(())),
        Err(e) => (None, Err(e)),
    };
    agree_load(pg.as_ref(), dir, local)?;
    let reader = reader.expect("prepared on every rank");
    let meta = reader.apply(model, optim, &mut stats).map_err(mismatch)?;
    // A run fingerprint continues at the checkpoint's step (a resumed run's records carry the
    // uninterrupted run's step numbers).
    model.set_fingerprint_step(meta.train.step);
    Ok(Loaded {
        dir: dir.to_path_buf(),
        meta,
        stats,
        skipped: Vec::new(),
    })
}

/// Loads the sharded checkpoint in `dir` into `model` and `optim` (a collective), at the saved
/// world size or any other, and under any sharding strategy.
///
/// Each rank maps only the saved files that cover its new shard (plus rank 0's for buffers),
/// verifies the CRC-32C of every tensor it reads from, and copies only its element ranges;
/// gradients are dropped. The optimizer gets the saved hyper-parameters of every group (lr
/// included), its per-parameter step counts and its buffers. The training state is in the
/// returned metadata (`loaded.meta.train`): restoring the sampler, the LR scheduler
/// ([`crate::LrScheduler::from_state`]), the grad scaler and the like is the caller's part.
///
/// Errors (on every rank; model and optimizer unchanged), naming file, tensor and expected vs
/// found: a missing or unreadable `meta.json` or shard file; metadata that does not parse, is
/// inconsistent or is from a newer format version; a shard file truncated, corrupt or of the
/// wrong rank; tensor data whose checksum does not match; a parameter or buffer of the model
/// missing from the checkpoint, or one of the checkpoint the model does not have; a shape or
/// dtype mismatch; an optimizer of another kind than the saved one (naming both) or with other
/// parameter groups.
pub fn load_sharded(
    dir: &Path,
    model: &mut FsdpModel,
    optim: &mut dyn ShardedOptimizer,
) -> Result<Loaded> {
    let step = model.step();
    load_dir(dir, model, optim).map_err(|e| e.error.in_checkpoint(step))
}

/// The candidates of a newest-first load, chosen by rank 0 and broadcast (a collective), so
/// every rank tries the same checkpoints in the same order.
pub(super) fn agree_on_candidates(
    pg: &dyn crate::comm::ProcessGroup,
    root: &Path,
    pick: impl FnOnce() -> Result<Vec<PathBuf>>,
) -> Result<Vec<PathBuf>> {
    let local = if pg.rank() == 0 {
        pick()
    } else {
        Ok(Vec::new())
    };
    let (local, dirs) = match local {
        Ok(d) => (Ok(()), d),
        Err(e) => (Err(e), Vec::new()),
    };
    agree(pg, "choosing the checkpoint to load", root, local)?;
    let steps: Vec<u64> = dirs
        .iter()
        .rev()
        .filter_map(|p| parse_step_dir(p.file_name()?.to_str()?))
        .collect();
    let steps = if pg.world_size() == 1 {
        steps
    } else {
        let n = pg.broadcast_u64s(vec![steps.len() as u64], 0)?[0] as usize;
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut v = steps;
        v.resize(n, 0);
        pg.broadcast_u64s(v, 0)?
    };
    Ok(steps
        .into_iter()
        .map(|s| root.join(step_dir_name(s)))
        .collect())
}

/// Renames a damaged checkpoint to `step-<n>.damaged` (or `.damaged-<i>`), out of the list of
/// complete ones, and returns the new path.
pub(super) fn set_aside(dir: &Path) -> Option<PathBuf> {
    let name = dir.file_name()?.to_str()?;
    let root = dir.parent()?;
    let target = (0..100)
        .map(|i| match i {
            0 => root.join(format!("{name}.damaged")),
            i => root.join(format!("{name}.damaged-{i}")),
        })
        .find(|p| !p.exists())?;
    fs::rename(dir, &target).ok()?;
    sync_dir(root);
    Some(target)
}

/// Tries `candidates` newest first; a damaged one is reported, renamed for inspection (rank
/// 0) and passed over.
pub(super) fn load_first_good(
    root: &Path,
    candidates: Vec<PathBuf>,
    model: &mut FsdpModel,
    optim: &mut dyn ShardedOptimizer,
) -> Result<Option<Loaded>> {
    let pg = model.process_group().clone();
    let mut skipped = Vec::new();
    for dir in candidates {
        match load_dir(&dir, model, optim) {
            Ok(mut l) => {
                l.skipped = skipped;
                return Ok(Some(l));
            }
            Err(e) if e.damaged => {
                let renamed = if pg.rank() == 0 {
                    set_aside(&dir)
                } else {
                    None
                };
                let flag = if pg.world_size() == 1 {
                    u64::from(renamed.is_some())
                } else {
                    pg.broadcast_u64s(vec![u64::from(renamed.is_some())], 0)?[0]
                };
                let renamed_to = (flag == 1).then(|| {
                    renamed.unwrap_or_else(|| {
                        let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("step");
                        root.join(format!("{name}.damaged"))
                    })
                });
                tracing::warn!(
                    "checkpoint {} is damaged and was skipped ({}); renamed to {:?}",
                    dir.display(),
                    e.error,
                    renamed_to
                );
                skipped.push(SkippedCheckpoint {
                    dir,
                    renamed_to,
                    error: e.error.to_string(),
                });
            }
            Err(e) => return Err(*e.error),
        }
    }
    if skipped.is_empty() {
        return Ok(None);
    }
    Err(Error::file(
        root,
        format!(
            "no loadable checkpoint: every candidate is damaged: {}",
            skipped
                .iter()
                .map(|s| match &s.renamed_to {
                    Some(to) => format!(
                        "{} ({}; set aside as {})",
                        s.dir.display(),
                        s.error,
                        to.display()
                    ),
                    None => format!("{} ({})", s.dir.display(), s.error),
                })
                .collect::<Vec<_>>()
                .join("; ")
        ),
    ))
}

/// Loads the newest complete checkpoint under `root`, if any (a collective: rank 0 picks the
/// candidates and broadcasts them, so every rank loads the same one; see [`load_sharded`]).
///
/// When the newest fails to load because it is damaged (a truncated or missing file, a bad
/// header or metadata, a checksum mismatch), the previous one is tried, and so on: the damaged
/// ones are renamed to `step-<n>.damaged` for inspection and listed in
/// [`Loaded::skipped`] (and logged with `tracing::warn!`). A checkpoint that does not fit the
/// model or the optimizer is an error, not skipped.
///
/// Errors: as [`load_sharded`]; `root` holds checkpoints of more than one run (naming each run
/// and its newest checkpoint): resuming would silently pick another run's weights, so choose
/// with [`load_latest_of_run`] or load a directory with [`load_sharded`]; every candidate is
/// damaged.
pub fn load_latest(
    root: &Path,
    model: &mut FsdpModel,
    optim: &mut dyn ShardedOptimizer,
) -> Result<Option<Loaded>> {
    let step = model.step();
    let result = (|| -> Result<Option<Loaded>> {
        let pg = model.process_group().clone();
        let candidates = agree_on_candidates(pg.as_ref(), root, || {
            let all = list_complete(root)?;
            // Unreadable metadata names no run: such a checkpoint stays a candidate (it will
            // be found damaged and passed over).
            let mut runs: BTreeMap<Option<String>, PathBuf> = BTreeMap::new();
            for d in &all {
                if let Some(r) = read_run(d) {
                    runs.insert(r, d.clone());
                }
            }
            if runs.len() > 1 {
                let list: Vec<String> = runs
                    .iter()
                    .map(|(r, d)| {
                        format!(
                            "run {} (newest {})",
                            r.as_deref().unwrap_or("<anonymous>"),
                            d.file_name().and_then(|n| n.to_str()).unwrap_or("?")
                        )
                    })
                    .collect();
                return Err(Error::file(
                    root,
                    format!(
                        "holds checkpoints of {} runs: {}; loading the newest would silently \
                         pick one of them: load one explicitly (--resume-from PATH, \
                         load_sharded) or by run id (load_latest_of_run)",
                        runs.len(),
                        list.join(", ")
                    ),
                ));
            }
            Ok(all)
        })?;
        load_first_good(root, candidates, model, optim)
    })();
    result.map_err(|e| e.in_checkpoint(step))
}

/// As [`load_latest`], among the checkpoints of run `run_id` only (`None`: the anonymous run,
/// checkpoints saved without a run id); other runs' checkpoints under `root` are ignored.
///
/// Errors: as [`load_latest`], without the several-runs error.
pub fn load_latest_of_run(
    root: &Path,
    run_id: Option<&str>,
    model: &mut FsdpModel,
    optim: &mut dyn ShardedOptimizer,
) -> Result<Option<Loaded>> {
    let step = model.step();
    let result = (|| -> Result<Option<Loaded>> {
        let pg = model.process_group().clone();
        let candidates = agree_on_candidates(pg.as_ref(), root, || list_run(root, run_id))?;
        load_first_good(root, candidates, model, optim)
    })();
    result.map_err(|e| e.in_checkpoint(step))
}
