//! HYBRID_SHARD and its SHARD_GRAD_OP variant: parity with single-process Candle at world sizes
//! 4 (2 replicas × 2) and 6 (3 × 2 and 2 × 3), every mixed-precision policy against FULL_SHARD
//! at the same world size, what each rank holds and sends, the errors of a bad shard size, the
//! default shard size; and the partial reshard after forward.

use crate::common;
use crate::parity::harness;

use std::sync::Arc;

use candle_core::DType;
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::ProcessGroup;
use candle_fsdp::grad_scaler::{GradScalerConfig, ShardedGradScaler};
use candle_fsdp::launch::Launcher;
use candle_fsdp::optim::{Sgd, SgdConfig, ShardedOptimizer};
use candle_fsdp::{FsdpConfig, FsdpModel, MixedPrecision, ShardingStrategy};
use common::*;
use harness::{check, Opt};

/// Every parameter's name and values.
type Params = Vec<(String, Vec<f32>)>;

fn hybrid(shard_size: usize) -> ShardingStrategy {
    ShardingStrategy::HybridShard {
        shard_size: Some(shard_size),
    }
}

#[test]
fn hybrid_shard_matches_single_process_2x2_3x2_2x3() {
    check(&Launcher::threads(4), hybrid(2), Opt::Adam, true);
    check(&Launcher::threads(4), hybrid(2), Opt::SgdMomentum, false);
    check(&Launcher::threads(6), hybrid(2), Opt::Adam, true);
    check(&Launcher::threads(6), hybrid(3), Opt::SgdMomentum, true);
    let zero2 = ShardingStrategy::HybridShardGradOp {
        shard_size: Some(2),
    };
    check(&Launcher::threads(4), zero2, Opt::Adam, true);
    // Shard groups of one rank: DDP (nothing sharded, gradients all-reduced across replicas).
    check(&Launcher::threads(2), hybrid(1), Opt::Adam, true);
}

fn model(
    pg: Arc<dyn ProcessGroup>,
    strategy: ShardingStrategy,
    mp: MixedPrecision,
) -> candle_fsdp::Result<FsdpModel> {
    model_with(
        pg,
        FsdpConfig {
            sharding_strategy: strategy,
            mixed_precision: mp,
            ..Default::default()
        },
    )
}

/// The test model under `config` (seed 5).
fn model_with(pg: Arc<dyn ProcessGroup>, config: FsdpConfig) -> candle_fsdp::Result<FsdpModel> {
    let mut b = FsdpModel::builder(pg, FsdpConfig { seed: 5, ..config });
    for u in units() {
        b = b.unit_spec(u);
    }
    b.build()
}

/// Losses (rank 0's) of a few SGD steps at world size 4 under `strategy` and `mp` (with the
/// grad scaler), and every rank's gathered parameters.
fn train_ws4(strategy: ShardingStrategy, mp: MixedPrecision) -> (Vec<f32>, Vec<Params>) {
    let data = batches(4, 16, 31);
    let out = run_ranks_ok(4, ThreadGroupConfig::default(), |pg| {
        let rank = pg.rank();
        let mut m = model(pg, strategy, mp)?;
        let mut opt = Sgd::new(SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            ..Default::default()
        });
        // The scaler under every policy (a power of two: exact in f32); f16 needs it.
        let mut scaler = ShardedGradScaler::new(GradScalerConfig {
            init_scale: 1024.0,
            ..Default::default()
        })?;
        let mut losses = Vec::new();
        for (x, y) in &data {
            let logits = m.forward(&x.narrow(0, rank * 4, 4)?)?;
            let loss = candle_nn::loss::cross_entropy(
                &logits.to_dtype(DType::F32)?,
                &y.narrow(0, rank * 4, 4)?,
            )?;
            m.backward(&scaler.scale_loss(&loss)?)?;
            assert!(scaler.step(&mut m, &mut opt)?, "no overflow expected");
            m.zero_grad();
            losses.push(loss.to_scalar::<f32>()?);
        }
        let params = m.gather_full_params(false)?.expect("every rank gathers");
        Ok((
            losses,
            params
                .into_iter()
                .map(|(k, t)| (k, to_vec(&t)))
                .collect::<Vec<_>>(),
        ))
    })
    .unwrap();
    let losses = out[0].0.clone();
    (losses, out.into_iter().map(|(_, p)| p).collect())
}

