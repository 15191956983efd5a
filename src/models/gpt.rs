//! A GPT-2-style decoder-only transformer (Radford et al. 2019) written with candle-nn, as FSDP
//! units (cargo feature `gpt`).
//!
//! ```text
//! ids (B, T) u32 ─▶ wte: token embedding (V, d) ──┐
//! positions (T,) ─▶ wpe: position embedding (T_max, d) ─▶ + ─▶ h (B, T, d)
//! h ─▶ blk0 … blk{L-1}: pre-norm blocks
//!        h = h + attn(ln1(h))     causal multi-head self-attention, n_head heads
//!        h = h + mlp(ln2(h))      Linear(d, 4d) → GELU (tanh) → Linear(4d, d)
//! h ─▶ lnf: final LayerNorm ─▶ head: Linear(d, V), no bias ─▶ logits (B, T, V)
//! ```
//!
//! Every parameter and activation is f32 unless a mixed-precision policy gathers parameters in
//! another dtype (the blocks then compute in it).
//! Token ids are u32 in `[0, V)`.
//!
//! **Units** ([`FsdpGpt`]): the token embedding (unit `emb` of group `wte`), the position
//! embedding `wpe`, each block `blk0` … `blk{L-1}`, the final norm `lnf` and the LM head
//! `head`; [`GptConfig::n_layer`] + 3 FlatParameters when tied, + 4 untied. Parameter names are
//! `wte.weight`, `wpe.weight`, `blk{i}.ln1.weight`, `blk{i}.attn.qkv.weight`, …, `lnf.weight`
//! and, untied, `head.weight`. With tied weights ([`GptConfig::tied`], the GPT-2 default) the
//! head is a second member of group `wte` and multiplies by `wte.weight`: one FlatParameter
//! for both uses, as FSDP2's `fully_shard([emb, head])`.
//!
//! [`Gpt`] is the same model as plain Candle code (one process, parameters from any
//! `VarBuilder`, e.g. [`crate::init::seeded_var_builder`], which gives the values the FSDP
//! runtime initialises with the same seed): the reference of the tests.
//!
//! Initialisation as GPT-2: every weight matrix and embedding N(0, 0.02), the two residual
//! projections of each block N(0, 0.02/√(2L)), biases 0, norms 1 and 0.

use candle_core::{Device, Module, Tensor};
use candle_nn::{Embedding, Init, Linear, VarBuilder};
use serde::{Deserialize, Serialize};

use super::gpt2_block::{gpt_block, GptBlockParams};
use crate::error::{Error, Result};
use crate::fsdp::{Forward, FsdpModel, FsdpModelBuilder};
pub use crate::nn::gelu;
use crate::nn::{causal_attention, layer_norm, linear_forward, linear_gelu, LayerNorm};
use crate::unit::UnitSpec;

/// Standard deviation of GPT-2's weight initialisation.
const INIT_STD: f64 = 0.02;

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
    /// Errors ([`Error::InvalidArgument`], naming the value): a zero size; `n_head` not
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
                return Err(Error::InvalidArgument(format!(
                    "GPT {name} must be at least 1, found 0"
                )));
            }
        }
        if !self.d_model.is_multiple_of(self.n_head) {
            return Err(Error::InvalidArgument(format!(
                "GPT n_head {} must divide d_model {}",
                self.n_head, self.d_model
            )));
        }
        if !(self.layer_norm_eps.is_finite() && self.layer_norm_eps > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "GPT layer_norm_eps must be a positive finite number, found {}",
                self.layer_norm_eps
            )));
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

