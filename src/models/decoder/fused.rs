//! The decoder block of the rotary families (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2) as one graph
//! node inside the FSDP runtime's training calls ([`crate::fsdp::fused`]): RMSNorm (Gemma's
//! `1 + w` too), the q/k/v projections from separate weights (or Phi-3's fused `qkv_proj`)
//! written straight into one `qkv` buffer (no concatenation), their biases and the rotary
//! embedding in one pass, grouped-query attention with the layer's window, soft-cap and scale
//! ([`crate::nn::kernels::attention_forward`]), the output projection accumulating into `x` (+
//! its bias), the gated MLP (SwiGLU / GeGLU; separate or fused `gate_up_proj`) with the gate's
//! activation and the product in one pass, the down projection accumulating into `h`; Gemma 2's
//! sandwich norms around both.
//!
//! ```text
//! a1 = norm₁(x)                 qkv = rope(a1 · [W_q; W_k; W_v]ᵀ + b_qkv)      (N, (h + 2kv)·hd)
//! o  = attn(qkv) · W_oᵀ + b_o   h = x + o          (Gemma 2: h = x + norm_pa(o))
//! a2 = norm₂(h)                 [g, u] = a2 · [W_g; W_u]ᵀ + b                    (N, 2I)
//! m  = act(g) ⊙ u               out = h + m · W_dᵀ + b_d   (Gemma 2: h + norm_pf(m · W_dᵀ))
//! ```
//!
//! The forward keeps `qkv` (rotated), the attention's output, `h`, `[g, u]` (and Gemma 2's two
//! pre-norm projections); the backward recomputes the two norms' outputs and `m` (in the same
//! pass as the gate's gradient) instead of keeping them. The backward runs the formulas in
//! reverse and sends the parameters' gradients to the runtime; the rotary embedding's backward
//! is the rotation by the opposite angles.
//!
//! Qwen3's per-head q/k norms run between the projection and the rotation (the pre-norm
//! columns kept for the backward).
//!
//! GPT-2's style (LayerNorm with biases, `Conv1D` weights, learned positions) runs the GPT's
//! block node (`models/decoder/fused/gpt2.rs`) over its `(in, out)` weights.
//!
//! LoRA adapters ([`crate::lora`]) run inside the node: each adapted projection adds
//! `s·(drop(a)·Aᵀ)·Bᵀ` into its columns (`drop`: the adapter's dropout mask, regenerated from
//! the call's seed in the backward, never stored), and the backward computes only what trains — with the base frozen
//! ([`crate::fsdp::fused::trains`]) the base weights' gradient products are skipped, which is
//! most of a LoRA step's saving.
//!
//! Where nothing tracks gradients (an activation-checkpointed forward, evaluation) the node's
//! forward runs alone, so that a checkpointed forward, its recompute and an unchecked forward
//! compute the same bits. Not fused (the block composes its layers instead, with the same
//! values up to rounding): GPT-2 with LoRA adapters, anything but f32 on the CPU, autograd
//! outside an armed training call (plain Candle training).

use std::sync::Mutex;

use candle_core::{bail, CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor};
use candle_nn::Module;

use super::layers::{Block, MlpKind, NormKind, Positions, Proj, Qkv};
use super::Activation;
use crate::fsdp::fused;
use crate::nn::kernels::{
    add_assign, attention_backward, attention_forward, broadcast_rows, col_sums, col_sums_strided,
    matmul, matmul_new, norm_backward, norm_forward, rope_in_place, AttentionOptions,
    AttentionShape, Mat,
};
use crate::unit::UnitModule;

/// One projection's share of a fused buffer: its weight `(rows, in)` (and bias `(rows,)`)
/// index in the node's parameter list, written at columns `col .. col + rows`.
#[derive(Clone, Copy, Debug)]
struct Piece {
    w: usize,
    b: Option<usize>,
    col: usize,
    rows: usize,
    /// A LoRA adapter: `A` `(r, in)` and `B` `(rows, r)` indices, `r`, the scale.
    lora: Option<(usize, usize, usize, f32)>,
    /// The adapter's dropout in this call, `(p, mask seed)` ([`crate::lora::LoraAdapter::dropout_now`]).
    drop: Option<(f32, u64)>,
}

