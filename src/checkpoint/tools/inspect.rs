//! `fsdp-ckpt inspect`: what a sharded checkpoint holds, from its metadata.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

use super::{optim_list, resolve_checkpoint, OptimList, SourceFile};
use crate::checkpoint::{read_meta, CheckpointMeta};
use crate::error::{Error, Result};

/// One tensor of the full model (as [`super::export_full`] writes it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorRow {
    /// Full name, e.g. `fc1.weight`.
    pub name: String,
    /// Unit holding it.
    pub unit: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// safetensors dtype name (`F32` for parameters: the master dtype).
    pub dtype: String,
    /// Bytes of its data (unsharded, unpadded).
    pub bytes: u64,
    /// A buffer (replicated, e.g. a running statistic) rather than a parameter.
    pub buffer: bool,
}

/// What [`inspect()`] found; `Display` prints the report of `fsdp-ckpt inspect`.
#[derive(Debug, Clone, PartialEq)]
pub struct Inspection {
    /// The checkpoint directory (the newest one when a root was given).
    pub dir: PathBuf,
    /// Its metadata.
    pub meta: CheckpointMeta,
    /// Every parameter and buffer, in model order (a unit's parameters, then its buffers).
    pub tensors: Vec<TensorRow>,
    /// The optimizer's kind (from the names of its state), e.g. `AdamW`.
    pub optimizer_kind: String,
    /// Optimizer state tensors summed over all ranks' files.
    pub optimizer_tensors: usize,
    /// Bytes of optimizer state summed over all ranks' files (f32).
    pub optimizer_bytes: u64,
    /// Every file in the directory with its size in bytes, by name.
    pub files: Vec<(String, u64)>,
}

impl Inspection {
    /// Total size of the directory's files in bytes.
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|(_, b)| b).sum()
    }
}

