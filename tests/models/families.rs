//! The model families of the one decoder (`models::decoder`) against transformers 5.25: for a
//! tiny random Mistral (sliding window shorter than the sequence), Qwen2 (q/k/v biases, tied,
//! also with bf16 weights), Qwen3 (q/k norms, head_dim ≠ d/heads), Phi-3 (fused qkv_proj and
//! gate_up_proj), Gemma 2 (soft-capping, sandwich norms, alternating sliding layers, GeGLU,
//! √d embeddings, query_pre_attn_scalar) and GPT-2 (Conv1D, learned positions), written by
//! `scripts/make-hf-family-fixture.py`: logits and loss within 1e-4 at world sizes 1, 2 and 3,
//! one AdamW step within 1e-5 of `torch.optim.AdamW`, an export in the family's own layout
//! (bit-exact tensors, and transformers' logits when a Python with transformers is present),
//! and errors that name the file and the tensor or key.

use std::path::Path;
use std::process::Command;

use candle_fsdp::hf::decoder::{build_from_hf, read_config, resolve};
use candle_fsdp::hf::{export_hf, HfExportOptions};
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::models::decoder::{lm_loss, Family, LayerType};
use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, ShardedOptimizer};

use super::common::{tmpdir, to_vec};
use super::hf_export::{fine_tuned, python_with_transformers};
use super::llama::logits_match;
use super::{fixture, inputs, max_abs_diff, weights_of, ExpectedFile};

/// Every family fixture, with its family.
const FAMILIES: [(&str, Family); 8] = [
    ("family-mistral", Family::Mistral),
    ("family-qwen2", Family::Qwen2),
    ("family-qwen2-bf16", Family::Qwen2),
    ("family-qwen3", Family::Qwen3),
    ("family-phi3", Family::Phi3),
    ("family-gemma2", Family::Gemma2),
    ("family-gemma2-pad", Family::Gemma2),
    ("family-gpt2", Family::Gpt2),
];

/// Logits and loss at world sizes 1, 2 and 3 (the shards of every parameter cut differently).
fn all_world_sizes(name: &str) {
    let cfg = read_config(&fixture(name)).unwrap();
    let family = FAMILIES.iter().find(|(n, _)| *n == name).unwrap().1;
    assert_eq!(cfg.family, family, "{name}");
    for ws in [1, 2, 3] {
        logits_match(name, ws);
    }
}

#[test]
fn mistral_sliding_window_equals_transformers() {
    let cfg = read_config(&fixture("family-mistral")).unwrap();
    // The window is shorter than the fixture's 12 positions, on every layer.
    assert_eq!(cfg.sliding_window, Some(5));
    assert!(cfg
        .layer_types
        .iter()
        .all(|t| *t == LayerType::SlidingAttention));
    all_world_sizes("family-mistral");
}

#[test]
fn qwen2_biases_and_tied_head_equal_transformers() {
    let cfg = read_config(&fixture("family-qwen2")).unwrap();
    assert!(cfg.qkv_bias && !cfg.o_bias && cfg.tie_word_embeddings);
    assert_eq!(cfg.rope_theta, 1e6);
    all_world_sizes("family-qwen2");
    all_world_sizes("family-qwen2-bf16");
}

#[test]
fn qwen3_qk_norm_and_wide_heads_equal_transformers() {
    let cfg = read_config(&fixture("family-qwen3")).unwrap();
    assert!(cfg.qk_norm);
    assert_ne!(cfg.head_dim * cfg.num_attention_heads, cfg.hidden_size);
    all_world_sizes("family-qwen3");
}

#[test]
fn phi3_fused_projections_equal_transformers() {
    all_world_sizes("family-phi3");
}

#[test]
fn gemma2_equals_transformers() {
    let cfg = read_config(&fixture("family-gemma2")).unwrap();
    assert!(cfg.attn_logit_softcapping.is_some() && cfg.final_logit_softcapping.is_some());
    // Both kinds of layer, and a window shorter than the sequence.
    assert!(cfg.layer_types.contains(&LayerType::SlidingAttention));
    assert!(cfg.layer_types.contains(&LayerType::FullAttention));
    assert!(cfg.sliding_window.unwrap() < 12);
    all_world_sizes("family-gemma2");
}

