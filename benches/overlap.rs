//! Step time and exposed communication of FSDP FULL_SHARD training, prefetch on vs off.
//!
//! Model: 8 units, each `Linear(512, 512)` + ReLU, MSE loss, AdamW; batch 64 per rank; world
//! sizes 2 and 4 (in-process thread ranks). "Prefetch on" is the default configuration
//! (forward prefetch, `BackwardPrefetch::BackwardPre`, `limit_all_gathers = Some(2)`); "off" is
//! `forward_prefetch = false`, `BackwardPrefetch::None` (every all-gather issued when its unit is
//! needed).
//!
//! Timed: `iter_custom` runs all ranks through `launch` (thread ranks); each rank builds the model, runs one
//! untimed warm-up step, lines up on a barrier and runs the requested number of steps; the
//! slowest rank's time is reported (per step).
//!
//! Then, per configuration, a traced run (a `TraceSession`, `FsdpModel::set_tracer`) of
//! `TRACED_STEPS` steps after `WARMUP_STEPS` untraced ones gives the overlap figures of
//! `overlap_summary`: mean over (rank, step) of exposed communication (compute-thread waits on
//! collectives) as a fraction of step time, and of the overlap fraction (`1 - exposed / comm`).
//! They are printed as a table at the end; the timeline of one traced step at world size 2 with
//! prefetch is written to `target/overlap-timeline.png` (and `.svg`), and the Chrome trace of all
//! its traced steps to `target/overlap-trace.json` (open in ui.perfetto.dev).
//!
//! A wait on a collective lasts until the slowest rank joins it, so "exposed communication"
//! includes skew between ranks: where ranks outnumber free cores (world size 4 on 2 cores, or a
//! busy machine) a rank's wait is mostly its peers being off the CPU, not data movement.
//!
//! `cargo bench --bench overlap` (about a minute on 2 cores);
//! `cargo bench --bench overlap -- traced_only` (a filter matching no benchmark) skips the
//! timing and prints only the traced figures.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{Device, Module, Tensor};
use candle_fsdp::comm::threads::{set_intra_op_threads, ThreadGroupConfig};
use candle_fsdp::comm::{ProcessGroup, ProcessGroupExt};
use candle_fsdp::fsdp::BackwardPrefetch;
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::timeline::render_timeline;
use candle_fsdp::trace::{overlap_summary, Span, TraceSession};
use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, FsdpModel, ShardedOptimizer};
use criterion::{BenchmarkId, Criterion, SamplingMode};

// As in examples/mnist.rs: MB-sized buffers are allocated and freed every step.
#[path = "../examples/common/alloc.rs"]
mod alloc;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const UNITS: usize = 8;
const DIM: usize = 512;
const BATCH: usize = 64;
const WORLD_SIZES: [usize; 2] = [2, 4];
const WARMUP_STEPS: usize = 2;
const TRACED_STEPS: usize = 10;

/// One unit: `Linear(DIM, DIM)` followed by ReLU.
struct LinearRelu(candle_nn::Linear);

impl Module for LinearRelu {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.0.forward(x)?.relu()
    }
}

fn config(prefetch: bool) -> FsdpConfig {
    let mut c = FsdpConfig::default();
    if !prefetch {
        c.forward_prefetch = false;
        c.backward_prefetch = BackwardPrefetch::None;
    }
    c
}

fn prefetch_name(prefetch: bool) -> &'static str {
    if prefetch {
        "prefetch"
    } else {
        "no_prefetch"
    }
}

/// A rank's model, optimizer and (fixed, rank-specific) batch.
struct Rank {
    model: FsdpModel,
    opt: AdamW,
    x: Tensor,
    y: Tensor,
}

