//! Mixed precision, the sharded grad scaler, gradient clipping and gradient accumulation (also
//! bf16 and micro-batches without gradient sync on the GPT of tests/common/user_gpt.rs).

use crate::common;

use std::sync::Arc;

use crate::user_gpt::{assert_parity, diff, fsdp, reference, BlockCfg, Case};
use candle_core::{DType, Device, Tensor};
use candle_fsdp::clip::{clip_grad_norm, total_grad_norm};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::ProcessGroup;
#[cfg(feature = "mnist")]
use candle_fsdp::data::{BatchLoader, DistributedSampler, Mnist};
use candle_fsdp::grad_scaler::{GradScalerConfig, ShardedGradScaler};
use candle_fsdp::init::{seeded_var_builder, varmap_values};
use candle_fsdp::optim::{AdamW, AdamWConfig, Sgd, SgdConfig, ShardedOptimizer};
use candle_fsdp::{FsdpConfig, FsdpModel, MixedPrecision, ShardingStrategy};
use candle_nn::VarMap;
use common::*;

fn model(pg: Arc<dyn ProcessGroup>, mp: MixedPrecision) -> candle_fsdp::Result<FsdpModel> {
    model_with(pg, mp, ShardingStrategy::FullShard)
}

/// 2 replicas × 2 ranks.
const HYBRID_2: ShardingStrategy = ShardingStrategy::HybridShard {
    shard_size: Some(2),
};

fn model_with(
    pg: Arc<dyn ProcessGroup>,
    mp: MixedPrecision,
    strategy: ShardingStrategy,
) -> candle_fsdp::Result<FsdpModel> {
    let mut b = FsdpModel::builder(
        pg,
        FsdpConfig {
            seed: 11,
            mixed_precision: mp,
            sharding_strategy: strategy,
            ..Default::default()
        },
    );
    for u in units() {
        b = b.unit_spec(u);
    }
    b.build()
}

#[test]
fn bf16_all_gather_sends_half_the_bytes_of_f32() {
    let x = Tensor::ones((2, IN.0, IN.1), DType::F32, &Device::Cpu).unwrap();
    let bytes = |mp: MixedPrecision| {
        let x = x.clone();
        run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
            let mut m = model(pg.clone(), mp)?;
            let before = pg.stats();
            let y = m.forward(&x)?;
            m.backward(&y.to_dtype(DType::F32)?.sum_all()?)?;
            let after = pg.stats();
            Ok((
                after.all_gather_bytes - before.all_gather_bytes,
                after.reduce_scatter_bytes - before.reduce_scatter_bytes,
            ))
        })
        .unwrap()[0]
    };
    let f32_bytes = bytes(MixedPrecision::full_f32());
    let bf16_bytes = bytes(MixedPrecision::bf16());
    let mixed = bytes(MixedPrecision::bf16_compute_f32_reduce());
    assert!(f32_bytes.0 > 0 && f32_bytes.1 > 0);
    assert_eq!(bf16_bytes.0 * 2, f32_bytes.0, "all-gather bytes");
    assert_eq!(bf16_bytes.1 * 2, f32_bytes.1, "reduce-scatter bytes");
    assert_eq!(mixed.0 * 2, f32_bytes.0);
    assert_eq!(
        mixed.1, f32_bytes.1,
        "f32 reduce keeps f32 reduce-scatter bytes"
    );
}

#[test]
fn bf16_training_tracks_f32_closely() {
    // Same data, a few SGD steps: bf16 compute follows f32 closely (bf16 has 8 bits of
    // mantissa: relative differences of ~1e-2).
    let data = batches(4, 8, 21);
    let run = |mp: MixedPrecision| {
        let data = data.clone();
        run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
            let rank = pg.rank();
            let mut m = model(pg, mp)?;
            let mut opt = Sgd::new(SgdConfig {
                lr: 0.1,
                ..Default::default()
            });
            let mut losses = Vec::new();
            for (x, y) in &data {
                let logits = m.forward(&x.narrow(0, rank * 4, 4)?)?;
                assert_eq!(logits.dtype(), mp.param_dtype);
                let loss = candle_nn::loss::cross_entropy(
                    &logits.to_dtype(DType::F32)?,
                    &y.narrow(0, rank * 4, 4)?,
                )?;
                m.backward(&loss)?;
                opt.step(&mut m)?;
                m.zero_grad();
                losses.push(loss.to_scalar::<f32>()?);
            }
            Ok(losses)
        })
        .unwrap()
        .remove(0)
    };
    let a = run(MixedPrecision::full_f32());
    let b = run(MixedPrecision::bf16());
    for (x, y) in a.iter().zip(&b) {
        assert!(((x - y) / x).abs() < 0.03, "f32 {a:?} vs bf16 {b:?}");
    }
    assert_ne!(a, b, "bf16 must actually change the arithmetic");
}

