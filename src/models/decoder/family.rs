//! The model families as data: each [`Family`]'s table ([`FamilyTable`]: architecture, tensor
//! names, fused layouts, norms) and the reading of its Hugging Face `config.json` into a
//! [`DecoderConfig`] ([`config_from_json`]), with transformers 5.25's defaults and derived
//! values (`layer_types`, Gemma 2's soft-caps, Qwen's sliding-window switch).

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::{Activation, DecoderConfig, LayerType, Llama3RopeScaling};
use crate::error::{Error, Result};

/// A model family the decoder implements (serialised as transformers' `model_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// `LlamaForCausalLM` (Llama 2, 3, 3.1, 3.2; TinyLlama; SmolLM2).
    Llama,
    /// `MistralForCausalLM`: a Llama with a sliding window.
    Mistral,
    /// `Qwen2ForCausalLM` (Qwen2, Qwen2.5): biases on q, k, v.
    Qwen2,
    /// `Qwen3ForCausalLM`: per-head q/k RMSNorm, explicit `head_dim`.
    Qwen3,
    /// `Phi3ForCausalLM`: fused `qkv_proj` and `gate_up_proj`.
    Phi3,
    /// `Gemma2ForCausalLM`: `(1 + w)` norms around both sublayers, `√d` embeddings, GeGLU,
    /// soft-capping, alternating sliding and global layers.
    Gemma2,
    /// `GPT2LMHeadModel`: LayerNorm, learned positions, `Conv1D` weights `(in, out)`, fused
    /// `c_attn`.
    Gpt2,
}

/// How a family's block is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockStyle {
    /// RMSNorm, rotary embeddings, grouped-query attention, gated MLP (`layers.rs`'s
    /// [`super::Block`] Llama form).
    Llama,
    /// LayerNorm with bias, learned positions, `Conv1D` projections with biases, fused
    /// `c_attn`, `c_fc → GELU → c_proj` MLP.
    Gpt2,
}

/// Unit and parameter-prefix names of a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Names {
    /// The token embedding (and, tied, the group of it and the head).
    pub embed: &'static str,
    /// Learned positions (GPT-2's `transformer.wpe`); `None`: rotary embeddings.
    pub positions: Option<&'static str>,
    /// Prefix of the blocks: block `i` is `{layers}.{i}`.
    pub layers: &'static str,
    /// The final norm.
    pub norm: &'static str,
    /// The LM head.
    pub head: &'static str,
    /// The base model's prefix, which some published files leave out (GPT-2's `wte.weight` for
    /// `transformer.wte.weight`): transformers' `base_model_prefix` plus a dot.
    pub base_prefix: &'static str,
}

impl Names {
    /// Unit name (and parameter prefix) of block `i`.
    pub fn layer(&self, i: usize) -> String {
        format!("{}.{i}", self.layers)
    }
}

/// Names of the Llama-style families (transformers' `LlamaModel` layout).
const LLAMA_NAMES: Names = Names {
    embed: "model.embed_tokens",
    positions: None,
    layers: "model.layers",
    norm: "model.norm",
    head: "lm_head",
    base_prefix: "model.",
};

/// A family as data.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FamilyTable {
    /// The family.
    pub family: Family,
    /// The `architectures` entry of its `config.json`.
    pub architecture: &'static str,
    /// Its `model_type`.
    pub model_type: &'static str,
    /// Unit and tensor names.
    pub names: Names,
    /// How the block is built.
    pub style: BlockStyle,
    /// Queries, keys and values are one `self_attn.qkv_proj` `((h + 2·kv)·hd, d)`, split in
    /// that order after the matmul (Phi-3); else `q_proj`, `k_proj`, `v_proj`.
    pub fused_qkv: bool,
    /// Gate and up projections are one `mlp.gate_up_proj` `(2·I, d)`, gate rows first
    /// (Phi-3); else `gate_proj`, `up_proj`.
    pub fused_gate_up: bool,
    /// RMSNorm scales by `1 + w` (weights stored as offsets from 1, initialised 0: Gemma).
    pub norm_offset: bool,
    /// The embedding is multiplied by `√d` rounded to the activations' dtype (Gemma).
    pub embed_scale: bool,
    /// Norms after the attention and the MLP too (`post_attention_layernorm` on the attention's
    /// output, `pre_feedforward_layernorm` / `post_feedforward_layernorm` around the MLP:
    /// Gemma 2); else `post_attention_layernorm` is the MLP's input norm.
    pub sandwich_norms: bool,
    /// Default of `head_dim` when `config.json` has none; `None`: `hidden_size / heads`.
    pub default_head_dim: Option<usize>,
    /// Default of `tie_word_embeddings` (transformers' config class default).
    pub default_tied: bool,
}

