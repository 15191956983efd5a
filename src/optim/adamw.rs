//! Sharded AdamW.

use candle_core::DType;
use serde::{Deserialize, Serialize};

use super::groups::{group_mut, group_of, with_default, ParamGroup};
use super::state::{any_gradient, for_present, narrow, no_gradient, ShardState};
use super::{
    check_loadable, BufferKind, OptimizerHyper, OptimizerKind, OptimizerState, ShardedOptimizer,
};
use crate::error::{Phase, Result};
use crate::fsdp::fused::mix64;
use crate::fsdp::FsdpModel;
use crate::ops::{self, AdamWHyper};

/// AdamW hyper-parameters (defaults as PyTorch's `torch.optim.AdamW`, except weight decay 0).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
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

const ADAMW_BUFFERS: &[BufferKind] = &[BufferKind::ExpAvg, BufferKind::ExpAvgSq];

/// Sharded AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019),
/// computed as candle-nn's `AdamW` and PyTorch's `torch.optim.AdamW` (docs: "Algorithm"):
/// per parameter, with its own update count `t`,
/// `θ ← θ(1 − lr·λ)`, `m ← β1 m + (1 − β1) g`, `v ← β2 v + (1 − β2) g²`,
/// `θ ← θ − lr · (m / (1 − β1ᵗ)) / (sqrt(v / (1 − β2ᵗ)) + ε)`, all in f32 ([`ops::adamw_step`]),
/// with the hyper-parameters of the parameter's group; a first moment below f32's smallest
/// normal number is stored as 0, and so is such a second moment once the first is 0
/// (`crate::kernels::flush_second_moment`, decision 87: PyTorch keeps such subnormals, at up to
/// 17× the cost). Moments `m`, `v`: one f32 tensor per
/// unit shard on its device (8 bytes per shard element), or bf16 ([`AdamW::with_state_dtype`]:
/// 4 bytes, the update still computed in f32).
///
/// Not `Clone`: a clone would share the moment tensors, which steps update in place.
#[derive(Debug)]
pub struct AdamW {
    groups: Vec<ParamGroup<AdamWConfig>>,
    steps_taken: u64,
    state: ShardState,
}

impl AdamW {
    /// An optimizer with one group (every parameter); state is allocated at the first step.
    pub fn new(config: AdamWConfig) -> Self {
        Self::with_groups(config, Vec::new())
    }

    /// An optimizer with a default group (`default`, index 0) and `groups` (indices 1…), see
    /// [`ParamGroup`].
    pub fn with_groups(default: AdamWConfig, groups: Vec<ParamGroup<AdamWConfig>>) -> Self {
        Self {
            groups: with_default(default, groups),
            steps_taken: 0,
            state: ShardState::new(ADAMW_BUFFERS),
        }
    }

    /// The groups (index 0 the default).
    pub fn groups(&self) -> &[ParamGroup<AdamWConfig>] {
        &self.groups
    }

    /// The groups, to change hyper-parameters between steps.
    pub fn groups_mut(&mut self) -> &mut [ParamGroup<AdamWConfig>] {
        &mut self.groups
    }

    /// Keeps both moments in `dtype`: f32 (the default) or bf16, which halves the optimizer
    /// state (4 bytes a shard element instead of 8). In bf16 each step reads the moments into
    /// f32, computes the update exactly as in f32, and rounds the new moments once,
    /// stochastically ([`ops::adamw_step_bf16_state`] says why); the random bits are a hash of
    /// the unit, the parameter's step count and the element's index in the flat parameter, so
    /// a resumed run continues bit for bit. A storage choice, not a hyper-parameter: a
    /// checkpoint holds the moments' values (as f32) and loads into either setting (f32 → bf16
    /// rounds to nearest; bf16 → f32 is exact). CPU only (a GPU step with bf16 state is an
    /// error naming it).
    ///
    /// Errors: a dtype other than f32 or bf16; state already allocated in another dtype (call
    /// before the first step or load).
    pub fn with_state_dtype(mut self, dtype: DType) -> Result<Self> {
        if !matches!(dtype, DType::F32 | DType::BF16) {
            return Err(crate::Error::dtype(
                "AdamW state dtype",
                "f32 or bf16",
                dtype,
            ));
        }
        if !self.state.units.is_empty() && self.state.dtype != dtype {
            return Err(crate::Error::conflict(
                "AdamW state dtype",
                "a state already allocated",
                "set it before the first step",
            ));
        }
        self.state.dtype = dtype;
        Ok(self)
    }

