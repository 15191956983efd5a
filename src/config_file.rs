//! `--config FILE`: a command's flags as a TOML file, as accelerate's config file or
//! DeepSpeed's JSON are for theirs. Every example reads one, and `fsdp-run --config` reads its
//! `[launch]` table from the same file, so one file describes a whole job. [cargo feature `cli`]
//!
//! The rules:
//! - A key is a flag's long name, with `_` or `-` (`n_layer = 6` is `--n-layer 6`).
//! - A key the command has no flag for is an error naming the key and the file, and so is a
//!   table the reader was not asked for (top-level keys belong to the example, the `[launch]`
//!   table to `fsdp-run`; each reader skips the other's).
//! - Values are handed to clap as if typed on the command line before its own flags
//!   ([`parse_with_config`]), so they are parsed and checked exactly as flags are, and a value
//!   clap refuses is an error naming the file and the flag.
//! - Flags given on the command line (or through an environment variable clap reads) win over
//!   the file.
//! - `key = true` turns a switch on. `key = false` passes `--key=false` to a flag that takes a
//!   value and leaves a plain switch off. An array gives an appending flag one value per
//!   element; to a flag of one value it is an error naming the key, and so is a flag set by
//!   two keys (`seq_len` and `seq-len`) or a key for `--help` / `--version`.
//!
//! ```toml
//! # examples/gpt/bench.toml: the GPT benchmark configuration.
//! n_layer = 6
//! d_model = 512
//! batch_size = 4
//! untied = true
//!
//! [launch]          # read by `fsdp-run --config`, skipped by the example
//! nproc_per_node = 2
//! ```

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgMatches, Command};

/// The table of `fsdp-run`'s settings in a config file.
pub const LAUNCH_TABLE: &str = "launch";

/// Why a command line with a config file could not be parsed.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The command line itself is wrong, or asks for `--help` / `--version`: clap's own error,
    /// for the caller to print and exit with (`e.exit()`).
    #[error(transparent)]
    CommandLine(#[from] clap::Error),
    /// The file cannot be read or parsed, sets a key with no flag, or a value clap refuses.
    #[error("config file {}: {message}", path.display())]
    File {
        /// The file named by `--config`.
        path: PathBuf,
        /// What is wrong, naming the key or flag.
        message: String,
    },
}

/// Which part of a config file a command reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Section<'a> {
    /// The top-level keys; the tables named here belong to other readers and are skipped.
    TopLevel {
        /// Tables to skip (for the examples: `[launch]`).
        skip: &'a [&'a str],
    },
    /// The keys of one table (`[launch]` for `fsdp-run`); everything outside it is skipped, and
    /// a file without it sets nothing.
    Table(&'a str),
}

/// One config file, parsed as TOML.
#[derive(Debug, Clone)]
pub struct ConfigFile {
    path: PathBuf,
    table: toml::Table,
}

