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

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, DType, Device, Layout, Module, Shape, Tensor,
};
use candle_nn::{Embedding, Init, Linear, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::fsdp::{Forward, FsdpModel, FsdpModelBuilder};
use crate::nn::{causal_softmax, layer_norm, linear_forward, LayerNorm};
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
/// [`causal_softmax`]; this is the mask for code that adds it to scores itself.
pub fn causal_mask(seq_len: usize, device: &Device) -> candle_core::Result<Tensor> {
    let values: Vec<f32> = (0..seq_len)
        .flat_map(|q| (0..seq_len).map(move |k| if k <= q { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Tensor::from_vec(values, (seq_len, seq_len), device)
}

/// A linear layer `y = x·Wᵀ + b` with weight `(out, in)` drawn from N(0, `std`) and a zero
/// bias (when `bias`).
fn linear(
    in_dim: usize,
    out_dim: usize,
    std: f64,
    bias: bool,
    vb: VarBuilder,
) -> candle_core::Result<Linear> {
    let w = vb.get_with_hints(
        (out_dim, in_dim),
        "weight",
        Init::Randn {
            mean: 0.0,
            stdev: std,
        },
    )?;
    let b = if bias {
        Some(vb.get_with_hints(out_dim, "bias", Init::Const(0.0))?)
    } else {
        None
    };
    Ok(Linear::new(w, b))
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
/// `q·kᵀ / √(d/h)`, normalised by [`causal_softmax`] (query `i` sees keys `j ≤ i`).
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
        let (b, t, d) = x.dims3()?;
        let (h, hd) = (self.n_head, d / self.n_head);
        // (B, T, 3d) → 3 × (B, h, T, hd)
        let qkv = apply(&self.qkv, x)?
            .reshape((b, t, 3, h, hd))?
            .permute((2, 0, 3, 1, 4))?;
        let q = qkv.get(0)?.contiguous()?;
        let k = qkv.get(1)?.contiguous()?;
        let v = qkv.get(2)?.contiguous()?;
        let scores = q.matmul(&k.t()?)?; // (B, h, T, T)
        let att = causal_softmax(&scores, 1.0 / (hd as f64).sqrt())?;
        let y = att
            .matmul(&v)? // (B, h, T, hd)
            .transpose(1, 2)?
            .reshape((b, t, d))?;
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
        apply(&self.proj, &gelu(&apply(&self.fc, x)?)?)
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
        let h = (x + self.attn.forward(&self.ln1.forward(x)?)?)?;
        &h + self.mlp.forward(&self.ln2.forward(&h)?)?
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
/// f32 scalar (logits of another dtype are widened first).
///
/// Errors: mismatched shapes; Candle's.
pub fn lm_loss(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logits = logits.flatten_to(1)?.to_dtype(DType::F32)?;
    Ok(candle_nn::loss::cross_entropy(
        &logits,
        &targets.flatten_all()?,
    )?)
}

/// GELU with the tanh approximation (GPT-2's), `x ↦ x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))`,
/// elementwise, any shape: [`Tensor::gelu`]'s values, faster. On the CPU, for f32, bf16 and f16
/// (computed in f32), the forward is one pass and its backward a second one (Candle's own
/// evaluates `tanh` per element in the forward and composes a dozen tensor ops, `powf`
/// included, in the backward: on a 2-core machine that was most of a GPT block's step).
/// Elsewhere it is [`Tensor::gelu`].
///
/// Errors: Candle's.
pub fn gelu(x: &Tensor) -> candle_core::Result<Tensor> {
    let fused = x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16);
    if fused {
        x.contiguous()?.apply_op1(GeluOp)
    } else {
        x.gelu()
    }
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_C: f32 = 0.044_715;

/// `tanh(u)` as `1 − 2 / (1 + e^{2u})`: one `exp` (faster than libm's `tanhf`), ±1 at the
/// extremes (no NaN: `e^{2u}` is ∞ or 0 there), absolute error a few f32 ulps.
#[inline]
fn tanh_fast(u: f32) -> f32 {
    1.0 - 2.0 / (1.0 + (2.0 * u).exp())
}

#[inline]
fn gelu_f32(x: f32) -> f32 {
    let t = tanh_fast(SQRT_2_OVER_PI * (x + GELU_C * x * x * x));
    0.5 * x * (1.0 + t)
}

/// d gelu / dx = (1 + t)/2 + x/2 · (1 − t²) · √(2/π) · (1 + 3 · 0.044715 x²).
#[inline]
fn gelu_grad_f32(x: f32) -> f32 {
    let t = tanh_fast(SQRT_2_OVER_PI * (x + GELU_C * x * x * x));
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x * x)
}

/// The contiguous elements of a CPU storage as a slice.
fn contiguous_slice<'a, T: candle_core::WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
) -> candle_core::Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s.as_slice::<T>()?[a..b]),
        None => bail!("gelu: the input must be contiguous"),
    }
}

