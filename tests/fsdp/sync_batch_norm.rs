//! SyncBatchNorm equals one candle-nn `BatchNorm` over the concatenated global batch: forward
//! outputs, input / weight / bias gradients and running statistics (relative error ≤ 1e-5), at
//! world sizes 1–4 with equal and unequal per-rank batches (including ranks with 0 or 1 sample),
//! for 2-D and 4-D inputs; eval mode equals `BatchNorm` eval with no communication; a global
//! count of 1 is an error on every rank; and a conv + SyncBatchNorm model trained with FSDP
//! equals the plain single-process model with candle-nn `BatchNorm`.

use crate::common;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use candle_fsdp::comm::threads::{run_ranks, run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::{ProcessGroup, ProcessGroupExt, ReduceOp};
use candle_fsdp::init::{seeded_var_builder, varmap_values};
use candle_fsdp::optim::{AdamW, AdamWConfig, ShardedOptimizer};
use candle_fsdp::sync_batch_norm::{all_reduce_sum, sync_batch_norm};
use candle_fsdp::unit::UnitSpec;
use candle_fsdp::{FsdpConfig, FsdpModel, ShardingStrategy};
use candle_nn::{BatchNorm, BatchNormConfig, Module, ModuleT, Optimizer, VarBuilder, VarMap};
use common::{batches, rel_err, to_vec, CLASSES};
use rand::{Rng, SeedableRng};

const C: usize = 3;
const EPS: f64 = 1e-5;
const MOMENTUM: f64 = 0.1;
/// Training steps per case (the running statistics compound over them).
const STEPS: u64 = 2;
const TOL: f64 = 1e-5;

#[derive(Clone, Debug)]
struct Case {
    /// Per-rank batch sizes (world size = len).
    batches: Vec<usize>,
    /// Dimensions after (N, C): `[]` for 2-D inputs, `[H, W]` for 4-D.
    spatial: Vec<usize>,
    config: BatchNormConfig,
}

fn case(batches: &[usize], spatial: &[usize]) -> Case {
    Case {
        batches: batches.to_vec(),
        spatial: spatial.to_vec(),
        config: BatchNormConfig {
            eps: EPS,
            momentum: MOMENTUM,
            ..Default::default()
        },
    }
}

fn uniform(n: usize, lo: f32, hi: f32, seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

fn shape(n: usize, spatial: &[usize]) -> Vec<usize> {
    [vec![n, C], spatial.to_vec()].concat()
}

/// Global input of step `step` (channel c offset by c, so means are far from 0) and the
/// upstream gradient `g` of the loss `sum(y · g)`.
fn step_data(total: usize, spatial: &[usize], step: u64) -> (Tensor, Tensor) {
    let dims = shape(total, spatial);
    let n: usize = dims.iter().product();
    let per_channel: usize = spatial.iter().product();
    let x: Vec<f32> = uniform(n, -1.0, 2.0, 10 + step)
        .into_iter()
        .enumerate()
        .map(|(i, v)| v + ((i / per_channel) % C) as f32)
        .collect();
    let g = uniform(n, -1.0, 1.0, 20 + step);
    (
        Tensor::from_vec(x, dims.clone(), &Device::Cpu).unwrap(),
        Tensor::from_vec(g, dims, &Device::Cpu).unwrap(),
    )
}

/// Initial (weight, bias, running_mean, running_var), not the trivial 1/0/0/1.
fn initial_params() -> [Vec<f32>; 4] {
    [
        uniform(C, 0.5, 1.5, 1),
        uniform(C, -0.5, 0.5, 2),
        uniform(C, -0.2, 0.2, 3),
        uniform(C, 0.5, 1.5, 4),
    ]
}

fn t1(v: &[f32]) -> Tensor {
    Tensor::from_slice(v, C, &Device::Cpu).unwrap()
}

/// What a run produces, flattened in global (rank-concatenated) order.
#[derive(Debug, Default)]
struct Outcome {
    /// Per step: outputs, input gradients, weight gradients, bias gradients.
    y: Vec<Vec<f32>>,
    gx: Vec<Vec<f32>>,
    gw: Vec<Vec<f32>>,
    gb: Vec<Vec<f32>>,
    running_mean: Vec<f32>,
    running_var: Vec<f32>,
    eval: Vec<f32>,
}

fn eval_input(spatial: &[usize]) -> Tensor {
    step_data(4, spatial, 99).0
}

/// One candle-nn BatchNorm on the concatenated batch.
fn reference(case: &Case) -> Outcome {
    let total: usize = case.batches.iter().sum();
    let [w, b, rm, rv] = initial_params();
    let w = Var::from_tensor(&t1(&w)).unwrap();
    let b = Var::from_tensor(&t1(&b)).unwrap();
    let bn = if case.config.affine {
        BatchNorm::new_with_momentum(
            C,
            t1(&rm),
            t1(&rv),
            w.as_tensor().clone(),
            b.as_tensor().clone(),
            EPS,
            MOMENTUM,
        )
    } else {
        BatchNorm::new_no_bias_with_momentum(C, t1(&rm), t1(&rv), EPS, MOMENTUM)
    }
    .unwrap();
    let mut out = Outcome::default();
    for step in 0..STEPS {
        let (x, g) = step_data(total, &case.spatial, step);
        let x = Var::from_tensor(&x).unwrap();
        let y = bn.forward_t(x.as_tensor(), true).unwrap();
        let grads = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
        out.y.push(to_vec(&y));
        out.gx.push(to_vec(grads.get(x.as_tensor()).unwrap()));
        if case.config.affine {
            out.gw.push(to_vec(grads.get(w.as_tensor()).unwrap()));
            out.gb.push(to_vec(grads.get(b.as_tensor()).unwrap()));
        }
    }
    out.running_mean = to_vec(bn.running_mean());
    out.running_var = to_vec(bn.running_var());
    out.eval = to_vec(&bn.forward_t(&eval_input(&case.spatial), false).unwrap());
    out
}

/// Per-rank result of a SyncBatchNorm run.
struct RankOutcome {
    y: Vec<Vec<f32>>,
    gx: Vec<Vec<f32>>,
    gw: Vec<Vec<f32>>,
    gb: Vec<Vec<f32>>,
    running_mean: Vec<f32>,
    running_var: Vec<f32>,
    eval: Vec<f32>,
    eval_collectives: u64,
}

/// A `VarBuilder` over a VarMap holding this test's initial parameters and buffers as
/// variables (so the layer updates the map's buffers in place), under prefix `bn`.
fn prefilled_var_builder(affine: bool) -> (VarMap, VarBuilder<'static>) {
    let [w, b, rm, rv] = initial_params();
    let varmap = VarMap::new();
    {
        let mut data = varmap.data().lock().unwrap();
        let mut put = |name: &str, v: &[f32]| {
            data.insert(name.to_string(), Var::from_tensor(&t1(v)).unwrap());
        };
        put("bn.running_mean", &rm);
        put("bn.running_var", &rv);
        if affine {
            put("bn.weight", &w);
            put("bn.bias", &b);
        }
    }
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    (varmap, vb)
}

fn var_of(varmap: &VarMap, name: &str) -> Tensor {
    varmap.data().lock().unwrap()[name].as_tensor().clone()
}

fn sync_run(case: &Case) -> Outcome {
    let ws = case.batches.len();
    let total: usize = case.batches.iter().sum();
    let data: Vec<_> = (0..STEPS)
        .map(|s| step_data(total, &case.spatial, s))
        .collect();
    let ranks = run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
        let r = pg.rank();
        let offset: usize = case.batches[..r].iter().sum();
        let n = case.batches[r];
        let (varmap, vb) = prefilled_var_builder(case.config.affine);
        let bn = sync_batch_norm(C, case.config, pg.clone(), vb.pp("bn"))?;
        let mut out = RankOutcome {
            y: vec![],
            gx: vec![],
            gw: vec![],
            gb: vec![],
            running_mean: vec![],
            running_var: vec![],
            eval: vec![],
            eval_collectives: 0,
        };
        for (x, g) in &data {
            let x = Var::from_tensor(&x.narrow(0, offset, n)?)?;
            let g = g.narrow(0, offset, n)?;
            let y = bn.forward_t(x.as_tensor(), true)?;
            let grads = (&y * &g)?.sum_all()?.backward()?;
            out.y.push(to_vec(&y));
            out.gx
                .push(to_vec(grads.get(x.as_tensor()).expect("input grad")));
            if case.config.affine {
                let w = var_of(&varmap, "bn.weight");
                let b = var_of(&varmap, "bn.bias");
                out.gw.push(to_vec(grads.get(&w).expect("weight grad")));
                out.gb.push(to_vec(grads.get(&b).expect("bias grad")));
            }
        }
        // The buffers of the VarBuilder's map were updated in place.
        out.running_mean = to_vec(&var_of(&varmap, "bn.running_mean"));
        out.running_var = to_vec(&var_of(&varmap, "bn.running_var"));
        assert_eq!(out.running_mean, to_vec(bn.running_mean()));
        let before = pg.stats().other_calls;
        out.eval = to_vec(&bn.forward_t(&eval_input(&case.spatial), false)?);
        out.eval_collectives = pg.stats().other_calls - before;
        Ok(out)
    })
    .unwrap_or_else(|e| panic!("{case:?}: {e}"));
    // Concatenate outputs and input gradients in rank order; sum parameter gradients.
    let mut out = Outcome::default();
    for s in 0..STEPS as usize {
        out.y
            .push(ranks.iter().flat_map(|r| r.y[s].clone()).collect());
        out.gx
            .push(ranks.iter().flat_map(|r| r.gx[s].clone()).collect());
        if case.config.affine {
            let sum = |f: &dyn Fn(&RankOutcome) -> &Vec<f32>| -> Vec<f32> {
                (0..C)
                    .map(|c| ranks.iter().map(|r| f(r)[c]).sum())
                    .collect()
            };
            out.gw.push(sum(&|r| &r.gw[s]));
            out.gb.push(sum(&|r| &r.gb[s]));
        }
    }
    for r in &ranks[1..] {
        // Replicated buffers stay bitwise identical on every rank.
        assert_eq!(r.running_mean, ranks[0].running_mean, "{case:?}");
        assert_eq!(r.running_var, ranks[0].running_var, "{case:?}");
        assert_eq!(r.eval, ranks[0].eval, "{case:?}");
    }
    assert!(
        ranks.iter().all(|r| r.eval_collectives == 0),
        "{case:?}: eval communicated"
    );
    out.running_mean = ranks[0].running_mean.clone();
    out.running_var = ranks[0].running_var.clone();
    out.eval = ranks[0].eval.clone();
    out
}

