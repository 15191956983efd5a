//! Sharded SGD with momentum.

use serde::{Deserialize, Serialize};

use super::groups::{group_mut, group_of, with_default, ParamGroup};
use super::state::{any_gradient, for_present, narrow, no_gradient, ShardState};
use super::{
    check_loadable, BufferKind, OptimizerHyper, OptimizerKind, OptimizerState, ShardedOptimizer,
};
use crate::error::{Phase, Result};
use crate::fsdp::FsdpModel;
use crate::ops::{self, SgdHyper};

const SGD_BUFFERS: &[BufferKind] = &[BufferKind::MomentumBuffer];

/// SGD hyper-parameters (PyTorch's `torch.optim.SGD`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
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

impl SgdConfig {
    fn hyper(&self, first_step: bool) -> SgdHyper {
        SgdHyper {
            lr: self.lr as f32,
            momentum: self.momentum as f32,
            one_minus_dampening: (1.0 - self.dampening) as f32,
            weight_decay: self.weight_decay as f32,
            nesterov: self.nesterov,
            first_step,
        }
    }
}

/// Sharded SGD with momentum, PyTorch's algorithm (`torch.optim.SGD` docs), per parameter:
/// `g ← g + λθ`; `b ← g` at the parameter's first update, else `b ← μ b + (1 − τ) g`;
/// `g ← g + μ b` if Nesterov else `g ← b`; `θ ← θ − lr · g`, in f32 ([`ops::sgd_step`]), with
/// the hyper-parameters of the parameter's group. Momentum buffers: one f32 tensor per unit
/// shard on its device; a buffer value below f32's smallest normal number is stored as 0
/// (`crate::kernels::flush_subnormal`, decision 87).
///
/// Not `Clone`, for the reason given at [`crate::AdamW`].
#[derive(Debug)]
pub struct Sgd {
    groups: Vec<ParamGroup<SgdConfig>>,
    steps_taken: u64,
    state: ShardState,
}

impl Sgd {
    /// An optimizer with one group (every parameter).
    pub fn new(config: SgdConfig) -> Self {
        Self::with_groups(config, Vec::new())
    }

    /// An optimizer with a default group (`default`, index 0) and `groups` (indices 1…), see
    /// [`ParamGroup`].
    pub fn with_groups(default: SgdConfig, groups: Vec<ParamGroup<SgdConfig>>) -> Self {
        Self {
            groups: with_default(default, groups),
            steps_taken: 0,
            state: ShardState::new(SGD_BUFFERS),
        }
    }

    /// The groups (index 0 the default).
    pub fn groups(&self) -> &[ParamGroup<SgdConfig>] {
        &self.groups
    }

    /// The groups, to change hyper-parameters between steps.
    pub fn groups_mut(&mut self) -> &mut [ParamGroup<SgdConfig>] {
        &mut self.groups
    }

    /// The default group's hyper-parameters.
    pub fn config(&self) -> &SgdConfig {
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
        // Momentum buffers exist only when some group uses momentum.
        if self.state.units.is_empty() && self.state.pending.is_none() {
            self.state.kinds = if groups.iter().any(|g| g.config.momentum != 0.0) {
                SGD_BUFFERS
            } else {
                &[]
            };
        }
        self.state.ensure(model, |n| group_of(groups, n))?;
        for (v, u) in model.shards().zip(&mut self.state.units) {
            let Some(g) = v.grad else { continue };
            let (steps, group) = (&u.steps, &u.group);
            let present = for_present(
                &v,
                |i, j| (steps[i] == 0) == (steps[j] == 0) && group[i] == group[j],
                |r, i| {
                    let c = groups[group[i]].config;
                    let buf = match u.bufs.first() {
                        Some(b) if c.momentum != 0.0 => Some(narrow(b, &r)?),
                        _ => None,
                    };
                    ops::sgd_step(
                        &narrow(v.param, &r)?,
                        &narrow(g, &r)?,
                        buf.as_ref(),
                        &c.hyper(steps[i] == 0),
                    )
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

impl ShardedOptimizer for Sgd {
    fn state_bytes(&self) -> usize {
        Self::state_bytes(self)
    }

    fn step(&mut self, model: &mut FsdpModel) -> Result<()> {
        model.in_phase(Phase::Optimizer, Some("FSDP::optimizer_step"), |m| {
            self.step_inner(m)
        })?;
        model.fingerprint_step()
    }

    fn kind(&self) -> OptimizerKind {
        OptimizerKind::Sgd
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
        OptimizerHyper::Sgd(self.groups.clone())
    }

    shard_state_access!();

    fn load_state(&mut self, state: OptimizerState) -> Result<()> {
        check_loadable(self.kind(), &self.hyper(), &state.hyper)?;
        let OptimizerHyper::Sgd(groups) = state.hyper else {
            unreachable!("kind checked")
        };
        self.groups = groups;
        self.state.kinds = if self.groups.iter().any(|g| g.config.momentum != 0.0) {
            SGD_BUFFERS
        } else {
            &[]
        };
        self.steps_taken = state.step;
        self.state.import(state.units);
        Ok(())
    }

    fn clear_state(&mut self) {
        self.state.clear();
    }
}
