//! Sharded state dict: one safetensors file per rank plus `meta.json`, loadable at any world
//! size (see the module docs of [`crate::checkpoint`] for the layout).
//!
//! Resharding: a parameter sits at the same offset of its unit's flat buffer whatever the world
//! size (offsets are aligned to [`crate::flat_param::ALIGN_ELEMS`], independent of it); only the
//! final padding and the shard boundaries move. A loading rank walks its new shard table
//! (which part of which parameter its shard holds), looks each parameter up by name in the
//! saved layouts (so units may even be regrouped), turns the part into a range of the saved
//! unit's flat buffer, and splits that range at the saved shard boundaries: each piece is a
//! contiguous element range of one saved rank's file, copied out of the memory map. Optimizer
//! buffers laid out like a unit's shard (`exp_avg.3`, …) are resharded by the same pieces.
//! Alignment gaps and padding stay zero.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::Tensor;
use safetensors::Dtype;

use super::io::{st_dtype, sync_dir, MappedFile, SafetensorsWriter, TensorSpec};
use super::{
    agree, agree_on_latest, fault, list_complete, read_meta, step_dir_name, write_atomic,
    BufferMeta, CheckpointMeta, FileMeta, Loaded, OptimBufferMeta, OptimizerMeta, ParamMeta,
    ReadStats, TrainState, UnitMeta, FORMAT_VERSION, META_FILE,
};
use crate::error::{Error, Result};
use crate::fsdp::FsdpModel;
use crate::ops::with_host_f32;
use crate::optim::{OptimizerState, ShardedOptimizer};
use crate::shard_view::ShardView;

/// Value of the `format` entry of a shard file's safetensors metadata.
pub const SHARDED_FORMAT: &str = "candle-fsdp/sharded";

/// File name of rank `rank`'s shards in a checkpoint of `world_size` ranks
/// (`shard-00001-of-00002.safetensors`).
pub fn shard_file_name(rank: usize, world_size: usize) -> String {
    format!("shard-{rank:05}-of-{world_size:05}.safetensors")
}

fn unit_metas(model: &FsdpModel) -> Result<Vec<UnitMeta>> {
    model
        .shards()
        .map(|u| {
            let l = u.layout;
            Ok(UnitMeta {
                name: u.unit_name.to_string(),
                dtype: "F32".into(),
                world_size: l.world_size,
                unpadded_numel: l.unpadded_numel,
                padded_numel: l.padded_numel,
                shard_numel: l.shard_numel,
                params: l
                    .params
                    .iter()
                    .map(|p| ParamMeta {
                        name: p.name.clone(),
                        shape: p.shape.dims().to_vec(),
                        offset: p.offset,
                        numel: p.numel,
                    })
                    .collect(),
                buffers: u
                    .buffers
                    .iter()
                    .map(|(name, var)| {
                        Ok(BufferMeta {
                            name: name.clone(),
                            shape: var.dims().to_vec(),
                            dtype: format!("{:?}", st_dtype(var.dtype())?),
                        })
                    })
                    .collect::<Result<_>>()?,
            })
        })
        .collect()
}

/// Which optimizer buffers are laid out like a unit's shard (`<kind>.<unit>` of that length).
fn classify_optim(model: &FsdpModel, state: &OptimizerState) -> Vec<OptimBufferMeta> {
    let shard_numels: Vec<usize> = model.shards().map(|u| u.layout.shard_numel).collect();
    state
        .buffers
        .iter()
        .map(|(name, v)| OptimBufferMeta {
            name: name.clone(),
            unit: name
                .rsplit_once('.')
                .and_then(|(_, k)| k.parse::<usize>().ok())
                .filter(|&k| shard_numels.get(k) == Some(&v.len())),
        })
        .collect()
}

