//! Optimizer semantics users bring from `torch.optim` (issue 11): per-parameter state (a
//! parameter without gradient is not stepped; zero is not absent), a step with no gradient at
//! all is an error that changes nothing, parameter groups, learning-rate schedulers, and
//! clipping with any p-norm.

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use candle_core::{Device, Module, Tensor};
use candle_fsdp::clip::{clip_grad_norm_with, total_grad_norm, total_grad_norm_p, ClipOptions};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::ProcessGroup;
use candle_fsdp::optim::glob_match;
use candle_fsdp::unit::UnitSpec;
use candle_fsdp::{
    AdamW, AdamWConfig, FsdpConfig, FsdpModel, LrSchedule, LrScheduler, ParamGroup, Sgd, SgdConfig,
    ShardedOptimizer,
};
use candle_nn::{Linear, VarBuilder};
use common::{batches, to_vec, units};

/// Two expert Linears `a` and `b` in one unit; `b` runs only when the flag is set. `zero_b`:
/// `b`'s output is multiplied by 0 (a gradient of zero, not an absent one).
struct Experts {
    a: Linear,
    b: Linear,
    use_b: Arc<AtomicBool>,
    zero_b: bool,
}

impl Module for Experts {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = self.a.forward(x)?;
        if self.use_b.load(Ordering::SeqCst) {
            let yb = self.b.forward(x)?;
            let yb = if self.zero_b {
                yb.broadcast_mul(&Tensor::zeros(1, yb.dtype(), yb.device())?)?
            } else {
                yb
            };
            y + yb
        } else {
            Ok(y)
        }
    }
}

fn experts_model(
    pg: Arc<dyn ProcessGroup>,
    use_b: Arc<AtomicBool>,
    zero_b: bool,
) -> candle_fsdp::Result<FsdpModel> {
    // Expert b is used only in some steps: the unit says so (DDP's find_unused_parameters).
    FsdpModel::builder(pg, FsdpConfig::default())
        .unit_spec(
            UnitSpec::new("experts", move |vb: VarBuilder| {
                Ok(Experts {
                    a: candle_nn::linear(4, 3, vb.pp("a"))?,
                    b: candle_nn::linear(4, 3, vb.pp("b"))?,
                    use_b: use_b.clone(),
                    zero_b,
                })
            })
            .with_unused_parameters(true),
        )
        .build()
}

/// This rank's elements of parameter `name` (in shard order).
fn param_part(m: &FsdpModel, name: &str, grad: bool) -> Vec<f32> {
    let mut out = Vec::new();
    for v in m.shards() {
        let t = if grad { v.grad.unwrap() } else { v.param };
        let all = to_vec(t);
        for e in v.layout.shard_table(v.shard_index) {
            if v.layout.params[e.param_index].name == name {
                out.extend_from_slice(
                    &all[e.offset_in_shard..e.offset_in_shard + e.numel_in_shard],
                );
            }
        }
    }
    out
}

const PARAMS: [&str; 4] = [
    "experts.a.weight",
    "experts.a.bias",
    "experts.b.weight",
    "experts.b.bias",
];

/// One forward/backward of the experts model on this rank's batch.
fn fwd_bwd(m: &mut FsdpModel, rank: usize) -> candle_fsdp::Result<()> {
    let x = Tensor::arange(0f32, 8.0, &Device::Cpu)?
        .reshape((2, 4))?
        .affine(0.3, -1.0 + rank as f64 * 0.1)?;
    let y = m.forward(&x)?;
    // Weights 1..6 on the outputs: every output element gets a distinct, nonzero gradient.
    let w = Tensor::arange(1f32, 7.0, &Device::Cpu)?.reshape((2, 3))?;
    m.backward(&(y * w)?.sum_all()?)
}

/// The case: world size 2, AdamW lr 0.1. Step 1 uses only `a`, step 2 both. Returns
/// per rank: (b before, b after step 1, b after step 2) for `b.weight` and `b.bias`
/// concatenated, and each parameter's step count.
/// Per rank: `b` before, after step 1, after step 2, and every parameter's step count.
type ExpertsRun = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<u64>);

