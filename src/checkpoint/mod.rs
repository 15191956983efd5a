//! Checkpoints: full and sharded state dicts, resharding across world sizes, safe writes.
//!
//! Two formats, both built on safetensors files (little-endian, row-major):
//!
//! **Full state dict** ([`save_full`], [`load_full`], [`build_from_full`]): one safetensors file
//! holding every parameter unsharded under its original name (`fc1.weight`, …) and shape, in
//! the master dtype (f32), followed by each unit's buffers in their own dtype. It is an
//! ordinary candle file: `VarBuilder::from_mmaped_safetensors` plus the same candle-nn
//! constructors rebuild the model in a plain, unwrapped program. Rank 0 writes it while the
//! units are gathered one at a time (peak: one unit's f32 flat buffer per rank). Loading maps
//! the file and every rank copies only the byte ranges of its own shard.
//!
//! **Sharded state dict** ([`save_sharded`], [`load_sharded`], [`load_latest`]): a directory
//! per checkpoint,
//! ```text
//! <root>/step-00000938/shard-00000-of-00002.safetensors   rank 0: its shard of every unit's
//!                                                         flat parameter (param.<unit>), its
//!                                                         shard of each optimizer buffer
//!                                                         (optim.<kind>.<unit>) and, on rank 0
//!                                                         only, the buffers (buffer.<name>)
//! <root>/step-00000938/shard-00001-of-00002.safetensors   rank 1
//! <root>/step-00000938/meta.json                          CheckpointMeta: written last
//! ```
//! `meta.json` ([`CheckpointMeta`]) records the format version, world size, sharding strategy,
//! every unit's layout (parameter names, shapes, offsets, padding, shard size), the optimizer
//! (kind, every group's hyper-parameters, buffer kinds, per-parameter step counts by name), each
//! file's size and the CRC-32C of each of its tensors, the save time, and the training state
//! ([`TrainState`]: step, epoch, sampler position, RNG seed, LR scheduler and grad scaler states,
//! mixed-precision policy, run id). A parameter's offset in its unit's flat buffer does not
//! depend on the world size (only the final padding and the shard boundaries do), so a rank of a
//! group of any size finds which saved shards cover its new shard and copies just those element
//! ranges out of the memory-mapped files: loading works at the saved world size or any other.
//!
//! **Offline tools** ([`tools`], the `fsdp-ckpt` binary): inspect, export to one full file,
//! import from one, reshard and verify a sharded checkpoint without a process group or the
//! model, streaming tensor data in constant memory.
//!
//! **Safe writes.** Every file is written to a temporary name in its final directory, flushed,
//! fsynced and renamed ([`AtomicFile`]). A sharded checkpoint is first assembled in a hidden
//! staging directory (`.step-00000938.partial`); `meta.json` is written last, then the staging
//! directory is renamed to `step-00000938`. A directory counts as a checkpoint only when its
//! `meta.json` exists ([`list_complete`]), so a crash or an error at any point of a save leaves
//! the previous checkpoints untouched and loadable; `keep_last` rotation deletes older ones only
//! after the new one is complete.
//!
//! **Runs, damage, checksums.** A checkpoint belongs to the run named by
//! [`TrainState::run_id`]: `keep_last` rotation deletes only that run's older checkpoints, and
//! [`load_latest`] refuses a root holding several runs ([`load_latest_of_run`] picks one).
//! [`load_latest`] passes over a damaged checkpoint (truncated or missing file, bad header or
//! metadata, checksum mismatch), renaming it `step-<n>.damaged` and reporting it in
//! [`Loaded::skipped`]. Every tensor a load reads from is checked against its CRC-32C first.
//!
//! **Collectives.** Saving and loading are collectives (every rank calls them, in the same
//! order as its other collectives): the ranks agree on success with one small all-reduce, so
//! when one rank fails (a missing file, a full disk) every rank returns an error and none has
//! changed its model or optimizer.
//!
//! **Errors** name the file, the tensor or parameter, and the expected vs found value: a missing
//! file, a truncated or corrupt file, a parameter missing or extra, a shape or dtype mismatch, a
//! metadata version from the future.