fn close(case: &Case, what: &str, a: &[f32], b: &[f32]) {
    let rel = rel_err(a, b);
    assert!(rel <= TOL, "{case:?}: {what}: relative error {rel:e}");
}

fn check(case: Case) {
    let want = reference(&case);
    let got = sync_run(&case);
    for s in 0..STEPS as usize {
        close(&case, &format!("output, step {s}"), &got.y[s], &want.y[s]);
        close(
            &case,
            &format!("input grad, step {s}"),
            &got.gx[s],
            &want.gx[s],
        );
        if case.config.affine {
            close(
                &case,
                &format!("weight grad, step {s}"),
                &got.gw[s],
                &want.gw[s],
            );
            close(
                &case,
                &format!("bias grad, step {s}"),
                &got.gb[s],
                &want.gb[s],
            );
        }
    }
    close(&case, "running mean", &got.running_mean, &want.running_mean);
    close(&case, "running var", &got.running_var, &want.running_var);
    // Eval: the same operations on the same running statistics.
    close(&case, "eval output", &got.eval, &want.eval);
}

#[test]
fn matches_batch_norm_on_concatenated_batch_2d() {
    for batches in [
        &[5][..],
        &[4, 4],
        &[1, 6],
        &[1, 2],
        &[3, 3, 3],
        &[0, 5, 2],
        &[2, 2, 2, 2],
        &[3, 0, 1, 5],
    ] {
        check(case(batches, &[]));
    }
}

