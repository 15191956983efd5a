//! A decoder of the Hugging Face families (`candle_fsdp::models::decoder`: Llama, Mistral,
//! Qwen2 / Qwen2.5, Qwen3, Phi-3, Gemma 2, GPT-2) fine-tuned, or a small Llama trained from
//! scratch, with FSDP over N ranks running as threads of this process (or one per process
//! under `mpirun`).
//!
//! With `--from-hf DIR` the model is a Hugging Face directory's (`config.json` and
//! `model.safetensors` or `model.safetensors.index.json` + shards; each rank reads only its
//! shards, bf16 / f16 weights become f32 masters) and its `tokenizer.json`, when there is one,
//! makes the tokens (else bytes are the tokens, which needs a vocabulary of at least 256).
//! Without it, a small Llama of the shape flags, from scratch, on bytes. The loop, the data
//! (`--data`, Shakespeare by default), the optimizer and every other flag are the GPT
//! example's (`examples/common/lm.rs`, `examples/common/`); `--config FILE` takes them from a
//! TOML file. Checkpoints store the model's `config.json`, so that
//! `fsdp-ckpt export CKPT --format hf --out DIR` publishes the result as a Hugging Face
//! directory (copy `tokenizer.json` next to it).
//!
//! `--eval-file FILE --max-steps 0` only evaluates: rank 0 prints `eval loss X`, the mean
//! next-token cross-entropy over FILE's tokens in consecutive windows of `--seq-len` inputs
//! plus one target, computed on all ranks' share and reduced.
//!
//! ```text
//! cargo run --release --example llama -- --world-size 2 --max-steps 50
//! cargo run --release --example llama -- --from-hf path/to/model --seq-len 128 --max-steps 100
//! cargo run --release --example llama -- --from-hf path/to/model --eval-file text.txt --max-steps 0
//! fsdp-ckpt export checkpoints/llama --format hf --out my-model --dtype bf16
//! ```

#[path = "../common/mod.rs"]
#[allow(dead_code, unused_imports)] // the MNIST examples' data and epoch loop are not used here
mod common;
mod data;
#[path = "../common/lm.rs"]
mod lm;

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use candle_core::{DType, Device, Module, Tensor};
use candle_fsdp::data::text::TextCorpus;
use candle_fsdp::hf::decoder::{build_from_resolved_with, resolve, HfDir, HfOptions, CONFIG_FILE};
use candle_fsdp::hf::llama::config_to_json;
use candle_fsdp::hf::peft::load_peft_adapter;
use candle_fsdp::hf::HF_CONFIG_KEY;
use candle_fsdp::lora::LoraConfig;
use candle_fsdp::models::decoder::{self, lm_loss, DecoderConfig, FsdpDecoder};
use candle_fsdp::models::llama::LlamaConfig;
use candle_fsdp::quant::BaseDType;
use candle_fsdp::{FsdpModel, MemoryBudget};
use clap::Parser;

use data::{load_tokens, HfTokenizer};
use lm::{Bytes, Codec, Corpus, LmParts, LmRank};

