//! Free and refill under FULL_SHARD: a unit's parameters are freed after its forward (their
//! storage emptied in place under the live autograd graph) and refilled by an all-gather just
//! before its backward. The gradients must be bit-identical to plain Candle's, with activation
//! checkpointing off (refill) and on (recompute), for the layer kinds users build from.

use std::collections::HashMap;

use candle_core::{DType, Device, Module, ModuleT, Tensor, D};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::init::seeded_var_builder;
use candle_fsdp::unit::UnitSpec;
use candle_fsdp::{FsdpConfig, FsdpModel, MixedPrecision, ShardingStrategy};
use candle_nn::{Dropout, Linear, VarBuilder, VarMap};

const SEED: u64 = 7;

/// One test case: units (the first is the unit under test, never the last, so FULL_SHARD frees
/// it), an input, and the policy.
struct Case {
    units: fn() -> Vec<UnitSpec>,
    input: fn() -> Tensor,
    policy: MixedPrecision,
}

/// Loss: a fixed weighting of the output (in f32), so every output element gets its own
/// gradient.
fn loss(out: &Tensor) -> candle_core::Result<Tensor> {
    let out = out.to_dtype(DType::F32)?;
    let w = Tensor::arange(0f32, out.elem_count() as f32, out.device())?
        .affine(0.01, -0.2)?
        .reshape(out.shape())?;
    (out * w)?.sum_all()
}

/// Gradients of every parameter by name from an FSDP model at `world_size` (shards put back
/// together), with the unit under test checkpointed or not.
fn fsdp_grads(
    case: &Case,
    world_size: usize,
    strategy: ShardingStrategy,
    checkpoint: bool,
) -> HashMap<String, Vec<f32>> {
    let per_rank = run_ranks_ok(world_size, ThreadGroupConfig::default(), |pg| {
        let config = FsdpConfig {
            seed: SEED,
            sharding_strategy: strategy,
            mixed_precision: case.policy,
            ..FsdpConfig::default()
        };
        let mut specs = (case.units)();
        specs[0] = specs[0].clone().with_activation_checkpointing(checkpoint);
        let mut model = FsdpModel::builder(pg, config).units(specs).build()?;
        let out = model.forward(&(case.input)())?;
        model.backward(&loss(&out)?)?;
        let mut grads = Vec::new();
        for v in model.shards() {
            let g = match v.grad {
                Some(g) => g.to_vec1::<f32>()?,
                None => vec![0.0; v.layout.shard_numel],
            };
            grads.push((v.layout.clone(), v.shard_index, g));
        }
        Ok(grads)
    })
    .unwrap();
    let mut out = HashMap::new();
    for k in 0..per_rank[0].len() {
        let layout = &per_rank[0][k].0;
        let mut flat = vec![0.0f32; layout.padded_numel];
        for rank in &per_rank {
            let (l, idx, g) = &rank[k];
            let r = l.shard_range(*idx);
            if l.world_size == 1 {
                flat.copy_from_slice(g);
            } else {
                flat[r].copy_from_slice(g);
            }
        }
        for p in &layout.params {
            out.insert(p.name.clone(), flat[p.offset..p.offset + p.numel].to_vec());
        }
    }
    out
}

/// The same model in plain single-process Candle (same initial values), its gradients by name.
fn plain_grads(case: &Case) -> HashMap<String, Vec<f32>> {
    let varmap = VarMap::new();
    let vb: VarBuilder = seeded_var_builder(&varmap, SEED, case.policy.param_dtype, &Device::Cpu);
    let modules: Vec<Box<dyn candle_fsdp::unit::UnitModule>> = (case.units)()
        .iter()
        .map(|u| (u.ctor)(vb.pp(&u.name)).unwrap())
        .collect();
    let mut h = (case.input)();
    if h.dtype().is_float() {
        h = h.to_dtype(case.policy.param_dtype).unwrap();
    }
    for m in &modules {
        h = m.forward1(&h, true).unwrap();
    }
    let grads = loss(&h).unwrap().backward().unwrap();
    let vars = varmap.data().lock().unwrap().clone();
    vars.iter()
        .map(|(name, var)| {
            let g = grads
                .get(var.as_tensor())
                .map(|g| {
                    g.to_dtype(DType::F32)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                })
                .unwrap_or_else(|| vec![0.0; var.elem_count()]);
            (name.clone(), g)
        })
        .collect()
}

