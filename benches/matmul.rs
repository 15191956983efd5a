//! f32 matmul throughput of the GPT benchmark step's shapes through Candle's CPU matmul (the
//! `gemm` crate, AVX-512 kernels with its `x86-v4` feature), on every core
//! (`RAYON_NUM_THREADS` unset) or as set. The physical limit these are measured against, and
//! the same shapes in PyTorch (`benches/pytorch/matmul.py`), are in BENCHMARKS.md.
//!
//! `cargo bench --bench matmul`: two lines per shape and orientation, GFLOP/s = 2·m·n·k / time,
//! for the best of 5 rounds of 5 products and for the mean of all 25 (after one warm-up
//! product): `candle`, Candle's `Tensor::matmul` (the `gemm` crate), and `kernel`, the crate's
//! own products (`candle_fsdp::nn::kernels::matmul`, on the kernel `matmul_kernel()` names:
//! the crate's AVX2 kernel without AVX-512, `gemm` with it; `FSDP_MATMUL=avx2|gemm` forces one).
//!
//! `MATMUL_SHAPES=llama` times the Llama bench block's projections instead (the families'
//! step, BENCHMARKS §2).
//!
//! `MATMUL_MODE=cold` writes 64 MiB of other memory before each product (its operands leave
//! the caches, as in a training step, where a product's operands were last touched many ops
//! earlier); `sleep` waits 3 ms before each (the pool's threads fall asleep); `coldsleep` both.

use std::time::Instant;

use candle_core::{Device, Tensor};
use candle_fsdp::nn::kernels::{matmul, matmul_kernel, Mat};

#[path = "../examples/common/alloc.rs"]
mod alloc;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `(m, k, n)`: the products of one Llama bench block at batch 4 × 256 (BENCHMARKS §2: d 512,
/// 8 + 2 + 2 heads of 64, SwiGLU 1408; forward `x · Wᵀ` of qkv, o, gate-up and down), with
/// `MATMUL_SHAPES=llama`.
const LLAMA: [(usize, usize, usize); 4] = [
    (1024, 512, 768),
    (1024, 512, 512),
    (1024, 512, 2816),
    (1024, 1408, 512),
];

/// `(m, k, n)`: the products of one GPT block at batch 4 × 256 (forward `x · Wᵀ` of qkv, fc,
/// the MLP projection; backward `g · W` and `gᵀ · x`), and a square one.
const SHAPES: [(usize, usize, usize); 6] = [
    (1024, 512, 1536),
    (1024, 512, 2048),
    (1024, 2048, 512),
    (512, 1024, 2048),
    (2048, 1024, 512),
    (1024, 1024, 1024),
];

fn main() -> candle_core::Result<()> {
    alloc::keep_freed_memory();
    println!(
        "threads {} (RAYON_NUM_THREADS or all cores); kernel {:?}",
        candle_core::utils::get_num_threads(),
        matmul_kernel()
    );
    let mut flush = vec![0f32; 16 << 20];
    let shapes: &[(usize, usize, usize)] = match std::env::var("MATMUL_SHAPES").as_deref() {
        Ok("llama") => &LLAMA,
        _ => &SHAPES,
    };
    for &(m, k, n) in shapes {
        let a = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?;
        let b = Tensor::randn(0f32, 1.0, (k, n), &Device::Cpu)?;
        // The backward's transposed operand, as a strided view (no copy).
        let bt = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?;
        // The weight gradient's transposed lhs, as a strided view.
        let at = Tensor::randn(0f32, 1.0, (k, m), &Device::Cpu)?.t()?;
        for (name, lhs, rhs) in [
            ("a·b", &a, b),
            ("a·bᵀ", &a, bt.t()?),
            ("aᵀ·b", &at, Tensor::randn(0f32, 1.0, (k, n), &Device::Cpu)?),
        ] {
            let flop = 2.0 * (m * n * k) as f64;
            let (best, mean) = time(&mut flush, || {
                std::hint::black_box(lhs.matmul(&rhs).unwrap());
            });
            report(m, k, n, name, "candle", best, mean, flop);
            // The same product through the crate's kernel, on the same (strided) operands.
            let (lv, rv) = (view(lhs)?, view(&rhs)?);
            let (lm, rm) = (mat(&lv.0, lhs, lv.1), mat(&rv.0, &rhs, rv.1));
            let mut dst = vec![0f32; m * n];
            let (best, mean) = time(&mut flush, || {
                matmul(&mut dst, n, false, lm, rm);
                std::hint::black_box(&dst);
            });
            report(m, k, n, name, "kernel", best, mean, flop);
        }
    }
    Ok(())
}

/// The best round of five products and the mean of all 25, each timed alone, after one
/// warm-up: the kernel's rate, and what a step pays on average when products run back to back.
fn time(flush: &mut [f32], mut f: impl FnMut()) -> (f64, f64) {
    f();
    let mut best = f64::INFINITY;
    let mut total = 0.0;
    for _ in 0..5 {
        let mut round = 0.0;
        for _ in 0..5 {
            surroundings(flush);
            let t = Instant::now();
            f();
            round += t.elapsed().as_secs_f64();
        }
        best = best.min(round / 5.0);
        total += round;
    }
    (best, total / 25.0)
}

#[allow(clippy::too_many_arguments)]
fn report(m: usize, k: usize, n: usize, name: &str, who: &str, best: f64, mean: f64, flop: f64) {
    println!(
        "{m:5} × {k:5} × {n:5}  {name:5}  {who:6}  best {:7.3} ms {:6.1} GFLOP/s  mean {:7.3} ms \
         {:6.1} GFLOP/s",
        best * 1e3,
        flop / best / 1e9,
        mean * 1e3,
        flop / mean / 1e9
    );
}

/// A 2-D tensor's storage and the offset of its first element, for a [`Mat`] over it.
fn view(t: &Tensor) -> candle_core::Result<(Vec<f32>, usize)> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(s) => Ok((s.as_slice::<f32>()?.to_vec(), layout.start_offset())),
        _ => candle_core::bail!("a CPU tensor"),
    }
}

/// `t`'s strided view over `data` (its storage, copied once outside the timing).
fn mat<'a>(data: &'a [f32], t: &Tensor, offset: usize) -> Mat<'a> {
    let (rows, cols) = t.dims2().unwrap();
    let s = t.stride();
    Mat {
        data: &data[offset..],
        rows,
        cols,
        rs: s[0],
        cs: s[1],
    }
}

/// What runs between two timed products, as `MATMUL_MODE` says (see the file's documentation).
fn surroundings(flush: &mut [f32]) {
    let mode = std::env::var("MATMUL_MODE").unwrap_or_default();
    if mode.contains("cold") {
        for (i, v) in flush.iter_mut().enumerate() {
            *v += i as f32;
        }
        std::hint::black_box(&flush);
    }
    if mode.contains("sleep") {
        std::thread::sleep(std::time::Duration::from_millis(3));
    }
}