#[test]
fn inf_on_one_rank_makes_every_rank_skip_and_halve_the_scale() {
    inf_on_one_rank(3, ShardingStrategy::FullShard, 1);
    // Hybrid 2 × 2, the overflow on a rank of replica 1: the found-inf reduction spans the
    // world, so replica 0 skips too.
    inf_on_one_rank(4, HYBRID_2, 3);
}

fn inf_on_one_rank(ws: usize, strategy: ShardingStrategy, bad_rank: usize) {
    let data = batches(2, 3 * ws, 4);
    let results = run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
        let rank = pg.rank();
        let mut m = model_with(pg, MixedPrecision::f16(), strategy)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        let mut scaler = ShardedGradScaler::new(GradScalerConfig {
            init_scale: 1024.0,
            ..Default::default()
        })?;
        let shards = |m: &FsdpModel| -> Vec<Vec<f32>> {
            m.shards()
                .map(|u| u.param.to_vec1::<f32>().unwrap())
                .collect()
        };
        let mut out = Vec::new();
        for (step, (x, y)) in data.iter().enumerate() {
            let logits = m
                .forward(&x.narrow(0, rank * 3, 3)?)?
                .to_dtype(DType::F32)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &y.narrow(0, rank * 3, 3)?)?;
            m.backward(&scaler.scale_loss(&loss)?)?;
            if step == 0 && rank == bad_rank {
                // Inject an overflow into one element of one rank's gradient shard.
                let g = m.shard(1).unwrap().grad.expect("fc1 has a gradient");
                g.slice_set(&Tensor::new(&[f32::INFINITY], g.device())?, 0, 0)?;
            }
            let before = shards(&m);
            let stepped = scaler.step(&mut m, &mut opt)?;
            let unchanged = before == shards(&m);
            m.zero_grad();
            out.push((stepped, unchanged, scaler.state()));
        }
        Ok(out)
    })
    .unwrap();
    for (rank, steps) in results.iter().enumerate() {
        let (stepped, unchanged, st) = steps[0];
        assert!(!stepped && unchanged, "rank {rank} must skip step 0");
        assert_eq!(st.scale, 512.0, "rank {rank}: scale halves");
        assert_eq!(st.skipped_steps, 1);
        let (stepped, unchanged, st) = steps[1];
        assert!(stepped && !unchanged, "rank {rank} steps at step 1");
        assert_eq!((st.scale, st.skipped_steps, st.taken_steps), (512.0, 1, 1));
    }
}

#[test]
fn scaler_grows_after_growth_interval_clean_steps_and_rejects_bad_scales() {
    assert!(ShardedGradScaler::new(GradScalerConfig {
        init_scale: 1000.0,
        ..Default::default()
    })
    .unwrap_err()
    .to_string()
    .contains("power of two"));
    let data = batches(3, 2, 8);
    let st = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let rank = pg.rank();
        let mut m = model(pg, MixedPrecision::f16())?;
        let mut opt = Sgd::new(SgdConfig::default());
        let mut scaler = ShardedGradScaler::new(GradScalerConfig {
            init_scale: 256.0,
            growth_interval: 2,
            ..Default::default()
        })?;
        for (x, y) in &data {
            let logits = m.forward(&x.narrow(0, rank, 1)?)?.to_dtype(DType::F32)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &y.narrow(0, rank, 1)?)?;
            m.backward(&scaler.scale_loss(&loss)?)?;
            scaler.step(&mut m, &mut opt)?;
            m.zero_grad();
        }
        Ok(scaler.state())
    })
    .unwrap()[0];
    // Steps 1, 2 clean → grow to 512 and reset; step 3 clean → tracker 1.
    assert_eq!((st.scale, st.growth_tracker, st.taken_steps), (512.0, 1, 3));
}

