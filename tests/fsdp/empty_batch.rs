//! A rank whose local batch is empty (issue 20, item 1): the end of an epoch with an uneven
//! loader. It takes part in every collective, contributes zero gradients, and the step equals
//! plain Candle over the rows that exist, for every sharding strategy, whatever the empty rank
//! computes as its loss (`0 * logits.sum()`, a constant 0, or the mean over no rows), with or
//! without `with_unused_parameters`; also with SyncBatchNorm inside the model.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Module, ModuleT, Tensor};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::ProcessGroup;
use candle_fsdp::init::{seeded_var_builder, varmap_values};
use candle_fsdp::sync_batch_norm::sync_batch_norm;
use candle_fsdp::unit::UnitSpec;
use candle_fsdp::{FsdpConfig, FsdpModel, Sgd, SgdConfig, ShardedOptimizer, ShardingStrategy};
use candle_nn::{Activation, BatchNormConfig, Optimizer, VarMap};
use common::{rel_err, to_vec};

const SEED: u64 = 20;
const LR: f64 = 0.5;
const STEPS: usize = 2;
/// Rows of the global batch; all of them on rank 0, none on rank 1.
const ROWS: usize = 3;

/// fc1 = linear(4, 5) + ReLU, fc2 = linear(5, 3); `unused`: both say
/// `with_unused_parameters(true)`.
fn mlp_units(unused: bool) -> Vec<UnitSpec> {
    vec![
        UnitSpec::new("fc1", |vb| {
            Ok(candle_nn::seq()
                .add(candle_nn::linear(4, 5, vb)?)
                .add(Activation::Relu))
        })
        .with_unused_parameters(unused),
        UnitSpec::new("fc2", |vb| candle_nn::linear(5, 3, vb)).with_unused_parameters(unused),
    ]
}

/// linear(4, 6) → SyncBatchNorm(6) (candle-nn BatchNorm when `pg` is None) → ReLU → linear(6, 3).
fn bn_units(pg: Option<Arc<dyn ProcessGroup>>) -> Vec<UnitSpec> {
    vec![
        UnitSpec::new("block", move |vb| {
            let fc = candle_nn::linear(4, 6, vb.pp("fc"))?;
            let cfg = BatchNormConfig {
                eps: 1e-5,
                momentum: 0.3,
                ..Default::default()
            };
            let bn: Box<dyn ModuleT + Send + Sync> = match &pg {
                Some(pg) => Box::new(sync_batch_norm(6, cfg, pg.clone(), vb.pp("bn"))?),
                None => Box::new(candle_nn::batch_norm(6, cfg, vb.pp("bn"))?),
            };
            Ok(candle_nn::func_t(move |x, train| {
                bn.forward_t(&fc.forward(x)?, train)?.relu()
            }))
        }),
        UnitSpec::new("head", |vb| candle_nn::linear(6, 3, vb)),
    ]
}

/// Step `s`'s global batch: `ROWS` rows of 4 features and their labels.
fn batch(s: usize) -> (Tensor, Tensor) {
    let x: Vec<f32> = (0..ROWS * 4)
        .map(|i| ((i * 7 + s * 5) % 11) as f32 / 5.0 - 1.0)
        .collect();
    let y: Vec<u32> = (0..ROWS).map(|i| ((i + s) % 3) as u32).collect();
    (
        Tensor::from_vec(x, (ROWS, 4), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, ROWS, &Device::Cpu).unwrap(),
    )
}

/// Plain Candle, one process: SGD (lr `LR`) on the mean cross-entropy over the `ROWS` rows.
fn reference(units: Vec<UnitSpec>) -> HashMap<String, Vec<f32>> {
    let varmap = VarMap::new();
    let vb = seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu);
    let model: Vec<_> = units
        .iter()
        .map(|u| (u.ctor)(vb.pp(&u.name)).unwrap())
        .collect();
    let mut opt = candle_nn::SGD::new(varmap.all_vars(), LR).unwrap();
    for s in 0..STEPS {
        let (x, y) = batch(s);
        let mut h = x;
        for m in &model {
            h = m.forward1(&h, true).unwrap();
        }
        let loss = candle_nn::loss::cross_entropy(&h, &y).unwrap();
        opt.backward_step(&loss).unwrap();
    }
    varmap_values(&varmap).unwrap()
}

/// What the rank without rows back-propagates.
#[derive(Clone, Copy, Debug)]
enum EmptyLoss {
    /// `0 * logits.sum()`.
    ZeroTimesSum,
    /// A constant 0 that does not depend on the model.
    Constant,
    /// `logits.sum() / max(rows, 1) * world_size` written for any row count: 0 here.
    ScaledSum,
}

