//! PEFT's adapter directories: `adapter_config.json` and `adapter_model.safetensors`, the LoRA
//! parameters under PEFT's names (`base_model.model.<our name>`, [`crate::lora::peft_name`]).
//! [`save_peft_adapter`] writes what `peft.PeftModel.from_pretrained(base, DIR)` loads;
//! [`load_peft_adapter`] reads one into a model built with the same LoRA config.

use std::collections::HashMap;
use std::path::Path;

use candle_core::Tensor;
use safetensors::Dtype;

use crate::checkpoint::io::{MappedFile, SafetensorsWriter, TensorSpec};
use crate::checkpoint::{agree, write_atomic, ReadStats};
use crate::error::{Error, Result};
use crate::fsdp::FsdpModel;
use crate::lora::{peft_name, LoraConfig};
use crate::ops::with_host_f32;

/// The adapter's weights file in a PEFT directory.
pub const PEFT_WEIGHTS: &str = "adapter_model.safetensors";
/// The adapter's config file in a PEFT directory.
pub const PEFT_CONFIG: &str = "adapter_config.json";

fn is_lora(name: &str) -> bool {
    name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight")
}

/// Whether an adapter parameter sits on a GPT-2 `Conv1D` module (`c_attn`, `c_fc`, `c_proj`
/// under `transformer.h.`): PEFT's `fan_in_fan_out`.
pub(crate) fn is_conv1d_module(name: &str) -> bool {
    name.contains(".h.")
        && [".c_attn.", ".c_fc.", ".c_proj."]
            .iter()
            .any(|m| name.contains(m))
}

/// The units holding LoRA parameters, in unit order.
fn lora_units(model: &FsdpModel) -> Vec<usize> {
    model
        .shards()
        .filter(|u| u.layout.params.iter().any(|p| is_lora(&p.name)))
        .map(|u| u.unit_index)
        .collect()
}

/// Writes the LoRA parameters of `model` (a collective: the units holding them are gathered;
/// rank 0 writes) as a PEFT adapter directory `dir`: `adapter_model.safetensors` (f32, PEFT's
/// names) and `adapter_config.json` (`peft_type` LORA, `r`, `lora_alpha`, `target_modules`,
/// `use_rslora`, `lora_dropout`, `bias` "none", `task_type` CAUSAL_LM, and
/// `base_model_name_or_path` when given). Each file is written atomically.
///
/// Errors (on every rank): a model without LoRA parameters; `dir` not creatable; I/O.
pub fn save_peft_adapter(
    model: &FsdpModel,
    lora: &LoraConfig,
    base_model: Option<&str>,
    dir: &Path,
) -> Result<()> {
    let pg = model.process_group().clone();
    let units = lora_units(model);
    let mut local = Ok(());
    let mut writer = None;
    if units.is_empty() {
        local = Err(Error::missing(
            "LoRA parameters (*.lora_A.weight, *.lora_B.weight) in the model",
            "nothing to save as a PEFT adapter",
        ));
    } else if pg.rank() == 0 {
        let opened = (|| -> Result<SafetensorsWriter> {
            std::fs::create_dir_all(dir).map_err(|e| Error::file(dir, e.to_string()))?;
            let mut specs = Vec::new();
            for &k in &units {
                let u = model.shard(k).expect("a unit of the model");
                for p in u.layout.params.iter().filter(|p| is_lora(&p.name)) {
                    specs.push(TensorSpec {
                        name: peft_name(&p.name),
                        dtype: Dtype::F32,
                        shape: p.shape.dims().to_vec(),
                    });
                }
            }
            let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
            SafetensorsWriter::create(&dir.join(PEFT_WEIGHTS), specs, meta)
        })();
        match opened {
            Ok(w) => writer = Some(w),
            Err(e) => local = Err(e),
        }
    }
    agree(pg.as_ref(), "saving the PEFT adapter", dir, local)?;
    let mut local = Ok(());
    for &k in &units {
        let full = model.gather_unit_f32(k)?;
        if let Some(w) = writer.as_mut() {
            let u = model.shard(k).expect("a unit of the model");
            let written = with_host_f32(&full, |full| -> Result<()> {
                for p in u.layout.params.iter().filter(|p| is_lora(&p.name)) {
                    w.write_f32(&peft_name(&p.name), &full[p.offset..p.offset + p.numel])?;
                }
                Ok(())
            })
            .and_then(|r| r);
            if let Err(e) = written {
                writer = None;
                local = Err(e);
            }
        }
    }
    if let Some(w) = writer {
        let done = w.finish().and_then(|_| {
            let conv1d = units.iter().any(|&k| {
                model.shard(k).is_some_and(|u| {
                    u.layout
                        .params
                        .iter()
                        .any(|p| is_lora(&p.name) && is_conv1d_module(&p.name))
                })
            });
            let names: Vec<String> = model
                .shards()
                .flat_map(|u| u.layout.params.iter().map(|p| p.name.clone()))
                .collect();
            let adapted = crate::lora::adapted_modules(names.iter().map(String::as_str));
            let text =
                serde_json::to_string_pretty(&lora.peft_config(base_model, conv1d, &adapted))
                    .map_err(|e| Error::InvalidArgument(e.to_string()))?;
            write_atomic(&dir.join(PEFT_CONFIG), text.as_bytes())
        });
        if let Err(e) = done {
            local = Err(e);
        }
    }
    agree(pg.as_ref(), "saving the PEFT adapter", dir, local)
}