/// Fine-tune a decoder from a Hugging Face directory (Llama, Mistral, Qwen2, Qwen3, Phi-3,
/// Gemma 2, GPT-2), or train a small Llama from scratch, with FSDP
/// over in-process ranks (or the processes of an `mpirun` job).
#[derive(Debug, Parser)]
#[command(version)]
pub struct Args {
    /// A Hugging Face model directory to start from (config.json, safetensors weights, and
    /// tokenizer.json if any); the shape flags below are then ignored.
    #[arg(long, value_name = "DIR")]
    pub from_hf: Option<PathBuf>,
    /// Context length in tokens (training and evaluation windows).
    #[arg(long, default_value_t = 64)]
    pub seq_len: usize,
    /// From scratch: blocks.
    #[arg(long, default_value_t = 4)]
    pub n_layer: usize,
    /// From scratch: model width.
    #[arg(long, default_value_t = 128)]
    pub d_model: usize,
    /// From scratch: query heads (must divide --d-model).
    #[arg(long, default_value_t = 4)]
    pub n_head: usize,
    /// From scratch: key/value heads (must divide --n-head).
    #[arg(long, default_value_t = 2)]
    pub n_kv_head: usize,
    /// From scratch: hidden width of the SwiGLU MLP.
    #[arg(long, default_value_t = 352)]
    pub intermediate_size: usize,
    /// From scratch: tie the LM head to the token embedding.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value_t = false, action = clap::ArgAction::Set)]
    pub tied: bool,
    /// LoRA: the rank r of adapters on the --lora-targets projections (0: full fine-tuning).
    /// Only the adapters train (gradients, reduce-scatter, optimizer state); the base is frozen.
    #[arg(long, default_value_t = 0)]
    pub lora_rank: usize,
    /// LoRA: alpha (the update is scaled by alpha / r, or alpha / √r with --rslora).
    #[arg(long, default_value_t = 16.0)]
    pub lora_alpha: f64,
    /// LoRA: dropout on the adapters' input in training (PEFT's lora_dropout, in [0, 1)): each
    /// element zeroed with this probability, the rest scaled by 1 / (1 - p).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub lora_dropout: f64,
    /// LoRA: the target modules, comma-separated, as PEFT's target_modules (names such as
    /// q_proj, or globs such as '*.mlp.*').
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "q_proj,k_proj,v_proj,o_proj"
    )]
    pub lora_targets: Vec<String>,
    /// LoRA: rsLoRA's scaling alpha / √r.
    #[arg(long)]
    pub rslora: bool,
    /// LoRA: start the adapters from this PEFT adapter directory (adapter_model.safetensors)
    /// instead of PEFT's initialisation.
    #[arg(long, value_name = "DIR")]
    pub lora_from: Option<PathBuf>,
    /// LoRA: storage of the frozen base, f32 | bf16 | int8 | nf4 (QLoRA's 4-bit NormalFloat):
    /// each rank quantises its own shard once, keeps it packed and all-gathers the packed
    /// bytes; the unit computes in f32 after the gather.
    #[arg(long, default_value = "f32", value_name = "DTYPE")]
    pub base_dtype: String,
    /// Supervised examples (--data FILE.jsonl): pack several into each --seq-len sequence
    /// (best fit, longest first), positions restarting at each and attention confined to it,
    /// instead of padding each to --seq-len: the same loss, less padding computed.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value_t = false, action = clap::ArgAction::Set)]
    pub pack: bool,
    #[command(flatten)]
    pub lm: lm::LmArgs,
    #[command(flatten)]
    pub train: common::TrainArgs,
}

impl Args {
    /// The storage of the frozen base (`--base-dtype`), checked: a packed base needs LoRA.
    fn base_dtype(&self) -> anyhow::Result<BaseDType> {
        let d = BaseDType::from_name(&self.base_dtype).context("--base-dtype")?;
        anyhow::ensure!(
            d == BaseDType::F32 || self.lora_rank > 0,
            "--base-dtype {} stores a frozen base packed: it needs --lora-rank (full \
             fine-tuning trains every weight in f32)",
            d.name()
        );
        Ok(d)
    }

    /// The LoRA config of the flags, `None` without --lora-rank.
    fn lora(&self) -> anyhow::Result<Option<LoraConfig>> {
        if self.lora_rank == 0 {
            anyhow::ensure!(
                self.lora_from.is_none(),
                "--lora-from needs --lora-rank (the adapters' rank, as in the adapter's \
                 adapter_config.json)"
            );
            return Ok(None);
        }
        let mut cfg = LoraConfig::new(self.lora_rank, self.lora_alpha, self.lora_targets.clone());
        cfg.rslora = self.rslora;
        cfg.dropout = self.lora_dropout;
        cfg.validate()
            .context("--lora-rank / --lora-alpha / --lora-dropout / --lora-targets")?;
        if let Some(dir) = &self.lora_from {
            anyhow::ensure!(
                !self.train.resume && self.train.resume_from.is_none(),
                "--lora-from starts a run's adapters from {}; a resumed run continues its \
                 checkpoint's adapters: give one or the other",
                dir.display()
            );
            candle_fsdp::hf::peft::check_peft_config(dir, &cfg)
                .context("--lora-from: the adapter's config differs from this run's LoRA flags")?;
        }
        Ok(Some(cfg))
    }