/// A norm's weight index and whether it is Gemma's offset (`1 + w`).
#[derive(Clone, Copy, Debug)]
struct NormAt {
    w: usize,
    offset: bool,
}

/// Where each parameter sits in the node's list, and the shapes.
#[derive(Clone, Debug)]
struct Plan {
    n1: NormAt,
    qkv: Vec<Piece>,
    /// Qwen3's per-head norms of the queries and of the keys (weights `(hd,)`).
    qk_norm: Option<(NormAt, NormAt)>,
    o: Piece,
    post_attn: Option<NormAt>,
    n2: NormAt,
    gate_up: Vec<Piece>,
    down: Piece,
    post_mlp: Option<NormAt>,
    eps: f32,
    act: Activation,
    n_head: usize,
    n_kv_head: usize,
    hd: usize,
    inter: usize,
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_at(x, None)
    }
}

/// The block as a unit: inputs `[h]` or `[h, position_ids]` (`(B, T)` u32, packed examples:
/// [`Positions`]); one output.
impl UnitModule for Block {
    fn forward_t(&self, xs: &[Tensor], _train: bool) -> candle_core::Result<Vec<Tensor>> {
        match xs {
            [x] => Ok(vec![self.forward_at(x, None)?]),
            [x, ids] => Ok(vec![self.forward_at(x, Some(&Positions::new(ids)?))?]),
            _ => candle_core::bail!(
                "a decoder block takes the hidden states and optionally position ids, found {} \
                 inputs",
                xs.len()
            ),
        }
    }
}

impl Block {
    /// The block's output `(B, T, d)` of `x` `(B, T, d)`, its tokens at `pos` (packed
    /// examples: rotary angles at their position ids, attention within their example) or at
    /// `0..T`.
    ///
    /// Errors: `pos` not `(B, T)`; Candle's.
    pub fn forward_at(&self, x: &Tensor, pos: Option<&Positions>) -> candle_core::Result<Tensor> {
        if let Some(p) = pos {
            let (b, t, _) = x.dims3()?;
            if p.ids.dims() != [b, t] {
                candle_core::bail!(
                    "position ids {:?} do not fit hidden states {:?} (B, T, d)",
                    p.ids.dims(),
                    x.dims()
                )
            }
        }
        // Inside the FSDP runtime's training forward: the whole block as one node where it
        // applies; its composed layers elsewhere.
        if let Some(y) = block(self, x, pos)? {
            return Ok(y);
        }
        self.forward_composed(x, pos)
    }
}