/// World size 2, rank 0 holds the `ROWS` rows, rank 1 none. Each rank's loss is its sum of
/// cross-entropies × world size / `ROWS` (the mean over the global batch, as the gradients are
/// averaged over the ranks). Returns the full parameters (and buffers) after `STEPS` SGD steps.
fn fsdp(
    strategy: ShardingStrategy,
    empty: EmptyLoss,
    units: impl Fn(Arc<dyn ProcessGroup>) -> Vec<UnitSpec> + Send + Sync,
) -> HashMap<String, Vec<f32>> {
    let results = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let rank = pg.rank();
        let ws = pg.world_size() as f64;
        let config = FsdpConfig {
            sharding_strategy: strategy,
            seed: SEED,
            ..Default::default()
        };
        let mut b = FsdpModel::builder(pg.clone(), config);
        for u in units(pg.clone()) {
            b = b.unit_spec(u);
        }
        let mut model = b.build()?;
        let mut opt = Sgd::new(SgdConfig {
            lr: LR,
            ..Default::default()
        });
        for s in 0..STEPS {
            let (x, y) = batch(s);
            let rows = if rank == 0 { ROWS } else { 0 };
            let x = x.narrow(0, 0, rows)?;
            let y = y.narrow(0, 0, rows)?;
            let logits = model.forward(&x)?;
            assert_eq!(logits.dims(), [rows, 3]);
            let loss = if rows > 0 {
                candle_nn::loss::cross_entropy(&logits, &y)?.affine(ws, 0.0)?
            } else {
                match empty {
                    EmptyLoss::ZeroTimesSum => (logits.sum_all()? * 0.0)?,
                    EmptyLoss::Constant => Tensor::new(0f32, &Device::Cpu)?,
                    EmptyLoss::ScaledSum => logits.sum_all()?.affine(ws, 0.0)?,
                }
            };
            model.backward(&loss)?;
            opt.step(&mut model)?;
            model.zero_grad();
        }
        let full = model
            .gather_full_params(false)?
            .expect("every rank gathers");
        Ok(full
            .into_iter()
            .map(|(k, t)| (k, to_vec(&t)))
            .collect::<HashMap<_, _>>())
    })
    .unwrap_or_else(|e| panic!("{strategy:?} {empty:?}: {e}"));
    assert_eq!(results[0], results[1], "the ranks disagree");
    results.into_iter().next().unwrap()
}

fn assert_close(
    got: &HashMap<String, Vec<f32>>,
    want: &HashMap<String, Vec<f32>>,
    init: &HashMap<String, Vec<f32>>,
    what: &str,
) {
    let mut names: Vec<_> = want.keys().collect();
    names.sort();
    let mut got_names: Vec<_> = got.keys().collect();
    got_names.sort();
    assert_eq!(names, got_names, "{what}: names");
    for name in names {
        let rel = rel_err(&got[name], &want[name]);
        assert!(rel <= 1e-5, "{what}: {name}: relative error {rel:e}");
        // Every parameter moved (its gradient is not the empty rank's zero alone).
        if !name.contains("running") {
            assert_ne!(want[name], init[name], "{what}: {name} did not move");
        }
    }
}

fn initial(units: Vec<UnitSpec>) -> HashMap<String, Vec<f32>> {
    let varmap = VarMap::new();
    let vb = seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu);
    for u in &units {
        (u.ctor)(vb.pp(&u.name)).unwrap();
    }
    varmap_values(&varmap).unwrap()
}

#[test]
fn a_rank_with_an_empty_batch_steps_with_zero_gradients_every_strategy() {
    let want = reference(mlp_units(false));
    let init = initial(mlp_units(false));
    for strategy in [
        ShardingStrategy::FullShard,
        ShardingStrategy::ShardGradOp,
        ShardingStrategy::NoShard,
    ] {
        for empty in [
            EmptyLoss::ZeroTimesSum,
            EmptyLoss::Constant,
            EmptyLoss::ScaledSum,
        ] {
            for unused in [false, true] {
                let got = fsdp(strategy, empty, |_| mlp_units(unused));
                assert_close(
                    &got,
                    &want,
                    &init,
                    &format!("{strategy:?} {empty:?} unused {unused}"),
                );
            }
        }
    }
}

#[test]
fn sync_batch_norm_in_fsdp_with_a_rank_holding_zero_rows() {
    let want = reference(bn_units(None));
    let init = initial(bn_units(None));
    assert!(want.contains_key("block.bn.running_mean"));
    for strategy in [ShardingStrategy::FullShard, ShardingStrategy::NoShard] {
        for empty in [EmptyLoss::ZeroTimesSum, EmptyLoss::ScaledSum] {
            let got = fsdp(strategy, empty, |pg| bn_units(Some(pg)));
            assert_close(&got, &want, &init, &format!("bn {strategy:?} {empty:?}"));
        }
    }
}
