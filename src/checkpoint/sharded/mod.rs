//! Sharded state dict: one safetensors file per rank plus `meta.json`, loadable at any world
//! size (see the module docs of [`crate::checkpoint`] for the layout).
//!
//! Resharding: a parameter sits at the same offset of its unit's flat buffer whatever the world
//! size (offsets are aligned to [`crate::flat_param::ALIGN_ELEMS`], independent of it); only the
//! final padding and the shard boundaries move. A loading rank walks its new shard table
//! (which part of which parameter its shard holds), looks each parameter up by name in the
//! saved layouts (so units may even be regrouped), turns the part into a range of the saved
//! unit's flat buffer, and splits that range at the saved shard boundaries: each piece is a
//! contiguous element range of one saved rank's file, copied out of the memory map. Optimizer
//! buffers laid out like a unit's shard (`exp_avg.3`, …) are resharded by the same pieces.
//! Alignment gaps and padding stay zero.
//!
//! One concept a file: `save` (each rank's file, the checksums, the metadata, publishing),
//! `load` (the reader's named steps, `load_sharded`, `load_latest*`), `dirs` (staging,
//! publishing, rotation and runs of step directories); the tensor names and unit metadata both
//! share are here.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::Tensor;
use safetensors::Dtype;

use super::io::{st_dtype, sync_dir, MappedFile, SafetensorsWriter, TensorSpec};
use super::{
    agree, fault, list_complete, parse_step_dir, read_meta, step_dir_name, write_atomic,
    BufferMeta, CheckpointMeta, FileMeta, Loaded, OptimizerMeta, ParamMeta, ReadStats,
    SkippedCheckpoint, TrainState, UnitMeta, FORMAT_VERSION, META_FILE,
};
use crate::comm::{ProcessGroupExt, ReduceOp};
use crate::error::{Error, Result};
use crate::flat_param::FlatParamLayout;
use crate::fsdp::FsdpModel;
use crate::fsdp::ShardView;
use crate::ops::with_host_f32;
use crate::optim::{
    check_loadable, BufferKind, OptimizerHyper, OptimizerState, ShardedOptimizer, UnitOptimState,
};

mod dirs;
mod load;
mod save;

use dirs::*;
pub(crate) use dirs::{prepare_staging, publish};
#[allow(unused_imports)]
use load::*;
pub(crate) use load::{discover_kinds, root_message};
pub use load::{load_latest, load_latest_of_run, load_sharded};
pub(crate) use save::now_unix_ms;
#[allow(unused_imports)]
use save::*;
pub use save::{save_sharded, save_sharded_async, PendingSave};
/// Value of the `format` entry of a shard file's safetensors metadata.
pub const SHARDED_FORMAT: &str = "candle-fsdp/sharded";

/// File name of rank `rank`'s shards in a checkpoint of `world_size` ranks
/// (`shard-00001-of-00002.safetensors`).
pub fn shard_file_name(rank: usize, world_size: usize) -> String {
    format!("shard-{rank:05}-of-{world_size:05}.safetensors")
}

pub(super) fn unit_metas(model: &FsdpModel, kept: &Kept) -> Result<Vec<UnitMeta>> {
    model
        .shards()
        .enumerate()
        .map(|(k, u)| {
            let mut m = UnitMeta::from_layout(u.unit_name, u.layout, u.buffers)?;
            m.in_base = kept.in_base[k];
            m.no_optim_state = kept.stateless[k];
            Ok(m)
        })
        .collect()
}

/// What a save leaves out of the files, per unit.
pub(super) struct Kept {
    /// Left to the frozen base (decision 75): the stateless units when the model knows its
    /// base ([`FsdpModel::base`]); no parameters, buffers or state in the files.
    pub in_base: Vec<bool>,
    /// Frozen and never stepped (`steps`, the optimizer's header): no optimizer state (zeros
    /// the optimizer does not keep). A unit frozen after training is not: its values and state
    /// are its own, not the base's.
    pub stateless: Vec<bool>,
    /// The dtype the optimizer buffers are written in (the optimizer's state dtype).
    pub optim_dtype: Dtype,
}

impl Kept {
    /// Both, from the model and the optimizer's step counts; `state_dtype` the optimizer's
    /// (f32 or bf16).
    ///
    /// Errors: another state dtype.
    pub(super) fn of(
        model: &FsdpModel,
        steps: &OptimizerState,
        state_dtype: candle_core::DType,
    ) -> Result<Self> {
        let stateless: Vec<bool> = model
            .shards()
            .enumerate()
            .map(|(k, u)| {
                u.frozen
                    && steps
                        .units
                        .get(k)
                        .is_none_or(|s| s.steps.iter().all(|&n| n == 0))
            })
            .collect();
        let has_base = model.base().is_some();
        let optim_dtype = match state_dtype {
            candle_core::DType::F32 => Dtype::F32,
            candle_core::DType::BF16 => Dtype::BF16,
            d => {
                return Err(Error::dtype(
                    "checkpoint: optimizer state",
                    "f32 or bf16 (those are saved)",
                    d,
                ))
            }
        };
        Ok(Self {
            in_base: stateless.iter().map(|&s| s && has_base).collect(),
            stateless,
            optim_dtype,
        })
    }
}

/// The tensors of rank `rank`'s file, in file order: its shards of the units it holds a shard
/// of (but those `in_base`), the matching optimizer buffers (`kinds`, when the optimizer has
/// state; but those of stateless units), and (rank 0) the buffers (but those of units
/// `in_base`). A function of the model and the rank only, so rank 0 knows every file's tensor
/// names (for the checksums) without asking.
pub(super) fn rank_file_specs(
    model: &FsdpModel,
    kinds: &[BufferKind],
    rank: usize,
    kept: &Kept,
) -> Result<Vec<TensorSpec>> {
    let mut specs = Vec::new();
    let in_base = &kept.in_base;
    // Shard s of a unit lives in rank s's file; under NO_SHARD (one shard) only rank 0 has it.
    let holds = |k: usize, u: &ShardView| u.layout.world_size > rank && !in_base[k];
    for (k, u) in model.shards().enumerate() {
        if holds(k, &u) {
            specs.push(TensorSpec::f32(param_tensor(k), u.layout.shard_numel));
        }
    }
    for kind in kinds {
        for (k, u) in model.shards().enumerate() {
            if holds(k, &u) && !kept.stateless[k] {
                specs.push(TensorSpec {
                    dtype: kept.optim_dtype,
                    ..TensorSpec::f32(optim_tensor(*kind, k), u.layout.shard_numel)
                });
            }
        }
    }
    if rank == 0 {
        for (k, u) in model.shards().enumerate() {
            if in_base[k] {
                continue;
            }
            for (name, var) in u.buffers {
                specs.push(TensorSpec {
                    name: buffer_tensor(name),
                    dtype: st_dtype(var.dtype())?,
                    shape: var.dims().to_vec(),
                });
            }
        }
    }
    Ok(specs)
}

/// Tensor name of unit `k`'s parameter shard.
pub(super) fn param_tensor(k: usize) -> String {
    format!("param.{k}")
}

/// Tensor name of unit `k`'s optimizer buffer `kind` (written, never parsed back).
pub(super) fn optim_tensor(kind: BufferKind, k: usize) -> String {
    format!("optim.{}.{k}", kind.name())
}

/// Tensor name of a buffer.
pub(super) fn buffer_tensor(name: &str) -> String {
    format!("buffer.{name}")
}