const fn llama_like(
    family: Family,
    architecture: &'static str,
    model_type: &'static str,
) -> FamilyTable {
    FamilyTable {
        family,
        architecture,
        model_type,
        names: LLAMA_NAMES,
        style: BlockStyle::Llama,
        fused_qkv: false,
        fused_gate_up: false,
        norm_offset: false,
        embed_scale: false,
        sandwich_norms: false,
        default_head_dim: None,
        default_tied: false,
    }
}

/// Every family's table, in [`Family`] order.
pub const FAMILIES: [FamilyTable; 7] = [
    llama_like(Family::Llama, "LlamaForCausalLM", "llama"),
    llama_like(Family::Mistral, "MistralForCausalLM", "mistral"),
    llama_like(Family::Qwen2, "Qwen2ForCausalLM", "qwen2"),
    FamilyTable {
        default_head_dim: Some(128),
        ..llama_like(Family::Qwen3, "Qwen3ForCausalLM", "qwen3")
    },
    FamilyTable {
        fused_qkv: true,
        fused_gate_up: true,
        ..llama_like(Family::Phi3, "Phi3ForCausalLM", "phi3")
    },
    FamilyTable {
        norm_offset: true,
        embed_scale: true,
        sandwich_norms: true,
        default_head_dim: Some(256),
        default_tied: true,
        ..llama_like(Family::Gemma2, "Gemma2ForCausalLM", "gemma2")
    },
    FamilyTable {
        family: Family::Gpt2,
        architecture: "GPT2LMHeadModel",
        model_type: "gpt2",
        names: Names {
            embed: "transformer.wte",
            positions: Some("transformer.wpe"),
            layers: "transformer.h",
            norm: "transformer.ln_f",
            head: "lm_head",
            base_prefix: "transformer.",
        },
        style: BlockStyle::Gpt2,
        fused_qkv: true,
        fused_gate_up: false,
        norm_offset: false,
        embed_scale: false,
        sandwich_norms: false,
        default_head_dim: None,
        default_tied: true,
    },
];

impl Family {
    /// The family's table.
    pub fn table(self) -> &'static FamilyTable {
        FAMILIES
            .iter()
            .find(|t| t.family == self)
            .expect("every family has a table")
    }

    /// The family of a `config.json`'s `architectures` entry.
    pub fn of_architecture(arch: &str) -> Option<Family> {
        FAMILIES
            .iter()
            .find(|t| t.architecture == arch)
            .map(|t| t.family)
    }
}

/// The supported `architectures` entries.
pub fn architectures() -> Vec<&'static str> {
    FAMILIES.iter().map(|t| t.architecture).collect()
}

/// Reads a Hugging Face `config.json` (given as text; `path` names it in errors) of any
/// family of [`FAMILIES`], with transformers 5.25's defaults.
///
/// Read (Llama-style families): `vocab_size`, `hidden_size`, `intermediate_size`,
/// `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads` (default: the heads),
/// `head_dim` (default [`FamilyTable::default_head_dim`] or `hidden_size / heads`),
/// `max_position_embeddings` (default 2048), `rms_norm_eps` (default 1e-6), `rope_theta` or
/// transformers 5's `rope_parameters.rope_theta` (default 10000), Llama 3's rotary scaling,
/// `tie_word_embeddings`, `attention_bias` (q, k, v and o; Qwen2: q, k, v always, o never),
/// `mlp_bias`, `hidden_act` / Gemma's `hidden_activation`, `sliding_window` with Qwen's
/// `use_sliding_window` and `max_window_layers`, `layer_types` (derived as transformers
/// derives it when absent: Mistral and Phi-3 every layer sliding when a window is set, Qwen
/// layers from `max_window_layers` on, Gemma 2 even layers), Gemma 2's
/// `attn_logit_softcapping` (default 50), `final_logit_softcapping` (default 30) and
/// `query_pre_attn_scalar` (default 256). GPT-2: `n_embd`, `n_layer`, `n_head`, `n_positions`,
/// `n_inner` (default `4·n_embd`), `layer_norm_epsilon` (default 1e-5), `activation_function`.
/// Other keys (token ids, dtypes, dropouts of GPT-2, `initializer_range`, `use_cache`, …) do
/// not change the computation and are ignored.
///
/// Errors ([`Error::File`] naming `path` and the key): not JSON; an architecture not in
/// [`FAMILIES`] (the supported ones listed); a missing or mistyped required key; keys it
/// cannot honour: an activation other than SiLU (GELU-tanh for Gemma 2 and GPT-2), a rotary
/// type other than the default or `"llama3"`, Phi-3's `partial_rotary_factor` ≠ 1 or
/// `rope_scaling` (LongRoPE), a non-zero `attention_dropout`, GPT-2's
/// `scale_attn_by_inverse_layer_idx`, `add_cross_attention` or `scale_attn_weights: false`,
/// a `layer_types` entry other than `full_attention` / `sliding_attention`; an invalid shape
/// ([`DecoderConfig::validate`]).
pub fn config_from_json(text: &str, path: &Path) -> Result<DecoderConfig> {
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
    let Some(family) = archs.iter().find_map(|a| Family::of_architecture(a)) else {
        return Err(bad(format!(
            "unsupported architecture {archs:?} (key `architectures`): supported are {:?}",
            architectures()
        )));
    };
    let keys = Keys { o, path };
    let cfg = match family.table().style {
        BlockStyle::Gpt2 => gpt2_config(&keys)?,
        BlockStyle::Llama => llama_style_config(family, &keys)?,
    };
    cfg.validate()
        .map_err(|e| bad(e.argument_text().unwrap_or_else(|| e.to_string())))?;
    Ok(cfg)
}

