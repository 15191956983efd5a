//! Loading Hugging Face directories: the sharded index layout equals the single file, and bad
//! input (a missing tensor, a wrong shape, a non-float tensor, a tensor the model lacks, an
//! unsupported architecture or key) is an error naming the file and the tensor or key.

use std::path::{Path, PathBuf};

use candle_fsdp::hf::llama::{build_from_hf, read_config};
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::FsdpConfig;

use super::common::tmpdir;
use super::{fixture, inputs};

/// Every parameter of the model built from `dir` at world size `ws`, gathered (name, values).
pub(super) fn loaded(dir: &Path, ws: usize) -> Vec<(String, Vec<f32>)> {
    let mut out = launch(&Launcher::threads(ws), |pg| {
        let (_, model, _) = build_from_hf(pg, FsdpConfig::default(), dir, false)?;
        let params = model.gather_full_params(true)?;
        Ok(params.map(|ps| {
            ps.into_iter()
                .map(|(n, t)| (n, super::common::to_vec(&t)))
                .collect::<Vec<_>>()
        }))
    })
    .unwrap();
    out.swap_remove(0)
        .expect("rank 0 holds the gathered parameters")
}

#[test]
fn sharded_index_layout_loads_the_same_values_as_one_file() {
    let single = loaded(&fixture("llama-mha"), 2);
    let index = loaded(&fixture("llama-mha-index"), 3);
    assert!(
        std::fs::read_dir(fixture("llama-mha-index"))
            .unwrap()
            .filter(|e| e
                .as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("model-"))
            .count()
            > 1,
        "the fixture is really sharded"
    );
    assert_eq!(
        single.len(),
        2 + 2 * 9 + 1,
        "embedding, 2 blocks of 9, norm, head"
    );
    for ((a, va), (b, vb)) in single.iter().zip(&index) {
        assert_eq!(a, b);
        assert!(
            va.iter().zip(vb).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{a} differs"
        );
    }
    // And the values are the file's: the embedding's first row.
    let want = super::weights_of(&fixture("llama-mha"));
    let (_, _, emb) = want
        .iter()
        .find(|(n, _, _)| n == "model.embed_tokens.weight")
        .unwrap();
    assert_eq!(single[0].0, "model.embed_tokens.weight");
    assert_eq!(&single[0].1, emb);
}

/// A copy of fixture `name` in a fresh directory, with `edit` applied to the text of `file`.
fn edited(name: &str, tag: &str, file: &str, edit: impl Fn(&str) -> String) -> PathBuf {
    let dir = tmpdir(&format!("hf-{tag}"));
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    let text = std::fs::read_to_string(dir.join(file)).unwrap();
    let new = edit(&text);
    assert_ne!(new, text, "the edit changed {file}");
    std::fs::write(dir.join(file), new).unwrap();
    dir
}

/// The error of building from `dir` at world size 2 (on every rank), as text.
pub(super) fn load_error(dir: &Path) -> String {
    let e = launch(&Launcher::threads(2), |pg| {
        build_from_hf(pg, FsdpConfig::default(), dir, false).map(|_| ())
    })
    .unwrap_err();
    e.to_string()
}

