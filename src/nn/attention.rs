//! Causal multi-head self-attention as one graph node, straight from the fused `qkv`
//! projection: a flash-style CPU kernel (Dao et al. 2022, "FlashAttention", arXiv:2205.14135)
//! that never materialises the `(B, h, T, T)` scores. [`attention`] takes the options the model
//! families need ([`AttentionOptions`]): grouped-query heads, the scale of the scores, a sliding
//! window and logit soft-capping.
//!
//! # Formulas
//!
//! For each batch element and head, with `Q`, `K`, `V` its `(T, hd)` slices of `qkv`, `s` the
//! scale (`1/√hd` unless given), `c` the soft-cap and `W` the window:
//!
//! ```text
//!     U = s · Q·Kᵀ          Z = c · tanh(U / c)   (soft-capping on; Z = U when off)
//!     A(i) = { j : i − W < j ≤ i }                (a window W; { j : j ≤ i } without one;
//!                                                  packed examples: also j ≥ S(i), the start
//!                                                  of query i's example, [`attention_packed`])
//!     P_ij = exp(Z_ij) / Σ_{k ∈ A(i)} exp(Z_ik)   (j ∈ A(i); 0 elsewhere)        O = P·V
//! ```
//!
//! and with `dO` the output's gradient and `D_i = Σ_j dO_ij · O_ij` (= `Σ_j P_ij · dP_ij`):
//!
//! ```text
//!     dP = dO·Vᵀ     dZ = P ⊙ (dP − D)     dS = s · dZ ⊙ (1 − (Z/c)²)   (dS = s · dZ when off)
//!     dQ = dS·K      dK = dSᵀ·Q            dV = Pᵀ·dO
//! ```
//!
//! `dS` is the gradient of `Q·Kᵀ`. The soft-cap factor is the chain rule through
//! `Z = c · tanh(U / c)`: `dZ/dU = 1 − tanh²(U / c) = 1 − (Z/c)²`, elementwise, applied to `dS`
//! before the two gemms that read it (entries outside `A(i)` have `P = 0`, hence `dS = 0`).
//! Soft-capping is Gemma 2's (Gemma Team 2024, "Gemma 2", arXiv:2408.00118, §2: attention
//! logits capped at 50 as `soft_cap · tanh(logits / soft_cap)`) in the order of transformers'
//! Gemma 2 `eager_attention_forward`: `Q·Kᵀ · scaling`, then `/ softcap`, `tanh`, `· softcap`,
//! then the mask and the softmax, with `scaling = query_pre_attn_scalar^−½`. The window is
//! transformers' sliding-window mask (`masking_utils.sliding_window_overlay`:
//! `kv_idx > q_idx − sliding_window`, with the causal `kv_idx ≤ q_idx`): `W` keys, the query's
//! own position included.
//!
//! # Kernel
//!
//! Work is cut into one task per `(batch, head)`; the tasks run over rayon's pool under the rule
//! of `crate::cpu::parallel_map`. A task copies its `Q`, `K`, `V` into contiguous f32 buffers and
//! walks the queries in tiles of [`TILE`] rows. For the tile of rows `r0..r1` only keys
//! `k0..r1` exist, `k0 = 0` without a window (causality) and `k0 = max(0, r0 + 1 − W)` with one
//! (whole key blocks left of the window are never computed; with packed examples also at least
//! `S(r0)`, each row's first key being non-decreasing), so the tile's scores are one
//! `(r1 − r0) × (r1 − k0)` gemm, the softmax of each row is exact in one pass over its keys
//! `A(i)` (its whole row is there: no running maximum is needed; the entries of the tile outside
//! `A(i)` are set to zero probability), and the tile's output one `(r1 − r0) × hd` gemm. With
//! soft-capping the `tanh` is taken inside the exponential's pass (the row's maximum is taken
//! on `U`, `tanh` being increasing); the backward keeps `1 − (Z/c)²` of the tile in a third
//! tile buffer. The backward recomputes each tile's `P` the same way instead of storing it
//! (FlashAttention's recomputation) and accumulates `dK`, `dV` over the tiles with gemms that
//! read their destination. Scratch per task: two `TILE × min(T, TILE − 1 + W)` f32 tiles (three
//! in a soft-capped backward) and the head's buffers; nothing of size `T × T` outlives a tile.
//! The gemms run `crate::cpu::gemm_f32` (the kernel `crate::cpu::matmul_kernel` names),
//! single-threaded inside a task; a task converts its output rows into the result itself (its
//! own column block: no pass over the result after the tasks); the exponentials are
//! `crate::cpu::exp_fast`, vectorised, and so is `tanh` (`(1 − e)/(1 + e)` with
//! `e = exp(−2|x|)`). Without a window or a soft-cap (the plain causal case, also what the GPT
//! block of `models/decoder/fused/gpt2.rs` runs) the kernel performs exactly the plain causal kernel's operations,
//! bit for bit: the options cost a branch per row and nothing per element.
//!
//! Grouped-query attention runs the same tasks, one per query head; a task reads the key and
//! value blocks of its group's key/value head, and the backward sums the `dK`, `dV` of a group's
//! query heads (in head order) before writing them once, in a second set of tasks, one per
//! `(batch, key/value head)`.
//!
//! f32, bf16 and f16 inputs on the CPU run the kernel (computing in f32, rounding the outputs
//! once); other dtypes and devices run [`attention_composed`].

