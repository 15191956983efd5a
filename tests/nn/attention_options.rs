//! The options of `nn::attention` ([`AttentionOptions`]: scale, sliding window, logit
//! soft-capping, grouped-query heads) in the fused kernel against a direct f64 reference written
//! out here (values) and against `attention_composed` under Candle's autograd (gradients, in f32
//! and in f64), for every combination of the options, contexts across the kernel's 64-row tile
//! and below it; a window of `T` or more is no window (bit-equal); a window hides the keys left
//! of it (changing them leaves the output bit-equal); bf16 within its rounding; invalid options
//! are errors naming the option. Packed sequences (`attention_packed`): each example's output
//! equals the example attended alone, gradients equal the composed ops' in f64, bad segment
//! starts are errors naming the position.

use candle_core::{DType, Tensor, Var};
use candle_fsdp::nn::{
    attention, attention_composed, attention_packed, attention_packed_composed,
    causal_attention_gqa, segment_starts, AttentionOptions,
};

use super::fused::{max_abs_diff, random, values};

type AttentionFn = fn(&Tensor, &AttentionOptions) -> candle_core::Result<Tensor>;

/// `(y, d loss / d qkv)` for `loss = Σ y ⊙ w` through `f`.
fn attention_and_grad(
    f: AttentionFn,
    qkv: &Tensor,
    opts: &AttentionOptions,
    w: &Tensor,
) -> (Vec<f64>, Vec<f64>) {
    let v = Var::from_tensor(qkv).unwrap();
    let y = f(v.as_tensor(), opts).unwrap();
    let loss = (&y * w.to_dtype(y.dtype()).unwrap())
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    (values(&y), values(grads.get(v.as_tensor()).unwrap()))
}

/// Attention over `(B, T, (h + 2·kvh)·hd)` computed directly in f64 from the formulas:
/// `u = scale · q·k`, `z = c · tanh(u / c)` when soft-capped, softmax over the keys `j` with
/// `i − W < j ≤ i` (`j ≤ i` without a window), `·v`; query head `hi` reads key/value head
/// `hi / (h / kvh)`.
fn attention_reference(
    qkv: &[f64],
    (b, t, hd): (usize, usize, usize),
    opts: &AttentionOptions,
) -> Vec<f64> {
    let (h, kvh) = (opts.n_head, opts.n_kv_head);
    let (w, d, rep) = ((h + 2 * kvh) * hd, h * hd, h / kvh);
    let scale = opts.scale.unwrap_or(1.0 / (hd as f64).sqrt());
    let at = |bi: usize, ti: usize, c: usize| qkv[(bi * t + ti) * w + c];
    let mut y = vec![0f64; b * t * d];
    for bi in 0..b {
        for hi in 0..h {
            let (kc, vc) = (d + (hi / rep) * hd, d + kvh * hd + (hi / rep) * hd);
            for i in 0..t {
                let first = opts.window.map_or(0, |win| (i + 1).saturating_sub(win));
                let z: Vec<f64> = (first..=i)
                    .map(|j| {
                        let u = (0..hd)
                            .map(|c| at(bi, i, hi * hd + c) * at(bi, j, kc + c))
                            .sum::<f64>()
                            * scale;
                        match opts.softcap {
                            None => u,
                            Some(cap) => cap * (u / cap).tanh(),
                        }
                    })
                    .collect();
                let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = z.iter().map(|v| (v - m).exp()).collect();
                let sum: f64 = e.iter().sum();
                for c in 0..hd {
                    y[(bi * t + i) * d + hi * hd + c] = (first..=i)
                        .map(|j| e[j - first] / sum * at(bi, j, vc + c))
                        .sum();
                }
            }
        }
    }
    y
}

