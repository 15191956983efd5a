//! Hugging Face in and out, in one place: model directories (`config.json`, safetensors in one
//! file or sharded under an index) read into a sharded model and written from a checkpoint, and
//! PEFT's adapter directories.
//!
//! | file | what |
//! |---|---|
//! | [`weights`] | a directory's safetensors mapped, tensors read by name and element range (each rank copies only its own shards' bytes), an [`crate::FsdpModel`] built from them |
//! | [`decoder`] | a directory resolved as transformers' `from_pretrained` does (config, weights file, tied head, base prefix) and loaded as the decoder of its family |
//! | [`llama`] | the Llama's `config.json` in and out (a from-scratch run's config) |
//! | [`export_hf`] | a sharded checkpoint to a model directory (`fsdp-ckpt export --format hf`) |
//! | [`peft`], [`export_peft`] | PEFT adapter directories: save and load adapters, and a LoRA checkpoint's adapters out (`fsdp-ckpt export --format peft`) |
//!
//! **Layering**: this folder sits above [`crate::checkpoint`] (the format it reads through and
//! exports from) and [`crate::models`] (the models hand in their names, shapes and config as
//! values: [`crate::models::decoder::DecoderConfig::parameter_shapes`],
//! [`crate::models::decoder::family::config_from_json`]); neither of them imports it
//! (`scripts/check-layers.sh`).

#[cfg(feature = "llama")]
pub mod decoder;
mod export;
mod export_peft;
#[cfg(feature = "llama")]
pub mod llama;
pub mod peft;
pub mod weights;

pub use export::{export_hf, HfExportOptions, HfExportSummary, HF_CONFIG_KEY};
pub use export_peft::{export_peft, PeftExportSummary};
