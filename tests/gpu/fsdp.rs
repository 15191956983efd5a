//! FSDP on a GPU: world size 1 against plain Candle CUDA, 2 and 4 thread ranks sharing one
//! GPU, parameters freed after each unit's forward (the CUDA memory pool's counters), the
//! all-gather overlapped with compute in the GPU-timed trace.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_fsdp::comm::{ProcessGroup, ProcessGroupExt};
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::optim::{Sgd, SgdConfig, ShardedOptimizer};
use candle_fsdp::trace::{SpanKind, TraceSession};
use candle_fsdp::unit::UnitSpec;
use candle_fsdp::{FsdpConfig, FsdpModel, ShardingStrategy};

use crate::parity::{check_against, Opt};

/// `ws` thread ranks sharing the test GPU (the thread backend on CUDA tensors).
fn gpu_threads(ws: usize) -> Launcher {
    Launcher::threads_on_gpu(ws, crate::gpu())
}

fn cuda() -> Device {
    Device::new_cuda(crate::gpu()).expect("a CUDA device")
}

#[test]
#[ignore = "needs a GPU; scripts/gpu-check.sh runs it"]
fn world_size_1_matches_plain_candle_cuda() {
    for opt in [Opt::Adam, Opt::SgdMomentum] {
        check_against(
            &cuda(),
            &gpu_threads(1),
            ShardingStrategy::FullShard,
            opt,
            true,
        );
    }
}

#[test]
#[ignore = "needs a GPU; scripts/gpu-check.sh runs it"]
fn two_and_four_ranks_on_one_gpu_match_plain_candle_cuda() {
    for ws in [2, 4] {
        for strategy in [
            ShardingStrategy::FullShard,
            ShardingStrategy::ShardGradOp,
            ShardingStrategy::NoShard,
        ] {
            for prefetch in [true, false] {
                check_against(&cuda(), &gpu_threads(ws), strategy, Opt::Adam, prefetch);
            }
        }
    }
}

/// Bytes in use in the GPU's default memory pool (stream-ordered allocations), with every
/// rank at the same point: the pool is the device's, shared by all the thread ranks on it, so
/// each rank first runs its stream's queued work (and so its queued frees), the ranks meet,
/// each reads the counter (the same snapshot of every rank's allocations), and they meet again
/// before anyone allocates.
fn pool_used(pg: &Arc<dyn ProcessGroup>) -> u64 {
    let Device::Cuda(d) = pg.device() else {
        panic!("a CUDA group")
    };
    d.cuda_stream().synchronize().unwrap();
    pg.barrier_wait().expect("barrier");
    let used = candle_fsdp::device::cuda::pool_used_bytes(d).expect("pool counters");
    pg.barrier_wait().expect("barrier");
    used
}

/// Four units of 1024×1024 f32 weights (4 MiB each): after a FULL_SHARD forward at world size
/// 2, each unit's gathered parameters are freed once the next unit starts, so the pool holds
/// the shards + fewer than two gathered units per rank, not four. The pool is the device's,
/// shared by the ranks on the GPU: the bound is for all of them together.
#[test]
#[ignore = "needs a GPU; scripts/gpu-check.sh runs it"]
fn parameters_are_freed_after_each_units_forward() {
    const D: usize = 1024;
    const WS: usize = 2;
    let unit_bytes = (D * D * 4) as u64;
    let results = launch(&gpu_threads(WS), |pg| {
        let units: Vec<UnitSpec> = (0..4)
            .map(|i| UnitSpec::new(format!("l{i}"), |vb| candle_nn::linear_no_bias(D, D, vb)))
            .collect();
        let config = FsdpConfig {
            device: pg.device().clone(),
            ..Default::default()
        };
        let mut b = FsdpModel::builder(pg.clone(), config);
        for u in units {
            b = b.unit_spec(u);
        }
        let mut model = b.build()?;
        let x = Tensor::ones((2, D), DType::F32, pg.device())?;
        let before = pool_used(&pg);
        // Eval forward: no graph keeps anything alive.
        let y = model.forward_eval(&x)?;
        let after_eval = pool_used(&pg);
        drop(y);
        // Training forward: parameters freed under the live graph (storage swapped out).
        let y = model.forward(&x)?;
        let after_train = pool_used(&pg);
        let loss = y.sum_all()?;
        model.backward(&loss)?;
        Ok((before, after_eval, after_train))
    })
    .expect("run");
    // Activations are 2×1024 f32: tiny. Without freeing, 4 gathered units (16 MiB) per rank
    // stay; with it, at most one per rank (the last unit, or a prefetched one). Every rank read
    // the same snapshots of the shared pool.
    let bound = WS as u64 * 2 * unit_bytes;
    for (rank, (before, after_eval, after_train)) in results.into_iter().enumerate() {
        let grown_eval = after_eval.saturating_sub(before);
        let grown_train = after_train.saturating_sub(before);
        assert!(
            grown_eval < bound,
            "rank {rank}: {grown_eval} bytes still in use on the GPU after the eval forward of \
             {WS} ranks (4 units of {unit_bytes} B were gathered per rank; at most one each may \
             be kept)"
        );
        assert!(
            grown_train < bound,
            "rank {rank}: {grown_train} bytes still in use on the GPU after the training forward \
             of {WS} ranks (at most one gathered unit of {unit_bytes} B each may be kept)"
        );
    }
}

