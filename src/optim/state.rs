//! The device state of a sharded optimizer (one [`ShardState`] shared by AdamW and SGD): per
//! unit, per-parameter step counts and group indices and the moment buffers laid out like the
//! shard; `ensure` (first step), `adopt` (a loaded state), `export` / `import` (host copies),
//! and the walk over a shard's present parameters that both steps use.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};

use super::{missing_buffer, BufferKind, UnitOptimState};
use crate::error::{Error, Result};
use crate::fsdp::{FsdpModel, ShardView};
use crate::ops;

/// One unit's device state.
#[derive(Debug)]
pub(super) struct UnitSlot {
    /// Per parameter: updates taken.
    pub(super) steps: Vec<u64>,
    /// Per parameter: its group.
    pub(super) group: Vec<usize>,
    /// Buffers in the optimizer's kinds order (`shard_numel` elements each). A frozen twin
    /// holds them only when its parameters were stepped before they were frozen (loaded from a
    /// checkpoint with nonzero step counts): then they are kept unchanged while frozen, with
    /// the step counts, so that unfreezing resumes as a continuation. None otherwise.
    pub(super) bufs: Vec<Tensor>,
    /// A frozen twin's `shard_numel` (without buffers its state exports as zeros, see
    /// [`ShardState::export`]).
    pub(super) frozen_numel: Option<usize>,
}

/// Per-parameter steps and per-unit buffers of one optimizer: allocated at the first step,
/// loaded from host copies, checked against the model before every step.
#[derive(Debug)]
pub(super) struct ShardState {
    pub(super) kinds: &'static [BufferKind],
    /// The buffers' dtype on the device: f32, or bf16 (AdamW's
    /// [`super::AdamW::with_state_dtype`]); host copies are always f32.
    pub(super) dtype: DType,
    pub(super) units: Vec<UnitSlot>,
    /// Loaded state not yet checked against a model.
    pub(super) pending: Option<Vec<UnitOptimState>>,
}

impl ShardState {
    pub(super) fn new(kinds: &'static [BufferKind]) -> Self {
        Self {
            kinds,
            dtype: DType::F32,
            units: Vec::new(),
            pending: None,
        }
    }

    pub(super) fn bytes(&self) -> usize {
        let dev: usize = self
            .units
            .iter()
            .flat_map(|u| &u.bufs)
            .map(Tensor::elem_count)
            .sum();
        let host: usize = self
            .pending
            .iter()
            .flatten()
            .flat_map(|u| u.buffers.values())
            .map(Vec::len)
            .sum();
        self.dtype.size_in_bytes() * dev + 4 * host
    }

    pub(super) fn clear(&mut self) {
        self.units.clear();
        self.pending = None;
    }

    pub(super) fn export(&self) -> Result<Vec<UnitOptimState>> {
        if let Some(p) = &self.pending {
            return Ok(p.clone());
        }
        self.units
            .iter()
            .map(|u| {
                // A frozen twin that was never stepped holds no state; it exports zeros so
                // that every unit of a checkpoint has every buffer kind (the format's
                // invariant).
                let buffers = match u.frozen_numel {
                    Some(n) if u.bufs.is_empty() => {
                        self.kinds.iter().map(|k| (*k, vec![0.0; n])).collect()
                    }
                    _ => self
                        .kinds
                        .iter()
                        .zip(&u.bufs)
                        .map(|(k, b)| Ok((*k, host_f32(b)?)))
                        .collect::<Result<_>>()?,
                };
                Ok(UnitOptimState {
                    steps: u.steps.clone(),
                    buffers,
                })
            })
            .collect()
    }

    /// Steps of every unit, buffers left out, and the kinds every unit holds.
    pub(super) fn header(&self) -> (Vec<UnitOptimState>, Vec<BufferKind>) {
        if let Some(p) = &self.pending {
            let kinds = p
                .first()
                .map(|u| u.buffers.keys().copied().collect())
                .unwrap_or_default();
            let units = p
                .iter()
                .map(|u| UnitOptimState {
                    steps: u.steps.clone(),
                    buffers: BTreeMap::new(),
                })
                .collect();
            return (units, kinds);
        }
        let kinds = if self.units.is_empty() {
            Vec::new()
        } else {
            self.kinds.to_vec()
        };
        let units = self
            .units
            .iter()
            .map(|u| UnitOptimState {
                steps: u.steps.clone(),
                buffers: BTreeMap::new(),
            })
            .collect();
        (units, kinds)
    }

