//! One decoder-only transformer for every model family this crate trains from Hugging Face:
//! Llama, Mistral, Qwen2 / Qwen2.5, Qwen3, Phi-3, Gemma 2 and GPT-2 (cargo feature `llama`).
//! A family is data ([`family::FamilyTable`]: its architecture name, tensor names, the layout of
//! its fused tensors, its norms), not a model file; the wrapper around the units
//! ([`FsdpDecoder`]: `new`, activation checkpointing, `logits`) exists once.
//!
//! ```text
//! ids (B, T) u32 ─▶ embedding (V, d) [× √d: Gemma] [+ learned positions: GPT-2] ─▶ h (B, T, d)
//! h ─▶ block 0 … block L−1 (layers.rs)
//!        Llama style:  h = h + post?(attn(norm₁(h)));  h = h + post?(mlp(norm₂(h)))
//!        GPT-2 style:  h = h + attn(ln_1(h));           h = h + mlp(ln_2(h))
//! h ─▶ final norm ─▶ head (V, d), tied or not [c·tanh(·/c): Gemma 2] ─▶ logits (B, T, V)
//! ```
//!
//! Packed examples ([`FsdpDecoder::forward_at`], decision 77): position ids `(B, T)` restarting
//! at each example go to every block as a second input ([`Positions`]): rotary angles at the
//! ids, attention within each example ([`crate::nn::attention_packed`]); GPT-2's learned
//! positions are looked up at the ids.
//!
//! **Parameters keep Hugging Face's names and layouts** (decision 71): a family's fused tensors
//! (Phi-3's `qkv_proj` and `gate_up_proj`, GPT-2's `c_attn`) are single parameters the block
//! splits after its matmul, and GPT-2's `Conv1D` weights stay `(in, out)`. So a directory loads
//! by name (each rank reads the element ranges of its own shards, a fused tensor's rows
//! included), a checkpoint exports to the family's own layout with no renaming, and a fused
//! projection stays one matmul.
//!
//! **Units** (as the Llama's before): the embedding (with a tied head, a group of both), learned
//! positions (GPT-2), each block, the final norm, and, untied, the head. Unit names are the
//! parameter prefixes ([`family::Names`]): `model.embed_tokens`, `model.layers.{i}`,
//! `model.norm`, `lm_head`; GPT-2's `transformer.wte`, `transformer.wpe`, `transformer.h.{i}`,
//! `transformer.ln_f`, `lm_head`.
//!
//! Every parameter is f32 (the master copy) unless a mixed-precision policy gathers it in
//! another dtype.

pub mod family;
mod fused;
mod layers;

use candle_core::{Module, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::fsdp::{Forward, FsdpModel, FsdpModelBuilder, ModelSpec};
use crate::unit::UnitSpec;

pub use family::{BlockStyle, Family, FamilyTable, Names};
pub use layers::{
    final_norm, lm_head, positions, rope_tables, token_embedding, Attention, Block, Embedding,
    Head, Mlp, Norm, Positions,
};

/// Standard deviation of the initialisation of a model built from scratch (transformers'
/// `initializer_range` default).
pub(crate) const INIT_STD: f64 = 0.02;

/// Whether a layer attends over the whole causal context or a sliding window (transformers'
/// `layer_types` values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    /// Every earlier position (`"full_attention"`).
    FullAttention,
    /// The last [`DecoderConfig::sliding_window`] positions (`"sliding_attention"`).
    SlidingAttention,
}

/// The MLP's nonlinearity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// SiLU (`silu`): SwiGLU in a gated MLP (Shazeer 2020, arXiv:2002.05202).
    Silu,
    /// GELU, tanh approximation (`gelu_pytorch_tanh`, `gelu_new`): GeGLU in a gated MLP
    /// (Gemma), the plain MLP's nonlinearity in GPT-2.
    GeluTanh,
}

