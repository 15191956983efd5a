//! The FlatParameter: one unit's parameters flattened into one padded buffer, of which a rank
//! keeps one contiguous shard.
//!
//! Layout (all sizes in elements; f32 master shards are 4 bytes an element):
//! - Each parameter starts at an offset aligned to [`ALIGN_ELEMS`] elements (16 bytes of f32),
//!   so a gathered buffer can be viewed per parameter without a copy and vectorised kernels see
//!   aligned rows. The gaps between parameters are zero.
//! - The total is padded with zeros to `padded_numel`, the next multiple of the world size
//!   (at least one element per rank once the unit has any parameter), so every rank's shard has
//!   the same length `shard_numel = padded_numel / world_size`.
//! - Rank r keeps `[r * shard_numel, (r + 1) * shard_numel)`, as PyTorch FSDP's `FlatParamHandle`
//!   does (`torch/distributed/fsdp/_flat_param.py`).
//!
//! [`FlatParamLayout::shard_table`] lists, for one rank, which part of which parameter its shard
//! holds: what the optimizer, clipping and state dicts need.

use std::ops::Range;

use candle_core::Shape;

use crate::error::{Error, Result};

/// Parameter offsets are multiples of this many elements (16 bytes of f32).
pub const ALIGN_ELEMS: usize = 4;

/// One parameter's place in the flat buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamInfo {
    /// Fully qualified name, e.g. `fc1.weight`.
    pub name: String,
    /// Shape as the constructor asked for it.
    pub shape: Shape,
    /// `shape.elem_count()`.
    pub numel: usize,
    /// Offset of the first element in the unsharded flat buffer (multiple of [`ALIGN_ELEMS`]).
    pub offset: usize,
}

/// One entry of a rank's shard table: the part of one parameter that lies in the shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardEntry {
    /// Index into [`FlatParamLayout::params`].
    pub param_index: usize,
    /// Where this part starts inside the rank's shard (elements).
    pub offset_in_shard: usize,
    /// How many elements of the parameter the shard holds.
    pub numel_in_shard: usize,
    /// Which elements of the flattened parameter (row-major) they are.
    pub range_in_param: Range<usize>,
}

/// How one unit's parameters are laid out and sharded over `world_size` ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct FlatParamLayout {
    /// Parameters in the order the constructor created them.
    pub params: Vec<ParamInfo>,
    /// Elements used by parameters and alignment gaps (before the final padding).
    pub unpadded_numel: usize,
    /// Total flat length, a multiple of `world_size` (0 when the unit has no parameter).
    pub padded_numel: usize,
    /// Number of shards.
    pub world_size: usize,
    /// `padded_numel / world_size`.
    pub shard_numel: usize,
}

impl FlatParamLayout {
    /// Lays out `params` (name, shape) over `world_size` shards.
    ///
    /// Errors: `world_size == 0`, or two parameters with the same name.
    pub fn new(params: &[(String, Shape)], world_size: usize) -> Result<Self> {
        if world_size == 0 {
            return Err(Error::InvalidArgument(
                "world size must be at least 1".into(),
            ));
        }
        let mut infos = Vec::with_capacity(params.len());
        let mut offset = 0usize;
        for (name, shape) in params {
            if infos.iter().any(|p: &ParamInfo| &p.name == name) {
                return Err(Error::InvalidArgument(format!(
                    "parameter {name} is registered twice in one unit"
                )));
            }
            offset = offset.div_ceil(ALIGN_ELEMS) * ALIGN_ELEMS;
            let numel = shape.elem_count();
            infos.push(ParamInfo {
                name: name.clone(),
                shape: shape.clone(),
                numel,
                offset,
            });
            offset += numel;
        }
        let unpadded_numel = offset;
        let padded_numel = unpadded_numel.div_ceil(world_size) * world_size;
        Ok(Self {
            params: infos,
            unpadded_numel,
            padded_numel,
            world_size,
            shard_numel: padded_numel / world_size,
        })
    }

    /// Sum of the parameters' element counts (no gaps, no padding).
    pub fn param_numel(&self) -> usize {
        self.params.iter().map(|p| p.numel).sum()
    }

    /// The flat range rank `rank` keeps.
    pub fn shard_range(&self, rank: usize) -> Range<usize> {
        rank * self.shard_numel..(rank + 1) * self.shard_numel
    }

    /// What rank `rank`'s shard holds of each parameter (parameters it holds nothing of are
    /// left out), in flat order.
    pub fn shard_table(&self, rank: usize) -> Vec<ShardEntry> {
        let shard = self.shard_range(rank);
        self.params
            .iter()
            .enumerate()
            .filter_map(|(i, p)| {
                let start = p.offset.max(shard.start);
                let end = (p.offset + p.numel).min(shard.end);
                (start < end).then(|| ShardEntry {
                    param_index: i,
                    offset_in_shard: start - shard.start,
                    numel_in_shard: end - start,
                    range_in_param: start - p.offset..end - p.offset,
                })
            })
            .collect()
    }

    /// Index of the parameter called `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.params.iter().position(|p| p.name == name)
    }
}

/// One rank's state of one unit: the layout, its f32 master shard and its f32 gradient shard.
#[derive(Debug, Clone)]
pub struct FlatParameter {
    /// Layout shared by all ranks.
    pub layout: FlatParamLayout,
    /// This rank's index into the shards.
    pub shard_index: usize,
    /// Master shard, `layout.shard_numel` f32 values.
    pub shard: Vec<f32>,
    /// Gradient shard (reduced over ranks), `None` until a backward produced one.
    pub grad: Option<Vec<f32>>,
}

impl FlatParameter {
    /// Builds the shard of `shard_index` by calling `fill(param_index, range_in_param, out)` for
    /// every piece of a parameter that lands in it; gaps and padding stay zero.
    pub fn from_fn(
        layout: FlatParamLayout,
        shard_index: usize,
        mut fill: impl FnMut(usize, Range<usize>, &mut [f32]) -> Result<()>,
    ) -> Result<Self> {
        let mut shard = vec![0.0f32; layout.shard_numel];
        for e in layout.shard_table(shard_index) {
            let out = &mut shard[e.offset_in_shard..e.offset_in_shard + e.numel_in_shard];
            fill(e.param_index, e.range_in_param.clone(), out)?;
        }
        Ok(Self {
            layout,
            shard_index,
            shard,
            grad: None,
        })
    }

    /// Adds `reduced` (one reduced gradient shard) into the gradient shard.
    pub fn accumulate_grad(&mut self, reduced: Vec<f32>) {
        match &mut self.grad {
            None => self.grad = Some(reduced),
            Some(g) => g.iter_mut().zip(reduced).for_each(|(a, b)| *a += b),
        }
    }

    /// Bytes held by the master and gradient shards.
    pub fn sharded_bytes(&self) -> usize {
        4 * (self.shard.len() + self.grad.as_ref().map_or(0, |g| g.len()))
    }
}
