//! `fsdp::fused::Linear` under the runtime: an MLP of them trains bit for bit like the same MLP
//! of `nn::Linear` (losses and final parameters) at world sizes 1 and 2 under every strategy,
//! with a checkpointed unit and with a frozen weight; inside the runtime the layers' parameters
//! are bound as views after the first step (not autograd variables: the point of the node),
//! while `nn::Linear` keeps getting variables.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{Device, Module, Result, Tensor};
use candle_fsdp::comm::{ProcessGroupExt, ReduceOp};
use candle_fsdp::fsdp::fused;
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::unit::UnitSpec;
use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, FsdpModel, ShardedOptimizer, ShardingStrategy};
use candle_nn::{Activation, VarBuilder};

use crate::common::to_vec;

const IN: usize = 20;
const HIDDEN: usize = 16;
const OUT: usize = 4;
const PER_RANK: usize = 6;
const STEPS: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Fused,
    Plain,
}

/// A linear layer of either kind that notes, at each call, whether its weight or bias is an
/// autograd variable.
struct Probe {
    kind: Kind,
    weight: Tensor,
    bias: Option<Tensor>,
    seen: Arc<Mutex<Vec<bool>>>,
}

impl Module for Probe {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let var = self.weight.is_variable() || self.bias.as_ref().is_some_and(Tensor::is_variable);
        self.seen.lock().unwrap().push(var);
        match self.kind {
            Kind::Fused => fused::linear_forward(x, &self.weight, self.bias.as_ref()),
            Kind::Plain => candle_fsdp::nn::linear_forward(x, &self.weight, self.bias.as_ref()),
        }
    }
}

fn probe(
    kind: Kind,
    (i, o, bias): (usize, usize, bool),
    seen: &Arc<Mutex<Vec<bool>>>,
    vb: VarBuilder,
) -> Result<Probe> {
    let l = if bias {
        candle_nn::linear(i, o, vb)?
    } else {
        candle_nn::linear_no_bias(i, o, vb)?
    };
    Ok(Probe {
        kind,
        weight: l.weight().clone(),
        bias: l.bias().cloned(),
        seen: seen.clone(),
    })
}

/// `fc1` (input without gradient) → ReLU → `fc2` → ReLU → `head` (no bias); the first two
/// checkpointed when asked.
fn units(kind: Kind, checkpoint: bool, seen: &Arc<Mutex<Vec<bool>>>) -> Vec<UnitSpec> {
    let (s1, s2, s3) = (seen.clone(), seen.clone(), seen.clone());
    vec![
        UnitSpec::new("fc1", move |vb| {
            Ok(candle_nn::seq()
                .add(probe(kind, (IN, HIDDEN, true), &s1, vb)?)
                .add(Activation::Relu))
        })
        .with_activation_checkpointing(checkpoint),
        UnitSpec::new("fc2", move |vb| {
            Ok(candle_nn::seq()
                .add(probe(kind, (HIDDEN, HIDDEN, true), &s2, vb)?)
                .add(Activation::Relu))
        })
        .with_activation_checkpointing(checkpoint),
        UnitSpec::new("head", move |vb| probe(kind, (HIDDEN, OUT, false), &s3, vb)),
    ]
}

/// `rows` examples of step `step` for rank `rank`.
fn batch(step: usize, rank: usize, rows: usize) -> (Tensor, Tensor) {
    let v = |n: usize, salt: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7 + step * 13 + rank * 31 + salt) % 23) as f32 - 11.0) / 11.0)
            .collect()
    };
    let x = Tensor::from_vec(v(rows * IN, 0), (rows, IN), &Device::Cpu).unwrap();
    let y = Tensor::from_vec(v(rows * OUT, 5), (rows, OUT), &Device::Cpu).unwrap();
    (x, y)
}

/// The squared error summed over the batch, over a full batch's element count (an empty batch:
/// 0, not the mean's NaN).
fn loss(pred: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    (pred - y)?.sqr()?.sum_all()? / (PER_RANK * OUT) as f64
}

struct Run {
    losses: Vec<u32>,
    init: HashMap<String, Vec<f32>>,
    params: HashMap<String, Vec<f32>>,
    /// Rank 0's notes: was the weight or bias a variable, call by call.
    seen: Vec<bool>,
    /// How many of `seen` are the first step's.
    first_step_calls: usize,
}

