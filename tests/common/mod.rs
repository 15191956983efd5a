//! Shared pieces of the integration tests: a small model made of candle-nn constructors, its
//! plain single-process reference, and comparison helpers.
#![allow(dead_code)]

use candle_core::{DType, Device, Module, Tensor};
use candle_fsdp::ops::AdamWHyper;
use candle_fsdp::unit::UnitSpec;
use candle_nn::{Activation, Init, VarBuilder};
use rand::{Rng, SeedableRng};

/// Prints `rank {rank}: error: {message}` to stderr in one `write` call, the message without
/// Candle's stack traces ([`candle_fsdp::Error::message`]). A rank process of a multi-process
/// test shares its output pipe with the others; a line shorter than `PIPE_BUF` (4096 bytes)
/// written at once is never split by theirs, where `eprintln!` writes piece by piece.
pub fn report_rank_error(rank: usize, e: &candle_fsdp::Error) {
    eprint_line(&format!("rank {rank}: error: {}", e.message()));
}

/// Writes `line` and a newline to stderr in one `write` call (see [`report_rank_error`]).
pub fn eprint_line(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr()
        .lock()
        .write_all(format!("{line}\n").as_bytes());
}

/// A TCP port on 127.0.0.1 that nothing listens on now, for a test's store or backend to bind
/// later, chosen *below* the kernel's ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`).
///
/// The usual `bind(":0")`-then-close hands out a port from that range, which the kernel gives
/// again to any socket of the machine that binds port 0 or connects out meanwhile: a test that
/// binds its port a while later (a server started after its clients) then failed now and then
/// with "Address already in use" while the other tests of its binary opened connections. A port
/// outside the range is only ever taken by an explicit bind; candidates are spread by process
/// id and a per-process counter, and each is checked free by binding it.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768)
        .clamp(2048, 65535);
    let (base, span) = (1024u32, low - 1024);
    let seed = std::process::id().wrapping_mul(7919);
    for _ in 0..1000 {
        let k = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = (base + (seed.wrapping_add(k.wrapping_mul(104_729)) % span)) as u16;
        if std::net::TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port below the ephemeral range {low} after 1000 tries")
}

/// A module with one learnable scalar that multiplies its input (numel 1: smaller than any
/// world size above 1, so most ranks hold only padding).
pub struct Scale {
    w: Tensor,
}

impl Module for Scale {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        xs.broadcast_mul(&self.w)
    }
}

pub fn scale(vb: VarBuilder) -> candle_core::Result<Scale> {
    Ok(Scale {
        w: vb.get_with_hints(1, "w", Init::Const(1.0))?,
    })
}

pub const IN: (usize, usize) = (4, 5);
pub const CLASSES: usize = 3;

/// flatten (no parameters) → fc1 + ReLU → fc2 + ReLU → head → scale.
pub fn units() -> Vec<UnitSpec> {
    vec![
        UnitSpec::new("flatten", |_vb| Ok(candle_nn::func(|x| x.flatten_from(1)))),
        UnitSpec::new("fc1", |vb| {
            Ok(candle_nn::seq()
                .add(candle_nn::linear(20, 13, vb)?)
                .add(Activation::Relu))
        }),
        UnitSpec::new("fc2", |vb| {
            Ok(candle_nn::seq()
                .add(candle_nn::linear(13, 7, vb)?)
                .add(Activation::Relu))
        }),
        UnitSpec::new("head", |vb| candle_nn::linear(7, CLASSES, vb)),
        UnitSpec::new("scale", scale),
    ]
}

/// The same units built as a plain Candle model from `vb`.
pub fn reference_model(
    vb: VarBuilder,
) -> candle_core::Result<Vec<Box<dyn candle_fsdp::unit::UnitModule>>> {
    units().iter().map(|u| (u.ctor)(vb.pp(&u.name))).collect()
}

