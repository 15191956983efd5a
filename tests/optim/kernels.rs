//! The CPU references of the CUDA kernels (`candle_fsdp::kernels`) against the production CPU
//! paths they stand for: the `half` crate's conversions (and Candle's `to_dtype`, which uses
//! them), the loops of `candle_fsdp::ops`, the copy-in that `FsdpModel::backward` performs
//! (`fsdp::collectives::flatten_grads` and the cast before the reduce-scatter, observed through
//! the public API: the reduced gradient shards and their presence flags), the copy-out
//! (`param_copies`: narrow, reshape, contiguous), and the grad scaler's update. The GPU tests
//! (`tests/gpu/kernels.rs`) compare each kernel with these references; together they tie the
//! kernels to the CPU path.
//!
//! Bit-exact comparisons use `to_bits`; NaN payloads included (both sides are Rust here).

use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::ProcessGroup;
use candle_fsdp::flat_param::FlatParamLayout;
use candle_fsdp::grad_scaler::{GradScalerConfig, ShardedGradScaler};
use candle_fsdp::kernels::{self, plan as args, FloatVec, Floats, KernelFloat};
use candle_fsdp::ops::{self, ScaleFactor, SgdHyper, Unscale};
use candle_fsdp::optim::{Sgd, SgdConfig};
use candle_fsdp::unit::UnitSpec;
use candle_fsdp::{FsdpConfig, FsdpModel, MixedPrecision};
use candle_nn::{Init, VarBuilder};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::common::adamw_hyper;

/// The awkward sizes of the kernel tests (1, a prime, one past a power of two, a size that
/// hits the reductions' block cap).
const SIZES: [usize; 5] = [1, 7, 1025, 4099, 300_007];

fn cpu(v: Vec<f32>) -> Tensor {
    let n = v.len();
    Tensor::from_vec(v, n, &Device::Cpu).unwrap()
}

fn host(t: &Tensor) -> Vec<f32> {
    t.to_vec1::<f32>().unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Values of varied magnitude and sign, with a few zeros.
fn random(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            if i % 97 == 13 {
                0.0
            } else {
                let e: i32 = rng.random_range(-8..8);
                rng.random_range(-1.0f32..1.0) * scale * 2f32.powi(e)
            }
        })
        .collect()
}

/// f32 values that exercise every conversion case: zeros, infinities, NaNs with payloads,
/// the f16 and bf16 overflow, subnormal and tie boundaries, and random bits.
fn special_f32(rng: &mut StdRng) -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7F80_0001), // signalling NaN, low payload
        f32::from_bits(0x7FA0_0000), // signalling NaN, high payload
        f32::from_bits(0xFFC1_2345),
        f32::MAX,
        f32::MIN_POSITIVE,
        f32::from_bits(1), // smallest f32 subnormal
        65504.0,           // f16 max
        65519.996,
        65520.0, // f16 tie to infinity
        2f32.powi(-24),
        2f32.powi(-25),       // tie between 0 and the smallest f16 subnormal: to 0
        3.0 * 2f32.powi(-25), // tie: to the even neighbour 2^-23
        2f32.powi(-14),       // smallest f16 normal
        2f32.powi(-14) - 2f32.powi(-25),
        1.0 + 2f32.powi(-8),       // bf16 tie, even below
        1.0 + 3.0 * 2f32.powi(-8), // bf16 tie, even above
        1.0 + 2f32.powi(-11),      // f16 tie
        1.0 + 3.0 * 2f32.powi(-11),
        3.389_531_4e38, // bf16 rounds to infinity
    ];
    v.extend((0..200).map(|_| f32::from_bits(rng.random::<u32>())));
    v.extend(v.clone().iter().map(|x| -x));
    v
}

#[test]
fn widening_matches_half_for_every_bit_pattern() {
    for b in 0..=u16::MAX {
        assert_eq!(
            kernels::bf16_bits_to_f32(b).to_bits(),
            bf16::from_bits(b).to_f32().to_bits(),
            "bf16 {b:#06x}"
        );
        assert_eq!(
            kernels::f16_bits_to_f32(b).to_bits(),
            f16::from_bits(b).to_f32().to_bits(),
            "f16 {b:#06x}"
        );
    }
}

#[test]
fn narrowing_matches_half_on_ties_nans_infinities_and_subnormals() {
    let mut rng = StdRng::seed_from_u64(1);
    // Every value of the top 16 bits (sign, exponent, the bits that decide every rounding
    // position of bf16 and of f16 subnormals) with low halves that put the round and sticky
    // bits of f16 normals and bf16 on both sides of every tie.
    let mut lows: Vec<u32> = vec![
        0, 1, 0x0FFF, 0x1000, 0x1001, 0x2000, 0x3000, 0x3001, 0x7FFF, 0x8000, 0x8001, 0xC000,
        0xFFFF,
    ];
    lows.extend((0..3).map(|_| rng.random::<u32>() & 0xFFFF));
    let mut checked = 0usize;
    for hi in 0..=0xFFFFu32 {
        for &lo in &lows {
            let x = f32::from_bits((hi << 16) | lo);
            assert_eq!(
                kernels::f32_to_bf16_bits(x),
                bf16::from_f32(x).to_bits(),
                "bf16 of {:#010x}",
                x.to_bits()
            );
            assert_eq!(
                kernels::f32_to_f16_bits(x),
                f16::from_f32(x).to_bits(),
                "f16 of {:#010x}",
                x.to_bits()
            );
            checked += 1;
        }
    }
    for x in special_f32(&mut rng) {
        assert_eq!(
            kernels::f32_to_bf16_bits(x),
            bf16::from_f32(x).to_bits(),
            "{x:e}"
        );
        assert_eq!(
            kernels::f32_to_f16_bits(x),
            f16::from_f32(x).to_bits(),
            "{x:e}"
        );
    }
    assert!(checked > 1_000_000);
    // The tie cases by value: to even.
    assert_eq!(
        f16::from_bits(kernels::f32_to_f16_bits(65520.0)),
        f16::INFINITY
    );
    assert_eq!(kernels::f32_to_f16_bits(2f32.powi(-25)), 0);
    assert_eq!(kernels::f32_to_bf16_bits(1.0 + 2f32.powi(-8)), 0x3F80);
    assert_eq!(kernels::f32_to_bf16_bits(1.0 + 3.0 * 2f32.powi(-8)), 0x3F82);
}

