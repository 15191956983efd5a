//! Bit-exact resume with the real data pipeline: train N steps with `DistributedSampler` +
//! `BatchLoader`, save (mid-epoch, at an epoch end, or in a later epoch), start a fresh process
//! group, load, train to the end: parameters and optimizer state equal (bitwise) those of
//! training straight through.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_fsdp::checkpoint::{load_latest, save_sharded, RngState, SamplerState, TrainState};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::data::{BatchLoader, DistributedSampler};
use candle_fsdp::optim::{AdamW, AdamWConfig, OptimizerState, ShardedOptimizer};
use candle_fsdp::{FsdpConfig, FsdpModel};
use common::*;
use rand::{Rng, SeedableRng};

const ITEMS: usize = 45;
const BATCH: usize = 4;
const EPOCHS: u64 = 2;
const SEED: u64 = 3;

fn tmpdir(tag: &str) -> PathBuf {
    let d = common::tmpdir(&format!("resume-{tag}"));
    d
}

/// A synthetic dataset of `ITEMS` items of shape (1, 4, 5) with labels in 0..3.
fn dataset() -> (Arc<Vec<f32>>, Arc<Vec<u8>>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    let images = (0..ITEMS * IN.0 * IN.1)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let labels = (0..ITEMS)
        .map(|_| rng.random_range(0..CLASSES as u8))
        .collect();
    (Arc::new(images), Arc::new(labels))
}

type Outcome = (Vec<Vec<f32>>, OptimizerState);

/// Trains for `EPOCHS` epochs (from a checkpoint under `root` when `resume`), stopping after
/// `stop_at` steps with a checkpoint under `root` when given.
fn run(ws: usize, root: &Path, resume: bool, stop_at: Option<u64>) -> Vec<Outcome> {
    let (images, labels) = dataset();
    run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
        let rank = pg.rank();
        let mut model = FsdpModel::builder(
            pg.clone(),
            FsdpConfig {
                seed: SEED,
                ..Default::default()
            },
        );
        for u in units() {
            model = model.unit_spec(u);
        }
        let mut model = model.build()?;
        let mut opt = AdamW::new(AdamWConfig {
            lr: 1e-2,
            ..Default::default()
        });
        let mut sampler = DistributedSampler::new(ITEMS, ws, rank, true, SEED, false)?;
        let (mut step, mut start) = (0, None);
        if resume {
            let loaded = load_latest(root, &mut model, &mut opt)?.expect("a checkpoint");
            let train = loaded.meta.train;
            assert_eq!(train.rng, Some(RngState { seed: SEED }));
            step = train.step;
            start = train.sampler;
        }
        let first_epoch = start.map_or(0, |s| s.epoch);
        for epoch in first_epoch..EPOCHS {
            match start.take() {
                Some(s) => s.apply(&mut sampler)?,
                None => sampler.set_epoch(epoch),
            }
            let loader = BatchLoader::new(
                images.clone(),
                labels.clone(),
                (1, IN.0, IN.1),
                sampler.indices(),
                BATCH,
                false,
            )?;
            let mut consumed = 0;
            for batch in loader {
                let batch = batch?;
                let logits = model.forward(&batch.images)?;
                let loss = candle_nn::loss::cross_entropy(&logits, &batch.labels)?;
                model.backward(&loss)?;
                opt.step(&mut model)?;
                model.zero_grad();
                consumed += batch.len();
                step += 1;
                if stop_at == Some(step) {
                    let state = TrainState {
                        step,
                        epoch,
                        sampler: Some(SamplerState::new(&sampler, consumed)),
                        rng: Some(RngState { seed: SEED }),
                        ..Default::default()
                    };
                    save_sharded(root, &model, &opt, &state, 0)?;
                    return Ok((Vec::new(), opt.state()?));
                }
            }
        }
        let shards = model
            .shards()
            .map(|u| u.param.to_vec1::<f32>())
            .collect::<candle_core::Result<_>>()?;
        Ok((shards, opt.state()?))
    })
    .unwrap()
}

#[test]
fn resume_with_the_sampler_is_bitwise_exact_mid_epoch_and_at_epoch_ends() {
    for ws in [1, 2, 3] {
        let straight = run(ws, Path::new("/nonexistent"), false, None);
        let per_epoch = (ITEMS.div_ceil(ws)).div_ceil(BATCH) as u64;
        let total = per_epoch * EPOCHS;
        assert_eq!(straight[0].1.step, total);
        // Mid first epoch, at the end of the first epoch, mid second epoch, one step before
        // the end.
        for stop in [2, per_epoch, per_epoch + 2, total - 1] {
            let dir = tmpdir(&format!("{ws}-{stop}"));
            run(ws, &dir, false, Some(stop));
            let resumed = run(ws, &dir, true, None);
            assert_eq!(resumed, straight, "ws {ws}, resumed after step {stop}");
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

#[test]
fn sampler_state_positions() {
    let mut s = DistributedSampler::new(100, 4, 1, true, 0, false).unwrap();
    s.set_epoch(3);
    let st = SamplerState::new(&s, 8);
    assert_eq!(
        st,
        SamplerState {
            epoch: 3,
            position: 8,
            world_size: 4
        }
    );
    // Resumed twice: the position adds to the start.
    st.apply(&mut s).unwrap();
    assert_eq!((s.epoch(), s.start()), (3, 8));
    assert_eq!(SamplerState::new(&s, 4).position, 12);
    // 8 per rank at 4 ranks = 32 of the global list = 16 per rank at 2, 10 (rounded down) at 3.
    assert_eq!(st.position_for(2), 16);
    assert_eq!(st.position_for(3), 10);
    assert_eq!(st.position_for(4), 8);
}

#[test]
fn a_sampler_position_past_the_epoch_is_an_error() {
    let mut s = DistributedSampler::new(100, 4, 1, true, 0, false).unwrap();
    let bad = SamplerState {
        epoch: 0,
        position: 999_999,
        world_size: 4,
    };
    let e = bad.apply(&mut s).unwrap_err().to_string();
    assert!(
        e.contains("999999") && e.contains("25 samples per rank"),
        "{e}"
    );
    // The end of the epoch itself is a valid position (nothing left to do in it).
    let end = SamplerState {
        epoch: 0,
        position: 25,
        world_size: 4,
    };
    end.apply(&mut s).unwrap();
    assert!(s.indices().is_empty());
}
