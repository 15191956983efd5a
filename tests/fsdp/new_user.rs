//! A new user's probes: models written the way Candle users write them (a small GPT with
//! pre-norm causal self-attention, a tied embedding / LM head, a final LayerNorm), trained with
//! candle-fsdp at world sizes 2 and 3 and compared with single-process plain Candle on the
//! global batch (same init, loss = mean); plus the features and the errors a user runs into.
//!
//! Tests that document a fault of the library are `#[ignore]`d with the reason.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Module, Tensor, Var, D};
use candle_fsdp::comm::threads::{run_ranks, run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::{ProcessGroup, ProcessGroupExt, ReduceOp};
use candle_fsdp::init::{seeded_var_builder, varmap_values};
use candle_fsdp::optim::glob_match;
use candle_fsdp::unit::{UnitModule, UnitSpec};
use candle_fsdp::{
    AdamW, AdamWConfig, FsdpConfig, FsdpModel, FsdpModelBuilder, MixedPrecision, Sgd, SgdConfig,
    ShardedOptimizer, ShardingStrategy,
};
use candle_nn::{Linear, Optimizer, VarBuilder, VarMap};
use rand::{Rng, SeedableRng};

/// Vocabulary: divisible by neither 2 nor 3.
const V: usize = 67;
const DM: usize = 16;
const HEADS: usize = 2;
const T: usize = 6;
const SEED: u64 = 11;
const LR: f64 = 1e-2;

type Layout = Vec<(String, Vec<UnitSpec>)>;
type Call<'a> = dyn FnMut(&str, &[&Tensor]) -> candle_fsdp::Result<Vec<Tensor>> + 'a;
/// The forward + loss, written once for both sides: (call a unit, this rank's batch, step).
type Program =
    Arc<dyn Fn(&mut Call<'_>, &[Tensor], usize) -> candle_fsdp::Result<Tensor> + Send + Sync>;

// ---------------------------------------------------------------------------------------------
// The model, as a Candle user writes it.

enum Norm {
    Ours(candle_fsdp::nn::LayerNorm),
    Fused(candle_nn::LayerNorm),
}

impl Module for Norm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Norm::Ours(n) => n.forward(x),
            Norm::Fused(n) => n.forward(x),
        }
    }
}

#[derive(Clone, Copy, Default)]
struct BlockCfg {
    dropout: f32,
    /// candle-nn's layer_norm (fused, no backward) instead of candle_fsdp::nn's.
    fused_ln: bool,
    /// candle_nn::ops::softmax_last_dim (fused, no backward) instead of ops::softmax.
    fused_softmax: bool,
}

/// GPT-2 style pre-norm block: x + attn(ln1(x), mask); x + mlp(ln2(x)).
struct Block {
    ln1: Norm,
    attn: Linear,
    attn_proj: Linear,
    ln2: Norm,
    fc: Linear,
    proj: Linear,
    cfg: BlockCfg,
}

fn block(
    cfg: BlockCfg,
) -> impl Fn(VarBuilder) -> candle_core::Result<Block> + Send + Sync + Clone + 'static {
    move |vb: VarBuilder| {
        let norm = |vb: VarBuilder| -> candle_core::Result<Norm> {
            Ok(if cfg.fused_ln {
                Norm::Fused(candle_nn::layer_norm(DM, 1e-5, vb)?)
            } else {
                Norm::Ours(candle_fsdp::nn::layer_norm(DM, 1e-5, vb)?)
            })
        };
        Ok(Block {
            ln1: norm(vb.pp("ln1"))?,
            attn: candle_nn::linear(DM, 3 * DM, vb.pp("attn"))?,
            attn_proj: candle_nn::linear(DM, DM, vb.pp("attn_proj"))?,
            ln2: norm(vb.pp("ln2"))?,
            fc: candle_nn::linear(DM, 4 * DM, vb.pp("fc"))?,
            proj: candle_nn::linear(4 * DM, DM, vb.pp("proj"))?,
            cfg,
        })
    }
}

impl Block {
    fn fwd(&self, x: &Tensor, mask: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let hd = d / HEADS;
        let h = self.ln1.forward(x)?;
        let qkv = self.attn.forward(&h)?;
        let split = |i: usize| -> candle_core::Result<Tensor> {
            qkv.narrow(2, i * d, d)?
                .reshape((b, t, HEADS, hd))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (split(0)?, split(1)?, split(2)?);
        let att = (q.matmul(&k.t()?)? * (1.0 / (hd as f64).sqrt()))?;
        let neg = Tensor::new(f32::NEG_INFINITY, x.device())?
            .to_dtype(att.dtype())?
            .broadcast_as(att.shape())?;
        let att = mask.broadcast_as(att.shape())?.where_cond(&neg, &att)?;
        let att = if self.cfg.fused_softmax {
            candle_nn::ops::softmax_last_dim(&att)?
        } else {
            candle_nn::ops::softmax(&att, D::Minus1)?
        };
        let att = if train && self.cfg.dropout > 0.0 {
            candle_nn::ops::dropout(&att, self.cfg.dropout)?
        } else {
            att
        };
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, d))?;
        let x = (x + self.attn_proj.forward(&y)?)?;
        let m = self
            .proj
            .forward(&self.fc.forward(&self.ln2.forward(&x)?)?.gelu()?)?;
        x + m
    }
}

impl UnitModule for Block {
    fn forward_t(&self, xs: &[Tensor], train: bool) -> candle_core::Result<Vec<Tensor>> {
        let [x, mask] = xs else {
            candle_core::bail!("block takes (x, mask), found {} inputs", xs.len())
        };
        Ok(vec![self.fwd(x, mask, train)?])
    }
}

fn head(vb: VarBuilder) -> candle_core::Result<Linear> {
    Ok(Linear::new(vb.get((V, DM), "weight")?, None))
}

/// 1 where a position must not attend (j > i), u8 as candle-transformers builds it.
fn causal_mask(t: usize) -> candle_core::Result<Tensor> {
    let m: Vec<u8> = (0..t)
        .flat_map(|i| (0..t).map(move |j| u8::from(j > i)))
        .collect();
    Tensor::from_vec(m, (t, t), &Device::Cpu)
}

fn ce(logits: &Tensor, y: &Tensor) -> candle_fsdp::Result<Tensor> {
    Ok(candle_nn::loss::cross_entropy(
        &logits.to_dtype(DType::F32)?.flatten_to(1)?,
        &y.flatten_all()?,
    )?)
}

fn embeddings() -> Layout {
    vec![
        (
            "wte".into(),
            vec![
                UnitSpec::new("emb", |vb| candle_nn::embedding(V, DM, vb)),
                UnitSpec::new("head", head),
            ],
        ),
        (
            "wpe".into(),
            vec![UnitSpec::new("wpe", |vb| candle_nn::embedding(T, DM, vb))],
        ),
    ]
}

fn ln_f() -> (String, Vec<UnitSpec>) {
    (
        "ln_f".into(),
        vec![UnitSpec::new("ln_f", |vb| {
            candle_fsdp::nn::layer_norm(DM, 1e-5, vb)
        })],
    )
}

fn gpt_layout(nblk: usize, cfg: BlockCfg, ac: bool) -> Layout {
    let mut l = embeddings();
    for i in 0..nblk {
        let n = format!("h{i}");
        l.push((
            n.clone(),
            vec![UnitSpec::multi(n, block(cfg)).with_activation_checkpointing(ac)],
        ));
    }
    l.push(ln_f());
    l
}

