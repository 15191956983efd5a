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
use candle_fsdp::comm::threads::{run_ranks_ok, set_intra_op_threads, ThreadGroupConfig};
use candle_fsdp::comm::{CommBuffer, ReduceOp};
use candle_fsdp::data::{BatchLoader, DistributedSampler, Mnist};
use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, FsdpModel, ShardedOptimizer, ShardingStrategy};
use candle_nn::Activation;
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

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
            for batch in loader {
                let batch = batch?;
                let logits = model.forward(&batch.images)?;
                let loss = candle_nn::loss::cross_entropy(&logits, &batch.labels)?;
                model.backward(&loss)?;
                optim.step(&mut model)?;
                model.zero_grad();
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
