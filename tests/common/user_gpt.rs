//! A small GPT written the way Candle users write it (pre-norm causal self-attention, an
//! embedding tied to the LM head, a final LayerNorm, candle-nn layers), and the harness that
//! trains any forward over such units both with single-process plain Candle on the global batch
//! and with candle-fsdp at a given world size (same init, loss = mean), then compares the two:
//! [`Case`], [`reference`], [`fsdp`], [`assert_parity`]. Used by the fsdp binary's feature
//! modules (parity, mixed precision, any forward, frozen parameters, misuse, overlap, dropout)
//! and by the checkpoint binary (resharding on resume).
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor, Var, D};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
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
pub const V: usize = 67;
pub const DM: usize = 16;
pub const HEADS: usize = 2;
pub const T: usize = 6;
pub const SEED: u64 = 11;
pub const LR: f64 = 1e-2;

pub type Layout = Vec<(String, Vec<UnitSpec>)>;
pub type Call<'a> = dyn FnMut(&str, &[&Tensor]) -> candle_fsdp::Result<Vec<Tensor>> + 'a;
/// The forward + loss, written once for both sides: (call a unit, this rank's batch, step).
pub type Program =
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
pub struct BlockCfg {
    pub dropout: f32,
    /// candle-nn's layer_norm (fused, no backward) instead of candle_fsdp::nn's.
    pub fused_ln: bool,
    /// candle_nn::ops::softmax_last_dim (fused, no backward) instead of ops::softmax.
    pub fused_softmax: bool,
}

/// GPT-2 style pre-norm block: x + attn(ln1(x), mask); x + mlp(ln2(x)).
pub struct Block {
    ln1: Norm,
    attn: Linear,
    attn_proj: Linear,
    ln2: Norm,
    fc: Linear,
    proj: Linear,
    cfg: BlockCfg,
}

pub fn block(
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

pub fn head(vb: VarBuilder) -> candle_core::Result<Linear> {
    Ok(Linear::new(vb.get((V, DM), "weight")?, None))
}

/// 1 where a position must not attend (j > i), u8 as candle-transformers builds it.
pub fn causal_mask(t: usize) -> candle_core::Result<Tensor> {
    let m: Vec<u8> = (0..t)
        .flat_map(|i| (0..t).map(move |j| u8::from(j > i)))
        .collect();
    Tensor::from_vec(m, (t, t), &Device::Cpu)
}

pub fn ce(logits: &Tensor, y: &Tensor) -> candle_fsdp::Result<Tensor> {
    Ok(candle_nn::loss::cross_entropy(
        &logits.to_dtype(DType::F32)?.flatten_to(1)?,
        &y.flatten_all()?,
    )?)
}

pub fn embeddings() -> Layout {
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

pub fn ln_f() -> (String, Vec<UnitSpec>) {
    (
        "ln_f".into(),
        vec![UnitSpec::new("ln_f", |vb| {
            candle_fsdp::nn::layer_norm(DM, 1e-5, vb)
        })],
    )
}

pub fn gpt_layout(nblk: usize, cfg: BlockCfg, ac: bool) -> Layout {
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
pub fn gpt_program(nblk: usize) -> Program {
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
pub struct Case {
    pub layout: Arc<dyn Fn() -> Layout + Send + Sync>,
    pub program: Program,
    pub freeze: Vec<String>,
    pub strategy: ShardingStrategy,
    pub mp: MixedPrecision,
    /// Micro-batches per step (gradient sync off for all but the last).
    pub accum: usize,
    pub sgd: bool,
    pub steps: usize,
    /// Global rows per step.
    pub rows: usize,
}

impl Case {
    pub fn new(layout: impl Fn() -> Layout + Send + Sync + 'static, program: Program) -> Self {
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

    pub fn gpt(nblk: usize, cfg: BlockCfg, ac: bool) -> Self {
        Case::new(move || gpt_layout(nblk, cfg, ac), gpt_program(nblk))
    }
}

pub fn builder(c: &Case, pg: Arc<dyn ProcessGroup>) -> FsdpModelBuilder {
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
pub fn batches(rows: usize, steps: usize) -> Vec<Vec<Tensor>> {
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
pub struct Outcome {
    pub losses: Vec<f32>,
    pub params: HashMap<String, Vec<f32>>,
}

enum RefOpt {
    A(candle_nn::AdamW),
    S(candle_nn::SGD),
}

/// Single-process plain Candle on the global batch. One optimizer per variable, stepped only
/// when the variable got a gradient (torch.optim's per-parameter step counts, which
/// candle-fsdp documents); frozen variables are left out of the optimizer.
pub fn reference(c: &Case) -> Outcome {
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

pub fn make_opt(sgd: bool) -> Box<dyn ShardedOptimizer> {
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

pub fn full_params(model: &FsdpModel) -> candle_fsdp::Result<HashMap<String, Vec<f32>>> {
    model
        .gather_full_params(false)?
        .unwrap()
        .into_iter()
        .map(|(n, t)| Ok((n, t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)))
        .collect()
}

/// One training step of this rank (its rows of the global batch), in `c.accum` micro-batches;
/// returns the loss averaged over the ranks.
pub fn train_step(
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

pub fn fsdp(c: &Case, ws: usize) -> Outcome {
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
pub fn diff(a: &Outcome, b: &Outcome) -> (f32, f64, String) {
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

pub fn assert_parity(got: &Outcome, want: &Outcome, what: &str) {
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

pub fn init_params(c: &Case) -> HashMap<String, Vec<f32>> {
    let varmap = VarMap::new();
    let vb = seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu);
    for (prefix, specs) in (c.layout)() {
        for s in specs {
            (s.ctor)(vb.pp(&prefix)).unwrap();
        }
    }
    varmap_values(&varmap).unwrap()
}

/// Full parameters by name.
pub type Params = HashMap<String, Vec<f32>>;