/// `cast_reference::<S, D>` against Candle's CPU `to_dtype` and `ops::cast`, bit for bit.
fn check_cast<S: KernelFloat, D: KernelFloat>(src: &[S]) {
    let want: Vec<D> = kernels::cast_reference(src);
    let t = Tensor::from_vec(src.to_vec(), src.len(), &Device::Cpu).unwrap();
    for (how, got) in [
        ("to_dtype", t.to_dtype(D::DTYPE).unwrap()),
        ("ops::cast", ops::cast(&t, D::DTYPE).unwrap()),
    ] {
        let got = got.to_vec1::<D>().unwrap();
        for (i, (a, b)) in want.iter().zip(&got).enumerate() {
            assert_eq!(
                a.widen().to_bits(),
                b.widen().to_bits(),
                "{how} {:?} -> {:?} at {i}: source {}",
                S::DTYPE,
                D::DTYPE,
                src[i].widen()
            );
        }
        // The stored bits too (widening merges a signalling NaN with its quiet twin).
        let raw = |v: &[D]| v.iter().map(|x| x.to_raw()).collect::<Vec<u32>>();
        assert_eq!(
            raw(&want),
            raw(&got),
            "{how} {:?} -> {:?}",
            S::DTYPE,
            D::DTYPE
        );
    }
}

#[test]
fn cast_reference_is_candles_to_dtype_for_all_six_pairs() {
    let mut rng = StdRng::seed_from_u64(2);
    let f: Vec<f32> = special_f32(&mut rng);
    let b: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
    let h: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    check_cast::<f32, bf16>(&f);
    check_cast::<f32, f16>(&f);
    check_cast::<f32, f32>(&f);
    check_cast::<bf16, f32>(&b);
    check_cast::<f16, f32>(&h);
    check_cast::<bf16, f16>(&b);
    check_cast::<f16, bf16>(&h);
    check_cast::<bf16, bf16>(&b);
    check_cast::<f16, f16>(&h);
}

#[test]
fn adamw_reference_is_ops_adamw_step_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(3);
    for &n in &SIZES {
        for (wd, inv) in [(0.0, 1.0f32), (0.01, 1.0), (0.01, 1.0 / 1024.0), (0.1, 0.3)] {
            let p0 = random(&mut rng, n, 1.0);
            let (p, m, v) = (cpu(p0.clone()), cpu(vec![0.0; n]), cpu(vec![0.0; n]));
            let (pf, mf, vf) = (cpu(p0.clone()), cpu(vec![0.0; n]), cpu(vec![0.0; n]));
            let (mut rp, mut rm, mut rv) = (p0, vec![0.0f32; n], vec![0.0f32; n]);
            for t in 1..=3 {
                let h = adamw_hyper(1e-3, wd, t);
                let g0 = random(&mut rng, n, 100.0);
                // Production: unscale in place (the grad scaler), then the step.
                let g = cpu(g0.clone());
                if inv != 1.0 {
                    assert!(ops::scale_and_check_finite_(&g, inv).unwrap());
                }
                ops::adamw_step(&p, &g, &m, &v, &h).unwrap();
                // The fused entry: unscale in registers.
                let gf = cpu(g0.clone());
                let u = Unscale {
                    inv_scale: ScaleFactor::Value(inv),
                    found_inf: Some(&cpu(vec![0.0])),
                };
                ops::adamw_step_fused(&pf, &gf, &mf, &vf, &h, &u).unwrap();
                assert_eq!(
                    bits(&host(&gf)),
                    bits(&g0),
                    "the fused step reads grad only"
                );
                kernels::adamw_reference(&mut rp, &g0, &mut rm, &mut rv, &(&h).into(), inv, 0.0);
                for (what, a, b) in [
                    ("param", &p, &rp),
                    ("exp_avg", &m, &rm),
                    ("exp_avg_sq", &v, &rv),
                ] {
                    assert_eq!(
                        bits(&host(a)),
                        bits(b),
                        "n {n} wd {wd} inv {inv} t {t}: {what}"
                    );
                }
                assert_eq!(bits(&host(&pf)), bits(&rp), "fused n {n} t {t}");
                assert_eq!(bits(&host(&mf)), bits(&rm));
                assert_eq!(bits(&host(&vf)), bits(&rv));
            }
            // found_inf set: nothing moves, in the reference and in the fused step (the flag
            // as a tensor; the factor as a tensor too).
            let before = (host(&pf), host(&mf), host(&vf));
            let g = cpu(random(&mut rng, n, 1.0));
            let u = Unscale {
                inv_scale: ScaleFactor::Device(&cpu(vec![inv])),
                found_inf: Some(&cpu(vec![1.0])),
            };
            ops::adamw_step_fused(&pf, &g, &mf, &vf, &adamw_hyper(1e-3, wd, 4), &u).unwrap();
            assert_eq!((host(&pf), host(&mf), host(&vf)), before);
            let (mut a, mut b, mut c) = before.clone();
            kernels::adamw_reference(
                &mut a,
                &host(&g),
                &mut b,
                &mut c,
                &(&adamw_hyper(1e-3, wd, 4)).into(),
                inv,
                1.0,
            );
            assert_eq!((a, b, c), before);
        }
    }
}

#[test]
fn sgd_reference_is_ops_sgd_step_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(4);
    for &n in &SIZES[..4] {
        for momentum in [0.0f32, 0.9] {
            for nesterov in [false, true] {
                for (wd, damp, inv) in [(0.0, 0.0, 1.0f32), (1e-4, 0.1, 1.0), (1e-2, 0.0, 0.125)] {
                    if nesterov && momentum == 0.0 {
                        continue;
                    }
                    let p0 = random(&mut rng, n, 1.0);
                    let (p, b) = (cpu(p0.clone()), cpu(vec![0.0; n]));
                    let (pf, bf) = (cpu(p0.clone()), cpu(vec![0.0; n]));
                    let (mut rp, mut rb) = (p0, vec![0.0f32; n]);
                    for step in 0..3 {
                        let h = SgdHyper {
                            lr: 0.05,
                            momentum,
                            one_minus_dampening: 1.0 - damp,
                            weight_decay: wd,
                            nesterov,
                            first_step: step == 0,
                        };
                        let g0 = random(&mut rng, n, 10.0);
                        let g = cpu(g0.clone());
                        if inv != 1.0 {
                            ops::scale_(&g, inv).unwrap();
                        }
                        let buf = (momentum != 0.0).then_some(&b);
                        ops::sgd_step(&p, &g, buf, &h).unwrap();
                        let u = Unscale {
                            inv_scale: ScaleFactor::Value(inv),
                            found_inf: None,
                        };
                        let buf_f = (momentum != 0.0).then_some(&bf);
                        ops::sgd_step_fused(&pf, &cpu(g0.clone()), buf_f, &h, &u).unwrap();
                        let rbuf = (momentum != 0.0).then_some(&mut rb[..]);
                        kernels::sgd_reference(&mut rp, &g0, rbuf, &(&h).into(), inv, 0.0);
                        let what =
                            format!("n {n} mu {momentum} nesterov {nesterov} wd {wd} step {step}");
                        assert_eq!(bits(&host(&p)), bits(&rp), "{what}");
                        assert_eq!(bits(&host(&pf)), bits(&rp), "fused {what}");
                        if momentum != 0.0 {
                            assert_eq!(bits(&host(&b)), bits(&rb), "buffer {what}");
                            assert_eq!(bits(&host(&bf)), bits(&rb), "fused buffer {what}");
                        }
                    }
                    // Skipped on found_inf.
                    let before = host(&pf);
                    let h = SgdHyper {
                        lr: 0.05,
                        momentum,
                        one_minus_dampening: 1.0,
                        weight_decay: wd,
                        nesterov,
                        first_step: false,
                    };
                    let u = Unscale {
                        inv_scale: ScaleFactor::Value(1.0),
                        found_inf: Some(&cpu(vec![1.0])),
                    };
                    let g = cpu(vec![1.0; n]);
                    ops::sgd_step_fused(&pf, &g, (momentum != 0.0).then_some(&bf), &h, &u).unwrap();
                    assert_eq!(host(&pf), before);
                }
            }
        }
    }
}