/// Llama 3's frequency-dependent rotary scaling (transformers' `rope_type: "llama3"`,
/// `_compute_llama3_parameters`; Meta's Llama 3.1 release): with `θ_i` the default
/// frequencies, wavelength `λ_i = 2π/θ_i`, `L` = `original_max_position_embeddings`, `lo` =
/// `low_freq_factor`, `hi` = `high_freq_factor`:
///
/// ```text
///     λ_i < L/hi            θ_i                        (high frequencies kept)
///     λ_i > L/lo            θ_i / factor               (low frequencies slowed)
///     otherwise             (1 − s)·θ_i/factor + s·θ_i,   s = (L/λ_i − lo) / (hi − lo)
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Llama3RopeScaling {
    /// How much the low frequencies are slowed (Llama 3.1: 8).
    pub factor: f64,
    /// Wavelengths above `L / low_freq_factor` are fully scaled (Llama 3.1: 1).
    pub low_freq_factor: f64,
    /// Wavelengths below `L / high_freq_factor` are kept (Llama 3.1: 4).
    pub high_freq_factor: f64,
    /// `L`: the context the model was first trained with (Llama 3.1: 8192).
    pub original_max_position_embeddings: usize,
}

impl Llama3RopeScaling {
    /// The scaled frequency of default frequency `inv` (radians per position).
    pub fn scale(&self, inv: f64) -> f64 {
        let l = self.original_max_position_embeddings as f64;
        let wavelen = 2.0 * std::f64::consts::PI / inv;
        if wavelen < l / self.high_freq_factor {
            inv
        } else if wavelen > l / self.low_freq_factor {
            inv / self.factor
        } else {
            let s = (l / wavelen - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor);
            (1.0 - s) * inv / self.factor + s * inv
        }
    }

    /// Checks the numbers, naming the key under `rope_scaling`.
    pub(crate) fn validate(&self, model: &str) -> Result<()> {
        for (name, v) in [
            ("factor", self.factor),
            ("low_freq_factor", self.low_freq_factor),
            ("high_freq_factor", self.high_freq_factor),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::value(
                    format!("{model} rope_scaling.{name}"),
                    "a positive finite number",
                    v,
                ));
            }
        }
        if self.low_freq_factor >= self.high_freq_factor {
            return Err(Error::value(
                format!("{model} rope_scaling.low_freq_factor"),
                format!("below high_freq_factor {}", self.high_freq_factor),
                self.low_freq_factor,
            ));
        }
        if self.original_max_position_embeddings == 0 {
            return Err(Error::value(
                format!("{model} rope_scaling.original_max_position_embeddings"),
                "at least 1",
                0,
            ));
        }
        Ok(())
    }
}

/// The shape of a decoder of any family: Hugging Face's config fields under their names where
/// the families agree (see [`family::config_from_json`] for the keys read from a `config.json`
/// and those refused).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecoderConfig {
    /// The family: names, fused layouts and norms ([`Family::table`]).
    pub family: Family,
    /// Vocabulary size `V`.
    pub vocab_size: usize,
    /// Model width `d`.
    pub hidden_size: usize,
    /// Hidden width of the MLP (GPT-2: `n_inner`, default `4·d`).
    pub intermediate_size: usize,
    /// Number of blocks `L`.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (divides `num_attention_heads`; equal: multi-head attention).
    pub num_key_value_heads: usize,
    /// Width of one head (transformers' default `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// Longest context: GPT-2's position table rows (`n_positions`); for rotary families the
    /// context the model was trained with (longer ones run, as in transformers).
    pub max_position_embeddings: usize,
    /// Epsilon of every norm (`rms_norm_eps`, GPT-2's `layer_norm_epsilon`).
    pub norm_eps: f64,
    /// Base of the rotary frequencies (unused by GPT-2's learned positions).
    pub rope_theta: f64,
    /// Llama 3's scaling of the rotary frequencies; `None`: the default rotary embedding.
    #[serde(default)]
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// The head multiplies by the token embedding's weight.
    pub tie_word_embeddings: bool,
    /// Biases on the query, key and value projections (Llama's `attention_bias`; Qwen2 always).
    pub qkv_bias: bool,
    /// A bias on the output projection (Llama's `attention_bias`; not Qwen2).
    pub o_bias: bool,
    /// Biases on the MLP's projections (`mlp_bias`; GPT-2 always).
    pub mlp_bias: bool,
    /// Per-head RMSNorm of queries and keys before the rotary embedding (Qwen3's `q_norm`,
    /// `k_norm`, parameters `(head_dim,)`).
    pub qk_norm: bool,
    /// The MLP's nonlinearity.
    pub activation: Activation,
    /// Window `W` of the sliding-window layers: query `i` sees keys `i − W < j ≤ i`.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Each layer's attention (`num_hidden_layers` entries); sliding layers need a window.
    pub layer_types: Vec<LayerType>,
    /// Attention scores soft-capped, `c·tanh(s/c)` (Gemma 2's `attn_logit_softcapping`).
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    /// Logits soft-capped, `c·tanh(z/c)` (Gemma 2's `final_logit_softcapping`).
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
    /// Scores scaled by `query_pre_attn_scalar^−½` instead of `head_dim^−½` (Gemma 2).
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f64>,
    /// The embedding row whose lookups send no gradient (transformers' `nn.Embedding(…,
    /// padding_idx=pad_token_id)`; the values are looked up as any row's, and a tied head's
    /// gradient still reaches the row). `None`: every row trains (GPT-2, no `pad_token_id`).
    #[serde(default)]
    pub pad_token_id: Option<u32>,
}

