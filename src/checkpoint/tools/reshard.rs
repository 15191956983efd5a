//! `fsdp-ckpt import` (one full safetensors file to a sharded checkpoint) and `fsdp-ckpt
//! reshard` (a sharded checkpoint to another world size), both offline and streamed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::Shape;
use safetensors::Dtype;

use super::{optim_list, parse_dtype, resolve_checkpoint, stream_flat, write_sharded, SourceFile};
use crate::checkpoint::io::{candle_dtype, TensorSpec};
use crate::checkpoint::{
    read_meta, strategy_name, BufferMeta, CheckpointMeta, OptimizerMeta, TrainState, UnitMeta,
    FORMAT_VERSION, META_FILE,
};
use crate::error::{Error, Result};
use crate::flat_param::FlatParamLayout;
use crate::fsdp::{FsdpConfig, ShardingStrategy};

/// How [`import_full`] lays a full model out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportOptions {
    /// World size of the checkpoint written (number of shard files); at least 1.
    pub world_size: usize,
    /// Sharding strategy recorded; under `NoShard` every unit is one shard in rank 0's file.
    pub strategy: ShardingStrategy,
    /// Tensors whose name ends with `.<suffix>` are buffers (replicated, kept in their dtype),
    /// the others parameters (f32 masters); the same rule as
    /// [`FsdpConfig::buffer_suffixes`], whose default this is.
    pub buffer_suffixes: Vec<String>,
}

impl Default for ImportOptions {
    fn default() -> Self {
        Self {
            world_size: 1,
            strategy: ShardingStrategy::FullShard,
            buffer_suffixes: FsdpConfig::default().buffer_suffixes,
        }
    }
}

/// A unit's parameters as `(offset, numel)` in flat order.
fn spans(u: &UnitMeta) -> Vec<(usize, usize)> {
    u.params.iter().map(|p| (p.offset, p.numel)).collect()
}

/// The layout of `params` (name, shape, in flat order) over `world_size` shards, as the runtime
/// computes it ([`FlatParamLayout::new`]).
fn unit_meta(
    name: &str,
    params: &[(String, Vec<usize>)],
    buffers: Vec<BufferMeta>,
    world_size: usize,
) -> Result<UnitMeta> {
    let shapes: Vec<(String, Shape)> = params
        .iter()
        .map(|(n, s)| (n.clone(), Shape::from(s.clone())))
        .collect();
    let layout = FlatParamLayout::new(&shapes, world_size)?;
    Ok(UnitMeta::from_layout_and_buffers(name, &layout, buffers))
}

/// What one tensor of an imported checkpoint is filled from.
enum ImportSource {
    /// Unit `k`'s flat parameter shard.
    Param(usize),
    /// A buffer, copied in its own dtype.
    Buffer(String),
}

