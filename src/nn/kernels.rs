//! The f32 CPU kernels of a transformer step over plain slices: the building blocks of fused
//! nodes ([`crate::fsdp::fused`]). The GPT block (`models/decoder/fused/gpt2.rs`) and the decoder
//! families' block (`models/decoder/fused.rs`) are written with them; a user's own fused unit
//! can be too.
//!
//! Every matrix is row-major f32 unless a [`Mat`] says otherwise; `N` is the number of rows
//! (tokens, `B·T`). The work of each kernel is split over the rank's threads as the rest of
//! [`crate::nn`] (see its documentation): bit-identical results whatever the thread count,
//! also [`matmul`] on the crate's AVX2 kernel; on the `gemm` crate's ([`matmul_kernel`]) that
//! is the crate's to say.

use std::ops::Range;

use super::attention::{attention_bwd_with, attention_fwd_with, check_options, Dims, Scores};
use super::norm::{norm_bwd, norm_fwd};
use crate::cpu::{exp_fast, filled, gemm_f32, parallel_chunks, parallel_map, with_simd};

pub use super::activation::{gelu_f32 as gelu_tanh, gelu_grad_f32 as gelu_tanh_grad};
pub use super::attention::AttentionOptions;
pub use crate::cpu::{matmul_kernel, MatmulKernel};

/// A strided view of an `rows × cols` f32 matrix: element `(i, j)` at `data[i·rs + j·cs]`.
#[derive(Clone, Copy, Debug)]
pub struct Mat<'a> {
    /// The elements (at least up to the last one the strides reach).
    pub data: &'a [f32],
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Row stride, in elements.
    pub rs: usize,
    /// Column stride, in elements.
    pub cs: usize,
}

impl<'a> Mat<'a> {
    /// A contiguous row-major `rows × cols` matrix.
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// The transposed view (no copy).
    pub fn t(self) -> Self {
        Self {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }

    /// Columns `cols` of the view (no copy).
    ///
    /// Panics: a range past the columns.
    pub fn columns(self, cols: Range<usize>) -> Self {
        assert!(cols.end <= self.cols, "columns {cols:?} of {}", self.cols);
        let start = if cols.is_empty() {
            0
        } else {
            cols.start * self.cs
        };
        Self {
            data: &self.data[start.min(self.data.len())..],
            cols: cols.len(),
            ..self
        }
    }

    /// Rows `rows` of the view (no copy).
    ///
    /// Panics: a range past the rows.
    pub fn rows(self, rows: Range<usize>) -> Self {
        assert!(rows.end <= self.rows, "rows {rows:?} of {}", self.rows);
        let start = if rows.is_empty() {
            0
        } else {
            rows.start * self.rs
        };
        Self {
            data: &self.data[start.min(self.data.len())..],
            rows: rows.len(),
            ..self
        }
    }

    /// Whether every element the strides reach lies in `data` (false when the last one's
    /// offset overflows `usize`).
    fn fits(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || last_offset(self.rows, self.rs, self.cols, self.cs)
                .is_some_and(|last| last < self.data.len())
    }
}

/// `(rows − 1)·rs + (cols − 1)·cs`, the offset of a strided view's last element (`rows`, `cols`
/// at least 1), or `None` when it overflows `usize`: bounds checks on strides a caller chose
/// must not wrap (a wrapped sum passed them and the kernel read 2⁶³ elements away).
pub(super) fn last_offset(rows: usize, rs: usize, cols: usize, cs: usize) -> Option<usize> {
    (rows - 1)
        .checked_mul(rs)?
        .checked_add((cols - 1).checked_mul(cs)?)
}

/// `dst = a · b` (or `dst += a · b` when `accumulate`) for `a` `m × k` and `b` `k × n`; `dst`
/// holds the `m × n` result row-major with row stride `dst_rs` (`≥ n`; a wider stride writes a
/// block of columns of a wider matrix). The kernel [`matmul_kernel`] names, on the rank's
/// threads.
///
/// Panics: shapes that do not chain, a view or `dst` too short for its strides.
pub fn matmul(dst: &mut [f32], dst_rs: usize, accumulate: bool, a: Mat<'_>, b: Mat<'_>) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "matmul: a is {m}×{k}, b {}×{n}", b.rows);
    assert!(a.fits() && b.fits(), "matmul: a view runs past its data");
    assert!(
        dst_rs >= n
            && (m == 0 || n == 0 || last_offset(m, dst_rs, n, 1).is_some_and(|l| l < dst.len())),
        "matmul: dst of {} elements, row stride {dst_rs}, cannot hold {m}×{n}",
        dst.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for row in dst.chunks_mut(dst_rs).take(m) {
                row[..n].fill(0.0);
            }
        }
        return;
    }
    // SAFETY: the asserts above: every element the strides reach is inside its slice.
    unsafe {
        gemm_f32(
            (m, n, k),
            dst.as_mut_ptr(),
            dst_rs,
            accumulate,
            (a.data, a.rs, a.cs),
            (b.data, b.rs, b.cs),
            true,
        )
    }
}

