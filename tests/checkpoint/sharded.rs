//! Sharded checkpoints: exact round trips at world sizes 1–4, loads at another world size or
//! sharding strategy (4→2, 2→3, 3→1, …), resume equal to training straight through (bitwise),
//! failed and killed saves that keep the previous checkpoint, rotation, and clear errors for
//! every kind of bad input; a GPT with a tied head and frozen parameters (tests/common/user_gpt.rs)
//! saved at world size 2 and continued at world size 3 trains like uninterrupted plain Candle.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{Device, Tensor};
use candle_fsdp::checkpoint::{
    self, fault, list_complete, load_latest, load_sharded, read_meta, save_sharded, RngState,
    SamplerState, TrainState,
};
use candle_fsdp::comm::threads::{run_ranks, run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::ProcessGroup;
use candle_fsdp::optim::{
    AdamW, AdamWConfig, BufferKind, OptimizerState, ShardedOptimizer, UnitOptimState,
};
use candle_fsdp::unit::UnitSpec;
use candle_fsdp::{FsdpConfig, FsdpModel, ShardingStrategy};

use common::*;

fn tmpdir(tag: &str) -> PathBuf {
    let d = common::tmpdir(&format!("ckpt-{tag}"));
    d
}

fn specs() -> Vec<UnitSpec> {
    units_with_buffer()
}

fn model_from(
    pg: Arc<dyn ProcessGroup>,
    specs: Vec<UnitSpec>,
    seed: u64,
    strategy: ShardingStrategy,
) -> candle_fsdp::Result<FsdpModel> {
    let mut b = FsdpModel::builder(
        pg,
        FsdpConfig {
            seed,
            sharding_strategy: strategy,
            ..Default::default()
        },
    );
    for u in specs {
        b = b.unit_spec(u);
    }
    b.build()
}

fn model(pg: Arc<dyn ProcessGroup>) -> candle_fsdp::Result<FsdpModel> {
    model_from(pg, specs(), 7, ShardingStrategy::FullShard)
}

/// Sets every buffer to values that depend on its name only (as training would change them).
fn set_buffers(model: &FsdpModel) -> candle_fsdp::Result<()> {
    for u in model.shards() {
        for (name, var) in u.buffers {
            let n = var.elem_count();
            let v: Vec<f32> = (0..n).map(|i| 0.01 * (i + name.len()) as f32).collect();
            var.set(&Tensor::from_vec(v, var.shape(), &Device::Cpu)?.to_dtype(var.dtype())?)?;
        }
    }
    Ok(())
}

fn buffers(model: &FsdpModel) -> Vec<(String, Vec<f32>)> {
    model
        .shards()
        .flat_map(|u| {
            u.buffers
                .iter()
                .map(|(n, v)| (n.clone(), to_vec(v.as_tensor())))
        })
        .collect()
}

/// Trains on the global batches `data`, each rank on its contiguous part of each batch.
fn train(
    model: &mut FsdpModel,
    opt: &mut AdamW,
    data: &[(Tensor, Tensor)],
) -> candle_fsdp::Result<()> {
    let (rank, ws) = (
        model.process_group().rank(),
        model.process_group().world_size(),
    );
    for (x, y) in data {
        let per_rank = x.dim(0)? / ws;
        let logits = model.forward(&x.narrow(0, rank * per_rank, per_rank)?)?;
        let loss =
            candle_nn::loss::cross_entropy(&logits, &y.narrow(0, rank * per_rank, per_rank)?)?;
        model.backward(&loss)?;
        opt.step(model)?;
        model.zero_grad();
    }
    Ok(())
}

fn shards(model: &FsdpModel) -> Vec<Vec<f32>> {
    model.shards().map(|u| to_vec(u.param)).collect()
}

fn at_step(step: u64) -> TrainState {
    TrainState {
        step,
        ..Default::default()
    }
}

/// One rank's view: shards, optimizer state, and per unit (unpadded, shard length).
type RankView = (Vec<Vec<f32>>, OptimizerState, Vec<(usize, usize)>);

fn view(model: &FsdpModel, opt: &AdamW) -> RankView {
    (
        shards(model),
        opt.state().unwrap(),
        model
            .shards()
            .map(|u| (u.layout.unpadded_numel, u.layout.shard_numel))
            .collect(),
    )
}

/// The unsharded flat buffers (without padding) of every unit: parameters and each optimizer
/// buffer kind, from all ranks' shards concatenated in rank order (the first rank's alone
/// under NO_SHARD). Checks that the padding is zero.
fn unsharded(views: &[RankView], no_shard: bool) -> BTreeMap<String, Vec<f32>> {
    let ranks = if no_shard { &views[..1] } else { views };
    let (_, _, layout) = &views[0];
    let mut out = BTreeMap::new();
    let mut add = |key: String, pieces: Vec<&Vec<f32>>, unpadded: usize| {
        let mut full: Vec<f32> = pieces.into_iter().flatten().copied().collect();
        assert!(
            full[unpadded..].iter().all(|&v| v == 0.0),
            "padding of {key} not zero"
        );
        full.truncate(unpadded);
        out.insert(key, full);
    };
    for (k, &(unpadded, _)) in layout.iter().enumerate() {
        add(
            format!("param.{k}"),
            ranks.iter().map(|v| &v.0[k]).collect(),
            unpadded,
        );
        for kind in [BufferKind::ExpAvg, BufferKind::ExpAvgSq] {
            let key = format!("{kind}.{k}");
            if views[0]
                .1
                .units
                .get(k)
                .is_some_and(|u| u.buffers.contains_key(&kind))
            {
                add(
                    key.clone(),
                    ranks.iter().map(|v| &v.1.units[k].buffers[&kind]).collect(),
                    unpadded,
                );
            }
        }
    }
    out
}

#[test]
fn sharded_round_trip_at_world_sizes_1_to_4() {
    for ws in 1..=4 {
        let dir = tmpdir(&format!("roundtrip{ws}"));
        let data = batches(2, 4 * ws, 11);
        let state = TrainState {
            step: 2,
            epoch: 1,
            sampler: Some(SamplerState {
                epoch: 1,
                position: 8,
                world_size: ws,
            }),
            rng: Some(RngState { seed: 7 }),
            grad_scaler: Some(serde_json::json!({"scale": 1024.0, "growth_tracker": 3})),
            mixed_precision: None,
            extra: BTreeMap::from([("note".to_string(), "hello".to_string())]),
            ..Default::default()
        };
        let saved = run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
            let mut m = model(pg)?;
            let mut opt = AdamW::new(AdamWConfig::default());
            train(&mut m, &mut opt, &data)?;
            set_buffers(&m)?;
            let path = save_sharded(&dir, &m, &opt, &state, 0)?;
            Ok((path, shards(&m), opt.state()?, buffers(&m)))
        })
        .unwrap();
        let path = saved[0].0.clone();
        assert_eq!(path, dir.join("step-00000002"));
        assert_eq!(list_complete(&dir).unwrap(), vec![path.clone()]);
        // Nothing but the checkpoint is left under the root.
        let entries: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(entries, vec!["step-00000002"]);
        let meta = read_meta(&path).unwrap();
        assert_eq!(meta.format_version, checkpoint::FORMAT_VERSION);
        assert_eq!(meta.world_size, ws);
        assert_eq!(meta.files.len(), ws);
        assert_eq!(meta.units.len(), 6);
        assert_eq!(meta.units[4].params[0].name, "head.weight");
        assert_eq!(meta.units[3].buffers[0].name, "shift.running_mean");
        assert_eq!(meta.train.sampler, state.sampler);
        assert_eq!(meta.train.grad_scaler, state.grad_scaler);
        assert_eq!(meta.train.extra, state.extra);
        assert!(meta.train.mixed_precision.is_some(), "policy recorded");
        assert_eq!(meta.optimizer.as_ref().unwrap().step, 2);
        // A fresh group with differently initialised models loads it exactly.
        let loaded = run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
            let mut m = model_from(pg, specs(), 99, ShardingStrategy::FullShard)?;
            let mut opt = AdamW::new(AdamWConfig::default());
            let l = load_latest(&dir, &mut m, &mut opt)?.expect("a checkpoint");
            Ok((l, shards(&m), opt.state()?, buffers(&m)))
        })
        .unwrap();
        for (r, (s, l)) in saved.iter().zip(&loaded).enumerate() {
            assert_eq!(s.1, l.1, "ws {ws} rank {r}: shards");
            assert_eq!(s.2, l.2, "ws {ws} rank {r}: optimizer state");
            assert_eq!(s.3, l.3, "ws {ws} rank {r}: buffers");
            let l = &l.0;
            assert_eq!(l.meta.train.step, 2);
            assert_eq!(l.meta.train.epoch, 1);
            assert_eq!(l.meta.train.rng, Some(RngState { seed: 7 }));
            assert_eq!(l.dir, path);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Saves after two steps at `from` (strategy `sa`), loads at `to` (strategy `sb`): the unsharded
/// parameters and optimizer state are bitwise equal, each rank read exactly the bytes of its
/// own new shard, and one more step from either is the same up to rounding.
fn reshard_case(from: usize, sa: ShardingStrategy, to: usize, sb: ShardingStrategy) {
    let dir = tmpdir(&format!("reshard{from}{to}{sa}{sb}"));
    // A global batch of 12 splits evenly over 1, 2, 3 and 4 ranks.
    let data = batches(3, 12, 5);
    let saved = run_ranks_ok(from, ThreadGroupConfig::default(), |pg| {
        let mut m = model_from(pg, specs(), 7, sa)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        train(&mut m, &mut opt, &data[..2])?;
        set_buffers(&m)?;
        save_sharded(&dir, &m, &opt, &at_step(2), 0)?;
        let v = view(&m, &opt);
        train(&mut m, &mut opt, &data[2..])?;
        Ok((v, m.gather_full_params(false)?.unwrap(), buffers(&m)))
    })
    .unwrap();
    let loaded = run_ranks_ok(to, ThreadGroupConfig::default(), |pg| {
        let mut m = model_from(pg, specs(), 99, sb)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        let l = load_latest(&dir, &mut m, &mut opt)?.expect("a checkpoint");
        let v = view(&m, &opt);
        // Bytes of this rank's new shard: the parameter elements it holds, once for the
        // parameters and once per optimizer buffer kind, plus the buffers (read by every rank).
        let own: usize = m
            .shards()
            .map(|u| {
                u.layout
                    .shard_table(u.shard_index)
                    .iter()
                    .map(|e| e.numel_in_shard)
                    .sum::<usize>()
            })
            .sum();
        let buf_bytes = 4 * m
            .shards()
            .flat_map(|u| u.buffers)
            .map(|(_, v)| v.elem_count())
            .sum::<usize>();
        assert_eq!(
            l.stats.data_bytes as usize,
            4 * own * 3 + buf_bytes,
            "rank {} read other ranks' data",
            m.process_group().rank()
        );
        let bufs = buffers(&m);
        train(&mut m, &mut opt, &data[2..])?;
        Ok((v, m.gather_full_params(false)?.unwrap(), bufs))
    })
    .unwrap();
    // The ranks holding distinct shards: one shard group under the hybrid strategies.
    let holders = |ws: usize, s: ShardingStrategy| s.shard_size().unwrap_or(ws);
    let a: Vec<_> = saved[..holders(from, sa)]
        .iter()
        .map(|s| s.0.clone())
        .collect();
    let b: Vec<_> = loaded[..holders(to, sb)]
        .iter()
        .map(|s| s.0.clone())
        .collect();
    // Every replica holds what the first one holds.
    for (r, s) in saved.iter().enumerate() {
        assert!(
            s.0 == a[r % a.len()],
            "{from} {sa}: rank {r}'s replica differs"
        );
    }
    for (r, l) in loaded.iter().enumerate() {
        assert!(
            l.0 == b[r % b.len()],
            "{to} {sb}: rank {r}'s replica differs"
        );
    }
    let (ua, ub) = (
        unsharded(&a, sa == ShardingStrategy::NoShard),
        unsharded(&b, sb == ShardingStrategy::NoShard),
    );
    assert_eq!(ua.keys().collect::<Vec<_>>(), ub.keys().collect::<Vec<_>>());
    for (k, v) in &ua {
        assert!(
            v == &ub[k],
            "{from} {sa:?} -> {to} {sb:?}: {k} differs after resharding"
        );
    }
    assert_eq!(saved[0].2, loaded[0].2, "buffers");
    for (r, l) in loaded.iter().enumerate() {
        assert_eq!(l.2, loaded[0].2, "rank {r} buffers");
    }
    // One more step on the same global batch at both world sizes: equal up to the order of
    // float reductions.
    for ((na, ta), (nb, tb)) in saved[0].1.iter().zip(&loaded[0].1) {
        assert_eq!(na, nb);
        let e = rel_err(&to_vec(tb), &to_vec(ta));
        assert!(
            e < 1e-5,
            "{from} -> {to}: {na} after one more step: rel err {e}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sharded_loads_across_world_sizes() {
    use ShardingStrategy::*;
    for (from, to) in [(4, 2), (2, 3), (3, 1), (1, 4), (4, 3)] {
        reshard_case(from, FullShard, to, FullShard);
    }
}

#[test]
fn sharded_loads_across_sharding_strategies() {
    use ShardingStrategy::*;
    reshard_case(2, NoShard, 3, FullShard);
    reshard_case(3, FullShard, 2, NoShard);
    reshard_case(2, ShardGradOp, 4, FullShard);
}

#[test]
fn hybrid_checkpoints_load_at_any_world_size_and_strategy_and_back() {
    use ShardingStrategy::*;
    let h = |s| HybridShard {
        shard_size: Some(s),
    };
    // HYBRID 2 replicas × 2 → FULL_SHARD at 3 → HYBRID 2 × 3; 3 × 2 → 2 × 2; each link
    // bit-exact (parameters and optimizer state).
    reshard_case(4, h(2), 3, FullShard);
    reshard_case(3, FullShard, 6, h(3));
    reshard_case(6, h(2), 4, h(2));
    // Replicas write once: the checkpoint of 3 replicas × 2 is the shard group's, 2 files.
    let dir = tmpdir("hybrid-files");
    run_ranks_ok(6, ThreadGroupConfig::default(), |pg| {
        let m = model_from(pg, specs(), 7, h(2))?;
        let opt = AdamW::new(AdamWConfig::default());
        save_sharded(&dir, &m, &opt, &at_step(1), 0).map(|_| ())
    })
    .unwrap();
    let step = dir.join("step-00000001");
    let meta = read_meta(&step).unwrap();
    assert_eq!((meta.world_size, meta.files.len()), (2, 2));
    assert_eq!(meta.strategy.as_deref(), Some("hybrid-shard"));
    let mut files: Vec<String> = std::fs::read_dir(&step)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "meta.json",
            "shard-00000-of-00002.safetensors",
            "shard-00001-of-00002.safetensors"
        ]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resume_is_bitwise_equal_to_training_straight_through() {
    for ws in [1, 2, 3] {
        let dir = tmpdir(&format!("resume{ws}"));
        let data = batches(6, 4 * ws, 3);
        let (first, rest) = data.split_at(3);
        // N + M steps straight.
        let straight = run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
            let mut m = model(pg)?;
            let mut opt = AdamW::new(AdamWConfig::default());
            train(&mut m, &mut opt, &data)?;
            Ok((shards(&m), opt.state()?))
        })
        .unwrap();
        // N steps, save; a fresh group loads and trains M steps.
        run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
            let mut m = model(pg)?;
            let mut opt = AdamW::new(AdamWConfig::default());
            train(&mut m, &mut opt, first)?;
            save_sharded(&dir, &m, &opt, &at_step(opt.state()?.step), 0)?;
            Ok(())
        })
        .unwrap();
        let resumed = run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
            let mut m = model(pg)?;
            let mut opt = AdamW::new(AdamWConfig::default());
            let loaded = load_latest(&dir, &mut m, &mut opt)?.expect("a checkpoint");
            assert_eq!(loaded.meta.train.step, 3);
            assert_eq!(loaded.meta.world_size, ws);
            train(&mut m, &mut opt, rest)?;
            Ok((shards(&m), opt.state()?))
        })
        .unwrap();
        assert_eq!(resumed, straight, "ws {ws}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

fn names(d: &Path) -> Vec<String> {
    list_complete(d)
        .unwrap()
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect()
}

/// Loads the newest checkpoint under `dir` at world size 2 and returns its step.
fn load_step(dir: &Path) -> u64 {
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        Ok(load_latest(dir, &mut m, &mut opt)?.unwrap().meta.train.step)
    })
    .unwrap()[0]
}