mod composed;
mod op;

use candle_core::{bail, DType, Layout, Result, Tensor};

use std::sync::Arc;

use crate::cpu::{
    dot16, exp_fast, gemm_f32, max16, parallel_chunks, parallel_map, sum16, with_simd, Elem,
    Scattered, Uninit,
};
use composed::composed_in;
pub use composed::{
    attention_composed, attention_packed_composed, causal_attention_composed,
    causal_attention_gqa_composed,
};
use op::AttentionOp;

/// Query rows per tile of the kernel: 64 rows of scores for `T` keys are `256 · T` bytes, which
/// stays in L2 for the contexts used here.
pub const TILE: usize = 64;

/// Options of [`attention`] and [`attention_composed`]: the heads, the scale of the scores, a
/// sliding window and logit soft-capping (the formulas: [`attention`]).
/// [`AttentionOptions::new`] is the plain causal case.
///
/// Valid options: `n_kv_head ≥ 1` dividing `n_head`; `scale`, when given, finite and positive;
/// `window`, when given, at least 1; `softcap`, when given, finite and positive. The functions
/// taking them return an error naming the option otherwise.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionOptions {
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention when below `n_head`; it must divide `n_head`).
    /// Key/value head `j` serves query heads `j·rep .. (j+1)·rep`, `rep = n_head / n_kv_head`
    /// (transformers' `repeat_kv`).
    pub n_kv_head: usize,
    /// Multiplier of the scores `Q·Kᵀ`; `None`: `1/√hd`. (Gemma 2: `query_pre_attn_scalar^−½`.)
    pub scale: Option<f64>,
    /// Sliding window `W`: query `i` sees keys `j` with `i − W < j ≤ i` (transformers'
    /// sliding-window mask, `kv_idx > q_idx − sliding_window`), `W` keys with its own. `None`:
    /// all `j ≤ i`. A window of `T` or more is the same as none.
    pub window: Option<usize>,
    /// Logit soft-capping `c` (Gemma 2's `attn_logit_softcapping`): the scaled scores `u`
    /// become `c · tanh(u / c)` before the softmax. `None`: off.
    pub softcap: Option<f64>,
}

impl AttentionOptions {
    /// The plain causal case: `n_head` query heads, `n_kv_head` key/value heads, scale
    /// `1/√hd`, no window, no soft-capping.
    pub fn new(n_head: usize, n_kv_head: usize) -> Self {
        Self {
            n_head,
            n_kv_head,
            scale: None,
            window: None,
            softcap: None,
        }
    }
}

