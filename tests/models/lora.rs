//! LoRA on the decoder against PEFT 0.21 (`scripts/make-peft-fixture.py`: the tiny Llama of
//! `llama-gqa` with an adapter on q/v/o/gate/down, r 4, alpha 8, its A and B random): the
//! adapted logits and loss at world sizes 1, 2 and 3, one AdamW step on the adapters (the base
//! frozen and unchanged), the adapter saved in PEFT's layout and read back, and the errors.

use candle_fsdp::hf::decoder::{build_from_hf_with, HfOptions};
use candle_fsdp::hf::peft::{load_peft_adapter, save_peft_adapter, PEFT_WEIGHTS};
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::lora::{peft_name, LoraConfig};
use candle_fsdp::models::decoder::lm_loss;
use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, ShardedOptimizer};

use super::common::{tmpdir, to_vec};
use super::{fixture, inputs, max_abs_diff, weights_of, ExpectedFile};

const ADAPTER: &str = "lora-llama";
const BASE: &str = "llama-gqa";

fn expected_json() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture(ADAPTER).join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The fixture's LoRA config (PEFT's field names).
fn lora_config() -> LoraConfig {
    let v = &expected_json()["lora"];
    LoraConfig::new(
        v["r"].as_u64().unwrap() as usize,
        v["lora_alpha"].as_f64().unwrap(),
        v["target_modules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().to_string()),
    )
}

fn opts() -> HfOptions {
    HfOptions {
        activation_checkpointing: false,
        lora: Some(lora_config()),
    }
}

#[test]
fn adapted_logits_and_loss_equal_peft_at_world_sizes_1_2_3() {
    let (ids, targets) = inputs(BASE);
    let want = ExpectedFile::open(ADAPTER);
    let (logits_want, loss_want) = (want.get("logits"), want.get("loss")[0]);
    for ws in [1, 2, 3] {
        let out = launch(&Launcher::threads(ws), |pg| {
            let (decoder, mut model, _) =
                build_from_hf_with(pg, FsdpConfig::default(), &fixture(BASE), &opts())?;
            // Before the adapter is read: A random, B zero, so the model is the base.
            let fresh = decoder.logits(&mut model, &ids, false)?;
            load_peft_adapter(&fixture(ADAPTER), &mut model)?;
            let logits = decoder.logits(&mut model, &ids, false)?;
            let loss = lm_loss(&logits, &targets)?.to_scalar::<f32>()?;
            Ok((to_vec(&fresh), to_vec(&logits), loss))
        })
        .unwrap();
        let base_logits: Vec<f32> = super::expected(BASE, "logits");
        for (rank, (fresh, logits, loss)) in out.iter().enumerate() {
            let d = max_abs_diff(fresh, &base_logits);
            assert!(
                d < 2e-5,
                "ws {ws} rank {rank}: fresh adapters change the base by {d}"
            );
            let d = max_abs_diff(logits, &logits_want);
            assert!(
                d < 2e-5,
                "ws {ws} rank {rank}: logits differ from PEFT's by {d}"
            );
            assert!(
                (loss - loss_want).abs() < 2e-5,
                "ws {ws}: loss {loss} vs {loss_want}"
            );
        }
    }
}

#[test]
fn one_adamw_step_on_the_adapters_equals_peft_and_the_base_stays() {
    let (ids, targets) = inputs(BASE);
    let want = ExpectedFile::open(ADAPTER);
    let a = &expected_json()["adamw"];
    let cfg = AdamWConfig {
        lr: a["lr"].as_f64().unwrap(),
        beta1: a["betas"][0].as_f64().unwrap(),
        beta2: a["betas"][1].as_f64().unwrap(),
        eps: a["eps"].as_f64().unwrap(),
        weight_decay: a["weight_decay"].as_f64().unwrap(),
    };
    let base = weights_of(&fixture(BASE));
    for ws in [1, 2] {
        let params = launch(&Launcher::threads(ws), |pg| {
            let (decoder, mut model, _) =
                build_from_hf_with(pg, FsdpConfig::default(), &fixture(BASE), &opts())?;
            load_peft_adapter(&fixture(ADAPTER), &mut model)?;
            let mut opt = AdamW::new(cfg);
            let logits = decoder.logits(&mut model, &ids, true)?;
            model.backward(&lm_loss(&logits, &targets)?)?;
            opt.step(&mut model)?;
            model.gather_full_params(true)
        })
        .unwrap();
        let params = params[0].as_ref().expect("rank 0");
        let mut adapters = 0;
        for (n, t) in params {
            let got = to_vec(t);
            if n.contains(".lora_") {
                adapters += 1;
                let theirs = want.get(&format!("step.{}", peft_name(n)));
                let d = max_abs_diff(&got, &theirs);
                assert!(d < 1e-5, "ws {ws}: {n} differs from PEFT's step by {d}");
            } else {
                let (_, _, b) = base
                    .iter()
                    .find(|(m, _, _)| m == n)
                    .unwrap_or_else(|| panic!("{n} not in the base"));
                assert!(
                    got.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "ws {ws}: frozen {n} changed"
                );
            }
        }
        assert_eq!(adapters, 20, "ws {ws}: 2 layers × 5 targets × (A, B)");
    }
}

#[test]
fn saved_adapter_has_peft_names_and_reads_back_at_another_world_size() {
    let dir = tmpdir("lora-save");
    let (ids, _) = inputs(BASE);
    let saved = launch(&Launcher::threads(2), |pg| {
        let (decoder, mut model, _) =
            build_from_hf_with(pg, FsdpConfig::default(), &fixture(BASE), &opts())?;
        load_peft_adapter(&fixture(ADAPTER), &mut model)?;
        save_peft_adapter(&model, &lora_config(), Some("llama-gqa"), &dir)?;
        Ok(to_vec(&decoder.logits(&mut model, &ids, false)?))
    })
    .unwrap();
    // Tensor for tensor, PEFT's names, shapes and values.
    let read = |p: &std::path::Path| {
        let bytes = std::fs::read(p).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut v: Vec<(String, Vec<usize>, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(n, t)| (n, t.shape().to_vec(), t.data().to_vec()))
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        read(&dir.join(PEFT_WEIGHTS)),
        read(&fixture(ADAPTER).join(PEFT_WEIGHTS))
    );
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["peft_type"], "LORA");
    assert_eq!(cfg["r"], 4);
    assert_eq!(cfg["lora_alpha"], 8.0);
    // Read back at world size 3: the same logits.
    let again = launch(&Launcher::threads(3), |pg| {
        let (decoder, mut model, _) =
            build_from_hf_with(pg, FsdpConfig::default(), &fixture(BASE), &opts())?;
        load_peft_adapter(&dir, &mut model)?;
        Ok(to_vec(&decoder.logits(&mut model, &ids, false)?))
    })
    .unwrap();
    assert_eq!(again[0], saved[0]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn lora_errors_name_the_problem() {
    let build = |lora: LoraConfig| {
        launch(&Launcher::threads(1), |pg| {
            let opts = HfOptions {
                activation_checkpointing: false,
                lora: Some(lora.clone()),
            };
            build_from_hf_with(pg, FsdpConfig::default(), &fixture(BASE), &opts).map(|_| ())
        })
        .unwrap_err()
        .to_string()
    };
    let e = build(LoraConfig::new(4, 8.0, ["query_key_value"]));
    assert!(
        e.contains("matches no projection")
            && e.contains("q_proj")
            && e.contains("down_proj")
            && e.contains("query_key_value"),
        "{e}"
    );
    let e = build(LoraConfig::new(0, 8.0, ["q_proj"]));
    assert!(e.contains("r (the rank) must be at least 1"), "{e}");
    let mut dropout = LoraConfig::new(4, 8.0, ["q_proj"]);
    dropout.dropout = 1.0;
    let e = build(dropout);
    assert!(
        e.contains("dropout must be in [0, 1)") && e.contains("found 1"),
        "{e}"
    );
    // An adapter of another rank: the shape mismatch names the file and the tensor.
    let e = launch(&Launcher::threads(2), |pg| {
        let opts = HfOptions {
            activation_checkpointing: false,
            lora: Some(LoraConfig::new(8, 16.0, lora_config().targets)),
        };
        let (_, mut model, _) =
            build_from_hf_with(pg, FsdpConfig::default(), &fixture(BASE), &opts)?;
        load_peft_adapter(&fixture(ADAPTER), &mut model).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(PEFT_WEIGHTS)
            && e.contains("lora_A.weight: expected shape [8, 32], found [4, 32]"),
        "{e}"
    );
    // An adapter on fewer modules than the file holds: the extra tensor is named.
    let e = launch(&Launcher::threads(1), |pg| {
        let opts = HfOptions {
            activation_checkpointing: false,
            lora: Some(LoraConfig::new(4, 8.0, ["q_proj"])),
        };
        let (_, mut model, _) =
            build_from_hf_with(pg, FsdpConfig::default(), &fixture(BASE), &opts)?;
        load_peft_adapter(&fixture(ADAPTER), &mut model).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("is not a LoRA parameter of the model"), "{e}");
}

#[test]
fn a_lora_checkpoint_exports_its_adapters_in_peft_layout() {
    use candle_fsdp::checkpoint::{save_sharded, TrainState};
    use candle_fsdp::hf::export_peft;
    use candle_fsdp::lora::LORA_CONFIG_KEY;
    let root = tmpdir("lora-export");
    let (ids, targets) = inputs(BASE);
    let lora = lora_config();
    let trained = launch(&Launcher::threads(2), |pg| {
        let (decoder, mut model, _) =
            build_from_hf_with(pg, FsdpConfig::default(), &fixture(BASE), &opts())?;
        load_peft_adapter(&fixture(ADAPTER), &mut model)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        let logits = decoder.logits(&mut model, &ids, true)?;
        model.backward(&lm_loss(&logits, &targets)?)?;
        opt.step(&mut model)?;
        let mut state = TrainState {
            step: 1,
            ..Default::default()
        };
        state.extra.insert(
            LORA_CONFIG_KEY.into(),
            serde_json::to_string(&lora).unwrap(),
        );
        let dir = save_sharded(&root.join("ckpt"), &model, &opt, &state, 0)?;
        let params = model.gather_full_params(false)?.expect("every rank");
        Ok((dir, params))
    })
    .unwrap();
    let (ckpt, params) = &trained[0];
    let out = root.join("adapter");
    let s = export_peft(ckpt, &out, Some("llama-gqa")).unwrap();
    assert_eq!(s.tensors, 20);
    let bytes = std::fs::read(out.join(PEFT_WEIGHTS)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.names().len(), 20, "only the adapters, no base tensor");
    for (n, t) in params.iter().filter(|(n, _)| n.contains(".lora_")) {
        let got: Vec<f32> = st
            .tensor(&peft_name(n))
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(got, to_vec(t), "{n}");
    }
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["base_model_name_or_path"], "llama-gqa");
    assert_eq!(cfg["target_modules"].as_array().unwrap().len(), 5);
    // A full fine-tuning checkpoint has no adapter to export: said, naming the key.
    let (full, _, _) = super::hf_export::fine_tuned(BASE, &root.join("full"));
    let e = export_peft(&full, &root.join("none"), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a LoRA run's checkpoint"), "{e}");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn merged_export_equals_peft_merge_and_unload() {
    use candle_fsdp::checkpoint::{save_sharded, TrainState};
    use candle_fsdp::hf::decoder::resolve;
    use candle_fsdp::hf::{export_hf, HfExportOptions, HF_CONFIG_KEY};
    use candle_fsdp::lora::LORA_CONFIG_KEY;
    let root = tmpdir("lora-merge");
    let config = resolve(&fixture(BASE)).unwrap().config_json;
    let lora = lora_config();
    let ckpt = launch(&Launcher::threads(2), |pg| {
        let (_, mut model, _) =
            build_from_hf_with(pg, FsdpConfig::default(), &fixture(BASE), &opts())?;
        load_peft_adapter(&fixture(ADAPTER), &mut model)?;
        let opt = AdamW::new(AdamWConfig::default());
        let mut state = TrainState::default();
        state.extra.insert(HF_CONFIG_KEY.into(), config.clone());
        state.extra.insert(
            LORA_CONFIG_KEY.into(),
            serde_json::to_string(&lora).unwrap(),
        );
        save_sharded(&root.join("ckpt"), &model, &opt, &state, 0)
    })
    .unwrap()
    .swap_remove(0);
    // Without --merge a LoRA checkpoint is refused, naming both ways out.
    let e = export_hf(&ckpt, &root.join("plain"), &HfExportOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("--format peft") && e.contains("--merge"), "{e}");
    let out = root.join("merged");
    let opts = HfExportOptions {
        merge: true,
        ..Default::default()
    };
    export_hf(&ckpt, &out, &opts).unwrap();
    let want = ExpectedFile::open(ADAPTER);
    let written = weights_of(&out);
    let mut merged_names: Vec<String> = want
        .names()
        .into_iter()
        .filter_map(|n| n.strip_prefix("merged.").map(String::from))
        .collect();
    merged_names.sort();
    let mut ours: Vec<String> = written.iter().map(|(n, _, _)| n.clone()).collect();
    ours.sort();
    assert_eq!(ours, merged_names, "the merged model's tensors, no adapter");
    let mut adapted = 0;
    for (n, _, v) in &written {
        let theirs = want.get(&format!("merged.{n}"));
        let d = max_abs_diff(v, &theirs);
        assert!(d < 1e-6, "{n} differs from PEFT's merge by {d}");
        let base = &weights_of(&fixture(BASE))
            .into_iter()
            .find(|(m, _, _)| m == n)
            .unwrap()
            .2;
        if max_abs_diff(v, base) > 1e-3 {
            adapted += 1;
        }
    }
    assert_eq!(adapted, 10, "2 layers × 5 targets changed by the merge");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn an_adapter_whose_config_differs_from_the_runs_is_refused_naming_the_field() {
    use candle_fsdp::hf::peft::check_peft_config;
    check_peft_config(&fixture(ADAPTER), &lora_config()).unwrap();
    let mut alpha = lora_config();
    alpha.alpha = 16.0;
    let e = check_peft_config(&fixture(ADAPTER), &alpha)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("adapter_config.json")
            && e.contains("lora_alpha is 8, this run's is 16 (--lora-alpha)"),
        "{e}"
    );
    let mut rs = lora_config();
    rs.rslora = true;
    let e = check_peft_config(&fixture(ADAPTER), &rs)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("use_rslora is false, this run's is true (--rslora)"),
        "{e}"
    );
    let mut r = lora_config();
    r.r = 8;
    let e = check_peft_config(&fixture(ADAPTER), &r)
        .unwrap_err()
        .to_string();
    assert!(e.contains("r is 4, this run's is 8 (--lora-rank)"), "{e}");
}

#[test]
fn dropout_is_the_same_under_activation_checkpointing_and_off_in_evaluation() {
    let (ids, targets) = inputs(BASE);
    // Three AdamW steps at world size 2: the losses and the adapters after them.
    let run = |dropout: f64, checkpointing: bool| {
        let (ids, targets) = (ids.clone(), targets.clone());
        launch(&Launcher::threads(2), move |pg| {
            let mut lora = lora_config();
            lora.dropout = dropout;
            let opts = HfOptions {
                activation_checkpointing: checkpointing,
                lora: Some(lora),
            };
            let (decoder, mut model, _) =
                build_from_hf_with(pg, FsdpConfig::default(), &fixture(BASE), &opts)?;
            load_peft_adapter(&fixture(ADAPTER), &mut model)?;
            let eval = to_vec(&decoder.logits(&mut model, &ids, false)?);
            let mut opt = AdamW::new(AdamWConfig::default());
            let mut losses = Vec::new();
            for _ in 0..3 {
                let logits = decoder.logits(&mut model, &ids, true)?;
                let loss = lm_loss(&logits, &targets)?;
                losses.push(loss.to_scalar::<f32>()?);
                model.backward(&loss)?;
                opt.step(&mut model)?;
            }
            let params = model.gather_full_params(false)?.expect("every rank");
            let adapters: Vec<Vec<f32>> = params
                .iter()
                .filter(|(n, _)| n.contains(".lora_"))
                .map(|(_, t)| to_vec(t))
                .collect();
            Ok((eval, losses, adapters))
        })
        .unwrap()
        .swap_remove(0)
    };
    let plain = run(0.0, false);
    let dropped = run(0.1, false);
    let recomputed = run(0.1, true);
    // Evaluation runs without dropout; training with it follows another path.
    assert_eq!(dropped.0, plain.0, "evaluation applied dropout");
    assert_ne!(dropped.1[0].to_bits(), plain.1[0].to_bits());
    // The recomputation of a checkpointed call draws the forward's masks, and the checkpointed
    // forward runs the block node's kernel (nothing tracks gradients there): the same run, bit
    // for bit.
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&dropped.1),
        bits(&recomputed.1),
        "losses {:?} vs {:?}",
        dropped.1,
        recomputed.1
    );
    for (a, b) in dropped.2.iter().zip(&recomputed.2) {
        let d = max_abs_diff(a, b);
        assert!(
            d == 0.0,
            "adapters differ by {d} under activation checkpointing"
        );
    }
    // And the run is deterministic.
    assert_eq!(run(0.1, false).1, dropped.1);
}
