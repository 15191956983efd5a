//! Supervised fine-tuning data (`data::sft`): the per-token loss normalised over every rank and
//! micro-batch of a step gives the gradients of one process over the same global batch — ranks
//! holding 3, 0 and 11 target tokens, and the same split as three micro-batches of one rank —
//! and a JSONL file's errors name the line.

use candle_core::Device;
use candle_fsdp::data::sft::{
    batch, lines_list, read_jsonl, token_scale, ChatTemplate, Message, SftExample,
};
use candle_fsdp::hf::decoder::{build_from_hf_with, HfOptions};
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::nn::lm_loss_sum;
use candle_fsdp::{FsdpConfig, Sgd, SgdConfig, ShardedOptimizer};

use super::common::{tmpdir, to_vec};
use super::{fixture, max_abs_diff};

const BASE: &str = "llama-gqa";
const T: usize = 12;

/// The three ranks' examples: 3, 0 and 11 target tokens (the last rank holds two examples).
fn examples() -> Vec<Vec<SftExample>> {
    let ids = |seed: u32, n: usize| -> Vec<u32> {
        (0..n as u32).map(|i| (seed * 7 + i * 13) % 64).collect()
    };
    vec![
        vec![SftExample::new(&ids(1, 5), &ids(2, 2), Some(2), T)],
        vec![SftExample::new(&ids(3, 9), &[], None, T)],
        vec![
            SftExample::new(&ids(4, 3), &ids(5, 4), Some(2), T),
            SftExample::new(&ids(6, 1), &ids(7, 5), Some(2), T),
        ],
    ]
}

