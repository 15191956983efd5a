//! Where a GPT step's time goes, op by op: each op of one block of the GPT benchmark
//! configuration (batch 4 × 256 tokens, d 512, 8 heads, f32) timed alone, forward and forward +
//! backward, for this crate's fused op next to the composed Candle ops it replaces. The
//! backward is `loss.backward()` of `loss = Σ y ⊙ g` for a fixed random `g`, so each line also
//! pays Candle's gradient accumulation for the op's inputs (a zero-filled tensor and an add per
//! input), as a training step does; the `sum(x ⊙ g)` line is that harness alone.
//!
//! `cargo bench --bench gpt_ops` (all cores) or `RAYON_NUM_THREADS=1 cargo bench --bench
//! gpt_ops` (one core, as each rank at world size 2 on 2 cores). Median of 15 runs after 3
//! warm-ups, in ms; BENCHMARKS.md has the table and the per-step totals.

use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use candle_fsdp::nn;

#[path = "../examples/common/alloc.rs"]
mod alloc;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const B: usize = 4;
const T: usize = 256;
const D: usize = 512;
const H: usize = 8;
const V: usize = 256;

fn median_ms(mut f: impl FnMut() -> candle_core::Result<()>) -> candle_core::Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    let mut t = Vec::new();
    for _ in 0..15 {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64() * 1e3);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

type Op<'a> = Box<dyn Fn(&[Tensor]) -> candle_core::Result<Tensor> + 'a>;

/// Forward, and forward + backward through `Σ y ⊙ g`, of `op` on `inputs` (each a `Var`).
fn row(name: &str, inputs: &[Tensor], op: Op) -> candle_core::Result<(f64, f64)> {
    if let Ok(only) = std::env::var("GPT_OPS_ONLY") {
        if !name.contains(&only) {
            return Ok((0.0, 0.0));
        }
    }
    let vars: Vec<Var> = inputs
        .iter()
        .map(Var::from_tensor)
        .collect::<candle_core::Result<_>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = op(&ts)?;
    let g = Tensor::randn(0f32, 1.0, y.shape(), &Device::Cpu)?.to_dtype(y.dtype())?;
    let fwd = median_ms(|| op(&ts).map(|_| ()))?;
    let both = median_ms(|| {
        let y = op(&ts)?;
        (y * &g)?.sum_all()?.backward().map(|_| ())
    })?;
    println!("{name:44} {fwd:8.2} {both:10.2} {:8.2}", both - fwd);
    Ok((fwd, both))
}

fn randn(shape: &[usize]) -> candle_core::Result<Tensor> {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu)
}

fn main() -> candle_core::Result<()> {
    alloc::keep_freed_memory();
    println!(
        "GPT block ops at B {B}, T {T}, d {D}, {H} heads, f32, {} thread(s)",
        candle_core::utils::get_num_threads()
    );
    println!("{:44} {:>8} {:>10} {:>8}", "op", "fwd ms", "fwd+bwd", "bwd");
    let x = randn(&[B, T, D])?;
    let qkv = (randn(&[B, T, 3 * D])? * 0.5)?;
    let hidden = randn(&[B, T, 4 * D])?;
    let w = |o: usize, i: usize| randn(&[o, i])? * 0.02;
    let b = |o: usize| randn(&[o]);
    row(
        "harness: sum(x ⊙ g)",
        std::slice::from_ref(&x),
        Box::new(|t| Ok(t[0].clone())),
    )?;
    for (name, o, i, inp) in [
        ("linear qkv (d → 3d)", 3 * D, D, &x),
        ("linear fc (d → 4d)", 4 * D, D, &x),
        ("linear proj (4d → d)", D, 4 * D, &hidden),
    ] {
        let args = [inp.clone(), w(o, i)?, b(o)?];
        row(
            &format!("{name}: nn::linear_forward"),
            &args,
            Box::new(|t| nn::linear_forward(&t[0], &t[1], Some(&t[2]))),
        )?;
        row(
            &format!("{name}: candle_nn::Linear"),
            &args,
            Box::new(|t| {
                candle_core::Module::forward(
                    &candle_nn::Linear::new(t[1].clone(), Some(t[2].clone())),
                    &t[0],
                )
            }),
        )?;
    }
    row(
        "attention: nn::causal_attention",
        std::slice::from_ref(&qkv),
        Box::new(|t| nn::causal_attention(&t[0], H)),
    )?;
    row(
        "attention: composed (split, QKᵀ, softmax, ·V)",
        std::slice::from_ref(&qkv),
        Box::new(|t| nn::causal_attention_composed(&t[0], H)),
    )?;
    row(
        "gelu: nn::gelu",
        std::slice::from_ref(&hidden),
        Box::new(|t| nn::gelu(&t[0])),
    )?;
    row(
        "gelu: Tensor::gelu",
        std::slice::from_ref(&hidden),
        Box::new(|t| nn::gelu_composed(&t[0])),
    )?;
    let ln_w = Tensor::ones(D, DType::F32, &Device::Cpu)?;
    let ln_b = Tensor::zeros(D, DType::F32, &Device::Cpu)?;
    let ln = nn::LayerNorm::new(ln_w, ln_b, 1e-5);
    row(
        "layer norm: nn::LayerNorm",
        std::slice::from_ref(&x),
        Box::new(|t| candle_core::Module::forward(&ln, &t[0])),
    )?;
    row(
        "residual add",
        &[x.clone(), x.clone()],
        Box::new(|t| &t[0] + &t[1]),
    )?;
    let logits = randn(&[B * T, V])?;
    let targets = Tensor::from_vec(
        (0..B * T).map(|i| (i * 37 % V) as u32).collect::<Vec<_>>(),
        B * T,
        &Device::Cpu,
    )?;
    let tg = targets.clone();
    row(
        "cross-entropy: nn::cross_entropy",
        std::slice::from_ref(&logits),
        Box::new(move |t| nn::cross_entropy(&t[0], &tg)),
    )?;
    row(
        "cross-entropy: candle_nn::loss::cross_entropy",
        &[logits],
        Box::new(move |t| nn::cross_entropy_composed(&t[0], &targets)),
    )?;
    Ok(())
}