impl ConfigFile {
    /// Parses TOML text; `path` names the file in errors.
    ///
    /// Errors: [`ConfigError::File`] for invalid TOML (with its line and column).
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let table = text.parse::<toml::Table>().map_err(|e| ConfigError::File {
            path: path.to_path_buf(),
            message: e.to_string().trim_end().to_string(),
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            table,
        })
    }

    /// Reads and parses `path`.
    ///
    /// Errors: the file cannot be read; as [`ConfigFile::parse`].
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
            path: path.to_path_buf(),
            message: format!("cannot read it: {e}"),
        })?;
        Self::parse(&text, path)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn error(&self, message: String) -> ConfigError {
        ConfigError::File {
            path: self.path.clone(),
            message,
        }
    }

    /// The flags `section` of the file sets for `command`, in the file's key order, each as the
    /// argument's id (clap's, for [`ArgMatches::value_source`]) and the words to append to the command line (`["--n-layer=6"]`, `["--untied"]`,
    /// none for a plain switch set to false, one word per element of an array).
    ///
    /// Errors: a key with no flag in `command` (or naming a positional argument or `--config`
    /// itself), a key for `--help` / `--version`, two keys of one flag (`n_layer` and
    /// `n-layer`), an array for a flag of one value, a table outside `section`, a nested table,
    /// or an array of tables.
    pub fn settings(
        &self,
        command: &Command,
        section: Section<'_>,
    ) -> Result<Vec<(String, Vec<String>)>, ConfigError> {
        let entries: Vec<(&String, &toml::Value)> = match section {
            Section::TopLevel { skip } => {
                let mut out = Vec::new();
                for (key, value) in &self.table {
                    match value {
                        toml::Value::Table(_) if skip.contains(&key.as_str()) => {}
                        toml::Value::Table(_) => {
                            return Err(self.error(format!(
                                "table [{key}] is not one this command reads (its flags are \
                                 top-level keys{})",
                                if skip.is_empty() {
                                    String::new()
                                } else {
                                    format!("; [{}] is fsdp-run's", skip.join("], ["))
                                }
                            )))
                        }
                        v => out.push((key, v)),
                    }
                }
                out
            }
            Section::Table(name) => match self.table.get(name) {
                None => Vec::new(),
                Some(toml::Value::Table(t)) => t.iter().collect(),
                Some(_) => {
                    return Err(self.error(format!("{name} must be a table ([{name}])")));
                }
            },
        };
        let mut out = Vec::new();
        // (key, argument id) of the keys read so far: `seq_len` and `seq-len` are one flag.
        let mut seen: Vec<(String, String)> = Vec::new();
        for (key, value) in entries {
            let long = key.replace('_', "-");
            let flag = format!("--{long}");
            let arg = command
                .get_arguments()
                .find(|a| a.get_long() == Some(long.as_str()) && long != "config")
                .ok_or_else(|| {
                    self.error(format!(
                        "unknown key {key}: {} has no flag {flag}{}",
                        command.get_bin_name().unwrap_or(command.get_name()),
                        match section {
                            Section::Table(name) => format!(" (keys of [{name}])"),
                            Section::TopLevel { .. } => String::new(),
                        }
                    ))
                })?;
            if matches!(
                arg.get_action(),
                clap::ArgAction::Help
                    | clap::ArgAction::HelpShort
                    | clap::ArgAction::HelpLong
                    | clap::ArgAction::Version
            ) {
                return Err(self.error(format!(
                    "key {key}: {flag} is not a setting (it prints and exits; give it on the \
                     command line)"
                )));
            }
            let id = arg.get_id().to_string();
            if let Some((earlier, _)) = seen.iter().find(|(_, i)| *i == id) {
                return Err(self.error(format!(
                    "keys {earlier} and {key} both set {flag}: keep one"
                )));
            }
            seen.push((key.clone(), id.clone()));
            let appends = matches!(arg.get_action(), clap::ArgAction::Append)
                || arg.get_num_args().is_some_and(|r| r.max_values() > 1);
            if let toml::Value::Array(items) = value {
                if !appends {
                    return Err(self.error(format!(
                        "key {key}: {flag} takes one value, found an array of {}",
                        items.len()
                    )));
                }
            }
            let takes_value = arg.get_action().takes_values();
            let words = self.words(key, &flag, value, takes_value)?;
            out.push((id, words));
        }
        Ok(out)
    }

    /// The command-line words of one key.
    fn words(
        &self,
        key: &str,
        flag: &str,
        value: &toml::Value,
        takes_value: bool,
    ) -> Result<Vec<String>, ConfigError> {
        Ok(match value {
            toml::Value::Boolean(true) if !takes_value => vec![flag.to_string()],
            toml::Value::Boolean(false) if !takes_value => Vec::new(),
            toml::Value::String(s) => vec![format!("{flag}={s}")],
            toml::Value::Array(items) => {
                let mut words = Vec::with_capacity(items.len());
                for item in items {
                    match item {
                        toml::Value::Array(_) | toml::Value::Table(_) => {
                            return Err(self.error(format!(
                                "key {key}: an array of plain values expected, found a nested \
                                 array or table"
                            )))
                        }
                        v => words.extend(self.words(key, flag, v, true)?),
                    }
                }
                words
            }
            toml::Value::Table(_) => {
                return Err(self.error(format!("key {key}: a value expected, found a table")))
            }
            toml::Value::Boolean(b) => vec![format!("{flag}={b}")],
            toml::Value::Integer(i) => vec![format!("{flag}={i}")],
            toml::Value::Float(x) => vec![format!("{flag}={x}")],
            toml::Value::Datetime(d) => vec![format!("{flag}={d}")],
        })
    }
}

/// Parses `argv` with `command`; when it names a file with `--config` (argument id `config`),
/// appends the settings of `section` whose flags the command line (or the environment) did not
/// give, and parses again.
///
/// Errors: [`ConfigError::CommandLine`] for the command line itself (so the caller can exit with
/// clap's message, or print `--help`); [`ConfigError::File`] for the file, naming it: it cannot
/// be read, a key with no flag, a value the flag refuses.
pub fn parse_with_config(
    command: &mut Command,
    argv: Vec<OsString>,
    section: Section<'_>,
) -> Result<ArgMatches, ConfigError> {
    let matches = command.try_get_matches_from_mut(argv.clone())?;
    let path = match matches.try_get_one::<PathBuf>("config") {
        Ok(Some(p)) => p.clone(),
        _ => return Ok(matches),
    };
    let file = ConfigFile::load(&path)?;
    // The file's words go right after the program's name, before the command line's own: after
    // them they could land behind a `--` that starts a launched command's arguments.
    let mut from_file = Vec::new();
    for (id, words) in file.settings(command, section)? {
        if matches!(
            matches.value_source(&id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        ) {
            continue;
        }
        from_file.extend(words.into_iter().map(OsString::from));
    }
    let mut full = argv;
    let at = full.len().min(1);
    full.splice(at..at, from_file);
    command.try_get_matches_from_mut(full).map_err(|e| {
        // Not the clap error any more: the caller would print clap's message without the file.
        let message = e.to_string();
        let message = message.trim_start_matches("error: ").trim_end();
        file.error(message.to_string())
    })
}
