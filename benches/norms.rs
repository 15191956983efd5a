//! Time of the differentiable norms of `candle_fsdp::nn` on a (8, 256, 512) f32 CPU input:
//! forward alone and forward + backward, against candle-nn's fused forward (which has no
//! backward) and against the same layers composed of Candle ops (`forward_composed`).
//!
//! `cargo bench --bench norms` (with `RAYON_NUM_THREADS=1`, candle-nn's fused forward, which
//! splits the rows over the rayon pool, gets one core like ours). Each line gives the minimum and
//! the median of 50 timed runs after 3 warm-up runs (the minimum is the steadier figure on a
//! shared machine). "fwd+bwd" is `norm(x).backward()` with `x`, the weight and the bias as Vars:
//! Candle seeds the backward with ones and accumulates each returned gradient into a zero
//! tensor, both included. "kernel fwd + tensor-op bwd" is the alternative design (the same
//! forward kernel, the closed-form backward written as Candle ops), timed as the untracked
//! forward, those ops on a ones gradient, and the same accumulation.

use std::time::Instant;

use candle_core::{DType, Device, Module, Tensor, Var, D};
use candle_fsdp::nn::{LayerNorm, RmsNorm};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const SHAPE: (usize, usize, usize) = (8, 256, 512);
const EPS: f64 = 1e-5;
const WARMUP: usize = 3;
const RUNS: usize = 50;

/// (min, median) in ms of `RUNS` runs of `f` after `WARMUP` runs.
fn time_ms(mut f: impl FnMut()) -> (f64, f64) {
    for _ in 0..WARMUP {
        f();
    }
    let mut times: Vec<f64> = (0..RUNS)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    (times[0], times[RUNS / 2])
}

/// `(dx, dw, db)` of the closed-form backward written as Candle ops, for output gradient `g`.
fn tensor_op_backward(
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
    remove_mean: bool,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let d = x.dim(D::Minus1)? as f64;
    let xc = if remove_mean {
        x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?
    } else {
        x.clone()
    };
    let rstd = ((xc.sqr()?.sum_keepdim(D::Minus1)? / d)? + EPS)?
        .sqrt()?
        .recip()?;
    let xh = xc.broadcast_mul(&rstd)?;
    let gh = g.broadcast_mul(w)?;
    let mut inner = gh.broadcast_sub(&xh.broadcast_mul(&(&gh * &xh)?.mean_keepdim(D::Minus1)?)?)?;
    if remove_mean {
        inner = inner.broadcast_sub(&gh.mean_keepdim(D::Minus1)?)?;
    }
    let dx = inner.broadcast_mul(&rstd)?;
    let rows = x.elem_count() / x.dim(D::Minus1)?;
    let g2 = g.reshape((rows, ()))?;
    let dw = (g2.clone() * xh.reshape((rows, ()))?)?.sum(0)?;
    let db = g2.sum(0)?;
    Ok((dx, dw, db))
}

/// What Candle's backprop does with each gradient an op returns: add it to a zero-initialised
/// sum (`GradStore::or_insert` then `add`), so the alternative pays what the others pay.
fn accumulate(g: &Tensor) -> Tensor {
    (g.zeros_like().unwrap() + g).unwrap()
}

fn main() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let (b, t, d) = SHAPE;
    let x = Tensor::randn(0f32, 1.0, (b, t, d), &dev)?;
    let w = Tensor::randn(1f32, 0.1, d, &dev)?;
    let bias = Tensor::randn(0f32, 0.1, d, &dev)?;
    let xv = Var::from_tensor(&x)?;
    let wv = Var::from_tensor(&w)?;
    let bv = Var::from_tensor(&bias)?;
    println!(
        "input {SHAPE:?} f32, RAYON_NUM_THREADS={}",
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "unset".into())
    );
    println!("{:<46} {:>8} {:>8}", "", "min ms", "median");
    let line = |what: &str, (min, med): (f64, f64)| println!("{what:<46} {min:>8.2} {med:>8.2}");

    for rms in [false, true] {
        let name = if rms { "RmsNorm" } else { "LayerNorm" };
        println!("-- {name}");
        let theirs: Box<dyn Module> = if rms {
            Box::new(candle_nn::RmsNorm::new(w.clone(), EPS))
        } else {
            Box::new(candle_nn::LayerNorm::new(w.clone(), bias.clone(), EPS))
        };
        // On plain tensors (forward timings) and on Vars (forward + backward).
        let (plain, vars) = if rms {
            (
                RmsNorm::new(w.clone(), EPS).into_inner(),
                RmsNorm::new(wv.as_tensor().clone(), EPS).into_inner(),
            )
        } else {
            (
                LayerNorm::new(w.clone(), bias.clone(), EPS),
                LayerNorm::new(wv.as_tensor().clone(), bv.as_tensor().clone(), EPS),
            )
        };
        line(
            "candle-nn fused fwd (no backward)",
            time_ms(|| {
                theirs.forward(&x).unwrap();
            }),
        );
        line(
            "ours fwd",
            time_ms(|| {
                plain.forward(&x).unwrap();
            }),
        );
        line(
            "ours fwd+bwd",
            time_ms(|| {
                vars.forward(xv.as_tensor()).unwrap().backward().unwrap();
            }),
        );
        line(
            "composed ops fwd",
            time_ms(|| {
                plain.forward_composed(&x).unwrap();
            }),
        );
        line(
            "composed ops fwd+bwd",
            time_ms(|| {
                let y = vars.forward_composed(xv.as_tensor()).unwrap();
                y.backward().unwrap();
            }),
        );
        line(
            "kernel fwd + tensor-op bwd (alternative)",
            time_ms(|| {
                let y = plain.forward(&x).unwrap();
                let g = y.ones_like().unwrap();
                let (dx, dw, db) = tensor_op_backward(&x, &w, &g, !rms).unwrap();
                accumulate(&dx);
                accumulate(&dw);
                if !rms {
                    accumulate(&db);
                }
            }),
        );
    }
    // The alternative backward computes the same gradients (a check that it timed real work).
    let y = LayerNorm::new(wv.as_tensor().clone(), bv.as_tensor().clone(), EPS)
        .forward(xv.as_tensor())?;
    let grads = y.backward()?;
    let (dx, dw, db) = tensor_op_backward(&x, &w, &y.ones_like()?, true)?;
    for (a, r) in [
        (&dx, grads.get(&xv)),
        (&dw, grads.get(&wv)),
        (&db, grads.get(&bv)),
    ] {
        let r = r.expect("gradient");
        let diff = (a - r)?
            .abs()?
            .max_all()?
            .to_dtype(DType::F32)?
            .to_scalar::<f32>()?;
        let scale = r.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff <= 1e-4 * scale.max(1.0), "{diff} (scale {scale})");
    }
    Ok(())
}
