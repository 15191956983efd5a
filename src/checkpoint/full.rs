//! Full (unsharded) state dict: one safetensors file under the original parameter names,
//! shapes and dtypes, readable by plain candle (`VarBuilder::from_mmaped_safetensors`).
//!
//! File layout: every unit in model order, its parameters in constructor order (f32, the master
//! dtype), then its buffers (their own dtype). The safetensors metadata holds
//! `format = candle-fsdp/full`, `format_version` and `dtype = F32`; a loader ignores it, so any
//! safetensors file with the right names and shapes (a pretrained model) loads as well.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::Arc;

use candle_core::Tensor;
use safetensors::Dtype;

use super::io::{candle_dtype, st_dtype, MappedFile, SafetensorsWriter, TensorSpec};
use super::{agree, ReadStats, FORMAT_VERSION};
use crate::comm::ProcessGroup;
use crate::error::{Error, Result};
use crate::fsdp::ModelSpec;
use crate::fsdp::{FsdpConfig, FsdpModel};
use crate::ops::with_host_f32;

/// Value of the `format` entry of a full state-dict file's safetensors metadata.
pub const FULL_FORMAT: &str = "candle-fsdp/full";

fn full_specs(model: &FsdpModel) -> Result<Vec<TensorSpec>> {
    let mut specs = Vec::new();
    for u in model.shards() {
        for p in &u.layout.params {
            specs.push(TensorSpec {
                name: p.name.clone(),
                dtype: Dtype::F32,
                shape: p.shape.dims().to_vec(),
            });
        }
        for (name, var) in u.buffers {
            specs.push(TensorSpec {
                name: name.clone(),
                dtype: st_dtype(var.dtype())?,
                shape: var.dims().to_vec(),
            });
        }
    }
    Ok(specs)
}

/// Writes the full state dict of `model` to `path` as one safetensors file (a collective).
///
/// Every parameter is stored unsharded under its original name and shape in f32 (the master
/// dtype), every buffer in its own dtype. Units are gathered one at a time and rank 0 streams
/// each unit's bytes to the file after writing the header, so the peak extra memory is one
/// unit's f32 flat buffer per rank. The file is written atomically ([`super::AtomicFile`]): on
/// any error, a previous file at `path` is left as it was.
///
/// Returns the file size in bytes on rank 0, `None` on the other ranks.
///
/// Errors (on every rank): the file cannot be created or written on rank 0 (naming it), or a
/// collective fails.
pub fn save_full(path: &Path, model: &FsdpModel) -> Result<Option<u64>> {
    let step = model.step();
    let result = (|| -> Result<Option<u64>> {
        let pg = model.process_group().clone();
        let mut writer = None;
        let mut local = Ok(());
        if pg.rank() == 0 {
            let meta = HashMap::from([
                ("format".to_string(), FULL_FORMAT.to_string()),
                ("format_version".to_string(), FORMAT_VERSION.to_string()),
                ("dtype".to_string(), "F32".to_string()),
            ]);
            match full_specs(model).and_then(|specs| SafetensorsWriter::create(path, specs, meta)) {
                Ok(w) => writer = Some(w),
                Err(e) => local = Err(e),
            }
        }
        agree(pg.as_ref(), "saving the full state dict", path, local)?;
        let mut local = Ok(());
        for u in model.shards() {
            let full = model.gather_unit_f32(u.unit_index)?;
            if let Some(w) = writer.as_mut() {
                let written = (|| -> Result<()> {
                    with_host_f32(&full, |full| -> Result<()> {
                        for p in &u.layout.params {
                            w.write_f32(&p.name, &full[p.offset..p.offset + p.numel])?;
                        }
                        Ok(())
                    })??;
                    for (name, var) in u.buffers {
                        w.write_tensor(name, var.as_tensor())?;
                    }
                    Ok(())
                })();
                if let Err(e) = written {
                    // Dropping the writer removes its temporary file.
                    writer = None;
                    local = Err(e);
                }
            }
        }
        let mut size = None;
        if let Some(w) = writer {
            match w.finish() {
                Ok((n, _)) => size = Some(n),
                Err(e) => local = Err(e),
            }
        }
        agree(pg.as_ref(), "saving the full state dict", path, local)?;
        Ok(size)
    })();
    result.map_err(|e| e.in_checkpoint(step))
}

/// One tensor a full file must hold.
struct Expected {
    name: String,
    shape: Vec<usize>,
    what: &'static str,
}

fn expected_of_model(model: &FsdpModel) -> Vec<Expected> {
    let mut out = Vec::new();
    for u in model.shards() {
        for p in &u.layout.params {
            out.push(Expected {
                name: p.name.clone(),
                shape: p.shape.dims().to_vec(),
                what: "parameter",
            });
        }
        for (name, var) in u.buffers {
            out.push(Expected {
                name: name.clone(),
                shape: var.dims().to_vec(),
                what: "buffer",
            });
        }
    }
    out
}