/// Writes this rank's file: its shards of the units it holds a shard of, the matching optimizer
/// buffers, rank-local optimizer buffers, and (rank 0) the buffers.
fn write_rank_file(
    path: &Path,
    model: &FsdpModel,
    state: &OptimizerState,
    obufs: &[OptimBufferMeta],
    rank: usize,
    ws: usize,
) -> Result<u64> {
    let units: Vec<ShardView> = model.shards().collect();
    // Shard s of a unit lives in rank s's file; under NO_SHARD (one shard) only rank 0 has it.
    let holds = |k: usize| units[k].layout.world_size > rank;
    let mut specs = Vec::new();
    for (k, u) in units.iter().enumerate() {
        if holds(k) {
            specs.push(TensorSpec::f32(format!("param.{k}"), u.layout.shard_numel));
        }
    }
    for b in obufs {
        if b.unit.is_none_or(holds) {
            specs.push(TensorSpec::f32(
                format!("optim.{}", b.name),
                state.buffers[&b.name].len(),
            ));
        }
    }
    if rank == 0 {
        for u in &units {
            for (name, var) in u.buffers {
                specs.push(TensorSpec {
                    name: format!("buffer.{name}"),
                    dtype: st_dtype(var.dtype())?,
                    shape: var.dims().to_vec(),
                });
            }
        }
    }
    let meta = HashMap::from([
        ("format".to_string(), SHARDED_FORMAT.to_string()),
        ("format_version".to_string(), FORMAT_VERSION.to_string()),
        ("rank".to_string(), rank.to_string()),
        ("world_size".to_string(), ws.to_string()),
    ]);
    let mut w = SafetensorsWriter::create(path, specs, meta)?;
    for (k, u) in units.iter().enumerate() {
        if holds(k) {
            with_host_f32(u.param, |s| w.write_f32(&format!("param.{k}"), s))??;
        }
    }
    for b in obufs {
        if b.unit.is_none_or(holds) {
            w.write_f32(&format!("optim.{}", b.name), &state.buffers[&b.name])?;
        }
    }
    if rank == 0 {
        for u in &units {
            for (name, var) in u.buffers {
                w.write_tensor(&format!("buffer.{name}"), var.as_tensor())?;
            }
        }
    }
    w.finish()
}

/// Rank 0: removes a stale staging directory of the same step and creates a fresh one.
pub(crate) fn prepare_staging(root: &Path, staging: &Path) -> Result<()> {
    fs::create_dir_all(root).map_err(|e| Error::io(root, e))?;
    if staging.exists() {
        fs::remove_dir_all(staging).map_err(|e| Error::io(staging, e))?;
    }
    fs::create_dir(staging).map_err(|e| Error::io(staging, e))?;
    sync_dir(root);
    Ok(())
}

/// Rank 0: writes `meta.json` into the staging directory, renames it to its final name
/// (replacing a checkpoint of the same step) and rotates.
pub(crate) fn publish(
    root: &Path,
    staging: &Path,
    final_dir: &Path,
    meta: &CheckpointMeta,
    keep_last: usize,
) -> Result<()> {
    let json = serde_json::to_vec_pretty(meta).expect("metadata serialises");
    write_atomic(&staging.join(META_FILE), &json)?;
    sync_dir(staging);
    let name = final_dir
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("step");
    let replaced = root.join(format!(".{name}.replaced"));
    let had_old = final_dir.exists();
    if had_old {
        if replaced.exists() {
            fs::remove_dir_all(&replaced).map_err(|e| Error::io(&replaced, e))?;
        }
        fs::rename(final_dir, &replaced).map_err(|e| Error::io(final_dir, e))?;
    }
    if let Err(e) = fs::rename(staging, final_dir) {
        if had_old {
            let _ = fs::rename(&replaced, final_dir);
        }
        return Err(Error::io(final_dir, e));
    }
    sync_dir(root);
    if had_old {
        let _ = fs::remove_dir_all(&replaced);
    }
    if keep_last > 0 {
        if let Err(e) = rotate(root, final_dir, keep_last) {
            tracing::warn!("checkpoint rotation under {}: {e}", root.display());
        }
    }
    Ok(())
}

