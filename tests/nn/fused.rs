//! The fused kernels of `nn` against the composed ops they replace.
//!
//! - `causal_attention`: values and the gradient of `qkv` equal `causal_attention_composed`'s
//!   (the q/k/v split, `Q·Kᵀ`, causal softmax, `·V`, head merge) in f32, for contexts below,
//!   at and across the kernel's 64-row tile, and equal a direct f64 reference written out here
//!   (loops over the formulas); bf16 and f16 stay within their rounding of the f32 values;
//!   queries never see later keys (changing a later position leaves earlier outputs bit-equal).
//! - `gelu`: values and gradients of the fused kernel equal Candle's `gelu` over a wide range,
//!   NaN stays NaN, an empty tensor works.
//! - `cross_entropy`: loss and logit gradients equal candle-nn's for u32 and i64 targets, with
//!   an upstream gradient other than 1; a target out of range is an error naming the row.

use candle_core::{DType, Device, Tensor, Var};
use candle_fsdp::nn::{
    causal_attention, causal_attention_composed, causal_attention_gqa,
    causal_attention_gqa_composed, cross_entropy, cross_entropy_composed, gelu, gelu_composed,
};
use rand::{Rng, SeedableRng};

pub(super) fn random(seed: u64, shape: &[usize], spread: f64) -> Tensor {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| (spread * (rng.random::<f64>() * 2.0 - 1.0)) as f32)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

pub(super) fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

pub(super) fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            if x.is_nan() && y.is_nan() {
                0.0
            } else {
                (x - y).abs()
            }
        })
        .fold(0.0, f64::max)
}

/// `(y, d loss / d qkv)` for `loss = Σ y ⊙ w` through `f`.
fn attention_and_grad(
    f: impl Fn(&Tensor, usize) -> candle_core::Result<Tensor>,
    qkv: &Tensor,
    heads: usize,
    w: &Tensor,
) -> (Vec<f64>, Vec<f64>) {
    let v = Var::from_tensor(qkv).unwrap();
    let y = f(v.as_tensor(), heads).unwrap();
    let loss = (&y * w.to_dtype(y.dtype()).unwrap())
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    (values(&y), values(grads.get(v.as_tensor()).unwrap()))
}

