//! The per-rank memory budget (issue 12, item 6): checked before any shard is allocated, its
//! error names the numbers and the world size that would fit, and the plan follows the formula
//! of `fsdp::budget` (16 bytes per parameter of f32 AdamW state, divided by the world size).

use candle_core::{DType, Device, Tensor};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::{FsdpConfig, FsdpModel, MemoryBudget};

const D: usize = 64;
const LAYERS: usize = 4;
/// Parameters: LAYERS × (D·D + D) (weights and biases; D is a multiple of the alignment).
const PARAMS: usize = LAYERS * (D * D + D);

fn build(
    pg: std::sync::Arc<dyn candle_fsdp::comm::ProcessGroup>,
    budget: Option<MemoryBudget>,
) -> candle_fsdp::Result<FsdpModel> {
    let mut b = FsdpModel::builder(
        pg,
        FsdpConfig {
            memory_budget: budget,
            ..Default::default()
        },
    );
    for i in 0..LAYERS {
        b = b.unit(format!("l{i}"), |vb| candle_nn::linear(D, D, vb));
    }
    b.build()
}

#[test]
fn the_plan_follows_the_formula() {
    for ws in [1usize, 2, 4] {
        let plans = run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
            let m = build(pg, None)?;
            Ok(m.memory_plan(8, 1000))
        })
        .unwrap();
        let p = plans[0];
        let shard = (D * D + D).div_ceil(ws);
        assert_eq!(p.param_shard_bytes, 4 * LAYERS * shard);
        assert_eq!(p.grad_shard_bytes, 4 * LAYERS * shard);
        assert_eq!(p.optimizer_bytes, 8 * LAYERS * shard);
        // 16 bytes per parameter of f32 AdamW state, over the world size.
        assert_eq!(p.sharded_bytes(), 16 * LAYERS * shard);
        assert!(p.sharded_bytes() >= 16 * PARAMS / ws);
        // Two units gathered (buffer + variables), one unit's f32 flat gradient, its f32 cast
        // and its parameter gradients.
        let padded = shard * ws;
        assert_eq!(p.unsharded_bytes, 2 * 2 * 4 * padded + padded * 12);
        assert_eq!(p.activation_bytes, 1000);
    }
}

#[test]
fn a_budget_too_small_fails_before_allocating_and_names_the_numbers() {
    // Fits at world size 4, not at 1 or 2.
    let budget = |max| MemoryBudget {
        max_bytes_per_rank: max,
        optimizer_bytes_per_element: 8,
        activation_bytes: 10_000,
    };
    let need = |ws: usize| {
        run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
            Ok(build(pg, None)?.memory_plan(8, 10_000).total_bytes())
        })
        .unwrap()[0]
    };
    let (at1, at2, at4) = (need(1), need(2), need(4));
    assert!(at1 > at2 && at2 > at4);
    let max = (at2 + at4) / 2;
    let errs = run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
        Ok(build(pg, Some(budget(max))).err().map(|e| e.to_string()))
    })
    .unwrap();
    for e in errs {
        let e = e.expect("the budget must be refused at world size 2");
        assert!(e.contains("memory budget exceeded"), "{e}");
        assert!(
            e.contains(&format!("the model needs {at2} B per rank at world size 2")),
            "{e}"
        );
        assert!(
            e.contains(&format!("more than the budget of {max} B per rank")),
            "{e}"
        );
        assert!(
            e.contains("parameter shards") && e.contains("activations 10000"),
            "{e}"
        );
        assert!(
            e.contains("it fits from world size 3 on")
                || e.contains("it fits from world size 4 on"),
            "{e}"
        );
    }
    // At world size 4 it builds and trains.
    run_ranks_ok(4, ThreadGroupConfig::default(), move |pg| {
        let mut m = build(pg, Some(budget(max)))?;
        let x = Tensor::ones((2, D), DType::F32, &Device::Cpu)?;
        let y = m.forward(&x)?;
        m.backward(&y.sum_all()?)?;
        Ok(())
    })
    .unwrap();
    // A budget below what activations alone take: no world size fits.
    let e = run_ranks_ok(1, ThreadGroupConfig::default(), move |pg| {
        Ok(build(pg, Some(budget(5_000))).err().unwrap().to_string())
    })
    .unwrap()
    .remove(0);
    assert!(e.contains("no world size up to 4096 fits it"), "{e}");
}
