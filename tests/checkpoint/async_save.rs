//! Asynchronous sharded saves (`save_sharded_async`, issue 35, first part): training goes on
//! while the save is pending and the checkpoint holds the state at the save; the files are
//! byte for byte those of a synchronous save; nothing is published before `wait` (the previous
//! checkpoint stays the newest complete one); a failure of the background part is reported by
//! `wait`, naming the file, on every rank.

use crate::common;

use std::path::PathBuf;

use candle_fsdp::checkpoint::{
    fault, list_complete, load_sharded, read_meta, save_sharded, save_sharded_async, TrainState,
};
use candle_fsdp::comm::threads::{run_ranks, run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::ProcessGroup;
use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, FsdpModel, ShardedOptimizer};
use common::{batches, to_vec, units};

fn model(pg: std::sync::Arc<dyn ProcessGroup>) -> candle_fsdp::Result<FsdpModel> {
    FsdpModel::builder(pg, FsdpConfig::default())
        .units(units())
        .build()
}

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

fn state(step: u64) -> TrainState {
    TrainState {
        step,
        ..Default::default()
    }
}

#[test]
fn training_goes_on_while_a_save_is_pending_and_the_files_are_a_sync_saves() {
    let root = common::tmpdir("async-save");
    let (sync_root, async_root) = (root.join("sync"), root.join("async"));
    let data = batches(6, 8, 21);
    let (a, s) = (async_root.clone(), sync_root.clone());
    let out = run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
        let mut m = model(pg.clone())?;
        let mut opt = AdamW::new(AdamWConfig::default());
        step(&mut m, &mut opt, &data[0])?;
        let first = save_sharded(&a, &m, &opt, &state(1), 0)?;
        for b in &data[1..3] {
            step(&mut m, &mut opt, b)?;
        }
        let at_save = m.gather_full_params(false)?;
        save_sharded(&s, &m, &opt, &state(3), 0)?;
        let pending = save_sharded_async(&a, &m, &opt, &state(3), 0)?;
        // Not yet published: the newest complete checkpoint is still step 1.
        let complete_before = list_complete(&a)?;
        for b in &data[3..] {
            step(&mut m, &mut opt, b)?;
        }
        let dir = pending.wait()?;
        // The checkpoint holds the state of the save, not of the steps after it.
        let mut fresh = model(pg)?;
        let mut fresh_opt = AdamW::new(AdamWConfig::default());
        load_sharded(&dir, &mut fresh, &mut fresh_opt)?;
        let loaded = fresh.gather_full_params(false)?;
        let now = m.gather_full_params(false)?;
        Ok((first, complete_before, dir, at_save, loaded, now))
    })
    .unwrap();
    for (rank, (first, complete_before, dir, at_save, loaded, now)) in out.iter().enumerate() {
        assert_eq!(complete_before, &vec![first.clone()], "rank {rank}");
        assert_eq!(dir, &async_root.join("step-00000003"));
        if let (Some(at_save), Some(loaded), Some(now)) = (at_save, loaded, now) {
            let v = |p: &Vec<(String, candle_core::Tensor)>| -> Vec<f32> {
                p.iter().flat_map(|(_, t)| to_vec(t)).collect()
            };
            assert_eq!(
                v(loaded),
                v(at_save),
                "rank {rank}: loaded != state at the save"
            );
            assert_ne!(v(now), v(at_save), "the later steps changed nothing");
        }
    }
    // The same files as the synchronous save of the same state, byte for byte; the metadata
    // too but its timestamp.
    let (d_sync, d_async) = (
        sync_root.join("step-00000003"),
        async_root.join("step-00000003"),
    );
    let mut meta_sync = read_meta(&d_sync).unwrap();
    let mut meta_async = read_meta(&d_async).unwrap();
    for f in &meta_sync.files {
        let a = std::fs::read(d_sync.join(&f.name)).unwrap();
        let b = std::fs::read(d_async.join(&f.name)).unwrap();
        assert!(a == b, "{}: the async save's bytes differ", f.name);
    }
    meta_sync.saved_at_unix_ms = None;
    meta_async.saved_at_unix_ms = None;
    assert_eq!(meta_sync, meta_async);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_failed_background_write_is_reported_by_wait_on_every_rank() {
    let root = common::tmpdir("async-save-fail");
    let r = root.clone();
    let data = batches(2, 8, 22);
    let results = run_ranks(2, ThreadGroupConfig::default(), move |pg| {
        let mut m = model(pg.clone())?;
        let mut opt = AdamW::new(AdamWConfig::default());
        step(&mut m, &mut opt, &data[0])?;
        let first = save_sharded(&r, &m, &opt, &state(1), 0)?;
        step(&mut m, &mut opt, &data[1])?;
        // Rank 1's background write fails halfway, as on a full disk (the fault follows the
        // write to its thread).
        if pg.rank() == 1 {
            fault::fail_writes_after(1000, false);
        }
        let pending = save_sharded_async(&r, &m, &opt, &state(2), 0)?;
        fault::disarm();
        let err = pending.wait().map(|_| ());
        Ok::<(PathBuf, candle_fsdp::Result<()>), candle_fsdp::Error>((first, err))
    });
    for (rank, res) in results.into_iter().enumerate() {
        let (first, err) = res.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        let e = err.expect_err("the background write failed").to_string();
        assert!(e.contains("shard-00001-of-00002"), "rank {rank}: {e}");
        assert_eq!(list_complete(&root).unwrap(), vec![first]);
    }
    let _ = std::fs::remove_dir_all(&root);
}
