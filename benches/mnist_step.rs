//! Step time of the seed recipe (MNIST MLP 784-128-64-10, batch 32 per rank, AdamW) at world
//! size 2: FULL_SHARD, SHARD_GRAD_OP and NO_SHARD (DDP-like), next to plain single-process Candle
//! on the same per-rank batch. Synthetic inputs of MNIST's shape: the data loader is not timed.
//!
//! `cargo bench --bench mnist_step`. One epoch of the recipe at world size 2 is 938 steps, so
//! epoch seconds ≈ step ms × 0.938.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_fsdp::comm::threads::{set_intra_op_threads, ThreadGroupConfig};
use candle_fsdp::comm::ProcessGroupExt;
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, FsdpModel, ShardedOptimizer, ShardingStrategy};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use criterion::{BenchmarkId, Criterion};

#[path = "../examples/common/alloc.rs"]
mod alloc;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const BATCH: usize = 32;

fn batch(rank: usize) -> (Tensor, Tensor) {
    let x = Tensor::rand(0f32, 1.0, (BATCH, 1, 28, 28), &Device::Cpu).unwrap();
    let y = Tensor::from_vec(
        (0..BATCH as u32)
            .map(|i| (i + rank as u32) % 10)
            .collect::<Vec<_>>(),
        BATCH,
        &Device::Cpu,
    )
    .unwrap();
    (x, y)
}

/// The same units as plain Candle modules, run in order.
fn mlp(vb: VarBuilder) -> candle_core::Result<Vec<Box<dyn candle_fsdp::unit::UnitModule>>> {
    candle_fsdp::models::mnist_mlp()
        .iter()
        .map(|u| (u.ctor)(vb.pp(&u.name)))
        .collect()
}

/// Wall time of `steps` FSDP steps on every rank (the slowest rank's), after one warm-up step.
fn fsdp_steps(strategy: ShardingStrategy, steps: u64) -> Duration {
    let times = launch(
        &Launcher::Threads {
            world_size: 2,
            config: ThreadGroupConfig::default(),
        },
        |pg| {
            let rank = pg.rank();
            let mut model = FsdpModel::builder(
                pg.clone(),
                FsdpConfig {
                    sharding_strategy: strategy,
                    ..Default::default()
                },
            )
            .units(candle_fsdp::models::mnist_mlp())
            .build()?;
            let mut opt = AdamW::new(AdamWConfig::default());
            let (x, y) = batch(rank);
            let mut step = |model: &mut FsdpModel| -> candle_fsdp::Result<()> {
                let logits = model.forward(&x)?;
                let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
                model.backward(&loss)?;
                opt.step(model)?;
                model.zero_grad();
                Ok(())
            };
            step(&mut model)?;
            pg.barrier_wait()?;
            let t0 = Instant::now();
            for _ in 0..steps {
                step(&mut model)?;
            }
            Ok(t0.elapsed())
        },
    )
    .expect("FSDP steps");
    times.into_iter().max().unwrap()
}

fn plain_steps(steps: u64) -> Duration {
    let varmap = VarMap::new();
    let model = mlp(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).unwrap();
    let mut opt = candle_nn::AdamW::new(varmap.all_vars(), Default::default()).unwrap();
    let (x, y) = batch(0);
    let t0 = Instant::now();
    for _ in 0..steps {
        let logits = model
            .iter()
            .try_fold(x.clone(), |h, m| m.forward1(&h, true))
            .unwrap();
        let loss = candle_nn::loss::cross_entropy(&logits, &y).unwrap();
        opt.backward_step(&loss).unwrap();
    }
    t0.elapsed()
}

fn main() {
    alloc::keep_freed_memory();
    set_intra_op_threads(2);
    let mut c = Criterion::default()
        .sample_size(10)
        .measurement_time(Duration::from_secs(5))
        .configure_from_args();
    let mut g = c.benchmark_group("mnist_step_ws2");
    for (name, strategy) in [
        ("full_shard", ShardingStrategy::FullShard),
        ("shard_grad_op", ShardingStrategy::ShardGradOp),
        ("no_shard", ShardingStrategy::NoShard),
    ] {
        g.bench_function(BenchmarkId::new("fsdp", name), |b| {
            b.iter_custom(|iters| fsdp_steps(strategy, iters))
        });
    }
    g.bench_function("plain_candle_one_process_batch32", |b| {
        b.iter_custom(plain_steps)
    });
    g.finish();
    c.final_summary();
}