fn experts_run(weight_decay: f64) -> Vec<ExpertsRun> {
    run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
        let rank = pg.rank();
        let use_b = Arc::new(AtomicBool::new(false));
        let mut m = experts_model(pg, use_b.clone(), false)?;
        let mut opt = AdamW::new(AdamWConfig {
            lr: 0.1,
            weight_decay,
            ..Default::default()
        });
        let b = |m: &FsdpModel| {
            let mut v = param_part(m, "experts.b.weight", false);
            v.extend(param_part(m, "experts.b.bias", false));
            v
        };
        let b0 = b(&m);
        fwd_bwd(&mut m, rank)?;
        // The gradient store tells absent from zero.
        let present = m.shard(0).unwrap().grad_present.to_vec();
        assert_eq!(present, [true, true, false, false]);
        opt.step(&mut m)?;
        m.zero_grad();
        let b1 = b(&m);
        use_b.store(true, Ordering::SeqCst);
        fwd_bwd(&mut m, rank)?;
        opt.step(&mut m)?;
        let b2 = b(&m);
        let steps = opt.state()?.units[0].steps.clone();
        Ok((b0, b1, b2, steps))
    })
    .unwrap()
}

#[test]
fn a_parameter_without_gradient_is_not_stepped_and_gets_its_own_first_adam_step() {
    for wd in [0.0, 0.1] {
        let r = experts_run(wd);
        // b's 15 elements are spread over the ranks (here all on rank 1).
        assert_eq!(r.iter().map(|x| x.0.len()).sum::<usize>(), 15);
        for (rank, (b0, b1, b2, steps)) in r.into_iter().enumerate() {
            // Step 1: b untouched, bit for bit (no weight decay either).
            assert_eq!(b1, b0, "rank {rank}, wd {wd}: b moved without a gradient");
            // Step 2 is b's first Adam step: m̂ = g, v̂ = g², so every element moves by
            // lr · g / (|g| + ε) = ±0.1 (times 1 − lr·wd for the decay).
            for (i, (&before, &after)) in b1.iter().zip(&b2).enumerate() {
                let moved = after - before * (1.0 - 0.1 * wd as f32);
                assert!(
                    (moved.abs() - 0.1).abs() < 1e-6,
                    "rank {rank}, wd {wd}, element {i}: moved by {moved}, expected ±0.1"
                );
            }
            // Per-parameter step counts: a twice, b once (the same on every rank).
            assert_eq!(steps, [2, 2, 1, 1], "rank {rank}");
        }
    }
}

#[test]
fn a_zero_gradient_is_a_gradient_and_one_rank_using_b_makes_b_present_on_all() {
    // b's output times 0: its gradient is exactly zero but present, so it is stepped (weight
    // decay shrinks it by lr·wd = 1 %).
    let r = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let rank = pg.rank();
        let use_b = Arc::new(AtomicBool::new(true));
        let mut m = experts_model(pg, use_b, true)?;
        let mut opt = AdamW::new(AdamWConfig {
            lr: 0.1,
            weight_decay: 0.1,
            ..Default::default()
        });
        let b0 = param_part(&m, "experts.b.weight", false);
        fwd_bwd(&mut m, rank)?;
        assert_eq!(m.shard(0).unwrap().grad_present, [true; 4]);
        opt.step(&mut m)?;
        Ok((b0, param_part(&m, "experts.b.weight", false)))
    })
    .unwrap();
    for (b0, b1) in r {
        for (x, y) in b0.iter().zip(&b1) {
            assert_eq!(*y, x * (1.0f64 - 0.1 * 0.1) as f32);
        }
    }
    // Only rank 0 runs b: the presence is agreed over the ranks, so b is stepped on both.
    let steps = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let rank = pg.rank();
        let use_b = Arc::new(AtomicBool::new(rank == 0));
        let mut m = experts_model(pg, use_b, false)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        fwd_bwd(&mut m, rank)?;
        assert_eq!(m.shard(0).unwrap().grad_present, [true; 4], "rank {rank}");
        opt.step(&mut m)?;
        Ok(opt.state()?.units[0].steps.clone())
    })
    .unwrap();
    assert_eq!(steps, vec![vec![1u64; 4]; 2]);
}

