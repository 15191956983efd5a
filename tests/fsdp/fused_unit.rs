//! A user's own fused unit (`fsdp::fused::{FusedOp, apply}`, the seam of `examples/fused_unit.rs`)
//! under the runtime: a stack of hand-fused residual MLP blocks trains exactly like the same
//! blocks composed of Candle ops and like plain single-process Candle (losses and final
//! parameters, relative error ≤ 1e-5), the fused node really is taken inside the runtime (and
//! only there), and a broken op fails with an error naming it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_fsdp::comm::{ProcessGroupExt, ReduceOp};
use candle_fsdp::fsdp::fused::{self, FusedOp};
use candle_fsdp::init::{seeded_var_builder, varmap_values};
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::unit::UnitSpec;
use candle_fsdp::{
    AdamW, AdamWConfig, FsdpConfig, FsdpModel, Sgd, SgdConfig, ShardedOptimizer, ShardingStrategy,
};
use candle_nn::{Linear, Optimizer, VarBuilder, VarMap};
use rand::{Rng, SeedableRng};

use crate::common::{rel_err, to_vec};

const SEED: u64 = 77;
const STEPS: usize = 3;
const PER_RANK: usize = 5;
const IN: usize = 6;
const D_MODEL: usize = 8;
const HIDDEN: usize = 12;
const OUT: usize = 3;
const BLOCKS: usize = 3;
const EPS: f64 = 1e-6;
const LR: f64 = 1e-2;
const WEIGHT_DECAY: f64 = 0.01;
const SGD_LR: f64 = 0.1;

/// AdamW (lr 1e-2, weight decay 0.01) or plain SGD (lr 0.1). AdamW's update does not change when
/// a parameter's gradient is scaled by a constant factor; SGD's is proportional to it.
#[derive(Clone, Copy, Debug)]
enum Opt {
    AdamW,
    Sgd,
}

/// What the blocks do: the fused node (where `apply` allows it), the composed ops only, or a
/// fused node whose backward is broken in one way.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Fused,
    Composed,
    /// The gradient of `w1` (parameter 1) transposed: `(D_MODEL, HIDDEN)` for `(HIDDEN, D_MODEL)`.
    WrongParamShape,
    /// The input's gradient with one column too few.
    WrongInputShape,
    /// One parameter gradient short.
    MissingParamGrad,
}

/// Calls of the op's forward and backward, over every rank.
#[derive(Clone, Default)]
struct Counts {
    fwd: Arc<AtomicUsize>,
    bwd: Arc<AtomicUsize>,
}

impl Counts {
    fn get(&self) -> (usize, usize) {
        (
            self.fwd.load(Ordering::SeqCst),
            self.bwd.load(Ordering::SeqCst),
        )
    }
}

/// `y = x + W2·relu(W1·rmsnorm(x)·g + b1) + b2` by hand; params `[g, w1, b1, w2, b2]`.
struct BlockOp {
    mode: Mode,
    counts: Counts,
}

struct Parts {
    inv: Tensor,
    xhat: Tensor,
    h: Tensor,
    a: Tensor,
    r: Tensor,
}

fn parts(x: &Tensor, p: &[Tensor]) -> Result<Parts> {
    let inv = (x.sqr()?.mean_keepdim(D::Minus1)? + EPS)?.sqrt()?.recip()?;
    let xhat = x.broadcast_mul(&inv)?;
    let h = xhat.broadcast_mul(&p[0])?;
    let a = h.matmul(&p[1].t()?)?.broadcast_add(&p[2])?;
    let r = a.relu()?;
    Ok(Parts { inv, xhat, h, a, r })
}

impl FusedOp for BlockOp {
    fn name(&self) -> &'static str {
        "test-residual-mlp"
    }

    fn forward(&self, x: &Tensor, p: &[Tensor]) -> Result<Tensor> {
        self.counts.fwd.fetch_add(1, Ordering::SeqCst);
        assert!(
            !x.track_op() && p.iter().all(|t| !t.track_op()),
            "the op's inputs are detached"
        );
        let s = parts(x, p)?;
        x + s.r.matmul(&p[3].t()?)?.broadcast_add(&p[4])?
    }

    fn backward(
        &self,
        x: &Tensor,
        p: &[Tensor],
        dy: &Tensor,
        _trains: &[bool],
    ) -> Result<(Tensor, Vec<Option<Tensor>>)> {
        self.counts.bwd.fetch_add(1, Ordering::SeqCst);
        let s = parts(x, p)?;
        let db2 = dy.sum(0)?;
        let dw2 = dy.t()?.matmul(&s.r)?;
        let da = (dy.matmul(&p[3])? * s.a.ge(0f64)?.to_dtype(x.dtype())?)?;
        let db1 = da.sum(0)?;
        let dw1 = da.t()?.matmul(&s.h)?;
        let dh = da.matmul(&p[1])?;
        let dg = (&dh * &s.xhat)?.sum(0)?;
        let dxhat = dh.broadcast_mul(&p[0])?;
        let m = (&dxhat * &s.xhat)?.mean_keepdim(D::Minus1)?;
        let dx = (dy + (dxhat - s.xhat.broadcast_mul(&m)?)?.broadcast_mul(&s.inv)?)?;
        let mut grads = vec![Some(dg), Some(dw1), Some(db1), Some(dw2), Some(db2)];
        match self.mode {
            Mode::WrongParamShape => grads[1] = Some(grads[1].as_ref().unwrap().t()?),
            Mode::WrongInputShape => return Ok((dx.narrow(1, 0, D_MODEL - 1)?, grads)),
            Mode::MissingParamGrad => {
                grads.pop();
            }
            Mode::Fused | Mode::Composed => {}
        }
        Ok((dx, grads))
    }
}

