//! A convolutional network with SyncBatchNorm trained on real MNIST with FSDP (FULL_SHARD by
//! default) over N ranks running as threads of this process.
//!
//! (conv 3×3 pad 1, no bias → SyncBatchNorm → ReLU → max-pool 2) × 2 → flatten → linear → ReLU
//! → linear → 10 logits; cross-entropy; Adam (AdamW with weight decay 0) whose learning rate
//! decays from `--lr` to 0 along a cosine over the whole run (Loshchilov & Hutter 2017, SGDR).
//! Each unit is one block, so FSDP gathers one block's parameters at a time; the batch-norm
//! statistics are computed over the global batch (all ranks) and the running statistics are
//! replicated buffers. Rank 0 logs one line per epoch (mean train loss, test accuracy, epoch
//! time) and evaluates on the 10 000 test images with the gathered full model (eval mode:
//! running statistics, no communication) while the other ranks wait at a barrier. The loop and
//! its flags (checkpoints, precision, accumulation, tracing, …) are `examples/common/`'s.
//!
//! ```text
//! cargo run --release --example mnist_cnn -- --world-size 2 --epochs 2
//! ```

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use candle_fsdp::comm::ProcessGroup;
use candle_fsdp::sync_batch_norm::sync_batch_norm;
use candle_fsdp::unit::UnitSpec;
use candle_fsdp::{metrics, AdamW, AdamWConfig};
use candle_nn::{BatchNormConfig, Conv2dConfig, Module, ModuleT, VarBuilder};
use clap::Parser;

/// Train a CNN with SyncBatchNorm on MNIST with FSDP over in-process ranks.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Epochs to train (in total, counting resumed ones).
    #[arg(long, default_value_t = 2)]
    epochs: u64,
    #[command(flatten)]
    train: common::TrainArgs,
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

/// The units: `block1`, `block2` (conv blocks), `fc` (flatten → linear → ReLU), `head`.
fn units(args: &Args, pg: Arc<dyn ProcessGroup>) -> Vec<UnitSpec> {
    let (c1, c2, hidden) = (args.channels1, args.channels2, args.hidden);
    let pg2 = pg.clone();
    vec![
        UnitSpec::new("block1", move |vb| conv_block(1, c1, pg.clone(), vb)),
        UnitSpec::new("block2", move |vb| conv_block(c1, c2, pg2.clone(), vb)),
        UnitSpec::new("fc", move |vb| {
            let fc = candle_nn::linear(c2 * 7 * 7, hidden, vb)?;
            Ok(candle_nn::func(move |x| {
                fc.forward(&x.flatten_from(1)?)?.relu()
            }))
        }),
        UnitSpec::new("head", move |vb| candle_nn::linear(hidden, 10, vb)),
    ]
}

/// Cosine decay from `peak` at step 0 to 0 at step `total` (SGDR without restarts).
fn cosine(peak: f64, step: u64, total: u64) -> f64 {
    let progress = step as f64 / total as f64;
    peak * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
}

fn main() -> anyhow::Result<()> {
    let args: Args = common::parse(&common::Defaults {
        batch_size: "32",
        lr: "3e-3",
        lr_help: "Peak learning rate (cosine decay to 0 over the run)",
        checkpoint_dir: "checkpoints/mnist_cnn",
    })?;
    let train = &args.train;
    let setup = common::setup(train)?;
    let mnist = common::load_mnist(&args.data_dir)?;
    let world_size = setup.launcher.world_size();
    let intra_op = setup.intra_op;
    if setup.prints() {
        println!(
        "MNIST CNN: {} train / {} test images; world size {} ({}), batch {} per rank, channels {}/{}, \
         hidden {}, {:?}, {} compute thread(s) per rank",
        mnist.train_len(),
        mnist.test_len(),
        world_size,
        setup.device_desc(),
        train.batch_size,
        args.channels1,
        args.channels2,
        args.hidden,
        train.sharding_strategy(),
        intra_op
    );
    }
    let outcome = common::train(
        train,
        &setup.launcher,
        &common::Job {
            epochs: args.epochs,
            data: &mnist.train,
            units: &|pg| units(&args, pg),
            optimizer: &|| {
                AdamW::new(AdamWConfig {
                    lr: train.lr,
                    weight_decay: 0.0,
                    ..Default::default()
                })
            },
            learning_rate: Some(&|step, total| cosine(train.lr, step, total)),
            evaluate: &|full| metrics::accuracy(full, &mnist.test_x, &mnist.test_y, 1000),
        },
    );
    // Every process reports its own peak (under mpirun: one line per rank).
    common::print_peak_rss(&setup.launcher);
    let outcome = outcome?;
    let Some(outcome) = outcome else {
        // Not rank 0's process (mpirun): rank 0 reports.
        return Ok(());
    };
    if !outcome.accuracy.is_finite() {
        // No epoch ran (as the MLP example says it).
        println!(
            "nothing to train: --epochs {} {}",
            args.epochs,
            if args.epochs == 0 {
                "asks for none"
            } else {
                "is already covered by the checkpoint"
            }
        );
        common::print_checkpoint(train)?;
        return Ok(());
    }
    let times = &outcome.epoch_times;
    let mean_time = times.iter().sum::<f64>() / times.len().max(1) as f64;
    println!(
        "final test accuracy {:.2}% after {} epoch(s), mean epoch time {mean_time:.1}s",
        outcome.accuracy,
        times.len()
    );
    common::print_checkpoint(train)?;
    Ok(())
}