/// `STEPS` AdamW steps; every rank's batch is empty at step `empty_at`.
fn run(
    kind: Kind,
    ws: usize,
    strategy: ShardingStrategy,
    checkpoint: bool,
    freeze: &[&str],
    empty_at: Option<usize>,
) -> Run {
    let seen0 = Arc::new(Mutex::new(Vec::new()));
    let results = launch(&Launcher::threads(ws), |pg| {
        let seen = if pg.rank() == 0 {
            seen0.clone()
        } else {
            Arc::new(Mutex::new(Vec::new()))
        };
        let config = FsdpConfig {
            sharding_strategy: strategy,
            seed: 3,
            ..Default::default()
        };
        let mut builder =
            FsdpModel::builder(pg.clone(), config).units(units(kind, checkpoint, &seen));
        if !freeze.is_empty() {
            builder = builder.freeze(freeze.iter().copied());
        }
        let mut model = builder.build()?;
        let gather = |model: &FsdpModel| -> candle_fsdp::Result<HashMap<String, Vec<f32>>> {
            Ok(model
                .gather_full_params(false)?
                .expect("every rank gathers")
                .into_iter()
                .map(|(k, t)| (k, to_vec(&t)))
                .collect())
        };
        let init = gather(&model)?;
        let mut opt = AdamW::new(AdamWConfig {
            lr: 1e-2,
            weight_decay: 0.01,
            ..Default::default()
        });
        let mut losses = Vec::new();
        let mut first_step_calls = 0;
        for step in 0..STEPS {
            let rows = if empty_at == Some(step) { 0 } else { PER_RANK };
            let (x, y) = batch(step, pg.rank(), rows);
            let loss = loss(&model.forward(&x)?, &y)?;
            model.backward(&loss)?;
            opt.step(&mut model)?;
            model.zero_grad();
            let avg = pg.all_reduce_f32s(vec![loss.to_scalar::<f32>()?], ReduceOp::Avg)?[0];
            losses.push(avg.to_bits());
            if step == 0 {
                first_step_calls = seen.lock().unwrap().len();
            }
        }
        Ok((losses, init, gather(&model)?, first_step_calls))
    })
    .unwrap();
    let (losses, init, params, first_step_calls) = results.into_iter().next().unwrap();
    let seen = seen0.lock().unwrap().clone();
    Run {
        losses,
        init,
        params,
        seen,
        first_step_calls,
    }
}

/// The fused layers' parameters are views after the first step (whose calls saw variables
/// where they recorded autograd: the runtime learns there that only fused nodes read them);
/// `nn::Linear` always reads variables where its calls record autograd.
fn assert_views_after_the_first_step(what: &str, fused: &Run, plain: &Run) {
    let first = fused.first_step_calls;
    assert!(first >= 3, "{what}: the first step's calls");
    assert!(
        fused.seen[..first].contains(&true),
        "{what}: first step {:?}",
        fused.seen
    );
    assert!(
        fused.seen[first..].iter().all(|v| !v),
        "{what}: views after the first step: {:?}",
        fused.seen
    );
    assert!(
        plain.seen[plain.first_step_calls..].contains(&true),
        "{what}: nn::Linear's variables"
    );
}

fn assert_same(what: &str, fused: &Run, plain: &Run) {
    assert_eq!(fused.losses, plain.losses, "{what}: losses (bits)");
    assert_ne!(
        fused.losses[0],
        fused.losses[STEPS - 1],
        "{what}: training moved the loss"
    );
    let mut names: Vec<_> = plain.params.keys().collect();
    names.sort();
    assert_eq!(names.len(), 5, "{what}: parameters {names:?}");
    for n in names {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&fused.params[n]),
            bits(&plain.params[n]),
            "{what}: parameter {n} (bits)"
        );
    }
}

#[test]
fn fused_linear_trains_bit_for_bit_like_nn_linear_under_every_strategy() {
    for (ws, strategy) in [
        (1, ShardingStrategy::FullShard),
        (2, ShardingStrategy::FullShard),
        (2, ShardingStrategy::ShardGradOp),
        (2, ShardingStrategy::NoShard),
    ] {
        let what = format!("ws {ws} {strategy:?}");
        let fused = run(Kind::Fused, ws, strategy, false, &[], None);
        let plain = run(Kind::Plain, ws, strategy, false, &[], None);
        assert_same(&what, &fused, &plain);
        // Three layers a step: variables in the first step, views after it.
        assert_eq!(fused.seen.len(), 3 * STEPS, "{what}: calls");
        assert_eq!(&fused.seen[..3], [true; 3], "{what}: first step");
        assert_views_after_the_first_step(&what, &fused, &plain);
        assert!(
            plain.seen.iter().all(|v| *v),
            "{what}: nn::Linear's variables"
        );
    }
}

