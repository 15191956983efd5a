//! FSDP training against plain single-process candle-nn training on the same global batches,
//! on the ranks of any [`Launcher`] (threads in `fsdp_parity.rs`, MPI processes in `mpi.rs`).
#![allow(dead_code)]

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use candle_fsdp::comm::{ProcessGroupExt, ReduceOp};
use candle_fsdp::init::{seeded_var_builder, varmap_values};
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::optim::{AdamW, AdamWConfig, Sgd, SgdConfig, ShardedOptimizer};
use candle_fsdp::{BackwardPrefetch, FsdpConfig, FsdpModel, ShardingStrategy};
use candle_nn::{Optimizer, VarMap};

use crate::common::*;

pub const SEED: u64 = 1234;
const STEPS: usize = 5;
const PER_RANK: usize = 6;

#[derive(Clone, Copy, Debug)]
pub enum Opt {
    Adam,
    SgdMomentum,
}

fn adam_cfg() -> AdamWConfig {
    AdamWConfig {
        lr: 1e-2,
        weight_decay: 0.01,
        ..Default::default()
    }
}

fn sgd_cfg() -> SgdConfig {
    SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 1e-3,
        ..Default::default()
    }
}

/// Plain Candle on the CPU: losses per step and final parameters by name.
pub fn reference(ws: usize, opt: Opt) -> (Vec<f32>, HashMap<String, Vec<f32>>) {
    reference_on(&Device::Cpu, ws, opt)
}

/// Plain Candle on `device`: losses per step and final parameters by name.
pub fn reference_on(device: &Device, ws: usize, opt: Opt) -> (Vec<f32>, HashMap<String, Vec<f32>>) {
    let varmap = VarMap::new();
    let vb = seeded_var_builder(&varmap, SEED, DType::F32, device);
    let model = reference_model(vb).unwrap();
    let vars = varmap.all_vars();
    let mut adam = candle_nn::AdamW::new(
        vars.clone(),
        candle_nn::ParamsAdamW {
            lr: adam_cfg().lr,
            weight_decay: adam_cfg().weight_decay,
            ..Default::default()
        },
    )
    .unwrap();
    let mut bufs: Vec<Option<Tensor>> = vec![None; vars.len()];
    let mut losses = Vec::new();
    for (x, y) in batches(STEPS, PER_RANK * ws, 99) {
        let (x, y) = (x.to_device(device).unwrap(), y.to_device(device).unwrap());
        let logits = reference_forward(&model, &x).unwrap();
        let loss = candle_nn::loss::cross_entropy(&logits, &y).unwrap();
        losses.push(loss.to_scalar::<f32>().unwrap());
        let grads = loss.backward().unwrap();
        match opt {
            Opt::Adam => adam.step(&grads).unwrap(),
            Opt::SgdMomentum => sgd_momentum_reference(&vars, &grads, &mut bufs),
        }
    }
    (losses, varmap_values(&varmap).unwrap())
}

/// torch.optim.SGD with momentum and weight decay, written with Candle tensor ops.
fn sgd_momentum_reference(
    vars: &[Var],
    grads: &candle_core::backprop::GradStore,
    bufs: &mut [Option<Tensor>],
) {
    let c = sgd_cfg();
    for (v, b) in vars.iter().zip(bufs.iter_mut()) {
        let Some(g) = grads.get(v.as_tensor()) else {
            continue;
        };
        let d = (g + (v.as_tensor() * c.weight_decay).unwrap()).unwrap();
        let nb = match b.take() {
            None => d,
            Some(old) => {
                ((old * c.momentum).unwrap() + (d * (1.0 - c.dampening)).unwrap()).unwrap()
            }
        };
        v.set(&(v.as_tensor() - (&nb * c.lr).unwrap()).unwrap())
            .unwrap();
        *b = Some(nb);
    }
}

