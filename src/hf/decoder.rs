//! Hugging Face model directories for every family: the directory resolved as transformers'
//! `from_pretrained` resolves it ([`resolve`]: config, weights file, tied head, names without
//! the base prefix) and the sharded load ([`build_from_hf`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use super::weights::{build_from_hf_weights, HfNames, HfWeights, TiedHead};
use crate::checkpoint::{agree, ReadStats};
use crate::comm::ProcessGroup;
use crate::error::{Error, Result};
use crate::fsdp::{FsdpConfig, FsdpModel};
use crate::models::decoder::family::{config_from_json, gpt2_dropout_note, Family};
use crate::models::decoder::{DecoderConfig, FsdpDecoder};

/// The model configuration file of a Hugging Face directory.
pub const CONFIG_FILE: &str = "config.json";

/// Reads `dir/config.json` ([`config_from_json`]).
///
/// Errors: the file missing or unreadable (named); as [`config_from_json`].
pub fn read_config(dir: &Path) -> Result<DecoderConfig> {
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    config_from_json(&text, &path)
}

/// Tensors of a Hugging Face directory that are not parameters here: rotary tables some older
/// checkpoints store, GPT-2's causal-mask buffers (`attn.bias`, `attn.masked_bias`), and a tied
/// model's duplicate head.
fn ignored(cfg: &DecoderConfig) -> impl Fn(&str) -> bool {
    let tied = cfg.tie_word_embeddings;
    let head = format!("{}.weight", cfg.names().head);
    let gpt2 = cfg.family == Family::Gpt2;
    move |name: &str| {
        name.ends_with(".rotary_emb.inv_freq")
            || (gpt2 && (name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")))
            || (tied && name == head)
    }
}

/// A Hugging Face directory resolved as transformers' `from_pretrained` (5.x) resolves it:
/// [`resolve`].
#[derive(Debug, Clone)]
pub struct HfDir {
    /// The directory.
    pub dir: PathBuf,
    /// The model's shape as it loads: `config.json`'s, with `tie_word_embeddings` turned off
    /// when the files hold a head that differs from the embedding.
    pub config: DecoderConfig,
    /// `config.json`'s text, with `tie_word_embeddings` set to `false` in that case (what a
    /// checkpoint stores for `fsdp-ckpt export --format hf`).
    pub config_json: String,
    /// What was decided that is not the plain case, one sentence each, for a line on rank 0
    /// ("not tying lm_head: …", "using model.safetensors; ignoring …"); empty when plain.
    pub decisions: Vec<String>,
    /// Parameter → the file tensor it is read from, where they differ.
    sources: BTreeMap<String, String>,
}

/// Resolves the Hugging Face directory `dir` as transformers' `from_pretrained` does:
/// - the config: `dir/config.json` ([`read_config`]: the family from `architectures`);
/// - the weights file: `model.safetensors` when present, an index beside it ignored; else
///   `model.safetensors.index.json` and its shards ([`HfWeights::open`]);
/// - names without the base model's prefix (GPT-2's published `wte.weight`, `h.0.…`) read as
///   the prefixed parameters (transformers' `base_model_prefix`);
/// - a tied head (`tie_word_embeddings: true`, [`HfWeights::resolve_tied_head`]): a head in
///   the files that differs from the embedding is loaded as an untied head (transformers:
///   "both are present in the checkpoints with different values, so we will NOT tie them"); a
///   file with the head and no embedding ties the embedding to the head.
///
/// Reads the headers, and the two tables when both are present under a tied config. Each
/// non-plain choice is one sentence of [`HfDir::decisions`] (also GPT-2's dropouts, which
/// training here does not apply).
///
/// Errors, naming the file and the key or tensor: as [`read_config`] and [`HfWeights::open`];
/// a read of the two tables.
pub fn resolve(dir: &Path) -> Result<HfDir> {
    let path = dir.join(CONFIG_FILE);
    let mut config_json = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let mut cfg = config_from_json(&config_json, &path)?;
    let names = cfg.names();
    let weights = HfWeights::open(dir, &mut ReadStats::default())?;
    let mut decisions = weights.decisions().to_vec();
    if cfg.family == Family::Gpt2 {
        decisions.extend(gpt2_dropout_note(&config_json));
    }
    // Parameters stored without the base prefix (one rule for the whole file, as
    // transformers decides per checkpoint).
    let mut sources = BTreeMap::new();
    let expected = cfg.parameter_shapes()?;
    let bare = |p: &str| p.strip_prefix(names.base_prefix).map(str::to_string);
    let prefixed_missing = expected.iter().all(|(p, _)| weights.shape(p).is_none());
    if prefixed_missing {
        let some_bare = expected
            .iter()
            .any(|(p, _)| bare(p).is_some_and(|b| weights.shape(&b).is_some()));
        if some_bare {
            for (p, _) in &expected {
                if let Some(b) = bare(p) {
                    sources.insert(p.clone(), b);
                }
            }
            decisions.push(format!(
                "the weights name tensors without the `{}` prefix (as published for {}); read \
                 as the prefixed parameters",
                names.base_prefix,
                cfg.table().architecture
            ));
        }
    }
    let source = |n: &str| sources.get(n).cloned().unwrap_or_else(|| n.to_string());
    let (embedding, head) = (
        format!("{}.weight", names.embed),
        format!("{}.weight", names.head),
    );
    if cfg.tie_word_embeddings {
        let file = |n: &str| {
            weights
                .file_of(n)
                .and_then(Path::file_name)
                .map_or(String::new(), |f| f.to_string_lossy().into_owned())
        };
        let emb_src = source(&embedding);
        match weights.resolve_tied_head(&emb_src, &head)? {
            TiedHead::Tied => {}
            TiedHead::Untied => {
                decisions.push(format!(
                    "not tying {}: {config} says tie_word_embeddings: true, but {head} \
                     ({}) differs from {emb_src} ({}); both are loaded, as transformers does, \
                     and the model is saved untied",
                    names.head,
                    file(&head),
                    file(&emb_src),
                    config = path.display(),
                ));
                cfg.tie_word_embeddings = false;
                let mut v: Value = serde_json::from_str(&config_json)
                    .map_err(|e| Error::file(&path, format!("not JSON: {e}")))?;
                v["tie_word_embeddings"] = Value::Bool(false);
                config_json = serde_json::to_string_pretty(&v).expect("JSON");
            }
            TiedHead::TiedFromHead => {
                decisions.push(format!(
                    "tying {embedding} to {head}: the weights ({}) hold the head and no \
                     embedding, and {} says tie_word_embeddings: true (as transformers does)",
                    file(&head),
                    path.display(),
                ));
                sources.insert(embedding, head);
            }
        }
    }
    Ok(HfDir {
        dir: dir.to_path_buf(),
        config: cfg,
        config_json,
        decisions,
        sources,
    })
}

/// Builds the decoder of the Hugging Face directory `dir` as a sharded [`FsdpModel`] (a
/// collective): the directory resolved as transformers resolves it ([`resolve`], agreed on by
/// every rank; its [`HfDir::decisions`] logged on rank 0 with `tracing::warn!`), then
/// [`build_from_resolved`].
///
/// Returns the units (for [`FsdpDecoder::logits`]; their config is the resolved one), the
/// model and what this rank read.
///
/// Errors, on every rank, naming the file and the tensor or key: as [`resolve`] and
/// [`build_from_resolved`].
pub fn build_from_hf(
    pg: Arc<dyn ProcessGroup>,
    config: FsdpConfig,
    dir: &Path,
    activation_checkpointing: bool,
) -> Result<(FsdpDecoder, FsdpModel, ReadStats)> {
    let opts = HfOptions {
        activation_checkpointing,
        lora: None,
    };
    build_from_hf_with(pg, config, dir, &opts)
}

/// How [`build_from_hf_with`] builds the decoder beyond the directory's config.
#[derive(Debug, Clone, Default)]
pub struct HfOptions {
    /// [`FsdpDecoder::with_activation_checkpointing`].
    pub activation_checkpointing: bool,
    /// [`FsdpDecoder::with_lora`]: adapters initialised as PEFT's (not read from the
    /// directory), the base frozen.
    pub lora: Option<crate::lora::LoraConfig>,
}

/// [`build_from_hf`] with options: activation checkpointing, LoRA adapters on the pretrained
/// base ([`HfOptions`]).
///
/// Errors: as [`build_from_hf`]; an invalid LoRA config or targets that match no projection.
pub fn build_from_hf_with(
    pg: Arc<dyn ProcessGroup>,
    config: FsdpConfig,
    dir: &Path,
    opts: &HfOptions,
) -> Result<(FsdpDecoder, FsdpModel, ReadStats)> {
    let (resolved, local) = match resolve(dir) {
        Ok(r) => (Some(r), Ok(())),
        Err(e) => (None, Err(e)),
    };
    agree(
        pg.as_ref(),
        "resolving the Hugging Face directory",
        dir,
        local,
    )?;
    let resolved = resolved.expect("resolved on every rank");
    if pg.rank() == 0 {
        for d in &resolved.decisions {
            tracing::warn!("{}: {d}", dir.display());
        }
    }
    build_from_resolved_with(pg, config, &resolved, opts)
}

/// Builds the decoder of a resolved directory ([`resolve`]) as a sharded [`FsdpModel`] (a
/// collective): the shape from [`HfDir::config`], the parameters from the weights file it
/// chose ([`super::weights::build_from_hf_weights`]): each rank memory-maps the files and
/// copies only the element ranges of its own shards (a fused tensor's rows included),
/// converting BF16 / F16 to f32 masters. `activation_checkpointing` is
/// [`FsdpDecoder::with_activation_checkpointing`].
///
/// Returns the units, the model and what this rank read.
///
/// Errors, on every rank, naming the file and the tensor: missing weights; a missing tensor, a
/// tensor of another shape (expected vs found), a tensor the model does not have; then the
/// model builder's.
pub fn build_from_resolved(
    pg: Arc<dyn ProcessGroup>,
    config: FsdpConfig,
    resolved: &HfDir,
    activation_checkpointing: bool,
) -> Result<(FsdpDecoder, FsdpModel, ReadStats)> {
    let opts = HfOptions {
        activation_checkpointing,
        lora: None,
    };
    build_from_resolved_with(pg, config, resolved, &opts)
}

/// [`build_from_resolved`] with [`HfOptions`]: with LoRA, the adapters are initialised (PEFT's
/// initialisation, the config's seed), everything else read, and the directory is recorded as
/// the model's frozen base ([`FsdpModel::set_base`], checksummed once per process): its sharded
/// checkpoints are then adapter-only.
///
/// Errors: as [`build_from_resolved`]; as [`FsdpDecoder::with_lora`].
pub fn build_from_resolved_with(
    pg: Arc<dyn ProcessGroup>,
    config: FsdpConfig,
    resolved: &HfDir,
    opts: &HfOptions,
) -> Result<(FsdpDecoder, FsdpModel, ReadStats)> {
    let cfg = resolved.config.clone();
    let mut decoder =
        FsdpDecoder::new(cfg.clone())?.with_activation_checkpointing(opts.activation_checkpointing);
    if let Some(lora) = &opts.lora {
        decoder = decoder.with_lora(lora.clone())?;
    }
    let ignored = ignored(&cfg);
    let fresh = |n: &str| n.ends_with(".lora_A.weight") || n.ends_with(".lora_B.weight");
    let names = HfNames {
        sources: resolved.sources.clone(),
        ignored: &ignored,
        fresh: opts
            .lora
            .is_some()
            .then_some(&fresh as &dyn Fn(&str) -> bool),
    };
    let (mut model, stats) =
        build_from_hf_weights(pg, config, decoder.spec(), &resolved.dir, &names)?;
    if opts.lora.is_some() {
        // A LoRA run's base: its checkpoints are adapter-only (decision 75).
        let (id, local) = match crate::base::BaseIdentity::of(&resolved.dir) {
            Ok(id) => (Some(id), Ok(())),
            Err(e) => (None, Err(e)),
        };
        let pg = model.process_group().clone();
        agree(
            pg.as_ref(),
            "identifying the frozen base",
            &resolved.dir,
            local,
        )?;
        model.set_base(id);
    }
    Ok((decoder, model, stats))
}
