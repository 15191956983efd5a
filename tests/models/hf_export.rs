//! Hugging Face checkpoints out: a fine-tuned checkpoint exported with `fsdp-ckpt export
//! --format hf` (single file and sharded with an index, f32 and bf16) reloads bit-exactly in
//! our loader at another world size, and, when a Python with `transformers` is present,
//! `AutoModelForCausalLM.from_pretrained` loads it and computes our logits.

use std::path::{Path, PathBuf};
use std::process::Command;

use candle_fsdp::checkpoint::{save_sharded, TrainState};
use candle_fsdp::hf::llama::{build_from_hf, resolve};
use candle_fsdp::hf::{export_hf, HfExportOptions, HF_CONFIG_KEY};
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::models::llama::lm_loss;
use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, ShardedOptimizer};

use super::common::{tmpdir, to_vec};
use super::{fixture, inputs, weights_of};

/// A checkpoint directory, the parameters (name, values) and the logits of the inputs.
pub(super) type Tuned = (PathBuf, Vec<(String, Vec<f32>)>, Vec<f32>);

/// Fine-tunes fixture `name` for one AdamW step at world size 2 and saves a sharded checkpoint
/// under `root` storing the fixture's config.json as it loads; returns the checkpoint directory, the
/// parameters after the step (name, values) and the logits of the fixture's inputs then.
pub(super) fn fine_tuned(name: &str, root: &Path) -> Tuned {
    let (ids, targets) = inputs(name);
    // config.json as it loads (untied when the files' head differs: `resolve`).
    let config = resolve(&fixture(name)).unwrap().config_json;
    let mut out = launch(&Launcher::threads(2), |pg| {
        let (llama, mut model, _) =
            build_from_hf(pg, FsdpConfig::default(), &fixture(name), false)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        let logits = llama.logits(&mut model, &ids, true)?;
        model.backward(&lm_loss(&logits, &targets)?)?;
        opt.step(&mut model)?;
        let mut state = TrainState {
            step: 1,
            ..Default::default()
        };
        state.extra.insert(HF_CONFIG_KEY.into(), config.clone());
        let dir = save_sharded(root, &model, &opt, &state, 0)?;
        let params = model
            .gather_full_params(false)?
            .expect("every rank")
            .into_iter()
            .map(|(n, t)| (n, to_vec(&t)))
            .collect::<Vec<_>>();
        let logits = to_vec(&llama.logits(&mut model, &ids, false)?);
        Ok((dir, params, logits))
    })
    .unwrap();
    out.swap_remove(0)
}