#[test]
fn gemma2_pad_row_gets_no_gradient_from_its_lookups_as_in_transformers() {
    // As published, pad_token_id 0; the fixture's first sequence starts with three pads. The
    // pad's lookups send no gradient, the tied head's does: the step test
    // (one_adamw_step_equals_torch_adamw_for_every_family) compares row 0 after one step with
    // transformers' (it differs by 2.0e-3 when the lookups do send gradient); here the config
    // and the logits.
    let cfg = read_config(&fixture("family-gemma2-pad")).unwrap();
    assert_eq!(cfg.pad_token_id, Some(0));
    all_world_sizes("family-gemma2-pad");
}

#[test]
fn gpt2_equals_transformers() {
    all_world_sizes("family-gpt2");
}

/// One AdamW step at world size `ws` from fixture `name` equals `torch.optim.AdamW`'s (1e-5),
/// and moved every parameter.
pub(super) fn adamw_step_matches(name: &str, ws: usize) -> f32 {
    let (ids, targets) = inputs(name);
    let want = ExpectedFile::open(name);
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).unwrap();
    let meta: serde_json::Value = serde_json::from_str(&text).unwrap();
    let a = &meta["adamw"];
    let cfg = AdamWConfig {
        lr: a["lr"].as_f64().unwrap(),
        beta1: a["betas"][0].as_f64().unwrap(),
        beta2: a["betas"][1].as_f64().unwrap(),
        eps: a["eps"].as_f64().unwrap(),
        weight_decay: a["weight_decay"].as_f64().unwrap(),
    };
    let params = launch(&Launcher::threads(ws), |pg| {
        let (decoder, mut model, _) =
            build_from_hf(pg, FsdpConfig::default(), &fixture(name), false)?;
        let mut opt = AdamW::new(cfg);
        let logits = decoder.logits(&mut model, &ids, true)?;
        model.backward(&lm_loss(&logits, &targets)?)?;
        opt.step(&mut model)?;
        Ok(model.gather_full_params(false)?.expect("every rank"))
    })
    .unwrap();
    let mut names = want.names();
    names.retain(|n| n.starts_with("step."));
    assert_eq!(
        names.len(),
        params[0].len(),
        "{name}: one expected tensor per parameter ({names:?})"
    );
    let before = weights_of(&fixture(name));
    let mut worst = 0.0f32;
    for (rank, ps) in params.iter().enumerate() {
        for (n, t) in ps {
            let full = to_vec(t);
            let mut got = full.clone();
            let mut theirs = want.get(&format!("step.{n}"));
            if name == "family-gpt2" && n.ends_with(".attn.c_attn.bias") {
                // The key bias adds q·b to every score of a query's row, which the softmax
                // cancels: its gradient is zero analytically and rounding noise in both runs,
                // which Adam's first step (g / (|g| + eps)) turns into a step of up to lr of
                // either sign. That slice moved by at most lr (plus the decay) in both; the
                // query and value slices are compared as every other tensor.
                let d = got.len() / 3;
                let lr = cfg.lr as f32;
                let key = max_abs_diff(&got[d..2 * d], &theirs[d..2 * d]);
                assert!(key <= 2.0 * lr * 1.01, "{name}: key bias differs by {key}");
                got.drain(d..2 * d);
                theirs.drain(d..2 * d);
            }
            let d = max_abs_diff(&got, &theirs);
            assert!(
                d < 1e-5,
                "{name} ws {ws} rank {rank}: {n} differs by {d} after one step"
            );
            worst = worst.max(d);
            let b = &before.iter().find(|(m, _, _)| m == n).unwrap().2;
            assert!(max_abs_diff(&full, b) > 5e-4, "{name}: {n} did not move");
        }
    }
    eprintln!("{name} AdamW step ws {ws}: max |param - torch| = {worst:.3e}");
    worst
}

#[test]
fn one_adamw_step_equals_torch_adamw_for_every_family() {
    for (name, _) in FAMILIES {
        if name.ends_with("-bf16") {
            continue; // the same model as family-qwen2
        }
        for ws in [1, 2] {
            adamw_step_matches(name, ws);
        }
    }
}

