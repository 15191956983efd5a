//! Rotary position embeddings (Su et al. 2021, "RoFormer", arXiv:2104.09864) in transformers'
//! "rotate half" form, as one graph node.
//!
//! # Formulas
//!
//! For each row `x` of `head_dim = 2h` values at position `p`, with the tables `c = cos(p·θ)`,
//! `s = sin(p·θ)` (`(T, head_dim)`, each frequency twice: `θ_i` at columns `i` and `i + h`) and
//! `R([a, b]) = [−b, a]` (a rotation of each pair `(j, j + h)` by a quarter turn):
//!
//! ```text
//!     y = x ⊙ c + R(x) ⊙ s
//!     dx = g ⊙ c − R(g ⊙ s)          (Rᵀ = −R)
//! ```
//!
//! On the CPU for f32, bf16 and f16 (computed in f32, rounded once) the forward is one pass and
//! the backward a second (its own no-backward op), the work split over the rank's threads;
//! elsewhere [`rope_composed`] (narrows, a negation, a concatenation and two broadcast products,
//! about six nodes per call, each with its own gradient accumulator in the backward).

use candle_core::{
    backend::BackendStorage, bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, D,
};

use crate::cpu::{contiguous, filled, with_simd, Elem};

/// Elements per task of the kernels.
const CHUNK: usize = 1 << 15;

/// Rotary embedding of `x` `(B, T, heads, head_dim)` with tables `cos`, `sin` `(T,
/// head_dim)`, or `(B, T, head_dim)` when each sequence has its own positions (packed examples)
/// (f32; [`rope_composed`] gives the formula): `x ⊙ cos + rotate_half(x) ⊙ sin`,
/// differentiable in `x` (the tables are constants). Same values as [`rope_composed`] up to
/// rounding; see the module documentation (`src/nn/rope.rs`).
///
/// Errors: `x` not 4-D, an odd `head_dim`, tables of another shape than `(T, head_dim)` or
/// `(B, T, head_dim)`; Candle's.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, t, heads, hd) = x.dims4()?;
    let rows = check(x, cos, sin)?;
    let fused = x.device().is_cpu()
        && matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && x.elem_count() > 0;
    if !fused {
        return rope_composed(x, cos, sin);
    }
    let table = |t: &Tensor| -> Result<Vec<f32>> {
        t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
    };
    debug_assert!(rows == t || rows == b * t);
    let op = RopeOp {
        cos: table(cos)?,
        sin: table(sin)?,
        t: rows,
        heads,
        hd,
        backward: false,
    };
    x.contiguous()?.apply_op1(op)
}

/// The table rows of [`rope`]'s arguments: `T` for `(T, hd)` tables, `B·T` for `(B, T, hd)`.
fn check(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<usize> {
    let (b, t, _, hd) = x.dims4()?;
    let shared = cos.dims() == [t, hd] && sin.dims() == [t, hd];
    let per_row = cos.dims() == [b, t, hd] && sin.dims() == [b, t, hd];
    if hd % 2 != 0 || !(shared || per_row) {
        bail!(
            "rope: x {:?} needs an even head_dim and cos, sin of shape [{t}, {hd}] or [{b}, {t}, \
             {hd}], found {:?} and {:?}",
            x.dims(),
            cos.dims(),
            sin.dims()
        );
    }
    Ok(if shared { t } else { b * t })
}

/// [`rope`] composed of Candle ops: any dtype and device (the tables are converted to `x`'s
/// dtype), differentiable to any order.
///
/// Errors: as [`rope`].
pub fn rope_composed(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, t, _, hd) = x.dims4()?;
    let rows = check(x, cos, sin)?;
    let half = hd / 2;
    let shape = if rows == t && cos.rank() == 2 {
        (1, t, 1, hd)
    } else {
        (b, t, 1, hd)
    };
    let cos = cos.to_dtype(x.dtype())?.reshape(shape)?;
    let sin = sin.to_dtype(x.dtype())?.reshape(shape)?;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?
}

/// The op of [`rope`] (`backward: false`) and of its backward (`true`, no backward itself).
#[derive(Clone)]
struct RopeOp {
    cos: Vec<f32>,
    sin: Vec<f32>,
    t: usize,
    heads: usize,
    hd: usize,
    backward: bool,
}

impl RopeOp {
    /// Forward: `y_j = x_j c_j + sgn_j x_{j'} s_j`; backward: `dx_j = g_j c_j − sgn_j g_{j'}
    /// s_{j'}`, with `j'` the pair partner of `j` and `sgn_j = −1` in the first half, `+1` in
    /// the second.
    fn run<T: Elem>(&self, x: &[T]) -> Vec<T> {
        let (hd, half) = (self.hd, self.hd / 2);
        let row_len = hd;
        // SAFETY: each chunk's every element is written.
        unsafe {
            filled(x.len(), CHUNK, |i, out| {
                let start = i * CHUNK;
                with_simd(
                    #[inline(always)]
                    || {
                        for (k, o) in out.iter_mut().enumerate() {
                            let e = start + k;
                            let (row, j) = (e / row_len, e % row_len);
                            let p = (row / self.heads) % self.t;
                            let (partner, sgn) = if j < half {
                                (e + half, -1.0f32)
                            } else {
                                (e - half, 1.0)
                            };
                            let (c, s) = (self.cos[p * hd + j], self.sin[p * hd + j]);
                            let v = if self.backward {
                                let jp = if j < half { j + half } else { j - half };
                                x[e].to_f32() * c
                                    - sgn * x[partner].to_f32() * self.sin[p * hd + jp]
                            } else {
                                x[e].to_f32() * c + sgn * x[partner].to_f32() * s
                            };
                            o.write(T::from_f32(v));
                        }
                    },
                )
            })
        }
    }
}

impl CustomOp1 for RopeOp {
    fn name(&self) -> &'static str {
        if self.backward {
            "rope-fused-grad"
        } else {
            "rope-fused"
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = match s.dtype() {
            DType::F32 => CpuStorage::F32(self.run(contiguous(s.as_slice::<f32>()?, l, "input")?)),
            DType::BF16 => {
                CpuStorage::BF16(self.run(contiguous(s.as_slice::<half::bf16>()?, l, "input")?))
            }
            DType::F16 => {
                CpuStorage::F16(self.run(contiguous(s.as_slice::<half::f16>()?, l, "input")?))
            }
            dt => bail!("rope: no CPU kernel for {dt:?}"),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let op = RopeOp {
            backward: true,
            ..self.clone()
        };
        Ok(Some(grad_res.contiguous()?.apply_op1_no_bwd(&op)?))
    }
}