/// Causal self-attention over a fused projection with the options of [`AttentionOptions`]
/// (grouped-query heads, scale, sliding window, logit soft-capping), differentiable in `qkv`.
///
/// `qkv` is `(B, T, (n_head + 2·n_kv_head)·hd)`: for each position the `n_head·hd` query
/// features, then the `n_kv_head·hd` key features, then the `n_kv_head·hd` value features,
/// head `h` at columns `h·hd .. (h+1)·hd` of each block. With `n_kv_head == n_head` this is
/// `(B, T, 3·d)`, what a `Linear(d, 3d)` followed by a reshape to `(B, T, 3, n_head, hd)` means
/// in GPT-2 and nanoGPT. Query head `h` attends with key/value head `h / (n_head / n_kv_head)`
/// (Ainslie et al. 2023, "GQA", arXiv:2305.13245; transformers' `repeat_kv`), without the keys
/// and values being repeated in memory; their gradients sum over the query heads they serve.
/// The result is `(B, T, n_head·hd)` in `qkv`'s dtype, head `h` at columns `h·hd ..`: the heads
/// merged, ready for the output projection. For each batch element and query head, query
/// position `i`, with `s` the scale, `c` the soft-cap and `W` the window:
///
/// ```text
///     z_ij = c · tanh(s · q_i·k_j / c)      (s · q_i·k_j without a soft-cap)
///     A(i) = { j : i − W < j ≤ i }           ({ j : j ≤ i } without a window)
///     y_i  = Σ_{j ∈ A(i)} exp(z_ij) · v_j / Σ_{j ∈ A(i)} exp(z_ij)
/// ```
///
/// (the gradient's formulas, the soft-cap's slope among them, and the kernel are in the
/// documentation of the module, `src/nn/attention.rs`).
///
/// Dtypes and devices: f32, bf16 and f16 on the CPU run the flash-style kernel (a forward and
/// a backward custom op, computing in f32); anything else (f64, other devices, an empty
/// `qkv`) runs [`attention_composed`]. Both give the same values up to rounding (the tests
/// compare them, values and gradients, and an f64 reference).
///
/// Errors: `qkv` not of rank 3; `n_kv_head` zero or not dividing `n_head`; the last dimension
/// not a multiple of `n_head + 2·n_kv_head`; an invalid `scale`, `window` or `softcap` (each
/// error names the option); Candle's.
pub fn attention(qkv: &Tensor, opts: &AttentionOptions) -> Result<Tensor> {
    attention_in(qkv, opts, None)
}

/// [`attention`] over sequences that pack several examples one after the other (supervised
/// fine-tuning's packing): each query sees only keys of its own example, on top of the
/// causal mask and the window:
///
/// ```text
///     A(i) = { j : max(S(i), i − W + 1) ≤ j ≤ i }
/// ```
///
/// with `starts` `(B, T)` u32 holding `S(i)`, the first position of position `i`'s example
/// in its sequence (as [`segment_starts`] derives from position ids). Rows whose examples
/// start at 0 everywhere give [`attention`]'s values exactly. The kernel computes no score left
/// of a tile's first row's `S` (a packed batch costs less than a full causal one).
///
/// Errors: as [`attention`]; `starts` not `(B, T)` u32 of `qkv`'s `B`, `T`, or not segment
/// starts (`S(0) = 0`; each `S(i)` is `S(i − 1)` or `i`), naming the first bad position.
pub fn attention_packed(qkv: &Tensor, opts: &AttentionOptions, starts: &Tensor) -> Result<Tensor> {
    attention_in(qkv, opts, Some(starts))
}

/// The first position of each position's example, `(B, T)` u32, from position ids `(B, T)`
/// (u32 or i64): a new example starts at 0 and wherever a position id is not the previous one
/// plus one (transformers' `find_packed_sequence_indices`, the rule behind its packed-sequence
/// masks and `DataCollatorWithFlattening`). Positions `0, 1, 2, 0, 1` give starts `0, 0, 0,
/// 3, 3`.
///
/// Errors: `position_ids` not 2-D or not an integer dtype; Candle's.
pub fn segment_starts(position_ids: &Tensor) -> Result<Tensor> {
    let (b, t) = position_ids.dims2()?;
    let ids: Vec<i64> = match position_ids.dtype() {
        DType::U32 | DType::U8 | DType::I64 => position_ids
            .to_dtype(DType::I64)?
            .flatten_all()?
            .to_vec1::<i64>()?,
        dt => bail!("segment_starts: position ids must be integers (u32 or i64), found {dt:?}"),
    };
    let mut starts = Vec::with_capacity(b * t);
    for row in ids.chunks(t.max(1)).take(b) {
        let mut s = 0u32;
        for (i, &p) in row.iter().enumerate() {
            if i > 0 && p != row[i - 1] + 1 {
                s = i as u32;
            }
            starts.push(s);
        }
    }
    Tensor::from_vec(starts, (b, t), position_ids.device())
}