/// Deletes the oldest complete checkpoints other than `keep` until `keep_last` remain
/// (`keep` counting as one). Each is renamed to a hidden name first, so a crash during the
/// deletion never leaves a partly deleted directory that looks complete.
fn rotate(root: &Path, keep: &Path, keep_last: usize) -> Result<()> {
    let mut all = list_complete(root)?;
    all.retain(|p| p != keep);
    while all.len() + 1 > keep_last {
        let old = all.remove(0);
        let name = old.file_name().and_then(|n| n.to_str()).unwrap_or("step");
        let trash = root.join(format!(".{name}.deleting"));
        fs::rename(&old, &trash).map_err(|e| Error::io(&old, e))?;
        fs::remove_dir_all(&trash).map_err(|e| Error::io(&trash, e))?;
    }
    sync_dir(root);
    Ok(())
}

/// Saves a sharded checkpoint of `model` and `optim` as `<root>/step-<state.step>/` (a
/// collective) and returns that directory.
///
/// Each rank writes its file (its shards of the parameters and of the optimizer state; rank 0
/// also the buffers) into a hidden staging directory; when every rank succeeded, rank 0 writes
/// `meta.json` (layouts, optimizer buffers, file sizes and `state`; the model's mixed-precision
/// policy when `state.mixed_precision` is `None`) and renames the staging directory into place,
/// replacing a checkpoint of the same step. `keep_last`: complete checkpoints kept under `root`
/// (older ones, by step, are deleted after the new one is complete; the new one is never
/// deleted); 0 keeps all. Memory: one copy of this rank's optimizer state
/// ([`ShardedOptimizer::state`]) plus 64 KiB of conversion buffer.
///
/// Errors (on every rank; previous checkpoints untouched, the staging directory removed): any
/// rank failing to write (naming its file), or a collective failure.
pub fn save_sharded(
    root: &Path,
    model: &FsdpModel,
    optim: &dyn ShardedOptimizer,
    state: &TrainState,
    keep_last: usize,
) -> Result<PathBuf> {
    let step = model.step();
    let result = (|| -> Result<PathBuf> {
        let pg = model.process_group().clone();
        let (rank, ws) = (pg.rank(), pg.world_size());
        let name = step_dir_name(state.step);
        let final_dir = root.join(&name);
        let staging = root.join(format!(".{name}.partial"));
        let prep = if rank == 0 {
            prepare_staging(root, &staging)
        } else {
            Ok(())
        };
        agree(
            pg.as_ref(),
            "preparing the checkpoint directory",
            &staging,
            prep,
        )?;
        let file = staging.join(shard_file_name(rank, ws));
        let (written, obufs, optim_step) = match optim.state() {
            Ok(ostate) => {
                let obufs = classify_optim(model, &ostate);
                let written = write_rank_file(&file, model, &ostate, &obufs, rank, ws).map(|_| ());
                (written, obufs, ostate.step)
            }
            Err(e) => (Err(e), Vec::new(), 0),
        };
        let cleanup = |staging: &Path| {
            if rank == 0 && !fault::crash_mode() {
                let _ = fs::remove_dir_all(staging);
            }
        };
        if let Err(e) = agree(
            pg.as_ref(),
            "writing the checkpoint shards",
            &staging,
            written,
        ) {
            cleanup(&staging);
            return Err(e);
        }
        let finished = if rank == 0 {
            (|| -> Result<()> {
                let files = (0..ws)
                    .map(|r| {
                        let name = shard_file_name(r, ws);
                        let p = staging.join(&name);
                        let bytes = fs::metadata(&p).map_err(|e| Error::io(&p, e))?.len();
                        Ok(FileMeta {
                            rank: r,
                            name,
                            bytes,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                let mut train = state.clone();
                if train.mixed_precision.is_none() {
                    train.mixed_precision =
                        serde_json::to_value(model.config().mixed_precision).ok();
                }
                let meta = CheckpointMeta {
                    format_version: FORMAT_VERSION,
                    world_size: ws,
                    strategy: Some(
                        super::strategy_name(model.config().sharding_strategy).to_string(),
                    ),
                    train,
                    dtype: "F32".into(),
                    units: unit_metas(model)?,
                    optimizer: Some(OptimizerMeta {
                        step: optim_step,
                        buffers: obufs.clone(),
                    }),
                    files,
                };
                publish(root, &staging, &final_dir, &meta, keep_last)
            })()
        } else {
            Ok(())
        };
        if finished.is_err() {
            cleanup(&staging);
        }
        agree(
            pg.as_ref(),
            "completing the checkpoint",
            &final_dir,
            finished,
        )?;
        Ok(final_dir)
    })();
    result.map_err(|e| e.in_checkpoint(step))
}

/// A contiguous range of one saved shard to copy into the new shard.
#[derive(Debug, Clone, Copy)]
struct Piece {
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

/// A checked plan for loading one checkpoint into one rank's model.
struct Reader {
    meta: CheckpointMeta,
    files: HashMap<usize, MappedFile>,
    /// Per model unit, the pieces of its new shard.
    plans: Vec<Vec<Piece>>,
    /// Optimizer buffer kinds resharded like the units (`exp_avg`, …).
    kinds: Vec<String>,
    /// Rank-local optimizer buffers read as they are (same world size only).
    local_bufs: Vec<String>,
    /// Optimizer steps.
    optim_step: u64,
}

fn meta_err(dir: &Path, msg: String) -> Error {
    Error::file(dir.join(META_FILE), msg)
}

/// Version-1 checkpoints do not list the optimizer buffers: find them in rank 0's file.
pub(crate) fn discover_optimizer(meta: &CheckpointMeta, file0: &MappedFile) -> OptimizerMeta {
    let mut buffers: Vec<OptimBufferMeta> = file0
        .names()
        .filter_map(|n| n.strip_prefix("optim."))
        .map(|name| {
            let len = file0
                .info(&format!("optim.{name}"))
                .map(|i| i.shape.iter().product::<usize>());
            let unit = name
                .rsplit_once('.')
                .and_then(|(_, k)| k.parse::<usize>().ok())
                .filter(|&k| k < meta.units.len() && Some(meta.units[k].shard_numel) == len);
            OptimBufferMeta {
                name: name.to_string(),
                unit,
            }
        })
        .collect();
    buffers.sort_by(|a, b| a.name.cmp(&b.name));
    OptimizerMeta {
        step: meta.train.step,
        buffers,
    }
}

impl Reader {
    /// Reads the metadata, matches it against the model, plans every copy, opens the files it
    /// needs and checks every tensor it will read. Reads no tensor data.
    fn prepare(dir: &Path, model: &FsdpModel, stats: &mut ReadStats) -> Result<Self> {
        let mut meta = read_meta(dir)?;
        let ws = model.process_group().world_size();
        let rank = model.process_group().rank();
        // Saved parameters and buffers by name.
        let mut saved: HashMap<&str, (usize, &ParamMeta)> = HashMap::new();
        let mut saved_bufs: HashMap<&str, &BufferMeta> = HashMap::new();
        for (j, u) in meta.units.iter().enumerate() {
            for p in &u.params {
                saved.insert(&p.name, (j, p));
            }
            for b in &u.buffers {
                saved_bufs.insert(&b.name, b);
            }
        }
        // Names, shapes: parameters.
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
                    Some((_, sp)) if sp.shape != p.shape.dims() => {
                        return Err(meta_err(
                            dir,
                            format!(
                                "parameter {}: the model expects shape {:?}, the checkpoint has \
                                 {:?}",
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
                                "buffer {name}: the model expects shape {:?}, the checkpoint has \
                                 {:?}",
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
        // Pieces of every new shard.
        let mut plans = Vec::with_capacity(model.shards().len());
        for u in model.shards() {
            let layout = u.layout;
            let mut pieces = Vec::new();
            for e in layout.shard_table(u.shard_index) {
                let p = &layout.params[e.param_index];
                let (j, sp) = saved[p.name.as_str()];
                let n = meta.units[j].shard_numel;
                let mut flat = sp.offset + e.range_in_param.start;
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
            plans.push(pieces);
        }
        // Files: those holding a piece, rank 0's for buffers, this rank's for rank-local
        // optimizer buffers.
        let mut needed: BTreeSet<usize> = plans.iter().flatten().map(|p| p.file).collect();
        let has_buffers = model.shards().any(|u| !u.buffers.is_empty());
        if has_buffers || meta.optimizer.is_none() {
            needed.insert(0);
        }
        let mut files = HashMap::new();
        let open = |s: usize, stats: &mut ReadStats| -> Result<MappedFile> {
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
            Ok(f)
        };
        for &s in &needed {
            files.insert(s, open(s, stats)?);
        }
        let optimizer = match meta.optimizer.clone() {
            Some(o) => o,
            None => discover_optimizer(&meta, &files[&0]),
        };
        let mut kinds = BTreeSet::new();
        let mut local_bufs = Vec::new();
        let mut by_name = BTreeSet::new();
        for b in &optimizer.buffers {
            by_name.insert(b.name.as_str());
            match b.unit {
                Some(_) => {
                    let kind = b.name.rsplit_once('.').map_or("", |(k, _)| k);
                    kinds.insert(kind.to_string());
                }
                None => local_bufs.push(b.name.clone()),
            }
        }
        if !local_bufs.is_empty() {
            if meta.world_size != ws {
                return Err(meta_err(
                    dir,
                    format!(
                        "optimizer buffer {} is not laid out like a unit shard, so it loads at \
                         the saved world size only: saved at world size {}, loading at world size \
                         {ws}",
                        local_bufs[0], meta.world_size
                    ),
                ));
            }
            if let std::collections::hash_map::Entry::Vacant(e) = files.entry(rank) {
                e.insert(open(rank, stats)?);
            }
        }
        // Check every tensor that will be read.
        let mut checks: BTreeSet<(usize, String, usize)> = BTreeSet::new();
        for p in plans.iter().flatten() {
            let n = meta.units[p.unit].shard_numel;
            checks.insert((p.file, format!("param.{}", p.unit), n));
            for kind in &kinds {
                let name = format!("{kind}.{}", p.unit);
                if !by_name.contains(name.as_str()) {
                    return Err(meta_err(
                        dir,
                        format!(
                            "optimizer buffer {name} (unit {}) is missing from the checkpoint, \
                             which has {kind} for other units",
                            meta.units[p.unit].name
                        ),
                    ));
                }
                checks.insert((p.file, format!("optim.{name}"), n));
            }
        }
        for (s, name, n) in &checks {
            files[s].check(name, Dtype::F32, &[*n])?;
        }
        for name in &local_bufs {
            let f = &files[&rank];
            let t = format!("optim.{name}");
            let info = f.info(&t).ok_or_else(|| {
                Error::file(&f.path, format!("tensor {t} is missing (expected F32)"))
            })?;
            f.check(&t, Dtype::F32, &info.shape.clone())?;
        }
        for u in model.shards() {
            for (name, _) in u.buffers {
                let b = saved_bufs[name.as_str()];
                let dtype: Dtype = serde_json::from_value(serde_json::Value::String(
                    b.dtype.clone(),
                ))
                .map_err(|_| meta_err(dir, format!("buffer {name}: unknown dtype {}", b.dtype)))?;
                files[&0].check(&format!("buffer.{name}"), dtype, &b.shape)?;
            }
        }
        meta.optimizer = Some(optimizer.clone());
        Ok(Self {
            meta,
            files,
            plans,
            kinds: kinds.into_iter().collect(),
            local_bufs,
            optim_step: optimizer.step,
        })
    }

    /// Fills a buffer of one model unit's new shard length from saved tensors `<prefix>.<unit>`.
    fn fill(
        &self,
        k: usize,
        shard_numel: usize,
        prefix: &str,
        stats: &mut ReadStats,
    ) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; shard_numel];
        for p in &self.plans[k] {
            self.files[&p.file].read_f32(
                &format!("{prefix}.{}", p.unit),
                p.offset..p.offset + p.len,
                &mut out[p.out..p.out + p.len],
                stats,
            )?;
        }
        Ok(out)
    }

    /// Copies everything into the model and the optimizer.
    fn apply(
        &self,
        model: &mut FsdpModel,
        optim: &mut dyn ShardedOptimizer,
        stats: &mut ReadStats,
    ) -> Result<()> {
        let rank = model.process_group().rank();
        let device = model.config().device.clone();
        // Release the old optimizer state before the new one is allocated.
        optim.load_state(OptimizerState::default())?;
        let mut buffers = BTreeMap::new();
        let shard_numels: Vec<usize> = model.shards().map(|u| u.layout.shard_numel).collect();
        for (k, &n) in shard_numels.iter().enumerate() {
            let shard = self.fill(k, n, "param", stats)?;
            model.set_unit_shard(k, Tensor::from_vec(shard, n, &device)?)?;
            for kind in &self.kinds {
                buffers.insert(
                    format!("{kind}.{k}"),
                    self.fill(k, n, &format!("optim.{kind}"), stats)?,
                );
            }
        }
        for name in &self.local_bufs {
            let f = &self.files[&rank];
            let t = format!("optim.{name}");
            let n = f.info(&t).map_or(0, |i| i.shape.iter().product());
            let mut v = vec![0.0f32; n];
            f.read_f32(&t, 0..n, &mut v, stats)?;
            buffers.insert(name.clone(), v);
        }
        for u in model.shards() {
            for (name, var) in u.buffers {
                let t = self.files[&0].read_tensor(
                    &format!("buffer.{name}"),
                    var.dtype(),
                    &device,
                    stats,
                )?;
                var.set(&t)?;
            }
        }
        optim.load_state(OptimizerState {
            step: self.optim_step,
            buffers,
        })?;
        model.zero_grad();
        Ok(())
    }
}

/// Loads the sharded checkpoint in `dir` into `model` and `optim` (a collective), at the saved
/// world size or any other, and under any sharding strategy.
///
/// Each rank maps only the saved files that cover its new shard (plus rank 0's for buffers) and
/// copies only those element ranges; gradients are dropped. The training state is in the
/// returned metadata (`loaded.meta.train`): restoring the sampler, the grad scaler and the like
/// is the caller's part.
///
/// Errors (on every rank; model and optimizer unchanged), naming file, tensor and expected vs
/// found: a missing or unreadable `meta.json` or shard file; metadata that does not parse, is
/// inconsistent or is from a newer format version; a shard file truncated, corrupt or of the
/// wrong rank; a parameter or buffer of the model missing from the checkpoint, or one of the
/// checkpoint the model does not have; a shape or dtype mismatch.
pub fn load_sharded(
    dir: &Path,
    model: &mut FsdpModel,
    optim: &mut dyn ShardedOptimizer,
) -> Result<Loaded> {
    let step = model.step();
    let result = (|| -> Result<Loaded> {
        let pg = model.process_group().clone();
        let mut stats = ReadStats::default();
        let (reader, local) = match Reader::prepare(dir, model, &mut stats) {
            Ok(r) => (Some(r), Ok(())),
            Err(e) => (None, Err(e)),
        };
        agree(pg.as_ref(), "loading the checkpoint", dir, local)?;
        let reader = reader.expect("prepared on every rank");
        reader.apply(model, optim, &mut stats)?;
        Ok(Loaded {
            dir: dir.to_path_buf(),
            meta: reader.meta,
            stats,
        })
    })();
    result.map_err(|e| e.in_checkpoint(step))
}

/// Loads the newest complete checkpoint under `root`, if any (a collective: rank 0 picks it and
/// broadcasts its step, so every rank loads the same one; see [`load_sharded`]).
pub fn load_latest(
    root: &Path,
    model: &mut FsdpModel,
    optim: &mut dyn ShardedOptimizer,
) -> Result<Option<Loaded>> {
    let step = model.step();
    let result = (|| -> Result<Option<Loaded>> {
        let pg = model.process_group().clone();
        match agree_on_latest(pg.as_ref(), root)? {
            Some(dir) => load_sharded(&dir, model, optim).map(Some),
            None => Ok(None),
        }
    })();
    result.map_err(|e| e.in_checkpoint(step))
}
