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
//! a model directory loads by name ([`hf::build_from_hf`]) and a checkpoint exports to one with
//! no renaming (decision 50). **Units**: `model.embed_tokens`, each `model.layers.{i}`,
//! `model.norm` and `lm_head`; with tied embeddings (`tie_word_embeddings`) the head is a second
//! member of group `model.embed_tokens` and multiplies by `model.embed_tokens.weight` (one
//! FlatParameter, as GPT's tied head).
//!
//! Every parameter is f32 (the master copy) unless a mixed-precision policy gathers it in
//! another dtype; the rotary tables follow the activations' dtype.

pub mod hf;

use candle_core::{Device, Module, Tensor};
use candle_nn::{Embedding, Init, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::fsdp::{Forward, FsdpModel, FsdpModelBuilder, ModelSpec};
use crate::nn::{causal_attention_gqa, linear_normal, rms_norm, Linear, RmsNorm};
use crate::unit::UnitSpec;

/// Standard deviation of the initialisation of a model built from scratch (transformers'
/// `initializer_range` default).
const INIT_STD: f64 = 0.02;

/// The shape of a Llama: Hugging Face `LlamaConfig`'s fields under their names (see
/// [`hf::config_from_json`] for the keys read from a `config.json` and those refused).
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
    fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("factor", self.factor),
            ("low_freq_factor", self.low_freq_factor),
            ("high_freq_factor", self.high_freq_factor),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::InvalidArgument(format!(
                    "Llama rope_scaling.{name} must be a positive finite number, found {v}"
                )));
            }
        }
        if self.low_freq_factor >= self.high_freq_factor {
            return Err(Error::InvalidArgument(format!(
                "Llama rope_scaling.low_freq_factor {} must be below high_freq_factor {}",
                self.low_freq_factor, self.high_freq_factor
            )));
        }
        if self.original_max_position_embeddings == 0 {
            return Err(Error::InvalidArgument(
                "Llama rope_scaling.original_max_position_embeddings must be at least 1, found 0"
                    .into(),
            ));
        }
        Ok(())
    }
}

impl LlamaConfig {
    /// Checks the shape.
    ///
    /// Errors ([`Error::InvalidArgument`], naming the key): a zero size; `num_key_value_heads`
    /// not dividing `num_attention_heads`; an odd `head_dim` (RoPE rotates pairs); an epsilon
    /// or `rope_theta` that is not a positive finite number.
    pub fn validate(&self) -> Result<()> {
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
                return Err(Error::InvalidArgument(format!(
                    "Llama {name} must be at least 1, found 0"
                )));
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(Error::InvalidArgument(format!(
                "Llama num_key_value_heads {} must divide num_attention_heads {}",
                self.num_key_value_heads, self.num_attention_heads
            )));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(Error::InvalidArgument(format!(
                "Llama head_dim must be even (rotary embeddings rotate pairs), found {}",
                self.head_dim
            )));
        }
        for (name, v) in [
            ("rms_norm_eps", self.rms_norm_eps),
            ("rope_theta", self.rope_theta),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::InvalidArgument(format!(
                    "Llama {name} must be a positive finite number, found {v}"
                )));
            }
        }
        if let Some(scaling) = &self.rope_scaling {
            scaling.validate()?;
        }
        Ok(())
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

/// `Linear(in, out)` with weight `(out, in)` N(0, 0.02) and, when `bias`, a zero bias.
fn linear(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    vb: VarBuilder,
) -> candle_core::Result<Linear> {
    linear_normal(in_dim, out_dim, INIT_STD, bias, vb)
}

/// `l` applied to `x` `(…, in)` → `(…, out)` ([`crate::nn::linear_forward`]: one graph node).
fn apply(l: &Linear, x: &Tensor) -> candle_core::Result<Tensor> {
    l.forward(x)
}

/// The token embedding `model.embed_tokens`: ids `(B, T)` u32 → `(B, T, d)`; parameter
/// `weight` `(V, d)`, N(0, 0.02).
pub fn token_embedding(cfg: &LlamaConfig, vb: VarBuilder) -> candle_core::Result<Embedding> {
    let w = vb.get_with_hints(
        (cfg.vocab_size, cfg.hidden_size),
        "weight",
        Init::Randn {
            mean: 0.0,
            stdev: INIT_STD,
        },
    )?;
    Ok(Embedding::new(w, cfg.hidden_size))
}

/// The final norm `model.norm`: RMSNorm, parameter `weight` `(d,)`.
pub fn final_norm(cfg: &LlamaConfig, vb: VarBuilder) -> candle_core::Result<RmsNorm> {
    rms_norm(cfg.hidden_size, cfg.rms_norm_eps, vb)
}

/// The LM head: `(B, T, d)` → logits `(B, T, V)`, no bias; parameter `weight` `(V, d)` (with
/// tied weights built under the embedding's prefix, where it is the embedding's table).
pub fn lm_head(cfg: &LlamaConfig, vb: VarBuilder) -> candle_core::Result<Linear> {
    linear(cfg.hidden_size, cfg.vocab_size, false, vb)
}