struct Block {
    norm: candle_fsdp::nn::RmsNorm,
    fc1: Linear,
    fc2: Linear,
    mode: Mode,
    counts: Counts,
    /// Where the block leaves its fused node's output (to back-propagate it outside the runtime).
    stash: Option<Arc<Mutex<Option<Tensor>>>>,
}

fn block(mode: Mode, counts: Counts, vb: VarBuilder) -> Result<Block> {
    Ok(Block {
        norm: candle_fsdp::nn::rms_norm(D_MODEL, EPS, vb.pp("norm"))?,
        fc1: candle_nn::linear(D_MODEL, HIDDEN, vb.pp("fc1"))?,
        fc2: candle_nn::linear(HIDDEN, D_MODEL, vb.pp("fc2"))?,
        mode,
        counts,
        stash: None,
    })
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.mode != Mode::Composed {
            let params = [
                self.norm.weight().clone(),
                self.fc1.weight().clone(),
                self.fc1.bias().unwrap().clone(),
                self.fc2.weight().clone(),
                self.fc2.bias().unwrap().clone(),
            ];
            let op = BlockOp {
                mode: self.mode,
                counts: self.counts.clone(),
            };
            if let Some(y) = fused::apply(x, &params, op)? {
                if let Some(stash) = &self.stash {
                    *stash.lock().unwrap() = Some(y.clone());
                }
                return Ok(y);
            }
        }
        let h = self.fc1.forward(&self.norm.forward(x)?)?.relu()?;
        x + self.fc2.forward(&h)?
    }
}

/// `embed` (a plain linear: its input is data, without gradient) → `block0..` → `head`.
fn units(mode: Mode, counts: &Counts, checkpoint_blocks: bool) -> Vec<UnitSpec> {
    let mut u = vec![UnitSpec::new("embed", |vb| {
        candle_nn::linear(IN, D_MODEL, vb)
    })];
    for i in 0..BLOCKS {
        let counts = counts.clone();
        u.push(
            UnitSpec::new(format!("block{i}"), move |vb| {
                block(mode, counts.clone(), vb)
            })
            .with_activation_checkpointing(checkpoint_blocks),
        );
    }
    u.push(UnitSpec::new("head", |vb| {
        candle_nn::linear(D_MODEL, OUT, vb)
    }));
    u
}

/// Regression batches: `x ~ U(-1, 1)`, `y = tanh(x A)` for a fixed random `A`.
fn batches(global: usize) -> Vec<(Tensor, Tensor)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let mut uniform =
        |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect() };
    let a = Tensor::from_vec(uniform(IN * OUT), (IN, OUT), &Device::Cpu).unwrap();
    (0..STEPS)
        .map(|_| {
            let x = Tensor::from_vec(uniform(global * IN), (global, IN), &Device::Cpu).unwrap();
            let y = x.matmul(&a).unwrap().tanh().unwrap();
            (x, y)
        })
        .collect()
}

type Run = (Vec<f32>, HashMap<String, Vec<f32>>);