/// Every combination of window {none, 3, T + 5}, soft-cap {none, 2}, scale {1/√hd, 0.3}, for
/// grouped-query (4 heads, 2 key/value heads) and multi-head (2 and 2) attention, at T = 70 (a
/// full tile and a ragged one: tiles matter, and the window's first key moves inside the second
/// tile) and T = 5: kernel values against the f64 formula, kernel gradients against Candle's
/// autograd of the composed ops in f32 and in f64.
#[test]
fn attention_options_equal_f64_reference_and_composed_gradients() {
    let mut case = 0u64;
    for (b, t, hd) in [(1, 70, 8), (2, 5, 4)] {
        for (h, kvh) in [(4, 2), (2, 2)] {
            for window in [None, Some(3), Some(t + 5)] {
                for softcap in [None, Some(2.0)] {
                    for scale in [None, Some(0.3)] {
                        case += 1;
                        let opts = AttentionOptions {
                            n_head: h,
                            n_kv_head: kvh,
                            scale,
                            window,
                            softcap,
                        };
                        let what = format!("T {t}, {opts:?}");
                        let qkv = random(100 + case, &[b, t, (h + 2 * kvh) * hd], 1.5);
                        let w = random(200 + case, &[b, t, h * hd], 1.0);
                        let (y, g) = attention_and_grad(attention, &qkv, &opts, &w);

                        // Values: the formula in f64, and the composed ops in f64 equal it.
                        let r = attention_reference(&values(&qkv), (b, t, hd), &opts);
                        let dr = max_abs_diff(&y, &r);
                        assert!(dr < 2e-6, "{what}: values differ from f64 by {dr}");
                        let q64 = qkv.to_dtype(DType::F64).unwrap();
                        let (y64, g64) = attention_and_grad(attention_composed, &q64, &opts, &w);
                        let dc = max_abs_diff(&y64, &r);
                        assert!(dc < 1e-12, "{what}: composed f64 is not the formula ({dc})");

                        // Gradients: the composed ops under Candle's autograd, f32 and f64.
                        let (yc, gc) = attention_and_grad(attention_composed, &qkv, &opts, &w);
                        let (dy, dg) = (max_abs_diff(&y, &yc), max_abs_diff(&g, &gc));
                        assert!(dy < 2e-6, "{what}: values differ from composed by {dy}");
                        assert!(dg < 2e-5, "{what}: gradients differ from composed by {dg}");
                        let dg64 = max_abs_diff(&g, &g64);
                        assert!(dg64 < 2e-5, "{what}: gradients differ from f64 by {dg64}");
                    }
                }
            }
        }
    }
}

/// A window of `T` or more is no window: the kernel runs the same operations (bit-equal values
/// and gradients), the composed ops agree.
#[test]
fn window_of_t_or_more_is_no_window() {
    let (b, t, h, kvh, hd) = (2, 70, 4, 2, 8);
    let qkv = random(7, &[b, t, (h + 2 * kvh) * hd], 1.5);
    let w = random(8, &[b, t, h * hd], 1.0);
    for softcap in [None, Some(2.0)] {
        let none = AttentionOptions {
            softcap,
            ..AttentionOptions::new(h, kvh)
        };
        let (y, g) = attention_and_grad(attention, &qkv, &none, &w);
        for win in [t, t + 1, t + 5, usize::MAX] {
            let opts = AttentionOptions {
                window: Some(win),
                ..none
            };
            let (yw, gw) = attention_and_grad(attention, &qkv, &opts, &w);
            assert_eq!(y, yw, "window {win}, softcap {softcap:?}: values");
            assert_eq!(g, gw, "window {win}, softcap {softcap:?}: gradients");
            let (yc, gc) = attention_and_grad(attention_composed, &qkv, &opts, &w);
            assert!(max_abs_diff(&y, &yc) < 2e-6 && max_abs_diff(&g, &gc) < 2e-5);
        }
    }
    // The options' plain case is the plain causal kernel.
    let plain = values(&causal_attention_gqa(&qkv, h, kvh).unwrap());
    let new = values(&attention(&qkv, &AttentionOptions::new(h, kvh)).unwrap());
    assert_eq!(plain, new);
}

/// With a window `W`, output `i` depends on positions `i − W + 1 ..= i` only: changing every
/// other position leaves it bit-equal (the kernel skips those keys, it does not merely weigh
/// them by ~0); a window of 1 returns each position's own value.
#[test]
fn window_hides_the_keys_left_of_it() {
    let (b, t, h, kvh, hd, win) = (1, 150, 2, 1, 8, 20);
    let wd = (h + 2 * kvh) * hd;
    let qkv = random(9, &[b, t, wd], 1.0);
    for softcap in [None, Some(2.0)] {
        let opts = AttentionOptions {
            window: Some(win),
            softcap,
            ..AttentionOptions::new(h, kvh)
        };
        let y = values(&attention(&qkv, &opts).unwrap());
        // Rows 100..120 see keys 81..120: replace positions 0..81 (two whole tiles and more)
        // and 120..150.
        let changed = Tensor::cat(
            &[
                &random(10, &[b, 81, wd], 1.0),
                &qkv.narrow(1, 81, 39).unwrap(),
                &random(11, &[b, 30, wd], 1.0),
            ],
            1,
        )
        .unwrap();
        let y2 = values(&attention(&changed, &opts).unwrap());
        let d = h * hd;
        assert_eq!(y[100 * d..120 * d], y2[100 * d..120 * d], "{softcap:?}");
        assert_ne!(y[..100 * d], y2[..100 * d]);
    }
    let own = AttentionOptions {
        window: Some(1),
        ..AttentionOptions::new(h, kvh)
    };
    let y = values(&attention(&qkv, &own).unwrap());
    let v = values(&qkv.narrow(2, (h + kvh) * hd, hd).unwrap());
    for (i, row) in y.chunks_exact(h * hd).enumerate() {
        for head in row.chunks_exact(hd) {
            assert_eq!(head, &v[i * hd..(i + 1) * hd]);
        }
    }
}