/// The rotary tables of positions `0..t`: `(cos, sin)`, each `(t, head_dim)` f32, the
/// frequencies `θ_i = rope_theta^(−2i/head_dim)` (scaled by [`Llama3RopeScaling::scale`] when
/// the config has one) repeated twice along the head (transformers' `LlamaRotaryEmbedding`;
/// angles computed in f64, rounded once).
pub fn rope_tables(
    cfg: &LlamaConfig,
    t: usize,
    device: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let hd = cfg.head_dim;
    let half = hd / 2;
    let mut cos = Vec::with_capacity(t * hd);
    let mut sin = Vec::with_capacity(t * hd);
    for p in 0..t {
        for j in 0..hd {
            let i = j % half;
            let mut inv = 1.0 / cfg.rope_theta.powf((2 * i) as f64 / hd as f64);
            if let Some(scaling) = &cfg.rope_scaling {
                inv = scaling.scale(inv);
            }
            let a = p as f64 * inv;
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    Ok((
        Tensor::from_vec(cos, (t, hd), device)?,
        Tensor::from_vec(sin, (t, hd), device)?,
    ))
}

/// Rotary embedding of `x` `(B, T, heads, head_dim)` with tables `(T, head_dim)`:
/// `x·cos + rotate_half(x)·sin`, one graph node ([`crate::nn::rope`]).
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    crate::nn::rope(x, cos, sin)
}

/// Grouped-query causal self-attention `self_attn`: `(B, T, d)` → `(B, T, d)`. Parameters
/// `q_proj.weight` `(n_head·hd, d)`, `k_proj.weight`, `v_proj.weight` `(n_kv_head·hd, d)`,
/// `o_proj.weight` `(d, n_head·hd)` (and their biases with `attention_bias`).
#[derive(Debug, Clone)]
pub struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    cfg: LlamaConfig,
}

impl Attention {
    /// Builds the layer.
    pub fn new(cfg: &LlamaConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        let (d, hd, b) = (cfg.hidden_size, cfg.head_dim, cfg.attention_bias);
        Ok(Self {
            q: linear(d, cfg.num_attention_heads * hd, b, vb.pp("q_proj"))?,
            k: linear(d, cfg.num_key_value_heads * hd, b, vb.pp("k_proj"))?,
            v: linear(d, cfg.num_key_value_heads * hd, b, vb.pp("v_proj"))?,
            o: linear(cfg.num_attention_heads * hd, d, b, vb.pp("o_proj"))?,
            cfg: *cfg,
        })
    }
}

impl Module for Attention {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (h, kvh, hd) = (
            self.cfg.num_attention_heads,
            self.cfg.num_key_value_heads,
            self.cfg.head_dim,
        );
        let (cos, sin) = rope_tables(&self.cfg, t, x.device())?;
        let q = apply_rope(&apply(&self.q, x)?.reshape((b, t, h, hd))?, &cos, &sin)?;
        let k = apply_rope(&apply(&self.k, x)?.reshape((b, t, kvh, hd))?, &cos, &sin)?;
        let v = apply(&self.v, x)?.reshape((b, t, kvh, hd))?;
        // Key/value head j serves query heads j·rep .. (j+1)·rep (transformers' repeat_kv),
        // read in place by the kernel.
        let qkv = Tensor::cat(
            &[
                q.reshape((b, t, h * hd))?,
                k.reshape((b, t, kvh * hd))?,
                v.reshape((b, t, kvh * hd))?,
            ],
            2,
        )?;
        apply(&self.o, &causal_attention_gqa(&qkv, h, kvh)?)
    }
}

