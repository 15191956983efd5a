//! `fsdp-ckpt export`: a sharded checkpoint, saved at any world size, to one full safetensors
//! file, streamed tensor by tensor.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::DType;
use safetensors::Dtype;

use super::{parse_dtype, resolve_checkpoint, st_float, SourceFile};
use crate::checkpoint::io::{SafetensorsWriter, TensorSpec};
use crate::checkpoint::{read_meta, FORMAT_VERSION, FULL_FORMAT, META_FILE};
use crate::error::{Error, Result};

/// What [`export_full`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportSummary {
    /// The checkpoint directory read (the newest one when a root was given).
    pub checkpoint: PathBuf,
    /// The model file written.
    pub path: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
    /// Tensors written (parameters and buffers).
    pub tensors: usize,
    /// Bytes of the largest tensor written.
    pub largest_tensor_bytes: u64,
}

/// Writes the full model of the sharded checkpoint `dir` (a checkpoint directory, or a root
/// whose newest complete checkpoint is used) to `out` as one safetensors file, without a process
/// group and at whatever world size it was saved.
///
/// The file is what [`crate::checkpoint::save_full`] writes for the same model: every unit in
/// model order, its parameters under their names and shapes, then its buffers; safetensors
/// metadata `format = candle-fsdp/full`, `format_version`, `dtype`. With `dtype: None` the
/// tensors keep the checkpoint's dtypes (f32 parameters, buffers in their own dtype) and the
/// file is byte-identical to `save_full`'s; with `Some(d)` (F32, BF16, F16 or F64) every tensor
/// is converted to `d` (rounding to nearest even, as Candle's `to_dtype`). Plain Candle
/// (`VarBuilder::from_mmaped_safetensors`) and PyTorch (`safetensors.torch.load_file`) load it
/// by name.
///
/// Memory: a constant ([`super::CHUNK_ELEMS`] elements of read and conversion buffer plus the
/// 256 KiB write buffer): tensors are streamed chunk by chunk. The file is written atomically
/// ([`crate::checkpoint::AtomicFile`]).
///
/// Errors, naming the file, the tensor and expected vs found: `dir` missing or not a checkpoint;
/// damaged `meta.json`; a shard file missing, of another size than recorded, with a corrupt
/// header, or without a tensor the metadata lists, or a tensor whose CRC-32C differs from the
/// one recorded at save time (all checked before anything is written: one extra read of the
/// checkpoint); `out` not writable; `out` inside the checkpoint; `out` an existing file while
/// `overwrite` is false (an export loses no data: with `overwrite`, the file is replaced
/// atomically once the export is complete).
pub fn export_full(
    dir: &Path,
    out: &Path,
    dtype: Option<DType>,
    overwrite: bool,
) -> Result<ExportSummary> {
    let dir = resolve_checkpoint(dir)?;
    // Writing into the checkpoint (e.g. over one of its shards) would destroy what is read.
    let out_dir = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if let (Ok(a), Ok(b)) = (fs::canonicalize(out_dir), fs::canonicalize(&dir)) {
        if a.starts_with(&b) {
            return Err(Error::file(
                out,
                format!(
                    "is inside the checkpoint being exported ({}): choose an output outside it",
                    dir.display()
                ),
            ));
        }
    }
    if out.is_dir() {
        return Err(Error::file(
            out,
            "is a directory: --out names the file to write (e.g. DIR/model.safetensors)",
        ));
    }
    // `symlink_metadata`: a link (even a dangling one) is something there, not an absent path.
    if out.symlink_metadata().is_ok() && !overwrite {
        return Err(Error::file(
            out,
            "exists: an export does not replace a file unless given --overwrite",
        ));
    }
    let meta = read_meta(&dir)?;
    super::check_checksums(&dir, &meta)?;
    let meta_path = dir.join(META_FILE);
    if let Some(base) = meta.adapter_base() {
        return Err(Error::file(
            &meta_path,
            format!(
                "an adapter-only checkpoint: its frozen base ({}) is not in it; export the \
                 adapters with --format peft, or the merged model with --format hf --merge \
                 (which reads the base)",
                base.dir.display()
            ),
        ));
    }
    let dst = dtype.map(st_float).transpose()?;
    let files = open_shard_files(&dir, &meta)?;
    let mut specs = Vec::new();
    for u in &meta.units {
        for p in &u.params {
            specs.push(TensorSpec {
                name: p.name.clone(),
                dtype: dst.unwrap_or(Dtype::F32),
                shape: p.shape.clone(),
            });
        }
        for b in &u.buffers {
            let saved = parse_dtype(&b.dtype, &meta_path, &format!("buffer {}", b.name))?;
            files[0].check(&format!("buffer.{}", b.name), saved, &b.shape)?;
            specs.push(TensorSpec {
                name: b.name.clone(),
                dtype: dst.unwrap_or(saved),
                shape: b.shape.clone(),
            });
        }
    }
    let largest = specs
        .iter()
        .map(|s| (s.shape.iter().product::<usize>() * s.dtype.bitsize() / 8) as u64)
        .max()
        .unwrap_or(0);
    let tensors = specs.len();
    let file_dtype = dst.unwrap_or(Dtype::F32);
    let md = HashMap::from([
        ("format".to_string(), FULL_FORMAT.to_string()),
        ("format_version".to_string(), FORMAT_VERSION.to_string()),
        ("dtype".to_string(), format!("{file_dtype:?}")),
    ]);
    let mut w = SafetensorsWriter::create(out, specs, md)?;
    for (k, u) in meta.units.iter().enumerate() {
        let name = format!("param.{k}");
        let n = u.shard_numel;
        let to = dst.unwrap_or(Dtype::F32);
        for p in &u.params {
            w.begin_tensor(&p.name, to, p.numel * to.bitsize() / 8)?;
            stream_param(&files, &name, n, p, to, &mut |b| w.write_part(b))?;
        }
        for b in &u.buffers {
            let saved = parse_dtype(&b.dtype, &meta_path, &format!("buffer {}", b.name))?;
            let to = dst.unwrap_or(saved);
            let numel: usize = b.shape.iter().product();
            w.begin_tensor(&b.name, to, numel * to.bitsize() / 8)?;
            files[0].stream(&format!("buffer.{}", b.name), 0..numel, to, &mut |x| {
                w.write_part(x)
            })?;
        }
    }
    let (bytes, _crcs) = w.finish()?;
    Ok(ExportSummary {
        checkpoint: dir,
        path: out.to_path_buf(),
        bytes,
        tensors,
        largest_tensor_bytes: largest,
    })
}