#[test]
fn fused_linear_checkpointed_and_frozen_train_like_nn_linear() {
    let full = ShardingStrategy::FullShard;
    // fc1 checkpointed is the case `fused::records` exists for: its input carries no
    // gradient, its forward records nothing, its recompute builds the node.
    let fused = run(Kind::Fused, 2, full, true, &[], None);
    let plain = run(Kind::Plain, 2, full, true, &[], None);
    assert_same("checkpointed fc1 and fc2", &fused, &plain);
    assert_views_after_the_first_step("checkpointed fc1 and fc2", &fused, &plain);
    // A frozen weight: no gradient computed or sent for it, its bias still trains.
    let fused = run(Kind::Fused, 2, full, false, &["fc2.weight"], None);
    let plain = run(Kind::Plain, 2, full, false, &["fc2.weight"], None);
    assert_same("frozen fc2 weight", &fused, &plain);
    assert_views_after_the_first_step("frozen fc2 weight", &fused, &plain);
    for r in [&fused, &plain] {
        assert_eq!(
            r.params["fc2.weight"], r.init["fc2.weight"],
            "the frozen weight changed"
        );
        assert_ne!(
            r.params["fc2.bias"], r.init["fc2.bias"],
            "fc2.bias did not train"
        );
    }
}

/// A step whose batch is empty on every rank: the fused layers send zero gradients for every
/// parameter, as PyTorch has them (the step's optimizer then finds every parameter present;
/// before, the views got none and the step failed). `nn::Linear` composes there, and Candle's
/// broadcast add of an empty tensor drops the bias from the graph, so its biases skip that
/// step: the runs agree up to the empty step, not after it.
#[test]
fn fused_linear_with_an_empty_batch_steps_every_parameter() {
    for ws in [1, 2] {
        let full = ShardingStrategy::FullShard;
        let fused = run(Kind::Fused, ws, full, false, &[], Some(2));
        let plain = run(Kind::Plain, ws, full, false, &[], Some(2));
        let what = format!("ws {ws}, empty step 2");
        assert_eq!(
            fused.losses[..2],
            plain.losses[..2],
            "{what}: before the empty step"
        );
        assert_eq!(
            f32::from_bits(fused.losses[2]),
            0.0,
            "{what}: the empty step's loss"
        );
        let last = f32::from_bits(fused.losses[STEPS - 1]);
        assert!(last.is_finite() && last > 0.0, "{what}: {last}");
        for (n, v) in &fused.params {
            assert!(v.iter().all(|x| x.is_finite()), "{what}: {n}");
            assert_ne!(v, &fused.init[n], "{what}: {n} trained");
        }
    }
}

/// A fused layer whose result the unit drops: its parameters are promised (so the forward's
/// connectivity check counts them as reached) but no backward sends their gradients. Once the
/// group is bound as views, the call's backward says so, naming the parameter, instead of
/// training on without them.
#[test]
fn a_dropped_fused_result_is_an_error_naming_the_parameter() {
    struct Dropped(fused::Linear);
    impl Module for Dropped {
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let _unused = self.0.forward(x)?;
            x * 2.0
        }
    }
    let err = launch(&Launcher::threads(2), |pg| {
        let mut model = FsdpModel::builder(pg.clone(), FsdpConfig::default())
            .units(vec![
                UnitSpec::new("fc1", |vb| fused::linear(IN, HIDDEN, vb)),
                UnitSpec::new("mid", |vb| Ok(Dropped(fused::linear(HIDDEN, HIDDEN, vb)?))),
                UnitSpec::new("head", |vb| fused::linear(HIDDEN, OUT, vb)),
            ])
            .build()?;
        let mut opt = AdamW::new(AdamWConfig::default());
        for step in 0..STEPS {
            let (x, y) = batch(step, pg.rank(), PER_RANK);
            let loss = loss(&model.forward(&x)?, &y)?;
            model.backward(&loss)?;
            opt.step(&mut model)?;
            model.zero_grad();
        }
        Ok(())
    })
    .expect_err("a dropped fused result must not train silently")
    .to_string();
    assert!(
        err.contains("mid.weight") && err.contains("none sent its gradient"),
        "{err}"
    );
}
