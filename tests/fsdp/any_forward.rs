//! Any forward (issue 12): a forward written as ordinary Rust that calls units by name, with a
//! residual spanning units, a unit of two inputs and two outputs, a unit called twice, a
//! concatenation, a differentiable LayerNorm, and an embedding tied to the LM head through a
//! group — against single-process Candle running the same modules. Plus frozen parameters and
//! the loud errors of operations without backward. Module `users_gpt`: the same kinds of forward
//! on the GPT of tests/common/user_gpt.rs (a unit called three times, units unused in some
//! steps, integer inputs and views, a unit returning its weight, a rank-dependent depth) and the
//! gathered `FullModel` against the sharded eval forward.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor, D};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::{ProcessGroup, ProcessGroupExt};
use candle_fsdp::init::{seeded_var_builder, varmap_values};
use candle_fsdp::unit::{UnitModule, UnitSpec};
use candle_fsdp::{
    AdamW, AdamWConfig, FsdpConfig, FsdpModel, FsdpModelBuilder, ShardedOptimizer, ShardingStrategy,
};
use candle_nn::{Activation, Linear, Optimizer, VarBuilder, VarMap};
use rand::{Rng, SeedableRng};

/// A vocabulary divisible by neither 2 nor 3 (nor 4).
const V: usize = 1001;
const DIM: usize = 8;
const T: usize = 5;
const PER_RANK: usize = 2;
const STEPS: usize = 3;
const SEED: u64 = 7;
const LR: f64 = 1e-2;

/// Two inputs (hidden states, a constant mask), two outputs.
struct Pair {
    a: Linear,
    b: Linear,
}

impl UnitModule for Pair {
    fn forward_t(&self, xs: &[Tensor], _train: bool) -> candle_core::Result<Vec<Tensor>> {
        let [h, mask] = xs else {
            candle_core::bail!("pair takes (hidden, mask), found {} inputs", xs.len())
        };
        let p = self.a.forward(h)?.broadcast_mul(mask)?;
        let q = self.b.forward(h)?.tanh()?;
        Ok(vec![p, q])
    }
}

fn pair(vb: VarBuilder) -> candle_core::Result<Pair> {
    Ok(Pair {
        a: candle_nn::linear(DIM, DIM, vb.pp("a"))?,
        b: candle_nn::linear(DIM, DIM, vb.pp("b"))?,
    })
}

fn blk(vb: VarBuilder) -> candle_core::Result<candle_nn::Sequential> {
    Ok(candle_nn::seq()
        .add(candle_nn::linear(DIM, DIM, vb.pp("fc"))?)
        .add(Activation::Gelu))
}

fn head(vb: VarBuilder) -> candle_core::Result<Linear> {
    Ok(Linear::new(vb.get((V, DIM), "weight")?, None))
}

/// (group prefix, unit specs) in build order: what both sides construct.
fn layout() -> Vec<(&'static str, Vec<UnitSpec>)> {
    vec![
        (
            "wte",
            vec![
                UnitSpec::new("emb", |vb| candle_nn::embedding(V, DIM, vb)),
                UnitSpec::new("head", head),
            ],
        ),
        ("pair", vec![UnitSpec::multi("pair", pair)]),
        ("blk", vec![UnitSpec::new("blk", blk)]),
        (
            "norm",
            vec![UnitSpec::new("norm", |vb| {
                candle_fsdp::nn::layer_norm(DIM, 1e-5, vb)
            })],
        ),
    ]
}

fn builder(pg: Arc<dyn ProcessGroup>, strategy: ShardingStrategy) -> FsdpModelBuilder {
    let mut b = FsdpModel::builder(
        pg,
        FsdpConfig {
            sharding_strategy: strategy,
            seed: SEED,
            ..Default::default()
        },
    );
    for (prefix, specs) in layout() {
        b = if specs.len() == 1 && prefix == specs[0].name {
            b.unit_spec(specs.into_iter().next().unwrap())
        } else {
            b.group(prefix, specs)
        };
    }
    b
}

