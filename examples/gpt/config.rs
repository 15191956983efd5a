//! `--config FILE`: the GPT example's flags as a TOML file.
//!
//! Every key is a flag's long name with `_` for `-` (`n_layer = 6` is `--n-layer 6`); an
//! unknown key is an error naming it (serde's `deny_unknown_fields`), and so is a value of the
//! wrong type. Flags given on the command line override the file. A boolean flag is set by
//! `key = true`; `false` leaves it at its default (off); on the command line `--flag=false`
//! turns off what the file turned on.
//!
//! ```toml
//! # The benchmark configuration.
//! n_layer = 6
//! d_model = 512
//! n_head = 8
//! seq_len = 256
//! batch_size = 4
//! untied = true
//! ```
//!
//! The file's values are handed to clap as if typed after the command line's own flags
//! ([`parse_with_config`]), so they are parsed and checked exactly as flags are.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::parser::ValueSource;
use clap::{ArgMatches, Command};
use serde::{Deserialize, Serialize};

/// The keys of a config file: one per flag of the example (see the flags' `--help` for each).
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    // The model and the run.
    pub n_layer: Option<usize>,
    pub n_head: Option<usize>,
    pub d_model: Option<usize>,
    pub seq_len: Option<usize>,
    pub untied: Option<bool>,
    pub max_steps: Option<u64>,
    pub warmup_steps: Option<u64>,
    pub min_lr_factor: Option<f64>,
    pub weight_decay: Option<f64>,
    pub beta1: Option<f64>,
    pub beta2: Option<f64>,
    pub log_interval: Option<u64>,
    pub eval_interval: Option<u64>,
    pub eval_batches: Option<u64>,
    pub sample_len: Option<usize>,
    pub temperature: Option<f64>,
    pub prompt: Option<String>,
    pub data: Option<PathBuf>,
    pub activation_checkpointing: Option<bool>,
    pub max_memory_per_rank: Option<u64>,
    // The training loop's flags, shared with the MNIST examples.
    pub world_size: Option<usize>,
    pub seed: Option<u64>,
    pub batch_size: Option<usize>,
    pub lr: Option<f64>,
    pub checkpoint_dir: Option<PathBuf>,
    pub resume: Option<bool>,
    pub resume_from: Option<PathBuf>,
    pub save_every: Option<u64>,
    pub keep_last: Option<usize>,
    pub strategy: Option<String>,
    pub shard_size: Option<usize>,
    pub reshard_after_forward: Option<usize>,
    pub no_prefetch: Option<bool>,
    pub precision: Option<String>,
    pub grad_accum: Option<usize>,
    pub accum_mode: Option<String>,
    pub clip_grad_norm: Option<f32>,
    pub trace: Option<PathBuf>,
    pub trace_steps: Option<usize>,
    pub timeout_s: Option<u64>,
}

impl ConfigFile {
    /// Parses TOML text; `path` names the file in errors.
    ///
    /// Errors: invalid TOML, an unknown key (named), a value of the wrong type (named).
    pub fn parse(text: &str, path: &Path) -> anyhow::Result<Self> {
        toml::from_str(text).map_err(|e| {
            anyhow::anyhow!(
                "config file {}: {}",
                path.display(),
                e.to_string().trim_end()
            )
        })
    }

    /// Reads and parses `path`.
    ///
    /// Errors: the file cannot be read; as [`ConfigFile::parse`].
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("config file {}: cannot read it", path.display()))?;
        Self::parse(&text, path)
    }

    /// The keys the file sets, each with its flag's value (`None` for a boolean set to true),
    /// sorted by key; keys absent and booleans set to false are left out.
    pub fn settings(&self) -> anyhow::Result<Vec<(String, Option<String>)>> {
        let serde_json::Value::Object(map) = serde_json::to_value(self)? else {
            anyhow::bail!("config keys do not serialise to a table");
        };
        let mut out = Vec::new();
        for (key, value) in map {
            match value {
                serde_json::Value::Null | serde_json::Value::Bool(false) => {}
                serde_json::Value::Bool(true) => out.push((key, None)),
                serde_json::Value::String(s) => out.push((key, Some(s))),
                v => out.push((key, Some(v.to_string()))),
            }
        }
        Ok(out)
    }
}

/// Parses `argv` with `command`; when it names a file with `--config` (argument id `config`),
/// appends the file's settings whose flags the command line did not give, and parses again.
///
/// Errors: clap's, as a [`clap::Error`] for the command line itself (so the caller can exit
/// with clap's message, or print `--help`), as a message naming the file for a value of the
/// file; the file's ([`ConfigFile::load`]); a key with no flag of that name in `command`.
pub fn parse_with_config(command: &mut Command, argv: Vec<OsString>) -> anyhow::Result<ArgMatches> {
    let matches = command.try_get_matches_from_mut(argv.clone())?;
    let Some(path) = matches.get_one::<PathBuf>("config").cloned() else {
        return Ok(matches);
    };
    let file = ConfigFile::load(&path)?;
    let mut full = argv;
    for (key, value) in file.settings()? {
        anyhow::ensure!(
            command.get_arguments().any(|a| a.get_id() == key.as_str()),
            "config file {}: key {key} has no flag --{}",
            path.display(),
            key.replace('_', "-")
        );
        if matches.value_source(&key) == Some(ValueSource::CommandLine) {
            continue;
        }
        let flag = format!("--{}", key.replace('_', "-"));
        full.push(match value {
            None => flag.into(),
            Some(v) => format!("{flag}={v}").into(),
        });
    }
    command.try_get_matches_from_mut(full).map_err(|e| {
        // Not a clap::Error any more: the caller would print clap's message without the file.
        let message = e.to_string();
        let message = message.trim_start_matches("error: ").trim_end();
        anyhow::anyhow!("config file {}: {message}", path.display())
    })
}
