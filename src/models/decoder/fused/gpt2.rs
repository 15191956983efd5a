//! GPT-2's style of the decoder block (LayerNorm with biases, fused `c_attn`, `Conv1D`
//! weights, GELU(tanh), learned positions; the GPT example's model and Hugging Face's GPT-2)
//! as one graph node inside the FSDP runtime: [`gpt2`] maps a [`Block`] onto it, [`gpt_block`]
//! runs it over weights `(out, in)` or, `conv1d`, Hugging Face's `Conv1D` `(in, out)`.
//!
//! ```text
//! h   = x + (attn(ln1(x)) · W_projᵀ + b_proj)        attn: causal multi-head over ln1(x)·W_qkvᵀ + b_qkv
//! out = h + (gelu(ln2(h) · W_fcᵀ + b_fc) · W_mpᵀ + b_mp)
//! ```
//!
//! Composed of the one-node layers ([`crate::nn::layer_norm`], [`crate::nn::linear_forward`],
//! [`crate::nn::causal_attention`], [`crate::nn::linear_gelu`]) and two residual additions, a block is
//! nine graph nodes and twenty-one node inputs: Candle's backward keeps a zero-filled
//! gradient accumulator for each and adds every gradient into it, about 45 MB of extra memory
//! traffic a block at the benchmark's shapes, and the residual additions are two more passes.
//! This node runs the same kernels ([`crate::nn::kernels`]: norms, the `gemm` crate, attention,
//! GELU) in one forward and one backward that hand the intermediate
//! gradients from kernel to kernel directly, and fold each residual addition and bias into its
//! projection's gemm (the gemm accumulates into a buffer holding `x + b`), or into the pass that
//! reads the projection's output anyway: the MLP's first bias into the GELU, the `qkv` bias into
//! the attention kernel's gathers.
//!
//! Its only graph input is `x`: the twelve parameters' gradients go to the runtime's sink
//! ([`crate::fsdp::fused`]), so the node exists only while a unit's training forward is armed
//! ([`gpt_block`] returns `None` otherwise, and the model composes the layers). The backward
//! reads the parameters as they are then (the runtime has refilled them), as every other node
//! does.

use std::sync::Mutex;

use candle_core::{
    bail, CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Storage, Tensor,
};

use crate::cpu::{filled, gemm_f32, with_simd};
use crate::fsdp::fused as grad_sink;
use crate::models::decoder::layers::{Block, MlpKind, NormKind, Qkv};
use crate::models::decoder::Activation;
use crate::nn::kernels::{
    add_assign as add_into, attention_backward, attention_forward, broadcast_rows as rows_plus,
    col_sums, gelu_tanh, gelu_tanh_grad, norm_backward, norm_forward, AttentionOptions,
    AttentionShape,
};

/// GPT-2's block (no rotary tables: learned positions) as the GPT's one node
/// ([`crate::models::decoder`]) over its `Conv1D` weights, or `None` for a layout it does
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

/// The parameters of one block, in [`gpt_block`]'s order: `ln1` weight and bias `(d,)`, `qkv`
/// weight `(3d, d)` and bias `(3d,)`, attention projection `(d, d)` and `(d,)`, `ln2` `(d,)`
/// twice, MLP `fc` `(k, d)` and `(k,)`, MLP projection `(d, k)` and `(d,)` — or, with
/// `conv1d`, the four weights transposed, `(in, out)` (GPT-2's `Conv1D`, as Hugging Face stores
/// them): `(d, 3d)`, `(d, d)`, `(d, k)`, `(k, d)`.
pub(super) struct GptBlockParams<'a> {
    /// The twelve parameter tensors, in the order above.
    pub tensors: [&'a Tensor; 12],
    /// Attention heads (dividing `d`).
    pub n_head: usize,
    /// Epsilon of both layer norms.
    pub eps: f64,
    /// The weights are `(in, out)` (`Conv1D`), read and differentiated in that layout.
    pub conv1d: bool,
}

