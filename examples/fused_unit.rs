//! Your own unit as **one** graph node under FSDP: the template to copy.
//!
//! Inside the runtime's training calls a unit may replace its dozen Candle nodes by a single
//! node whose forward and backward you write by hand ([`fused::FusedOp`]). That node takes only
//! the activation `x` as its graph input; the parameters' gradients bypass Candle's autograd and
//! are sent straight to the runtime ([`fused::apply`] does the promising and sending), which adds
//! them where Candle's would have been before the reduce-scatter. Outside a training call of the
//! runtime (plain Candle, evaluation) or when `x` carries no gradient, [`fused::apply`] returns
//! `None` and the unit must compute **the same function** with ordinary, differentiable Candle
//! ops: the *composed* path. It must also take the same path in every training step.
//!
//! The block here is a pre-norm residual MLP, `y = x + W2·relu(W1·rmsnorm(x) + b1) + b2`. The
//! example trains `embed → block0 … blockN-1 → head` on synthetic regression data at world size
//! 2 (ranks as threads, FULL_SHARD, AdamW) twice, once with the fused blocks and once composed,
//! and checks that both runs give the same losses. (The first unit, `embed`, is an ordinary
//! linear layer: its input is data without gradient, where a fused block would compose anyway.)
//!
//! ```text
//! cargo run --release --example fused_unit -- --world-size 2 --steps 20
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::{Device, Module, Result, Tensor, D};
use candle_fsdp::comm::{ProcessGroupExt, ReduceOp};
use candle_fsdp::fsdp::fused::{self, FusedOp};
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, FsdpModel, ShardedOptimizer};
use candle_nn::{Linear, VarBuilder};
use clap::Parser;
use rand::{Rng, SeedableRng};

const EPS: f64 = 1e-6;

/// The fused node's forward and backward, by hand over Candle tensors (no autograd: the runtime
/// passes detached tensors). Parameters in the order [`ResidualMlp::params`] lists them:
/// `[g (d), w1 (h, d), b1 (h), w2 (d, h), b2 (d)]`; `x` is `(rows, d)`.
struct ResidualMlpOp {
    /// Counts the fused nodes built (shown at the end: the seam really was taken).
    built: Arc<AtomicUsize>,
}

/// The forward's intermediates. Recomputed by the backward here (simplest; an op may instead
/// keep them in `self` behind a `Mutex`, as the node is back-propagated at most once).
struct Saved {
    inv: Tensor,  // 1 / sqrt(mean(x²) + eps), (rows, 1)
    xhat: Tensor, // x · inv
    h: Tensor,    // xhat · g
    a: Tensor,    // h W1ᵀ + b1
    r: Tensor,    // relu(a)
}

fn forward_parts(x: &Tensor, p: &[Tensor]) -> Result<Saved> {
    let (g, w1, b1) = (&p[0], &p[1], &p[2]);
    let inv = (x.sqr()?.mean_keepdim(D::Minus1)? + EPS)?.sqrt()?.recip()?;
    let xhat = x.broadcast_mul(&inv)?;
    let h = xhat.broadcast_mul(g)?;
    let a = h.matmul(&w1.t()?)?.broadcast_add(b1)?;
    let r = a.relu()?;
    Ok(Saved { inv, xhat, h, a, r })
}

