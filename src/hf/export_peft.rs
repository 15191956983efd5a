//! `fsdp-ckpt export --format peft`: the LoRA adapters of a LoRA run's sharded checkpoint as a
//! PEFT adapter directory, streamed tensor by tensor, without a process group.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::Dtype;

use super::peft::{PEFT_CONFIG, PEFT_WEIGHTS};
use crate::checkpoint::io::{SafetensorsWriter, TensorSpec};
use crate::checkpoint::tools::export::{open_shard_files, stream_param};
use crate::checkpoint::tools::{check_checksums, resolve_checkpoint};
use crate::checkpoint::{read_meta, write_atomic, META_FILE};
use crate::error::{Error, Result};
use crate::lora::{peft_name, LoraConfig, LORA_CONFIG_KEY};

/// What [`export_peft`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeftExportSummary {
    /// The checkpoint directory read.
    pub checkpoint: PathBuf,
    /// The adapter directory written.
    pub dir: PathBuf,
    /// Adapter tensors written (`lora_A` and `lora_B` of every adapted module).
    pub tensors: usize,
    /// Bytes of `adapter_model.safetensors`.
    pub bytes: u64,
}

/// Writes the LoRA adapters of the checkpoint `dir` (a LoRA run's: its metadata holds the LoRA
/// config under [`LORA_CONFIG_KEY`]) to the directory `out` as PEFT writes them:
/// `adapter_model.safetensors` (f32, `base_model.model.<name>`) and `adapter_config.json`
/// (`base_model_name_or_path` from `base_model` when given, else the frozen base an
/// adapter-only checkpoint recorded). Each file is written atomically;
/// the frozen base is not read.
///
/// Errors, naming the file: `dir` not a checkpoint, damaged, or of a run without LoRA; `out`
/// inside the checkpoint, or holding an adapter or a model's weights already
/// ([`refuse_exported`]); I/O.
pub fn export_peft(dir: &Path, out: &Path, base_model: Option<&str>) -> Result<PeftExportSummary> {
    let dir = resolve_checkpoint(dir)?;
    let meta = read_meta(&dir)?;
    let meta_path = dir.join(META_FILE);
    let text = meta.train.extra.get(LORA_CONFIG_KEY).ok_or_else(|| {
        Error::file(
            &meta_path,
            format!(
                "not a LoRA run's checkpoint (no train.extra.{LORA_CONFIG_KEY}): export the \
                 full model with --format hf"
            ),
        )
    })?;
    let lora: LoraConfig = serde_json::from_str(text).map_err(|e| {
        Error::file(
            &meta_path,
            format!("{LORA_CONFIG_KEY} is not a LoRA config: {e}"),
        )
    })?;
    if out.exists() && !out.is_dir() {
        return Err(Error::file(out, "exists and is not a directory"));
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    if let (Ok(a), Ok(b)) = (std::fs::canonicalize(out), std::fs::canonicalize(&dir)) {
        if a.starts_with(&b) {
            return Err(Error::file(out, "is inside the checkpoint being exported"));
        }
    }
    refuse_exported(out)?;
    check_checksums(&dir, &meta)?;
    let files = open_shard_files(&dir, &meta)?;
    let is_lora = |n: &str| n.ends_with(".lora_A.weight") || n.ends_with(".lora_B.weight");
    let mut specs = Vec::new();
    for u in &meta.units {
        for p in u.params.iter().filter(|p| is_lora(&p.name)) {
            specs.push(TensorSpec {
                name: peft_name(&p.name),
                dtype: Dtype::F32,
                shape: p.shape.clone(),
            });
        }
    }
    if specs.is_empty() {
        return Err(Error::file(
            &meta_path,
            "the checkpoint holds no LoRA parameter (*.lora_A.weight, *.lora_B.weight)",
        ));
    }
    let tensors = specs.len();
    let md = HashMap::from([("format".to_string(), "pt".to_string())]);
    let mut w = SafetensorsWriter::create(&out.join(PEFT_WEIGHTS), specs, md)?;
    for (k, u) in meta.units.iter().enumerate() {
        let name = format!("param.{k}");
        for p in u.params.iter().filter(|p| is_lora(&p.name)) {
            w.begin_tensor(&peft_name(&p.name), Dtype::F32, p.numel * 4)?;
            stream_param(&files, &name, u.shard_numel, p, Dtype::F32, &mut |b| {
                w.write_part(b)
            })?;
        }
    }
    let (bytes, _) = w.finish()?;
    let conv1d = meta.units.iter().any(|u| {
        u.params
            .iter()
            .any(|p| is_lora(&p.name) && super::peft::is_conv1d_module(&p.name))
    });
    let adapted = crate::lora::adapted_modules(
        meta.units
            .iter()
            .flat_map(|u| u.params.iter().map(|p| p.name.as_str())),
    );
    // Without --base-model, an adapter-only checkpoint names the base it recorded.
    let recorded = meta.adapter_base().map(|b| b.dir.display().to_string());
    let base_model = base_model.or(recorded.as_deref());
    let text = serde_json::to_string_pretty(&lora.peft_config(base_model, conv1d, &adapted))
        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
    write_atomic(&out.join(PEFT_CONFIG), text.as_bytes())?;
    Ok(PeftExportSummary {
        checkpoint: dir,
        dir: out.to_path_buf(),
        tensors,
        bytes,
    })
}

/// Refuses a directory `out` that already holds a model or an adapter, in any format: a
/// model's weights (`model.safetensors`, `model-*.safetensors`, `consolidated*.safetensors`,
/// `pytorch_model*.bin`, their `*.index.json`), an adapter's (`adapter_model.safetensors`,
/// `adapter_model.bin`), or a config an export writes (`config.json`, `adapter_config.json`).
/// An export never replaces such a file (data would be lost: a `config.json` replaced beside
/// another model's weights makes that model unloadable) nor writes a model beside an adapter;
/// other files (a tokenizer, notes) may stay.
///
/// # Errors
/// [`Error::File`] naming the directory and the first such file; [`Error::Io`] when it cannot
/// be listed.
pub(super) fn refuse_exported(out: &Path) -> Result<()> {
    let mut names = Vec::new();
    for e in std::fs::read_dir(out).map_err(|e| Error::io(out, e))? {
        names.push(e.map_err(|e| Error::io(out, e))?.file_name());
    }
    names.sort();
    for name in &names {
        let name = name.to_string_lossy();
        let weights = name.ends_with(".safetensors")
            || name.ends_with(".bin")
            || name.ends_with(".index.json");
        let kind = if name.starts_with("adapter_") && (weights || name == PEFT_CONFIG) {
            "a PEFT adapter"
        } else if weights || name == "config.json" {
            "Hugging Face weights"
        } else {
            continue;
        };
        return Err(Error::file(
            out,
            format!(
                "already holds {kind} ({name}): choose an empty directory (an export \
                 replaces no weights and mixes no model with an adapter)"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::refuse_exported;

    #[test]
    fn a_directory_holding_either_kind_of_export_is_refused_naming_the_file() {
        let dir = std::env::temp_dir().join(format!("refuse-exported-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
        std::fs::write(dir.join("notes.txt"), "mine").unwrap();
        refuse_exported(&dir).unwrap();
        for (name, kind) in [
            ("adapter_config.json", "a PEFT adapter"),
            ("adapter_model.safetensors", "a PEFT adapter"),
            ("model.safetensors", "Hugging Face weights"),
            ("model.safetensors.index.json", "Hugging Face weights"),
            ("model-00001-of-00002.safetensors", "Hugging Face weights"),
            ("pytorch_model.bin", "Hugging Face weights"),
            ("pytorch_model.bin.index.json", "Hugging Face weights"),
            ("consolidated.safetensors", "Hugging Face weights"),
            ("config.json", "Hugging Face weights"),
            ("adapter_model.bin", "a PEFT adapter"),
        ] {
            std::fs::write(dir.join(name), "x").unwrap();
            let e = refuse_exported(&dir).unwrap_err().to_string();
            assert_eq!(
                e,
                format!(
                    "{}: already holds {kind} ({name}): choose an empty directory (an export \
                     replaces no weights and mixes no model with an adapter)",
                    dir.display()
                )
            );
            std::fs::remove_file(dir.join(name)).unwrap();
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