/// The block applied to `x` `(B, T, d)` as one node inside an armed unit forward
/// ([`grad_sink::armed`]) when `x` carries a gradient; its forward alone when neither `x` nor a
/// parameter carries one (an activation-checkpointed forward, evaluation: the same values as
/// the node's); or `None` where the caller must compose the layers: autograd outside an armed
/// forward, anything but f32 on the CPU, non-contiguous parameters, an empty batch.
///
/// Errors: parameters whose shapes do not fit `x` and each other.
pub(super) fn gpt_block(x: &Tensor, p: &GptBlockParams<'_>) -> Result<Option<Tensor>> {
    let Some(fusion) = grad_sink::fusion(x, p.tensors) else {
        return Ok(None);
    };
    let applies = x.device().is_cpu()
        && x.dtype() == DType::F32
        && x.rank() == 3
        && x.elem_count() > 0
        && p.tensors
            .iter()
            .all(|t| t.device().is_cpu() && t.dtype() == DType::F32 && t.is_contiguous());
    if !applies {
        return Ok(None);
    }
    let d = x.dim(2)?;
    let k = p.tensors[9].dim(0)?;
    for (i, (t, w)) in p
        .tensors
        .iter()
        .zip(param_shapes(d, k, p.conv1d))
        .enumerate()
    {
        if t.dims() != w.as_slice() {
            bail!(
                "gpt block: parameter {i} is {:?}, expected {w:?} for an input {:?}",
                t.shape(),
                x.shape()
            )
        }
    }
    if p.n_head == 0 || !d.is_multiple_of(p.n_head) {
        bail!("gpt block: n_head {} must divide d {d}", p.n_head)
    }
    let op = BlockOp {
        params: p.tensors.map(Tensor::clone),
        n_head: p.n_head,
        eps: p.eps as f32,
        t: p.conv1d,
        saved: Mutex::new(None),
    };
    if fusion == grad_sink::Fusion::Node {
        grad_sink::promise(p.tensors);
    }
    Ok(Some(x.contiguous()?.apply_op1(op)?))
}

/// The twelve parameters' shapes in [`GptBlockParams`]' order, for width `d` and MLP width `k`
/// (the weights transposed with `conv1d`).
fn param_shapes(d: usize, k: usize, conv1d: bool) -> [Vec<usize>; 12] {
    let w = |out: usize, inp: usize| {
        if conv1d {
            vec![inp, out]
        } else {
            vec![out, inp]
        }
    };
    [
        vec![d],
        vec![d],
        w(3 * d, d),
        vec![3 * d],
        w(d, d),
        vec![d],
        vec![d],
        vec![d],
        w(k, d),
        vec![k],
        w(d, k),
        vec![d],
    ]
}

/// The node: the parameters (read at forward and backward) and the activations the forward
/// keeps for the backward.
struct BlockOp {
    params: [Tensor; 12],
    n_head: usize,
    eps: f32,
    /// The weights are `(in, out)` (`Conv1D`).
    t: bool,
    saved: Mutex<Option<Saved>>,
}

/// The forward's intermediate values kept for the backward (`N = B·T` rows): `qkv` without its
/// bias `(N, 3d)`,
/// the attention output `(N, d)`, `h` `(N, d)`, the MLP's pre-activation without its bias and
/// its GELU `(N, k)`.
/// The two layer norms' outputs are recomputed in the backward from `x` and `h` (one cheap pass
/// each, just before the product that reads them, instead of `2·N·d` floats kept: 30 → 26 MB
/// a block at the benchmark's shapes, measured speed-neutral); the GELU is kept
/// (recomputing it cost 1–3 % of a world-size-2 step).
struct Saved {
    qkv: Vec<f32>,
    att: Vec<f32>,
    h: Vec<f32>,
    f: Vec<f32>,
    gl: Vec<f32>,
}

