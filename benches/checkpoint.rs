//! Checkpoint size and save/load times at world size 2, full and sharded, for the MNIST MLP of
//! the main job and for a model of about 100 M parameters (10 units of Linear(3200, 3200)).
//!
//! ```text
//! cargo bench --bench checkpoint              # both models (under a minute, ~3 GiB RAM, ~2 GiB of /tmp)
//! cargo bench --bench checkpoint -- --quick   # the MNIST model only
//! ```
//!
//! Each model is built at world size 2 and trained one AdamW step (so the optimizer state is
//! real), then: full save (`save_full`), sharded save (`save_sharded`), and in fresh process
//! groups full load (`load_full`), FSDP build from the full file (`build_from_full`), sharded
//! load at world size 2 and at world size 1 (resharding). Times are wall-clock of the
//! collective on rank 0, between two barriers. Loads follow the saves, so the files are in the
//! page cache: load times are memory-bandwidth times, not disk reads. Saves include the fsyncs.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Tensor};
use candle_fsdp::checkpoint::{
    build_from_full, load_full, load_sharded, save_full, save_sharded, TrainState,
};
use candle_fsdp::comm::threads::{set_intra_op_threads, ThreadGroupConfig};
use candle_fsdp::comm::{ProcessGroup, ProcessGroupExt};
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::unit::UnitSpec;
use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, FsdpModel, ShardedOptimizer};

struct Bench {
    name: &'static str,
    specs: fn() -> Vec<UnitSpec>,
    input: usize,
    reps: usize,
}

const BIG: usize = 3200;

fn big() -> Vec<UnitSpec> {
    (0..10)
        .map(|i| UnitSpec::new(format!("l{i}"), |vb| candle_nn::linear(BIG, BIG, vb)))
        .collect()
}

fn build(pg: Arc<dyn ProcessGroup>, specs: Vec<UnitSpec>) -> candle_fsdp::Result<FsdpModel> {
    FsdpModel::build_with(pg, FsdpConfig::default(), specs, |_, _, out| {
        // Values do not matter for timing: a cheap deterministic fill.
        for (i, v) in out.iter_mut().enumerate() {
            *v = ((i % 97) as f32 - 48.0) * 1e-3;
        }
        Ok(())
    })
}

