//! `fsdp-ckpt export --format hf`: a sharded checkpoint to a Hugging Face model directory
//! (`config.json` and `model.safetensors`, or `model.safetensors.index.json` and
//! `model-0000k-of-0000n.safetensors` above a size), streamed tensor by tensor.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::DType;
use safetensors::Dtype;

use super::weights::{HF_INDEX_FILE, HF_WEIGHTS_FILE};
use crate::checkpoint::io::{write_atomic, SafetensorsWriter, TensorSpec};
use crate::checkpoint::tools::export::{open_shard_files, read_param_f32, stream_param};
use crate::checkpoint::tools::{check_checksums, parse_dtype, resolve_checkpoint, st_float};
use crate::checkpoint::{read_meta, META_FILE};
use crate::error::{Error, Result};

/// Key of [`crate::checkpoint::TrainState::extra`] under which a training run stores the
/// Hugging Face `config.json` (as text) of its model, for [`export_hf`].
pub const HF_CONFIG_KEY: &str = "hf_config";

/// Options of [`export_hf`].
#[derive(Debug, Clone)]
pub struct HfExportOptions {
    /// Dtype of the weights (F32, BF16, F16); `None`: the checkpoint's (f32).
    pub dtype: Option<DType>,
    /// Above this many bytes of weights, the files are sharded (each file at most this size,
    /// or one tensor when a tensor is larger) with an index, as `save_pretrained`'s
    /// `max_shard_size`. Default 5 GB (5·10⁹ bytes).
    pub max_shard_bytes: u64,
    /// The `config.json` to write (its dtype keys updated); `None`: the one the checkpoint
    /// stores under [`HF_CONFIG_KEY`].
    pub config: Option<PathBuf>,
    /// A LoRA run's checkpoint: write the merged model, each adapted weight `W + s·B·A`
    /// (transposed for GPT-2's `Conv1D`), without the adapters (PEFT's `merge_and_unload`).
    /// Required for such a checkpoint (its adapters alone: `--format peft`).
    pub merge: bool,
    /// An adapter-only checkpoint's frozen base read from this directory instead of the one
    /// recorded (moved or copied; checked against the recorded identity either way).
    pub base: Option<PathBuf>,
}

impl Default for HfExportOptions {
    fn default() -> Self {
        Self {
            dtype: None,
            max_shard_bytes: 5_000_000_000,
            config: None,
            merge: false,
            base: None,
        }
    }
}

/// What [`export_hf`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfExportSummary {
    /// The checkpoint directory read.
    pub checkpoint: PathBuf,
    /// The weight files written, in order.
    pub files: Vec<PathBuf>,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of tensor data (the index's `total_size`).
    pub total_size: u64,
}

fn is_lora(name: &str) -> bool {
    name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight")
}

/// One adapted weight's update: `A` `(r, in)`, `B` `(out, r)`, the scale, and whether the
/// weight is stored `(in, out)` (`Conv1D`).
struct Merge {
    a: Vec<f32>,
    b: Vec<f32>,
    r: usize,
    scale: f32,
    conv1d: bool,
}

impl Merge {
    /// `W + s·B·A` for the f32 little-endian bytes of `W` (shape `shape`), in `W`'s layout.
    fn apply(&self, base: &[u8], shape: &[usize]) -> Vec<f32> {
        let w: Vec<f32> = crate::checkpoint::tools::f32s_le(base).collect();
        let cols = shape[1];
        let inp = self.a.len() / self.r;
        w.iter()
            .enumerate()
            .map(|(e, &v)| {
                let (i, j) = (e / cols, e % cols);
                // (out row o, in column c) of B·A.
                let (o, c) = if self.conv1d { (j, i) } else { (i, j) };
                let mut d = 0f32;
                for k in 0..self.r {
                    d += self.b[o * self.r + k] * self.a[k * inp + c];
                }
                v + self.scale * d
            })
            .collect()
    }
}

