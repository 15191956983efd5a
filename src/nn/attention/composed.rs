//! [`super::attention`] composed of Candle ops: the `(B, n_head, T, T)` scores materialised,
//! Candle's autograd differentiating them; any dtype and device. The reference of the kernel
//! in the tests, and what other dtypes and devices run.

use candle_core::{Device, Result, Tensor, D};

use super::{check, starts_of, AttentionOptions};
use crate::nn::softmax::causal_softmax;

/// [`attention`](super::attention) composed of Candle ops: split `qkv` into `(B, n_head, T, hd)` queries and
/// keys and values repeated to `n_head` heads (transformers' `repeat_kv`), `U = scale · Q·Kᵀ`,
/// then either [`causal_softmax`] (no soft-cap, no window shorter than `T`) or `c · tanh(U / c)`
/// when soft-capped, plus a `(T, T)` mask (0 where `i − W < j ≤ i`, −∞ elsewhere) and
/// `candle_nn::ops::softmax`; then `·V` and the heads merged back to `(B, T, n_head·hd)`. The
/// `(B, n_head, T, T)` scores are materialised. Candle's autograd differentiates it; any dtype
/// and device. The reference of [`attention`](super::attention)'s kernel in the tests.
///
/// Errors: as [`attention`](super::attention).
pub fn attention_composed(qkv: &Tensor, opts: &AttentionOptions) -> Result<Tensor> {
    composed_in(qkv, opts, None)
}

/// [`attention_packed`](super::attention_packed) composed of Candle ops, as [`attention_composed`] with a `(B, 1, T, T)`
/// mask that also hides the keys of other examples. Any dtype and device.
///
/// Errors: as [`attention_packed`](super::attention_packed).
pub fn attention_packed_composed(
    qkv: &Tensor,
    opts: &AttentionOptions,
    starts: &Tensor,
) -> Result<Tensor> {
    let (b, t, _) = check(qkv, opts)?;
    composed_in(qkv, opts, Some(&starts_of(starts, b, t)?))
}

/// [`attention_composed`] with the segment starts (`B·T`, checked) when given.
pub(super) fn composed_in(
    qkv: &Tensor,
    opts: &AttentionOptions,
    starts: Option<&[u32]>,
) -> Result<Tensor> {
    let (b, t, hd) = check(qkv, opts)?;
    let (n_head, n_kv_head) = (opts.n_head, opts.n_kv_head);
    let (d, dkv) = (n_head * hd, n_kv_head * hd);
    if b == 0 || t == 0 {
        // No position, no score (Candle's softmax refuses an empty reduction): the result is
        // the empty `(B, T, d)`, still a node of the graph.
        return qkv.narrow(2, 0, d);
    }
    let rep = n_head / n_kv_head;
    let heads = |z: Tensor, n: usize| z.reshape((b, t, n, hd))?.transpose(1, 2)?.contiguous();
    let repeat = |z: Tensor| -> Result<Tensor> {
        let z = z.reshape((b, t, n_kv_head, 1, hd))?;
        let z = z.broadcast_as((b, t, n_kv_head, rep, hd))?.contiguous()?;
        heads(z.reshape((b, t, d))?, n_head)
    };
    let q = heads(qkv.narrow(2, 0, d)?, n_head)?;
    let k = repeat(qkv.narrow(2, d, dkv)?)?;
    let v = repeat(qkv.narrow(2, d + dkv, dkv)?)?;
    let scores = q.matmul(&k.t()?)?; // (B, h, T, T)
    let scale = opts.scale.unwrap_or(1.0 / (hd as f64).sqrt());
    let window = opts.window.filter(|&w| w < t);
    let att = if opts.softcap.is_none() && window.is_none() && starts.is_none() {
        causal_softmax(&scores, scale)?
    } else {
        let z = match opts.softcap {
            None => (scores * scale)?,
            Some(c) => ((scores * (scale / c))?.tanh()? * c)?,
        };
        let mask = window_mask(b, t, window, starts, qkv.device())?.to_dtype(z.dtype())?;
        candle_nn::ops::softmax(&z.broadcast_add(&mask)?, D::Minus1)?
    };
    att.matmul(&v)? // (B, h, T, hd)
        .transpose(1, 2)?
        .reshape((b, t, d))
}

/// The f32 mask of query `i` (rows) and key `j` (columns): 0 where `j ≤ i` and, with a
/// window `W`, `j > i − W`, and with segment starts `S` (`B·T`), `j ≥ S(i)`; −∞ elsewhere.
/// `(T, T)` without starts, `(B, 1, T, T)` with them.
fn window_mask(
    b: usize,
    t: usize,
    window: Option<usize>,
    starts: Option<&[u32]>,
    device: &Device,
) -> Result<Tensor> {
    let seen = |i: usize, j: usize| j <= i && window.is_none_or(|w| j + w > i);
    let Some(starts) = starts else {
        let mask: Vec<f32> = (0..t)
            .flat_map(|i| (0..t).map(move |j| if seen(i, j) { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        return Tensor::from_vec(mask, (t, t), device);
    };
    let mut mask = Vec::with_capacity(b * t * t);
    for row in starts.chunks(t.max(1)).take(b) {
        for (i, &s) in row.iter().enumerate() {
            let s = s as usize;
            mask.extend((0..t).map(|j| {
                if seen(i, j) && j >= s {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            }));
        }
    }
    Tensor::from_vec(mask, (b, 1, t, t), device)
}

/// [`causal_attention`](super::causal_attention) composed of Candle ops: [`attention_composed`] with
/// `AttentionOptions::new(n_head, n_head)`. Any dtype and device.
///
/// Errors: as [`causal_attention`](super::causal_attention).
pub fn causal_attention_composed(qkv: &Tensor, n_head: usize) -> Result<Tensor> {
    causal_attention_gqa_composed(qkv, n_head, n_head)
}

/// [`causal_attention_gqa`](super::causal_attention_gqa) composed of Candle ops: [`attention_composed`] with
/// `AttentionOptions::new(n_head, n_kv_head)`. Any dtype and device.
///
/// Errors: as [`causal_attention_gqa`](super::causal_attention_gqa).
pub fn causal_attention_gqa_composed(
    qkv: &Tensor,
    n_head: usize,
    n_kv_head: usize,
) -> Result<Tensor> {
    attention_composed(qkv, &AttentionOptions::new(n_head, n_kv_head))
}