#[test]
fn a_step_without_any_gradient_is_an_error_that_changes_nothing() {
    for sgd in [false, true] {
        let r = run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
            let rank = pg.rank();
            let use_b = Arc::new(AtomicBool::new(true));
            let mut m = experts_model(pg, use_b, false)?;
            let mut opt: Box<dyn ShardedOptimizer> = if sgd {
                Box::new(Sgd::new(SgdConfig {
                    lr: 0.1,
                    momentum: 0.9,
                    ..Default::default()
                }))
            } else {
                Box::new(AdamW::new(AdamWConfig::default()))
            };
            // Sync left off for the only micro-batch: no gradient was produced.
            m.set_requires_gradient_sync(false);
            fwd_bwd(&mut m, rank)?;
            let before: Vec<Vec<f32>> = PARAMS.iter().map(|p| param_part(&m, p, false)).collect();
            let e = opt.step(&mut m).unwrap_err().to_string();
            let after: Vec<Vec<f32>> = PARAMS.iter().map(|p| param_part(&m, p, false)).collect();
            assert_eq!(before, after);
            let st = opt.state()?;
            Ok((e, st.step, st.units.len()))
        })
        .unwrap();
        for (e, step, units) in r {
            assert!(e.contains("optimizer step without any gradient"), "{e}");
            assert_eq!((step, units), (0, 0), "counters unchanged (sgd {sgd})");
        }
    }
}

#[test]
fn sgd_momentum_is_set_up_at_each_parameter_s_first_step() {
    // Dampening 0.5: a parameter's first step sets b ← g (PyTorch), later ones blend
    // b ← μ b + (1 − τ) g. b's first step is the optimizer's second: it must still be b ← g.
    let lr = 0.1f32;
    let r = run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
        let rank = pg.rank();
        let use_b = Arc::new(AtomicBool::new(false));
        let mut m = experts_model(pg, use_b.clone(), false)?;
        let mut opt = Sgd::new(SgdConfig {
            lr: lr as f64,
            momentum: 0.9,
            dampening: 0.5,
            ..Default::default()
        });
        fwd_bwd(&mut m, rank)?;
        opt.step(&mut m)?;
        m.zero_grad();
        use_b.store(true, Ordering::SeqCst);
        fwd_bwd(&mut m, rank)?;
        let before = param_part(&m, "experts.b.weight", false);
        let g = param_part(&m, "experts.b.weight", true);
        opt.step(&mut m)?;
        Ok((before, g, param_part(&m, "experts.b.weight", false)))
    })
    .unwrap();
    for (before, g, after) in r {
        for i in 0..before.len() {
            assert_eq!(after[i], before[i] - lr * g[i], "element {i}");
        }
    }
}

#[test]
fn glob_patterns_match_whole_names() {
    assert!(glob_match("*.bias", "fc1.bias"));
    assert!(!glob_match("*.bias", "fc1.bias_extra"));
    assert!(glob_match("*norm*.weight", "block.norm1.weight"));
    assert!(!glob_match("*norm*.weight", "block.norm1.bias"));
    assert!(glob_match("fc?.weight", "fc2.weight"));
    assert!(!glob_match("fc?.weight", "fc12.weight"));
    assert!(glob_match("*", ""));
}

/// Trains `units()` one step at world size 2 with `opt` and returns every parameter's values
/// on rank 0 and 1, by name.
fn one_step(make: fn() -> AdamW) -> Vec<Vec<(String, Vec<f32>)>> {
    let data = batches(1, 8, 5);
    run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
        let mut m = FsdpModel::builder(pg, FsdpConfig::default())
            .units(units())
            .build()?;
        let mut opt = make();
        let (x, y) = &data[0];
        let n = x.dim(0)? / 2;
        let rank = m.process_group().rank();
        let logits = m.forward(&x.narrow(0, rank * n, n)?)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &y.narrow(0, rank * n, n)?)?;
        m.backward(&loss)?;
        opt.step(&mut m)?;
        let names: Vec<String> = m
            .shards()
            .flat_map(|v| {
                v.layout
                    .params
                    .iter()
                    .map(|p| p.name.clone())
                    .collect::<Vec<_>>()
            })
            .collect();
        Ok(names
            .into_iter()
            .map(|n| {
                let v = param_part(&m, &n, false);
                (n, v)
            })
            .collect())
    })
    .unwrap()
}

