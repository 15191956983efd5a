//! The differentiable norms of `candle_fsdp::nn`: LayerNorm and RMSNorm outputs and input /
//! weight / bias gradients equal a hand-derived f64 reference (closed-form backward) for both the
//! CPU kernel and the composed-ops path; their forwards equal candle-nn's; a Linear → LayerNorm →
//! Linear model gets gradients below the norm that match finite differences (where candle-nn's
//! `layer_norm` gives none), and trains under FSDP (two thread ranks) as in one process;
//! bf16/f16 stay in their dtype close to f32; any input rank and layout works.

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_fsdp::nn::{layer_norm, layer_norm_no_bias, rms_norm, LayerNorm, RmsNorm};
use candle_nn::{LayerNormConfig, VarBuilder, VarMap};
use rand::{Rng, SeedableRng};

const EPS: f64 = 1e-5;
const SHAPE: (usize, usize, usize) = (2, 3, 6);

fn randn(rng: &mut rand::rngs::StdRng, n: usize, scale: f64, offset: f64) -> Vec<f64> {
    (0..n)
        .map(|_| offset + scale * (rng.random::<f64>() * 2.0 - 1.0))
        .collect()
}

fn tensor(v: &[f64], shape: &[usize]) -> Tensor {
    let v: Vec<f32> = v.iter().map(|&v| v as f32).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn to_f64(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

/// Max over elements of `|a − r| / max(1, |r|)`.
fn err(a: &[f64], r: &[f64]) -> f64 {
    assert_eq!(a.len(), r.len());
    a.iter()
        .zip(r)
        .map(|(a, r)| (a - r).abs() / r.abs().max(1.0))
        .fold(0.0, f64::max)
}

/// Max over elements of `|a − r|`.
fn max_abs_diff(a: &[f64], r: &[f64]) -> f64 {
    assert_eq!(a.len(), r.len());
    a.iter()
        .zip(r)
        .map(|(a, r)| (a - r).abs())
        .fold(0.0, f64::max)
}

/// The hand-derived reference on plain vectors, in f64, rows of `w.len()`: output, dx, dw, db
/// for the output gradient `g`. LayerNorm (`remove_mean`): x̂ = (x − μ)/σ, σ = sqrt(var + eps),
/// dx = (ĝ − mean(ĝ) − x̂·mean(ĝ·x̂))/σ with ĝ = g·w. RMSNorm: r = sqrt(mean(x²) + eps),
/// dx = (w·g)/r − x·mean(x·w·g)/r³. Both: dw = Σ g·x̂, db = Σ g.
struct Reference {
    y: Vec<f64>,
    dx: Vec<f64>,
    dw: Vec<f64>,
    db: Vec<f64>,
}

fn reference(x: &[f64], w: &[f64], b: &[f64], g: &[f64], remove_mean: bool) -> Reference {
    let d = w.len();
    let (mut y, mut dx) = (Vec::new(), Vec::new());
    let (mut dw, mut db) = (vec![0.0; d], vec![0.0; d]);
    for (xs, gs) in x.chunks(d).zip(g.chunks(d)) {
        let n = d as f64;
        if remove_mean {
            let mu = xs.iter().sum::<f64>() / n;
            let var = xs.iter().map(|v| (v - mu).powi(2)).sum::<f64>() / n;
            let sigma = (var + EPS).sqrt();
            let xh: Vec<f64> = xs.iter().map(|v| (v - mu) / sigma).collect();
            let gh: Vec<f64> = gs.iter().zip(w).map(|(g, w)| g * w).collect();
            let mean_gh = gh.iter().sum::<f64>() / n;
            let mean_ghxh = gh.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>() / n;
            for i in 0..d {
                y.push(xh[i] * w[i] + b[i]);
                dx.push((gh[i] - mean_gh - xh[i] * mean_ghxh) / sigma);
                dw[i] += gs[i] * xh[i];
                db[i] += gs[i];
            }
        } else {
            let r = (xs.iter().map(|v| v * v).sum::<f64>() / n + EPS).sqrt();
            let mean_xwg = (0..d).map(|i| xs[i] * w[i] * gs[i]).sum::<f64>() / n;
            for i in 0..d {
                y.push(xs[i] / r * w[i] + b[i]);
                dx.push(w[i] * gs[i] / r - xs[i] * mean_xwg / r.powi(3));
                dw[i] += gs[i] * xs[i] / r;
                db[i] += gs[i];
            }
        }
    }
    Reference { y, dx, dw, db }
}

/// Random input `(2, 3, 6)`, weight, bias and upstream gradient `c` (loss = Σ out · c).
struct Case {
    x: Vec<f64>,
    w: Vec<f64>,
    b: Vec<f64>,
    c: Vec<f64>,
}

fn case(seed: u64) -> Case {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (b0, b1, d) = SHAPE;
    let n = b0 * b1 * d;
    Case {
        // An offset, so that removing the mean matters.
        x: randn(&mut rng, n, 2.0, 0.7),
        w: randn(&mut rng, d, 1.0, 0.5),
        b: randn(&mut rng, d, 1.0, 0.0),
        c: randn(&mut rng, n, 1.5, 0.0),
    }
}

/// Runs `forward` on the case as f32 Vars and returns (out, dx, dw, db) as f64.
fn run(
    case: &Case,
    with_bias: bool,
    forward: impl Fn(&Tensor, Tensor, Option<Tensor>) -> Tensor,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Option<Vec<f64>>) {
    let (b0, b1, d) = SHAPE;
    let x = Var::from_tensor(&tensor(&case.x, &[b0, b1, d])).unwrap();
    let w = Var::from_tensor(&tensor(&case.w, &[d])).unwrap();
    let b = Var::from_tensor(&tensor(&case.b, &[d])).unwrap();
    let c = tensor(&case.c, &[b0, b1, d]);
    let y = forward(
        x.as_tensor(),
        w.as_tensor().clone(),
        with_bias.then(|| b.as_tensor().clone()),
    );
    assert_eq!(y.dims(), &[b0, b1, d]);
    let loss = (&y * &c).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let get = |v: &Var| to_f64(grads.get(v).expect("no gradient"));
    let db = with_bias.then(|| get(&b));
    (to_f64(&y), get(&x), get(&w), db)
}

const TOL: f64 = 1e-5;

#[test]
fn layer_norm_gradients_match_hand_derived_reference() {
    for seed in [1, 2, 3] {
        let case = case(seed);
        let r = reference(&case.x, &case.w, &case.b, &case.c, true);
        // Both paths: the CPU kernel (Module::forward) and the composed ops.
        for composed in [false, true] {
            let (y, dx, dw, db) = run(&case, true, |x, w, b| {
                let ln = LayerNorm::new(w, b.unwrap(), EPS);
                assert!(ln.remove_mean() && ln.bias().is_some() && ln.eps() == EPS);
                if composed {
                    ln.forward_composed(x).unwrap()
                } else {
                    ln.forward(x).unwrap()
                }
            });
            let db = db.unwrap();
            let what = format!("seed {seed} composed {composed}");
            assert!(err(&y, &r.y) < TOL, "{what} y: {}", err(&y, &r.y));
            assert!(err(&dx, &r.dx) < TOL, "{what} dx: {}", err(&dx, &r.dx));
            assert!(err(&dw, &r.dw) < TOL, "{what} dw: {}", err(&dw, &r.dw));
            assert!(err(&db, &r.db) < TOL, "{what} db: {}", err(&db, &r.db));
            // The gradients are not trivially small: the test would catch zeros.
            assert!(r.dx.iter().any(|v| v.abs() > 0.1) && r.dw.iter().any(|v| v.abs() > 0.1));
        }
        // Without a bias: same output less b, same dx and dw.
        let (y, dx, dw, db) = run(&case, false, |x, w, _| {
            LayerNorm::new_no_bias(w, EPS).forward(x).unwrap()
        });
        assert!(db.is_none());
        let y_ref: Vec<f64> =
            r.y.iter()
                .enumerate()
                .map(|(i, y)| y - case.b[i % case.b.len()])
                .collect();
        assert!(err(&y, &y_ref) < TOL);
        assert!(err(&dx, &r.dx) < TOL && err(&dw, &r.dw) < TOL);
    }
}

#[test]
fn rms_norm_gradients_match_hand_derived_reference() {
    for seed in [4, 5, 6] {
        let case = case(seed);
        let zeros = vec![0.0; case.w.len()];
        let r = reference(&case.x, &case.w, &zeros, &case.c, false);
        for composed in [false, true] {
            let (y, dx, dw, db) = run(&case, false, |x, w, _| {
                let rms = RmsNorm::new(w, EPS);
                assert_eq!(rms.eps(), EPS);
                if composed {
                    rms.forward_composed(x).unwrap()
                } else {
                    rms.forward(x).unwrap()
                }
            });
            assert!(db.is_none());
            let what = format!("seed {seed} composed {composed}");
            assert!(err(&y, &r.y) < TOL, "{what} y: {}", err(&y, &r.y));
            assert!(err(&dx, &r.dx) < TOL, "{what} dx: {}", err(&dx, &r.dx));
            assert!(err(&dw, &r.dw) < TOL, "{what} dw: {}", err(&dw, &r.dw));
            assert!(r.dx.iter().any(|v| v.abs() > 0.1) && r.dw.iter().any(|v| v.abs() > 0.1));
        }
        // RMSNorm with a bias: layer_norm with LayerNormConfig { remove_mean: false, affine: true }.
        let r = reference(&case.x, &case.w, &case.b, &case.c, false);
        let (b0, b1, d) = SHAPE;
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let config = LayerNormConfig {
            eps: EPS,
            remove_mean: false,
            affine: true,
        };
        let ln = layer_norm(d, config, vb).unwrap();
        assert!(!ln.remove_mean() && ln.bias().is_some());
        set(&varmap, "weight", &case.w);
        set(&varmap, "bias", &case.b);
        let x = Var::from_tensor(&tensor(&case.x, &[b0, b1, d])).unwrap();
        let y = ln.forward(&x).unwrap();
        let loss = (&y * tensor(&case.c, &[b0, b1, d]))
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        let var = |name: &str| varmap.data().lock().unwrap()[name].clone();
        let dw = to_f64(grads.get(&var("weight")).unwrap());
        let db = to_f64(grads.get(&var("bias")).unwrap());
        let dx = to_f64(grads.get(&x).unwrap());
        assert!(err(&to_f64(&y), &r.y) < TOL && err(&dx, &r.dx) < TOL);
        assert!(err(&dw, &r.dw) < TOL && err(&db, &r.db) < TOL);
    }
}

/// Copies `values` into the VarMap variable `name`.
fn set(varmap: &VarMap, name: &str, values: &[f64]) {
    let data = varmap.data().lock().unwrap();
    let var = &data[name];
    var.set(&tensor(values, var.dims())).unwrap();
}

#[test]
fn forward_matches_candle_nn() {
    let case = case(7);
    let (b0, b1, d) = SHAPE;
    let x = tensor(&case.x, &[b0, b1, d]);
    let configs = [
        LayerNormConfig::from(EPS),
        LayerNormConfig::from(1e-3),
        LayerNormConfig {
            eps: EPS,
            remove_mean: true,
            affine: false,
        },
        LayerNormConfig {
            eps: EPS,
            remove_mean: false,
            affine: true,
        },
        LayerNormConfig {
            eps: EPS,
            remove_mean: false,
            affine: false,
        },
    ];
    for config in configs {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let ours = layer_norm(d, config, vb.pp("ln")).unwrap();
        // The same names: candle-nn's constructor reuses our Vars.
        let theirs = candle_nn::layer_norm(d, config, vb.pp("ln")).unwrap();
        let names: Vec<String> = varmap.data().lock().unwrap().keys().cloned().collect();
        let expected = if config.affine { 2 } else { 1 };
        assert_eq!(names.len(), expected, "{names:?}");
        // Init: weight ones, bias zeros.
        assert_eq!(to_f64(ours.weight()), vec![1.0; d]);
        if let Some(b) = ours.bias() {
            assert_eq!(to_f64(b), vec![0.0; d]);
        }
        assert_eq!(ours.bias().is_some(), config.affine);
        assert_eq!(ours.remove_mean(), config.remove_mean);
        set(&varmap, "ln.weight", &case.w);
        if config.affine {
            set(&varmap, "ln.bias", &case.b);
        }
        for input in [
            x.clone(),
            x.transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
                .transpose(1, 2)
                .unwrap(),
        ] {
            let a = to_f64(&ours.forward(&input).unwrap());
            let b = to_f64(&theirs.forward(&input).unwrap());
            let diff = max_abs_diff(&a, &b);
            assert!(diff < 1e-6, "{config:?}: {diff}");
        }
    }
    // rms_norm against candle-nn's rms_norm (the fused RmsNorm on a contiguous input).
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let ours = rms_norm(d, EPS, vb.pp("rms")).unwrap();
    let theirs = candle_nn::rms_norm(d, EPS, vb.pp("rms")).unwrap();
    assert_eq!(varmap.data().lock().unwrap().len(), 1);
    set(&varmap, "rms.weight", &case.w);
    let diff = max_abs_diff(
        &to_f64(&ours.forward(&x).unwrap()),
        &to_f64(&theirs.forward(&x).unwrap()),
    );
    assert!(diff < 1e-6, "rms: {diff}");
    // layer_norm_no_bias against candle-nn's.
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let ours = layer_norm_no_bias(d, EPS, vb.pp("n")).unwrap();
    let theirs = candle_nn::layer_norm_no_bias(d, EPS, vb.pp("n")).unwrap();
    set(&varmap, "n.weight", &case.w);
    assert!(ours.bias().is_none());
    let diff = max_abs_diff(
        &to_f64(&ours.forward(&x).unwrap()),
        &to_f64(&theirs.forward(&x).unwrap()),
    );
    assert!(diff < 1e-6, "no bias: {diff}");
}

/// The scenario: Linear(4, 6) → LayerNorm(6) → Linear(6, 3), Vars from a VarMap, loss
/// Σ out · c; the norm is ours or candle-nn's.
struct Mlp {
    varmap: VarMap,
    fc1: candle_nn::Linear,
    norm: Box<dyn Module>,
    fc2: candle_nn::Linear,
}

impl Mlp {
    fn new(candle_norm: bool) -> Mlp {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let fc1 = candle_nn::linear(4, 6, vb.pp("fc1")).unwrap();
        let norm: Box<dyn Module> = if candle_norm {
            Box::new(candle_nn::layer_norm(6, EPS, vb.pp("norm")).unwrap())
        } else {
            Box::new(layer_norm(6, EPS, vb.pp("norm")).unwrap())
        };
        let fc2 = candle_nn::linear(6, 3, vb.pp("fc2")).unwrap();
        // Deterministic parameters; a norm weight away from 1 and a bias away from 0.
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for (name, n) in [
            ("fc1.weight", 24),
            ("fc1.bias", 6),
            ("fc2.weight", 18),
            ("fc2.bias", 3),
        ] {
            set(&varmap, name, &randn(&mut rng, n, 0.8, 0.0));
        }
        set(&varmap, "norm.weight", &randn(&mut rng, 6, 0.5, 1.0));
        set(&varmap, "norm.bias", &randn(&mut rng, 6, 0.5, 0.0));
        Mlp {
            varmap,
            fc1,
            norm,
            fc2,
        }
    }

    fn loss(&self, x: &Tensor, c: &Tensor) -> Tensor {
        let h = self.fc1.forward(x).unwrap();
        let h = self.norm.forward(&h).unwrap();
        let y = self.fc2.forward(&h).unwrap();
        (y * c).unwrap().sum_all().unwrap()
    }

    fn var(&self, name: &str) -> Var {
        self.varmap.data().lock().unwrap()[name].clone()
    }
}

#[test]
fn linear_layer_norm_linear_trains_below_the_norm() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(12);
    let x = tensor(&randn(&mut rng, 5 * 4, 1.0, 0.0), &[5, 4]);
    let c = tensor(&randn(&mut rng, 5 * 3, 1.0, 0.0), &[5, 3]);

    let model = Mlp::new(false);
    let grads = model.loss(&x, &c).backward().unwrap();
    for name in [
        "fc1.weight",
        "fc1.bias",
        "norm.weight",
        "norm.bias",
        "fc2.weight",
    ] {
        let g = to_f64(grads.get(&model.var(name)).expect(name));
        assert!(g.iter().any(|v| v.abs() > 1e-3), "{name}: {g:?}");
    }
    // Central finite differences on two elements of fc1.weight and two of norm.weight, each the
    // largest-magnitude gradient element and one other.
    let h = 1e-2;
    for name in ["fc1.weight", "norm.weight"] {
        let var = model.var(name);
        let analytic = to_f64(grads.get(&var).unwrap());
        let original = to_f64(var.as_tensor());
        let largest = (0..analytic.len())
            .max_by(|&a, &b| analytic[a].abs().total_cmp(&analytic[b].abs()))
            .unwrap();
        let other = (largest + 1) % analytic.len();
        for i in [largest, other] {
            let loss_at = |delta: f64| {
                let mut v = original.clone();
                v[i] += delta;
                var.set(&tensor(&v, var.dims())).unwrap();
                model.loss(&x, &c).to_scalar::<f32>().unwrap() as f64
            };
            let numeric = (loss_at(h) - loss_at(-h)) / (2.0 * h);
            var.set(&tensor(&original, var.dims())).unwrap();
            let rel = (numeric - analytic[i]).abs() / analytic[i].abs().max(1e-3);
            assert!(
                rel < 1e-2,
                "{name}[{i}]: analytic {} numeric {numeric}",
                analytic[i]
            );
            assert!(analytic[i].abs() > 1e-3, "{name}[{i}] {}", analytic[i]);
        }
    }

    // The fault this module exists for: the same model with candle-nn's layer_norm gets no
    // gradient at or below the norm (its fused forward has no backward), only above it.
    let model = Mlp::new(true);
    let grads = model.loss(&x, &c).backward().unwrap();
    for name in ["fc1.weight", "fc1.bias", "norm.weight", "norm.bias"] {
        assert!(grads.get(&model.var(name)).is_none(), "{name}");
    }
    assert!(grads.get(&model.var("fc2.weight")).is_some());
}

#[test]
fn half_precision_stays_in_dtype_and_close_to_f32() {
    let case = case(13);
    let (b0, b1, d) = SHAPE;
    let c32 = tensor(&case.c, &[b0, b1, d]);
    let run = |dtype: DType, rms: bool| {
        let x = Var::from_tensor(&tensor(&case.x, &[b0, b1, d]).to_dtype(dtype).unwrap()).unwrap();
        let w = Var::from_tensor(&tensor(&case.w, &[d]).to_dtype(dtype).unwrap()).unwrap();
        let b = Var::from_tensor(&tensor(&case.b, &[d]).to_dtype(dtype).unwrap()).unwrap();
        let y = if rms {
            RmsNorm::new(w.as_tensor().clone(), EPS)
                .forward(&x)
                .unwrap()
        } else {
            LayerNorm::new(w.as_tensor().clone(), b.as_tensor().clone(), EPS)
                .forward(&x)
                .unwrap()
        };
        assert_eq!(y.dtype(), dtype);
        let loss = (&y * &c32.to_dtype(dtype).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        let mut out = vec![to_f64(&y)];
        let vars = if rms { vec![&x, &w] } else { vec![&x, &w, &b] };
        for v in vars {
            let g = grads.get(v).unwrap();
            assert_eq!(g.dtype(), dtype);
            out.push(to_f64(g));
        }
        out
    };
    for rms in [false, true] {
        let full = run(DType::F32, rms);
        // bf16 keeps 8 significant bits (relative rounding 2^-9 ≈ 2e-3 per value; the inputs, the
        // weight and the upstream gradient are rounded too); f16 keeps 11.
        for (dtype, tol) in [(DType::BF16, 2e-2), (DType::F16, 3e-3)] {
            let half = run(dtype, rms);
            for (k, (h, f)) in half.iter().zip(&full).enumerate() {
                let scale = f.iter().map(|v| v.abs()).fold(0.0, f64::max);
                let diff = max_abs_diff(h, f);
                assert!(
                    diff < tol * scale,
                    "{dtype:?} rms {rms} #{k}: {diff} (scale {scale})"
                );
            }
        }
    }
}

#[test]
fn any_rank_and_layout_kernel_equals_composed() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(14);
    let d = 5;
    let w = tensor(&randn(&mut rng, d, 1.0, 0.5), &[d]);
    let b = tensor(&randn(&mut rng, d, 1.0, 0.0), &[d]);
    let shapes: [&[usize]; 4] = [&[d], &[3, d], &[2, 3, d], &[2, 1, 3, d]];
    for shape in shapes {
        let n: usize = shape.iter().product();
        let x = Var::from_tensor(&tensor(&randn(&mut rng, n, 2.0, 0.3), shape)).unwrap();
        let c = tensor(&randn(&mut rng, n, 1.0, 0.0), shape);
        for rms in [false, true] {
            let wv = Var::from_tensor(&w).unwrap();
            let bv = Var::from_tensor(&b).unwrap();
            let ln = if rms {
                LayerNorm::rms_norm(wv.as_tensor().clone(), EPS)
            } else {
                LayerNorm::new(wv.as_tensor().clone(), bv.as_tensor().clone(), EPS)
            };
            let mut results = Vec::new();
            for composed in [false, true] {
                let y = if composed {
                    ln.forward_composed(&x).unwrap()
                } else {
                    ln.forward(&x).unwrap()
                };
                assert_eq!(y.dims(), shape);
                let grads = (&y * &c).unwrap().sum_all().unwrap().backward().unwrap();
                let mut r = vec![
                    to_f64(&y),
                    to_f64(grads.get(&x).unwrap()),
                    to_f64(grads.get(&wv).unwrap()),
                ];
                if !rms {
                    r.push(to_f64(grads.get(&bv).unwrap()));
                }
                results.push(r);
            }
            for (k, (a, c)) in results[0].iter().zip(&results[1]).enumerate() {
                assert!(err(a, c) < TOL, "{shape:?} rms {rms} #{k}: {}", err(a, c));
            }
        }
        // A non-contiguous input (the transpose of a contiguous one) through the kernel.
        if shape.len() >= 2 {
            let r = shape.len();
            let t = x.transpose(r - 2, r - 1).unwrap().contiguous().unwrap();
            let xt = t.transpose(r - 2, r - 1).unwrap();
            assert!(!xt.is_contiguous() || shape[r - 2] == 1);
            let ln = LayerNorm::new(w.clone(), b.clone(), EPS);
            let a = to_f64(&ln.forward(&xt).unwrap());
            let c = to_f64(&ln.forward_composed(&xt).unwrap());
            assert!(err(&a, &c) < TOL);
        }
    }
    // Mismatched sizes and dtypes are errors, not panics.
    let x = Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap();
    assert!(LayerNorm::new(w.clone(), b.clone(), EPS)
        .forward(&x)
        .is_err());
    let x = Tensor::zeros((2, d), DType::BF16, &Device::Cpu).unwrap();
    assert!(RmsNorm::new(w.clone(), EPS).forward(&x).is_err());
    // f64 goes through the composed ops.
    let x = Tensor::ones((2, d), DType::F64, &Device::Cpu).unwrap();
    let ln = LayerNorm::new(
        w.to_dtype(DType::F64).unwrap(),
        b.to_dtype(DType::F64).unwrap(),
        EPS,
    );
    assert_eq!(
        to_f64(&ln.forward(&x).unwrap()),
        to_f64(&b.broadcast_as((2, d)).unwrap())
    );
}

/// Linear(4, 6) → our LayerNorm(6) → Linear(6, 3) as three FSDP units.
fn fsdp_units() -> Vec<candle_fsdp::unit::UnitSpec> {
    use candle_fsdp::unit::UnitSpec;
    vec![
        UnitSpec::new("fc1", |vb| candle_nn::linear(4, 6, vb)),
        UnitSpec::new("norm", |vb| layer_norm(6, EPS, vb)),
        UnitSpec::new("fc2", |vb| candle_nn::linear(6, 3, vb)),
    ]
}

#[test]
fn fsdp_unit_with_layer_norm_trains_like_single_process() {
    use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
    use candle_fsdp::init::{seeded_var_builder, varmap_values};
    use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, FsdpModel, ShardedOptimizer};
    use candle_nn::Optimizer;

    const SEED: u64 = 21;
    const WS: usize = 2;
    const PER_RANK: usize = 4;
    const STEPS: usize = 4;
    const LR: f64 = 5e-2;
    let mut rng = rand::rngs::StdRng::seed_from_u64(22);
    let data: Vec<(Tensor, Tensor)> = (0..STEPS)
        .map(|_| {
            let x = tensor(
                &randn(&mut rng, WS * PER_RANK * 4, 1.5, 0.2),
                &[WS * PER_RANK, 4],
            );
            let y: Vec<u32> = (0..WS * PER_RANK).map(|_| rng.random_range(0..3)).collect();
            (x, Tensor::new(y, &Device::Cpu).unwrap())
        })
        .collect();

    // Single process: the same units on the global batch, candle-nn's AdamW.
    let varmap = VarMap::new();
    let vb = seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu);
    let units: Vec<_> = fsdp_units()
        .iter()
        .map(|u| (u.ctor)(vb.pp(&u.name)).unwrap())
        .collect();
    let initial = varmap_values(&varmap).unwrap();
    let params = candle_nn::ParamsAdamW {
        lr: LR,
        weight_decay: 0.0,
        ..Default::default()
    };
    let mut opt = candle_nn::AdamW::new(varmap.all_vars(), params).unwrap();
    for (x, y) in &data {
        let mut h = x.clone();
        for u in &units {
            h = u.forward1(&h, true).unwrap();
        }
        let loss = candle_nn::loss::cross_entropy(&h, y).unwrap();
        opt.step(&loss.backward().unwrap()).unwrap();
    }
    let reference = varmap_values(&varmap).unwrap();

    // FSDP FULL_SHARD over two thread ranks, each on its half of the batch.
    let results = run_ranks_ok(WS, ThreadGroupConfig::default(), |pg| {
        let rank = pg.rank();
        let config = FsdpConfig {
            seed: SEED,
            ..Default::default()
        };
        let mut model = FsdpModel::builder(pg.clone(), config)
            .units(fsdp_units())
            .build()?;
        let mut opt = AdamW::new(AdamWConfig {
            lr: LR,
            weight_decay: 0.0,
            ..Default::default()
        });
        for (x, y) in &data {
            let x = x.narrow(0, rank * PER_RANK, PER_RANK)?;
            let y = y.narrow(0, rank * PER_RANK, PER_RANK)?;
            let loss = candle_nn::loss::cross_entropy(&model.forward(&x)?, &y)?;
            model.backward(&loss)?;
            opt.step(&mut model)?;
            model.zero_grad();
        }
        Ok(model.gather_full_params(false)?.expect("all ranks gather"))
    })
    .expect("FSDP run");
    for (name, t) in &results[0] {
        let got = to_f64(t);
        let want: Vec<f64> = reference[name].iter().map(|&v| v as f64).collect();
        let start: Vec<f64> = initial[name].iter().map(|&v| v as f64).collect();
        let diff = max_abs_diff(&got, &want);
        assert!(diff < 1e-5, "{name}: {diff}");
        // Every parameter trained, the norm's and those below it included.
        assert!(max_abs_diff(&want, &start) > 1e-2, "{name} did not move");
    }
    assert_eq!(results[0].len(), 6);
}