type Call<'a> = dyn FnMut(&str, &[&Tensor]) -> candle_fsdp::Result<Vec<Tensor>> + 'a;

/// The forward, written once for both sides: a residual spanning units, a two-input two-output
/// unit, one unit called twice, a concatenation, and the tied head.
fn program(call: &mut Call<'_>, ids: &Tensor, mask: &Tensor) -> candle_fsdp::Result<Tensor> {
    let tok = call("emb", &[ids])?.remove(0);
    let pq = call("pair", &[&tok, mask])?;
    let mut h = (&tok + &pq[0])?;
    for _ in 0..2 {
        let y = call("blk", &[&h])?.remove(0);
        h = (h + y)?;
    }
    let h = call("norm", &[&h])?.remove(0);
    let both = Tensor::cat(&[&h, &pq[1]], 0)?;
    Ok(call("head", &[&both])?.remove(0))
}

fn loss(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    let targets = Tensor::cat(&[targets, targets], 0)?;
    candle_nn::loss::cross_entropy(&logits.flatten_to(1)?, &targets.flatten_all()?)
}

/// Global batches: (ids (n, T) u32, mask (n, T, 1) f32, targets (n, T) u32).
fn batches(n: usize) -> Vec<(Tensor, Tensor, Tensor)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    (0..STEPS)
        .map(|_| {
            let ids: Vec<u32> = (0..n * T).map(|_| rng.random_range(0..V as u32)).collect();
            let mask: Vec<f32> = (0..n * T)
                .map(|_| if rng.random_bool(0.8) { 1.0 } else { 0.0 })
                .collect();
            let y: Vec<u32> = (0..n * T).map(|_| rng.random_range(0..V as u32)).collect();
            let dev = &Device::Cpu;
            (
                Tensor::from_vec(ids, (n, T), dev).unwrap(),
                Tensor::from_vec(mask, (n, T, 1), dev).unwrap(),
                Tensor::from_vec(y, (n, T), dev).unwrap(),
            )
        })
        .collect()
}

/// Plain Candle on the global batch: losses and final parameters. Parameters whose name starts
/// with one of `frozen` are left out of the optimizer.
fn reference(ws: usize, frozen: &[&str]) -> (Vec<f32>, HashMap<String, Vec<f32>>) {
    let varmap = VarMap::new();
    let vb = seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu);
    let mut modules: HashMap<String, Box<dyn UnitModule>> = HashMap::new();
    for (prefix, specs) in layout() {
        for s in specs {
            modules.insert(s.name.clone(), (s.ctor)(vb.pp(prefix)).unwrap());
        }
    }
    let vars: Vec<candle_core::Var> = {
        let data = varmap.data().lock().unwrap();
        data.iter()
            .filter(|(k, _)| !frozen.iter().any(|f| k.starts_with(f)))
            .map(|(_, v)| v.clone())
            .collect()
    };
    let mut opt = candle_nn::AdamW::new(
        vars,
        candle_nn::ParamsAdamW {
            lr: LR,
            weight_decay: 0.0,
            ..Default::default()
        },
    )
    .unwrap();
    let mut losses = Vec::new();
    for (ids, mask, y) in batches(PER_RANK * ws) {
        let mut call = |name: &str, xs: &[&Tensor]| -> candle_fsdp::Result<Vec<Tensor>> {
            let xs: Vec<Tensor> = xs.iter().map(|&x| x.clone()).collect();
            Ok(modules[name].forward_t(&xs, true)?)
        };
        let logits = program(&mut call, &ids, &mask).unwrap();
        let l = loss(&logits, &y).unwrap();
        losses.push(l.to_scalar::<f32>().unwrap());
        opt.step(&l.backward().unwrap()).unwrap();
    }
    (losses, varmap_values(&varmap).unwrap())
}

struct FsdpRun {
    losses: Vec<f32>,
    params: HashMap<String, Vec<f32>>,
    reduce_scatter_bytes: u64,
    /// Per unit (group) name: whether its exported optimizer state is anything but zeros.
    opt_state: HashMap<String, bool>,
    /// Bytes of optimizer state on the device, and the trainable (non-frozen) shard elements.
    opt_bytes: usize,
    trainable_shard_numel: usize,
}

