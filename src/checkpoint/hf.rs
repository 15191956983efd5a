//! Hugging Face weight layouts, read side: a model directory holding either one
//! `model.safetensors` or a `model.safetensors.index.json` (`{"weight_map": {tensor: file}}`)
//! and the shard files it names. [`HfWeights`] maps every file (headers parsed, nothing else
//! touched) and reads element ranges of tensors by name, converting BF16 / F16 / F64 to f32;
//! [`build_from_hf_weights`] builds an [`FsdpModel`] whose parameters are read from them, each
//! rank copying only the byte ranges of its own shards. The write side is
//! `checkpoint::tools::export_hf`.
//!
//! The parameter names are the file's: a model built this way must name its parameters as the
//! checkpoint does (`models::llama` uses Hugging Face's names for that reason, decision 50).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::io::MappedFile;
use super::{agree, ReadStats};
use crate::comm::ProcessGroup;
use crate::error::{Error, Result};
use crate::fsdp::{FsdpConfig, FsdpModel, ModelSpec};

/// The single-file layout's weights file.
pub const HF_WEIGHTS_FILE: &str = "model.safetensors";
/// The sharded layout's index (`{"metadata": {...}, "weight_map": {tensor: file}}`).
pub const HF_INDEX_FILE: &str = "model.safetensors.index.json";

/// The weights of a Hugging Face model directory, memory-mapped (headers parsed and checked;
/// data pages are touched only by the reads).
pub struct HfWeights {
    dir: PathBuf,
    files: Vec<MappedFile>,
    /// Tensor name → index into `files`.
    by_name: BTreeMap<String, usize>,
}

impl HfWeights {
    /// Opens the weights of `dir`: the shards its `model.safetensors.index.json` names when
    /// there is one, else `model.safetensors`.
    ///
    /// Errors, naming the file: neither file present; an index that does not parse or has no
    /// `weight_map`; a shard file the index names missing (naming the index, the file and one
    /// of its tensors), unreadable or corrupt; a tensor the index places in
    /// a file that does not hold it.
    pub fn open(dir: &Path, stats: &mut ReadStats) -> Result<Self> {
        let index = dir.join(HF_INDEX_FILE);
        let single = dir.join(HF_WEIGHTS_FILE);
        if index.is_file() {
            let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
            #[derive(serde::Deserialize)]
            struct Index {
                weight_map: BTreeMap<String, String>,
            }
            let parsed: Index = serde_json::from_str(&text)
                .map_err(|e| Error::file(&index, format!("not a safetensors index ({e})")))?;
            let mut files = Vec::new();
            let mut file_of: HashMap<String, usize> = HashMap::new();
            let mut by_name = BTreeMap::new();
            for (tensor, file) in parsed.weight_map {
                let k = match file_of.get(&file) {
                    Some(&k) => k,
                    None => {
                        if file.contains('/') || file.contains("..") {
                            return Err(Error::file(
                                &index,
                                format!("tensor {tensor}: file {file:?} is not in the directory"),
                            ));
                        }
                        let path = dir.join(&file);
                        if !path.is_file() {
                            return Err(Error::file(
                                &index,
                                format!(
                                    "file {file} (holding tensor {tensor}, among others) is \
                                     missing from the directory"
                                ),
                            ));
                        }
                        files.push(MappedFile::open(&path, None, stats)?);
                        file_of.insert(file.clone(), files.len() - 1);
                        files.len() - 1
                    }
                };
                if files[k].info(&tensor).is_none() {
                    return Err(Error::file(
                        &files[k].path,
                        format!("tensor {tensor} is missing (the index {HF_INDEX_FILE} places it in this file)"),
                    ));
                }
                by_name.insert(tensor, k);
            }
            Ok(Self {
                dir: dir.to_path_buf(),
                files,
                by_name,
            })
        } else if single.is_file() {
            let f = MappedFile::open(&single, None, stats)?;
            let by_name = f.names().map(|n| (n.to_string(), 0)).collect();
            Ok(Self {
                dir: dir.to_path_buf(),
                files: vec![f],
                by_name,
            })
        } else {
            Err(Error::file(
                dir,
                format!("no Hugging Face weights: neither {HF_WEIGHTS_FILE} nor {HF_INDEX_FILE}"),
            ))
        }
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Number of safetensors files.
    pub fn num_files(&self) -> usize {
        self.files.len()
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }

    /// Shape of tensor `name`, if present.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        let f = &self.files[*self.by_name.get(name)?];
        f.info(name).map(|i| i.shape.as_slice())
    }

    /// Dtype of tensor `name`, if present.
    pub fn dtype(&self, name: &str) -> Option<safetensors::Dtype> {
        let f = &self.files[*self.by_name.get(name)?];
        f.info(name).map(|i| i.dtype)
    }