/// The merges of a LoRA checkpoint: each adapted module's `weight` → its update.
fn lora_merges(
    files: &[crate::checkpoint::tools::SourceFile],
    meta: &crate::checkpoint::CheckpointMeta,
    config: &serde_json::Value,
) -> Result<HashMap<String, Merge>> {
    let meta_path = Path::new(META_FILE);
    let text = meta
        .train
        .extra
        .get(crate::lora::LORA_CONFIG_KEY)
        .ok_or_else(|| Error::file(meta_path, "no LoRA config"))?;
    let lora: crate::lora::LoraConfig = serde_json::from_str(text)
        .map_err(|e| Error::file(meta_path, format!("the LoRA config is not valid: {e}")))?;
    let conv1d = config["model_type"] == "gpt2";
    let read = |k: usize, p: &crate::checkpoint::ParamMeta| {
        read_param_f32(files, &format!("param.{k}"), meta.units[k].shard_numel, p)
    };
    let mut out = HashMap::new();
    for (k, u) in meta.units.iter().enumerate() {
        for p in u
            .params
            .iter()
            .filter(|p| p.name.ends_with(".lora_A.weight"))
        {
            let module = p.name.trim_end_matches(".lora_A.weight");
            let b_name = format!("{module}.lora_B.weight");
            let (kb, pb) = meta
                .units
                .iter()
                .enumerate()
                .find_map(|(kb, ub)| ub.params.iter().find(|q| q.name == b_name).map(|q| (kb, q)))
                .ok_or_else(|| Error::file(meta_path, format!("{b_name} is missing")))?;
            out.insert(
                format!("{module}.weight"),
                Merge {
                    a: read(k, p)?,
                    b: read(kb, pb)?,
                    r: p.shape[0],
                    scale: lora.scale() as f32,
                    conv1d,
                },
            );
        }
    }
    Ok(out)
}

/// The Hugging Face dtype name of a safetensors dtype.
fn torch_name(d: Dtype) -> &'static str {
    match d {
        Dtype::BF16 => "bfloat16",
        Dtype::F16 => "float16",
        Dtype::F64 => "float64",
        _ => "float32",
    }
}