#[test]
fn matches_batch_norm_on_concatenated_batch_4d() {
    for batches in [
        &[3][..],
        &[2, 2],
        &[1, 4],
        &[1, 0],
        &[2, 2, 2],
        &[4, 1, 0],
        &[1, 1, 1, 1],
        &[0, 2, 3, 1],
    ] {
        check(case(batches, &[3, 2]));
    }
}

#[test]
fn non_affine_and_no_mean_removal_match_batch_norm() {
    let mut c = case(&[2, 0, 3], &[2, 2]);
    c.config.affine = false;
    check(c);
    // candle-nn's `remove_mean: false`: no centring, E[x²] as the variance.
    let mut c = case(&[3, 1], &[]);
    c.config.remove_mean = false;
    // The reference needs a BatchNorm built from a config for this flag.
    let want = {
        let (varmap, vb) = prefilled_var_builder(true);
        let bn = candle_nn::batch_norm(C, c.config, vb.pp("bn")).unwrap();
        let mut out = Outcome::default();
        let w = var_of(&varmap, "bn.weight");
        for step in 0..STEPS {
            let (x, g) = step_data(4, &c.spatial, step);
            let x = Var::from_tensor(&x).unwrap();
            let y = bn.forward_t(x.as_tensor(), true).unwrap();
            let grads = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
            out.y.push(to_vec(&y));
            out.gx.push(to_vec(grads.get(x.as_tensor()).unwrap()));
            out.gw.push(to_vec(grads.get(&w).unwrap()));
        }
        out.running_mean = to_vec(bn.running_mean());
        out.running_var = to_vec(bn.running_var());
        out
    };
    let got = sync_run(&c);
    for s in 0..STEPS as usize {
        close(&c, "output", &got.y[s], &want.y[s]);
        close(&c, "input grad", &got.gx[s], &want.gx[s]);
        close(&c, "weight grad", &got.gw[s], &want.gw[s]);
    }
    close(&c, "running mean", &got.running_mean, &want.running_mean);
    close(&c, "running var", &got.running_var, &want.running_var);
}

