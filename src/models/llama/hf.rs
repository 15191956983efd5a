//! Hugging Face model directories for the Llama: `config.json` in and out
//! ([`config_from_json`], [`config_to_json`]), the directory resolved as transformers'
//! `from_pretrained` resolves it ([`resolve`]: which weights file, whether the head is tied) and
//! the sharded load ([`build_from_hf`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{json, Map, Value};

use super::{FsdpLlama, Llama3RopeScaling, LlamaConfig, EMBED, HEAD};
use crate::checkpoint::hf::{build_from_hf_weights, HfNames, HfWeights, TiedHead};
use crate::checkpoint::{agree, ReadStats};
use crate::comm::ProcessGroup;
use crate::error::{Error, Result};
use crate::fsdp::{FsdpConfig, FsdpModel};

/// The model configuration file of a Hugging Face directory.
pub const CONFIG_FILE: &str = "config.json";

/// Architectures [`config_from_json`] accepts (the same modules and parameter names; Mistral
/// only without a sliding window).
pub const ARCHITECTURES: [&str; 2] = ["LlamaForCausalLM", "MistralForCausalLM"];

/// Reads a Hugging Face `config.json` (given as text; `path` names it in errors).
///
/// Read: `architectures` (one of [`ARCHITECTURES`]), `vocab_size`, `hidden_size`,
/// `intermediate_size`, `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`
/// (default: `num_attention_heads`), `head_dim` (default `hidden_size / num_attention_heads`),
/// `max_position_embeddings` (default 2048), `rms_norm_eps` (default 1e-6), `rope_theta`, or
/// transformers 5's `rope_parameters.rope_theta` (default 10000), `tie_word_embeddings`
/// (default false), `attention_bias`, `mlp_bias` (default false). Other keys (token ids,
/// `torch_dtype`, `initializer_range`, `use_cache`, `pretraining_tp`, …) do not change the
/// computation and are ignored.
///
/// Errors ([`Error::File`] naming `path` and the key): not JSON; an architecture not in
/// [`ARCHITECTURES`]; a missing or mistyped required key; keys it cannot honour:
/// `hidden_act` other than `silu`, a `rope_scaling` / `rope_parameters.rope_type` other than
/// the default or `"llama3"` (whose `factor`, `low_freq_factor`, `high_freq_factor` and
/// `original_max_position_embeddings` are read: [`Llama3RopeScaling`]), a `sliding_window`, a non-zero `attention_dropout`; an invalid shape
/// ([`LlamaConfig::validate`]).
pub fn config_from_json(text: &str, path: &Path) -> Result<LlamaConfig> {
    let bad = |msg: String| Error::file(path, msg);
    let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let o = v
        .as_object()
        .ok_or_else(|| bad("expected a JSON object".into()))?;
    let archs: Vec<&str> = o
        .get("architectures")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if !archs.iter().any(|a| ARCHITECTURES.contains(a)) {
        return Err(bad(format!(
            "unsupported architecture {archs:?} (key `architectures`): supported are {ARCHITECTURES:?}"
        )));
    }
    let usize_key = |k: &str, default: Option<usize>| -> Result<usize> {
        match o.get(k) {
            None | Some(Value::Null) => default.ok_or_else(|| bad(format!("key `{k}` is missing"))),
            Some(x) => x.as_u64().map(|n| n as usize).ok_or_else(|| {
                bad(format!(
                    "key `{k}`: expected a non-negative integer, found {x}"
                ))
            }),
        }
    };
    let f64_key = |obj: &Map<String, Value>, k: &str, default: f64| -> Result<f64> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(default),
            Some(x) => x
                .as_f64()
                .ok_or_else(|| bad(format!("key `{k}`: expected a number, found {x}"))),
        }
    };
    let bool_key = |k: &str| -> Result<bool> {
        match o.get(k) {
            None | Some(Value::Null) => Ok(false),
            Some(x) => x
                .as_bool()
                .ok_or_else(|| bad(format!("key `{k}`: expected true or false, found {x}"))),
        }
    };
    if let Some(act) = o.get("hidden_act").and_then(Value::as_str) {
        if act != "silu" {
            return Err(bad(format!(
                "key `hidden_act` is {act:?}: only \"silu\" (SwiGLU) is supported"
            )));
        }
    }
    if let Some(s) = o.get("sliding_window").filter(|s| !s.is_null()) {
        return Err(bad(format!(
            "key `sliding_window` is {s}: sliding-window attention is not supported"
        )));
    }
    let dropout = f64_key(o, "attention_dropout", 0.0)?;
    if dropout != 0.0 {
        return Err(bad(format!(
            "key `attention_dropout` is {dropout}: attention dropout is not supported (0 only)"
        )));
    }
    let mut rope_theta = f64_key(o, "rope_theta", 10000.0)?;
    let mut rope_scaling = None;
    for key in ["rope_scaling", "rope_parameters"] {
        match o.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::Object(p)) => {
                let kind = p
                    .get("rope_type")
                    .or_else(|| p.get("type"))
                    .and_then(Value::as_str)
                    .unwrap_or("default");
                match kind {
                    "default" => {}
                    "llama3" => {
                        let number = |k: &str| -> Result<f64> {
                            p.get(k).and_then(Value::as_f64).ok_or_else(|| {
                                bad(format!(
                                    "key `{key}.{k}`: a number is needed for rope_type \"llama3\", \
                                     found {}",
                                    p.get(k).map_or("nothing".to_string(), |v| v.to_string())
                                ))
                            })
                        };
                        let factor = number("factor")?;
                        let low_freq_factor = number("low_freq_factor")?;
                        let high_freq_factor = number("high_freq_factor")?;
                        let original = p
                            .get("original_max_position_embeddings")
                            .and_then(Value::as_u64)
                            .ok_or_else(|| {
                                bad(format!(
                                    "key `{key}.original_max_position_embeddings`: a \
                                     non-negative integer is needed for rope_type \"llama3\""
                                ))
                            })?;
                        rope_scaling = Some(Llama3RopeScaling {
                            factor,
                            low_freq_factor,
                            high_freq_factor,
                            original_max_position_embeddings: original as usize,
                        });
                    }
                    _ => {
                        return Err(bad(format!(
                            "key `{key}.rope_type` is {kind:?}: supported are the default rotary \
                             embedding and \"llama3\""
                        )))
                    }
                }
                rope_theta = f64_key(p, "rope_theta", rope_theta)?;
            }
            Some(x) => return Err(bad(format!("key `{key}`: expected an object, found {x}"))),
        }
    }
    let hidden_size = usize_key("hidden_size", None)?;
    let num_attention_heads = usize_key("num_attention_heads", None)?;
    let cfg = LlamaConfig {
        vocab_size: usize_key("vocab_size", None)?,
        hidden_size,
        intermediate_size: usize_key("intermediate_size", None)?,
        num_hidden_layers: usize_key("num_hidden_layers", None)?,
        num_attention_heads,
        num_key_value_heads: usize_key("num_key_value_heads", Some(num_attention_heads))?,
        head_dim: usize_key("head_dim", Some(hidden_size / num_attention_heads.max(1)))?,
        max_position_embeddings: usize_key("max_position_embeddings", Some(2048))?,
        rms_norm_eps: f64_key(o, "rms_norm_eps", 1e-6)?,
        rope_theta,
        rope_scaling,
        tie_word_embeddings: bool_key("tie_word_embeddings")?,
        attention_bias: bool_key("attention_bias")?,
        mlp_bias: bool_key("mlp_bias")?,
    };
    cfg.validate().map_err(|e| bad(e.to_string()))?;
    Ok(cfg)
}

