//! The MPI backend under `mpirun` (feature `mpi`): run as
//! `mpirun -n N target/release/deps/mpi-<hash> --test-threads=1` (`.ci/run` does it for N = 2
//! and 3; without `mpirun` it runs as a job of one process).
//!
//! One test runs every scenario in a fixed order, because MPI collectives must be issued in the
//! same order by every process (the test harness would interleave separate tests differently in
//! each process):
//! - every collective, dtype and reduce op gives bitwise the thread backend's result;
//! - two streams are independent (an all-gather and a reduce-scatter in flight together);
//! - a mismatched call is the same error on every rank, and the group stays usable;
//! - FSDP training equals plain single-process Candle (the thread parity suite's checks);
//! - a checkpoint saved by the MPI processes loads in thread ranks of another world size and the
//!   reverse, bit-exactly (parameters and optimizer state, shown by identical later losses).
//!
//! `mpi_hybrid_suite` runs HYBRID_SHARD at world sizes 4 (2 × 2) and 6 (3 × 2 and 2 × 3) only
//! (`.ci/run` starts it alone, `mpirun -n 4|6 <binary> hybrid`): parity with single-process
//! Candle, and a hybrid checkpoint loaded by FULL_SHARD thread ranks and back, bit-exactly.
#![cfg(feature = "mpi")]

mod common;
#[path = "common/parity.rs"]
mod parity;

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_fsdp::checkpoint::{self, TrainState};
use candle_fsdp::comm::mpi::MpiConfig;
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::{ProcessGroup, ProcessGroupExt, ReduceOp};
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::optim::{AdamW, AdamWConfig};
use candle_fsdp::{Error, FsdpConfig, FsdpModel, ShardingStrategy};
use common::*;
use parity::{check, Opt};
use rand::{Rng, SeedableRng};

fn mpi() -> Launcher {
    Launcher::mpi(MpiConfig::default()).expect("MPI starts")
}

const DTYPES: [DType; 9] = [
    DType::F32,
    DType::BF16,
    DType::F16,
    DType::F64,
    DType::I64,
    DType::I32,
    DType::I16,
    DType::U32,
    DType::U8,
];

/// Rank `rank`'s deterministic input of `len` elements of `dtype` (small values: integer sums
/// do not wrap, and every rank can rebuild every other rank's input).
fn input(rank: usize, dtype: DType, len: usize) -> Tensor {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rank as u64 * 1000 + dtype as u64);
    let v: Vec<f64> = (0..len)
        .map(|_| {
            let x = rng.random_range(0.0..100.0f64);
            if dtype.is_float() {
                x - 50.0 + 1.0 / 3.0
            } else {
                x.floor()
            }
        })
        .collect();
    Tensor::new(v, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// Every collective of rank `pg.rank()` on `dtype`, as f64 vectors (exact for every dtype):
/// shards of `n` elements, in-place buffers of `odd` elements.
fn collectives(
    pg: &Arc<dyn ProcessGroup>,
    dtype: DType,
    n: usize,
    odd: usize,
) -> candle_fsdp::Result<Vec<Vec<f64>>> {
    let (rank, ws) = (pg.rank(), pg.world_size());
    let s = pg.default_stream();
    let f64s = |t: Tensor| t.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
    let mut out = Vec::new();
    let x = input(rank, dtype, n);
    let gathered = pg
        .all_gather(&s, &x, Tensor::zeros(ws * n, dtype, &Device::Cpu)?)
        .wait()?;
    out.push(f64s(gathered));
    let ops: &[ReduceOp] = if dtype.is_float() {
        &[ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min]
    } else {
        &[ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min]
    };
    for &op in ops {
        let big = input(rank, dtype, ws * n);
        let shard = pg
            .reduce_scatter(&s, &big, Tensor::zeros(n, dtype, &Device::Cpu)?, op)
            .wait()?;
        out.push(f64s(shard));
        let all = pg.all_reduce(&s, input(rank, dtype, odd), op).wait()?;
        out.push(f64s(all));
        let root = 1 % ws;
        let red = pg.reduce(&s, input(rank, dtype, odd), root, op).wait()?;
        out.push(f64s(red));
    }
    let b = pg.broadcast(&s, input(rank, dtype, odd), ws - 1).wait()?;
    out.push(f64s(b));
    pg.barrier(&s).wait()?;
    Ok(out)
}

/// Small buffers for every dtype, and buffers of several 256 KiB segments with uneven chunks
/// for the float dtypes.
fn collectives_equal_the_thread_backend(launcher: &Launcher) {
    let ws = launcher.world_size();
    let cases = DTYPES
        .iter()
        .map(|&d| (d, 1000, 1001))
        .chain([DType::F32, DType::BF16, DType::F16].map(|d| (d, 70_001, 300_007)));
    for (dtype, n, odd) in cases {
        let threads = run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
            collectives(&pg, dtype, n, odd)
        })
        .unwrap();
        let mine = launch(launcher, |pg| collectives(&pg, dtype, n, odd)).unwrap();
        let rank = launcher.local_ranks().start;
        assert!(
            mine[0] == threads[rank],
            "{dtype:?} (n {n}, odd {odd}): MPI rank {rank} differs from the thread backend"
        );
    }
}

