//! Causal multi-head self-attention as one graph node, straight from the fused `qkv`
//! projection: a flash-style CPU kernel (Dao et al. 2022, "FlashAttention", arXiv:2205.14135)
//! that never materialises the `(B, h, T, T)` scores.
//!
//! # Formulas
//!
//! For each batch element and head, with `Q`, `K`, `V` its `(T, hd)` slices of `qkv`,
//! `s = 1/√hd` and the causal mask (query `i` sees keys `j ≤ i`):
//!
//! ```text
//!     S = s · Q·Kᵀ        P_ij = exp(S_ij) / Σ_{k ≤ i} exp(S_ik)  (j ≤ i; 0 above)     O = P·V
//! ```
//!
//! and with `dO` the output's gradient and `D_i = Σ_j dO_ij · O_ij` (= `Σ_j P_ij · dP_ij`):
//!
//! ```text
//!     dP = dO·Vᵀ     dS = s · P ⊙ (dP − D)     dQ = dS·K     dK = dSᵀ·Q     dV = Pᵀ·dO
//! ```
//!
//! # Kernel
//!
//! Work is cut into one task per `(batch, head)`; the tasks run over rayon's pool under the rule
//! of `crate::cpu::parallel_map`. A task copies its `Q`, `K`, `V` into contiguous f32 buffers and
//! walks the queries in tiles of [`TILE`] rows. For the tile of rows `r0..r1` only keys `0..r1`
//! exist (causality), so the tile's scores are one `(r1 − r0) × r1` gemm, the softmax of each row
//! is exact in one pass (its whole row is there: no running maximum is needed), and the tile's
//! output one `(r1 − r0) × hd` gemm. The backward recomputes each tile's `P` the same way
//! instead of storing it (FlashAttention's recomputation) and accumulates `dK`, `dV` over the
//! tiles with gemms that read their destination. Scratch per task: two `TILE × T` f32 tiles and
//! the head's buffers; nothing of size `T × T` outlives a tile. The gemms are the `gemm` crate's,
//! single-threaded inside a task; the exponentials are `crate::cpu::exp_fast`, vectorised.
//!
//! Grouped-query attention ([`causal_attention_gqa`]) runs the same tasks, one per query head;
//! a task reads the key and value blocks of its group's key/value head, and the backward sums
//! the `dK`, `dV` of a group's query heads (in head order) before writing them once.
//!
//! f32, bf16 and f16 inputs run the kernel (computing in f32, rounding the outputs once);
//! other dtypes and devices run [`causal_attention_composed`].

use candle_core::{
    backend::BackendStorage, bail, CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape,
    Tensor,
};

use std::mem::MaybeUninit;

use super::softmax::causal_softmax;
use crate::cpu::{
    contiguous, dot16, exp_fast, filled, gemm_f32, max16, parallel_map, sum16, with_simd, Elem,
};

/// Query rows per tile of the kernel: 64 rows of scores for `T` keys are `256 · T` bytes, which
/// stays in L2 for the contexts used here.
pub const TILE: usize = 64;

/// Causal multi-head self-attention over a fused projection, differentiable in `qkv`.
///
/// `qkv` is `(B, T, 3·d)`: for each position, the `d` query features, then the `d` key features,
/// then the `d` value features, head `h` at columns `h·hd .. (h+1)·hd` of each (`hd = d /
/// n_head`), which is what a `Linear(d, 3d)` followed by a reshape to `(B, T, 3, n_head, hd)`
/// means in GPT-2 and nanoGPT. The result is `(B, T, d)`, head `h` at columns `h·hd ..`: the
/// heads already merged, ready for the output projection. Scores are scaled by `1/√hd` and
/// masked causally; see the [module documentation](self) for the formulas and the kernel.
///
/// Equals [`causal_attention_composed`] up to rounding (the tests compare both, values and
/// gradients, and an f64 reference).
///
/// Errors: `qkv` not of rank 3, its last dimension not `3 · d` with `n_head` dividing `d`;
/// Candle's.
pub fn causal_attention(qkv: &Tensor, n_head: usize) -> Result<Tensor> {
    causal_attention_gqa(qkv, n_head, n_head)
}