#[test]
fn elementwise_references_are_the_ops_cpu_loops() {
    let mut rng = StdRng::seed_from_u64(5);
    for &n in &SIZES {
        let x0 = random(&mut rng, n, 1e3);
        // scale_
        let t = cpu(x0.clone());
        ops::scale_(&t, 0.37).unwrap();
        let mut r = x0.clone();
        kernels::scale_reference(&mut r, 0.37);
        assert_eq!(bits(&host(&t)), bits(&r), "scale n {n}");
        // scale_and_check_finite_, clean and with an overflow the scaling itself produces
        for (extra, s) in [(None, 0.5f32), (Some(3e38f32), 4.0), (Some(f32::NAN), 1.0)] {
            let mut x = x0.clone();
            if let Some(e) = extra {
                x[n / 2] = e;
            }
            let t = cpu(x.clone());
            let finite = ops::scale_and_check_finite_(&t, s).unwrap();
            let mut r = x.clone();
            let mut flag = 0.0f32;
            kernels::scale_check_finite_reference(&mut r, s, &mut flag);
            assert_eq!(bits(&host(&t)), bits(&r), "scale_check n {n}");
            assert_eq!(finite, flag == 0.0, "n {n} extra {extra:?}");
            // The device-flag form (CPU path): same values, flag set, never cleared.
            let t = cpu(x.clone());
            let f = cpu(vec![0.0]);
            ops::unscale_check_finite_(&t, ScaleFactor::Value(s), &f).unwrap();
            assert_eq!(bits(&host(&t)), bits(&r));
            assert_eq!(host(&f), vec![flag]);
            let f = cpu(vec![1.0]);
            ops::unscale_check_finite_(&cpu(x0.clone()), ScaleFactor::Device(&cpu(vec![s])), &f)
                .unwrap();
            assert_eq!(host(&f), vec![1.0], "the flag accumulates");
            // all_finite / check_finite_ on the scaled values
            let mut nf = 0.0f32;
            kernels::non_finite_reference(&r, &mut nf);
            assert_eq!(ops::all_finite(&cpu(r.clone())).unwrap(), nf == 0.0);
            let f = cpu(vec![0.0]);
            ops::check_finite_(&cpu(r.clone()), &f).unwrap();
            assert_eq!(host(&f), vec![nf]);
        }
        // add_ from each dtype
        let src = random(&mut rng, n, 10.0);
        let s32 = cpu(src.clone());
        for s in [
            s32.clone(),
            s32.to_dtype(DType::BF16).unwrap(),
            s32.to_dtype(DType::F16).unwrap(),
        ] {
            let d = cpu(x0.clone());
            ops::add_(&d, &s).unwrap();
            let mut r = x0.clone();
            let (sb, sh): (Vec<bf16>, Vec<f16>) = match s.dtype() {
                DType::BF16 => (s.to_vec1().unwrap(), vec![]),
                DType::F16 => (vec![], s.to_vec1().unwrap()),
                _ => (vec![], vec![]),
            };
            let floats = match s.dtype() {
                DType::BF16 => Floats::BF16(&sb),
                DType::F16 => Floats::F16(&sh),
                _ => Floats::F32(&src),
            };
            kernels::add_reference(&mut r, floats);
            assert_eq!(bits(&host(&d)), bits(&r), "add n {n} from {:?}", s.dtype());
        }
    }
}

#[test]
fn sum_squares_reference_is_the_kernels_order_and_agrees_with_ops() {
    let mut rng = StdRng::seed_from_u64(6);
    for &n in &SIZES {
        // Small integers: every partial sum exact, so any order gives the same f64.
        let ints: Vec<f32> = (0..n)
            .map(|_| rng.random_range(-50i32..50) as f32)
            .collect();
        assert_eq!(
            kernels::sum_squares_reference(&ints),
            ops::sum_squares(&cpu(ints.clone())).unwrap(),
            "n {n}"
        );
        let x = random(&mut rng, n, 3.0);
        let (a, b) = (
            kernels::sum_squares_reference(&x),
            ops::sum_squares(&cpu(x.clone())).unwrap(),
        );
        assert!(((a - b) / b).abs() < 1e-12, "n {n}: {a} vs {b}");
    }
    assert_eq!(kernels::sum_squares_reference(&[]), 0.0);
    assert_eq!(kernels::sum_squares_blocks(300_007), 1024);
}

// ---- copy-in: the gradient shards FsdpModel::backward produces -----------------------------

/// Parameter shapes of the probe unit; the fourth is never used (no gradient).
const PROBE: [&[usize]; 5] = [&[5], &[3, 7], &[1], &[2], &[9]];
const UNUSED: usize = 3;

/// `sum over used q of sum(w_q ⊙ x_q)`, x_q consecutive slices of the 1-D input: the gradient
/// of w_q is exactly x_q (in the compute dtype).
struct Probe {
    ws: Vec<Tensor>,
}

impl Module for Probe {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut acc: Option<Tensor> = None;
        let mut at = 0;
        for (q, w) in self.ws.iter().enumerate() {
            let n = w.elem_count();
            if q != UNUSED {
                let term = (w * x.narrow(0, at, n)?.reshape(w.shape())?)?.sum_all()?;
                acc = Some(match acc {
                    None => term,
                    Some(a) => (a + term)?,
                });
            }
            at += n;
        }
        acc.expect("some used parameter").reshape(1)
    }
}

fn probe(vb: VarBuilder) -> candle_core::Result<Probe> {
    let ws = PROBE
        .iter()
        .enumerate()
        .map(|(q, s)| vb.get_with_hints(*s, &format!("w{q}"), Init::Const(0.5)))
        .collect::<candle_core::Result<_>>()?;
    Ok(Probe { ws })
}

