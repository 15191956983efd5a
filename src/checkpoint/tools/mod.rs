//! Offline checkpoint tools, the library side of the `fsdp-ckpt` binary: [`inspect()`],
//! [`export_full`] (a sharded checkpoint to one safetensors file; the Hugging Face and PEFT
//! layouts are [`crate::hf::export_hf`] and [`crate::hf::export_peft`], on these readers),
//! [`import_full`] (the reverse), [`reshard`] (to another world size), [`verify()`] and [`diff_checkpoints`].
//!
//! They need no process group and no model: everything comes from `meta.json`
//! ([`super::CheckpointMeta`]) and the files. A parameter's elements lie at
//! `[offset, offset + numel)` of its unit's flat buffer, which is split into shards of
//! `shard_numel` elements, shard `s` in rank `s`'s file as tensor `param.<unit>` (see
//! [`crate::checkpoint`]); so any element range of any parameter is a few contiguous ranges of
//! saved shards, whatever the world size it was saved at.
//!
//! **Memory.** Tensor data is read with positioned reads into a fixed buffer of at most
//! [`CHUNK_ELEMS`] elements, converted, and appended to the output file chunk by chunk. Headers
//! are parsed through a memory map (only the header pages are touched), but tensor data never
//! goes through one: pages of a map count in the process's resident set once touched, until it
//! is unmapped, so a mapped export would grow with the model. Peak memory is therefore a
//! constant (a few MiB of chunk and write buffers), independent of the model's and of its
//! largest tensor's size.
//!
//! **Outputs** are written atomically: a model file through [`super::AtomicFile`]; a sharded
//! checkpoint as a live save writes one (files in a hidden staging directory, `meta.json` last,
//! then a rename to `step-<step>`), under an output root that is refused if that checkpoint
//! already exists.
//!
//! **Errors** name the file, the tensor and expected vs found, as the loaders' do: a missing
//! directory, a directory that is not a checkpoint, damaged metadata, a missing, truncated or
//! corrupt shard file.

mod diff;
pub(crate) mod export;
mod inspect;
mod reshard;
mod verify;

use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::{Path, PathBuf};

use candle_core::DType;
use safetensors::tensor::TensorInfo;
use safetensors::Dtype;

use super::io::{candle_dtype, MappedFile, SafetensorsWriter, TensorSpec};
use super::sharded::{prepare_staging, publish};
use super::{
    list_complete, shard_file_name, step_dir_name, CheckpointMeta, FileMeta, OptimizerMeta,
    ReadStats, FORMAT_VERSION, META_FILE, SHARDED_FORMAT,
};
use crate::error::{Error, Result};

pub use diff::{diff_checkpoints, CheckpointDiff, TensorDifference};
pub use export::{export_full, ExportSummary};
pub use inspect::{inspect, Inspection, TensorRow};
pub use reshard::{import_full, reshard, ImportOptions};
pub use verify::{verify, Problem, VerifyReport};

/// Where streamed bytes go (e.g. the next part of a tensor being written).
pub(crate) type Sink<'a> = dyn FnMut(&[u8]) -> Result<()> + 'a;

/// Streams a piece of one parameter (its index, an element range of it) to a sink.
type ReadPiece<'a> =
    dyn for<'s, 't> FnMut(usize, Range<usize>, &'t mut Sink<'s>) -> Result<()> + 'a;

/// Elements read, converted and written at a time (1 MiB of f32).
pub const CHUNK_ELEMS: usize = 256 * 1024;

/// The checkpoint directory `path` names: `path` itself when it holds a `meta.json`, else the
/// newest complete checkpoint under it (a checkpoint root such as `checkpoints/mnist`).
///
/// Errors, naming `path`: it does not exist, is not a directory, or is neither a checkpoint nor
/// a root holding one (interrupted saves found there are named).
pub fn resolve_checkpoint(path: &Path) -> Result<PathBuf> {
    let md = match fs::metadata(path) {
        Ok(md) => md,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::file(path, "no such directory"))
        }
        Err(e) => return Err(Error::io(path, e)),
    };
    if !md.is_dir() {
        return Err(Error::file(
            path,
            format!(
                "not a directory: expected a checkpoint directory (holding {META_FILE}) or a \
                 checkpoint root (holding step-N directories)"
            ),
        ));
    }
    if path.join(META_FILE).exists() {
        return Ok(path.to_path_buf());
    }
    if let Some(latest) = list_complete(path)?.pop() {
        return Ok(latest);
    }
    let mut partial: Vec<String> = fs::read_dir(path)
        .map_err(|e| Error::io(path, e))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(".step-") && n.ends_with(".partial"))
        .collect();
    partial.sort();
    let partial = if partial.is_empty() {
        String::new()
    } else {
        format!(
            "; interrupted saves found (no {META_FILE} written): {}",
            partial.join(", ")
        )
    };
    Err(Error::file(
        path,
        format!(
            "not a checkpoint: no {META_FILE} in it and no complete checkpoint \
             (step-N/{META_FILE}) under it{partial}"
        ),
    ))
}