/// The starts of `starts` `(B, T)` as `B·T` values, checked against `qkv`'s `(B, T)`.
fn starts_of(starts: &Tensor, b: usize, t: usize) -> Result<Vec<u32>> {
    if starts.dims() != [b, t] || starts.dtype() != DType::U32 {
        bail!(
            "attention: segment starts must be ({b}, {t}) u32 like qkv's (B, T), found {:?} {:?}",
            starts.dims(),
            starts.dtype()
        )
    }
    let v = starts.flatten_all()?.to_vec1::<u32>()?;
    for (bi, row) in v.chunks(t.max(1)).enumerate() {
        for (i, &s) in row.iter().enumerate() {
            let prev = if i == 0 { 0 } else { row[i - 1] };
            if s as usize != i && s != prev {
                bail!(
                    "attention: segment start {s} at position {i} of sequence {bi} is neither the \
                     previous position's start {prev} nor {i} (a new example)"
                )
            }
        }
    }
    Ok(v)
}

/// [`attention`] (`starts` none) or [`attention_packed`].
fn attention_in(qkv: &Tensor, opts: &AttentionOptions, starts: Option<&Tensor>) -> Result<Tensor> {
    let (b, t, hd) = check(qkv, opts)?;
    let starts = starts.map(|s| starts_of(s, b, t)).transpose()?;
    let kernel = qkv.device().is_cpu()
        && matches!(qkv.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && qkv.elem_count() > 0;
    if !kernel {
        return composed_in(qkv, opts, starts.as_deref());
    }
    qkv.contiguous()?.apply_op1(AttentionOp {
        n_head: opts.n_head,
        n_kv_head: opts.n_kv_head,
        scores: Scores::of(opts, hd),
        starts: starts.map(Arc::from),
    })
}

/// Causal multi-head self-attention over a fused projection, differentiable in `qkv`: [`attention`]
/// with `AttentionOptions::new(n_head, n_head)` (scale `1/√hd`, no window, no soft-cap).
///
/// `qkv` is `(B, T, 3·d)`: for each position, the `d` query features, then the `d` key
/// features, then the `d` value features, head `h` at columns `h·hd .. (h+1)·hd` of each
/// (`hd = d / n_head`). The result is `(B, T, d)`, the heads merged.
///
/// Errors: `qkv` not of rank 3, its last dimension not `3 · d` with `n_head` dividing `d`;
/// Candle's.
pub fn causal_attention(qkv: &Tensor, n_head: usize) -> Result<Tensor> {
    causal_attention_gqa(qkv, n_head, n_head)
}

/// Causal grouped-query attention over a fused projection, differentiable in `qkv`:
/// [`attention`] with `AttentionOptions::new(n_head, n_kv_head)` (scale `1/√hd`, no window, no
/// soft-cap). `qkv` is `(B, T, (n_head + 2·n_kv_head)·hd)`, the result `(B, T, n_head·hd)`.
///
/// Errors: as [`attention`].
pub fn causal_attention_gqa(qkv: &Tensor, n_head: usize, n_kv_head: usize) -> Result<Tensor> {
    attention(qkv, &AttentionOptions::new(n_head, n_kv_head))
}

/// `(B, T, hd)` of a valid `qkv` under valid options.
fn check(qkv: &Tensor, opts: &AttentionOptions) -> Result<(usize, usize, usize)> {
    let dims = check_qkv(qkv, opts.n_head, opts.n_kv_head)?;
    check_options(opts)?;
    Ok(dims)
}

/// `opts`' scale, window and soft-cap valid (the head counts are the shape's business).
pub(super) fn check_options(opts: &AttentionOptions) -> Result<()> {
    // Positive and finite, in f64 and as the kernel's f32.
    let positive = |v: f64| v.is_finite() && v > 0.0 && (v as f32).is_finite() && v as f32 > 0.0;
    if let Some(s) = opts.scale.filter(|&s| !positive(s)) {
        bail!("attention: option `scale` must be finite and positive, found {s}")
    }
    if opts.window == Some(0) {
        bail!("attention: option `window` must be at least 1 (keys i − W < j ≤ i), found 0")
    }
    if let Some(c) = opts.softcap.filter(|&c| !positive(c)) {
        bail!("attention: option `softcap` must be finite and positive, found {c}")
    }
    Ok(())
}

/// `(B, T, hd)` of a valid `qkv`.
fn check_qkv(qkv: &Tensor, n_head: usize, n_kv_head: usize) -> Result<(usize, usize, usize)> {
    let Ok((b, t, c)) = qkv.dims3() else {
        bail!(
            "attention: qkv must be (B, T, 3·d) (grouped-query: (B, T, (n_head + \
             2·n_kv_head)·hd)), found {:?}",
            qkv.shape()
        )
    };
    if n_head == 0 || n_kv_head == 0 || !n_head.is_multiple_of(n_kv_head) {
        bail!("attention: n_kv_head {n_kv_head} must divide n_head {n_head} (both at least 1)")
    }
    let per = n_head + 2 * n_kv_head;
    if c % per != 0 && n_kv_head == n_head {
        bail!("attention: qkv's last dimension {c} must be 3·d with n_head {n_head} dividing d")
    }
    if c % per != 0 {
        bail!(
            "attention: qkv's last dimension {c} must be (n_head {n_head} + 2·n_kv_head \
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
/// `qkv` whose projection's bias was left for this pass, as the fused blocks do).
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
///
/// # Safety
///
/// No other task writes these elements meanwhile.
#[inline(always)]
unsafe fn scatter<T: Elem>(
    dst: Scattered<'_, T>,
    width: usize,
    dims: Dims,
    bi: usize,
    col: usize,
    src: &[f32],
) {
    let (t, hd) = (dims.t, dims.hd);
    let base = bi * t * width + col;
    for (i, row) in src.chunks_exact(hd).enumerate() {
        // SAFETY: this task's block (the caller's contract).
        let out = unsafe { dst.run(base + i * width, hd) };
        for (o, &v) in out.iter_mut().zip(row) {
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

/// What the kernel does to a head's scores `Q·Kᵀ`, past the shapes: the scale, the window and
/// the soft-cap of [`AttentionOptions`], in f32, and in a task, the segment starts of its
/// sequence.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Scores<'a> {
    /// `s` (positive).
    pub(super) scale: f32,
    /// `W` (at least 1), or all earlier keys.
    pub(super) window: Option<usize>,
    /// `c` (positive), or no soft-capping.
    pub(super) softcap: Option<f32>,
    /// `S(i)` of each position of the task's sequence (`T` values, [`attention_packed`]), or
    /// one segment.
    pub(super) starts: Option<&'a [u32]>,
}

impl<'a> Scores<'a> {
    /// The options of `opts` for heads of `hd` features, one segment.
    pub(super) fn of(opts: &AttentionOptions, hd: usize) -> Scores<'static> {
        Scores {
            scale: match opts.scale {
                None => (hd as f32).sqrt().recip(),
                Some(s) => s as f32,
            },
            window: opts.window,
            softcap: opts.softcap.map(|c| c as f32),
            starts: None,
        }
    }

    /// These options for sequence `bi` of `t` positions, with the starts of every sequence
    /// (`B·T` values) when given.
    #[inline(always)]
    fn in_sequence(self, starts: Option<&'a [u32]>, bi: usize, t: usize) -> Scores<'a> {
        Scores {
            starts: starts.map(|s| &s[bi * t..(bi + 1) * t]),
            ..self
        }
    }

    /// The first key query `i` sees: `max(0, i + 1 − W, S(i))`, `S(i)` its segment's first
    /// position (0 in one segment). Non-decreasing in `i` (the starts are checked to be).
    #[inline(always)]
    fn first_key(&self, i: usize) -> usize {
        let w = match self.window {
            None => 0,
            Some(w) => (i + 1).saturating_sub(w),
        };
        match self.starts {
            None => w,
            Some(s) => w.max(s[i] as usize),
        }
    }

    /// The most keys a tile of [`TILE`] rows reads: `min(T, TILE − 1 + W)`.
    fn tile_width(&self, t: usize) -> usize {
        match self.window {
            None => t,
            Some(w) => t.min((TILE - 1).saturating_add(w)),
        }
    }
}

/// `(tanh x, 1 − tanh² x)` as `((1 − e) / (1 + e), 4e / (1 + e)²)` with `e = exp(−2|x|)` and the
/// sign of `x` restored on the first: a vectorised exponential, no overflow, both tails exact to
/// a few f32 ulps (the second one relatively), absolute error a few ulps of 1 near 0.
#[inline(always)]
fn tanh_and_slope(x: f32) -> (f32, f32) {
    let e = exp_fast(-2.0 * x.abs());
    let inv = (1.0 + e).recip();
    ((1.0 - e).copysign(x) * inv, 4.0 * e * inv * inv)
}

/// The probabilities `P` of query rows `r0 .. r0 + br` against keys `k0 .. kend` (`k0 =
/// sc.first_key(r0)`, `kend = r0 + br`) into `p` (`br × (kend − k0)`, row-major): `s · q·kᵀ`,
/// soft-capped when `sc.softcap` is set, then the softmax of each row over its keys, zero
/// outside them. With `slope` (soft-capping only) `1 − (Z/c)²` of each entry goes there (zero
/// outside the row's keys). Returns `k0`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn tile_probs(
    q: &[f32],
    k: &[f32],
    hd: usize,
    r0: usize,
    br: usize,
    sc: Scores<'_>,
    p: &mut [f32],
    mut slope: Option<&mut [f32]>,
) -> usize {
    let (k0, kend) = (sc.first_key(r0), r0 + br);
    let n = kend - k0;
    gemm(
        (br, n, hd),
        p,
        n,
        false,
        (&q[r0 * hd..], hd, 1),
        (&k[k0 * hd..], 1, hd),
    );
    let scale = sc.scale;
    for (i, row) in p.chunks_exact_mut(n).enumerate() {
        // Keys first_key(r0 + i) ..= r0 + i, at lo .. hi of the tile's row.
        let (lo, hi) = (sc.first_key(r0 + i) - k0, r0 + i + 1 - k0);
        let (left, rest) = row.split_at_mut(lo);
        let (live, masked) = rest.split_at_mut(hi - lo);
        // softmax(s·x) = exp(s·(x − max x)) / Σ: the scale folded into the exponential's pass.
        let m = max16(live);
        match (sc.softcap, slope.as_deref_mut()) {
            (None, _) => {
                for v in live.iter_mut() {
                    *v = exp_fast(scale * (*v - m));
                }
            }
            // Z = c·tanh(a·x), a = s/c: tanh is increasing, so max Z = c·tanh(a·max x).
            (Some(c), None) => {
                let a = scale / c;
                let mz = c * tanh_and_slope(a * m).0;
                for v in live.iter_mut() {
                    *v = exp_fast(c * tanh_and_slope(a * *v).0 - mz);
                }
            }
            (Some(c), Some(slope)) => {
                let a = scale / c;
                let mz = c * tanh_and_slope(a * m).0;
                let srow = &mut slope[i * n..(i + 1) * n];
                srow[..lo].fill(0.0);
                srow[hi..].fill(0.0);
                for (v, f) in live.iter_mut().zip(&mut srow[lo..hi]) {
                    let (th, d) = tanh_and_slope(a * *v);
                    *f = d;
                    *v = exp_fast(c * th - mz);
                }
            }
        }
        let inv = sum16(live, |v| v).recip();
        for v in live.iter_mut() {
            *v *= inv;
        }
        left.fill(0.0);
        masked.fill(0.0);
    }
    k0
}

/// One head's forward: `O` (`T × hd`) from its `Q`, `K`, `V`.
#[inline(always)]
fn head_forward(q: &[f32], k: &[f32], v: &[f32], t: usize, hd: usize, sc: Scores<'_>) -> Vec<f32> {
    let mut o = vec![0f32; t * hd];
    let mut p = vec![0f32; TILE * sc.tile_width(t)];
    for r0 in (0..t).step_by(TILE) {
        let br = TILE.min(t - r0);
        let n = r0 + br - sc.first_key(r0);
        let p = &mut p[..br * n];
        let k0 = tile_probs(q, k, hd, r0, br, sc, p, None);
        gemm(
            (br, hd, n),
            &mut o[r0 * hd..],
            hd,
            false,
            (p, n, 1),
            (&v[k0 * hd..], hd, 1),
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
    sc: Scores<'_>,
) -> [Vec<f32>; 3] {
    let delta: Vec<f32> = o
        .chunks_exact(hd)
        .zip(d_o.chunks_exact(hd))
        .map(|(o, g)| dot16(o, g))
        .collect();
    let (mut dq, mut dk, mut dv) = (vec![0f32; t * hd], vec![0f32; t * hd], vec![0f32; t * hd]);
    let width = sc.tile_width(t);
    let (mut p, mut ds) = (vec![0f32; TILE * width], vec![0f32; TILE * width]);
    // 1 − (Z/c)² of a tile: soft-capping only.
    let slope_len = if sc.softcap.is_some() {
        TILE * width
    } else {
        0
    };
    let mut slope = vec![0f32; slope_len];
    let scale = sc.scale;
    for r0 in (0..t).step_by(TILE) {
        let br = TILE.min(t - r0);
        let n = r0 + br - sc.first_key(r0);
        let p = &mut p[..br * n];
        let ds = &mut ds[..br * n];
        let mut tile_slope = sc.softcap.map(|_| &mut slope[..br * n]);
        let k0 = tile_probs(q, k, hd, r0, br, sc, p, tile_slope.as_deref_mut());
        // dV[k0..kend] += Pᵀ · dO[r0..r1]
        gemm(
            (n, hd, br),
            &mut dv[k0 * hd..],
            hd,
            true,
            (p, 1, n),
            (&d_o[r0 * hd..], hd, 1),
        );
        // dP = dO[r0..r1] · V[k0..kend]ᵀ
        gemm(
            (br, n, hd),
            ds,
            n,
            false,
            (&d_o[r0 * hd..], hd, 1),
            (&v[k0 * hd..], 1, hd),
        );
        // dS = s · P ⊙ (dP − D) [⊙ (1 − (Z/c)²)]
        match tile_slope {
            None => {
                for (i, (ds_row, p_row)) in
                    ds.chunks_exact_mut(n).zip(p.chunks_exact(n)).enumerate()
                {
                    let di = delta[r0 + i];
                    for (g, &pv) in ds_row.iter_mut().zip(p_row) {
                        *g = scale * pv * (*g - di);
                    }
                }
            }
            Some(slope) => {
                for (i, ((ds_row, p_row), f_row)) in ds
                    .chunks_exact_mut(n)
                    .zip(p.chunks_exact(n))
                    .zip(slope.chunks_exact(n))
                    .enumerate()
                {
                    let di = delta[r0 + i];
                    for ((g, &pv), &f) in ds_row.iter_mut().zip(p_row).zip(f_row) {
                        *g = scale * pv * (*g - di) * f;
                    }
                }
            }
        }
        // dQ[r0..r1] = dS · K[k0..kend]
        gemm(
            (br, hd, n),
            &mut dq[r0 * hd..],
            hd,
            false,
            (ds, n, 1),
            (&k[k0 * hd..], hd, 1),
        );
        // dK[k0..kend] += dSᵀ · Q[r0..r1]
        gemm(
            (n, hd, br),
            &mut dk[k0 * hd..],
            hd,
            true,
            (ds, 1, n),
            (&q[r0 * hd..], hd, 1),
        );
    }
    [dq, dk, dv]
}

/// The kernel's forward over `x` = `qkv` `(B, T, w)`, plus `bias` (`w`) added to every row of
/// `x` when given, with the scores' options `sc` and the segment starts of every position
/// (`B·T`, checked by the caller) when given (`nn::kernels::attention_forward`).
#[inline(always)]
pub(super) fn attention_fwd_with<T: Elem>(
    x: &[T],
    bias: Option<&[f32]>,
    dims: Dims,
    sc: Scores<'_>,
    starts: Option<&[u32]>,
) -> Vec<T> {
    let (w, d) = (dims.w(), dims.d());
    // The tasks below write every element only for a shape the callers checked.
    debug_assert!(dims.h > 0 && dims.h.is_multiple_of(dims.kvh) && x.len() == dims.b * dims.t * w);
    let mut y = Uninit::new(dims.b * dims.t * d);
    let out = y.share();
    parallel_map(dims.b * dims.h, |task| {
        let (bi, hi) = (task / dims.h, task % dims.h);
        let (kc, vc) = dims.kv_cols(hi);
        with_simd(
            #[inline(always)]
            || {
                let q = gather(x, w, dims, bi, hi * dims.hd, bias);
                let k = gather(x, w, dims, bi, kc, bias);
                let v = gather(x, w, dims, bi, vc, bias);
                let sc = sc.in_sequence(starts, bi, dims.t);
                let o = head_forward(&q, &k, &v, dims.t, dims.hd, sc);
                // SAFETY: the task's own column block of its batch element's rows.
                unsafe { scatter(out, d, dims, bi, hi * dims.hd, &o) }
            },
        )
    });
    // SAFETY: the heads' column blocks tile every row of every batch element.
    unsafe { y.assume_init() }
}

/// The kernel's backward: `grad x` from `x` (+ `bias` as in [`attention_fwd_with`]), the output
/// `y` and its gradient `g`, with the scores' options `sc` and the segment starts.
#[inline(always)]
pub(super) fn attention_bwd_with<T: Elem>(
    x: &[T],
    bias: Option<&[f32]>,
    y: &[T],
    g: &[T],
    dims: Dims,
    sc: Scores<'_>,
    starts: Option<&[u32]>,
) -> Vec<T> {
    let (w, d) = (dims.w(), dims.d());
    let rep = dims.h / dims.kvh;
    // The tasks below write every element only for a shape the callers checked.
    debug_assert!(dims.h > 0 && dims.h.is_multiple_of(dims.kvh) && x.len() == dims.b * dims.t * w);
    let mut dx = Uninit::new(x.len());
    let out = dx.share();
    // Each task writes its head's `dQ`, and its `dK`, `dV` when its key/value head serves it
    // alone; else it returns them for the group's sum below.
    let mut kv = parallel_map(dims.b * dims.h, |task| {
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
                let sc = sc.in_sequence(starts, bi, dims.t);
                let [dq, dk, dv] = head_backward(&q, &k, &v, &o, &d_o, dims.t, dims.hd, sc);
                // SAFETY: the task's own query block; its key and value blocks when no other
                // query head reads them.
                unsafe {
                    scatter(out, w, dims, bi, c, &dq);
                    if rep > 1 {
                        return Some([dk, dv]);
                    }
                    scatter(out, w, dims, bi, kc, &dk);
                    scatter(out, w, dims, bi, vc, &dv);
                }
                None
            },
        )
    });
    if rep > 1 {
        // A key/value head's gradient is the sum over the query heads it serves, in head
        // order: one task per batch element and key/value head.
        parallel_chunks(&mut kv, rep, |group, heads| {
            let bi = group / dims.kvh;
            let (kc, vc) = dims.kv_cols(group % dims.kvh * rep);
            with_simd(
                #[inline(always)]
                || {
                    // Summed into the first head's buffers (taken, not copied).
                    let mut sum = heads[0].take().expect("a grouped head's dK, dV");
                    for other in heads[1..].iter().flatten() {
                        for (acc, add) in sum.iter_mut().zip(other) {
                            for (a, &b) in acc.iter_mut().zip(add) {
                                *a += b;
                            }
                        }
                    }
                    // SAFETY: the group's key and value blocks, which no head task wrote.
                    unsafe {
                        scatter(out, w, dims, bi, kc, &sum[0]);
                        scatter(out, w, dims, bi, vc, &sum[1]);
                    }
                },
            )
        });
    }
    // SAFETY: every head's query block, every key/value head's blocks, in every row.
    unsafe { dx.assume_init() }
}
