//! Sharded dynamic loss scaling for f16 training (PyTorch's `ShardedGradScaler` /
//! `torch.amp.GradScaler` algorithm, Micikevicius et al., "Mixed Precision Training", 2018).
//!
//! Per step: the loss is multiplied by `scale` before backward; [`ShardedGradScaler::unscale`]
//! divides every gradient shard by `scale` and looks for inf/NaN; the finding is all-reduced (max)
//! so every rank agrees; [`ShardedGradScaler::step`] skips the optimizer step when any rank found
//! one, and its scale update halves the scale after a skipped step or doubles it
//! after `growth_interval` consecutive clean steps.

use candle_core::Tensor;

use crate::comm::{ProcessGroup, ProcessGroupExt, ReduceOp};
use crate::error::{Error, Phase, Result};
use crate::fsdp::FsdpModel;
use crate::ops;
use crate::optim::ShardedOptimizer;

/// Max all-reduce of one f32 across the group (the scaler's one collective: the inf/NaN flag).
fn all_reduce_max(pg: &dyn ProcessGroup, v: f32) -> Result<f32> {
    Ok(pg.all_reduce_f32s(vec![v], ReduceOp::Max)?[0])
}

/// Scaler configuration (PyTorch defaults).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GradScalerConfig {
    /// Initial scale; must be a power of two (default 2^16).
    pub init_scale: f32,
    /// Multiplier after `growth_interval` clean steps (default 2).
    pub growth_factor: f32,
    /// Multiplier after a step with inf/NaN (default 0.5).
    pub backoff_factor: f32,
    /// Clean steps between growths (default 2000).
    pub growth_interval: u64,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

/// The scaler's state, for checkpoints and reports.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GradScalerState {
    /// Current scale.
    pub scale: f32,
    /// Clean steps since the last growth or backoff.
    pub growth_tracker: u64,
    /// Steps skipped so far because of inf/NaN.
    pub skipped_steps: u64,
    /// Steps taken so far.
    pub taken_steps: u64,
}

/// Dynamic loss scaler over sharded gradients (see the module docs).
#[derive(Debug, Clone)]
pub struct ShardedGradScaler {
    config: GradScalerConfig,
    state: GradScalerState,
    /// `Some(found_inf)` once this step's gradients were unscaled.
    unscaled: Option<bool>,
}

impl ShardedGradScaler {
    /// A scaler; errors if `init_scale` is not a positive power of two or a factor is not
    /// positive.
    pub fn new(config: GradScalerConfig) -> Result<Self> {
        let s = config.init_scale;
        if !(s > 0.0 && s.is_finite() && s.log2().fract() == 0.0) {
            return Err(Error::value(
                "grad scaler init_scale",
                "a positive power of two",
                s,
            ));
        }
        if config.growth_factor <= 1.0 || !(0.0..1.0).contains(&config.backoff_factor) {
            return Err(Error::value(
                "grad scaler growth_factor and backoff_factor",
                "> 1 and in (0, 1)",
                format!("{} and {}", config.growth_factor, config.backoff_factor),
            ));
        }
        Ok(Self {
            config,
            state: GradScalerState {
                scale: s,
                growth_tracker: 0,
                skipped_steps: 0,
                taken_steps: 0,
            },
            unscaled: None,
        })
    }

    /// Current scale.
    pub fn scale(&self) -> f32 {
        self.state.scale
    }

    /// State (scale, growth tracker, skipped and taken steps).
    pub fn state(&self) -> GradScalerState {
        self.state
    }

    /// Restores a state saved with [`ShardedGradScaler::state`].
    pub fn load_state(&mut self, state: GradScalerState) {
        self.state = state;
        self.unscaled = None;
    }

    /// `loss * scale`, in the loss's dtype.
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor> {
        Ok((loss * self.state.scale as f64)?)
    }

    /// Divides every gradient shard by the scale and returns whether any rank found inf/NaN
    /// (a collective: one all-reduce max of one f32). Idempotent within a step. The gradients
    /// are scaled in place on their device ([`crate::ops::scale_and_check_finite_`]) through
    /// [`FsdpModel::shards`]; on a GPU every shard's check sets one device flag
    /// ([`crate::ops::unscale_check_finite_`]), read back once.
    ///
    /// Errors: a collective error; a gradient the kernels cannot update.
    pub fn unscale(&mut self, model: &mut FsdpModel) -> Result<bool> {
        if let Some(found) = self.unscaled {
            return Ok(found);
        }
        let inv = 1.0 / self.state.scale;
        let mut local_inf = false;
        let mut device_flag: Option<Tensor> = None;
        for v in model.shards() {
            if let Some(g) = v.grad {
                if g.device().is_cuda() {
                    if device_flag.is_none() {
                        device_flag = Some(Tensor::zeros(1, candle_core::DType::F32, g.device())?);
                    }
                    let flag = device_flag.as_ref().expect("just set");
                    ops::unscale_check_finite_(g, ops::ScaleFactor::Value(inv), flag)?;
                } else {
                    local_inf |= !ops::scale_and_check_finite_(g, inv)?;
                }
            }
        }
        if let Some(f) = device_flag {
            local_inf |= f.to_vec1::<f32>()?[0] != 0.0;
        }
        let flag = if local_inf { 1.0 } else { 0.0 };
        let found = model.in_phase(Phase::Optimizer, None, |m| {
            all_reduce_max(m.process_group().as_ref(), flag)
        })? > 0.0;
        self.unscaled = Some(found);
        Ok(found)
    }

    /// Unscales (if not done yet) and steps `optim` unless some rank found inf/NaN, then updates
    /// the scale. Returns whether the optimizer stepped. Gradients are left in place; call
    /// `model.zero_grad()` after.
    pub fn step(
        &mut self,
        model: &mut FsdpModel,
        optim: &mut dyn ShardedOptimizer,
    ) -> Result<bool> {
        let found = self.unscale(model)?;
        if !found {
            optim.step(model)?;
        } else {
            // A skipped step is still a step of the run fingerprint (shards unchanged).
            model.fingerprint_step()?;
        }
        self.update(found);
        Ok(!found)
    }

    /// Updates the scale after a step (`found_inf`: the step was skipped).
    fn update(&mut self, found_inf: bool) {
        let s = &mut self.state;
        if found_inf {
            s.scale *= self.config.backoff_factor;
            s.growth_tracker = 0;
            s.skipped_steps += 1;
        } else {
            s.taken_steps += 1;
            s.growth_tracker += 1;
            if s.growth_tracker >= self.config.growth_interval {
                s.scale *= self.config.growth_factor;
                s.growth_tracker = 0;
            }
        }
        self.unscaled = None;
    }
}