/// tok + pos, blocks, ln_f, tied head, cross entropy.
fn gpt_program(nblk: usize) -> Program {
    Arc::new(move |call, b, _step| {
        let (ids, y) = (&b[0], &b[1]);
        let t = ids.dim(1)?;
        let pos = Tensor::arange(0u32, t as u32, ids.device())?;
        let tok = call("emb", &[ids])?.remove(0);
        let pe = call("wpe", &[&pos])?.remove(0);
        let mut h = tok.broadcast_add(&pe)?;
        let mask = causal_mask(t)?;
        for i in 0..nblk {
            h = call(&format!("h{i}"), &[&h, &mask])?.remove(0);
        }
        let h = call("ln_f", &[&h])?.remove(0);
        let logits = call("head", &[&h])?.remove(0);
        ce(&logits, y)
    })
}

// ---------------------------------------------------------------------------------------------
// Harness: plain Candle vs candle-fsdp.

#[derive(Clone)]
struct Case {
    layout: Arc<dyn Fn() -> Layout + Send + Sync>,
    program: Program,
    freeze: Vec<String>,
    strategy: ShardingStrategy,
    mp: MixedPrecision,
    /// Micro-batches per step (gradient sync off for all but the last).
    accum: usize,
    sgd: bool,
    steps: usize,
    /// Global rows per step.
    rows: usize,
}

impl Case {
    fn new(layout: impl Fn() -> Layout + Send + Sync + 'static, program: Program) -> Self {
        Case {
            layout: Arc::new(layout),
            program,
            freeze: Vec::new(),
            strategy: ShardingStrategy::FullShard,
            mp: MixedPrecision::full_f32(),
            accum: 1,
            sgd: false,
            steps: 3,
            rows: 12,
        }
    }

    fn gpt(nblk: usize, cfg: BlockCfg, ac: bool) -> Self {
        Case::new(move || gpt_layout(nblk, cfg, ac), gpt_program(nblk))
    }
}

fn builder(c: &Case, pg: Arc<dyn ProcessGroup>) -> FsdpModelBuilder {
    let mut b = FsdpModel::builder(
        pg,
        FsdpConfig {
            sharding_strategy: c.strategy,
            seed: SEED,
            mixed_precision: c.mp,
            ..Default::default()
        },
    );
    for (prefix, specs) in (c.layout)() {
        b = if specs.len() == 1 && prefix == specs[0].name {
            b.unit_spec(specs.into_iter().next().unwrap())
        } else {
            b.group(prefix, specs)
        };
    }
    if !c.freeze.is_empty() {
        b = b.freeze(c.freeze.clone());
    }
    b
}

/// Per step: ids (rows, T) u32, targets (rows, T) u32.
fn batches(rows: usize, steps: usize) -> Vec<Vec<Tensor>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    (0..steps)
        .map(|_| {
            let mut draw = || -> Tensor {
                let v: Vec<u32> = (0..rows * T)
                    .map(|_| rng.random_range(0..V as u32))
                    .collect();
                Tensor::from_vec(v, (rows, T), &Device::Cpu).unwrap()
            };
            vec![draw(), draw()]
        })
        .collect()
}

#[derive(Debug)]
struct Outcome {
    losses: Vec<f32>,
    params: HashMap<String, Vec<f32>>,
}

enum RefOpt {
    A(candle_nn::AdamW),
    S(candle_nn::SGD),
}

/// Single-process plain Candle on the global batch. One optimizer per variable, stepped only
/// when the variable got a gradient (torch.optim's per-parameter step counts, which
/// candle-fsdp documents); frozen variables are left out of the optimizer.
fn reference(c: &Case) -> Outcome {
    let varmap = VarMap::new();
    let vb = seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu);
    let mut modules: HashMap<String, Box<dyn UnitModule>> = HashMap::new();
    for (prefix, specs) in (c.layout)() {
        for s in specs {
            modules.insert(s.name.clone(), (s.ctor)(vb.pp(&prefix)).unwrap());
        }
    }
    let mut opts: Vec<(Var, RefOpt)> = {
        let data = varmap.data().lock().unwrap();
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        names
            .into_iter()
            .filter(|n| !c.freeze.iter().any(|p| glob_match(p, n)))
            .map(|n| {
                let v = data[n].clone();
                let o = if c.sgd {
                    RefOpt::S(candle_nn::SGD::new(vec![v.clone()], LR).unwrap())
                } else {
                    RefOpt::A(
                        candle_nn::AdamW::new(
                            vec![v.clone()],
                            candle_nn::ParamsAdamW {
                                lr: LR,
                                weight_decay: 0.0,
                                ..Default::default()
                            },
                        )
                        .unwrap(),
                    )
                };
                (v, o)
            })
            .collect()
    };
    let mut losses = Vec::new();
    for (step, b) in batches(c.rows, c.steps).iter().enumerate() {
        let mut call = |name: &str, xs: &[&Tensor]| -> candle_fsdp::Result<Vec<Tensor>> {
            let xs: Vec<Tensor> = xs.iter().map(|&x| x.clone()).collect();
            Ok(modules[name].forward_t(&xs, true)?)
        };
        let l = (c.program)(&mut call, b, step).unwrap();
        losses.push(l.to_scalar::<f32>().unwrap());
        let grads = l.backward().unwrap();
        for (v, o) in opts.iter_mut() {
            if grads.get(v.as_tensor()).is_some() {
                match o {
                    RefOpt::A(o) => o.step(&grads).unwrap(),
                    RefOpt::S(o) => o.step(&grads).unwrap(),
                }
            }
        }
    }
    Outcome {
        losses,
        params: varmap_values(&varmap).unwrap(),
    }
}

fn make_opt(sgd: bool) -> Box<dyn ShardedOptimizer> {
    if sgd {
        Box::new(Sgd::new(SgdConfig {
            lr: LR,
            ..Default::default()
        }))
    } else {
        Box::new(AdamW::new(AdamWConfig {
            lr: LR,
            ..Default::default()
        }))
    }
}

fn full_params(model: &FsdpModel) -> candle_fsdp::Result<HashMap<String, Vec<f32>>> {
    model
        .gather_full_params(false)?
        .unwrap()
        .into_iter()
        .map(|(n, t)| Ok((n, t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)))
        .collect()
}

/// One training step of this rank (its rows of the global batch), in `c.accum` micro-batches;
/// returns the loss averaged over the ranks.
fn train_step(
    c: &Case,
    model: &mut FsdpModel,
    opt: &mut dyn ShardedOptimizer,
    batch: &[Tensor],
    step: usize,
) -> candle_fsdp::Result<f32> {
    let pg = model.process_group().clone();
    let (r, ws) = (pg.rank(), pg.world_size());
    let per = c.rows / ws;
    let micro = per / c.accum;
    let mut total = 0f32;
    for k in 0..c.accum {
        let rows: Vec<Tensor> = batch
            .iter()
            .map(|t| t.narrow(0, r * per + k * micro, micro))
            .collect::<candle_core::Result<_>>()?;
        model.set_requires_gradient_sync(k + 1 == c.accum);
        let p = c.program.clone();
        let loss = model.forward_with(|f| p(&mut |n, xs| f.call(n, xs), &rows, step))?;
        let loss = (loss / c.accum as f64)?;
        model.backward(&loss)?;
        total += loss.to_scalar::<f32>()?;
    }
    opt.step(model)?;
    model.zero_grad();
    let m = model.memory_stats();
    assert_eq!(m.unsharded_bytes, 0, "after a step: {m:?}");
    assert_eq!(m.unsharded_grad_bytes, 0, "after a step: {m:?}");
    Ok(pg.all_reduce_f32s(vec![total], ReduceOp::Avg)?[0])
}