/// The summary lines of the report, in order: a label and the value read from the metadata
/// (`None` prints `none`). A new field of [`CheckpointMeta`] is shown by adding its line here
/// (e.g. `("run id", |m| m.run_id.clone())` once checkpoints record one).
type Row = (&'static str, fn(&CheckpointMeta) -> Option<String>);
const SUMMARY: &[Row] = &[
    ("format version", |m| Some(m.format_version.to_string())),
    ("run id", |m| m.train.run_id.clone()),
    ("saved at", |m| {
        m.saved_at_unix_ms
            .map(|ms| format!("{ms} ms after the Unix epoch"))
    }),
    ("step", |m| Some(m.train.step.to_string())),
    ("epochs completed", |m| Some(m.train.epoch.to_string())),
    ("world size", |m| Some(m.world_size.to_string())),
    ("strategy", strategy),
    ("master dtype", |m| Some(m.dtype.clone())),
    ("frozen base", |m| {
        m.adapter_base()
            .map(|b| format!("{} ({} files checksummed)", b.dir.display(), b.files.len()))
    }),
    ("mixed precision", |m| {
        m.train.mixed_precision.as_ref().map(|v| v.to_string())
    }),
    ("sampler", |m| {
        m.train.sampler.map(|s| {
            format!(
                "epoch {}, {} entries of each rank's list consumed at world size {}",
                s.epoch, s.position, s.world_size
            )
        })
    }),
    ("seed", |m| m.train.rng.map(|r| r.seed.to_string())),
    ("lr scheduler", |m| {
        m.train
            .lr_scheduler
            .as_ref()
            .map(|s| serde_json::to_string(s).unwrap_or_default())
    }),
    ("grad scaler", |m| {
        m.train.grad_scaler.as_ref().map(|v| v.to_string())
    }),
    ("extra", |m| {
        (!m.train.extra.is_empty()).then(|| format!("{:?}", m.train.extra))
    }),
];

fn strategy(m: &CheckpointMeta) -> Option<String> {
    Some(match &m.strategy {
        Some(s) => s.clone(),
        None if m.world_size > 1 && m.units.iter().all(|u| u.world_size == 1) => {
            "no-shard (not recorded; one shard per unit)".into()
        }
        None => "not recorded (full-shard or shard-grad-op: parameters sharded)".into(),
    })
}

/// The optimizer's kind: recorded (format 3, with its groups), else from the names of its
/// state buffers.
fn optimizer_kind(o: &OptimList) -> String {
    if let Some(h) = &o.hyper {
        let groups: Vec<String> = h
            .group_names()
            .into_iter()
            .zip(h.learning_rates())
            .map(|((name, _), lr)| format!("{name} lr {lr}"))
            .collect();
        return format!("{} (groups: {})", h.kind(), groups.join(", "));
    }
    let mut kinds: Vec<&str> = o
        .buffers
        .iter()
        .map(|b| b.name.rsplit_once('.').map_or(b.name.as_str(), |(k, _)| k))
        .collect();
    kinds.sort_unstable();
    kinds.dedup();
    match kinds.as_slice() {
        [] => "no state saved (before the first step, or SGD without momentum)".into(),
        ["exp_avg", "exp_avg_sq"] => "AdamW (exp_avg, exp_avg_sq)".into(),
        ["momentum_buffer"] => "SGD with momentum (momentum_buffer)".into(),
        other => format!("unknown ({})", other.join(", ")),
    }
}

/// Reads what the checkpoint `dir` (a checkpoint directory, or a root whose newest complete
/// checkpoint is used) holds: its metadata, every tensor of the full model with shape, dtype and
/// size, the optimizer's kind and state size, and the size of its files. Reads `meta.json` and
/// the directory listing (and a shard file's header only for version-1 checkpoints or rank-local
/// optimizer state); no tensor data.
///
/// Errors, naming the file: `dir` missing or not a checkpoint; damaged `meta.json`; a shard
/// file needed for the optimizer's state missing or damaged.
pub fn inspect(dir: &Path) -> Result<Inspection> {
    let dir = resolve_checkpoint(dir)?;
    let meta = read_meta(&dir)?;
    let meta_path = dir.join(crate::checkpoint::META_FILE);
    let mut tensors = Vec::new();
    for u in &meta.units {
        for p in &u.params {
            // A unit an adapter-only checkpoint left to its base: no bytes here.
            let (dtype, bytes) = if u.in_base {
                ("base".to_string(), 0)
            } else {
                (u.dtype.clone(), 4 * p.numel as u64)
            };
            tensors.push(TensorRow {
                name: p.name.clone(),
                unit: u.name.clone(),
                shape: p.shape.clone(),
                dtype,
                bytes,
                buffer: false,
            });
        }
        for b in &u.buffers {
            let size = super::parse_dtype(&b.dtype, &meta_path, &format!("buffer {}", b.name))?
                .bitsize()
                / 8;
            tensors.push(TensorRow {
                name: b.name.clone(),
                unit: u.name.clone(),
                shape: b.shape.clone(),
                dtype: b.dtype.clone(),
                bytes: (size * b.shape.iter().product::<usize>()) as u64,
                buffer: true,
            });
        }
    }
    let file0 = match &meta.optimizer {
        Some(_) => None,
        None => Some(SourceFile::open_shard(&dir, &meta, 0)?.header),
    };
    let optimizer = optim_list(&meta, file0.as_ref()).expect("rank 0's file given for version 1");
    let (mut optimizer_tensors, mut optimizer_bytes) = (0, 0u64);
    for b in &optimizer.buffers {
        match b.unit {
            Some(k) => {
                let u = &meta.units[k];
                optimizer_tensors += u.world_size;
                optimizer_bytes += 4 * u.padded_numel as u64;
            }
            None => {
                for r in 0..meta.world_size {
                    let f = SourceFile::open_shard(&dir, &meta, r)?;
                    let info = f.info(&format!("optim.{}", b.name))?;
                    optimizer_tensors += 1;
                    optimizer_bytes += (info.data_offsets.1 - info.data_offsets.0) as u64;
                }
            }
        }
    }
    let mut files = Vec::new();
    for e in fs::read_dir(&dir).map_err(|e| Error::io(&dir, e))? {
        let e = e.map_err(|e| Error::io(&dir, e))?;
        let md = e.metadata().map_err(|err| Error::io(e.path(), err))?;
        if md.is_file() {
            files.push((e.file_name().to_string_lossy().into_owned(), md.len()));
        }
    }
    files.sort();
    Ok(Inspection {
        dir,
        optimizer_kind: optimizer_kind(&optimizer),
        optimizer_tensors,
        optimizer_bytes,
        meta,
        tensors,
        files,
    })
}

impl fmt::Display for Inspection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.meta;
        writeln!(f, "checkpoint {}", self.dir.display())?;
        let opt = format!(
            "{}; step {}; {} tensors, {} bytes over all ranks",
            self.optimizer_kind,
            m.optimizer.as_ref().map_or(m.train.step, |o| o.step),
            self.optimizer_tensors,
            self.optimizer_bytes
        );
        let mut rows: Vec<(&str, String)> = SUMMARY
            .iter()
            .map(|(label, value)| (*label, value(m).unwrap_or_else(|| "none".into())))
            .collect();
        rows.push(("optimizer", opt));
        let w = rows.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
        for (label, value) in &rows {
            writeln!(f, "  {label:<w$}  {value}")?;
        }
        let (params, buffers): (Vec<&TensorRow>, Vec<&TensorRow>) =
            self.tensors.iter().partition(|t| !t.buffer);
        let count = |ts: &[&TensorRow]| {
            let elems: u64 = ts
                .iter()
                .map(|t| t.shape.iter().product::<usize>() as u64)
                .sum();
            let bytes: u64 = ts.iter().map(|t| t.bytes).sum();
            let plural = if ts.len() == 1 { "" } else { "s" };
            format!(
                "{} tensor{plural}, {elems} elements, {bytes} bytes",
                ts.len()
            )
        };
        writeln!(
            f,
            "tensors (parameters: {}; buffers: {}):",
            count(&params),
            count(&buffers)
        )?;
        let shapes: Vec<String> = self
            .tensors
            .iter()
            .map(|t| format!("{:?}", t.shape))
            .collect();
        let wn = self.tensors.iter().map(|t| t.name.len()).max().unwrap_or(0);
        let ws = shapes.iter().map(String::len).max().unwrap_or(0);
        let wb = self
            .tensors
            .iter()
            .map(|t| t.bytes.to_string().len())
            .max()
            .unwrap_or(0);
        for (t, shape) in self.tensors.iter().zip(&shapes) {
            let kind = if t.buffer { "  buffer" } else { "" };
            writeln!(
                f,
                "  {:<wn$}  {shape:<ws$}  {:<4}  {:>wb$} bytes{kind}",
                t.name, t.dtype, t.bytes
            )?;
        }
        writeln!(f, "files:")?;
        let wf = self.files.iter().map(|(n, _)| n.len()).max().unwrap_or(0);
        let wb = self
            .files
            .iter()
            .map(|(_, b)| b.to_string().len())
            .max()
            .unwrap_or(0);
        for (name, bytes) in &self.files {
            writeln!(f, "  {name:<wf$}  {bytes:>wb$} bytes")?;
        }
        let total = self.total_bytes();
        write!(f, "total on disk: {total} bytes ({})", human(total))
    }
}

/// `bytes` in KiB, MiB or GiB, one decimal.
fn human(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        0..0x10_0000 => format!("{:.1} KiB", b / 1024.0),
        0x10_0000..0x4000_0000 => format!("{:.1} MiB", b / (1u64 << 20) as f64),
        _ => format!("{:.1} GiB", b / (1u64 << 30) as f64),
    }
}
