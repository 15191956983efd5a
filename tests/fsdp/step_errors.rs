//! Errors that say where: a collective error, timeout or abort during a step names the unit, the
//! phase and the step, and `run_ranks_ok` still reports the root cause under that context. A
//! panic (in forward or in backward) or a unit error on one rank, and ranks calling different
//! units, fail every rank promptly instead of waiting for the collective timeout.

use std::time::{Duration, Instant};

use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor};
use candle_fsdp::comm::threads::{run_ranks, run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::{ProcessGroup, ProcessGroupExt};
use candle_fsdp::error::Phase;
use candle_fsdp::{Error, FsdpConfig, FsdpModel};
use candle_nn::Linear;

use crate::user_gpt::{make_opt, DM};

fn model(
    pg: std::sync::Arc<dyn candle_fsdp::comm::ProcessGroup>,
) -> candle_fsdp::Result<FsdpModel> {
    FsdpModel::builder(pg, FsdpConfig::default())
        .unit("pre", |vb| candle_nn::linear(4, 8, vb))
        .unit("branch", |vb| candle_nn::linear(8, 8, vb))
        .unit("head", |vb| candle_nn::linear(8, 2, vb))
        .build()
}

/// The case of the issue: 2 ranks, a 3 s timeout; rank 0 runs one more forward/backward than
/// rank 1, which then waits in a barrier. Rank 0's error names the unit whose all-gather timed
/// out, the phase and the step; rank 1 fails promptly after rank 0's timeout.
#[test]
fn a_timeout_names_unit_phase_and_step() {
    let config = ThreadGroupConfig {
        timeout: Duration::from_secs(3),
    };
    let t0 = Instant::now();
    let results = run_ranks(2, config, |pg| {
        let mut m = model(pg.clone())?;
        let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
        let steps = if pg.rank() == 0 { 2 } else { 1 };
        for _ in 0..steps {
            let y = m.forward(&x)?;
            m.backward(&y.sum_all()?)?;
        }
        if pg.rank() == 1 {
            // Rank 1's own 3 s timer starts a second after rank 0's: rank 0 times out first.
            std::thread::sleep(Duration::from_secs(1));
        }
        pg.barrier_wait()?;
        Ok(())
    });
    let elapsed = t0.elapsed();
    assert!(elapsed < Duration::from_secs(20), "took {elapsed:?}");
    let e0 = results[0].as_ref().unwrap_err();
    match e0 {
        Error::InStep {
            unit: Some(unit),
            phase: Phase::Forward,
            step: 1,
            source,
        } => {
            assert_eq!(unit, "pre");
            assert!(
                matches!(**source, Error::Timeout { rank: 0, ref missing, .. } if missing == &[1]),
                "{source:?}"
            );
        }
        other => panic!("rank 0: {other:?}"),
    }
    let text = e0.to_string();
    assert!(
        text.starts_with("forward of unit pre at step 1: all_gather")
            && text.contains("timed out after 3s"),
        "{text}"
    );
    // Rank 1 waited in a barrier outside any step: it fails because rank 0 gave up, or times
    // out itself at the same moment, waiting for rank 0.
    let e1 = results[1].as_ref().unwrap_err().root_cause();
    assert!(
        matches!(e1, Error::PeerFailed { failed_rank: 0, .. })
            || matches!(e1, Error::Timeout { rank: 1, missing, .. } if missing == &[0]),
        "{:?}",
        results[1]
    );
}

/// A rank that fails in the middle of backward: the peers' errors name their unit, phase
/// backward and the step, and `run_ranks_ok` returns the failing rank's own error.
#[test]
fn a_peer_failure_in_backward_names_the_unit_and_run_ranks_ok_finds_the_root_cause() {
    let results = run_ranks(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg.clone())?;
        let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
        for step in 0..3 {
            let y = m.forward(&x)?;
            if step == 2 && pg.rank() == 1 {
                return Err(Error::InvalidArgument("rank 1 gives up".into()));
            }
            m.backward(&y.sum_all()?)?;
        }
        Ok(())
    });
    match results[0].as_ref().unwrap_err() {
        Error::InStep {
            unit: Some(_),
            phase: Phase::Backward,
            step: 2,
            source,
        } => assert!(
            matches!(**source, Error::PeerFailed { failed_rank: 1, .. }),
            "{source:?}"
        ),
        other => panic!("rank 0: {other:?}"),
    }
    let err = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg.clone())?;
        let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
        let y = m.forward(&x)?;
        if pg.rank() == 1 {
            return Err(Error::InvalidArgument("rank 1 gives up".into()));
        }
        m.backward(&y.sum_all()?)?;
        Ok(())
    })
    .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m == "rank 1 gives up"),
        "{err:?}"
    );
}