/// bf16 and f16 inputs with every option on stay within their rounding of the f32 kernel.
#[test]
fn attention_options_half_precision_within_rounding() {
    let (b, t, h, kvh, hd) = (2, 70, 4, 2, 8);
    let qkv = random(12, &[b, t, (h + 2 * kvh) * hd], 1.0);
    let w = random(13, &[b, t, h * hd], 1.0);
    let opts = AttentionOptions {
        n_head: h,
        n_kv_head: kvh,
        scale: Some(0.3),
        window: Some(3),
        softcap: Some(2.0),
    };
    let (y, g) = attention_and_grad(attention, &qkv, &opts, &w);
    for (dtype, tol) in [(DType::BF16, 3e-2), (DType::F16, 4e-3)] {
        let (yh, gh) = attention_and_grad(attention, &qkv.to_dtype(dtype).unwrap(), &opts, &w);
        let (dy, dg) = (max_abs_diff(&y, &yh), max_abs_diff(&g, &gh));
        assert!(dy < tol, "{dtype:?}: values differ from f32 by {dy}");
        assert!(
            dg < 4.0 * tol,
            "{dtype:?}: gradients differ from f32 by {dg}"
        );
    }
}

/// Invalid options are errors naming the option, from the kernel's entry point and the
/// composed one alike (and for an input the kernel does not take, f64).
#[test]
fn attention_rejects_bad_options() {
    let qkv = random(14, &[1, 4, 24], 1.0);
    let base = AttentionOptions::new(2, 1);
    let bad = [
        (
            AttentionOptions {
                window: Some(0),
                ..base
            },
            "`window`",
        ),
        (
            AttentionOptions {
                softcap: Some(0.0),
                ..base
            },
            "`softcap`",
        ),
        (
            AttentionOptions {
                softcap: Some(-1.0),
                ..base
            },
            "`softcap`",
        ),
        (
            AttentionOptions {
                softcap: Some(f64::NAN),
                ..base
            },
            "`softcap`",
        ),
        (
            AttentionOptions {
                softcap: Some(f64::INFINITY),
                ..base
            },
            "`softcap`",
        ),
        (
            AttentionOptions {
                scale: Some(f64::NAN),
                ..base
            },
            "`scale`",
        ),
        (
            AttentionOptions {
                scale: Some(f64::INFINITY),
                ..base
            },
            "`scale`",
        ),
        (
            AttentionOptions {
                scale: Some(-0.5),
                ..base
            },
            "`scale`",
        ),
    ];
    use candle_fsdp::nn::kernels::{attention_backward, attention_forward, AttentionShape};
    let shape = AttentionShape {
        batch: 1,
        seq: 4,
        n_head: 2,
        n_kv_head: 1,
        head_dim: 6,
    };
    let raw = qkv.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (out, grad) = (vec![0.5f32; 4 * 12], vec![1f32; 4 * 12]);
    for (opts, name) in bad {
        for x in [qkv.clone(), qkv.to_dtype(DType::F64).unwrap()] {
            for f in [attention as AttentionFn, attention_composed] {
                let e = f(&x, &opts).unwrap_err().to_string();
                assert!(e.contains(name), "{opts:?}: {e}");
            }
        }
        // The raw kernels panic with the same message (they returned zeros, NaN or panicked
        // inside a task before).
        for backward in [false, true] {
            let e = std::panic::catch_unwind(|| {
                if backward {
                    attention_backward(&raw, None, &out, &grad, shape, &opts, None);
                } else {
                    attention_forward(&raw, None, shape, &opts, None);
                }
            })
            .unwrap_err();
            let msg = e.downcast_ref::<String>().cloned().unwrap_or_default();
            assert!(msg.contains(name), "{opts:?}: {msg}");
        }
    }
    // The valid base runs.
    assert_eq!(attention(&qkv, &base).unwrap().dims(), [1, 4, 12]);
}