/// The f32 data of each tensor (contiguous, checked by [`gpt_block`]), read-locked for `f`.
fn with_data<R>(ts: &[Tensor], f: impl FnOnce(&[&[f32]]) -> Result<R>) -> Result<R> {
    let guards: Vec<_> = ts.iter().map(Tensor::storage_and_layout).collect();
    let mut data = Vec::with_capacity(ts.len());
    for (s, l) in &guards {
        let Storage::Cpu(s) = &**s else {
            bail!("gpt block: a parameter left the CPU")
        };
        let o = l.start_offset();
        data.push(&s.as_slice::<f32>()?[o..o + l.shape().elem_count()]);
    }
    f(&data)
}

/// The strides `(rs, cs)` of the `inp × out` matrix `wᵀ` for a weight `w` `(out, inp)`
/// row-major, or `(inp, out)` when `t` (`Conv1D`).
fn wt(inp: usize, out: usize, t: bool) -> (usize, usize) {
    if t {
        (out, 1)
    } else {
        (1, inp)
    }
}

/// `dst (n × out) += a (n × inp) · wᵀ` for `w` `(out, inp)` row-major (`(inp, out)` when `t`).
fn a_wt(dst: &mut [f32], a: &[f32], w: &[f32], (n, inp, out): (usize, usize, usize), t: bool) {
    let (rs, cs) = wt(inp, out, t);
    debug_assert!(dst.len() == n * out && a.len() == n * inp && w.len() == out * inp);
    // SAFETY: the three operands hold exactly their shapes (asserted by the callers' sizes).
    unsafe {
        gemm_f32(
            (n, out, inp),
            dst.as_mut_ptr(),
            out,
            true,
            (a, inp, 1),
            (w, rs, cs),
            true,
        )
    }
}

/// `a (n × inp) · wᵀ` for `w` `(out, inp)` row-major (`(inp, out)` when `t`), a new `(n, out)`
/// buffer.
fn a_wt_new(a: &[f32], w: &[f32], (n, inp, out): (usize, usize, usize), t: bool) -> Vec<f32> {
    let (rs, cs) = wt(inp, out, t);
    let mut dst = Vec::with_capacity(n * out);
    // SAFETY: operands of their full shapes; the gemm writes every element of `dst` (no
    // accumulation), so the length is set after.
    unsafe {
        gemm_f32(
            (n, out, inp),
            dst.as_mut_ptr(),
            out,
            false,
            (a, inp, 1),
            (w, rs, cs),
            true,
        );
        dst.set_len(n * out);
    }
    dst
}

/// GELU (tanh approximation) of `f + b` (`b` added to every row of `f` `(rows, b.len())`):
/// the activation, or with `g` its backward `g ⊙ gelu'(f + b)`. One pass over the rank's
/// threads, the same per-element formulas as [`super::gelu`].
fn gelu_bias(f: &[f32], b: &[f32], g: Option<&[f32]>) -> Vec<f32> {
    let k = b.len();
    let chunk = (1 << 16) / k.max(1) * k.max(1);
    let chunk = chunk.max(k);
    // SAFETY: each chunk of whole rows is written element by element.
    unsafe {
        filled(f.len(), chunk, |i, out| {
            let r = i * chunk..i * chunk + out.len();
            let f = &f[r.clone()];
            with_simd(
                #[inline(always)]
                || match g {
                    None => {
                        for (o, f) in out.chunks_exact_mut(k).zip(f.chunks_exact(k)) {
                            for ((o, &v), &b) in o.iter_mut().zip(f).zip(b) {
                                o.write(gelu_tanh(v + b));
                            }
                        }
                    }
                    Some(g) => {
                        let g = &g[r];
                        let rows = out.chunks_exact_mut(k).zip(f.chunks_exact(k));
                        for ((o, f), g) in rows.zip(g.chunks_exact(k)) {
                            for (((o, &v), &b), &g) in o.iter_mut().zip(f).zip(b).zip(g) {
                                o.write(g * gelu_tanh_grad(v + b));
                            }
                        }
                    }
                },
            )
        })
    }
}

