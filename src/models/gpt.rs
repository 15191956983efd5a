//! The GPT example's model: a GPT-2 (Radford et al. 2019) built from scratch, which is the
//! GPT-2 family of the one decoder ([`crate::models::decoder`]; cargo feature `gpt`, which
//! turns on the decoder's `llama`).
//!
//! ```text
//! ids (B, T) u32 ─▶ transformer.wte: token embedding (V, d) ──┐
//! positions (T,) ─▶ transformer.wpe: position embedding (T_max, d) ─▶ + ─▶ h (B, T, d)
//! h ─▶ transformer.h.0 … transformer.h.{L-1}: pre-norm blocks
//!        h = h + attn(ln_1(h))     causal multi-head self-attention, n_head heads
//!        h = h + mlp(ln_2(h))      Conv1D(d, 4d) → GELU (tanh) → Conv1D(4d, d)
//! h ─▶ transformer.ln_f: final LayerNorm ─▶ lm_head: (V, d), no bias ─▶ logits (B, T, V)
//! ```
//!
//! [`GptConfig`] is the shape a from-scratch run chooses (the example's flags); it converts
//! into the decoder's config ([`DecoderConfig`], family GPT-2), so the model, its units, its
//! fused block node and its names are the decoder's: Hugging Face's GPT-2 names and layouts
//! (`transformer.h.{i}.attn.c_attn.weight` `(d, 3d)`, …), and a checkpoint of the example
//! exports with `fsdp-ckpt export --format hf` to a directory transformers'
//! `GPT2LMHeadModel` loads. [`FsdpGpt`] is [`crate::models::decoder::FsdpDecoder`] and [`Gpt`] the plain-Candle
//! [`crate::models::decoder::Decoder`] (the tests' single-process reference).
//!
//! **Units**: `transformer.wte` (with a tied head, [`GptConfig::tied`], the GPT-2 default, a
//! group of the embedding and the head `lm_head`: one FlatParameter for both uses, as FSDP2's
//! `fully_shard([emb, head])`), `transformer.wpe`, each block `transformer.h.{i}`,
//! `transformer.ln_f` and, untied, `lm_head`: [`GptConfig::n_layer`] + 3 FlatParameters tied,
//! + 4 untied.
//!
//! Initialisation as GPT-2: every weight matrix and embedding N(0, 0.02), the two residual
//! projections of each block (`c_proj`) N(0, 0.02/√(2L)), biases 0, norms 1 and 0.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use candle_fsdp::launch::{launch, Launcher};
//! use candle_fsdp::models::gpt::{lm_loss, FsdpGpt, GptConfig};
//! use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, FsdpModel, ShardedOptimizer};
//!
//! let cfg = GptConfig { n_layer: 1, n_head: 2, d_model: 16, seq_len: 8, ..GptConfig::default() };
//! launch(&Launcher::threads(2), |pg| {
//!     let gpt = FsdpGpt::new(cfg)?;
//!     let mut model = gpt.add_units(FsdpModel::builder(pg, FsdpConfig::default())).build()?;
//!     let mut opt = AdamW::new(AdamWConfig::default());
//!     let ids = Tensor::new(&[[1u32, 2, 3, 4, 5, 6, 7, 8]], &Device::Cpu)?; // (B, T)
//!     let targets = Tensor::new(&[[2u32, 3, 4, 5, 6, 7, 8, 9]], &Device::Cpu)?;
//!     let logits = gpt.logits(&mut model, &ids, true)?; // (1, 8, 256)
//!     model.backward(&lm_loss(&logits, &targets)?)?;
//!     opt.step(&mut model)?;
//!     Ok(())
//! })?;
//! # Ok::<(), candle_fsdp::Error>(())
//! ```

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::models::decoder::family::Gpt2Shape;
pub use crate::models::decoder::{lm_loss, Block};
use crate::models::decoder::{Activation, DecoderConfig};
pub use crate::models::decoder::{Decoder as Gpt, FsdpDecoder as FsdpGpt};
pub use crate::nn::gelu;

/// The shape of a GPT.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GptConfig {
    /// Vocabulary size `V` (256 for bytes).
    pub vocab_size: usize,
    /// Number of transformer blocks `L`.
    pub n_layer: usize,
    /// Attention heads per block (must divide `d_model`).
    pub n_head: usize,
    /// Model width `d`.
    pub d_model: usize,
    /// Longest context `T_max`: rows of the position table.
    pub seq_len: usize,
    /// The LM head multiplies by the token embedding's weight (GPT-2) instead of its own.
    pub tied: bool,
    /// Epsilon of every LayerNorm.
    pub layer_norm_eps: f64,
}