#[test]
fn every_precision_tracks_full_shard_and_replicas_stay_identical() {
    for (name, mp, tol) in [
        ("f32", MixedPrecision::full_f32(), 1e-5),
        (
            "bf16 compute, f32 reduce",
            MixedPrecision::bf16_compute_f32_reduce(),
            1e-5,
        ),
        // A reduction in 16 bits rounds once per stage here (shard group, then replicas)
        // against once under FULL_SHARD: differences of the order of bf16's / f16's epsilon.
        ("bf16", MixedPrecision::bf16(), 0.03),
        ("f16", MixedPrecision::f16(), 0.01),
    ] {
        let (want, _) = train_ws4(ShardingStrategy::FullShard, mp);
        let (got, params) = train_ws4(hybrid(2), mp);
        for (a, b) in got.iter().zip(&want) {
            assert!(
                ((a - b) / b).abs() <= tol,
                "{name}: hybrid {got:?} vs full shard {want:?}"
            );
        }
        assert_ne!(got[0], got[3], "{name}: training moved the loss");
        // Every rank of every replica holds bitwise the same parameters.
        for (r, p) in params.iter().enumerate() {
            assert!(*p == params[0], "{name}: rank {r} differs from rank 0");
        }
    }
}

/// Sharded bytes per rank and bytes sent by rank 0 in one training step (forward + backward +
/// optimizer), over every group the model uses, and the bytes of one reduced chunk (shard and
/// presence flags, f32) of every unit with parameters.
fn footprint(ws: usize, strategy: ShardingStrategy) -> (usize, [u64; 3], u64) {
    let x = batches(1, 4 * ws, 3).remove(0).0;
    run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
        let rank = pg.rank();
        let mut m = model(pg.clone(), strategy, MixedPrecision::full_f32())?;
        let groups = |m: &FsdpModel| {
            let mut g = vec![m.process_group().clone()];
            if let Some(r) = m.replica_group() {
                g.push(m.shard_group().clone());
                g.push(r.clone());
            }
            g
        };
        let sent = |m: &FsdpModel| {
            groups(m).iter().fold([0u64; 3], |acc, g| {
                let s = g.stats();
                [
                    acc[0] + s.all_gather_bytes,
                    acc[1] + s.reduce_scatter_bytes,
                    acc[2] + s.other_bytes,
                ]
            })
        };
        let before = sent(&m);
        let y = m.forward(&x.narrow(0, rank * 4, 4)?)?;
        m.backward(&y.sum_all()?)?;
        Sgd::new(SgdConfig::default()).step(&mut m)?;
        let after = sent(&m);
        let bytes = [0, 1, 2].map(|i| after[i] - before[i]);
        let chunks = m
            .shards()
            .filter(|u| u.layout.padded_numel > 0)
            .map(|u| 4 * (u.layout.shard_numel + u.layout.params.len()) as u64)
            .sum();
        Ok((m.memory_stats().sharded_bytes, bytes, chunks))
    })
    .unwrap()
    .remove(0)
}