/// `block` applied to `x` `(B, T, d)` as one node, or `None` where it does not apply (see the
/// module documentation) and the caller composes the layers.
///
/// Errors: Candle's (the rotary tables).
pub(super) fn block(blk: &Block, x: &Tensor, pos: Option<&Positions>) -> Result<Option<Tensor>> {
    #[cfg(test)]
    if tests::COMPOSE.with(|c| c.get()) {
        return Ok(None);
    }
    let applies =
        x.device().is_cpu() && x.dtype() == DType::F32 && x.rank() == 3 && x.elem_count() > 0;
    // `fused::fusion` decides again once the parameters are known; autograd outside the
    // runtime composes whatever they are.
    if !applies || fused::fusion(x, []).is_none() {
        return Ok(None);
    }
    if blk.attn.rope.is_none() {
        if pos.is_some() {
            // The GPT-2 node attends over whole sequences: packed examples compose.
            return Ok(None);
        }
        return gpt2::gpt2(blk, x);
    }
    let mut params: Vec<Tensor> = Vec::new();
    let mut push = |t: &Tensor| {
        params.push(t.clone());
        params.len() - 1
    };
    let mut eps = None;
    let mut norm = |n: &super::layers::Norm, push: &mut dyn FnMut(&Tensor) -> usize| {
        let (w, e, offset) = match &n.inner {
            NormKind::Rms(r) => (r.weight(), r.eps(), false),
            NormKind::RmsOffset(w, e) => (w, *e, true),
            NormKind::Layer(_) => return None,
        };
        if eps.is_some_and(|old| old != e) {
            return None;
        }
        eps = Some(e);
        Some(NormAt { w: push(w), offset })
    };
    let piece = |p: &Proj, col: usize, push: &mut dyn FnMut(&Tensor) -> usize| -> Result<Piece> {
        let rows = p.weight.dim(0)?;
        Ok(Piece {
            w: push(&p.weight),
            b: p.bias.as_ref().map(&mut *push),
            col,
            rows,
            lora: match &p.lora {
                Some(l) => Some((push(l.a()), push(l.b()), l.a().dim(0)?, l.scale() as f32)),
                None => None,
            },
            drop: p.lora.as_ref().and_then(|l| l.dropout_now()),
        })
    };
    let Some(n1) = norm(&blk.norm1, &mut push) else {
        return Ok(None);
    };
    let qkv = match &blk.attn.qkv {
        Qkv::Separate { q, k, v } => {
            let pq = piece(q, 0, &mut push)?;
            let pk = piece(k, pq.rows, &mut push)?;
            let pv = piece(v, pq.rows + pk.rows, &mut push)?;
            vec![pq, pk, pv]
        }
        Qkv::Fused(p) => vec![piece(p, 0, &mut push)?],
    };
    let qk_norm = match (&blk.attn.q_norm, &blk.attn.k_norm) {
        (Some(qn), Some(kn)) => match (norm(qn, &mut push), norm(kn, &mut push)) {
            (Some(q), Some(k)) => Some((q, k)),
            _ => return Ok(None),
        },
        (None, None) => None,
        _ => return Ok(None),
    };
    let o = piece(&blk.attn.o, 0, &mut push)?;
    let post_attn = match &blk.post_attn {
        Some(n) => match norm(n, &mut push) {
            Some(at) => Some(at),
            None => return Ok(None),
        },
        None => None,
    };
    let Some(n2) = norm(&blk.norm2, &mut push) else {
        return Ok(None);
    };
    let (gate_up, down, inter) = match &blk.mlp.kind {
        MlpKind::Gated { gate, up, down } => {
            let pg = piece(gate, 0, &mut push)?;
            let pu = piece(up, pg.rows, &mut push)?;
            (vec![pg, pu], piece(down, 0, &mut push)?, pg.rows)
        }
        MlpKind::GatedFused { gate_up, down, i } => (
            vec![piece(gate_up, 0, &mut push)?],
            piece(down, 0, &mut push)?,
            *i,
        ),
        MlpKind::Plain { .. } => return Ok(None),
    };
    let post_mlp = match &blk.post_mlp {
        Some(n) => match norm(n, &mut push) {
            Some(at) => Some(at),
            None => return Ok(None),
        },
        None => None,
    };
    let Some(eps) = eps else { return Ok(None) };
    if !params
        .iter()
        .all(|t| t.device().is_cpu() && t.dtype() == DType::F32 && t.is_contiguous())
    {
        return Ok(None);
    }
    let Some(fusion) = fused::fusion(x, &params) else {
        return Ok(None);
    };
    let opts = blk.attn.opts;
    let plan = Plan {
        n1,
        qkv,
        qk_norm,
        o,
        post_attn,
        n2,
        gate_up,
        down,
        post_mlp,
        eps: eps as f32,
        act: blk.mlp.act,
        n_head: opts.n_head,
        n_kv_head: opts.n_kv_head,
        hd: blk.attn.hd,
        inter,
    };
    plan.check(&params, x.dim(2)?)?;
    let t = x.dim(1)?;
    let cfg = blk.attn.rope.as_ref().expect("checked above");
    let (cos, sin) = blk.attn.tables_at(cfg, t, pos, x.device())?;
    let trains = params.iter().map(fused::trains).collect();
    let op = BlockOp {
        plan,
        trains,
        opts,
        rows: if pos.is_some() { x.dim(0)? * t } else { t },
        cos: cos.flatten_all()?.to_vec1::<f32>()?,
        sin: sin.flatten_all()?.to_vec1::<f32>()?,
        starts: pos
            .map(|p| p.starts.flatten_all()?.to_vec1::<u32>())
            .transpose()?,
        params: params.clone(),
        saved: Mutex::new(None),
    };
    if fusion == fused::Fusion::Node {
        fused::promise(&params);
    }
    Ok(Some(x.contiguous()?.apply_op1(op)?))
}

