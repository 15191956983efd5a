//! Sharded checkpoints (same world size): each rank writes its master shards and optimizer
//! state; rank 0 writes the metadata last.
//!
//! Layout of a checkpoint root:
//! ```text
//! <root>/step-00000938/shard-00000-of-00002.safetensors   rank 0's shards + optimizer state
//! <root>/step-00000938/shard-00001-of-00002.safetensors   rank 1's
//! <root>/step-00000938/meta.json                          written last: marks it complete
//! ```
//! Every file is written to a temporary name, flushed, fsynced and renamed ([`write_atomic`]),
//! and a checkpoint directory counts only once its `meta.json` exists, so a crash while saving
//! leaves the previous complete checkpoint as the latest. `keep_last` rotation deletes older
//! complete checkpoints only after the new one is complete.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::comm::ProcessGroup;
use crate::error::{Error, Result};
use crate::fsdp::FsdpModel;
use crate::optim::{OptimizerState, ShardedOptimizer};

/// Version written into `meta.json`; loading a larger one is an error.
pub const FORMAT_VERSION: u32 = 1;

/// One parameter in the metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamMeta {
    /// Full name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Offset in the unsharded flat buffer (elements).
    pub offset: usize,
}

/// One unit's layout in the metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitMeta {
    /// Unit name.
    pub name: String,
    /// Flat length with padding (elements).
    pub padded_numel: usize,
    /// Shard length (elements).
    pub shard_numel: usize,
    /// Parameters.
    pub params: Vec<ParamMeta>,
}