#[test]
fn global_count_of_one_is_an_error_on_every_rank() {
    for (batches, spatial) in [(&[1][..], &[][..]), (&[1, 0], &[]), (&[0, 1, 0], &[1, 1])] {
        let c = case(batches, spatial);
        let results = run_ranks(batches.len(), ThreadGroupConfig::default(), |pg| {
            let (_varmap, vb) = prefilled_var_builder(true);
            let bn = sync_batch_norm(C, c.config, pg.clone(), vb.pp("bn"))?;
            let x = Tensor::zeros(shape(batches[pg.rank()], spatial), DType::F32, &Device::Cpu)?;
            Ok(bn.forward_t(&x, true)?)
        });
        assert!(
            results.iter().all(|r| r.is_err()),
            "{c:?}: every rank fails"
        );
        let err = run_ranks_ok(batches.len(), ThreadGroupConfig::default(), |pg| {
            let (_varmap, vb) = prefilled_var_builder(true);
            let bn = sync_batch_norm(C, c.config, pg.clone(), vb.pp("bn"))?;
            let x = Tensor::zeros(shape(batches[pg.rank()], spatial), DType::F32, &Device::Cpu)?;
            Ok(bn.forward_t(&x, true)?)
        })
        .expect_err("an error");
        assert!(
            err.to_string()
                .contains("expected more than 1 value per channel when training"),
            "{c:?}: {err}"
        );
    }
    // Eval mode with one sample is fine (running statistics, no communication).
    let (_varmap, vb) = prefilled_var_builder(true);
    let pg_out = run_ranks_ok(1, ThreadGroupConfig::default(), |pg| {
        let bn = sync_batch_norm(C, BatchNormConfig::default(), pg, vb.pp("bn"))?;
        Ok(bn
            .forward_t(&Tensor::ones((1, C), DType::F32, &Device::Cpu)?, false)?
            .dims()
            .to_vec())
    })
    .unwrap();
    assert_eq!(pg_out[0], vec![1, C]);
}