/// Single-process reference of `steps` SGD steps with clipping to `max_norm`: per-step total
/// gradient norms and final parameters.
fn clip_reference(
    data: &[(Tensor, Tensor)],
    max_norm: f32,
) -> (Vec<f32>, std::collections::HashMap<String, Vec<f32>>) {
    let varmap = VarMap::new();
    let model = reference_model(seeded_var_builder(&varmap, 11, DType::F32, &Device::Cpu)).unwrap();
    let vars = varmap.all_vars();
    let mut norms = Vec::new();
    for (x, y) in data {
        let loss =
            candle_nn::loss::cross_entropy(&reference_forward(&model, x).unwrap(), y).unwrap();
        let grads = loss.backward().unwrap();
        let sq: f32 = vars
            .iter()
            .map(|v| {
                grads
                    .get(v)
                    .unwrap()
                    .sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
            })
            .sum();
        let norm = sq.sqrt();
        norms.push(norm);
        let coef = (max_norm / (norm + 1e-6)).min(1.0) as f64;
        for v in &vars {
            let g = (grads.get(v).unwrap() * coef).unwrap();
            v.set(&(v.as_tensor() - (g * 0.5).unwrap()).unwrap())
                .unwrap();
        }
    }
    (norms, varmap_values(&varmap).unwrap())
}

#[test]
fn clip_grad_norm_matches_single_process_clipping() {
    let max_norm = 0.3;
    let three_by_two = ShardingStrategy::HybridShard {
        shard_size: Some(3),
    };
    for (ws, strategy) in (1..=4)
        .map(|ws| (ws, ShardingStrategy::FullShard))
        .chain([(4, HYBRID_2), (6, three_by_two)])
    {
        let data = batches(3, 4 * ws, 13);
        let (ref_norms, ref_params) = clip_reference(&data, max_norm);
        let out = run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
            let rank = pg.rank();
            let mut m = model_with(pg, MixedPrecision::full_f32(), strategy)?;
            let mut opt = Sgd::new(SgdConfig {
                lr: 0.5,
                ..Default::default()
            });
            let mut norms = Vec::new();
            for (x, y) in &data {
                let logits = m.forward(&x.narrow(0, rank * 4, 4)?)?;
                let loss = candle_nn::loss::cross_entropy(&logits, &y.narrow(0, rank * 4, 4)?)?;
                m.backward(&loss)?;
                norms.push(clip_grad_norm(&mut m, max_norm)?);
                // After clipping the norm is max_norm (clipping was active).
                let after = total_grad_norm(&m)?;
                assert!(
                    (after - max_norm).abs() / max_norm < 1e-5,
                    "after clip {after}"
                );
                opt.step(&mut m)?;
                m.zero_grad();
            }
            let params = m.gather_full_params(true)?;
            Ok((norms, params))
        })
        .unwrap();
        let (norms, params) = &out[0];
        for (a, b) in norms.iter().zip(&ref_norms) {
            assert!(
                ((a - b) / b).abs() <= 1e-5,
                "ws {ws} {strategy}: norm {a} vs {b}"
            );
            assert!(*b > max_norm, "clipping must be active in this test");
        }
        for (name, t) in params.as_ref().unwrap() {
            let rel = rel_err(&to_vec(t), &ref_params[name]);
            assert!(rel <= 1e-5, "ws {ws} {strategy}: {name}: rel {rel:e}");
        }
        // Every rank, of every replica, computed the same norms.
        assert!(out.iter().all(|(n, _)| n == norms), "ws {ws} {strategy}");
    }
}

/// `k` micro-batches per step with either accumulation mode vs one step on the k-times larger
/// batch: same parameters.
#[test]
fn gradient_accumulation_equals_one_large_batch_step_both_ways() {
    accumulation_both_ways(2, ShardingStrategy::FullShard);
    accumulation_both_ways(4, HYBRID_2);
}

