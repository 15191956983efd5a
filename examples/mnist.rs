//! The main job: an MLP trained on real MNIST with FSDP (FULL_SHARD by default) over N ranks
//! running as threads of this process.
//!
//! Flatten → Linear(784,128) → ReLU → Linear(128,64) → ReLU → Linear(64,10); cross-entropy;
//! Adam (AdamW with weight decay 0), lr 1e-3; batch 32 per rank. Rank 0 logs one line per
//! epoch (epoch, mean train loss, test accuracy, epoch time), evaluates on the 10 000 test images
//! while the other ranks wait at a barrier, and a sharded checkpoint is saved at the end of every
//! epoch (and every `--save-every` steps); `--resume` continues from the newest one, mid-epoch
//! ones where the sampler stopped.
//!
//! ```text
//! cargo run --release --example mnist -- --world-size 2 --epochs 5
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use candle_core::{DType, Tensor};
use candle_fsdp::checkpoint;
use candle_fsdp::clip::clip_grad_norm;
use candle_fsdp::comm::threads::{run_ranks_ok, set_intra_op_threads, ThreadGroupConfig};
use candle_fsdp::comm::{ProcessGroupExt, ReduceOp};
use candle_fsdp::data::{BatchLoader, DistributedSampler, Mnist};
use candle_fsdp::grad_scaler::{GradScalerConfig, ShardedGradScaler};
use candle_fsdp::timeline::render_timeline;
use candle_fsdp::trace::{
    chrome_trace_json, overlap_summary, peak_rss_bytes, OverlapSummary, Span, TraceSession,
};
use candle_fsdp::{
    AdamW, AdamWConfig, BackwardPrefetch, FsdpConfig, FsdpModel, MixedPrecision, ShardedOptimizer,
    ShardingStrategy,
};
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

// Every step allocates and frees MB-sized buffers (gathered parameters, gradients); glibc's
// malloc returns them to the kernel and pays page faults on each reuse, mimalloc keeps them.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum AccumMode {
    NoSync,
    ReduceScatter,
}

/// Train an MLP on MNIST with FSDP over in-process ranks.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Number of ranks (threads).
    #[arg(long, default_value_t = 2)]
    world_size: usize,
    /// Epochs to train (in total, counting resumed ones).
    #[arg(long, default_value_t = 5)]
    epochs: u64,
    /// Seed of initialisation and shuffling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Batch size per rank.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Directory with the four MNIST IDX files (gzipped).
    #[arg(long, default_value = "data/mnist")]
    data_dir: PathBuf,
    /// Where sharded checkpoints go (one `step-<n>/` directory per save).
    #[arg(long, default_value = "checkpoints/mnist")]
    checkpoint_dir: PathBuf,
    /// Resume from the newest complete checkpoint in --checkpoint-dir (a mid-epoch one
    /// continues the epoch where it stopped); without it, training starts from scratch.
    #[arg(long)]
    resume: bool,
    /// Also save a checkpoint every N optimizer steps (0: only at the end of each epoch).
    #[arg(long, default_value_t = 0)]
    save_every: u64,
    /// Complete checkpoints to keep (0 keeps all).
    #[arg(long, default_value_t = 2)]
    keep_last: usize,
    /// Sharding strategy.
    #[arg(long, default_value = "full-shard")]
    strategy: ShardingStrategy,
    /// Disable forward and backward prefetch.
    #[arg(long)]
    no_prefetch: bool,
    /// Mixed precision: f32, bf16, f16 (with a dynamic loss scaler) or bf16-f32-reduce.
    #[arg(long, default_value = "f32")]
    precision: String,
    /// Micro-batches accumulated per optimizer step.
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    /// How to accumulate: no-sync (unsharded gradients, one reduce-scatter per step) or
    /// reduce-scatter (every micro-batch reduced, sharded accumulation).
    #[arg(long, value_enum, default_value_t = AccumMode::NoSync)]
    accum_mode: AccumMode,
    /// Clip gradients to this total L2 norm (0 = off).
    #[arg(long, default_value_t = 0.0)]
    clip_grad_norm: f32,
    /// Write a Chrome/Perfetto trace of a few training steps to this JSON file, plus the
    /// timeline picture next to it (same name, .png and .svg), and print overlap figures.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Number of steps traced (after 8 warm-up steps of the first epoch trained).
    #[arg(long, default_value_t = 4)]
    trace_steps: usize,
    /// Collective timeout in seconds.
    #[arg(long, default_value_t = 300)]
    timeout_s: u64,
}