/// `a · b` as a new row-major `m × n` buffer ([`matmul`] without accumulation).
pub fn matmul_new(a: Mat<'_>, b: Mat<'_>) -> Vec<f32> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "matmul: a is {m}×{k}, b {}×{n}", b.rows);
    assert!(a.fits() && b.fits(), "matmul: a view runs past its data");
    if m == 0 || n == 0 || k == 0 {
        return vec![0f32; m * n];
    }
    let mut dst = Vec::with_capacity(m * n);
    // SAFETY: the asserts above; the gemm writes every element of the `m × n` destination (no
    // accumulation), so the length is set after.
    unsafe {
        gemm_f32(
            (m, n, k),
            dst.as_mut_ptr(),
            n,
            false,
            (a.data, a.rs, a.cs),
            (b.data, b.rs, b.cs),
            true,
        );
        dst.set_len(m * n);
    }
    dst
}

/// LayerNorm (`remove_mean`) or RMSNorm of each row of `x` (rows of `w.len()`): `(x − μ)/σ · w
/// (+ b)`, `σ = √(mean((x − μ)²) + eps)` (`μ = 0` for RMSNorm), in f32.
pub fn norm_forward(
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    eps: f32,
    remove_mean: bool,
) -> Vec<f32> {
    assert!(!w.is_empty() && x.len().is_multiple_of(w.len()));
    norm_fwd(x, w, b, eps, remove_mean)
}

/// The backward of [`norm_forward`] for the output gradient `g`: `(dx, dw, db)` (`db` the
/// column sums of `g`, the bias's gradient; ignore it without a bias).
pub fn norm_backward(
    x: &[f32],
    w: &[f32],
    g: &[f32],
    eps: f32,
    remove_mean: bool,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    assert!(!w.is_empty() && x.len().is_multiple_of(w.len()) && g.len() == x.len());
    let d = w.len();
    let mut all = norm_bwd(x, w, g, eps, remove_mean);
    let db = all[x.len() + d..].to_vec();
    let dw = all[x.len()..x.len() + d].to_vec();
    all.truncate(x.len());
    (all, dw, db)
}

/// The shape of an attention problem: `batch` sequences of `seq` positions, `n_head` query and
/// `n_kv_head` key/value heads of `head_dim` features.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    /// Sequences.
    pub batch: usize,
    /// Positions per sequence.
    pub seq: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (dividing `n_head`).
    pub n_kv_head: usize,
    /// Features per head.
    pub head_dim: usize,
}

impl AttentionShape {
    /// Width of `qkv`: `(n_head + 2·n_kv_head)·head_dim`.
    pub fn qkv_width(&self) -> usize {
        (self.n_head + 2 * self.n_kv_head) * self.head_dim
    }

    /// Width of the output: `n_head·head_dim`.
    pub fn out_width(&self) -> usize {
        self.n_head * self.head_dim
    }

    fn dims(&self) -> Dims {
        Dims {
            b: self.batch,
            t: self.seq,
            h: self.n_head,
            kvh: self.n_kv_head,
            hd: self.head_dim,
        }
    }

    fn check(&self, qkv: &[f32], bias: Option<&[f32]>, starts: Option<&[u32]>) {
        // Checked: a product that wrapped could equal `qkv.len()` for a shape it cannot hold.
        let width = (self.n_kv_head.checked_mul(2))
            .and_then(|kv| self.n_head.checked_add(kv))
            .and_then(|heads| heads.checked_mul(self.head_dim));
        let elems = width.and_then(|w| self.batch.checked_mul(self.seq)?.checked_mul(w));
        assert!(
            self.n_kv_head > 0
                && self.n_head > 0
                && self.n_head.is_multiple_of(self.n_kv_head)
                && self.head_dim > 0
                && elems == Some(qkv.len())
                && bias.is_none_or(|b| Some(b.len()) == width),
            "attention: {self:?} does not fit a qkv of {} elements",
            qkv.len()
        );
        if let Some(s) = starts {
            let segments = s.len() == self.batch * self.seq
                && s.chunks(self.seq.max(1)).all(|row| {
                    row.iter()
                        .enumerate()
                        .all(|(i, &v)| v as usize == i || (i > 0 && v == row[i - 1]))
                });
            assert!(
                segments,
                "attention: segment starts of {} values are not those of {self:?}",
                s.len()
            );
        }
    }
}

