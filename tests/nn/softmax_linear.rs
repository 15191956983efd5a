//! The fused ops of attention blocks in `candle_fsdp::nn`.
//!
//! - `causal_softmax`: values and input gradients equal the composed reference
//!   (`candle_nn::ops::softmax` of `scale · s` plus a −∞ mask above the diagonal) for f32, bf16,
//!   f16 and f64, rank-3 and rank-4 inputs and non-contiguous inputs; entries above the diagonal
//!   are exactly 0 and get exactly 0 gradient.
//! - `linear_forward`: values and gradients of input, weight and bias equal `candle_nn::Linear`'s,
//!   with and without a bias, rank 2 to 4, f32 (the kernel) and f64 (candle-nn's path);
//!   strided input and weight.

use candle_core::Module;
use candle_core::{DType, Device, Tensor, Var, D};
use candle_fsdp::nn::{causal_softmax, causal_softmax_composed, linear_forward};
use rand::{Rng, SeedableRng};

const SCALE: f64 = 0.35;

fn random(seed: u64, shape: &[usize], spread: f64) -> Tensor {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| (spread * (rng.random::<f64>() * 2.0 - 1.0)) as f32)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// The reference written out here, independent of the crate: `softmax(scale · s + mask)`.
fn reference(s: &Tensor, scale: f64) -> Tensor {
    let t = s.dim(D::Minus1).unwrap();
    let mask: Vec<f32> = (0..t)
        .flat_map(|q| (0..t).map(move |k| if k <= q { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), s.device())
        .unwrap()
        .to_dtype(s.dtype())
        .unwrap();
    candle_nn::ops::softmax(
        &(s * scale).unwrap().broadcast_add(&mask).unwrap(),
        D::Minus1,
    )
    .unwrap()
}

/// Output and input gradient of `f` on `x` (in `dtype`) for the loss `Σ y · w`.
fn run(
    f: impl Fn(&Tensor) -> Tensor,
    x: &Tensor,
    w: &Tensor,
    dtype: DType,
) -> (Vec<f64>, Vec<f64>) {
    let var = Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap();
    let y = f(var.as_tensor());
    assert_eq!(y.dtype(), dtype);
    assert_eq!(y.shape(), x.shape());
    let loss = (y.to_dtype(DType::F32).unwrap() * w)
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    let dx = grads
        .get(var.as_tensor())
        .expect("no gradient of the scores");
    assert_eq!(dx.dtype(), dtype);
    (values(&y), values(dx))
}

/// Kernel and composed path against the reference in `dtype`, the reference computed in f64.
fn check(x: &Tensor, dtype: DType, tol: f64) {
    let w = random(99, x.dims(), 1.0);
    let (ry, rdx) = run(|s| reference(s, SCALE), x, &w, DType::F64);
    let t = *x.dims().last().unwrap();
    for (name, f) in [
        (
            "kernel",
            &(|s: &Tensor| causal_softmax(s, SCALE).unwrap()) as &dyn Fn(&Tensor) -> Tensor,
        ),
        ("composed", &|s: &Tensor| {
            causal_softmax_composed(s, SCALE).unwrap()
        }),
    ] {
        let (y, dx) = run(f, x, &w, dtype);
        let (ey, edx) = (max_abs_diff(&y, &ry), max_abs_diff(&dx, &rdx));
        assert!(
            ey < tol && edx < tol,
            "{name} {dtype:?} {:?}: value error {ey:e}, gradient error {edx:e}",
            x.dims()
        );
        // Above the diagonal: exactly 0 and no gradient.
        for (idx, (&y, &dx)) in y.iter().zip(&dx).enumerate() {
            let (q, k) = ((idx / t) % t, idx % t);
            if k > q {
                assert_eq!((y, dx), (0.0, 0.0), "{name} {dtype:?} at ({q}, {k})");
            }
        }
        // Each row sums to 1.
        for row in y.chunks(t) {
            let s: f64 = row.iter().sum();
            assert!(
                (s - 1.0).abs() < tol * t as f64,
                "{name} {dtype:?}: row sum {s}"
            );
        }
    }
}

#[test]
fn values_and_gradients_match_the_masked_softmax_f32_and_f64() {
    for shape in [&[3usize, 7, 7][..], &[2, 3, 5, 5], &[1, 1], &[2, 2, 19, 19]] {
        let x = random(1, shape, 4.0);
        check(&x, DType::F32, 1e-5);
        check(&x, DType::F64, 1e-5);
    }
}

#[test]
fn half_precision_stays_in_dtype_close_to_the_reference() {
    for shape in [&[3usize, 7, 7][..], &[2, 3, 5, 5]] {
        let x = random(2, shape, 4.0);
        check(&x, DType::BF16, 2e-2);
        check(&x, DType::F16, 4e-3);
    }
}

#[test]
fn non_contiguous_input_equals_contiguous() {
    // (B, h, T, hd)-style permutation: the scores come out of a transpose.
    let base = random(3, &[2, 6, 3, 6], 4.0);
    let x = base.transpose(1, 2).unwrap(); // (2, 3, 6, 6), not contiguous
    assert!(!x.is_contiguous());
    check(&x, DType::F32, 1e-5);
    check(&x, DType::BF16, 2e-2);
    let t = random(4, &[4, 4, 3], 4.0).transpose(0, 2).unwrap(); // (3, 4, 4)
    assert!(!t.is_contiguous());
    check(&t, DType::F32, 1e-5);
}

#[test]
fn large_scores_do_not_overflow() {
    let x = (random(5, &[2, 9, 9], 1.0) * 1e4).unwrap();
    let y = values(&causal_softmax(&x, 1.0).unwrap());
    assert!(y.iter().all(|v| v.is_finite()));
    let r = values(&reference(&x, 1.0));
    assert!(max_abs_diff(&y, &r) < 1e-6);
}

#[test]
fn bad_shapes_are_errors() {
    let x = random(6, &[2, 3, 4], 1.0);
    let e = causal_softmax(&x, 1.0).unwrap_err().to_string();
    assert!(e.contains("(…, T, T)"), "{e}");
    assert!(causal_softmax(&random(7, &[5], 1.0), 1.0).is_err());
    assert!(causal_softmax_composed(&x, 1.0).is_err());
}

/// Output and gradients of `(x, w, b)` of `f` for the loss `Σ y · r`.
fn linear_run(
    f: &dyn Fn(&Tensor, &Tensor, Option<&Tensor>) -> Tensor,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    dtype: DType,
) -> Vec<Vec<f64>> {
    let to = |t: &Tensor| Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap();
    let (xv, wv, bv) = (to(x), to(w), b.map(to));
    let y = f(
        xv.as_tensor(),
        wv.as_tensor(),
        bv.as_ref().map(|b| b.as_tensor()),
    );
    assert_eq!(y.dtype(), dtype);
    let r = random(77, y.dims(), 1.0).to_dtype(dtype).unwrap();
    let grads = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let mut out = vec![values(&y), values(grads.get(xv.as_tensor()).unwrap())];
    out.push(values(grads.get(wv.as_tensor()).unwrap()));
    if let Some(b) = &bv {
        out.push(values(grads.get(b.as_tensor()).unwrap()));
    }
    out
}

#[test]
fn linear_forward_matches_candle_nn_linear() {
    let reference = |x: &Tensor, w: &Tensor, b: Option<&Tensor>| {
        candle_nn::Linear::new(w.clone(), b.cloned())
            .forward(x)
            .unwrap()
    };
    let fused = |x: &Tensor, w: &Tensor, b: Option<&Tensor>| linear_forward(x, w, b).unwrap();
    let (inp, out) = (7, 5);
    for shape in [&[6usize, inp][..], &[2, 3, inp], &[2, 2, 3, inp]] {
        for with_bias in [true, false] {
            for dtype in [DType::F32, DType::F64] {
                let x = random(10, shape, 2.0);
                let w = random(11, &[out, inp], 1.0);
                let b = random(12, &[out], 1.0);
                let b = with_bias.then_some(&b);
                let r = linear_run(&reference, &x, &w, b, dtype);
                let f = linear_run(&fused, &x, &w, b, dtype);
                assert_eq!(r.len(), f.len());
                for (i, (r, f)) in r.iter().zip(&f).enumerate() {
                    let e = max_abs_diff(f, r);
                    assert!(
                        e < 1e-5,
                        "{shape:?} bias {with_bias} {dtype:?} part {i}: {e:e}"
                    );
                }
            }
        }
    }
}

#[test]
fn linear_forward_takes_strided_input_and_weight() {
    // x (2, 3, 7) as a transpose, the weight as the transpose of an (in, out) tensor.
    let x = random(13, &[2, 7, 3], 2.0).transpose(1, 2).unwrap();
    let w = random(14, &[7, 5], 1.0).t().unwrap();
    let b = random(15, &[5], 1.0);
    assert!(!x.is_contiguous() && !w.is_contiguous());
    let (xv, wv, bv) = (
        Var::from_tensor(&random(13, &[2, 7, 3], 2.0)).unwrap(),
        Var::from_tensor(&random(14, &[7, 5], 1.0)).unwrap(),
        Var::from_tensor(&b).unwrap(),
    );
    let views = |xv: &Var, wv: &Var| {
        (
            xv.as_tensor().transpose(1, 2).unwrap(),
            wv.as_tensor().t().unwrap(),
        )
    };
    let (xs, ws) = views(&xv, &wv);
    let y = linear_forward(&xs, &ws, Some(bv.as_tensor())).unwrap();
    let yr = candle_nn::Linear::new(w.contiguous().unwrap(), Some(b.clone()))
        .forward(&x.contiguous().unwrap())
        .unwrap();
    assert!(max_abs_diff(&values(&y), &values(&yr)) < 1e-5);
    assert_eq!(y.dims(), &[2, 3, 5]);
    let grads = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    // d/dx Σ y² = 2 y · W, through the transpose.
    let dx = grads.get(xv.as_tensor()).unwrap();
    let want = (yr * 2.0)
        .unwrap()
        .matmul(&w.contiguous().unwrap().broadcast_left(2).unwrap())
        .unwrap()
        .transpose(1, 2)
        .unwrap();
    assert!(max_abs_diff(&values(dx), &values(&want)) < 1e-4);
    assert_eq!(grads.get(wv.as_tensor()).unwrap().dims(), &[7, 5]);
}

#[test]
fn linear_forward_rejects_mismatched_shapes() {
    let x = random(16, &[2, 7], 1.0);
    let w = random(17, &[5, 6], 1.0);
    assert!(linear_forward(&x, &w, None).is_err());
    let w = random(17, &[5, 7], 1.0);
    let b = random(18, &[4], 1.0);
    assert!(linear_forward(&x, &w, Some(&b)).is_err());
}