/// Exports `ckpt` as a Hugging Face directory `out` (f32) and checks it holds the fixture's
/// tensor names and shapes with our values, and the family's config.
fn export_is_the_family_layout(name: &str, root: &Path) -> (std::path::PathBuf, Vec<f32>) {
    let (ckpt, params, logits) = fine_tuned(name, &root.join("ckpt"));
    let out = root.join("hf");
    export_hf(&ckpt, &out, &HfExportOptions::default()).unwrap();
    let written = weights_of(&out);
    let original = weights_of(&fixture(name));
    // The fixture's tensors (transformers' save_pretrained) by name and shape; ignoring only
    // GPT-2's causal-mask buffers, which are no parameters.
    let shapes = |w: &[(String, Vec<usize>, Vec<f32>)]| -> Vec<(String, Vec<usize>)> {
        let mut v: Vec<_> = w
            .iter()
            .filter(|(n, _, _)| !n.ends_with(".attn.bias") && !n.ends_with(".attn.masked_bias"))
            .map(|(n, s, _)| (n.clone(), s.clone()))
            .collect();
        v.sort();
        v
    };
    assert_eq!(shapes(&written), shapes(&original), "{name}: tensors");
    for (n, v) in &params {
        let (_, _, w) = written.iter().find(|(m, _, _)| m == n).unwrap();
        assert!(
            v.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}: {n}"
        );
    }
    let cfg = |d: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap()
    };
    assert_eq!(
        cfg(&out)["architectures"],
        cfg(&fixture(name))["architectures"]
    );
    assert_eq!(cfg(&out)["model_type"], cfg(&fixture(name))["model_type"]);
    (out, logits)
}

#[test]
fn every_family_exports_to_its_own_layout_and_transformers_reloads_it() {
    let python = python_with_transformers();
    for (name, _) in FAMILIES {
        let root = tmpdir(&format!("family-export-{name}"));
        let (out, logits) = export_is_the_family_layout(name, &root);
        match &python {
            Ok(py) => {
                let (ids, _) = inputs(name);
                let ids: Vec<Vec<u32>> = ids.to_vec2().unwrap();
                let script = format!(
                    "import sys, json, torch\n\
                     from transformers import AutoModelForCausalLM\n\
                     m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, \
                     attn_implementation='eager')\n\
                     with torch.no_grad():\n\
                     \x20   l = m(input_ids=torch.tensor({ids:?})).logits\n\
                     print(json.dumps(l.flatten().tolist()))\n"
                );
                let o = Command::new(py)
                    .arg("-c")
                    .arg(&script)
                    .arg(&out)
                    .output()
                    .unwrap();
                assert!(
                    o.status.success(),
                    "{name}: {}",
                    String::from_utf8_lossy(&o.stderr)
                );
                let theirs: Vec<f32> =
                    serde_json::from_str(String::from_utf8_lossy(&o.stdout).trim()).unwrap();
                let d = max_abs_diff(&theirs, &logits);
                println!("{name}: transformers on our export: max |logits - ours| {d:.3e}");
                assert!(
                    d < 1e-4,
                    "{name}: transformers' logits of our export differ by {d}"
                );
            }
            Err(why) => println!("SKIPPED the transformers check of {name}'s export: {why}"),
        }
        let _ = std::fs::remove_dir_all(&root);
    }
}

/// A copy of fixture `name` under a temporary directory, with `edit` applied to file `file`'s
/// text (`config.json`).
fn edited_config(name: &str, tag: &str, edit: impl Fn(&str) -> String) -> std::path::PathBuf {
    let dir = tmpdir(&format!("family-{tag}"));
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(fixture(name)).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), dir.join(f.file_name())).unwrap();
    }
    let p = dir.join("config.json");
    let text = std::fs::read_to_string(&p).unwrap();
    let new = edit(&text);
    assert_ne!(new, text, "the edit changed nothing");
    std::fs::write(&p, new).unwrap();
    dir
}

