//! The kernels of `kernels/` on a GPU against their CPU references (`candle_fsdp::kernels`),
//! which `tests/optim/kernels.rs` ties to the production CPU paths.
//!
//! `every_module_compiles_with_nvrtc` is not ignored: it needs libnvrtc, not a GPU, and checks
//! each kernel's parameter list in the PTX against what the launch wrappers pass (the one thing
//! a wrong launch would not report). It is skipped, saying why, only when libnvrtc cannot be
//! loaded. The other tests need a GPU (`scripts/gpu-check.sh` runs them): each kernel on random
//! data of awkward sizes (1, 7, 1025, 2^20 + 3) in f32, bf16 and f16, compared bit for bit
//! (NaN payloads aside where arithmetic produces a NaN), and the device-side skip on found_inf.

use candle_core::{DType, Device, Tensor};
use candle_fsdp::flat_param::FlatParamLayout;
use candle_fsdp::kernels::{self, FloatVec, Floats, KernelFloat};
use candle_fsdp::ops::cuda as k;
use candle_fsdp::ops::{self, ScaleFactor, SgdHyper, Unscale};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::common::adamw_hyper;

const SIZES: [usize; 4] = [1, 7, 1025, (1 << 20) + 3];

// ---- NVRTC: every module compiles, every kernel's parameters are the wrappers' -------------

/// The parameter list of `.entry name(...)` in `ptx`: `u64`, `u32`, `f32`, or `b8[N]` for a
/// by-value struct of N bytes.
fn entry_params(ptx: &str, name: &str) -> Option<Vec<String>> {
    let start = ptx.find(&format!(".entry {name}("))?;
    let body = &ptx[start..];
    let end = body.find(')')?;
    Some(
        body[..end]
            .lines()
            .skip(1)
            .map(|l| {
                let l = l.trim().trim_end_matches(',');
                if l.contains(".b8 ") {
                    let n = &l[l.find('[').unwrap() + 1..l.find(']').unwrap()];
                    format!("b8[{n}]")
                } else {
                    l.split_whitespace()
                        .nth(1)
                        .unwrap_or("?")
                        .trim_start_matches('.')
                        .to_string()
                }
            })
            .collect(),
    )
}

/// Whether libnvrtc can be loaded. cudarc links it dynamically (Candle's `dynamic-linking`), so
/// a binary that runs has it already; the check still asks the loader by the names NVRTC 11.2
/// to 13 use, so that a build that loads it lazily skips cleanly instead of panicking.
fn nvrtc_loadable() -> Result<(), String> {
    let names = [
        "libnvrtc.so.13",
        "libnvrtc.so.12",
        "libnvrtc.so.11.2",
        "libnvrtc.so",
    ];
    for n in names {
        let c = std::ffi::CString::new(n).unwrap();
        // SAFETY: dlopen with a valid NUL-terminated name; a handle it returns is closed at once
        // (a library cudarc linked stays loaded).
        unsafe {
            let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
            if !h.is_null() {
                libc::dlclose(h);
                return Ok(());
            }
        }
    }
    Err(format!("none of {names:?} loads"))
}