fn probe_model(pg: Arc<dyn ProcessGroup>, mp: MixedPrecision) -> candle_fsdp::Result<FsdpModel> {
    FsdpModel::builder(
        pg,
        FsdpConfig {
            mixed_precision: mp,
            ..Default::default()
        },
    )
    .unit_spec(UnitSpec::new("probe", probe).with_unused_parameters(true))
    .build()
}

/// The reference buffer, widened to f32, for gradients `grads` (host, compute dtype).
fn reference_buffer(layout: &FlatParamLayout, grads: &[Option<Tensor>], reduce: DType) -> Vec<f32> {
    let owned: Vec<Option<FloatVec>> = grads
        .iter()
        .map(|g| g.as_ref().map(|g| FloatVec::from_tensor(g).unwrap()))
        .collect();
    let floats: Vec<Option<Floats<'_>>> = owned
        .iter()
        .map(|o| o.as_ref().map(FloatVec::as_floats))
        .collect();
    match reduce {
        DType::BF16 => kernels::copy_in_reference::<bf16>(&layout.copy_layout(), &floats)
            .unwrap()
            .iter()
            .map(|x| x.widen())
            .collect(),
        DType::F16 => kernels::copy_in_reference::<f16>(&layout.copy_layout(), &floats)
            .unwrap()
            .iter()
            .map(|x| x.widen())
            .collect(),
        _ => kernels::copy_in_reference::<f32>(&layout.copy_layout(), &floats).unwrap(),
    }
}

#[test]
fn copy_in_reference_is_what_backward_reduces_into_the_gradient_shards() {
    let total: usize = PROBE.iter().map(|s| s.iter().product::<usize>()).sum();
    let mut rng = StdRng::seed_from_u64(7);
    let x = cpu(random(&mut rng, total, 4.0));
    for (param, reduce) in [
        (DType::F32, DType::F32),
        (DType::BF16, DType::BF16),
        (DType::F16, DType::F16),
        (DType::BF16, DType::F32),
        (DType::BF16, DType::F16),
        (DType::F16, DType::BF16),
    ] {
        let mp = MixedPrecision {
            param_dtype: param,
            reduce_dtype: reduce,
            ..MixedPrecision::full_f32()
        };
        // The gradients: each used parameter's slice of x in the compute dtype.
        let xp = x.to_dtype(param).unwrap();
        let mut at = 0;
        let grads: Vec<Option<Tensor>> = PROBE
            .iter()
            .enumerate()
            .map(|(q, s)| {
                let n: usize = s.iter().product();
                let g = (q != UNUSED).then(|| xp.narrow(0, at, n).unwrap());
                at += n;
                g
            })
            .collect();
        // World sizes whose average of equal values is exact (x + x, halved).
        for ws in [1usize, 2] {
            let x = x.clone();
            let out = run_ranks_ok(ws, ThreadGroupConfig::default(), move |pg| {
                let mut m = probe_model(pg.clone(), mp)?;
                let y = m.forward(&x)?;
                m.backward(&y.to_dtype(DType::F32)?.sum_all()?)?;
                let v = m.shards().next().expect("one unit");
                Ok((
                    v.layout.clone(),
                    v.shard_index,
                    host(v.grad.expect("a gradient shard")),
                    v.grad_present.to_vec(),
                ))
            })
            .unwrap();
            for (layout, r, shard, present) in out {
                assert_eq!(layout.world_size, ws);
                let buf = reference_buffer(&layout, &grads, reduce);
                let (s, f) = (layout.shard_numel, layout.params.len());
                let chunk = &buf[r * (s + f)..(r + 1) * (s + f)];
                let what = format!("param {param:?} reduce {reduce:?} ws {ws} rank {r}");
                assert_eq!(bits(&shard), bits(&chunk[..s]), "{what}: gradient shard");
                let flags: Vec<bool> = chunk[s..].iter().map(|&v| v > 0.0).collect();
                assert_eq!(present, flags, "{what}: presence flags");
                assert!(!present[UNUSED] && present.iter().filter(|p| **p).count() == 4);
            }
        }
    }
}

#[test]
fn copy_in_reference_layout_by_hand() {
    // Two parameters of 3 and 2 elements (offsets 0 and 4), world size 3: padded 6, S = 2,
    // F = 2; the second parameter has no gradient.
    let layout =
        FlatParamLayout::new(&[("a".into(), 3.into()), ("b".into(), 2.into())], 3).unwrap();
    assert_eq!((layout.padded_numel, layout.shard_numel), (6, 2));
    let g = [1.5f32, -2.0, 3.0];
    let out =
        kernels::copy_in_reference::<f32>(&layout.copy_layout(), &[Some(Floats::F32(&g))]).unwrap();
    #[rustfmt::skip]
    assert_eq!(out, vec![
        1.5, -2.0, 1.0, 0.0, // chunk 0: a[0], a[1], flags
        3.0, 0.0, 1.0, 0.0,  // chunk 1: a[2], gap, flags
        0.0, 0.0, 1.0, 0.0,  // chunk 2: b (absent), flags
    ]);
    let empty = FlatParamLayout::new(&[], 2).unwrap();
    assert!(kernels::copy_in_reference::<f32>(&empty.copy_layout(), &[]).is_none());
}

#[test]
fn copy_out_reference_is_param_copies() {
    let shapes: Vec<(String, candle_core::Shape)> = vec![
        ("a".into(), (3, 5).into()),
        ("b".into(), 1.into()),
        ("c".into(), (2, 2, 3).into()),
        ("d".into(), 7.into()),
    ];
    let layout = FlatParamLayout::new(&shapes, 3).unwrap();
    let mut rng = StdRng::seed_from_u64(8);
    let flat = cpu(random(&mut rng, layout.padded_numel, 2.0));
    for src in [DType::F32, DType::BF16, DType::F16] {
        let flat = flat.to_dtype(src).unwrap();
        for dst in [DType::F32, DType::BF16, DType::F16] {
            // param_copies: narrow + reshape + contiguous (then the compute dtype).
            let want: Vec<Vec<f32>> = layout
                .params
                .iter()
                .map(|p| {
                    flat.narrow(0, p.offset, p.numel)
                        .unwrap()
                        .reshape(p.shape.clone())
                        .unwrap()
                        .force_contiguous()
                        .unwrap()
                        .to_dtype(dst)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_dtype(DType::F32)
                        .unwrap()
                        .to_vec1()
                        .unwrap()
                })
                .collect();
            let got: Vec<Vec<f32>> = match (src, dst) {
                (DType::F32, d) => out_f32::<f32>(&layout, &flat.to_vec1::<f32>().unwrap(), d),
                (DType::BF16, d) => out_f32::<bf16>(&layout, &flat.to_vec1::<bf16>().unwrap(), d),
                (_, d) => out_f32::<f16>(&layout, &flat.to_vec1::<f16>().unwrap(), d),
            };
            assert_eq!(
                got.iter().map(|v| bits(v)).collect::<Vec<_>>(),
                want.iter().map(|v| bits(v)).collect::<Vec<_>>(),
                "{src:?} -> {dst:?}"
            );
        }
    }
}