    /// The from-scratch shape (bytes as tokens).
    fn scratch_config(&self) -> LlamaConfig {
        LlamaConfig {
            vocab_size: 256,
            hidden_size: self.d_model,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.n_layer,
            num_attention_heads: self.n_head,
            num_key_value_heads: self.n_kv_head,
            head_dim: self.d_model / self.n_head.max(1),
            max_position_embeddings: self.seq_len.max(1),
            tie_word_embeddings: self.tied,
            ..LlamaConfig::default()
        }
    }
}

/// Norm weights (GPT-2's `ln_1`, `ln_2`, `ln_f` too) and biases: no weight decay.
const NO_DECAY: [&str; 5] = [
    "*norm.weight",
    "*.bias",
    "*.ln_1.weight",
    "*.ln_2.weight",
    "*.ln_f.weight",
];

/// Activations per rank of one training step ([`lm::activation_estimate`]), from plain-Candle
/// probes of 1 and 2 blocks of `cfg` (the units' modules over a `VarMap`).
fn measure_activation_bytes(
    cfg: &DecoderConfig,
    batch: usize,
    seq_len: usize,
    checkpointed: bool,
) -> anyhow::Result<usize> {
    let held = |layers: usize| -> anyhow::Result<usize> {
        let varmap = candle_nn::VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let emb = decoder::token_embedding(cfg, vb.pp("emb"))?;
        let blocks = (0..layers)
            .map(|i| decoder::Block::new(cfg, i, vb.pp(format!("b{i}"))))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let norm = decoder::final_norm(cfg, vb.pp("norm"))?;
        let head = decoder::lm_head(cfg, vb.pp("head"))?;
        let ids = Tensor::zeros((batch, seq_len), DType::U32, &Device::Cpu)?;
        let before = candle_fsdp::alloc::live_bytes();
        let mut h = emb.forward(&ids)?;
        for b in &blocks {
            h = b.forward(&h)?;
        }
        let loss = lm_loss(&head.forward(&norm.forward(&h)?)?, &ids)?;
        let after = candle_fsdp::alloc::live_bytes();
        drop(loss);
        Ok(after.saturating_sub(before))
    };
    let input = batch * seq_len * cfg.hidden_size * 4;
    lm::activation_estimate(cfg.num_hidden_layers, input, checkpointed, held)
}