#[test]
fn every_module_compiles_with_nvrtc() {
    if let Err(why) = nvrtc_loadable() {
        println!("SKIPPED every_module_compiles_with_nvrtc: libnvrtc cannot be loaded ({why})");
        return;
    }
    for (module, _) in kernels::SOURCES {
        let ptx = kernels::nvrtc::ptx(module).unwrap_or_else(|e| panic!("module {module}: {e}"));
        assert!(ptx.contains(".entry"), "{module}: PTX without kernels");
        println!("kernels/{module}.cu: {} bytes of PTX", ptx.len());
    }
    // What the wrappers of src/ops/cuda/ push, in order: device pointers and u64 sizes
    // are `u64`, dtype codes and flags `u32`, scalars `f32`, structs `b8[size]` (their Rust
    // mirrors have these sizes).
    let ptr = "u64";
    let p = COPY_PARAMS_SIZES;
    let expected: &[(&str, &str, Vec<String>)] = &[
        ("cast", "cast", sig(&[ptr, "u32", ptr, "u32", "u64"])),
        ("copy", "copy_in", sig(&[ptr, &format!("b8[{}]", p.0)])),
        ("copy", "copy_out", sig(&[ptr, &format!("b8[{}]", p.1)])),
        ("ops", "scale", sig(&[ptr, "u64", "f32"])),
        (
            "ops",
            "scale_check_finite",
            sig(&[ptr, "u64", "f32", ptr, ptr]),
        ),
        ("ops", "non_finite", sig(&[ptr, "u64", ptr])),
        ("ops", "add", sig(&[ptr, ptr, "u32", "u64"])),
        ("ops", "sum_squares_partial", sig(&[ptr, "u64", ptr])),
        ("ops", "sum_squares_final", sig(&[ptr, "u32", ptr, "u32"])),
        (
            "optim",
            "adamw",
            sig(&[ptr, ptr, ptr, ptr, "u64", "b8[36]", "f32", ptr, ptr]),
        ),
        (
            "optim",
            "sgd",
            sig(&[ptr, ptr, ptr, "u64", "b8[24]", "f32", ptr, ptr]),
        ),
        (
            "optim",
            "update_scale",
            sig(&[ptr, ptr, ptr, ptr, "f32", "f32", "u32"]),
        ),
    ];
    for (module, function, want) in expected {
        let ptx = kernels::nvrtc::ptx(module).unwrap();
        let got = entry_params(&ptx, function)
            .unwrap_or_else(|| panic!("{module}.cu: no kernel {function} in the PTX"));
        assert_eq!(&got, want, "{module}::{function}: parameters");
    }
}

/// Byte sizes of `CopyInArgs` and `CopyOutArgs` (kernels/copy.cu and their Rust mirrors).
const COPY_PARAMS_SIZES: (usize, usize) = (
    32 + 40 * kernels::COPY_MAX_PARAMS,
    16 + 24 * kernels::COPY_MAX_PARAMS,
);

fn sig(s: &[&str]) -> Vec<String> {
    s.iter().map(|s| s.to_string()).collect()
}

// ---- helpers of the GPU tests --------------------------------------------------------------

fn gpu() -> Device {
    Device::new_cuda(crate::gpu()).expect("a CUDA device")
}

fn on(dev: &Device, v: &[f32]) -> Tensor {
    Tensor::from_vec(v.to_vec(), v.len(), &Device::Cpu)
        .unwrap()
        .to_device(dev)
        .unwrap()
}

fn host(t: &Tensor) -> Vec<f32> {
    t.to_device(&Device::Cpu).unwrap().to_vec1::<f32>().unwrap()
}

/// Bit-equal, or both NaN (a GPU returns the canonical NaN of an operation on NaN).
fn assert_same(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            "{what}: element {i}: got {a:e} ({:#010x}), want {b:e} ({:#010x})",
            a.to_bits(),
            b.to_bits()
        );
    }
}

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

/// Values at the conversions' edges (NaNs with payloads, infinities, ties, subnormals), then
/// random bit patterns, then random values: `n` in all.
fn edgy(rng: &mut StdRng, n: usize) -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0x7F80_0001),
        f32::from_bits(0xFFA0_1234),
        65504.0,
        65520.0,
        2f32.powi(-24),
        2f32.powi(-25),
        3.0 * 2f32.powi(-25),
        2f32.powi(-14) - 2f32.powi(-25),
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
        1.0 + 2f32.powi(-11),
        f32::from_bits(1),
        3.389_531_4e38,
    ];
    while v.len() < n / 2 {
        v.push(f32::from_bits(rng.random::<u32>()));
    }
    v.extend(random(rng, n.saturating_sub(v.len()), 100.0));
    v.truncate(n);
    v
}