fn accumulation_both_ways(ws: usize, strategy: ShardingStrategy) {
    let (k, micro) = (3, 2);
    let data = batches(2, ws * k * micro, 17);
    let train = |accum: Option<bool>| {
        let data = data.clone();
        run_ranks_ok(ws, ThreadGroupConfig::default(), move |pg| {
            let rank = pg.rank();
            let mut m = model_with(pg.clone(), MixedPrecision::full_f32(), strategy)?;
            let mut opt = Sgd::new(SgdConfig {
                lr: 0.5,
                momentum: 0.9,
                ..Default::default()
            });
            let mut peak_unsharded_grad = 0usize;
            for (x, y) in &data {
                // Rank r's share of the global batch: rows [r*k*micro, (r+1)*k*micro).
                let x = x.narrow(0, rank * k * micro, k * micro)?;
                let y = y.narrow(0, rank * k * micro, k * micro)?;
                match accum {
                    None => {
                        let loss = candle_nn::loss::cross_entropy(&m.forward(&x)?, &y)?;
                        m.backward(&loss)?;
                    }
                    Some(no_sync) => {
                        for i in 0..k {
                            m.set_requires_gradient_sync(!no_sync || i + 1 == k);
                            let xi = x.narrow(0, i * micro, micro)?;
                            let yi = y.narrow(0, i * micro, micro)?;
                            let loss = candle_nn::loss::cross_entropy(&m.forward(&xi)?, &yi)?;
                            m.backward(&(loss / k as f64)?)?;
                            let held = m.memory_stats().unsharded_grad_bytes / 4;
                            peak_unsharded_grad = peak_unsharded_grad.max(held);
                        }
                    }
                }
                opt.step(&mut m)?;
                m.zero_grad();
            }
            let rs_calls = m.shard_group().stats().reduce_scatter_calls;
            Ok((m.gather_full_params(true)?, peak_unsharded_grad, rs_calls))
        })
        .unwrap()
        .remove(0)
    };
    let (reference, _, rs_ref) = train(None);
    let (no_sync, held_no_sync, rs_no_sync) = train(Some(true));
    let (after_rs, held_rs, rs_every) = train(Some(false));
    // Traffic: no_sync reduces once per step, the other way once per micro-batch.
    assert_eq!(rs_no_sync, rs_ref);
    assert_eq!(rs_every, rs_ref * k as u64);
    // Memory: no_sync holds unsharded gradients between micro-batches, the other way never.
    assert!(held_no_sync > 0);
    assert_eq!(held_rs, 0);
    let reference = reference.unwrap();
    for params in [no_sync.unwrap(), after_rs.unwrap()] {
        for ((name, a), (_, b)) in params.iter().zip(&reference) {
            let rel = rel_err(&to_vec(a), &to_vec(b));
            assert!(rel <= 1e-5, "{strategy}: {name}: rel {rel:e}");
        }
    }
}

#[cfg(feature = "mnist")]
fn mnist_accuracy(mnist: &Mnist, mp: MixedPrecision) -> f64 {
    let images = Arc::new(mnist.train_images.clone());
    let labels = Arc::new(mnist.train_labels.clone());
    let test_x = Tensor::from_vec(
        mnist.test_images.clone(),
        (mnist.test_len(), 784),
        &Device::Cpu,
    )
    .unwrap();
    let test_y: Vec<u32> = mnist.test_labels.iter().map(|&l| l as u32).collect();
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let rank = pg.rank();
        let mut m = FsdpModel::builder(
            pg.clone(),
            FsdpConfig {
                seed: 0,
                mixed_precision: mp,
                ..Default::default()
            },
        )
        .units(candle_fsdp::models::mnist_mlp())
        .build()?;
        let mut opt = AdamW::new(AdamWConfig::default());
        let mut scaler = mp
            .uses_f16()
            .then(|| ShardedGradScaler::new(GradScalerConfig::default()).unwrap());
        let mut sampler = DistributedSampler::new(labels.len(), 2, rank, true, 0, false)?;
        sampler.set_epoch(0);
        let loader = BatchLoader::new(
            images.clone(),
            labels.clone(),
            (1, 28, 28),
            sampler.indices(),
            32,
            false,
        )?;
        for batch in loader {
            let batch = batch?;
            let logits = m.forward(&batch.images)?.to_dtype(DType::F32)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &batch.labels)?;
            match &mut scaler {
                Some(s) => {
                    m.backward(&s.scale_loss(&loss)?)?;
                    s.step(&mut m, &mut opt)?;
                }
                None => {
                    m.backward(&loss)?;
                    opt.step(&mut m)?;
                }
            }
            m.zero_grad();
        }
        let logits = m.forward_eval(&test_x)?.to_dtype(DType::F32)?;
        let pred = logits.argmax(1)?.to_vec1::<u32>()?;
        let correct = pred.iter().zip(&test_y).filter(|(a, b)| a == b).count();
        Ok(100.0 * correct as f64 / test_y.len() as f64)
    })
    .unwrap()[0]
}