fn main() -> anyhow::Result<()> {
    let args: Args = common::parse(&common::Defaults {
        batch_size: "8",
        lr: "3e-4",
        lr_help: "Peak learning rate (linear warm-up, then cosine decay to --min-lr-factor · lr)",
        checkpoint_dir: "checkpoints/llama",
    })?;
    args.lm.validate()?;
    anyhow::ensure!(args.seq_len >= 1, "--seq-len must be at least 1");
    // The LoRA and storage flags before anything is read.
    args.base_dtype()?;
    args.lora()?;
    let train = &args.train;
    let setup = common::setup(train)?;
    // The model's shape and its config.json (stored in every checkpoint for the export).
    let (cfg, config_json, resolved): (DecoderConfig, _, Option<HfDir>) = match &args.from_hf {
        Some(dir) => {
            anyhow::ensure!(
                dir.is_dir(),
                "--from-hf {}: {} (expected a Hugging Face model directory: config.json and \
                 model.safetensors or model.safetensors.index.json)",
                dir.display(),
                if dir.exists() {
                    "not a directory"
                } else {
                    "no such directory"
                }
            );
            if !dir.join(CONFIG_FILE).is_file() {
                let is_checkpoint = dir.join(candle_fsdp::checkpoint::META_FILE).is_file()
                    || !candle_fsdp::checkpoint::list_complete(dir)
                        .unwrap_or_default()
                        .is_empty();
                anyhow::bail!(
                    "--from-hf {}: no {CONFIG_FILE} in it: {}",
                    dir.display(),
                    if is_checkpoint {
                        "it is a candle-fsdp checkpoint, not a Hugging Face directory (continue \
                         it with --resume --checkpoint-dir, or publish it with fsdp-ckpt export \
                         --format hf)"
                    } else {
                        "not a Hugging Face model directory"
                    }
                );
            }
            // Resolved as transformers resolves it: which weights file, whether the head is
            // tied (the config and its text as they load).
            let resolved = resolve(dir)?;
            (
                resolved.config.clone(),
                resolved.config_json.clone(),
                Some(resolved),
            )
        }
        None => {
            let cfg = args.scratch_config();
            cfg.validate()
                .context("--n-layer / --d-model / --n-head / --n-kv-head / --intermediate-size")?;
            (
                cfg.into(),
                config_to_json(&cfg, "float32").to_string(),
                None,
            )
        }
    };
    let config_src = args.from_hf.as_ref().map_or_else(
        || "the from-scratch shape".to_string(),
        |d| d.join(CONFIG_FILE).display().to_string(),
    );
    let learned_positions = cfg.names().positions.is_some();
    anyhow::ensure!(
        !learned_positions || args.seq_len <= cfg.max_position_embeddings,
        "--seq-len {} is longer than n_positions {} of {config_src}: the model's learned position \
         table has that many rows",
        args.seq_len,
        cfg.max_position_embeddings
    );
    let beyond_context = !learned_positions && args.seq_len > cfg.max_position_embeddings;
    // Tokens: the directory's tokenizer.json, else bytes.
    let tokenizer = match &args.from_hf {
        Some(dir) if dir.join("tokenizer.json").is_file() => {
            Some(HfTokenizer::load(&dir.join("tokenizer.json"))?)
        }
        _ => None,
    };
    let codec: &dyn Codec = match &tokenizer {
        Some(t) => {
            anyhow::ensure!(
                t.vocab_size() <= cfg.vocab_size,
                "{} has {} tokens, more than the model's vocab_size {} ({config_src})",
                args.from_hf.as_ref().map_or_else(String::new, |d| d
                    .join("tokenizer.json")
                    .display()
                    .to_string()),
                t.vocab_size(),
                cfg.vocab_size
            );
            t
        }
        None => {
            anyhow::ensure!(
                cfg.vocab_size >= 256,
                "no tokenizer.json beside the model and its vocab_size {} is below 256: bytes \
                 cannot be its tokens",
                cfg.vocab_size
            );
            &Bytes
        }
    };
    let eval_tokens = match &args.lm.eval_file {
        Some(path) => Some(lm::read_eval_file(path, codec, args.seq_len)?),
        None => None,
    };
    // The corpus is needed only to train.
    let corpus: Option<Box<dyn Corpus>> = if args.lm.max_steps == 0 && eval_tokens.is_some() {
        None
    } else if sft_data(&args.lm.data)? {
        // Supervised examples: the loss on the completions only, per token over the step.
        let encode = |t: &str| -> candle_fsdp::Result<Vec<u32>> {
            codec
                .encode(t)
                .map_err(|e| candle_fsdp::Error::InvalidArgument(e.to_string()))
        };
        // The completion ends with the tokenizer's end of sequence (config.json's
        // eos_token_id, the first of a list); byte tokens have none.
        let eos = tokenizer.as_ref().and_then(|_| {
            let v: serde_json::Value = serde_json::from_str(&config_json).ok()?;
            let e = &v["eos_token_id"];
            e.as_u64().or_else(|| e.get(0)?.as_u64()).map(|e| e as u32)
        });
        // `messages` lines are rendered by the model's chat template, when it has one.
        let template = match &args.from_hf {
            Some(dir) if dir.join("tokenizer_config.json").is_file() => {
                candle_fsdp::data::sft::ChatTemplate::from_tokenizer_config(
                    &dir.join("tokenizer_config.json"),
                )?
            }
            _ => None,
        };
        let read = candle_fsdp::data::sft::read_jsonl(
            &args.lm.data,
            &encode,
            template.as_ref(),
            eos,
            args.seq_len,
        )?;
        if setup.prints() && !read.skipped.is_empty() {
            println!(
                "note: {} skipped: {}: the prompt fills --seq-len {} (no completion token to \
                 learn; a longer --seq-len keeps them)",
                args.lm.data.display(),
                candle_fsdp::data::sft::lines_list(&read.skipped),
                args.seq_len
            );
        }
        let examples = read.examples;
        let cut = examples.iter().filter(|e| e.truncated).count();
        let mut corpus = lm::SftCorpus::new(examples, cfg.pad_token_id.unwrap_or(0))
            .with_context(|| format!("--data {}", args.lm.data.display()))?;
        if setup.prints() {
            println!(
                "data: supervised examples from {} ({} training, {} held out; the loss on the \
                 completions, per token over the step){}",
                args.lm.data.display(),
                corpus.train.len(),
                corpus.val.len(),
                if template.is_some() {
                    ", chat template of tokenizer_config.json"
                } else {
                    ""
                }
            );
            if cut > 0 {
                println!(
                    "note: {cut} example(s) longer than --seq-len {} + 1 tokens were cut (their \
                     completion's end not learned)",
                    args.seq_len
                );
            }
        }
        if args.pack {
            let (examples, tokens) = (corpus.train.len(), corpus.tokens());
            corpus.train = candle_fsdp::data::sft::pack(&corpus.train, args.seq_len)?;
            corpus.val = candle_fsdp::data::sft::pack(&corpus.val, args.seq_len)?;
            if setup.prints() {
                let rows = corpus.train.len();
                println!(
                    "packing: {examples} training examples into {rows} sequences of at most {} \
                     tokens ({:.0} % full)",
                    args.seq_len,
                    100.0 * tokens as f64 / (rows * args.seq_len) as f64,
                );
            }
        }
        Some(Box::new(corpus))
    } else if args.pack {
        anyhow::bail!(
            "--pack packs supervised examples: --data must be a .jsonl file of prompt/completion \
             or messages lines, found {}",
            args.lm.data.display()
        );
    } else if tokenizer.is_some() {
        Some(Box::new(load_tokens(&args.lm.data, codec, args.seq_len)?))
    } else {
        let c = TextCorpus::load(&args.lm.data).with_context(|| {
            format!(
                "loading the corpus {} (--data; a relative path is from the current \
                     directory)",
                args.lm.data.display()
            )
        })?;
        c.check_seq_len(candle_fsdp::data::text::Split::Train, args.seq_len)?;
        c.check_seq_len(candle_fsdp::data::text::Split::Val, args.seq_len)?;
        Some(Box::new(c))
    };
    let empty = TokenCorpusless;
    let corpus_ref: &dyn Corpus = corpus.as_deref().unwrap_or(&empty);
    if setup.prints() {
        println!(
            "{}{}: {} layers, d {}, {} heads ({} key/value) of {}, MLP {}, vocab {}, {}, {:.2} M \
             parameters; tokens: {}; world size {} ({}), batch {} × {} tokens per rank, {:?}",
            cfg.table().architecture,
            args.from_hf
                .as_ref()
                .map_or(String::new(), |d| format!(" from {}", d.display())),
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.vocab_size,
            if cfg.tie_word_embeddings {
                "tied"
            } else {
                "untied"
            },
            cfg.num_params()? as f64 / 1e6,
            if tokenizer.is_some() {
                "tokenizer.json"
            } else {
                "bytes"
            },
            setup.launcher.world_size(),
            setup.device_desc(),
            train.batch_size,
            args.seq_len,
            train.sharding_strategy(),
        );
        // What the directory's resolution decided beyond the plain case.
        if let Some(r) = &resolved {
            for d in &r.decisions {
                println!("{}: {d}", r.dir.display());
            }
        }
        if beyond_context {
            println!(
                "note: --seq-len {} is longer than max_position_embeddings {} of {config_src} \
                 (the context the model was trained with); rotary positions extend to it, as in \
                 transformers",
                args.seq_len, cfg.max_position_embeddings
            );
        }
    }
    let budget = match args.lm.max_memory_per_rank {
        Some(max) => Some(MemoryBudget {
            max_bytes_per_rank: usize::try_from(max).unwrap_or(usize::MAX),
            optimizer_bytes_per_element: args.lm.state_bytes_per_element(),
            activation_bytes: measure_activation_bytes(
                &cfg,
                train.batch_size,
                args.seq_len,
                args.lm.activation_checkpointing,
            )?,
        }),
        None => None,
    };
    let lora = args.lora()?;
    let base_dtype = args.base_dtype()?;
    check_resumed_model(
        train,
        &cfg,
        &config_src,
        setup.prints(),
        lora.as_ref(),
        base_dtype,
    )?;
    let mut extra = BTreeMap::from([(HF_CONFIG_KEY.to_string(), config_json)]);
    if let Some(l) = &lora {
        extra.insert(
            candle_fsdp::lora::LORA_CONFIG_KEY.to_string(),
            serde_json::to_string(l)?,
        );
        extra.insert(BASE_DTYPE_KEY.to_string(), base_dtype.name().to_string());
        if setup.prints() {
            println!(
                "LoRA: r {}, alpha {} (scale {}), dropout {}, targets {}; the base frozen ({}){}",
                l.r,
                l.alpha,
                l.scale(),
                l.dropout,
                l.targets.join(", "),
                base_dtype.name(),
                args.lora_from.as_ref().map_or(String::new(), |d| format!(
                    ", adapters from {}",
                    d.display()
                ))
            );
        }
    }
    let outcome = common::trainer::run_job(train, &setup.launcher, |pg, session| {
        let mut model = FsdpDecoder::new(cfg.clone())?
            .with_activation_checkpointing(args.lm.activation_checkpointing);
        if let Some(l) = &lora {
            model = model.with_lora(l.clone())?;
        }
        let parts = LmParts {
            model: model.clone(),
            seq_len: args.seq_len,
            corpus: corpus_ref,
            codec,
            eval_tokens: eval_tokens.as_deref(),
            no_decay: &NO_DECAY,
            extra: extra.clone(),
        };
        let build_pg = pg.clone();
        let activations = budget.map(|b| b.activation_bytes);
        LmRank::new(
            &args.lm,
            train,
            parts,
            pg,
            session,
            activations,
            |mut config| {
                config.memory_budget = budget;
                config.frozen_storage = base_dtype;
                let mut built = match &resolved {
                    Some(dir) => {
                        let opts = HfOptions {
                            activation_checkpointing: args.lm.activation_checkpointing,
                            lora: lora.clone(),
                        };
                        build_from_resolved_with(build_pg, config, dir, &opts)?.1
                    }
                    None => model
                        .add_units(FsdpModel::builder(build_pg, config))
                        .build()?,
                };
                if let Some(dir) = &args.lora_from {
                    load_peft_adapter(dir, &mut built)?;
                }
                Ok(built)
            },
        )?
        .run()
    });
    common::print_peak_rss(&setup.launcher);
    let Some(outcome) = outcome? else {
        return Ok(());
    };
    if outcome.steps_trained == 0 && outcome.eval_loss.is_none() {
        println!(
            "nothing to train: --max-steps {} is already covered or asks for none",
            args.lm.max_steps
        );
    }
    if let Some(sample) = &outcome.sample {
        println!(
            "sample ({} tokens after {:?}):",
            args.lm.sample_len, args.lm.prompt
        );
        println!("{sample}");
    }
    if outcome.steps_trained > 0 {
        common::print_checkpoint(train)?;
    }
    Ok(())
}