/// Typed reads of a `config.json` object, errors naming the file and key.
struct Keys<'a> {
    o: &'a Map<String, Value>,
    path: &'a Path,
}

impl Keys<'_> {
    fn bad(&self, msg: String) -> Error {
        Error::file(self.path, msg)
    }

    /// The value of `k`, `None` when absent or null.
    fn get(&self, k: &str) -> Option<&Value> {
        self.o.get(k).filter(|v| !v.is_null())
    }

    fn usize(&self, k: &str, default: Option<usize>) -> Result<usize> {
        match self.get(k) {
            None => default.ok_or_else(|| self.bad(format!("key `{k}` is missing"))),
            Some(x) => x.as_u64().map(|n| n as usize).ok_or_else(|| {
                self.bad(format!(
                    "key `{k}`: expected a non-negative integer, found {x}"
                ))
            }),
        }
    }

    /// An integer that may be absent or null (`None`).
    fn opt_usize(&self, k: &str) -> Result<Option<usize>> {
        self.get(k).map(|_| self.usize(k, None)).transpose()
    }

    fn f64_in(&self, obj: &Map<String, Value>, k: &str, default: f64) -> Result<f64> {
        match obj.get(k).filter(|v| !v.is_null()) {
            None => Ok(default),
            Some(x) => x
                .as_f64()
                .ok_or_else(|| self.bad(format!("key `{k}`: expected a number, found {x}"))),
        }
    }

    fn f64(&self, k: &str, default: f64) -> Result<f64> {
        self.f64_in(self.o, k, default)
    }

    /// A number that may be explicitly null (off): absent gives `default`.
    fn opt_f64(&self, k: &str, default: Option<f64>) -> Result<Option<f64>> {
        match self.o.get(k) {
            None => Ok(default),
            Some(Value::Null) => Ok(None),
            Some(x) => x.as_f64().map(Some).ok_or_else(|| {
                self.bad(format!("key `{k}`: expected a number or null, found {x}"))
            }),
        }
    }

    fn bool(&self, k: &str, default: bool) -> Result<bool> {
        match self.get(k) {
            None => Ok(default),
            Some(x) => x
                .as_bool()
                .ok_or_else(|| self.bad(format!("key `{k}`: expected true or false, found {x}"))),
        }
    }

    fn str(&self, k: &str) -> Option<&str> {
        self.get(k).and_then(Value::as_str)
    }
}

/// The activation of key `k` (`value`), or the error naming what is supported.
fn activation(keys: &Keys<'_>, k: &str, value: &str, family: Family) -> Result<Activation> {
    match value {
        "silu" | "swish" if family != Family::Gpt2 => Ok(Activation::Silu),
        "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Ok(Activation::GeluTanh),
        _ => Err(keys.bad(format!(
            "key `{k}` is {value:?}: supported are \"silu\" (SwiGLU) and the tanh GELU \
             (\"gelu_pytorch_tanh\", \"gelu_new\")"
        ))),
    }
}