#[test]
fn parameter_groups_give_biases_their_own_weight_decay_and_lr() {
    let grouped = one_step(|| {
        let base = AdamWConfig {
            lr: 0.05,
            weight_decay: 0.1,
            ..Default::default()
        };
        AdamW::with_groups(
            base,
            vec![
                ParamGroup::new(
                    "no_decay",
                    ["*.bias"],
                    AdamWConfig {
                        weight_decay: 0.0,
                        ..base
                    },
                ),
                ParamGroup::new("slow", ["scale.*"], AdamWConfig { lr: 0.01, ..base }),
            ],
        )
    });
    let decayed = one_step(|| {
        AdamW::new(AdamWConfig {
            lr: 0.05,
            weight_decay: 0.1,
            ..Default::default()
        })
    });
    let plain = one_step(|| {
        AdamW::new(AdamWConfig {
            lr: 0.05,
            weight_decay: 0.0,
            ..Default::default()
        })
    });
    let slow = one_step(|| {
        AdamW::new(AdamWConfig {
            lr: 0.01,
            weight_decay: 0.1,
            ..Default::default()
        })
    });
    let mut biases = 0;
    for r in 0..2 {
        for (i, (name, v)) in grouped[r].iter().enumerate() {
            let expect = if name.ends_with(".bias") {
                biases += 1;
                &plain[r][i]
            } else if name.starts_with("scale.") {
                &slow[r][i]
            } else {
                &decayed[r][i]
            };
            assert_eq!(&expect.0, name);
            assert_eq!(v, &expect.1, "rank {r}: {name}");
        }
    }
    assert!(biases >= 3);
    // The groups differ where they should (the test would pass vacuously otherwise).
    assert_ne!(plain[0], decayed[0]);
}

#[test]
fn lr_schedulers_follow_the_torch_formulas_per_group() {
    let mut opt = AdamW::with_groups(
        AdamWConfig {
            lr: 0.01,
            ..Default::default()
        },
        vec![ParamGroup::new(
            "bias",
            ["*.bias"],
            AdamWConfig {
                lr: 0.02,
                ..Default::default()
            },
        )],
    );
    // Linear decay to a quarter over 3 steps (LinearLR start 1, end 0.25).
    let mut s = LrScheduler::new(
        LrSchedule::Linear {
            start_factor: 1.0,
            end_factor: 0.25,
            total_steps: 3,
        },
        &mut opt,
    )
    .unwrap();
    let mut lrs = vec![opt.group_learning_rates()];
    for _ in 0..4 {
        s.step(&mut opt).unwrap();
        lrs.push(opt.group_learning_rates());
    }
    assert_eq!(
        lrs,
        [
            [0.01, 0.02],
            [0.0075, 0.015],
            [0.005, 0.01],
            [0.0025, 0.005],
            [0.0025, 0.005]
        ]
    );
    // Warm-up from 0.1 over 4 steps, then constant.
    let w = LrSchedule::linear_warmup(0.1, 4);
    let f: Vec<f64> = (0..6).map(|t| w.factor(t)).collect();
    for (a, b) in f.iter().zip([0.1, 0.325, 0.55, 0.775, 1.0, 1.0]) {
        assert!((a - b).abs() < 1e-12, "{f:?}");
    }
    // Cosine (CosineAnnealingLR): 1 → min over T, half-way at T/2.
    let c = LrSchedule::Cosine {
        total_steps: 10,
        min_factor: 0.1,
    };
    assert_eq!(c.factor(0), 1.0);
    assert!((c.factor(5) - 0.55).abs() < 1e-12);
    assert!((c.factor(10) - 0.1).abs() < 1e-12 && c.factor(11) == c.factor(10));
    assert_eq!(LrSchedule::Constant.factor(123), 1.0);
    // A schedule of 0 steps is refused.
    let e = LrScheduler::new(
        LrSchedule::Cosine {
            total_steps: 0,
            min_factor: 0.0,
        },
        &mut opt,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("must be one with total_steps at least 1") && e.contains("total_steps: 0"),
        "{e}"
    );
}