/// The corpus of an evaluation-only run: never asked for windows.
struct TokenCorpusless;

impl Corpus for TokenCorpusless {
    fn windows(
        &self,
        _: candle_fsdp::data::text::Split,
        _: usize,
        _: usize,
        _: u64,
        _: usize,
        _: u64,
        _: &Device,
    ) -> candle_fsdp::Result<lm::LmBatch> {
        Err(candle_fsdp::Error::InvalidArgument(
            "an evaluation-only run has no corpus".into(),
        ))
    }
}

/// `train.extra`'s key of a LoRA run's `--base-dtype` (the frozen base's storage).
const BASE_DTYPE_KEY: &str = "base_dtype";

/// With `--resume` / `--resume-from`, the checkpoint to resume must be of this run's model: its
/// stored `config.json` (train state `hf_config`) is read as a decoder config and its
/// parameters compared with `cfg`'s (names and shapes). Another model is an error naming both
/// (instead of the load's list of missing tensors); the same parameters under a config that
/// differs otherwise (a window, a cap) continue with this run's, said on stdout.
fn check_resumed_model(
    train: &common::TrainArgs,
    cfg: &DecoderConfig,
    config_src: &str,
    prints: bool,
    lora: Option<&LoraConfig>,
    base_dtype: BaseDType,
) -> anyhow::Result<()> {
    use candle_fsdp::checkpoint::{list_complete, read_meta, META_FILE};
    use candle_fsdp::models::decoder::family::config_from_json;
    let dir = match (&train.resume_from, train.resume) {
        (Some(d), _) => d.clone(),
        (None, true) => match list_complete(&train.checkpoint_dir)?.pop() {
            Some(d) => d,
            None => return Ok(()),
        },
        (None, false) => return Ok(()),
    };
    let meta = read_meta(&dir)?;
    // LoRA: the same adapters (rank, scale, targets), or none, as the checkpoint's run.
    let stored: Option<LoraConfig> = meta
        .train
        .extra
        .get(candle_fsdp::lora::LORA_CONFIG_KEY)
        .map(|t| serde_json::from_str(t))
        .transpose()
        .with_context(|| format!("{}: its LoRA config", dir.display()))?;
    let flags = |l: &LoraConfig| {
        format!(
            "--lora-rank {} --lora-alpha {} --lora-targets {}{}",
            l.r,
            l.alpha,
            l.targets.join(","),
            if l.rslora { " --rslora" } else { "" }
        )
    };
    match (&stored, lora) {
        (None, None) => {}
        (Some(s), None) => anyhow::bail!(
            "{} is a LoRA run's checkpoint (r {}, alpha {}, targets {}): resume it with its \
             adapters, {}",
            dir.display(),
            s.r,
            s.alpha,
            s.targets.join(", "),
            flags(s)
        ),
        (None, Some(_)) => anyhow::bail!(
            "{} is a full fine-tuning run's checkpoint (no LoRA adapters): resume it without \
             --lora-rank, or start the LoRA run in another --checkpoint-dir",
            dir.display()
        ),
        // Dropout may change between runs (it shapes training, not the adapters' meaning).
        (Some(s), Some(l)) => anyhow::ensure!(
            LoraConfig {
                dropout: l.dropout,
                ..s.clone()
            } == *l,
            "{} was trained with LoRA {}, this run asks for {}: resume it with the same \
             adapters and scale",
            dir.display(),
            flags(s),
            flags(l)
        ),
    }
    // The frozen base's storage may change (the adapters continue), but not without a word.
    if let Some(was) = meta.train.extra.get(BASE_DTYPE_KEY) {
        if prints && was != base_dtype.name() {
            println!(
                "note: {} was trained over a base stored as --base-dtype {was}; this run stores \
                 it as {}: the frozen base's values change, the adapters continue",
                dir.display(),
                base_dtype.name()
            );
        }
    }
    let Some(text) = meta.train.extra.get(HF_CONFIG_KEY) else {
        return Ok(());
    };
    let at = dir.join(META_FILE);
    let theirs = config_from_json(text, &at)?;
    let (a, b) = (theirs.parameter_shapes()?, cfg.parameter_shapes()?);
    anyhow::ensure!(
        a == b,
        "{} is a checkpoint of another model: a {} of {} parameters (its stored config.json), \
         where this run's is a {} of {} parameters ({config_src}); resume it with the model it \
         was trained from, or start this one in another --checkpoint-dir",
        dir.display(),
        theirs.table().architecture,
        a.len(),
        cfg.table().architecture,
        b.len(),
    );
    let changes = theirs.differences(cfg);
    if prints && !changes.is_empty() {
        println!(
            "note: {}'s stored config.json differs from {config_src} beyond the parameters' \
             shapes ({}); this run continues with {config_src}'s (and stores it in its \
             checkpoints)",
            dir.display(),
            changes.join(", ")
        );
    }
    Ok(())
}

/// Whether `--data` names supervised examples: a `.jsonl` file (any case). A `.json` file or a
/// compressed `.jsonl.gz` is refused (one example a line is expected, uncompressed) instead of
/// being read as text, which would train on the JSON syntax.
fn sft_data(path: &std::path::Path) -> anyhow::Result<bool> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    if name.ends_with(".jsonl") {
        return Ok(true);
    }
    anyhow::ensure!(
        !(name.ends_with(".json") || name.ends_with(".jsonl.gz") || name.ends_with(".json.gz")),
        "--data {}: supervised data is read from an uncompressed .jsonl file (one \
         {{\"prompt\", \"completion\"}} or {{\"messages\"}} object a line); a text corpus is \
         any other file, plain or .gz",
        path.display()
    );
    Ok(false)
}