impl FusedOp for ResidualMlpOp {
    fn name(&self) -> &'static str {
        "residual-mlp"
    }

    fn forward(&self, x: &Tensor, p: &[Tensor]) -> Result<Tensor> {
        self.built.fetch_add(1, Ordering::Relaxed);
        let s = forward_parts(x, p)?;
        x + s.r.matmul(&p[3].t()?)?.broadcast_add(&p[4])?
    }

    fn backward(
        &self,
        x: &Tensor,
        p: &[Tensor],
        dy: &Tensor,
        trains: &[bool],
    ) -> Result<(Tensor, Vec<Option<Tensor>>)> {
        let (g, w1, w2) = (&p[0], &p[1], &p[3]);
        // A frozen parameter (trains[i] false: the model's freeze / train_only) needs no
        // gradient: skip its product.
        let grad_if = |i: usize, f: &dyn Fn() -> Result<Tensor>| -> Result<Option<Tensor>> {
            if trains[i] {
                f().map(Some)
            } else {
                Ok(None)
            }
        };
        let s = forward_parts(x, p)?;
        // y = x + r W2ᵀ + b2
        let db2 = grad_if(4, &|| dy.sum(0))?;
        let dw2 = grad_if(3, &|| dy.t()?.matmul(&s.r))?;
        let dr = dy.matmul(w2)?;
        // r = relu(a): Candle's convention, gradient 1 where a ≥ 0.
        let da = (dr * s.a.ge(0f64)?.to_dtype(x.dtype())?)?;
        // a = h W1ᵀ + b1
        let db1 = grad_if(2, &|| da.sum(0))?;
        let dw1 = grad_if(1, &|| da.t()?.matmul(&s.h))?;
        let dh = da.matmul(w1)?;
        // h = xhat · g
        let dg = grad_if(0, &|| (&dh * &s.xhat)?.sum(0))?;
        let dxhat = dh.broadcast_mul(g)?;
        // xhat = x · inv:  dx = inv · (dxhat − xhat · mean(dxhat · xhat)); plus the residual.
        let m = (&dxhat * &s.xhat)?.mean_keepdim(D::Minus1)?;
        let dnorm = (dxhat - s.xhat.broadcast_mul(&m)?)?.broadcast_mul(&s.inv)?;
        let dx = (dy + dnorm)?;
        Ok((dx, vec![dg, dw1, db1, dw2, db2]))
    }
}

/// The unit: its layers for the composed path, and the same tensors as the op's parameters.
struct ResidualMlp {
    norm: candle_fsdp::nn::RmsNorm,
    fc1: Linear,
    fc2: Linear,
    fused: bool,
    built: Arc<AtomicUsize>,
}

impl ResidualMlp {
    fn new(
        d: usize,
        hidden: usize,
        fused: bool,
        built: Arc<AtomicUsize>,
        vb: VarBuilder,
    ) -> Result<Self> {
        Ok(Self {
            norm: candle_fsdp::nn::rms_norm(d, EPS, vb.pp("norm"))?,
            fc1: candle_nn::linear(d, hidden, vb.pp("fc1"))?,
            fc2: candle_nn::linear(hidden, d, vb.pp("fc2"))?,
            fused,
            built,
        })
    }

    /// The tensors the unit got from its `VarBuilder`, in the op's order (biases exist: `linear`).
    fn params(&self) -> Vec<Tensor> {
        let bias = |l: &Linear| l.bias().expect("linear has a bias").clone();
        let (fc1, fc2) = (&self.fc1, &self.fc2);
        vec![
            self.norm.weight().clone(),
            fc1.weight().clone(),
            bias(fc1),
            fc2.weight().clone(),
            bias(fc2),
        ]
    }

    /// The same function from differentiable Candle ops (every gradient through autograd).
    fn composed(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.fc1.forward(&self.norm.forward(x)?)?.relu()?;
        x + self.fc2.forward(&h)?
    }
}

impl Module for ResidualMlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.fused {
            let op = ResidualMlpOp {
                built: self.built.clone(),
            };
            if let Some(y) = fused::apply(x, &self.params(), op)? {
                return Ok(y);
            }
        }
        self.composed(x)
    }
}

/// Train a stack of hand-fused residual MLP blocks under FSDP, fused and composed.
#[derive(Debug, Parser)]
#[command(about)]
struct Args {
    /// Ranks (threads of this process).
    #[arg(long, default_value_t = 2)]
    world_size: usize,
    /// Optimizer steps per run.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Residual MLP blocks (one FSDP unit each).
    #[arg(long, default_value_t = 3)]
    blocks: usize,
    /// Width of the blocks (their MLP is 4× wider).
    #[arg(long, default_value_t = 32)]
    dim: usize,
    /// Rows per rank and step.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
}

