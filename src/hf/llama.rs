//! Hugging Face model directories for the Llama: `config.json` in and out
//! ([`config_from_json`], [`config_to_json`]); the directory's resolution and the sharded load
//! are the decoder's ([`resolve`], [`build_from_hf`]: every family), re-exported here.

use std::path::Path;

use serde_json::{json, Value};

pub use super::decoder::{
    build_from_hf, build_from_resolved, resolve, HfDir as HfLlamaDir, CONFIG_FILE,
};
use crate::error::{Error, Result};
use crate::models::decoder::{self, DecoderConfig, Family};
use crate::models::llama::LlamaConfig;

/// Architectures [`config_from_json`] reads as a [`LlamaConfig`] (Mistral only without a
/// sliding window); [`crate::models::decoder::family::config_from_json`] reads every family.
pub const ARCHITECTURES: [&str; 2] = ["LlamaForCausalLM", "MistralForCausalLM"];

/// Reads a Hugging Face `config.json` (given as text; `path` names it in errors) of a Llama:
/// [`crate::models::decoder::family::config_from_json`] (its keys, defaults and refusals),
/// then the Llama's shape of it.
///
/// Errors ([`Error::File`] naming `path` and the key): as the decoder's; a family other than
/// [`ARCHITECTURES`], or a Mistral with a sliding window (the decoder builds those).
pub fn config_from_json(text: &str, path: &Path) -> Result<LlamaConfig> {
    let cfg = decoder::family::config_from_json(text, path)?;
    if !matches!(cfg.family, Family::Llama | Family::Mistral) || cfg.sliding_window.is_some() {
        return Err(Error::file(
            path,
            format!(
                "a {} config{} is not a Llama: use models::decoder (FsdpDecoder, \
                 hf::decoder::build_from_hf)",
                cfg.table().architecture,
                if cfg.sliding_window.is_some() {
                    " with a sliding_window"
                } else {
                    ""
                }
            ),
        ));
    }
    LlamaConfig::try_from(&cfg).map_err(|e| Error::file(path, e.to_string()))
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

/// Reads `dir/config.json` as a Llama ([`config_from_json`]).
///
/// Errors: the file missing or unreadable (named); as [`config_from_json`].
pub fn read_config(dir: &Path) -> Result<LlamaConfig> {
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    config_from_json(&text, &path)
}

/// The parameters a Llama of shape `cfg` has, under Hugging Face's names, each with its shape,
/// in model order ([`DecoderConfig::parameter_shapes`]).
///
/// Errors: an invalid shape ([`LlamaConfig::validate`]).
pub fn parameter_shapes(cfg: &LlamaConfig) -> Result<Vec<(String, Vec<usize>)>> {
    DecoderConfig::from(*cfg).parameter_shapes()
}
