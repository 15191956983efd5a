//! Sharded optimizers: each rank steps only its f32 master shards with its reduced gradient
//! shards, and keeps optimizer state for those shards alone (ZeRO stage 1+).
//!
//! State is device-resident: one f32 tensor per unit shard and kind (`exp_avg`, `exp_avg_sq`,
//! `momentum_buffer`) on the shard's device, allocated at the first step and updated in place,
//! with the parameter shard, by one kernel of [`crate::ops`] per unit. A step sees the model only
//! through its accessor ([`FsdpModel::shards`]). Host copies are made only for checkpoints
//! ([`OptimizerState`]).
//!
//! Padding and alignment gaps of a shard have zero parameter and zero gradient, so they stay zero
//! under both updates below; stepping the whole shard therefore equals stepping each parameter.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Phase, Result};
use crate::fsdp::FsdpModel;
use crate::ops::{self, AdamWHyper, SgdHyper};
use crate::trace::SpanKind;

/// An optimizer's local state as host copies, for checkpoints: its step count and named f32
/// buffers (one per unit shard and kind, e.g. `exp_avg.3` for unit 3).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OptimizerState {
    /// Steps taken.
    pub step: u64,
    /// Named buffers, each the length of its unit's shard.
    pub buffers: BTreeMap<String, Vec<f32>>,
}

/// Copies `bufs` to the host as `<kind>.<unit>` entries of `out`.
fn export(kind: &str, bufs: &[Tensor], out: &mut BTreeMap<String, Vec<f32>>) -> Result<()> {
    for (i, b) in bufs.iter().enumerate() {
        out.insert(
            format!("{kind}.{i}"),
            ops::with_host_f32(b, <[f32]>::to_vec)?,
        );
    }
    Ok(())
}

/// Takes the `<kind>.0`, `<kind>.1`, … entries of `state` as CPU tensors (moved, not copied);
/// the next step moves them to the shards' device and checks their lengths.
fn import(kind: &str, state: &mut OptimizerState) -> Result<Vec<Tensor>> {
    let mut out = Vec::new();
    while let Some(b) = state.buffers.remove(&format!("{kind}.{}", out.len())) {
        let n = b.len();
        out.push(Tensor::from_vec(b, n, &Device::Cpu)?);
    }
    Ok(out)
}

/// An optimizer over the local shards of an [`FsdpModel`].
pub trait ShardedOptimizer {
    /// One update of every shard that has a gradient (shards without one are skipped, as PyTorch
    /// skips parameters whose `.grad` is `None`), in place on the shards' device. Local: no
    /// communication. Reads the model through [`FsdpModel::shards`] only.
    fn step(&mut self, model: &mut FsdpModel) -> Result<()>;
    /// Current learning rate.
    fn learning_rate(&self) -> f64;
    /// Sets the learning rate (for schedulers).
    fn set_learning_rate(&mut self, lr: f64);
    /// Copies out the local state (step and buffers) to the host.
    ///
    /// Errors: a failed device-to-host copy.
    fn state(&self) -> Result<OptimizerState>;
    /// Replaces the local state. Buffer lengths are checked against the model, and buffers moved
    /// to the shards' device, at the next step.
    ///
    /// Errors: a failed tensor creation.
    fn load_state(&mut self, state: OptimizerState) -> Result<()>;
    /// Bytes of optimizer state held by this rank (f32: 4 bytes an element).
    fn state_bytes(&self) -> usize;
}

/// AdamW hyper-parameters (defaults as PyTorch's `torch.optim.AdamW`, except weight decay 0).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay (0 gives Adam).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

impl AdamWConfig {
    /// The f32 constants of update number `t` (counted from 1), computed in f64 and rounded
    /// once, as candle-nn's `AdamW` does.
    fn hyper(&self, t: u64) -> AdamWHyper {
        AdamWHyper {
            beta1: self.beta1 as f32,
            beta2: self.beta2 as f32,
            one_minus_beta1: (1.0 - self.beta1) as f32,
            one_minus_beta2: (1.0 - self.beta2) as f32,
            bias_correction1: (1.0 / (1.0 - self.beta1.powi(t as i32))) as f32,
            bias_correction2: (1.0 / (1.0 - self.beta2.powi(t as i32))) as f32,
            decay: (1.0 - self.lr * self.weight_decay) as f32,
            lr: self.lr as f32,
            eps: self.eps as f32,
        }
    }
}