/// The raw bits of a tensor's elements (f32: 32 bits; bf16/f16: 16).
fn raw(t: &Tensor) -> Vec<u32> {
    let t = t.to_device(&Device::Cpu).unwrap().flatten_all().unwrap();
    match t.dtype() {
        DType::F32 => t
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect(),
        DType::BF16 => t
            .to_vec1::<bf16>()
            .unwrap()
            .iter()
            .map(|x| x.to_raw())
            .collect(),
        DType::F16 => t
            .to_vec1::<f16>()
            .unwrap()
            .iter()
            .map(|x| x.to_raw())
            .collect(),
        d => panic!("unexpected {d:?}"),
    }
}

fn raw_of<T: KernelFloat>(v: &[T]) -> Vec<u32> {
    v.iter().map(|x| x.to_raw()).collect()
}

/// The reference cast of `src` (host f32 values already in dtype `s`) to `d`, as raw bits.
fn cast_ref(src: &Tensor, d: DType) -> Vec<u32> {
    let s = src.to_device(&Device::Cpu).unwrap();
    macro_rules! go {
        ($S:ty) => {{
            let v = s.to_vec1::<$S>().unwrap();
            match d {
                DType::F32 => raw_of(&kernels::cast_reference::<$S, f32>(&v)),
                DType::BF16 => raw_of(&kernels::cast_reference::<$S, bf16>(&v)),
                _ => raw_of(&kernels::cast_reference::<$S, f16>(&v)),
            }
        }};
    }
    match s.dtype() {
        DType::F32 => go!(f32),
        DType::BF16 => go!(bf16),
        _ => go!(f16),
    }
}

const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// A tensor of `v` in dtype `d` (converted on the CPU, with `half`), on `dev`.
fn typed(dev: &Device, v: &[f32], d: DType) -> Tensor {
    Tensor::from_vec(v.to_vec(), v.len(), &Device::Cpu)
        .unwrap()
        .to_dtype(d)
        .unwrap()
        .to_device(dev)
        .unwrap()
}

// ---- cast ----------------------------------------------------------------------------------

#[test]
#[ignore = "needs a GPU; scripts/gpu-check.sh runs it"]
fn cast_matches_its_reference_for_all_pairs() {
    let dev = gpu();
    let mut rng = StdRng::seed_from_u64(11);
    for &n in &SIZES {
        let v = edgy(&mut rng, n);
        for s in FLOATS {
            // Signalling NaNs survive in the source only where no conversion touched them: build
            // the source on the CPU from bits.
            let src = typed(&dev, &v, s);
            for d in FLOATS {
                let want = cast_ref(&src, d);
                let got = k::cast(&src, d, None).unwrap();
                assert_eq!(got.dtype(), d);
                assert_eq!(raw(&got), want, "cast {s:?} -> {d:?}, n {n}");
                let into = Tensor::zeros(n, d, &dev).unwrap();
                k::cast_into(&src, &into).unwrap();
                assert_eq!(raw(&into), want, "cast_into {s:?} -> {d:?}, n {n}");
                assert_eq!(raw(&ops::cast(&src, d).unwrap()), want, "ops::cast");
            }
        }
    }
    // A narrowed (offset) and a non-contiguous source.
    let v = random(&mut rng, 64, 3.0);
    let t = on(&dev, &v).reshape((8, 8)).unwrap();
    let part = t.narrow(0, 3, 2).unwrap();
    let got = k::cast(&part, DType::BF16, None).unwrap();
    assert_eq!(got.dims(), &[2, 8]);
    assert_eq!(raw(&got), cast_ref(&on(&dev, &v[24..40]), DType::BF16));
    let tr = t.t().unwrap();
    let got = k::cast(&tr, DType::F16, None).unwrap();
    let want = cast_ref(&tr.contiguous().unwrap().flatten_all().unwrap(), DType::F16);
    assert_eq!(raw(&got), want);
}

// ---- copy-in / copy-out --------------------------------------------------------------------