/// Rank 0 waits for its reduce-scatter (stream b) before its all-gather (stream a) completes;
/// the others issue the all-gather only after their reduce-scatter completed. One ordered
/// channel per process would deadlock; one communicator per stream does not.
fn streams_are_independent(launcher: &Launcher) {
    launch(launcher, |pg| {
        let (rank, ws) = (pg.rank(), pg.world_size());
        let a = pg.new_stream("a")?;
        let b = pg.new_stream("b")?;
        let x = Tensor::new(&[rank as f32 + 1.0], &Device::Cpu)?;
        let big = Tensor::ones(ws, DType::F32, &Device::Cpu)?;
        let zeros = |n| Tensor::zeros(n, DType::F32, &Device::Cpu);
        let (gathered, reduced) = if rank == 0 {
            let ag = pg.all_gather(&a, &x, zeros(ws)?);
            let rs = pg.reduce_scatter(&b, &big, zeros(1)?, ReduceOp::Sum);
            let reduced = rs.wait()?;
            (ag.wait()?, reduced)
        } else {
            let reduced = pg
                .reduce_scatter(&b, &big, zeros(1)?, ReduceOp::Sum)
                .wait()?;
            (pg.all_gather(&a, &x, zeros(ws)?).wait()?, reduced)
        };
        let expected: Vec<f32> = (1..=ws).map(|r| r as f32).collect();
        assert_eq!(gathered.to_vec1::<f32>()?, expected);
        assert_eq!(reduced.to_vec1::<f32>()?, vec![ws as f32]);
        Ok(())
    })
    .unwrap();
}

/// Rank 0 passes 4 elements where the others pass 5: every rank gets the same mismatch error,
/// then the group works again.
fn mismatch_is_an_error_on_every_rank(launcher: &Launcher) {
    if launcher.world_size() < 2 {
        return;
    }
    launch(launcher, |pg| {
        let (rank, ws) = (pg.rank(), pg.world_size());
        let s = pg.default_stream();
        let n = if rank == 0 { 4 } else { 5 };
        let x = Tensor::zeros(n, DType::F32, &Device::Cpu)?;
        let err = pg
            .all_gather(&s, &x, Tensor::zeros(ws * n, DType::F32, &Device::Cpu)?)
            .wait()
            .unwrap_err();
        assert!(
            matches!(err, Error::CollectiveMismatch { .. }),
            "rank {rank}: {err}"
        );
        assert_eq!(
            err.to_string(),
            "all_gather #1 (stream collective): rank 1 passed an input of 5 elements but rank 0 \
             passed an input of 4 elements"
        );
        let sum = pg.all_reduce_f32s(vec![1.0], ReduceOp::Sum)?;
        assert_eq!(sum, vec![ws as f32]);
        Ok(())
    })
    .unwrap();
}