/// The `config.json` of `cfg` for `LlamaForCausalLM` with weights of `dtype` (`"float32"`,
/// `"bfloat16"`, `"float16"`): the keys [`config_from_json`] reads (the rotary base both as
/// `rope_theta` and in `rope_parameters`, which transformers 4 and 5 read respectively),
/// `hidden_act`, `model_type`, and the dtype as `torch_dtype` and `dtype`.
pub fn config_to_json(cfg: &LlamaConfig, dtype: &str) -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope_parameters(cfg),
        "rope_scaling": cfg.rope_scaling.map(|_| rope_parameters(cfg)),
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "hidden_act": "silu",
        "torch_dtype": dtype,
        "dtype": dtype,
    })
}

/// `rope_parameters` of `cfg` for [`config_to_json`]: the rotary base, and Llama 3's scaling
/// when it has one (also written as `rope_scaling` there, which transformers 4 reads).
fn rope_parameters(cfg: &LlamaConfig) -> Value {
    match &cfg.rope_scaling {
        None => json!({"rope_type": "default", "rope_theta": cfg.rope_theta}),
        Some(s) => json!({
            "rope_type": "llama3",
            "rope_theta": cfg.rope_theta,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }),
    }
}

/// Reads `dir/config.json` ([`config_from_json`]).
///
/// Errors: the file missing or unreadable (named); as [`config_from_json`].
pub fn read_config(dir: &Path) -> Result<LlamaConfig> {
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    config_from_json(&text, &path)
}

/// The parameters a Llama of shape `cfg` has, under Hugging Face's names, each with its shape,
/// in model order (a tied model's head is the embedding's `model.embed_tokens.weight`, listed
/// once). Nothing is allocated (the units' constructors are recorded).
///
/// Errors: an invalid shape ([`LlamaConfig::validate`]).
pub fn parameter_shapes(cfg: &LlamaConfig) -> Result<Vec<(String, Vec<usize>)>> {
    Ok(FsdpLlama::new(*cfg)?
        .spec()
        .record(&candle_core::Device::Cpu)?
        .into_iter()
        .map(|p| (p.name, p.shape.dims().to_vec()))
        .collect())
}

/// Tensors of a Hugging Face Llama directory that are not parameters here: rotary tables some
/// older checkpoints store, and a tied model's duplicate `lm_head.weight`.
fn ignored(cfg: &LlamaConfig) -> impl Fn(&str) -> bool {
    let tied = cfg.tie_word_embeddings;
    move |name: &str| {
        name.ends_with(".rotary_emb.inv_freq") || (tied && name == format!("{HEAD}.weight"))
    }
}