/// Checks the names, shapes and dtypes of a full file against what the model holds.
fn check_full(file: &MappedFile, expected: &[Expected]) -> Result<()> {
    let mut missing = Vec::new();
    for e in expected {
        let Some(info) = file.info(&e.name) else {
            missing.push(format!("{} ({}, shape {:?})", e.name, e.what, e.shape));
            continue;
        };
        if info.shape != e.shape {
            return Err(Error::file(
                &file.path,
                format!(
                    "tensor {}: expected shape {:?} (the model's {}), found {:?}",
                    e.name, e.shape, e.what, info.shape
                ),
            ));
        }
        if candle_dtype(info.dtype).is_none() {
            return Err(Error::file(
                &file.path,
                format!(
                    "tensor {}: expected dtype F32 (or BF16, F16, F64, converted to f32), found \
                     {:?}",
                    e.name, info.dtype
                ),
            ));
        }
    }
    if !missing.is_empty() {
        return Err(Error::file(
            &file.path,
            format!(
                "{} tensor(s) of the model missing from the file: {}",
                missing.len(),
                list(&missing)
            ),
        ));
    }
    let known: BTreeSet<&str> = expected.iter().map(|e| e.name.as_str()).collect();
    let mut extra: Vec<String> = file
        .names()
        .filter(|n| !known.contains(n))
        .map(|n| {
            let i = file.info(n).expect("listed");
            format!("{n} ({:?}, shape {:?})", i.dtype, i.shape)
        })
        .collect();
    if !extra.is_empty() {
        extra.sort();
        return Err(Error::file(
            &file.path,
            format!(
                "{} tensor(s) in the file are not parameters or buffers of the model: {}",
                extra.len(),
                list(&extra)
            ),
        ));
    }
    Ok(())
}

/// The first few entries of a list, and how many more there are.
fn list(items: &[String]) -> String {
    const SHOWN: usize = 5;
    let mut s = items[..items.len().min(SHOWN)].join(", ");
    if items.len() > SHOWN {
        s.push_str(&format!(", and {} more", items.len() - SHOWN));
    }
    s
}

fn load_buffers(file: &MappedFile, model: &FsdpModel, stats: &mut ReadStats) -> Result<()> {
    let device = model.config().device.clone();
    for u in model.shards() {
        for (name, var) in u.buffers {
            let t = file.read_tensor(name, var.dtype(), &device, stats)?;
            var.set(&t)?;
        }
    }
    Ok(())
}

/// Loads a full state dict (a file written by [`save_full`], or any safetensors file with the
/// model's parameter and buffer names, e.g. a pretrained model) into `model` (a collective).
///
/// The file is memory-mapped and each rank copies only the byte ranges of its own shard (and
/// the buffers), never the whole file. BF16, F16 and F64 tensors are converted to f32.
/// Gradients are dropped.
///
/// Returns what this rank read.
///
/// Errors, naming the file (on every rank; the model is unchanged): missing, truncated or
/// corrupt file; a parameter or buffer missing from the file, or a tensor of the file the model
/// does not have; a shape mismatch (expected vs found); a non-float dtype.
pub fn load_full(path: &Path, model: &mut FsdpModel) -> Result<ReadStats> {
    let step = model.step();
    let result = (|| -> Result<ReadStats> {
        let pg = model.process_group().clone();
        let mut stats = ReadStats::default();
        let opened = MappedFile::open(path, None, &mut stats)
            .and_then(|f| check_full(&f, &expected_of_model(model)).map(|_| f));
        let (file, local) = match opened {
            Ok(f) => (Some(f), Ok(())),
            Err(e) => (None, Err(e)),
        };
        agree(pg.as_ref(), "loading the full state dict", path, local)?;
        let file = file.expect("checked on every rank");
        let device = model.config().device.clone();
        let units = model.shards().len();
        for k in 0..units {
            let u = model.shard(k).expect("k < number of units");
            let layout = u.layout;
            let mut shard = vec![0.0f32; layout.shard_numel];
            for e in layout.shard_table(u.shard_index) {
                let p = &layout.params[e.param_index];
                let out = &mut shard[e.offset_in_shard..e.offset_in_shard + e.numel_in_shard];
                file.read_f32(&p.name, e.range_in_param.clone(), out, &mut stats)?;
            }
            let n = shard.len();
            model.set_unit_shard(k, Tensor::from_vec(shard, n, &device)?)?;
        }
        load_buffers(&file, model, &mut stats)?;
        model.zero_grad();
        Ok(stats)
    })();
    result.map_err(|e| e.in_checkpoint(step))
}

/// Builds an [`FsdpModel`] from `specs` with its parameters read from a full state-dict file
/// (see [`load_full`]) instead of initialised: each rank fills its shards straight from the
/// memory-mapped file, reading only the byte ranges of its own shard (a collective).
///
/// Returns the model and what this rank read.
///
/// Errors: as [`load_full`] (checked against the parameters the constructors record, before
/// anything is built), and as [`FsdpModel::build_with`].
pub fn build_from_full(
    pg: Arc<dyn ProcessGroup>,
    config: FsdpConfig,
    specs: impl Into<ModelSpec>,
    path: &Path,
) -> Result<(FsdpModel, ReadStats)> {
    let specs: ModelSpec = specs.into();
    let mut stats = ReadStats::default();
    let checked = (|| -> Result<MappedFile> {
        let mut expected = Vec::new();
        for p in specs.record(&config.device)? {
            expected.push(Expected {
                name: p.name,
                shape: p.shape.dims().to_vec(),
                what: "parameter or buffer",
            });
        }
        let file = MappedFile::open(path, None, &mut stats)?;
        check_full(&file, &expected)?;
        Ok(file)
    })();
    let (file, local) = match checked {
        Ok(f) => (Some(f), Ok(())),
        Err(e) => (None, Err(e)),
    };
    agree(
        pg.as_ref(),
        "building from the full state dict",
        path,
        local,
    )?;
    let file = file.expect("checked on every rank");
    let model = FsdpModel::build_with(pg, config, specs, |p, range, out| {
        file.read_f32(&p.name, range, out, &mut stats)
    })?;
    load_buffers(&file, &model, &mut stats)?;
    Ok((model, stats))
}