/// `g (n × out) · w (out × inp)`, a new `(n, inp)` buffer (the input's gradient); `w` stored
/// `(inp, out)` when `t`.
fn g_w(g: &[f32], w: &[f32], (n, out, inp): (usize, usize, usize), t: bool) -> Vec<f32> {
    let (cs, rs) = wt(inp, out, t);
    let mut dst = Vec::with_capacity(n * inp);
    // SAFETY: operands of their full shapes; the gemm writes every element of `dst` (no
    // accumulation), so the length is set after.
    unsafe {
        gemm_f32(
            (n, inp, out),
            dst.as_mut_ptr(),
            inp,
            false,
            (g, out, 1),
            (w, rs, cs),
            true,
        );
        dst.set_len(n * inp);
    }
    dst
}

/// The weight's gradient, a new buffer in the weight's layout: `gᵀ (out × n) · a (n × inp)`,
/// or `aᵀ · g` `(inp, out)` when `t`.
fn gt_a(g: &[f32], a: &[f32], (n, out, inp): (usize, usize, usize), t: bool) -> Vec<f32> {
    let mut dst = Vec::with_capacity(out * inp);
    // SAFETY: as in `g_w`.
    unsafe {
        if t {
            gemm_f32(
                (inp, out, n),
                dst.as_mut_ptr(),
                out,
                false,
                (a, 1, inp),
                (g, out, 1),
                true,
            );
        } else {
            gemm_f32(
                (out, inp, n),
                dst.as_mut_ptr(),
                inp,
                false,
                (g, 1, out),
                (a, inp, 1),
                true,
            );
        }
        dst.set_len(out * inp);
    }
    dst
}

impl BlockOp {
    fn shape(&self, batch: usize, seq: usize, d: usize) -> AttentionShape {
        AttentionShape {
            batch,
            seq,
            n_head: self.n_head,
            n_kv_head: self.n_head,
            head_dim: d / self.n_head,
        }
    }

    /// Plain causal attention, scale `1/√hd`.
    fn opts(&self) -> AttentionOptions {
        AttentionOptions::new(self.n_head, self.n_head)
    }
}