impl Plan {
    /// Width of `qkv`.
    fn w(&self) -> usize {
        (self.n_head + 2 * self.n_kv_head) * self.hd
    }

    /// The parameters' shapes against the plan, for width `d`.
    fn check(&self, params: &[Tensor], d: usize) -> Result<()> {
        let (w, ho) = (self.w(), self.n_head * self.hd);
        let mut want: Vec<(usize, Vec<usize>)> = vec![(self.n1.w, vec![d]), (self.n2.w, vec![d])];
        if let Some((qn, kn)) = self.qk_norm {
            want.push((qn.w, vec![self.hd]));
            want.push((kn.w, vec![self.hd]));
        }
        for n in [self.post_attn, self.post_mlp].into_iter().flatten() {
            want.push((n.w, vec![d]));
        }
        let mut pieces = |ps: &[Piece], width: usize, inp: usize| {
            let total: usize = ps.iter().map(|p| p.rows).sum();
            for p in ps {
                want.push((p.w, vec![p.rows, inp]));
                if let Some(b) = p.b {
                    want.push((b, vec![p.rows]));
                }
                if let Some((a, b, r, _)) = p.lora {
                    want.push((a, vec![r, inp]));
                    want.push((b, vec![p.rows, r]));
                }
            }
            total == width
        };
        let fits = pieces(&self.qkv, w, d)
            && pieces(&self.gate_up, 2 * self.inter, d)
            && pieces(std::slice::from_ref(&self.o), d, ho)
            && pieces(std::slice::from_ref(&self.down), d, self.inter);
        for (i, shape) in want {
            if params[i].dims() != shape.as_slice() {
                bail!(
                    "decoder block: parameter {i} is {:?}, expected {shape:?} for width {d}",
                    params[i].shape()
                )
            }
        }
        if !fits {
            bail!(
                "decoder block: the projections do not fill qkv ({w}) and gate/up ({})",
                2 * self.inter
            )
        }
        Ok(())
    }
}

/// The node: the plan, the attention's options, the rotary tables (`(T, hd)`, or `(B·T, hd)`
/// for packed examples), the segment starts of packed examples, the parameters (read at
/// forward and backward), and the activations kept for the backward.
struct BlockOp {
    plan: Plan,
    /// Per parameter: whether it trains (frozen ones, e.g. under LoRA, get no gradient).
    trains: Vec<bool>,
    opts: AttentionOptions,
    /// Rows of the tables: `T`, or `B·T` (one per token).
    rows: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// Packed examples: the first position of each token's example (`B·T`).
    starts: Option<Vec<u32>>,
    params: Vec<Tensor>,
    saved: Mutex<Option<Saved>>,
}

/// What the forward keeps (`N` rows): `qkv` with its biases, rotated `(N, W)`; the attention's
/// output `(N, h·hd)`; `h` `(N, d)`; `[g, u]` with biases `(N, 2I)`; Gemma 2's attention output
/// before its norm and MLP output before its norm `(N, d)`.
struct Saved {
    qkv: Vec<f32>,
    /// Qwen3: the queries' and keys' columns before their norms, `(N, h·hd)` and `(N, kv·hd)`.
    qk_pre: Option<(Vec<f32>, Vec<f32>)>,
    att: Vec<f32>,
    h: Vec<f32>,
    gu: Vec<f32>,
    o: Option<Vec<f32>>,
    mo: Option<Vec<f32>>,
}

/// The f32 data of each tensor (contiguous, checked by [`block`]), read-locked for `f`.
fn with_data<R>(ts: &[Tensor], f: impl FnOnce(&[&[f32]]) -> Result<R>) -> Result<R> {
    let guards: Vec<_> = ts.iter().map(Tensor::storage_and_layout).collect();
    let mut data = Vec::with_capacity(ts.len());
    for (s, l) in &guards {
        let candle_core::Storage::Cpu(s) = &**s else {
            bail!("decoder block: a tensor left the CPU")
        };
        let o = l.start_offset();
        data.push(&s.as_slice::<f32>()?[o..o + l.shape().elem_count()]);
    }
    f(&data)
}