/// Causal grouped-query attention (Ainslie et al. 2023, "GQA", arXiv:2305.13245) over a fused
/// projection with fewer key/value heads than query heads, differentiable in `qkv`:
/// [`causal_attention`] when `n_kv_head == n_head`.
///
/// `qkv` is `(B, T, (n_head + 2·n_kv_head)·hd)`: for each position the `n_head·hd` query
/// features, then the `n_kv_head·hd` key features, then the `n_kv_head·hd` value features. Query
/// head `h` attends with key/value head `h / (n_head / n_kv_head)` (transformers' `repeat_kv`:
/// key/value head `j` serves query heads `j·rep .. (j+1)·rep`), without the keys and values
/// being repeated in memory; their gradients sum over the query heads they serve. The result is
/// `(B, T, n_head·hd)`, the heads merged.
///
/// Equals [`causal_attention_gqa_composed`] up to rounding (tested, values and gradients).
///
/// Errors: `qkv` not of rank 3, `n_kv_head` zero or not dividing `n_head`, the last dimension
/// not a multiple of `n_head + 2·n_kv_head`; Candle's.
pub fn causal_attention_gqa(qkv: &Tensor, n_head: usize, n_kv_head: usize) -> Result<Tensor> {
    let (_, _, hd) = check_qkv(qkv, n_head, n_kv_head)?;
    let kernel = qkv.device().is_cpu()
        && matches!(qkv.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && qkv.elem_count() > 0;
    if !kernel {
        return causal_attention_gqa_composed(qkv, n_head, n_kv_head);
    }
    qkv.contiguous()?.apply_op1(AttentionOp {
        n_head,
        n_kv_head,
        scale: (hd as f32).sqrt().recip(),
    })
}

/// [`causal_attention`] composed of Candle ops: split `qkv` into `(B, n_head, T, hd)` queries,
/// keys and values, `Q·Kᵀ`, [`causal_softmax`] with scale `1/√hd`, `·V`, and the heads merged
/// back to `(B, T, d)`. Candle's autograd differentiates it; any dtype and device.
///
/// Errors: as [`causal_attention`].
pub fn causal_attention_composed(qkv: &Tensor, n_head: usize) -> Result<Tensor> {
    causal_attention_gqa_composed(qkv, n_head, n_head)
}

/// [`causal_attention_gqa`] composed of Candle ops: the keys and values repeated to `n_head`
/// heads (transformers' `repeat_kv`), then [`causal_attention_composed`]'s steps. Candle's
/// autograd differentiates it; any dtype and device.
///
/// Errors: as [`causal_attention_gqa`].
pub fn causal_attention_gqa_composed(
    qkv: &Tensor,
    n_head: usize,
    n_kv_head: usize,
) -> Result<Tensor> {
    let (b, t, hd) = check_qkv(qkv, n_head, n_kv_head)?;
    let (d, dkv) = (n_head * hd, n_kv_head * hd);
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
    let att = causal_softmax(&scores, 1.0 / (hd as f64).sqrt())?;
    att.matmul(&v)? // (B, h, T, hd)
        .transpose(1, 2)?
        .reshape((b, t, d))
}

/// `(B, T, hd)` of a valid `qkv`.
fn check_qkv(qkv: &Tensor, n_head: usize, n_kv_head: usize) -> Result<(usize, usize, usize)> {
    let Ok((b, t, c)) = qkv.dims3() else {
        bail!(
            "causal_attention: qkv must be (B, T, 3·d) (grouped-query: (B, T, (n_head + \
             2·n_kv_head)·hd)), found {:?}",
            qkv.shape()
        )
    };
    if n_head == 0 || n_kv_head == 0 || !n_head.is_multiple_of(n_kv_head) {
        bail!(
            "causal_attention: n_kv_head {n_kv_head} must divide n_head {n_head} (both at least 1)"
        )
    }
    let per = n_head + 2 * n_kv_head;
    if c % per != 0 && n_kv_head == n_head {
        bail!(
            "causal_attention: qkv's last dimension {c} must be 3·d with n_head {n_head} dividing d"
        )
    }
    if c % per != 0 {
        bail!(
            "causal_attention: qkv's last dimension {c} must be (n_head {n_head} + 2·n_kv_head \
             {n_kv_head})·hd"
        )
    }
    Ok((b, t, c / per))
}

/// The shape of one problem: batch `b`, context `t`, `h` query heads and `kvh` key/value heads
/// of `hd` features.
#[derive(Clone, Copy, Debug)]
pub(super) struct Dims {
    pub(super) b: usize,
    pub(super) t: usize,
    pub(super) h: usize,
    pub(super) kvh: usize,
    pub(super) hd: usize,
}

impl Dims {
    fn of(l: &Layout, n_head: usize, n_kv_head: usize) -> Result<Self> {
        let (b, t, c) = l.shape().dims3()?;
        Ok(Self {
            b,
            t,
            h: n_head,
            kvh: n_kv_head,
            hd: c / (n_head + 2 * n_kv_head),
        })
    }
    /// Width of the output: the query heads' features.
    fn d(&self) -> usize {
        self.h * self.hd
    }
    /// Width of `qkv`.
    fn w(&self) -> usize {
        (self.h + 2 * self.kvh) * self.hd
    }
    /// Columns of query head `hi`'s key and value blocks in `qkv`.
    fn kv_cols(&self, hi: usize) -> (usize, usize) {
        let j = hi / (self.h / self.kvh);
        let k = self.d() + j * self.hd;
        (k, k + self.kvh * self.hd)
    }
}

/// Copies column block `col .. col + hd` of the `(T, width)` matrix of batch element `bi` into a
/// contiguous f32 `(T, hd)` buffer, adding `bias[col .. col + hd]` to every row when given (a
/// `qkv` whose projection's bias was left for this pass, `nn::block`).
#[inline(always)]
fn gather<T: Elem>(
    src: &[T],
    width: usize,
    dims: Dims,
    bi: usize,
    col: usize,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let (t, hd) = (dims.t, dims.hd);
    // Extended row by row: no zero-fill of a buffer every element of which is written.
    let mut out = Vec::with_capacity(t * hd);
    let base = bi * t * width + col;
    for i in 0..t {
        let s = &src[base + i * width..base + i * width + hd];
        match bias {
            None => out.extend(s.iter().map(|&v| v.to_f32())),
            Some(b) => out.extend(
                s.iter()
                    .zip(&b[col..col + hd])
                    .map(|(&v, &b)| v.to_f32() + b),
            ),
        }
    }
    out
}

/// Writes a contiguous f32 `(T, hd)` buffer into column block `col ..` of batch element `bi` of
/// the `(B, T, width)` output.
fn scatter<T: Elem>(
    dst: &mut [MaybeUninit<T>],
    width: usize,
    dims: Dims,
    bi: usize,
    col: usize,
    src: &[f32],
) {
    let (t, hd) = (dims.t, dims.hd);
    let base = bi * t * width + col;
    for (i, row) in src.chunks_exact(hd).enumerate() {
        for (o, &v) in dst[base + i * width..base + i * width + hd]
            .iter_mut()
            .zip(row)
        {
            o.write(T::from_f32(v));
        }
    }
}

/// `dst (m × n) = [dst +] lhs (m × k) · rhs (k × n)` with explicit strides (row stride `rs`,
/// column stride `cs` of each operand), single-threaded: the `gemm` crate's kernel.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn gemm(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    lhs: (&[f32], usize, usize),
    rhs: (&[f32], usize, usize),
) {
    debug_assert!(m == 0 || n == 0 || dst.len() > (m - 1) * dst_rs + n - 1);
    debug_assert!(m == 0 || k == 0 || lhs.0.len() > (m - 1) * lhs.1 + (k - 1) * lhs.2);
    debug_assert!(k == 0 || n == 0 || rhs.0.len() > (k - 1) * rhs.1 + (n - 1) * rhs.2);
    // SAFETY: the three slices hold every element the strides reach (asserted above in debug
    // builds; each call site derives the strides from the slices' own shapes), `dst` does not
    // overlap `lhs` or `rhs` (it is a distinct `&mut`) and is initialised.
    unsafe {
        gemm_f32(
            (m, n, k),
            dst.as_mut_ptr(),
            dst_rs,
            accumulate,
            lhs,
            rhs,
            false,
        )
    }
}