/// Layouts for the copy tests: the probe unit of tests/kernels.rs, 150 parameters of random
/// sizes (several launches of 64; some of 0 elements), and one large parameter between small
/// ones.
fn layouts(rng: &mut StdRng) -> Vec<FlatParamLayout> {
    let mut out = Vec::new();
    for ws in [1, 2, 3, 4] {
        let shapes: Vec<(String, candle_core::Shape)> =
            [vec![5usize], vec![3, 7], vec![1], vec![2], vec![9]]
                .into_iter()
                .enumerate()
                .map(|(i, s)| (format!("p{i}"), s.into()))
                .collect();
        out.push(FlatParamLayout::new(&shapes, ws).unwrap());
    }
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
    for ws in [1, 3, 8] {
        out.push(FlatParamLayout::new(&many, ws).unwrap());
    }
    let big: Vec<(String, candle_core::Shape)> = vec![
        ("a".into(), 7.into()),
        ("b".into(), ((1 << 20) + 3).into()),
        ("c".into(), 1025.into()),
    ];
    for ws in [1, 4] {
        out.push(FlatParamLayout::new(&big, ws).unwrap());
    }
    out
}

#[test]
#[ignore = "needs a GPU; scripts/gpu-check.sh runs it"]
fn copy_in_matches_its_reference() {
    let dev = gpu();
    let Device::Cuda(cdev) = &dev else {
        unreachable!()
    };
    let mut rng = StdRng::seed_from_u64(12);
    for layout in layouts(&mut rng) {
        // Gradients of mixed dtypes, some absent.
        let f = layout.params.len();
        let mut host_vals: Vec<Option<(DType, Vec<f32>)>> = Vec::with_capacity(f);
        for q in 0..f {
            // Parameters of 0 elements get no gradient here (a device tensor of 0 elements
            // would ask the driver for an empty allocation).
            if q % 4 == 3 || layout.params[q].numel == 0 {
                host_vals.push(None);
            } else {
                let d = FLOATS[rng.random_range(0..3)];
                host_vals.push(Some((d, edgy(&mut rng, layout.params[q].numel))));
            }
        }
        let grads: Vec<Option<Tensor>> = host_vals
            .iter()
            .zip(&layout.params)
            .map(|(h, p)| {
                h.as_ref()
                    .map(|(d, v)| typed(&dev, v, *d).reshape(p.shape.clone()).unwrap())
            })
            .collect();
        // The reference sees the gradients as the GPU holds them (converted with half).
        let host_typed: Vec<Option<FloatVec>> = grads
            .iter()
            .map(|g| g.as_ref().map(|g| FloatVec::from_tensor(g).unwrap()))
            .collect();
        let floats: Vec<Option<Floats<'_>>> = host_typed
            .iter()
            .map(|h| h.as_ref().map(FloatVec::as_floats))
            .collect();
        let refs: Vec<Option<&Tensor>> = grads.iter().map(Option::as_ref).collect();
        for reduce in FLOATS {
            let want = match reduce {
                DType::F32 => raw_of(
                    &kernels::copy_in_reference::<f32>(&layout.copy_layout(), &floats).unwrap(),
                ),
                DType::BF16 => raw_of(
                    &kernels::copy_in_reference::<bf16>(&layout.copy_layout(), &floats).unwrap(),
                ),
                _ => raw_of(
                    &kernels::copy_in_reference::<f16>(&layout.copy_layout(), &floats).unwrap(),
                ),
            };
            let got = k::copy_in(&layout, &refs, reduce, cdev, None)
                .unwrap()
                .unwrap();
            assert_eq!(got.dtype(), reduce);
            assert_eq!(
                raw(&got),
                want,
                "copy_in: {f} params, ws {}, reduce {reduce:?}",
                layout.world_size
            );
        }
        // Fewer gradients than parameters: the rest are absent.
        let short = &refs[..f / 2];
        let mut floats_short = floats.clone();
        floats_short.truncate(f / 2);
        let want = raw_of(
            &kernels::copy_in_reference::<f32>(&layout.copy_layout(), &floats_short).unwrap(),
        );
        let got = k::copy_in(&layout, short, DType::F32, cdev, None)
            .unwrap()
            .unwrap();
        assert_eq!(raw(&got), want, "copy_in with a short gradient list");
    }
    // A non-contiguous gradient (transposed) is copied as its row-major values.
    let layout = FlatParamLayout::new(&[("w".into(), (4, 6).into())], 2).unwrap();
    let v = random(&mut rng, 24, 1.0);
    let g = on(&dev, &v).reshape((6, 4)).unwrap().t().unwrap();
    let row_major = host(&g.contiguous().unwrap().flatten_all().unwrap());
    let want = raw_of(
        &kernels::copy_in_reference::<f32>(&layout.copy_layout(), &[Some(Floats::F32(&row_major))])
            .unwrap(),
    );
    let got = k::copy_in(&layout, &[Some(&g)], DType::F32, cdev, None)
        .unwrap()
        .unwrap();
    assert_eq!(raw(&got), want);
    // Wrong element count: an error naming the parameter.
    let bad = on(&dev, &[1.0; 5]);
    let e = k::copy_in(&layout, &[Some(&bad)], DType::F32, cdev, None).unwrap_err();
    assert!(e.to_string().contains("gradient of w"), "{e}");
}

