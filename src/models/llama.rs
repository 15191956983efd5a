//! A Llama-family decoder (Touvron et al. 2023, "LLaMA", arXiv:2302.13971; Hugging Face
//! `LlamaForCausalLM`) written with candle-nn and the differentiable kernels of [`crate::nn`],
//! as FSDP units (cargo feature `llama`).
//!
//! ```text
//! ids (B, T) u32 ─▶ model.embed_tokens: (V, d) ─▶ h (B, T, d)
//! h ─▶ model.layers.0 … model.layers.{L-1}: pre-norm blocks
//!        h = h + o_proj(attn(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))   n = rms(h)
//!        h = h + down_proj(silu(gate_proj(n)) ⊙ up_proj(n))                   n = rms(h)
//! h ─▶ model.norm: RMSNorm ─▶ lm_head: Linear(d, V) ─▶ logits (B, T, V)
//! ```
//!
//! - **Attention**: `n_head` query heads of width `head_dim`, `n_kv_head` key/value heads
//!   (grouped-query attention, Ainslie et al. 2023, arXiv:2305.13245: query head `h` reads
//!   key/value head `h / (n_head / n_kv_head)`, as transformers' `repeat_kv`), causal, scores
//!   scaled by `1/√head_dim`. Rotary position embeddings (Su et al. 2021, arXiv:2104.09864) in
//!   transformers' "rotate half" form: with `θ_i = rope_theta^(−2i/head_dim)`, `i <
//!   head_dim/2`, position `p`, `cos`/`sin` of `p·θ` repeated twice along the head,
//!   `x' = x·cos + rotate_half(x)·sin`, `rotate_half([a, b]) = [−b, a]`. The rotation is
//!   [`crate::nn::rope`] (one graph node); the attention itself is
//!   [`crate::nn::causal_attention_gqa`]'s fused kernel on the concatenated
//!   `(B, T, (n_head + 2·n_kv_head)·head_dim)` tensor, the key/value heads read in place.
//! - **MLP**: SwiGLU (Shazeer 2020, arXiv:2002.05202), `down(silu(gate(x)) ⊙ up(x))`, hidden
//!   width `intermediate_size`.
//! - **Norms**: RMSNorm ([`crate::nn::rms_norm`]), `x / √(mean(x²) + eps) · w`.
//! - No biases, unless `attention_bias` (q, k, v, o) or `mlp_bias` (gate, up, down).
//!
//! **Parameter names are Hugging Face's** (`model.embed_tokens.weight`,
//! `model.layers.{i}.self_attn.q_proj.weight`, …, `model.norm.weight`, `lm_head.weight`), so
//! a model directory loads by name ([`crate::hf::llama::build_from_hf`]) and a checkpoint exports to one with
//! no renaming (decision 50). **Units**: `model.embed_tokens`, each `model.layers.{i}`,
//! `model.norm` and `lm_head`; with tied embeddings (`tie_word_embeddings`) the head is a second
//! member of group `model.embed_tokens` and multiplies by `model.embed_tokens.weight` (one
//! FlatParameter, as GPT's tied head).
//!
//! Every parameter is f32 (the master copy) unless a mixed-precision policy gathers it in
//! another dtype; the rotary tables follow the activations' dtype.
//!
//! The model is the Llama family of the one decoder ([`crate::models::decoder`]): this module
//! keeps the Llama's own config type ([`LlamaConfig`], what a from-scratch run chooses), its
//! `config.json` writer ([`crate::hf::llama::config_to_json`]) and the names it has always had
//! ([`FsdpLlama`] is [`FsdpDecoder`]).

use candle_core::{Device, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
pub use crate::models::decoder::Llama3RopeScaling;
use crate::models::decoder::{self, Activation, DecoderConfig, Family, FsdpDecoder, LayerType};

/// The shape of a Llama: Hugging Face `LlamaConfig`'s fields under their names (see
/// [`crate::hf::llama::config_from_json`] for the keys read from a `config.json` and those refused).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlamaConfig {
    /// Vocabulary size `V`.
    pub vocab_size: usize,
    /// Model width `d`.
    pub hidden_size: usize,
    /// Hidden width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of blocks `L`.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (divides `num_attention_heads`; equal: multi-head attention).
    pub num_key_value_heads: usize,
    /// Width of one head (transformers' default `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// Longest context the model is used with (only checked: RoPE has no table to outgrow).
    pub max_position_embeddings: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f64,
    /// Base of the rotary frequencies.
    pub rope_theta: f64,
    /// Llama 3's scaling of the rotary frequencies (`rope_type: "llama3"`); `None`: the
    /// default rotary embedding.
    #[serde(default)]
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// The LM head multiplies by the token embedding's weight.
    pub tie_word_embeddings: bool,
    /// Biases on the q, k, v and o projections.
    pub attention_bias: bool,
    /// Biases on the gate, up and down projections.
    pub mlp_bias: bool,
}

impl Default for LlamaConfig {
    /// The example's from-scratch default: bytes (256), 4 layers, width 128, 4 query heads of
    /// 32, 2 key/value heads, MLP 352, context 256, untied.
    fn default() -> Self {
        Self {
            vocab_size: 256,
            hidden_size: 128,
            intermediate_size: 352,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 32,
            max_position_embeddings: 256,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            tie_word_embeddings: false,
            attention_bias: false,
            mlp_bias: false,
        }
    }
}