impl DecoderConfig {
    /// The family's table.
    pub fn table(&self) -> &'static FamilyTable {
        self.family.table()
    }

    /// The fields in which `other` differs from `self`, each as `name: self's → other's`, by
    /// field name (alphabetical); empty when the two are equal. A list of the same length or a
    /// table names its first differing entry (`layer_types[5]: "sliding_attention" →
    /// "full_attention"`, `rope_scaling.factor: 8.0 → 4.0`); a value is JSON, one longer than
    /// 40 characters cut there. For messages: what a resumed checkpoint's stored config changes.
    pub fn differences(&self, other: &DecoderConfig) -> Vec<String> {
        use serde_json::Value;
        fn show(v: Option<&Value>) -> String {
            let s = match v {
                None | Some(Value::Null) => "none".to_string(),
                Some(v) => v.to_string(),
            };
            match s.char_indices().nth(40) {
                Some((cut, _)) => format!("{}…", &s[..cut]),
                None => s,
            }
        }
        /// `name: a → b`, or the first differing entry of two lists of one length or two tables.
        fn first(name: String, a: Option<&Value>, b: Option<&Value>) -> String {
            match (a, b) {
                (Some(Value::Array(x)), Some(Value::Array(y))) if x.len() == y.len() => {
                    match (0..x.len()).find(|&i| x[i] != y[i]) {
                        Some(i) => first(format!("{name}[{i}]"), Some(&x[i]), Some(&y[i])),
                        None => format!("{name}: {} → {}", show(a), show(b)),
                    }
                }
                (Some(Value::Object(x)), Some(Value::Object(y))) => {
                    let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
                    keys.sort();
                    match keys.into_iter().find(|k| x.get(*k) != y.get(*k)) {
                        Some(k) => first(format!("{name}.{k}"), x.get(k), y.get(k)),
                        None => format!("{name}: {} → {}", show(a), show(b)),
                    }
                }
                _ => format!("{name}: {} → {}", show(a), show(b)),
            }
        }
        let as_map = |c: &DecoderConfig| match serde_json::to_value(c) {
            Ok(Value::Object(m)) => m,
            _ => serde_json::Map::new(),
        };
        let (a, b) = (as_map(self), as_map(other));
        let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
        keys.sort();
        keys.dedup();
        keys.into_iter()
            .filter(|k| a.get(*k) != b.get(*k))
            .map(|k| first(k.clone(), a.get(k), b.get(k)))
            .collect()
    }

    /// Unit and tensor names.
    pub fn names(&self) -> Names {
        self.table().names
    }

    /// Checks the shape.
    ///
    /// Errors (naming the key: [`Error::Value`], [`Error::OutOfRange`], [`Error::Shape`],
    /// [`Error::Conflict`], [`Error::Missing`]): a zero size; `num_key_value_heads`
    /// not dividing `num_attention_heads`; an odd `head_dim` with rotary embeddings; an
    /// epsilon, `rope_theta`, soft-cap or scalar that is not a positive finite number;
    /// `layer_types` not of `num_hidden_layers` entries; a sliding layer without a window, or a
    /// window of 0; GPT-2 with grouped-query attention or a `head_dim` other than `d / heads`.
    pub fn validate(&self) -> Result<()> {
        let model = self.table().architecture;
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(Error::value(format!("{model} {name}"), "at least 1", 0));
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(Error::value(
                format!("{model} num_key_value_heads"),
                format!(
                    "a divisor of num_attention_heads {}",
                    self.num_attention_heads
                ),
                self.num_key_value_heads,
            ));
        }
        let gpt2 = self.table().style == family::BlockStyle::Gpt2;
        if gpt2
            && (self.num_key_value_heads != self.num_attention_heads
                || self.head_dim * self.num_attention_heads != self.hidden_size)
        {
            return Err(Error::conflict(format!("{model}: {} key/value heads of {}", self.num_key_value_heads, self.head_dim), format!("n_head {} and n_embd {}", self.num_attention_heads, self.hidden_size), "n_head must divide n_embd (multi-head attention: as many key/value heads as heads, head_dim = n_embd / n_head)"));
        }
        if !gpt2 && !self.head_dim.is_multiple_of(2) {
            return Err(Error::value(
                format!("{model} head_dim"),
                "even (rotary embeddings rotate pairs)",
                self.head_dim,
            ));
        }
        let positive = |name: &str, v: f64| -> Result<()> {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(Error::value(
                    format!("{model} {name}"),
                    "a positive finite number",
                    v,
                ))
            }
        };
        positive("norm epsilon", self.norm_eps)?;
        positive("rope_theta", self.rope_theta)?;
        for (name, v) in [
            ("attn_logit_softcapping", self.attn_logit_softcapping),
            ("final_logit_softcapping", self.final_logit_softcapping),
            ("query_pre_attn_scalar", self.query_pre_attn_scalar),
        ] {
            if let Some(v) = v {
                positive(name, v)?;
            }
        }
        if let Some(scaling) = &self.rope_scaling {
            scaling.validate(model)?;
        }
        if self.layer_types.len() != self.num_hidden_layers {
            return Err(Error::shape(
                format!("{model} layer_types"),
                format!("{} entries (one per layer)", self.num_hidden_layers),
                format!("{} entries", self.layer_types.len()),
            ));
        }
        if let Some(p) = self.pad_token_id {
            if p as usize >= self.vocab_size {
                return Err(Error::out_of_range(
                    format!("{model} pad_token_id"),
                    p as usize,
                    "vocab_size",
                    self.vocab_size,
                ));
            }
        }
        let sliding = self.layer_types.contains(&LayerType::SlidingAttention);
        match self.sliding_window {
            Some(0) => {
                return Err(Error::value(
                    format!("{model} sliding_window"),
                    "at least 1",
                    0,
                ))
            }
            None if sliding => {
                return Err(Error::missing(
                    format!("sliding_window in {model} (it is null)"),
                    "layer_types has sliding_attention layers, which need one",
                ))
            }
            _ => {}
        }
        Ok(())
    }

    /// The attention window of layer `i`: `Some(W)` for a sliding layer.
    pub fn window_of(&self, i: usize) -> Option<usize> {
        match self.layer_types.get(i) {
            Some(LayerType::SlidingAttention) => self.sliding_window,
            _ => None,
        }
    }

    /// The parameters a decoder of this shape has, under Hugging Face's names, each with its
    /// shape, in model order (a tied model's head is the embedding's weight, listed once):
    /// what the model hands to the Hugging Face reader and export ([`crate::hf`]). Nothing is
    /// allocated (the units' constructors are recorded).
    ///
    /// Errors: an invalid shape ([`DecoderConfig::validate`]).
    pub fn parameter_shapes(&self) -> Result<Vec<(String, Vec<usize>)>> {
        Ok(FsdpDecoder::new(self.clone())?
            .spec()
            .record(&candle_core::Device::Cpu)?
            .into_iter()
            .map(|p| (p.name, p.shape.dims().to_vec()))
            .collect())
    }

    /// Number of parameters (a tied head counts once), from the units' recorded shapes.
    ///
    /// Errors: an invalid shape ([`DecoderConfig::validate`]).
    pub fn num_params(&self) -> Result<usize> {
        Ok(self
            .parameter_shapes()?
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum())
    }
}