fn build_model(
    pg: Arc<dyn candle_fsdp::comm::ProcessGroup>,
    args: &Args,
) -> candle_fsdp::Result<FsdpModel> {
    let config = FsdpConfig {
        sharding_strategy: args.strategy,
        seed: args.seed,
        forward_prefetch: !args.no_prefetch,
        backward_prefetch: if args.no_prefetch {
            BackwardPrefetch::None
        } else {
            BackwardPrefetch::BackwardPre
        },
        mixed_precision: MixedPrecision::from_name(&args.precision)?,
        ..Default::default()
    };
    FsdpModel::builder(pg, config)
        .units(candle_fsdp::models::mnist_mlp())
        .build()
}

/// Writes the trace JSON and the timeline pictures, and prints the overlap summary.
fn write_trace(path: &std::path::Path, spans: Vec<Span>) -> anyhow::Result<()> {
    anyhow::ensure!(
        !spans.is_empty(),
        "no span was traced (was the epoch shorter than 8 steps?)"
    );
    std::fs::write(path, chrome_trace_json(&spans))
        .with_context(|| format!("writing {}", path.display()))?;
    for ext in ["png", "svg"] {
        render_timeline(&spans, &path.with_extension(ext))?;
    }
    let summary = overlap_summary(&spans);
    let n = summary.len() as f64;
    let mean = |f: fn(&OverlapSummary) -> f64| summary.iter().map(f).sum::<f64>() / n;
    println!(
        "trace: {} spans of {} rank-steps written to {} (+ .png, .svg); per step: {:.2} ms, \
         compute {:.2} ms, communication {:.2} ms, exposed {:.2} ms ({:.1}% of the step), \
         overlap {:.1}%",
        spans.len(),
        summary.len(),
        path.display(),
        mean(|s| s.step_s) * 1e3,
        mean(|s| s.compute_s) * 1e3,
        mean(|s| s.comm_s) * 1e3,
        mean(|s| s.exposed_s) * 1e3,
        100.0 * mean(|s| s.exposed_s / s.step_s),
        100.0 * mean(|s| s.overlap_fraction)
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.world_size >= 1, "--world-size must be at least 1");
    anyhow::ensure!(args.batch_size >= 1, "--batch-size must be at least 1");
    anyhow::ensure!(args.grad_accum >= 1, "--grad-accum must be at least 1");
    anyhow::ensure!(
        args.lr.is_finite() && args.lr > 0.0,
        "--lr must be a positive finite number, found {}",
        args.lr
    );
    MixedPrecision::from_name(&args.precision)?;
    // Output paths are checked now, not after an epoch of training.
    if let Some(p) = &args.trace {
        anyhow::ensure!(args.trace_steps >= 1, "--trace-steps must be at least 1");
        anyhow::ensure!(
            !p.is_dir(),
            "--trace {}: is a directory, expected a .json file path",
            p.display()
        );
        let dir = p.parent().filter(|d| !d.as_os_str().is_empty());
        anyhow::ensure!(
            dir.is_none_or(|d| d.is_dir()),
            "--trace {}: directory {} does not exist",
            p.display(),
            dir.map(|d| d.display().to_string()).unwrap_or_default()
        );
    }
    std::fs::create_dir_all(&args.checkpoint_dir).with_context(|| {
        format!(
            "--checkpoint-dir {}: cannot create it",
            args.checkpoint_dir.display()
        )
    })?;
    let probe = args.checkpoint_dir.join(".write-probe");
    std::fs::write(&probe, b"").with_context(|| {
        format!(
            "--checkpoint-dir {}: not writable",
            args.checkpoint_dir.display()
        )
    })?;
    let _ = std::fs::remove_file(&probe);
    let existing = checkpoint::list_complete(&args.checkpoint_dir)?;
    match (args.resume, existing.last()) {
        (true, None) => println!(
            "--resume: no complete checkpoint in {}: starting from scratch",
            args.checkpoint_dir.display()
        ),
        (false, Some(last)) => println!(
            "note: {} already holds checkpoints (newest {}); this run starts from scratch and \
             saves beside them (pass --resume to continue from the newest)",
            args.checkpoint_dir.display(),
            last.display()
        ),
        _ => {}
    }
    let intra_op = set_intra_op_threads(args.world_size);
    let mnist = Mnist::load(&args.data_dir)
        .with_context(|| format!("loading MNIST from {}", args.data_dir.display()))?;
    let (train_len, test_len) = (mnist.train_len(), mnist.test_len());
    let Mnist {
        train_images,
        train_labels,
        test_images,
        test_labels,
        rows,
        cols,
    } = mnist;
    // Shared by the rank threads without a copy.
    let (train_images, train_labels) = (Arc::new(train_images), Arc::new(train_labels));
    let test_x = Tensor::from_vec(
        test_images,
        (test_len, 1, rows, cols),
        &candle_core::Device::Cpu,
    )?;
    let test_y = Tensor::from_vec(
        test_labels.iter().map(|&l| l as u32).collect::<Vec<_>>(),
        test_len,
        &candle_core::Device::Cpu,
    )?;
    println!(
        "MNIST: {} train / {} test images; world size {}, batch {} per rank, {:?}, {} compute thread(s) per rank",
        train_len,
        test_len,args.world_size,
        args.batch_size,
        args.strategy,
        intra_op
    );
    let group_config = ThreadGroupConfig {
        timeout: Duration::from_secs(args.timeout_s),
    };
    let session = TraceSession::new();
    let finals = run_ranks_ok(args.world_size, group_config, |pg| {
        let rank = pg.rank();
        let ws = pg.world_size();
        let mut model = build_model(pg.clone(), &args)?;
        let tracer = args.trace.as_ref().map(|_| {
            let t = session.tracer(rank);
            t.set_enabled(false);
            t
        });
        model.set_tracer(tracer.clone());
        let mut traced_epoch = None;
        let mut scaler = if model.config().mixed_precision.uses_f16() {
            Some(ShardedGradScaler::new(GradScalerConfig::default())?)
        } else {
            None
        };
        let mut optim = AdamW::new(AdamWConfig {
            lr: args.lr,
            weight_decay: 0.0,
            ..Default::default()
        });
        let (mut start_epoch, mut step, mut resume_at) = (0, 0u64, None);
        if args.resume {
            if let Some(loaded) =
                checkpoint::load_latest(&args.checkpoint_dir, &mut model, &mut optim)?
            {
                let train = loaded.meta.train;
                if let Some(rng) = &train.rng {
                    if rng.seed != args.seed {
                        return Err(candle_fsdp::Error::InvalidArgument(format!(
                            "{} was trained with --seed {}; resuming with --seed {} would change \
                             the data order: pass --seed {}",
                            loaded.dir.display(),
                            rng.seed,
                            args.seed,
                            rng.seed
                        )));
                    }
                }
                (start_epoch, step) = (train.epoch, train.step);
                if let Some(s) = train.sampler {
                    (start_epoch, resume_at) = (s.epoch, Some(s));
                }
                if let (Some(s), Some(v)) = (&mut scaler, train.grad_scaler) {
                    s.load_state(serde_json::from_value(v).map_err(|e| {
                        candle_fsdp::Error::InvalidArgument(format!("grad scaler state: {e}"))
                    })?);
                }
                if rank == 0 {
                    println!(
                        "resumed from {} (epoch {}, step {})",
                        loaded.dir.display(),
                        start_epoch + 1,
                        step
                    );
                }
            }
        }
        let mut sampler =
            DistributedSampler::new(train_labels.len(), ws, rank, true, args.seed, false)?;
        let train_state =
            |step: u64,
             epoch: u64,
             sampler: checkpoint::SamplerState,
             scaler: Option<&ShardedGradScaler>| checkpoint::TrainState {
                step,
                epoch,
                sampler: Some(sampler),
                rng: Some(checkpoint::RngState { seed: args.seed }),
                grad_scaler: scaler.and_then(|s| serde_json::to_value(s.state()).ok()),
                ..Default::default()
            };
        let mut last_acc = f64::NAN;
        let mut train_mem = None;
        for epoch in start_epoch..args.epochs {
            let t0 = Instant::now();
            match resume_at.take() {
                Some(s) => s.apply(&mut sampler)?,
                None => sampler.set_epoch(epoch),
            }
            let loader = BatchLoader::new(
                train_images.clone(),
                train_labels.clone(),
                (1, rows, cols),
                sampler.indices(),
                args.batch_size,
                false,
            )?;
            let bar = (rank == 0).then(|| {
                let b = ProgressBar::new(loader.num_batches() as u64);
                b.set_style(
                    ProgressStyle::with_template(
                        "epoch {msg} [{bar:30}] {pos}/{len} {elapsed_precise} eta {eta}",
                    )
                    .expect("valid template")
                    .progress_chars("=> "),
                );
                b.set_message(format!("{}", epoch + 1));
                b
            });
            let (mut loss_sum, mut batches, mut consumed) = (0.0f64, 0usize, 0usize);
            let num_batches = loader.num_batches();
            let k = args.grad_accum;
            for (i, batch) in loader.enumerate() {
                let batch = batch?;
                if let Some(t) = &tracer {
                    // Trace steps 8 .. 8 + trace_steps of the first epoch trained.
                    let first = *traced_epoch.get_or_insert(epoch) == epoch;
                    t.set_enabled(first && (8..8 + args.trace_steps).contains(&i));
                }
                // The last micro-batch of each group of k (or of the epoch) steps the optimizer.
                let last_micro = (i + 1) % k == 0 || i + 1 == num_batches;
                model.set_requires_gradient_sync(
                    last_micro || matches!(args.accum_mode, AccumMode::ReduceScatter),
                );
                let logits = model.forward(&batch.images)?.to_dtype(DType::F32)?;
                let loss = candle_nn::loss::cross_entropy(&logits, &batch.labels)?;
                let micro_loss = (&loss / k as f64)?;
                match &scaler {
                    Some(s) => model.backward(&s.scale_loss(&micro_loss)?)?,
                    None => model.backward(&micro_loss)?,
                }
                if last_micro {
                    if let Some(s) = &mut scaler {
                        s.unscale(&mut model)?;
                    }
                    if args.clip_grad_norm > 0.0 {
                        clip_grad_norm(&mut model, args.clip_grad_norm)?;
                    }
                    match &mut scaler {
                        Some(s) => {
                            s.step(&mut model, &mut optim)?;
                        }
                        None => optim.step(&mut model)?,
                    }
                    model.zero_grad();
                    step += 1;
                }
                consumed += batch.len();
                // Mid-epoch checkpoint (the end of the epoch saves below).
                if last_micro
                    && args.save_every > 0
                    && step % args.save_every == 0
                    && i + 1 < num_batches
                {
                    let position = checkpoint::SamplerState::new(&sampler, consumed);
                    let state = train_state(step, epoch, position, scaler.as_ref());
                    checkpoint::save_sharded(
                        &args.checkpoint_dir,
                        &model,
                        &optim,
                        &state,
                        args.keep_last,
                    )?;
                }
                loss_sum += loss.to_scalar::<f32>()? as f64;
                batches += 1;
                if let Some(b) = &bar {
                    b.inc(1);
                }
            }
            if let Some(b) = bar {
                b.finish_and_clear();
            }
            // Mean train loss over all ranks' batches, reduced to rank 0.
            let sums = pg.reduce_f32s(vec![loss_sum as f32, batches as f32], 0, ReduceOp::Sum)?;
            let train_time = t0.elapsed().as_secs_f64();
            // Memory of training (the evaluation below gathers in f32 and would blur it).
            train_mem = Some(model.memory_stats());
            // Validation on rank 0; the others wait at the barrier.
            let full = model.gather_full_model(true)?;
            if let Some(full) = full {
                last_acc = full.accuracy(&test_x, &test_y, 1000)?;
            }
            pg.barrier_wait()?;
            if rank == 0 {
                println!(
                    "epoch {:>2}  train loss {:.4}  test accuracy {:.2}%  epoch time {:.2}s (train {:.2}s)",
                    epoch + 1,
                    sums[0] / sums[1],
                    last_acc,
                    t0.elapsed().as_secs_f64(),
                    train_time
                );
            }
            let next = checkpoint::SamplerState {
                epoch: epoch + 1,
                position: 0,
                world_size: ws,
            };
            checkpoint::save_sharded(
                &args.checkpoint_dir,
                &model,
                &optim,
                &train_state(step, epoch + 1, next, scaler.as_ref()),
                args.keep_last,
            )?;
        }
        if let (0, Some(m)) = (rank, train_mem) {
            println!(
                "rank 0 training memory: sharded state {} B (+ optimizer {} B), peak unsharded \
                 parameters {} B, at most {} unit(s) unsharded at once",
                m.sharded_bytes,
                optim.state_bytes(),
                m.peak_unsharded_bytes,
                m.peak_unsharded_units
            );
        }
        if rank == 0 {
            if let Some(rss) = peak_rss_bytes() {
                println!(
                    "process peak RSS {:.1} MiB (all ranks)",
                    rss as f64 / (1 << 20) as f64
                );
            }
            if let Some(s) = &scaler {
                let st = s.state();
                println!(
                    "grad scaler: scale {} after {} steps, {} skipped",
                    st.scale, st.taken_steps, st.skipped_steps
                );
            }
        }
        Ok((last_acc, tracer.map(|t| t.spans()).unwrap_or_default()))
    })?;
    if let Some(path) = &args.trace {
        write_trace(path, finals.iter().flat_map(|f| f.1.clone()).collect())?;
    }
    if finals[0].0.is_finite() {
        println!("final test accuracy {:.2}%", finals[0].0);
    } else {
        println!(
            "nothing to train: --epochs {} {}",
            args.epochs,
            if args.resume {
                "is already covered by the checkpoint"
            } else {
                "asks for none"
            }
        );
    }
    Ok(())
}