mod full;
pub(crate) mod io;
mod sharded;
pub(crate) use sharded::root_message;
pub mod tools;

/// Test-only fault injection (cargo feature `fault-injection`, which only the tests enable).
#[cfg(feature = "fault-injection")]
#[doc(hidden)]
pub mod fault;

/// Without the `fault-injection` feature the production path asks nothing: writes are never
/// failed and clean-up always runs.
#[cfg(not(feature = "fault-injection"))]
mod fault {
    /// Never a simulated crash.
    #[inline(always)]
    pub(crate) fn crash_mode() -> bool {
        false
    }

    /// Every write is allowed.
    #[inline(always)]
    pub(crate) fn allow(_len: usize) -> Result<(), usize> {
        Ok(())
    }

    /// Nothing to carry to a writer thread.
    #[derive(Clone, Copy)]
    pub(crate) struct Carried;

    /// Nothing armed.
    #[inline(always)]
    pub(crate) fn carried() -> Carried {
        Carried
    }

    /// Nothing to arm.
    #[inline(always)]
    pub(crate) fn carry(_: Carried) {}
}

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::comm::{ProcessGroup, ProcessGroupExt, ReduceOp};
use crate::error::{Error, Result};

/// The sampler's position a checkpoint stores (defined beside the sampler; re-exported here,
/// where it has always been).
pub use crate::data::SamplerState;
pub use full::{build_from_full, load_full, save_full, FULL_FORMAT};
pub use io::{write_atomic, AtomicFile};
pub use sharded::{
    load_latest, load_latest_of_run, load_sharded, save_sharded, save_sharded_async,
    shard_file_name, PendingSave, SHARDED_FORMAT,
};

/// Version written into `meta.json` (and into each file's safetensors metadata). Version 1
/// checkpoints (same-world-size format of the first release) are still read; a larger version
/// is an error.
///
/// Version 3 added: the optimizer's kind, group hyper-parameters and per-parameter step counts
/// (typed: buffer kinds, no names to parse), a CRC-32C checksum per tensor, the run id and the
/// save time. Version-2 metadata is still read (its optimizer buffer names are converted once,
/// on reading).
pub const FORMAT_VERSION: u32 = 3;

/// Name of the metadata file that marks a sharded checkpoint directory complete.
pub const META_FILE: &str = "meta.json";

/// Random-number state. The runtime keeps no global RNG: initialisation draws from streams
/// seeded by `(seed, parameter name)` and the sampler's shuffle from `seed + epoch`, so the seed
/// (with [`SamplerState`]) is the whole RNG state of a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngState {
    /// Seed of the run (initialisation and shuffling).
    pub seed: u64,
}

/// Training progress and run state stored in a sharded checkpoint's metadata.
///
/// `grad_scaler` and `mixed_precision` are free-form JSON so that the components that own them
/// define their content (e.g. `serde_json::to_value(scaler.state())`); when `mixed_precision`
/// is `None` at save time, the model's configured policy is recorded.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Training steps taken; names the checkpoint directory (`step-<step>`).
    pub step: u64,
    /// Epochs completed.
    pub epoch: u64,
    /// Position of the data sampler (for a mid-epoch resume).
    #[serde(default)]
    pub sampler: Option<SamplerState>,
    /// Random-number state.
    #[serde(default)]
    pub rng: Option<RngState>,
    /// State of a gradient scaler (mixed precision), as its owner serialises it.
    #[serde(default)]
    pub grad_scaler: Option<serde_json::Value>,
    /// Mixed-precision policy, as its owner serialises it.
    #[serde(default)]
    pub mixed_precision: Option<serde_json::Value>,
    /// Free-form values of the caller.
    #[serde(default)]
    pub extra: BTreeMap<String, String>,
    /// The run this checkpoint belongs to ([`new_run_id`]; `None`: an anonymous run).
    /// `keep_last` rotation and [`load_latest_of_run`] consider only the checkpoints of one run,
    /// and [`load_latest`] refuses a directory holding several runs.
    #[serde(default)]
    pub run_id: Option<String>,
    /// State of the learning-rate scheduler.
    #[serde(default)]
    pub lr_scheduler: Option<crate::lr_scheduler::LrSchedulerState>,
    /// An adapter-only checkpoint's frozen base (set by the save from
    /// [`crate::FsdpModel::base`] when it leaves units to it: [`UnitMeta::in_base`]); loading
    /// checks the model's base against it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<crate::base::BaseIdentity>,
}

