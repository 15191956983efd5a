//! A rank that fails mid-step must not leave the others hanging: they return an error naming it,
//! long before the collective timeout.

mod common;

use std::time::{Duration, Instant};

use candle_fsdp::comm::threads::{run_ranks, ThreadGroupConfig};
use candle_fsdp::optim::{AdamW, AdamWConfig, ShardedOptimizer};
use candle_fsdp::{Error, FsdpConfig, FsdpModel};
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
fn a_panicking_rank_makes_the_others_fail_promptly_naming_it() {
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
fn a_rank_returning_an_error_makes_the_others_fail_promptly_naming_it() {
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