impl CustomOp1 for BlockOp {
    fn name(&self) -> &'static str {
        "gpt-block"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (b, t, d) = l.shape().dims3()?;
        let n = b * t;
        let Some((o1, o2)) = l.contiguous_offsets() else {
            bail!("gpt block: the input is not contiguous")
        };
        let x = &s.as_slice::<f32>()?[o1..o2];
        let (saved, out) = with_data(&self.params, |p| {
            let [ln1w, ln1b, wqkv, bqkv, wp, bp, ln2w, ln2b, wfc, bfc, wmp, bmp] = p else {
                bail!("gpt block: twelve parameters expected")
            };
            let (k, tr) = (bfc.len(), self.t);
            let a1 = norm_forward(x, ln1w, Some(ln1b), self.eps, true);
            // qkv without its bias, which the attention kernel's gathers add.
            let qkv = a_wt_new(&a1, wqkv, (n, d, 3 * d), tr);
            let att = attention_forward(&qkv, Some(bqkv), self.shape(b, t, d), &self.opts(), None);
            let mut h = rows_plus(n, bp, Some(x));
            a_wt(&mut h, &att, wp, (n, d, d), tr);
            let a2 = norm_forward(&h, ln2w, Some(ln2b), self.eps, true);
            // f = a2 · W_fcᵀ without its bias, which the GELU pass adds (no bias rows written
            // and read back); the backward adds it again for gelu'.
            let f = a_wt_new(&a2, wfc, (n, d, k), tr);
            let gl = gelu_bias(&f, bfc, None);
            let mut out = rows_plus(n, bmp, Some(&h));
            a_wt(&mut out, &gl, wmp, (n, k, d), tr);
            drop((a1, a2));
            let saved = Saved { qkv, att, h, f, gl };
            Ok((saved, out))
        })?;
        *self.saved.lock().map_err(|_| poisoned())? = Some(saved);
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let Some(s) = self.saved.lock().map_err(|_| poisoned())?.take() else {
            bail!("gpt block backward: the forward's activations are missing (a second backward?)")
        };
        let (b, t, d) = arg.dims3()?;
        let n = b * t;
        let g = grad_res.contiguous()?;
        let x = arg.contiguous()?;
        let io = [x.clone(), g.clone()];
        let (dx, grads) = with_data(&io, |xg| {
            let (x, g) = (xg[0], xg[1]);
            with_data(&self.params, |p| {
                let [ln1w, ln1b, wqkv, bqkv, wp, _, ln2w, ln2b, wfc, bfc, wmp, _] = p else {
                    bail!("gpt block: twelve parameters expected")
                };
                let (k, tr) = (wfc.len() / d, self.t);
                // MLP projection: out = h + gl · W_mpᵀ + b_mp.
                let dwmp = gt_a(g, &s.gl, (n, d, k), tr);
                let dbmp = col_sums(g, d);
                let dgl = g_w(g, wmp, (n, d, k), tr);
                drop(s.gl);
                let df = gelu_bias(&s.f, bfc, Some(&dgl));
                drop((dgl, s.f));
                let a2 = norm_forward(&s.h, ln2w, Some(ln2b), self.eps, true);
                let dwfc = gt_a(&df, &a2, (n, k, d), tr);
                let dbfc = col_sums(&df, k);
                let da2 = g_w(&df, wfc, (n, k, d), tr);
                drop((df, a2));
                let (mut dh, dln2w, dln2b) = norm_backward(&s.h, ln2w, &da2, self.eps, true);
                drop((da2, s.h));
                add_into(&mut dh, g);
                let dh = &dh[..];
                // Attention projection: h = x + att · W_pᵀ + b_p.
                let dwp = gt_a(dh, &s.att, (n, d, d), tr);
                let dbp = col_sums(dh, d);
                let datt = g_w(dh, wp, (n, d, d), tr);
                let dqkv = attention_backward(
                    &s.qkv,
                    Some(bqkv),
                    &s.att,
                    &datt,
                    self.shape(b, t, d),
                    &self.opts(),
                    None,
                );
                drop((datt, s.att, s.qkv));
                let a1 = norm_forward(x, ln1w, Some(ln1b), self.eps, true);
                let dwqkv = gt_a(&dqkv, &a1, (n, 3 * d, d), tr);
                let dbqkv = col_sums(&dqkv, 3 * d);
                let da1 = g_w(&dqkv, wqkv, (n, 3 * d, d), tr);
                drop((dqkv, a1));
                let (mut n1, dln1w, dln1b) = norm_backward(x, ln1w, &da1, self.eps, true);
                drop(da1);
                add_into(&mut n1, dh);
                let grads = [
                    dln1w, dln1b, dwqkv, dbqkv, dwp, dbp, dln2w, dln2b, dwfc, dbfc, dwmp, dbmp,
                ];
                Ok((n1, grads))
            })
        })?;
        for (param, grad) in self.params.iter().zip(grads) {
            let grad = Tensor::from_vec(grad, param.shape(), &Device::Cpu)?;
            grad_sink::send(param, grad)?;
        }
        Ok(Some(Tensor::from_vec(dx, (b, t, d), &Device::Cpu)?))
    }
}