#[test]
fn clipping_supports_the_inf_norm_and_any_p_and_refuses_partial_or_nonfinite() {
    let data = batches(1, 8, 9);
    let r = run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
        let rank = pg.rank();
        let mut m = FsdpModel::builder(pg, FsdpConfig::default())
            .units(units())
            .build()?;
        let (x, y) = &data[0];
        let go = |m: &mut FsdpModel| -> candle_fsdp::Result<()> {
            let logits = m.forward(&x.narrow(0, rank * 4, 4)?)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &y.narrow(0, rank * 4, 4)?)?;
            m.backward(&loss)
        };
        // While sync is off the gradient is partial: an error, not 0.0.
        m.set_requires_gradient_sync(false);
        go(&mut m)?;
        let partial = clip_grad_norm_with(&mut m, 1.0, ClipOptions::default())
            .unwrap_err()
            .to_string();
        m.set_requires_gradient_sync(true);
        go(&mut m)?;
        let grads: Vec<f32> = m
            .shards()
            .flat_map(|v| v.grad.map(to_vec).unwrap_or_default())
            .collect();
        let norms = (
            total_grad_norm_p(&m, f64::INFINITY)?,
            total_grad_norm_p(&m, 3.0)?,
            total_grad_norm(&m)?,
            total_grad_norm_p(&m, 1.0)?,
        );
        // Clip to half the max-norm.
        let max = norms.0 / 2.0;
        let opts = ClipOptions {
            norm_type: f64::INFINITY,
            error_if_nonfinite: true,
        };
        let returned = clip_grad_norm_with(&mut m, max, opts)?;
        let after = total_grad_norm_p(&m, f64::INFINITY)?;
        // A NaN gradient: error_if_nonfinite refuses and leaves the gradients alone.
        let mut bad = to_vec(m.shard(1).unwrap().grad.unwrap());
        bad[0] = f32::NAN;
        let n = bad.len();
        m.set_unit_grad(1, Some(Tensor::from_vec(bad, n, &Device::Cpu)?))?;
        let before: Vec<f32> = m
            .shards()
            .flat_map(|v| v.grad.map(to_vec).unwrap_or_default())
            .collect();
        let nonfinite = clip_grad_norm_with(&mut m, 1.0, opts)
            .unwrap_err()
            .to_string();
        let kept: Vec<f32> = m
            .shards()
            .flat_map(|v| v.grad.map(to_vec).unwrap_or_default())
            .collect();
        assert_eq!(
            before.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            kept.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        Ok((partial, grads, norms, returned, after, max, nonfinite))
    })
    .unwrap();
    let all: Vec<f32> = r.iter().flat_map(|x| x.1.clone()).collect();
    let inf = all.iter().fold(0f32, |m, v| m.max(v.abs()));
    let p = |p: f64| {
        all.iter()
            .map(|v| f64::from(v.abs()).powf(p))
            .sum::<f64>()
            .powf(1.0 / p)
    };
    for (partial, _, norms, returned, after, max, nonfinite) in &r {
        assert!(partial.contains("gradient sync is off"), "{partial}");
        assert_eq!(norms.0, inf);
        assert!(
            (f64::from(norms.1) - p(3.0)).abs() < 1e-5 * p(3.0),
            "{norms:?}"
        );
        assert!(
            (f64::from(norms.2) - p(2.0)).abs() < 1e-5 * p(2.0),
            "{norms:?}"
        );
        assert!(
            (f64::from(norms.3) - p(1.0)).abs() < 1e-5 * p(1.0),
            "{norms:?}"
        );
        assert!(norms.0 < norms.1 && norms.1 < norms.2 && norms.2 < norms.3);
        assert_eq!(*returned, norms.0);
        assert!((after - max).abs() <= 1e-4 * max, "{after} vs {max}");
        assert!(
            nonfinite.contains("non-finite") && nonfinite.contains("inf-norm"),
            "{nonfinite}"
        );
    }
}

// ---- A parameter trained, frozen across a save/load, then unfrozen (issue 20, item 2) ------

/// The rule: the optimizer state of a frozen parameter (moments / momentum buffer and step
/// count) is kept unchanged while it is frozen, saved and loaded with it at any world size, and
/// the parameter resumes as a continuation when unfrozen (PyTorch keeps per-parameter state).
mod freeze_cycle {
    use super::*;
    use candle_core::DType;
    use candle_fsdp::checkpoint::{load_sharded, save_sharded, TrainState};
    use candle_fsdp::init::{seeded_var_builder, varmap_values};
    use candle_nn::VarMap;
    use std::collections::HashMap;