/// A GPU-timed trace of FULL_SHARD at world size 2 shows all-gathers on their comm stream
/// running while the compute stream computes (overlap > 0), with CUDA-event times.
///
/// On the device the gather of unit k+1 waits for its shard cast, enqueued on the compute
/// stream before unit k's forward, so it can run during that forward; whether it does depends
/// on the GPU being the bottleneck (if the host is, each kernel runs as soon as it is enqueued
/// and the comm stream's host rendezvous decides the order). The batch makes each forward
/// about 34 GFLOP per rank, long beside the host's issue of a unit, so the compute stream is
/// behind the host and the prefetched gather starts while the previous forward runs.
#[test]
#[ignore = "needs a GPU; scripts/gpu-check.sh runs it"]
fn trace_on_gpu_shows_all_gather_overlapping_compute() {
    const D: usize = 2048;
    const BATCH: usize = 4096;
    let session = TraceSession::new();
    let spans = launch(&gpu_threads(2), |pg| {
        let config = FsdpConfig {
            device: pg.device().clone(),
            ..Default::default()
        };
        let mut b = FsdpModel::builder(pg.clone(), config);
        for i in 0..6 {
            b = b.unit_spec(UnitSpec::new(format!("l{i}"), |vb| {
                candle_nn::linear_no_bias(D, D, vb)
            }));
        }
        let mut model = b.build()?;
        let tracer = session.tracer(pg.rank());
        model.set_tracer(Some(tracer.clone()));
        let mut opt = Sgd::new(SgdConfig {
            lr: 1e-3,
            ..Default::default()
        });
        let x = Tensor::ones((BATCH, D), DType::F32, pg.device())?;
        for _ in 0..3 {
            let loss = model.forward(&x)?.sum_all()?;
            model.backward(&loss)?;
            opt.step(&mut model)?;
            model.zero_grad();
        }
        Ok(tracer.spans())
    })
    .expect("run");
    let s = &spans[0];
    let gathers: Vec<_> = s.iter().filter(|s| s.kind == SpanKind::AllGather).collect();
    let forwards: Vec<_> = s.iter().filter(|s| s.kind == SpanKind::Forward).collect();
    assert!(
        !gathers.is_empty() && !forwards.is_empty(),
        "spans recorded"
    );
    // Device timing in effect: every all-gather and reduce-scatter (each moves data between
    // its events) has its events' duration; a span left on its host issue time, because its
    // events could not be read, has none.
    let untimed: Vec<_> = s
        .iter()
        .filter(|s| matches!(s.kind, SpanKind::AllGather | SpanKind::ReduceScatter))
        .filter(|s| s.dur_us <= 0.0)
        .collect();
    assert!(
        untimed.is_empty(),
        "comm spans without a device duration: {untimed:?}"
    );
    let overlap: f64 = gathers
        .iter()
        .map(|g| {
            forwards
                .iter()
                .map(|f| {
                    let lo = g.start_us.max(f.start_us);
                    let hi = (g.start_us + g.dur_us).min(f.start_us + f.dur_us);
                    (hi - lo).max(0.0)
                })
                .sum::<f64>()
        })
        .sum();
    assert!(
        overlap > 0.0,
        "no all-gather overlapped a forward on the GPU timeline: {gathers:?} {forwards:?}"
    );
}