/// Causal attention over `(B, T, 3d)` computed directly in f64 from the formula.
fn attention_reference(qkv: &[f64], b: usize, t: usize, heads: usize, hd: usize) -> Vec<f64> {
    let d = heads * hd;
    let scale = 1.0 / (hd as f64).sqrt();
    let at = |bi: usize, ti: usize, c: usize| qkv[(bi * t + ti) * 3 * d + c];
    let mut y = vec![0f64; b * t * d];
    for bi in 0..b {
        for h in 0..heads {
            for i in 0..t {
                let s: Vec<f64> = (0..=i)
                    .map(|j| {
                        (0..hd)
                            .map(|c| at(bi, i, h * hd + c) * at(bi, j, d + h * hd + c))
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for c in 0..hd {
                    y[(bi * t + i) * d + h * hd + c] = (0..=i)
                        .map(|j| e[j] / z * at(bi, j, 2 * d + h * hd + c))
                        .sum();
                }
            }
        }
    }
    y
}

#[test]
fn attention_equals_composed_ops_and_f64_reference() {
    // Contexts below, at and across the 64-row tile (and a ragged last tile).
    for (case, (b, t, heads, hd)) in [(2, 5, 2, 4), (1, 64, 3, 8), (2, 70, 2, 16), (1, 130, 1, 5)]
        .into_iter()
        .enumerate()
    {
        let d = heads * hd;
        let qkv = random(10 + case as u64, &[b, t, 3 * d], 1.5);
        let w = random(20 + case as u64, &[b, t, d], 1.0);
        let (y, g) = attention_and_grad(causal_attention, &qkv, heads, &w);
        let (yc, gc) = attention_and_grad(causal_attention_composed, &qkv, heads, &w);
        let (dy, dg) = (max_abs_diff(&y, &yc), max_abs_diff(&g, &gc));
        assert!(dy < 2e-6, "case {case}: values differ by {dy}");
        assert!(dg < 2e-5, "case {case}: gradients differ by {dg}");

        // f64: the kernel against the formula written out, and against Candle's autograd of
        // the composed ops in f64 for the gradient.
        let r = attention_reference(&values(&qkv), b, t, heads, hd);
        let dr = max_abs_diff(&y, &r);
        assert!(
            dr < 2e-6,
            "case {case}: values differ from the f64 formula by {dr}"
        );
        let q64 = qkv.to_dtype(DType::F64).unwrap();
        let (y64, g64) = attention_and_grad(causal_attention_composed, &q64, heads, &w);
        assert!(
            max_abs_diff(&y64, &r) < 1e-12,
            "case {case}: composed f64 is not the formula"
        );
        let dg64 = max_abs_diff(&g, &g64);
        assert!(
            dg64 < 2e-5,
            "case {case}: gradients differ from f64 by {dg64}"
        );
    }
}

/// `qkv` of grouped-query attention `(B, T, (h + 2·kvh)·hd)` with its key/value heads repeated
/// to `h` heads (transformers' `repeat_kv`): the multi-head `(B, T, 3·h·hd)` it means.
fn repeat_kv(qkv: &[f64], b: usize, t: usize, h: usize, kvh: usize, hd: usize) -> Vec<f64> {
    let (w, rep) = ((h + 2 * kvh) * hd, h / kvh);
    let mut out = Vec::with_capacity(b * t * 3 * h * hd);
    for row in qkv.chunks_exact(w).take(b * t) {
        out.extend_from_slice(&row[..h * hd]);
        for block in [&row[h * hd..(h + kvh) * hd], &row[(h + kvh) * hd..]] {
            for head in 0..h {
                let j = head / rep;
                out.extend_from_slice(&block[j * hd..(j + 1) * hd]);
            }
        }
    }
    out
}

#[test]
fn grouped_query_attention_equals_composed_ops_and_the_repeated_reference() {
    // (b, t, h, kvh, hd): groups of 2 and 3 query heads, one key/value head for all (MQA), and
    // kvh = h (plain multi-head through the same entry point).
    for (case, (b, t, h, kvh, hd)) in [
        (2, 5, 4, 2, 4),
        (1, 70, 6, 2, 8),
        (2, 66, 3, 1, 16),
        (1, 9, 2, 2, 5),
    ]
    .into_iter()
    .enumerate()
    {
        let qkv = random(40 + case as u64, &[b, t, (h + 2 * kvh) * hd], 1.5);
        let w = random(50 + case as u64, &[b, t, h * hd], 1.0);
        let kernel = |x: &Tensor, h| causal_attention_gqa(x, h, kvh);
        let composed = |x: &Tensor, h| causal_attention_gqa_composed(x, h, kvh);
        let (y, g) = attention_and_grad(kernel, &qkv, h, &w);
        let (yc, gc) = attention_and_grad(composed, &qkv, h, &w);
        let (dy, dg) = (max_abs_diff(&y, &yc), max_abs_diff(&g, &gc));
        assert!(dy < 2e-6, "case {case}: values differ by {dy}");
        assert!(dg < 2e-5, "case {case}: gradients differ by {dg}");
        // Values: the multi-head formula on the repeated heads, in f64.
        let r = attention_reference(&repeat_kv(&values(&qkv), b, t, h, kvh, hd), b, t, h, hd);
        let dr = max_abs_diff(&y, &r);
        assert!(
            dr < 2e-6,
            "case {case}: values differ from the f64 formula by {dr}"
        );
        // Gradients: Candle's autograd of the composed ops in f64 (the repeat's backward sums
        // over each group).
        let (_, g64) = attention_and_grad(composed, &qkv.to_dtype(DType::F64).unwrap(), h, &w);
        let dg64 = max_abs_diff(&g, &g64);
        assert!(
            dg64 < 2e-5,
            "case {case}: gradients differ from f64 by {dg64}"
        );
    }
    // A group count that does not divide the heads, and a width that does not fit, are named.
    let e = causal_attention_gqa(&random(1, &[1, 4, 40], 1.0), 4, 3).unwrap_err();
    assert!(
        e.to_string().contains("n_kv_head 3 must divide n_head 4"),
        "{e}"
    );
    let e = causal_attention_gqa(&random(1, &[1, 4, 42], 1.0), 4, 2).unwrap_err();
    assert!(
        e.to_string().contains("(n_head 4 + 2·n_kv_head 2)·hd"),
        "{e}"
    );
}

#[test]
fn attention_is_causal() {
    let (b, t, heads, hd) = (1, 80, 2, 8);
    let d = heads * hd;
    let qkv = random(3, &[b, t, 3 * d], 1.0);
    let y = values(&causal_attention(&qkv, heads).unwrap());
    // Change the last 10 positions: the first 70 outputs stay bit-equal.
    let tail = random(4, &[b, 10, 3 * d], 1.0);
    let changed = Tensor::cat(&[&qkv.narrow(1, 0, 70).unwrap(), &tail], 1).unwrap();
    let y2 = values(&causal_attention(&changed, heads).unwrap());
    assert_eq!(y[..70 * d], y2[..70 * d]);
    assert_ne!(y[70 * d..], y2[70 * d..]);
}

#[test]
fn attention_half_precision_within_rounding() {
    let (b, t, heads, hd) = (2, 66, 2, 8);
    let d = heads * hd;
    let qkv = random(5, &[b, t, 3 * d], 1.0);
    let w = random(6, &[b, t, d], 1.0);
    let (y, g) = attention_and_grad(causal_attention, &qkv, heads, &w);
    for (dtype, tol) in [(DType::BF16, 3e-2), (DType::F16, 4e-3)] {
        let (yh, gh) =
            attention_and_grad(causal_attention, &qkv.to_dtype(dtype).unwrap(), heads, &w);
        let (dy, dg) = (max_abs_diff(&y, &yh), max_abs_diff(&g, &gh));
        assert!(dy < tol, "{dtype:?}: values differ from f32 by {dy}");
        assert!(
            dg < 4.0 * tol,
            "{dtype:?}: gradients differ from f32 by {dg}"
        );
    }
}

#[test]
fn attention_rejects_bad_shapes() {
    let e = causal_attention(&random(1, &[2, 4, 10], 1.0), 2).unwrap_err();
    assert!(e.to_string().contains("3·d"), "{e}");
    let e = causal_attention(&random(1, &[4, 12], 1.0), 2).unwrap_err();
    assert!(e.to_string().contains("(B, T, 3·d)"), "{e}");
}

#[test]
fn gelu_kernel_equals_candle_over_a_wide_range() {
    // −30 … 30 in steps of 0.01 (tails included: ±1 of tanh, x and 0 of gelu).
    let x = Tensor::arange(-3000i64, 3000, &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .affine(0.01, 0.0)
        .unwrap();
    let w = random(7, &[6000], 2.0);
    let run = |f: fn(&Tensor) -> candle_core::Result<Tensor>| {
        let v = Var::from_tensor(&x).unwrap();
        let y = f(v.as_tensor()).unwrap();
        let g = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
        (values(&y), values(g.get(v.as_tensor()).unwrap()))
    };
    let ((y, g), (yc, gc)) = (run(gelu), run(gelu_composed));
    let rel = |a: &[f64], b: &[f64]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs() / y.abs().max(1.0))
            .fold(0.0, f64::max)
    };
    assert!(rel(&y, &yc) < 2e-6, "values differ by {}", rel(&y, &yc));
    assert!(rel(&g, &gc) < 1e-5, "gradients differ by {}", rel(&g, &gc));
    // NaN propagates (a grad scaler must see it); an empty tensor passes through.
    let nan = Tensor::new(&[1.0f32, f32::NAN, -2.0], &Device::Cpu).unwrap();
    let y = gelu(&nan).unwrap().to_vec1::<f32>().unwrap();
    assert!(
        y[1].is_nan() && y[0].is_finite() && y[2].is_finite(),
        "{y:?}"
    );
    let empty = Tensor::zeros((0, 4), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(gelu(&empty).unwrap().dims(), [0, 4]);
}

#[test]
fn cross_entropy_equals_candle_nn() {
    let (n, v) = (130, 37);
    let logits = random(8, &[n, v], 6.0);
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let t: Vec<u32> = (0..n).map(|_| rng.random_range(0..v as u32)).collect();
    let t32 = Tensor::new(t.as_slice(), &Device::Cpu).unwrap();
    let t64 = t32.to_dtype(DType::I64).unwrap();
    for targets in [&t32, &t64] {
        let run = |f: fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>| {
            let x = Var::from_tensor(&logits).unwrap();
            let loss = f(x.as_tensor(), targets).unwrap();
            // An upstream gradient other than 1.
            let g = (&loss * 3.0).unwrap().backward().unwrap();
            (
                loss.to_scalar::<f32>().unwrap() as f64,
                values(g.get(x.as_tensor()).unwrap()),
            )
        };
        let ((l, g), (lc, gc)) = (run(cross_entropy), run(cross_entropy_composed));
        assert!(
            (l - lc).abs() < 2e-6 * lc.abs().max(1.0),
            "loss {l} vs {lc}"
        );
        let dg = max_abs_diff(&g, &gc);
        assert!(dg < 1e-6, "gradients differ by {dg}");
    }
    let bad = Tensor::new(&[0u32, 37, 1], &Device::Cpu).unwrap();
    let e = cross_entropy(&random(1, &[3, 37], 1.0), &bad).unwrap_err();
    assert!(e.to_string().contains("row 1 is 37"), "{e}");
}

#[test]
fn linear_gelu_equals_linear_then_gelu() {
    use candle_fsdp::nn::{linear_forward, linear_gelu};
    let x = random(11, &[3, 70, 24], 1.5);
    let w = (random(12, &[40, 24], 1.0) * 0.3).unwrap();
    let b = random(13, &[40], 0.5);
    let g = random(14, &[3, 70, 40], 1.0);
    let run = |fused: bool| {
        let (xv, wv, bv) = (
            Var::from_tensor(&x).unwrap(),
            Var::from_tensor(&w).unwrap(),
            Var::from_tensor(&b).unwrap(),
        );
        let y = if fused {
            linear_gelu(xv.as_tensor(), wv.as_tensor(), bv.as_tensor()).unwrap()
        } else {
            gelu_composed(
                &linear_forward(xv.as_tensor(), wv.as_tensor(), Some(bv.as_tensor())).unwrap(),
            )
            .unwrap()
        };
        let loss = (&y * &g).unwrap().sum_all().unwrap();
        // Twice over the same graph: the op keeps its pre-activation for every backward.
        let grads = loss.backward().unwrap();
        let again = loss.backward().unwrap();
        let gx = values(grads.get(xv.as_tensor()).unwrap());
        assert_eq!(gx, values(again.get(xv.as_tensor()).unwrap()));
        [
            values(&y),
            gx,
            values(grads.get(wv.as_tensor()).unwrap()),
            values(grads.get(bv.as_tensor()).unwrap()),
        ]
    };
    let (f, c) = (run(true), run(false));
    for (what, (a, b)) in ["y", "dx", "dw", "db"].iter().zip(f.iter().zip(&c)) {
        let rel = max_abs_diff(a, b) / b.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        assert!(rel < 2e-6, "{what}: relative difference {rel}");
    }
}

/// Rotary embeddings: the fused op against the composed Candle ops, values and the gradient of
/// a weighted sum, f32 and bf16, on a non-contiguous input.
#[test]
fn rope_matches_the_composed_ops_values_and_gradients() {
    use candle_fsdp::nn::{rope, rope_composed};
    let dev = Device::Cpu;
    let (b, t, h, hd) = (2, 5, 3, 8);
    // θ_i = 500^(−2i/hd), each frequency at columns i and i + hd/2.
    let angle =
        |p: usize, j: usize| p as f64 * 500f64.powf(-2.0 * (j % (hd / 2)) as f64 / hd as f64);
    let table = |f: fn(f64) -> f64| {
        let v: Vec<f32> = (0..t)
            .flat_map(|p| (0..hd).map(move |j| (p, j)))
            .map(|(p, j)| f(angle(p, j)) as f32)
            .collect();
        Tensor::from_vec(v, (t, hd), &dev).unwrap()
    };
    let (cos, sin) = (table(f64::cos), table(f64::sin));
    let to_vec = |z: &Tensor| -> Vec<f32> {
        z.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    // (B, H, T, hd) transposed to (B, T, H, hd): not contiguous.
    let x = Tensor::randn(0f32, 1.0, (b, h, t, hd), &dev)
        .unwrap()
        .transpose(1, 2)
        .unwrap();
    let w = Tensor::randn(0f32, 1.0, (b, t, h, hd), &dev).unwrap();
    for (dtype, tol) in [(DType::F32, 1e-6f32), (DType::BF16, 2e-2)] {
        let var = Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap();
        let run = |f: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>| {
            let y = f(var.as_tensor()).unwrap();
            let loss = (y.to_dtype(DType::F32).unwrap() * &w)
                .unwrap()
                .sum_all()
                .unwrap();
            let grads = loss.backward().unwrap();
            let g = grads.get(var.as_tensor()).unwrap().clone();
            (to_vec(&y), to_vec(&g))
        };
        let (y1, g1) = run(&|x| rope(x, &cos, &sin));
        let (y2, g2) = run(&|x| rope_composed(x, &cos, &sin));
        // Relative to the magnitude above 1: a bf16 value near 4 is a 2⁻⁶ step, and the
        // composed ops round after each of their three operations (an absolute bound failed
        // about one run in thirty on random inputs).
        let diff = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(p, q)| (p - q).abs() / q.abs().max(1.0))
                .fold(0f32, f32::max)
        };
        assert!(
            diff(&y1, &y2) <= tol,
            "{dtype:?} values: {}",
            diff(&y1, &y2)
        );
        assert!(
            diff(&g1, &g2) <= tol,
            "{dtype:?} gradients: {}",
            diff(&g1, &g2)
        );
        // A rotation keeps the norm. Each output is rounded once to `dtype` (relative error
        // at most 2⁻⁹ in bf16), so each square is within a relative 2·2⁻⁹ + 2⁻¹⁸ of the
        // rotated one's and so is the sum: 1e-3 held only while the roundings cancelled (one
        // bf16 run in a few hundred failed). In f32 the two sums' own rounding bounds it
        // (about 3e-5 at worst for these 240-term sums).
        let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        let xs = to_vec(var.as_tensor());
        let norm_tol = if dtype == DType::BF16 { 4e-3 } else { 5e-5 };
        assert!(
            (norm(&y1) - norm(&xs)).abs() <= norm_tol * norm(&xs),
            "{dtype:?} norm: {} against {}",
            norm(&y1),
            norm(&xs)
        );
    }
    // Position 0 is the identity (cos 1, sin 0).
    let y = rope(&x, &cos, &sin).unwrap();
    let first = |z: &Tensor| to_vec(&z.narrow(1, 0, 1).unwrap().contiguous().unwrap());
    assert_eq!(first(&y), first(&x));
}