/// A failing unit forward names the unit and the phase; the model is usable afterwards.
#[test]
fn a_unit_error_names_the_unit_and_the_model_recovers() {
    run_ranks_ok(1, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg)?;
        let bad = Tensor::ones((3, 5), DType::F32, &Device::Cpu)?;
        let e = m.forward(&bad).unwrap_err();
        assert!(
            matches!(&e, Error::InStep { unit: Some(u), phase: Phase::Forward, step: 0, .. } if u == "pre"),
            "{e:?}"
        );
        assert!(e.to_string().starts_with("forward of unit pre at step 0: "), "{e}");
        assert_eq!(m.memory_stats().unsharded_units, 0);
        let y = m.forward(&Tensor::ones((3, 4), DType::F32, &Device::Cpu)?)?;
        m.backward(&y.sum_all()?)?;
        let e = m.forward_eval(&bad).unwrap_err();
        assert!(matches!(&e, Error::InStep { phase: Phase::Eval, .. }), "{e:?}");
        Ok(())
    })
    .unwrap();
}

/// A peer that fails before the optimizer's collectives (clipping) or a checkpoint's: the other
/// rank's error says optimizer step / checkpoint and the step.
#[test]
fn optimizer_and_checkpoint_collectives_name_their_phase() {
    let dir = std::env::temp_dir().join(format!("step-errors-ckpt-{}", std::process::id()));
    for (phase, which) in [(Phase::Optimizer, 0), (Phase::Checkpoint, 1)] {
        let dir = dir.clone();
        let results = run_ranks(2, ThreadGroupConfig::default(), move |pg| {
            let mut m = model(pg.clone())?;
            let opt = candle_fsdp::AdamW::new(candle_fsdp::AdamWConfig::default());
            let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
            let y = m.forward(&x)?;
            m.backward(&y.sum_all()?)?;
            if pg.rank() == 1 {
                return Err(Error::InvalidArgument("rank 1 gives up".into()));
            }
            if which == 0 {
                candle_fsdp::clip::clip_grad_norm(&mut m, 1.0)?;
            } else {
                let state = candle_fsdp::checkpoint::TrainState::default();
                candle_fsdp::checkpoint::save_sharded(&dir, &m, &opt, &state, 0)?;
            }
            Ok(())
        });
        match results[0].as_ref().unwrap_err() {
            Error::InStep {
                unit: None,
                phase: p,
                step: 0,
                source,
            } => {
                assert_eq!(*p, phase);
                assert!(
                    matches!(**source, Error::PeerFailed { failed_rank: 1, .. }),
                    "{source:?}"
                );
            }
            other => panic!("{phase}: rank 0: {other:?}"),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Misuse that used to be silent or to hang gets an immediate error on every rank.
#[test]
fn ranks_building_different_models_fail_at_build_not_at_the_timeout() {
    let t0 = Instant::now();
    let results = run_ranks(2, ThreadGroupConfig::default(), |pg| {
        let mut b = FsdpModel::builder(pg.clone(), FsdpConfig::default())
            .unit("pre", |vb| candle_nn::linear(4, 8, vb));
        if pg.rank() == 1 {
            b = b.unit("extra", |vb| candle_nn::linear(8, 8, vb));
        }
        b.build().map(|_| ())
    });
    assert!(t0.elapsed() < Duration::from_secs(10));
    for r in &results {
        let e = r.as_ref().unwrap_err().to_string();
        assert!(e.contains("the ranks built different models"), "{e}");
    }
}

/// Ranks built alike but configured with different schedule-shaping fields (prefetching, the
/// mixed-precision policy) fail at build naming each field and their own value of it, instead
/// of issuing all-gathers in different orders or dtypes and hanging until the timeout. The
/// device and the memory budget may differ.
#[test]
fn ranks_configured_differently_fail_at_build_naming_the_fields() {
    // One Linear unit; `rank` gets a memory budget, and when `differ`, the other prefetch
    // setting and bf16.
    let build = |pg: Arc<dyn ProcessGroup>, rank: usize, differ: bool| {
        let mut config = FsdpConfig::default();
        if pg.rank() == rank {
            config.memory_budget = Some(candle_fsdp::MemoryBudget {
                max_bytes_per_rank: 1 << 30,
                optimizer_bytes_per_element: 8,
                activation_bytes: 0,
            });
            if differ {
                config.forward_prefetch = !config.forward_prefetch;
                config.mixed_precision = candle_fsdp::MixedPrecision::bf16();
            }
        }
        FsdpModel::builder(pg, config)
            .unit("pre", |vb| candle_nn::linear(4, 8, vb))
            .build()
            .map(|_| ())
    };
    let t0 = Instant::now();
    let results = run_ranks(2, ThreadGroupConfig::default(), |pg| build(pg, 1, true));
    assert!(t0.elapsed() < Duration::from_secs(10));
    let default = FsdpConfig::default();
    for (rank, r) in results.iter().enumerate() {
        let e = r.as_ref().unwrap_err().to_string();
        let prefetch = default.forward_prefetch ^ (rank == 1);
        assert!(
            e.contains(&format!(
                "the ranks configured FSDP differently: rank {rank} has forward_prefetch = \
                 {prefetch}, mixed_precision = "
            )),
            "{e}"
        );
        assert!(!e.contains("memory_budget") && !e.contains("seed"), "{e}");
    }
    // Only the memory budget differs: the ranks build.
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| build(pg, 0, false)).unwrap();
}

#[test]
fn eval_during_a_pending_forward_unrelated_losses_and_bad_unit_indices_are_errors() {
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg)?;
        let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
        let y = m.forward(&x)?;
        let e = m.forward_eval(&x).unwrap_err().to_string();
        assert!(e.contains("awaits its backward"), "{e}");
        // The pending forward is intact: its backward still runs.
        m.backward(&y.sum_all()?)?;
        // A loss that does not come from the model's output.
        let _y = m.forward(&x)?;
        let unrelated = candle_core::Var::new(&[1f32, 2.0], &Device::Cpu)?;
        let e = m
            .backward(&unrelated.as_tensor().sum_all()?)
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not depend on the output"), "{e}");
        let e = m.gather_unit_f32(7).unwrap_err().to_string();
        assert!(
            e.contains("unit index 7 is out of range for the model's unit count 3 (expected 0..3)"),
            "{e}"
        );
        Ok(())
    })
    .unwrap();
}