/// Contents of `meta.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// World size at save time.
    pub world_size: usize,
    /// Optimizer steps taken.
    pub step: u64,
    /// Epochs completed.
    pub epoch: u64,
    /// Unit layouts.
    pub units: Vec<UnitMeta>,
    /// Free-form values of the caller (e.g. the seed).
    pub extra: BTreeMap<String, String>,
}

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, flushed and
/// fsynced, then renamed over `path`, then the directory fsynced.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("file"),
        std::process::id()
    ));
    let res = (|| {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.flush()?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        if let Ok(d) = fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    res.map_err(|e| {
        let _ = fs::remove_file(&tmp);
        Error::io(path, e)
    })
}

fn shard_file(dir: &Path, rank: usize, ws: usize) -> PathBuf {
    dir.join(format!("shard-{rank:05}-of-{ws:05}.safetensors"))
}

fn unit_metas(model: &FsdpModel) -> Vec<UnitMeta> {
    model
        .units()
        .iter()
        .map(|u| UnitMeta {
            name: u.spec.name.clone(),
            padded_numel: u.flat.layout.padded_numel,
            shard_numel: u.flat.layout.shard_numel,
            params: u
                .flat
                .layout
                .params
                .iter()
                .map(|p| ParamMeta {
                    name: p.name.clone(),
                    shape: p.shape.dims().to_vec(),
                    offset: p.offset,
                })
                .collect(),
        })
        .collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Saves a sharded checkpoint of `model` and `optim` as `<root>/step-<step>/` (a collective).
///
/// `keep_last`: number of complete checkpoints kept under `root` (older ones are removed by
/// rank 0 after the new one is complete); 0 keeps all. Returns the new checkpoint directory.
pub fn save_sharded(
    root: &Path,
    model: &FsdpModel,
    optim: &dyn ShardedOptimizer,
    epoch: u64,
    extra: BTreeMap<String, String>,
    keep_last: usize,
) -> Result<PathBuf> {
    let pg = model.process_group().clone();
    let (rank, ws) = (pg.rank(), pg.world_size());
    let state = optim.state();
    let dir = root.join(format!("step-{:08}", state.step));
    let result = (|| {
        fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        let mut named: Vec<(String, Vec<u8>, usize)> = Vec::new();
        for (i, u) in model.units().iter().enumerate() {
            named.push((
                format!("param.{i}"),
                f32_bytes(&u.flat.shard),
                u.flat.shard.len(),
            ));
        }
        for (k, b) in &state.buffers {
            named.push((format!("optim.{k}"), f32_bytes(b), b.len()));
        }
        let views = named
            .iter()
            .map(|(n, bytes, len)| {
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![*len], bytes)
                    .map(|v| (n.clone(), v))
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::file(&dir, format!("cannot build tensors: {e}")))?;
        let mut info = std::collections::HashMap::new();
        info.insert("optim.step".to_string(), state.step.to_string());
        let bytes = safetensors::serialize(views, Some(info))
            .map_err(|e| Error::file(&dir, format!("cannot serialize: {e}")))?;
        write_atomic(&shard_file(&dir, rank, ws), &bytes)
    })();
    // Everyone's shard must be on disk before the metadata marks the checkpoint complete; a rank
    // that failed aborts the group, so the barrier below fails instead of hanging.
    if let Err(e) = &result {
        pg.abort(&format!("checkpoint save failed: {e}"));
    }
    result?;
    pg.barrier().wait()?;
    if rank == 0 {
        let meta = CheckpointMeta {
            format_version: FORMAT_VERSION,
            world_size: ws,
            step: state.step,
            epoch,
            units: unit_metas(model),
            extra,
        };
        let json = serde_json::to_vec_pretty(&meta).expect("metadata serialises");
        write_atomic(&dir.join("meta.json"), &json)?;
        if keep_last > 0 {
            let mut all = list_complete(root)?;
            while all.len() > keep_last {
                let old = all.remove(0);
                fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
            }
        }
    }
    pg.barrier().wait()?;
    Ok(dir)
}

/// Complete checkpoint directories under `root` (those with a `meta.json`), oldest first.
pub fn list_complete(root: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let entries = match fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(Error::io(root, e)),
    };
    for e in entries {
        let p = e.map_err(|e| Error::io(root, e))?.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with("step-") && p.join("meta.json").is_file() {
            out.push(p);
        }
    }
    out.sort();
    Ok(out)
}

/// Reads and checks a checkpoint's `meta.json`.
pub fn read_meta(dir: &Path) -> Result<CheckpointMeta> {
    let path = dir.join("meta.json");
    let bytes = fs::read(&path).map_err(|e| Error::io(&path, e))?;
    let meta: CheckpointMeta = serde_json::from_slice(&bytes)
        .map_err(|e| Error::file(&path, format!("not valid checkpoint metadata: {e}")))?;
    if meta.format_version > FORMAT_VERSION {
        return Err(Error::file(
            &path,
            format!(
                "format version {} is newer than this reader's {FORMAT_VERSION}",
                meta.format_version
            ),
        ));
    }
    Ok(meta)
}

/// Loads the checkpoint in `dir` into `model` and `optim` (every rank its own shard file) and
/// returns its metadata.
///
/// Errors: a different world size or unit layout than saved (naming unit and parameter,
/// expected vs found), a missing or corrupt shard file, a tensor of the wrong length.
pub fn load_sharded(
    dir: &Path,
    model: &mut FsdpModel,
    optim: &mut dyn ShardedOptimizer,
) -> Result<CheckpointMeta> {
    let meta = read_meta(dir)?;
    let pg = model.process_group().clone();
    let (rank, ws) = (pg.rank(), pg.world_size());
    let meta_path = dir.join("meta.json");
    if meta.world_size != ws {
        return Err(Error::file(
            &meta_path,
            format!(
                "saved at world size {}, loading at world size {ws}: this format reloads at the \
                 same world size only",
                meta.world_size
            ),
        ));
    }
    let expected = unit_metas(model);
    if meta.units.len() != expected.len() {
        return Err(Error::file(
            &meta_path,
            format!(
                "checkpoint has {} units, the model {}",
                meta.units.len(),
                expected.len()
            ),
        ));
    }
    for (found, exp) in meta.units.iter().zip(&expected) {
        if found != exp {
            return Err(Error::file(
                &meta_path,
                format!(
                    "unit layout differs: model has {} with params {:?}, checkpoint has {} with \
                     params {:?}",
                    exp.name,
                    exp.params
                        .iter()
                        .map(|p| (&p.name, &p.shape))
                        .collect::<Vec<_>>(),
                    found.name,
                    found
                        .params
                        .iter()
                        .map(|p| (&p.name, &p.shape))
                        .collect::<Vec<_>>()
                ),
            ));
        }
    }
    let path = shard_file(dir, rank, ws);
    let bytes = fs::read(&path).map_err(|e| Error::io(&path, e))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| Error::file(&path, format!("corrupt safetensors file: {e}")))?;
    let read = |name: &str, expected_len: Option<usize>| -> Result<Vec<f32>> {
        let t = st
            .tensor(name)
            .map_err(|_| Error::file(&path, format!("tensor {name} is missing")))?;
        if t.dtype() != safetensors::Dtype::F32 {
            return Err(Error::file(
                &path,
                format!("tensor {name}: expected dtype F32, found {:?}", t.dtype()),
            ));
        }
        let v: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        if let Some(n) = expected_len {
            if v.len() != n {
                return Err(Error::file(
                    &path,
                    format!("tensor {name}: expected {n} elements, found {}", v.len()),
                ));
            }
        }
        Ok(v)
    };
    let mut shards = Vec::new();
    for (i, u) in model.units().iter().enumerate() {
        shards.push(read(&format!("param.{i}"), Some(u.flat.shard.len()))?);
    }
    let mut state = OptimizerState {
        step: meta.step,
        buffers: BTreeMap::new(),
    };
    for name in st.names() {
        if let Some(k) = name.strip_prefix("optim.") {
            state.buffers.insert(k.to_string(), read(name, None)?);
        }
    }
    for (u, s) in model.units_mut().iter_mut().zip(shards) {
        u.flat.shard = s;
        u.flat.grad = None;
    }
    optim.load_state(state);
    Ok(meta)
}

