//! The decoder's modules, each a candle-nn style constructor `(cfg, VarBuilder) -> Module` and
//! one FSDP unit or part of one: the embedding, learned positions, the blocks of both styles,
//! the final norm and the head. Every op is one of [`crate::nn`]'s differentiable kernels
//! (one graph node each on the CPU) or a Candle op.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{Init, VarBuilder};

use super::family::BlockStyle;
use super::{Activation, DecoderConfig, INIT_STD};
use crate::lora::{LoraAdapter, LoraConfig};
use crate::nn::{
    attention, attention_packed, layer_norm, linear_forward, linear_normal, rms_norm,
    segment_starts, AttentionOptions, LayerNorm, Linear, RmsNorm,
};

/// Where each token of a batch sits when a sequence packs several examples: its position id
/// (what its rotary angles, or GPT-2's learned position, are taken at) and the first position
/// of its example in the sequence (the attention sees no key before it). Built from position
/// ids that restart at 0 at each example, as transformers' packed batches
/// (`DataCollatorWithFlattening`) give them; [`crate::nn::segment_starts`] says where an
/// example starts.
#[derive(Debug, Clone)]
pub struct Positions {
    /// `(B, T)` u32 position ids.
    pub ids: Tensor,
    /// `(B, T)` u32: the first position of each token's example.
    pub starts: Tensor,
    /// The largest id.
    pub(super) max: u32,
}

impl Positions {
    /// The positions of `ids` `(B, T)` (u32 or i64, non-negative).
    ///
    /// Errors: `ids` not 2-D integers, a negative id; Candle's.
    pub fn new(ids: &Tensor) -> candle_core::Result<Self> {
        let (b, t) = ids.dims2()?;
        let flat = ids.to_dtype(DType::I64)?.flatten_all()?.to_vec1::<i64>()?;
        if let Some(i) = flat
            .iter()
            .position(|&p| !(0..=u32::MAX as i64).contains(&p))
        {
            candle_core::bail!(
                "position id {} at ({}, {}) is outside 0 ..= {}",
                flat[i],
                i / t.max(1),
                i % t.max(1),
                u32::MAX
            )
        }
        let flat: Vec<u32> = flat.into_iter().map(|p| p as u32).collect();
        Ok(Self {
            max: flat.iter().copied().max().unwrap_or(0),
            ids: Tensor::from_vec(flat, (b, t), ids.device())?,
            starts: segment_starts(ids)?,
        })
    }

    /// The rotary tables at these positions, `(B, T, head_dim)` each, gathered from `table`
    /// (`(n, head_dim)`, `n` > every id).
    pub(super) fn gather(&self, table: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t) = self.ids.dims2()?;
        let hd = table.dim(1)?;
        table
            .index_select(&self.ids.flatten_all()?, 0)?
            .reshape((b, t, hd))
    }
}

/// A norm of the family: RMSNorm (`x / √(mean(x²) + eps) · w`; with Gemma's offset `· (1 +
/// w)`, `w` stored as the offset and initialised 0) or GPT-2's LayerNorm with a bias.
/// Parameters `weight` `(D,)` (and `bias` for LayerNorm).
#[derive(Debug, Clone)]
pub struct Norm {
    pub(super) inner: NormKind,
}

#[derive(Debug, Clone)]
pub(super) enum NormKind {
    Rms(RmsNorm),
    /// `(1 + w)`: the stored offset and epsilon.
    RmsOffset(Tensor, f64),
    Layer(LayerNorm),
}

impl Norm {
    /// The family's norm of width `size` under `vb`.
    pub fn new(cfg: &DecoderConfig, size: usize, vb: VarBuilder) -> candle_core::Result<Self> {
        let table = cfg.table();
        let inner = if table.style == BlockStyle::Gpt2 {
            NormKind::Layer(layer_norm(size, cfg.norm_eps, vb)?)
        } else if table.norm_offset {
            let w = vb.get_with_hints(size, "weight", Init::Const(0.0))?;
            NormKind::RmsOffset(w, cfg.norm_eps)
        } else {
            NormKind::Rms(rms_norm(size, cfg.norm_eps, vb)?)
        };
        Ok(Self { inner })
    }
}

impl Module for Norm {
    /// Normalises `x` `(…, D)` over its last dimension.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match &self.inner {
            NormKind::Rms(n) => n.forward(x),
            NormKind::Layer(n) => n.forward(x),
            // Gemma's `x̂ · (1 + w)`: the scale formed in the graph, so `w`'s gradient is the
            // scale's.
            NormKind::RmsOffset(w, eps) => RmsNorm::new(w.affine(1.0, 1.0)?, *eps).forward(x),
        }
    }
}

