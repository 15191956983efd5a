//! Hugging Face weight layouts, read side: a model directory holding one `model.safetensors`
//! or a `model.safetensors.index.json` (`{"weight_map": {tensor: file}}`) and the shard files
//! it names. [`HfWeights`] maps every file (headers parsed, nothing else touched) and reads
//! element ranges of tensors by name, converting BF16 / F16 / F64 to f32;
//! [`build_from_hf_weights`] builds an [`FsdpModel`] whose parameters are read from them, each
//! rank copying only the byte ranges of its own shards. The write side is
//! [`super::export_hf`].
//!
//! A directory is resolved as transformers' `from_pretrained` (5.x) resolves it, and every
//! choice that is not the plain case is said ([`HfWeights::decisions`]):
//! - **Which weights file**: `model.safetensors` when it exists, an index beside it ignored
//!   (even one whose shards are missing); else the index and its shards. PyTorch pickles
//!   (`pytorch_model.bin`) are not read: a directory holding only those is refused, naming them.
//! - **A tied head** ([`HfWeights::resolve_tied_head`]): with `tie_word_embeddings` set, a head
//!   in the file that differs from the embedding is kept untied (transformers warns "we will
//!   NOT tie them"); a file with the head but no embedding ties the embedding to the head.
//!
//! The parameter names are the file's: a model built this way must name its parameters as the
//! checkpoint does (the decoder's families keep Hugging Face's names for that reason, decision 50).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::checkpoint::io::MappedFile;
use crate::checkpoint::{agree, ReadStats};
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
    /// What [`HfWeights::open`] decided that is not the plain case, one sentence each.
    decisions: Vec<String>,
}

/// How a head that `config.json` ties to the embedding (`tie_word_embeddings: true`) is
/// loaded: [`HfWeights::resolve_tied_head`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TiedHead {
    /// Tied: the head is the embedding's table (a head in the file equal to it is skipped).
    Tied,
    /// Tied, the table read from the file's head: the file holds no embedding.
    TiedFromHead,
    /// Not tied: the file's head differs from its embedding, and both are loaded.
    Untied,
}

/// Weights files a directory may hold that [`HfWeights`] does not read (PyTorch pickles and
/// their index), named when they are all there is.
const UNREAD_WEIGHTS: [&str; 2] = ["pytorch_model.bin", "pytorch_model.bin.index.json"];

impl HfWeights {
    /// Opens the weights of `dir` as transformers' `from_pretrained` chooses them:
    /// `model.safetensors` when it exists (an index beside it is ignored, and that is said in
    /// [`HfWeights::decisions`]), else the shards that `model.safetensors.index.json` names.
    ///
    /// Errors, naming the file: neither file present (naming the PyTorch pickles it holds
    /// instead, which are not read); an index that does not parse or has no `weight_map`; a
    /// shard file the index names missing (naming the index, the file and one of its tensors),
    /// unreadable or corrupt; a tensor the index places in a file that does not hold it.
    pub fn open(dir: &Path, stats: &mut ReadStats) -> Result<Self> {
        let index = dir.join(HF_INDEX_FILE);
        let single = dir.join(HF_WEIGHTS_FILE);
        if single.is_file() {
            let f = MappedFile::open(&single, None, stats)?;
            let by_name = f.names().map(|n| (n.to_string(), 0)).collect();
            let mut decisions = Vec::new();
            if index.is_file() {
                decisions.push(format!(
                    "using {HF_WEIGHTS_FILE}; ignoring {HF_INDEX_FILE} beside it (transformers \
                     loads the single file when both are present)"
                ));
            }
            Ok(Self {
                dir: dir.to_path_buf(),
                files: vec![f],
                by_name,
                decisions,
            })
        } else if index.is_file() {
            Self::open_index(dir, &index, stats)
        } else {
            let unread: Vec<&str> = UNREAD_WEIGHTS
                .into_iter()
                .filter(|f| dir.join(f).is_file())
                .collect();
            let found = if unread.is_empty() {
                String::new()
            } else {
                format!(
                    " (it holds {}: PyTorch pickle weights, which are not read; convert them \
                     with transformers' save_pretrained(dir, safe_serialization=True))",
                    unread.join(" and ")
                )
            };
            Err(Error::file(
                dir,
                format!(
                    "no Hugging Face weights: neither {HF_WEIGHTS_FILE} nor {HF_INDEX_FILE}{found}"
                ),
            ))
        }
    }