#[test]
fn a_missing_tensor_is_named_with_the_file() {
    // The index no longer lists the final norm: the tensor is missing from the weights.
    let dir = edited(
        "llama-mha-index",
        "missing",
        "model.safetensors.index.json",
        |t| {
            let mut v: serde_json::Value = serde_json::from_str(t).unwrap();
            v["weight_map"]
                .as_object_mut()
                .unwrap()
                .remove("model.norm.weight")
                .unwrap();
            v.to_string()
        },
    );
    let e = load_error(&dir);
    assert!(
        e.contains("model.norm.weight") && e.contains("missing"),
        "{e}"
    );
    assert!(
        e.contains("model.safetensors.index.json") && e.contains("[32]"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A shard file the index names is missing: the index, the file and a tensor it should hold
/// are named (it was the bare "No such file or directory" of the shard's path).
#[test]
fn a_missing_shard_file_is_named_with_the_index() {
    let dir = edited(
        "llama-mha-index",
        "missing-shard",
        "model.safetensors.index.json",
        |t| format!("{t} "),
    );
    std::fs::remove_file(dir.join("model-00002-of-00004.safetensors")).unwrap();
    let e = load_error(&dir);
    assert!(
        e.contains(
            "model.safetensors.index.json: file model-00002-of-00004.safetensors (holding tensor "
        ) && e.contains("is missing from the directory"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_wrong_shape_names_file_tensor_expected_and_found() {
    // config.json says intermediate_size 40; the file's MLP matrices are 48 wide.
    let dir = edited("llama-mha", "shape", "config.json", |t| {
        t.replace("\"intermediate_size\": 48", "\"intermediate_size\": 40")
    });
    let e = load_error(&dir);
    assert!(e.contains("model.safetensors"), "{e}");
    assert!(
        e.contains("model.layers.0.mlp.gate_proj.weight")
            && e.contains("expected shape [40, 32], found [48, 32]"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_non_float_tensor_is_named_before_any_rank_reads() {
    // The header says I32 for the final norm (same size as F32: the file stays valid).
    let dir = tmpdir("hf-int");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("llama-mha").join(f), dir.join(f)).unwrap();
    }
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let key = b"\"model.norm.weight\":{\"dtype\":\"F32\"";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len() - 4;
    bytes[at..at + 3].copy_from_slice(b"I32");
    std::fs::write(&path, bytes).unwrap();
    let e = load_error(&dir);
    assert!(
        e.contains("model.safetensors")
            && e.contains("model.norm.weight")
            && e.contains("expected a float dtype")
            && e.contains("found I32"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_tensor_the_model_does_not_have_is_named() {
    // The fixture's tensors plus a `model.norm.bias` (Llama's norms have none).
    let dir = tmpdir("hf-extra");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        fixture("llama-mha").join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    let mut tensors = super::weights_of(&fixture("llama-mha"));
    tensors.push(("model.norm.bias".into(), vec![32], vec![0.0; 32]));
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views = tensors.iter().zip(&bytes).map(|((n, shape, _), b)| {
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b);
        (n.clone(), view.unwrap())
    });
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let e = load_error(&dir);
    assert!(
        e.contains("model.safetensors")
            && e.contains("tensor model.norm.bias is not a parameter of the model"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unsupported_architecture_or_key_is_named() {
    let dir = edited("llama-mha", "arch", "config.json", |t| {
        t.replace("LlamaForCausalLM", "GPTNeoXForCausalLM")
    });
    let e = load_error(&dir);
    assert!(
        e.contains("config.json")
            && e.contains("unsupported architecture [\"GPTNeoXForCausalLM\"]")
            && e.contains("LlamaForCausalLM"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    for (tag, from, to, says) in [
        (
            "act",
            "\"silu\"",
            "\"gelu\"",
            "key `hidden_act` is \"gelu\"",
        ),
        (
            "rope",
            "\"rope_type\": \"default\"",
            "\"rope_type\": \"yarn\"",
            "key `rope_parameters.rope_type` is \"yarn\"",
        ),
        // Llama 3's scaling needs its numbers.
        (
            "llama3",
            "\"rope_type\": \"default\"",
            "\"rope_type\": \"llama3\"",
            "key `rope_parameters.factor`: a number is needed for rope_type \"llama3\"",
        ),
    ] {
        let dir = edited("llama-mha", tag, "config.json", |t| t.replace(from, to));
        let e = read_config(&dir).unwrap_err().to_string();
        assert!(e.contains("config.json") && e.contains(says), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn loaded_model_runs_on_the_fixtures_inputs_at_world_size_3_from_the_index() {
    // The sharded layout gives transformers' logits too (the same weights as llama-mha).
    let (ids, _) = inputs("llama-mha");
    let want = super::expected("llama-mha", "logits");
    let out = launch(&Launcher::threads(3), |pg| {
        let (llama, mut model, _) = build_from_hf(
            pg,
            FsdpConfig::default(),
            &fixture("llama-mha-index"),
            false,
        )?;
        Ok(super::common::to_vec(
            &llama.logits(&mut model, &ids, false)?,
        ))
    })
    .unwrap();
    for got in out {
        assert!(super::max_abs_diff(&got, &want) < 1e-4);
    }
}
