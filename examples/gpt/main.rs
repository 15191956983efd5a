//! A GPT-2-style decoder trained on the works of Shakespeare, byte by byte, with FSDP
//! (FULL_SHARD by default) over N ranks running as threads of this process (or one per process
//! under `mpirun`).
//!
//! Token (256 bytes) and position embeddings → `--n-layer` pre-norm blocks (causal multi-head
//! attention with `--n-head` heads, MLP 4× with GELU) → final LayerNorm → LM head, tied to the
//! token embedding unless `--untied` (`candle_fsdp::models::gpt`). Units: the embeddings, each
//! block, the norm and the head. AdamW (lr 3e-4, betas 0.9 / 0.95, weight decay 0.1 on the
//! weight matrices and embeddings) with a linear warm-up and a cosine decay to `--min-lr-factor` · lr at
//! `--max-steps`. Each rank trains on its own random windows of the first 95 % of
//! `data/shakespeare/shakespeare.txt.gz` (`--seq-len` bytes, `--batch-size` per rank), drawn
//! from `(seed, rank, step)`, so a resumed run sees the batches an uninterrupted one would.
//!
//! Rank 0 prints a loss line every `--log-interval` steps (mean over the ranks' micro-batches
//! since the last line, learning rate, step time, tokens per second over all ranks), the
//! validation loss on the last 5 % every `--eval-interval` steps and at the end, and a sample
//! generated from `--prompt`. Checkpoints, resume, precision, accumulation, clipping, trace and
//! strategy are the MNIST examples' flags (`examples/common/`). Every flag can also come from a
//! TOML file (`--config FILE`, `candle_fsdp::config_file`); flags on the command line win.
//!
//! ```text
//! cargo run --release --example gpt -- --world-size 2
//! cargo run --release --example gpt -- --world-size 2 --n-layer 6 --d-model 512 --n-head 8 \
//!     --seq-len 256 --batch-size 4 --untied --max-steps 20
//! ```

#[path = "../common/mod.rs"]
#[allow(dead_code, unused_imports)] // the MNIST examples' data and epoch loop are not used here
mod common;
#[path = "../common/lm.rs"]
mod lm;
mod run;

use anyhow::Context;
use candle_fsdp::data::text::{Split, TextCorpus, VOCAB_SIZE};
use candle_fsdp::models::gpt::GptConfig;
use clap::Parser;

/// Train a GPT-2-style decoder on Shakespeare (bytes as tokens) with FSDP over in-process ranks
/// (or the processes of an `mpirun` job).
#[derive(Debug, Parser)]
#[command(version)]
pub struct Args {
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    pub n_layer: usize,
    /// Attention heads per block (must divide --d-model).
    #[arg(long, default_value_t = 4)]
    pub n_head: usize,
    /// Model width.
    #[arg(long, default_value_t = 128)]
    pub d_model: usize,
    /// Context length in bytes (training windows and the position table).
    #[arg(long, default_value_t = 64)]
    pub seq_len: usize,
    /// Give the LM head its own weight instead of the token embedding's.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value_t = false, action = clap::ArgAction::Set)]
    pub untied: bool,
    #[command(flatten)]
    pub lm: lm::LmArgs,
    #[command(flatten)]
    pub train: common::TrainArgs,
}

impl Args {
    /// The model's shape.
    pub fn gpt_config(&self) -> GptConfig {
        GptConfig {
            vocab_size: VOCAB_SIZE,
            n_layer: self.n_layer,
            n_head: self.n_head,
            d_model: self.d_model,
            seq_len: self.seq_len,
            tied: !self.untied,
            ..GptConfig::default()
        }
    }

    /// The GPT's own flag checks (the loop's are `common::setup`'s).
    fn validate(&self) -> anyhow::Result<()> {
        self.gpt_config()
            .validate()
            .context("--n-layer / --n-head / --d-model / --seq-len")?;
        self.lm.validate()
    }
}

/// Parses the command line (and the `--config` file it names).
fn parse() -> anyhow::Result<Args> {
    common::parse(&common::Defaults {
        batch_size: "8",
        lr: "3e-4",
        lr_help: "Peak learning rate (linear warm-up, then cosine decay to --min-lr-factor · lr)",
        checkpoint_dir: "checkpoints/gpt",
    })
}

fn main() -> anyhow::Result<()> {
    let args = parse()?;
    args.validate()?;
    let train = &args.train;
    let setup = common::setup(train)?;
    let corpus = TextCorpus::load(&args.lm.data)
        .with_context(|| format!("loading the corpus {}", args.lm.data.display()))?;
    corpus.check_seq_len(Split::Train, args.seq_len)?;
    corpus.check_seq_len(Split::Val, args.seq_len)?;
    let cfg = args.gpt_config();
    if setup.prints() {
        println!(
            "GPT: {} layers, d {}, {} heads, context {}, {}, {:.2} M parameters; {}: {} train / {} \
             validation bytes; world size {} ({}), batch {} × {} tokens per rank, {:?}{}, {} \
             compute thread(s) per rank",
            cfg.n_layer,
            cfg.d_model,
            cfg.n_head,
            cfg.seq_len,
            if cfg.tied { "tied" } else { "untied" },
            cfg.num_params() as f64 / 1e6,
            args.lm.data.display(),
            corpus.split(Split::Train).len(),
            corpus.split(Split::Val).len(),
            setup.launcher.world_size(),
            setup.device_desc(),
            train.batch_size,
            cfg.seq_len,
            train.sharding_strategy(),
            if args.lm.activation_checkpointing {
                ", blocks checkpointed"
            } else {
                ""
            },
            setup.intra_op
        );
    }
    let budget = match args.lm.max_memory_per_rank {
        Some(max) => {
            let activation_bytes = run::measure_activation_bytes(
                &cfg,
                train.batch_size,
                args.lm.activation_checkpointing,
            )?;
            if setup.prints() {
                println!(
                    "memory budget {max} B per rank; measured activation estimate \
                     {activation_bytes} B per rank"
                );
            }
            Some(candle_fsdp::MemoryBudget {
                max_bytes_per_rank: usize::try_from(max).unwrap_or(usize::MAX),
                optimizer_bytes_per_element: args.lm.state_bytes_per_element(),
                activation_bytes,
            })
        }
        None => None,
    };
    let eval_tokens = match &args.lm.eval_file {
        Some(path) => Some(lm::read_eval_file(path, &lm::Bytes, args.seq_len)?),
        None => None,
    };
    let outcome = run::train(
        &args,
        cfg,
        &corpus,
        eval_tokens.as_deref(),
        &setup.launcher,
        budget,
    );
    // Every process reports its own peak (under mpirun: one line per rank).
    common::print_peak_rss(&setup.launcher);
    let outcome = outcome?;
    let Some(outcome) = outcome else {
        // Not rank 0's process (mpirun): rank 0 reports.
        return Ok(());
    };
    if outcome.steps_trained == 0 && outcome.eval_loss.is_none() {
        println!(
            "nothing to train: --max-steps {} {}",
            args.lm.max_steps,
            if args.lm.max_steps == 0 {
                "asks for none"
            } else {
                "is already covered by the checkpoint"
            }
        );
    }
    if let Some(sample) = &outcome.sample {
        println!(
            "sample ({} bytes after {:?}):",
            args.lm.sample_len, args.lm.prompt
        );
        println!("{sample}");
    }
    common::print_checkpoint(train)?;
    Ok(())
}
