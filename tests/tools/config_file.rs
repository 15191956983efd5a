//! `--config FILE` (`candle_fsdp::config_file`): the TOML file every example and `fsdp-run`
//! read. Keys are flag names, unknown keys and foreign tables are errors naming the key and the
//! file, the command line wins, and each reader takes only its own part of a shared file.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use candle_fsdp::config_file::{parse_with_config, ConfigError, ConfigFile, Section, LAUNCH_TABLE};
use clap::{CommandFactory, FromArgMatches, Parser};

use crate::common::tmpdir;

/// The shape of an example's flags: numbers, a switch that takes `=false`, a plain switch, a
/// string, a value clap parses itself, an appending flag, and a positional command (as
/// fsdp-run's).
#[derive(Debug, Parser)]
#[command(name = "mini")]
struct MiniArgs {
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long, default_value_t = 4)]
    n_layer: usize,
    #[arg(long, default_value_t = 3e-4)]
    lr: f64,
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value_t = false, action = clap::ArgAction::Set)]
    untied: bool,
    #[arg(long)]
    verbose: bool,
    #[arg(long, default_value = "hello")]
    prompt: String,
    #[arg(long, default_value = "full-shard")]
    strategy: candle_fsdp::ShardingStrategy,
    #[arg(long = "tag")]
    tags: Vec<String>,
    #[arg(last = true)]
    command: Vec<String>,
}

const TOP: Section<'static> = Section::TopLevel {
    skip: &[LAUNCH_TABLE],
};

fn parse_mini(argv: &[&str], section: Section<'_>) -> Result<MiniArgs, ConfigError> {
    let mut cmd = MiniArgs::command();
    let argv: Vec<OsString> = argv.iter().map(Into::into).collect();
    let m = parse_with_config(&mut cmd, argv, section)?;
    Ok(MiniArgs::from_arg_matches(&m).unwrap())
}

fn write(dir: &Path, text: &str) -> String {
    write_as(dir, "c.toml", text)
}

