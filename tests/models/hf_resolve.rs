//! A Hugging Face directory resolved as transformers' `from_pretrained` resolves it (issue 30):
//! which weights file wins when a single file and an index are both present, and whether a head
//! declared tied is tied when the files hold one. Each fixture (`resolve-*`, written by
//! `scripts/make-hf-resolve-fixture.py`) records transformers' own choice and its logits; our
//! choice must be the same, said in `decisions`, and our logits must equal transformers'.

use candle_fsdp::hf::llama::{build_from_hf, resolve};
use candle_fsdp::hf::{export_hf, HfExportOptions};
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::FsdpConfig;

use super::common::{tmpdir, to_vec};
use super::fixture;
use super::hf_export::fine_tuned;
use super::llama::logits_match;

/// What transformers decided for fixture `name` (its `expected.json`): whether the loaded head
/// is the embedding's storage.
fn transformers_tied(name: &str) -> bool {
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["tied"].as_bool().expect("expected.json records `tied`")
}

#[test]
fn a_head_that_differs_from_the_embedding_is_not_tied_whatever_the_config_says() {
    let name = "resolve-tied-differs";
    let text = std::fs::read_to_string(fixture(name).join("config.json")).unwrap();
    assert!(
        text.contains("\"tie_word_embeddings\": true"),
        "the fixture's flag is on"
    );
    let r = resolve(&fixture(name)).unwrap();
    assert!(
        !transformers_tied(name),
        "transformers keeps the file's head"
    );
    assert_eq!(r.config.tie_word_embeddings, transformers_tied(name));
    assert_eq!(r.decisions.len(), 1, "{:?}", r.decisions);
    assert!(
        r.decisions[0].contains("not tying lm_head")
            && r.decisions[0].contains("differs from model.embed_tokens.weight"),
        "{:?}",
        r.decisions
    );
    // The config a checkpoint stores (and the export writes) says untied.
    let v: serde_json::Value = serde_json::from_str(&r.config_json).unwrap();
    assert_eq!(v["tie_word_embeddings"], false);
    assert_eq!(v["hidden_size"], 32, "the other keys kept");
    for ws in [1, 2, 3] {
        logits_match(name, ws);
    }
}

#[test]
fn a_tied_config_whose_file_holds_only_the_head_ties_the_embedding_to_it() {
    let name = "resolve-tied-head-only";
    let r = resolve(&fixture(name)).unwrap();
    assert!(transformers_tied(name));
    assert_eq!(r.config.tie_word_embeddings, transformers_tied(name));
    assert!(
        r.decisions.len() == 1
            && r.decisions[0].contains("tying model.embed_tokens.weight to lm_head.weight"),
        "{:?}",
        r.decisions
    );
    for ws in [1, 2, 3] {
        logits_match(name, ws);
    }
}

#[test]
fn a_single_file_wins_over_an_index_beside_it_as_in_transformers() {
    for name in ["resolve-single-and-index", "resolve-index-missing"] {
        let r = resolve(&fixture(name)).unwrap();
        assert!(
            r.decisions.len() == 1
                && r.decisions[0]
                    .contains("using model.safetensors; ignoring model.safetensors.index.json"),
            "{name}: {:?}",
            r.decisions
        );
        // The logits are those of model.safetensors (transformers' `loaded`), not the index's.
        for ws in [1, 2] {
            logits_match(name, ws);
        }
    }
    // Without the single file the index's shards are loaded (another model: other logits), and
    // with their files missing that is refused naming the index and the file.
    let dir = tmpdir("hf-index-only");
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(fixture("resolve-single-and-index")).unwrap() {
        let e = e.unwrap();
        if e.file_name() != "model.safetensors" {
            std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
        }
    }
    let r = resolve(&dir).unwrap();
    assert!(r.decisions.is_empty(), "{:?}", r.decisions);
    let norm = |d: &std::path::Path| -> Vec<f32> {
        super::weights_of(d)
            .into_iter()
            .find(|(n, _, _)| n == "model.norm.weight")
            .unwrap()
            .2
    };
    let loaded = launch(&Launcher::threads(2), |pg| {
        let (_, model, _) = build_from_hf(pg, FsdpConfig::default(), &dir, false)?;
        model.gather_full_params(true)
    })
    .unwrap()
    .swap_remove(0)
    .unwrap();
    let (_, t) = loaded
        .iter()
        .find(|(n, _)| n == "model.norm.weight")
        .unwrap();
    assert_eq!(to_vec(t), norm(&dir), "the index's values");
    assert_ne!(
        norm(&dir),
        norm(&fixture("resolve-single-and-index")),
        "the two models differ"
    );
    std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    let e = resolve(&dir).unwrap_err().to_string();
    assert!(
        e.contains("model.safetensors.index.json")
            && e.contains("model-00002-of-00002.safetensors")
            && e.contains("missing"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn pickle_only_weights_are_refused_naming_the_file() {
    let dir = tmpdir("hf-pickle");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        fixture("llama-mha").join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    std::fs::write(dir.join("pytorch_model.bin"), b"PK\x03\x04 not read").unwrap();
    let e = resolve(&dir).unwrap_err().to_string();
    assert!(
        e.contains("neither model.safetensors nor model.safetensors.index.json")
            && e.contains("pytorch_model.bin")
            && e.contains("safe_serialization=True"),
        "{e}"
    );
    let e = launch(&Launcher::threads(2), |pg| {
        build_from_hf(pg, FsdpConfig::default(), &dir, false).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("pytorch_model.bin"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_untied_head_survives_fine_tuning_and_export() {
    // Fine-tuned from the directory whose flag says tied but whose head differs: the export
    // says untied and holds both tensors, and reloads bit-exactly.
    let root = tmpdir("hf-untied-export");
    let (ckpt, params, _) = fine_tuned("resolve-tied-differs", &root.join("ckpt"));
    assert!(params.iter().any(|(n, _)| n == "lm_head.weight"));
    let out = root.join("hf");
    export_hf(&ckpt, &out, &HfExportOptions::default()).unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["tie_word_embeddings"], false);
    let r = resolve(&out).unwrap();
    assert!(r.decisions.is_empty(), "{:?}", r.decisions);
    let back = launch(&Launcher::threads(3), |pg| {
        let (_, model, _) = build_from_hf(pg, FsdpConfig::default(), &out, false)?;
        model.gather_full_params(true)
    })
    .unwrap()
    .swap_remove(0)
    .unwrap();
    assert_eq!(back.len(), params.len());
    for ((n, v), (m, t)) in params.iter().zip(&back) {
        assert_eq!(n, m);
        assert!(
            v.iter()
                .zip(to_vec(t))
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{n}"
        );
    }
    let _ = std::fs::remove_dir_all(&root);
}