    /// The sharded layout: the files `index` names.
    fn open_index(dir: &Path, index: &Path, stats: &mut ReadStats) -> Result<Self> {
        let text = std::fs::read_to_string(index).map_err(|e| Error::io(index, e))?;
        #[derive(serde::Deserialize)]
        struct Index {
            weight_map: BTreeMap<String, String>,
        }
        let parsed: Index = serde_json::from_str(&text)
            .map_err(|e| Error::file(index, format!("not a safetensors index ({e})")))?;
        let mut files = Vec::new();
        let mut file_of: HashMap<String, usize> = HashMap::new();
        let mut by_name = BTreeMap::new();
        for (tensor, file) in parsed.weight_map {
            let k = match file_of.get(&file) {
                Some(&k) => k,
                None => {
                    if file.contains('/') || file.contains("..") {
                        return Err(Error::file(
                            index,
                            format!("tensor {tensor}: file {file:?} is not in the directory"),
                        ));
                    }
                    let path = dir.join(&file);
                    if !path.is_file() {
                        return Err(Error::file(
                            index,
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
                    format!(
                        "tensor {tensor} is missing (the index {HF_INDEX_FILE} places it in \
                         this file)"
                    ),
                ));
            }
            by_name.insert(tensor, k);
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            files,
            by_name,
            decisions: Vec::new(),
        })
    }

    /// What [`HfWeights::open`] decided that is not the plain case (one sentence each, for a
    /// line on rank 0): today, a single file chosen over an index beside it.
    pub fn decisions(&self) -> &[String] {
        &self.decisions
    }

    /// Whether tensors `a` and `b` are both present with the same shape and equal values
    /// (compared as f32 after conversion, `==` element by element, as `torch.equal` on the
    /// loaded parameters). Reads both tensors whole, in pieces of 1 Mi elements.
    ///
    /// Errors: a read's (naming the file and tensor).
    pub fn same_values(&self, a: &str, b: &str) -> Result<bool> {
        let (Some(sa), Some(sb)) = (self.shape(a), self.shape(b)) else {
            return Ok(false);
        };
        if sa != sb || !self.is_float(a) || !self.is_float(b) {
            return Ok(false);
        }
        let numel: usize = sa.iter().product();
        const PIECE: usize = 1 << 20;
        let mut stats = ReadStats::default();
        let (mut va, mut vb) = (
            vec![0.0f32; PIECE.min(numel)],
            vec![0.0f32; PIECE.min(numel)],
        );
        let mut start = 0;
        while start < numel {
            let end = (start + PIECE).min(numel);
            let n = end - start;
            self.read_f32(a, start..end, &mut va[..n], &mut stats)?;
            self.read_f32(b, start..end, &mut vb[..n], &mut stats)?;
            if va[..n].iter().zip(&vb[..n]).any(|(x, y)| x != y) {
                return Ok(false);
            }
            start = end;
        }
        Ok(true)
    }

    /// How a head tied to the embedding by `config.json` loads from these files, as
    /// transformers 5's `PreTrainedModel.tie_weights` decides during `from_pretrained`: both
    /// tensors present and different (a head trained untied, saved with the flag left on):
    /// [`TiedHead::Untied`]; only the head present: [`TiedHead::TiedFromHead`]; otherwise (only
    /// the embedding, both equal, neither): [`TiedHead::Tied`].
    ///
    /// Errors: a read's, comparing the two.
    pub fn resolve_tied_head(&self, embedding: &str, head: &str) -> Result<TiedHead> {
        let has = |n: &str| self.by_name.contains_key(n);
        Ok(match (has(embedding), has(head)) {
            (true, true) if !self.same_values(embedding, head)? => TiedHead::Untied,
            (false, true) => TiedHead::TiedFromHead,
            _ => TiedHead::Tied,
        })
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

    /// Checks that every `(name, shape)` of `expected` is present (under the file's name
    /// `names.source(name)`) with that shape and a float dtype, and that every tensor of the
    /// files is expected or ignored by `names` (so that the reads of a build cannot fail on one
    /// rank only).
    ///
    /// Errors, naming the file and tensor: the first missing tensor (with its expected shape),
    /// a non-float dtype, a shape mismatch (expected vs found), an unexpected tensor.
    pub fn check(&self, expected: &[(String, Vec<usize>)], names: &HfNames<'_>) -> Result<()> {
        for (param, shape) in expected {
            let name = names.source(param);
            let what = if name == param {
                format!("tensor {name}")
            } else {
                format!("tensor {name} (read as parameter {param})")
            };
            match self.shape(name) {
                None => {
                    let at = if self.files.len() == 1 {
                        self.files[0].path.clone()
                    } else {
                        self.dir.join(HF_INDEX_FILE)
                    };
                    return Err(Error::file(
                        &at,
                        format!("{what} is missing (expected shape {shape:?})"),
                    ));
                }
                Some(_) if !self.is_float(name) => {
                    let dtype = self.dtype(name).expect("present");
                    return Err(Error::file(
                        self.file_of(name).expect("present"),
                        format!(
                            "{what}: expected a float dtype (F32, BF16, F16, F64), found {dtype:?}"
                        ),
                    ));
                }
                Some(found) if found != shape.as_slice() => {
                    return Err(Error::file(
                        self.file_of(name).expect("present"),
                        format!("{what}: expected shape {shape:?}, found {found:?}"),
                    ));
                }
                Some(_) => {}
            }
        }
        let known: std::collections::HashSet<&str> =
            expected.iter().map(|(n, _)| names.source(n)).collect();
        if let Some(extra) = self
            .names()
            .find(|n| !known.contains(n) && !(names.ignored)(n))
        {
            return Err(Error::file(
                self.file_of(extra).expect("listed"),
                format!("tensor {extra} is not a parameter of the model"),
            ));
        }
        Ok(())
    }
}

/// How a model's parameters are found in Hugging Face files: the file tensor each parameter
/// is read from where the names differ, and the file tensors that are not parameters.
pub struct HfNames<'a> {
    /// Parameter name → the file's tensor name, for the parameters read under another name
    /// (a tied embedding read from a file's only head, [`TiedHead::TiedFromHead`]).
    pub sources: BTreeMap<String, String>,
    /// File tensors that are not parameters and are skipped (rotary tables, a tied head's
    /// duplicate).
    pub ignored: &'a dyn Fn(&str) -> bool,
    /// Parameters that are not in the files and are initialised instead (from their init
    /// hints and the config's seed, as [`crate::FsdpModelBuilder::build`] does): LoRA's
    /// adapters on a pretrained base. `None`: every parameter is read.
    pub fresh: Option<&'a dyn Fn(&str) -> bool>,
}

impl<'a> HfNames<'a> {
    /// Every parameter under its own name; `ignored` skipped.
    pub fn new(ignored: &'a dyn Fn(&str) -> bool) -> Self {
        Self {
            sources: BTreeMap::new(),
            ignored,
            fresh: None,
        }
    }