fn fsdp(c: &Case, ws: usize) -> Outcome {
    let data = batches(c.rows, c.steps);
    let c2 = c.clone();
    let runs = run_ranks_ok(ws, ThreadGroupConfig::default(), move |pg| {
        let mut model = builder(&c2, pg.clone()).build()?;
        let mut opt = make_opt(c2.sgd);
        let mut losses = Vec::new();
        for (step, b) in data.iter().enumerate() {
            losses.push(train_step(&c2, &mut model, opt.as_mut(), b, step)?);
        }
        Ok(Outcome {
            losses,
            params: full_params(&model)?,
        })
    })
    .unwrap();
    runs.into_iter().next().unwrap()
}

/// (max |Δloss|, max over parameters of max|Δ| / max|ref|, worst parameter).
fn diff(a: &Outcome, b: &Outcome) -> (f32, f64, String) {
    assert_eq!(a.losses.len(), b.losses.len());
    let dl = a
        .losses
        .iter()
        .zip(&b.losses)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    let mut names: Vec<&String> = b.params.keys().collect();
    names.sort();
    let got: Vec<&String> = {
        let mut n: Vec<&String> = a.params.keys().collect();
        n.sort();
        n
    };
    assert_eq!(got, names, "parameter names differ");
    let mut worst = (0.0f64, String::new());
    for n in names {
        let (x, y) = (&a.params[n], &b.params[n]);
        assert_eq!(x.len(), y.len(), "{n}");
        let scale = y.iter().map(|v| v.abs() as f64).fold(1e-6, f64::max);
        // The key part of the qkv bias has an exactly zero gradient in exact arithmetic
        // (softmax is invariant to adding q·b_k to a whole row); AdamW turns its ~1e-9 rounding
        // noise into ±lr steps whose signs depend on summation order, on both sides. Not
        // comparable: skipped.
        let key_bias = |i: usize| n.ends_with("attn.bias") && (DM..2 * DM).contains(&i);
        let (i, e) = x
            .iter()
            .zip(y)
            .map(|(p, q)| (*p as f64 - *q as f64).abs() / scale)
            .enumerate()
            .filter(|(i, _)| !key_bias(*i))
            .fold((0, 0.0), |a, (i, e)| if e > a.1 { (i, e) } else { a });
        if e >= worst.0 {
            worst = (e, format!("{n}[{i}]: {} vs {}", x[i], y[i]));
        }
    }
    (dl, worst.0, worst.1)
}

fn assert_parity(got: &Outcome, want: &Outcome, what: &str) {
    let (dl, dp, worst) = diff(got, want);
    println!(
        "{what}: max |dloss| {dl:e}, max param rel err {dp:e} ({worst}); losses {:?} vs {:?}",
        got.losses, want.losses
    );
    assert!(
        dl <= 1e-4,
        "{what}: losses {:?} vs plain Candle {:?}",
        got.losses,
        want.losses
    );
    assert!(dp < 1e-4, "{what}: parameter {worst} differs by {dp:e}");
}

fn init_params(c: &Case) -> HashMap<String, Vec<f32>> {
    let varmap = VarMap::new();
    let vb = seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu);
    for (prefix, specs) in (c.layout)() {
        for s in specs {
            (s.ctor)(vb.pp(&prefix)).unwrap();
        }
    }
    varmap_values(&varmap).unwrap()
}

// ---------------------------------------------------------------------------------------------
// 1. A small GPT, tied embedding / head, 3 AdamW steps.

#[test]
fn p1_gpt_tied_parity_ws2_ws3() {
    let c = Case::gpt(3, BlockCfg::default(), false);
    let want = reference(&c);
    assert!(
        want.losses[2] < want.losses[0],
        "the reference trains: {:?}",
        want.losses
    );
    let init = init_params(&c);
    assert_ne!(want.params["wte.weight"], init["wte.weight"]);
    for ws in [2, 3] {
        let got = fsdp(&c, ws);
        assert_parity(&got, &want, &format!("gpt ws {ws}"));
        assert!(!got.params.contains_key("emb.weight") && !got.params.contains_key("head.weight"));
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Variants.

#[test]
fn p2_activation_checkpointing_parity() {
    let c = Case::gpt(3, BlockCfg::default(), true);
    let want = reference(&c);
    for ws in [2, 3] {
        assert_parity(
            &fsdp(&c, ws),
            &want,
            &format!("gpt + activation checkpointing ws {ws}"),
        );
    }
}

#[test]
fn p2_bf16_loss_close() {
    let mut c = Case::gpt(3, BlockCfg::default(), false);
    let want = reference(&c);
    c.mp = MixedPrecision::bf16();
    let got = fsdp(&c, 2);
    let (dl, dp, worst) = diff(&got, &want);
    println!(
        "bf16: losses {:?} vs f32 {:?}; max param rel err {dp:e} ({worst})",
        got.losses, want.losses
    );
    assert!(got.losses.iter().all(|l| l.is_finite()));
    assert!(
        dl < 0.05,
        "bf16 losses {:?} vs f32 {:?}",
        got.losses,
        want.losses
    );
    assert!(dp < 0.05, "bf16 parameter {worst} off by {dp}");
    assert!(got.losses[2] < got.losses[0], "{:?}", got.losses);
}

/// bf16 with everything at once: activation checkpointing, frozen parameters, 2 micro-batches.
#[test]
fn p2_bf16_checkpointing_frozen_accumulation_close() {
    let mut c = Case::gpt(2, BlockCfg::default(), true);
    c.freeze = vec!["h0.ln1.*".into(), "wpe.*".into()];
    let want = reference(&c);
    c.mp = MixedPrecision::bf16();
    c.accum = 2;
    let got = fsdp(&c, 2);
    let (dl, dp, worst) = diff(&got, &want);
    println!(
        "bf16 + AC + frozen + no_sync: losses {:?} vs f32 {:?}; max param rel err {dp:e} ({worst})",
        got.losses, want.losses
    );
    assert!(dl < 0.05, "{:?} vs {:?}", got.losses, want.losses);
    assert!(dp < 0.05, "{worst}: {dp}");
}

#[test]
fn p2_shard_grad_op_and_no_shard_parity() {
    let mut c = Case::gpt(2, BlockCfg::default(), false);
    let want = reference(&c);
    for (s, ws) in [
        (ShardingStrategy::ShardGradOp, 2),
        (ShardingStrategy::NoShard, 2),
        (ShardingStrategy::NoShard, 3),
        (ShardingStrategy::ShardGradOp, 3),
    ] {
        c.strategy = s;
        assert_parity(&fsdp(&c, ws), &want, &format!("{s:?} ws {ws}"));
    }
}

#[test]
fn p2_gradient_accumulation_no_sync_parity() {
    let mut c = Case::gpt(2, BlockCfg::default(), false);
    let want = reference(&c);
    c.accum = 2;
    for ws in [2, 3] {
        assert_parity(
            &fsdp(&c, ws),
            &want,
            &format!("2 micro-batches, no_sync, ws {ws}"),
        );
    }
    // With activation checkpointing too.
    let mut c = Case::gpt(2, BlockCfg::default(), true);
    c.accum = 2;
    assert_parity(&fsdp(&c, 2), &want, "2 micro-batches + checkpointing ws 2");
}

#[test]
fn p2_dropout_trains() {
    let mut c = Case::gpt(
        2,
        BlockCfg {
            dropout: 0.1,
            ..Default::default()
        },
        false,
    );
    c.steps = 5;
    let got = fsdp(&c, 2);
    println!("dropout losses {:?}", got.losses);
    assert!(got.losses.iter().all(|l| l.is_finite()));
    assert!(got.losses[4] < got.losses[0], "{:?}", got.losses);
}

#[test]
#[ignore = "no way to seed dropout: candle's CPU RNG cannot be seeded (Device::set_seed fails) and FsdpConfig::seed only covers init; two runs with the same seed differ"]
fn p2_dropout_deterministic_per_seed() {
    let c = Case::gpt(
        2,
        BlockCfg {
            dropout: 0.1,
            ..Default::default()
        },
        false,
    );
    let a = fsdp(&c, 2);
    let b = fsdp(&c, 2);
    assert_eq!(a.losses, b.losses, "two runs with seed {SEED}");
}

// ---------------------------------------------------------------------------------------------
// 3. Forward shapes.

struct Mlp {
    fc: Linear,
    proj: Linear,
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.proj.forward(&self.fc.forward(x)?.gelu()?)
    }
}

fn mlp(vb: VarBuilder) -> candle_core::Result<Mlp> {
    Ok(Mlp {
        fc: candle_nn::linear(DM, 2 * DM, vb.pp("fc"))?,
        proj: candle_nn::linear(2 * DM, DM, vb.pp("proj"))?,
    })
}

/// A unit without parameters returning its input (a view of it).
struct Identity;
impl Module for Identity {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(x.clone())
    }
}

