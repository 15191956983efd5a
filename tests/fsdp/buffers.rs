//! Buffers keep their dtype (issue 11): a unit's buffers are served in their own
//! `buffer_dtype` and are the live variables the module updates in place, never a converted
//! copy; an error from a unit's forward names the unit.

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::unit::UnitSpec;
use candle_fsdp::{FsdpConfig, FsdpModel, MixedPrecision};
use candle_nn::{BatchNormConfig, Init, ModuleT, VarBuilder};

/// A module with one buffer `count` (a running statistic) that every forward increments in
/// place, and a parameter `w` that scales the input.
struct Counter {
    w: Tensor,
    count: Var,
}

impl Module for Counter {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let c = self.count.as_tensor();
        self.count.set(&(c + 1.0)?)?;
        x.broadcast_mul(&self.w)
    }
}

fn counter(vb: VarBuilder) -> candle_core::Result<Counter> {
    let w = vb.get_with_hints(1, "w", Init::Const(2.0))?;
    // Asked for in the VarBuilder's dtype (bf16 here), as candle-nn layers do.
    let count = vb.get_with_hints(1, "running_mean", Init::Const(0.0))?;
    Ok(Counter {
        w,
        count: Var::from_tensor(&count)?,
    })
}

fn bf16_params_f32_buffers() -> MixedPrecision {
    MixedPrecision {
        buffer_dtype: DType::F32,
        ..MixedPrecision::bf16()
    }
}

#[test]
fn a_buffer_is_served_in_its_own_dtype_and_updated_in_place() {
    let counts = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = FsdpModel::builder(pg, FsdpConfig::default())
            .unit_spec(
                UnitSpec::new("counter", counter).with_mixed_precision(bf16_params_f32_buffers()),
            )
            .build()?;
        let x = Tensor::ones((2, 1), DType::F32, &Device::Cpu)?;
        for _ in 0..3 {
            let y = m.forward(&x)?;
            assert_eq!(y.dtype(), DType::BF16);
            m.backward(&y.to_dtype(DType::F32)?.sum_all()?)?;
        }
        m.forward_eval(&x)?;
        let (name, var) = m.shard(0).unwrap().buffers[0].clone();
        assert_eq!(name, "counter.running_mean");
        assert_eq!(var.dtype(), DType::F32, "the buffer keeps its buffer_dtype");
        Ok(var.as_tensor().to_vec1::<f32>()?)
    })
    .unwrap();
    // Three training forwards and one eval forward, each counted in the model's own buffer
    // (a bf16 copy would have been counted and dropped: the buffer would still be 0).
    assert_eq!(counts, vec![vec![4.0f32]; 2]);
}

#[test]
fn a_candle_nn_batch_norm_unit_with_its_own_bf16_policy_trains_and_errors_name_the_unit() {
    let x = Tensor::new(&[[1.0f32, 2.0], [3.0, 5.0], [-1.0, 0.5]], &Device::Cpu).unwrap();
    // Its own bf16 policy (f32 buffers): candle-nn's BatchNorm computes bf16 inputs' statistics
    // in f32 and blends them into f32 running statistics, so it needs the buffers in their own
    // f32; they are the model's buffers, updated in place, equal to plain candle-nn's.
    let x1 = x.clone();
    let stats = run_ranks_ok(1, ThreadGroupConfig::default(), move |pg| {
        let mut m = FsdpModel::builder(pg, FsdpConfig::default())
            .unit_spec(
                UnitSpec::new("bn", |vb| {
                    candle_nn::batch_norm(2, BatchNormConfig::default(), vb)
                })
                .with_mixed_precision(MixedPrecision::bf16()),
            )
            .build()?;
        for _ in 0..2 {
            let y = m.forward(&x1)?;
            assert_eq!(y.dtype(), DType::BF16);
            m.backward(&y.to_dtype(DType::F32)?.sum_all()?)?;
        }
        let bufs = m.shard(0).unwrap().buffers.to_vec();
        Ok(bufs
            .iter()
            .map(|(n, v)| {
                (
                    n.clone(),
                    v.dtype(),
                    v.as_tensor().to_vec1::<f32>().unwrap(),
                )
            })
            .collect::<Vec<_>>())
    })
    .unwrap()
    .remove(0);
    let dev = &Device::Cpu;
    let bn = candle_nn::BatchNorm::new(
        2,
        Tensor::zeros(2, DType::F32, dev).unwrap(),
        Tensor::ones(2, DType::F32, dev).unwrap(),
        Tensor::ones(2, DType::BF16, dev).unwrap(),
        Tensor::zeros(2, DType::BF16, dev).unwrap(),
        1e-5,
    )
    .unwrap();
    let xb = x.to_dtype(DType::BF16).unwrap();
    for _ in 0..2 {
        bn.forward_t(&xb, true).unwrap();
    }
    let v = |t: &Tensor| t.to_vec1::<f32>().unwrap();
    assert_eq!(stats[0].0, "bn.running_mean");
    assert_eq!((stats[0].1, stats[1].1), (DType::F32, DType::F32));
    assert_eq!(stats[0].2, v(bn.running_mean()));
    assert_eq!(stats[1].2, v(bn.running_var()));
    assert!(stats[0].2.iter().all(|&m| m != 0.0), "updated: {stats:?}");
    // bf16 buffers: candle-nn's BatchNorm cannot blend f32 statistics into them; the error
    // says which unit.
    let e = run_ranks_ok(1, ThreadGroupConfig::default(), move |pg| {
        let bf16_buffers = MixedPrecision {
            buffer_dtype: DType::BF16,
            ..MixedPrecision::bf16()
        };
        let mut m = FsdpModel::builder(pg, FsdpConfig::default())
            .unit("pre", |vb| candle_nn::linear(2, 2, vb))
            .unit_spec(
                UnitSpec::new("bn", |vb| {
                    candle_nn::batch_norm(2, BatchNormConfig::default(), vb)
                })
                .with_mixed_precision(bf16_buffers),
            )
            .build()?;
        m.forward(&x).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("unit bn") && e.contains("dtype mismatch"), "{e}");
}
