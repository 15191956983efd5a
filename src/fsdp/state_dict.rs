//! State-dict gathering: the full parameters of a sharded model, one unit at a time. One f32
//! unit gather ([`FsdpModel::gather_unit_f32`]) serves [`FsdpModel::gather_full_params`],
//! [`FsdpModel::gather_full_model`] and the full safetensors checkpoint.

use std::collections::HashMap;

use crate::unit::UnitModule;
use candle_core::{DType, Tensor};

use super::collectives;
use super::model::FsdpModel;
use crate::error::{Error, Phase, Result};

impl FsdpModel {
    /// Gathers unit `k`'s flat parameter in f32 (exact master values, whatever the policy's
    /// `param_dtype`; a packed frozen shard's dequantised values): a 1-D tensor of `padded_numel` elements, on every rank (a collective, on
    /// the model's all-gather stream). The one f32 unit gather of state dicts and the full
    /// checkpoint: the unit itself stays sharded; the returned buffer counts as unsharded
    /// memory while the gather runs.
    ///
    /// Errors: `k` out of range; ([`Error::InStep`], phase checkpoint) any collective error, or
    /// a training step in progress (gather state dicts between steps).
    pub fn gather_unit_f32(&self, k: usize) -> Result<Tensor> {
        let Some(u) = self.units.get(k) else {
            return Err(Error::out_of_range(
                "unit index",
                k,
                "the model's unit count",
                self.units.len(),
            ));
        };
        if !u.is_sharded() || u.in_step() {
            let e = Error::Misuse {
                call: "gathering a state dict",
                state: "during a training step",
                fix: "call it between steps".into(),
            };
            return Err(self.at(e, None, Phase::Checkpoint));
        }
        let _guard = self
            .mem
            .unshard(u.flat().layout().padded_numel * DType::F32.size_in_bytes());
        let gathered = match u.flat().packed() {
            // A packed frozen shard: its packed bytes, dequantised (the values it computes with).
            Some(p) => collectives::wait_gathered(collectives::all_gather_packed(
                self.comm.shard_pg(),
                &self.comm.all_gather,
                &p.bytes,
                u.gathers(),
            ))
            .and_then(|g| {
                collectives::unpack_gathered(p.format, &g, u.flat().layout(), DType::F32)
            }),
            None => collectives::wait_gathered(collectives::all_gather_shard(
                self.comm.shard_pg(),
                &self.comm.all_gather,
                u.flat(),
                DType::F32,
                u.gathers(),
            )),
        };
        gathered.map_err(|e| self.at(e, Some(k), Phase::Checkpoint))
    }

    /// Gathers every unit's full parameters (a collective, one unit at a time). With
    /// `rank0_only`, only rank 0 gets the result (`None` elsewhere).
    ///
    /// Returns (name, f32 tensor of the parameter's shape) for every parameter, followed by each
    /// unit's buffers, unit by unit.
    ///
    /// Errors: see [`FsdpModel::gather_unit_f32`].
    pub fn gather_full_params(&self, rank0_only: bool) -> Result<Option<Vec<(String, Tensor)>>> {
        let keep = !rank0_only || self.pg.rank() == 0;
        let mut out = Vec::new();
        for k in 0..self.units.len() {
            let full = self.gather_unit_f32(k)?;
            if keep {
                let u = &self.units[k];
                for p in &u.flat().layout().params {
                    let t = full
                        .narrow(0, p.offset, p.numel)?
                        .reshape(p.shape.clone())?
                        .force_contiguous()?;
                    out.push((p.name.clone(), t));
                }
                for (name, var) in u.buffers() {
                    out.push((name.clone(), var.as_tensor().copy()?));
                }
            }
        }
        Ok(keep.then_some(out))
    }

    /// Gathers the full model (a collective) and returns, on rank 0 only with `rank0_only`, a
    /// plain unsharded copy that runs without communication (for evaluation or export).
    ///
    /// Errors: see [`FsdpModel::gather_unit_f32`]; a constructor's error.
    pub fn gather_full_model(&self, rank0_only: bool) -> Result<Option<FullModel>> {
        let Some(params) = self.gather_full_params(rank0_only)? else {
            return Ok(None);
        };
        let map: HashMap<String, Tensor> = params.into_iter().collect();
        let modules = self
            .members
            .iter()
            .map(|m| {
                let module =
                    m.spec
                        .bind(&m.prefix, map.clone(), DType::F32, &self.config.device)?;
                Ok((m.spec.name.clone(), module))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(FullModel {
            modules,
            device: self.config.device.clone(),
        }))
    }
}

/// An unsharded copy of a model's units (see [`FsdpModel::gather_full_model`]), in f32.
pub struct FullModel {
    modules: Vec<(String, Box<dyn UnitModule>)>,
    device: candle_core::Device,
}

impl FullModel {
    /// The device its parameters live on (the model's: inputs must be moved there).
    pub fn device(&self) -> &candle_core::Device {
        &self.device
    }

    /// Runs every unit in build order, each on the previous one's output (a chain model).
    ///
    /// Errors: a unit's own; a unit of several outputs.
    pub fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let mut h = x.clone();
        for (name, m) in &self.modules {
            let mut out = m.forward_t(std::slice::from_ref(&h), train)?;
            if out.len() != 1 {
                return Err(Error::shape(
                    format!("unit {name}"),
                    "one output (call units of a model that is not a chain with FullModel::call)",
                    format!("{} outputs", out.len()),
                ));
            }
            h = out.pop().expect("one output");
        }
        Ok(h)
    }

    /// Calls unit `unit` on `xs` (the unsharded counterpart of [`crate::fsdp::Forward::call`]).
    ///
    /// Errors: no unit of that name; the unit's own.
    pub fn call(&self, unit: &str, xs: &[&Tensor], train: bool) -> Result<Vec<Tensor>> {
        let Some((_, m)) = self.modules.iter().find(|(n, _)| n == unit) else {
            return Err(Error::missing(
                format!("unit named {unit:?}"),
                "FullModel::call takes the name of one of the model's units",
            ));
        };
        let xs: Vec<Tensor> = xs.iter().map(|&x| x.clone()).collect();
        Ok(m.forward_t(&xs, train)?)
    }
}
