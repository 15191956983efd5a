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
//!
//! [`FlatParameter`] holds the rank's master shard and gradient shard as 1-D f32 Candle tensors
//! on the model's device (device-resident state); its fields are private, and the rest of the
//! crate reaches them through [`crate::ShardView`].

use std::ops::Range;

use candle_core::{DType, Device, Shape, Tensor};

use crate::error::{Error, Result};
use crate::quant::BaseDType;

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
    /// `shard_numel` is a multiple of this ([`FlatParamLayout::with_shard_multiple`]; 1 for
    /// [`FlatParamLayout::new`]).
    pub shard_multiple: usize,
}

impl FlatParamLayout {
    /// Lays out `params` (name, shape) over `world_size` shards.
    ///
    /// Errors: `world_size == 0`, or two parameters with the same name.
    pub fn new(params: &[(String, Shape)], world_size: usize) -> Result<Self> {
        Self::with_shard_multiple(params, world_size, 1)
    }

    /// As [`FlatParamLayout::new`], padded further so that `shard_numel` is a multiple of
    /// `multiple` (e.g. a packed format's block, [`crate::quant::BaseDType::block`], so that
    /// every rank packs whole blocks).
    ///
    /// Errors: as [`FlatParamLayout::new`]; `multiple == 0`.
    pub fn with_shard_multiple(
        params: &[(String, Shape)],
        world_size: usize,
        multiple: usize,
    ) -> Result<Self> {
        if multiple == 0 {
            return Err(Error::value("shard multiple", "at least 1", 0));
        }
        if world_size == 0 {
            return Err(Error::value("world size", "at least 1", 0));
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
        let padded_numel = unpadded_numel.div_ceil(world_size * multiple) * world_size * multiple;
        Ok(Self {
            params: infos,
            unpadded_numel,
            padded_numel,
            world_size,
            shard_numel: padded_numel / world_size,
            shard_multiple: multiple,
        })
    }

    /// The geometry the copy kernels see ([`crate::kernels::plan::CopyLayout`]): each
    /// parameter's offset and element count, the shard size and the world size.
    pub fn copy_layout(&self) -> crate::kernels::plan::CopyLayout {
        crate::kernels::plan::CopyLayout {
            spans: self
                .params
                .iter()
                .map(|p| crate::kernels::plan::ParamSpan {
                    offset: p.offset,
                    numel: p.numel,
                })
                .collect(),
            shard_numel: self.shard_numel,
            world_size: self.world_size,
        }
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

/// One rank's state of one unit: the layout, its f32 master shard and its f32 gradient shard,
/// both Candle tensors on the model's device.
///
/// Invariants (checked by every setter): the shard is a 1-D f32 tensor of
/// `layout.shard_numel` elements; the gradient, when present, has the same shape, dtype and
/// device. Alignment gaps and padding hold zeros in both. Optimizers, clipping and the grad
/// scaler update the tensors **in place** through [`crate::ops`], so a tensor handed to
/// [`FlatParameter::set_shard`], [`FlatParameter::set_grad`] or the parameter group's gradient
/// accumulation (`crate::fsdp::param_group`) becomes owned state: nothing else should keep
/// using its storage.
#[derive(Debug)]
pub struct FlatParameter {
    layout: FlatParamLayout,
    shard_index: usize,
    shard: Tensor,
    grad: Option<Tensor>,
    /// Per parameter (layout order): whether the gradient shard holds a gradient of it (it
    /// received one on some rank in some backward since the last clear), as opposed to the
    /// zeros that stand in for a parameter without gradient.
    grad_present: Vec<bool>,
    /// The shard stored packed ([`FlatParameter::pack`]): then `shard` is empty.
    packed: Option<PackedShard>,
}

/// A frozen parameter shard kept in a storage format of [`crate::quant`] instead of f32
/// ([`crate::FsdpConfig::frozen_storage`]): the bytes [`crate::quant::pack`] wrote for the
/// `shard_numel` values, a 1-D `u8` tensor on the shard's device.
#[derive(Debug, Clone)]
pub struct PackedShard {
    /// The storage format.
    pub format: BaseDType,
    /// `format.packed_bytes(shard_numel)` bytes, 1-D `u8`.
    pub bytes: Tensor,
}

impl PackedShard {
    /// The `numel` values these bytes hold, dequantised ([`crate::quant::unpack`]): 1-D f32 on
    /// the bytes' device.
    ///
    /// Errors: a byte count that is not `format.packed_bytes(numel)`; a failed transfer.
    pub fn unpack(&self, numel: usize) -> Result<Tensor> {
        let bytes = self.bytes.to_vec1::<u8>()?;
        let mut out = vec![0f32; numel];
        crate::quant::unpack(self.format, &bytes, &mut out)?;
        Ok(Tensor::from_vec(out, numel, self.bytes.device())?)
    }
}

impl FlatParameter {
    /// Builds the shard of `shard_index` on `device` by calling
    /// `fill(param_index, range_in_param, out)` for every piece of a parameter that lands in it;
    /// gaps and padding stay zero. The values are assembled on the host, then moved (CPU: no
    /// copy) to `device`.
    ///
    /// Errors: whatever `fill` returns; a failed transfer to `device`.
    pub fn from_fn(
        layout: FlatParamLayout,
        shard_index: usize,
        device: &Device,
        mut fill: impl FnMut(usize, Range<usize>, &mut [f32]) -> Result<()>,
    ) -> Result<Self> {
        // In the shared arena under shm (the all-gather's peers read the shard in place).
        let mut shard = crate::alloc::in_shared(|| vec![0.0f32; layout.shard_numel]);
        for e in layout.shard_table(shard_index) {
            let out = &mut shard[e.offset_in_shard..e.offset_in_shard + e.numel_in_shard];
            fill(e.param_index, e.range_in_param.clone(), out)?;
        }
        let n = shard.len();
        let grad_present = vec![false; layout.params.len()];
        Ok(Self {
            layout,
            shard_index,
            shard: Tensor::from_vec(shard, n, device)?,
            grad: None,
            grad_present,
            packed: None,
        })
    }

    /// Keeps the shard packed in `format` from now on (a frozen twin under
    /// [`crate::FsdpConfig::frozen_storage`]): the f32 shard is quantised by
    /// [`crate::quant::pack`] and dropped; [`FlatParameter::shard`] is then empty and
    /// [`FlatParameter::packed`] holds the bytes. `F32` is a no-op.
    ///
    /// Errors: a gradient shard is held (only parameters without gradient are packed);
    /// `shard_numel` not a multiple of the format's block (the layout must be built with
    /// [`FlatParamLayout::with_shard_multiple`]); a failed device transfer.
    pub fn pack(&mut self, format: BaseDType) -> Result<()> {
        if format == BaseDType::F32 {
            return Ok(());
        }
        if self.grad.is_some() {
            return Err(Error::conflict(
                "pack",
                "a flat parameter that holds a gradient",
                "only frozen parameters are stored packed",
            ));
        }
        let n = self.layout.shard_numel;
        if !n.is_multiple_of(format.block()) {
            return Err(Error::shape(
                "pack: shard",
                format!(
                    "a whole number of {}-element {} blocks",
                    format.block(),
                    format.name()
                ),
                format!("{n} elements"),
            ));
        }
        let device = self.shard.device().clone();
        let values = self.shard.to_vec1::<f32>()?;
        let mut bytes = crate::alloc::in_shared(|| vec![0u8; format.packed_bytes(n)]);
        crate::quant::pack(format, &values, &mut bytes)?;
        let len = bytes.len();
        self.packed = Some(PackedShard {
            format,
            bytes: Tensor::from_vec(bytes, len, &device)?,
        });
        self.shard = Tensor::zeros(0, DType::F32, &device)?;
        Ok(())
    }

    /// The packed shard, when the shard is stored packed ([`FlatParameter::pack`]).
    pub fn packed(&self) -> Option<&PackedShard> {
        self.packed.as_ref()
    }

    /// The shard's values in f32 (1-D, `shard_numel` elements): the master shard itself, or
    /// a packed shard dequantised ([`crate::quant::unpack`]) into a new tensor.
    ///
    /// Errors: a failed device transfer.
    pub fn shard_f32(&self) -> Result<Tensor> {
        match &self.packed {
            Some(p) => p.unpack(self.layout.shard_numel),
            None => Ok(self.shard.clone()),
        }
    }

    /// Layout shared by all ranks.
    pub fn layout(&self) -> &FlatParamLayout {
        &self.layout
    }

    /// This rank's index into the shards (its rank, or 0 under NO_SHARD).
    pub fn shard_index(&self) -> usize {
        self.shard_index
    }

    /// Master shard: 1-D f32, `layout().shard_numel` elements (empty when the shard is stored
    /// packed: see [`FlatParameter::packed`] and [`FlatParameter::shard_f32`]).
    pub fn shard(&self) -> &Tensor {
        &self.shard
    }

    /// Gradient shard (reduced over ranks, 1-D f32 like the shard), `None` until a backward
    /// produced one or after [`FlatParameter::clear_grad`].
    pub fn grad(&self) -> Option<&Tensor> {
        self.grad.as_ref()
    }

    /// Per parameter in layout order: whether the gradient shard holds a gradient of it
    /// (`false`: the parameter received no gradient, its elements of the gradient shard are
    /// zeros standing in for "absent"). All `false` without a gradient shard.
    pub fn grad_present(&self) -> &[bool] {
        &self.grad_present
    }

    /// Device of the shard.
    pub fn device(&self) -> &Device {
        self.shard.device()
    }

    /// Checks one reduced gradient shard before it is added into the gradient shard (by the
    /// parameter group, `crate::fsdp::param_group`): `shard_numel` elements of f32, bf16 or f16,
    /// any shape, on the shard's device, with presence flags `present` (one per parameter,
    /// layout order). Returns it 1-D.
    ///
    /// Errors: `present` of the wrong length; wrong element count, device or dtype (naming
    /// expected and found).
    pub(crate) fn check_reduced_grad(&self, reduced: Tensor, present: &[bool]) -> Result<Tensor> {
        if present.len() != self.layout.params.len() {
            return Err(Error::shape(
                "gradient presence flags",
                format!("one per parameter ({})", self.layout.params.len()),
                present.len(),
            ));
        }
        let n = self.layout.shard_numel;
        if reduced.elem_count() != n
            || !reduced.device().same_device(self.shard.device())
            || !matches!(reduced.dtype(), DType::F32 | DType::BF16 | DType::F16)
        {
            return Err(Error::shape(
                "reduced gradient shard",
                format!(
                    "{n} elements of f32, bf16 or f16 on {:?}",
                    self.shard.device().location()
                ),
                format!(
                    "{} elements of {:?} on {:?}",
                    reduced.elem_count(),
                    reduced.dtype(),
                    reduced.device().location()
                ),
            ));
        }
        Ok(if reduced.rank() == 1 {
            reduced
        } else {
            reduced.flatten_all()?
        })
    }

    /// Makes `grad` (1-D f32, contiguous, `shard_numel` elements on the shard's device, as
    /// [`FlatParameter::check_reduced_grad`] and the caller made sure) the gradient shard,
    /// keeping the presence flags.
    pub(crate) fn put_grad(&mut self, grad: Tensor) {
        self.grad = Some(grad);
    }

    /// ORs `present` (one flag per parameter) into [`FlatParameter::grad_present`].
    pub(crate) fn add_grad_present(&mut self, present: &[bool]) {
        for (have, new) in self.grad_present.iter_mut().zip(present) {
            *have |= *new;
        }
    }

    /// Drops the gradient shard (PyTorch's `zero_grad(set_to_none=True)`).
    pub fn clear_grad(&mut self) {
        self.grad = None;
        self.grad_present.iter_mut().for_each(|p| *p = false);
    }

    /// Replaces the master shard (e.g. when loading a checkpoint); the gradient is kept.
    ///
    /// A packed shard keeps its bytes when `shard` holds exactly the values they dequantise to
    /// (a checkpoint of the same base, saved dequantised: resume is then bit-exact, also at
    /// another world size, since blocks sit at the same flat offsets whatever the world size);
    /// other values are packed anew in its format. Packing dequantised values again is exact
    /// for bf16 and NF4 but may move an int8 block's scale by one ulp, hence the comparison.
    ///
    /// Errors: `shard` is not a 1-D f32 tensor of `shard_numel` elements on the shard's device
    /// (naming expected and found); the shard is then unchanged.
    pub fn set_shard(&mut self, shard: Tensor) -> Result<()> {
        self.check("shard", &shard)?;
        if let Some(format) = self.packed.as_ref().map(|p| p.format) {
            let new = shard.to_vec1::<f32>()?;
            let old = self.shard_f32()?.to_vec1::<f32>()?;
            if new
                .iter()
                .zip(&old)
                .all(|(a, b)| a.to_bits() == b.to_bits())
            {
                return Ok(());
            }
            self.packed = None;
            self.shard = shard.contiguous()?;
            return self.pack(format);
        }
        // Under shm the shard lives in the shared arena, where the all-gather's peers read it
        // in place: a shard from elsewhere (a checkpoint's) is copied there.
        let shared = crate::alloc::is_shared_enabled() && shard.device().is_cpu();
        self.shard = match (shard.is_contiguous(), shared) {
            (true, false) => shard,
            (false, false) => shard.contiguous()?,
            // A buffer of the shard's size, whatever storage the given view is part of.
            (_, true) => crate::alloc::in_shared(|| shard.force_contiguous())?,
        };
        Ok(())
    }

    /// Replaces (or with `None` drops) the gradient shard. A gradient set this way counts as a
    /// gradient of every parameter ([`FlatParameter::grad_present`]).
    ///
    /// Errors: as [`FlatParameter::set_shard`].
    pub fn set_grad(&mut self, grad: Option<Tensor>) -> Result<()> {
        let present = grad.is_some();
        self.grad = match grad {
            None => None,
            Some(g) => {
                self.check("gradient shard", &g)?;
                Some(if g.is_contiguous() {
                    g
                } else {
                    g.contiguous()?
                })
            }
        };
        self.grad_present.iter_mut().for_each(|p| *p = present);
        Ok(())
    }

    /// Bytes held by the master and gradient shards (4 per f32 element), or by the packed
    /// shard.
    pub fn sharded_bytes(&self) -> usize {
        4 * (self.shard.elem_count() + self.grad.as_ref().map_or(0, |g| g.elem_count()))
            + self.packed.as_ref().map_or(0, |p| p.bytes.elem_count())
    }

    /// Checks that `t` may serve as this parameter's `what`.
    fn check(&self, what: &str, t: &Tensor) -> Result<()> {
        let n = self.layout.shard_numel;
        let device = self.shard.device();
        if t.dims() != [n] || t.dtype() != DType::F32 || !t.device().same_device(device) {
            return Err(Error::shape(
                what,
                format!(
                    "a 1-D f32 tensor of {n} elements on {:?}",
                    device.location()
                ),
                format!(
                    "shape {:?} of {:?} on {:?}",
                    t.dims(),
                    t.dtype(),
                    t.device().location()
                ),
            ));
        }
        Ok(())
    }
}