/// The causal mask of `seq_len` positions: `(seq_len, seq_len)` f32, 0 where a query may see a
/// key (key ≤ query), −∞ above the diagonal. The attention applies it inside
/// [`crate::nn::causal_softmax`]; this is the mask for code that adds it to scores itself.
pub fn causal_mask(seq_len: usize, device: &Device) -> candle_core::Result<Tensor> {
    let values: Vec<f32> = (0..seq_len)
        .flat_map(|q| (0..seq_len).map(move |k| if k <= q { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Tensor::from_vec(values, (seq_len, seq_len), device)
}

/// A linear layer `y = x·Wᵀ + b` with weight `(out, in)` drawn from N(0, `std`) and a zero
/// bias (when `bias`): [`crate::nn::linear_normal`].
fn linear(
    in_dim: usize,
    out_dim: usize,
    std: f64,
    bias: bool,
    vb: VarBuilder,
) -> candle_core::Result<Linear> {
    let l = crate::nn::linear_normal(in_dim, out_dim, std, bias, vb)?;
    Ok(Linear::new(l.weight().clone(), l.bias().cloned()))
}

/// `l` applied to `x` `(…, in)` → `(…, out)` as [`linear_forward`]: one graph node, the
/// weight gradient one gemm over all rows.
fn apply(l: &Linear, x: &Tensor) -> candle_core::Result<Tensor> {
    linear_forward(x, l.weight(), l.bias())
}

/// An embedding table `(rows, d)` named `weight`, N(0, 0.02).
fn embedding(rows: usize, d: usize, vb: VarBuilder) -> candle_core::Result<Embedding> {
    let w = vb.get_with_hints(
        (rows, d),
        "weight",
        Init::Randn {
            mean: 0.0,
            stdev: INIT_STD,
        },
    )?;
    Ok(Embedding::new(w, d))
}

/// The token embedding `wte`: ids `(B, T)` u32 → `(B, T, d)`; parameter `weight` `(V, d)`.
pub fn token_embedding(cfg: &GptConfig, vb: VarBuilder) -> candle_core::Result<Embedding> {
    embedding(cfg.vocab_size, cfg.d_model, vb)
}

/// The position embedding `wpe`: positions `(T,)` u32 (T ≤ `seq_len`) → `(T, d)`, added to
/// the token embeddings by broadcasting; parameter `weight` `(seq_len, d)`.
pub fn position_embedding(cfg: &GptConfig, vb: VarBuilder) -> candle_core::Result<Embedding> {
    embedding(cfg.seq_len, cfg.d_model, vb)
}

/// The final LayerNorm `lnf`: `(…, d)` → `(…, d)`; parameters `weight`, `bias` `(d,)`.
pub fn final_norm(cfg: &GptConfig, vb: VarBuilder) -> candle_core::Result<LayerNorm> {
    layer_norm(cfg.d_model, cfg.layer_norm_eps, vb)
}

/// The LM head: `(B, T, d)` → logits `(B, T, V)`, no bias; parameter `weight` `(V, d)`. Tied
/// weights: build it from the token embedding's `VarBuilder` prefix (`wte`), where `weight`
/// is the embedding's table (same name, shape and init hint, so it is one parameter).
pub fn lm_head(cfg: &GptConfig, vb: VarBuilder) -> candle_core::Result<Linear> {
    linear(cfg.d_model, cfg.vocab_size, INIT_STD, false, vb)
}

/// Causal multi-head self-attention: `(B, T, d)` → `(B, T, d)`, T ≤ `seq_len`.
/// Parameters `qkv.weight` `(3d, d)`, `qkv.bias` `(3d,)` (queries, keys, values, each `d`
/// wide, head-major), `proj.weight` `(d, d)`, `proj.bias` `(d,)`. The scores of each head are
/// `q·kᵀ / √(d/h)`, normalised by [`crate::nn::causal_softmax`] (query `i` sees keys `j ≤ i`).
#[derive(Debug, Clone)]
pub struct CausalSelfAttention {
    qkv: Linear,
    proj: Linear,
    n_head: usize,
}

impl CausalSelfAttention {
    /// Builds the layer.
    pub fn new(cfg: &GptConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        let d = cfg.d_model;
        let residual_std = INIT_STD / (2.0 * cfg.n_layer as f64).sqrt();
        Ok(Self {
            qkv: linear(d, 3 * d, INIT_STD, true, vb.pp("qkv"))?,
            proj: linear(d, d, residual_std, true, vb.pp("proj"))?,
            n_head: cfg.n_head,
        })
    }
}

impl Module for CausalSelfAttention {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        // (B, T, 3d) → (B, T, d), heads merged: one fused op (see `nn::causal_attention`).
        let y = causal_attention(&apply(&self.qkv, x)?, self.n_head)?;
        apply(&self.proj, &y)
    }
}

/// The feed-forward part of a block: `(…, d)` → Linear(d, 4d) → GELU (tanh approximation,
/// as GPT-2) → Linear(4d, d). Parameters `fc.weight` `(4d, d)`, `fc.bias`, `proj.weight`
/// `(d, 4d)`, `proj.bias`.
#[derive(Debug, Clone)]
pub struct Mlp {
    fc: Linear,
    proj: Linear,
}

impl Mlp {
    /// Builds the layer.
    pub fn new(cfg: &GptConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        let d = cfg.d_model;
        let residual_std = INIT_STD / (2.0 * cfg.n_layer as f64).sqrt();
        Ok(Self {
            fc: linear(d, 4 * d, INIT_STD, true, vb.pp("fc"))?,
            proj: linear(4 * d, d, residual_std, true, vb.pp("proj"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let bias = self.fc.bias().expect("the MLP's fc layer has a bias");
        apply(&self.proj, &linear_gelu(x, self.fc.weight(), bias)?)
    }
}

/// One pre-norm transformer block, `(B, T, d)` → `(B, T, d)` with both residuals inside:
/// `h = x + attn(ln1(x)); h + mlp(ln2(h))`. One FSDP unit.
#[derive(Debug, Clone)]
pub struct Block {
    ln1: LayerNorm,
    attn: CausalSelfAttention,
    ln2: LayerNorm,
    mlp: Mlp,
}

impl Block {
    /// Builds the block (parameters `ln1.*`, `attn.*`, `ln2.*`, `mlp.*` under `vb`).
    pub fn new(cfg: &GptConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        let d = cfg.d_model;
        Ok(Self {
            ln1: layer_norm(d, cfg.layer_norm_eps, vb.pp("ln1"))?,
            attn: CausalSelfAttention::new(cfg, vb.pp("attn"))?,
            ln2: layer_norm(d, cfg.layer_norm_eps, vb.pp("ln2"))?,
            mlp: Mlp::new(cfg, vb.pp("mlp"))?,
        })
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        // Inside the FSDP runtime's training forward: the whole block as one node.
        if let Some(y) = self.fused(x)? {
            return Ok(y);
        }
        let h = (x + self.attn.forward(&self.ln1.forward(x)?)?)?;
        &h + self.mlp.forward(&self.ln2.forward(&h)?)?
    }
}

impl Block {
    /// The block as one node (`models/gpt2_block.rs`, through [`crate::fsdp::fused`]) where it applies, else `None`.
    fn fused(&self, x: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (Some(b1), Some(bq), Some(bp), Some(b2), Some(bf), Some(bm)) = (
            self.ln1.bias(),
            self.attn.qkv.bias(),
            self.attn.proj.bias(),
            self.ln2.bias(),
            self.mlp.fc.bias(),
            self.mlp.proj.bias(),
        ) else {
            return Ok(None);
        };
        if !self.ln1.remove_mean() || !self.ln2.remove_mean() || self.ln1.eps() != self.ln2.eps() {
            return Ok(None);
        }
        let params = GptBlockParams {
            tensors: [
                self.ln1.weight(),
                b1,
                self.attn.qkv.weight(),
                bq,
                self.attn.proj.weight(),
                bp,
                self.ln2.weight(),
                b2,
                self.mlp.fc.weight(),
                bf,
                self.mlp.proj.weight(),
                bm,
            ],
            n_head: self.attn.n_head,
            eps: self.ln1.eps(),
            conv1d: false,
        };
        gpt_block(x, &params)
    }
}

/// The positions `0..t` as a `(t,)` u32 tensor (the input of `wpe`).
pub fn positions(t: usize, device: &Device) -> candle_core::Result<Tensor> {
    Tensor::arange(0u32, t as u32, device)
}

/// Name of block `i`'s unit (and parameter prefix): `blk{i}`.
pub fn block_name(i: usize) -> String {
    format!("blk{i}")
}

/// The whole model as plain Candle code, parameters named as the FSDP units' (see the module
/// docs): the single-process reference.
#[derive(Debug, Clone)]
pub struct Gpt {
    cfg: GptConfig,
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    lnf: LayerNorm,
    head: Linear,
}

impl Gpt {
    /// Builds the model from `vb` (names `wte.weight`, `wpe.weight`, `blk{i}.…`, `lnf.…`, and
    /// `head.weight` when untied).
    ///
    /// Errors: an invalid `cfg` ([`GptConfig::validate`]), the `VarBuilder`'s own.
    pub fn new(cfg: GptConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let head_vb = if cfg.tied {
            vb.pp("wte")
        } else {
            vb.pp("head")
        };
        Ok(Self {
            wte: token_embedding(&cfg, vb.pp("wte"))?,
            wpe: position_embedding(&cfg, vb.pp("wpe"))?,
            blocks: (0..cfg.n_layer)
                .map(|i| Block::new(&cfg, vb.pp(block_name(i))))
                .collect::<candle_core::Result<_>>()?,
            lnf: final_norm(&cfg, vb.pp("lnf"))?,
            head: lm_head(&cfg, head_vb)?,
            cfg,
        })
    }

    /// The shape.
    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// Logits `(B, T, V)` of token ids `(B, T)` u32, T ≤ `seq_len`.
    ///
    /// Errors: a longer context; Candle's.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let (_, t) = ids.dims2()?;
        if t > self.cfg.seq_len {
            return Err(Error::InvalidArgument(format!(
                "GPT context of {t} tokens is longer than seq_len {}",
                self.cfg.seq_len
            )));
        }
        let pos = self.wpe.forward(&positions(t, ids.device())?)?;
        let mut h = self.wte.forward(ids)?.broadcast_add(&pos)?;
        for b in &self.blocks {
            h = b.forward(&h)?;
        }
        Ok(self.head.forward(&self.lnf.forward(&h)?)?)
    }
}

/// The GPT as FSDP units: [`FsdpGpt::add_units`] puts them in a model builder,
/// [`FsdpGpt::logits`] runs them.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fsdp::launch::{launch, Launcher};
/// use candle_fsdp::models::gpt::{lm_loss, FsdpGpt, GptConfig};
/// use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, FsdpModel, ShardedOptimizer};
///
/// let cfg = GptConfig { n_layer: 1, n_head: 2, d_model: 16, seq_len: 8, ..GptConfig::default() };
/// launch(&Launcher::threads(2), |pg| {
///     let gpt = FsdpGpt::new(cfg)?;
///     let mut model = gpt.add_units(FsdpModel::builder(pg, FsdpConfig::default())).build()?;
///     let mut opt = AdamW::new(AdamWConfig::default());
///     let ids = Tensor::new(&[[1u32, 2, 3, 4, 5, 6, 7, 8]], &Device::Cpu)?; // (B, T)
///     let targets = Tensor::new(&[[2u32, 3, 4, 5, 6, 7, 8, 9]], &Device::Cpu)?;
///     let logits = gpt.logits(&mut model, &ids, true)?; // (1, 8, 256)
///     model.backward(&lm_loss(&logits, &targets)?)?;
///     opt.step(&mut model)?;
///     Ok(())
/// })?;
/// # Ok::<(), candle_fsdp::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct FsdpGpt {
    cfg: GptConfig,
    activation_checkpointing: bool,
}

impl FsdpGpt {
    /// The units of `cfg`.
    ///
    /// Errors: an invalid `cfg` ([`GptConfig::validate`]).
    pub fn new(cfg: GptConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            cfg,
            activation_checkpointing: false,
        })
    }

    /// Activation checkpointing of the blocks (PyTorch's `apply_activation_checkpointing` on
    /// each block, [`UnitSpec::with_activation_checkpointing`]): a block's forward keeps only
    /// its input (`B·T·d` values) and is recomputed in its backward, which trades one more
    /// forward of each block for its activations (attention scores `B·heads·T²`, MLP hidden
    /// `B·T·4d`, …). Same values as without.
    pub fn with_activation_checkpointing(mut self, on: bool) -> Self {
        self.activation_checkpointing = on;
        self
    }

    /// Whether the blocks are checkpointed ([`FsdpGpt::with_activation_checkpointing`]).
    pub fn activation_checkpointing(&self) -> bool {
        self.activation_checkpointing
    }

    /// The shape.
    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// Adds the units to `builder` (see the module docs), each its own FlatParameter:
    /// - group `wte` (parameter `wte.weight`): unit `emb`, the token embedding, and, with tied
    ///   weights, unit `head`, the LM head, which asks for the same `weight` (FSDP2's
    ///   `fully_shard([emb, head])`: one FlatParameter, gathered for each call, its gradient the
    ///   sum of both uses);
    /// - `wpe`, `blk0` … `blk{L-1}` (checkpointed when
    ///   [`FsdpGpt::with_activation_checkpointing`] is on), `lnf`;
    /// - untied: `head` (parameter `head.weight`).
    pub fn add_units(&self, builder: FsdpModelBuilder) -> FsdpModelBuilder {
        let cfg = self.cfg;
        let emb = UnitSpec::new("emb", move |vb| token_embedding(&cfg, vb));
        let head = UnitSpec::new("head", move |vb| lm_head(&cfg, vb));
        let mut b = if cfg.tied {
            builder.group("wte", [emb, head.clone()])
        } else {
            builder.group("wte", [emb])
        };
        b = b.unit_spec(UnitSpec::new("wpe", move |vb| position_embedding(&cfg, vb)));
        for i in 0..cfg.n_layer {
            b = b.unit_spec(
                UnitSpec::new(block_name(i), move |vb| Block::new(&cfg, vb))
                    .with_activation_checkpointing(self.activation_checkpointing),
            );
        }
        b = b.unit_spec(UnitSpec::new("lnf", move |vb| final_norm(&cfg, vb)));
        if cfg.tied {
            b
        } else {
            b.unit_spec(head)
        }
    }

    /// The forward through the units: logits `(B, T, V)` of token ids `(B, T)` u32,
    /// T ≤ `seq_len`, in the head's `param_dtype` (f32 without a mixed-precision policy).
    ///
    /// Errors: a longer context; the units'.
    pub fn forward(&self, f: &mut Forward<'_>, ids: &Tensor) -> Result<Tensor> {
        let (_, t) = ids.dims2()?;
        if t > self.cfg.seq_len {
            return Err(Error::InvalidArgument(format!(
                "GPT context of {t} tokens is longer than seq_len {}",
                self.cfg.seq_len
            )));
        }
        let tok = f.call1("emb", ids)?;
        let pos = f.call1("wpe", &positions(t, ids.device())?)?;
        let mut h = tok.broadcast_add(&pos)?;
        for i in 0..self.cfg.n_layer {
            h = f.call1(&block_name(i), &h)?;
        }
        let h = f.call1("lnf", &h)?;
        f.call1("head", &h)
    }

    /// [`FsdpGpt::forward`] as a training forward of `model` (`train`: to be followed by
    /// [`FsdpModel::backward`] of a loss computed from the logits) or an inference one. A
    /// collective.
    ///
    /// Errors: as [`FsdpGpt::forward`]; the model's.
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
