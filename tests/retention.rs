//! What a step keeps: after `FsdpModel::backward` a rank holds its parameter shards and its
//! gradient shards, and nothing of the step's activations or gathered parameters. Measured with
//! the tests' counting allocator (`common/counting_alloc.rs`, on `candle_fsdp::alloc`), which
//! makes this binary's heap observable; one test function so that nothing else allocates while
//! it measures. The units are GPT blocks (attention and MLP), whose activations are their own,
//! not unit outputs.
//!
//! The fault this guards against: a gradient computed by Candle's backward keeps the graph it was
//! computed from (the unit's inputs and gathered weights) unless detached. Where the flat
//! gradient itself becomes the gradient shard (world size 1, and NO_SHARD's all-reduce in
//! place), every unit's activations stayed alive until the optimizer step: on the 152 M-parameter
//! GPT at world size 1 that was 2.2 GB more than the memory plan.

use candle_core::{Device, Tensor};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::ProcessGroupExt;
use candle_fsdp::models::gpt::{Block, GptConfig};
use candle_fsdp::{FsdpConfig, FsdpModel, ShardingStrategy};

#[path = "common/counting_alloc.rs"]
mod counting_alloc;

use counting_alloc::live;

#[global_allocator]
static GLOBAL: counting_alloc::Counting = counting_alloc::COUNTING;

const LAYERS: usize = 4;
/// Batch of (B, T) positions: a block's MLP hidden activation is B·T·4d f32 = 4 MiB, its
/// attention scores B·heads·T·T f32 = 4 MiB.
const B: usize = 64;

fn cfg() -> GptConfig {
    GptConfig {
        n_layer: LAYERS,
        n_head: 4,
        d_model: 64,
        seq_len: 64,
        ..GptConfig::default()
    }
}

/// Heap growth from before the forward to after the backward of one step, and the gradient
/// shards' bytes (f32), both summed over the ranks of the process.
fn growth(world_size: usize, strategy: ShardingStrategy) -> (isize, usize) {
    let out = run_ranks_ok(world_size, ThreadGroupConfig::default(), move |pg| {
        let mut b = FsdpModel::builder(
            pg.clone(),
            FsdpConfig {
                sharding_strategy: strategy,
                ..Default::default()
            },
        );
        for i in 0..LAYERS {
            b = b.unit(format!("blk{i}"), move |vb| {
                Block::new(&cfg().into(), i, vb)
            });
        }
        let mut model = b.build()?;
        let d = cfg().d_model;
        let x = Tensor::randn(0f32, 1.0, (B, cfg().seq_len, d), &Device::Cpu)?;
        // A first step, so that lazily made state (streams, prefetch tapes) exists before
        // measuring.
        for step in 0..2 {
            pg.barrier_wait()?;
            let before = live();
            let y = model.forward(&x)?;
            let loss = y.sqr()?.mean_all()?;
            model.backward(&loss)?;
            drop((y, loss));
            pg.barrier_wait()?;
            let after = live();
            model.zero_grad();
            if step == 1 {
                let shards: usize = model.shards().map(|v| 4 * v.layout.shard_numel).sum();
                return Ok((after - before, shards));
            }
        }
        unreachable!()
    });
    let out = out.expect("ranks");
    (out[0].0, out.iter().map(|o| o.1).sum())
}

#[test]
fn a_step_keeps_gradient_shards_and_no_activations() {
    let probe = vec![0u8; 64];
    assert!(
        candle_fsdp::alloc::is_counting(),
        "the counting allocator is installed"
    );
    drop(probe);
    let c = cfg();
    let activations = LAYERS * B * c.seq_len * (4 * c.d_model + c.n_head * c.seq_len) * 4;
    for (ws, strategy) in [
        (1, ShardingStrategy::FullShard),
        (1, ShardingStrategy::NoShard),
        (2, ShardingStrategy::FullShard),
        (2, ShardingStrategy::ShardGradOp),
        (2, ShardingStrategy::NoShard),
    ] {
        // Gradients of every rank of the process (a shard each; the whole model's gradient
        // under NO_SHARD), and 1 MiB of slack for small state.
        let (g, grads) = growth(ws, strategy);
        let bound = (grads + (1 << 20)) as isize;
        assert!(
            g <= bound,
            "world size {ws}, {strategy:?}: the heap grew by {g} B over a step, more than the \
             gradients ({grads} B) + 1 MiB; activations are {activations} B"
        );
    }
}
