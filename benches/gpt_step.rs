//! Step time of the GPT benchmark configuration ([`GptConfig::benchmark`]: 6 layers, d 512,
//! 8 heads, untied head, 19.3 M parameters; batch 4 × 256 tokens, f32, AdamW) in one process:
//! plain single-process Candle (the same `models::gpt` modules, `candle_nn::AdamW`) next to
//! FSDP FULL_SHARD at world size 1 (ranks as threads) and at world size 2 (two threads sharing
//! the machine's cores). Synthetic token ids: the data loader is not timed.
//!
//! `cargo bench --bench gpt_step`. Tokens/s = 1024 × world size / step seconds.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_fsdp::comm::threads::{set_intra_op_threads, ThreadGroupConfig};
use candle_fsdp::comm::ProcessGroupExt;
use candle_fsdp::init::seeded_var_builder;
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::models::gpt::{lm_loss, FsdpGpt, Gpt, GptConfig};
use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, FsdpModel, ShardedOptimizer};
use candle_nn::{Optimizer, VarMap};
use criterion::{BenchmarkId, Criterion};

#[path = "../examples/common/alloc.rs"]
mod alloc;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const BATCH: usize = 4;

/// `(ids, targets)`, both `(BATCH, seq_len)` u32 bytes, different per rank.
fn batch(cfg: &GptConfig, rank: usize) -> (Tensor, Tensor) {
    let n = BATCH * cfg.seq_len;
    let ids: Vec<u32> = (0..n)
        .map(|i| ((i * 7919 + rank * 31) % 256) as u32)
        .collect();
    let tg: Vec<u32> = (0..n)
        .map(|i| ((i * 104729 + 3 + rank) % 256) as u32)
        .collect();
    let shape = (BATCH, cfg.seq_len);
    (
        Tensor::from_vec(ids, shape, &Device::Cpu).unwrap(),
        Tensor::from_vec(tg, shape, &Device::Cpu).unwrap(),
    )
}

fn adamw() -> AdamWConfig {
    AdamWConfig {
        lr: 3e-4,
        beta1: 0.9,
        beta2: 0.95,
        weight_decay: 0.1,
        ..Default::default()
    }
}

/// Wall time of `steps` FSDP steps at `world_size` (the slowest rank's), after one warm-up step.
fn fsdp_steps(world_size: usize, steps: u64) -> Duration {
    let cfg = GptConfig::benchmark();
    let times = launch(
        &Launcher::Threads {
            world_size,
            config: ThreadGroupConfig::default(),
        },
        |pg| {
            let gpt = FsdpGpt::new(cfg)?;
            let mut model = gpt
                .add_units(FsdpModel::builder(pg.clone(), FsdpConfig::default()))
                .build()?;
            let mut opt = AdamW::new(adamw());
            let (x, y) = batch(&cfg, pg.rank());
            let mut step = |model: &mut FsdpModel| -> candle_fsdp::Result<()> {
                let logits = gpt.logits(model, &x, true)?;
                let loss = lm_loss(&logits, &y)?;
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

/// Wall time of `steps` plain Candle steps, after one warm-up step.
fn plain_steps(steps: u64) -> Duration {
    let cfg = GptConfig::benchmark();
    let varmap = VarMap::new();
    let gpt = Gpt::new(
        cfg,
        seeded_var_builder(&varmap, 0, DType::F32, &Device::Cpu),
    )
    .unwrap();
    let a = adamw();
    let mut opt = candle_nn::AdamW::new(
        varmap.all_vars(),
        candle_nn::ParamsAdamW {
            lr: a.lr,
            beta1: a.beta1,
            beta2: a.beta2,
            eps: a.eps,
            weight_decay: a.weight_decay,
        },
    )
    .unwrap();
    let (x, y) = batch(&cfg, 0);
    let mut step = || {
        let loss = lm_loss(&gpt.forward(&x).unwrap(), &y).unwrap();
        opt.backward_step(&loss).unwrap();
    };
    step();
    let t0 = Instant::now();
    for _ in 0..steps {
        step();
    }
    t0.elapsed()
}

fn main() {
    alloc::keep_freed_memory();
    set_intra_op_threads(2);
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(30))
        .configure_from_args();
    let mut g = c.benchmark_group("gpt_step_bench_config");
    g.bench_function("plain_candle_one_process", |b| b.iter_custom(plain_steps));
    for ws in [1, 2] {
        g.bench_function(BenchmarkId::new("fsdp_full_shard_threads_ws", ws), |b| {
            b.iter_custom(|iters| fsdp_steps(ws, iters))
        });
    }
    g.finish();
    c.final_summary();
}