/// The decoder as FSDP units: [`FsdpDecoder::add_units`] / [`FsdpDecoder::spec`] give them to
/// a model builder, [`crate::hf::decoder::build_from_hf`] builds them from a Hugging Face directory,
/// [`FsdpDecoder::logits`] runs them.
#[derive(Debug, Clone)]
pub struct FsdpDecoder {
    cfg: DecoderConfig,
    activation_checkpointing: bool,
    lora: Option<crate::lora::LoraConfig>,
}

impl FsdpDecoder {
    /// The units of `cfg` (a [`DecoderConfig`], or anything that converts into one, such as a
    /// [`crate::models::llama::LlamaConfig`]).
    ///
    /// Errors: an invalid `cfg` ([`DecoderConfig::validate`]).
    pub fn new(cfg: impl Into<DecoderConfig>) -> Result<Self> {
        let cfg = cfg.into();
        cfg.validate()?;
        Ok(Self {
            cfg,
            activation_checkpointing: false,
            lora: None,
        })
    }

    /// LoRA adapters on the projections `lora` targets ([`crate::lora`]; PEFT's module names:
    /// `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`, Phi-3's
    /// `qkv_proj` and `gate_up_proj`, GPT-2's `c_attn`, `c_proj`, `c_fc`), everything else
    /// frozen: [`FsdpDecoder::spec`] and [`FsdpDecoder::add_units`] train only the adapters
    /// (`train_only(`[`crate::lora::TRAINABLE`]`)`).
    ///
    /// Errors: an invalid config ([`crate::lora::LoraConfig::validate`]); targets that match no
    /// projection of the model (naming the projections).
    pub fn with_lora(mut self, lora: crate::lora::LoraConfig) -> Result<Self> {
        lora.validate()?;
        let modules: Vec<String> = self
            .cfg
            .parameter_shapes()?
            .into_iter()
            .filter(|(n, s)| {
                s.len() == 2
                    && n.ends_with(".weight")
                    && n.starts_with(&format!("{}.", self.cfg.names().layers))
            })
            .map(|(n, _)| n.trim_end_matches(".weight").to_string())
            .collect();
        if !modules.iter().any(|m| lora.targets_module(m)) {
            let mut kinds: Vec<&str> = modules
                .iter()
                .filter_map(|m| m.rsplit('.').next())
                .collect();
            kinds.sort_unstable();
            kinds.dedup();
            return Err(Error::no_match(
                "LoRA: the target list",
                format_args!("{:?}", lora.targets),
                "projection of the model",
                format_args!("its projections are: {}", kinds.join(", ")),
            ));
        }
        self.lora = Some(lora);
        Ok(self)
    }