/// The token embedding: ids `(B, T)` u32 → `(B, T, d)`, parameter `weight` `(V, d)` N(0,
/// 0.02); times `√d` rounded to the output's dtype for Gemma (transformers' `normalizer`). With
/// a `pad_token_id`, the lookups of that row send no gradient (transformers' `padding_idx`):
/// the looked-up rows at its positions are detached, `O(B·T·d)`.
#[derive(Debug, Clone)]
pub struct Embedding {
    table: candle_nn::Embedding,
    scale: Option<f64>,
    pad: Option<u32>,
}

impl Module for Embedding {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = self.table.forward(ids)?;
        if let Some(p) = self.pad {
            let at_pad = ids.eq(p)?.unsqueeze(D::Minus1)?.broadcast_as(h.shape())?;
            h = at_pad.where_cond(&h.detach(), &h)?;
        }
        match self.scale {
            None => Ok(h),
            // transformers: torch.tensor(hidden_size ** 0.5, dtype=hidden_states.dtype),
            // rounded here on the host (no device round trip in the step).
            Some(s) => h.affine(round_to(s, h.dtype()), 0.0),
        }
    }
}

/// `v` rounded to `dtype` (nearest even), as a tensor of that dtype would hold it.
fn round_to(v: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F32 => v as f32 as f64,
        DType::BF16 => half::bf16::from_f64(v).to_f64(),
        DType::F16 => half::f16::from_f64(v).to_f64(),
        _ => v,
    }
}

/// The token embedding of `cfg` under `vb` ([`Embedding`]).
pub fn token_embedding(cfg: &DecoderConfig, vb: VarBuilder) -> candle_core::Result<Embedding> {
    let w = vb.get_with_hints(
        (cfg.vocab_size, cfg.hidden_size),
        "weight",
        Init::Randn {
            mean: 0.0,
            stdev: INIT_STD,
        },
    )?;
    Ok(Embedding {
        table: candle_nn::Embedding::new(w, cfg.hidden_size),
        scale: cfg
            .table()
            .embed_scale
            .then(|| (cfg.hidden_size as f64).sqrt()),
        pad: cfg.pad_token_id,
    })
}

/// GPT-2's learned positions `transformer.wpe`: positions `(T,)` u32 → `(T, d)`, parameter
/// `weight` `(n_positions, d)` N(0, 0.02).
pub fn positions(cfg: &DecoderConfig, vb: VarBuilder) -> candle_core::Result<candle_nn::Embedding> {
    let w = vb.get_with_hints(
        (cfg.max_position_embeddings, cfg.hidden_size),
        "weight",
        Init::Randn {
            mean: 0.0,
            stdev: INIT_STD,
        },
    )?;
    Ok(candle_nn::Embedding::new(w, cfg.hidden_size))
}

/// The final norm ([`Norm`], parameters `weight` (and GPT-2's `bias`) `(d,)`).
pub fn final_norm(cfg: &DecoderConfig, vb: VarBuilder) -> candle_core::Result<Norm> {
    Norm::new(cfg, cfg.hidden_size, vb)
}

/// The LM head: `(B, T, d)` → logits `(B, T, V)`, no bias, parameter `weight` `(V, d)` (tied:
/// built under the embedding's prefix, where it is the embedding's table); logits soft-capped
/// `c·tanh(z/c)` with Gemma 2's `final_logit_softcapping`.
#[derive(Debug, Clone)]
pub struct Head {
    linear: Linear,
    softcap: Option<f64>,
}

impl Module for Head {
    fn forward(&self, h: &Tensor) -> candle_core::Result<Tensor> {
        let z = self.linear.forward(h)?;
        match self.softcap {
            None => Ok(z),
            Some(c) => z.affine(1.0 / c, 0.0)?.tanh()?.affine(c, 0.0),
        }
    }
}

/// The LM head of `cfg` under `vb` ([`Head`]).
pub fn lm_head(cfg: &DecoderConfig, vb: VarBuilder) -> candle_core::Result<Head> {
    Ok(Head {
        linear: linear_normal(cfg.hidden_size, cfg.vocab_size, INIT_STD, false, vb)?,
        softcap: cfg.final_logit_softcapping,
    })
}

