//! Sharded optimizers: each rank steps only its f32 master shards with its reduced gradient
//! shards, and keeps optimizer state for those shards alone (ZeRO stage 1+).
//!
//! Padding and alignment gaps of a shard have zero parameter and zero gradient, so they stay zero
//! under both updates below; stepping the whole shard therefore equals stepping each parameter.

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::fsdp::FsdpModel;

/// An optimizer's local state: its step count and named f32 buffers (one per unit shard and
/// kind, e.g. `exp_avg.3` for unit 3), for checkpoints.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OptimizerState {
    /// Steps taken.
    pub step: u64,
    /// Named buffers, each the length of its unit's shard.
    pub buffers: BTreeMap<String, Vec<f32>>,
}

fn export(kind: &str, bufs: &[Vec<f32>], out: &mut BTreeMap<String, Vec<f32>>) {
    for (i, b) in bufs.iter().enumerate() {
        out.insert(format!("{kind}.{i}"), b.clone());
    }
}

fn import(kind: &str, state: &OptimizerState) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    while let Some(b) = state.buffers.get(&format!("{kind}.{}", out.len())) {
        out.push(b.clone());
    }
    out
}

/// An optimizer over the local shards of an [`FsdpModel`].
pub trait ShardedOptimizer {
    /// One update of every shard that has a gradient (shards without one are skipped, as PyTorch
    /// skips parameters whose `.grad` is `None`). Local: no communication.
    fn step(&mut self, model: &mut FsdpModel) -> Result<()>;
    /// Current learning rate.
    fn learning_rate(&self) -> f64;
    /// Sets the learning rate (for schedulers).
    fn set_learning_rate(&mut self, lr: f64);
    /// Copies out the local state (step and buffers).
    fn state(&self) -> OptimizerState;
    /// Replaces the local state. Buffer lengths are checked against the model at the next step.
    fn load_state(&mut self, state: OptimizerState);
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

/// Sharded AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019),
/// computed exactly as candle-nn's `AdamW` and PyTorch's `torch.optim.AdamW`:
/// `θ ← θ(1 − lr·λ)`, `m ← β1 m + (1 − β1) g`, `v ← β2 v + (1 − β2) g²`,
/// `θ ← θ − lr · (m / (1 − β1ᵗ)) / (sqrt(v / (1 − β2ᵗ)) + ε)`, all in f32.
#[derive(Debug, Clone)]
pub struct AdamW {
    /// Hyper-parameters.
    pub config: AdamWConfig,
    /// Steps taken (t).
    pub step: u64,
    /// First moments, one vector per unit shard (empty until the first step).
    pub exp_avg: Vec<Vec<f32>>,
    /// Second moments, one vector per unit shard.
    pub exp_avg_sq: Vec<Vec<f32>>,
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
        4 * self
            .exp_avg
            .iter()
            .chain(&self.exp_avg_sq)
            .map(Vec::len)
            .sum::<usize>()
    }
}

/// Allocates zeroed state on the first step; afterwards checks it matches the model's shards.
/// `kind` and `step` name the buffer and the optimizer step in errors (state missing after step
/// 0 means a checkpoint without it was loaded: silently restarting it would change training).
fn ensure_state(state: &mut Vec<Vec<f32>>, model: &FsdpModel, kind: &str, step: u64) -> Result<()> {
    if state.is_empty() && step > 0 {
        return Err(Error::InvalidArgument(format!(
            "optimizer at step {step} has no {kind} state (loaded from a checkpoint without it?)"
        )));
    }
    if state.is_empty() {
        *state = model
            .units()
            .iter()
            .map(|u| vec![0.0; u.flat.shard.len()])
            .collect();
    }
    for (u, s) in model.units().iter().zip(state.iter()) {
        if u.flat.shard.len() != s.len() {
            return Err(Error::InvalidArgument(format!(
                "optimizer state of unit {} has {} elements, its shard {}",
                u.spec.name,
                s.len(),
                u.flat.shard.len()
            )));
        }
    }
    if state.len() != model.units().len() {
        return Err(Error::InvalidArgument(format!(
            "optimizer state covers {} units, the model has {}",
            state.len(),
            model.units().len()
        )));
    }
    Ok(())
}