fn fsdp(ws: usize, strategy: ShardingStrategy, freeze: &[&str]) -> FsdpRun {
    let data = batches(PER_RANK * ws);
    let freeze: Vec<String> = freeze.iter().map(|s| s.to_string()).collect();
    let runs = run_ranks_ok(ws, ThreadGroupConfig::default(), move |pg| {
        let r = pg.rank();
        let mut model = builder(pg.clone(), strategy)
            .freeze(freeze.clone())
            .build()?;
        let mut opt = AdamW::new(AdamWConfig {
            lr: LR,
            weight_decay: 0.0,
            ..Default::default()
        });
        let mut losses = Vec::new();
        let before = pg.stats().reduce_scatter_bytes;
        for (ids, mask, y) in &data {
            let rows = |t: &Tensor| t.narrow(0, r * PER_RANK, PER_RANK);
            let (ids, mask, y) = (rows(ids)?, rows(mask)?, rows(y)?);
            let logits =
                model.forward_with(|f| program(&mut |n, xs| f.call(n, xs), &ids, &mask))?;
            let l = loss(&logits, &y)?;
            model.backward(&l)?;
            opt.step(&mut model)?;
            model.zero_grad();
            let mean = pg.all_reduce_f32s(
                vec![l.to_scalar::<f32>()?],
                candle_fsdp::comm::ReduceOp::Avg,
            )?;
            losses.push(mean[0]);
        }
        let reduce_scatter_bytes = pg.stats().reduce_scatter_bytes - before;
        let state = opt.state()?;
        let opt_state = model
            .shards()
            .zip(&state.units)
            .map(|(v, u)| {
                let nonzero = u.buffers.values().any(|b| b.iter().any(|x| *x != 0.0))
                    || u.steps.iter().any(|s| *s > 0);
                (v.unit_name.to_string(), nonzero)
            })
            .collect();
        let opt_bytes = opt.state_bytes();
        let trainable_shard_numel = model
            .shards()
            .filter(|v| !v.frozen)
            .map(|v| v.layout.shard_numel)
            .sum();
        let params = model
            .gather_full_params(false)?
            .unwrap()
            .into_iter()
            .map(|(n, t)| Ok((n, t.flatten_all()?.to_vec1::<f32>()?)))
            .collect::<candle_fsdp::Result<_>>()?;
        Ok(FsdpRun {
            losses,
            params,
            reduce_scatter_bytes,
            opt_state,
            opt_bytes,
            trainable_shard_numel,
        })
    })
    .unwrap();
    runs.into_iter().next().unwrap()
}

fn max_rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().map(|v| v.abs() as f64).fold(1e-6, f64::max);
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs() / scale)
        .fold(0.0, f64::max)
}

fn assert_parity(run: &FsdpRun, reference: &(Vec<f32>, HashMap<String, Vec<f32>>), what: &str) {
    let (losses, params) = reference;
    for (s, (a, b)) in run.losses.iter().zip(losses).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs().max(1.0),
            "{what}: loss of step {s}: fsdp {a} vs candle {b}"
        );
    }
    assert_eq!(
        run.params.len(),
        params.len(),
        "{what}: parameter names {:?} vs {:?}",
        run.params.keys().collect::<Vec<_>>(),
        params.keys().collect::<Vec<_>>()
    );
    for (name, want) in params {
        let got = &run.params[name];
        let e = max_rel_err(got, want);
        assert!(e < 1e-5, "{what}: {name} differs from plain Candle by {e}");
    }
}

#[test]
fn any_forward_with_tied_weights_matches_plain_candle_at_world_sizes_1_2_3() {
    for ws in [1, 2, 3] {
        let reference = reference(ws, &[]);
        // The loss falls and the tied weight moved: the test trains something.
        assert!(reference.0[STEPS - 1] < reference.0[0], "{:?}", reference.0);
        let run = fsdp(ws, ShardingStrategy::FullShard, &[]);
        assert_parity(&run, &reference, &format!("FULL_SHARD ws {ws}"));
        assert!(run.params.contains_key("wte.weight"));
        assert!(!run.params.contains_key("emb.weight") && !run.params.contains_key("head.weight"));
    }
    let reference = reference(2, &[]);
    let run = fsdp(2, ShardingStrategy::ShardGradOp, &[]);
    assert_parity(&run, &reference, "SHARD_GRAD_OP ws 2");
}

