//! Packed examples (several examples in one sequence, position ids restarting at each): the
//! decoder's logits equal transformers' packed-sequence forward (`position_ids` without an
//! attention mask, `scripts/make-packed-fixture.py`) for Llama, Mistral's window, Gemma 2,
//! Qwen3, Phi-3 and GPT-2's learned positions, through the one-node blocks of a training
//! forward and the composed layers of an inference one, at world sizes 1 and 2; and a step on
//! packed supervised examples (`data::sft::pack`) equals the step on the same examples padded
//! one per sequence, also split over ranks with the blocks checkpointed.

use candle_core::{Device, Tensor};
use candle_fsdp::data::sft::{batch, pack, token_scale, SftExample};
use candle_fsdp::hf::decoder::{build_from_hf, build_from_hf_with, HfOptions};
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::nn::lm_loss_sum;
use candle_fsdp::{FsdpConfig, Sgd, SgdConfig, ShardedOptimizer};

use super::common::to_vec;
use super::{fixture, max_abs_diff};

const FIXTURES: [&str; 6] = [
    "llama-gqa",
    "family-mistral",
    "family-gemma2",
    "family-qwen3",
    "family-phi3",
    "family-gpt2",
];

/// `ids`, `positions` (both `(2, 12)` u32) and transformers' `logits` of fixture `name`.
fn packed_fixture(name: &str) -> (Tensor, Tensor, Vec<f32>) {
    let path = fixture("packed").join(format!("{name}.safetensors"));
    let t = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let u32s = |k: &str| t[k].to_dtype(candle_core::DType::U32).unwrap();
    (u32s("ids"), u32s("positions"), to_vec(&t["logits"]))
}

#[test]
fn packed_logits_equal_transformers_in_training_and_inference_forwards() {
    for name in FIXTURES {
        let (ids, pos, want) = packed_fixture(name);
        for ws in [1, 2] {
            let out = launch(&Launcher::threads(ws), |pg| {
                let (decoder, mut model, _) =
                    build_from_hf(pg, FsdpConfig::default(), &fixture(name), false)?;
                let eval = decoder.logits_at(&mut model, &ids, Some(&pos), false)?;
                let train = decoder.logits_at(&mut model, &ids, Some(&pos), true)?;
                model.backward(&train.sum_all()?)?;
                // Without the positions the logits are another thing (the fixture tells).
                let plain = decoder.logits(&mut model, &ids, false)?;
                Ok((to_vec(&eval), to_vec(&train), to_vec(&plain)))
            })
            .unwrap();
            for (rank, (eval, train, plain)) in out.iter().enumerate() {
                let d = max_abs_diff(eval, &want);
                assert!(
                    d < 1e-4,
                    "{name} ws {ws} rank {rank}: inference differs by {d}"
                );
                let d = max_abs_diff(train, &want);
                assert!(
                    d < 1e-4,
                    "{name} ws {ws} rank {rank}: training differs by {d}"
                );
                let d = max_abs_diff(plain, &want);
                assert!(
                    d > 1e-2,
                    "{name}: unpacked logits within {d} of packed ones"
                );
            }
        }
    }
}

#[test]
fn position_ids_of_another_shape_or_past_learned_positions_are_refused() {
    let (ids, pos, _) = packed_fixture("family-gpt2");
    let errs = launch(&Launcher::threads(1), |pg| {
        let (decoder, mut model, _) =
            build_from_hf(pg, FsdpConfig::default(), &fixture("family-gpt2"), false)?;
        let short = pos.narrow(1, 0, 6)?;
        let e1 = decoder
            .logits_at(&mut model, &ids, Some(&short), false)
            .unwrap_err()
            .to_string();
        // n_positions is 64: position 64 has no row.
        let far = (pos.clone() + 60.0)?;
        let e2 = decoder
            .logits_at(&mut model, &ids, Some(&far), false)
            .unwrap_err()
            .to_string();
        Ok((e1, e2))
    })
    .unwrap();
    let (e1, e2) = &errs[0];
    assert!(e1.contains("position ids must be (2, 12) u32"), "{e1}");
    assert!(e1.contains("[2, 6]"), "{e1}");
    assert!(
        e2.contains("67 positions") && e2.contains("n_positions 64"),
        "{e2}"
    );
}