    /// The LoRA config, when the decoder has adapters.
    pub fn lora(&self) -> Option<&crate::lora::LoraConfig> {
        self.lora.as_ref()
    }

    /// Activation checkpointing of the blocks ([`UnitSpec::with_activation_checkpointing`]).
    pub fn with_activation_checkpointing(mut self, on: bool) -> Self {
        self.activation_checkpointing = on;
        self
    }

    /// The shape.
    pub fn config(&self) -> &DecoderConfig {
        &self.cfg
    }

    /// The units in model order: the members of the embedding's group (the embedding and,
    /// tied, the head), then the learned positions (GPT-2), each block, the final norm and,
    /// untied, the head.
    fn units(&self) -> (Vec<UnitSpec>, Vec<UnitSpec>) {
        let names = self.cfg.names();
        let cfg = std::sync::Arc::new(self.cfg.clone());
        let c = cfg.clone();
        let emb = UnitSpec::new(names.embed, move |vb| token_embedding(&c, vb));
        let c = cfg.clone();
        let head = UnitSpec::new(names.head, move |vb| lm_head(&c, vb));
        let mut rest = Vec::new();
        if let Some(pos) = names.positions {
            let c = cfg.clone();
            rest.push(UnitSpec::new(pos, move |vb| positions(&c, vb)));
        }
        for i in 0..cfg.num_hidden_layers {
            let c = cfg.clone();
            let lora = self.lora.clone();
            rest.push(
                UnitSpec::multi(names.layer(i), move |vb| {
                    Block::with_lora(&c, i, lora.as_ref(), vb)
                })
                .with_activation_checkpointing(self.activation_checkpointing),
            );
        }
        let c = cfg.clone();
        rest.push(UnitSpec::new(names.norm, move |vb| final_norm(&c, vb)));
        if cfg.tie_word_embeddings {
            (vec![emb, head], rest)
        } else {
            rest.push(head);
            (vec![emb], rest)
        }
    }

