//! GPT-2's style of the decoder block (LayerNorm with biases, fused `c_attn`, `Conv1D` weights,
//! GELU(tanh), learned positions) as the GPT's one node ([`crate::models::gpt2_block`]).

use candle_core::{Result, Tensor};

use crate::models::decoder::layers::{Block, MlpKind, NormKind, Qkv};
use crate::models::decoder::Activation;
use crate::models::gpt2_block::{gpt_block, GptBlockParams};

/// GPT-2's block (no rotary tables: learned positions) as the GPT's one node
/// ([`crate::models::gpt2_block`]) over its `Conv1D` weights, or `None` for a layout it does
/// not cover.
pub(super) fn gpt2(blk: &Block, x: &Tensor) -> Result<Option<Tensor>> {
    if blk.has_lora() {
        // The GPT-2 node takes no adapters yet: the adapted block composes.
        return Ok(None);
    }
    let (NormKind::Layer(n1), NormKind::Layer(n2)) = (&blk.norm1.inner, &blk.norm2.inner) else {
        return Ok(None);
    };
    let (Qkv::Fused(qkv), MlpKind::Plain { fc, proj }) = (&blk.attn.qkv, &blk.mlp.kind) else {
        return Ok(None);
    };
    let o = &blk.attn.o;
    let (Some(b1), Some(b2), Some(bq), Some(bo), Some(bf), Some(bp)) = (
        n1.bias(),
        n2.bias(),
        qkv.bias.as_ref(),
        o.bias.as_ref(),
        fc.bias.as_ref(),
        proj.bias.as_ref(),
    ) else {
        return Ok(None);
    };
    let opts = blk.attn.opts;
    let plain = opts.n_kv_head == opts.n_head
        && opts.scale.is_none()
        && opts.window.is_none()
        && opts.softcap.is_none()
        && blk.post_attn.is_none()
        && blk.post_mlp.is_none()
        && n1.remove_mean()
        && n2.remove_mean()
        && n1.eps() == n2.eps()
        && blk.mlp.act == Activation::GeluTanh;
    if !plain {
        return Ok(None);
    }
    let params = GptBlockParams {
        tensors: [
            n1.weight(),
            b1,
            &qkv.weight,
            bq,
            &o.weight,
            bo,
            n2.weight(),
            b2,
            &fc.weight,
            bf,
            &proj.weight,
            bp,
        ],
        n_head: opts.n_head,
        eps: n1.eps(),
        conv1d: true,
    };
    gpt_block(x, &params)
}
