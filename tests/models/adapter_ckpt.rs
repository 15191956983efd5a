//! Adapter-only checkpoints (issue 33, decision 75): a LoRA run built from a Hugging Face
//! directory stores only the adapters and their optimizer state, plus the base's identity;
//! it resumes bit-exact at another world size (also on a packed base), refuses a changed base
//! naming the file, and `fsdp-ckpt verify` / `export --format hf --merge` read it.

use std::path::{Path, PathBuf};

use candle_fsdp::checkpoint::tools::verify;
use candle_fsdp::checkpoint::{load_sharded, save_sharded, TrainState};
use candle_fsdp::hf::decoder::{build_from_hf_with, resolve, HfOptions};
use candle_fsdp::hf::peft::load_peft_adapter;
use candle_fsdp::hf::{export_hf, HfExportOptions, HF_CONFIG_KEY};
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::lora::{LoraConfig, LORA_CONFIG_KEY};
use candle_fsdp::models::decoder::lm_loss;
use candle_fsdp::quant::BaseDType;
use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, ShardedOptimizer};

use super::common::{tmpdir, to_vec};
use super::{fixture, inputs, max_abs_diff, weights_of};

const ADAPTER: &str = "lora-llama";
const BASE: &str = "llama-gqa";

fn lora() -> LoraConfig {
    LoraConfig::new(
        4,
        8.0,
        ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"].map(String::from),
    )
}

fn opts() -> HfOptions {
    HfOptions {
        activation_checkpointing: false,
        lora: Some(lora()),
    }
}

/// Every gathered parameter: (name, values).
type Params = Vec<(String, Vec<f32>)>;

/// A copy of the base fixture under `root` (so that a test may change it).
fn base_copy(root: &Path) -> PathBuf {
    let dir = root.join("base");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture(BASE).join(f), dir.join(f)).unwrap();
    }
    dir
}

/// One AdamW step at world size 2 on `base` stored as `storage`, saved under `root/ckpt`; then
/// the next forward's loss and every gathered parameter (what a resume must reproduce).
fn train_and_save(base: &Path, storage: BaseDType, root: &Path) -> (PathBuf, f32, Params) {
    let (ids, targets) = inputs(BASE);
    let config = resolve(base).unwrap().config_json;
    let base = base.to_path_buf();
    let ckpt = root.join("ckpt");
    launch(&Launcher::threads(2), move |pg| {
        let fsdp = FsdpConfig {
            frozen_storage: storage,
            ..FsdpConfig::default()
        };
        let (decoder, mut model, _) = build_from_hf_with(pg, fsdp, &base, &opts())?;
        load_peft_adapter(&fixture(ADAPTER), &mut model)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        let logits = decoder.logits(&mut model, &ids, true)?;
        model.backward(&lm_loss(&logits, &targets)?)?;
        opt.step(&mut model)?;
        let mut state = TrainState {
            step: 1,
            ..Default::default()
        };
        state.extra.insert(HF_CONFIG_KEY.into(), config.clone());
        state.extra.insert(
            LORA_CONFIG_KEY.into(),
            serde_json::to_string(&lora()).unwrap(),
        );
        let dir = save_sharded(&ckpt, &model, &opt, &state, 0)?;
        let loss = lm_loss(&decoder.logits(&mut model, &ids, false)?, &targets)?;
        let params = model.gather_full_params(false)?.expect("every rank");
        let params = params.iter().map(|(n, t)| (n.clone(), to_vec(t))).collect();
        Ok((dir, loss.to_scalar::<f32>()?, params))
    })
    .unwrap()
    .swap_remove(0)
}