#[test]
fn keys_a_family_cannot_honour_are_refused_by_name() {
    for (name, tag, edit, says) in [
        (
            "family-phi3",
            "partial",
            Box::new(|t: &str| t.replacen('{', "{\n  \"partial_rotary_factor\": 0.5,", 1))
                as Box<dyn Fn(&str) -> String>,
            "key `partial_rotary_factor` is 0.5",
        ),
        (
            "family-phi3",
            "longrope",
            Box::new(|t: &str| {
                t.replacen(
                    '{',
                    "{\n  \"rope_scaling\": {\"type\": \"longrope\", \"short_factor\": [1.0]},",
                    1,
                )
            }),
            "key `rope_scaling`",
        ),
        (
            "family-gemma2",
            "act",
            Box::new(|t: &str| t.replace("gelu_pytorch_tanh", "relu")),
            "is \"relu\"",
        ),
        (
            "family-gpt2",
            "inverse",
            Box::new(|t: &str| {
                t.replace(
                    "\"scale_attn_by_inverse_layer_idx\": false",
                    "\"scale_attn_by_inverse_layer_idx\": true",
                )
            }),
            "key `scale_attn_by_inverse_layer_idx` is true",
        ),
        (
            "family-mistral",
            "arch",
            Box::new(|t: &str| t.replace("MistralForCausalLM", "MixtralForCausalLM")),
            "unsupported architecture [\"MixtralForCausalLM\"]",
        ),
    ] {
        let dir = edited_config(name, tag, edit);
        let e = resolve(&dir).unwrap_err().to_string();
        assert!(
            e.contains("config.json") && e.contains(says),
            "{name} {tag}: {e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_missing_or_misshapen_family_tensor_is_named_with_its_file() {
    use candle_fsdp::checkpoint::ReadStats;
    use candle_fsdp::hf::weights::HfWeights;
    // Rewrites fixture `name`'s weights without tensor `drop` and with `reshape` given another
    // shape (its first dimension halved).
    fn rewritten(name: &str, tag: &str, drop: &str, reshape: &str) -> std::path::PathBuf {
        let dir = edited_config(name, tag, |t| format!("{t}\n"));
        let w = HfWeights::open(&fixture(name), &mut ReadStats::default()).unwrap();
        let mut tensors = Vec::new();
        for n in w.names() {
            if n == drop {
                continue;
            }
            let mut shape = w.shape(n).unwrap().to_vec();
            let numel: usize = shape.iter().product();
            let mut v = vec![0f32; numel];
            w.read_f32(n, 0..numel, &mut v, &mut ReadStats::default())
                .unwrap();
            if n == reshape {
                shape[0] /= 2;
                v.truncate(shape.iter().product());
            }
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            tensors.push((n.to_string(), shape, bytes));
        }
        let views = tensors.iter().map(|(n, s, b)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b);
            (n.clone(), view.unwrap())
        });
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
        dir
    }
    let load = |dir: &Path| {
        launch(&Launcher::threads(2), |pg| {
            build_from_hf(pg, FsdpConfig::default(), dir, false).map(|_| ())
        })
        .unwrap_err()
        .to_string()
    };
    let dir = rewritten(
        "family-qwen3",
        "missing",
        "model.layers.1.self_attn.k_norm.weight",
        "",
    );
    let e = load(&dir);
    assert!(
        e.contains("model.safetensors")
            && e.contains("tensor model.layers.1.self_attn.k_norm.weight is missing"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    let dir = rewritten(
        "family-phi3",
        "shape",
        "",
        "model.layers.0.self_attn.qkv_proj.weight",
    );
    let e = load(&dir);
    assert!(
        e.contains("model.safetensors")
            && e.contains("tensor model.layers.0.self_attn.qkv_proj.weight: expected shape"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn gpt2_weights_published_without_the_transformer_prefix_load() {
    // openai-community/gpt2's model.safetensors names its tensors `wte.weight`, `h.0.…`, and
    // keeps the causal-mask buffers `h.{i}.attn.bias`.
    use candle_fsdp::checkpoint::ReadStats;
    use candle_fsdp::hf::weights::HfWeights;
    let name = "family-gpt2";
    let dir = edited_config(name, "bare", |t| format!("{t}\n"));
    let w = HfWeights::open(&fixture(name), &mut ReadStats::default()).unwrap();
    let mut tensors = Vec::new();
    for n in w.names() {
        let shape = w.shape(n).unwrap().to_vec();
        let numel: usize = shape.iter().product();
        let mut v = vec![0f32; numel];
        w.read_f32(n, 0..numel, &mut v, &mut ReadStats::default())
            .unwrap();
        let bare = n.strip_prefix("transformer.").unwrap_or(n).to_string();
        tensors.push((
            bare,
            shape,
            v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
        ));
    }
    let t = 64usize; // n_positions
    let mask: Vec<u8> = (0..t * t).flat_map(|_| 1f32.to_le_bytes()).collect();
    tensors.push(("h.0.attn.bias".into(), vec![1, 1, t, t], mask));
    let views = tensors.iter().map(|(n, s, b)| {
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b);
        (n.clone(), view.unwrap())
    });
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let r = resolve(&dir).unwrap();
    assert!(
        r.decisions
            .iter()
            .any(|d| d.contains("without the `transformer.` prefix")),
        "{:?}",
        r.decisions
    );
    let (ids, targets) = inputs(name);
    let want = super::expected(name, "logits");
    let want_loss = super::expected(name, "loss")[0];
    let out = launch(&Launcher::threads(2), |pg| {
        let (decoder, mut model, _) = build_from_hf(pg, FsdpConfig::default(), &dir, false)?;
        let logits = decoder.logits(&mut model, &ids, false)?;
        let loss = lm_loss(&logits, &targets)?.to_scalar::<f32>()?;
        Ok((to_vec(&logits), loss))
    })
    .unwrap();
    for (logits, loss) in out {
        assert!(max_abs_diff(&logits, &want) < 1e-4);
        assert!((loss - want_loss).abs() < 1e-4);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_truncated_weights_file_says_how_many_bytes_are_missing() {
    let name = "family-qwen3";
    let dir = edited_config(name, "trunc", |t| format!("{t}\n"));
    let f = dir.join("model.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() - 1000]).unwrap();
    let e = resolve(&dir).unwrap_err().to_string();
    assert!(
        e.contains("model.safetensors")
            && e.contains(&format!("places tensor data up to byte {} (", bytes.len()))
            && e.contains(&format!("but the file has {} bytes", bytes.len() - 1000)),
        "{e}"
    );
    // Cut inside the header.
    std::fs::write(&f, &bytes[..100]).unwrap();
    let e = resolve(&dir).unwrap_err().to_string();
    assert!(
        e.contains("bytes of JSON follow the 8-byte length, but the file has 100 bytes"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unsupported_rope_type_is_named_under_the_key_the_file_uses() {
    // transformers 4's configs write `type`, transformers 5's `rope_type`.
    let dir = edited_config("family-qwen2", "yarn", |t| {
        t.replacen(
            '{',
            "{\n  \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4.0},",
            1,
        )
    });
    let e = resolve(&dir).unwrap_err().to_string();
    assert!(e.contains("key `rope_scaling.type` is \"yarn\""), "{e}");
    assert!(!e.contains("invalid argument"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn rotary_models_run_past_max_position_embeddings_and_gpt2_names_n_positions() {
    // transformers computes rotary positions for any context; GPT-2's table has n_positions
    // rows.
    let long = |name: &str, max: usize| {
        let dir = edited_config(name, "long", |t| {
            let key = if name == "family-gpt2" {
                "n_positions"
            } else {
                "max_position_embeddings"
            };
            t.replace(&format!("\"{key}\": 64"), &format!("\"{key}\": {max}"))
        });
        let (ids, _) = inputs(name);
        let r = launch(&Launcher::threads(1), |pg| {
            let (decoder, mut model, _) = build_from_hf(pg, FsdpConfig::default(), &dir, false)?;
            decoder.logits(&mut model, &ids, false).map(|l| to_vec(&l))
        });
        let _ = std::fs::remove_dir_all(&dir);
        r
    };
    // 8 positions of context for 12 tokens: Qwen3's logits are transformers' (rotary tables do
    // not depend on the maximum).
    let got = long("family-qwen3", 8).unwrap();
    assert!(max_abs_diff(&got[0], &super::expected("family-qwen3", "logits")) < 1e-4);
    // GPT-2 with an 8-row table cannot take 12 tokens (the weights' table has 64 rows, so the
    // shape check speaks first); the forward's own check names n_positions.
    let e = long("family-gpt2", 8).unwrap_err().to_string();
    assert!(
        e.contains("transformer.wpe.weight") && e.contains("expected shape [8, 32]"),
        "{e}"
    );
}

/// `DecoderConfig::differences` names the first differing entry of a list (a late layer type)
/// and of a table, so that two long values never print alike.
#[test]
fn config_differences_name_the_first_differing_entry() {
    let cfg = read_config(&fixture("family-gemma2")).unwrap();
    assert!(cfg.differences(&cfg).is_empty());
    let mut other = cfg.clone();
    let last = other.layer_types.len() - 1;
    other.layer_types[last] = LayerType::SlidingAttention;
    other.sliding_window = Some(cfg.sliding_window.unwrap() + 1);
    assert_eq!(
        cfg.differences(&other),
        [
            format!("layer_types[{last}]: \"full_attention\" → \"sliding_attention\""),
            format!(
                "sliding_window: {} → {}",
                cfg.sliding_window.unwrap(),
                cfg.sliding_window.unwrap() + 1
            ),
        ]
    );
}