/// A fresh run id: 128 random bits from the operating system's generator, as 32 hex digits.
pub fn new_run_id() -> String {
    let v: u128 = rand::random();
    format!("{v:032x}")
}

/// One parameter of a unit's layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamMeta {
    /// Full name, e.g. `fc1.weight`.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Offset of its first element in the unit's unsharded flat buffer (elements).
    pub offset: usize,
    /// Number of elements (product of `shape`).
    #[serde(default)]
    pub numel: usize,
}

/// One buffer (replicated tensor such as a running statistic) of a unit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferMeta {
    /// Full name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// safetensors dtype name (`F32`, `BF16`, `F16`).
    pub dtype: String,
}

/// One unit's flat-parameter layout at save time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitMeta {
    /// Unit name.
    pub name: String,
    /// safetensors dtype name of the saved shards (the master dtype, `F32`).
    #[serde(default = "f32_name")]
    pub dtype: String,
    /// Number of shards (the world size, or 1 under NO_SHARD); shard `s` is in rank `s`'s file.
    #[serde(default)]
    pub world_size: usize,
    /// Elements used by parameters and alignment gaps.
    #[serde(default)]
    pub unpadded_numel: usize,
    /// Flat length with padding, `world_size × shard_numel` (elements).
    pub padded_numel: usize,
    /// Shard length (elements).
    pub shard_numel: usize,
    /// `shard_numel` is a multiple of this (a packed frozen base's block, e.g. 64 for int8 /
    /// NF4: [`crate::flat_param::FlatParamLayout::shard_multiple`]); 1, and then not written,
    /// otherwise.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub shard_multiple: usize,
    /// Not in the files: a frozen unit of an adapter-only checkpoint, whose parameters (and
    /// buffers) are the base's (`train.base`, decision 75); loading keeps the values the
    /// model read from its base.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_base: bool,
    /// No optimizer state in the files: a frozen unit whose parameters were never stepped
    /// (its state would be zeros; the optimizer keeps none for it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_optim_state: bool,
    /// Parameters in flat order.
    pub params: Vec<ParamMeta>,
    /// Buffers, saved unsharded in rank 0's file.
    #[serde(default)]
    pub buffers: Vec<BufferMeta>,
}

