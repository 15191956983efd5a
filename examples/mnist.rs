//! The main job: an MLP trained on real MNIST with FSDP (FULL_SHARD by default) over N ranks
//! running as threads of this process.
//!
//! Flatten → Linear(784,128) → ReLU → Linear(128,64) → ReLU → Linear(64,10); cross-entropy;
//! Adam (AdamW with weight decay 0), lr 1e-3; batch 32 per rank. Rank 0 logs one line per
//! epoch (epoch, mean train loss, test accuracy, epoch time), evaluates on the 10 000 test images
//! while the other ranks wait at a barrier, and a sharded checkpoint is saved at the end of every
//! epoch; a rerun resumes from the newest one.
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
use candle_fsdp::comm::{CommBuffer, ReduceOp};
use candle_fsdp::data::{BatchLoader, DistributedSampler, Mnist};
use candle_fsdp::grad_scaler::{GradScalerConfig, ShardedGradScaler};
use candle_fsdp::{
    AdamW, AdamWConfig, FsdpConfig, FsdpModel, MixedPrecision, ShardedOptimizer, ShardingStrategy,
};
use candle_nn::Activation;
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum AccumMode {
    NoSync,
    ReduceScatter,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Strategy {
    FullShard,
    ShardGradOp,
    NoShard,
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
    /// Where checkpoints go; training resumes from the newest one found there.
    #[arg(long, default_value = "checkpoints/mnist")]
    checkpoint_dir: PathBuf,
    /// Start from scratch even if a checkpoint exists (it is not deleted).
    #[arg(long)]
    no_resume: bool,
    /// Complete checkpoints to keep.
    #[arg(long, default_value_t = 2)]
    keep_last: usize,
    /// Sharding strategy.
    #[arg(long, value_enum, default_value_t = Strategy::FullShard)]
    strategy: Strategy,
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
    /// Collective timeout in seconds.
    #[arg(long, default_value_t = 300)]
    timeout_s: u64,
}

fn build_model(
    pg: Arc<dyn candle_fsdp::comm::ProcessGroup>,
    args: &Args,
) -> candle_fsdp::Result<FsdpModel> {
    let config = FsdpConfig {
        sharding_strategy: match args.strategy {
            Strategy::FullShard => ShardingStrategy::FullShard,
            Strategy::ShardGradOp => ShardingStrategy::ShardGradOp,
            Strategy::NoShard => ShardingStrategy::NoShard,
        },
        seed: args.seed,
        forward_prefetch: !args.no_prefetch,
        backward_prefetch: !args.no_prefetch,
        mixed_precision: MixedPrecision::from_name(&args.precision)?,
        ..Default::default()
    };
    FsdpModel::builder(pg, config)
        .unit("flatten", |_vb| Ok(candle_nn::func(|x| x.flatten_from(1))))
        .unit("fc1", |vb| {
            Ok(candle_nn::seq()
                .add(candle_nn::linear(784, 128, vb)?)
                .add(Activation::Relu))
        })
        .unit("fc2", |vb| {
            Ok(candle_nn::seq()
                .add(candle_nn::linear(128, 64, vb)?)
                .add(Activation::Relu))
        })
        .unit("fc3", |vb| candle_nn::linear(64, 10, vb))
        .build()
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.world_size >= 1, "--world-size must be at least 1");
    anyhow::ensure!(args.batch_size >= 1, "--batch-size must be at least 1");
    anyhow::ensure!(args.grad_accum >= 1, "--grad-accum must be at least 1");
    MixedPrecision::from_name(&args.precision)?;
    let intra_op = set_intra_op_threads(args.world_size);
    let mnist = Mnist::load(&args.data_dir)
        .with_context(|| format!("loading MNIST from {}", args.data_dir.display()))?;
    let train_images = Arc::new(mnist.train_images.clone());
    let train_labels = Arc::new(mnist.train_labels.clone());
    let (rows, cols) = (mnist.rows, mnist.cols);
    let test_len = mnist.test_len();
    let test_x = Tensor::from_vec(
        mnist.test_images.clone(),
        (test_len, 1, rows, cols),
        &candle_core::Device::Cpu,
    )?;
    let test_y = Tensor::from_vec(
        mnist
            .test_labels
            .iter()
            .map(|&l| l as u32)
            .collect::<Vec<_>>(),
        test_len,
        &candle_core::Device::Cpu,
    )?;
    println!(
        "MNIST: {} train / {} test images; world size {}, batch {} per rank, {:?}, {} compute thread(s) per rank",
        mnist.train_len(),
        test_len,
        args.world_size,
        args.batch_size,
        args.strategy,
        intra_op
    );
    let group_config = ThreadGroupConfig {
        timeout: Duration::from_secs(args.timeout_s),
    };
    let finals = run_ranks_ok(args.world_size, group_config, |pg| {
        let rank = pg.rank();
        let ws = pg.world_size();
        let mut model = build_model(pg.clone(), &args)?;
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
        let mut start_epoch = 0;
        if !args.no_resume {
            if let Some(meta) =
                checkpoint::load_latest(&args.checkpoint_dir, &mut model, &mut optim)?
            {
                start_epoch = meta.epoch;
                if rank == 0 {
                    println!(
                        "resumed from {} (epoch {}, step {})",
                        args.checkpoint_dir.display(),
                        meta.epoch,
                        meta.step
                    );
                }
            }
        }
        let mut sampler =
            DistributedSampler::new(train_labels.len(), ws, rank, true, args.seed, false)?;
        let mut last_acc = f64::NAN;
        for epoch in start_epoch..args.epochs {
            let t0 = Instant::now();
            sampler.set_epoch(epoch);
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
            let (mut loss_sum, mut batches) = (0.0f64, 0usize);
            let num_batches = loader.num_batches();
            let k = args.grad_accum;
            for (i, batch) in loader.enumerate() {
                let batch = batch?;
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
            let sums = pg
                .reduce(
                    CommBuffer::F32(vec![loss_sum as f32, batches as f32]),
                    0,
                    ReduceOp::Sum,
                )
                .wait()?
                .into_f32()?;
            let train_time = t0.elapsed().as_secs_f64();
            // Validation on rank 0; the others wait at the barrier.
            let full = model.gather_full_model(true)?;
            if let Some(full) = full {
                let mut correct = 0usize;
                for start in (0..test_len).step_by(1000) {
                    let n = 1000.min(test_len - start);
                    let logits = full.forward_t(&test_x.narrow(0, start, n)?, false)?;
                    let pred = logits.argmax(1)?;
                    correct += pred
                        .eq(&test_y.narrow(0, start, n)?)?
                        .to_dtype(DType::F32)?
                        .sum_all()?
                        .to_scalar::<f32>()? as usize;
                }
                last_acc = 100.0 * correct as f64 / test_len as f64;
            }
            pg.barrier().wait()?;
            let mut extra = std::collections::BTreeMap::new();
            extra.insert("seed".to_string(), args.seed.to_string());
            checkpoint::save_sharded(
                &args.checkpoint_dir,
                &model,
                &optim,
                epoch + 1,
                extra,
                args.keep_last,
            )?;
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
        }
        if rank == 0 {
            let m = model.memory_stats();
            println!(
                "rank 0 memory: sharded state {} B (+ optimizer {} B), peak unsharded parameters {} B in {} unit(s)",
                m.sharded_bytes,
                optim.state_bytes(),
                m.peak_unsharded_bytes,
                m.peak_unsharded_units
            );
            if let Some(s) = &scaler {
                let st = s.state();
                println!(
                    "grad scaler: scale {} after {} steps, {} skipped",
                    st.scale, st.taken_steps, st.skipped_steps
                );
            }
        }
        Ok(last_acc)
    })?;
    if finals[0].is_finite() {
        println!("final test accuracy {:.2}%", finals[0]);
    } else {
        println!(
            "nothing to train: the checkpoint already covers {} epochs",
            args.epochs
        );
    }
    Ok(())
}