/// A unit without parameters returning a reshape (a view) of its input.
struct Flatten;
impl Module for Flatten {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.flatten_to(1)
    }
}

/// Returns (a(x), b(x)): the caller uses only the first.
struct Two {
    a: Linear,
    b: Linear,
}
impl UnitModule for Two {
    fn forward_t(&self, xs: &[Tensor], _: bool) -> candle_core::Result<Vec<Tensor>> {
        Ok(vec![
            self.a.forward(&xs[0])?,
            self.b.forward(&xs[0])?.tanh()?,
        ])
    }
}
fn two(vb: VarBuilder) -> candle_core::Result<Two> {
    Ok(Two {
        a: candle_nn::linear(DM, DM, vb.pp("a"))?,
        b: candle_nn::linear(DM, DM, vb.pp("b"))?,
    })
}

/// Universal transformer: one block called 3 times, a residual spanning units (h + mlp(h)).
#[test]
fn p3_residual_across_units_and_unit_called_three_times() {
    let layout = || {
        let mut l = embeddings();
        l.push((
            "blk".into(),
            vec![UnitSpec::multi("blk", block(BlockCfg::default()))],
        ));
        l.push(("mlp".into(), vec![UnitSpec::new("mlp", mlp)]));
        l.push(ln_f());
        l
    };
    let program: Program = Arc::new(|call, b, _| {
        let (ids, y) = (&b[0], &b[1]);
        let pos = Tensor::arange(0u32, T as u32, ids.device())?;
        let mut h = call("emb", &[ids])?
            .remove(0)
            .broadcast_add(&call("wpe", &[&pos])?[0])?;
        let mask = causal_mask(T)?;
        for _ in 0..3 {
            h = call("blk", &[&h, &mask])?.remove(0);
            h = (&h + call("mlp", &[&h])?.remove(0))?;
        }
        let h = call("ln_f", &[&h])?.remove(0);
        ce(&call("head", &[&h])?[0], y)
    });
    let c = Case::new(layout, program);
    let want = reference(&c);
    for ws in [2, 3] {
        assert_parity(
            &fsdp(&c, ws),
            &want,
            &format!("universal transformer ws {ws}"),
        );
    }
    let mut c = c;
    c.layout = Arc::new(move || {
        let mut l = layout();
        l[2].1[0] =
            UnitSpec::multi("blk", block(BlockCfg::default())).with_activation_checkpointing(true);
        l
    });
    assert_parity(
        &fsdp(&c, 2),
        &want,
        "universal transformer + checkpointing ws 2",
    );
}

/// "aux" is called every step but its output reaches the loss only in even steps; "extra" is
/// called only in step 1. Both must then get no update (AdamW skips parameters without a
/// gradient).
#[test]
fn p3_unit_output_unused_or_unit_not_called_in_some_steps() {
    let layout = || {
        let mut l = embeddings();
        l.push((
            "aux".into(),
            vec![UnitSpec::new("aux", |vb| candle_nn::linear(DM, DM, vb))],
        ));
        l.push(("extra".into(), vec![UnitSpec::new("extra", mlp)]));
        l.push(("mlp".into(), vec![UnitSpec::new("mlp", mlp)]));
        l.push(ln_f());
        l
    };
    let program: Program = Arc::new(|call, b, step| {
        let (ids, y) = (&b[0], &b[1]);
        let pos = Tensor::arange(0u32, T as u32, ids.device())?;
        let mut h = call("emb", &[ids])?
            .remove(0)
            .broadcast_add(&call("wpe", &[&pos])?[0])?;
        let a = call("aux", &[&h])?.remove(0);
        if step % 2 == 0 {
            h = (h + a)?;
        }
        if step == 1 {
            h = (&h + call("extra", &[&h])?.remove(0))?;
        }
        h = (&h + call("mlp", &[&h])?.remove(0))?;
        let h = call("ln_f", &[&h])?.remove(0);
        ce(&call("head", &[&h])?[0], y)
    });
    let mut c = Case::new(layout, program);
    c.steps = 4;
    let want = reference(&c);
    for ws in [2, 3] {
        assert_parity(
            &fsdp(&c, ws),
            &want,
            &format!("unused outputs, AdamW, ws {ws}"),
        );
    }
    c.sgd = true;
    let want = reference(&c);
    assert_parity(&fsdp(&c, 2), &want, "unused outputs, SGD, ws 2");
}

/// Integer input → f32 output (embedding with token ids), a parameterless identity unit (returns
/// its input), a reshape-view unit, a two-output unit of which one output is used.
#[test]
fn p3_integer_input_view_outputs_and_two_outputs() {
    let layout = || {
        let mut l = embeddings();
        l.push(("id".into(), vec![UnitSpec::new("id", |_vb| Ok(Identity))]));
        l.push((
            "flat".into(),
            vec![UnitSpec::new("flat", |_vb| Ok(Flatten))],
        ));
        l.push(("two".into(), vec![UnitSpec::multi("two", two)]));
        l.push(ln_f());
        l
    };
    let program: Program = Arc::new(|call, b, _| {
        let (ids, y) = (&b[0], &b[1]);
        let (bs, t) = ids.dims2()?;
        let pos = Tensor::arange(0u32, t as u32, ids.device())?;
        let tok = call("emb", &[ids])?.remove(0);
        assert_eq!(tok.dtype(), DType::F32);
        // identity on a tensor with history, and on a fresh leaf (pos embedding output)
        let pe = call("wpe", &[&pos])?.remove(0);
        let pe = call("id", &[&pe])?.remove(0);
        let h = call("id", &[&tok.broadcast_add(&pe)?])?.remove(0);
        let h = call("flat", &[&h])?.remove(0); // (bs*t, DM)
        let mut o = call("two", &[&h])?;
        let h = o.remove(0).reshape((bs, t, DM))?;
        let h = call("ln_f", &[&h])?.remove(0);
        ce(&call("head", &[&h])?[0], y)
    });
    let c = Case::new(layout, program);
    let want = reference(&c);
    for ws in [2, 3] {
        assert_parity(
            &fsdp(&c, ws),
            &want,
            &format!("views / two outputs ws {ws}"),
        );
    }
}