fn assert_bitwise(what: &str, a: &HashMap<String, Vec<f32>>, b: &HashMap<String, Vec<f32>>) {
    assert_eq!(a.len(), b.len(), "{what}: parameter sets differ");
    for (name, ga) in a {
        let gb = &b[name];
        assert!(
            ga.iter().any(|v| *v != 0.0),
            "{what}: {name} got no gradient"
        );
        let same = ga.iter().zip(gb).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(
            same,
            "{what}: {name} differs: {:?} vs {:?}",
            &ga[..4],
            &gb[..4]
        );
    }
}

/// Every case: FULL_SHARD (refill) and checkpointed units at world size 1 equal plain Candle
/// bit for bit; at world size 2 FULL_SHARD equals SHARD_GRAD_OP (which never frees) bit for bit.
fn check(case: Case) {
    let plain = plain_grads(&case);
    for checkpoint in [false, true] {
        let what = format!("checkpoint={checkpoint}");
        let ws1 = fsdp_grads(&case, 1, ShardingStrategy::FullShard, checkpoint);
        assert_bitwise(&format!("{what} ws 1 vs plain Candle"), &ws1, &plain);
        let full = fsdp_grads(&case, 2, ShardingStrategy::FullShard, checkpoint);
        let keep = fsdp_grads(&case, 2, ShardingStrategy::ShardGradOp, checkpoint);
        assert_bitwise(
            &format!("{what} ws 2 FULL_SHARD vs SHARD_GRAD_OP"),
            &full,
            &keep,
        );
    }
}

fn head(n_in: usize) -> UnitSpec {
    UnitSpec::new("head", move |vb| candle_nn::linear(n_in, 3, vb))
}

fn x_2d(n: usize) -> Tensor {
    Tensor::arange(0f32, (4 * n) as f32, &Device::Cpu)
        .unwrap()
        .affine(0.37, -1.1)
        .unwrap()
        .sin()
        .unwrap()
        .reshape((4, n))
        .unwrap()
}

#[test]
fn linear_refill_is_bit_identical() {
    check(Case {
        units: || {
            vec![
                UnitSpec::new("a", |vb| {
                    Ok(candle_nn::seq()
                        .add(candle_nn::linear(8, 16, vb.pp("l1"))?)
                        .add(candle_nn::Activation::Relu)
                        .add(candle_nn::linear(16, 16, vb.pp("l2"))?))
                }),
                head(16),
            ]
        },
        input: || x_2d(8),
        policy: MixedPrecision::full_f32(),
    });
}

#[test]
fn bf16_refill_is_bit_identical() {
    check(Case {
        units: || {
            vec![
                UnitSpec::new("a", |vb| candle_nn::linear(8, 16, vb)),
                head(16),
            ]
        },
        input: || x_2d(8),
        policy: MixedPrecision::bf16(),
    });
}

#[test]
fn conv2d_refill_is_bit_identical() {
    check(Case {
        units: || {
            vec![
                UnitSpec::new("conv", |vb| {
                    let c = candle_nn::conv2d(2, 3, 3, Default::default(), vb)?;
                    Ok(candle_nn::func(move |x| {
                        c.forward(x)?.relu()?.flatten_from(1)
                    }))
                }),
                head(3 * 4 * 4),
            ]
        },
        input: || {
            Tensor::arange(0f32, 4. * 2. * 36., &Device::Cpu)
                .unwrap()
                .affine(0.05, -1.0)
                .unwrap()
                .cos()
                .unwrap()
                .reshape((4, 2, 6, 6))
                .unwrap()
        },
        policy: MixedPrecision::full_f32(),
    });
}

#[test]
fn embedding_refill_is_bit_identical() {
    check(Case {
        units: || {
            vec![
                UnitSpec::new("emb", |vb| {
                    let e = candle_nn::embedding(11, 6, vb)?;
                    Ok(candle_nn::func(move |ids| e.forward(ids)?.mean(D::Minus2)))
                }),
                head(6),
            ]
        },
        input: || {
            Tensor::new(
                &[[1u32, 4, 4, 9], [0, 10, 3, 3], [7, 7, 7, 2], [5, 6, 8, 1]],
                &Device::Cpu,
            )
            .unwrap()
        },
        policy: MixedPrecision::full_f32(),
    });
}

/// y = relu(x Wᵀ) Wᵀ: one parameter used twice in a unit.
struct Twice(Linear);

impl Module for Twice {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.0.forward(&self.0.forward(x)?.relu()?)
    }
}

#[test]
fn a_parameter_used_twice_refills_bit_identically() {
    check(Case {
        units: || {
            vec![
                UnitSpec::new("twice", |vb| Ok(Twice(candle_nn::linear(8, 8, vb)?))),
                head(8),
            ]
        },
        input: || x_2d(8),
        policy: MixedPrecision::full_f32(),
    });
}

