//! Bit-exact resume with the real data pipeline: train N steps with `DistributedSampler` +
//! `BatchLoader`, save (mid-epoch, at an epoch end, or in a later epoch), start a fresh process
//! group, load, train to the end: parameters and optimizer state equal (bitwise) those of
//! training straight through.

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_fsdp::checkpoint::{load_latest, save_sharded, RngState, SamplerState, TrainState};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::data::{BatchLoader, DistributedSampler};
use candle_fsdp::grad_scaler::{GradScalerConfig, GradScalerState, ShardedGradScaler};
use candle_fsdp::optim::{AdamW, AdamWConfig, OptimizerState, ParamGroup, ShardedOptimizer};
use candle_fsdp::{FsdpConfig, FsdpModel};
use candle_fsdp::{LrSchedule, LrScheduler};
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

/// Shards, optimizer state, and (with `rich`) the scheduler and grad scaler states.
type Outcome = (Vec<Vec<f32>>, OptimizerState, String);

/// Trains for `EPOCHS` epochs (from a checkpoint under `root` when `resume`), stopping after
/// `stop_at` steps with a checkpoint under `root` when given.
fn run(ws: usize, root: &Path, resume: bool, stop_at: Option<u64>) -> Vec<Outcome> {
    run_with(ws, root, resume, stop_at, false)
}

/// As [`run`]; with `rich`, AdamW has two parameter groups (no weight decay on biases), a
/// cosine LR scheduler steps after every optimizer step, and a grad scaler scales the loss:
/// all three are saved and restored.
fn run_with(
    ws: usize,
    root: &Path,
    resume: bool,
    stop_at: Option<u64>,
    rich: bool,
) -> Vec<Outcome> {
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
        let base = AdamWConfig {
            lr: 1e-2,
            weight_decay: if rich { 0.05 } else { 0.0 },
            ..Default::default()
        };
        let mut opt = if rich {
            let no_decay = AdamWConfig {
                weight_decay: 0.0,
                ..base
            };
            AdamW::with_groups(
                base,
                vec![ParamGroup::new("no_decay", ["*.bias"], no_decay)],
            )
        } else {
            AdamW::new(base)
        };
        let total = (ITEMS.div_ceil(ws)).div_ceil(BATCH) as u64 * EPOCHS;
        let mut sched = rich
            .then(|| {
                LrScheduler::new(
                    LrSchedule::Cosine {
                        total_steps: total,
                        min_factor: 0.1,
                    },
                    &mut opt,
                )
            })
            .transpose()?;
        let mut scaler = rich
            .then(|| {
                ShardedGradScaler::new(GradScalerConfig {
                    init_scale: 1024.0,
                    growth_interval: 3,
                    ..Default::default()
                })
            })
            .transpose()?;
        let mut sampler = DistributedSampler::new(ITEMS, ws, rank, true, SEED, false)?;
        let (mut step, mut start) = (0, None);
        if resume {
            let loaded = load_latest(root, &mut model, &mut opt)?.expect("a checkpoint");
            let train = loaded.meta.train;
            assert_eq!(train.rng, Some(RngState { seed: SEED }));
            step = train.step;
            start = train.sampler;
            if rich {
                sched = Some(LrScheduler::from_state(
                    train.lr_scheduler.expect("scheduler saved"),
                    &mut opt,
                )?);
                let st: GradScalerState =
                    serde_json::from_value(train.grad_scaler.expect("scaler saved")).unwrap();
                scaler.as_mut().unwrap().load_state(st);
            }
        }
        let rich_state = |sched: &Option<LrScheduler>, scaler: &Option<ShardedGradScaler>| {
            format!(
                "{:?} {:?}",
                sched.as_ref().map(LrScheduler::state),
                scaler.as_ref().map(ShardedGradScaler::state)
            )
        };
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
                match &mut scaler {
                    Some(sc) => {
                        model.backward(&sc.scale_loss(&loss)?)?;
                        sc.step(&mut model, &mut opt)?;
                    }
                    None => {
                        model.backward(&loss)?;
                        opt.step(&mut model)?;
                    }
                }
                if let Some(s) = &mut sched {
                    s.step(&mut opt)?;
                }
                model.zero_grad();
                consumed += batch.len();
                step += 1;
                if stop_at == Some(step) {
                    let state = TrainState {
                        step,
                        epoch,
                        sampler: Some(SamplerState::new(&sampler, consumed)),
                        rng: Some(RngState { seed: SEED }),
                        lr_scheduler: sched.as_ref().map(LrScheduler::state),
                        grad_scaler: scaler
                            .as_ref()
                            .map(|s| serde_json::to_value(s.state()).unwrap()),
                        ..Default::default()
                    };
                    save_sharded(root, &model, &opt, &state, 0)?;
                    return Ok((Vec::new(), opt.state()?, String::new()));
                }
            }
        }
        let shards = model
            .shards()
            .map(|u| u.param.to_vec1::<f32>())
            .collect::<candle_core::Result<_>>()?;
        Ok((shards, opt.state()?, rich_state(&sched, &scaler)))
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
fn resume_is_bitwise_exact_with_groups_a_scheduler_and_the_grad_scaler() {
    for ws in [1, 2] {
        let straight = run_with(ws, Path::new("/nonexistent"), false, None, true);
        let per_epoch = (ITEMS.div_ceil(ws)).div_ceil(BATCH) as u64;
        // The groups and the scheduler really act: the lr decayed, the bias group kept wd 0.
        let lrs = straight[0].1.hyper.learning_rates();
        assert!(lrs[0] < 1e-2 && lrs[0] == lrs[1], "{lrs:?}");
        assert!(straight[0].2.contains("Cosine") && straight[0].2.contains("scale"));
        for stop in [3, per_epoch + 1] {
            let dir = tmpdir(&format!("rich-{ws}-{stop}"));
            run_with(ws, &dir, false, Some(stop), true);
            let resumed = run_with(ws, &dir, true, None, true);
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