/// Streams parameter `p` of unit tensor `name` (elements `[offset, offset + numel)` of the
/// unit's flat buffer, split into shards of `shard_numel` elements, shard `s` in `files[s]`)
/// to `sink` as `to` values.
pub(crate) fn stream_param(
    files: &[SourceFile],
    name: &str,
    shard_numel: usize,
    p: &crate::checkpoint::ParamMeta,
    to: Dtype,
    sink: &mut super::Sink<'_>,
) -> Result<()> {
    let mut flat = p.offset;
    let end = p.offset + p.numel;
    while flat < end {
        let (s, off) = (flat / shard_numel, flat % shard_numel);
        let len = (shard_numel - off).min(end - flat);
        files[s].stream(name, off..off + len, to, sink)?;
        flat += len;
    }
    Ok(())
}

/// [`stream_param`] into f32 values: parameter `p` of unit tensor `name` (one parameter's
/// memory; a piece of it when `p` describes a range).
pub(crate) fn read_param_f32(
    files: &[SourceFile],
    name: &str,
    shard_numel: usize,
    p: &crate::checkpoint::ParamMeta,
) -> Result<Vec<f32>> {
    let mut v = Vec::with_capacity(p.numel);
    stream_param(files, name, shard_numel, p, Dtype::F32, &mut |b| {
        v.extend(super::f32s_le(b));
        Ok(())
    })?;
    Ok(v)
}

/// The shard files of the checkpoint `dir` holding some unit's shard, or (rank 0's) the
/// buffers, each unit's `param.<k>` checked (F32, `shard_numel` elements) in the files of its
/// shards.
///
/// Errors, naming file and tensor: a file missing, of another size than recorded, for another
/// rank; a unit's shard tensor missing or of another dtype or size.
pub(crate) fn open_shard_files(
    dir: &std::path::Path,
    meta: &crate::checkpoint::CheckpointMeta,
) -> Result<Vec<SourceFile>> {
    let needed = meta
        .units
        .iter()
        .map(|u| u.world_size)
        .max()
        .unwrap_or(0)
        .max(1);
    let files: Vec<SourceFile> = (0..needed)
        .map(|s| SourceFile::open_shard(dir, meta, s))
        .collect::<Result<_>>()?;
    for (k, u) in meta.units.iter().enumerate().filter(|(_, u)| !u.in_base) {
        for f in files.iter().take(u.world_size) {
            f.check(&format!("param.{k}"), Dtype::F32, &[u.shard_numel])?;
        }
    }
    Ok(files)
}