fn out_f32<S: KernelFloat>(layout: &FlatParamLayout, flat: &[S], dst: DType) -> Vec<Vec<f32>> {
    fn widen<D: KernelFloat>(v: Vec<Vec<D>>) -> Vec<Vec<f32>> {
        v.into_iter()
            .map(|p| p.into_iter().map(|x| x.widen()).collect())
            .collect()
    }
    match dst {
        DType::BF16 => widen(kernels::copy_out_reference::<S, bf16>(
            &layout.copy_layout().spans,
            flat,
        )),
        DType::F16 => widen(kernels::copy_out_reference::<S, f16>(
            &layout.copy_layout().spans,
            flat,
        )),
        _ => widen(kernels::copy_out_reference::<S, f32>(
            &layout.copy_layout().spans,
            flat,
        )),
    }
}

#[test]
fn update_scale_reference_follows_the_grad_scaler() {
    // Clean (false) and overflowing (true) steps; growth interval 2.
    let pattern = [
        false, false, false, true, false, true, true, false, false, false,
    ];
    let cfg = GradScalerConfig {
        init_scale: 1024.0,
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval: 2,
    };
    let total: usize = PROBE.iter().map(|s| s.iter().product::<usize>()).sum();
    let x = cpu(vec![0.25; total]);
    let states = run_ranks_ok(1, ThreadGroupConfig::default(), move |pg| {
        let mut m = probe_model(pg, MixedPrecision::full_f32())?;
        let mut opt = Sgd::new(SgdConfig::default());
        let mut scaler = ShardedGradScaler::new(cfg)?;
        let mut out = Vec::new();
        for &inf in &pattern {
            let y = m.forward(&x)?;
            m.backward(&scaler.scale_loss(&y.sum_all()?)?)?;
            if inf {
                let g = m.shards().next().unwrap().grad.expect("a gradient");
                g.slice_set(&Tensor::new(&[f32::INFINITY], g.device())?, 0, 0)?;
            }
            let stepped = scaler.step(&mut m, &mut opt)?;
            assert_eq!(stepped, !inf);
            m.zero_grad();
            out.push(scaler.state());
        }
        Ok(out)
    })
    .unwrap()
    .remove(0);
    let (mut scale, mut tracker) = (cfg.init_scale, 0u32);
    for (k, (&inf, st)) in pattern.iter().zip(&states).enumerate() {
        let inv = kernels::update_scale_reference(
            &mut scale,
            &mut tracker,
            if inf { 1.0 } else { 0.0 },
            cfg.growth_factor,
            cfg.backoff_factor,
            cfg.growth_interval as u32,
        );
        assert_eq!(
            (scale, tracker as u64),
            (st.scale, st.growth_tracker),
            "step {k}"
        );
        assert_eq!(inv, 1.0 / st.scale);
    }
}

#[test]
fn every_kernel_the_wrappers_launch_is_in_its_module() {
    // (module, function) pairs src/ops/cuda/ loads; a rename on either side fails here,
    // without NVRTC.
    let launched = [
        ("cast", "cast"),
        ("copy", "copy_in"),
        ("copy", "copy_out"),
        ("ops", "scale"),
        ("ops", "scale_check_finite"),
        ("ops", "non_finite"),
        ("ops", "add"),
        ("ops", "sum_squares_partial"),
        ("ops", "sum_squares_final"),
        ("optim", "adamw"),
        ("optim", "sgd"),
        ("optim", "update_scale"),
    ];
    for (module, function) in launched {
        let (_, src) = kernels::SOURCES
            .iter()
            .find(|(m, _)| *m == module)
            .unwrap_or_else(|| panic!("module {module} not registered"));
        assert!(
            src.contains(&format!("extern \"C\" __global__ void {function}(")),
            "{module}.cu has no kernel {function}"
        );
        assert!(
            src.starts_with(kernels::COMMON),
            "{module}: the prelude comes first"
        );
        assert!(
            !src.lines().any(|l| l.trim_start().starts_with("#include")),
            "{module}: NVRTC gets no include path"
        );
    }
    for (module, src) in kernels::SOURCES {
        assert!(
            src.starts_with(kernels::COMMON),
            "{module}: the prelude comes first"
        );
    }
}

// ---- the kernel sources themselves, run on the CPU -----------------------------------------

/// `kernels/host/launch.cpp` (the kernel sources under `kernels/host/emulation.h`) built with
/// the C++ compiler as a shared library and loaded; `None` (with the reason) when no compiler
/// runs here.
struct Emulated(*mut libc::c_void);