fn fsdp_matches_single_process(launcher: &Launcher) {
    check(launcher, ShardingStrategy::FullShard, Opt::Adam, true);
    check(
        launcher,
        ShardingStrategy::FullShard,
        Opt::SgdMomentum,
        true,
    );
    check(launcher, ShardingStrategy::ShardGradOp, Opt::Adam, true);
    check(launcher, ShardingStrategy::NoShard, Opt::Adam, true);
    check(launcher, ShardingStrategy::FullShard, Opt::Adam, false);
}

const PER_RANK: usize = 4;

fn build(pg: Arc<dyn ProcessGroup>) -> candle_fsdp::Result<(FsdpModel, AdamW)> {
    build_with(pg, ShardingStrategy::FullShard)
}

fn build_with(
    pg: Arc<dyn ProcessGroup>,
    strategy: ShardingStrategy,
) -> candle_fsdp::Result<(FsdpModel, AdamW)> {
    let mut b = FsdpModel::builder(
        pg,
        FsdpConfig {
            seed: 7,
            sharding_strategy: strategy,
            ..Default::default()
        },
    );
    for u in units() {
        b = b.unit_spec(u);
    }
    let optim = AdamW::new(AdamWConfig {
        lr: 1e-2,
        weight_decay: 0.01,
        ..Default::default()
    });
    Ok((b.build()?, optim))
}

/// Trains `steps` steps on global batches `data[first..]`; returns each step's local loss.
fn train(
    model: &mut FsdpModel,
    optim: &mut AdamW,
    data: &[(Tensor, Tensor)],
) -> candle_fsdp::Result<Vec<f32>> {
    use candle_fsdp::optim::ShardedOptimizer;
    let rank = model.process_group().rank();
    let mut losses = Vec::new();
    for (x, y) in data {
        let x = x.narrow(0, rank * PER_RANK, PER_RANK)?;
        let y = y.narrow(0, rank * PER_RANK, PER_RANK)?;
        let loss = candle_nn::loss::cross_entropy(&model.forward(&x)?, &y)?;
        model.backward(&loss)?;
        optim.step(model)?;
        model.zero_grad();
        losses.push(loss.to_scalar::<f32>()?);
    }
    Ok(losses)
}

fn params(model: &FsdpModel) -> candle_fsdp::Result<Vec<(String, Vec<f32>)>> {
    let mut p: Vec<(String, Vec<f32>)> = model
        .gather_full_params(false)?
        .expect("every rank gathers")
        .into_iter()
        .map(|(k, t)| (k, to_vec(&t)))
        .collect();
    p.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(p)
}

/// A directory every process of the job agrees on (rank 0's process id).
fn shared_dir(pg: &Arc<dyn ProcessGroup>, tag: &str) -> PathBuf {
    let pid = pg
        .broadcast_u64s(vec![std::process::id() as u64], 0)
        .unwrap()[0];
    std::env::temp_dir().join(format!("candle-fsdp-mpi-{tag}-{pid}"))
}

fn checkpoints_cross_backends_and_world_sizes(launcher: &Launcher) {
    let ws = launcher.world_size();
    let other_ws = if ws == 3 { 2 } else { 3 };
    checkpoints_cross(launcher, ShardingStrategy::FullShard, other_ws);
}