#[test]
#[ignore = "needs a GPU; scripts/gpu-check.sh runs it"]
fn copy_out_matches_its_reference() {
    let dev = gpu();
    let mut rng = StdRng::seed_from_u64(13);
    for layout in layouts(&mut rng) {
        let flat_vals = edgy(&mut rng, layout.padded_numel);
        for s in FLOATS {
            let flat = typed(&dev, &flat_vals, s);
            let flat_host = flat.to_device(&Device::Cpu).unwrap();
            for d in FLOATS {
                macro_rules! want {
                    ($S:ty) => {{
                        let v = flat_host.to_vec1::<$S>().unwrap();
                        match d {
                            DType::F32 => kernels::copy_out_reference::<$S, f32>(
                                &layout.copy_layout().spans,
                                &v,
                            )
                            .iter()
                            .map(|p| raw_of(p))
                            .collect::<Vec<_>>(),
                            DType::BF16 => kernels::copy_out_reference::<$S, bf16>(
                                &layout.copy_layout().spans,
                                &v,
                            )
                            .iter()
                            .map(|p| raw_of(p))
                            .collect(),
                            _ => kernels::copy_out_reference::<$S, f16>(
                                &layout.copy_layout().spans,
                                &v,
                            )
                            .iter()
                            .map(|p| raw_of(p))
                            .collect(),
                        }
                    }};
                }
                let want: Vec<Vec<u32>> = match s {
                    DType::F32 => want!(f32),
                    DType::BF16 => want!(bf16),
                    _ => want!(f16),
                };
                for is_variable in [false, true] {
                    let got = k::copy_out(&layout, &flat, d, is_variable, None).unwrap();
                    assert_eq!(got.len(), layout.params.len());
                    for ((t, p), w) in got.iter().zip(&layout.params).zip(&want) {
                        assert_eq!(t.shape(), &p.shape, "{}", p.name);
                        assert_eq!(t.dtype(), d);
                        assert!(t.is_contiguous());
                        assert_eq!(&raw(t), w, "copy_out {s:?} -> {d:?}: {}", p.name);
                    }
                }
            }
        }
    }
}

// ---- ops -----------------------------------------------------------------------------------