    const SEED: u64 = 2020;
    const ROWS: usize = 6;

    /// (world size, frozen unit, steps): the four stages.
    const STAGES: [(usize, Option<&str>, std::ops::Range<usize>); 4] = [
        (2, Some("fc1"), 0..2),
        (3, None, 2..3),
        (2, Some("fc2"), 3..4),
        (2, None, 4..5),
    ];

    fn cycle_units() -> Vec<UnitSpec> {
        vec![
            UnitSpec::new("fc1", |vb| {
                Ok(candle_nn::seq()
                    .add(candle_nn::linear(6, 6, vb)?)
                    .add(candle_nn::Activation::Relu))
            }),
            UnitSpec::new("fc2", |vb| {
                Ok(candle_nn::seq()
                    .add(candle_nn::linear(6, 6, vb)?)
                    .add(candle_nn::Activation::Sigmoid))
            }),
            UnitSpec::new("head", |vb| candle_nn::linear(6, 3, vb)),
        ]
    }

    fn batch(s: usize) -> (Tensor, Tensor) {
        let x: Vec<f32> = (0..ROWS * 6)
            .map(|i| ((i * 13 + s * 7) % 17) as f32 / 8.0 - 1.0)
            .collect();
        let y: Vec<u32> = (0..ROWS).map(|i| ((i * 2 + s) % 3) as u32).collect();
        (
            Tensor::from_vec(x, (ROWS, 6), &Device::Cpu).unwrap(),
            Tensor::from_vec(y, ROWS, &Device::Cpu).unwrap(),
        )
    }

    #[derive(Clone, Copy, Debug)]
    enum Which {
        AdamW,
        SgdMomentum,
    }

    const LR: f64 = 0.02;

    fn optimizer(which: Which) -> Box<dyn ShardedOptimizer> {
        match which {
            Which::AdamW => Box::new(AdamW::new(AdamWConfig {
                lr: LR,
                weight_decay: 0.1,
                ..Default::default()
            })),
            Which::SgdMomentum => Box::new(Sgd::new(SgdConfig {
                lr: LR,
                momentum: 0.9,
                ..Default::default()
            })),
        }
    }

    /// Per-parameter optimizer state of the reference (torch.optim semantics).
    #[derive(Default)]
    struct ParamState {
        steps: u64,
        a: Vec<f64>,
        b: Vec<f64>,
    }