impl UnitMeta {
    /// The metadata of a unit's flat-parameter layout and buffers (what a save records).
    ///
    /// Errors: a buffer of a dtype checkpoints do not store.
    pub fn from_layout(
        name: &str,
        layout: &crate::flat_param::FlatParamLayout,
        buffers: &[(String, candle_core::Var)],
    ) -> Result<Self> {
        let buffers = buffers
            .iter()
            .map(|(name, var)| {
                Ok(BufferMeta {
                    name: name.clone(),
                    shape: var.dims().to_vec(),
                    dtype: format!("{:?}", io::st_dtype(var.dtype())?),
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self::from_layout_and_buffers(name, layout, buffers))
    }

    /// The metadata of a unit's flat-parameter layout, with its buffers' metadata as given.
    pub fn from_layout_and_buffers(
        name: &str,
        layout: &crate::flat_param::FlatParamLayout,
        buffers: Vec<BufferMeta>,
    ) -> Self {
        UnitMeta {
            name: name.to_string(),
            dtype: "F32".into(),
            world_size: layout.world_size,
            unpadded_numel: layout.unpadded_numel,
            padded_numel: layout.padded_numel,
            shard_numel: layout.shard_numel,
            shard_multiple: layout.shard_multiple,
            in_base: false,
            no_optim_state: false,
            params: layout
                .params
                .iter()
                .map(|p| ParamMeta {
                    name: p.name.clone(),
                    shape: p.shape.dims().to_vec(),
                    offset: p.offset,
                    numel: p.numel,
                })
                .collect(),
            buffers,
        }
    }

    /// The flat-parameter layout this metadata describes: the layout of its parameters
    /// (names, shapes, in order) over its `world_size` shards, checked against the recorded
    /// offsets and sizes.
    ///
    /// Errors: the recorded offsets or sizes are not those of that layout (naming the unit,
    /// and the first parameter or size that differs).
    pub fn to_layout(&self) -> Result<crate::flat_param::FlatParamLayout> {
        let named: Vec<(String, candle_core::Shape)> = self
            .params
            .iter()
            .map(|p| (p.name.clone(), candle_core::Shape::from(p.shape.clone())))
            .collect();
        let layout = crate::flat_param::FlatParamLayout::with_shard_multiple(
            &named,
            self.world_size.max(1),
            self.shard_multiple,
        )?;
        let unit = &self.name;
        let mut prev: Option<&ParamMeta> = None;
        for (p, q) in self.params.iter().zip(&layout.params) {
            if p.numel != q.numel {
                return Err(Error::shape(
                    format!("unit {unit}: parameter {} of shape {:?}", p.name, p.shape),
                    format!("{} elements (its layout's)", q.numel),
                    format!("{} elements recorded", p.numel),
                ));
            }
            if p.offset != q.offset {
                let msg = match prev.filter(|r| p.offset < r.offset + r.numel) {
                    Some(r) => format!(
                        "unit {unit}: parameters {} (elements {}..{}) and {} (from {}) overlap",
                        r.name,
                        r.offset,
                        r.offset + r.numel,
                        p.name,
                        p.offset
                    ),
                    None => format!(
                        "unit {unit}: parameter {} recorded at offset {}, its layout puts it at {}",
                        p.name, p.offset, q.offset
                    ),
                };
                return Err(Error::InvalidArgument(msg));
            }
            prev = Some(p);
        }
        let recorded = (self.unpadded_numel, self.padded_numel, self.shard_numel);
        let derived = (
            layout.unpadded_numel,
            layout.padded_numel,
            layout.shard_numel,
        );
        if recorded != derived {
            return Err(Error::shape(
                format!(
                    "unit {unit}: unpadded/padded/shard sizes over {} shards",
                    self.world_size
                ),
                format!("{derived:?} (its parameters' layout)"),
                format!("{recorded:?} recorded"),
            ));
        }
        Ok(layout)
    }
}

/// An optimizer buffer as version-2 metadata listed it (`exp_avg.3`); read only to convert a
/// version-2 checkpoint, never written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LegacyOptimBuffer {
    /// `<kind>.<unit>`.
    pub name: String,
    /// The unit whose shard it is laid out like; `None` for a rank-local buffer.
    pub unit: Option<usize>,
}

/// The optimizer part of the metadata (typed: the files hold buffer kind `kind` of unit `k` as
/// tensor `optim.<kind>.<k>`, laid out and resharded like the unit's flat parameter).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerMeta {
    /// Optimizer steps taken ([`crate::OptimizerState::step`]).
    pub step: u64,
    /// Kind and per-group hyper-parameters (`None` in version 1 and 2 checkpoints).
    #[serde(default)]
    pub hyper: Option<crate::optim::OptimizerHyper>,
    /// Buffer kinds saved for every unit (empty before the first step).
    #[serde(default)]
    pub buffer_kinds: Vec<crate::optim::BufferKind>,
    /// Updates taken by each parameter, by full name (empty before the first step).
    #[serde(default)]
    pub param_steps: BTreeMap<String, u64>,
    /// Version-2 buffer list (converted on reading; empty in version 3).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub buffers: Vec<LegacyOptimBuffer>,
    /// The dtype of the optimizer buffers in the files: F32, or BF16 for an optimizer that
    /// keeps bf16 state ([`crate::AdamW::with_state_dtype`]); absent means F32.
    #[serde(default = "f32_dtype", skip_serializing_if = "is_f32")]
    pub state_dtype: safetensors::Dtype,
}

impl Default for OptimizerMeta {
    fn default() -> Self {
        Self {
            step: 0,
            hyper: None,
            buffer_kinds: Vec::new(),
            param_steps: BTreeMap::new(),
            buffers: Vec::new(),
            state_dtype: safetensors::Dtype::F32,
        }
    }
}

fn f32_dtype() -> safetensors::Dtype {
    safetensors::Dtype::F32
}

fn is_f32(d: &safetensors::Dtype) -> bool {
    *d == safetensors::Dtype::F32
}

/// One rank's file of a sharded checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileMeta {
    /// Rank that wrote it.
    pub rank: usize,
    /// File name inside the checkpoint directory.
    pub name: String,
    /// Size in bytes (checked on load: catches truncated files).
    pub bytes: u64,
    /// CRC-32C (Castagnoli) of each tensor's data bytes, by tensor name (checked on load for
    /// every tensor read: catches flipped bits; empty in version 1 and 2 checkpoints).
    #[serde(default)]
    pub crc32c: BTreeMap<String, u32>,
}