/// A norm's effective weight: `w`, or `1 + w` for Gemma's offset.
fn norm_weight(p: &[&[f32]], n: NormAt) -> Vec<f32> {
    if n.offset {
        p[n.w].iter().map(|w| 1.0 + w).collect()
    } else {
        p[n.w].to_vec()
    }
}

/// Adds `bias` (columns `col ..` of rows of `width`) to every row of `x`, on the rank's threads.
fn add_bias(x: &mut [f32], width: usize, col: usize, bias: &[f32]) {
    crate::cpu::parallel_chunks(x, 64 * width, |_, rows| {
        crate::cpu::with_simd(
            #[inline(always)]
            || {
                for row in rows.chunks_exact_mut(width) {
                    for (v, &b) in row[col..col + bias.len()].iter_mut().zip(bias) {
                        *v += b;
                    }
                }
            },
        )
    });
}

/// Columns `cols` of `x` (rows of `width`) as a new `(rows, cols.len())` buffer.
fn columns(x: &[f32], width: usize, cols: std::ops::Range<usize>) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len() / width * cols.len());
    for row in x.chunks_exact(width) {
        out.extend_from_slice(&row[cols.clone()]);
    }
    out
}

/// Writes `src` (rows of `cols`) into columns `col .. col + cols` of `x` (rows of `width`).
fn put_columns(x: &mut [f32], width: usize, col: usize, src: &[f32], cols: usize) {
    for (row, s) in x.chunks_exact_mut(width).zip(src.chunks_exact(cols)) {
        row[col..col + cols].copy_from_slice(s);
    }
}

/// The projections `pieces` of `a` `(n, inp)` into the columns of a new `(n, width)` buffer,
/// plus their biases.
fn project(
    a: &[f32],
    n: usize,
    inp: usize,
    pieces: &[Piece],
    width: usize,
    p: &[&[f32]],
) -> Vec<f32> {
    debug_assert_eq!(pieces.iter().map(|pc| pc.rows).sum::<usize>(), width);
    let mut out: Vec<f32> = Vec::with_capacity(n * width);
    for pc in pieces {
        debug_assert!(p[pc.w].len() == pc.rows * inp && a.len() == n * inp);
        // SAFETY: the pieces tile the columns (`Plan::check`), each gemm writes its `n ×
        // rows` block at column `col` of rows of `width` (no accumulation), inside the
        // capacity; the length is set once every block is written.
        unsafe {
            crate::cpu::gemm_f32(
                (n, pc.rows, inp),
                out.as_mut_ptr().add(pc.col),
                width,
                false,
                (a, inp, 1),
                (p[pc.w], 1, inp),
                true,
            );
        }
    }
    // SAFETY: every element was written above.
    unsafe { out.set_len(n * width) };
    for pc in pieces {
        if let Some(b) = pc.b {
            add_bias(&mut out, width, pc.col, p[b]);
        }
        if let Some((ai, bi, r, scale)) = pc.lora {
            // + s · (drop(a)·Aᵀ)·Bᵀ into the piece's columns.
            let xa = lora_down(&dropped(a, pc.drop), n, inp, p[ai], r, scale);
            let bt = Mat::new(p[bi], pc.rows, r).t();
            matmul(&mut out[pc.col..], width, true, Mat::new(&xa, n, r), bt);
        }
    }
    out
}

/// The backward of [`project`] for the gradient `g` `(n, width)` of its output: each piece's
/// weight (and bias) gradient in `grads`, and the input's gradient `(n, inp)`.
#[allow(clippy::too_many_arguments)]
fn project_bwd(
    g: &[f32],
    a: &[f32],
    n: usize,
    inp: usize,
    pieces: &[Piece],
    width: usize,
    p: &[&[f32]],
    trains: &[bool],
    grads: &mut [Option<Vec<f32>>],
) -> Vec<f32> {
    let gm = Mat::new(g, n, width);
    let mut da: Option<Vec<f32>> = None;
    for pc in pieces {
        let gp = gm.columns(pc.col..pc.col + pc.rows);
        if trains[pc.w] {
            grads[pc.w] = Some(matmul_new(gp.t(), Mat::new(a, n, inp)));
        }
        if let Some(b) = pc.b.filter(|&b| trains[b]) {
            grads[b] = Some(col_sums_strided(g, width, pc.col..pc.col + pc.rows));
        }
        let w = Mat::new(p[pc.w], pc.rows, inp);
        match da.as_mut() {
            None => da = Some(matmul_new(gp, w)),
            Some(da) => matmul(da, inp, true, gp, w),
        }
        if pc.lora.is_some() {
            let da = da.as_mut().expect("set above");
            lora_bwd_cols(gp, a, n, inp, pc, p, trains, grads, da);
        }
    }
    da.unwrap_or_else(|| vec![0f32; n * inp])
}