impl Rank {
    fn new(pg: Arc<dyn ProcessGroup>, prefetch: bool) -> candle_fsdp::Result<Rank> {
        let rank = pg.rank();
        let mut b = FsdpModel::builder(pg, config(prefetch));
        for i in 0..UNITS {
            b = b.unit(format!("l{i}"), |vb| {
                Ok(LinearRelu(candle_nn::linear(DIM, DIM, vb)?))
            });
        }
        let model = b.build()?;
        let opt = AdamW::new(AdamWConfig {
            lr: 1e-4,
            ..AdamWConfig::default()
        });
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (BATCH, DIM), &dev)?.affine(1.0, rank as f64 * 0.01)?;
        let y = Tensor::randn(0f32, 1.0, (BATCH, DIM), &dev)?.relu()?;
        Ok(Rank { model, opt, x, y })
    }

    fn step(&mut self) -> candle_fsdp::Result<()> {
        let out = self.model.forward(&self.x)?;
        let loss = candle_nn::loss::mse(&out, &self.y)?;
        self.model.backward(&loss)?;
        self.opt.step(&mut self.model)?;
        self.model.zero_grad();
        Ok(())
    }
}

/// Wall time of `steps` training steps on `ws` ranks (slowest rank), after one warm-up step.
fn timed_steps(ws: usize, prefetch: bool, steps: u64) -> Duration {
    let times = launch(
        &Launcher::Threads {
            world_size: ws,
            config: ThreadGroupConfig::default(),
        },
        |pg| {
            let mut r = Rank::new(pg.clone(), prefetch)?;
            r.step()?;
            pg.barrier_wait()?;
            let start = Instant::now();
            for _ in 0..steps {
                r.step()?;
            }
            let t = start.elapsed();
            // Stop the clock before the barrier, so a rank does not count waiting for the others.
            pg.barrier_wait()?;
            Ok(t)
        },
    )
    .expect("timed run");
    times.into_iter().max().unwrap_or_default()
}

/// Spans of `TRACED_STEPS` steps on `ws` ranks, after `WARMUP_STEPS` untraced ones.
fn traced_spans(ws: usize, prefetch: bool) -> Vec<Span> {
    let session = TraceSession::new();
    let per_rank = launch(
        &Launcher::Threads {
            world_size: ws,
            config: ThreadGroupConfig::default(),
        },
        |pg| {
            let mut r = Rank::new(pg.clone(), prefetch)?;
            for _ in 0..WARMUP_STEPS {
                r.step()?;
            }
            // The barriers that line the ranks up stay out of the trace (they would be counted as
            // a step of their own, or as communication of the last step).
            pg.barrier_wait()?;
            let tracer = session.tracer(pg.rank());
            r.model.set_tracer(Some(tracer.clone()));
            for _ in 0..TRACED_STEPS {
                r.step()?;
            }
            r.model.set_tracer(None);
            // Backward waited for every reduce-scatter: nothing traced is still running.
            pg.barrier_wait()?;
            Ok(tracer.spans())
        },
    )
    .expect("traced run");
    per_rank.into_iter().flatten().collect()
}

struct Figures {
    ws: usize,
    prefetch: bool,
    step_ms: f64,
    traced_step_ms: f64,
    exposed_fraction: f64,
    overlap_fraction: f64,
    comm_ms: f64,
    exposed_ms: f64,
}

fn figures(ws: usize, prefetch: bool, step_ms: f64, spans: &[Span]) -> Figures {
    let s = overlap_summary(spans);
    let n = s.len().max(1) as f64;
    let mean =
        |f: &dyn Fn(&candle_fsdp::trace::OverlapSummary) -> f64| s.iter().map(f).sum::<f64>() / n;
    Figures {
        ws,
        prefetch,
        step_ms,
        traced_step_ms: mean(&|o| o.step_s) * 1e3,
        exposed_fraction: mean(&|o| {
            if o.step_s > 0.0 {
                o.exposed_s / o.step_s
            } else {
                0.0
            }
        }),
        overlap_fraction: mean(&|o| o.overlap_fraction),
        comm_ms: mean(&|o| o.comm_s) * 1e3,
        exposed_ms: mean(&|o| o.exposed_s) * 1e3,
    }
}