/// Contents of a sharded checkpoint's `meta.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// World size at save time (number of shard files); under the hybrid strategies the shard
    /// group's size (replica 0 alone writes).
    pub world_size: usize,
    /// Sharding strategy at save time, as `--strategy` spells it (`full-shard`, `shard-grad-op`,
    /// `no-shard`, `hybrid-shard`, `hybrid-shard-grad-op`; [`strategy_name`]). `None` in checkpoints written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<String>,
    /// Training state (step, epoch, sampler, RNG, grad scaler, mixed precision, extra); its
    /// fields appear at the top level of the JSON.
    #[serde(flatten)]
    pub train: TrainState,
    /// safetensors dtype name of the master shards and optimizer state (`F32`).
    #[serde(default = "f32_name")]
    pub dtype: String,
    /// Unit layouts, in model order.
    pub units: Vec<UnitMeta>,
    /// Optimizer buffers (`None` in version-1 checkpoints: found from the files).
    #[serde(default)]
    pub optimizer: Option<OptimizerMeta>,
    /// The files, one per rank (empty in version-1 checkpoints).
    #[serde(default)]
    pub files: Vec<FileMeta>,
    /// When it was saved: milliseconds since the Unix epoch (`None` before version 3).
    #[serde(default)]
    pub saved_at_unix_ms: Option<u64>,
}

impl CheckpointMeta {
    /// An adapter-only checkpoint's frozen base: `train.base` when some unit is left to it
    /// ([`UnitMeta::in_base`]), else `None`.
    pub fn adapter_base(&self) -> Option<&crate::base::BaseIdentity> {
        self.train
            .base
            .as_ref()
            .filter(|_| self.units.iter().any(|u| u.in_base))
    }
}

impl CheckpointMeta {
    /// Training steps taken (`train.step`).
    pub fn step(&self) -> u64 {
        self.train.step
    }

    /// Epochs completed (`train.epoch`).
    pub fn epoch(&self) -> u64 {
        self.train.epoch
    }
}