#[cfg(feature = "mnist")]
#[test]
fn bf16_and_f16_mnist_accuracy_within_half_a_point_of_f32() {
    let mnist = Mnist::load("data/mnist").expect("MNIST shipped in data/mnist");
    let f32_acc = mnist_accuracy(&mnist, MixedPrecision::full_f32());
    let bf16_acc = mnist_accuracy(&mnist, MixedPrecision::bf16());
    let f16_acc = mnist_accuracy(&mnist, MixedPrecision::f16());
    println!("one epoch, world size 2: f32 {f32_acc:.2}%  bf16 {bf16_acc:.2}%  f16 {f16_acc:.2}%");
    assert!(f32_acc > 94.0, "f32 accuracy {f32_acc}");
    assert!(
        (bf16_acc - f32_acc).abs() <= 0.5,
        "bf16 {bf16_acc} vs f32 {f32_acc}"
    );
    assert!(
        (f16_acc - f32_acc).abs() <= 0.5,
        "f16 {f16_acc} vs f32 {f32_acc}"
    );
}

// A GPT written the way Candle users write it (tests/common/user_gpt.rs): bf16 against plain
// Candle in f32, micro-batches without gradient sync against one global batch.

#[test]
fn bf16_users_gpt_trains_within_5_percent_of_f32() {
    let mut c = Case::gpt(3, BlockCfg::default(), false);
    let want = reference(&c);
    c.mp = MixedPrecision::bf16();
    let got = fsdp(&c, 2);
    let (dl, dp, worst) = diff(&got, &want);
    println!(
        "bf16: losses {:?} vs f32 {:?}; max param rel err {dp:e} ({worst})",
        got.losses, want.losses
    );
    assert!(got.losses.iter().all(|l| l.is_finite()));
    assert!(
        dl < 0.05,
        "bf16 losses {:?} vs f32 {:?}",
        got.losses,
        want.losses
    );
    assert!(dp < 0.05, "bf16 parameter {worst} off by {dp}");
    assert!(got.losses[2] < got.losses[0], "{:?}", got.losses);
}

/// bf16 with everything at once: activation checkpointing, frozen parameters, 2 micro-batches.
#[test]
fn bf16_with_checkpointing_frozen_parameters_and_accumulation_within_5_percent_of_f32() {
    let mut c = Case::gpt(2, BlockCfg::default(), true);
    c.freeze = vec!["h0.ln1.*".into(), "wpe.*".into()];
    let want = reference(&c);
    c.mp = MixedPrecision::bf16();
    c.accum = 2;
    let got = fsdp(&c, 2);
    let (dl, dp, worst) = diff(&got, &want);
    println!(
        "bf16 + AC + frozen + no_sync: losses {:?} vs f32 {:?}; max param rel err {dp:e} ({worst})",
        got.losses, want.losses
    );
    assert!(dl < 0.05, "{:?} vs {:?}", got.losses, want.losses);
    assert!(dp < 0.05, "{worst}: {dp}");
}

#[test]
fn micro_batches_without_gradient_sync_match_one_global_batch_with_and_without_checkpointing() {
    let mut c = Case::gpt(2, BlockCfg::default(), false);
    let want = reference(&c);
    c.accum = 2;
    for ws in [2, 3] {
        assert_parity(
            &fsdp(&c, ws),
            &want,
            &format!("2 micro-batches, no_sync, ws {ws}"),
        );
    }
    // With activation checkpointing too.
    let mut c = Case::gpt(2, BlockCfg::default(), true);
    c.accum = 2;
    assert_parity(&fsdp(&c, 2), &want, "2 micro-batches + checkpointing ws 2");
}