    /// The units as a [`ModelSpec`]: the embedding's group (the embedding and, tied, the
    /// head), then every other unit.
    pub fn spec(&self) -> ModelSpec {
        let (emb, rest) = self.units();
        let mut s = ModelSpec::new();
        s.push_group(self.cfg.names().embed, emb);
        rest.into_iter().for_each(|u| s.push_unit(u));
        if self.lora.is_some() {
            s.push_train_only(crate::lora::TRAINABLE);
        }
        s
    }

    /// Adds the units of [`FsdpDecoder::spec`] to `builder`, for a model initialised from
    /// scratch (matrices and embeddings N(0, 0.02), norms 1 (Gemma's offset weights 0), biases
    /// 0).
    pub fn add_units(&self, builder: FsdpModelBuilder) -> FsdpModelBuilder {
        let (emb, rest) = self.units();
        let builder = builder.group(self.cfg.names().embed, emb).units(rest);
        if self.lora.is_some() {
            builder.train_only(crate::lora::TRAINABLE)
        } else {
            builder
        }
    }

    /// The forward through the units: logits `(B, T, V)` of token ids `(B, T)` u32 in the
    /// head's `param_dtype` (f32 without a mixed-precision policy).
    ///
    /// Errors: with learned positions (GPT-2), a context longer than the table
    /// (`max_position_embeddings`, GPT-2's `n_positions`); the units'.
    pub fn forward(&self, f: &mut Forward<'_>, ids: &Tensor) -> Result<Tensor> {
        self.forward_at(f, ids, None)
    }

    /// [`FsdpDecoder::forward`] of sequences that pack several examples: `position_ids` `(B, T)`
    /// u32 restart at 0 at each example (transformers' packed batches,
    /// `DataCollatorWithFlattening`); each token's rotary angles (GPT-2: its learned position)
    /// are taken at its id, and it attends only to the earlier tokens of its own example (an
    /// example starts where an id is not the previous one plus one:
    /// [`crate::nn::segment_starts`]). The logits of each example equal those of the example
    /// run alone. `None`: positions `0..T`, one example per sequence.
    ///
    /// Errors: as [`FsdpDecoder::forward`]; `position_ids` not `(B, T)` u32, or (learned
    /// positions) an id past the table.
    pub fn forward_at(
        &self,
        f: &mut Forward<'_>,
        ids: &Tensor,
        position_ids: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let cfg = &self.cfg;
        let arch = cfg.table().architecture;
        if let Some(p) = position_ids {
            if p.dims() != [b, t] || p.dtype() != candle_core::DType::U32 {
                return Err(Error::value(
                    format!("{arch}: position ids"),
                    format!("({b}, {t}) u32 like the token ids"),
                    format!("{:?} {:?}", p.dims(), p.dtype()),
                ));
            }
        }
        // Learned positions have a table of that many rows; rotary positions extend to any
        // context (transformers computes them, and so do we).
        if cfg.names().positions.is_some() {
            let last = match position_ids {
                None => t,
                Some(_) if t == 0 => 0,
                Some(p) => p.flatten_all()?.max(0)?.to_scalar::<u32>()? as usize + 1,
            };
            check_context(cfg, last)?;
        }
        let names = cfg.names();
        let mut h = f.call1(names.embed, ids)?;
        if let Some(pos) = names.positions {
            let p = match position_ids {
                None => Tensor::arange(0u32, t as u32, ids.device())?,
                Some(p) => p.clone(),
            };
            let p = f.call1(pos, &p)?;
            h = h.broadcast_add(&p.to_dtype(h.dtype())?)?;
        }
        for i in 0..cfg.num_hidden_layers {
            h = match position_ids {
                None => f.call1(&names.layer(i), &h)?,
                Some(p) => f.call(&names.layer(i), &[&h, p])?.remove(0),
            };
        }
        let h = f.call1(names.norm, &h)?;
        f.call1(names.head, &h)
    }