    /// Whether tensor `name` is present and of a dtype [`HfWeights::read_f32`] converts.
    fn is_float(&self, name: &str) -> bool {
        use safetensors::Dtype::{BF16, F16, F32, F64};
        matches!(self.dtype(name), Some(F32 | BF16 | F16 | F64))
    }

    /// The file holding tensor `name`.
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.by_name
            .get(name)
            .map(|&k| self.files[k].path.as_path())
    }

    /// Copies elements `range` (row-major) of tensor `name` into `out` (`range.len()` long),
    /// converting F32, BF16, F16 or F64 to f32; only the bytes of that range are touched.
    ///
    /// Errors, naming file and tensor: missing tensor, a range past its end, a non-float dtype.
    pub fn read_f32(
        &self,
        name: &str,
        range: std::ops::Range<usize>,
        out: &mut [f32],
        stats: &mut ReadStats,
    ) -> Result<()> {
        let k = *self.by_name.get(name).ok_or_else(|| {
            Error::file(
                &self.dir,
                format!("tensor {name} is missing from the weights"),
            )
        })?;
        self.files[k].read_f32(name, range, out, stats)
    }

    /// Checks that every `(name, shape)` of `expected` is present with that shape and a float
    /// dtype, and that every tensor of the files is expected or `ignored(name)` (so that the
    /// reads of a build cannot fail on one rank only).
    ///
    /// Errors, naming the file and tensor: the first missing tensor (with its expected shape),
    /// a non-float dtype, a shape mismatch (expected vs found), an unexpected tensor.
    pub fn check(
        &self,
        expected: &[(String, Vec<usize>)],
        ignored: &dyn Fn(&str) -> bool,
    ) -> Result<()> {
        for (name, shape) in expected {
            match self.shape(name) {
                None => {
                    let at = if self.files.len() == 1 {
                        self.files[0].path.clone()
                    } else {
                        self.dir.join(HF_INDEX_FILE)
                    };
                    return Err(Error::file(
                        &at,
                        format!("tensor {name} is missing (expected shape {shape:?})"),
                    ));
                }
                Some(_) if !self.is_float(name) => {
                    let dtype = self.dtype(name).expect("present");
                    return Err(Error::file(
                        self.file_of(name).expect("present"),
                        format!(
                            "tensor {name}: expected a float dtype (F32, BF16, F16, F64), \
                             found {dtype:?}"
                        ),
                    ));
                }
                Some(found) if found != shape.as_slice() => {
                    return Err(Error::file(
                        self.file_of(name).expect("present"),
                        format!("tensor {name}: expected shape {shape:?}, found {found:?}"),
                    ));
                }
                Some(_) => {}
            }
        }
        let known: std::collections::HashSet<&str> =
            expected.iter().map(|(n, _)| n.as_str()).collect();
        if let Some(extra) = self.names().find(|n| !known.contains(n) && !ignored(n)) {
            return Err(Error::file(
                self.file_of(extra).expect("listed"),
                format!("tensor {extra} is not a parameter of the model"),
            ));
        }
        Ok(())
    }
}

/// Builds an [`FsdpModel`] from `spec` with every parameter read from the Hugging Face weights
/// in `dir` ([`HfWeights`]) instead of initialised (a collective). Each rank maps the files and
/// copies only the element ranges of its own shards, converting to f32, so no rank holds more
/// than its shards plus one conversion of a shard piece; the model's parameter names must be
/// the files' tensor names. Tensors of the files that `ignored` accepts (e.g. a tied head's
/// duplicate, rotary tables) are skipped; any other tensor the model lacks is an error.
///
/// Returns the model and what this rank read.
///
/// Errors, on every rank and before anything is allocated: as [`HfWeights::open`] and
/// [`HfWeights::check`]; then as [`FsdpModel::build_with`].
pub fn build_from_hf_weights(
    pg: Arc<dyn ProcessGroup>,
    config: FsdpConfig,
    spec: impl Into<ModelSpec>,
    dir: &Path,
    ignored: &dyn Fn(&str) -> bool,
) -> Result<(FsdpModel, ReadStats)> {
    let spec: ModelSpec = spec.into();
    let mut stats = ReadStats::default();
    let checked = (|| -> Result<HfWeights> {
        let expected: Vec<(String, Vec<usize>)> = spec
            .record(&config.device)?
            .into_iter()
            .map(|p| (p.name, p.shape.dims().to_vec()))
            .collect();
        let w = HfWeights::open(dir, &mut stats)?;
        w.check(&expected, ignored)?;
        Ok(w)
    })();
    let (weights, local) = match checked {
        Ok(w) => (Some(w), Ok(())),
        Err(e) => (None, Err(e)),
    };
    agree(
        pg.as_ref(),
        "building from Hugging Face weights",
        dir,
        local,
    )?;
    let weights = weights.expect("checked on every rank");
    let model = FsdpModel::build_with(pg, config, spec, |p, range, out| {
        weights.read_f32(&p.name, range, out, &mut stats)
    })?;
    Ok((model, stats))
}