/// Writes the model of the sharded checkpoint `dir` (a checkpoint, or a root whose newest one
/// is used) as a Hugging Face model directory `out`, without a process group.
///
/// Tensors keep the checkpoint's names (a model whose parameters carry Hugging Face's names,
/// as `models::llama`, is then loadable by `transformers`' `from_pretrained`), in model order,
/// parameters then buffers of each unit, converted to `opts.dtype`; safetensors metadata
/// `format = pt` (what transformers requires). Up to `opts.max_shard_bytes` of data: one
/// `model.safetensors`; above: consecutive tensors grouped into files of at most that size,
/// `model-00001-of-0000N.safetensors`, …, and `model.safetensors.index.json`
/// (`metadata.total_size`, `weight_map`). `config.json` is the checkpoint's
/// [`HF_CONFIG_KEY`] (or `opts.config`) with `torch_dtype` and `dtype` set to the weights'.
///
/// Memory: constant, as [`crate::checkpoint::tools::export_full`] (chunks of [`crate::checkpoint::tools::CHUNK_ELEMS`]). Each file
/// is written atomically, `config.json` last. Before anything is written (or `out` created):
/// the config is read, the checkpoint's tensors are checked against the parameters of the
/// decoder the config describes (any family of `models::decoder`: names and shapes; with the
/// cargo feature `llama`), and the
/// checksums are verified. A failure while writing removes what the export wrote: the
/// directories it created, or, in a directory that existed, its own files.
///
/// Errors, naming the file: as [`crate::checkpoint::tools::export_full`] (but for the rules on
/// an existing output, which follow here); no config (the checkpoint stores none
/// and `opts.config` is `None`) or one that is not a JSON object; a config that is not a
/// decoder family's (`models::decoder::family::config_from_json`), or whose model's parameters are
/// not the checkpoint's (a missing or extra tensor, a shape: config vs checkpoint); `out` a
/// file, inside the checkpoint, or already holding Hugging Face weights (`model.safetensors`,
/// an index or `model-*` shards: mixing two exports would load the wrong files) or an adapter
/// or a config (any format: `export_peft`'s `refuse_exported`); a zero
/// `max_shard_bytes`.
pub fn export_hf(dir: &Path, out: &Path, opts: &HfExportOptions) -> Result<HfExportSummary> {
    let dir = resolve_checkpoint(dir)?;
    if opts.max_shard_bytes == 0 {
        return Err(Error::value("max_shard_bytes", "at least 1", 0));
    }
    if out.exists() && !out.is_dir() {
        return Err(Error::file(
            out,
            "exists and is not a directory: the Hugging Face layout is a directory",
        ));
    }
    let meta = read_meta(&dir)?;
    let meta_path = dir.join(META_FILE);
    let config_text = match &opts.config {
        Some(p) => std::fs::read_to_string(p).map_err(|e| Error::io(p, e))?,
        None => meta
            .train
            .extra
            .get(HF_CONFIG_KEY)
            .cloned()
            .ok_or_else(|| {
                Error::file(
                    &meta_path,
                    format!(
                        "no Hugging Face config: the checkpoint stores none (train.extra.\
                     {HF_CONFIG_KEY}, written by a run started from --from-hf or by the llama or gpt \
                     example); give one (--hf-config FILE)"
                    ),
                )
            })?,
    };
    let config_src = opts.config.clone().unwrap_or(meta_path.clone());
    let mut config: serde_json::Value = serde_json::from_str(&config_text)
        .map_err(|e| Error::file(&config_src, format!("config is not JSON: {e}")))?;
    let lora = meta.train.extra.get(crate::lora::LORA_CONFIG_KEY);
    match (lora, opts.merge) {
        (Some(_), false) => {
            return Err(Error::file(
                &meta_path,
                "a LoRA run's checkpoint: export its adapters with --format peft, or the \
                 merged model with --format hf --merge",
            ))
        }
        (None, true) => {
            return Err(Error::file(
                &meta_path,
                "--merge needs a LoRA run's checkpoint; this one has no adapters (export it \
                 without --merge)",
            ))
        }
        _ => {}
    }
    #[cfg(feature = "llama")]
    check_against_config(&config_text, &config_src, &meta, &meta_path)?;
    check_checksums(&dir, &meta)?;
    let to = opts.dtype.map(st_float).transpose()?.unwrap_or(Dtype::F32);
    let obj = config
        .as_object_mut()
        .ok_or_else(|| Error::file(&config_src, "config is not a JSON object"))?;
    for key in ["torch_dtype", "dtype"] {
        obj.insert(key.into(), torch_name(to).into());
    }
    // Everything is checked: only now is `out` created. A failure from here on removes what
    // this export wrote (the directories it created, or its files in an existing one).
    let created = first_missing(out);
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let mut written = Vec::new();
    let result = write_hf(&dir, out, opts, &meta, &config, to, &mut written);
    if result.is_err() {
        match &created {
            Some(top) => {
                let _ = std::fs::remove_dir_all(top);
            }
            None => {
                for f in &written {
                    let _ = std::fs::remove_file(f);
                }
            }
        }
    }
    result
}

/// The outermost directory of `path` (itself included) that does not exist yet: what
/// `create_dir_all(path)` creates. `None` when `path` exists.
fn first_missing(path: &Path) -> Option<PathBuf> {
    let mut top = None;
    let mut p = Some(path);
    while let Some(q) = p.filter(|q| !q.as_os_str().is_empty() && !q.exists()) {
        top = Some(q.to_path_buf());
        p = q.parent();
    }
    top
}

