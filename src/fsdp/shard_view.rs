//! The one accessor through which the optimizers, gradient clipping, the grad scaler and both
//! checkpoint formats see a model's local state: [`FsdpModel::shards`], one [`ShardView`] per
//! unit, plus the setters that loading needs ([`FsdpModel::set_unit_shard`],
//! [`FsdpModel::set_unit_grad`]).
//!
//! A view borrows the unit's tensors. Shard and gradient are device tensors that the kernels of
//! [`crate::ops`] update in place, so `&Tensor` is enough to step an optimizer; buffers are
//! [`Var`]s, set in place with [`Var::set`]. Replacing a tensor (loading) goes through the
//! setters, which check its length, dtype and device against the unit's layout.

use candle_core::{Tensor, Var};

use super::model::FsdpModel;
use super::param_group::ParamGroup;
use crate::error::{Error, Result};
use crate::flat_param::{FlatParamLayout, PackedShard};

/// What one rank holds of one unit, borrowed from an [`FsdpModel`].
#[derive(Debug, Clone, Copy)]
pub struct ShardView<'a> {
    /// Index of the unit in forward order (the `k` of `param.k` / `exp_avg.k` in checkpoints).
    pub unit_index: usize,
    /// Name of the unit.
    pub unit_name: &'a str,
    /// Layout of the unit's flat parameter (shared by all ranks).
    pub layout: &'a FlatParamLayout,
    /// This rank's shard index (its rank, or 0 under NO_SHARD).
    pub shard_index: usize,
    /// Master shard: 1-D f32, `layout.shard_numel` elements, on the model's device; empty
    /// when the shard is stored packed (`packed`; [`ShardView::param_f32`] reads either).
    pub param: &'a Tensor,
    /// A frozen twin's shard stored packed ([`crate::FsdpConfig::frozen_storage`]).
    pub packed: Option<&'a PackedShard>,
    /// Gradient shard (same shape, dtype and device), `None` before a backward or after
    /// [`FsdpModel::zero_grad`].
    pub grad: Option<&'a Tensor>,
    /// Per parameter of `layout.params`: whether `grad` holds a gradient of it (`false`: the
    /// parameter received no gradient on any rank; its elements of `grad` are zeros standing
    /// in for "absent", and optimizers skip it). All `false` when `grad` is `None`.
    pub grad_present: &'a [bool],
    /// The unit's buffers (name, variable): replicated, in the policy's `buffer_dtype`.
    pub buffers: &'a [(String, Var)],
    /// A frozen twin ([`crate::FsdpModelBuilder::freeze`]): parameters that never get a
    /// gradient; optimizers keep no state for them.
    pub frozen: bool,
}

impl ShardView<'_> {
    /// The shard's values in f32 (1-D, `layout.shard_numel` elements): `param`, or the packed
    /// shard dequantised ([`crate::quant::unpack`]) into a new tensor.
    ///
    /// Errors: a failed transfer.
    pub fn param_f32(&self) -> Result<Tensor> {
        match self.packed {
            Some(p) => p.unpack(self.layout.shard_numel),
            None => Ok(self.param.clone()),
        }
    }
}

impl FsdpModel {
    /// One view per unit, in forward order: the accessor of optimizers, clipping, the grad scaler
    /// and checkpoints. Local: no communication.
    pub fn shards(&self) -> impl ExactSizeIterator<Item = ShardView<'_>> + '_ {
        self.units.iter().enumerate().map(|(k, u)| ShardView {
            unit_index: k,
            unit_name: u.name(),
            layout: u.flat().layout(),
            shard_index: u.flat().shard_index(),
            param: u.flat().shard(),
            packed: u.flat().packed(),
            grad: u.flat().grad(),
            grad_present: u.flat().grad_present(),
            buffers: u.buffers(),
            frozen: u.is_frozen(),
        })
    }

    /// The view of unit `unit` (see [`FsdpModel::shards`]); `None` past the last unit.
    pub fn shard(&self, unit: usize) -> Option<ShardView<'_>> {
        self.shards().nth(unit)
    }

    /// Replaces unit `unit`'s master shard (loading a checkpoint); its gradient is kept.
    ///
    /// Errors (the shard is then unchanged): no such unit; `shard` not a 1-D f32 tensor of the
    /// unit's `shard_numel` elements on the model's device. The message names the unit and the
    /// expected and found shape, dtype and device.
    pub fn set_unit_shard(&mut self, unit: usize, shard: Tensor) -> Result<()> {
        let u = self.unit_mut(unit)?;
        let name = u.name().to_string();
        u.flat_mut().set_shard(shard).map_err(|e| in_unit(&name, e))
    }

    /// Replaces (or with `None` drops) unit `unit`'s gradient shard.
    ///
    /// Errors: as [`FsdpModel::set_unit_shard`].
    pub fn set_unit_grad(&mut self, unit: usize, grad: Option<Tensor>) -> Result<()> {
        let u = self.unit_mut(unit)?;
        let name = u.name().to_string();
        u.flat_mut().set_grad(grad).map_err(|e| in_unit(&name, e))
    }

    fn unit_mut(&mut self, unit: usize) -> Result<&mut ParamGroup> {
        let n = self.units.len();
        self.units
            .get_mut(unit)
            .ok_or_else(|| Error::out_of_range("unit index", unit, "the model's unit count", n))
    }
}

/// Prefixes an argument error with the unit it concerns.
fn in_unit(name: &str, e: Error) -> Error {
    e.prefixed(&format!("unit {name}"))
}