impl LlamaConfig {
    /// Checks the shape.
    ///
    /// Errors (those of [`DecoderConfig::validate`], e.g. [`crate::Error::Value`], naming the
    /// key): a zero size; `num_key_value_heads` not dividing `num_attention_heads`; an odd
    /// `head_dim`; an epsilon or `rope_theta` that is not a positive finite number.
    pub fn validate(&self) -> Result<()> {
        DecoderConfig::from(*self).validate()
    }

    /// Number of parameters (a tied head counts once).
    pub fn num_params(&self) -> usize {
        let (v, d, i) = (self.vocab_size, self.hidden_size, self.intermediate_size);
        let (q, kv) = (
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
        );
        let ab = usize::from(self.attention_bias);
        let mb = usize::from(self.mlp_bias);
        let block = 2 * d
            + d * q
            + 2 * d * kv
            + q * d
            + ab * (q + 2 * kv + d)
            + 3 * d * i
            + mb * (2 * i + d);
        let head = if self.tie_word_embeddings { 0 } else { v * d };
        v * d + self.num_hidden_layers * block + d + head
    }
}

impl From<LlamaConfig> for DecoderConfig {
    /// The Llama family's decoder of this shape (`attention_bias` on q, k, v and o).
    fn from(c: LlamaConfig) -> Self {
        DecoderConfig {
            family: Family::Llama,
            vocab_size: c.vocab_size,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            num_hidden_layers: c.num_hidden_layers,
            num_attention_heads: c.num_attention_heads,
            num_key_value_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            max_position_embeddings: c.max_position_embeddings,
            norm_eps: c.rms_norm_eps,
            rope_theta: c.rope_theta,
            rope_scaling: c.rope_scaling,
            tie_word_embeddings: c.tie_word_embeddings,
            qkv_bias: c.attention_bias,
            o_bias: c.attention_bias,
            mlp_bias: c.mlp_bias,
            qk_norm: false,
            activation: Activation::Silu,
            sliding_window: None,
            layer_types: vec![LayerType::FullAttention; c.num_hidden_layers],
            attn_logit_softcapping: None,
            final_logit_softcapping: None,
            query_pre_attn_scalar: None,
            pad_token_id: None,
        }
    }
}

impl TryFrom<&DecoderConfig> for LlamaConfig {
    type Error = Error;

    /// The Llama shape of a Llama-family decoder config.
    ///
    /// Errors: a family other than Llama and Mistral, or options a Llama does not have (a
    /// window, soft-caps, q/k norms, a bias on q, k, v but not o), naming them.
    fn try_from(c: &DecoderConfig) -> Result<Self> {
        // A Mistral without a window is a Llama.
        let plain = matches!(c.family, Family::Llama | Family::Mistral)
            && c.qkv_bias == c.o_bias
            && !c.qk_norm
            && c.activation == Activation::Silu
            && c.sliding_window.is_none()
            && c.attn_logit_softcapping.is_none()
            && c.final_logit_softcapping.is_none()
            && c.query_pre_attn_scalar.is_none();
        if !plain {
            return Err(Error::conflict(
                format!("a {} decoder", c.table().architecture),
                "a Llama",
                "it is not one (models::decoder builds it)",
            ));
        }
        Ok(LlamaConfig {
            vocab_size: c.vocab_size,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            num_hidden_layers: c.num_hidden_layers,
            num_attention_heads: c.num_attention_heads,
            num_key_value_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            max_position_embeddings: c.max_position_embeddings,
            rms_norm_eps: c.norm_eps,
            rope_theta: c.rope_theta,
            rope_scaling: c.rope_scaling,
            tie_word_embeddings: c.tie_word_embeddings,
            attention_bias: c.qkv_bias,
            mlp_bias: c.mlp_bias,
        })
    }
}

/// The token embedding `model.embed_tokens`: ids `(B, T)` u32 → `(B, T, d)`; parameter
/// `weight` `(V, d)`, N(0, 0.02) ([`decoder::token_embedding`]).
pub fn token_embedding(
    cfg: &LlamaConfig,
    vb: VarBuilder,
) -> candle_core::Result<decoder::Embedding> {
    decoder::token_embedding(&(*cfg).into(), vb)
}

/// The final norm `model.norm`: RMSNorm, parameter `weight` `(d,)`.
pub fn final_norm(cfg: &LlamaConfig, vb: VarBuilder) -> candle_core::Result<decoder::Norm> {
    decoder::final_norm(&(*cfg).into(), vb)
}

/// The LM head: `(B, T, d)` → logits `(B, T, V)`, no bias; parameter `weight` `(V, d)`.
pub fn lm_head(cfg: &LlamaConfig, vb: VarBuilder) -> candle_core::Result<decoder::Head> {
    decoder::lm_head(&(*cfg).into(), vb)
}

/// The rotary tables of positions `0..t` ([`decoder::rope_tables`]): `(cos, sin)`, each `(t,
/// head_dim)` f32.
pub fn rope_tables(
    cfg: &LlamaConfig,
    t: usize,
    device: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    decoder::rope_tables(&(*cfg).into(), t, device)
}

/// Unit name (and parameter prefix) of block `i`: `model.layers.{i}`.
pub fn block_name(i: usize) -> String {
    format!("model.layers.{i}")
}

/// Unit name of the token embedding (and, tied, of the group holding it and the head).
pub const EMBED: &str = "model.embed_tokens";
/// Unit name of the final norm.
pub const NORM: &str = "model.norm";
/// Unit name of the LM head.
pub const HEAD: &str = "lm_head";

/// The Llama as FSDP units: the decoder ([`FsdpDecoder`]) of a [`LlamaConfig`]
/// (`FsdpLlama::new(cfg)` converts it).
pub type FsdpLlama = FsdpDecoder;

pub use crate::models::decoder::lm_loss;