/// Checks that the checkpoint's tensors are exactly the parameters of the decoder that `config`
/// (read from `config_src`) describes, with its shapes: `--hf-config` of another model, or a
/// checkpoint of another model, would otherwise publish a directory that `from_pretrained`
/// refuses, or loads with some weights randomly initialised.
///
/// Errors: the config is not one of the decoder's families
/// (`models::decoder::family::config_from_json`'s errors, naming it); a parameter of the config
/// missing from the checkpoint, a checkpoint tensor the config's model lacks, or a shape that
/// differs (config vs checkpoint), naming the tensor, `meta.json` and the config.
#[cfg(feature = "llama")]
fn check_against_config(
    config_text: &str,
    config_src: &Path,
    meta: &crate::checkpoint::CheckpointMeta,
    meta_path: &Path,
) -> Result<()> {
    use crate::models::decoder::family::config_from_json;
    let cfg = config_from_json(config_text, config_src).map_err(|e| {
        Error::InvalidArgument(format!(
            "--format hf exports a model of the decoder's families (models::decoder) and \
             checks the checkpoint against its config: {e}"
        ))
    })?;
    let expected = cfg.parameter_shapes()?;
    let mut found: BTreeMap<&str, &[usize]> = BTreeMap::new();
    for u in &meta.units {
        for p in u.params.iter().filter(|p| !is_lora(&p.name)) {
            found.insert(p.name.as_str(), p.shape.as_slice());
        }
        for b in &u.buffers {
            found.insert(b.name.as_str(), b.shape.as_slice());
        }
    }
    let against = format!("the model of {}", config_src.display());
    for (name, shape) in &expected {
        match found.get(name.as_str()) {
            None => {
                return Err(Error::file(
                    meta_path,
                    format!(
                        "tensor {name} (shape {shape:?}) of {against} is not in the checkpoint: \
                         the checkpoint is of another model"
                    ),
                ))
            }
            Some(s) if *s != shape.as_slice() => {
                return Err(Error::file(
                    meta_path,
                    format!(
                        "tensor {name}: {against} expects shape {shape:?}, the checkpoint \
                         has {s:?}"
                    ),
                ))
            }
            Some(_) => {}
        }
    }
    let known: std::collections::HashSet<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
    if let Some(extra) = found.keys().find(|n| !known.contains(*n)) {
        return Err(Error::file(
            meta_path,
            format!("tensor {extra} of the checkpoint is not a parameter of {against}"),
        ));
    }
    Ok(())
}