#[test]
fn each_rank_holds_and_sends_what_its_shard_group_would() {
    // 2 × 2: the sharded state (parameter + gradient shards) of FULL_SHARD at world size 2,
    // twice FULL_SHARD's at 4; the all-gathers and reduce-scatters of world size 2; one
    // all-reduce of the reduced shards (and their presence flags) across the 2 replicas.
    let (full4, full4_sent, _) = footprint(4, ShardingStrategy::FullShard);
    let (full2, full2_sent, _) = footprint(2, ShardingStrategy::FullShard);
    let (hyb, hyb_sent, chunks) = footprint(4, hybrid(2));
    assert_eq!(hyb, full2);
    assert!(hyb > full4 && hyb <= 2 * full4 + 64, "{hyb} vs {full4}");
    assert_eq!(hyb_sent[0], full2_sent[0], "all-gather bytes");
    assert_eq!(hyb_sent[1], full2_sent[1], "reduce-scatter bytes");
    // The replica all-reduce carries each reduced chunk: one shard + flags per unit, f32.
    assert!(chunks > 0);
    assert_eq!(
        hyb_sent[2] - full2_sent[2],
        chunks,
        "replica all-reduce bytes"
    );
    assert!(full4_sent[0] < full2_sent[0]);
}

#[test]
fn a_bad_or_disagreeing_shard_size_is_a_clear_error() {
    let e = run_ranks_ok(6, ThreadGroupConfig::default(), |pg| {
        model(pg, hybrid(4), MixedPrecision::full_f32()).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("shard size 4 does not divide the world size 6"),
        "{e}"
    );
    let e = run_ranks_ok(4, ThreadGroupConfig::default(), |pg| {
        let s = if pg.rank() == 3 { 4 } else { 2 };
        model(pg, hybrid(s), MixedPrecision::full_f32()).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("different HYBRID_SHARD shard sizes"), "{e}");
}

#[test]
fn strategy_names_parse_and_print_back() {
    for (s, want) in [
        (
            "hybrid-shard",
            ShardingStrategy::HybridShard { shard_size: None },
        ),
        ("HYBRID_SHARD:4", hybrid(4)),
        (
            "_hybrid_shard_zero2",
            ShardingStrategy::HybridShardGradOp { shard_size: None },
        ),
        (
            "hybrid-shard-grad-op:2",
            ShardingStrategy::HybridShardGradOp {
                shard_size: Some(2),
            },
        ),
        ("full-shard", ShardingStrategy::FullShard),
    ] {
        let got: ShardingStrategy = s.parse().unwrap();
        assert_eq!(got, want, "{s}");
        assert_eq!(got.to_string().parse::<ShardingStrategy>().unwrap(), got);
    }
    assert_eq!(hybrid(4).to_string(), "hybrid-shard:4");
    for bad in ["hybrid-shard:0", "hybrid-shard:x", "full-shard:2", "hybrid"] {
        assert!(bad.parse::<ShardingStrategy>().is_err(), "{bad}");
    }
}

/// Two SGD steps at world size 4 under `strategy` with `reshard_after_forward_ranks = k`:
/// rank 0's losses, every rank's gathered parameters, the bytes left unsharded after the first
/// forward (measured, and planned by `memory_plan`), and the shard group's all-gathers in the
/// first step.
fn partial_run(
    strategy: ShardingStrategy,
    k: Option<usize>,
) -> (Vec<f32>, Vec<Params>, [usize; 2], u64) {
    let data = batches(2, 16, 41);
    let out = run_ranks_ok(4, ThreadGroupConfig::default(), |pg| {
        let rank = pg.rank();
        let mut m = model_with(
            pg.clone(),
            FsdpConfig {
                sharding_strategy: strategy,
                reshard_after_forward_ranks: k,
                ..Default::default()
            },
        )?;
        let mut opt = Sgd::new(SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            ..Default::default()
        });
        let planned = m.memory_plan(0, 0).unsharded_bytes;
        let (mut losses, mut after_forward, mut gathers) = (Vec::new(), 0, 0);
        for (step, (x, y)) in data.iter().enumerate() {
            let before = m.shard_group().stats().all_gather_calls;
            let logits = m.forward(&x.narrow(0, rank * 4, 4)?)?;
            if step == 0 {
                after_forward = m.memory_stats().unsharded_bytes;
            }
            let loss = candle_nn::loss::cross_entropy(&logits, &y.narrow(0, rank * 4, 4)?)?;
            m.backward(&loss)?;
            if step == 0 {
                gathers = m.shard_group().stats().all_gather_calls - before;
            }
            opt.step(&mut m)?;
            m.zero_grad();
            losses.push(loss.to_scalar::<f32>()?);
        }
        assert_eq!(m.memory_stats().unsharded_bytes, 0, "pieces dropped");
        let params = m.gather_full_params(false)?.expect("every rank gathers");
        let params = params.into_iter().map(|(n, t)| (n, to_vec(&t))).collect();
        Ok((losses, params, [after_forward, planned], gathers))
    })
    .unwrap();
    let (losses, _, after_forward, gathers) = out[0].clone();
    (
        losses,
        out.into_iter().map(|o| o.1).collect(),
        after_forward,
        gathers,
    )
}

#[test]
fn partial_reshard_after_forward_is_bitwise_full_shard_with_a_smaller_backward_gather() {
    // FULL_SHARD over 4 ranks keeping halves (pairs of ranks) between forward and backward;
    // HYBRID 2 × 2 keeping whole copies (k = 1: no backward gather at all).
    for (strategy, k) in [(ShardingStrategy::FullShard, 2), (hybrid(2), 1)] {
        let (want, want_params, [full_bytes, full_plan], full_gathers) =
            partial_run(strategy, None);
        let (got, params, [bytes, plan], gathers) = partial_run(strategy, Some(k));
        assert_eq!(got, want, "{strategy} k={k}: losses");
        assert!(params == want_params, "{strategy} k={k}: parameters");
        // Each unit with parameters keeps 1/k of its gathered flat buffer (f32) after forward.
        let shard = if strategy.is_hybrid() { 2 } else { 4 };
        let kept: usize = partial_layouts()
            .iter()
            .map(|&n| 4 * n.div_ceil(shard) * shard / k)
            .sum();
        assert_eq!(bytes - full_bytes, kept, "{strategy} k={k}: bytes kept");
        // The memory plan counts them.
        assert_eq!(plan - full_plan, kept, "{strategy} k={k}: bytes planned");
        // The backward's gathers left the shard group for the smaller one.
        assert!(
            gathers < full_gathers,
            "{strategy} k={k}: {gathers} vs {full_gathers}"
        );
    }
    let e = run_ranks_ok(4, ThreadGroupConfig::default(), |pg| {
        let config = FsdpConfig {
            reshard_after_forward_ranks: Some(3),
            ..Default::default()
        };
        model_with(pg, config).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("reshard_after_forward_ranks 3 does not divide the shard group's 4 ranks"),
        "{e}"
    );
}

/// Unpadded parameter elements of each unit of `units()` that has parameters.
fn partial_layouts() -> Vec<usize> {
    let out = run_ranks_ok(1, ThreadGroupConfig::default(), |pg| {
        let m = model(pg, ShardingStrategy::FullShard, MixedPrecision::full_f32())?;
        Ok(m.shards()
            .map(|u| u.layout.unpadded_numel)
            .filter(|&n| n > 0)
            .collect::<Vec<_>>())
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

#[test]
fn the_default_shard_size_is_the_ranks_of_one_machine() {
    // Thread ranks all run on this machine: one shard group of the whole world, no replicas
    // (FULL_SHARD's layout). Under mpirun or torchrun the size is the launcher's local size.
    let out = run_ranks_ok(4, ThreadGroupConfig::default(), |pg| {
        let strategy = ShardingStrategy::HybridShard { shard_size: None };
        let m = model(pg, strategy, MixedPrecision::full_f32())?;
        Ok((
            m.shard_group().world_size(),
            m.replica_group().is_none(),
            m.shards().map(|u| u.layout.world_size).max(),
            m.config().sharding_strategy,
        ))
    })
    .unwrap();
    assert!(
        out.iter().all(|&o| o == (4, true, Some(4), hybrid(4))),
        "{out:?}"
    );
}
