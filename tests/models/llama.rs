//! The Llama decoder built from the fixtures equals transformers: logits and loss at world
//! sizes 1, 2 and 3 (multi-head, grouped-query with bf16 weights, tied with biases), and one
//! AdamW step equals `torch.optim.AdamW`'s.

use candle_fsdp::hf::llama::build_from_hf;
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::models::llama::lm_loss;
use candle_fsdp::FsdpConfig;

use super::common::to_vec;
use super::{expected, fixture, inputs, max_abs_diff};

/// Logits and loss of fixture `name` at world size `ws`, compared with transformers' (1e-4),
/// returning the largest logit difference.
pub(super) fn logits_match(name: &str, ws: usize) -> f32 {
    let (ids, targets) = inputs(name);
    let want_logits = expected(name, "logits");
    let want_loss = expected(name, "loss")[0];
    let out = launch(&Launcher::threads(ws), |pg| {
        let (llama, mut model, _) =
            build_from_hf(pg, FsdpConfig::default(), &fixture(name), false)?;
        let logits = llama.logits(&mut model, &ids, false)?;
        let loss = lm_loss(&logits, &targets)?.to_scalar::<f32>()?;
        Ok((to_vec(&logits), loss))
    })
    .unwrap();
    let mut worst = 0.0f32;
    for (rank, (logits, loss)) in out.iter().enumerate() {
        let d = max_abs_diff(logits, &want_logits);
        assert!(d < 1e-4, "{name} ws {ws} rank {rank}: logits differ by {d}");
        assert!(
            (loss - want_loss).abs() < 1e-4,
            "{name} ws {ws} rank {rank}: loss {loss} vs transformers' {want_loss}"
        );
        worst = worst.max(d);
    }
    eprintln!(
        "{name} ws {ws}: max |logits - transformers| = {worst:.3e}, loss {:.7} vs {want_loss:.7}",
        out[0].1
    );
    worst
}

#[test]
fn multi_head_logits_and_loss_equal_transformers_at_world_sizes_1_2_3() {
    for ws in [1, 2, 3] {
        logits_match("llama-mha", ws);
    }
}

#[test]
fn grouped_query_bf16_weights_equal_transformers() {
    for ws in [1, 3] {
        logits_match("llama-gqa", ws);
    }
}

#[test]
fn tied_embeddings_with_biases_equal_transformers() {
    for ws in [1, 2] {
        logits_match("llama-tied", ws);
    }
}

/// Llama 3's rotary scaling (`rope_type: "llama3"`, as Llama 3.1 / 3.2 configs have it):
/// transformers' logits, and the fixture does exercise the scaling (its tables differ from the
/// unscaled ones at the fixture's positions).
#[test]
fn llama3_rope_scaling_equals_transformers() {
    use candle_fsdp::hf::llama::read_config;
    use candle_fsdp::models::llama::rope_tables;
    let cfg = read_config(&fixture("llama3-rope")).unwrap();
    let scaling = cfg
        .rope_scaling
        .expect("the fixture's config has llama3 scaling");
    assert_eq!(
        (scaling.factor, scaling.original_max_position_embeddings),
        (8.0, 64)
    );
    let dev = candle_core::Device::Cpu;
    let (_, sin) = rope_tables(&cfg, 12, &dev).unwrap();
    let plain = candle_fsdp::models::llama::LlamaConfig {
        rope_scaling: None,
        ..cfg
    };
    let (_, sin_plain) = rope_tables(&plain, 12, &dev).unwrap();
    let d = max_abs_diff(&to_vec(&sin), &to_vec(&sin_plain));
    assert!(d > 0.1, "scaled and plain tables differ by only {d}");
    for ws in [1, 2] {
        logits_match("llama3-rope", ws);
    }
}

#[test]
fn one_adamw_step_equals_torch_adamw() {
    for ws in [1, 2] {
        super::families::adamw_step_matches("llama-mha", ws);
    }
}