/// The writing part of [`export_hf`], into the existing directory `out`; every file it
/// completes is pushed on `written`.
fn write_hf(
    dir: &Path,
    out: &Path,
    opts: &HfExportOptions,
    meta: &crate::checkpoint::CheckpointMeta,
    config: &serde_json::Value,
    to: Dtype,
    written: &mut Vec<PathBuf>,
) -> Result<HfExportSummary> {
    if let (Ok(a), Ok(b)) = (std::fs::canonicalize(out), std::fs::canonicalize(dir)) {
        if a.starts_with(&b) {
            return Err(Error::file(
                out,
                format!(
                    "is inside the checkpoint being exported ({})",
                    dir.display()
                ),
            ));
        }
    }
    super::export_peft::refuse_exported(out)?;
    let meta_path = dir.join(META_FILE);
    let files = open_shard_files(dir, meta)?;
    // Every tensor: where it comes from (unit, parameter or buffer index), its spec.
    enum Src {
        Param(usize, usize),
        Buffer(usize, usize),
    }
    let mut tensors: Vec<(Src, TensorSpec)> = Vec::new();
    let merges = if opts.merge {
        lora_merges(&files, meta, config)?
    } else {
        HashMap::new()
    };
    // An adapter-only checkpoint's frozen units are read from its base, checked unchanged.
    let base = match meta.adapter_base() {
        Some(b) => {
            b.verify_at(opts.base.as_deref())
                .map_err(|e| Error::file(&meta_path, crate::checkpoint::root_message(e)))?;
            Some(super::weights::HfWeights::open(
                opts.base.as_deref().unwrap_or(&b.dir),
                &mut crate::checkpoint::ReadStats::default(),
            )?)
        }
        None => None,
    };
    for (k, u) in meta.units.iter().enumerate() {
        for (i, p) in u
            .params
            .iter()
            .enumerate()
            .filter(|(_, p)| !is_lora(&p.name))
        {
            let spec = TensorSpec {
                name: p.name.clone(),
                dtype: to,
                shape: p.shape.clone(),
            };
            tensors.push((Src::Param(k, i), spec));
        }
        for (i, b) in u.buffers.iter().enumerate() {
            let saved = parse_dtype(&b.dtype, &meta_path, &format!("buffer {}", b.name))?;
            files[0].check(&format!("buffer.{}", b.name), saved, &b.shape)?;
            let spec = TensorSpec {
                name: b.name.clone(),
                dtype: to,
                shape: b.shape.clone(),
            };
            tensors.push((Src::Buffer(k, i), spec));
        }
    }
    let nbytes =
        |s: &TensorSpec| (s.shape.iter().product::<usize>() * s.dtype.bitsize() / 8) as u64;
    let total_size: u64 = tensors.iter().map(|(_, s)| nbytes(s)).sum();
    // Consecutive tensors grouped into files of at most max_shard_bytes.
    let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
    let mut in_group = 0u64;
    for (i, (_, s)) in tensors.iter().enumerate() {
        let n = nbytes(s);
        if in_group > 0 && in_group + n > opts.max_shard_bytes {
            groups.push(Vec::new());
            in_group = 0;
        }
        groups.last_mut().expect("one group").push(i);
        in_group += n;
    }
    let count = groups.len();
    let file_name = |g: usize| {
        if count == 1 {
            HF_WEIGHTS_FILE.to_string()
        } else {
            format!("model-{:05}-of-{count:05}.safetensors", g + 1)
        }
    };
    let md = HashMap::from([("format".to_string(), "pt".to_string())]);
    let mut weight_map = BTreeMap::new();
    for (g, members) in groups.iter().enumerate() {
        let path = out.join(file_name(g));
        let specs = members.iter().map(|&i| tensors[i].1.clone()).collect();
        let mut w = SafetensorsWriter::create(&path, specs, md.clone())?;
        for &i in members {
            let (src, spec) = &tensors[i];
            w.begin_tensor(&spec.name, to, nbytes(spec) as usize)?;
            match *src {
                Src::Param(k, j) if meta.units[k].in_base => {
                    let p = &meta.units[k].params[j];
                    let base = base.as_ref().expect("opened for units in the base");
                    let mut v = vec![0f32; p.numel];
                    base.read_f32(
                        &p.name,
                        0..p.numel,
                        &mut v,
                        &mut crate::checkpoint::ReadStats::default(),
                    )?;
                    if let Some(m) = merges.get(&p.name) {
                        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                        v = m.apply(&bytes, &p.shape);
                    }
                    w.write_part(&crate::checkpoint::tools::convert_f32(&v, to))?;
                }
                Src::Param(k, j) => {
                    let u = &meta.units[k];
                    let p = &u.params[j];
                    match merges.get(&p.name) {
                        None => stream_param(
                            &files,
                            &format!("param.{k}"),
                            u.shard_numel,
                            p,
                            to,
                            &mut |b| w.write_part(b),
                        )?,
                        Some(m) => {
                            let mut base = Vec::with_capacity(p.numel * 4);
                            stream_param(
                                &files,
                                &format!("param.{k}"),
                                u.shard_numel,
                                p,
                                Dtype::F32,
                                &mut |b| {
                                    base.extend_from_slice(b);
                                    Ok(())
                                },
                            )?;
                            let merged = m.apply(&base, &p.shape);
                            w.write_part(&crate::checkpoint::tools::convert_f32(&merged, to))?;
                        }
                    }
                }
                Src::Buffer(k, j) => {
                    let b = &meta.units[k].buffers[j];
                    let numel: usize = b.shape.iter().product();
                    files[0].stream(&format!("buffer.{}", b.name), 0..numel, to, &mut |x| {
                        w.write_part(x)
                    })?;
                }
            }
            weight_map.insert(spec.name.clone(), file_name(g));
        }
        w.finish()?;
        written.push(path);
    }
    if count > 1 {
        let index = serde_json::json!({
            "metadata": {"total_size": total_size},
            "weight_map": weight_map,
        });
        let text = serde_json::to_string_pretty(&index).expect("JSON");
        write_atomic(&out.join(HF_INDEX_FILE), text.as_bytes())?;
        written.push(out.join(HF_INDEX_FILE));
    }
    let text = serde_json::to_string_pretty(config).expect("JSON");
    write_atomic(&out.join("config.json"), text.as_bytes())?;
    Ok(HfExportSummary {
        checkpoint: dir.to_path_buf(),
        files: written
            .iter()
            .filter(|f| f.extension().is_some_and(|e| e == "safetensors"))
            .cloned()
            .collect(),
        tensors: tensors.len(),
        total_size,
    })
}