#[test]
fn tied_weight_gets_the_sum_of_both_uses_on_every_element() {
    // One backward: the tied weight's gradient equals plain Candle's, which sums the embedding's
    // (rows of the ids only) and the head's (every row) contributions.
    let ws = 3;
    let data = batches(PER_RANK * ws);
    let (ids, mask, y) = data[0].clone();
    let varmap = VarMap::new();
    let vb = seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu);
    let mut modules: HashMap<String, Box<dyn UnitModule>> = HashMap::new();
    for (prefix, specs) in layout() {
        for s in specs {
            modules.insert(s.name.clone(), (s.ctor)(vb.pp(prefix)).unwrap());
        }
    }
    let mut call = |name: &str, xs: &[&Tensor]| -> candle_fsdp::Result<Vec<Tensor>> {
        let xs: Vec<Tensor> = xs.iter().map(|&x| x.clone()).collect();
        Ok(modules[name].forward_t(&xs, true)?)
    };
    let l = loss(&program(&mut call, &ids, &mask).unwrap(), &y).unwrap();
    let grads = l.backward().unwrap();
    let w = varmap.data().lock().unwrap()["wte.weight"].clone();
    let want = grads
        .get(w.as_tensor())
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let got = run_ranks_ok(ws, ThreadGroupConfig::default(), move |pg| {
        let r = pg.rank();
        let mut model = builder(pg.clone(), ShardingStrategy::FullShard).build()?;
        let rows = |t: &Tensor| t.narrow(0, r * PER_RANK, PER_RANK);
        let (ids, mask, y) = (rows(&ids)?, rows(&mask)?, rows(&y)?);
        let logits = model.forward_with(|f| program(&mut |n, xs| f.call(n, xs), &ids, &mask))?;
        model.backward(&loss(&logits, &y)?)?;
        // Reassemble the full gradient of unit "wte" from every rank's gradient shard.
        let v = model.shards().find(|v| v.unit_name == "wte").unwrap();
        let shard = v.grad.unwrap().to_vec1::<f32>()?;
        let all = pg.all_reduce_f32s(
            {
                let mut full = vec![0f32; v.layout.padded_numel];
                let range = v.layout.shard_range(r);
                full[range].copy_from_slice(&shard);
                full
            },
            candle_fsdp::comm::ReduceOp::Sum,
        )?;
        let p = &v.layout.params[0];
        assert!(v.grad_present.iter().all(|&p| p));
        Ok(all[p.offset..p.offset + p.numel].to_vec())
    })
    .unwrap();
    for g in got {
        let e = max_rel_err(&g, &want);
        assert!(e < 1e-5, "tied gradient differs by {e}");
        // Every row of the vocabulary has a gradient (the head's), not only the ids' rows.
        for row in g.chunks(DIM) {
            assert!(row.iter().any(|v| *v != 0.0));
        }
    }
}

