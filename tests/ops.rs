//! Device kernels (`candle_fsdp::ops`) on the CPU: bitwise equal to the host loops they replaced
//! (the crate's references `candle_fsdp::kernels::{adamw,sgd,scale}_reference`, which are those
//! loops operation for operation; the f64 sum of squares of the former `clip.rs` below), in place
//! (a clone of the tensor sees the update), without allocation proportional to the tensor, and
//! refusing bad arguments with errors that name them.

use std::sync::Mutex;

use candle_core::{DType, Device, Tensor};
use candle_fsdp::kernels;
use candle_fsdp::ops::{self, SgdHyper};

#[path = "common/mod.rs"]
mod common;
#[path = "common/counting_alloc.rs"]
mod counting_alloc;

use common::adamw_hyper;

use counting_alloc::{peak, reset_peak};

#[global_allocator]
static GLOBAL: counting_alloc::Counting = counting_alloc::COUNTING;

/// Tests of this file run one at a time: the allocation test reads process-wide counters.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Deterministic values in about [-scale, scale] (an LCG), with a few exact zeros.
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|i| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            if i % 17 == 0 {
                0.0
            } else {
                ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            }
        })
        .collect()
}

fn t(v: &[f32]) -> Tensor {
    Tensor::new(v, &Device::Cpu).unwrap()
}