/// `rope_theta` and Llama 3's scaling from `rope_theta`, `rope_scaling` and transformers 5's
/// `rope_parameters`.
fn rope(keys: &Keys<'_>) -> Result<(f64, Option<Llama3RopeScaling>)> {
    let mut rope_theta = keys.f64("rope_theta", 10000.0)?;
    let mut scaling = None;
    for key in ["rope_scaling", "rope_parameters"] {
        match keys.get(key) {
            None => {}
            Some(Value::Object(p)) => {
                // transformers 4 wrote `type`, 5 writes `rope_type`: the error names the one
                // the file has.
                let type_key = if p.contains_key("rope_type") {
                    "rope_type"
                } else {
                    "type"
                };
                let kind = p.get(type_key).and_then(Value::as_str).unwrap_or("default");
                match kind {
                    "default" => {}
                    "llama3" => {
                        let number = |k: &str| -> Result<f64> {
                            p.get(k).and_then(Value::as_f64).ok_or_else(|| {
                                keys.bad(format!(
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
                                keys.bad(format!(
                                    "key `{key}.original_max_position_embeddings`: a \
                                     non-negative integer is needed for rope_type \"llama3\""
                                ))
                            })?;
                        scaling = Some(Llama3RopeScaling {
                            factor,
                            low_freq_factor,
                            high_freq_factor,
                            original_max_position_embeddings: original as usize,
                        });
                    }
                    _ => {
                        return Err(keys.bad(format!(
                            "key `{key}.{type_key}` is {kind:?}: supported are the default rotary \
                             embedding and \"llama3\""
                        )))
                    }
                }
                rope_theta = keys.f64_in(p, "rope_theta", rope_theta)?;
                let partial = keys.f64_in(p, "partial_rotary_factor", 1.0)?;
                if partial != 1.0 {
                    return Err(keys.bad(format!(
                        "key `{key}.partial_rotary_factor` is {partial}: only 1.0 (the whole \
                         head rotated) is supported"
                    )));
                }
            }
            Some(x) => return Err(keys.bad(format!("key `{key}`: expected an object, found {x}"))),
        }
    }
    Ok((rope_theta, scaling))
}

/// `layer_types` from the key when present, else `derive(i)` for each layer.
fn layer_types(
    keys: &Keys<'_>,
    layers: usize,
    derive: impl Fn(usize) -> LayerType,
) -> Result<Vec<LayerType>> {
    match keys.get("layer_types") {
        None => Ok((0..layers).map(derive).collect()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| match t.as_str() {
                Some("full_attention") => Ok(LayerType::FullAttention),
                Some("sliding_attention") => Ok(LayerType::SlidingAttention),
                _ => Err(keys.bad(format!(
                    "key `layer_types`: entry {t} is not \"full_attention\" or \
                     \"sliding_attention\""
                ))),
            })
            .collect(),
        Some(x) => Err(keys.bad(format!("key `layer_types`: expected a list, found {x}"))),
    }
}

/// A Llama-style family's config.
fn llama_style_config(family: Family, keys: &Keys<'_>) -> Result<DecoderConfig> {
    let table = family.table();
    let act_key = if family == Family::Gemma2 && keys.get("hidden_activation").is_some() {
        "hidden_activation"
    } else {
        "hidden_act"
    };
    let default_act = if family == Family::Gemma2 {
        "gelu_pytorch_tanh"
    } else {
        "silu"
    };
    let act = activation(
        keys,
        act_key,
        keys.str(act_key).unwrap_or(default_act),
        family,
    )?;
    if family != Family::Gemma2 && act != Activation::Silu {
        return Err(keys.bad(format!(
            "key `{act_key}` is {:?}: {} uses \"silu\" (SwiGLU) only",
            keys.str(act_key).unwrap_or_default(),
            table.architecture
        )));
    }
    let dropout = keys.f64("attention_dropout", 0.0)?;
    if dropout != 0.0 {
        return Err(keys.bad(format!(
            "key `attention_dropout` is {dropout}: attention dropout is not supported (0 only)"
        )));
    }
    if family == Family::Gemma2 && keys.bool("use_bidirectional_attention", false)? {
        return Err(keys.bad(
            "key `use_bidirectional_attention` is true: only causal attention is supported".into(),
        ));
    }
    if family == Family::Phi3 {
        let partial = keys.f64("partial_rotary_factor", 1.0)?;
        if partial != 1.0 {
            return Err(keys.bad(format!(
                "key `partial_rotary_factor` is {partial}: only 1.0 (the whole head rotated) \
                 is supported"
            )));
        }
        if let Some(s) = keys.get("rope_scaling") {
            return Err(keys.bad(format!(
                "key `rope_scaling` is {s}: Phi-3's LongRoPE / SuScaled rotary scaling is not \
                 supported (the 4k-context models have none)"
            )));
        }
    }
    let (rope_theta, rope_scaling) = rope(keys)?;
    let hidden_size = keys.usize("hidden_size", None)?;
    let heads = keys.usize("num_attention_heads", None)?;
    let layers = keys.usize("num_hidden_layers", None)?;
    let head_dim = keys.usize(
        "head_dim",
        Some(table.default_head_dim.unwrap_or(hidden_size / heads.max(1))),
    )?;
    let attention_bias = keys.bool("attention_bias", false)?;
    let (qkv_bias, o_bias) = match family {
        Family::Qwen2 => (true, false),
        Family::Mistral | Family::Phi3 => (false, false),
        _ => (attention_bias, attention_bias),
    };
    let mlp_bias = match family {
        Family::Llama => keys.bool("mlp_bias", false)?,
        _ => false,
    };
    // Where transformers 5.25 reads a window, and which layers it slides in.
    let window = match family {
        Family::Llama => None,
        Family::Mistral | Family::Phi3 => keys.opt_usize("sliding_window")?,
        Family::Qwen2 | Family::Qwen3 if keys.bool("use_sliding_window", false)? => {
            keys.opt_usize("sliding_window")?
        }
        Family::Qwen2 | Family::Qwen3 => None,
        Family::Gemma2 => Some(keys.usize("sliding_window", Some(4096))?),
        Family::Gpt2 => unreachable!("GPT-2 is read by gpt2_config"),
    };
    let max_window_layers = keys.usize("max_window_layers", Some(layers))?;
    let derive = |i: usize| {
        let sliding = match family {
            Family::Llama => false,
            Family::Mistral | Family::Phi3 => window.is_some(),
            Family::Qwen2 | Family::Qwen3 => window.is_some() && i >= max_window_layers,
            Family::Gemma2 => i.is_multiple_of(2),
            Family::Gpt2 => false,
        };
        if sliding {
            LayerType::SlidingAttention
        } else {
            LayerType::FullAttention
        }
    };
    let mut layer_types = layer_types(keys, layers, derive)?;
    if window.is_none() && family != Family::Gemma2 {
        // transformers' masks slide only with a window (Qwen's `use_sliding_window: false`
        // turns a stored `layer_types` into full attention everywhere).
        layer_types.fill(LayerType::FullAttention);
    }
    let gemma = family == Family::Gemma2;
    Ok(DecoderConfig {
        family,
        vocab_size: keys.usize("vocab_size", None)?,
        hidden_size,
        intermediate_size: keys.usize("intermediate_size", None)?,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: keys.usize("num_key_value_heads", Some(heads))?,
        head_dim,
        max_position_embeddings: keys.usize("max_position_embeddings", Some(2048))?,
        norm_eps: keys.f64("rms_norm_eps", 1e-6)?,
        rope_theta,
        rope_scaling,
        tie_word_embeddings: keys.bool("tie_word_embeddings", table.default_tied)?,
        qkv_bias,
        o_bias,
        mlp_bias,
        qk_norm: family == Family::Qwen3,
        activation: act,
        sliding_window: window,
        layer_types,
        attn_logit_softcapping: if gemma {
            keys.opt_f64("attn_logit_softcapping", Some(50.0))?
        } else {
            None
        },
        final_logit_softcapping: if gemma {
            keys.opt_f64("final_logit_softcapping", Some(30.0))?
        } else {
            None
        },
        query_pre_attn_scalar: if gemma {
            Some(keys.f64("query_pre_attn_scalar", 256.0)?)
        } else {
            None
        },
        pad_token_id: pad_token_id(keys)?,
    })
}

/// `pad_token_id` as the embedding's `padding_idx` (a negative one counts from the end, as
/// PyTorch's `nn.Embedding` takes it).
fn pad_token_id(keys: &Keys<'_>) -> Result<Option<u32>> {
    let Some(v) = keys.get("pad_token_id") else {
        return Ok(None);
    };
    let vocab = keys.usize("vocab_size", None)? as i64;
    let p = v.as_i64().ok_or_else(|| {
        keys.bad(format!(
            "key `pad_token_id`: expected an integer, found {v}"
        ))
    })?;
    let row = if p < 0 { vocab + p } else { p };
    if row < 0 || row >= vocab {
        return Err(keys.bad(format!(
            "key `pad_token_id` is {p}: outside the vocabulary of {vocab} (transformers' \
             embedding refuses it too)"
        )));
    }
    Ok(Some(row as u32))
}

/// GPT-2's config (`GPT2Config` keys).
fn gpt2_config(keys: &Keys<'_>) -> Result<DecoderConfig> {
    for (k, want) in [
        ("scale_attn_weights", true),
        ("scale_attn_by_inverse_layer_idx", false),
        ("add_cross_attention", false),
    ] {
        if keys.bool(k, want)? != want {
            return Err(keys.bad(format!("key `{k}` is {}: only {want} is supported", !want)));
        }
    }
    let act = keys.str("activation_function").unwrap_or("gelu_new");
    let activation = activation(keys, "activation_function", act, Family::Gpt2)?;
    let d = keys.usize("n_embd", None)?;
    let heads = keys.usize("n_head", None)?;
    let layers = keys.usize("n_layer", None)?;
    Ok(Gpt2Shape {
        vocab_size: keys.usize("vocab_size", Some(50257))?,
        n_embd: d,
        n_inner: keys.usize("n_inner", Some(4 * d))?,
        n_layer: layers,
        n_head: heads,
        n_positions: keys.usize("n_positions", Some(1024))?,
        layer_norm_epsilon: keys.f64("layer_norm_epsilon", 1e-5)?,
        tied: keys.bool("tie_word_embeddings", true)?,
        activation,
    }
    .config())
}

/// The keys of a GPT-2 (`GPT2Config`'s names) that vary; everything else of the family is fixed:
/// [`Gpt2Shape::config`]. Shared by a `config.json` and a from-scratch run
/// ([`crate::models::gpt::GptConfig`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gpt2Shape {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width `d`.
    pub n_embd: usize,
    /// MLP width (GPT-2: `4·d`).
    pub n_inner: usize,
    /// Blocks.
    pub n_layer: usize,
    /// Attention heads (multi-head: as many key/value heads).
    pub n_head: usize,
    /// Rows of the learned position table.
    pub n_positions: usize,
    /// Epsilon of every LayerNorm.
    pub layer_norm_epsilon: f64,
    /// The head multiplies by the token embedding.
    pub tied: bool,
    /// The MLP's nonlinearity (GPT-2: GELU, tanh approximation).
    pub activation: Activation,
}

impl Gpt2Shape {
    /// The decoder config: biases everywhere, learned positions, multi-head attention,
    /// `head_dim = d / heads`, no window, no soft-caps, no padding row.
    pub fn config(&self) -> DecoderConfig {
        DecoderConfig {
            family: Family::Gpt2,
            vocab_size: self.vocab_size,
            hidden_size: self.n_embd,
            intermediate_size: self.n_inner,
            num_hidden_layers: self.n_layer,
            num_attention_heads: self.n_head,
            num_key_value_heads: self.n_head,
            head_dim: self.n_embd / self.n_head.max(1),
            max_position_embeddings: self.n_positions,
            norm_eps: self.layer_norm_epsilon,
            rope_theta: 10000.0,
            rope_scaling: None,
            tie_word_embeddings: self.tied,
            qkv_bias: true,
            o_bias: true,
            mlp_bias: true,
            qk_norm: false,
            activation: self.activation,
            sliding_window: None,
            layer_types: vec![LayerType::FullAttention; self.n_layer],
            attn_logit_softcapping: None,
            final_logit_softcapping: None,
            query_pre_attn_scalar: None,
            // GPT2Model's `wte` has no padding_idx.
            pad_token_id: None,
        }
    }
}

/// Dropout probabilities of a GPT-2 `config.json` that are not zero (`resid_pdrop`,
/// `embd_pdrop`, `attn_pdrop`), which training here does not apply: one sentence for
/// [`crate::hf::decoder::HfDir::decisions`], `None` when all are zero.
pub(crate) fn gpt2_dropout_note(text: &str) -> Option<String> {
    let v: Value = serde_json::from_str(text).ok()?;
    let on: Vec<String> = [
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
        "summary_first_dropout",
    ]
    .iter()
    .filter_map(|k| {
        let p = v.get(*k)?.as_f64()?;
        (p != 0.0).then(|| format!("{k} {p}"))
    })
    .collect();
    (!on.is_empty()).then(|| {
        format!(
            "dropout is not applied ({}): training and evaluation run the model without it",
            on.join(", ")
        )
    })
}