/// One SGD step (lr 1, no momentum, no decay) on `parts` (this rank's micro-batches, by rank),
/// each micro-batch's loss the summed loss times [`token_scale`]; rank 0's gathered parameters.
fn step(ws: usize, parts: Vec<Vec<Vec<SftExample>>>) -> Vec<(String, Vec<f32>)> {
    launch(&Launcher::threads(ws), move |pg| {
        let (decoder, mut model, _) = build_from_hf_with(
            pg.clone(),
            FsdpConfig::default(),
            &fixture(BASE),
            &HfOptions::default(),
        )?;
        let mine = &parts[pg.rank()];
        let local: usize = mine.iter().flatten().map(SftExample::target_count).sum();
        let scale = token_scale(pg.as_ref(), local)?;
        for (m, micro) in mine.iter().enumerate() {
            model.set_requires_gradient_sync(m + 1 == mine.len());
            let refs: Vec<&SftExample> = micro.iter().collect();
            let (x, y, _) = batch(&refs, 0, &Device::Cpu)?;
            let (sum, _) = lm_loss_sum(&decoder.logits(&mut model, &x, true)?, &y)?;
            model.backward(&sum.affine(scale as f64, 0.0)?)?;
        }
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
fn per_token_loss_over_ranks_and_micro_batches_equals_one_process() {
    let ex = examples();
    assert_eq!(
        ex.iter()
            .map(|r| r.iter().map(SftExample::target_count).sum::<usize>())
            .collect::<Vec<_>>(),
        [3, 0, 11]
    );
    // One process, one batch of the four examples: the mean over the 14 tokens. (Batches of
    // different sizes are fine: here rank 2 holds two examples, the others one.)
    let all: Vec<SftExample> = ex.iter().flatten().cloned().collect();
    let reference = step(1, vec![vec![all]]);
    // Three ranks, one micro-batch each.
    let ranks = step(3, ex.iter().map(|r| vec![r.clone()]).collect());
    // One rank, the three parts as micro-batches of one step (accumulated).
    let micro = step(1, vec![ex.clone()]);
    let base = super::weights_of(&fixture(BASE));
    let mut moved = 0;
    for (((n, want), (_, got3)), (_, got1)) in reference.iter().zip(&ranks).zip(&micro) {
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
        let d = max_abs_diff(got3, want) / scale;
        assert!(
            d < 2e-6,
            "{n}: world size 3 differs from one process by {d}"
        );
        let d = max_abs_diff(got1, want) / scale;
        assert!(
            d < 2e-6,
            "{n}: three micro-batches differ from one batch by {d}"
        );
        let b = &base.iter().find(|(m, _, _)| m == n).unwrap().2;
        moved += usize::from(max_abs_diff(want, b) > 1e-4);
    }
    assert!(moved > 5, "the step moved {moved} tensors");
    // A per-batch mean instead (each rank its own tokens' mean, averaged) is not the same: the
    // normalisation matters for these counts.
    let wrong = launch(&Launcher::threads(3), |pg| {
        let (decoder, mut model, _) = build_from_hf_with(
            pg.clone(),
            FsdpConfig::default(),
            &fixture(BASE),
            &HfOptions::default(),
        )?;
        let refs: Vec<&SftExample> = ex[pg.rank()].iter().collect();
        let (x, y, _) = batch(&refs, 0, &Device::Cpu)?;
        let (sum, k) = lm_loss_sum(&decoder.logits(&mut model, &x, true)?, &y)?;
        model.backward(&sum.affine(1.0 / k.max(1) as f64, 0.0)?)?;
        let mut opt = Sgd::new(SgdConfig {
            lr: 1.0,
            ..SgdConfig::default()
        });
        opt.step(&mut model)?;
        let params = model.gather_full_params(false)?.expect("every rank");
        Ok(params
            .iter()
            .map(|(n, t)| (n.clone(), to_vec(t)))
            .collect::<Vec<_>>())
    })
    .unwrap()
    .swap_remove(0);
    let differs = wrong
        .iter()
        .zip(&reference)
        .any(|((_, a), (_, b))| max_abs_diff(a, b) > 1e-4);
    assert!(differs, "a per-batch mean gave the per-token gradients");
}

#[test]
fn jsonl_errors_name_the_line() {
    let dir = tmpdir("sft-jsonl");
    std::fs::create_dir_all(&dir).unwrap();
    let tok = |s: &str| -> candle_fsdp::Result<Vec<u32>> { Ok(s.bytes().map(u32::from).collect()) };
    let write = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let ok = write(
        "ok.jsonl",
        "{\"prompt\": \"Q: 2+2?\\nA: \", \"completion\": \"4\"}\n\n{\"prompt\": \"Hi\", \"completion\": \" there\"}\n",
    );
    let ex = read_jsonl(&ok, &tok, None, Some(0), 16).unwrap().examples;
    assert_eq!(ex.len(), 2);
    assert_eq!(ex[0].target_count(), 2, "'4' and eos");
    assert_eq!(ex[1].target_count(), 7, "' there' and eos");
    // A byte-order mark before the first line is skipped (editors write one).
    let bom = write(
        "bom.jsonl",
        "\u{feff}{\"prompt\": \"Hi\", \"completion\": \" there\"}\n",
    );
    let ex = read_jsonl(&bom, &tok, None, Some(0), 16).unwrap().examples;
    assert_eq!(ex[0].target_count(), 7);
    // The error of a one-file read (no template, no eos, seq-len 16).
    let refused = |name: &str, text: &str| {
        read_jsonl(&write(name, text), &tok, None, None, 16)
            .unwrap_err()
            .to_string()
    };
    let e = refused(
        "bad.jsonl",
        "{\"prompt\": \"a\", \"completion\": \"b\"}\n{\"prompt\": 3}\n",
    );
    assert!(
        e.contains("bad.jsonl")
            && e.contains("line 2")
            && e.contains("\"prompt\" is missing or not a string"),
        "{e}"
    );
    let e = refused("chat.jsonl", "{\"messages\": []}\n");
    assert!(
        e.contains("line 1") && e.contains("needs the tokenizer's chat template"),
        "{e}"
    );
    let e = refused("empty.jsonl", "{\"prompt\": \"x\", \"completion\": \"\"}\n");
    assert!(e.contains("line 1: the completion is empty"), "{e}");
    let e = refused(
        "long.jsonl",
        "{\"prompt\": \"0123456789abcdefXYZ\", \"completion\": \"b\"}\n",
    );
    assert!(
        e.contains("line 1") && e.contains("fill --seq-len 16"),
        "{e}"
    );
    // Beside examples that fit, such an example is skipped and its line listed.
    let mixed = write(
        "mixed.jsonl",
        "{\"prompt\": \"Hi\", \"completion\": \" there\"}\n{\"prompt\": \"0123456789abcdefXYZ\", \"completion\": \"b\"}\n",
    );
    assert_eq!(lines_list(&[]), "no line");
    assert_eq!(lines_list(&[27]), "line 27");
    assert_eq!(lines_list(&[1, 2, 3]), "lines 1, 2, 3");
    assert_eq!(
        lines_list(&(1..=9).collect::<Vec<_>>()),
        "lines 1, 2, 3, 4, 5, 6, 7, 8, … (9 lines)"
    );
    let read = read_jsonl(&mixed, &tok, None, None, 16).unwrap();
    assert_eq!((read.examples.len(), read.skipped), (1, vec![2]));
    assert_eq!(read.examples[0].target_count(), 6, "' there'");
    let e = refused("json.jsonl", "{\"prompt\": \n");
    assert!(e.contains("line 1: not JSON"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The fixture's templates (`scripts/make-chat-template-fixture.py`), by name.
fn templates() -> (
    serde_json::Value,
    std::collections::BTreeMap<String, ChatTemplate>,
) {
    let text = std::fs::read_to_string(fixture("chat").join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let special: std::collections::BTreeMap<String, String> =
        serde_json::from_value(v["special"].clone()).unwrap();
    let t = v["templates"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(n, src)| {
            (
                n.clone(),
                ChatTemplate::new(src.as_str().unwrap(), special.clone()).unwrap(),
            )
        })
        .collect();
    (v, t)
}

#[test]
fn chat_templates_render_as_transformers_renders_them() {
    let (v, templates) = templates();
    let cases = v["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 9);
    for c in cases {
        let t = &templates[c["template"].as_str().unwrap()];
        let messages: Vec<Message> = serde_json::from_value(c["messages"].clone()).unwrap();
        let full = t.render(&messages, false).unwrap();
        assert_eq!(
            full,
            c["full"].as_str().unwrap(),
            "{}: the conversation",
            c["template"]
        );
        let (prompt, completion) = t.prompt_and_completion(&messages).unwrap();
        assert_eq!(
            prompt,
            c["prompt"].as_str().unwrap(),
            "{}: the prompt",
            c["template"]
        );
        assert_eq!(format!("{prompt}{completion}"), full);
    }
    // raise_exception's message reaches the error.
    let bad: Vec<Message> = serde_json::from_value(v["raises"]["messages"].clone()).unwrap();
    let e = templates["zephyr"]
        .render(&bad, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains(v["raises"]["message"].as_str().unwrap()), "{e}");
    let e = templates["chatml"]
        .prompt_and_completion(&bad[..1])
        .unwrap_err()
        .to_string();
    assert!(e.contains("the last message is the tool's"), "{e}");
}

#[test]
fn messages_lines_train_on_the_assistants_turn() {
    let (_, templates) = templates();
    let dir = tmpdir("sft-chat");
    std::fs::create_dir_all(&dir).unwrap();
    let tok = |s: &str| -> candle_fsdp::Result<Vec<u32>> { Ok(s.bytes().map(u32::from).collect()) };
    let p = dir.join("chat.jsonl");
    std::fs::write(
        &p,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"2+2?\"}, {\"role\": \"assistant\", \"content\": \"4\"}]}\n",
    )
    .unwrap();
    let ex = read_jsonl(&p, &tok, Some(&templates["chatml"]), Some(0), 128)
        .unwrap()
        .examples;
    // ChatML's completion: "4<|im_end|>\n", 13 bytes, every one a target; no eos appended.
    assert_eq!(ex[0].target_count(), "4<|im_end|>\n".len());
    let want: Vec<u32> = "4<|im_end|>\n".bytes().map(u32::from).collect();
    let got: Vec<u32> = ex[0]
        .targets
        .iter()
        .copied()
        .filter(|&t| t != candle_fsdp::nn::IGNORE_INDEX)
        .collect();
    assert_eq!(got, want);
    std::fs::write(&p, "{\"messages\": [{\"role\": \"user\"}]}\n").unwrap();
    let e = read_jsonl(&p, &tok, Some(&templates["chatml"]), None, 128)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("line 1") && e.contains("role") && e.contains("content"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