#[test]
fn frozen_parameters_stay_unchanged_get_no_state_and_are_not_reduced() {
    let frozen = ["pair.b.", "blk.fc.bias"];
    let reference = reference(2, &frozen);
    let run = fsdp(2, ShardingStrategy::FullShard, &["pair.b.*", "blk.fc.bias"]);
    assert_parity(&run, &reference, "frozen ws 2");
    // Unchanged: equal to the initial values (plain Candle never stepped them either, and its
    // initial values are FSDP's).
    let varmap = VarMap::new();
    let vb = seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu);
    for (prefix, specs) in layout() {
        for s in specs {
            (s.ctor)(vb.pp(prefix)).unwrap();
        }
    }
    let init = varmap_values(&varmap).unwrap();
    for name in ["pair.b.weight", "pair.b.bias", "blk.fc.bias"] {
        assert_eq!(run.params[name], init[name], "{name} changed");
    }
    assert_ne!(run.params["pair.a.weight"], init["pair.a.weight"]);
    // No optimizer state for the frozen twins, state for the rest.
    assert_eq!(run.opt_state.get("pair[frozen]"), Some(&false));
    assert_eq!(run.opt_state.get("blk[frozen]"), Some(&false));
    assert_eq!(run.opt_state.get("pair"), Some(&true));
    // Device-resident state: two f32 moments of the trainable shards only.
    assert_eq!(run.opt_bytes, 8 * run.trainable_shard_numel);
    // Their share of reduce-scatter bytes is not sent: at least their f32 bytes less per step.
    let all = fsdp(2, ShardingStrategy::FullShard, &[]);
    let frozen_bytes = 4 * (DIM * DIM + DIM + DIM) as u64;
    let saved = all.reduce_scatter_bytes - run.reduce_scatter_bytes;
    assert!(
        saved >= STEPS as u64 * frozen_bytes,
        "reduce-scatter bytes {} with frozen parameters vs {} without: {saved} saved, expected \
         at least {}",
        run.reduce_scatter_bytes,
        all.reduce_scatter_bytes,
        STEPS as u64 * frozen_bytes
    );
}

#[test]
fn build_errors_name_the_problem() {
    run_ranks_ok(1, ThreadGroupConfig::default(), |pg| {
        // Two units that both create emb.weight (the head reaches into the embedding's name).
        let e = FsdpModel::builder(pg.clone(), FsdpConfig::default())
            .unit("emb", |vb| candle_nn::embedding(10, 4, vb))
            .unit("head", |vb| {
                Ok(Linear::new(vb.root().pp("emb").get((10, 4), "weight")?, None))
            })
            .build()
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("units emb and head both create a tensor named emb.weight"),
            "{e}"
        );
        assert!(e.contains("group"), "{e}");
        // Members of a group that ask for one tensor with two shapes.
        let e = FsdpModel::builder(pg.clone(), FsdpConfig::default())
            .group(
                "wte",
                [
                    UnitSpec::new("emb", |vb| candle_nn::embedding(10, 4, vb)),
                    UnitSpec::new("head", |vb| {
                        Ok(Linear::new(vb.get((4, 10), "weight")?, None))
                    }),
                ],
            )
            .build()
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("units emb and head of group wte both ask for wte.weight but with different shapes: [10, 4] and [4, 10]"),
            "{e}"
        );
        // A freeze pattern that matches nothing.
        let e = FsdpModel::builder(pg.clone(), FsdpConfig::default())
            .unit("fc", |vb| candle_nn::linear(4, 4, vb))
            .freeze(["fc.wieght"])
            .build()
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("freeze pattern \"fc.wieght\" matches no parameter; the parameters are: fc.bias, fc.weight"),
            "{e}"
        );
        // A call of a unit that does not exist, and call1 of a two-output unit.
        let mut m = builder(pg.clone(), ShardingStrategy::FullShard).build()?;
        let ids = Tensor::zeros((1, T), DType::U32, &Device::Cpu)?;
        let e = m
            .forward_with(|f| f.call1("embed", &ids))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no unit named \"embed\"; the model's units are: emb, head, pair, blk, norm"), "{e}");
        let e = m
            .forward_with(|f| {
                let h = f.call1("emb", &ids)?;
                let mask = Tensor::ones((1, T, 1), DType::F32, &Device::Cpu)?;
                f.call1("pair", &Tensor::cat(&[&h, &mask.broadcast_as((1, T, DIM))?], 0)?)
            })
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unit pair") && e.contains("pair takes (hidden, mask), found 1 inputs"),
            "{e}"
        );
        // forward(x) refuses a model with a group.
        let e = m.forward(&ids).unwrap_err().to_string();
        assert!(e.contains("forward_with"), "{e}");
        Ok(())
    })
    .unwrap();
}