impl ShardedOptimizer for AdamW {
    fn step(&mut self, model: &mut FsdpModel) -> Result<()> {
        let _span = model.span(crate::trace::SpanKind::OptimizerStep, || {
            "FSDP::optimizer_step".to_string()
        });
        ensure_state(&mut self.exp_avg, model, "exp_avg", self.step)?;
        ensure_state(&mut self.exp_avg_sq, model, "exp_avg_sq", self.step)?;
        self.step += 1;
        let c = self.config;
        let (b1, b2) = (c.beta1 as f32, c.beta2 as f32);
        let (one_b1, one_b2) = ((1.0 - c.beta1) as f32, (1.0 - c.beta2) as f32);
        let scale_m = (1.0 / (1.0 - c.beta1.powi(self.step as i32))) as f32;
        let scale_v = (1.0 / (1.0 - c.beta2.powi(self.step as i32))) as f32;
        let decay = (1.0 - c.lr * c.weight_decay) as f32;
        let (lr, eps) = (c.lr as f32, c.eps as f32);
        for ((u, m), v) in model
            .units_mut()
            .iter_mut()
            .zip(&mut self.exp_avg)
            .zip(&mut self.exp_avg_sq)
        {
            let Some(g) = &u.flat.grad else { continue };
            for (((p, &g), m), v) in u.flat.shard.iter_mut().zip(g).zip(m).zip(v) {
                *m = *m * b1 + g * one_b1;
                *v = *v * b2 + (g * g) * one_b2;
                let m_hat = *m * scale_m;
                let v_hat = *v * scale_v;
                *p *= decay;
                *p -= (m_hat / (v_hat.sqrt() + eps)) * lr;
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

    fn state(&self) -> OptimizerState {
        let mut buffers = BTreeMap::new();
        export("exp_avg", &self.exp_avg, &mut buffers);
        export("exp_avg_sq", &self.exp_avg_sq, &mut buffers);
        OptimizerState {
            step: self.step,
            buffers,
        }
    }

    fn load_state(&mut self, state: OptimizerState) {
        self.step = state.step;
        self.exp_avg = import("exp_avg", &state);
        self.exp_avg_sq = import("exp_avg_sq", &state);
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
/// Nesterov else `g ← b`; `θ ← θ − lr · g`.
#[derive(Debug, Clone)]
pub struct Sgd {
    /// Hyper-parameters.
    pub config: SgdConfig,
    /// Momentum buffers, one per unit shard (empty until the first step with momentum).
    pub momentum_buffer: Vec<Vec<f32>>,
    /// Steps taken.
    pub step: u64,
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
}

impl ShardedOptimizer for Sgd {
    fn step(&mut self, model: &mut FsdpModel) -> Result<()> {
        let _span = model.span(crate::trace::SpanKind::OptimizerStep, || {
            "FSDP::optimizer_step".to_string()
        });
        let c = self.config;
        let first = self.step == 0;
        if c.momentum != 0.0 {
            ensure_state(
                &mut self.momentum_buffer,
                model,
                "momentum_buffer",
                self.step,
            )?;
        }
        self.step += 1;
        let (lr, mu, damp, wd) = (
            c.lr as f32,
            c.momentum as f32,
            (1.0 - c.dampening) as f32,
            c.weight_decay as f32,
        );
        for (i, u) in model.units_mut().iter_mut().enumerate() {
            let Some(grad) = &u.flat.grad else { continue };
            for (j, (p, &g)) in u.flat.shard.iter_mut().zip(grad).enumerate() {
                let mut d = g;
                if wd != 0.0 {
                    d += wd * *p;
                }
                if mu != 0.0 {
                    let b = &mut self.momentum_buffer[i][j];
                    *b = if first { d } else { mu * *b + damp * d };
                    d = if c.nesterov { d + mu * *b } else { *b };
                }
                *p -= lr * d;
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

    fn state(&self) -> OptimizerState {
        let mut buffers = BTreeMap::new();
        export("momentum_buffer", &self.momentum_buffer, &mut buffers);
        OptimizerState {
            step: self.step,
            buffers,
        }
    }

    fn load_state(&mut self, state: OptimizerState) {
        self.step = state.step;
        self.momentum_buffer = import("momentum_buffer", &state);
    }
}