/// No sequence, or sequences of no position: the empty `(B, T, n_head·hd)` result, with an
/// (empty) gradient, on the kernel's dtypes and on f64 (the composed ops).
#[test]
fn attention_of_nothing_is_empty() {
    let opts = AttentionOptions::new(2, 1);
    for dims in [[0, 3, 12], [2, 0, 12]] {
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            for f in [attention as AttentionFn, attention_composed] {
                let x = Var::from_tensor(
                    &Tensor::zeros(&dims[..], dtype, &candle_core::Device::Cpu).unwrap(),
                )
                .unwrap();
                let y = f(x.as_tensor(), &opts).unwrap();
                assert_eq!(y.dims(), [dims[0], dims[1], 6], "{dims:?} {dtype:?}");
                let g = y.sum_all().unwrap().backward().unwrap();
                let gx = g.get(x.as_tensor()).expect("a gradient for qkv");
                assert_eq!(gx.dims(), dims, "{dims:?} {dtype:?}");
            }
        }
    }
}

/// Examples packed in sequences of 150 positions (row 0: 40 + 70 + 40, segment starts inside
/// the kernel's tiles and on none of their edges; row 1: 1 + 149), for window {none, 3, 50} and
/// soft-cap {none, 2}, grouped-query heads: each example's rows of the packed output equal the
/// example attended alone, and the gradients equal the composed ops' under Candle's autograd in
/// f64.
#[test]
fn packed_examples_attend_as_if_alone() {
    let (b, t, hd, h, kvh) = (2, 150, 8, 4, 2);
    let rows: [&[usize]; 2] = [&[40, 70, 40], &[1, 149]];
    let ids: Vec<u32> = rows
        .iter()
        .flat_map(|r| r.iter().flat_map(|&n| 0..n as u32))
        .collect();
    let starts =
        segment_starts(&Tensor::from_vec(ids, (b, t), &candle_core::Device::Cpu).unwrap()).unwrap();
    let mut case = 0;
    for window in [None, Some(3), Some(50)] {
        for softcap in [None, Some(2.0)] {
            case += 1;
            let opts = AttentionOptions {
                n_head: h,
                n_kv_head: kvh,
                scale: None,
                window,
                softcap,
            };
            let qkv = random(300 + case, &[b, t, (h + 2 * kvh) * hd], 1.5);
            let w = random(400 + case, &[b, t, h * hd], 1.0);
            let packed = |q: &Tensor, o: &AttentionOptions| attention_packed(q, o, &starts);
            let v = Var::from_tensor(&qkv).unwrap();
            let y = packed(v.as_tensor(), &opts).unwrap();
            let g = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let g = values(g.get(v.as_tensor()).unwrap());
            for (bi, lens) in rows.iter().enumerate() {
                let mut at = 0;
                for &n in lens.iter() {
                    let one = qkv.narrow(0, bi, 1).unwrap().narrow(1, at, n).unwrap();
                    let alone = values(&attention(&one, &opts).unwrap());
                    let got = values(&y.narrow(0, bi, 1).unwrap().narrow(1, at, n).unwrap());
                    let d = max_abs_diff(&got, &alone);
                    assert!(d < 2e-6, "{opts:?}: example at ({bi}, {at}) differs by {d}");
                    at += n;
                }
            }
            let q64 = Var::from_tensor(&qkv.to_dtype(DType::F64).unwrap()).unwrap();
            let y64 = attention_packed_composed(q64.as_tensor(), &opts, &starts).unwrap();
            let w64 = w.to_dtype(DType::F64).unwrap();
            let g64 = (&y64 * &w64)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let dy = max_abs_diff(&values(&y), &values(&y64));
            assert!(
                dy < 2e-6,
                "{opts:?}: values differ from composed f64 by {dy}"
            );
            let dg = max_abs_diff(&g, &values(g64.get(q64.as_tensor()).unwrap()));
            assert!(
                dg < 2e-5,
                "{opts:?}: gradients differ from composed f64 by {dg}"
            );
        }
    }
    // One example per row: attention's values exactly.
    let zeros = Tensor::zeros((b, t), DType::U32, &candle_core::Device::Cpu).unwrap();
    let opts = AttentionOptions::new(h, kvh);
    let qkv = random(500, &[b, t, (h + 2 * kvh) * hd], 1.5);
    assert_eq!(
        values(&attention_packed(&qkv, &opts, &zeros).unwrap()),
        values(&attention(&qkv, &opts).unwrap())
    );
    // Starts that are not segment starts, or of another shape, are refused.
    let mut bad = vec![0u32; b * t];
    bad[7] = 3;
    let bad = Tensor::from_vec(bad, (b, t), &candle_core::Device::Cpu).unwrap();
    let e = attention_packed(&qkv, &opts, &bad).unwrap_err().to_string();
    assert!(
        e.contains("segment start 3 at position 7 of sequence 0"),
        "{e}"
    );
    let e = attention_packed(&qkv, &opts, &zeros.narrow(1, 0, 5).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("must be (2, 150) u32"), "{e}");
}