/// The tied weight returned by a unit of no input (the user computes the logits himself), the
/// same tensor passed as both inputs of a unit, and a unit returning one tensor twice.
struct WeightOf(Tensor);
impl UnitModule for WeightOf {
    fn forward_t(&self, xs: &[Tensor], _: bool) -> candle_core::Result<Vec<Tensor>> {
        assert!(xs.is_empty());
        Ok(vec![self.0.clone()])
    }
}
struct Pair2 {
    a: Linear,
    b: Linear,
}
impl UnitModule for Pair2 {
    fn forward_t(&self, xs: &[Tensor], _: bool) -> candle_core::Result<Vec<Tensor>> {
        Ok(vec![
            (self.a.forward(&xs[0])? + self.b.forward(&xs[1])?.tanh()?)?,
        ])
    }
}
struct Dup(Linear);
impl UnitModule for Dup {
    fn forward_t(&self, xs: &[Tensor], _: bool) -> candle_core::Result<Vec<Tensor>> {
        let y = self.0.forward(&xs[0])?;
        Ok(vec![y.clone(), y])
    }
}

#[test]
fn p3_weight_returning_unit_same_input_twice_same_output_twice() {
    let layout = || -> Layout {
        vec![
            (
                "wte".into(),
                vec![
                    UnitSpec::new("emb", |vb| candle_nn::embedding(V, DM, vb)),
                    UnitSpec::multi("wmat", |vb| Ok(WeightOf(vb.get((V, DM), "weight")?))),
                ],
            ),
            (
                "wpe".into(),
                vec![UnitSpec::new("wpe", |vb| candle_nn::embedding(T, DM, vb))],
            ),
            (
                "pair2".into(),
                vec![UnitSpec::multi("pair2", |vb| {
                    Ok(Pair2 {
                        a: candle_nn::linear(DM, DM, vb.pp("a"))?,
                        b: candle_nn::linear(DM, DM, vb.pp("b"))?,
                    })
                })],
            ),
            (
                "dup".into(),
                vec![UnitSpec::multi("dup", |vb| {
                    Ok(Dup(candle_nn::linear(DM, DM, vb)?))
                })],
            ),
            ln_f(),
        ]
    };
    let program: Program = Arc::new(|call, b, _| {
        let (ids, y) = (&b[0], &b[1]);
        let pos = Tensor::arange(0u32, T as u32, ids.device())?;
        let tok = call("emb", &[ids])?
            .remove(0)
            .broadcast_add(&call("wpe", &[&pos])?[0])?;
        let p = call("pair2", &[&tok, &tok])?.remove(0);
        let d = call("dup", &[&p])?;
        let h = (&d[0] + (&d[1] * 0.5)?)?;
        let h = call("ln_f", &[&h])?.remove(0);
        let w = call("wmat", &[])?.remove(0);
        ce(&h.broadcast_matmul(&w.t()?)?, y)
    });
    let c = Case::new(layout, program);
    let want = reference(&c);
    for ws in [2, 3] {
        assert_parity(
            &fsdp(&c, ws),
            &want,
            &format!("weight unit / same input twice ws {ws}"),
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 4. Frozen parameters.

#[test]
fn p4_frozen_parameters_parity() {
    let base = Case::gpt(2, BlockCfg::default(), false);
    let init = init_params(&base);
    let all: Vec<String> = init.keys().cloned().collect();
    for (what, freeze, keep) in [
        ("whole unit h0", vec!["h0.*"], None),
        ("part of units", vec!["h*.ln1.*", "h1.attn.weight"], None),
        ("tied embedding", vec!["wte.weight"], None),
        (
            "all but ln_f.bias",
            vec!["wte.*", "wpe.*", "h*", "ln_f.weight"],
            Some("ln_f.bias"),
        ),
    ] {
        let mut c = base.clone();
        c.freeze = freeze.iter().map(|s| s.to_string()).collect();
        let want = reference(&c);
        let got = fsdp(&c, 2);
        assert_parity(&got, &want, &format!("freeze {what}"));
        for n in &all {
            let frozen = c.freeze.iter().any(|p| glob_match(p, n));
            if frozen {
                assert_eq!(got.params[n], init[n], "{what}: frozen {n} changed");
            } else {
                assert_ne!(got.params[n], init[n], "{what}: trainable {n} unchanged");
            }
        }
        if let Some(k) = keep {
            assert_ne!(got.params[k], init[k]);
        }
    }
}

#[test]
fn p4_freeze_pattern_typo_is_an_error() {
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut c = Case::gpt(1, BlockCfg::default(), false);
        c.freeze = vec!["h0.ln_1.*".into()];
        let e = builder(&c, pg)
            .build()
            .err()
            .expect("a typo must fail")
            .to_string();
        assert!(
            e.contains("h0.ln_1.*")
                && e.contains("matches no parameter")
                && e.contains("h0.ln1.weight"),
            "{e}"
        );
        Ok(())
    })
    .unwrap();
}

// ---------------------------------------------------------------------------------------------
// 5. Errors.

fn one_rank_batch() -> Vec<Tensor> {
    batches(2, 1).remove(0)
}

#[test]
fn p5_direct_loss_backward_is_an_error_and_the_step_still_works() {
    let c = Case::gpt(2, BlockCfg::default(), false);
    let mut one = c.clone();
    one.steps = 1;
    one.rows = 4;
    let want = reference(&one);
    let got = run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
        let r = pg.rank();
        let mut model = builder(&c, pg.clone()).build()?;
        let mut opt = make_opt(false);
        let b: Vec<Tensor> = batches(4, 1)[0]
            .iter()
            .map(|t| t.narrow(0, r * 2, 2))
            .collect::<candle_core::Result<_>>()?;
        let p = c.program.clone();
        let loss = model.forward_with(|f| p(&mut |n, xs| f.call(n, xs), &b, 0))?;
        let e = loss
            .backward()
            .expect_err("loss.backward() must fail")
            .to_string();
        assert!(e.contains("FsdpModel::backward(&loss)"), "{e}");
        // The user fixes the call: the same step still back-propagates correctly.
        model.backward(&loss)?;
        opt.step(&mut model)?;
        full_params(&model)
    })
    .unwrap()
    .remove(0);
    let got = Outcome {
        losses: want.losses.clone(),
        params: got,
    };
    assert_parity(&got, &want, "after a direct loss.backward()");
}

#[test]
fn p5_backward_twice_and_stale_outputs_are_errors() {
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let c = Case::gpt(1, BlockCfg::default(), false);
        let mut model = builder(&c, pg.clone()).build()?;
        let b = one_rank_batch();
        let p = c.program.clone();
        let loss = model.forward_with(|f| p(&mut |n, xs| f.call(n, xs), &b, 0))?;
        model.backward(&loss)?;
        let e = model.backward(&loss).unwrap_err().to_string();
        assert!(e.contains("without a preceding training forward"), "{e}");
        model.zero_grad();

        // The output of the previous step in this step's loss.
        let p = c.program.clone();
        let loss2 = model.forward_with(|f| p(&mut |n, xs| f.call(n, xs), &b, 1))?;
        let both = (&loss2 + &loss)?;
        let e = model.backward(&both).unwrap_err().to_string();
        println!("stale output error: {e}");
        // The stale node's own message (it passed before only through a backtrace frame named
        // `FsdpModel::backward` when RUST_BACKTRACE was set).
        assert!(
            e.contains("FsdpModel::backward")
                || e.contains("previous")
                || e.contains("earlier training forward"),
            "{e}"
        );
        // The model is usable afterwards.
        let p = c.program.clone();
        let loss3 = model.forward_with(|f| p(&mut |n, xs| f.call(n, xs), &b, 2))?;
        model.backward(&loss3)?;
        Ok(())
    })
    .unwrap();
}