/// The rotary tables of positions `0..t`: `(cos, sin)`, each `(t, head_dim)` f32, the
/// frequencies `θ_i = rope_theta^(−2i/head_dim)` (scaled by
/// [`super::Llama3RopeScaling::scale`] when the config has one) repeated twice along the head
/// (transformers' rotary embedding, "rotate half" form; angles computed in f64, rounded once).
pub fn rope_tables(
    cfg: &DecoderConfig,
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

/// A projection of the family: `Linear` (weight `(out, in)`) or GPT-2's `Conv1D` (weight `(in,
/// out)`, read through a transposed view by the same one-node kernel, no copy).
#[derive(Debug, Clone)]
pub(super) struct Proj {
    pub(super) weight: Tensor,
    pub(super) bias: Option<Tensor>,
    conv1d: bool,
    /// A LoRA adapter (`lora_A`, `lora_B` under the projection) when the run's LoRA config
    /// targets it.
    pub(super) lora: Option<LoraAdapter>,
}

impl Proj {
    /// A projection whose weight starts at N(0, 0.02).
    fn new(
        cfg: &DecoderConfig,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
        lora: Option<&LoraConfig>,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        Self::with_std(cfg, (in_dim, out_dim), bias, lora, INIT_STD, vb)
    }

    /// GPT-2's residual projections (both `c_proj`): N(0, 0.02/√(2L)) (Radford et al. 2019,
    /// §2.3; transformers' `GPT2PreTrainedModel._init_weights`).
    fn residual(
        cfg: &DecoderConfig,
        in_dim: usize,
        out_dim: usize,
        lora: Option<&LoraConfig>,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        let stdev = INIT_STD / (2.0 * cfg.num_hidden_layers as f64).sqrt();
        Self::with_std(cfg, (in_dim, out_dim), true, lora, stdev, vb)
    }

    fn with_std(
        cfg: &DecoderConfig,
        (in_dim, out_dim): (usize, usize),
        bias: bool,
        lora: Option<&LoraConfig>,
        stdev: f64,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        let conv1d = cfg.table().style == BlockStyle::Gpt2;
        let shape = if conv1d {
            (in_dim, out_dim)
        } else {
            (out_dim, in_dim)
        };
        let weight = vb.get_with_hints(shape, "weight", Init::Randn { mean: 0.0, stdev })?;
        let bias = if bias {
            Some(vb.get_with_hints(out_dim, "bias", Init::Const(0.0))?)
        } else {
            None
        };
        Ok(Self {
            lora: LoraAdapter::for_module(in_dim, out_dim, lora, &vb)?,
            weight,
            bias,
            conv1d,
        })
    }
}

impl Module for Proj {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let w = if self.conv1d {
            self.weight.t()?
        } else {
            self.weight.clone()
        };
        let y = linear_forward(x, &w, self.bias.as_ref())?;
        match &self.lora {
            Some(a) => y + a.forward(x)?,
            None => Ok(y),
        }
    }
}

/// The query, key and value projections: separate, or one fused tensor split after the
/// matmul (Phi-3's `qkv_proj`, GPT-2's `c_attn`).
#[derive(Debug, Clone)]
pub(super) enum Qkv {
    Separate { q: Proj, k: Proj, v: Proj },
    Fused(Proj),
}

/// Self-attention `self_attn` (GPT-2: `attn`): `(B, T, d)` → `(B, T, d)`. Parameters: `q_proj`
/// `(h·hd, d)`, `k_proj`, `v_proj` `(kv·hd, d)` (Phi-3: `qkv_proj` `((h + 2·kv)·hd, d)`; GPT-2:
/// `c_attn` `(d, 3d)`), `o_proj` `(d, h·hd)` (GPT-2: `c_proj` `(d, d)`), biases as the config
/// says, Qwen3's `q_norm`, `k_norm` `(hd,)`. Queries and keys rotated (not GPT-2), then
/// [`crate::nn::attention`] with the layer's window, the soft-cap and the scale.
#[derive(Debug, Clone)]
pub struct Attention {
    pub(super) qkv: Qkv,
    pub(super) o: Proj,
    pub(super) q_norm: Option<Norm>,
    pub(super) k_norm: Option<Norm>,
    pub(super) opts: AttentionOptions,
    pub(super) hd: usize,
    pub(super) rope: Option<DecoderConfig>,
    /// The rotary tables of the last context length and device (computed once, not every
    /// forward: the step's contexts repeat).
    tables: Arc<Mutex<Option<RopeTables>>>,
}