/// A Hugging Face Llama directory resolved as transformers' `from_pretrained` (5.x) resolves
/// it: [`resolve`].
#[derive(Debug, Clone)]
pub struct HfLlamaDir {
    /// The directory.
    pub dir: PathBuf,
    /// The model's shape as it loads: `config.json`'s, with `tie_word_embeddings` turned off
    /// when the files hold a head that differs from the embedding.
    pub config: LlamaConfig,
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
/// - the config: `dir/config.json` ([`read_config`]);
/// - the weights file: `model.safetensors` when present, an index beside it ignored; else
///   `model.safetensors.index.json` and its shards ([`HfWeights::open`]);
/// - a tied head (`tie_word_embeddings: true`, [`HfWeights::resolve_tied_head`]): a
///   `lm_head.weight` in the files that differs from `model.embed_tokens.weight` is loaded as an
///   untied head (transformers: "both are present in the checkpoints with different values, so
///   we will NOT tie them"); a file with `lm_head.weight` and no embedding ties the embedding to
///   the head (the embedding reads the head's values).
///
/// Reads the headers, and the two tables when both are present under a tied config (to compare
/// them). Each non-plain choice is one sentence of [`HfLlamaDir::decisions`].
///
/// Errors, naming the file and the key or tensor: as [`read_config`] and [`HfWeights::open`];
/// a read of the two tables.
pub fn resolve(dir: &Path) -> Result<HfLlamaDir> {
    let path = dir.join(CONFIG_FILE);
    let mut config_json = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let mut cfg = config_from_json(&config_json, &path)?;
    let weights = HfWeights::open(dir, &mut ReadStats::default())?;
    let mut decisions = weights.decisions().to_vec();
    let mut sources = BTreeMap::new();
    let (embedding, head) = (format!("{EMBED}.weight"), format!("{HEAD}.weight"));
    if cfg.tie_word_embeddings {
        let file = |n: &str| {
            weights
                .file_of(n)
                .and_then(Path::file_name)
                .map_or(String::new(), |f| f.to_string_lossy().into_owned())
        };
        match weights.resolve_tied_head(&embedding, &head)? {
            TiedHead::Tied => {}
            TiedHead::Untied => {
                decisions.push(format!(
                    "not tying {HEAD}: {config} says tie_word_embeddings: true, but {head} \
                     ({}) differs from {embedding} ({}); both are loaded, as transformers does, \
                     and the model is saved untied",
                    file(&head),
                    file(&embedding),
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
    Ok(HfLlamaDir {
        dir: dir.to_path_buf(),
        config: cfg,
        config_json,
        decisions,
        sources,
    })
}

/// Builds the Llama of the Hugging Face directory `dir` as a sharded [`FsdpModel`] (a
/// collective): the directory resolved as transformers resolves it ([`resolve`], agreed on by
/// every rank; its [`HfLlamaDir::decisions`] logged on rank 0 with `tracing::warn!`), then
/// [`build_from_resolved`].
///
/// Returns the units (for [`FsdpLlama::logits`]; their config is the resolved one), the model
/// and what this rank read.
///
/// Errors, on every rank, naming the file and the tensor or key: as [`resolve`] and
/// [`build_from_resolved`].
pub fn build_from_hf(
    pg: Arc<dyn ProcessGroup>,
    config: FsdpConfig,
    dir: &Path,
    activation_checkpointing: bool,
) -> Result<(FsdpLlama, FsdpModel, ReadStats)> {
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
    build_from_resolved(pg, config, &resolved, activation_checkpointing)
}

/// Builds the Llama of a resolved directory ([`resolve`]) as a sharded [`FsdpModel`] (a
/// collective): the shape from [`HfLlamaDir::config`], the parameters from the weights file it
/// chose ([`crate::checkpoint::hf::build_from_hf_weights`]): each rank memory-maps the files and
/// copies only the element ranges of its own shards, converting BF16 / F16 to f32 masters.
/// `activation_checkpointing` is [`FsdpLlama::with_activation_checkpointing`].
///
/// Returns the units, the model and what this rank read.
///
/// Errors, on every rank, naming the file and the tensor: missing weights; a missing tensor, a
/// tensor of another shape (expected vs found), a tensor the model does not have; then the
/// model builder's.
pub fn build_from_resolved(
    pg: Arc<dyn ProcessGroup>,
    config: FsdpConfig,
    resolved: &HfLlamaDir,
    activation_checkpointing: bool,
) -> Result<(FsdpLlama, FsdpModel, ReadStats)> {
    let cfg = resolved.config;
    let llama = FsdpLlama::new(cfg)?.with_activation_checkpointing(activation_checkpointing);
    let ignored = ignored(&cfg);
    let names = HfNames {
        sources: resolved.sources.clone(),
        ignored: &ignored,
    };
    let (model, stats) = build_from_hf_weights(pg, config, llama.spec(), &resolved.dir, &names)?;
    Ok((llama, model, stats))
}