#[test]
fn p5_panicking_unit_on_one_rank_does_not_hang() {
    struct Boom(Linear);
    impl Module for Boom {
        fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
            if std::thread::current().name() == Some("rank-1") {
                panic!("boom in rank 1");
            }
            self.0.forward(x)
        }
    }
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let start = Instant::now();
        let res = run_ranks(2, ThreadGroupConfig::default(), |pg| {
            let mut model = FsdpModel::builder(pg.clone(), FsdpConfig::default())
                .unit("a", |vb| candle_nn::linear(DM, DM, vb))
                .unit("boom", |vb| Ok(Boom(candle_nn::linear(DM, DM, vb)?)))
                .unit("c", |vb| candle_nn::linear(DM, DM, vb))
                .build()?;
            let x = Tensor::ones((2, DM), DType::F32, &Device::Cpu)?;
            let y = model.forward(&x)?;
            model.backward(&y.sum_all()?)?;
            Ok(())
        });
        let msgs: Vec<String> = res
            .iter()
            .map(|r| match r {
                Ok(()) => "ok".into(),
                Err(e) => e.to_string(),
            })
            .collect();
        let _ = tx.send((start.elapsed(), msgs));
    });
    let (elapsed, msgs) = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("ranks still running 120 s after one panicked");
    println!("panic: {elapsed:?} {msgs:?}");
    assert!(
        elapsed < Duration::from_secs(10),
        "took {elapsed:?}: {msgs:?}"
    );
    assert!(msgs[1].contains("boom in rank 1"), "{msgs:?}");
    assert!(msgs[0] != "ok", "{msgs:?}");
}

#[test]
fn p5_group_members_with_different_shapes() {
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        // The LM head written with in/out swapped: (DM, V) instead of (V, DM).
        let e = FsdpModel::builder(pg.clone(), FsdpConfig::default())
            .group(
                "wte",
                [
                    UnitSpec::new("emb", |vb| candle_nn::embedding(V, DM, vb)),
                    UnitSpec::new("head", |vb| candle_nn::linear_no_bias(V, DM, vb)),
                ],
            )
            .build()
            .err()
            .expect("must fail")
            .to_string();
        assert!(
            e.contains("units emb and head of group wte both ask for wte.weight but with different shapes: [67, 16] and [16, 67]"),
            "{e}"
        );
        Ok(())
    })
    .unwrap();
}

/// Full parameters by name.
type Params = HashMap<String, Vec<f32>>;

/// The initial parameters of `c` and each rank's full parameters (or error) after 2 AdamW steps
/// at world size 2 on 4-row batches.
fn two_steps_at_ws2(c: &mut Case) -> (Params, Vec<candle_fsdp::Result<Params>>) {
    c.rows = 4;
    c.steps = 2;
    let init = init_params(c);
    let c2 = c.clone();
    let data = batches(c.rows, c.steps);
    let got = run_ranks(2, ThreadGroupConfig::default(), move |pg| {
        let mut model = builder(&c2, pg.clone()).build()?;
        let mut opt = make_opt(false);
        for (s, b) in data.iter().enumerate() {
            train_step(&c2, &mut model, opt.as_mut(), b, s)?;
        }
        full_params(&model)
    });
    (init, got)
}

/// candle-nn's fused layer_norm inside a pre-norm block (the usual way): the block's output is
/// still connected to its input (residual) and its other parameters, so neither of the
/// library's checks fires; ln1/ln2 get no gradient and the gradient through the attention and
/// MLP branches into x is dropped. Expected: a clear error naming the unit.
#[test]
fn p5_candle_nn_layer_norm_in_prenorm_block_is_an_error() {
    let mut c = Case::gpt(
        2,
        BlockCfg {
            fused_ln: true,
            ..Default::default()
        },
        false,
    );
    let (init, got) = two_steps_at_ws2(&mut c);
    let e = match &got[0] {
        Ok(params) => {
            let mut frozen: Vec<&String> =
                params.keys().filter(|n| params[*n] == init[*n]).collect();
            frozen.sort();
            panic!("no error: trained 2 steps with candle-nn's layer_norm in blocks h0, h1; parameters that silently never changed: {frozen:?}")
        }
        Err(e) => e.to_string(),
    };
    assert!(e.contains("unit h0") && e.contains("layer_norm"), "{e}");
}

/// The same with candle_nn::ops::softmax_last_dim (fused, no backward) in the attention: q/k
/// get no gradient, silently.
#[test]
#[ignore = "known limit: an operation without backward that consumes no parameter directly (candle_nn::ops::softmax_last_dim after a combined qkv projection) leaves every parameter connected through another path; it cannot be seen in the graph (use candle_nn::ops::softmax)"]
fn p5_fused_softmax_in_attention_is_an_error() {
    let mut c = Case::gpt(
        1,
        BlockCfg {
            fused_softmax: true,
            ..Default::default()
        },
        false,
    );
    let (init, got) = two_steps_at_ws2(&mut c);
    if let Ok(params) = &got[0] {
        let w = &params["h0.attn.weight"];
        let w0 = &init["h0.attn.weight"];
        // Rows 0..2*DM of the (3*DM, DM) qkv weight are q and k.
        let qk_unchanged = w[..2 * DM * DM] == w0[..2 * DM * DM];
        let v_changed = w[2 * DM * DM..] != w0[2 * DM * DM..];
        panic!("no error with softmax_last_dim in block h0: q/k rows of h0.attn.weight unchanged after 2 AdamW steps: {qk_unchanged}, v rows changed: {v_changed}");
    }
}

/// The fused layer_norm as a unit of its own (the case the library documents) is an error
/// naming the unit.
#[test]
fn p5_candle_nn_layer_norm_as_own_unit_is_an_error_naming_it() {
    let layout = || {
        let mut l = gpt_layout(1, BlockCfg::default(), false);
        let last = l.len() - 1;
        l[last] = (
            "ln_f".into(),
            vec![UnitSpec::new("ln_f", |vb| {
                candle_nn::layer_norm(DM, 1e-5, vb)
            })],
        );
        l
    };
    let mut c = Case::new(layout, gpt_program(1));
    c.rows = 4;
    let got = run_ranks(2, ThreadGroupConfig::default(), move |pg| {
        let mut model = builder(&c, pg.clone()).build()?;
        let mut opt = make_opt(false);
        let b = batches(4, 1).remove(0);
        train_step(&c, &mut model, opt.as_mut(), &b, 0)
    });
    let e = got[0].as_ref().expect_err("must fail").to_string();
    assert!(
        e.contains("unit ln_f") && e.contains("candle_fsdp::nn::layer_norm"),
        "{e}"
    );
}

// ---------------------------------------------------------------------------------------------
// 6. Checkpoint: tied group + frozen params, save at ws 2, load at ws 3, continue.