/// `f` of each element, computed in f32, in the storage's dtype.
fn map_f32(
    s: &CpuStorage,
    l: &Layout,
    f: impl Fn(f32) -> f32,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let out = match s.dtype() {
        DType::F32 => CpuStorage::F32(
            contiguous_slice::<f32>(s, l)?
                .iter()
                .map(|&x| f(x))
                .collect(),
        ),
        DType::BF16 => CpuStorage::BF16(
            contiguous_slice::<half::bf16>(s, l)?
                .iter()
                .map(|&x| half::bf16::from_f32(f(x.to_f32())))
                .collect(),
        ),
        DType::F16 => CpuStorage::F16(
            contiguous_slice::<half::f16>(s, l)?
                .iter()
                .map(|&x| half::f16::from_f32(f(x.to_f32())))
                .collect(),
        ),
        dt => bail!("gelu: no CPU kernel for {dt:?}"),
    };
    Ok((out, l.shape().clone()))
}

/// The fused forward of [`gelu`].
struct GeluOp;

impl CustomOp1 for GeluOp {
    fn name(&self) -> &'static str {
        "gelu-tanh-fused"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        map_f32(s, l, gelu_f32)
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(
            arg.apply_op2_no_bwd(&grad_res.contiguous()?, &GeluGradOp)?,
        ))
    }
}

/// The backward of [`gelu`]: `grad · gelu'(x)`, inputs `(x, grad)` of one shape and dtype.
struct GeluGradOp;

impl CustomOp2 for GeluGradOp {
    fn name(&self) -> &'static str {
        "gelu-tanh-fused-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        if l1.shape() != l2.shape() || s1.dtype() != s2.dtype() {
            bail!(
                "gelu backward: input {:?} {:?} and gradient {:?} {:?} differ",
                l1.shape(),
                s1.dtype(),
                l2.shape(),
                s2.dtype()
            );
        }
        fn zip<T: candle_core::WithDType>(
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
            to: impl Fn(T) -> f32,
            from: impl Fn(f32) -> T,
        ) -> candle_core::Result<Vec<T>> {
            let (x, g) = (
                contiguous_slice::<T>(s1, l1)?,
                contiguous_slice::<T>(s2, l2)?,
            );
            Ok(x.iter()
                .zip(g)
                .map(|(&x, &g)| from(to(g) * gelu_grad_f32(to(x))))
                .collect())
        }
        let out = match s1.dtype() {
            DType::F32 => CpuStorage::F32(zip(s1, l1, s2, l2, |v: f32| v, |v| v)?),
            DType::BF16 => CpuStorage::BF16(zip(
                s1,
                l1,
                s2,
                l2,
                |v: half::bf16| v.to_f32(),
                half::bf16::from_f32,
            )?),
            DType::F16 => CpuStorage::F16(zip(
                s1,
                l1,
                s2,
                l2,
                |v: half::f16| v.to_f32(),
                half::f16::from_f32,
            )?),
            dt => bail!("gelu backward: no CPU kernel for {dt:?}"),
        };
        Ok((out, l1.shape().clone()))
    }
}