/// Runs `f` between two barriers and returns its wall time in seconds (rank 0's).
fn timed<T>(
    pg: &dyn ProcessGroup,
    f: impl FnOnce() -> candle_fsdp::Result<T>,
) -> candle_fsdp::Result<(T, f64)> {
    pg.barrier_wait()?;
    let t0 = Instant::now();
    let out = f()?;
    pg.barrier_wait()?;
    Ok((out, t0.elapsed().as_secs_f64()))
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

/// Seconds of one repetition: save full, save sharded, load full, load sharded (ws 2),
/// build from full, load sharded at ws 1.
type Times = [f64; 6];

/// One repetition; returns (parameters, full file bytes, sharded checkpoint bytes, times).
fn run_once(b: &Bench, root: &Path) -> (usize, u64, u64, Times) {
    let full: PathBuf = root.join(format!("{}.safetensors", b.name));
    let sharded_root = root.join(format!("{}-sharded", b.name));
    let config = ThreadGroupConfig::default();
    // Build, one step, save full and sharded.
    let saved = launch(
        &Launcher::Threads {
            world_size: 2,
            config,
        },
        |pg| {
            let mut m = build(pg.clone(), (b.specs)())?;
            let params: usize = m.shards().map(|u| u.layout.param_numel()).sum();
            let mut opt = AdamW::new(AdamWConfig::default());
            let x = Tensor::ones((4, b.input), candle_core::DType::F32, &Device::Cpu)?;
            let y = Tensor::zeros(4, candle_core::DType::U32, &Device::Cpu)?;
            let loss = candle_nn::loss::cross_entropy(&m.forward(&x)?, &y)?;
            m.backward(&loss)?;
            opt.step(&mut m)?;
            m.zero_grad();
            let (size, t_full) = timed(pg.as_ref(), || save_full(&full, &m))?;
            let state = TrainState {
                step: 1,
                ..Default::default()
            };
            let (dir, t_sharded) = timed(pg.as_ref(), || {
                save_sharded(&sharded_root, &m, &opt, &state, 1)
            })?;
            Ok((params, size, t_full, dir, t_sharded))
        },
    )
    .unwrap();
    let (params, full_size, t_save_full, ckpt, t_save_sharded) = saved.into_iter().next().unwrap();
    let full_size = full_size.unwrap();
    let sharded_size = dir_bytes(&ckpt);
    // Loads at world size 2.
    let loads = launch(
        &Launcher::Threads {
            world_size: 2,
            config,
        },
        |pg| {
            let mut m = build(pg.clone(), (b.specs)())?;
            let mut opt = AdamW::new(AdamWConfig::default());
            let (_, t_full) = timed(pg.as_ref(), || load_full(&full, &mut m))?;
            let (_, t_sharded) = timed(pg.as_ref(), || load_sharded(&ckpt, &mut m, &mut opt))?;
            drop((m, opt));
            let (_, t_build) = timed(pg.as_ref(), || {
                build_from_full(pg.clone(), FsdpConfig::default(), (b.specs)(), &full)
            })?;
            Ok((t_full, t_sharded, t_build))
        },
    )
    .unwrap();
    let (t_load_full, t_load_sharded, t_build) = loads[0];
    // Resharded load at world size 1.
    let t_reshard = launch(
        &Launcher::Threads {
            world_size: 1,
            config,
        },
        |pg| {
            let mut m = build(pg.clone(), (b.specs)())?;
            let mut opt = AdamW::new(AdamWConfig::default());
            Ok(timed(pg.as_ref(), || load_sharded(&ckpt, &mut m, &mut opt))?.1)
        },
    )
    .unwrap()[0];
    (
        params,
        full_size,
        sharded_size,
        [
            t_save_full,
            t_save_sharded,
            t_load_full,
            t_load_sharded,
            t_build,
            t_reshard,
        ],
    )
}

fn run(b: &Bench, root: &Path) {
    let mut reps = Vec::new();
    let mut sizes = (0, 0, 0);
    for _ in 0..b.reps {
        let (params, full, sharded, t) = run_once(b, root);
        sizes = (params, full, sharded);
        reps.push(t);
        let _ = std::fs::remove_dir_all(root);
        std::fs::create_dir_all(root).unwrap();
    }
    // Median of each time over the repetitions.
    let t: Vec<f64> = (0..6)
        .map(|i| {
            let mut v: Vec<f64> = reps.iter().map(|r| r[i]).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        })
        .collect();
    let (params, full_size, sharded_size) = sizes;
    let ms = |s: f64| s * 1e3;
    let gbps = |bytes: u64, s: f64| mb(bytes) / 1e3 / s;
    println!(
        "\n{} ({} parameters), world size 2, median of {} run(s)",
        b.name, params, b.reps
    );
    println!(
        "  full state dict   {:>9.2} MB  save_full {:>8.1} ms ({:.2} GB/s)  load_full {:>8.1} ms  \
         build_from_full {:>8.1} ms",
        mb(full_size),
        ms(t[0]),
        gbps(full_size, t[0]),
        ms(t[2]),
        ms(t[4])
    );
    println!(
        "  sharded (+AdamW)  {:>9.2} MB  save_sharded {:>5.1} ms ({:.2} GB/s)  load ws 2 {:>8.1} ms  \
         load ws 1 (reshard) {:>8.1} ms",
        mb(sharded_size),
        ms(t[1]),
        gbps(sharded_size, t[1]),
        ms(t[3]),
        ms(t[5])
    );
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    set_intra_op_threads(2);
    let root = std::env::temp_dir().join(format!("candle-fsdp-ckpt-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let mut benches = vec![Bench {
        name: "mnist-mlp",
        specs: candle_fsdp::models::mnist_mlp,
        input: 784,
        reps: 7,
    }];
    if !quick {
        benches.push(Bench {
            name: "linear-10x3200",
            specs: big,
            input: BIG,
            reps: 3,
        });
    }
    for b in &benches {
        run(b, &root);
    }
    let _ = std::fs::remove_dir_all(&root);
}