    /// The moments' dtype (f32 or bf16).
    pub fn state_dtype(&self) -> DType {
        self.state.dtype
    }

    /// Optimizer-state bytes per trainable shard element: 8 (two f32 moments) or 4 (bf16),
    /// what [`crate::fsdp::MemoryBudget::optimizer_bytes_per_element`] takes.
    pub fn state_bytes_per_element(&self) -> usize {
        2 * self.state.dtype.size_in_bytes()
    }

    /// The default group's hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.groups[0].config
    }

    /// Bytes of optimizer state held by this rank.
    pub fn state_bytes(&self) -> usize {
        self.state.bytes()
    }

    fn step_inner(&mut self, model: &FsdpModel) -> Result<()> {
        if !any_gradient(model) {
            return Err(no_gradient());
        }
        let groups = &self.groups;
        self.state.ensure(model, |n| group_of(groups, n))?;
        let bf16 = self.state.dtype == DType::BF16;
        for (v, u) in model.shards().zip(&mut self.state.units) {
            let Some(g) = v.grad else { continue };
            let (steps, group) = (&u.steps, &u.group);
            let present = for_present(
                &v,
                |i, j| steps[i] == steps[j] && group[i] == group[j],
                |r, i| {
                    let t = steps[i] + 1;
                    let h = groups[group[i]].config.hyper(t);
                    let (p, gr) = (narrow(v.param, &r)?, narrow(g, &r)?);
                    let (m, s) = (narrow(&u.bufs[0], &r)?, narrow(&u.bufs[1], &r)?);
                    if bf16 {
                        // The element's index in the flat parameter: the same bits at any
                        // world size.
                        let seed = mix64(mix64(v.unit_index as u64) ^ t);
                        let offset = (v.shard_index * v.layout.shard_numel + r.start) as u64;
                        ops::adamw_step_bf16_state(&p, &gr, &m, &s, &h, seed, offset)
                    } else {
                        ops::adamw_step(&p, &gr, &m, &s, &h)
                    }
                    .map_err(|e| e.in_step(Some(v.unit_name), Phase::Optimizer, model.step()))
                },
            )?;
            for i in present {
                u.steps[i] += 1;
            }
        }
        self.steps_taken += 1;
        Ok(())
    }
}

impl ShardedOptimizer for AdamW {
    fn state_bytes(&self) -> usize {
        Self::state_bytes(self)
    }

    fn state_dtype(&self) -> DType {
        self.state.dtype
    }

    fn step(&mut self, model: &mut FsdpModel) -> Result<()> {
        model.in_phase(Phase::Optimizer, Some("FSDP::optimizer_step"), |m| {
            self.step_inner(m)
        })?;
        model.fingerprint_step()
    }

    fn kind(&self) -> OptimizerKind {
        OptimizerKind::AdamW
    }

    fn learning_rate(&self) -> f64 {
        self.groups[0].config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.groups.iter_mut().for_each(|g| g.config.lr = lr);
    }

    fn group_learning_rates(&self) -> Vec<f64> {
        self.groups.iter().map(|g| g.config.lr).collect()
    }

    fn set_group_learning_rate(&mut self, group: usize, lr: f64) -> Result<()> {
        group_mut(&mut self.groups, group)?.config.lr = lr;
        Ok(())
    }

    fn hyper(&self) -> OptimizerHyper {
        OptimizerHyper::AdamW(self.groups.clone())
    }

    shard_state_access!();

    fn load_state(&mut self, state: OptimizerState) -> Result<()> {
        check_loadable(self.kind(), &self.hyper(), &state.hyper)?;
        let OptimizerHyper::AdamW(groups) = state.hyper else {
            unreachable!("kind checked")
        };
        self.groups = groups;
        self.steps_taken = state.step;
        self.state.import(state.units);
        Ok(())
    }

    fn clear_state(&mut self) {
        self.state.clear();
    }
}