/// Linear(4, 64, no bias) then dropout(0.5): a random forward.
struct LinDrop(Linear, Dropout);

impl ModuleT for LinDrop {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        self.1.forward_t(&self.0.forward(x)?, train)
    }
}

/// The dropout unit's output and gradient (world size 1), with `options` applied to its spec.
fn dropout_step(options: fn(UnitSpec) -> UnitSpec) -> (Vec<f32>, Vec<f32>) {
    run_ranks_ok(1, ThreadGroupConfig::default(), |pg| {
        let drop = options(UnitSpec::new("drop", |vb| {
            Ok(LinDrop(
                candle_nn::linear_no_bias(4, 64, vb)?,
                Dropout::new(0.5),
            ))
        }));
        let mut m = FsdpModel::builder(pg, FsdpConfig::default())
            .unit_spec(drop)
            .unit("id", |_vb| Ok(candle_nn::func(|x| Ok(x.clone()))))
            .build()?;
        let x = Tensor::ones((1, 4), DType::F32, &Device::Cpu)?;
        let out = m.forward(&x)?;
        m.backward(&out.sum_all()?)?;
        let out: Vec<f32> = out.flatten_all()?.to_vec1()?;
        let grad = m.shard(0).unwrap().grad.unwrap().to_vec1::<f32>()?;
        Ok((out, grad))
    })
    .unwrap()
    .remove(0)
}

/// d sum(dropout(W·1)) / dW[i, :] = mask_i / (1 - p): 2 exactly where the forward kept row i
/// (and then out[i] ≠ 0), 0 elsewhere. True when the gradient is that of the forward that ran.
fn gradient_matches_forward(out: &[f32], grad: &[f32]) -> bool {
    out.iter().enumerate().all(|(i, o)| {
        let row = &grad[i * 4..i * 4 + 4];
        if *o != 0.0 {
            row.iter().all(|g| (g - 2.0).abs() < 1e-6)
        } else {
            row.iter().all(|g| *g == 0.0)
        }
    })
}

#[test]
fn dropout_trains_correctly_without_a_flag() {
    // FULL_SHARD with refill keeps the forward's graph (and its mask): no flag needed. Keeping
    // the unit unsharded (`reshard_after_forward(false)`) keeps it too.
    let plain: fn(UnitSpec) -> UnitSpec = |s| s;
    let kept: fn(UnitSpec) -> UnitSpec = |s| s.with_reshard_after_forward(false);
    for options in [plain, kept] {
        let (out, grad) = dropout_step(options);
        let kept = out.iter().filter(|o| **o != 0.0).count();
        assert!(kept > 0 && kept < 64, "dropout kept {kept} of 64");
        assert!(
            gradient_matches_forward(&out, &grad),
            "out {out:?}\ngrad {grad:?}"
        );
    }
    // With activation checkpointing the recompute draws another mask (the documented reason not
    // to checkpoint a random unit): the gradient is not the forward's (all 64 rows agreeing by
    // chance has probability 2^-64).
    let (out, grad) = dropout_step(|s| s.with_activation_checkpointing(true));
    assert!(!gradient_matches_forward(&out, &grad));
}

/// Checkpointing asked for on every unit, the last included: the last unit's output feeds the
/// loss, so it is not checkpointed, and the gradients equal those without checkpointing.
#[test]
fn checkpointing_every_unit_including_the_last_gives_the_same_gradients() {
    let grads = |checkpoint: bool| {
        run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
            let config = FsdpConfig {
                seed: SEED,
                ..FsdpConfig::default()
            };
            let specs = [8, 16, 16, 3].windows(2).enumerate().map(|(i, w)| {
                let (a, b) = (w[0], w[1]);
                UnitSpec::new(format!("l{i}"), move |vb| candle_nn::linear(a, b, vb))
                    .with_activation_checkpointing(checkpoint)
            });
            let mut model = FsdpModel::builder(pg, config).units(specs).build()?;
            let out = model.forward(&x_2d(8))?;
            model.backward(&loss(&out)?)?;
            model
                .shards()
                .map(|v| {
                    Ok(v.grad
                        .expect("every unit has a gradient")
                        .to_vec1::<f32>()?)
                })
                .collect::<candle_fsdp::Result<Vec<_>>>()
        })
        .unwrap()
    };
    let (on, off) = (grads(true), grads(false));
    assert_eq!(on, off);
    assert!(on[0][0].iter().any(|g| *g != 0.0));
}