impl Emulated {
    fn build() -> Result<Emulated, String> {
        let dir = std::env::temp_dir().join(format!("candle-fsdp-kernels-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let lib = dir.join("libkernels_emulated.so");
        let src = concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/host/launch.cpp");
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let out = std::process::Command::new(&cxx)
            .args([
                "-O2",
                "-std=c++17",
                "-ffp-contract=off",
                "-fno-fast-math",
                "-fPIC",
            ])
            .args(["-shared", "-Wall", "-Werror", "-o"])
            .arg(&lib)
            .arg(src)
            .output()
            .map_err(|e| format!("no C++ compiler ({cxx}: {e})"))?;
        assert!(
            out.status.success(),
            "{cxx} failed on kernels/host/launch.cpp:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let c = std::ffi::CString::new(lib.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path of the library just built.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        let _ = std::fs::remove_dir_all(&dir);
        assert!(!h.is_null(), "dlopen of the emulated kernels failed");
        Ok(Emulated(h))
    }

    /// The entry point `name`, as a function pointer of type `F`.
    ///
    /// # Safety
    ///
    /// `F` must be the C signature of `name` in kernels/host/launch.cpp.
    unsafe fn get<F: Copy>(&self, name: &str) -> F {
        let c = std::ffi::CString::new(name).unwrap();
        // SAFETY: a live handle and a valid name.
        let s = unsafe { libc::dlsym(self.0, c.as_ptr()) };
        assert!(!s.is_null(), "no {name} in the emulated kernels");
        assert_eq!(
            std::mem::size_of::<F>(),
            std::mem::size_of::<*mut libc::c_void>()
        );
        // SAFETY: a function pointer of the signature the caller vouches for.
        unsafe { std::mem::transmute_copy(&s) }
    }
}

/// A host buffer standing in for device memory: its address is what the kernels dereference.
fn addr(v: &FloatVec) -> u64 {
    match v {
        FloatVec::F32(x) => x.as_ptr() as u64,
        FloatVec::BF16(x) => x.as_ptr() as u64,
        FloatVec::F16(x) => x.as_ptr() as u64,
    }
}

fn raw(v: &FloatVec) -> Vec<u32> {
    match v {
        FloatVec::F32(x) => x.iter().map(|e| e.to_raw()).collect(),
        FloatVec::BF16(x) => x.iter().map(|e| e.to_raw()).collect(),
        FloatVec::F16(x) => x.iter().map(|e| e.to_raw()).collect(),
    }
}

/// `v` in the dtype of kernel code `code` (converted with half).
fn in_dtype(v: &[f32], code: u32) -> FloatVec {
    match code {
        1 => FloatVec::BF16(v.iter().map(|&x| bf16::from_f32(x)).collect()),
        2 => FloatVec::F16(v.iter().map(|&x| f16::from_f32(x)).collect()),
        _ => FloatVec::F32(v.to_vec()),
    }
}

/// `n` elements of dtype code `code` holding a pattern no kernel writes: an element left
/// unwritten shows.
fn sentinel(n: usize, code: u32) -> FloatVec {
    match code {
        1 => FloatVec::BF16(vec![bf16::from_bits(0xABCD); n]),
        2 => FloatVec::F16(vec![f16::from_bits(0xABCD); n]),
        _ => FloatVec::F32(vec![f32::from_bits(0xABCD_ABCD); n]),
    }
}

/// Conversion edge cases first, then random bit patterns and values.
fn edgy(rng: &mut StdRng, n: usize) -> Vec<f32> {
    let mut v = special_f32(rng);
    v.truncate(25);
    while v.len() < n {
        v.push(if rng.random::<bool>() {
            f32::from_bits(rng.random::<u32>())
        } else {
            rng.random_range(-100.0f32..100.0)
        });
    }
    v.truncate(n);
    v
}

fn cast_ref(src: &FloatVec, d: u32) -> Vec<u32> {
    macro_rules! go {
        ($S:ty, $x:expr) => {
            match d {
                0 => raw(&FloatVec::F32(kernels::cast_reference::<$S, f32>($x))),
                1 => raw(&FloatVec::BF16(kernels::cast_reference::<$S, bf16>($x))),
                _ => raw(&FloatVec::F16(kernels::cast_reference::<$S, f16>($x))),
            }
        };
    }
    match src {
        FloatVec::F32(x) => go!(f32, x),
        FloatVec::BF16(x) => go!(bf16, x),
        FloatVec::F16(x) => go!(f16, x),
    }
}

fn copy_out_ref(layout: &FlatParamLayout, flat: &FloatVec, d: u32) -> Vec<FloatVec> {
    macro_rules! go {
        ($S:ty, $x:expr) => {
            match d {
                0 => kernels::copy_out_reference::<$S, f32>(&layout.copy_layout().spans, $x)
                    .into_iter()
                    .map(FloatVec::F32)
                    .collect(),
                1 => kernels::copy_out_reference::<$S, bf16>(&layout.copy_layout().spans, $x)
                    .into_iter()
                    .map(FloatVec::BF16)
                    .collect(),
                _ => kernels::copy_out_reference::<$S, f16>(&layout.copy_layout().spans, $x)
                    .into_iter()
                    .map(FloatVec::F16)
                    .collect(),
            }
        };
    }
    match flat {
        FloatVec::F32(x) => go!(f32, x),
        FloatVec::BF16(x) => go!(bf16, x),
        FloatVec::F16(x) => go!(f16, x),
    }
}

type CastFn = unsafe extern "C" fn(u64, u32, u64, u32, u64, u32, u32);
type CopyInFn = unsafe extern "C" fn(u64, *const args::CopyInArgs, u32, u32, u32);
type CopyOutFn = unsafe extern "C" fn(u64, *const args::CopyOutArgs, u32, u32, u32);
type ScaleFn = unsafe extern "C" fn(*mut f32, u64, f32, u32, u32);
type ScaleCheckFn = unsafe extern "C" fn(*mut f32, u64, f32, *const f32, *mut f32, u32);
type NonFiniteFn = unsafe extern "C" fn(*const f32, u64, *mut f32, u32);
type AddFn = unsafe extern "C" fn(*mut f32, u64, u32, u64, u32, u32);
type AdamWFn = unsafe extern "C" fn(
    *mut f32,
    *const f32,
    *mut f32,
    *mut f32,
    u64,
    *const args::AdamWArgs,
    f32,
    *const f32,
    *const f32,
    u32,
    u32,
);
type SgdFn = unsafe extern "C" fn(
    *mut f32,
    *const f32,
    *mut f32,
    u64,
    *const args::SgdArgs,
    f32,
    *const f32,
    *const f32,
    u32,
    u32,
);
type UpdateScaleFn = unsafe extern "C" fn(*mut f32, *mut u32, *const f32, *mut f32, f32, f32, u32);

/// The layouts of the copy checks: the probe unit at world sizes 1 to 4, 150 parameters of
/// random sizes (three launches of at most 64; some of 0 elements) at world sizes up to 64, and
/// a large parameter between small ones.
fn copy_layouts(rng: &mut StdRng) -> Vec<FlatParamLayout> {
    let probe: Vec<(String, candle_core::Shape)> = PROBE
        .iter()
        .enumerate()
        .map(|(i, s)| (format!("p{i}"), s.to_vec().into()))
        .collect();
    let many: Vec<(String, candle_core::Shape)> = (0..150)
        .map(|i| {
            let n = if i % 37 == 5 {
                0
            } else {
                rng.random_range(1..300)
            };
            (format!("m{i}"), n.into())
        })
        .collect();
    let big: Vec<(String, candle_core::Shape)> = vec![
        ("a".into(), 7.into()),
        ("b".into(), ((1 << 17) + 3).into()),
        ("c".into(), 1025.into()),
    ];
    let mut out = Vec::new();
    for ws in [1, 2, 3, 4] {
        out.push(FlatParamLayout::new(&probe, ws).unwrap());
    }
    for ws in [1, 3, 8, 64] {
        out.push(FlatParamLayout::new(&many, ws).unwrap());
    }
    for ws in [1, 4, 5] {
        out.push(FlatParamLayout::new(&big, ws).unwrap());
    }
    out
}

/// The kernel sources compiled for the CPU (kernels/host/) and run, launch by launch, with the
/// launch plans the GPU wrappers use (`kernels::plan`), against the references: the indexing,
/// batching, dtype dispatch and arithmetic of the kernels themselves, on a machine without a GPU.
/// Outputs start as a sentinel pattern, so an element a launch plan misses shows. The block
/// reductions of the sum of squares are left to the GPU tests.
#[test]
fn kernel_sources_run_under_host_emulation() {
    let emu = match Emulated::build() {
        Ok(e) => e,
        Err(why) => {
            println!("SKIPPED kernel_sources_run_under_host_emulation: {why}");
            return;
        }
    };
    let mut rng = StdRng::seed_from_u64(9);
    // SAFETY (every `emu.get` below): the types are the C signatures of kernels/host/launch.cpp;
    // every pointer passed to an entry point addresses a live host buffer of the size the
    // kernel reads or writes (the same sizes the GPU wrappers check).
    let sizeof: unsafe extern "C" fn(u32) -> u32 = unsafe { emu.get("emu_sizeof") };
    // SAFETY: plain call.
    unsafe {
        assert_eq!(sizeof(0) as usize, std::mem::size_of::<args::CopyInArgs>());
        assert_eq!(sizeof(1) as usize, std::mem::size_of::<args::CopyOutArgs>());
        assert_eq!(sizeof(2) as usize, std::mem::size_of::<args::AdamWArgs>());
        assert_eq!(sizeof(3) as usize, std::mem::size_of::<args::SgdArgs>());
    }
    let blocks = kernels::elementwise_blocks;
    let threads = kernels::THREADS;

    // cast: every pair, bit for bit.
    let cast: CastFn = unsafe { emu.get("emu_cast") };
    for n in [1usize, 7, 1025, 70_001] {
        let v = edgy(&mut rng, n);
        for s in 0..3u32 {
            let src = in_dtype(&v, s);
            for d in 0..3u32 {
                let out = sentinel(n, d);
                // SAFETY: src and out hold n elements of dtype codes s and d.
                unsafe { cast(addr(&src), s, addr(&out), d, n as u64, blocks(n), threads) };
                assert_eq!(raw(&out), cast_ref(&src, d), "cast {s} -> {d}, n {n}");
            }
        }
    }

    // copy_in and copy_out with the wrappers' launch plans.
    let copy_in: CopyInFn = unsafe { emu.get("emu_copy_in") };
    let copy_out: CopyOutFn = unsafe { emu.get("emu_copy_out") };
    for layout in copy_layouts(&mut rng) {
        let f = layout.params.len();
        let grads: Vec<Option<FloatVec>> = (0..f)
            .map(|q| {
                (q % 4 != 3).then(|| {
                    let v = edgy(&mut rng, layout.params[q].numel);
                    in_dtype(&v, rng.random_range(0..3))
                })
            })
            .collect();
        let floats: Vec<Option<Floats<'_>>> = grads
            .iter()
            .map(|g| g.as_ref().map(FloatVec::as_floats))
            .collect();
        let srcs: Vec<(u64, u32)> = grads
            .iter()
            .map(|g| match g {
                None => (0, 0),
                Some(g) => (addr(g), kernels::dtype_code(g.as_floats().dtype()).unwrap()),
            })
            .collect();
        let what = format!("{f} params, ws {}", layout.world_size);
        for out_code in 0..3u32 {
            let out = sentinel(layout.world_size * (layout.shard_numel + f), out_code);
            for (a, grid) in args::copy_in_plan(&layout.copy_layout(), &srcs, out_code) {
                // SAFETY: `out` holds W·(S+F) elements of the out dtype; every source holds its
                // parameter's numel elements of its dtype.
                unsafe { copy_in(addr(&out), &a, grid.0, grid.1, threads) };
            }
            let want = match out_code {
                0 => raw(&FloatVec::F32(
                    kernels::copy_in_reference(&layout.copy_layout(), &floats).unwrap(),
                )),
                1 => raw(&FloatVec::BF16(
                    kernels::copy_in_reference(&layout.copy_layout(), &floats).unwrap(),
                )),
                _ => raw(&FloatVec::F16(
                    kernels::copy_in_reference(&layout.copy_layout(), &floats).unwrap(),
                )),
            };
            assert_eq!(raw(&out), want, "copy_in {what}, out dtype {out_code}");
        }
        let flat_vals = edgy(&mut rng, layout.padded_numel);
        for s in 0..3u32 {
            let flat = in_dtype(&flat_vals, s);
            for d in 0..3u32 {
                let outs: Vec<FloatVec> =
                    layout.params.iter().map(|p| sentinel(p.numel, d)).collect();
                let dsts: Vec<u64> = outs.iter().map(addr).collect();
                for (a, grid) in args::copy_out_plan(&layout.copy_layout().spans, &dsts, s, d) {
                    // SAFETY: `flat` holds padded_numel elements of dtype s; every output its
                    // parameter's numel elements of dtype d.
                    unsafe { copy_out(addr(&flat), &a, grid.0, grid.1, threads) };
                }
                let want = copy_out_ref(&layout, &flat, d);
                for (q, (o, w)) in outs.iter().zip(&want).enumerate() {
                    assert_eq!(raw(o), raw(w), "copy_out {what}, {s} -> {d}, param {q}");
                }
            }
        }
    }

    // The element-wise kernels of `ops`.
    let scale: ScaleFn = unsafe { emu.get("emu_scale") };
    let scale_check: ScaleCheckFn = unsafe { emu.get("emu_scale_check_finite") };
    let non_finite: NonFiniteFn = unsafe { emu.get("emu_non_finite") };
    let add: AddFn = unsafe { emu.get("emu_add") };
    for n in [1usize, 7, 1025, 70_001] {
        let x0 = random(&mut rng, n, 1e3);
        let mut x = x0.clone();
        // SAFETY: x holds n f32.
        unsafe { scale(x.as_mut_ptr(), n as u64, 0.37, blocks(n), threads) };
        let mut r = x0.clone();
        kernels::scale_reference(&mut r, 0.37);
        assert_eq!(bits(&x), bits(&r), "scale n {n}");
        for (extra, s, on_device) in [
            (None, 0.5f32, false),
            (Some(3e38f32), 4.0, true),
            (Some(f32::NAN), 1.0, false),
        ] {
            let mut x = x0.clone();
            if let Some(e) = extra {
                x[n / 2] = e;
            }
            let mut r = x.clone();
            let mut want = 0.0f32;
            kernels::scale_check_finite_reference(&mut r, s, &mut want);
            let (mut flag, factor) = (0.0f32, [s]);
            let (value, ptr) = if on_device {
                (7.0, factor.as_ptr())
            } else {
                (s, std::ptr::null())
            };
            // SAFETY: x holds n f32, the factor (when given) and the flag one.
            unsafe { scale_check(x.as_mut_ptr(), n as u64, value, ptr, &mut flag, blocks(n)) };
            assert_eq!(bits(&x), bits(&r), "scale_check_finite n {n}");
            assert_eq!(flag, want, "found_inf n {n} extra {extra:?}");
            let (mut nf, mut flag) = (0.0f32, 0.0f32);
            kernels::non_finite_reference(&r, &mut nf);
            // SAFETY: r holds n f32.
            unsafe { non_finite(r.as_ptr(), n as u64, &mut flag, blocks(n)) };
            assert_eq!(flag, nf);
        }
        let src = random(&mut rng, n, 10.0);
        for d in 0..3u32 {
            let s = in_dtype(&src, d);
            let mut x = x0.clone();
            // SAFETY: x and s hold n elements (s of dtype d).
            unsafe { add(x.as_mut_ptr(), addr(&s), d, n as u64, blocks(n), threads) };
            let mut r = x0.clone();
            kernels::add_reference(&mut r, s.as_floats());
            assert_eq!(bits(&x), bits(&r), "add n {n} from {d}");
        }
    }

    // The optimizers and the scaler update.
    let adamw: AdamWFn = unsafe { emu.get("emu_adamw") };
    let sgd: SgdFn = unsafe { emu.get("emu_sgd") };
    let update_scale: UpdateScaleFn = unsafe { emu.get("emu_update_scale") };
    let null = std::ptr::null::<f32>();
    for n in [1usize, 7, 1025, 70_001] {
        for (wd, inv, on_device) in [
            (0.0, 1.0f32, false),
            (0.01, 1.0 / 1024.0, true),
            (0.1, 0.3, false),
        ] {
            let p0 = random(&mut rng, n, 1.0);
            // Every fifth element starts with moments just above f32's smallest normal and
            // gets no gradient: its first step takes them below it (the subnormal flush).
            let tiny = f32::MIN_POSITIVE;
            let m0: Vec<f32> = (0..n)
                .map(|i| if i % 5 == 0 { tiny * 1.05 } else { 0.0 })
                .collect();
            let v0: Vec<f32> = (0..n)
                .map(|i| if i % 5 == 0 { tiny * 1.0005 } else { 0.0 })
                .collect();
            let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
            let (mut rp, mut rm, mut rv) = (p0, m0, v0);
            let (factor, zero, one) = ([inv], [0.0f32], [1.0f32]);
            for t in 1..=3 {
                let h = adamw_hyper(1e-3, wd, t);
                let a = args::AdamWArgs::from(&h);
                let mut g = random(&mut rng, n, 100.0);
                g.iter_mut().step_by(5).for_each(|g| *g = 0.0);
                // A gradient whose square is subnormal: `v` stays beside a normal `m`.
                g.iter_mut().skip(1).step_by(5).for_each(|g| *g = 1e-20);
                let (value, fp, found) = if on_device {
                    (7.0, factor.as_ptr(), zero.as_ptr())
                } else {
                    (inv, null, null)
                };
                // SAFETY: p, g, m, v hold n f32; the factor and flag one each (or null).
                unsafe {
                    adamw(
                        p.as_mut_ptr(),
                        g.as_ptr(),
                        m.as_mut_ptr(),
                        v.as_mut_ptr(),
                        n as u64,
                        &a,
                        value,
                        fp,
                        found,
                        blocks(n),
                        threads,
                    )
                };
                kernels::adamw_reference(&mut rp, &g, &mut rm, &mut rv, &(&h).into(), inv, 0.0);
                let what = format!("adamw n {n} wd {wd} inv {inv} t {t}");
                assert_eq!(bits(&p), bits(&rp), "{what}");
                assert_eq!(bits(&m), bits(&rm), "{what}");
                assert_eq!(bits(&v), bits(&rv), "{what}");
                assert_eq!((m[0].to_bits(), v[0].to_bits()), (0, 0), "{what}: flushed");
                if n > 1 && inv == 1.0 {
                    assert!(m[1] != 0.0 && v[1] != 0.0, "{what}: v kept beside m");
                }
                let before = (p.clone(), m.clone(), v.clone());
                // SAFETY: as above, the flag set: nothing is written.
                unsafe {
                    adamw(
                        p.as_mut_ptr(),
                        g.as_ptr(),
                        m.as_mut_ptr(),
                        v.as_mut_ptr(),
                        n as u64,
                        &a,
                        inv,
                        null,
                        one.as_ptr(),
                        blocks(n),
                        threads,
                    )
                };
                assert_eq!((p.clone(), m.clone(), v.clone()), before, "{what}: skipped");
            }
        }
        for momentum in [0.0f32, 0.9] {
            for nesterov in [false, true] {
                for (wd, damp, inv) in [(0.0f32, 0.0f32, 1.0f32), (1e-2, 0.1, 0.125)] {
                    let p0 = random(&mut rng, n, 1.0);
                    let (mut p, mut b) = (p0.clone(), vec![0.0f32; n]);
                    let (mut rp, mut rb) = (p0, vec![0.0f32; n]);
                    for step in 0..3 {
                        let h = SgdHyper {
                            lr: 0.05,
                            momentum,
                            one_minus_dampening: 1.0 - damp,
                            weight_decay: wd,
                            nesterov,
                            first_step: step == 0,
                        };
                        let a = args::SgdArgs::from(&h);
                        let g = random(&mut rng, n, 10.0);
                        let bp = if momentum != 0.0 {
                            b.as_mut_ptr()
                        } else {
                            std::ptr::null_mut()
                        };
                        // SAFETY: p, g and (with momentum) b hold n f32.
                        unsafe {
                            sgd(
                                p.as_mut_ptr(),
                                g.as_ptr(),
                                bp,
                                n as u64,
                                &a,
                                inv,
                                null,
                                null,
                                blocks(n),
                                threads,
                            )
                        };
                        let rbuf = (momentum != 0.0).then_some(&mut rb[..]);
                        kernels::sgd_reference(&mut rp, &g, rbuf, &(&h).into(), inv, 0.0);
                        let what =
                            format!("sgd n {n} mu {momentum} nesterov {nesterov} step {step}");
                        assert_eq!(bits(&p), bits(&rp), "{what}");
                        assert_eq!(bits(&b), bits(&rb), "{what}");
                    }
                }
            }
        }
    }
    let (mut s, mut t, mut inv) = (1024.0f32, 0u32, 0.0f32);
    let (mut rs, mut rt) = (1024.0f32, 0u32);
    for inf in [
        false, false, false, true, false, true, true, false, false, false,
    ] {
        let f = if inf { 1.0f32 } else { 0.0 };
        // SAFETY: four one-element host values.
        unsafe { update_scale(&mut s, &mut t, &f, &mut inv, 2.0, 0.5, 2) };
        let ri = kernels::update_scale_reference(&mut rs, &mut rt, f, 2.0, 0.5, 2);
        assert_eq!((s, t, inv.to_bits()), (rs, rt, ri.to_bits()));
    }
}