#[test]
#[ignore = "needs a GPU; scripts/gpu-check.sh runs it"]
fn elementwise_kernels_match_their_references() {
    let dev = gpu();
    let mut rng = StdRng::seed_from_u64(14);
    for &n in &SIZES {
        let x0 = random(&mut rng, n, 1e3);
        // scale_: a narrowed view (start offset) of a larger tensor, as the optimizers pass.
        let big = on(&dev, &[vec![7.0; 3], x0.clone(), vec![9.0; 2]].concat());
        let view = big.narrow(0, 3, n).unwrap();
        ops::scale_(&view, 0.37).unwrap();
        let mut r = x0.clone();
        kernels::scale_reference(&mut r, 0.37);
        assert_same(&host(&view), &r, "scale_");
        let all = host(&big);
        assert_eq!(
            (&all[..3], &all[3 + n..]),
            (&[7.0; 3][..], &[9.0; 2][..]),
            "outside the view"
        );
        // ops::scale_ dispatches to the same kernel.
        let t = on(&dev, &x0);
        ops::scale_(&t, 0.37).unwrap();
        assert_same(&host(&t), &r, "ops::scale_");
        // scale_check_finite_: clean, overflow by scaling, NaN; host and device factors.
        for (extra, s) in [(None, 0.5f32), (Some(3e38f32), 4.0), (Some(f32::NAN), 1.0)] {
            let mut x = x0.clone();
            if let Some(e) = extra {
                x[n / 2] = e;
            }
            let mut r = x.clone();
            let mut want_flag = 0.0f32;
            kernels::scale_check_finite_reference(&mut r, s, &mut want_flag);
            for factor_on_device in [false, true] {
                let t = on(&dev, &x);
                let flag = Tensor::zeros(1, DType::F32, &dev).unwrap();
                let fac = on(&dev, &[s]);
                let factor = if factor_on_device {
                    ScaleFactor::Device(&fac)
                } else {
                    ScaleFactor::Value(s)
                };
                ops::unscale_check_finite_(&t, factor, &flag).unwrap();
                assert_same(&host(&t), &r, "scale_check_finite_");
                assert_eq!(host(&flag), vec![want_flag], "flag, extra {extra:?}");
            }
            // The flag accumulates (never cleared by a clean call).
            let flag = on(&dev, &[1.0]);
            ops::unscale_check_finite_(&on(&dev, &x0), ScaleFactor::Value(1.0), &flag).unwrap();
            assert_eq!(host(&flag), vec![1.0]);
            // The host-answer forms.
            let t = on(&dev, &x);
            assert_eq!(
                ops::scale_and_check_finite_(&t, s).unwrap(),
                want_flag == 0.0
            );
            assert_same(&host(&t), &r, "ops::scale_and_check_finite_");
            let mut nf = 0.0f32;
            kernels::non_finite_reference(&r, &mut nf);
            let flag = Tensor::zeros(1, DType::F32, &dev).unwrap();
            ops::check_finite_(&on(&dev, &r), &flag).unwrap();
            assert_eq!(host(&flag), vec![nf]);
            assert_eq!(ops::all_finite(&on(&dev, &r)).unwrap(), nf == 0.0);
        }
        // add_ from each dtype.
        let src = random(&mut rng, n, 10.0);
        for d in FLOATS {
            let s = typed(&dev, &src, d);
            let sh = s.to_device(&Device::Cpu).unwrap();
            let (vb, vh): (Vec<bf16>, Vec<f16>) = match d {
                DType::BF16 => (sh.to_vec1().unwrap(), vec![]),
                DType::F16 => (vec![], sh.to_vec1().unwrap()),
                _ => (vec![], vec![]),
            };
            let floats = match d {
                DType::BF16 => Floats::BF16(&vb),
                DType::F16 => Floats::F16(&vh),
                _ => Floats::F32(&src),
            };
            let mut r = x0.clone();
            kernels::add_reference(&mut r, floats);
            let dst = on(&dev, &x0);
            ops::add_(&dst, &s).unwrap();
            assert_same(&host(&dst), &r, &format!("add_ from {d:?}"));
            let dst = on(&dev, &x0);
            ops::add_(&dst, &s).unwrap();
            assert_same(&host(&dst), &r, "ops::add_");
        }
        // sum of squares: bit for bit with the tree-order reference; accumulation on device.
        let x = random(&mut rng, n, 3.0);
        let want = kernels::sum_squares_reference(&x);
        let acc = Tensor::zeros(1, DType::F64, &dev).unwrap();
        k::sum_squares_into(&on(&dev, &x), &acc, false).unwrap();
        let got = acc
            .to_device(&Device::Cpu)
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()[0];
        assert_eq!(
            got.to_bits(),
            want.to_bits(),
            "sum_squares n {n}: {got} vs {want}"
        );
        k::sum_squares_into(&on(&dev, &x), &acc, true).unwrap();
        let twice = acc
            .to_device(&Device::Cpu)
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()[0];
        assert_eq!(twice, want + want);
        assert_eq!(
            ops::sum_squares(&on(&dev, &x)).unwrap().to_bits(),
            want.to_bits()
        );
    }
}