/// `(t, device, cos, sin)` of [`rope_tables`].
type RopeTables = (usize, candle_core::DeviceLocation, Tensor, Tensor);

impl Attention {
    /// The attention of layer `layer` of `cfg` under `vb`.
    pub fn new(cfg: &DecoderConfig, layer: usize, vb: VarBuilder) -> candle_core::Result<Self> {
        Self::with_lora(cfg, layer, None, vb)
    }

    /// [`Attention::new`] with the projections `lora` targets adapted.
    pub fn with_lora(
        cfg: &DecoderConfig,
        layer: usize,
        lora: Option<&LoraConfig>,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        let table = cfg.table();
        let (d, hd) = (cfg.hidden_size, cfg.head_dim);
        let (h, kv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let gpt2 = table.style == BlockStyle::Gpt2;
        let qkv = if gpt2 {
            Qkv::Fused(Proj::new(cfg, d, 3 * d, true, lora, vb.pp("c_attn"))?)
        } else if table.fused_qkv {
            Qkv::Fused(Proj::new(
                cfg,
                d,
                (h + 2 * kv) * hd,
                cfg.qkv_bias,
                lora,
                vb.pp("qkv_proj"),
            )?)
        } else {
            Qkv::Separate {
                q: Proj::new(cfg, d, h * hd, cfg.qkv_bias, lora, vb.pp("q_proj"))?,
                k: Proj::new(cfg, d, kv * hd, cfg.qkv_bias, lora, vb.pp("k_proj"))?,
                v: Proj::new(cfg, d, kv * hd, cfg.qkv_bias, lora, vb.pp("v_proj"))?,
            }
        };
        let o = if gpt2 {
            Proj::residual(cfg, h * hd, d, lora, vb.pp("c_proj"))?
        } else {
            Proj::new(cfg, h * hd, d, cfg.o_bias, lora, vb.pp("o_proj"))?
        };
        let (q_norm, k_norm) = if cfg.qk_norm {
            (
                Some(Norm::new(cfg, hd, vb.pp("q_norm"))?),
                Some(Norm::new(cfg, hd, vb.pp("k_norm"))?),
            )
        } else {
            (None, None)
        };
        let opts = AttentionOptions {
            n_head: h,
            n_kv_head: kv,
            scale: cfg.query_pre_attn_scalar.map(|s| s.powf(-0.5)),
            window: cfg.window_of(layer),
            softcap: cfg.attn_logit_softcapping,
        };
        Ok(Self {
            qkv,
            o,
            q_norm,
            k_norm,
            opts,
            hd,
            rope: (!gpt2).then(|| cfg.clone()),
            tables: Arc::default(),
        })
    }
}

impl Attention {
    /// [`rope_tables`] of `t` positions on `device`, from the cache when the last call had the
    /// same context and device.
    pub(super) fn tables(
        &self,
        cfg: &DecoderConfig,
        t: usize,
        device: &Device,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let mut cache = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((ct, loc, cos, sin)) = cache.as_ref() {
            if *ct == t && *loc == device.location() {
                return Ok((cos.clone(), sin.clone()));
            }
        }
        let (cos, sin) = rope_tables(cfg, t, device)?;
        *cache = Some((t, device.location(), cos.clone(), sin.clone()));
        Ok((cos, sin))
    }
}

impl Module for Attention {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_at(x, None)
    }
}

impl Attention {
    /// The rotary tables `(cos, sin)` of a batch: `(T, head_dim)` for positions `0..T`, or
    /// `(B, T, head_dim)` at `pos`' ids.
    pub(super) fn tables_at(
        &self,
        cfg: &DecoderConfig,
        t: usize,
        pos: Option<&Positions>,
        device: &Device,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        match pos {
            None => self.tables(cfg, t, device),
            Some(p) => {
                let (cos, sin) = self.tables(cfg, t.max(p.max as usize + 1), device)?;
                Ok((p.gather(&cos)?, p.gather(&sin)?))
            }
        }
    }