/// Sharded AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019),
/// computed exactly as candle-nn's `AdamW` and PyTorch's `torch.optim.AdamW`:
/// `θ ← θ(1 − lr·λ)`, `m ← β1 m + (1 − β1) g`, `v ← β2 v + (1 − β2) g²`,
/// `θ ← θ − lr · (m / (1 − β1ᵗ)) / (sqrt(v / (1 − β2ᵗ)) + ε)`, all in f32 ([`ops::adamw_step`]).
/// Moments `m`, `v`: one f32 tensor per unit shard on its device (8 bytes per shard element).
///
/// Not `Clone`: a clone would share the moment tensors, which steps update in place.
#[derive(Debug)]
pub struct AdamW {
    /// Hyper-parameters.
    pub config: AdamWConfig,
    /// Steps taken (t).
    step: u64,
    /// First moments, one tensor per unit shard (empty until the first step).
    exp_avg: Vec<Tensor>,
    /// Second moments, one tensor per unit shard.
    exp_avg_sq: Vec<Tensor>,
}

impl AdamW {
    /// A new optimizer; state is allocated at the first step.
    pub fn new(config: AdamWConfig) -> Self {
        Self {
            config,
            step: 0,
            exp_avg: Vec::new(),
            exp_avg_sq: Vec::new(),
        }
    }

    /// Bytes of optimizer state held by this rank.
    pub fn state_bytes(&self) -> usize {
        4 * (self.exp_avg.iter().chain(&self.exp_avg_sq))
            .map(Tensor::elem_count)
            .sum::<usize>()
    }
}

/// Allocates zeroed state on the shards' device at the first step; afterwards checks it
/// matches the model's shards and moves loaded (host) state to their device. `kind` and `step`
/// name the buffer and the optimizer step in errors (state missing after step 0 means a
/// checkpoint without it was loaded: silently restarting it would change training).
fn ensure_state(state: &mut Vec<Tensor>, model: &FsdpModel, kind: &str, step: u64) -> Result<()> {
    if state.is_empty() && step > 0 {
        return Err(Error::InvalidArgument(format!(
            "optimizer at step {step} has no {kind} state (loaded from a checkpoint without it?)"
        )));
    }
    if state.is_empty() {
        *state = model
            .shards()
            .map(|v| {
                Ok(Tensor::zeros(
                    v.layout.shard_numel,
                    DType::F32,
                    v.param.device(),
                )?)
            })
            .collect::<Result<_>>()?;
    }
    for (v, s) in model.shards().zip(state.iter_mut()) {
        if s.elem_count() != v.layout.shard_numel {
            return Err(Error::InvalidArgument(format!(
                "optimizer state {kind} of unit {} has {} elements, its shard {}",
                v.unit_name,
                s.elem_count(),
                v.layout.shard_numel
            )));
        }
        if !s.device().same_device(v.param.device()) {
            *s = s.to_device(v.param.device())?;
        }
    }
    if state.len() != model.shards().len() {
        return Err(Error::InvalidArgument(format!(
            "optimizer state {kind} covers {} units, the model has {}",
            state.len(),
            model.shards().len()
        )));
    }
    Ok(())
}

impl ShardedOptimizer for AdamW {
    fn state_bytes(&self) -> usize {
        Self::state_bytes(self)
    }