/// Six supervised examples of 7, 6, 5, 4, 3 and 3 tokens for `--seq-len` 12.
fn examples() -> Vec<SftExample> {
    let ids = |seed: u32, n: usize| -> Vec<u32> {
        (0..n as u32).map(|i| (seed * 11 + i * 7) % 64).collect()
    };
    [(3, 4), (2, 4), (4, 1), (1, 3), (1, 2), (2, 1)]
        .iter()
        .enumerate()
        .map(|(i, &(p, c))| SftExample::new(&ids(i as u32, p), &ids(9 + i as u32, c), Some(2), 12))
        .collect()
}

/// One SGD step (lr 1) of fixture `name` at world size `ws` on `rows[rank]` (one micro-batch
/// each), the per-token loss over all ranks, the blocks checkpointed with `ac`; rank 0's
/// gathered parameters.
fn step(name: &str, ws: usize, ac: bool, rows: Vec<Vec<SftExample>>) -> Vec<(String, Vec<f32>)> {
    let name = name.to_string();
    launch(&Launcher::threads(ws), move |pg| {
        let opts = HfOptions {
            activation_checkpointing: ac,
            ..HfOptions::default()
        };
        let (decoder, mut model, _) =
            build_from_hf_with(pg.clone(), FsdpConfig::default(), &fixture(&name), &opts)?;
        let mine: Vec<&SftExample> = rows[pg.rank()].iter().collect();
        let local: usize = mine.iter().map(|e| e.target_count()).sum();
        let scale = token_scale(pg.as_ref(), local)?;
        let (x, y, pos) = batch(&mine, 0, &Device::Cpu)?;
        let logits = decoder.logits_at(&mut model, &x, pos.as_ref(), true)?;
        let (sum, _) = lm_loss_sum(&logits, &y)?;
        model.backward(&sum.affine(scale as f64, 0.0)?)?;
        let mut opt = Sgd::new(SgdConfig {
            lr: 1.0,
            ..SgdConfig::default()
        });
        opt.step(&mut model)?;
        let params = model.gather_full_params(false)?.expect("every rank");
        Ok(params.iter().map(|(n, t)| (n.clone(), to_vec(t))).collect())
    })
    .unwrap()
    .swap_remove(0)
}

#[test]
fn a_step_on_packed_examples_equals_the_step_on_them_padded() {
    let ex = examples();
    assert_eq!(
        ex.iter().map(|e| e.len()).collect::<Vec<_>>(),
        [7, 6, 5, 4, 3, 3]
    );
    let rows = pack(&ex, 12).unwrap();
    assert_eq!(rows.len(), 3, "42 tokens in three sequences of 12, not six");
    for name in ["llama-gqa", "family-mistral", "family-gpt2"] {
        let padded = step(name, 1, false, vec![ex.clone()]);
        let packed = step(name, 1, false, vec![rows.clone()]);
        // Two ranks: two packed sequences on one, one on the other; the blocks checkpointed
        // (the position ids saved with the hidden states, the recomputation packed too).
        let split = step(name, 2, true, vec![rows[..2].to_vec(), rows[2..].to_vec()]);
        let base = super::weights_of(&fixture(name));
        let mut moved = 0;
        for (((n, want), (_, got)), (_, got2)) in padded.iter().zip(&packed).zip(&split) {
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
            let d = max_abs_diff(got, want) / scale;
            assert!(d < 2e-6, "{name} {n}: packed differs from padded by {d}");
            let d = max_abs_diff(got2, want) / scale;
            assert!(
                d < 2e-6,
                "{name} {n}: packed over 2 ranks, checkpointed, differs by {d}"
            );
            if let Some((_, _, b)) = base.iter().find(|(m, _, _)| m == n) {
                moved += usize::from(max_abs_diff(want, b) > 1e-4);
            }
        }
        assert!(moved > 5, "{name}: the step moved {moved} tensors");
    }
}
