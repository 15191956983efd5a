//! The main job: an MLP trained on real MNIST with FSDP (FULL_SHARD by default) over N ranks
//! running as threads of this process.
//!
//! Flatten → Linear(784,128) → ReLU → Linear(128,64) → ReLU → Linear(64,10); cross-entropy;
//! Adam (AdamW with weight decay 0), lr 1e-3; batch 32 per rank. Rank 0 logs one line per
//! epoch (epoch, mean train loss, test accuracy, epoch time), evaluates on the 10 000 test images
//! while the other ranks wait at a barrier, and a sharded checkpoint is saved at the end of every
//! epoch (and every `--save-every` steps); `--resume` continues from the newest one, mid-epoch
//! ones where the sampler stopped. The last lines name the newest checkpoint and the
//! `fsdp-ckpt export` command that makes one safetensors model file of it. The loop and its
//! flags are `examples/common/`'s.
//!
//! ```text
//! cargo run --release --example mnist -- --world-size 2 --epochs 5
//! ```

mod common;

use std::path::PathBuf;

use candle_fsdp::{metrics, models, AdamW, AdamWConfig};
use clap::Parser;

/// Train an MLP on MNIST with FSDP over in-process ranks.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Epochs to train (in total, counting resumed ones).
    #[arg(long, default_value_t = 5)]
    epochs: u64,
    #[command(flatten)]
    train: common::TrainArgs,
    /// Directory with the four MNIST IDX files (gzipped).
    #[arg(long, default_value = "data/mnist")]
    data_dir: PathBuf,
}

fn main() -> anyhow::Result<()> {
    let args: Args = common::parse(&common::Defaults {
        batch_size: "32",
        lr: "1e-3",
        lr_help: "Learning rate",
        checkpoint_dir: "checkpoints/mnist",
    })?;
    let train = &args.train;
    let setup = common::setup(train)?;
    let mnist = common::load_mnist(&args.data_dir)?;
    if setup.prints() {
        println!(
            "MNIST: {} train / {} test images; world size {} ({}), batch {} per rank, {:?}, {} compute thread(s) per rank",
            mnist.train_len(),
            mnist.test_len(),
            setup.launcher.world_size(),
            setup.device_desc(),
            train.batch_size,
            train.sharding_strategy(),
            setup.intra_op
        );
    }
    let outcome = common::train(
        train,
        &setup.launcher,
        &common::Job {
            epochs: args.epochs,
            data: &mnist.train,
            units: &|_pg| models::mnist_mlp(),
            optimizer: &|| {
                AdamW::new(AdamWConfig {
                    lr: train.lr,
                    weight_decay: 0.0,
                    ..Default::default()
                })
            },
            learning_rate: None,
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
    if outcome.accuracy.is_finite() {
        println!("final test accuracy {:.2}%", outcome.accuracy);
    } else {
        println!(
            "nothing to train: --epochs {} {}",
            args.epochs,
            if args.epochs == 0 {
                "asks for none"
            } else {
                "is already covered by the checkpoint"
            }
        );
    }
    common::print_checkpoint(train)?;
    Ok(())
}