// A panic or an error on one rank, and ranks that call different units: every rank fails
// promptly, none waits for the collective timeout.

#[test]
fn a_panic_in_forward_on_one_rank_fails_every_rank_promptly() {
    struct Boom(Linear);
    impl Module for Boom {
        fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
            if std::thread::current().name() == Some("rank-1") {
                panic!("boom in rank 1");
            }
            self.0.forward(x)
        }
    }
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let start = Instant::now();
        let res = run_ranks(2, ThreadGroupConfig::default(), |pg| {
            let mut model = FsdpModel::builder(pg.clone(), FsdpConfig::default())
                .unit("a", |vb| candle_nn::linear(DM, DM, vb))
                .unit("boom", |vb| Ok(Boom(candle_nn::linear(DM, DM, vb)?)))
                .unit("c", |vb| candle_nn::linear(DM, DM, vb))
                .build()?;
            let x = Tensor::ones((2, DM), DType::F32, &Device::Cpu)?;
            let y = model.forward(&x)?;
            model.backward(&y.sum_all()?)?;
            Ok(())
        });
        let msgs: Vec<String> = res
            .iter()
            .map(|r| match r {
                Ok(()) => "ok".into(),
                Err(e) => e.to_string(),
            })
            .collect();
        let _ = tx.send((start.elapsed(), msgs));
    });
    let (elapsed, msgs) = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("ranks still running 120 s after one panicked");
    println!("panic: {elapsed:?} {msgs:?}");
    assert!(
        elapsed < Duration::from_secs(10),
        "took {elapsed:?}: {msgs:?}"
    );
    assert!(msgs[1].contains("boom in rank 1"), "{msgs:?}");
    assert!(msgs[0] != "ok", "{msgs:?}");
}

/// Identity whose backward panics on rank 1.
struct PanicInBackward;

impl candle_core::CustomOp1 for PanicInBackward {
    fn name(&self) -> &'static str {
        "panic-in-backward"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let candle_core::CpuStorage::F32(v) = s else {
            candle_core::bail!("f32 only")
        };
        let (a, b) = l.contiguous_offsets().expect("contiguous");
        Ok((
            candle_core::CpuStorage::F32(v[a..b].to_vec()),
            l.shape().clone(),
        ))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        if std::thread::current().name() == Some("rank-1") {
            panic!("boom in rank 1's backward");
        }
        Ok(Some(g.clone()))
    }
}

struct LinearPanicBwd(Linear);

impl Module for LinearPanicBwd {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.0.forward(x)?.apply_op1(PanicInBackward)
    }
}