impl BlockOp {
    fn shape(&self, b: usize, t: usize) -> AttentionShape {
        AttentionShape {
            batch: b,
            seq: t,
            n_head: self.plan.n_head,
            n_kv_head: self.plan.n_kv_head,
            head_dim: self.plan.hd,
        }
    }
}

impl CustomOp1 for BlockOp {
    fn name(&self) -> &'static str {
        "decoder-block"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (b, t, d) = l.shape().dims3()?;
        let n = b * t;
        let Some((o1, o2)) = l.contiguous_offsets() else {
            bail!("decoder block: the input is not contiguous")
        };
        let x = &s.as_slice::<f32>()?[o1..o2];
        let pl = &self.plan;
        let (w, ho, i) = (pl.w(), pl.n_head * pl.hd, pl.inter);
        let (saved, out) = with_data(&self.params, |p| {
            let a1 = norm_forward(x, &norm_weight(p, pl.n1), None, pl.eps, false);
            let mut qkv = project(&a1, n, d, &pl.qkv, w, p);
            drop(a1);
            let (hq, hk) = (pl.n_head * pl.hd, pl.n_kv_head * pl.hd);
            let qk_pre = pl.qk_norm.map(|(qn, kn)| {
                let (q, k) = (columns(&qkv, w, 0..hq), columns(&qkv, w, hq..hq + hk));
                let nq = norm_forward(&q, p[qn.w], None, pl.eps, false);
                let nk = norm_forward(&k, p[kn.w], None, pl.eps, false);
                put_columns(&mut qkv, w, 0, &nq, hq);
                put_columns(&mut qkv, w, hq, &nk, hk);
                (q, k)
            });
            rope_in_place(
                &mut qkv,
                w,
                0,
                pl.n_head + pl.n_kv_head,
                self.rows,
                &self.cos,
                &self.sin,
                false,
            );
            let att = attention_forward(
                &qkv,
                None,
                self.shape(b, t),
                &self.opts,
                self.starts.as_deref(),
            );
            let bo = pl.o.b.map(|i| p[i]);
            let wo = Mat::new(p[pl.o.w], d, ho).t();
            let (h, o) = match pl.post_attn {
                None => {
                    let mut h = broadcast_rows(n, bo.unwrap_or(&vec![0.0; d]), Some(x));
                    matmul(&mut h, d, true, Mat::new(&att, n, ho), wo);
                    lora_into(&mut h, &att, n, ho, &pl.o, p);
                    (h, None)
                }
                Some(pa) => {
                    let mut o = broadcast_rows(n, bo.unwrap_or(&vec![0.0; d]), None);
                    matmul(&mut o, d, true, Mat::new(&att, n, ho), wo);
                    lora_into(&mut o, &att, n, ho, &pl.o, p);
                    let mut h = norm_forward(&o, &norm_weight(p, pa), None, pl.eps, false);
                    add_assign(&mut h, x);
                    (h, Some(o))
                }
            };
            let a2 = norm_forward(&h, &norm_weight(p, pl.n2), None, pl.eps, false);
            let gu = project(&a2, n, d, &pl.gate_up, 2 * i, p);
            drop(a2);
            let (m, _) = gate(&gu, None, i, pl.act);
            let bd = pl.down.b.map(|i| p[i]);
            let wd = Mat::new(p[pl.down.w], d, i).t();
            let (out, mo) = match pl.post_mlp {
                None => {
                    let mut out = broadcast_rows(n, bd.unwrap_or(&vec![0.0; d]), Some(&h));
                    matmul(&mut out, d, true, Mat::new(&m, n, i), wd);
                    lora_into(&mut out, &m, n, i, &pl.down, p);
                    (out, None)
                }
                Some(pf) => {
                    let mut mo = broadcast_rows(n, bd.unwrap_or(&vec![0.0; d]), None);
                    matmul(&mut mo, d, true, Mat::new(&m, n, i), wd);
                    lora_into(&mut mo, &m, n, i, &pl.down, p);
                    let mut out = norm_forward(&mo, &norm_weight(p, pf), None, pl.eps, false);
                    add_assign(&mut out, &h);
                    (out, Some(mo))
                }
            };
            Ok((
                Saved {
                    qkv,
                    qk_pre,
                    att,
                    h,
                    gu,
                    o,
                    mo,
                },
                out,
            ))
        })?;
        *self.saved.lock().map_err(|_| poisoned())? = Some(saved);
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let Some(s) = self.saved.lock().map_err(|_| poisoned())?.take() else {
            bail!("decoder block backward: the forward's activations are missing (a second backward?)")
        };
        let (b, t, d) = arg.dims3()?;
        let n = b * t;
        let pl = &self.plan;
        let (w, ho, i) = (pl.w(), pl.n_head * pl.hd, pl.inter);
        let io = [arg.contiguous()?, grad_res.contiguous()?];
        let mut grads: Vec<Option<Vec<f32>>> = vec![None; self.params.len()];
        let tr = &self.trains;
        let dx = with_data(&io, |xg| {
            let (x, g) = (xg[0], xg[1]);
            with_data(&self.params, |p| {
                // MLP: out = h + [norm_pf](m · W_dᵀ + b_d).
                let dmo_own;
                let dmo: &[f32] = match (pl.post_mlp, &s.mo) {
                    (Some(pf), Some(mo)) => {
                        let (dmo, dw, _) = norm_backward(mo, &norm_weight(p, pf), g, pl.eps, false);
                        if tr[pf.w] {
                            grads[pf.w] = Some(dw);
                        }
                        dmo_own = dmo;
                        &dmo_own
                    }
                    _ => g,
                };
                if let Some(bi) = pl.down.b.filter(|&b| tr[b]) {
                    grads[bi] = Some(col_sums(dmo, d));
                }
                let mut dm = matmul_new(Mat::new(dmo, n, d), Mat::new(p[pl.down.w], d, i));
                // The adapter's input `m` is known only after the gate pass, which needs `dm`:
                // its part of `dm` comes from `B` alone (`s·g·B·A`), added first.
                let dxa_down = pl.down.lora.map(|(ai, bi, r, scale)| {
                    let mut dxa = matmul_new(Mat::new(dmo, n, d), Mat::new(p[bi], d, r));
                    for v in &mut dxa {
                        *v *= scale;
                    }
                    let t = matmul_new(Mat::new(&dxa, n, r), Mat::new(p[ai], r, i));
                    add_dropped_grad(&mut dm, t, pl.down.drop);
                    dxa
                });
                let (m, dgu) = gate(&s.gu, Some(&dm), i, pl.act);
                drop(dm);
                if tr[pl.down.w] {
                    grads[pl.down.w] =
                        Some(matmul_new(Mat::new(dmo, n, d).t(), Mat::new(&m, n, i)));
                }
                if let (Some((ai, bi, r, scale)), Some(dxa)) = (pl.down.lora, dxa_down) {
                    let md = dropped(&m, pl.down.drop);
                    if tr[bi] {
                        let xa = lora_down(&md, n, i, p[ai], r, scale);
                        grads[bi] = Some(matmul_new(Mat::new(dmo, n, d).t(), Mat::new(&xa, n, r)));
                    }
                    if tr[ai] {
                        grads[ai] = Some(matmul_new(Mat::new(&dxa, n, r).t(), Mat::new(&md, n, i)));
                    }
                }
                drop(m);
                let w2 = norm_weight(p, pl.n2);
                let a2 = norm_forward(&s.h, &w2, None, pl.eps, false);
                let da2 = project_bwd(
                    &dgu,
                    &a2,
                    n,
                    d,
                    &pl.gate_up,
                    2 * i,
                    p,
                    &self.trains,
                    &mut grads,
                );
                drop((a2, dgu));
                let (mut dh, dw2, _) = norm_backward(&s.h, &w2, &da2, pl.eps, false);
                if tr[pl.n2.w] {
                    grads[pl.n2.w] = Some(dw2);
                }
                drop(da2);
                add_assign(&mut dh, g);
                // Attention: h = x + [norm_pa](att · W_oᵀ + b_o).
                let do_own;
                let do_: &[f32] = match (pl.post_attn, &s.o) {
                    (Some(pa), Some(o)) => {
                        let (d_o, dw, _) =
                            norm_backward(o, &norm_weight(p, pa), &dh, pl.eps, false);
                        if tr[pa.w] {
                            grads[pa.w] = Some(dw);
                        }
                        do_own = d_o;
                        &do_own
                    }
                    _ => &dh,
                };
                if let Some(bi) = pl.o.b.filter(|&b| tr[b]) {
                    grads[bi] = Some(col_sums(do_, d));
                }
                if tr[pl.o.w] {
                    grads[pl.o.w] =
                        Some(matmul_new(Mat::new(do_, n, d).t(), Mat::new(&s.att, n, ho)));
                }
                let mut datt = matmul_new(Mat::new(do_, n, d), Mat::new(p[pl.o.w], d, ho));
                lora_bwd(do_, &s.att, n, ho, &pl.o, p, tr, &mut grads, &mut datt);
                let mut dqkv = attention_backward(
                    &s.qkv,
                    None,
                    &s.att,
                    &datt,
                    self.shape(b, t),
                    &self.opts,
                    self.starts.as_deref(),
                );
                drop(datt);
                rope_in_place(
                    &mut dqkv,
                    w,
                    0,
                    pl.n_head + pl.n_kv_head,
                    self.rows,
                    &self.cos,
                    &self.sin,
                    true,
                );
                if let (Some((qn, kn)), Some((q, k))) = (pl.qk_norm, &s.qk_pre) {
                    let (hq, hk) = (pl.n_head * pl.hd, pl.n_kv_head * pl.hd);
                    let dq = columns(&dqkv, w, 0..hq);
                    let (dq, dwq, _) = norm_backward(q, p[qn.w], &dq, pl.eps, false);
                    let dk = columns(&dqkv, w, hq..hq + hk);
                    let (dk, dwk, _) = norm_backward(k, p[kn.w], &dk, pl.eps, false);
                    put_columns(&mut dqkv, w, 0, &dq, hq);
                    put_columns(&mut dqkv, w, hq, &dk, hk);
                    if tr[qn.w] {
                        grads[qn.w] = Some(dwq);
                    }
                    if tr[kn.w] {
                        grads[kn.w] = Some(dwk);
                    }
                }
                let w1 = norm_weight(p, pl.n1);
                let a1 = norm_forward(x, &w1, None, pl.eps, false);
                let da1 = project_bwd(&dqkv, &a1, n, d, &pl.qkv, w, p, &self.trains, &mut grads);
                drop((a1, dqkv));
                let (mut dx, dw1, _) = norm_backward(x, &w1, &da1, pl.eps, false);
                if tr[pl.n1.w] {
                    grads[pl.n1.w] = Some(dw1);
                }
                add_assign(&mut dx, &dh);
                Ok(dx)
            })
        })?;
        for (k, (param, grad)) in self.params.iter().zip(grads).enumerate() {
            let Some(grad) = grad else {
                if !self.trains[k] {
                    continue; // frozen: no gradient wanted
                }
                bail!("decoder block backward: no gradient computed for parameter {k}")
            };
            fused::send(param, Tensor::from_vec(grad, param.shape(), &Device::Cpu)?)?;
        }
        Ok(Some(Tensor::from_vec(dx, (b, t, d), &Device::Cpu)?))
    }
}

fn poisoned() -> candle_core::Error {
    candle_core::Error::Msg("decoder block: a panic poisoned the saved activations' lock".into())
}

mod gate;
mod gpt2;
mod lora;

use gate::gate;
use lora::{add_dropped_grad, dropped, lora_bwd, lora_bwd_cols, lora_down, lora_into};

#[cfg(test)]
mod tests;