/// The case: Linear(4,6) → candle-nn's fused layer_norm → Linear(6,3). Plain Candle
/// gives the first linear and the norm a zero gradient silently; FSDP refuses, naming the unit.
/// With the crate's differentiable layer_norm the same model trains.
#[test]
fn an_operation_without_backward_is_an_error_naming_the_unit() {
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
        let build = |fused: bool| {
            FsdpModel::builder(pg.clone(), FsdpConfig::default())
                .unit("fc1", |vb| candle_nn::linear(4, 6, vb))
                .unit_spec(if fused {
                    UnitSpec::new("norm", |vb| candle_nn::layer_norm(6, 1e-5, vb))
                } else {
                    UnitSpec::new("norm", |vb| candle_fsdp::nn::layer_norm(6, 1e-5, vb))
                })
                .unit("fc2", |vb| candle_nn::linear(6, 3, vb))
                .build()
        };
        let mut m = build(true)?;
        let e = m.forward(&x).unwrap_err().to_string();
        assert!(e.contains("unit norm") && e.contains("no backward"), "{e}");
        assert!(e.contains("candle_fsdp::nn::layer_norm"), "{e}");
        let mut m = build(false)?;
        let y = m.forward(&x)?;
        m.backward(&(y.sqr()?.sum_all()?))?;
        for v in m.shards() {
            let g = v.grad.unwrap().sqr()?.sum_all()?.to_scalar::<f32>()?;
            assert!(g > 0.0, "unit {} got no gradient", v.unit_name);
        }

        // An output connected to a parameter but not to the input: caught in backward.
        struct Half(Tensor);
        impl Module for Half {
            fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
                let w = Tensor::ones(6, DType::F32, x.device())?;
                let b = Tensor::zeros(6, DType::F32, x.device())?;
                candle_nn::ops::layer_norm(x, &w, &b, 1e-5)?.broadcast_add(&self.0)
            }
        }
        let mut m = FsdpModel::builder(pg.clone(), FsdpConfig::default())
            .unit("fc1", |vb| candle_nn::linear(4, 6, vb))
            .unit("half", |vb| Ok(Half(vb.get(6, "shift")?)))
            .build()?;
        let y = m.forward(&x)?;
        let e = m.backward(&y.sum_all()?).unwrap_err().to_string();
        assert!(
            e.contains("input 0 of unit half carries gradient") && e.contains("got none"),
            "{e}"
        );
        // The model is usable again after the error.
        m.forward_eval(&x)?;
        Ok(())
    })
    .unwrap();
}

#[test]
fn eval_forward_with_matches_the_training_forward_values() {
    let ws = 2;
    let data = batches(PER_RANK * ws);
    run_ranks_ok(ws, ThreadGroupConfig::default(), move |pg| {
        let r = pg.rank();
        let mut model = builder(pg.clone(), ShardingStrategy::FullShard).build()?;
        let (ids, mask, _) = &data[0];
        let rows = |t: &Tensor| t.narrow(0, r * PER_RANK, PER_RANK);
        let (ids, mask) = (rows(ids)?, rows(mask)?);
        let eval = model.forward_eval_with(|f| {
            assert!(!f.is_training());
            program(&mut |n, xs| f.call(n, xs), &ids, &mask)
        })?;
        let train = model.forward_with(|f| program(&mut |n, xs| f.call(n, xs), &ids, &mask))?;
        model.discard_forward();
        let (a, b) = (
            eval.flatten_all()?.to_vec1::<f32>()?,
            train.flatten_all()?.to_vec1::<f32>()?,
        );
        assert_eq!(a, b);
        assert!(eval
            .max_keepdim(D::Minus1)?
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .all(|v| v.is_finite()));
        Ok(())
    })
    .unwrap();
}