#[test]
fn bad_inputs_and_configs_are_errors() {
    run_ranks_ok(1, ThreadGroupConfig::default(), |pg| {
        let (_varmap, vb) = prefilled_var_builder(true);
        let bn = sync_batch_norm(C, BatchNormConfig::default(), pg.clone(), vb.pp("bn"))?;
        let e = bn.forward_t(&Tensor::zeros(4, DType::F32, &Device::Cpu)?, true);
        assert!(e
            .unwrap_err()
            .to_string()
            .contains("at least two dimensions"));
        let e = bn.forward_t(&Tensor::zeros((4, C + 1), DType::F32, &Device::Cpu)?, true);
        assert!(e.unwrap_err().to_string().contains("channels"));
        let (_varmap, vb) = prefilled_var_builder(true);
        let e = sync_batch_norm(C + 1, BatchNormConfig::default(), pg.clone(), vb.pp("bn"));
        assert!(e.is_err(), "shape mismatch with the stored buffers");
        let (_varmap, vb) = prefilled_var_builder(true);
        let cfg = BatchNormConfig {
            momentum: 1.5,
            ..Default::default()
        };
        assert!(sync_batch_norm(C, cfg, pg.clone(), vb.pp("bn")).is_err());
        Ok(())
    })
    .unwrap();
}

#[test]
fn all_reduce_sum_is_differentiable() {
    // y_r = all_reduce_sum(a_r · x_r); loss_r = sum(y_r · w_r). d(Σ_r loss_r)/dx_r =
    // a_r · Σ_r' w_r'.
    let ws = 3;
    let grads = run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
        let r = pg.rank() as f32;
        let x = Var::from_slice(&[1.0f32, 2.0], 2, &Device::Cpu)?;
        let y = all_reduce_sum(&(x.as_tensor() * (r as f64 + 1.0))?, &pg)?;
        assert_eq!(to_vec(&y), vec![6.0, 12.0]);
        let w = Tensor::from_slice(&[r, 10.0 * r], 2, &Device::Cpu)?;
        let g = (&y * &w)?.sum_all()?.backward()?;
        Ok(to_vec(g.get(x.as_tensor()).unwrap()))
    })
    .unwrap();
    for (r, g) in grads.iter().enumerate() {
        let a = r as f32 + 1.0;
        assert_eq!(g, &vec![a * 3.0, a * 30.0], "rank {r}");
    }
}

#[test]
fn bf16_compute_keeps_f32_running_stats_live() {
    // Bound as the runtime binds a unit computing in bf16 whose buffers are f32 variables: the
    // layer must update those variables (not converted copies), with statistics in f32.
    let c = case(&[3, 2], &[2, 2]);
    let total = 5;
    let (x, _) = step_data(total, &c.spatial, 0);
    let x_bf16 = x.to_dtype(DType::BF16).unwrap();
    // Reference: f32 BatchNorm on the bf16-rounded input.
    let [w, b, rm, rv] = initial_params();
    let bn =
        BatchNorm::new_with_momentum(C, t1(&rm), t1(&rv), t1(&w), t1(&b), EPS, MOMENTUM).unwrap();
    let want_y = to_vec(
        &bn.forward_t(&x_bf16.to_dtype(DType::F32).unwrap(), true)
            .unwrap(),
    );
    let ranks = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let r = pg.rank();
        let [w, b, rm, rv] = initial_params();
        let rm = Var::from_tensor(&t1(&rm))?;
        let rv = Var::from_tensor(&t1(&rv))?;
        let map = [
            ("u.bn.running_mean", rm.as_tensor().clone()),
            ("u.bn.running_var", rv.as_tensor().clone()),
            ("u.bn.weight", t1(&w)),
            ("u.bn.bias", t1(&b)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let pg2 = pg.clone();
        let spec = UnitSpec::new("u", move |vb| {
            sync_batch_norm(C, c.config, pg2.clone(), vb.pp("bn"))
        });
        let module = spec.bind("u", map, DType::BF16, &Device::Cpu)?;
        let offset = if r == 0 { 0 } else { 3 };
        let y = module.forward_t(&[x_bf16.narrow(0, offset, c.batches[r])?], true)?[0].clone();
        assert_eq!(y.dtype(), DType::BF16);
        assert_eq!(rm.dtype(), DType::F32);
        Ok((to_vec(&y), to_vec(rm.as_tensor()), to_vec(rv.as_tensor())))
    })
    .unwrap();
    let y: Vec<f32> = ranks.iter().flat_map(|r| r.0.clone()).collect();
    let rel = rel_err(&y, &want_y);
    assert!(rel <= 1e-2, "bf16 output: relative error {rel:e}");
    for r in &ranks {
        close(&c, "running mean", &r.1, &to_vec(bn.running_mean()));
        close(&c, "running var", &r.2, &to_vec(bn.running_var()));
    }
}