/// The traced step whose exposed-communication fraction (mean over ranks) is nearest `target`.
fn representative_step(spans: &[Span], target: f64) -> u64 {
    let mut per_step: std::collections::BTreeMap<u64, (f64, usize)> = Default::default();
    for o in overlap_summary(spans) {
        let e = per_step.entry(o.step).or_default();
        e.0 += if o.step_s > 0.0 {
            o.exposed_s / o.step_s
        } else {
            0.0
        };
        e.1 += 1;
    }
    per_step
        .into_iter()
        .map(|(step, (sum, n))| (step, (sum / n as f64 - target).abs()))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .expect("a traced step")
        .0
}

fn out_dir() -> PathBuf {
    let dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
    std::fs::create_dir_all(&dir).expect("target dir");
    dir
}

fn main() {
    alloc::keep_freed_memory();
    // Split the cores between the ranks (RAYON_NUM_THREADS) for the largest world size run.
    let threads = set_intra_op_threads(*WORLD_SIZES.iter().max().unwrap());

    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(6))
        .configure_from_args();
    let mut step_ms = Vec::new();
    {
        let mut g = c.benchmark_group("fsdp_step_8x512");
        g.sampling_mode(SamplingMode::Flat);
        for ws in WORLD_SIZES {
            for prefetch in [true, false] {
                let id = BenchmarkId::new(prefetch_name(prefetch), format!("ws{ws}"));
                let mut total = Duration::ZERO;
                let mut count = 0u64;
                g.bench_function(id, |b| {
                    b.iter_custom(|iters| {
                        let t = timed_steps(ws, prefetch, iters);
                        total += t;
                        count += iters;
                        t
                    })
                });
                if count > 0 {
                    step_ms.push(((ws, prefetch), total.as_secs_f64() * 1e3 / count as f64));
                }
            }
        }
        g.finish();
    }

    let mut rows = Vec::new();
    for ws in WORLD_SIZES {
        for prefetch in [true, false] {
            let spans = traced_spans(ws, prefetch);
            let ms = step_ms
                .iter()
                .find(|(k, _)| *k == (ws, prefetch))
                .map_or(f64::NAN, |(_, v)| *v);
            rows.push(figures(ws, prefetch, ms, &spans));
            if ws == 2 && prefetch {
                // A representative step (all ranks): the one whose exposed fraction, averaged
                // over the ranks, is nearest the mean over all steps.
                let mid =
                    representative_step(&spans, rows.last().expect("pushed").exposed_fraction);
                let one: Vec<Span> = spans.iter().filter(|s| s.step == mid).cloned().collect();
                let dir = out_dir();
                let json = dir.join("overlap-trace.json");
                std::fs::write(&json, candle_fsdp::trace::chrome_trace_json(&spans))
                    .expect("write the trace");
                println!(
                    "Chrome trace of the traced steps (ws 2, prefetch): {}",
                    json.display()
                );
                for ext in ["png", "svg"] {
                    let path = dir.join(format!("overlap-timeline.{ext}"));
                    render_timeline(&one, &path).expect("render the timeline");
                    println!(
                        "timeline of step {mid} (ws 2, prefetch): {}",
                        path.display()
                    );
                }
            }
        }
    }

    println!();
    println!(
        "8 x Linear({DIM},{DIM})+ReLU, batch {BATCH}/rank, AdamW, FULL_SHARD, RAYON_NUM_THREADS={threads}; \
         overlap over {TRACED_STEPS} traced steps x ranks"
    );
    println!(
        "{:>3} {:>12} {:>13} {:>15} {:>12} {:>12} {:>14} {:>12}",
        "ws",
        "prefetch",
        "step ms",
        "traced step ms",
        "comm ms",
        "exposed ms",
        "exposed/step",
        "overlap"
    );
    for f in &rows {
        // No step time when a filter skipped the timed benchmark.
        let step = if f.step_ms.is_nan() {
            "-".to_string()
        } else {
            format!("{:.2}", f.step_ms)
        };
        println!(
            "{:>3} {:>12} {:>13} {:>15.2} {:>12.2} {:>12.2} {:>13.1}% {:>11.1}%",
            f.ws,
            if f.prefetch { "on" } else { "off" },
            step,
            f.traced_step_ms,
            f.comm_ms,
            f.exposed_ms,
            100.0 * f.exposed_fraction,
            100.0 * f.overlap_fraction
        );
    }
    c.final_summary();
}