/// Plain single-process Candle on the global batches (nothing armed: the blocks compose).
fn reference(ws: usize, opt: Opt) -> Run {
    let varmap = VarMap::new();
    let vb = seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu);
    let counts = Counts::default();
    let model: Vec<_> = units(Mode::Fused, &counts, false)
        .iter()
        .map(|u| (u.ctor)(vb.pp(&u.name)).unwrap())
        .collect();
    let mut optimizer: Box<dyn FnMut(&Tensor)> = match opt {
        Opt::AdamW => {
            let params = candle_nn::ParamsAdamW {
                lr: LR,
                weight_decay: WEIGHT_DECAY,
                ..Default::default()
            };
            let mut o = candle_nn::AdamW::new(varmap.all_vars(), params).unwrap();
            Box::new(move |loss| o.backward_step(loss).unwrap())
        }
        Opt::Sgd => {
            let mut o = candle_nn::SGD::new(varmap.all_vars(), SGD_LR).unwrap();
            Box::new(move |loss| o.backward_step(loss).unwrap())
        }
    };
    let mut losses = Vec::new();
    for (x, y) in batches(PER_RANK * ws) {
        let mut h = x;
        for m in &model {
            h = m.forward1(&h, true).unwrap();
        }
        let loss = candle_nn::loss::mse(&h, &y).unwrap();
        losses.push(loss.to_scalar::<f32>().unwrap());
        optimizer(&loss);
    }
    assert_eq!(
        counts.get(),
        (0, 0),
        "plain Candle never builds a fused node"
    );
    (losses, varmap_values(&varmap).unwrap())
}

/// FSDP at world size `ws`: rank-averaged losses, final full parameters, the op's call counts.
fn fsdp(
    ws: usize,
    strategy: ShardingStrategy,
    opt: Opt,
    mode: Mode,
    checkpoint_blocks: bool,
) -> candle_fsdp::Result<(Run, (usize, usize))> {
    let data = batches(PER_RANK * ws);
    let counts = Counts::default();
    let results = launch(&Launcher::threads(ws), |pg| {
        let config = FsdpConfig {
            sharding_strategy: strategy,
            seed: SEED,
            ..Default::default()
        };
        let mut model = FsdpModel::builder(pg.clone(), config)
            .units(units(mode, &counts, checkpoint_blocks))
            .build()?;
        let mut opt: Box<dyn ShardedOptimizer> = match opt {
            Opt::AdamW => Box::new(AdamW::new(AdamWConfig {
                lr: LR,
                weight_decay: WEIGHT_DECAY,
                ..Default::default()
            })),
            Opt::Sgd => Box::new(Sgd::new(SgdConfig {
                lr: SGD_LR,
                ..Default::default()
            })),
        };
        let mut losses = Vec::new();
        for (x, y) in &data {
            let x = x.narrow(0, pg.rank() * PER_RANK, PER_RANK)?;
            let y = y.narrow(0, pg.rank() * PER_RANK, PER_RANK)?;
            let loss = candle_nn::loss::mse(&model.forward(&x)?, &y)?;
            model.backward(&loss)?;
            opt.step(&mut model)?;
            model.zero_grad();
            losses.push(pg.all_reduce_f32s(vec![loss.to_scalar::<f32>()?], ReduceOp::Avg)?[0]);
        }
        let params = model
            .gather_full_params(false)?
            .expect("every rank gathers");
        Ok((
            losses,
            params
                .into_iter()
                .map(|(k, t)| (k, to_vec(&t)))
                .collect::<HashMap<_, _>>(),
        ))
    })?;
    for r in &results[1..] {
        assert_eq!(r, &results[0], "ranks disagree");
    }
    Ok((results.into_iter().next().unwrap(), counts.get()))
}

fn assert_close(what: &str, got: &Run, want: &Run) {
    assert_eq!(got.0.len(), STEPS);
    for (step, (a, b)) in got.0.iter().zip(&want.0).enumerate() {
        let rel = ((a - b) / b).abs();
        assert!(
            rel <= 1e-5,
            "{what}: loss at step {step}: {a} vs {b} (rel {rel:e})"
        );
    }
    let mut names: Vec<_> = want.1.keys().cloned().collect();
    names.sort();
    let mut got_names: Vec<_> = got.1.keys().cloned().collect();
    got_names.sort();
    assert_eq!(names, got_names, "{what}: parameter names");
    assert_eq!(names.len(), 2 + 2 + 5 * BLOCKS);
    for name in &names {
        let rel = rel_err(&got.1[name], &want.1[name]);
        assert!(
            rel <= 1e-5,
            "{what}: parameter {name}: relative error {rel:e}"
        );
    }
}

#[test]
fn fused_blocks_train_like_composed_blocks_and_plain_candle_ws1_ws2() {
    for ws in [1, 2] {
        for opt in [Opt::AdamW, Opt::Sgd] {
            let what = format!("ws {ws} {opt:?}");
            let reference = reference(ws, opt);
            // Training moved the loss.
            assert_ne!(reference.0[0], reference.0[STEPS - 1]);
            let full = ShardingStrategy::FullShard;
            let (fused, fused_counts) = fsdp(ws, full, opt, Mode::Fused, false).unwrap();
            let (composed, composed_counts) = fsdp(ws, full, opt, Mode::Composed, false).unwrap();
            // One fused node per block call (every block's input carries gradient: `embed`
            // comes first), each back-propagated once; none without the fused path.
            let calls = BLOCKS * STEPS * ws;
            assert_eq!(fused_counts, (calls, calls), "{what}: fused node calls");
            assert_eq!(composed_counts, (0, 0), "{what}: composed run");
            assert_close(&format!("{what} fused vs composed"), &fused, &composed);
            assert_close(&format!("{what} fused vs plain"), &fused, &reference);
            assert_close(&format!("{what} composed vs plain"), &composed, &reference);
        }
    }
}