#[test]
fn p6_checkpoint_ws2_to_ws3_continue_matches_uninterrupted() {
    use candle_fsdp::checkpoint::{load_sharded, save_sharded, TrainState};
    let mut c = Case::gpt(2, BlockCfg::default(), false);
    c.freeze = vec!["wpe.*".into(), "h1.ln2.*".into()];
    c.rows = 6;
    c.steps = 4;
    let want = reference(&c);
    let dir = std::env::temp_dir().join(format!("new-user-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let data = batches(c.rows, c.steps);
    let (c1, d1, dir1) = (c.clone(), data.clone(), dir.clone());
    let (path, first) = run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
        let mut model = builder(&c1, pg.clone()).build()?;
        let mut opt = make_opt(false);
        let mut losses = Vec::new();
        for (s, batch) in d1.iter().enumerate().take(2) {
            losses.push(train_step(&c1, &mut model, opt.as_mut(), batch, s)?);
        }
        let state = TrainState {
            step: 2,
            ..Default::default()
        };
        let path = save_sharded(&dir1, &model, opt.as_ref(), &state, 0)?;
        Ok((path, losses))
    })
    .unwrap()
    .remove(0);
    let c2 = c.clone();
    let (later, params) = run_ranks_ok(3, ThreadGroupConfig::default(), move |pg| {
        let mut model = builder(&c2, pg.clone()).build()?;
        let mut opt = make_opt(false);
        load_sharded(&path, &mut model, opt.as_mut())?;
        let mut losses = Vec::new();
        for (s, batch) in data.iter().enumerate().take(4).skip(2) {
            losses.push(train_step(&c2, &mut model, opt.as_mut(), batch, s)?);
        }
        Ok((losses, full_params(&model)?))
    })
    .unwrap()
    .remove(0);
    let _ = std::fs::remove_dir_all(&dir);
    let got = Outcome {
        losses: first.into_iter().chain(later).collect(),
        params,
    };
    assert_parity(&got, &want, "save ws 2 -> load ws 3 -> continue");
}

// ---------------------------------------------------------------------------------------------
// 7. Memory.

/// Per step of rank 0: memory stats after forward, after backward, after the optimizer step.
fn memory_probe(
    freeze: Vec<String>,
) -> Vec<(
    candle_fsdp::MemoryStats,
    candle_fsdp::MemoryStats,
    candle_fsdp::MemoryStats,
)> {
    let mut c = Case::gpt(8, BlockCfg::default(), false);
    c.rows = 4;
    c.freeze = freeze.clone();
    let stats = run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
        let mut model = builder(&c, pg.clone()).build()?;
        let mut opt = make_opt(false);
        let data = batches(c.rows, 3);
        let mut out = Vec::new();
        let r = pg.rank();
        for (s, b) in data.iter().enumerate() {
            model.reset_peak();
            let rows: Vec<Tensor> = b
                .iter()
                .map(|t| t.narrow(0, r * 2, 2))
                .collect::<candle_core::Result<_>>()?;
            let p = c.program.clone();
            let loss = model.forward_with(|f| p(&mut |n, xs| f.call(n, xs), &rows, s))?;
            let after_fwd = model.memory_stats();
            model.backward(&loss)?;
            let after_bwd = model.memory_stats();
            opt.step(&mut model)?;
            model.zero_grad();
            out.push((after_fwd, after_bwd, model.memory_stats()));
        }
        Ok(out)
    })
    .unwrap();
    for (s, (f, b, _)) in stats[0].iter().enumerate() {
        println!("freeze {freeze:?} step {s}:\n after fwd {f:?}\n after bwd {b:?}");
    }
    stats.into_iter().next().unwrap()
}

/// Bytes of one block's parameters (f32).
const BLOCK_BYTES: usize = 4
    * (2 * DM
        + DM * 3 * DM
        + 3 * DM
        + DM * DM
        + DM
        + 2 * DM
        + DM * 4 * DM
        + 4 * DM
        + 4 * DM * DM
        + DM);

#[test]
fn p7_memory_stats_8_blocks() {
    for (s, (f, b, end)) in memory_probe(Vec::new()).iter().enumerate() {
        assert_eq!(
            b.unsharded_bytes, 0,
            "step {s}: unsharded bytes after backward: {b:?}"
        );
        assert_eq!(b.unsharded_units, 0, "{b:?}");
        assert_eq!(end.unsharded_bytes, 0);
        assert!(b.peak_unsharded_units <= 2, "step {s}: {b:?}");
        // Forward prefetch at work: a block computes while the next one is gathered.
        assert!(f.peak_unsharded_bytes >= 2 * BLOCK_BYTES, "step {s}: {f:?}");
        assert!(
            b.peak_unsharded_bytes <= 2 * BLOCK_BYTES + 4 * V * DM,
            "step {s}: {b:?}"
        );
    }
}

/// Freezing one tensor per block (h*.ln1.*) gives every block a frozen twin group;
/// `limit_all_gathers` (2) counts groups, so a block's own two groups exhaust it and the next
/// block is never prefetched: the peak of unsharded bytes in forward drops from two blocks to
/// one (all-gathers exposed), while peak_unsharded_units reaches 3.
#[test]
fn p7_memory_stats_8_blocks_with_frozen_twins() {
    for (s, (f, b, end)) in memory_probe(vec!["h*.ln1.*".to_string()])
        .iter()
        .enumerate()
    {
        assert_eq!(b.unsharded_bytes, 0, "step {s}: {b:?}");
        assert_eq!(end.unsharded_bytes, 0);
        assert!(
            f.peak_unsharded_bytes >= 2 * BLOCK_BYTES - 4 * 2 * DM * 8,
            "step {s}: forward peak {} bytes < two blocks ({} bytes): no forward prefetch: {f:?}",
            f.peak_unsharded_bytes,
            2 * BLOCK_BYTES
        );
        assert!(b.peak_unsharded_units <= 2, "step {s}: {b:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// More errors: a panic inside backward, an error on one rank, ranks that call different units.

/// Identity whose backward panics on rank 1.
struct PanicInBackward;

impl candle_core::CustomOp1 for PanicInBackward {
    fn name(&self) -> &'static str {
        "panic-in-backward"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let candle_core::CpuStorage::F32(v) = s else {
            candle_core::bail!("f32 only")
        };
        let (a, b) = l.contiguous_offsets().expect("contiguous");
        Ok((
            candle_core::CpuStorage::F32(v[a..b].to_vec()),
            l.shape().clone(),
        ))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        if std::thread::current().name() == Some("rank-1") {
            panic!("boom in rank 1's backward");
        }
        Ok(Some(g.clone()))
    }
}

struct LinearPanicBwd(Linear);
impl Module for LinearPanicBwd {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.0.forward(x)?.apply_op1(PanicInBackward)
    }
}

/// Runs `f` on 2 ranks in a watchdog thread: (elapsed, per-rank "ok" or error text).
fn timed_ranks<F>(timeout: Duration, f: F) -> (Duration, Vec<String>)
where
    F: Fn(Arc<dyn ProcessGroup>) -> candle_fsdp::Result<()> + Send + Sync + 'static,
{
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let start = Instant::now();
        let res = run_ranks(2, ThreadGroupConfig { timeout }, f);
        let msgs: Vec<String> = res
            .iter()
            .map(|r| match r {
                Ok(()) => "ok".into(),
                Err(e) => e.to_string(),
            })
            .collect();
        let _ = tx.send((start.elapsed(), msgs));
    });
    rx.recv_timeout(timeout + Duration::from_secs(60))
        .expect("ranks still running a minute past the collective timeout")
}