/// Causal attention over `qkv` `(N, qkv_width)` (queries, keys, values; the layout and the
/// formulas of [`crate::nn::attention`]), plus `bias` added to every row of `qkv` when given
/// (a projection's bias folded into the kernel's reads): the `(N, out_width)` output, heads
/// merged. `opts`' head counts are ignored (`shape`'s are used); its scale, window and
/// soft-cap apply. With `starts` (`batch·seq` values, [`crate::nn::attention_packed`]'s
/// `S(i)`: the first position of each position's example), each query sees only its own
/// example's keys.
///
/// Panics: `qkv` or `bias` not of `shape`'s sizes; `starts` of another length or not segment
/// starts (each `S(i)` is `S(i − 1)` or `i`); an invalid scale, window or soft-cap in `opts`
/// (the message [`crate::nn::attention`]'s error would give).
pub fn attention_forward(
    qkv: &[f32],
    bias: Option<&[f32]>,
    shape: AttentionShape,
    opts: &AttentionOptions,
    starts: Option<&[u32]>,
) -> Vec<f32> {
    shape.check(qkv, bias, starts);
    let sc = scores(opts, shape);
    attention_fwd_with(qkv, bias, shape.dims(), sc, starts)
}

/// The backward of [`attention_forward`]: `qkv`'s gradient `(N, qkv_width)` from `qkv` (and the
/// same `bias`), the forward's output `out` and its gradient `grad` (both `(N, out_width)`).
/// A key/value head's gradient sums over the query heads it serves; `starts` as the forward's.
///
/// Panics: as [`attention_forward`]; `out` or `grad` of another size.
pub fn attention_backward(
    qkv: &[f32],
    bias: Option<&[f32]>,
    out: &[f32],
    grad: &[f32],
    shape: AttentionShape,
    opts: &AttentionOptions,
    starts: Option<&[u32]>,
) -> Vec<f32> {
    shape.check(qkv, bias, starts);
    let n = shape.batch * shape.seq * shape.out_width();
    assert!(
        out.len() == n && grad.len() == n,
        "attention backward: out or grad not (N, out_width)"
    );
    attention_bwd_with(
        qkv,
        bias,
        out,
        grad,
        shape.dims(),
        scores(opts, shape),
        starts,
    )
}

/// The scores' options of `opts` for `shape`'s heads, or a panic naming the invalid one.
fn scores(opts: &AttentionOptions, shape: AttentionShape) -> Scores<'static> {
    if let Err(e) = check_options(opts) {
        panic!("{e}")
    }
    Scores::of(opts, shape.head_dim)
}

/// Rotary position embeddings in place ("rotate half", the formulas of [`crate::nn::rope`]):
/// in every row of `x` (rows of `width` elements; row `r` at position `r % seq`), the `heads`
/// blocks of `cos`'s row width starting at column `col` are rotated by their position's angles,
/// `y = x ⊙ cos + rotate_half(x) ⊙ sin`; with `inverse`, by the opposite angles — which is the
/// backward (`dx = g ⊙ cos − rotate_half(g ⊙ sin)`), the rotation being orthogonal. `cos`,
/// `sin`: `(seq, head_dim)` tables, each frequency at columns `i` and `i + head_dim/2`.
///
/// Panics: tables not `(seq, head_dim)` with an even `head_dim`, blocks past the row, `x` not
/// whole rows of whole sequences.
#[allow(clippy::too_many_arguments)]
pub fn rope_in_place(
    x: &mut [f32],
    width: usize,
    col: usize,
    heads: usize,
    seq: usize,
    cos: &[f32],
    sin: &[f32],
    inverse: bool,
) {
    let hd = cos.len() / seq.max(1);
    assert!(
        hd.is_multiple_of(2)
            && cos.len() == seq * hd
            && sin.len() == cos.len()
            && col + heads * hd <= width
            && x.len().is_multiple_of(width * seq.max(1)),
        "rope_in_place: tables of {} elements for {seq} positions, {heads} heads at column \
         {col} of rows of {width}, x of {} elements",
        cos.len(),
        x.len()
    );
    if x.is_empty() || heads == 0 {
        return;
    }
    let half = hd / 2;
    let sign = if inverse { -1.0f32 } else { 1.0 };
    // Whole rows per task: 64 of them.
    parallel_chunks(x, 64 * width, |i, rows| {
        with_simd(
            #[inline(always)]
            || {
                for (r, row) in rows.chunks_exact_mut(width).enumerate() {
                    let p = (i * 64 + r) % seq;
                    let (c, s) = (&cos[p * hd..][..hd], &sin[p * hd..][..hd]);
                    for head in row[col..col + heads * hd].chunks_exact_mut(hd) {
                        let (a, b) = head.split_at_mut(half);
                        for j in 0..half {
                            let (x1, x2) = (a[j], b[j]);
                            let (s1, s2) = (sign * s[j], sign * s[j + half]);
                            a[j] = x1 * c[j] - x2 * s1;
                            b[j] = x2 * c[j + half] + x1 * s2;
                        }
                    }
                }
            },
        )
    });
}