    /// The file's name of parameter `param`.
    pub fn source<'n>(&'n self, param: &'n str) -> &'n str {
        self.sources.get(param).map_or(param, String::as_str)
    }

    /// Whether parameter `param` is initialised instead of read ([`HfNames::fresh`]).
    pub fn is_fresh(&self, param: &str) -> bool {
        self.fresh.is_some_and(|f| f(param))
    }
}

/// Builds an [`FsdpModel`] from `spec` with every parameter read from the Hugging Face weights
/// in `dir` ([`HfWeights`]) instead of initialised (a collective). Each rank maps the files and
/// copies only the element ranges of its own shards, converting to f32, so no rank holds more
/// than its shards plus one conversion of a shard piece. A parameter is read from the file
/// tensor `names.source(name)` (its own name unless renamed); tensors of the files that
/// `names.ignored` accepts (e.g. a tied head's duplicate, rotary tables) are skipped; any other
/// tensor the model lacks is an error.
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
    names: &HfNames<'_>,
) -> Result<(FsdpModel, ReadStats)> {
    let spec: ModelSpec = spec.into();
    let mut stats = ReadStats::default();
    let checked = (|| -> Result<HfWeights> {
        let expected: Vec<(String, Vec<usize>)> = spec
            .record(&config.device)?
            .into_iter()
            .filter(|p| !names.is_fresh(&p.name))
            .map(|p| (p.name, p.shape.dims().to_vec()))
            .collect();
        let w = HfWeights::open(dir, &mut stats)?;
        w.check(&expected, names)?;
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
    let seed = config.seed;
    let model = FsdpModel::build_with(pg, config, spec, |p, range, out| {
        if names.is_fresh(&p.name) {
            let values = crate::init::init_values(&p.name, &p.shape, p.hint, seed);
            out.copy_from_slice(&values[range]);
            return Ok(());
        }
        weights.read_f32(names.source(&p.name), range, out, &mut stats)
    })?;
    Ok((model, stats))
}
