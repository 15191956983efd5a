use candle_core::{DType, Device, Tensor};
use candle_fsdp::comm::threads::{run_ranks_ok, set_intra_op_threads, ThreadGroupConfig};
use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, FsdpModel, ShardedOptimizer, ShardingStrategy};
use std::time::Instant;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let ws: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(2);
    let strat: ShardingStrategy = std::env::args()
        .nth(2)
        .map(|s| s.parse().unwrap())
        .unwrap_or_default();
    set_intra_op_threads(ws);
    let r = run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
        let cfg = FsdpConfig {
            sharding_strategy: strat,
            ..FsdpConfig::default()
        };
        let mut m = FsdpModel::builder(pg.clone(), cfg)
            .units(candle_fsdp::models::mnist_mlp())
            .build()?;
        let mut opt = AdamW::new(AdamWConfig::default());
        let x = Tensor::rand(0f32, 1.0, (32, 1, 28, 28), &Device::Cpu)?;
        let y = Tensor::from_vec(
            (0..32u32).map(|i| i % 10).collect::<Vec<_>>(),
            32,
            &Device::Cpu,
        )?;
        let (mut tf, mut tb, mut to) = (0f64, 0f64, 0f64);
        let n = 600;
        for i in 0..n + 50 {
            let t0 = Instant::now();
            let logits = m.forward(&x)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
            let t1 = Instant::now();
            m.backward(&loss)?;
            let t2 = Instant::now();
            opt.step(&mut m)?;
            m.zero_grad();
            let t3 = Instant::now();
            if i >= 50 {
                tf += (t1 - t0).as_secs_f64();
                tb += (t2 - t1).as_secs_f64();
                to += (t3 - t2).as_secs_f64();
            }
        }
        let _ = DType::F32;
        Ok((
            tf / n as f64 * 1e3,
            tb / n as f64 * 1e3,
            to / n as f64 * 1e3,
        ))
    })
    .unwrap();
    for (rank, (f, b, o)) in r.iter().enumerate() {
        println!("ws {ws} {strat:?} rank {rank}: forward {f:.3} ms, backward {b:.3} ms, optimizer {o:.3} ms, total {:.3} ms", f + b + o);
    }
}
