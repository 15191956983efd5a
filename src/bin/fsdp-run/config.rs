//! `fsdp-run --config FILE`: the launcher's settings from the `[launch]` table of a TOML file
//! (the file the examples read with their own `--config`; their keys are top-level, the
//! launcher reads only this table).
//!
//! ```toml
//! [launch]
//! nproc_per_node = 2
//! nnodes = 1
//! node_rank = 0
//! master_addr = "127.0.0.1"
//! master_port = 29500
//! max_restarts = 3
//! grace_period = 5.0
//! ```
//!
//! Keys are the flags' long names with `_` for `-`; an unknown key or a value of the wrong
//! type is an error naming the key and the file; a flag given on the command line overrides
//! the file.

use std::path::Path;

use clap::parser::ValueSource;
use clap::ArgMatches;
use serde::Deserialize;

use super::Cli;

/// The `[launch]` table.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Launch {
    nproc_per_node: Option<usize>,
    nnodes: Option<usize>,
    node_rank: Option<usize>,
    master_addr: Option<String>,
    master_port: Option<u16>,
    max_restarts: Option<usize>,
    grace_period: Option<f64>,
}

/// Reads `path`'s `[launch]` table (none: nothing to apply).
fn read(path: &Path) -> Result<Launch, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read it: {e}"))?;
    let mut doc: toml::Table = toml::from_str(&text).map_err(|e| e.to_string())?;
    match doc.remove("launch") {
        None => Ok(Launch::default()),
        Some(toml::Value::Table(t)) => Launch::deserialize(t).map_err(|e| format!("[launch]: {e}")),
        Some(other) => Err(format!(
            "`launch` must be a table ([launch]), found a {}",
            other.type_str()
        )),
    }
}

/// Sets every field of `cli` the file gives and the command line does not.
///
/// Errors: the file cannot be read or parsed, an unknown key, a wrong type, port 0: the
/// message names the file (and the key).
pub(crate) fn apply(cli: &mut Cli, matches: &ArgMatches) -> Result<(), String> {
    let Some(path) = cli.config.clone() else {
        return Ok(());
    };
    let file = read(&path).map_err(|e| format!("--config {}: {e}", path.display()))?;
    let from_file = |id: &str| matches.value_source(id) != Some(ValueSource::CommandLine);
    if let (Some(v), true) = (file.nproc_per_node, from_file("nproc_per_node")) {
        cli.nproc_per_node = v;
    }
    if let (Some(v), true) = (file.nnodes, from_file("nnodes")) {
        cli.nnodes = v;
    }
    if let (Some(v), true) = (file.node_rank, from_file("node_rank")) {
        cli.node_rank = v;
    }
    if let (Some(v), true) = (file.master_addr, from_file("master_addr")) {
        cli.master_addr = v;
    }
    if let (Some(v), true) = (file.master_port, from_file("master_port")) {
        if v == 0 {
            return Err(format!(
                "--config {}: [launch] master_port = 0: expected a TCP port (1..=65535)",
                path.display()
            ));
        }
        cli.master_port = v;
    }
    if let (Some(v), true) = (file.max_restarts, from_file("max_restarts")) {
        cli.max_restarts = v;
    }
    if let (Some(v), true) = (file.grace_period, from_file("grace_period")) {
        cli.grace_period = v;
    }
    Ok(())
}