/// Runs `f` on 2 ranks in a watchdog thread: (elapsed, per-rank "ok" or error text).
fn timed_ranks<F>(timeout: Duration, f: F) -> (Duration, Vec<String>)
where
    F: Fn(Arc<dyn ProcessGroup>) -> candle_fsdp::Result<()> + Send + Sync + 'static,
{
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let start = Instant::now();
        let res = run_ranks(2, ThreadGroupConfig { timeout }, f);
        let msgs: Vec<String> = res
            .iter()
            .map(|r| match r {
                Ok(()) => "ok".into(),
                Err(e) => e.to_string(),
            })
            .collect();
        let _ = tx.send((start.elapsed(), msgs));
    });
    rx.recv_timeout(timeout + Duration::from_secs(60))
        .expect("ranks still running a minute past the collective timeout")
}

#[test]
fn a_panic_in_backward_on_one_rank_fails_every_rank_promptly() {
    let (elapsed, msgs) = timed_ranks(Duration::from_secs(300), |pg| {
        let mut model = FsdpModel::builder(pg.clone(), FsdpConfig::default())
            .unit("a", |vb| candle_nn::linear(DM, DM, vb))
            .unit("boom", |vb| {
                Ok(LinearPanicBwd(candle_nn::linear(DM, DM, vb)?))
            })
            .unit("c", |vb| candle_nn::linear(DM, DM, vb))
            .build()?;
        let x = Tensor::ones((2, DM), DType::F32, &Device::Cpu)?;
        let y = model.forward(&x)?;
        model.backward(&y.sum_all()?)?;
        Ok(())
    });
    println!("panic in backward: {elapsed:?} {msgs:?}");
    assert!(
        elapsed < Duration::from_secs(10),
        "took {elapsed:?}: {msgs:?}"
    );
    assert!(msgs[1].contains("boom in rank 1's backward"), "{msgs:?}");
    assert!(msgs[0] != "ok", "{msgs:?}");
}

#[test]
fn a_unit_error_on_one_rank_fails_every_rank_promptly() {
    // Rank 1 feeds a batch of the wrong width (a data bug on one rank).
    let (elapsed, msgs) = timed_ranks(Duration::from_secs(300), |pg| {
        let mut model = FsdpModel::builder(pg.clone(), FsdpConfig::default())
            .unit("a", |vb| candle_nn::linear(DM, DM, vb))
            .unit("b", |vb| candle_nn::linear(DM, DM, vb))
            .build()?;
        let w = if pg.rank() == 1 { DM + 1 } else { DM };
        let x = Tensor::ones((2, w), DType::F32, &Device::Cpu)?;
        let y = model.forward(&x)?;
        model.backward(&y.sum_all()?)?;
        Ok(())
    });
    println!("error on one rank: {elapsed:?} {msgs:?}");
    assert!(
        elapsed < Duration::from_secs(10),
        "took {elapsed:?}: {msgs:?}"
    );
    assert!(msgs[1].contains("unit a"), "{msgs:?}");
    assert!(msgs[0] != "ok", "{msgs:?}");
}

/// Data-dependent control flow that differs between ranks: rank 0 calls unit "a", rank 1 calls
/// unit "b" (same shapes). The all-gathers pair rank 0's shard of a with rank 1's shard of b.
/// Expected: an error (the library checks at build time that ranks built the same model, and
/// the docs say every rank must call the same units in the same order), not silently mixed
/// parameters and gradients.
#[test]
fn ranks_calling_different_units_fail_promptly_in_the_forward() {
    let (elapsed, msgs) = timed_ranks(Duration::from_secs(20), |pg| {
        let mut model = FsdpModel::builder(pg.clone(), FsdpConfig::default())
            .unit("a", |vb| candle_nn::linear(DM, DM, vb))
            .unit("b", |vb| candle_nn::linear(DM, DM, vb))
            .unit("c", |vb| candle_nn::linear(DM, DM, vb))
            .build()?;
        let x = Tensor::ones((2, DM), DType::F32, &Device::Cpu)?;
        let r = pg.rank();
        let y = model.forward_with(|f| {
            let h = f.call1(if r == 0 { "a" } else { "b" }, &x)?;
            f.call1("c", &h)
        })?;
        model.backward(&y.sum_all()?)?;
        let mut opt = make_opt(false);
        opt.step(&mut model)?;
        Ok(())
    });
    println!("ranks calling different units: {elapsed:?} {msgs:?}");
    assert!(
        msgs.iter().all(|m| m != "ok"),
        "no error on any rank: {msgs:?}"
    );
    // Expected: a prompt error in the forward, not the collective timeout (20 s here).
    assert!(
        elapsed < Duration::from_secs(10),
        "took {elapsed:?}: {msgs:?}"
    );
    assert!(
        msgs[0].contains("forward"),
        "not caught in the forward: {msgs:?}"
    );
}