/// Name and size recorded for shard file `rank` (version-1 checkpoints record none).
fn file_entry(meta: &CheckpointMeta, rank: usize) -> (String, Option<u64>) {
    match meta.files.get(rank) {
        Some(f) => (f.name.clone(), Some(f.bytes)),
        None => (shard_file_name(rank, meta.world_size), None),
    }
}

/// A safetensors file whose header was parsed and checked (through a map that touches only the
/// header pages) and whose tensor data is read with positioned reads.
pub(crate) struct SourceFile {
    header: MappedFile,
    file: File,
}

impl SourceFile {
    /// Opens `path` and checks its header; `expected_len`: the size recorded at save time.
    ///
    /// Errors, naming the file: missing or unreadable, a size other than recorded, a header
    /// that does not parse or does not match the file's size.
    pub fn open(path: &Path, expected_len: Option<u64>) -> Result<Self> {
        let header = MappedFile::open(path, expected_len, &mut ReadStats::default())?;
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        Ok(Self { header, file })
    }

    /// Opens shard file `rank` of the checkpoint in `dir` and checks that its safetensors
    /// metadata names that rank and world size.
    pub fn open_shard(dir: &Path, meta: &CheckpointMeta, rank: usize) -> Result<Self> {
        let (name, bytes) = file_entry(meta, rank);
        let f = Self::open(&dir.join(name), bytes)?;
        let md = &f.header.metadata;
        if let (Some(r), Some(w)) = (md.get("rank"), md.get("world_size")) {
            if *r != rank.to_string() || *w != meta.world_size.to_string() {
                return Err(Error::file(
                    f.path(),
                    format!(
                        "expected the file of rank {rank} of {}, found rank {r} of {w}",
                        meta.world_size
                    ),
                ));
            }
        }
        Ok(f)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.header.path
    }

    /// The safetensors metadata (`__metadata__`).
    pub fn metadata(&self) -> &std::collections::HashMap<String, String> {
        &self.header.metadata
    }

    /// Names of its tensors, sorted by where their data starts (the order they were written).
    pub fn names_in_file_order(&self) -> Vec<String> {
        let mut names: Vec<(usize, String)> = self
            .header
            .names()
            .map(|n| {
                (
                    self.header.info(n).expect("listed").data_offsets.0,
                    n.into(),
                )
            })
            .collect();
        names.sort();
        names.into_iter().map(|(_, n)| n).collect()
    }

    /// The header entry of `name`, or an error naming file and tensor.
    pub fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.header
            .info(name)
            .ok_or_else(|| Error::file(self.path(), format!("tensor {name} is missing")))
    }

    /// Checks that `name` exists with `dtype` and `shape` (error naming file, tensor, expected
    /// vs found).
    pub fn check(&self, name: &str, dtype: Dtype, shape: &[usize]) -> Result<()> {
        self.header.check(name, dtype, shape)
    }

    /// Streams elements `range` (row-major) of tensor `name` to `sink` as little-endian `dst`
    /// values, converted from the tensor's float dtype (F32, BF16, F16, F64; rounding to
    /// nearest even as Candle's `to_dtype`), [`CHUNK_ELEMS`] elements at a time.
    ///
    /// Errors, naming file and tensor: missing, a non-float dtype, a range past its end, a read
    /// error (a file shortened since it was opened).
    pub fn stream(
        &self,
        name: &str,
        range: Range<usize>,
        dst: Dtype,
        sink: &mut Sink<'_>,
    ) -> Result<()> {
        let info = self.info(name)?;
        let src = info.dtype;
        if candle_dtype(src).is_none() {
            return Err(Error::file(
                self.path(),
                format!(
                    "tensor {name}: expected a float dtype (F32, BF16, F16, F64), found {src:?}"
                ),
            ));
        }
        let size = src.bitsize() / 8;
        let numel: usize = info.shape.iter().product();
        if range.end > numel {
            return Err(Error::file(
                self.path(),
                format!("tensor {name}: elements {range:?} requested, it has {numel} elements"),
            ));
        }
        let start = self.header.byte_range(name).expect("checked above").start;
        let base = start + (range.start * size) as u64;
        let mut raw = vec![0u8; CHUNK_ELEMS.min(range.len()) * size];
        let mut converted = Vec::new();
        let mut done = 0;
        while done < range.len() {
            let n = CHUNK_ELEMS.min(range.len() - done);
            let buf = &mut raw[..n * size];
            read_at(&self.file, base + (done * size) as u64, buf)
                .map_err(|e| Error::file(self.path(), format!("reading tensor {name}: {e}")))?;
            if src == dst {
                sink(buf)?;
            } else {
                convert(src, dst, buf, &mut converted);
                sink(&converted)?;
            }
            done += n;
        }
        Ok(())
    }
}