    /// The same five steps in one process with plain Candle and no save/load: a frozen
    /// parameter is neither updated nor has its state touched.
    fn reference(which: Which) -> HashMap<String, Vec<f32>> {
        let varmap = VarMap::new();
        let vb = seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu);
        let model: Vec<_> = cycle_units()
            .iter()
            .map(|u| (u.ctor)(vb.pp(&u.name)).unwrap())
            .collect();
        let vars: HashMap<String, candle_core::Var> =
            varmap.data().lock().unwrap().clone().into_iter().collect();
        let mut state: HashMap<String, ParamState> = HashMap::new();
        for (_, frozen, steps) in STAGES {
            for s in steps {
                let (x, y) = batch(s);
                let mut h = x;
                for m in &model {
                    h = m.forward1(&h, true).unwrap();
                }
                let loss = candle_nn::loss::cross_entropy(&h, &y).unwrap();
                let grads = loss.backward().unwrap();
                for (name, var) in &vars {
                    if frozen.is_some_and(|f| name.starts_with(&format!("{f}."))) {
                        continue;
                    }
                    let g: Vec<f64> = to_vec(grads.get(var).unwrap())
                        .into_iter()
                        .map(f64::from)
                        .collect();
                    let mut p: Vec<f64> =
                        to_vec(var.as_tensor()).into_iter().map(f64::from).collect();
                    let st = state.entry(name.clone()).or_default();
                    if st.a.is_empty() {
                        st.a = vec![0.0; g.len()];
                        st.b = vec![0.0; g.len()];
                    }
                    st.steps += 1;
                    let t = st.steps as i32;
                    for i in 0..p.len() {
                        match which {
                            Which::AdamW => {
                                let (b1, b2) = (0.9, 0.999);
                                p[i] *= 1.0 - LR * 0.1;
                                st.a[i] = b1 * st.a[i] + (1.0 - b1) * g[i];
                                st.b[i] = b2 * st.b[i] + (1.0 - b2) * g[i] * g[i];
                                let mh = st.a[i] / (1.0 - b1.powi(t));
                                let vh = st.b[i] / (1.0 - b2.powi(t));
                                p[i] -= LR * mh / (vh.sqrt() + 1e-8);
                            }
                            Which::SgdMomentum => {
                                st.a[i] = if t == 1 { g[i] } else { 0.9 * st.a[i] + g[i] };
                                p[i] -= LR * st.a[i];
                            }
                        }
                    }
                    let p: Vec<f32> = p.into_iter().map(|v| v as f32).collect();
                    let n = p.len();
                    var.set(
                        &Tensor::from_vec(p, n, &Device::Cpu)
                            .unwrap()
                            .reshape(var.shape())
                            .unwrap(),
                    )
                    .unwrap();
                }
            }
        }
        varmap_values(&varmap).unwrap()
    }

    /// The four stages with FSDP, each in a fresh process group at its world size, loading
    /// the previous stage's checkpoint and saving its own. Returns the final parameters and,
    /// per stage, the step counts of the state saved (by parameter name).
    fn staged(which: Which, root: &std::path::Path) -> HashMap<String, Vec<f32>> {
        let mut last_dir: Option<std::path::PathBuf> = None;
        let mut last = HashMap::new();
        for (stage, (ws, frozen, steps)) in STAGES.into_iter().enumerate() {
            let from = last_dir.clone();
            let out = run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
                let rank = pg.rank();
                let mut b = FsdpModel::builder(
                    pg.clone(),
                    FsdpConfig {
                        seed: SEED,
                        ..Default::default()
                    },
                );
                for u in cycle_units() {
                    b = b.unit_spec(u);
                }
                if let Some(f) = frozen {
                    b = b.freeze([format!("{f}.*")]);
                }
                let mut model = b.build()?;
                let mut opt = optimizer(which);
                if let Some(dir) = &from {
                    load_sharded(dir, &mut model, opt.as_mut())?;
                }
                let per = ROWS / ws;
                for s in steps.clone() {
                    let (x, y) = batch(s);
                    let logits = model.forward(&x.narrow(0, rank * per, per)?)?;
                    let loss =
                        candle_nn::loss::cross_entropy(&logits, &y.narrow(0, rank * per, per)?)?;
                    model.backward(&loss)?;
                    opt.step(&mut model)?;
                    model.zero_grad();
                }
                let state = TrainState {
                    step: steps.end as u64,
                    ..Default::default()
                };
                let dir = save_sharded(root, &model, opt.as_ref(), &state, 0)?;
                let full = model
                    .gather_full_params(false)?
                    .expect("every rank gathers");
                Ok((
                    dir,
                    full.into_iter()
                        .map(|(k, t)| (k, to_vec(&t)))
                        .collect::<HashMap<_, _>>(),
                ))
            })
            .unwrap_or_else(|e| panic!("{which:?} stage {}: {e}", stage + 1));
            let (dir, params) = out.into_iter().next().unwrap();
            if let Some(f) = frozen {
                // Frozen: unchanged by the stage, bit for bit.
                for (name, v) in &params {
                    if name.starts_with(&format!("{f}.")) && !last.is_empty() {
                        assert_eq!(
                            v,
                            &last[name],
                            "{which:?} stage {}: {name} moved",
                            stage + 1
                        );
                    }
                }
            }
            last = params;
            last_dir = Some(dir);
        }
        last
    }

    #[test]
    fn trained_frozen_unfrozen_across_save_load_and_world_sizes_resumes_as_a_continuation() {
        for which in [Which::AdamW, Which::SgdMomentum] {
            let root = common::tmpdir(&format!("freeze-cycle-{which:?}"));
            let want = reference(which);
            let got = staged(which, &root);
            let mut names: Vec<_> = want.keys().cloned().collect();
            names.sort();
            for name in names {
                let rel = common::rel_err(&got[&name], &want[&name]);
                assert!(
                    rel <= 1e-5,
                    "{which:?}: {name}: relative error {rel:e} against the uninterrupted \
                     single-process run"
                );
            }
            let _ = std::fs::remove_dir_all(&root);
        }
    }
}