#[test]
fn failed_save_keeps_the_previous_checkpoint_and_rotation_keeps_last_k() {
    let dir = tmpdir("rotate");
    let data = batches(4, 8, 1);
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg.clone())?;
        let mut opt = AdamW::new(AdamWConfig::default());
        for step in 0..4 {
            train(&mut m, &mut opt, &data[step..step + 1])?;
            save_sharded(&dir, &m, &opt, &at_step(opt.state()?.step), 2)?;
        }
        Ok(())
    })
    .unwrap();
    assert_eq!(names(&dir), vec!["step-00000003", "step-00000004"]);
    // A save that fails half way (rank 1's write fails after 100 bytes, as on a full disk)
    // errors on every rank and leaves step 4 the newest complete checkpoint.
    let results = run_ranks(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg.clone())?;
        let mut opt = AdamW::new(AdamWConfig::default());
        load_latest(&dir, &mut m, &mut opt)?;
        train(&mut m, &mut opt, &data[..1])?;
        if pg.rank() == 1 {
            fault::fail_writes_after(100, false);
        }
        let r = save_sharded(&dir, &m, &opt, &at_step(5), 2).map(|_| ());
        fault::disarm();
        r
    });
    assert!(results.iter().all(|r| r.is_err()), "{results:?}");
    let e1 = results[1].as_ref().unwrap_err().to_string();
    assert!(
        e1.contains("shard-00001-of-00002.safetensors") && e1.contains("injected"),
        "{e1}"
    );
    let e0 = results[0].as_ref().unwrap_err().to_string();
    assert!(e0.contains("rank(s) [1]"), "{e0}");
    assert!(!dir.join("step-00000005").exists());
    assert!(
        !dir.join(".step-00000005.partial").exists(),
        "staging removed"
    );
    assert_eq!(names(&dir), vec!["step-00000003", "step-00000004"]);
    // And it still loads.
    assert_eq!(load_step(&dir), 4);
    // The group survived the failed save: the same ranks can save again.
    let results = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg.clone())?;
        let mut opt = AdamW::new(AdamWConfig::default());
        load_latest(&dir, &mut m, &mut opt)?;
        if pg.rank() == 0 {
            fault::fail_writes_after(10, false);
        }
        let failed = save_sharded(&dir, &m, &opt, &at_step(5), 2).is_err();
        fault::disarm();
        save_sharded(&dir, &m, &opt, &at_step(5), 2)?;
        Ok(failed)
    })
    .unwrap();
    assert_eq!(results, vec![true, true]);
    assert_eq!(names(&dir), vec!["step-00000004", "step-00000005"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn save_killed_half_way_leaves_the_previous_checkpoint_loadable() {
    let dir = tmpdir("killed");
    let data = batches(2, 8, 2);
    let shard_bytes = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        train(&mut m, &mut opt, &data[..1])?;
        let d = save_sharded(&dir, &m, &opt, &at_step(1), 0)?;
        Ok(read_meta(&d)?.files[1].bytes)
    })
    .unwrap()[0];
    // "Kill" the next save: rank 1's write stops half way through its file and nothing is
    // cleaned up (crash mode on both ranks), as after kill -9.
    let results = run_ranks(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg.clone())?;
        let mut opt = AdamW::new(AdamWConfig::default());
        load_latest(&dir, &mut m, &mut opt)?;
        train(&mut m, &mut opt, &data[1..])?;
        let budget = if pg.rank() == 1 {
            shard_bytes / 2
        } else {
            u64::MAX
        };
        fault::fail_writes_after(budget, true);
        let r = save_sharded(&dir, &m, &opt, &at_step(2), 0).map(|_| ());
        fault::disarm();
        r
    });
    assert!(results.iter().all(|r| r.is_err()), "{results:?}");
    // The debris of the killed save is there, but it is not a checkpoint.
    let staging = dir.join(".step-00000002.partial");
    let debris: Vec<String> = std::fs::read_dir(&staging)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        debris.iter().any(|n| n.contains(".tmp-")),
        "half-written temporary file left: {debris:?}"
    );
    assert!(!staging.join("meta.json").exists());
    assert_eq!(names(&dir), vec!["step-00000001"]);
    assert_eq!(load_step(&dir), 1);
    // The restarted job saves step 2 over the debris.
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        load_latest(&dir, &mut m, &mut opt)?;
        train(&mut m, &mut opt, &data[1..])?;
        save_sharded(&dir, &m, &opt, &at_step(2), 0)?;
        Ok(())
    })
    .unwrap();
    assert!(!staging.exists());
    assert_eq!(names(&dir), vec!["step-00000001", "step-00000002"]);
    assert_eq!(load_step(&dir), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_failure_while_writing_the_metadata_keeps_the_previous_checkpoint() {
    let dir = tmpdir("metafail");
    let data = batches(1, 8, 2);
    let rank0_bytes = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        train(&mut m, &mut opt, &data)?;
        let d = save_sharded(&dir, &m, &opt, &at_step(1), 0)?;
        Ok(read_meta(&d)?.files[0].bytes)
    })
    .unwrap()[0];
    let before = std::fs::read(dir.join("step-00000001/meta.json")).unwrap();
    // Saving the same step again: rank 0's shard file gets written, its meta.json does not.
    let results = run_ranks(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg.clone())?;
        let mut opt = AdamW::new(AdamWConfig::default());
        load_latest(&dir, &mut m, &mut opt)?;
        if pg.rank() == 0 {
            fault::fail_writes_after(rank0_bytes + 20, false);
        }
        let state = TrainState {
            epoch: 9,
            ..at_step(1)
        };
        let r = save_sharded(&dir, &m, &opt, &state, 0).map(|_| ());
        fault::disarm();
        r
    });
    assert!(results.iter().all(|r| r.is_err()), "{results:?}");
    let e = results[0].as_ref().unwrap_err().to_string();
    assert!(e.contains("meta.json"), "{e}");
    assert_eq!(
        std::fs::read(dir.join("step-00000001/meta.json")).unwrap(),
        before,
        "the previous checkpoint of the same step is untouched"
    );
    assert_eq!(load_step(&dir), 1);
    // Saving the same step again successfully replaces it.
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let m = model(pg)?;
        let opt = AdamW::new(AdamWConfig::default());
        let state = TrainState {
            epoch: 9,
            ..at_step(1)
        };
        save_sharded(&dir, &m, &opt, &state, 0)
    })
    .unwrap();
    assert_eq!(
        read_meta(&dir.join("step-00000001")).unwrap().train.epoch,
        9
    );
    let entries: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(entries, vec!["step-00000001"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Loads `ckpt` at world size `ws` with the model built from `specs`; returns rank 0's error.
fn load_err(ckpt: &Path, ws: usize, specs: fn() -> Vec<UnitSpec>) -> String {
    let ckpt = ckpt.to_path_buf();
    run_ranks(ws, ThreadGroupConfig::default(), move |pg| {
        let mut m = model_from(pg, specs(), 7, ShardingStrategy::FullShard)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        load_sharded(&ckpt, &mut m, &mut opt).map(|_| ())
    })
    .remove(0)
    .unwrap_err()
    .to_string()
}

/// Saves a fresh checkpoint (one training step, so the optimizer has state) at world size 2.
fn fresh_checkpoint(dir: &Path) -> PathBuf {
    let _ = std::fs::remove_dir_all(dir);
    let data = batches(1, 8, 4);
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        train(&mut m, &mut opt, &data)?;
        save_sharded(dir, &m, &opt, &at_step(1), 0)
    })
    .unwrap()
    .remove(0)
}

