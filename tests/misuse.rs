//! Misuse gets a clear error or a documented opt-out, never silently wrong gradients.

use std::sync::Arc;

use candle_core::{DType, Device, Module, ModuleT, Tensor};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::ProcessGroup;
use candle_fsdp::unit::UnitSpec;
use candle_fsdp::{FsdpConfig, FsdpModel};
use candle_nn::{Dropout, Linear};

/// Linear(4, 64, no bias) then dropout(0.5): a random forward.
struct LinDrop(Linear, Dropout);

impl ModuleT for LinDrop {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        self.1.forward_t(&self.0.forward(x)?, train)
    }
}

#[test]
fn a_random_unit_kept_unsharded_gets_the_gradient_of_its_own_forward() {
    // World size 1: the gradient shard is the whole flat gradient (W is 64 × 4 at offset 0).
    let (out, grad) = run_ranks_ok(1, ThreadGroupConfig::default(), |pg| {
        let mut m = FsdpModel::builder(pg, FsdpConfig::default())
            .unit_spec(
                UnitSpec::new("drop", |vb| {
                    Ok(LinDrop(
                        candle_nn::linear_no_bias(4, 64, vb)?,
                        Dropout::new(0.5),
                    ))
                })
                .with_reshard_after_forward(false),
            )
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
    .remove(0);
    // d sum(dropout(W·1)) / dW[i, :] = mask_i / (1 - p): non-zero exactly where the forward kept
    // row i (and then out[i] = 2·(W·1)[i] ≠ 0).
    let kept = out.iter().filter(|o| **o != 0.0).count();
    assert!(kept > 0 && kept < 64, "dropout kept {kept} of 64");
    for (i, o) in out.iter().enumerate() {
        let row = &grad[i * 4..i * 4 + 4];
        if *o != 0.0 {
            assert!(
                row.iter().all(|g| (g - 2.0).abs() < 1e-6),
                "row {i}: {row:?}"
            );
        } else {
            assert!(row.iter().all(|g| *g == 0.0), "row {i}: {row:?}");
        }
    }
}

fn three_linears(pg: Arc<dyn ProcessGroup>) -> candle_fsdp::Result<FsdpModel> {
    FsdpModel::builder(pg, FsdpConfig::default())
        .unit("a", |vb| candle_nn::linear(6, 6, vb))
        .unit("b", |vb| candle_nn::linear(6, 6, vb))
        .unit("c", |vb| candle_nn::linear(6, 6, vb))
        .build()
}

#[test]
fn a_second_training_forward_before_backward_is_an_error_unless_discarded() {
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = three_linears(pg)?;
        let x = Tensor::ones((2, 6), DType::F32, &Device::Cpu)?;
        let _first = m.forward(&x)?;
        let e = m.forward(&x).unwrap_err().to_string();
        assert!(
            e.contains("not back-propagated") && e.contains("discard_forward"),
            "{e}"
        );
        m.discard_forward();
        let y = m.forward(&x)?;
        m.backward(&y.sum_all()?)?;
        Ok(())
    })
    .unwrap();
}

#[test]
fn two_units_creating_the_same_tensor_name_are_rejected() {
    let e = run_ranks_ok(1, ThreadGroupConfig::default(), |pg| {
        FsdpModel::builder(pg, FsdpConfig::default())
            .unit("a", |vb| candle_nn::linear(4, 4, vb.pp("b")))
            .unit("a.b", |vb| candle_nn::linear(4, 4, vb))
            .build()
            .map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("units a and a.b") && e.contains("a.b.weight"),
        "{e}"
    );
}

#[test]
fn a_failed_forward_leaves_no_unit_counted_as_unsharded() {
    let stats = run_ranks_ok(1, ThreadGroupConfig::default(), |pg| {
        let mut m = three_linears(pg)?;
        let bad = Tensor::zeros((2, 5), DType::F32, &Device::Cpu)?;
        assert!(
            m.forward(&bad).is_err(),
            "a (2, 5) input cannot feed Linear(6, 6)"
        );
        let x = Tensor::ones((2, 6), DType::F32, &Device::Cpu)?;
        for _ in 0..3 {
            let y = m.forward(&x)?;
            m.backward(&y.sum_all()?)?;
        }
        Ok(m.memory_stats())
    })
    .unwrap()
    .remove(0);
    assert_eq!(
        (stats.unsharded_units, stats.unsharded_bytes),
        (0, 0),
        "{stats:?}"
    );
    assert!(stats.peak_unsharded_units <= 2, "{stats:?}");
}