/// A model with a tied group and frozen twins saves at world size 2 and loads at world size 3
/// bit-exactly, optimizer state included (none for the frozen twins).
#[test]
fn tied_and_frozen_checkpoint_reshards_across_world_sizes() {
    use candle_fsdp::checkpoint::{load_sharded, save_sharded, TrainState};
    let dir = std::env::temp_dir().join(format!("fsdp-any-forward-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let freeze = ["pair.b.*"];
    let data = batches(PER_RANK * 2);
    let saved_dir = dir.clone();
    let saved = run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
        let r = pg.rank();
        let mut model = builder(pg.clone(), ShardingStrategy::FullShard)
            .freeze(freeze)
            .build()?;
        let mut opt = AdamW::new(AdamWConfig {
            lr: LR,
            ..Default::default()
        });
        for (ids, mask, y) in data.iter().take(2) {
            let rows = |t: &Tensor| t.narrow(0, r * PER_RANK, PER_RANK);
            let (ids, mask, y) = (rows(ids)?, rows(mask)?, rows(y)?);
            let logits =
                model.forward_with(|f| program(&mut |n, xs| f.call(n, xs), &ids, &mask))?;
            model.backward(&loss(&logits, &y)?)?;
            opt.step(&mut model)?;
            model.zero_grad();
        }
        let state = TrainState {
            step: 2,
            ..Default::default()
        };
        let path = save_sharded(&saved_dir, &model, &opt, &state, 0)?;
        let params = model.gather_full_params(false)?.unwrap();
        Ok((path, params))
    })
    .unwrap()
    .remove(0);
    let (path, params) = saved;
    let loaded = run_ranks_ok(3, ThreadGroupConfig::default(), move |pg| {
        let mut model = builder(pg.clone(), ShardingStrategy::FullShard)
            .freeze(freeze)
            .build()?;
        let mut opt = AdamW::new(AdamWConfig::default());
        load_sharded(&path, &mut model, &mut opt)?;
        let state = opt.state()?;
        for (v, u) in model.shards().zip(&state.units) {
            let zeros = u.buffers.values().all(|b| b.iter().all(|x| *x == 0.0));
            assert!(!v.frozen || zeros, "unit {}", v.unit_name);
            assert!(v.frozen || !zeros, "unit {}", v.unit_name);
        }

        Ok(model.gather_full_params(false)?.unwrap())
    })
    .unwrap()
    .remove(0);
    assert_eq!(params.len(), loaded.len());
    for ((n1, t1), (n2, t2)) in params.iter().zip(&loaded) {
        assert_eq!(n1, n2);
        let (a, b) = (
            t1.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            t2.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        assert!(a == b, "{n1} differs after resharding 2 -> 3");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The same kinds of forward on a GPT written the way Candle users write it
/// (tests/common/user_gpt.rs), trained against plain Candle on the global batch at world sizes 2
/// and 3: a universal transformer, units unused or not called in some steps, integer inputs and
/// view outputs, a unit returning its weight, a rank-dependent depth; and the gathered
/// `FullModel` against the sharded eval forward.
mod users_gpt {
    use std::sync::Arc;

    use candle_core::{DType, Device, Module, Tensor};
    use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
    use candle_fsdp::init::{seeded_var_builder, varmap_values};
    use candle_fsdp::unit::{UnitModule, UnitSpec};
    use candle_fsdp::{FsdpConfig, FsdpModel};
    use candle_nn::{Linear, Optimizer, VarBuilder, VarMap};

    use crate::user_gpt::*;

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
    fn a_residual_across_units_and_a_unit_called_three_times_match_plain_candle() {
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
            l[2].1[0] = UnitSpec::multi("blk", block(BlockCfg::default()))
                .with_activation_checkpointing(true);
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
    fn units_unused_or_not_called_in_some_steps_get_no_update_like_plain_candle() {
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
    fn integer_inputs_views_and_an_unused_second_output_match_plain_candle() {
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
    fn a_weight_returning_unit_one_input_twice_and_one_output_twice_match_plain_candle() {
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

    /// A rank-dependent depth (rank 0 applies "a" twice, rank 1 once: an early exit taken on one
    /// rank). The collectives still match (a second call of a present unit gathers nothing), and the
    /// result must be the gradient of the mean of the ranks' losses: compared with plain Candle.
    #[test]
    fn a_rank_dependent_depth_matches_plain_candle() {
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

    #[test]
    fn the_gathered_full_model_gives_the_sharded_eval_forwards_loss() {
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
}