fn v(t: &Tensor) -> Vec<f32> {
    t.to_vec1::<f32>().unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn adamw_step_is_bitwise_the_host_loop_and_in_place() {
    let _s = serial();
    let n = 1037;
    let (mut p, mut m, mut s) = (values(n, 1, 1.0), vec![0.0f32; n], vec![0.0f32; n]);
    let (tp, tm, ts) = (t(&p), t(&m), t(&s));
    let held = tp.clone();
    for step in 1..=5 {
        let g = values(n, 10 + step as u64, 0.1);
        let h = adamw_hyper(1e-3, 0.01, step);
        ops::adamw_step(&tp, &t(&g), &tm, &ts, &h).unwrap();
        // The loop of src/optim.rs before the kernels (unscaled, no inf found).
        kernels::adamw_reference(&mut p, &g, &mut m, &mut s, &(&h).into(), 1.0, 0.0);
        assert_eq!(bits(&v(&tp)), bits(&p), "param after step {step}");
        assert_eq!(bits(&v(&tm)), bits(&m), "exp_avg after step {step}");
        assert_eq!(bits(&v(&ts)), bits(&s), "exp_avg_sq after step {step}");
    }
    assert_eq!(
        bits(&v(&held)),
        bits(&p),
        "a clone shares the updated storage"
    );
    assert!(p.iter().zip(values(n, 1, 1.0)).any(|(a, b)| *a != b));
}

#[test]
fn sgd_step_is_bitwise_the_host_loop_for_every_option() {
    let _s = serial();
    let n = 515;
    for (momentum, dampening, wd, nesterov) in [
        (0.0f64, 0.0f64, 0.0f64, false),
        (0.0, 0.0, 1e-2, false),
        (0.9, 0.0, 0.0, false),
        (0.9, 0.1, 1e-2, false),
        (0.9, 0.0, 1e-2, true),
    ] {
        let mut p = values(n, 3, 1.0);
        let mut buf = vec![0.0f32; n];
        let (tp, tb) = (t(&p), t(&buf));
        for step in 0..4u64 {
            let g = values(n, 20 + step, 0.5);
            let h = SgdHyper {
                lr: 0.05,
                momentum: momentum as f32,
                one_minus_dampening: (1.0 - dampening) as f32,
                weight_decay: wd as f32,
                nesterov,
                first_step: step == 0,
            };
            let b = (momentum != 0.0).then_some(&tb);
            ops::sgd_step(&tp, &t(&g), b, &h).unwrap();
            // The loops of src/optim.rs before the kernels (unscaled, no inf found); without
            // momentum the buffer is neither read nor written.
            kernels::sgd_reference(&mut p, &g, Some(&mut buf), &(&h).into(), 1.0, 0.0);
            let what = format!("momentum {momentum}, nesterov {nesterov}, step {step}");
            assert_eq!(bits(&v(&tp)), bits(&p), "param, {what}");
            assert_eq!(bits(&v(&tb)), bits(&buf), "momentum buffer, {what}");
        }
    }
}

/// A moment or momentum buffer that decays below f32's smallest normal number is stored as
/// `+0` (the optimizers' subnormal flush: subnormal arithmetic is ~100× slower on a CPU), by the
/// kernels and their references alike; values above it are untouched.
#[test]
fn optimizer_state_decaying_into_subnormals_is_stored_as_zero() {
    let _s = serial();
    // 2^-126. Moments after one step with a zero gradient: state · β. Index 0 stays normal, 1–3
    // would become subnormal (m: 1.07e-38, -1.07e-38, 9e-40 from a subnormal; v: 0.9995 ·
    // 2^-126, 9e-40), 4 is ordinary.
    let tiny = f32::MIN_POSITIVE;
    let m0 = [tiny * 1.25, tiny * 1.1, -tiny * 1.1, tiny / 13.0, 0.5];
    let s0 = [tiny * 1.25, tiny * 1.0005, tiny * 1.0005, tiny / 13.0, 0.5];
    let n = m0.len();
    let g = vec![0.0f32; n];
    let h = adamw_hyper(1e-3, 0.0, 3);
    let (mut p, mut m, mut s) = (vec![1.0f32; n], m0.to_vec(), s0.to_vec());
    let (tp, tm, ts) = (t(&p), t(&m), t(&s));
    ops::adamw_step(&tp, &t(&g), &tm, &ts, &h).unwrap();
    kernels::adamw_reference(&mut p, &g, &mut m, &mut s, &(&h).into(), 1.0, 0.0);
    let got = v(&tm);
    assert_eq!(bits(&got), bits(&m), "exp_avg against the reference");
    assert_eq!(bits(&v(&ts)), bits(&s), "exp_avg_sq against the reference");
    assert_eq!(bits(&v(&tp)), bits(&p), "param against the reference");
    assert_eq!(got[0], m0[0] * h.beta1, "a normal result is kept: {got:?}");
    assert!(got[0] >= tiny);
    for i in 1..4 {
        assert_eq!(
            got[i].to_bits(),
            0,
            "element {i} ({:e} · β1) is stored as +0: {got:?}",
            m0[i]
        );
        assert_eq!(
            v(&ts)[i].to_bits(),
            0,
            "exp_avg_sq element {i} is stored as +0"
        );
    }
    assert_eq!(got[4], 0.5 * h.beta1);

    // A gradient whose square is subnormal beside a normal first moment: v is kept (a flushed
    // v would make the update m̂ / ε, infinite with ε = 0).
    let mut h0 = h;
    h0.eps = 0.0;
    let (tp, tm, ts) = (t(&[1.0f32]), t(&[0.0f32]), t(&[0.0f32]));
    ops::adamw_step(&tp, &t(&[1e-20f32]), &tm, &ts, &h0).unwrap();
    let (p1, m1, v1) = (v(&tp)[0], v(&tm)[0], v(&ts)[0]);
    assert!(m1 != 0.0 && v1 != 0.0 && v1 < tiny, "m {m1:e}, v {v1:e}");
    assert!(p1.is_finite() && (p1 - 1.0).abs() < 1e-2, "p {p1}");

    // bf16 moments: the same flush before rounding to bf16.
    let bf = |x: &[f32]| t(x).to_dtype(DType::BF16).unwrap();
    let (tm, ts) = (bf(&m0), bf(&s0));
    ops::adamw_step_bf16_state(&t(&vec![1.0f32; n]), &t(&g), &tm, &ts, &h, 7, 0).unwrap();
    let got = tm.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
    assert!(got[0] >= tiny, "bf16 exp_avg {got:?}");
    for i in 1..4 {
        assert_eq!(got[i].to_bits(), 0, "bf16 exp_avg element {i}: {got:?}");
    }

    // SGD's momentum buffer: b = μ·b with a zero gradient (not the first step).
    let hs = SgdHyper {
        lr: 0.1,
        momentum: 0.9,
        one_minus_dampening: 1.0,
        weight_decay: 0.0,
        nesterov: false,
        first_step: false,
    };
    let (mut p, mut b) = (vec![1.0f32; n], m0.to_vec());
    let (tp, tb) = (t(&p), t(&b));
    ops::sgd_step(&tp, &t(&g), Some(&tb), &hs).unwrap();
    kernels::sgd_reference(&mut p, &g, Some(&mut b), &(&hs).into(), 1.0, 0.0);
    let got = v(&tb);
    assert_eq!(
        bits(&got),
        bits(&b),
        "momentum buffer against the reference"
    );
    assert_eq!(bits(&v(&tp)), bits(&p), "param against the reference");
    assert_eq!(got[0], m0[0] * 0.9);
    for i in 1..4 {
        assert_eq!(got[i].to_bits(), 0, "momentum element {i}: {got:?}");
    }
}

#[test]
fn norms_scaling_and_finiteness() {
    let _s = serial();
    let x = values(999, 5, 3.0);
    let tx = t(&x);
    // The f64 sum of squares of src/clip.rs before the kernels.
    let expected = x.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
    assert_eq!(ops::sum_squares(&tx).unwrap().to_bits(), expected.to_bits());
    assert_eq!(ops::sum_squares(&t(&[3.0, 4.0])).unwrap(), 25.0);
    assert!(ops::all_finite(&tx).unwrap());

    ops::scale_(&tx, 0.3).unwrap();
    let mut scaled = x.clone();
    kernels::scale_reference(&mut scaled, 0.3);
    assert_eq!(bits(&v(&tx)), bits(&scaled));

    // Unscale with the inf/NaN check in one pass.
    let g = t(&[2.0, -4.0, 8.0]);
    assert!(ops::scale_and_check_finite_(&g, 0.25).unwrap());
    assert_eq!(v(&g), [0.5, -1.0, 2.0]);
    let g = t(&[2.0, f32::INFINITY, 8.0]);
    assert!(!ops::scale_and_check_finite_(&g, 0.5).unwrap());
    assert_eq!(v(&g)[2], 4.0, "every element is scaled, also after an inf");
    // Finite values that overflow when scaled count as non-finite.
    let g = t(&[f32::MAX, 1.0]);
    assert!(!ops::scale_and_check_finite_(&g, 4.0).unwrap());
    assert!(!ops::all_finite(&t(&[1.0, f32::NAN])).unwrap());
    // Empty tensors: nothing to do.
    let e = Tensor::zeros(0, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(ops::sum_squares(&e).unwrap(), 0.0);
    assert!(ops::scale_and_check_finite_(&e, 2.0).unwrap());
}

#[test]
fn add_widens_half_precision_sources_exactly() {
    let _s = serial();
    let dst = t(&[1.0, 2.0, 3.0]);
    ops::add_(&dst, &t(&[0.5, 0.25, -3.0])).unwrap();
    assert_eq!(v(&dst), [1.5, 2.25, 0.0]);
    let bf = t(&[0.1, 1.0, 2.0]).to_dtype(DType::BF16).unwrap();
    ops::add_(&dst, &bf).unwrap();
    assert_eq!(v(&dst), [1.5 + (205.0 / 2048.0), 3.25, 2.0]);
    let h = t(&[0.1, 0.0, 0.0]).to_dtype(DType::F16).unwrap();
    ops::add_(&dst, &h).unwrap();
    assert_eq!(v(&dst)[0], 1.5 + (205.0 / 2048.0) + (1638.0 / 16384.0));
    // A contiguous view with an offset reads (and writes) only its own elements.
    let big = t(&[1.0, 2.0, 3.0, 4.0]);
    let part = big.narrow(0, 2, 2).unwrap();
    ops::add_(&part, &t(&[10.0, 20.0])).unwrap();
    assert_eq!(v(&big), [1.0, 2.0, 13.0, 24.0]);
}

#[test]
fn bad_arguments_are_refused_naming_kernel_and_tensor() {
    let _s = serial();
    let (p, g, m, s) = (t(&[1.0; 4]), t(&[1.0; 4]), t(&[0.0; 4]), t(&[0.0; 4]));
    let h = adamw_hyper(1e-3, 0.0, 1);
    let err = |r: candle_fsdp::Result<()>| r.unwrap_err().to_string();
    // Length.
    let e = err(ops::adamw_step(&p, &t(&[1.0; 3]), &m, &s, &h));
    assert!(
        e.contains("adamw_step") && e.contains("grad has 3 elements, expected 4"),
        "{e}"
    );
    // Dtype.
    let bf = g.to_dtype(DType::BF16).unwrap();
    let e = err(ops::adamw_step(&p, &bf, &m, &s, &h));
    assert!(e.contains("grad must be F32, found BF16"), "{e}");
    // Not contiguous.
    let strided = Tensor::zeros((4, 2), DType::F32, &Device::Cpu)
        .unwrap()
        .narrow(1, 0, 1)
        .unwrap();
    let e = err(ops::scale_(&strided, 2.0));
    assert!(e.contains("scale_") && e.contains("contiguous"), "{e}");
    // Shared storage: refused (locking it twice would deadlock), nothing written.
    let e = err(ops::adamw_step(&p, &g, &m, &m.clone(), &h));
    assert!(
        e.contains("exp_avg and exp_avg_sq share one storage"),
        "{e}"
    );
    let e = err(ops::add_(&p, &p.narrow(0, 0, 4).unwrap()));
    assert!(e.contains("dst and src share one storage"), "{e}");
    assert_eq!(v(&p), [1.0; 4]);
    // Momentum without a buffer.
    let sh = SgdHyper {
        lr: 0.1,
        momentum: 0.9,
        one_minus_dampening: 1.0,
        weight_decay: 0.0,
        nesterov: false,
        first_step: true,
    };
    let e = err(ops::sgd_step(&p, &g, None, &sh));
    assert!(e.contains("needs a momentum buffer"), "{e}");
    let e = err(ops::add_(
        &p,
        &Tensor::zeros(4, DType::U8, &Device::Cpu).unwrap(),
    ));
    assert!(
        e.contains("src must be F32 or BF16 or F16, found U8"),
        "{e}"
    );
}

#[test]
fn kernels_allocate_nothing_proportional_to_the_tensor() {
    let _s = serial();
    let n = 1 << 20; // 4 MiB per tensor
    let (p, g, m, s) = (
        t(&values(n, 1, 1.0)),
        t(&values(n, 2, 0.1)),
        Tensor::zeros(n, DType::F32, &Device::Cpu).unwrap(),
        Tensor::zeros(n, DType::F32, &Device::Cpu).unwrap(),
    );
    let bf = g.to_dtype(DType::BF16).unwrap();
    let h = adamw_hyper(1e-3, 0.01, 1);
    let sh = SgdHyper {
        lr: 0.1,
        momentum: 0.9,
        one_minus_dampening: 1.0,
        weight_decay: 1e-4,
        nesterov: true,
        first_step: false,
    };
    // Once first: the optimizer loop starts rayon's thread pool on its first parallel call
    // (a one-time allocation of a few KiB, whatever the tensors' size).
    for _ in 0..3 {
        ops::adamw_step(&p, &g, &m, &s, &h).unwrap();
    }
    let base = reset_peak();
    ops::adamw_step(&p, &g, &m, &s, &h).unwrap();
    ops::sgd_step(&p, &g, Some(&m), &sh).unwrap();
    ops::scale_(&g, 0.5).unwrap();
    assert!(ops::scale_and_check_finite_(&g, 2.0).unwrap());
    assert!(ops::all_finite(&p).unwrap());
    assert!(ops::sum_squares(&g).unwrap() > 0.0);
    ops::add_(&g, &bf).unwrap();
    ops::add_(&g, &m).unwrap();
    let peak = peak() - base;
    // Candle's in-place entry point allocates a few bytes for its overlap check, and the
    // optimizer's rayon split a few KiB of job-queue blocks per call (9 KiB measured, whatever
    // the tensors' size); a temporary of the tensors would be 2-4 MiB.
    assert!(
        peak < 64 * 1024,
        "kernels allocated {peak} B at peak on 4 MiB tensors"
    );
}

/// An unfit tensor is a typed error callers can match: which kernel, which argument, what is
/// wrong.
#[test]
fn unfit_tensors_are_bad_tensor_errors() {
    let p = t(&values(8, 1, 1.0));
    let g16 = t(&values(8, 2, 1.0)).to_dtype(DType::BF16).unwrap();
    let (m, v) = (t(&[0.0; 8]), t(&[0.0; 8]));
    let h = adamw_hyper(1e-3, 0.0, 1);
    match ops::adamw_step(&p, &g16, &m, &v, &h) {
        Err(candle_fsdp::Error::BadTensor {
            op,
            tensor,
            problem,
        }) => {
            assert_eq!((op.as_str(), tensor.as_str()), ("adamw_step", "grad"));
            assert_eq!(problem, "must be F32, found BF16");
        }
        other => panic!("expected BadTensor, got {other:?}"),
    }
    let short = t(&[0.0; 4]);
    let e = ops::adamw_step(&p, &p.clone(), &short, &v, &h).unwrap_err();
    assert!(
        matches!(&e, candle_fsdp::Error::BadTensor { tensor, .. } if tensor == "grad" || tensor == "param" || tensor == "exp_avg"),
        "{e:?}"
    );
}