    fn step(&mut self, model: &mut FsdpModel) -> Result<()> {
        let _span = model.span(SpanKind::OptimizerStep, || {
            "FSDP::optimizer_step".to_string()
        });
        let ctx = |e: Error| model.at(e, None, Phase::Optimizer);
        ensure_state(&mut self.exp_avg, model, "exp_avg", self.step).map_err(ctx)?;
        ensure_state(&mut self.exp_avg_sq, model, "exp_avg_sq", self.step).map_err(ctx)?;
        self.step += 1;
        let h = self.config.hyper(self.step);
        for ((v, m), s) in model.shards().zip(&self.exp_avg).zip(&self.exp_avg_sq) {
            if let Some(g) = v.grad {
                ops::adamw_step(v.param, g, m, s, &h)
                    .map_err(|e| model.at(e, Some(v.unit_index), Phase::Optimizer))?;
            }
        }
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    fn state(&self) -> Result<OptimizerState> {
        let mut buffers = BTreeMap::new();
        export("exp_avg", &self.exp_avg, &mut buffers)?;
        export("exp_avg_sq", &self.exp_avg_sq, &mut buffers)?;
        Ok(OptimizerState {
            step: self.step,
            buffers,
        })
    }

    fn load_state(&mut self, mut state: OptimizerState) -> Result<()> {
        // Release the old state before the new one is taken over.
        self.exp_avg.clear();
        self.exp_avg_sq.clear();
        self.step = state.step;
        self.exp_avg = import("exp_avg", &mut state)?;
        self.exp_avg_sq = import("exp_avg_sq", &mut state)?;
        Ok(())
    }
}

/// SGD hyper-parameters (PyTorch's `torch.optim.SGD`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 disables the buffer).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        Self {
            lr: 1e-2,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

/// Sharded SGD with momentum, PyTorch's algorithm (`torch.optim.SGD` docs):
/// `g ← g + λθ`; `b ← g` at the first step, else `b ← μ b + (1 − τ) g`; `g ← g + μ b` if
/// Nesterov else `g ← b`; `θ ← θ − lr · g`, in f32 ([`ops::sgd_step`]). Momentum buffers: one
/// f32 tensor per unit shard on its device, only with momentum ≠ 0.
///
/// Not `Clone`, for the reason given at [`AdamW`].
#[derive(Debug)]
pub struct Sgd {
    /// Hyper-parameters.
    pub config: SgdConfig,
    /// Momentum buffers, one per unit shard (empty until the first step with momentum).
    momentum_buffer: Vec<Tensor>,
    /// Steps taken.
    step: u64,
}

impl Sgd {
    /// A new optimizer.
    pub fn new(config: SgdConfig) -> Self {
        Self {
            config,
            momentum_buffer: Vec::new(),
            step: 0,
        }
    }

    /// Bytes of optimizer state held by this rank.
    pub fn state_bytes(&self) -> usize {
        4 * self
            .momentum_buffer
            .iter()
            .map(Tensor::elem_count)
            .sum::<usize>()
    }
}

impl ShardedOptimizer for Sgd {
    fn state_bytes(&self) -> usize {
        Self::state_bytes(self)
    }

    fn step(&mut self, model: &mut FsdpModel) -> Result<()> {
        let _span = model.span(SpanKind::OptimizerStep, || {
            "FSDP::optimizer_step".to_string()
        });
        let c = self.config;
        let h = SgdHyper {
            lr: c.lr as f32,
            momentum: c.momentum as f32,
            one_minus_dampening: (1.0 - c.dampening) as f32,
            weight_decay: c.weight_decay as f32,
            nesterov: c.nesterov,
            first_step: self.step == 0,
        };
        if c.momentum != 0.0 {
            ensure_state(
                &mut self.momentum_buffer,
                model,
                "momentum_buffer",
                self.step,
            )
            .map_err(|e| model.at(e, None, Phase::Optimizer))?;
        }
        self.step += 1;
        for v in model.shards() {
            if let Some(g) = v.grad {
                let buf = self.momentum_buffer.get(v.unit_index);
                ops::sgd_step(v.param, g, buf.filter(|_| h.momentum != 0.0), &h)
                    .map_err(|e| model.at(e, Some(v.unit_index), Phase::Optimizer))?;
            }
        }
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    fn state(&self) -> Result<OptimizerState> {
        let mut buffers = BTreeMap::new();
        export("momentum_buffer", &self.momentum_buffer, &mut buffers)?;
        Ok(OptimizerState {
            step: self.step,
            buffers,
        })
    }

    fn load_state(&mut self, mut state: OptimizerState) -> Result<()> {
        self.momentum_buffer.clear();
        self.step = state.step;
        self.momentum_buffer = import("momentum_buffer", &mut state)?;
        Ok(())
    }
}