/// FSDP at world size `ws`: rank-averaged losses per step and final parameters by name.
fn fsdp(
    launcher: &Launcher,
    strategy: ShardingStrategy,
    opt: Opt,
    prefetch: bool,
) -> (Vec<f32>, HashMap<String, Vec<f32>>) {
    let ws = launcher.world_size();
    let data = batches(STEPS, PER_RANK * ws, 99);
    let results = launch(launcher, |pg| {
        let rank = pg.rank();
        let config = FsdpConfig {
            sharding_strategy: strategy,
            seed: SEED,
            forward_prefetch: prefetch,
            backward_prefetch: if prefetch {
                BackwardPrefetch::BackwardPre
            } else {
                BackwardPrefetch::None
            },
            device: pg.device().clone(),
            ..Default::default()
        };
        let mut builder = FsdpModel::builder(pg.clone(), config);
        for u in units() {
            builder = builder.unit_spec(u);
        }
        let mut model = builder.build()?;
        let mut optim: Box<dyn ShardedOptimizer> = match opt {
            Opt::Adam => Box::new(AdamW::new(adam_cfg())),
            Opt::SgdMomentum => Box::new(Sgd::new(sgd_cfg())),
        };
        let mut losses = Vec::new();
        for (x, y) in &data {
            let x = x
                .narrow(0, rank * PER_RANK, PER_RANK)?
                .to_device(pg.device())?;
            let y = y
                .narrow(0, rank * PER_RANK, PER_RANK)?
                .to_device(pg.device())?;
            let logits = model.forward(&x)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
            model.backward(&loss)?;
            optim.step(&mut model)?;
            model.zero_grad();
            let l = pg.all_reduce_f32s(vec![loss.to_scalar::<f32>()?], ReduceOp::Avg)?;
            losses.push(l[0]);
        }
        let params = model.gather_full_params(false)?.expect("all ranks gather");
        let params: HashMap<String, Vec<f32>> =
            params.into_iter().map(|(k, t)| (k, to_vec(&t))).collect();
        Ok((losses, params))
    })
    .expect("FSDP run");
    // Every rank (of this process) gathered the same parameters and saw the same averaged losses.
    for r in &results[1..] {
        assert_eq!(r.0, results[0].0);
        assert_eq!(r.1, results[0].1);
    }
    results.into_iter().next().unwrap()
}

/// Trains on the ranks of `launcher` and checks losses and final parameters against plain
/// Candle (relative error ≤ 1e-5).
pub fn check(launcher: &Launcher, strategy: ShardingStrategy, opt: Opt, prefetch: bool) {
    check_against(&Device::Cpu, launcher, strategy, opt, prefetch)
}

/// [`check`] against plain Candle on `reference_device` (the GPU tests compare FSDP on a GPU
/// with plain Candle CUDA).
pub fn check_against(
    reference_device: &Device,
    launcher: &Launcher,
    strategy: ShardingStrategy,
    opt: Opt,
    prefetch: bool,
) {
    let ws = launcher.world_size();
    let (ref_losses, ref_params) = reference_on(reference_device, ws, opt);
    let (losses, params) = fsdp(launcher, strategy, opt, prefetch);
    assert_eq!(losses.len(), STEPS);
    for (step, (a, b)) in losses.iter().zip(&ref_losses).enumerate() {
        let rel = ((a - b) / b).abs();
        assert!(
            rel <= 1e-5,
            "ws {ws} {strategy:?} {opt:?}: loss at step {step}: fsdp {a} vs reference {b} (rel {rel:e})"
        );
    }
    // Training did something: the loss moved.
    assert_ne!(ref_losses[0], ref_losses[STEPS - 1]);
    let mut names: Vec<_> = ref_params.keys().cloned().collect();
    names.sort();
    let mut fsdp_names: Vec<_> = params.keys().cloned().collect();
    fsdp_names.sort();
    assert_eq!(names, fsdp_names, "parameter names");
    for name in names {
        let rel = rel_err(&params[&name], &ref_params[&name]);
        assert!(
            rel <= 1e-5,
            "ws {ws} {strategy:?} {opt:?}: parameter {name}: relative error {rel:e}"
        );
    }
}