/// Rewrites one tensor of a shard file (and the recorded file size).
fn rewrite_tensor(
    ckpt: &Path,
    file: &str,
    tensor: &str,
    dtype: safetensors::Dtype,
    data: Vec<u8>,
    shape: Vec<usize>,
) {
    let path = ckpt.join(file);
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != tensor)
        .collect();
    tensors.push((
        tensor.to_string(),
        safetensors::tensor::TensorView::new(dtype, shape, &data).unwrap(),
    ));
    let out = safetensors::serialize(tensors, None).unwrap();
    std::fs::write(&path, &out).unwrap();
    let meta_path = ckpt.join("meta.json");
    let mut meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&meta_path).unwrap()).unwrap();
    for f in meta["files"].as_array_mut().unwrap() {
        if f["name"] == file {
            f["bytes"] = serde_json::json!(out.len());
        }
    }
    std::fs::write(&meta_path, serde_json::to_vec_pretty(&meta).unwrap()).unwrap();
}

#[test]
fn bad_checkpoints_give_errors_naming_file_and_values() {
    let dir = tmpdir("bad");
    let ckpt = fresh_checkpoint(&dir);
    // A different world size is no longer an error: 2 → 3 reshards.
    let ok = run_ranks_ok(3, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        Ok(load_sharded(&ckpt, &mut m, &mut opt)?.meta.world_size)
    })
    .unwrap();
    assert_eq!(ok, vec![2, 2, 2]);

    // Truncated shard file.
    let shard0 = ckpt.join("shard-00000-of-00002.safetensors");
    let bytes = std::fs::read(&shard0).unwrap();
    std::fs::write(&shard0, &bytes[..bytes.len() / 2]).unwrap();
    let e = load_err(&ckpt, 2, specs);
    assert!(
        e.contains("shard-00000-of-00002.safetensors")
            && e.contains("corrupt")
            && e.contains(&format!("expected {} bytes", bytes.len()))
            && e.contains(&format!("found {}", bytes.len() / 2)),
        "{e}"
    );
    // Corrupt header (same size).
    let mut garbled = bytes.clone();
    garbled[8..24].copy_from_slice(b"#not json here!!");
    std::fs::write(&shard0, &garbled).unwrap();
    let e = load_err(&ckpt, 2, specs);
    assert!(
        e.contains("shard-00000-of-00002.safetensors") && e.contains("corrupt"),
        "{e}"
    );
    // Missing shard file.
    std::fs::remove_file(&shard0).unwrap();
    let e = load_err(&ckpt, 2, specs);
    assert!(
        e.contains("shard-00000-of-00002.safetensors") && e.contains("No such file"),
        "{e}"
    );
    std::fs::write(&shard0, &bytes).unwrap();

    // A tensor of the wrong dtype: the fc1 shard stored as F16.
    let ckpt = fresh_checkpoint(&dir);
    let file = "shard-00001-of-00002.safetensors";
    let n = read_meta(&ckpt).unwrap().units[1].shard_numel;
    rewrite_tensor(
        &ckpt,
        file,
        "param.1",
        safetensors::Dtype::F16,
        vec![0; 2 * n],
        vec![n],
    );
    let e = run_ranks(2, ThreadGroupConfig::default(), {
        let ckpt = ckpt.clone();
        move |pg| {
            let mut m = model(pg)?;
            let mut opt = AdamW::new(AdamWConfig::default());
            load_sharded(&ckpt, &mut m, &mut opt).map(|_| ())
        }
    })
    .remove(1)
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(file) && e.contains("param.1") && e.contains("expected dtype F32, found F16"),
        "{e}"
    );
    // A tensor of the wrong length.
    let ckpt = fresh_checkpoint(&dir);
    rewrite_tensor(
        &ckpt,
        file,
        "param.1",
        safetensors::Dtype::F32,
        vec![0; 4 * (n - 1)],
        vec![n - 1],
    );
    let e = run_ranks(2, ThreadGroupConfig::default(), {
        let ckpt = ckpt.clone();
        move |pg| {
            let mut m = model(pg)?;
            let mut opt = AdamW::new(AdamWConfig::default());
            load_sharded(&ckpt, &mut m, &mut opt).map(|_| ())
        }
    })
    .remove(1)
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(file)
            && e.contains("param.1")
            && e.contains(&format!("expected shape [{n}], found [{}]", n - 1)),
        "{e}"
    );

    // Parameters missing from the checkpoint (the model has one more unit).
    let ckpt = fresh_checkpoint(&dir);
    fn more() -> Vec<UnitSpec> {
        let mut s = specs();
        s.push(UnitSpec::new("extra", |vb| candle_nn::linear(3, 2, vb)));
        s
    }
    let e = load_err(&ckpt, 2, more);
    assert!(
        e.contains("meta.json")
            && e.contains("missing from the checkpoint")
            && e.contains("extra.weight (unit extra, shape [2, 3])")
            && e.contains("extra.bias"),
        "{e}"
    );
    // A parameter of the checkpoint the model does not have (no `scale` unit).
    fn fewer() -> Vec<UnitSpec> {
        let mut s = specs();
        s.pop();
        s
    }
    let e = load_err(&ckpt, 2, fewer);
    assert!(
        e.contains("meta.json")
            && e.contains("the model does not have")
            && e.contains("scale.w (parameter of unit scale, shape [1])"),
        "{e}"
    );
    // A shape mismatch.
    fn narrower() -> Vec<UnitSpec> {
        let mut s = specs();
        s[1] = UnitSpec::new("fc1", |vb| candle_nn::linear(20, 11, vb));
        s
    }
    let e = load_err(&ckpt, 2, narrower);
    assert!(
        e.contains("meta.json")
            && e.contains("fc1.weight")
            && e.contains("expects shape [11, 20], the checkpoint has [13, 20]"),
        "{e}"
    );
    // A missing buffer.
    fn no_buffer() -> Vec<UnitSpec> {
        let mut s = specs();
        s.remove(3);
        s
    }
    let e = load_err(&ckpt, 2, no_buffer);
    assert!(e.contains("shift.running_mean"), "{e}");

    // Corrupt metadata.
    let meta_path = ckpt.join("meta.json");
    let text = std::fs::read_to_string(&meta_path).unwrap();
    std::fs::write(&meta_path, &text[..text.len() / 2]).unwrap();
    let e = load_err(&ckpt, 2, specs);
    assert!(e.contains("meta.json") && e.contains("not valid"), "{e}");
    // Metadata from the future.
    std::fs::write(
        &meta_path,
        text.replace(
            &format!("\"format_version\": {}", checkpoint::FORMAT_VERSION),
            "\"format_version\": 99",
        ),
    )
    .unwrap();
    let e = load_err(&ckpt, 2, specs);
    assert!(
        e.contains("meta.json") && e.contains("99") && e.contains("newer"),
        "{e}"
    );
    // Overlapping parameters (a hand-edited offset).
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let unit = v["units"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|u| u["params"].as_array().unwrap().len() >= 2)
        .expect("a unit with two parameters");
    unit["params"][1]["offset"] = serde_json::json!(0);
    std::fs::write(&meta_path, serde_json::to_string(&v).unwrap()).unwrap();
    let e = load_err(&ckpt, 2, specs);
    assert!(e.contains("meta.json") && e.contains("overlap"), "{e}");
    // Missing metadata: not a checkpoint.
    std::fs::remove_file(&meta_path).unwrap();
    let e = load_err(&ckpt, 2, specs);
    assert!(e.contains("meta.json") && e.contains("No such file"), "{e}");
    assert!(list_complete(&dir).unwrap().is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn version_1_checkpoints_still_load() {
    let dir = tmpdir("v1");
    let data = batches(2, 8, 6);
    let saved = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model_from(pg, units(), 7, ShardingStrategy::FullShard)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        train(&mut m, &mut opt, &data)?;
        save_sharded(&dir, &m, &opt, &at_step(2), 0)?;
        Ok((shards(&m), opt.state()?))
    })
    .unwrap();
    // Rewrite meta.json the way version 1 wrote it.
    let ckpt = dir.join("step-00000002");
    let meta = read_meta(&ckpt).unwrap();
    let v1 = serde_json::json!({
        "format_version": 1,
        "world_size": 2,
        "step": 2,
        "epoch": 0,
        "units": meta.units.iter().map(|u| serde_json::json!({
            "name": u.name,
            "padded_numel": u.padded_numel,
            "shard_numel": u.shard_numel,
            "params": u.params.iter().map(|p| serde_json::json!({
                "name": p.name, "shape": p.shape, "offset": p.offset,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "extra": {},
    });
    std::fs::write(
        ckpt.join("meta.json"),
        serde_json::to_vec_pretty(&v1).unwrap(),
    )
    .unwrap();
    let loaded = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model_from(pg, units(), 99, ShardingStrategy::FullShard)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        let l = load_sharded(&ckpt, &mut m, &mut opt)?;
        assert_eq!(l.meta.format_version, 1);
        assert_eq!(l.meta.train.step, 2);
        Ok((shards(&m), opt.state()?))
    })
    .unwrap();
    assert_eq!(loaded, saved);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn saving_the_same_state_twice_gives_byte_identical_files() {
    let dir = tmpdir("deterministic");
    let data = batches(1, 8, 8);
    let dirs = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        train(&mut m, &mut opt, &data)?;
        let a = save_sharded(&dir.join("a"), &m, &opt, &at_step(1), 0)?;
        let b = save_sharded(&dir.join("b"), &m, &opt, &at_step(1), 0)?;
        Ok((a, b))
    })
    .unwrap();
    let (a, b) = &dirs[0];
    for name in [
        "shard-00000-of-00002.safetensors",
        "shard-00001-of-00002.safetensors",
    ] {
        assert!(
            std::fs::read(a.join(name)).unwrap() == std::fs::read(b.join(name)).unwrap(),
            "{name} differs"
        );
    }
    // meta.json: byte-identical but for the save time (the one field that must differ).
    let without_time = |d: &std::path::Path| {
        let text = std::fs::read_to_string(d.join("meta.json")).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert!(v["saved_at_unix_ms"].as_u64().unwrap() > 1_600_000_000_000);
        v["saved_at_unix_ms"] = serde_json::Value::Null;
        serde_json::to_vec_pretty(&v).unwrap()
    };
    assert!(without_time(a) == without_time(b), "meta.json differs");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn mixed_precision_runs_resume_bitwise_with_bf16_buffers() {
    use candle_fsdp::MixedPrecision;
    let policy = MixedPrecision {
        buffer_dtype: candle_core::DType::BF16,
        ..MixedPrecision::bf16()
    };
    let build = move |pg: Arc<dyn ProcessGroup>| {
        let mut b = FsdpModel::builder(
            pg,
            FsdpConfig {
                seed: 7,
                mixed_precision: policy,
                ..Default::default()
            },
        );
        for u in specs() {
            b = b.unit_spec(u);
        }
        b.build()
    };
    let dir = tmpdir("mixed");
    let data = batches(4, 8, 9);
    let straight = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = build(pg)?;
        set_buffers(&m)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        train(&mut m, &mut opt, &data)?;
        Ok((shards(&m), opt.state()?, buffers(&m)))
    })
    .unwrap();
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = build(pg)?;
        set_buffers(&m)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        train(&mut m, &mut opt, &data[..2])?;
        save_sharded(&dir, &m, &opt, &at_step(2), 0)
    })
    .unwrap();
    let meta = read_meta(&dir.join("step-00000002")).unwrap();
    assert_eq!(meta.units[3].buffers[0].dtype, "BF16");
    assert_eq!(
        meta.train.mixed_precision,
        Some(serde_json::to_value(policy).unwrap())
    );
    let resumed = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = build(pg)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        load_latest(&dir, &mut m, &mut opt)?.expect("a checkpoint");
        assert_eq!(
            m.shard(3).unwrap().buffers[0].1.dtype(),
            candle_core::DType::BF16
        );
        train(&mut m, &mut opt, &data[2..])?;
        Ok((shards(&m), opt.state()?, buffers(&m)))
    })
    .unwrap();
    assert_eq!(resumed, straight);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_error_on_rank_1_is_the_one_reported_not_rank_0s_echo() {
    let dir = tmpdir("rank1err");
    let ckpt = fresh_checkpoint(&dir);
    let shard1 = ckpt.join("shard-00001-of-00002.safetensors");
    let bytes = std::fs::read(&shard1).unwrap();
    std::fs::write(&shard1, &bytes[..bytes.len() / 3]).unwrap();
    let ckpt2 = ckpt.clone();
    let results = run_ranks(2, ThreadGroupConfig::default(), move |pg| {
        let mut m = model(pg)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        load_sharded(&ckpt2, &mut m, &mut opt).map(|_| ())
    });
    // Rank 0 knows that rank 1 failed, and why (under mpirun rank 1's output may be another
    // process's) …
    assert!(
        matches!(&results[0], Err(candle_fsdp::Error::PeersFailed { failed_ranks, .. }) if failed_ranks == &vec![1]),
        "{:?}",
        results[0]
    );
    let echo = results[0].as_ref().unwrap_err().to_string();
    assert!(
        echo.contains("rank 1: ") && echo.contains("shard-00001-of-00002.safetensors"),
        "{echo}"
    );
    // … and run_ranks_ok reports rank 1's own error, which names its file.
    let ckpt3 = ckpt.clone();
    let e = run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
        let mut m = model(pg)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        load_sharded(&ckpt3, &mut m, &mut opt).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("shard-00001-of-00002.safetensors"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_optimizer_past_step_0_without_state_refuses_to_step() {
    let data = batches(1, 8, 4);
    let e = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        // A state that claims 5 steps but lost its second moments.
        let st = OptimizerState {
            hyper: opt.hyper(),
            step: 5,
            units: m
                .shards()
                .map(|u| UnitOptimState {
                    steps: vec![5; u.layout.params.len()],
                    buffers: BTreeMap::from([(
                        BufferKind::ExpAvg,
                        vec![0.0; u.layout.shard_numel],
                    )]),
                })
                .collect(),
        };
        opt.load_state(st)?;
        train(&mut m, &mut opt, &data)
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("step 5") && e.contains("exp_avg_sq"), "{e}");
}

#[test]
fn the_accessor_shows_every_unit_and_loading_checks_each_unit_shard() {
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let rank = pg.rank();
        let mut m = model(pg)?;
        let names: Vec<String> = m.shards().map(|v| v.unit_name.to_string()).collect();
        assert_eq!(names, ["flatten", "fc1", "fc2", "shift", "head", "scale"]);
        assert!(m.shards().enumerate().all(|(k, v)| v.unit_index == k));
        // fc1: weight 13×20 at 0, bias 13 at 260 → 273 elements, padded to 274, shards of 137.
        let fc1 = m.shard(1).unwrap();
        assert_eq!(
            (
                fc1.layout.padded_numel,
                fc1.layout.shard_numel,
                fc1.shard_index
            ),
            (274, 137, rank)
        );
        assert_eq!(fc1.param.dims(), [137]);
        assert!(fc1.grad.is_none() && fc1.buffers.is_empty());
        assert_eq!(m.shard(0).unwrap().param.dims(), [0]);
        assert_eq!(m.shard(3).unwrap().buffers[0].0, "shift.running_mean");
        assert!(m.shard(6).is_none());
        // Loading re-checks the length; the error names the unit, expected and found.
        let short = Tensor::zeros(136, candle_core::DType::F32, &Device::Cpu)?;
        let e = m.set_unit_shard(1, short).unwrap_err().to_string();
        assert!(
            e.contains("unit fc1") && e.contains("137 elements") && e.contains("[136]"),
            "{e}"
        );
        let e = m
            .set_unit_grad(
                2,
                Some(Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu)?),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("unit fc2") && e.contains("50 elements"), "{e}");
        let e = m
            .set_unit_shard(9, Tensor::zeros(1, candle_core::DType::F32, &Device::Cpu)?)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unit index 9 is out of range for the model's unit count 6"),
            "{e}"
        );
        // A good shard replaces the old one and the accessor shows it; the gradient likewise.
        let new: Vec<f32> = (0..137).map(|i| i as f32 * 0.5).collect();
        m.set_unit_shard(1, Tensor::from_vec(new.clone(), 137, &Device::Cpu)?)?;
        assert_eq!(to_vec(m.shard(1).unwrap().param), new);
        m.set_unit_grad(
            2,
            Some(Tensor::ones(50, candle_core::DType::F32, &Device::Cpu)?),
        )?;
        assert_eq!(to_vec(m.shard(2).unwrap().grad.unwrap()), vec![1.0; 50]);
        assert_eq!(
            m.memory_stats().sharded_bytes,
            4 * 50 + shards(&m).iter().map(|s| 4 * s.len()).sum::<usize>()
        );
        m.zero_grad();
        assert!(m.shards().all(|v| v.grad.is_none()));
        Ok(())
    })
    .unwrap();
}