/// The name a [`crate::ShardingStrategy`] is recorded under in [`CheckpointMeta::strategy`]
/// (the spelling its `FromStr` parses: `full-shard`, `shard-grad-op`, `no-shard`,
/// `hybrid-shard`, `hybrid-shard-grad-op`; a hybrid checkpoint is the shard group's, so its
/// shard size is the checkpoint's world size and is not repeated).
pub fn strategy_name(strategy: crate::ShardingStrategy) -> &'static str {
    match strategy {
        crate::ShardingStrategy::FullShard => "full-shard",
        crate::ShardingStrategy::ShardGradOp => "shard-grad-op",
        crate::ShardingStrategy::NoShard => "no-shard",
        crate::ShardingStrategy::HybridShard { .. } => "hybrid-shard",
        crate::ShardingStrategy::HybridShardGradOp { .. } => "hybrid-shard-grad-op",
    }
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

fn f32_name() -> String {
    "F32".to_string()
}

/// Bytes a load read from checkpoint files on one rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadStats {
    /// Files opened (memory-mapped).
    pub files_opened: usize,
    /// Bytes of safetensors headers parsed.
    pub header_bytes: u64,
    /// Bytes of tensor data copied out of the files.
    pub data_bytes: u64,
}

/// What [`load_sharded`] and [`load_latest`] return.
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    /// The checkpoint directory.
    pub dir: PathBuf,
    /// Its metadata (a version-1 checkpoint's completed to the current fields).
    pub meta: CheckpointMeta,
    /// What this rank read.
    pub stats: ReadStats,
    /// Newer checkpoints that [`load_latest`] found damaged and skipped, newest first.
    pub skipped: Vec<SkippedCheckpoint>,
}

/// A damaged checkpoint that [`load_latest`] passed over.
#[derive(Debug, Clone, PartialEq)]
pub struct SkippedCheckpoint {
    /// Where it was.
    pub dir: PathBuf,
    /// Where it is now, left for inspection (`step-<n>.damaged`), if the rename succeeded.
    pub renamed_to: Option<PathBuf>,
    /// Why it did not load.
    pub error: String,
}

/// Name of the directory of the checkpoint at `step` (`step-00000938`).
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// The step of a checkpoint directory name (`step-<digits>`), if it is one.
pub fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Complete checkpoint directories under `root` (named `step-<n>` and holding a `meta.json`),
/// oldest (smallest step) first. A missing `root` has none.
pub fn list_complete(root: &Path) -> Result<Vec<PathBuf>> {
    let mut out: Vec<(u64, PathBuf)> = Vec::new();
    let entries = match fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(root, e)),
    };
    for e in entries {
        let p = e.map_err(|e| Error::io(root, e))?.path();
        let Some(step) = p
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(parse_step_dir)
        else {
            continue;
        };
        if p.join(META_FILE).is_file() {
            out.push((step, p));
        }
    }
    out.sort();
    Ok(out.into_iter().map(|(_, p)| p).collect())
}

/// Reads and checks a sharded checkpoint's `meta.json` (version 1 or 2; a version-1 file is
/// completed to the current fields).
///
/// Errors, naming the file: missing or unreadable, not valid metadata JSON, a format version
/// newer than [`FORMAT_VERSION`], an inconsistent layout (e.g. a shard size that does not add
/// up to the padded size, a parameter outside its unit).
pub fn read_meta(dir: &Path) -> Result<CheckpointMeta> {
    let path = dir.join(META_FILE);
    let bytes = fs::read(&path).map_err(|e| Error::io(&path, e))?;
    // Check the version before the full parse so a future format with other fields still gets
    // the version error.
    let version = serde_json::from_slice::<serde_json::Value>(&bytes)
        .map_err(|e| Error::file(&path, format!("not valid checkpoint metadata (JSON): {e}")))?
        .get("format_version")
        .and_then(|v| v.as_u64())
        .ok_or_else(|| Error::file(&path, "not checkpoint metadata: no format_version"))?;
    if version > FORMAT_VERSION as u64 {
        return Err(Error::file(
            &path,
            format!(
                "format version {version} is newer than this reader's {FORMAT_VERSION}: written \
                 by a newer candle-fsdp"
            ),
        ));
    }
    let mut meta: CheckpointMeta = serde_json::from_slice(&bytes)
        .map_err(|e| Error::file(&path, format!("not valid checkpoint metadata: {e}")))?;
    if meta.format_version < 2 {
        upgrade_v1(&mut meta);
    }
    if meta.format_version < 3 {
        upgrade_v2(&mut meta, &path)?;
    }
    validate_meta(&meta, &path)?;
    Ok(meta)
}