#[test]
fn export_import_round_trip_is_bit_exact_single_file_and_sharded() {
    let root = tmpdir("hf-export");
    let (ckpt, params, _) = fine_tuned("llama-gqa", &root.join("ckpt"));
    // One file (the default size limit), then sharded with an index (30 kB files).
    for (tag, max) in [("single", 5_000_000_000u64), ("sharded", 30_000)] {
        let out = root.join(tag);
        let s = export_hf(
            &ckpt,
            &out,
            &HfExportOptions {
                max_shard_bytes: max,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(s.tensors, params.len());
        assert_eq!(
            out.join("model.safetensors.index.json").exists(),
            tag == "sharded"
        );
        if tag == "sharded" {
            assert!(s.files.len() > 2, "{:?}", s.files);
            for f in &s.files {
                // At most 30 kB of tensor data per file, or one larger tensor alone.
                let bytes = std::fs::read(f).unwrap();
                let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
                let data: usize = st.tensors().iter().map(|(_, t)| t.data().len()).sum();
                assert!(
                    data <= 30_000 || st.len() == 1,
                    "{f:?}: {data} B in {} tensors",
                    st.len()
                );
            }
        }
        // The files hold exactly our values, under the HF names, in f32.
        let written = weights_of(&out);
        assert_eq!(written.len(), params.len());
        for (n, v) in &params {
            let (_, _, w) = written.iter().find(|(m, _, _)| m == n).unwrap();
            assert!(
                v.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{n}"
            );
        }
        // The config is the fixture's, with the dtype of the weights.
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(cfg["torch_dtype"], "float32");
        assert_eq!(cfg["num_key_value_heads"], 2);
        // Reloaded at world size 3: bit-exact.
        let back = launch(&Launcher::threads(3), |pg| {
            let (_, model, _) = build_from_hf(pg, FsdpConfig::default(), &out, false)?;
            model.gather_full_params(true)
        })
        .unwrap();
        let back = back.into_iter().next().unwrap().unwrap();
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
    }
    // A directory already holding weights is refused (mixing two exports).
    let e = export_hf(&ckpt, &root.join("single"), &HfExportOptions::default()).unwrap_err();
    assert!(
        e.to_string().contains("already holds Hugging Face weights"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// A Python that can import transformers and torch, or why not.
pub(super) fn python_with_transformers() -> Result<String, String> {
    let py = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    match Command::new(&py)
        .args([
            "-c",
            "import transformers, torch; print(transformers.__version__)",
        ])
        .output()
    {
        Ok(o) if o.status.success() => Ok(py),
        Ok(o) => Err(format!(
            "{py} cannot import transformers and torch: {}",
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .last()
                .unwrap_or("")
        )),
        Err(e) => Err(format!("no {py}: {e}")),
    }
}

/// transformers' f32 logits (flattened) of `ids` for each model directory of `dirs`, loaded with
/// `AutoModelForCausalLM.from_pretrained`; `check` is Python run on each model `m` first
/// (empty: none).
fn transformers_logits(
    python: &str,
    dirs: &[&Path],
    ids: &[Vec<u32>],
    check: &str,
) -> Vec<Vec<f32>> {
    let script = format!(
        "import sys, json, torch\n\
         from transformers import AutoModelForCausalLM\n\
         for d in sys.argv[1:]:\n\
         \x20   m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)\n\
         \x20   {check}\n\
         \x20   with torch.no_grad():\n\
         \x20       l = m(input_ids=torch.tensor({ids:?})).logits\n\
         \x20   print(json.dumps(l.flatten().tolist()))\n"
    );
    let o = Command::new(python)
        .arg("-c")
        .arg(&script)
        .args(dirs)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn cli_export_bf16_loads_in_transformers_with_our_logits() {
    let root = tmpdir("hf-export-cli");
    let (_, params, logits) = fine_tuned("llama-tied", &root.join("ckpt"));
    let out = root.join("hf");
    let o = Command::new(env!("CARGO_BIN_EXE_fsdp-ckpt"))
        .arg("export")
        .arg(root.join("ckpt"))
        .args(["--format", "hf", "--dtype", "bf16", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("Hugging Face layout") && stdout.contains("1 file(s)"),
        "{stdout}"
    );
    // bf16 values: ours rounded to nearest even, and no lm_head.weight (tied).
    let written = weights_of(&out);
    assert!(written.iter().all(|(n, _, _)| n != "lm_head.weight"));
    for (n, v) in &params {
        let (_, _, w) = written.iter().find(|(m, _, _)| m == n).unwrap();
        for (a, b) in v.iter().zip(w) {
            assert_eq!(
                half::bf16::from_f32(*a).to_f32().to_bits(),
                b.to_bits(),
                "{n}"
            );
        }
    }
    let python = match python_with_transformers() {
        Ok(p) => p,
        Err(why) => {
            println!("SKIPPED the transformers check of the export: {why}");
            eprintln!("SKIPPED the transformers check of the export: {why}");
            let _ = std::fs::remove_dir_all(&root);
            return;
        }
    };
    // f32 export for the logits comparison (bf16 rounding would dominate the difference).
    let out32 = root.join("hf32");
    let o = Command::new(env!("CARGO_BIN_EXE_fsdp-ckpt"))
        .arg("export")
        .arg(root.join("ckpt"))
        .args(["--format", "hf", "--max-shard-size", "40000", "--out"])
        .arg(&out32)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (ids, _) = inputs("llama-tied");
    let lines = transformers_logits(&python, &[&out32, &out], &ids.to_vec2().unwrap(), "");
    let d32 = super::max_abs_diff(&lines[0], &logits);
    let d16 = super::max_abs_diff(&lines[1], &logits);
    println!("transformers on our export: max |logits - ours| f32 {d32:.3e}, bf16 {d16:.3e}");
    assert!(d32 < 1e-4, "f32 export: {d32}");
    assert!(d16 < 0.1, "bf16 export: {d16}");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn export_without_a_config_says_how_to_give_one() {
    let root = tmpdir("hf-export-noconfig");
    launch(&Launcher::threads(1), |pg| {
        let (_, model, _) = build_from_hf(pg, FsdpConfig::default(), &fixture("llama-mha"), false)?;
        let opt = AdamW::new(AdamWConfig::default());
        save_sharded(&root.join("ckpt"), &model, &opt, &TrainState::default(), 0)?;
        Ok(())
    })
    .unwrap();
    let e = export_hf(
        &root.join("ckpt"),
        &root.join("out"),
        &HfExportOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("meta.json")
            && e.contains("no Hugging Face config")
            && e.contains("--hf-config"),
        "{e}"
    );
    // Given explicitly, it works.
    let opts = HfExportOptions {
        config: Some(fixture("llama-mha").join("config.json")),
        ..Default::default()
    };
    export_hf(&root.join("ckpt"), &root.join("out"), &opts).unwrap();
    assert!(root.join("out/config.json").exists());
    let _ = std::fs::remove_dir_all(&root);
}

/// A checkpoint whose tensors are not those of the config's model is refused before anything
/// is written (no output directory is created), naming the tensor, the checkpoint's
/// `meta.json`, the config and both shapes: another Llama's config (`--hf-config` of the
/// grouped-query fixture for the multi-head checkpoint), a checkpoint of another model, a
/// config of an architecture that cannot be checked.
#[test]
fn export_refuses_a_config_that_does_not_describe_the_checkpoint() {
    let root = tmpdir("hf-export-mismatch");
    let (ckpt, _, _) = fine_tuned("llama-mha", &root.join("ckpt"));
    let out = root.join("out").join("nested");
    let with_config = |config: PathBuf| HfExportOptions {
        config: Some(config),
        ..Default::default()
    };
    let gqa = fixture("llama-gqa").join("config.json");
    let e = export_hf(&ckpt, &out, &with_config(gqa.clone()))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("meta.json")
            && e.contains(&gqa.display().to_string())
            && e.contains("tensor model.layers.0.self_attn.k_proj.weight: the model of")
            && e.contains("expects shape [16, 32], the checkpoint has [32, 32]"),
        "{e}"
    );
    assert!(!root.join("out").exists(), "nothing created on refusal");

    // A checkpoint of another model (one plain linear unit), the Llama config stored with it.
    let other = root.join("other");
    let config = std::fs::read_to_string(fixture("llama-mha").join("config.json")).unwrap();
    launch(&Launcher::threads(1), |pg| {
        let model = candle_fsdp::FsdpModel::builder(pg, FsdpConfig::default())
            .unit("fc", |vb| candle_nn::linear(4, 4, vb))
            .build()?;
        let mut state = TrainState::default();
        state.extra.insert(HF_CONFIG_KEY.into(), config.clone());
        save_sharded(
            &other,
            &model,
            &AdamW::new(AdamWConfig::default()),
            &state,
            0,
        )?;
        Ok(())
    })
    .unwrap();
    let e = export_hf(&other, &out, &HfExportOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tensor model.embed_tokens.weight (shape [64, 32])")
            && e.contains("is not in the checkpoint"),
        "{e}"
    );
    assert!(!root.join("out").exists());

    // A config whose architecture cannot be checked.
    let neox = root.join("neox.json");
    std::fs::write(
        &neox,
        config.replace("LlamaForCausalLM", "GPTNeoXForCausalLM"),
    )
    .unwrap();
    let e = export_hf(&ckpt, &out, &with_config(neox))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("GPTNeoXForCausalLM") && e.contains("decoder's families"),
        "{e}"
    );
    assert!(!root.join("out").exists());

    // An output path that is a file.
    let file = root.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let e = export_hf(&ckpt, &file, &HfExportOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("exists and is not a directory"), "{e}");
    let _ = std::fs::remove_dir_all(&root);
}

/// An export that fails while writing (a full disk, simulated) leaves nothing behind: the
/// directories it created are removed, and in a directory that existed only its own files
/// are (the user's other files stay), so that the same command can be run again.
#[test]
fn failed_export_removes_what_it_wrote() {
    use candle_fsdp::checkpoint::fault;
    let root = tmpdir("hf-export-fail");
    let (ckpt, _, _) = fine_tuned("llama-mha", &root.join("ckpt"));
    // Several files (tensors of at most 20 kB each), failing after the first ones.
    let opts = HfExportOptions {
        max_shard_bytes: 20_000,
        ..Default::default()
    };
    let fresh = root.join("new").join("model");
    fault::fail_writes_after(60_000, false);
    let e = export_hf(&ckpt, &fresh, &opts);
    fault::disarm();
    assert!(e.is_err(), "the write should fail");
    assert!(!root.join("new").exists(), "created directories removed");

    let existing = root.join("existing");
    std::fs::create_dir_all(&existing).unwrap();
    std::fs::write(existing.join("README.md"), b"mine").unwrap();
    fault::fail_writes_after(60_000, false);
    let e = export_hf(&ckpt, &existing, &opts);
    fault::disarm();
    assert!(e.is_err());
    let left: Vec<String> = std::fs::read_dir(&existing)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, ["README.md"]);
    // And again, with nothing failing: it works.
    let s = export_hf(&ckpt, &existing, &opts).unwrap();
    assert!(s.files.len() > 3, "{:?}", s.files);
    assert!(existing.join(HF_INDEX_FILE_NAME).exists());
    let _ = std::fs::remove_dir_all(&root);
}

const HF_INDEX_FILE_NAME: &str = candle_fsdp::hf::weights::HF_INDEX_FILE;

/// The GPT example's model (a GPT-2 built from scratch, `models::gpt`) trained one step at
/// world size 2, saved with its `GPT2Config` (`GptConfig::hf_config`) and exported with
/// `--format hf`: our loader reads the directory back at world size 1 to the same logits, and
/// transformers' `GPT2LMHeadModel` computes them too (tied and untied heads).
#[cfg(feature = "gpt")]
#[test]
fn gpt_from_scratch_exports_to_transformers_gpt2() {
    use candle_core::{Device, Tensor};
    use candle_fsdp::models::decoder::family::config_from_json;
    use candle_fsdp::models::decoder::DecoderConfig;
    use candle_fsdp::models::gpt::{FsdpGpt, GptConfig};
    let root = tmpdir("hf-export-gpt");
    let ids = Tensor::new(
        &[[3u32, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]],
        &Device::Cpu,
    )
    .unwrap();
    let targets = ids.roll(-1, 1).unwrap();
    let mut checked = Vec::new();
    for tied in [true, false] {
        let cfg = GptConfig {
            n_layer: 2,
            n_head: 2,
            d_model: 16,
            seq_len: 8,
            tied,
            ..GptConfig::default()
        };
        let config = cfg.hf_config("float32").to_string();
        // The decoder reads the config back as the same model.
        let back = config_from_json(&config, Path::new("hf_config")).unwrap();
        assert_eq!(back, DecoderConfig::from(cfg), "tied {tied}");
        let ckpt_root = root.join(format!("ckpt-{tied}"));
        let (ckpt, logits) = launch(&Launcher::threads(2), |pg| {
            let gpt = FsdpGpt::new(cfg)?;
            let mut model = gpt
                .add_units(candle_fsdp::FsdpModel::builder(pg, FsdpConfig::default()))
                .build()?;
            let mut opt = AdamW::new(AdamWConfig::default());
            let l = gpt.logits(&mut model, &ids, true)?;
            model.backward(&lm_loss(&l, &targets)?)?;
            opt.step(&mut model)?;
            let mut state = TrainState {
                step: 1,
                ..Default::default()
            };
            state.extra.insert(HF_CONFIG_KEY.into(), config.clone());
            let dir = save_sharded(&ckpt_root, &model, &opt, &state, 0)?;
            Ok((dir, to_vec(&gpt.logits(&mut model, &ids, false)?)))
        })
        .unwrap()
        .swap_remove(0);
        let out = root.join(format!("hf-{tied}"));
        export_hf(&ckpt, &out, &HfExportOptions::default()).unwrap();
        let names: Vec<String> = weights_of(&out).into_iter().map(|(n, _, _)| n).collect();
        assert!(names.contains(&"transformer.h.1.attn.c_attn.weight".to_string()));
        assert_eq!(
            names.contains(&"lm_head.weight".to_string()),
            !tied,
            "{names:?}"
        );
        let reread = launch(&Launcher::threads(1), |pg| {
            let (gpt, mut model, _) = build_from_hf(pg, FsdpConfig::default(), &out, false)?;
            Ok(to_vec(&gpt.logits(&mut model, &ids, false)?))
        })
        .unwrap()
        .swap_remove(0);
        assert_eq!(reread, logits, "tied {tied}: our loader at world size 1");
        checked.push((out, logits));
    }
    let python = match python_with_transformers() {
        Ok(p) => p,
        Err(why) => {
            println!("SKIPPED the transformers check of the GPT export: {why}");
            eprintln!("SKIPPED the transformers check of the GPT export: {why}");
            let _ = std::fs::remove_dir_all(&root);
            return;
        }
    };
    let dirs: Vec<&Path> = checked.iter().map(|(d, _)| d.as_path()).collect();
    let check = "assert type(m).__name__ == 'GPT2LMHeadModel', type(m); \
                 assert m.config.bos_token_id is None and m.config.eos_token_id is None";
    let lines = transformers_logits(&python, &dirs, &ids.to_vec2().unwrap(), check);
    for ((_, ours), theirs) in checked.iter().zip(&lines) {
        let d = super::max_abs_diff(theirs, ours);
        println!("transformers GPT2LMHeadModel on the GPT export: max |logits - ours| {d:.3e}");
        assert!(d < 1e-5, "{d}");
    }
    let _ = std::fs::remove_dir_all(&root);
}