/// Builds from `base` at `ws`, loads `ckpt`; the next forward's loss and the parameters.
fn resume(
    base: &Path,
    storage: BaseDType,
    ckpt: &Path,
    ws: usize,
) -> candle_fsdp::Result<(f32, Params)> {
    let (ids, targets) = inputs(BASE);
    let (base, ckpt) = (base.to_path_buf(), ckpt.to_path_buf());
    launch(&Launcher::threads(ws), move |pg| {
        let fsdp = FsdpConfig {
            frozen_storage: storage,
            ..FsdpConfig::default()
        };
        let (decoder, mut model, _) = build_from_hf_with(pg, fsdp, &base, &opts())?;
        let mut opt = AdamW::new(AdamWConfig::default());
        load_sharded(&ckpt, &mut model, &mut opt)?;
        let loss = lm_loss(&decoder.logits(&mut model, &ids, false)?, &targets)?;
        let params = model.gather_full_params(false)?.expect("every rank");
        let params = params.iter().map(|(n, t)| (n.clone(), to_vec(t))).collect();
        Ok((loss.to_scalar::<f32>()?, params))
    })
    .map(|mut v| v.swap_remove(0))
}

#[test]
fn a_lora_checkpoint_holds_only_the_adapters_and_resumes_bit_exact_at_another_world_size() {
    for storage in [BaseDType::F32, BaseDType::Nf4] {
        let root = tmpdir(&format!("adapter-ckpt-{}", storage.name()));
        let base = base_copy(&root);
        let (ckpt, loss, params) = train_and_save(&base, storage, &root);
        // The files: adapters and their AdamW state only, no tensor of the base.
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(ckpt.join("meta.json")).unwrap())
                .unwrap();
        let units = meta["units"].as_array().unwrap();
        let stored: Vec<&serde_json::Value> = units
            .iter()
            .filter(|u| !u["in_base"].as_bool().unwrap_or(false))
            .collect();
        assert!(!stored.is_empty() && stored.len() < units.len());
        for u in &stored {
            for p in u["params"].as_array().unwrap() {
                let n = p["name"].as_str().unwrap();
                assert!(
                    n.contains(".lora_"),
                    "{storage:?}: {n} stored beside the adapters"
                );
            }
        }
        let base_files = meta["base"]["files"].as_array().unwrap();
        let names: Vec<&str> = base_files
            .iter()
            .map(|f| f["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["config.json", "model.safetensors"]);
        let adapters: usize = params
            .iter()
            .filter(|(n, _)| n.contains(".lora_"))
            .map(|(_, v)| v.len())
            .sum();
        let shard_bytes: u64 = std::fs::read_dir(&ckpt)
            .unwrap()
            .map(|e| e.unwrap())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
            .map(|e| e.metadata().unwrap().len())
            .sum();
        // Parameters and two AdamW buffers of the adapters, padding and headers.
        assert!(
            shard_bytes < (3 * 4 * adapters + 16_384) as u64,
            "{storage:?}: {shard_bytes} bytes for {adapters} adapter elements"
        );
        // Resume at world size 3: the same parameters (adapters from the files, the base
        // re-read and re-packed) and the same loss, bit for bit.
        let (loss3, params3) = resume(&base, storage, &ckpt, 3).unwrap();
        assert_eq!(
            loss3.to_bits(),
            loss.to_bits(),
            "{storage:?}: loss after resume"
        );
        assert_eq!(params.len(), params3.len());
        for ((n, a), (m, b)) in params.iter().zip(&params3) {
            assert_eq!(n, m);
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "{storage:?}: {n} differs after resume at world size 3"
            );
        }
        assert!(verify(&ckpt).unwrap().is_ok(), "fsdp-ckpt verify");
        // inspect names the base; a PEFT export without --base-model names it too.
        let base_dir = std::fs::canonicalize(&base).unwrap().display().to_string();
        let shown = candle_fsdp::checkpoint::tools::inspect(&ckpt)
            .unwrap()
            .to_string();
        assert!(
            shown.contains("frozen base") && shown.contains(&base_dir),
            "{shown}"
        );
        let peft = root.join("peft");
        candle_fsdp::hf::export_peft(&ckpt, &peft, None).unwrap();
        let cfg: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(peft.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(cfg["base_model_name_or_path"], base_dir.as_str());
        let _ = std::fs::remove_dir_all(&root);
    }
}

#[test]
fn a_changed_base_is_refused_naming_the_file() {
    let root = tmpdir("adapter-ckpt-changed");
    let base = base_copy(&root);
    let (ckpt, _, _) = train_and_save(&base, BaseDType::F32, &root);
    // One weight changed in place (same size): named by its checksum.
    let path = base.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let e = resume(&base, BaseDType::F32, &ckpt, 2)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.safetensors differs") && e.contains("has changed since"),
        "{e}"
    );
    // fsdp-ckpt verify says so too.
    let report = verify(&ckpt).unwrap();
    assert!(!report.is_ok(), "verify passed a changed base");
    let p = report.problems[0].to_string();
    assert!(
        p.contains("meta.json") && p.contains("model.safetensors differs"),
        "{p}"
    );
    // Another base directory altogether: its config is named.
    let other = root.join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::copy(
        fixture(BASE).join("model.safetensors"),
        other.join("model.safetensors"),
    )
    .unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(BASE).join("config.json")).unwrap())
            .unwrap();
    config["rms_norm_eps"] = serde_json::json!(1e-5);
    std::fs::write(other.join("config.json"), config.to_string()).unwrap();
    let e = resume(&other, BaseDType::F32, &ckpt, 2)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("config.json has") || e.contains("config.json differs"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_merged_export_of_an_adapter_only_checkpoint_reads_the_base() {
    let root = tmpdir("adapter-ckpt-merge");
    let base = base_copy(&root);
    let (ckpt, _, params) = train_and_save(&base, BaseDType::F32, &root);
    let out = root.join("merged");
    let opts = HfExportOptions {
        merge: true,
        ..Default::default()
    };
    // The base moved: refused naming it and the way out, then read from where it went.
    let moved = root.join("moved-base");
    std::fs::rename(&base, &moved).unwrap();
    let e = export_hf(&ckpt, &out, &opts).unwrap_err().to_string();
    assert!(
        e.contains("meta.json") && e.contains("cannot be read") && e.contains("--base DIR"),
        "{e}"
    );
    let opts = HfExportOptions {
        base: Some(moved.clone()),
        ..opts
    };
    export_hf(&ckpt, &out, &opts).unwrap();
    // W + (alpha / r) · B · A from the trained parameters, for every weight.
    let get = |n: &str| &params.iter().find(|(m, _)| m == n).unwrap().1;
    let written = weights_of(&out);
    assert_eq!(written.len(), weights_of(&moved).len());
    for (n, shape, v) in &written {
        let module = n.trim_end_matches(".weight");
        let a_name = format!("{module}.lora_A.weight");
        let want: Vec<f32> = if params.iter().any(|(m, _)| *m == a_name) {
            let (a, b, w) = (
                get(&a_name),
                get(&format!("{module}.lora_B.weight")),
                get(n),
            );
            let (rows, cols, r) = (shape[0], shape[1], 4);
            (0..rows * cols)
                .map(|e| {
                    let (o, c) = (e / cols, e % cols);
                    let d: f32 = (0..r).map(|k| b[o * r + k] * a[k * cols + c]).sum();
                    w[e] + 2.0 * d
                })
                .collect()
        } else {
            get(n).clone()
        };
        let d = max_abs_diff(v, &want);
        assert!(d < 1e-6, "{n}: merged export differs by {d}");
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// Without a base (a LoRA model whose base is not recorded, as from scratch): every unit is
/// stored, but the frozen ones without optimizer state (never stepped: zeros the optimizer does
/// not keep); a resume at another world size holds the same parameters and the same AdamW
/// state, bit for bit.
#[test]
fn frozen_units_are_stored_without_optimizer_state() {
    let root = tmpdir("adapter-ckpt-stateless");
    let (ids, targets) = inputs(BASE);
    let ckpt = root.join("ckpt");
    // The parameters and, per parameter, the AdamW buffers gathered on rank 0 after training
    // and saving (`load` None) or after loading.
    let run = |ws: usize, load: Option<PathBuf>| {
        let (ids, targets, ckpt) = (ids.clone(), targets.clone(), ckpt.clone());
        launch(&Launcher::threads(ws), move |pg| {
            let (decoder, mut model, _) =
                build_from_hf_with(pg, FsdpConfig::default(), &fixture(BASE), &opts())?;
            model.set_base(None);
            let mut opt = AdamW::new(AdamWConfig::default());
            let dir = match &load {
                Some(d) => {
                    load_sharded(d, &mut model, &mut opt)?;
                    d.clone()
                }
                None => {
                    load_peft_adapter(&fixture(ADAPTER), &mut model)?;
                    let logits = decoder.logits(&mut model, &ids, true)?;
                    model.backward(&lm_loss(&logits, &targets)?)?;
                    opt.step(&mut model)?;
                    let state = TrainState {
                        step: 1,
                        ..Default::default()
                    };
                    save_sharded(&ckpt, &model, &opt, &state, 0)?
                }
            };
            let params = model.gather_full_params(false)?.expect("every rank");
            let params: Params = params.iter().map(|(n, t)| (n.clone(), to_vec(t))).collect();
            let state = opt.state()?;
            // This rank's state of each unit's shard, in unit order (empty where none).
            let mine: Vec<Vec<f32>> = state
                .units
                .iter()
                .map(|u| u.buffers.values().flatten().copied().collect())
                .collect();
            let local: f64 = mine.iter().flatten().map(|&v| f64::from(v.abs())).sum();
            let total = candle_fsdp::comm::ProcessGroupExt::all_reduce_f32s(
                model.process_group().as_ref(),
                vec![local as f32],
                candle_fsdp::comm::ReduceOp::Sum,
            )?[0];
            Ok((dir, params, total, state.step))
        })
        .unwrap()
        .swap_remove(0)
    };
    let (dir, trained, trained_state, step) = run(2, None);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
    let units = meta["units"].as_array().unwrap();
    assert!(
        units.iter().all(|u| u.get("in_base").is_none()),
        "no base: every unit stored"
    );
    let stateless = units.iter().filter(|u| u["no_optim_state"] == true).count();
    assert!(stateless > 0 && stateless < units.len());
    for (k, u) in units.iter().enumerate() {
        let params = u["params"].as_array().unwrap();
        let frozen = !params.is_empty()
            && params
                .iter()
                .all(|p| !p["name"].as_str().unwrap().contains(".lora_"));
        assert_eq!(u["no_optim_state"] == true, frozen, "unit {k}");
    }
    let bytes = std::fs::read(dir.join("shard-00000-of-00002.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let optim = st
        .names()
        .iter()
        .filter(|n| n.starts_with("optim."))
        .count();
    assert_eq!(
        optim,
        2 * (units.len() - stateless),
        "exp_avg and exp_avg_sq of trained units"
    );
    assert!(verify(&dir).unwrap().is_ok());
    let (_, resumed, resumed_state, resumed_step) = run(3, Some(dir));
    assert_eq!(resumed_step, step);
    for ((n, a), (_, b)) in trained.iter().zip(&resumed) {
        let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{n} differs after the resume");
    }
    // The AdamW state, |values| summed over every element of every rank (the shards split
    // otherwise at world size 3): the same sum, and not zero.
    assert!(trained_state != 0.0);
    let d = (trained_state - resumed_state).abs() / trained_state.abs();
    assert!(
        d < 1e-5,
        "AdamW state {trained_state} after training, {resumed_state} resumed"
    );
    let _ = std::fs::remove_dir_all(&root);
}
