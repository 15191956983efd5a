//! What a checkpoint must carry and how loading chooses (issue 11): the optimizer's kind and
//! hyper-parameters, the LR scheduler and grad scaler states; run ids (rotation and "latest"
//! per run); falling back past a damaged checkpoint; per-tensor checksums.

use crate::common;

use std::path::{Path, PathBuf};

use candle_fsdp::checkpoint::{
    list_complete, load_latest, load_latest_of_run, load_sharded, new_run_id, read_meta,
    save_sharded, TrainState,
};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::ProcessGroup;
use candle_fsdp::grad_scaler::{GradScalerConfig, GradScalerState, ShardedGradScaler};
use candle_fsdp::{
    AdamW, AdamWConfig, FsdpConfig, FsdpModel, LrSchedule, LrScheduler, ParamGroup, Sgd, SgdConfig,
    ShardedOptimizer,
};
use common::{batches, to_vec, units};

fn model(pg: std::sync::Arc<dyn ProcessGroup>) -> candle_fsdp::Result<FsdpModel> {
    FsdpModel::builder(pg, FsdpConfig::default())
        .units(units())
        .build()
}

/// One training step on this rank's half of `batch`.
fn step(
    m: &mut FsdpModel,
    opt: &mut dyn ShardedOptimizer,
    batch: &(candle_core::Tensor, candle_core::Tensor),
) -> candle_fsdp::Result<()> {
    let rank = m.process_group().rank();
    let n = batch.0.dim(0)? / 2;
    let logits = m.forward(&batch.0.narrow(0, rank * n, n)?)?;
    let loss = candle_nn::loss::cross_entropy(&logits, &batch.1.narrow(0, rank * n, n)?)?;
    m.backward(&loss)?;
    opt.step(m)?;
    m.zero_grad();
    Ok(())
}

/// Saves steps `steps` of a run `run_id` under `root` (2 ranks), with `keep_last`.
fn save_run(root: &Path, run_id: Option<String>, steps: &[u64], keep_last: usize) {
    let data = batches(steps.len(), 8, 3);
    let steps = steps.to_vec();
    run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
        let mut m = model(pg)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        for (i, s) in steps.iter().enumerate() {
            step(&mut m, &mut opt, &data[i])?;
            let state = TrainState {
                step: *s,
                run_id: run_id.clone(),
                ..Default::default()
            };
            save_sharded(root, &m, &opt, &state, keep_last)?;
        }
        Ok(())
    })
    .unwrap();
}

fn names(dirs: &[PathBuf]) -> Vec<String> {
    dirs.iter()
        .map(|d| d.file_name().unwrap().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn hyper_parameters_scheduler_and_scaler_come_back_and_kinds_must_match() {
    let dir = common::tmpdir("sem-hyper");
    let data = batches(3, 8, 1);
    let scaler_state = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg)?;
        let mut opt = AdamW::new(AdamWConfig {
            lr: 0.01,
            ..Default::default()
        });
        // lr lowered to 0.0025 over 3 steps.
        let mut sched = LrScheduler::new(
            LrSchedule::Linear {
                start_factor: 1.0,
                end_factor: 0.25,
                total_steps: 3,
            },
            &mut opt,
        )?;
        let mut scaler = ShardedGradScaler::new(GradScalerConfig {
            init_scale: 256.0,
            growth_interval: 2,
            ..Default::default()
        })?;
        for b in &data {
            step(&mut m, &mut opt, b)?;
            sched.step(&mut opt)?;
        }
        scaler.load_state(GradScalerState {
            scale: 512.0,
            growth_tracker: 1,
            skipped_steps: 2,
            taken_steps: 3,
        });
        assert_eq!(opt.learning_rate(), 0.0025);
        let state = TrainState {
            step: 3,
            lr_scheduler: Some(sched.state()),
            grad_scaler: Some(serde_json::to_value(scaler.state()).unwrap()),
            ..Default::default()
        };
        save_sharded(&dir, &m, &opt, &state, 0)?;
        Ok(scaler.state())
    })
    .unwrap()[0];
    let r = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg.clone())?;
        let mut opt = AdamW::new(AdamWConfig {
            lr: 0.01,
            ..Default::default()
        });
        let loaded = load_latest(&dir, &mut m, &mut opt)?.unwrap();
        let lr = opt.learning_rate();
        let train = loaded.meta.train;
        let sched = LrScheduler::from_state(train.lr_scheduler.unwrap(), &mut opt)?;
        let scaler: GradScalerState = serde_json::from_value(train.grad_scaler.unwrap()).unwrap();
        // Another kind of optimizer: an error naming both kinds.
        let mut m2 = model(pg.clone())?;
        let mut sgd = Sgd::new(SgdConfig::default());
        let kind = load_latest(&dir, &mut m2, &mut sgd)
            .unwrap_err()
            .to_string();
        // Other parameter groups: an error naming both.
        let mut m3 = model(pg)?;
        let mut grouped = AdamW::with_groups(
            AdamWConfig::default(),
            vec![ParamGroup::new(
                "no_decay",
                ["*.bias"],
                AdamWConfig::default(),
            )],
        );
        let groups = load_latest(&dir, &mut m3, &mut grouped)
            .unwrap_err()
            .to_string();
        Ok((
            lr,
            sched.steps(),
            sched.factor(),
            opt.learning_rate(),
            scaler,
            kind,
            groups,
        ))
    })
    .unwrap();
    for (lr, steps, factor, lr_after, scaler, kind, groups) in r {
        assert_eq!(lr, 0.0025, "the saved lr, not the fresh optimizer's 0.01");
        assert_eq!((steps, factor, lr_after), (3, 0.25, 0.0025));
        assert_eq!(scaler, scaler_state);
        assert!(
            kind.contains("AdamW") && kind.contains("SGD") && kind.contains("meta.json"),
            "{kind}"
        );
        assert!(
            groups.contains("no_decay") && groups.contains("default"),
            "{groups}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn load_latest_of_an_empty_root_finds_nothing() {
    let dir = common::tmpdir("sem-empty");
    let r = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        let a = load_latest(&dir, &mut m, &mut opt)?.is_none();
        let b = load_latest_of_run(&dir, Some("x"), &mut m, &mut opt)?.is_none();
        Ok(a && b)
    })
    .unwrap();
    assert_eq!(r, [true, true]);
}