// ---- Through the FSDP runtime --------------------------------------------------------------

const SEED: u64 = 77;
const FSDP_STEPS: usize = 4;
const PER_RANK: usize = 4;

fn bn_config() -> BatchNormConfig {
    BatchNormConfig {
        eps: EPS,
        momentum: 0.2,
        ..Default::default()
    }
}

/// conv(1→4, 3×3, no bias) + batch norm + ReLU, then flatten + linear(4·2·3 → CLASSES); `pg` selects
/// SyncBatchNorm (FSDP) or candle-nn BatchNorm (reference).
fn cnn_units(pg: Option<Arc<dyn ProcessGroup>>) -> Vec<UnitSpec> {
    vec![
        UnitSpec::new("block", move |vb| {
            // No conv bias: batch norm cancels it, so its gradient is rounding noise that Adam
            // would amplify into lr-sized steps (making the parity test compare noise).
            let conv = candle_nn::conv2d_no_bias(1, 4, 3, Default::default(), vb.pp("conv"))?;
            let bn: Box<dyn ModuleT + Send + Sync> = match &pg {
                Some(pg) => Box::new(sync_batch_norm(4, bn_config(), pg.clone(), vb.pp("bn"))?),
                None => Box::new(candle_nn::batch_norm(4, bn_config(), vb.pp("bn"))?),
            };
            Ok(candle_nn::func_t(move |x, train| {
                bn.forward_t(&conv.forward(x)?, train)?.relu()
            }))
        }),
        UnitSpec::new("head", |vb| {
            let fc = candle_nn::linear(4 * 2 * 3, CLASSES, vb)?;
            Ok(candle_nn::func(move |x| fc.forward(&x.flatten_from(1)?)))
        }),
    ]
}

fn adam_cfg() -> AdamWConfig {
    AdamWConfig {
        lr: 1e-2,
        weight_decay: 0.01,
        ..Default::default()
    }
}

fn images(x: &Tensor) -> Tensor {
    let n = x.dim(0).unwrap();
    x.reshape((n, 1, 4, 5)).unwrap()
}

fn cnn_reference(ws: usize) -> (Vec<f32>, std::collections::HashMap<String, Vec<f32>>) {
    let varmap = VarMap::new();
    let vb = seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu);
    let model: Vec<_> = cnn_units(None)
        .iter()
        .map(|u| (u.ctor)(vb.pp(&u.name)).unwrap())
        .collect();
    let mut opt = candle_nn::AdamW::new(
        varmap.all_vars(),
        candle_nn::ParamsAdamW {
            lr: adam_cfg().lr,
            weight_decay: adam_cfg().weight_decay,
            ..Default::default()
        },
    )
    .unwrap();
    let mut losses = vec![];
    for (x, y) in batches(FSDP_STEPS, PER_RANK * ws, 5) {
        let mut h = images(&x);
        for m in &model {
            h = m.forward1(&h, true).unwrap();
        }
        let loss = candle_nn::loss::cross_entropy(&h, &y).unwrap();
        losses.push(loss.to_scalar::<f32>().unwrap());
        opt.step(&loss.backward().unwrap()).unwrap();
    }
    (losses, varmap_values(&varmap).unwrap())
}