/// Writes the full model file `file` (a safetensors file such as [`super::export_full`] or
/// [`crate::checkpoint::save_full`] writes, or one from elsewhere with the model's names) as a
/// sharded checkpoint `<out_root>/step-00000000/` at `opts.world_size`, to start FSDP training
/// from it (`load_latest` / `--resume` with `--checkpoint-dir out_root`). Returns that directory.
///
/// Units: the tensors are grouped by the first component of their name (`fc1.weight` → unit
/// `fc1`, the runtime's naming of a unit's tensors), units in the order their first tensor's
/// data lies in the file, tensors in file order. Loading matches parameters by name, not by unit,
/// so a model whose units group tensors otherwise loads it as well. Parameters are stored as f32
/// master shards (BF16, F16, F64 converted), buffers in their own dtype. The training state is
/// step 0, epoch 0; there is no optimizer state (as before a first step).
///
/// Memory: a constant (tensors streamed chunk by chunk, see [`super`]).
///
/// Errors, naming the file and tensor: `file` missing, a directory, truncated or not
/// safetensors; a tensor of a non-float dtype; `world_size` 0; the output checkpoint already
/// exists; a write error.
pub fn import_full(file: &Path, out_root: &Path, opts: &ImportOptions) -> Result<PathBuf> {
    if opts.world_size == 0 {
        return Err(Error::value("world size", "at least 1", 0));
    }
    if file.is_dir() {
        return Err(Error::file(
            file,
            "is a directory: expected a safetensors model file",
        ));
    }
    let src = SourceFile::open(file, None)?;
    let is_buffer = |n: &str| {
        opts.buffer_suffixes
            .iter()
            .any(|s| n.ends_with(&format!(".{s}")))
    };
    // Units by first name component, in order of first appearance in the file.
    let mut order: Vec<String> = Vec::new();
    let mut params: BTreeMap<String, Vec<(String, Vec<usize>)>> = BTreeMap::new();
    let mut buffers: BTreeMap<String, Vec<BufferMeta>> = BTreeMap::new();
    for name in src.names_in_file_order() {
        let info = src.info(&name)?;
        if candle_dtype(info.dtype).is_none() {
            return Err(Error::file(
                file,
                format!(
                    "tensor {name}: expected a float dtype (F32, BF16, F16, F64), found {:?} \
                     (a model file holds float parameters and buffers only)",
                    info.dtype
                ),
            ));
        }
        let unit = name.split('.').next().unwrap_or(&name).to_string();
        if !params.contains_key(&unit) {
            order.push(unit.clone());
            params.insert(unit.clone(), Vec::new());
            buffers.insert(unit.clone(), Vec::new());
        }
        if is_buffer(&name) {
            buffers.get_mut(&unit).expect("inserted").push(BufferMeta {
                name: name.clone(),
                shape: info.shape.clone(),
                dtype: format!("{:?}", info.dtype),
            });
        } else {
            params
                .get_mut(&unit)
                .expect("inserted")
                .push((name.clone(), info.shape.clone()));
        }
    }
    let ws = opts.world_size;
    let unit_ws = if opts.strategy == ShardingStrategy::NoShard {
        1
    } else {
        ws
    };
    let units: Vec<UnitMeta> = order
        .iter()
        .map(|u| {
            unit_meta(
                u,
                &params[u],
                buffers.remove(u).unwrap_or_default(),
                unit_ws,
            )
        })
        .collect::<Result<_>>()?;
    let mut plan: Vec<Vec<(TensorSpec, ImportSource)>> = (0..ws).map(|_| Vec::new()).collect();
    for (rank, tensors) in plan.iter_mut().enumerate() {
        for (k, u) in units.iter().enumerate() {
            if u.world_size > rank {
                tensors.push((
                    TensorSpec::f32(format!("param.{k}"), u.shard_numel),
                    ImportSource::Param(k),
                ));
            }
        }
    }
    for u in &units {
        for b in &u.buffers {
            let dtype = src.info(&b.name)?.dtype;
            plan[0].push((
                TensorSpec {
                    name: format!("buffer.{}", b.name),
                    dtype,
                    shape: b.shape.clone(),
                },
                ImportSource::Buffer(b.name.clone()),
            ));
        }
    }
    let meta = CheckpointMeta {
        format_version: FORMAT_VERSION,
        world_size: ws,
        strategy: Some(strategy_name(opts.strategy).to_string()),
        train: TrainState::default(),
        dtype: "F32".into(),
        units: units.clone(),
        optimizer: Some(OptimizerMeta::default()),
        files: Vec::new(),
        saved_at_unix_ms: Some(crate::checkpoint::sharded::now_unix_ms()),
    };
    write_sharded(
        out_root,
        meta,
        plan,
        &mut |rank, source, sink| match source {
            ImportSource::Param(k) => {
                let u = &units[*k];
                let n = u.shard_numel;
                stream_flat(
                    &spans(u),
                    rank * n..(rank + 1) * n,
                    4,
                    sink,
                    &mut |i, range, sink| src.stream(&u.params[i].name, range, Dtype::F32, sink),
                )
            }
            ImportSource::Buffer(name) => {
                let info = src.info(name)?;
                let numel = info.shape.iter().product();
                src.stream(name, 0..numel, info.dtype, sink)
            }
        },
    )
}

/// What one tensor of a resharded checkpoint is filled from: the saved tensor of the same name.
enum ReshardSource {
    /// A tensor laid out like unit `unit`'s flat buffer (`param.<unit>`, `optim.exp_avg.<unit>`,
    /// …), resharded.
    Flat {
        unit: usize,
        tensor: String,
        /// Stored (and written) dtype: F32, or BF16 for bf16 optimizer state.
        dtype: Dtype,
    },
    /// Copied as it is from saved rank `file`'s file (buffers; rank-local optimizer state).
    Copy {
        file: usize,
        tensor: String,
        dtype: Dtype,
    },
}