/// The column sums of `g` `(rows, width)` (a bias's gradient): partial sums over tiles of 64
/// rows on the rank's threads, added in tile order (the same bits whatever the thread count).
pub fn col_sums(g: &[f32], width: usize) -> Vec<f32> {
    col_sums_strided(g, width, 0..width)
}

/// [`col_sums`] of columns `cols` of `g` `(rows, width)`.
pub fn col_sums_strided(g: &[f32], width: usize, cols: Range<usize>) -> Vec<f32> {
    const ROWS: usize = 64;
    assert!(cols.end <= width && (width == 0 || g.len().is_multiple_of(width)));
    let w = cols.len();
    if width == 0 {
        return Vec::new();
    }
    let tiles = g.len().div_ceil(ROWS * width);
    let partials = parallel_map(tiles, |i| {
        let mut s = vec![0f32; w];
        with_simd(
            #[inline(always)]
            || {
                let end = ((i + 1) * ROWS * width).min(g.len());
                for row in g[i * ROWS * width..end].chunks_exact(width) {
                    for (a, &v) in s.iter_mut().zip(&row[cols.clone()]) {
                        *a += v;
                    }
                }
            },
        );
        s
    });
    let mut s = vec![0f32; w];
    for p in &partials {
        for (a, &v) in s.iter_mut().zip(p) {
            *a += v;
        }
    }
    s
}

/// `a += b` element-wise, split over the rank's threads.
///
/// Panics: lengths differ.
pub fn add_assign(a: &mut [f32], b: &[f32]) {
    const CHUNK: usize = 1 << 14;
    assert_eq!(a.len(), b.len(), "add_assign: lengths differ");
    parallel_chunks(a, CHUNK, |i, a| {
        let b = &b[i * CHUNK..][..a.len()];
        with_simd(
            #[inline(always)]
            || {
                for (x, &y) in a.iter_mut().zip(b) {
                    *x += y;
                }
            },
        )
    });
}

/// `rows` copies of `row` (a bias broadcast over the rows), or `base + row` per row when `base`
/// (`rows × row.len()`) is given: the buffer a projection's [`matmul`] then accumulates into,
/// folding the bias and a residual into the product.
pub fn broadcast_rows(rows: usize, row: &[f32], base: Option<&[f32]>) -> Vec<f32> {
    let w = row.len();
    let n = rows
        .checked_mul(w)
        .expect("broadcast_rows: rows × width overflows usize");
    assert!(base.is_none_or(|b| b.len() == n));
    if w == 0 {
        return Vec::new();
    }
    // SAFETY: each chunk of whole rows is written element by element.
    unsafe {
        filled(n, 64 * w, |i, out| {
            with_simd(
                #[inline(always)]
                || {
                    for (r, o) in out.chunks_exact_mut(w).enumerate() {
                        match base {
                            Some(b) => {
                                let b = &b[(i * 64 + r) * w..][..w];
                                for ((o, &b), &v) in o.iter_mut().zip(b).zip(row) {
                                    o.write(b + v);
                                }
                            }
                            None => {
                                for (o, &v) in o.iter_mut().zip(row) {
                                    o.write(v);
                                }
                            }
                        }
                    }
                },
            )
        })
    }
}

/// SiLU `x · σ(x)`, `σ(x) = 1 / (1 + e^{−x})` (the exponential vectorisable, relative error
/// below 2.5e-7).
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp_fast(-x))
}

/// `d silu / dx = σ(x) · (1 + x · (1 − σ(x)))`.
#[inline(always)]
pub fn silu_grad(x: f32) -> f32 {
    let s = 1.0 / (1.0 + exp_fast(-x));
    s * (1.0 + x * (1.0 - s))
}