/// The SwiGLU MLP `mlp`: `down_proj(silu(gate_proj(x)) ⊙ up_proj(x))`. Parameters
/// `gate_proj.weight`, `up_proj.weight` `(I, d)`, `down_proj.weight` `(d, I)` (and biases
/// with `mlp_bias`).
#[derive(Debug, Clone)]
pub struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl Mlp {
    /// Builds the layer.
    pub fn new(cfg: &LlamaConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        let (d, i, b) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
        Ok(Self {
            gate: linear(d, i, b, vb.pp("gate_proj"))?,
            up: linear(d, i, b, vb.pp("up_proj"))?,
            down: linear(i, d, b, vb.pp("down_proj"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let g = apply(&self.gate, x)?.silu()?;
        apply(&self.down, &(g * apply(&self.up, x)?)?)
    }
}

/// One decoder block `model.layers.{i}`, `(B, T, d)` → `(B, T, d)`:
/// `h = x + self_attn(input_layernorm(x)); h + mlp(post_attention_layernorm(h))`. One FSDP
/// unit.
#[derive(Debug, Clone)]
pub struct Block {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl Block {
    /// Builds the block (parameters `input_layernorm.weight`, `self_attn.*`,
    /// `post_attention_layernorm.weight`, `mlp.*` under `vb`).
    pub fn new(cfg: &LlamaConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        let (d, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        Ok(Self {
            input_layernorm: rms_norm(d, eps, vb.pp("input_layernorm"))?,
            self_attn: Attention::new(cfg, vb.pp("self_attn"))?,
            post_attention_layernorm: rms_norm(d, eps, vb.pp("post_attention_layernorm"))?,
            mlp: Mlp::new(cfg, vb.pp("mlp"))?,
        })
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = (x + self.self_attn.forward(&self.input_layernorm.forward(x)?)?)?;
        &h + self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&h)?)?
    }
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

/// The Llama as FSDP units: [`FsdpLlama::add_units`] / [`FsdpLlama::spec`] give them to a
/// model builder, [`hf::build_from_hf`] builds them from a Hugging Face directory,
/// [`FsdpLlama::logits`] runs them.
#[derive(Debug, Clone)]
pub struct FsdpLlama {
    cfg: LlamaConfig,
    activation_checkpointing: bool,
}

impl FsdpLlama {
    /// The units of `cfg`.
    ///
    /// Errors: an invalid `cfg` ([`LlamaConfig::validate`]).
    pub fn new(cfg: LlamaConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            cfg,
            activation_checkpointing: false,
        })
    }

    /// Activation checkpointing of the blocks ([`UnitSpec::with_activation_checkpointing`]).
    pub fn with_activation_checkpointing(mut self, on: bool) -> Self {
        self.activation_checkpointing = on;
        self
    }

    /// The shape.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The units in model order: the members of group `model.embed_tokens` (the embedding
    /// and, tied, the head), then each block, `model.norm` and, untied, `lm_head`.
    fn units(&self) -> (Vec<UnitSpec>, Vec<UnitSpec>) {
        let cfg = self.cfg;
        let emb = UnitSpec::new(EMBED, move |vb| token_embedding(&cfg, vb));
        let head = UnitSpec::new(HEAD, move |vb| lm_head(&cfg, vb));
        let mut rest: Vec<UnitSpec> = (0..cfg.num_hidden_layers)
            .map(|i| {
                UnitSpec::new(block_name(i), move |vb| Block::new(&cfg, vb))
                    .with_activation_checkpointing(self.activation_checkpointing)
            })
            .collect();
        rest.push(UnitSpec::new(NORM, move |vb| final_norm(&cfg, vb)));
        if cfg.tie_word_embeddings {
            (vec![emb, head], rest)
        } else {
            rest.push(head);
            (vec![emb], rest)
        }
    }

    /// The units as a [`ModelSpec`] (module docs): group `model.embed_tokens` (the embedding
    /// and, tied, the head), each block, `model.norm`, and, untied, `lm_head`.
    pub fn spec(&self) -> ModelSpec {
        let (emb, rest) = self.units();
        let mut s = ModelSpec::new();
        s.push_group(EMBED, emb);
        rest.into_iter().for_each(|u| s.push_unit(u));
        s
    }

    /// Adds the units of [`FsdpLlama::spec`] to `builder`, for a model initialised from
    /// scratch (matrices and the embedding N(0, 0.02), norms 1, biases 0).
    pub fn add_units(&self, builder: FsdpModelBuilder) -> FsdpModelBuilder {
        let (emb, rest) = self.units();
        builder.group(EMBED, emb).units(rest)
    }

    /// The forward through the units: logits `(B, T, V)` of token ids `(B, T)` u32 in the
    /// head's `param_dtype` (f32 without a mixed-precision policy).
    ///
    /// Errors: a context longer than `max_position_embeddings`; the units'.
    pub fn forward(&self, f: &mut Forward<'_>, ids: &Tensor) -> Result<Tensor> {
        let (_, t) = ids.dims2()?;
        if t > self.cfg.max_position_embeddings {
            return Err(Error::InvalidArgument(format!(
                "Llama context of {t} tokens is longer than max_position_embeddings {}",
                self.cfg.max_position_embeddings
            )));
        }
        let mut h = f.call1(EMBED, ids)?;
        for i in 0..self.cfg.num_hidden_layers {
            h = f.call1(&block_name(i), &h)?;
        }
        let h = f.call1(NORM, &h)?;
        f.call1(HEAD, &h)
    }

    /// [`FsdpLlama::forward`] as a training forward of `model` (`train`) or an inference one.
    /// A collective.
    ///
    /// Errors: as [`FsdpLlama::forward`]; the model's.
    pub fn logits(&self, model: &mut FsdpModel, ids: &Tensor, train: bool) -> Result<Tensor> {
        if train {
            model.forward_with(|f| self.forward(f, ids))
        } else {
            model.forward_eval_with(|f| self.forward(f, ids))
        }
    }
}

/// Mean next-token cross-entropy of `logits` `(B, T, V)` against `targets` `(B, T)` u32, as an
/// f32 scalar: [`crate::nn::lm_loss`].
///
/// Errors: mismatched shapes; Candle's.
pub fn lm_loss(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    Ok(crate::nn::lm_loss(logits, targets)?)
}