/// The probabilities `P` of query rows `r0 .. r0 + br` against keys `0 .. kend` (`kend = r0 +
/// br`) into `p` (`br × kend`, row-major): `s · q·kᵀ`, then the causal softmax of each row,
/// zero above the diagonal.
#[inline(always)]
fn tile_probs(q: &[f32], k: &[f32], hd: usize, r0: usize, br: usize, scale: f32, p: &mut [f32]) {
    let kend = r0 + br;
    gemm(
        (br, kend, hd),
        p,
        kend,
        false,
        (&q[r0 * hd..], hd, 1),
        (k, 1, hd),
    );
    for (i, row) in p.chunks_exact_mut(kend).enumerate() {
        let n = r0 + i + 1;
        let (live, masked) = row.split_at_mut(n);
        // softmax(s·x) = exp(s·(x − max x)) / Σ: the scale folded into the exponential's pass.
        let m = max16(live);
        for v in live.iter_mut() {
            *v = exp_fast(scale * (*v - m));
        }
        let inv = sum16(live, |v| v).recip();
        for v in live.iter_mut() {
            *v *= inv;
        }
        masked.fill(0.0);
    }
}

/// One head's forward: `O` (`T × hd`) from its `Q`, `K`, `V`.
#[inline(always)]
fn head_forward(q: &[f32], k: &[f32], v: &[f32], t: usize, hd: usize, scale: f32) -> Vec<f32> {
    let mut o = vec![0f32; t * hd];
    let mut p = vec![0f32; TILE * t];
    for r0 in (0..t).step_by(TILE) {
        let br = TILE.min(t - r0);
        let kend = r0 + br;
        let p = &mut p[..br * kend];
        tile_probs(q, k, hd, r0, br, scale, p);
        gemm(
            (br, hd, kend),
            &mut o[r0 * hd..],
            hd,
            false,
            (p, kend, 1),
            (v, hd, 1),
        );
    }
    o
}