/// Saves under `strategy` in the MPI processes, loads in `other_ws` FULL_SHARD thread ranks
/// (rank 0's process), saves there, loads back in the MPI processes: the same parameters and,
/// continuing, the same losses as straight through.
fn checkpoints_cross(launcher: &Launcher, strategy: ShardingStrategy, other_ws: usize) {
    let ws = launcher.world_size();
    let data = batches(5, PER_RANK * ws.max(other_ws), 11);
    let (first, later) = data.split_at(3);
    let state = TrainState {
        step: 3,
        ..Default::default()
    };
    launch(launcher, |pg| {
        let root = shared_dir(&pg, "ckpt");
        let (dir_a, dir_b) = (root.join("mpi"), root.join("threads"));
        let (mut model, mut optim) = build_with(pg.clone(), strategy)?;
        train(&mut model, &mut optim, first)?;
        checkpoint::save_sharded(&dir_a, &model, &optim, &state, 0)?;
        let saved = params(&model)?;
        let direct = train(&mut model, &mut optim, later)?;
        pg.barrier_wait()?;
        // Rank 0's process: load the MPI checkpoint in `other_ws` thread ranks, check it, save it
        // again from there.
        let ok = if pg.rank() == 0 {
            let loaded = run_ranks_ok(other_ws, ThreadGroupConfig::default(), |tpg| {
                let (mut m, mut o) = build(tpg)?;
                let found = checkpoint::load_latest(&dir_a, &mut m, &mut o)?.expect("a checkpoint");
                assert_eq!(found.meta.step(), 3);
                let p = params(&m)?;
                checkpoint::save_sharded(&dir_b, &m, &o, &state, 0)?;
                Ok(p)
            })
            .unwrap();
            loaded.iter().all(|p| *p == saved)
        } else {
            true
        };
        let agreed = pg.all_reduce_u64s(vec![u64::from(ok)], ReduceOp::Min)?;
        assert_eq!(agreed, vec![1], "thread ranks loaded other parameters");
        // Every MPI rank: load what the thread ranks saved, continue, and land on the same
        // losses as the uninterrupted run (so the optimizer state survived both trips bitwise).
        let (mut model, mut optim) = build_with(pg.clone(), strategy)?;
        checkpoint::load_latest(&dir_b, &mut model, &mut optim)?.expect("a checkpoint");
        assert_eq!(params(&model)?, saved);
        let resumed = train(&mut model, &mut optim, later)?;
        assert_eq!(resumed, direct, "losses after the round trip");
        pg.barrier_wait()?;
        if pg.rank() == 0 {
            let _ = std::fs::remove_dir_all(&root);
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn mpi_suite() {
    let launcher = mpi();
    let say = |what: &str| {
        if launcher.local_ranks().start == 0 {
            eprintln!("mpi suite (world size {}): {what}", launcher.world_size());
        }
    };
    say("collectives equal the thread backend's, bitwise, for every dtype and op");
    collectives_equal_the_thread_backend(&launcher);
    say("two streams are independent");
    streams_are_independent(&launcher);
    say("a mismatched call is the same error on every rank");
    mismatch_is_an_error_on_every_rank(&launcher);
    say("FSDP training equals single-process Candle");
    fsdp_matches_single_process(&launcher);
    say("checkpoints cross backends and world sizes bit-exactly");
    checkpoints_cross_backends_and_world_sizes(&launcher);
    say("done");
}

#[test]
fn mpi_hybrid_suite() {
    let launcher = mpi();
    let ws = launcher.world_size();
    let say = |what: &str| {
        if launcher.local_ranks().start == 0 {
            eprintln!("mpi hybrid suite (world size {ws}): {what}");
        }
    };
    let shard_sizes: &[usize] = match ws {
        4 => &[2],
        6 => &[2, 3],
        _ => {
            say("runs at world sizes 4 and 6 only (mpirun -n 4|6): skipped");
            return;
        }
    };
    for &s in shard_sizes {
        let hybrid = ShardingStrategy::HybridShard {
            shard_size: Some(s),
        };
        say(&format!(
            "{} replicas x {s}: training equals single-process Candle",
            ws / s
        ));
        check(&launcher, hybrid, Opt::Adam, true);
        check(&launcher, hybrid, Opt::SgdMomentum, false);
        let zero2 = ShardingStrategy::HybridShardGradOp {
            shard_size: Some(s),
        };
        check(&launcher, zero2, Opt::Adam, true);
        say(&format!(
            "{} replicas x {s}: checkpoint to FULL_SHARD thread ranks and back, bit-exactly",
            ws / s
        ));
        checkpoints_cross(&launcher, hybrid, 3);
    }
    say("done");
}