fn write_as(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

fn dir(name: &str) -> PathBuf {
    let d = tmpdir(&format!("config-file-{name}"));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn an_unknown_key_or_a_bad_value_is_named_with_the_file() {
    let d = dir("errors");
    let cmd = MiniArgs::command();
    // A typo of a key.
    let p = write(&d, "n_layer = 2\nn_layers = 3\n");
    let e = parse_mini(&["mini", "--config", &p], TOP)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("n_layers") && e.contains("c.toml") && e.contains("no flag --n-layers"),
        "{e}"
    );
    // Invalid TOML: the file and the line.
    let e = ConfigFile::parse("n_layer = = 2\n", Path::new("run.toml"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("run.toml") && e.contains("line 1"), "{e}");
    // A value of the wrong type, and a value clap refuses: the file and the flag.
    let p = write(&d, "lr = \"fast\"\n");
    let e = parse_mini(&["mini", "--config", &p], TOP)
        .unwrap_err()
        .to_string();
    assert!(e.contains("c.toml") && e.contains("--lr"), "{e}");
    let p = write(&d, "n_layer = 2.5\n");
    let e = parse_mini(&["mini", "--config", &p], TOP)
        .unwrap_err()
        .to_string();
    assert!(e.contains("c.toml") && e.contains("--n-layer"), "{e}");
    let p = write(&d, "strategy = \"fast\"\n");
    let e = parse_mini(&["mini", "--config", &p], TOP)
        .unwrap_err()
        .to_string();
    assert!(e.contains("c.toml") && e.contains("--strategy"), "{e}");
    // ... which the command line can still override.
    assert!(parse_mini(&["mini", "--config", &p, "--strategy", "no-shard"], TOP).is_ok());
    // Neither the positional command nor --config itself is a key.
    for key in ["command = [\"ls\"]", "config = \"other.toml\""] {
        let f = ConfigFile::parse(key, Path::new("c.toml")).unwrap();
        let e = f.settings(&cmd, TOP).unwrap_err().to_string();
        assert!(e.contains("unknown key"), "{key}: {e}");
    }
    // A table nobody reads; [launch] is skipped by the example.
    let f = ConfigFile::parse("[train]\nlr = 1.0\n", Path::new("c.toml")).unwrap();
    let e = f.settings(&cmd, TOP).unwrap_err().to_string();
    assert!(e.contains("[train]") && e.contains("c.toml"), "{e}");
    // A file that is not there.
    let missing = d.join("missing.toml");
    let e = parse_mini(&["mini", "--config", missing.to_str().unwrap()], TOP)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("missing.toml") && e.contains("cannot read"),
        "{e}"
    );
    // The command line's own error stays clap's (the caller prints it with usage and exits 2).
    assert!(matches!(
        parse_mini(&["mini", "--n-layer", "x"], TOP),
        Err(ConfigError::CommandLine(_))
    ));
}

#[test]
fn settings_become_flags_and_the_command_line_wins() {
    let d = dir("settings");
    let p = write(
        &d,
        "n_layer = 6\nuntied = true\nverbose = true\nlr = 0.001\nprompt = \"-dash\"\n\
         tag = [\"a\", \"b\"]\n",
    );
    let a = parse_mini(&["mini", "--config", &p, "--n-layer", "2"], TOP).unwrap();
    assert_eq!(
        (a.n_layer, a.lr, a.untied, a.verbose, a.prompt.as_str()),
        (2, 0.001, true, true, "-dash")
    );
    assert_eq!(a.tags, ["a", "b"]);
    // Without --config, the defaults.
    let a = parse_mini(&["mini", "--n-layer", "3"], TOP).unwrap();
    assert_eq!(
        (a.n_layer, a.lr, a.untied, a.verbose),
        (3, 3e-4, false, false)
    );
    // A switch the file turns on, the command line turns off (`--untied=false`); alone, a
    // switch is on.
    let a = parse_mini(&["mini", "--config", &p, "--untied=false"], TOP).unwrap();
    assert_eq!((a.n_layer, a.untied), (6, false));
    assert!(parse_mini(&["mini", "--untied"], TOP).unwrap().untied);
    // `false` in the file: `--untied=false` for a flag with a value, nothing for a plain switch.
    let p2 = write_as(&d, "off.toml", "untied = false\nverbose = false\n");
    let a = parse_mini(&["mini", "--config", &p2], TOP).unwrap();
    assert_eq!((a.untied, a.verbose), (false, false));
    // An appending flag on the command line replaces the file's list.
    let a = parse_mini(&["mini", "--config", &p, "--tag", "c"], TOP).unwrap();
    assert_eq!(a.tags, ["c"]);
    // The file's flags never land in a launched command's arguments after `--`.
    let a = parse_mini(&["mini", "--config", &p, "--", "train", "--lr", "9"], TOP).unwrap();
    assert_eq!(a.command, ["train", "--lr", "9"]);
    assert_eq!((a.lr, a.n_layer), (0.001, 6));
    // Keys may be spelled with dashes.
    let p3 = write_as(&d, "dashes.toml", "n-layer = 5\n");
    assert_eq!(
        parse_mini(&["mini", "--config", &p3], TOP).unwrap().n_layer,
        5
    );
}

#[test]
fn one_file_for_the_example_and_the_launcher() {
    let d = dir("sections");
    let p = write(
        &d,
        "n_layer = 6\nlr = 0.5\n\n[launch]\nn_layer = 9\nprompt = \"launcher\"\n",
    );
    // The example reads the top level and skips [launch].
    let a = parse_mini(&["mini", "--config", &p], TOP).unwrap();
    assert_eq!((a.n_layer, a.lr, a.prompt.as_str()), (6, 0.5, "hello"));
    // The launcher reads [launch] only.
    let a = parse_mini(&["mini", "--config", &p], Section::Table(LAUNCH_TABLE)).unwrap();
    assert_eq!((a.n_layer, a.lr, a.prompt.as_str()), (9, 3e-4, "launcher"));
    // An unknown key of [launch] names the table; a [launch] that is not a table is an error;
    // a file without [launch] sets nothing for the launcher.
    let p = write(&d, "[launch]\nnproc = 2\n");
    let e = parse_mini(&["mini", "--config", &p], Section::Table(LAUNCH_TABLE))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("nproc") && e.contains("[launch]") && e.contains("c.toml"),
        "{e}"
    );
    let p = write(&d, "launch = 3\n");
    let e = parse_mini(&["mini", "--config", &p], Section::Table(LAUNCH_TABLE))
        .unwrap_err()
        .to_string();
    assert!(e.contains("launch must be a table"), "{e}");
    let p = write(&d, "n_layer = 6\n");
    let a = parse_mini(&["mini", "--config", &p], Section::Table(LAUNCH_TABLE)).unwrap();
    assert_eq!(a.n_layer, 4);
}

/// An array for a flag of one value, one flag set by both of its spellings, and a key for
/// `--help` / `--version` are errors naming the key(s), the flag and the file (they were
/// clap's "cannot be used multiple times" with no key, and help printed as an error); an
/// array still gives an appending flag one value per element.
#[test]
fn arrays_duplicates_and_help_keys_are_named() {
    let d = dir("shapes");
    let cases = [
        (
            "n_layer = [1, 2]\n",
            "key n_layer: --n-layer takes one value, found an array of 2",
        ),
        (
            "n_layer = 2\nn-layer = 3\n",
            // (the table's key order: `-` sorts before `_`)
            "keys n-layer and n_layer both set --n-layer: keep one",
        ),
        ("help = true\n", "key help: --help is not a setting"),
    ];
    for (text, want) in cases {
        let p = write(&d, text);
        let e = parse_mini(&["mini", "--config", &p], TOP)
            .unwrap_err()
            .to_string();
        assert!(e.contains(want) && e.contains("c.toml"), "{text}: {e}");
    }
    let p = write(&d, "tag = [\"a\", \"b\"]\n");
    let a = parse_mini(&["mini", "--config", &p], TOP).unwrap();
    assert_eq!(a.tags, ["a", "b"]);
}