/// One head's backward: `(dQ, dK, dV)` (each `T × hd`) from its `Q`, `K`, `V`, output `O` and
/// output gradient `dO`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn head_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    d_o: &[f32],
    t: usize,
    hd: usize,
    scale: f32,
) -> [Vec<f32>; 3] {
    let delta: Vec<f32> = o
        .chunks_exact(hd)
        .zip(d_o.chunks_exact(hd))
        .map(|(o, g)| dot16(o, g))
        .collect();
    let (mut dq, mut dk, mut dv) = (vec![0f32; t * hd], vec![0f32; t * hd], vec![0f32; t * hd]);
    let (mut p, mut ds) = (vec![0f32; TILE * t], vec![0f32; TILE * t]);
    for r0 in (0..t).step_by(TILE) {
        let br = TILE.min(t - r0);
        let kend = r0 + br;
        let p = &mut p[..br * kend];
        let ds = &mut ds[..br * kend];
        tile_probs(q, k, hd, r0, br, scale, p);
        // dV[0..kend] += Pᵀ · dO[r0..r1]
        gemm(
            (kend, hd, br),
            &mut dv,
            hd,
            true,
            (p, 1, kend),
            (&d_o[r0 * hd..], hd, 1),
        );
        // dP = dO[r0..r1] · V[0..kend]ᵀ
        gemm(
            (br, kend, hd),
            ds,
            kend,
            false,
            (&d_o[r0 * hd..], hd, 1),
            (v, 1, hd),
        );
        // dS = s · P ⊙ (dP − D)
        for (i, (ds_row, p_row)) in ds
            .chunks_exact_mut(kend)
            .zip(p.chunks_exact(kend))
            .enumerate()
        {
            let di = delta[r0 + i];
            for (g, &pv) in ds_row.iter_mut().zip(p_row) {
                *g = scale * pv * (*g - di);
            }
        }
        // dQ[r0..r1] = dS · K[0..kend]
        gemm(
            (br, hd, kend),
            &mut dq[r0 * hd..],
            hd,
            false,
            (ds, kend, 1),
            (k, hd, 1),
        );
        // dK[0..kend] += dSᵀ · Q[r0..r1]
        gemm(
            (kend, hd, br),
            &mut dk,
            hd,
            true,
            (ds, 1, kend),
            (&q[r0 * hd..], hd, 1),
        );
    }
    [dq, dk, dv]
}

