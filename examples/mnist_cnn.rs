//! A convolutional network with SyncBatchNorm trained on real MNIST with FSDP (FULL_SHARD by
//! default) over N ranks running as threads of this process.
//!
//! (conv 3×3 pad 1, no bias → SyncBatchNorm → ReLU → max-pool 2) × 2 → flatten → linear → ReLU
//! → linear → 10 logits; cross-entropy; Adam (AdamW with weight decay 0) whose learning rate decays from `--lr`
//! to 0 along a cosine over the whole run (Loshchilov & Hutter 2017, SGDR). Each unit is one block, so FSDP
//! gathers one block's parameters at a time; the batch-norm statistics are computed over the
//! global batch (all ranks) and the running statistics are replicated buffers. Rank 0 logs one
//! line per epoch (mean train loss, test accuracy, epoch time) and evaluates on the 10 000 test
//! images with the gathered full model (eval mode: running statistics, no communication) while
//! the other ranks wait at a barrier.
//!
//! ```text
//! cargo run --release --example mnist_cnn -- --world-size 2 --epochs 2
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use candle_core::Tensor;
use candle_fsdp::comm::threads::{run_ranks_ok, set_intra_op_threads, ThreadGroupConfig};
use candle_fsdp::comm::{ProcessGroup, ProcessGroupExt, ReduceOp};
use candle_fsdp::data::{BatchLoader, DistributedSampler, Mnist};
use candle_fsdp::sync_batch_norm::sync_batch_norm;
use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, FsdpModel, ShardedOptimizer, ShardingStrategy};
use candle_nn::{BatchNormConfig, Conv2dConfig, Module, ModuleT, VarBuilder};
use clap::Parser;

// See examples/mnist.rs: MB-sized buffers are allocated and freed every step.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Train a CNN with SyncBatchNorm on MNIST with FSDP over in-process ranks.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Number of ranks (threads).
    #[arg(long, default_value_t = 2)]
    world_size: usize,
    /// Epochs to train.
    #[arg(long, default_value_t = 2)]
    epochs: u64,
    /// Seed of initialisation and shuffling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Batch size per rank (batch-norm statistics cover world_size × this).
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Peak learning rate (cosine decay to 0 over the run).
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Output channels of the first convolution.
    #[arg(long, default_value_t = 16)]
    channels1: usize,
    /// Output channels of the second convolution.
    #[arg(long, default_value_t = 32)]
    channels2: usize,
    /// Width of the hidden fully connected layer.
    #[arg(long, default_value_t = 128)]
    hidden: usize,
    /// Directory with the four MNIST IDX files (gzipped).
    #[arg(long, default_value = "data/mnist")]
    data_dir: PathBuf,
    /// Sharding strategy.
    #[arg(long, default_value = "full-shard")]
    strategy: ShardingStrategy,
    /// Collective timeout in seconds.
    #[arg(long, default_value_t = 300)]
    timeout_s: u64,
}

/// conv 3×3 (padding 1, no bias: batch norm cancels it) → SyncBatchNorm → ReLU → max-pool 2:
/// `(B, c_in, H, W)` → `(B, c_out, H/2, W/2)`.
fn conv_block(
    c_in: usize,
    c_out: usize,
    pg: Arc<dyn ProcessGroup>,
    vb: VarBuilder,
) -> candle_core::Result<candle_nn::FuncT<'static>> {
    let conv_cfg = Conv2dConfig {
        padding: 1,
        ..Default::default()
    };
    let conv = candle_nn::conv2d_no_bias(c_in, c_out, 3, conv_cfg, vb.pp("conv"))?;
    let bn = sync_batch_norm(c_out, BatchNormConfig::default(), pg, vb.pp("bn"))?;
    Ok(candle_nn::func_t(move |x, train| {
        bn.forward_t(&conv.forward(x)?, train)?
            .relu()?
            .max_pool2d(2)
    }))
}