#[test]
fn p5_panic_in_backward_on_one_rank_does_not_hang() {
    let (elapsed, msgs) = timed_ranks(Duration::from_secs(300), |pg| {
        let mut model = FsdpModel::builder(pg.clone(), FsdpConfig::default())
            .unit("a", |vb| candle_nn::linear(DM, DM, vb))
            .unit("boom", |vb| {
                Ok(LinearPanicBwd(candle_nn::linear(DM, DM, vb)?))
            })
            .unit("c", |vb| candle_nn::linear(DM, DM, vb))
            .build()?;
        let x = Tensor::ones((2, DM), DType::F32, &Device::Cpu)?;
        let y = model.forward(&x)?;
        model.backward(&y.sum_all()?)?;
        Ok(())
    });
    println!("panic in backward: {elapsed:?} {msgs:?}");
    assert!(
        elapsed < Duration::from_secs(10),
        "took {elapsed:?}: {msgs:?}"
    );
    assert!(msgs[1].contains("boom in rank 1's backward"), "{msgs:?}");
    assert!(msgs[0] != "ok", "{msgs:?}");
}

#[test]
fn p5_unit_error_on_one_rank_fails_every_rank_promptly() {
    // Rank 1 feeds a batch of the wrong width (a data bug on one rank).
    let (elapsed, msgs) = timed_ranks(Duration::from_secs(300), |pg| {
        let mut model = FsdpModel::builder(pg.clone(), FsdpConfig::default())
            .unit("a", |vb| candle_nn::linear(DM, DM, vb))
            .unit("b", |vb| candle_nn::linear(DM, DM, vb))
            .build()?;
        let w = if pg.rank() == 1 { DM + 1 } else { DM };
        let x = Tensor::ones((2, w), DType::F32, &Device::Cpu)?;
        let y = model.forward(&x)?;
        model.backward(&y.sum_all()?)?;
        Ok(())
    });
    println!("error on one rank: {elapsed:?} {msgs:?}");
    assert!(
        elapsed < Duration::from_secs(10),
        "took {elapsed:?}: {msgs:?}"
    );
    assert!(msgs[1].contains("unit a"), "{msgs:?}");
    assert!(msgs[0] != "ok", "{msgs:?}");
}

/// Data-dependent control flow that differs between ranks: rank 0 calls unit "a", rank 1 calls
/// unit "b" (same shapes). The all-gathers pair rank 0's shard of a with rank 1's shard of b.
/// Expected: an error (the library checks at build time that ranks built the same model, and
/// the docs say every rank must call the same units in the same order), not silently mixed
/// parameters and gradients.
#[test]
fn p5_ranks_calling_different_units_is_an_error() {
    let (elapsed, msgs) = timed_ranks(Duration::from_secs(20), |pg| {
        let mut model = FsdpModel::builder(pg.clone(), FsdpConfig::default())
            .unit("a", |vb| candle_nn::linear(DM, DM, vb))
            .unit("b", |vb| candle_nn::linear(DM, DM, vb))
            .unit("c", |vb| candle_nn::linear(DM, DM, vb))
            .build()?;
        let x = Tensor::ones((2, DM), DType::F32, &Device::Cpu)?;
        let r = pg.rank();
        let y = model.forward_with(|f| {
            let h = f.call1(if r == 0 { "a" } else { "b" }, &x)?;
            f.call1("c", &h)
        })?;
        model.backward(&y.sum_all()?)?;
        let mut opt = make_opt(false);
        opt.step(&mut model)?;
        Ok(())
    });
    println!("ranks calling different units: {elapsed:?} {msgs:?}");
    assert!(
        msgs.iter().all(|m| m != "ok"),
        "no error on any rank: {msgs:?}"
    );
    // Expected: a prompt error in the forward, not the collective timeout (20 s here).
    assert!(
        elapsed < Duration::from_secs(10),
        "took {elapsed:?}: {msgs:?}"
    );
    assert!(
        msgs[0].contains("forward"),
        "not caught in the forward: {msgs:?}"
    );
}

/// A rank-dependent depth (rank 0 applies "a" twice, rank 1 once: an early exit taken on one
/// rank). The collectives still match (a second call of a present unit gathers nothing), and the
/// result must be the gradient of the mean of the ranks' losses: compared with plain Candle.
#[test]
fn p5_rank_dependent_depth_matches_plain_candle() {
    let xs: Vec<Tensor> = (0..2)
        .map(|r| {
            let v: Vec<f32> = (0..2 * DM)
                .map(|i| ((i * 7 + r * 3) % 11) as f32 / 11.0 - 0.5)
                .collect();
            Tensor::from_vec(v, (2, DM), &Device::Cpu).unwrap()
        })
        .collect();
    let fwd = |call: &mut Call<'_>, x: &Tensor, r: usize| -> candle_fsdp::Result<Tensor> {
        let mut h = call("a", &[x])?.remove(0).tanh()?;
        if r == 0 {
            h = call("a", &[&h])?.remove(0).tanh()?;
        }
        Ok(call("b", &[&h])?.remove(0).sqr()?.mean_all()?)
    };
    // Plain Candle: loss = (L0 + L1) / 2, one SGD step.
    let varmap = VarMap::new();
    let vb = seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu);
    let a = candle_nn::linear(DM, DM, vb.pp("a")).unwrap();
    let b = candle_nn::linear(DM, 3, vb.pp("b")).unwrap();
    let mut call = |n: &str, x: &[&Tensor]| -> candle_fsdp::Result<Vec<Tensor>> {
        Ok(vec![if n == "a" {
            a.forward(x[0])?
        } else {
            b.forward(x[0])?
        }])
    };
    let l0 = fwd(&mut call, &xs[0], 0).unwrap();
    let l1 = fwd(&mut call, &xs[1], 1).unwrap();
    let loss = ((l0 + l1).unwrap() / 2.0).unwrap();
    let mut sgd = candle_nn::SGD::new(varmap.all_vars(), LR).unwrap();
    sgd.backward_step(&loss).unwrap();
    let want = varmap_values(&varmap).unwrap();
    let got = run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
        let mut model = FsdpModel::builder(
            pg.clone(),
            FsdpConfig {
                seed: SEED,
                ..Default::default()
            },
        )
        .unit("a", |vb| candle_nn::linear(DM, DM, vb))
        .unit("b", |vb| candle_nn::linear(DM, 3, vb))
        .build()?;
        let r = pg.rank();
        let x = xs[r].clone();
        let l = model.forward_with(|f| fwd(&mut |n, x| f.call(n, x), &x, r))?;
        model.backward(&l)?;
        make_opt(true).step(&mut model)?;
        full_params(&model)
    })
    .unwrap()
    .remove(0);
    for (n, w) in &want {
        let e = w
            .iter()
            .zip(&got[n])
            .map(|(p, q)| (p - q).abs())
            .fold(0.0f32, f32::max);
        assert!(e < 1e-6, "{n} differs by {e}");
    }
}

// ---------------------------------------------------------------------------------------------
// 8. gather_full_model → FullModel::call gives the sharded eval forward's values.

#[test]
fn p8_full_model_call_matches_sharded_eval() {
    let c = Case::gpt(2, BlockCfg::default(), false);
    let data = batches(4, 2);
    run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
        let mut c = c.clone();
        c.rows = 4;
        let mut model = builder(&c, pg.clone()).build()?;
        let mut opt = make_opt(false);
        train_step(&c, &mut model, opt.as_mut(), &data[0], 0)?;
        let b = &data[1];
        let p = c.program.clone();
        let eval = model.forward_eval_with(|f| p(&mut |n, xs| f.call(n, xs), b, 0))?;
        let full = model.gather_full_model(false)?.unwrap();
        let p = c.program.clone();
        let direct = p(&mut |n, xs| full.call(n, xs, false), b, 0)?;
        let (a, d) = (eval.to_scalar::<f32>()?, direct.to_scalar::<f32>()?);
        assert!((a - d).abs() < 1e-5, "eval loss {a} vs FullModel {d}");
        Ok(())
    })
    .unwrap();
}