/// The kernel's forward over `x` = `qkv` `(B, T, w)`, plus `bias` (`w`) added to every row of
/// `x` when given.
pub(super) fn attention_fwd<T: Elem>(
    x: &[T],
    bias: Option<&[f32]>,
    dims: Dims,
    scale: f32,
) -> Vec<T> {
    let (w, d) = (dims.w(), dims.d());
    let heads = parallel_map(dims.b * dims.h, |task| {
        let (bi, hi) = (task / dims.h, task % dims.h);
        let (kc, vc) = dims.kv_cols(hi);
        with_simd(
            #[inline(always)]
            || {
                let q = gather(x, w, dims, bi, hi * dims.hd, bias);
                let k = gather(x, w, dims, bi, kc, bias);
                let v = gather(x, w, dims, bi, vc, bias);
                head_forward(&q, &k, &v, dims.t, dims.hd, scale)
            },
        )
    });
    let n = dims.b * dims.t * d;
    // SAFETY: the heads' column blocks tile every row of every batch element: each element is
    // written once.
    unsafe {
        filled(n, n, |_, y| {
            for (task, o) in heads.iter().enumerate() {
                let (bi, hi) = (task / dims.h, task % dims.h);
                scatter(y, d, dims, bi, hi * dims.hd, o);
            }
        })
    }
}

/// The kernel's backward: `grad x` from `x` (+ `bias` as in [`attention_fwd`]), the output `y`
/// and its gradient `g`.
pub(super) fn attention_bwd<T: Elem>(
    x: &[T],
    bias: Option<&[f32]>,
    y: &[T],
    g: &[T],
    dims: Dims,
    scale: f32,
) -> Vec<T> {
    let (w, d) = (dims.w(), dims.d());
    let mut heads = parallel_map(dims.b * dims.h, |task| {
        let (bi, hi) = (task / dims.h, task % dims.h);
        let (kc, vc) = dims.kv_cols(hi);
        with_simd(
            #[inline(always)]
            || {
                let c = hi * dims.hd;
                let q = gather(x, w, dims, bi, c, bias);
                let k = gather(x, w, dims, bi, kc, bias);
                let v = gather(x, w, dims, bi, vc, bias);
                let o = gather(y, d, dims, bi, c, None);
                let d_o = gather(g, d, dims, bi, c, None);
                head_backward(&q, &k, &v, &o, &d_o, dims.t, dims.hd, scale)
            },
        )
    });
    // A key/value head's gradient is the sum over the query heads it serves, in head order,
    // kept in the group's first head.
    let rep = dims.h / dims.kvh;
    if rep > 1 {
        for group in heads.chunks_mut(rep) {
            let (first, rest) = group.split_at_mut(1);
            for other in rest.iter() {
                for (acc, add) in first[0][1..].iter_mut().zip(&other[1..]) {
                    for (a, &b) in acc.iter_mut().zip(add) {
                        *a += b;
                    }
                }
            }
        }
    }
    // SAFETY: the query blocks of every head and the key and value blocks of every group's
    // first head tile every row: each element is written once.
    unsafe {
        filled(x.len(), x.len(), |_, dx| {
            for (task, [dq, dk, dv]) in heads.iter().enumerate() {
                let (bi, hi) = (task / dims.h, task % dims.h);
                scatter(dx, w, dims, bi, hi * dims.hd, dq);
                if hi % rep == 0 {
                    let (kc, vc) = dims.kv_cols(hi);
                    scatter(dx, w, dims, bi, kc, dk);
                    scatter(dx, w, dims, bi, vc, dv);
                }
            }
        })
    }
}