#[test]
fn loaded_optimizer_state_of_the_wrong_length_is_refused_at_the_step() {
    let data = batches(1, 8, 4);
    let e = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        let st = OptimizerState {
            hyper: opt.hyper(),
            step: 1,
            units: m
                .shards()
                .map(|u| {
                    // fc1's buffers one element short.
                    let n = u.layout.shard_numel - usize::from(u.unit_name == "fc1");
                    UnitOptimState {
                        steps: vec![1; u.layout.params.len()],
                        buffers: BTreeMap::from([
                            (BufferKind::ExpAvg, vec![0.0; n]),
                            (BufferKind::ExpAvgSq, vec![0.0; n]),
                        ]),
                    }
                })
                .collect(),
        };
        opt.load_state(st)?;
        let before = shards(&m);
        let r = train(&mut m, &mut opt, &data);
        assert_eq!(shards(&m), before, "nothing stepped");
        r
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("optimizer state exp_avg of unit fc1 has 136 elements, its shard 137"),
        "{e}"
    );
}

#[test]
fn a_users_gpt_with_tied_and_frozen_weights_saved_at_ws2_continues_at_ws3_like_uninterrupted() {
    use crate::user_gpt::{
        assert_parity, batches, builder, full_params, make_opt, reference, train_step, BlockCfg,
        Case, Outcome,
    };
    let mut c = Case::gpt(2, BlockCfg::default(), false);
    c.freeze = vec!["wpe.*".into(), "h1.ln2.*".into()];
    c.rows = 6;
    c.steps = 4;
    let want = reference(&c);
    let dir = std::env::temp_dir().join(format!("user-gpt-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let data = batches(c.rows, c.steps);
    let (c1, d1, dir1) = (c.clone(), data.clone(), dir.clone());
    let (path, first) = run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
        let mut model = builder(&c1, pg.clone()).build()?;
        let mut opt = make_opt(false);
        let mut losses = Vec::new();
        for (s, batch) in d1.iter().enumerate().take(2) {
            losses.push(train_step(&c1, &mut model, opt.as_mut(), batch, s)?);
        }
        let state = TrainState {
            step: 2,
            ..Default::default()
        };
        let path = save_sharded(&dir1, &model, opt.as_ref(), &state, 0)?;
        Ok((path, losses))
    })
    .unwrap()
    .remove(0);
    let c2 = c.clone();
    let (later, params) = run_ranks_ok(3, ThreadGroupConfig::default(), move |pg| {
        let mut model = builder(&c2, pg.clone()).build()?;
        let mut opt = make_opt(false);
        load_sharded(&path, &mut model, opt.as_mut())?;
        let mut losses = Vec::new();
        for (s, batch) in data.iter().enumerate().take(4).skip(2) {
            losses.push(train_step(&c2, &mut model, opt.as_mut(), batch, s)?);
        }
        Ok((losses, full_params(&model)?))
    })
    .unwrap()
    .remove(0);
    let _ = std::fs::remove_dir_all(&dir);
    let got = Outcome {
        losses: first.into_iter().chain(later).collect(),
        params,
    };
    assert_parity(&got, &want, "save ws 2 -> load ws 3 -> continue");
}