fn build_model(pg: Arc<dyn ProcessGroup>, args: &Args) -> candle_fsdp::Result<FsdpModel> {
    let config = FsdpConfig {
        sharding_strategy: args.strategy,
        seed: args.seed,
        ..Default::default()
    };
    let (c1, c2, hidden) = (args.channels1, args.channels2, args.hidden);
    let (pg1, pg2) = (pg.clone(), pg.clone());
    FsdpModel::builder(pg, config)
        .unit("block1", move |vb| conv_block(1, c1, pg1.clone(), vb))
        .unit("block2", move |vb| conv_block(c1, c2, pg2.clone(), vb))
        .unit("fc", move |vb| {
            let fc = candle_nn::linear(c2 * 7 * 7, hidden, vb)?;
            Ok(candle_nn::func(move |x| {
                fc.forward(&x.flatten_from(1)?)?.relu()
            }))
        })
        .unit("head", move |vb| candle_nn::linear(hidden, 10, vb))
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
    anyhow::ensure!(rows == 28 && cols == 28, "expected 28×28 images");
    let test_len = mnist.test_len();
    let device = candle_core::Device::Cpu;
    let test_x = Tensor::from_vec(
        mnist.test_images.clone(),
        (test_len, 1, rows, cols),
        &device,
    )?;
    let test_labels: Vec<u32> = mnist.test_labels.iter().map(|&l| l as u32).collect();
    let test_y = Tensor::from_vec(test_labels, test_len, &device)?;
    println!(
        "MNIST CNN: {} train / {} test images; world size {}, batch {} per rank, channels {}/{}, \
         hidden {}, {:?}, {} compute thread(s) per rank",
        mnist.train_len(),
        test_len,
        args.world_size,
        args.batch_size,
        args.channels1,
        args.channels2,
        args.hidden,
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
        let mut sampler =
            DistributedSampler::new(train_labels.len(), ws, rank, true, args.seed, false)?;
        let steps_per_epoch = sampler.indices().len().div_ceil(args.batch_size);
        let total_steps = (steps_per_epoch as u64 * args.epochs).max(1) as f64;
        let mut step = 0u64;
        let mut last_acc = f64::NAN;
        let mut epoch_times = Vec::new();
        for epoch in 0..args.epochs {
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
            let (mut loss_sum, mut batches) = (0.0f64, 0usize);
            for batch in loader {
                let batch = batch?;
                let progress = step as f64 / total_steps;
                optim.set_learning_rate(
                    args.lr * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
                );
                step += 1;
                let logits = model.forward(&batch.images)?;
                let loss = candle_nn::loss::cross_entropy(&logits, &batch.labels)?;
                model.backward(&loss)?;
                optim.step(&mut model)?;
                model.zero_grad();
                loss_sum += loss.to_scalar::<f32>()? as f64;
                batches += 1;
            }
            // Mean train loss over all ranks' batches, reduced to rank 0.
            let sums = pg.reduce_f32s(vec![loss_sum as f32, batches as f32], 0, ReduceOp::Sum)?;
            let train_time = t0.elapsed().as_secs_f64();
            // Validation on rank 0 (eval mode: running statistics, no communication); the
            // others wait at the barrier.
            if let Some(full) = model.gather_full_model(true)? {
                last_acc = full.accuracy(&test_x, &test_y, 1000)?;
            }
            pg.barrier_wait()?;
            epoch_times.push(t0.elapsed().as_secs_f64());
            if rank == 0 {
                println!(
                    "epoch {:>2}  train loss {:.4}  test accuracy {:.2}%  epoch time {:.1}s (train {:.1}s)",
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
            if let Some(rss) = candle_fsdp::trace::peak_rss_bytes() {
                println!(
                    "process peak RSS {:.1} MiB (all ranks)",
                    rss as f64 / (1 << 20) as f64
                );
            }
        }
        Ok((last_acc, epoch_times))
    })?;
    let (acc, times) = &finals[0];
    let mean_time = times.iter().sum::<f64>() / times.len().max(1) as f64;
    println!(
        "final test accuracy {acc:.2}% after {} epoch(s), mean epoch time {mean_time:.1}s",
        times.len()
    );
    Ok(())
}
