//! Sharded checkpoints: exact round trip of shards and optimizer state, resume equals training
//! straight through (bitwise), a failed save keeps the previous checkpoint, clear errors.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_fsdp::checkpoint::{self, list_complete, load_latest, load_sharded, save_sharded};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::ProcessGroup;
use candle_fsdp::optim::{AdamW, AdamWConfig, ShardedOptimizer};
use candle_fsdp::{FsdpConfig, FsdpModel};
use common::*;
use std::sync::Arc;

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "candle-fsdp-ckpt-{tag}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn model(pg: Arc<dyn ProcessGroup>) -> candle_fsdp::Result<FsdpModel> {
    let mut b = FsdpModel::builder(
        pg,
        FsdpConfig {
            seed: 7,
            ..Default::default()
        },
    );
    for u in units() {
        b = b.unit_spec(u);
    }
    b.build()
}

fn train(
    model: &mut FsdpModel,
    opt: &mut AdamW,
    data: &[(candle_core::Tensor, candle_core::Tensor)],
    per_rank: usize,
) -> candle_fsdp::Result<()> {
    let rank = model.process_group().rank();
    for (x, y) in data {
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
    model.units().iter().map(|u| u.flat.shard.clone()).collect()
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
            train(&mut m, &mut opt, &data, 4)?;
            Ok((shards(&m), opt.state()))
        })
        .unwrap();
        // N steps, save; a fresh group loads and trains M steps.
        run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
            let mut m = model(pg)?;
            let mut opt = AdamW::new(AdamWConfig::default());
            train(&mut m, &mut opt, first, 4)?;
            save_sharded(&dir, &m, &opt, 0, BTreeMap::new(), 0)?;
            Ok(())
        })
        .unwrap();
        let resumed = run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
            let mut m = model(pg)?;
            let mut opt = AdamW::new(AdamWConfig::default());
            let meta = load_latest(&dir, &mut m, &mut opt)?.expect("a checkpoint");
            assert_eq!(meta.step, 3);
            assert_eq!(meta.world_size, ws);
            train(&mut m, &mut opt, rest, 4)?;
            Ok((shards(&m), opt.state()))
        })
        .unwrap();
        assert_eq!(resumed, straight, "ws {ws}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn failed_save_keeps_the_previous_checkpoint_and_rotation_keeps_last_k() {
    let dir = tmpdir("rotate");
    let data = batches(4, 8, 1);
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg.clone())?;
        let mut opt = AdamW::new(AdamWConfig::default());
        for step in 0..4 {
            train(&mut m, &mut opt, &data[step..step + 1], 4)?;
            save_sharded(&dir, &m, &opt, 0, BTreeMap::new(), 2)?;
        }
        Ok(())
    })
    .unwrap();
    let names = |d: &Path| -> Vec<String> {
        list_complete(d)
            .unwrap()
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect()
    };
    assert_eq!(names(&dir), vec!["step-00000003", "step-00000004"]);
    // A save that fails half way (rank 1 cannot create its shard file: a directory is in the way)
    // errors on every rank and leaves step 4 the newest complete checkpoint.
    let blocked = dir.join("step-00000005");
    std::fs::create_dir_all(blocked.join("shard-00001-of-00002.safetensors")).unwrap();
    let results = candle_fsdp::comm::threads::run_ranks(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        load_latest(&dir, &mut m, &mut opt)?;
        train(&mut m, &mut opt, &data[..1], 4)?;
        save_sharded(&dir, &m, &opt, 0, BTreeMap::new(), 2).map(|_| ())
    });
    assert!(results.iter().all(|r| r.is_err()), "{results:?}");
    assert!(!blocked.join("meta.json").exists());
    assert_eq!(names(&dir), vec!["step-00000003", "step-00000004"]);
    // And it still loads.
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        let meta = load_latest(&dir, &mut m, &mut opt)?.unwrap();
        assert_eq!(meta.step, 4);
        Ok(())
    })
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_checkpoints_give_errors_naming_file_and_values() {
    let dir = tmpdir("bad");
    let ckpt = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let m = model(pg)?;
        let opt = AdamW::new(AdamWConfig::default());
        save_sharded(&dir, &m, &opt, 0, BTreeMap::new(), 0)
    })
    .unwrap()
    .remove(0);
    let load = |ws: usize| {
        let ckpt = ckpt.clone();
        candle_fsdp::comm::threads::run_ranks(ws, ThreadGroupConfig::default(), move |pg| {
            let mut m = model(pg)?;
            let mut opt = AdamW::new(AdamWConfig::default());
            load_sharded(&ckpt, &mut m, &mut opt).map(|_| ())
        })
        .remove(0)
        .unwrap_err()
        .to_string()
    };
    // Different world size.
    let e = load(3);
    assert!(
        e.contains("meta.json") && e.contains("world size 2") && e.contains("world size 3"),
        "{e}"
    );
    // Truncated shard file.
    let shard0 = ckpt.join("shard-00000-of-00002.safetensors");
    let bytes = std::fs::read(&shard0).unwrap();
    std::fs::write(&shard0, &bytes[..bytes.len() / 2]).unwrap();
    let e = load(2);
    assert!(
        e.contains("shard-00000-of-00002.safetensors") && e.contains("corrupt"),
        "{e}"
    );
    // Missing shard file.
    std::fs::remove_file(&shard0).unwrap();
    let e = load(2);
    assert!(e.contains("shard-00000-of-00002.safetensors"), "{e}");
    // Metadata from the future.
    let meta_path = ckpt.join("meta.json");
    let text = std::fs::read_to_string(&meta_path).unwrap();
    std::fs::write(
        &meta_path,
        text.replace(
            &format!("\"format_version\": {}", checkpoint::FORMAT_VERSION),
            "\"format_version\": 99",
        ),
    )
    .unwrap();
    let e = load(2);
    assert!(e.contains("meta.json") && e.contains("99"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