    /// See [`ShardedOptimizer::with_buffer`].
    pub(super) fn with_buffer(
        &self,
        unit: usize,
        kind: BufferKind,
        f: &mut dyn FnMut(&[f32]) -> Result<()>,
    ) -> Result<()> {
        if let Some(p) = &self.pending {
            let b = p
                .get(unit)
                .and_then(|u| u.buffers.get(&kind))
                .ok_or_else(|| missing_buffer(unit, kind))?;
            return f(b);
        }
        let u = self
            .units
            .get(unit)
            .ok_or_else(|| missing_buffer(unit, kind))?;
        let i = self
            .kinds
            .iter()
            .position(|k| *k == kind)
            .ok_or_else(|| missing_buffer(unit, kind))?;
        match u.frozen_numel {
            Some(n) if u.bufs.is_empty() => f(&vec![0.0; n]),
            _ if u.bufs[i].dtype() == DType::F32 => ops::with_host_f32(&u.bufs[i], |v| f(v))?,
            // bf16 state: one buffer's f32 copy at a time (exact).
            _ => f(&host_f32(&u.bufs[i])?),
        }
    }

    pub(super) fn import(&mut self, units: Vec<UnitOptimState>) {
        self.units.clear();
        self.pending = (!units.is_empty()).then_some(units);
    }

    /// Makes the state match `model` (allocating zeroed buffers at the first step, moving
    /// loaded ones to the shards' device) and assigns each parameter its group.
    pub(super) fn ensure(
        &mut self,
        model: &FsdpModel,
        group: impl Fn(&str) -> usize,
    ) -> Result<()> {
        let n_units = model.shards().len();
        if let Some(loaded) = self.pending.take() {
            let units = self.adopt(model, loaded)?;
            self.units = units;
        }
        if self.units.is_empty() {
            self.units = model
                .shards()
                .map(|v| {
                    Ok(UnitSlot {
                        frozen_numel: v.frozen.then_some(v.layout.shard_numel),
                        steps: vec![0; v.layout.params.len()],
                        group: Vec::new(),
                        // Frozen parameters that were never stepped get no optimizer state.
                        bufs: if v.frozen {
                            Vec::new()
                        } else {
                            self.kinds
                                .iter()
                                .map(|_| {
                                    Tensor::zeros(
                                        v.layout.shard_numel,
                                        self.dtype,
                                        v.param.device(),
                                    )
                                })
                                .collect::<candle_core::Result<_>>()?
                        },
                    })
                })
                .collect::<Result<_>>()?;
        }
        if self.units.len() != n_units {
            return Err(Error::shape(
                "optimizer state: units",
                format!("{n_units} (the model's)"),
                self.units.len(),
            ));
        }
        for (v, u) in model.shards().zip(&mut self.units) {
            if u.group.len() != v.layout.params.len() {
                u.group = v.layout.params.iter().map(|p| group(&p.name)).collect();
            }
        }
        Ok(())
    }