// ---- optimizers ----------------------------------------------------------------------------

#[test]
#[ignore = "needs a GPU; scripts/gpu-check.sh runs it"]
fn adamw_matches_its_reference_bit_for_bit_and_skips_on_found_inf() {
    let dev = gpu();
    let mut rng = StdRng::seed_from_u64(15);
    for &n in &SIZES {
        for (wd, inv) in [(0.0, 1.0f32), (0.01, 1.0 / 1024.0)] {
            for device_scalars in [false, true] {
                let p0 = random(&mut rng, n, 1.0);
                // Narrowed views of larger tensors (the optimizer's per-parameter ranges).
                let pad = |v: &[f32]| on(&dev, &[vec![0.5; 2], v.to_vec(), vec![0.25; 5]].concat());
                let (pb, mb, vb) = (pad(&p0), pad(&vec![0.0; n]), pad(&vec![0.0; n]));
                let view = |t: &Tensor| t.narrow(0, 2, n).unwrap();
                let (p, m, v) = (view(&pb), view(&mb), view(&vb));
                let (mut rp, mut rm, mut rv) = (p0.clone(), vec![0.0f32; n], vec![0.0f32; n]);
                let found = Tensor::zeros(1, DType::F32, &dev).unwrap();
                let inv_t = on(&dev, &[inv]);
                for t in 1..=3 {
                    let h = adamw_hyper(1e-3, wd, t);
                    let g0 = random(&mut rng, n, 100.0);
                    let g = on(&dev, &g0);
                    let u = if device_scalars {
                        Unscale {
                            inv_scale: ScaleFactor::Device(&inv_t),
                            found_inf: Some(&found),
                        }
                    } else {
                        Unscale {
                            inv_scale: ScaleFactor::Value(inv),
                            found_inf: None,
                        }
                    };
                    if t == 2 && inv == 1.0 && !device_scalars {
                        // The plain entry point dispatches to the same kernel.
                        ops::adamw_step(&p, &g, &m, &v, &h).unwrap();
                    } else {
                        ops::adamw_step_fused(&p, &g, &m, &v, &h, &u).unwrap();
                    }
                    kernels::adamw_reference(
                        &mut rp,
                        &g0,
                        &mut rm,
                        &mut rv,
                        &(&h).into(),
                        inv,
                        0.0,
                    );
                    let what = format!("adamw n {n} wd {wd} inv {inv} t {t}");
                    assert_same(&host(&p), &rp, &what);
                    assert_same(&host(&m), &rm, &what);
                    assert_same(&host(&v), &rv, &what);
                    assert_eq!(host(&g), g0, "the gradient is read only");
                }
                let all = host(&pb);
                assert_eq!((&all[..2], &all[2 + n..]), (&[0.5; 2][..], &[0.25; 5][..]));
                // An inf in the gradient: the check sets the flag on the device and the step
                // that reads it changes nothing.
                let mut g0 = random(&mut rng, n, 1.0);
                g0[n - 1] = f32::INFINITY;
                let g = on(&dev, &g0);
                let found = Tensor::zeros(1, DType::F32, &dev).unwrap();
                ops::unscale_check_finite_(&g, ScaleFactor::Value(inv), &found).unwrap();
                let before = (host(&p), host(&m), host(&v));
                let u = Unscale {
                    inv_scale: ScaleFactor::Value(1.0),
                    found_inf: Some(&found),
                };
                ops::adamw_step_fused(&p, &g, &m, &v, &adamw_hyper(1e-3, wd, 4), &u).unwrap();
                assert_eq!(
                    (host(&p), host(&m), host(&v)),
                    before,
                    "skipped on found_inf"
                );
                assert_eq!(host(&found), vec![1.0]);
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU; scripts/gpu-check.sh runs it"]
fn sgd_matches_its_reference_bit_for_bit_and_skips_on_found_inf() {
    let dev = gpu();
    let mut rng = StdRng::seed_from_u64(16);
    for &n in &SIZES {
        for momentum in [0.0f32, 0.9] {
            for nesterov in [false, true] {
                if nesterov && momentum == 0.0 {
                    continue;
                }
                for (wd, damp, inv) in [(0.0, 0.0, 1.0f32), (1e-2, 0.1, 0.125)] {
                    let p0 = random(&mut rng, n, 1.0);
                    let (p, b) = (on(&dev, &p0), Tensor::zeros(n, DType::F32, &dev).unwrap());
                    let (mut rp, mut rb) = (p0.clone(), vec![0.0f32; n]);
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
                        let buf = (momentum != 0.0).then_some(&b);
                        let zero = Tensor::zeros(1, DType::F32, &dev).unwrap();
                        let u = Unscale {
                            inv_scale: ScaleFactor::Value(inv),
                            found_inf: Some(&zero),
                        };
                        if inv == 1.0 && step == 1 {
                            ops::sgd_step(&p, &on(&dev, &g0), buf, &h).unwrap();
                        } else {
                            ops::sgd_step_fused(&p, &on(&dev, &g0), buf, &h, &u).unwrap();
                        }
                        let rbuf = (momentum != 0.0).then_some(&mut rb[..]);
                        kernels::sgd_reference(&mut rp, &g0, rbuf, &(&h).into(), inv, 0.0);
                        let what =
                            format!("sgd n {n} mu {momentum} nesterov {nesterov} step {step}");
                        assert_same(&host(&p), &rp, &what);
                        if momentum != 0.0 {
                            assert_same(&host(&b), &rb, &what);
                        }
                    }
                    let before = (host(&p), host(&b));
                    let one = on(&dev, &[1.0]);
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
                        found_inf: Some(&one),
                    };
                    let g = on(&dev, &vec![1.0; n]);
                    ops::sgd_step_fused(&p, &g, (momentum != 0.0).then_some(&b), &h, &u).unwrap();
                    assert_eq!((host(&p), host(&b)), before, "skipped on found_inf");
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU; scripts/gpu-check.sh runs it"]
fn update_scale_matches_its_reference() {
    let dev = gpu();
    let pattern = [
        false, false, false, true, false, true, true, false, false, false,
    ];
    let scale = on(&dev, &[1024.0]);
    let tracker = Tensor::zeros(1, DType::U32, &dev).unwrap();
    let inv = Tensor::zeros(1, DType::F32, &dev).unwrap();
    let (mut rs, mut rt) = (1024.0f32, 0u32);
    for (k_, &inf) in pattern.iter().enumerate() {
        let flag = on(&dev, &[if inf { 1.0 } else { 0.0 }]);
        let with_inv = k_ % 2 == 0;
        k::update_scale_(
            &scale,
            &tracker,
            &flag,
            with_inv.then_some(&inv),
            2.0,
            0.5,
            2,
        )
        .unwrap();
        let want_inv = kernels::update_scale_reference(
            &mut rs,
            &mut rt,
            if inf { 1.0 } else { 0.0 },
            2.0,
            0.5,
            2,
        );
        assert_eq!(host(&scale), vec![rs], "step {k_}");
        let t = tracker
            .to_device(&Device::Cpu)
            .unwrap()
            .to_vec1::<u32>()
            .unwrap();
        assert_eq!(t, vec![rt], "step {k_}");
        if with_inv {
            assert_eq!(host(&inv)[0].to_bits(), want_inv.to_bits());
        }
    }
}