/// Writes the sharded checkpoint `dir` (a checkpoint directory, or a root whose newest complete
/// checkpoint is used) resharded to `world_size` ranks as `<out_root>/step-<step>/`, without a
/// process group; returns that directory.
///
/// The result is the checkpoint a live reshard writes: [`crate::checkpoint::load_sharded`] at
/// `world_size` followed by [`crate::checkpoint::save_sharded`] of the loaded state gives
/// byte-identical files. Every unit keeps its parameters and their offsets; only the padding and
/// the shard boundaries move; parameters and the optimizer buffers laid out like them
/// (`exp_avg.<unit>`, …) are copied range by range, alignment gaps and padding are zero (as a
/// load leaves them). The strategy is kept (NO_SHARD units stay one shard in rank 0's file);
/// the metadata's training state is copied unchanged.
///
/// Memory: a constant (tensors streamed chunk by chunk, see [`super`]).
///
/// Errors, naming the file and tensor: as [`super::export_full`] for the input; optimizer state
/// that is not laid out like a unit (loadable at the saved world size only) with another
/// `world_size`; `world_size` 0; the output checkpoint already exists; a write error.
pub fn reshard(dir: &Path, out_root: &Path, world_size: usize) -> Result<PathBuf> {
    if world_size == 0 {
        return Err(Error::value("world size", "at least 1", 0));
    }
    let dir = resolve_checkpoint(dir)?;
    let meta = read_meta(&dir)?;
    super::check_checksums(&dir, &meta)?;
    let meta_path = dir.join(META_FILE);
    let files: Vec<SourceFile> = (0..meta.world_size)
        .map(|s| SourceFile::open_shard(&dir, &meta, s))
        .collect::<Result<_>>()?;
    let optimizer = optim_list(&meta, Some(&files[0].header)).expect("rank 0's file given");
    let state_dtype = meta
        .optimizer
        .as_ref()
        .map_or(Dtype::F32, |o| o.state_dtype);
    let no_shard = match meta.strategy.as_deref() {
        Some(s) => {
            let strategy: ShardingStrategy = s
                .parse()
                .map_err(|e| Error::file(&meta_path, format!("strategy {s:?}: {e}")))?;
            strategy == ShardingStrategy::NoShard
        }
        // Not recorded: NO_SHARD shows as one shard at a larger world size.
        None => meta.world_size > 1 && meta.units.iter().all(|u| u.world_size == 1),
    };
    let unit_ws = if no_shard { 1 } else { world_size };
    let mut units = Vec::with_capacity(meta.units.len());
    for u in &meta.units {
        let params: Vec<(String, Vec<usize>)> = u
            .params
            .iter()
            .map(|p| (p.name.clone(), p.shape.clone()))
            .collect();
        let mut new = unit_meta(&u.name, &params, u.buffers.clone(), unit_ws)?;
        new.in_base = u.in_base;
        new.no_optim_state = u.no_optim_state;
        if new.params != u.params {
            return Err(Error::file(
                &meta_path,
                format!(
                    "unit {}: parameter offsets {:?} do not follow the flat layout ({:?})",
                    u.name,
                    spans(u),
                    spans(&new)
                ),
            ));
        }
        units.push(new);
    }
    // Check every saved tensor that will be read, before anything is written.
    for (k, u) in meta.units.iter().enumerate().filter(|(_, u)| !u.in_base) {
        for f in files.iter().take(u.world_size) {
            f.check(&format!("param.{k}"), Dtype::F32, &[u.shard_numel])?;
            for b in optimizer.buffers.iter().filter(|b| b.unit == Some(k)) {
                f.check(&format!("optim.{}", b.name), state_dtype, &[u.shard_numel])?;
            }
        }
        for b in &u.buffers {
            let dtype = parse_dtype(&b.dtype, &meta_path, &format!("buffer {}", b.name))?;
            files[0].check(&format!("buffer.{}", b.name), dtype, &b.shape)?;
        }
    }
    let local: Vec<&str> = optimizer
        .buffers
        .iter()
        .filter(|b| b.unit.is_none())
        .map(|b| b.name.as_str())
        .collect();
    if !local.is_empty() && world_size != meta.world_size {
        return Err(Error::file(
            &meta_path,
            format!(
                "optimizer buffer {} is not laid out like a unit shard, so it loads at the saved \
                 world size only: saved at world size {}, resharding to world size {world_size}",
                local[0], meta.world_size
            ),
        ));
    }
    let mut plan: Vec<Vec<(TensorSpec, ReshardSource)>> =
        (0..world_size).map(|_| Vec::new()).collect();
    for (rank, tensors) in plan.iter_mut().enumerate() {
        for (k, u) in units.iter().enumerate() {
            if u.world_size > rank && !u.in_base {
                let tensor = format!("param.{k}");
                tensors.push((
                    TensorSpec::f32(tensor.clone(), u.shard_numel),
                    ReshardSource::Flat {
                        unit: k,
                        tensor,
                        dtype: Dtype::F32,
                    },
                ));
            }
        }
        for b in &optimizer.buffers {
            let name = format!("optim.{}", b.name);
            match b.unit {
                Some(k) if units[k].world_size > rank => tensors.push((
                    TensorSpec {
                        dtype: state_dtype,
                        ..TensorSpec::f32(name.clone(), units[k].shard_numel)
                    },
                    ReshardSource::Flat {
                        unit: k,
                        tensor: name,
                        dtype: state_dtype,
                    },
                )),
                Some(_) => {}
                None => {
                    let info = files[rank].info(&name)?;
                    if info.dtype != Dtype::F32 {
                        return Err(Error::file(
                            files[rank].path(),
                            format!("tensor {name}: expected dtype F32, found {:?}", info.dtype),
                        ));
                    }
                    let spec = TensorSpec {
                        name: name.clone(),
                        dtype: Dtype::F32,
                        shape: info.shape.clone(),
                    };
                    let source = ReshardSource::Copy {
                        file: rank,
                        tensor: name,
                        dtype: Dtype::F32,
                    };
                    tensors.push((spec, source));
                }
            }
        }
    }
    for u in units.iter().filter(|u| !u.in_base) {
        for b in &u.buffers {
            let dtype = parse_dtype(&b.dtype, &meta_path, &format!("buffer {}", b.name))?;
            let tensor = format!("buffer.{}", b.name);
            let spec = TensorSpec {
                name: tensor.clone(),
                dtype,
                shape: b.shape.clone(),
            };
            let source = ReshardSource::Copy {
                file: 0,
                tensor,
                dtype,
            };
            plan[0].push((spec, source));
        }
    }
    // Every other field (training state with its run id, strategy, and whatever later
    // versions record) is carried over unchanged; the save time is the reshard's, as a live
    // save's would be.
    let out = CheckpointMeta {
        format_version: FORMAT_VERSION,
        world_size,
        units: units.clone(),
        optimizer: Some(optimizer.to_meta(&meta)),
        files: Vec::new(),
        saved_at_unix_ms: Some(crate::checkpoint::sharded::now_unix_ms()),
        ..meta.clone()
    };
    write_sharded(out_root, out, plan, &mut |rank, source, sink| {
        match source {
            ReshardSource::Flat {
                unit,
                tensor,
                dtype,
            } => {
                let (new, old) = (&units[*unit], &meta.units[*unit]);
                let (n, saved) = (new.shard_numel, old.shard_numel);
                stream_flat(
                    &spans(new),
                    rank * n..(rank + 1) * n,
                    dtype.bitsize() / 8,
                    sink,
                    &mut |i, range, sink| {
                        // Flat elements of the parameter, split at the saved shard boundaries.
                        let mut flat = new.params[i].offset + range.start;
                        let end = new.params[i].offset + range.end;
                        while flat < end {
                            let (s, off) = (flat / saved, flat % saved);
                            let len = (saved - off).min(end - flat);
                            files[s].stream(tensor, off..off + len, *dtype, sink)?;
                            flat += len;
                        }
                        Ok(())
                    },
                )
            }
            ReshardSource::Copy {
                file,
                tensor,
                dtype,
            } => {
                let numel = files[*file].info(tensor)?.shape.iter().product();
                files[*file].stream(tensor, 0..numel, *dtype, sink)
            }
        }
    })
}