    /// Checks loaded host state against the model and moves it to the shards' device.
    pub(super) fn adopt(
        &self,
        model: &FsdpModel,
        loaded: Vec<UnitOptimState>,
    ) -> Result<Vec<UnitSlot>> {
        if loaded.len() != model.shards().len() {
            return Err(Error::shape(
                "optimizer state: units",
                format!("{} (the model's)", model.shards().len()),
                loaded.len(),
            ));
        }
        model
            .shards()
            .zip(loaded)
            .map(|(v, mut u)| {
                if u.steps.len() != v.layout.params.len() {
                    return Err(Error::shape(format!("optimizer state of unit {}: step counts", v.unit_name), format!("{} (one per parameter of the unit)", v.layout.params.len()), u.steps.len()));
                }
                let max_step = u.steps.iter().copied().max().unwrap_or(0);
                if v.frozen && max_step == 0 {
                    // Never stepped: no state to keep (zeros on export).
                    return Ok(UnitSlot {
                        frozen_numel: Some(v.layout.shard_numel),
                        steps: u.steps,
                        group: Vec::new(),
                        bufs: Vec::new(),
                    });
                }
                let bufs = self
                    .kinds
                    .iter()
                    .map(|k| match u.buffers.remove(k) {
                        None if max_step > 0 => Err(Error::missing(format!("{k} state for unit {}", v.unit_name), format!("the optimizer is at step {max_step} (loaded from a checkpoint without it?)"))),
                        None => Ok(Tensor::zeros(
                            v.layout.shard_numel,
                            self.dtype,
                            v.param.device(),
                        )?),
                        Some(b) if b.len() != v.layout.shard_numel => {
                            Err(Error::InvalidArgument(format!(
                                "optimizer state {k} of unit {} has {} elements, its shard {}",
                                v.unit_name,
                                b.len(),
                                v.layout.shard_numel
                            )))
                        }
                        Some(b) => {
                            let n = b.len();
                            // f32 → bf16 state rounds to nearest (exact for values a
                            // bf16 state saved).
                            Ok(Tensor::from_vec(b, n, &Device::Cpu)?
                                .to_dtype(self.dtype)?
                                .to_device(v.param.device())?)
                        }
                    })
                    .collect::<Result<_>>()?;
                if let Some(k) = u.buffers.keys().next() {
                    return Err(Error::conflict(format!("optimizer state of unit {} with a {k} buffer", v.unit_name), "this optimizer", "it does not use that buffer"));
                }
                // A frozen twin whose parameters were stepped keeps their state, unchanged while
                // frozen (see `UnitSlot::bufs`).
                Ok(UnitSlot {
                    frozen_numel: v.frozen.then_some(v.layout.shard_numel),
                    steps: u.steps,
                    group: Vec::new(),
                    bufs,
                })
            })
            .collect()
    }
}

/// The error of a step without any gradient.
pub(super) fn no_gradient() -> Error {
    Error::Misuse {
        call: "optimizer step",
        state: "without any gradient",
        fix: "no parameter received a gradient since the last zero_grad (was gradient sync left \
              off for every micro-batch?); nothing was changed"
            .into(),
    }
}

pub(super) fn any_gradient(model: &FsdpModel) -> bool {
    model
        .shards()
        .any(|v| v.grad.is_some() && v.grad_present.iter().any(|&p| p))
}

/// Calls `f(param range of the shard, param index)` for every parameter that has a gradient:
/// once for the whole shard (index `None`) when every parameter has one and `same(i, j)` holds
/// for all of them, else once per piece of a present parameter in this rank's shard. Then
/// returns the indices of the present parameters (the ones whose counts advance).
pub(super) fn for_present(
    v: &ShardView<'_>,
    same: impl Fn(usize, usize) -> bool,
    mut f: impl FnMut(std::ops::Range<usize>, usize) -> Result<()>,
) -> Result<Vec<usize>> {
    let n = v.layout.params.len();
    let present: Vec<usize> = (0..n).filter(|&i| v.grad_present[i]).collect();
    if present.is_empty() {
        return Ok(present);
    }
    if present.len() == n && (1..n).all(|i| same(0, i)) {
        f(0..v.layout.shard_numel, 0)?;
    } else {
        for e in v.layout.shard_table(v.shard_index) {
            if v.grad_present[e.param_index] && e.numel_in_shard > 0 {
                let r = e.offset_in_shard..e.offset_in_shard + e.numel_in_shard;
                f(r, e.param_index)?;
            }
        }
    }
    Ok(present)
}

/// A buffer's values as f32 on the host (bf16 widened exactly).
fn host_f32(b: &Tensor) -> Result<Vec<f32>> {
    if b.dtype() == DType::F32 {
        ops::with_host_f32(b, <[f32]>::to_vec)
    } else {
        Ok(b.to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?
            .to_vec1::<f32>()?)
    }
}

pub(super) fn narrow(t: &Tensor, r: &std::ops::Range<usize>) -> Result<Tensor> {
    if r.start == 0 && r.len() == t.elem_count() {
        Ok(t.clone())
    } else {
        Ok(t.narrow(0, r.start, r.len())?)
    }
}