#[test]
fn fused_blocks_match_plain_candle_shard_grad_op_no_shard_and_checkpointing_ws2() {
    let reference = reference(2, Opt::AdamW);
    let calls = BLOCKS * STEPS * 2;
    for strategy in [ShardingStrategy::ShardGradOp, ShardingStrategy::NoShard] {
        let (run, counts) = fsdp(2, strategy, Opt::AdamW, Mode::Fused, false).unwrap();
        assert_eq!(counts, (calls, calls), "{strategy:?}: fused node calls");
        assert_close(&format!("{strategy:?} fused"), &run, &reference);
    }
    // Activation checkpointing: the forward runs without gradient (the op's forward alone, so
    // that it computes what the recompute will), the backward's recompute builds the fused
    // node: two forwards a call, one backward.
    let full = ShardingStrategy::FullShard;
    let (run, counts) = fsdp(2, full, Opt::AdamW, Mode::Fused, true).unwrap();
    assert_eq!(
        counts,
        (2 * calls, calls),
        "checkpointed: fused op forwards, backwards"
    );
    assert_close("checkpointed fused", &run, &reference);
}

#[test]
fn broken_fused_backward_is_an_error_naming_the_op_and_shapes() {
    let cases = [
        (
            Mode::WrongParamShape,
            format!(
                "fused op test-residual-mlp: parameter 1's gradient is [{D_MODEL}, {HIDDEN}], \
                 the parameter [{HIDDEN}, {D_MODEL}]"
            ),
        ),
        (
            Mode::WrongInputShape,
            format!(
                "fused op test-residual-mlp: the input's gradient is [{PER_RANK}, {}] F32 on Cpu, \
                 the input [{PER_RANK}, {D_MODEL}] F32 on Cpu",
                D_MODEL - 1
            ),
        ),
        (
            Mode::MissingParamGrad,
            "fused op test-residual-mlp: the backward returned 4 parameter gradients for 5 \
             parameters"
                .to_string(),
        ),
    ];
    for (mode, want) in cases {
        for ws in [1, 2] {
            let e = fsdp(ws, ShardingStrategy::FullShard, Opt::AdamW, mode, false)
                .err()
                .unwrap_or_else(|| panic!("{mode:?} at ws {ws} trained without error"));
            let msg = e.message();
            assert!(msg.contains(&want), "{mode:?} ws {ws}: {msg}");
        }
    }
}

#[test]
fn fused_node_back_propagated_outside_the_runtime_is_an_error() {
    // A block that leaks its fused node's output; back-propagating that directly (not through
    // FsdpModel::backward) leaves the parameters' gradients nowhere to go.
    let stash: Arc<Mutex<Option<Tensor>>> = Arc::default();
    let counts = Counts::default();
    let (c, s) = (counts.clone(), stash.clone());
    let losses = launch(&Launcher::threads(1), move |pg| {
        let mut model = FsdpModel::builder(pg.clone(), FsdpConfig::default())
            .unit("embed", |vb| candle_nn::linear(IN, D_MODEL, vb))
            .unit_spec(
                UnitSpec::new("block", {
                    let (c, s) = (c.clone(), s.clone());
                    move |vb| {
                        let mut b = block(Mode::Fused, c.clone(), vb)?;
                        b.stash = Some(s.clone());
                        Ok(b)
                    }
                })
                // Its parameters stay gathered after the forward: the stray backward below
                // reads them (a resharded parameter's storage is empty until the runtime's
                // backward refills it, as is the unit's output).
                .with_reshard_after_forward(false),
            )
            .build()?;
        let x = Tensor::ones((2, IN), DType::F32, &Device::Cpu)?;
        let y = model.forward(&x)?;
        let leaked = s
            .lock()
            .unwrap()
            .take()
            .expect("the block built a fused node");
        let e = leaked.backward().unwrap_err().to_string();
        assert!(
            e.contains("a fused node's backward ran outside the FSDP runtime's backward"),
            "{e}"
        );
        // The runtime's own backward of the step still works.
        let loss = y.sqr()?.mean_all()?;
        model.backward(&loss)?;
        Ok(loss.to_scalar::<f32>()?)
    })
    .unwrap();
    assert!(losses[0].is_finite());
    // Built once; back-propagated twice (the stray backward, then the runtime's).
    assert_eq!(counts.get(), (1, 2));
}