/// Converts a version-2 optimizer buffer list (`<kind>.<unit>` names) into buffer kinds and
/// per-parameter step counts (every parameter at the optimizer's step: version 2 had one
/// optimizer-wide count). The only place a buffer name is parsed.
fn upgrade_v2(meta: &mut CheckpointMeta, path: &Path) -> Result<()> {
    let Some(o) = &mut meta.optimizer else {
        return Ok(());
    };
    let mut kinds = std::collections::BTreeSet::new();
    for b in std::mem::take(&mut o.buffers) {
        let kind = b.name.rsplit_once('.').map_or("", |(k, _)| k);
        let kind: crate::optim::BufferKind =
            serde_json::from_value(serde_json::Value::String(kind.into())).map_err(|_| {
                Error::file(
                    path,
                    format!("optimizer buffer {}: unknown kind {kind}", b.name),
                )
            })?;
        if b.unit.is_none() {
            return Err(Error::file(
                path,
                format!(
                    "optimizer buffer {} is not laid out like a unit shard (a rank-local buffer                      of a version-2 checkpoint): not supported by this reader",
                    b.name
                ),
            ));
        }
        kinds.insert(kind);
    }
    o.buffer_kinds = kinds.into_iter().collect();
    if o.step > 0 {
        let step = o.step;
        o.param_steps = meta
            .units
            .iter()
            .flat_map(|u| &u.params)
            .map(|p| (p.name.clone(), step))
            .collect();
    }
    Ok(())
}

/// Completes a version-1 metadata: per-unit shard counts, element counts, unpadded sizes.
fn upgrade_v1(meta: &mut CheckpointMeta) {
    let ws = meta.world_size;
    for u in &mut meta.units {
        for p in &mut u.params {
            p.numel = p.shape.iter().product();
        }
        u.unpadded_numel = u
            .params
            .iter()
            .map(|p| p.offset + p.numel)
            .max()
            .unwrap_or(0);
        // Version 1 wrote every rank's shard; under NO_SHARD a shard was the whole buffer.
        u.world_size = if u.shard_numel > 0 && u.shard_numel == u.padded_numel {
            1
        } else {
            ws
        };
    }
}

fn validate_meta(meta: &CheckpointMeta, path: &Path) -> Result<()> {
    let bad = |msg: String| Err(Error::file(path, format!("inconsistent metadata: {msg}")));
    if meta.world_size == 0 {
        return bad("world_size is 0".into());
    }
    if meta.dtype != "F32" {
        return bad(format!(
            "master dtype: expected F32, found {} (this reader keeps f32 masters)",
            meta.dtype
        ));
    }
    let mut seen = std::collections::HashSet::new();
    for u in &meta.units {
        if u.world_size == 0 || u.world_size > meta.world_size {
            return bad(format!(
                "unit {}: {} shards for world size {}",
                u.name, u.world_size, meta.world_size
            ));
        }
        if u.dtype != "F32" {
            return bad(format!(
                "unit {}: dtype expected F32, found {}",
                u.name, u.dtype
            ));
        }
        for p in &u.params {
            if !seen.insert(p.name.as_str()) {
                return bad(format!("parameter {} appears twice", p.name));
            }
        }
        // Offsets, sizes, overlaps: the metadata must be the layout of its parameters.
        if let Err(e) = u.to_layout() {
            return bad(e.argument_text().unwrap_or_else(|| e.to_string()));
        }
        for b in &u.buffers {
            if !seen.insert(b.name.as_str()) {
                return bad(format!("buffer {} appears twice", b.name));
            }
        }
    }
    if let Some(o) = &meta.optimizer {
        if let Some(name) = o.param_steps.keys().find(|n| !seen.contains(n.as_str())) {
            return bad(format!(
                "optimizer step count for parameter {name}, which no unit has"
            ));
        }
    }
    if !meta.files.is_empty() && meta.files.len() != meta.world_size {
        return bad(format!(
            "{} files listed for world size {}",
            meta.files.len(),
            meta.world_size
        ));
    }
    Ok(())
}