    /// [`FsdpDecoder::forward`] as a training forward of `model` (`train`) or an inference
    /// one. A collective.
    ///
    /// Errors: as [`FsdpDecoder::forward`]; the model's.
    pub fn logits(&self, model: &mut FsdpModel, ids: &Tensor, train: bool) -> Result<Tensor> {
        self.logits_at(model, ids, None, train)
    }

    /// [`FsdpDecoder::forward_at`] (packed examples at `position_ids`) as a training forward of
    /// `model` (`train`) or an inference one. A collective.
    ///
    /// Errors: as [`FsdpDecoder::forward_at`]; the model's.
    pub fn logits_at(
        &self,
        model: &mut FsdpModel,
        ids: &Tensor,
        position_ids: Option<&Tensor>,
        train: bool,
    ) -> Result<Tensor> {
        if train {
            model.forward_with(|f| self.forward_at(f, ids, position_ids))
        } else {
            model.forward_eval_with(|f| self.forward_at(f, ids, position_ids))
        }
    }
}

/// The decoder as plain Candle code: one process, parameters from any `VarBuilder` under the
/// units' names (e.g. [`crate::init::seeded_var_builder`], which gives the values the FSDP
/// runtime initialises with the same seed). The single-process reference of the tests and
/// benchmarks.
#[derive(Debug, Clone)]
pub struct Decoder {
    cfg: DecoderConfig,
    embed: Embedding,
    positions: Option<candle_nn::Embedding>,
    blocks: Vec<Block>,
    norm: Norm,
    head: Head,
}

impl Decoder {
    /// Builds the model of `cfg` from `vb` (the parameters of [`FsdpDecoder::spec`]'s units,
    /// created in the same order).
    ///
    /// Errors: an invalid `cfg` ([`DecoderConfig::validate`]); the `VarBuilder`'s own.
    pub fn new(cfg: impl Into<DecoderConfig>, vb: VarBuilder) -> Result<Self> {
        let cfg = cfg.into();
        cfg.validate()?;
        let names = cfg.names();
        let embed = token_embedding(&cfg, vb.pp(names.embed))?;
        let positions = match names.positions {
            Some(p) => Some(layers::positions(&cfg, vb.pp(p))?),
            None => None,
        };
        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| Block::new(&cfg, i, vb.pp(names.layer(i))))
            .collect::<candle_core::Result<_>>()?;
        let norm = final_norm(&cfg, vb.pp(names.norm))?;
        let head_vb = if cfg.tie_word_embeddings {
            vb.pp(names.embed)
        } else {
            vb.pp(names.head)
        };
        let head = lm_head(&cfg, head_vb)?;
        Ok(Self {
            cfg,
            embed,
            positions,
            blocks,
            norm,
            head,
        })
    }

    /// The shape.
    pub fn config(&self) -> &DecoderConfig {
        &self.cfg
    }

    /// Logits `(B, T, V)` of token ids `(B, T)` u32.
    ///
    /// Errors: with learned positions, a context longer than the table; Candle's.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let (_, t) = ids.dims2()?;
        let mut h = self.embed.forward(ids)?;
        if let Some(p) = &self.positions {
            check_context(&self.cfg, t)?;
            let p = p.forward(&Tensor::arange(0u32, t as u32, ids.device())?)?;
            h = h.broadcast_add(&p)?;
        }
        for b in &self.blocks {
            h = b.forward(&h)?;
        }
        Ok(self.head.forward(&self.norm.forward(&h)?)?)
    }
}

/// With learned positions, a context of `last` positions must fit the table.
fn check_context(cfg: &DecoderConfig, last: usize) -> Result<()> {
    if last > cfg.max_position_embeddings {
        return Err(Error::value(
            format!("{} context", cfg.table().architecture),
            format!(
                "at most n_positions {} (the rows of its learned position table)",
                cfg.max_position_embeddings
            ),
            format!("{last} positions"),
        ));
    }
    Ok(())
}

/// Mean next-token cross-entropy of `logits` `(B, T, V)` against `targets` `(B, T)` u32, as an
/// f32 scalar: [`crate::nn::lm_loss`].
///
/// Errors: mismatched shapes; Candle's.
pub fn lm_loss(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    Ok(crate::nn::lm_loss(logits, targets)?)
}