impl SourceFile {
    /// Streams the stored bytes of tensor `name` (any dtype) to `sink`, in pieces of at most
    /// [`CHUNK_ELEMS`]·4 bytes.
    ///
    /// Errors, naming file and tensor: missing; a read error.
    pub(crate) fn stream_raw(&self, name: &str, sink: &mut Sink<'_>) -> Result<()> {
        let r = self
            .header
            .byte_range(name)
            .ok_or_else(|| Error::file(self.path(), format!("tensor {name} is missing")))?;
        let mut buf = vec![0u8; (CHUNK_ELEMS * 4).min((r.end - r.start) as usize)];
        let mut at = r.start;
        while at < r.end {
            let n = ((r.end - at) as usize).min(buf.len());
            read_at(&self.file, at, &mut buf[..n])
                .map_err(|e| Error::file(self.path(), format!("reading tensor {name}: {e}")))?;
            sink(&buf[..n])?;
            at += n as u64;
        }
        Ok(())
    }
}

/// Checks every tensor's CRC-32C against the one `meta.json` records (format 3; older
/// checkpoints record none), reading each file once in constant memory: what `export` and
/// `reshard` do before writing anything, so that a flipped bit is never carried into a file
/// that then verifies clean. Also what loading checks (`checkpoint::load_sharded`).
///
/// Errors, naming file and tensor: a missing or unreadable file or tensor; a checksum that
/// differs (expected vs found).
pub(crate) fn check_checksums(dir: &Path, meta: &CheckpointMeta) -> Result<()> {
    for entry in &meta.files {
        if entry.crc32c.is_empty() {
            continue;
        }
        let f = SourceFile::open_shard(dir, meta, entry.rank)?;
        for (name, &expected) in &entry.crc32c {
            if f.header.byte_range(name).is_none() {
                // Missing: the structural checks that follow name it with its dtype and shape.
                continue;
            }
            let mut crc = 0u32;
            f.stream_raw(name, &mut |b| {
                crc = crc32c::crc32c_append(crc, b);
                Ok(())
            })?;
            if crc != expected {
                return Err(Error::file(
                    f.path(),
                    format!(
                        "tensor {name}: CRC-32C {crc:08x} of its data differs from the \
                         {expected:08x} recorded in meta.json (the data changed after the save; \
                         `fsdp-ckpt verify` lists every problem)"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Reads exactly `buf.len()` bytes at `offset`.
fn read_at(file: &File, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
    let mut f = file;
    f.seek(SeekFrom::Start(offset))?;
    f.read_exact(buf)
}

/// `values` as little-endian `dst` bytes (float dtypes).
pub(crate) fn convert_f32(values: &[f32], dst: Dtype) -> Vec<u8> {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    if dst == Dtype::F32 {
        return bytes;
    }
    let mut out = Vec::new();
    convert(Dtype::F32, dst, &bytes, &mut out);
    out
}

/// Converts little-endian `src` values to little-endian `dst` values (float dtypes).
fn convert(src: Dtype, dst: Dtype, bytes: &[u8], out: &mut Vec<u8>) {
    out.clear();
    let size = src.bitsize() / 8;
    out.reserve(bytes.len() / size * (dst.bitsize() / 8));
    for c in bytes.chunks_exact(size) {
        if src == Dtype::F64 {
            let v = f64::from_le_bytes(c.try_into().expect("8 bytes"));
            match dst {
                Dtype::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
                Dtype::BF16 => out.extend_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
                Dtype::F16 => out.extend_from_slice(&half::f16::from_f64(v).to_le_bytes()),
                _ => out.extend_from_slice(&v.to_le_bytes()),
            }
            continue;
        }
        let v = match src {
            Dtype::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            Dtype::BF16 => half::bf16::from_le_bytes([c[0], c[1]]).to_f32(),
            _ => half::f16::from_le_bytes([c[0], c[1]]).to_f32(),
        };
        match dst {
            Dtype::F32 => out.extend_from_slice(&v.to_le_bytes()),
            Dtype::BF16 => out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
            Dtype::F16 => out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            _ => out.extend_from_slice(&(v as f64).to_le_bytes()),
        }
    }
}

/// Sends `nbytes` zero bytes to `sink`.
fn zeros(nbytes: usize, sink: &mut Sink<'_>) -> Result<()> {
    static Z: [u8; 64 << 10] = [0; 64 << 10];
    let mut left = nbytes;
    while left > 0 {
        let n = left.min(Z.len());
        sink(&Z[..n])?;
        left -= n;
    }
    Ok(())
}

/// The safetensors dtype of a dtype name recorded in the metadata (`F32`, `BF16`, …).
pub(crate) fn parse_dtype(name: &str, path: &Path, what: &str) -> Result<Dtype> {
    serde_json::from_value(serde_json::Value::String(name.to_string()))
        .map_err(|_| Error::file(path, format!("{what}: unknown dtype {name}")))
}

/// The safetensors dtype of an export dtype.
pub(crate) fn st_float(dtype: DType) -> Result<Dtype> {
    match dtype {
        DType::F32 => Ok(Dtype::F32),
        DType::BF16 => Ok(Dtype::BF16),
        DType::F16 => Ok(Dtype::F16),
        DType::F64 => Ok(Dtype::F64),
        other => Err(Error::dtype(
            "a model file's tensor",
            "float (F32, BF16, F16, F64)",
            other,
        )),
    }
}

/// The f32 values of little-endian bytes (what [`SourceFile::stream`] writes for `Dtype::F32`).
pub(crate) fn f32s_le(b: &[u8]) -> impl Iterator<Item = f32> + '_ {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

/// Streams elements `range` of a unit's flat buffer: parameter elements through `read`
/// (parameter index, element range of the parameter), zeros for the alignment gaps and the
/// padding. `params`: `(offset, numel)` in flat order; `elem`: bytes an element.
fn stream_flat(
    params: &[(usize, usize)],
    range: Range<usize>,
    elem: usize,
    sink: &mut Sink<'_>,
    read: &mut ReadPiece<'_>,
) -> Result<()> {
    let mut at = range.start;
    for (i, &(off, numel)) in params.iter().enumerate() {
        let (s, e) = (off.max(range.start), (off + numel).min(range.end));
        if s >= e {
            continue;
        }
        zeros((s - at) * elem, sink)?;
        read(i, s - off..e - off, sink)?;
        at = e;
    }
    zeros((range.end.max(at) - at) * elem, sink)
}

/// Writes a sharded checkpoint offline, as [`super::save_sharded`] lays one out: `plan[r]` lists
/// rank `r`'s tensors in file order, each with what `fill` needs to stream its bytes. The files
/// go into a hidden staging directory under `root`, `meta` (its `files` filled in here) is
/// written last, and the directory is renamed to `step-<step>`.
///
/// Errors: the checkpoint `root/step-<step>` already exists (naming it); any write error
/// (naming the file; the staging directory is removed).
fn write_sharded<T>(
    root: &Path,
    mut meta: CheckpointMeta,
    plan: Vec<Vec<(TensorSpec, T)>>,
    fill: &mut dyn FnMut(usize, &T, &mut Sink<'_>) -> Result<()>,
) -> Result<PathBuf> {
    let name = step_dir_name(meta.train.step);
    let final_dir = root.join(&name);
    if final_dir.exists() {
        return Err(Error::file(
            &final_dir,
            "already exists: remove it or choose another output directory",
        ));
    }
    let staging = root.join(format!(".{name}.partial"));
    prepare_staging(root, &staging)?;
    let ws = meta.world_size;
    let written = (|| -> Result<Vec<FileMeta>> {
        let mut files = Vec::with_capacity(ws);
        for (rank, tensors) in plan.into_iter().enumerate() {
            let file_name = shard_file_name(rank, ws);
            let path = staging.join(&file_name);
            let md = std::collections::HashMap::from([
                ("format".to_string(), SHARDED_FORMAT.to_string()),
                ("format_version".to_string(), FORMAT_VERSION.to_string()),
                ("rank".to_string(), rank.to_string()),
                ("world_size".to_string(), ws.to_string()),
            ]);
            let specs = tensors.iter().map(|(s, _)| s.clone()).collect();
            let mut w = SafetensorsWriter::create(&path, specs, md)?;
            for (spec, source) in &tensors {
                let nbytes = spec.shape.iter().product::<usize>() * spec.dtype.bitsize() / 8;
                w.begin_tensor(&spec.name, spec.dtype, nbytes)?;
                fill(rank, source, &mut |b| w.write_part(b))?;
            }
            let names: Vec<String> = tensors.iter().map(|(s, _)| s.name.clone()).collect();
            let (bytes, crcs) = w.finish()?;
            files.push(FileMeta {
                rank,
                name: file_name,
                bytes,
                crc32c: names.into_iter().zip(crcs).collect(),
            });
        }
        Ok(files)
    })();
    let published = written.and_then(|files| {
        meta.files = files;
        publish(root, &staging, &final_dir, &meta, 0)
    });
    if let Err(e) = published {
        let _ = fs::remove_dir_all(&staging);
        return Err(e);
    }
    Ok(final_dir)
}

/// One optimizer buffer of a checkpoint: its tensor name without the `optim.` prefix
/// (`<kind>.<unit>`) and the unit whose shard it is laid out like.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OptimBuffer {
    pub name: String,
    pub unit: Option<usize>,
}

/// The optimizer state a checkpoint holds: its buffers and steps taken.
#[derive(Debug, Clone)]
pub(crate) struct OptimList {
    /// Every buffer kind for every unit (typed metadata), or what rank 0's file holds
    /// (version 1, whose metadata lists no optimizer).
    pub buffers: Vec<OptimBuffer>,
    /// Optimizer steps taken.
    pub step: u64,
    /// Kind and groups, when recorded (format 3).
    pub hyper: Option<crate::optim::OptimizerHyper>,
    /// The buffer kinds (every unit has each).
    pub kinds: Vec<crate::optim::BufferKind>,
}

impl OptimList {
    /// The optimizer metadata of a checkpoint written from `meta`'s: `meta`'s own (format 3, or
    /// format 2 converted on reading), or, for version 1, the kinds found in the file and one
    /// optimizer-wide step count given to every parameter (what the live reader assumes).
    pub(crate) fn to_meta(&self, meta: &CheckpointMeta) -> OptimizerMeta {
        if let Some(o) = &meta.optimizer {
            return o.clone();
        }
        let param_steps = if self.step > 0 {
            meta.units
                .iter()
                .flat_map(|u| &u.params)
                .map(|p| (p.name.clone(), self.step))
                .collect()
        } else {
            Default::default()
        };
        OptimizerMeta {
            step: self.step,
            hyper: None,
            buffer_kinds: self.kinds.clone(),
            param_steps,
            buffers: Vec::new(),
            state_dtype: safetensors::Dtype::F32,
        }
    }
}

/// The optimizer state of `meta`; `file0` (rank 0's file header) is read only for version 1,
/// whose metadata lists no optimizer (`None` then when it is not given).
pub(crate) fn optim_list(meta: &CheckpointMeta, file0: Option<&MappedFile>) -> Option<OptimList> {
    let (kinds, step, hyper) = match &meta.optimizer {
        Some(o) => (o.buffer_kinds.clone(), o.step, o.hyper.clone()),
        None => {
            let kinds = crate::checkpoint::sharded::discover_kinds(file0?);
            let step = if kinds.is_empty() { 0 } else { meta.train.step };
            (kinds, step, None)
        }
    };
    let buffers = kinds
        .iter()
        .flat_map(|kind| {
            // Units left to the base (adapter-only checkpoints) hold no state.
            (0..meta.units.len())
                .filter(|&k| !meta.units[k].in_base && !meta.units[k].no_optim_state)
                .map(move |k| OptimBuffer {
                    name: format!("{}.{k}", kind.name()),
                    unit: Some(k),
                })
        })
        .collect();
    Some(OptimList {
        buffers,
        step,
        hyper,
        kinds,
    })
}