impl Default for GptConfig {
    /// The example's default: bytes, 4 layers, d 128, 4 heads, context 64, tied.
    fn default() -> Self {
        Self {
            vocab_size: 256,
            n_layer: 4,
            n_head: 4,
            d_model: 128,
            seq_len: 64,
            tied: true,
            layer_norm_eps: 1e-5,
        }
    }
}

impl GptConfig {
    /// The benchmark configuration: bytes, 6 layers, d 512, 8 heads, context 256, untied
    /// (19.3 M parameters).
    pub fn benchmark() -> Self {
        Self {
            n_layer: 6,
            n_head: 8,
            d_model: 512,
            seq_len: 256,
            tied: false,
            ..Self::default()
        }
    }

    /// Width of one attention head, `d_model / n_head`.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_head.max(1)
    }

    /// Checks the shape.
    ///
    /// Errors ([`Error::Value`], [`Error::Conflict`], naming the values): a zero size; `n_head` not
    /// dividing `d_model`; an epsilon that is not a positive finite number.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("d_model", self.d_model),
            ("seq_len", self.seq_len),
        ] {
            if v == 0 {
                return Err(Error::value(format!("GPT {name}"), "at least 1", 0));
            }
        }
        if !self.d_model.is_multiple_of(self.n_head) {
            return Err(Error::conflict(
                format!("GPT n_head {}", self.n_head),
                format!("d_model {}", self.d_model),
                "n_head must divide d_model",
            ));
        }
        if !(self.layer_norm_eps.is_finite() && self.layer_norm_eps > 0.0) {
            return Err(Error::value(
                "GPT layer_norm_eps",
                "a positive finite number",
                self.layer_norm_eps,
            ));
        }
        Ok(())
    }

    /// Number of parameters (the tied head counts once).
    pub fn num_params(&self) -> usize {
        let (v, d, t) = (self.vocab_size, self.d_model, self.seq_len);
        let block = 2 * 2 * d // ln1, ln2
            + (d * 3 * d + 3 * d) // qkv
            + (d * d + d) // attention projection
            + (d * 4 * d + 4 * d) // mlp fc
            + (4 * d * d + d); // mlp projection
        let head = if self.tied { 0 } else { v * d };
        v * d + t * d + self.n_layer * block + 2 * d + head
    }
}

impl GptConfig {
    /// The `config.json` of this GPT as Hugging Face's `GPT2LMHeadModel` with weights of
    /// `dtype` (`"float32"`, `"bfloat16"`, `"float16"`): the `GPT2Config` keys the decoder
    /// reads ([`crate::models::decoder::family::config_from_json`] gives this config back),
    /// GELU (tanh) as `gelu_new`, the dropouts 0 (the model trained without them) and no `bos_token_id` / `eos_token_id`
    /// (bytes have none; GPT2Config's default 50256 lies outside the vocabulary). Stored
    /// in the GPT example's checkpoints, so that `fsdp-ckpt export --format hf` publishes them.
    pub fn hf_config(&self, dtype: &str) -> serde_json::Value {
        serde_json::json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": self.vocab_size,
            "n_embd": self.d_model,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_inner": 4 * self.d_model,
            "n_positions": self.seq_len,
            "n_ctx": self.seq_len,
            "layer_norm_epsilon": self.layer_norm_eps,
            "activation_function": "gelu_new",
            "tie_word_embeddings": self.tied,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            // No special tokens in a byte vocabulary (GPT2Config's default 50256 lies outside
            // it: transformers would warn and `generate` would stop on it).
            "bos_token_id": null,
            "eos_token_id": null,
            "torch_dtype": dtype,
            "dtype": dtype,
        })
    }
}

impl From<GptConfig> for DecoderConfig {
    /// The GPT-2 family's decoder of this shape ([`Gpt2Shape::config`]): MLP width `4·d`,
    /// GELU (tanh), learned positions of `seq_len` rows.
    fn from(c: GptConfig) -> Self {
        Gpt2Shape {
            vocab_size: c.vocab_size,
            n_embd: c.d_model,
            n_inner: 4 * c.d_model,
            n_layer: c.n_layer,
            n_head: c.n_head,
            n_positions: c.seq_len,
            layer_norm_epsilon: c.layer_norm_eps,
            tied: c.tied,
            activation: Activation::GeluTanh,
        }
        .config()
    }
}