fn cnn_fsdp(
    ws: usize,
    strategy: ShardingStrategy,
) -> (Vec<f32>, std::collections::HashMap<String, Vec<f32>>) {
    let data = batches(FSDP_STEPS, PER_RANK * ws, 5);
    let results = run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
        let rank = pg.rank();
        let config = FsdpConfig {
            sharding_strategy: strategy,
            seed: SEED,
            ..Default::default()
        };
        let mut builder = FsdpModel::builder(pg.clone(), config);
        for u in cnn_units(Some(pg.clone())) {
            builder = builder.unit_spec(u);
        }
        let mut model = builder.build()?;
        let mut opt = AdamW::new(adam_cfg());
        let mut losses = vec![];
        for (x, y) in &data {
            let x = images(&x.narrow(0, rank * PER_RANK, PER_RANK)?);
            let y = y.narrow(0, rank * PER_RANK, PER_RANK)?;
            let logits = model.forward(&x)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
            model.backward(&loss)?;
            opt.step(&mut model)?;
            model.zero_grad();
            let l = vec![loss.to_scalar::<f32>()?];
            losses.push(pg.all_reduce_f32s(l, ReduceOp::Avg)?[0]);
        }
        // Eval through the sharded model and the gathered full model agree (running stats).
        let x = images(&data[0].0.narrow(0, 0, PER_RANK)?);
        let sharded_eval = to_vec(&model.forward_eval(&x)?);
        let params = model.gather_full_params(false)?.expect("all ranks gather");
        if let Some(full) = model.gather_full_model(true)? {
            let full_eval = to_vec(&full.forward_t(&x, false)?);
            assert!(rel_err(&full_eval, &sharded_eval) <= 1e-6);
        }
        let params = params.into_iter().map(|(k, t)| (k, to_vec(&t))).collect();
        Ok((losses, params))
    })
    .expect("FSDP run");
    for r in &results[1..] {
        assert_eq!(r.0, results[0].0);
        assert_eq!(r.1, results[0].1);
    }
    results.into_iter().next().unwrap()
}

#[test]
fn fsdp_conv_sync_batch_norm_matches_single_process_batch_norm() {
    for (ws, strategy) in [
        (1, ShardingStrategy::FullShard),
        (2, ShardingStrategy::FullShard),
        (3, ShardingStrategy::FullShard),
        (2, ShardingStrategy::ShardGradOp),
        (2, ShardingStrategy::NoShard),
        // 2 replicas × 2: the statistics are reduced over the whole world.
        (
            4,
            ShardingStrategy::HybridShard {
                shard_size: Some(2),
            },
        ),
    ] {
        let (ref_losses, ref_params) = cnn_reference(ws);
        let (losses, params) = cnn_fsdp(ws, strategy);
        for (s, (a, b)) in losses.iter().zip(&ref_losses).enumerate() {
            let rel = ((a - b) / b).abs() as f64;
            assert!(
                rel <= TOL,
                "ws {ws} {strategy:?}: loss at step {s}: {a} vs {b} ({rel:e})"
            );
        }
        assert_ne!(ref_losses[0], ref_losses[FSDP_STEPS - 1]);
        let mut names: Vec<_> = ref_params.keys().cloned().collect();
        names.sort();
        let mut got: Vec<_> = params.keys().cloned().collect();
        got.sort();
        assert_eq!(names, got, "names (parameters and buffers)");
        assert!(names.contains(&"block.bn.running_var".to_string()));
        for name in names {
            let rel = rel_err(&params[&name], &ref_params[&name]);
            assert!(
                rel <= TOL,
                "ws {ws} {strategy:?}: {name}: relative error {rel:e}"
            );
        }
        // The running statistics moved away from their initial 0 / 1.
        assert!(params["block.bn.running_mean"].iter().any(|v| *v != 0.0));
    }
}