const IN: usize = 8;
const OUT: usize = 4;

/// Global batches of `x ~ U(-1, 1)^IN` and `y = sin(x A)` for one fixed random `A`.
fn batches(steps: usize, rows: usize) -> Result<Vec<(Tensor, Tensor)>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut uniform =
        |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect() };
    let a = Tensor::from_vec(uniform(IN * OUT), (IN, OUT), &Device::Cpu)?;
    (0..steps)
        .map(|_| {
            let x = Tensor::from_vec(uniform(rows * IN), (rows, IN), &Device::Cpu)?;
            let y = x.matmul(&a)?.sin()?;
            Ok((x, y))
        })
        .collect()
}

/// One training run: the rank-averaged loss of every step, and the fused nodes built.
fn train(args: &Args, fused: bool) -> candle_fsdp::Result<(Vec<f32>, usize)> {
    let data = batches(args.steps, args.batch_size * args.world_size)?;
    let built = Arc::new(AtomicUsize::new(0));
    let per_rank = launch(&Launcher::threads(args.world_size), |pg| {
        let config = FsdpConfig {
            seed: 42,
            ..Default::default()
        };
        let (d, blocks) = (args.dim, args.blocks);
        let mut builder = FsdpModel::builder(pg.clone(), config)
            .unit("embed", move |vb| candle_nn::linear(IN, d, vb));
        for i in 0..blocks {
            let built = built.clone();
            builder = builder.unit(format!("block{i}"), move |vb| {
                ResidualMlp::new(d, 4 * d, fused, built.clone(), vb)
            });
        }
        let mut model = builder
            .unit("head", move |vb| candle_nn::linear(d, OUT, vb))
            .build()?;
        let mut opt = AdamW::new(AdamWConfig {
            lr: args.lr,
            ..Default::default()
        });
        let mut losses = Vec::new();
        for (x, y) in &data {
            let rows = (pg.rank() * args.batch_size, args.batch_size);
            let (x, y) = (x.narrow(0, rows.0, rows.1)?, y.narrow(0, rows.0, rows.1)?);
            let loss = candle_nn::loss::mse(&model.forward(&x)?, &y)?;
            model.backward(&loss)?;
            opt.step(&mut model)?;
            model.zero_grad();
            losses.push(pg.all_reduce_f32s(vec![loss.to_scalar::<f32>()?], ReduceOp::Avg)?[0]);
        }
        Ok(losses)
    })?;
    let built = built.load(Ordering::Relaxed);
    Ok((per_rank.into_iter().next().expect("rank 0"), built))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.world_size >= 1 && args.steps >= 1,
        "--world-size and --steps must be at least 1"
    );
    println!(
        "embed → {} residual MLP blocks (d {}, hidden {}) → head; world size {}, FULL_SHARD, AdamW lr {}",
        args.blocks,
        args.dim,
        4 * args.dim,
        args.world_size,
        args.lr
    );
    let (fused, built) = train(&args, true)?;
    let (composed, built_composed) = train(&args, false)?;
    println!(
        "{:>5}  {:>12}  {:>12}  {:>9}",
        "step", "fused", "composed", "rel diff"
    );
    let mut worst = 0f32;
    for (step, (f, c)) in fused.iter().zip(&composed).enumerate() {
        let rel = (f - c).abs() / c.abs().max(f32::MIN_POSITIVE);
        worst = worst.max(rel);
        println!("{step:>5}  {f:>12.6}  {c:>12.6}  {rel:>9.2e}");
    }
    println!(
        "fused nodes built: {built} in the fused run (blocks × steps × ranks = {}), {built_composed} in the composed run",
        args.blocks * args.steps * args.world_size
    );
    anyhow::ensure!(
        built > 0 && built_composed == 0,
        "the fused path was not taken as expected"
    );
    anyhow::ensure!(
        worst <= 1e-4,
        "fused and composed losses differ (max relative difference {worst:e})"
    );
    println!("fused and composed runs agree: max relative loss difference {worst:.2e}");
    Ok(())
}
