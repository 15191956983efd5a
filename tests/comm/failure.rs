//! A rank that fails mid-step must not leave the others hanging: they return an error naming it,
//! long before the collective timeout (the thread backend's shared abort slot, hence the
//! `threads_` names), and comm errors keep their variant through Candle ops.

use crate::common;

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_fsdp::comm::threads::{run_ranks, ThreadGroupConfig};
use candle_fsdp::optim::{AdamW, AdamWConfig, ShardedOptimizer};
use candle_fsdp::sync_batch_norm::sync_batch_norm;
use candle_fsdp::{Error, FsdpConfig, FsdpModel, ShardingStrategy};
use candle_nn::{BatchNormConfig, ModuleT, VarBuilder, VarMap};
use common::*;

fn train_until_failure(fail_rank: usize, panic: bool) -> (Vec<candle_fsdp::Result<()>>, Duration) {
    let data = batches(4, 4 * 3, 5);
    let t0 = Instant::now();
    let results = run_ranks(3, ThreadGroupConfig::default(), |pg| {
        let rank = pg.rank();
        let mut b = FsdpModel::builder(pg, FsdpConfig::default());
        for u in units() {
            b = b.unit_spec(u);
        }
        let mut model = b.build()?;
        let mut opt = AdamW::new(AdamWConfig::default());
        for (step, (x, y)) in data.iter().enumerate() {
            let x = x.narrow(0, rank * 4, 4)?;
            let y = y.narrow(0, rank * 4, 4)?;
            let logits = model.forward(&x)?;
            if step == 2 && rank == fail_rank {
                if panic {
                    panic!("injected failure in step {step}");
                }
                return Err(Error::InvalidArgument(format!(
                    "injected error in step {step}"
                )));
            }
            let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
            model.backward(&loss)?;
            opt.step(&mut model)?;
        }
        Ok(())
    });
    (results, t0.elapsed())
}

#[test]
fn threads_a_panicking_rank_makes_the_others_fail_promptly_naming_it() {
    let (results, elapsed) = train_until_failure(1, true);
    // Default timeout is 300 s: the others must not have waited for it.
    assert!(elapsed < Duration::from_secs(30), "took {elapsed:?}");
    match &results[1] {
        Err(Error::RankPanicked { rank: 1, message }) => {
            assert!(message.contains("injected failure in step 2"), "{message}")
        }
        other => panic!("rank 1: expected RankPanicked, got {other:?}"),
    }
    for r in [0, 2] {
        // The peers' errors say where they were (backward of step 2) and why.
        let err = results[r].as_ref().unwrap_err();
        assert!(
            matches!(
                err,
                Error::InStep {
                    step: 2,
                    phase: candle_fsdp::error::Phase::Backward,
                    unit: Some(_),
                    ..
                }
            ),
            "rank {r}: {err:?}"
        );
        match err.root_cause() {
            Error::PeerFailed {
                rank,
                failed_rank: 1,
                op,
                reason,
            } => {
                assert_eq!(*rank, r);
                assert!(reason.contains("injected failure"), "{reason}");
                assert!(!op.is_empty());
                let text = results[r].as_ref().unwrap_err().to_string();
                assert!(text.contains("rank 1 failed"), "{text}");
            }
            other => panic!("rank {r}: expected PeerFailed naming rank 1, got {other:?}"),
        }
    }
}

#[test]
fn threads_a_rank_returning_an_error_makes_the_others_fail_promptly_naming_it() {
    let (results, elapsed) = train_until_failure(2, false);
    assert!(elapsed < Duration::from_secs(30), "took {elapsed:?}");
    assert!(
        matches!(&results[2], Err(Error::InvalidArgument(m)) if m.contains("injected error")),
        "{:?}",
        results[2]
    );
    for r in [0, 1] {
        assert!(
            matches!(
                results[r].as_ref().map_err(Error::root_cause),
                Err(Error::PeerFailed { failed_rank: 2, .. })
            ),
            "rank {r}: {:?}",
            results[r]
        );
    }
}

/// Rank 1 fails before a training forward through SyncBatchNorm; rank 0's forward runs the
/// batch-statistics all-reduce inside a Candle op, which must come back out as our
/// `PeerFailed` (not a Candle error wrapping its text).
#[test]
fn threads_a_peer_failure_in_sync_batch_norm_surfaces_as_peer_failed() {
    let x = || Tensor::arange(0f32, 12., &Device::Cpu)?.reshape((4, 3));
    // The module alone.
    let results = run_ranks::<(), _>(2, ThreadGroupConfig::default(), |pg| {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let bn = sync_batch_norm(3, BatchNormConfig::default(), pg.clone(), vb)?;
        if pg.rank() == 1 {
            std::thread::sleep(std::time::Duration::from_millis(100));
            return Err(Error::InvalidArgument("rank 1 has no batch".into()));
        }
        let start = Instant::now();
        let err = Error::from(bn.forward_t(&x()?, true).unwrap_err());
        assert!(start.elapsed() < Duration::from_secs(30));
        Err(err)
    });
    match &results[0] {
        Err(Error::PeerFailed {
            op,
            rank: 0,
            failed_rank: 1,
            reason,
        }) => {
            assert_eq!(op, "all_reduce #1 (stream collective)");
            assert!(reason.contains("rank 1 has no batch"), "{reason}");
        }
        other => panic!("rank 0: expected PeerFailed, got {other:?}"),
    }
    // Inside an FSDP model (NO_SHARD: the first collective of the forward is the batch norm's).
    let results = run_ranks(2, ThreadGroupConfig::default(), |pg| {
        let config = FsdpConfig {
            sharding_strategy: ShardingStrategy::NoShard,
            ..FsdpConfig::default()
        };
        let bn_pg = pg.clone();
        let mut model = FsdpModel::builder(pg.clone(), config)
            .unit("bn", move |vb| {
                sync_batch_norm(3, BatchNormConfig::default(), bn_pg.clone(), vb)
            })
            .build()?;
        if pg.rank() == 1 {
            return Err(Error::InvalidArgument("rank 1 has no batch".into()));
        }
        model.forward(&x()?).map(|_| ())
    });
    let err = results[0].as_ref().unwrap_err();
    assert!(
        matches!(err.root_cause(), Error::PeerFailed { failed_rank: 1, .. }),
        "rank 0: {err:?}"
    );
}
