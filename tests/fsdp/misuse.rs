//! Misuse gets a clear error or a documented opt-out, never silently wrong gradients.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::ProcessGroup;
use candle_fsdp::{FsdpConfig, FsdpModel};

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