/// A run started from scratch in a directory that holds another run's checkpoint of the same
/// step keeps that checkpoint (renamed `step-<n>.run-<id>`, no longer a step directory), with its
/// bytes unchanged; the same run saving a step again replaces its own.
#[test]
fn the_same_step_of_another_run_is_kept_not_overwritten() {
    let dir = common::tmpdir("sem-keep");
    save_run(&dir, Some("first".into()), &[6], 0);
    let shard = "shard-00000-of-00002.safetensors";
    let before = std::fs::read(dir.join("step-00000006").join(shard)).unwrap();
    save_run(&dir, Some("second".into()), &[6], 0);
    let kept = dir.join("step-00000006.run-first");
    assert_eq!(std::fs::read(kept.join(shard)).unwrap(), before);
    assert_eq!(
        read_meta(&kept).unwrap().train.run_id.as_deref(),
        Some("first")
    );
    let all = list_complete(&dir).unwrap();
    assert_eq!(names(&all), ["step-00000006"]);
    assert_eq!(
        read_meta(&all[0]).unwrap().train.run_id.as_deref(),
        Some("second")
    );
    // The same run again: its own step is replaced, nothing more is kept.
    save_run(&dir, Some("second".into()), &[6], 0);
    let mut entries: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    entries.sort();
    assert_eq!(entries, ["step-00000006", "step-00000006.run-first"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn rotation_and_latest_consider_only_this_run() {
    let dir = common::tmpdir("sem-runs");
    // Another run's checkpoint at step 100.
    save_run(&dir, Some("other-run".into()), &[100], 0);
    // A new run saves 1, 2, 3 with keep_last 2.
    let run = new_run_id();
    assert_eq!(run.len(), 32);
    assert_ne!(run, new_run_id());
    save_run(&dir, Some(run.clone()), &[1, 2, 3], 2);
    let all = list_complete(&dir).unwrap();
    assert_eq!(
        names(&all),
        ["step-00000002", "step-00000003", "step-00000100"],
        "rotation kept this run's last 2 and left the other run alone"
    );
    let meta = read_meta(&all[1]).unwrap();
    assert_eq!(meta.train.run_id.as_deref(), Some(run.as_str()));
    assert!(meta.saved_at_unix_ms.unwrap() > 1_600_000_000_000);
    // "Latest" of a directory holding two runs is an error naming both, never a silent pick
    // (rank 0 names the runs, the others report that rank 0 failed choosing).
    let err = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        load_latest(&dir, &mut m, &mut opt).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("2 runs") && err.contains("other-run") && err.contains(&run),
        "{err}"
    );
    let r = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        let l = load_latest_of_run(&dir, Some(&run), &mut m, &mut opt)?.unwrap();
        Ok(l.meta.train.step)
    })
    .unwrap();
    assert_eq!(r, [3, 3]);
    let _ = std::fs::remove_dir_all(&dir);
}

type Skipped = Vec<(PathBuf, Option<PathBuf>, String)>;