/// The forward custom op of [`causal_attention`]; its backward is [`AttentionBwdOp`].
#[derive(Clone, Copy, Debug)]
struct AttentionOp {
    n_head: usize,
    n_kv_head: usize,
    scale: f32,
}

impl CustomOp1 for AttentionOp {
    fn name(&self) -> &'static str {
        "causal-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        fn run<T: Elem + candle_core::WithDType>(
            op: &AttentionOp,
            s: &CpuStorage,
            l: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            let dims = Dims::of(l, op.n_head, op.n_kv_head)?;
            let x = contiguous(s.as_slice::<T>()?, l, "qkv")?;
            let y = attention_fwd(x, None, dims, op.scale);
            Ok((
                T::to_cpu_storage_owned(y),
                Shape::from((dims.b, dims.t, dims.d())),
            ))
        }
        match s.dtype() {
            DType::F32 => run::<f32>(self, s, l),
            DType::BF16 => run::<half::bf16>(self, s, l),
            DType::F16 => run::<half::f16>(self, s, l),
            dt => bail!("causal-attention: no CPU kernel for {dt:?}"),
        }
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let op = AttentionBwdOp {
            n_head: self.n_head,
            n_kv_head: self.n_kv_head,
            scale: self.scale,
        };
        Ok(Some(arg.apply_op3_no_bwd(
            res,
            &grad_res.contiguous()?,
            &op,
        )?))
    }
}

/// The backward kernel of [`causal_attention`] as a (no-backward) custom op on
/// `(qkv, y, grad_y)`, giving `grad_qkv`.
#[derive(Clone, Copy, Debug)]
struct AttentionBwdOp {
    n_head: usize,
    n_kv_head: usize,
    scale: f32,
}

impl CustomOp3 for AttentionBwdOp {
    fn name(&self) -> &'static str {
        "causal-attention-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = Dims::of(l1, self.n_head, self.n_kv_head)?;
        let out = [dims.b, dims.t, dims.d()];
        if l2.dims() != out || l3.dims() != out || s2.dtype() != s1.dtype() {
            bail!(
                "causal-attention backward: qkv {:?} {:?}, output {:?} {:?}, gradient {:?} do not fit",
                l1.shape(),
                s1.dtype(),
                l2.shape(),
                s2.dtype(),
                l3.shape()
            );
        }
        fn run<T: Elem + candle_core::WithDType>(
            op: &AttentionBwdOp,
            dims: Dims,
            x: (&CpuStorage, &Layout),
            y: (&CpuStorage, &Layout),
            g: (&CpuStorage, &Layout),
        ) -> Result<(CpuStorage, Shape)> {
            let xs = contiguous(x.0.as_slice::<T>()?, x.1, "qkv")?;
            let ys = contiguous(y.0.as_slice::<T>()?, y.1, "attention output")?;
            let gs = contiguous(g.0.as_slice::<T>()?, g.1, "output gradient")?;
            let dx = attention_bwd(xs, None, ys, gs, dims, op.scale);
            Ok((T::to_cpu_storage_owned(dx), x.1.shape().clone()))
        }
        match s1.dtype() {
            DType::F32 => run::<f32>(self, dims, (s1, l1), (s2, l2), (s3, l3)),
            DType::BF16 => run::<half::bf16>(self, dims, (s1, l1), (s2, l2), (s3, l3)),
            DType::F16 => run::<half::f16>(self, dims, (s1, l1), (s2, l2), (s3, l3)),
            dt => bail!("causal-attention-bwd: no CPU kernel for {dt:?}"),
        }
    }
}