/// The newest complete checkpoint under `root` as seen by rank 0, broadcast to all ranks
/// (a collective), so that every rank loads the same one.
pub fn agree_on_latest(pg: &dyn ProcessGroup, root: &Path) -> Result<Option<PathBuf>> {
    let latest = if pg.rank() == 0 {
        list_complete(root)?.pop()
    } else {
        None
    };
    // The step, or u64::MAX for none, broadcast as an exact integer.
    let step = latest
        .as_ref()
        .and_then(|p| parse_step_dir(p.file_name()?.to_str()?))
        .unwrap_or(u64::MAX);
    let step = if pg.world_size() == 1 {
        step
    } else {
        pg.broadcast_u64s(vec![step], 0)?[0]
    };
    Ok((step != u64::MAX).then(|| root.join(step_dir_name(step))))
}

/// Makes every rank agree on the outcome of a local phase (a collective: one all-reduce of
/// `world_size` floats). A rank whose phase failed returns its own error; the others return an
/// error naming `path`, `what` and the failed ranks.
pub(crate) fn agree(
    pg: &dyn ProcessGroup,
    what: &str,
    path: &Path,
    local: Result<()>,
) -> Result<()> {
    let (rank, ws) = (pg.rank(), pg.world_size());
    if ws == 1 {
        return local;
    }
    let mut flags = vec![0.0f32; ws];
    if local.is_err() {
        flags[rank] = 1.0;
    }
    let flags = pg.all_reduce_f32s(flags, ReduceOp::Sum)?;
    let failed: Vec<usize> = (0..ws).filter(|&r| flags[r] > 0.0).collect();
    if failed.is_empty() {
        return Ok(());
    }
    let reasons = exchange_reasons(pg, local.as_ref().err().map(|e| e.to_string()), &failed)?;
    local?;
    Err(Error::PeersFailed {
        what: what.to_string(),
        path: path.to_path_buf(),
        rank,
        failed_ranks: failed,
        reasons,
    })
}

/// Bytes of a failed rank's message that travel to the others.
const REASON_BYTES: usize = 480;

/// Every rank learns the failed ranks' error messages (a collective, only on the failure path:
/// one all-reduce of `world_size · 480` values, each rank's message bytes in its own slot;
/// longer messages are cut at a character boundary). `local` is this rank's message when it
/// failed. Returns `rank r: <message>` per failed rank, in `failed`'s order.
pub(crate) fn exchange_reasons(
    pg: &dyn ProcessGroup,
    local: Option<String>,
    failed: &[usize],
) -> Result<Vec<String>> {
    let (rank, ws) = (pg.rank(), pg.world_size());
    let mut slots = vec![0.0f32; ws * REASON_BYTES];
    if let Some(msg) = &local {
        let mut end = msg.len().min(REASON_BYTES);
        while !msg.is_char_boundary(end) {
            end -= 1;
        }
        for (i, b) in msg.as_bytes()[..end].iter().enumerate() {
            slots[rank * REASON_BYTES + i] = f32::from(*b);
        }
    }
    let slots = pg.all_reduce_f32s(slots, ReduceOp::Sum)?;
    Ok(failed
        .iter()
        .map(|&r| {
            let bytes: Vec<u8> = slots[r * REASON_BYTES..(r + 1) * REASON_BYTES]
                .iter()
                .map(|&v| v as u8)
                .take_while(|&b| b != 0)
                .collect();
            format!("rank {r}: {}", String::from_utf8_lossy(&bytes))
        })
        .collect())
}