/// Loads the newest complete checkpoint under `root`, if any (a collective: rank 0 picks it
/// and broadcasts its step, so all ranks load the same one; see [`load_sharded`]).
pub fn load_latest(
    root: &Path,
    model: &mut FsdpModel,
    optim: &mut dyn ShardedOptimizer,
) -> Result<Option<CheckpointMeta>> {
    let pg = model.process_group().clone();
    match agree_on_latest(pg.as_ref(), root)? {
        Some(dir) => load_sharded(&dir, model, optim).map(Some),
        None => Ok(None),
    }
}

/// The newest complete checkpoint under `root` as seen by rank 0, broadcast to all ranks
/// (a collective).
pub fn agree_on_latest(pg: &dyn ProcessGroup, root: &Path) -> Result<Option<PathBuf>> {
    let latest = if pg.rank() == 0 {
        list_complete(root)?.pop()
    } else {
        None
    };
    // The step, or u64::MAX for none, as four exact 16-bit pieces (f32 holds them exactly).
    let step = latest
        .as_ref()
        .and_then(|p| {
            p.file_name()?
                .to_str()?
                .strip_prefix("step-")?
                .parse::<u64>()
                .ok()
        })
        .unwrap_or(u64::MAX);
    let pieces: Vec<f32> = (0..4)
        .map(|i| ((step >> (16 * i)) & 0xffff) as f32)
        .collect();
    let b = pg
        .broadcast(crate::comm::CommBuffer::F32(pieces), 0)
        .wait()?
        .into_f32()?;
    let step = (0..4).fold(0u64, |acc, i| acc | ((b[i] as u64) << (16 * i)));
    Ok((step != u64::MAX).then(|| root.join(format!("step-{step:08}"))))
}