fn poisoned() -> candle_core::Error {
    candle_core::Error::Msg("gpt block: a panic poisoned the saved activations' lock".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::{causal_attention, linear_forward, linear_gelu, LayerNorm};
    use candle_core::{Module, Var};

    const EPS: f64 = 1e-5;

    fn randn(shape: &[usize], std: f64, seed: u64) -> Var {
        // A seeded value per element (Candle's `randn` takes no seed).
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| {
                let z = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    ^ seed.wrapping_mul(0xD1B5_4A32_D192_ED03);
                let u = (z >> 40) as f64 / (1u64 << 24) as f64;
                ((u - 0.5) * 3.4 * std) as f32
            })
            .collect();
        Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu).unwrap()).unwrap()
    }

    /// The block composed of the one-node layers: the model's path outside the runtime.
    fn composed(x: &Tensor, p: &[Var], n_head: usize) -> Result<Tensor> {
        let t = |i: usize| p[i].as_tensor().clone();
        let a1 = LayerNorm::new(t(0), t(1), EPS).forward(x)?;
        let att = causal_attention(&linear_forward(&a1, &t(2), Some(&t(3)))?, n_head)?;
        let h = (x + linear_forward(&att, &t(4), Some(&t(5)))?)?;
        let a2 = LayerNorm::new(t(6), t(7), EPS).forward(&h)?;
        let m = linear_forward(&linear_gelu(&a2, &t(8), &t(9))?, &t(10), Some(&t(11)))?;
        &h + m
    }

    fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
        let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        a.iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
            / scale
    }

    /// The node's output, its input's gradient and the twelve gradients it sends equal the
    /// composed layers' (Candle's autograd) to f32 rounding.
    #[test]
    fn one_node_block_matches_the_composed_layers() {
        let (b, t, d, k, n_head) = (2, 24, 32, 128, 4);
        let shapes = param_shapes(d, k, false);
        let p: Vec<Var> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let v = randn(s, 0.3, 10 + i as u64);
                // Norm weights around 1.
                if s.len() == 1 && (i == 0 || i == 6) {
                    Var::from_tensor(&(v.as_tensor() + 1.0).unwrap()).unwrap()
                } else {
                    v
                }
            })
            .collect();
        let x = randn(&[b, t, d], 1.0, 1);
        let r = randn(&[b, t, d], 1.0, 2).as_tensor().clone();

        let want = composed(x.as_tensor(), &p, n_head).unwrap();
        let want_grads = (&want * &r).unwrap().sum_all().unwrap().backward().unwrap();

        let params = GptBlockParams {
            tensors: std::array::from_fn(|i| p[i].as_tensor()),
            n_head,
            eps: EPS,
            conv1d: false,
        };
        assert!(
            gpt_block(x.as_tensor(), &params).unwrap().is_none(),
            "not armed: composed"
        );
        let armed = grad_sink::arm();
        let got = gpt_block(x.as_tensor(), &params)
            .unwrap()
            .expect("armed: one node");
        assert!(p.iter().all(|v| grad_sink::promised(v.as_tensor())));
        drop(armed);
        assert!(
            max_rel(&got, &want) < 1e-5,
            "output {}",
            max_rel(&got, &want)
        );
        let sink = grad_sink::collect();
        let grads = (&got * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let sent = sink.finish();
        let dx = grads.get(x.as_tensor()).expect("the input's gradient");
        let dx_want = want_grads.get(x.as_tensor()).unwrap();
        assert!(max_rel(dx, dx_want) < 1e-5, "dx {}", max_rel(dx, dx_want));
        assert_eq!(sent.len(), 12);
        for (i, ((param, grad), v)) in sent.iter().zip(&p).enumerate() {
            assert_eq!(param.id(), v.as_tensor().id(), "parameter {i} in order");
            assert!(
                grads.get(v.as_tensor()).is_none(),
                "parameter {i} past Candle's graph"
            );
            let e = max_rel(grad, want_grads.get(v.as_tensor()).unwrap());
            assert!(e < 2e-5, "parameter {i}: relative error {e}");
        }
        // A second backward of the same node has no activations left: a clear error.
        let sink = grad_sink::collect();
        let e = (&got * &r)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap_err()
            .to_string();
        assert!(e.contains("activations are missing"), "{e}");
        drop(sink);
        // A backward with no sink open names the way to run it.
        let armed = grad_sink::arm();
        let again = gpt_block(x.as_tensor(), &params).unwrap().unwrap();
        drop(armed);
        let e = again.sum_all().unwrap().backward().unwrap_err().to_string();
        assert!(e.contains("FsdpModel::backward"), "{e}");
    }
}