    /// The attention's output `(B, T, d)` of `x` `(B, T, d)`, its tokens at `pos` (packed
    /// examples) or at `0..T`.
    ///
    /// Errors: `pos` not `(B, T)`; Candle's.
    pub fn forward_at(&self, x: &Tensor, pos: Option<&Positions>) -> candle_core::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (h, kv, hd) = (self.opts.n_head, self.opts.n_kv_head, self.hd);
        let attend = |qkv: &Tensor| match pos {
            None => attention(qkv, &self.opts),
            Some(p) => attention_packed(qkv, &self.opts, &p.starts),
        };
        let (q, k, v) = match &self.qkv {
            Qkv::Fused(p) => {
                let qkv = p.forward(x)?;
                if self.rope.is_none() && self.q_norm.is_none() {
                    // GPT-2: the fused projection is already the kernel's layout.
                    return self.o.forward(&attend(&qkv)?);
                }
                (
                    qkv.narrow(2, 0, h * hd)?,
                    qkv.narrow(2, h * hd, kv * hd)?,
                    qkv.narrow(2, (h + kv) * hd, kv * hd)?,
                )
            }
            Qkv::Separate { q, k, v } => (q.forward(x)?, k.forward(x)?, v.forward(x)?),
        };
        let mut q = q.reshape((b, t, h, hd))?;
        let mut k = k.reshape((b, t, kv, hd))?;
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        if let Some(cfg) = &self.rope {
            let (cos, sin) = self.tables_at(cfg, t, pos, x.device())?;
            q = crate::nn::rope(&q, &cos, &sin)?;
            k = crate::nn::rope(&k, &cos, &sin)?;
        }
        // Key/value head j serves query heads j·rep .. (j+1)·rep (transformers' repeat_kv),
        // read in place by the kernel.
        let qkv = Tensor::cat(
            &[
                q.reshape((b, t, h * hd))?,
                k.reshape((b, t, kv * hd))?,
                v.reshape((b, t, kv * hd))?,
            ],
            2,
        )?;
        self.o.forward(&attend(&qkv)?)
    }
}

/// The MLP `mlp`: gated, `down_proj(act(gate_proj(x)) ⊙ up_proj(x))` (SwiGLU with SiLU, GeGLU
/// with the tanh GELU; Phi-3's fused `gate_up_proj` `(2·I, d)`, gate rows first); GPT-2's
/// `c_proj(gelu(c_fc(x)))`.
#[derive(Debug, Clone)]
pub struct Mlp {
    pub(super) kind: MlpKind,
    pub(super) act: Activation,
}

#[derive(Debug, Clone)]
pub(super) enum MlpKind {
    Gated { gate: Proj, up: Proj, down: Proj },
    GatedFused { gate_up: Proj, down: Proj, i: usize },
    Plain { fc: Proj, proj: Proj },
}

impl Mlp {
    /// The MLP of `cfg` under `vb`.
    pub fn new(cfg: &DecoderConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        Self::with_lora(cfg, None, vb)
    }

    /// [`Mlp::new`] with the projections `lora` targets adapted.
    pub fn with_lora(
        cfg: &DecoderConfig,
        lora: Option<&LoraConfig>,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        let table = cfg.table();
        let (d, i, bias) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
        let kind = if table.style == BlockStyle::Gpt2 {
            MlpKind::Plain {
                fc: Proj::new(cfg, d, i, true, lora, vb.pp("c_fc"))?,
                proj: Proj::residual(cfg, i, d, lora, vb.pp("c_proj"))?,
            }
        } else if table.fused_gate_up {
            MlpKind::GatedFused {
                gate_up: Proj::new(cfg, d, 2 * i, bias, lora, vb.pp("gate_up_proj"))?,
                down: Proj::new(cfg, i, d, bias, lora, vb.pp("down_proj"))?,
                i,
            }
        } else {
            MlpKind::Gated {
                gate: Proj::new(cfg, d, i, bias, lora, vb.pp("gate_proj"))?,
                up: Proj::new(cfg, d, i, bias, lora, vb.pp("up_proj"))?,
                down: Proj::new(cfg, i, d, bias, lora, vb.pp("down_proj"))?,
            }
        };
        Ok(Self {
            kind,
            act: cfg.activation,
        })
    }

    fn act(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self.act {
            Activation::Silu => x.silu(),
            Activation::GeluTanh => crate::nn::gelu(x),
        }
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match &self.kind {
            MlpKind::Gated { gate, up, down } => {
                down.forward(&(self.act(&gate.forward(x)?)? * up.forward(x)?)?)
            }
            MlpKind::GatedFused { gate_up, down, i } => {
                let gu = gate_up.forward(x)?;
                let g = self.act(&gu.narrow(2, 0, *i)?)?;
                down.forward(&(g * gu.narrow(2, *i, *i)?)?)
            }
            MlpKind::Plain { fc, proj } => proj.forward(&self.act(&fc.forward(x)?)?),
        }
    }
}