pub fn reference_forward(
    model: &[Box<dyn candle_fsdp::unit::UnitModule>],
    x: &Tensor,
) -> candle_core::Result<Tensor> {
    let mut h = x.clone();
    for m in model {
        h = m.forward1(&h, true)?;
    }
    Ok(h)
}

/// Deterministic global batches: `steps` of (x: (global_batch, 4, 5) f32, y: (global_batch,) u32).
pub fn batches(steps: usize, global_batch: usize, seed: u64) -> Vec<(Tensor, Tensor)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..steps)
        .map(|_| {
            let x: Vec<f32> = (0..global_batch * IN.0 * IN.1)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let y: Vec<u32> = (0..global_batch)
                .map(|_| rng.random_range(0..CLASSES as u32))
                .collect();
            (
                Tensor::from_vec(x, (global_batch, IN.0, IN.1), &Device::Cpu).unwrap(),
                Tensor::from_vec(y, global_batch, &Device::Cpu).unwrap(),
            )
        })
        .collect()
}

/// ||a - b|| / max(||b||, tiny).
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>().sqrt();
    num / den.max(1e-30)
}

pub fn to_vec(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// A fresh path under the temp dir, unique to this process and thread, removed if it existed
/// (not created).
pub fn tmpdir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!(
        "candle-fsdp-{tag}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A unit with a buffer (a name ending in `running_mean`): subtracts it from its input. The
/// buffer comes in its own `buffer_dtype` (the runtime never serves a converted copy), so it
/// is converted to the input's dtype here.
pub struct Shift {
    running_mean: Tensor,
}

impl Module for Shift {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        xs.broadcast_sub(&self.running_mean.to_dtype(xs.dtype())?)
    }
}

pub fn shift(vb: VarBuilder) -> candle_core::Result<Shift> {
    Ok(Shift {
        running_mean: vb.get_with_hints(7, "running_mean", Init::Const(0.0))?,
    })
}

/// The common test units with a buffer unit (`shift`) after fc2.
pub fn units_with_buffer() -> Vec<UnitSpec> {
    let mut u = units();
    u.insert(3, UnitSpec::new("shift", shift));
    u
}

/// The full name libtest gives test `name` of the module at `module_path` (pass
/// `module_path!()`): the path without the test binary's crate name
/// (`store::helper_store_rank`), what `--exact` matches when a test re-runs its own binary.
pub fn test_path(module_path: &str, name: &str) -> String {
    match module_path.split_once("::") {
        Some((_, module)) => format!("{module}::{name}"),
        None => name.to_string(),
    }
}

/// The example `name` as `cargo test` builds it next to this test binary
/// (`target/<profile>/examples/<name>`); panics naming `build` (the command that builds it)
/// when it is missing.
pub fn example_bin(name: &str, build: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .and_then(std::path::Path::parent)
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        bin.is_file(),
        "{} is missing: run `{build}` first",
        bin.display()
    );
    bin
}

/// The `final test accuracy …` line of an MNIST example's output (after any `[rank r] `).
pub fn final_accuracy(out: &str) -> String {
    out.lines()
        .find_map(|l| l.find("final test accuracy").map(|i| l[i..].to_string()))
        .unwrap_or_else(|| panic!("no final accuracy in:\n{out}"))
}

/// AdamW constants as `optim::AdamWConfig::hyper` computes them (f64, rounded once).
pub fn adamw_hyper(lr: f64, wd: f64, t: i32) -> AdamWHyper {
    let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8f64);
    AdamWHyper {
        beta1: b1 as f32,
        beta2: b2 as f32,
        one_minus_beta1: (1.0 - b1) as f32,
        one_minus_beta2: (1.0 - b2) as f32,
        bias_correction1: (1.0 / (1.0 - b1.powi(t))) as f32,
        bias_correction2: (1.0 / (1.0 - b2.powi(t))) as f32,
        decay: (1.0 - lr * wd) as f32,
        lr: lr as f32,
        eps: eps as f32,
    }
}
