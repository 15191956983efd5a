//! What a run fingerprint (`FsdpConfig::fingerprint`, issue 35) costs: CRC-32C throughput on
//! one core, and the training step of a model of 10 units of Linear(2048, 2048) (42 M
//! parameters) at world size 2 with and without the fingerprint, alternated.
//!
//! ```text
//! cargo bench --bench fingerprint     # about a minute, ~2 GiB RAM
//! ```
//!
//! A step hashes, per rank, every unit's gathered parameters (168 MB), its gradient before the
//! reduce-scatter (168 MB), the reduced chunk (84 MB) and the shard after the step (84 MB):
//! about 500 MB, against a step that moves and multiplies the same bytes several times.

use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use candle_fsdp::comm::threads::{set_intra_op_threads, ThreadGroupConfig};
use candle_fsdp::comm::{ProcessGroup, ProcessGroupExt};
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::unit::UnitSpec;
use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, FsdpModel, ShardedOptimizer};

const D: usize = 2048;
const STEPS: usize = 6;

fn specs() -> Vec<UnitSpec> {
    (0..10)
        .map(|i| UnitSpec::new(format!("l{i}"), |vb| candle_nn::linear(D, D, vb)))
        .collect()
}

/// Median seconds a step over `STEPS` steps after one warm-up (rank 0's, between barriers).
fn steps(fingerprint: Option<std::path::PathBuf>) -> f64 {
    let times = launch(
        &Launcher::Threads {
            world_size: 2,
            config: ThreadGroupConfig::default(),
        },
        move |pg: Arc<dyn ProcessGroup>| {
            let config = FsdpConfig {
                fingerprint: fingerprint.clone(),
                ..Default::default()
            };
            let mut m = FsdpModel::build_with(pg.clone(), config, specs(), |_, _, out| {
                for (i, v) in out.iter_mut().enumerate() {
                    *v = ((i % 97) as f32 - 48.0) * 1e-4;
                }
                Ok(())
            })?;
            let mut opt = AdamW::new(AdamWConfig::default());
            let x = Tensor::ones((64, D), DType::F32, &Device::Cpu)?;
            let y = Tensor::zeros(64, DType::U32, &Device::Cpu)?;
            let mut t = Vec::new();
            for s in 0..=STEPS {
                pg.barrier_wait()?;
                let t0 = Instant::now();
                let loss = candle_nn::loss::cross_entropy(&m.forward(&x)?, &y)?;
                m.backward(&loss)?;
                opt.step(&mut m)?;
                m.zero_grad();
                pg.barrier_wait()?;
                if s > 0 {
                    t.push(t0.elapsed().as_secs_f64());
                }
            }
            t.sort_by(f64::total_cmp);
            Ok(t[t.len() / 2])
        },
    )
    .unwrap();
    times[0]
}

fn main() {
    set_intra_op_threads(1);
    let buf: Vec<u8> = (0..64 << 20).map(|i| (i * 31 % 251) as u8).collect();
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t0 = Instant::now();
        std::hint::black_box(crc32c::crc32c(std::hint::black_box(&buf)));
        best = best.min(t0.elapsed().as_secs_f64());
    }
    println!(
        "crc32c, 64 MiB, one core: {:.1} GB/s (best of 5)",
        buf.len() as f64 / best / 1e9
    );
    drop(buf);
    let path = std::env::temp_dir().join(format!("candle-fsdp-fp-bench-{}.fp", std::process::id()));
    println!("10 x Linear({D}, {D}), world size 2, batch 64 a rank, median of {STEPS} steps:");
    for round in 1..=3 {
        let off = steps(None);
        let on = steps(Some(path.clone()));
        println!(
            "  round {round}: without {:.1} ms/step, with --fingerprint {:.1} ms/step ({:+.1} %)",
            off * 1e3,
            on * 1e3,
            (on / off - 1.0) * 100.0
        );
    }
    let _ = std::fs::remove_file(&path);
}