/// One decoder block (one FSDP unit), `(B, T, d)` → `(B, T, d)`:
///
/// ```text
/// Llama style:   h = x + attn(input_layernorm(x));     h + mlp(post_attention_layernorm(h))
/// Gemma 2:       h = x + post_attention_layernorm(attn(input_layernorm(x)))
///                h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
/// GPT-2:         h = x + attn(ln_1(x));                 h + mlp(ln_2(h))
/// ```
#[derive(Debug, Clone)]
pub struct Block {
    pub(super) norm1: Norm,
    pub(super) attn: Attention,
    /// Gemma 2's norm of the attention's output.
    pub(super) post_attn: Option<Norm>,
    pub(super) norm2: Norm,
    pub(super) mlp: Mlp,
    /// Gemma 2's norm of the MLP's output.
    pub(super) post_mlp: Option<Norm>,
}

impl Block {
    /// Whether a projection of the block carries a LoRA adapter.
    pub(super) fn has_lora(&self) -> bool {
        let attn = match &self.attn.qkv {
            Qkv::Separate { q, k, v } => [q, k, v].iter().any(|p| p.lora.is_some()),
            Qkv::Fused(p) => p.lora.is_some(),
        };
        let mlp = match &self.mlp.kind {
            MlpKind::Gated { gate, up, down } => [gate, up, down].iter().any(|p| p.lora.is_some()),
            MlpKind::GatedFused { gate_up, down, .. } => {
                gate_up.lora.is_some() || down.lora.is_some()
            }
            MlpKind::Plain { fc, proj } => fc.lora.is_some() || proj.lora.is_some(),
        };
        attn || mlp || self.attn.o.lora.is_some()
    }

    /// Block `layer` of `cfg` under `vb` (its names: the family's).
    pub fn new(cfg: &DecoderConfig, layer: usize, vb: VarBuilder) -> candle_core::Result<Self> {
        Self::with_lora(cfg, layer, None, vb)
    }

    /// [`Block::new`] with the projections `lora` targets adapted ([`crate::lora`]).
    pub fn with_lora(
        cfg: &DecoderConfig,
        layer: usize,
        lora: Option<&LoraConfig>,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        let table = cfg.table();
        let d = cfg.hidden_size;
        if table.style == BlockStyle::Gpt2 {
            return Ok(Self {
                norm1: Norm::new(cfg, d, vb.pp("ln_1"))?,
                attn: Attention::with_lora(cfg, layer, lora, vb.pp("attn"))?,
                post_attn: None,
                norm2: Norm::new(cfg, d, vb.pp("ln_2"))?,
                mlp: Mlp::with_lora(cfg, lora, vb.pp("mlp"))?,
                post_mlp: None,
            });
        }
        let norm1 = Norm::new(cfg, d, vb.pp("input_layernorm"))?;
        let attn = Attention::with_lora(cfg, layer, lora, vb.pp("self_attn"))?;
        let (post_attn, norm2, post_mlp) = if table.sandwich_norms {
            (
                Some(Norm::new(cfg, d, vb.pp("post_attention_layernorm"))?),
                Norm::new(cfg, d, vb.pp("pre_feedforward_layernorm"))?,
                Some(Norm::new(cfg, d, vb.pp("post_feedforward_layernorm"))?),
            )
        } else {
            (
                None,
                Norm::new(cfg, d, vb.pp("post_attention_layernorm"))?,
                None,
            )
        };
        Ok(Self {
            norm1,
            attn,
            post_attn,
            norm2,
            mlp: Mlp::with_lora(cfg, lora, vb.pp("mlp"))?,
            post_mlp,
        })
    }
}

impl Block {
    /// The block's composed layers (plain Candle ops) on `x` `(B, T, d)` at `pos`: the
    /// reference of the fused node and the path wherever it does not apply. The block's
    /// `Module` / `UnitModule` forward (`Block::forward_at`, in `super::fused`) checks `pos` and
    /// runs the node inside the runtime's training calls, this elsewhere.
    pub fn forward_composed(
        &self,
        x: &Tensor,
        pos: Option<&Positions>,
    ) -> candle_core::Result<Tensor> {
        let mut a = self.attn.forward_at(&self.norm1.forward(x)?, pos)?;
        if let Some(n) = &self.post_attn {
            a = n.forward(&a)?;
        }
        let h = (x + a)?;
        let mut m = self.mlp.forward(&self.norm2.forward(&h)?)?;
        if let Some(n) = &self.post_mlp {
            m = n.forward(&m)?;
        }
        h + m
    }
}