/// Reads the LoRA parameters of `model` from the PEFT adapter `path` (a directory holding
/// `adapter_model.safetensors`, or that file), a collective: each rank copies only its shards'
/// ranges; every other parameter is unchanged.
///
/// Errors, naming the file and tensor (on every rank; the model unchanged): a missing file; a
/// LoRA parameter of the model missing from it (a different `r` shows as a shape mismatch,
/// expected vs found); a tensor of the adapter the model has no parameter for (a target the
/// model was not built with).
pub fn load_peft_adapter(path: &Path, model: &mut FsdpModel) -> Result<ReadStats> {
    let file_path = if path.is_dir() {
        path.join(PEFT_WEIGHTS)
    } else {
        path.to_path_buf()
    };
    let pg = model.process_group().clone();
    let mut stats = ReadStats::default();
    let units = lora_units(model);
    let checked = (|| -> Result<MappedFile> {
        let file = MappedFile::open(&file_path, None, &mut stats)?;
        let mut known = std::collections::HashSet::new();
        for &k in &units {
            let u = model.shard(k).expect("a unit of the model");
            for p in u.layout.params.iter().filter(|p| is_lora(&p.name)) {
                let name = peft_name(&p.name);
                match file.info(&name) {
                    None => {
                        return Err(Error::file(
                            &file_path,
                            format!("tensor {name} (the model's {}) is missing", p.name),
                        ))
                    }
                    Some(info) if info.shape != p.shape.dims() => {
                        return Err(Error::file(
                            &file_path,
                            format!(
                                "tensor {name}: expected shape {:?}, found {:?} (another r or \
                                 another model?)",
                                p.shape.dims(),
                                info.shape
                            ),
                        ))
                    }
                    Some(_) => {}
                }
                known.insert(name);
            }
        }
        if let Some(extra) = file.names().find(|n| !known.contains(*n)) {
            return Err(Error::file(
                &file_path,
                format!(
                    "tensor {extra} is not a LoRA parameter of the model (its targets or \
                     adapter names differ)"
                ),
            ));
        }
        Ok(file)
    })();
    let (file, local) = match checked {
        Ok(f) => (Some(f), Ok(())),
        Err(e) => (None, Err(e)),
    };
    agree(pg.as_ref(), "loading the PEFT adapter", &file_path, local)?;
    let file = file.expect("checked on every rank");
    for k in units {
        let u = model.shard(k).expect("a unit of the model");
        let layout = u.layout.clone();
        let device = u.param.device().clone();
        let mut shard = with_host_f32(&u.param_f32()?, |s| s.to_vec())?;
        for e in layout.shard_table(u.shard_index) {
            let p = &layout.params[e.param_index];
            if !is_lora(&p.name) {
                continue;
            }
            let out = &mut shard[e.offset_in_shard..e.offset_in_shard + e.numel_in_shard];
            file.read_f32(
                &peft_name(&p.name),
                e.range_in_param.clone(),
                out,
                &mut stats,
            )?;
        }
        let n = shard.len();
        model.set_unit_shard(k, Tensor::from_vec(shard, n, &device)?)?;
    }
    Ok(stats)
}

/// Checks the `adapter_config.json` of the PEFT adapter directory `dir` against `lora`, the
/// config a model is built with, before [`load_peft_adapter`] reads its tensors (which checks
/// the shapes, so `r` and the targets, but cannot see the scale).
///
/// Errors, naming the file and the field with both values: no or an unreadable config; a
/// `peft_type` other than LORA; `r`, `lora_alpha` or `use_rslora` other than `lora`'s; a
/// non-empty `alpha_pattern` or `rank_pattern` (per-module scales and ranks are not supported).
pub fn check_peft_config(dir: &Path, lora: &LoraConfig) -> Result<()> {
    let path = dir.join(PEFT_CONFIG);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| Error::file(&path, format!("not JSON: {e}")))?;
    let field = |k: &str| v.get(k).cloned().unwrap_or(serde_json::Value::Null);
    if field("peft_type") != "LORA" {
        return Err(Error::file(
            &path,
            format!("peft_type is {}, expected \"LORA\"", field("peft_type")),
        ));
    }
    let mismatch = |what: &str, theirs: String, ours: String, flag: &str| {
        Err(Error::file(
            &path,
            format!("{what} is {theirs}, this run's is {ours} ({flag}): give the adapter's"),
        ))
    };
    let r = field("r").as_u64();
    if r != Some(lora.r as u64) {
        return mismatch(
            "r",
            field("r").to_string(),
            lora.r.to_string(),
            "--lora-rank",
        );
    }
    let alpha = field("lora_alpha").as_f64();
    if alpha != Some(lora.alpha) {
        return mismatch(
            "lora_alpha",
            field("lora_alpha").to_string(),
            lora.alpha.to_string(),
            "--lora-alpha",
        );
    }
    let rslora = field("use_rslora").as_bool().unwrap_or(false);
    if rslora != lora.rslora {
        return mismatch(
            "use_rslora",
            rslora.to_string(),
            lora.rslora.to_string(),
            "--rslora",
        );
    }
    for k in ["alpha_pattern", "rank_pattern"] {
        if field(k).as_object().is_some_and(|o| !o.is_empty()) {
            return Err(Error::file(
                &path,
                format!(
                    "{k} is {}: per-module ranks and scales are not supported",
                    field(k)
                ),
            ));
        }
    }
    Ok(())
}