/// Shards of a fresh model loaded with `load_latest` from `dir`, the skipped checkpoints and
/// the step loaded.
fn load_latest_shards(dir: &Path) -> (Vec<Vec<Vec<f32>>>, Skipped, u64) {
    let r = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        let l = load_latest(dir, &mut m, &mut opt)?.unwrap();
        let shards: Vec<Vec<f32>> = m.shards().map(|v| to_vec(v.param)).collect();
        let skipped = l
            .skipped
            .iter()
            .map(|s| (s.dir.clone(), s.renamed_to.clone(), s.error.clone()))
            .collect::<Vec<_>>();
        Ok((shards, skipped, l.meta.train.step))
    })
    .unwrap();
    // Rank 1's view: rank 1's file or the metadata every rank reads is the damaged part, so its
    // entry names the cause (rank 0's may only say that rank 1 failed).
    let skipped = r[1].1.clone();
    let step = r[1].2;
    (r.into_iter().map(|x| x.0).collect(), skipped, step)
}

/// Shards of a fresh model loaded with `load_sharded` from `ckpt`.
fn load_shards(ckpt: &Path) -> Vec<Vec<Vec<f32>>> {
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        load_sharded(ckpt, &mut m, &mut opt)?;
        Ok(m.shards().map(|v| to_vec(v.param)).collect())
    })
    .unwrap()
}

/// Flips one bit inside the data of tensor `tensor` of the safetensors file `file`.
fn flip_bit_in(file: &Path, tensor: &str) {
    let mut bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let start = header[tensor]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[8 + n + start + 6] ^= 0x01;
    std::fs::write(file, &bytes).unwrap();
}

#[test]
fn load_latest_falls_back_past_a_damaged_checkpoint_and_keeps_it_for_inspection() {
    for damage in ["truncate", "header", "bitflip", "meta"] {
        let dir = common::tmpdir(&format!("sem-fallback-{damage}"));
        save_run(&dir, Some("run-f".into()), &[1, 2], 0);
        let good = load_shards(&dir.join("step-00000001"));
        let file = dir
            .join("step-00000002")
            .join("shard-00001-of-00002.safetensors");
        let mut bytes = std::fs::read(&file).unwrap();
        match damage {
            "truncate" => bytes.truncate(bytes.len() / 2),
            "header" => bytes[10] = b'#',
            _ => {}
        }
        std::fs::write(&file, &bytes).unwrap();
        if damage == "bitflip" {
            flip_bit_in(&file, "param.1");
        }
        // Unreadable metadata: it names no run (so the directory does not look like a second
        // run) and is passed over like any damage.
        if damage == "meta" {
            let meta = dir.join("step-00000002").join("meta.json");
            std::fs::write(meta, b"{\"format_version\": 3, \"run_id\": ").unwrap();
        }
        let (shards, skipped, step) = load_latest_shards(&dir);
        assert_eq!(step, 1, "{damage}");
        assert_eq!(shards, good, "{damage}");
        assert_eq!(skipped.len(), 1, "{damage}");
        let (from, to, why) = &skipped[0];
        assert_eq!(from, &dir.join("step-00000002"));
        assert_eq!(
            to.as_deref(),
            Some(dir.join("step-00000002.damaged").as_path())
        );
        let named = if damage == "meta" {
            "meta.json"
        } else {
            "shard-00001-of-00002.safetensors"
        };
        assert!(why.contains(named), "{damage}: {why}");
        assert!(dir
            .join("step-00000002.damaged")
            .join("meta.json")
            .is_file());
        assert_eq!(names(&list_complete(&dir).unwrap()), ["step-00000001"]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_flipped_bit_in_tensor_data_is_an_error_naming_file_and_tensor() {
    let dir = common::tmpdir("sem-crc");
    save_run(&dir, None, &[1], 0);
    let ckpt = dir.join("step-00000001");
    let file = ckpt.join("shard-00000-of-00002.safetensors");
    flip_bit_in(&file, "param.1");
    let name = "param.1";
    let e = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        load_sharded(&ckpt, &mut m, &mut opt).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("shard-00000-of-00002.safetensors")
            && e.contains(&format!("tensor {name}"))
            && e.contains("CRC-32C"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn unit_metadata_converts_to_and_from_the_flat_parameter_layout() {
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let m = model(pg)?;
        for v in m.shards() {
            let meta =
                candle_fsdp::checkpoint::UnitMeta::from_layout(v.unit_name, v.layout, v.buffers)?;
            assert_eq!(&meta.to_layout()?, v.layout, "unit {}", v.unit_name);
            // A recorded offset that is not the layout's is refused, naming unit and parameter.
            if meta.params.len() >= 2 {
                let mut bad = meta.clone();
                bad.params[1].offset += 4;
                let e = bad.to_layout().unwrap_err().to_string();
                assert!(
                    e.contains(&format!("unit {}", v.unit_name))
                        && e.contains(&bad.params[1].name)
                        && e.contains("its layout puts it at"),
                    "{e}"
                );
            }
        }
        Ok(())
    })
    .unwrap();
}
