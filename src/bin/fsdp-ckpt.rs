//! `fsdp-ckpt`: look inside, export, import, reshard and verify candle-fsdp checkpoints from the
//! command line, without a process group or the model's code (cargo feature `cli`).
//!
//! ```text
//! fsdp-ckpt inspect checkpoints/mnist
//! fsdp-ckpt export checkpoints/mnist --out mnist.safetensors [--dtype bf16]
//! fsdp-ckpt export checkpoints/llama --format hf --out my-llama [--dtype bf16]
//! fsdp-ckpt import mnist.safetensors --out checkpoints/from-file --world-size 4
//! fsdp-ckpt reshard checkpoints/mnist --world-size 3 --out checkpoints/mnist-ws3
//! fsdp-ckpt verify checkpoints/mnist
//! fsdp-ckpt diff run-a.fingerprint run-b.fingerprint
//! fsdp-ckpt diff checkpoints/run-a checkpoints/run-b
//! ```
//!
//! A checkpoint `DIR` is a checkpoint directory (`step-00001875/`, holding `meta.json`) or a
//! checkpoint root (`--checkpoint-dir` of the examples), whose newest complete checkpoint is
//! used. Exit status: 0 on success; 1 on an error (printed on stderr, naming the file and the
//! problem), when `verify` found a problem or when `diff` found a difference; 2 on a usage error.
//! The work is done by `candle_fsdp::checkpoint::tools`.

use std::path::PathBuf;
use std::process::ExitCode;

use candle_core::DType;
use candle_fsdp::checkpoint;
use candle_fsdp::checkpoint::tools::{self, ImportOptions};
use candle_fsdp::fsdp::fingerprint;
use candle_fsdp::ShardingStrategy;
use clap::{Parser, Subcommand, ValueEnum};

/// Inspect, export, import, reshard and verify candle-fsdp sharded checkpoints.
#[derive(Debug, Parser)]
#[command(name = "fsdp-ckpt", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Dtype of an exported model file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ExportDtype {
    F32,
    Bf16,
    F16,
}

impl From<ExportDtype> for DType {
    fn from(d: ExportDtype) -> Self {
        match d {
            ExportDtype::F32 => DType::F32,
            ExportDtype::Bf16 => DType::BF16,
            ExportDtype::F16 => DType::F16,
        }
    }
}

/// Layout of an export.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ExportFormat {
    Safetensors,
    Hf,
    Peft,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Show a checkpoint: format, step, epoch, world size, strategy, every tensor (name, shape,
    /// dtype, bytes), the optimizer and its state's size, the files and their total size.
    Inspect {
        /// Checkpoint directory, or a checkpoint root (its newest checkpoint).
        dir: PathBuf,
    },
    /// Write the full model as one safetensors file (loads in plain Candle and PyTorch by
    /// name), or with `--format hf` as a Hugging Face model directory, streamed tensor by
    /// tensor, from a checkpoint saved at any world size.
    Export {
        /// Checkpoint directory, or a checkpoint root (its newest checkpoint).
        dir: PathBuf,
        /// The model file to write (atomically); with `--format hf`, the directory.
        #[arg(long)]
        out: PathBuf,
        /// Convert every tensor to this dtype (default: as saved, f32 parameters; the file is
        /// then identical to `checkpoint::save_full`'s).
        #[arg(long, value_enum)]
        dtype: Option<ExportDtype>,
        /// `safetensors`: one file of every tensor; `hf`: `config.json` and the weights
        /// (`model.safetensors`, or shards and `model.safetensors.index.json` above
        /// `--max-shard-size`) as `transformers`' `save_pretrained` writes them; `peft`: a
        /// LoRA run's adapters as PEFT's `save_pretrained` writes them (`adapter_config.json`,
        /// `adapter_model.safetensors`), which `PeftModel.from_pretrained(base, OUT)` loads.
        #[arg(long, value_enum, default_value = "safetensors")]
        format: ExportFormat,
        /// With `--format hf`: the largest weights file: bytes, or a size with a unit as
        /// `save_pretrained`'s `max_shard_size` takes it (`5GB` = 5·10⁹, `500MB`, `100KB`;
        /// `2GiB` = 2·2³⁰, `MiB`, `KiB`) (default 5GB).
        #[arg(long, value_name = "SIZE", value_parser = parse_size)]
        max_shard_size: Option<u64>,
        /// With `--format hf`: the `config.json` to write (default: the one the checkpoint
        /// stores, saved by a run started from `--from-hf` or by the llama or gpt example).
        #[arg(long)]
        hf_config: Option<PathBuf>,
        /// With `--format peft`: `base_model_name_or_path` of `adapter_config.json` (the base
        /// model's directory or hub name).
        #[arg(long)]
        base_model: Option<String>,
        /// With `--format hf`, for a LoRA run's checkpoint: the merged model (each adapted
        /// weight `W + s·B·A`, no adapters), as PEFT's `merge_and_unload` gives it.
        #[arg(long)]
        merge: bool,
        /// With `--format hf` of an adapter-only checkpoint (a LoRA run from `--from-hf`): read
        /// its frozen base from this directory instead of the one it recorded (moved or
        /// copied; checked against the recorded checksums).
        #[arg(long)]
        base: Option<PathBuf>,
        /// With `--format safetensors`: replace `--out` when it exists (without it, an existing
        /// file is refused: an export loses no data). Directories (`--format hf|peft`) are never
        /// written over: they must hold no weights of either kind.
        #[arg(long)]
        overwrite: bool,
    },
    /// Make a sharded checkpoint from a full safetensors model file, to start FSDP training
    /// from it (`--resume --checkpoint-dir OUT`).
    Import {
        /// The safetensors model file.
        file: PathBuf,
        /// Checkpoint root to write `step-00000000/` into.
        #[arg(long)]
        out: PathBuf,
        /// World size of the checkpoint.
        #[arg(long)]
        world_size: usize,
        /// Sharding strategy recorded (no-shard keeps each unit whole in rank 0's file).
        #[arg(long, default_value = "full-shard")]
        strategy: ShardingStrategy,
        /// Name suffix of buffers (replicated tensors kept in their dtype); repeat for several
        /// [default: running_mean, running_var, num_batches_tracked].
        #[arg(long = "buffer-suffix")]
        buffer_suffixes: Vec<String>,
    },
    /// Reshard a checkpoint to another world size offline (the same files a live load and save
    /// at that world size write).
    Reshard {
        /// Checkpoint directory, or a checkpoint root (its newest checkpoint).
        dir: PathBuf,
        /// World size of the new checkpoint.
        #[arg(long)]
        world_size: usize,
        /// Checkpoint root to write `step-<step>/` into.
        #[arg(long)]
        out: PathBuf,
    },
    /// Read the whole checkpoint and check sizes, headers, tensors and values; report every
    /// problem found and exit with status 1 if there is one.
    Verify {
        /// Checkpoint directory, or a checkpoint root (its newest checkpoint).
        dir: PathBuf,
    },
    /// Compare two runs: two fingerprint files (`--fingerprint`), record by record over the
    /// steps both recorded, or two checkpoints, tensor by tensor and bit for bit (any world
    /// sizes); print the first (step, unit, phase, rank) that differs (for checkpoints the
    /// tensor, its first differing element and every differing tensor's max abs / rel
    /// difference). Exit status 0 when identical, 1 when they differ.
    Diff {
        /// A fingerprint file, or a checkpoint directory or root.
        a: PathBuf,
        /// The same kind as `a`.
        b: PathBuf,
    },
}

fn run(cli: Cli) -> candle_fsdp::Result<ExitCode> {
    match cli.command {
        Command::Inspect { dir } => println!("{}", tools::inspect(&dir)?),
        Command::Export {
            dir,
            out,
            dtype,
            format: ExportFormat::Peft,
            max_shard_size,
            hf_config,
            base_model,
            merge,
            base,
            overwrite,
        } => {
            for (flag, given, why) in [
                ("--merge", merge, "a merged model is --format hf --merge"),
                (
                    "--overwrite",
                    overwrite,
                    "a directory holding an adapter or a model is never written over",
                ),
                (
                    "--base",
                    base.is_some(),
                    "an adapter holds no base tensor (--base-model names it in its config)",
                ),
                (
                    "--max-shard-size",
                    max_shard_size.is_some(),
                    "an adapter is one file",
                ),
                (
                    "--hf-config",
                    hf_config.is_some(),
                    "an adapter has no config.json",
                ),
                ("--dtype", dtype.is_some(), "the adapter is written in f32"),
            ] {
                if given {
                    return Err(candle_fsdp::Error::conflict(
                        flag,
                        "--format peft",
                        format!("it does not apply ({why})"),
                    ));
                }
            }
            let s = candle_fsdp::hf::export_peft(&dir, &out, base_model.as_deref())?;
            println!(
                "exported the LoRA adapters of {} to {} (PEFT layout): {} tensors, {} bytes",
                s.checkpoint.display(),
                s.dir.display(),
                s.tensors,
                s.bytes
            );
        }
        Command::Export {
            dir,
            out,
            dtype,
            format: ExportFormat::Hf,
            max_shard_size,
            hf_config,
            base_model,
            merge,
            base,
            overwrite,
        } => {
            if overwrite {
                return Err(candle_fsdp::Error::conflict(
                    "--overwrite",
                    "--format hf",
                    "--overwrite applies to --format safetensors only (a directory holding \
                     weights or an adapter is never written over: choose an empty one)",
                ));
            }
            if base_model.is_some() {
                return Err(candle_fsdp::Error::conflict(
                    "--base-model",
                    "--format hf",
                    "--base-model applies to --format peft only",
                ));
            }
            let opts = candle_fsdp::hf::HfExportOptions {
                dtype: dtype.map(DType::from),
                max_shard_bytes: max_shard_size
                    .unwrap_or(candle_fsdp::hf::HfExportOptions::default().max_shard_bytes),
                config: hf_config,
                merge,
                base,
            };
            let s = candle_fsdp::hf::export_hf(&dir, &out, &opts)?;
            println!(
                "exported {} to {} (Hugging Face layout): {} tensors, {} bytes in {} file(s)",
                s.checkpoint.display(),
                out.display(),
                s.tensors,
                s.total_size,
                s.files.len()
            );
        }
        Command::Export {
            dir,
            out,
            dtype,
            max_shard_size,
            hf_config,
            base_model,
            merge,
            base,
            overwrite,
            ..
        } => {
            // The Hugging Face layout's flags would otherwise be ignored without a word.
            for (flag, given, fmt) in [
                ("--max-shard-size", max_shard_size.is_some(), "hf"),
                ("--hf-config", hf_config.is_some(), "hf"),
                ("--base-model", base_model.is_some(), "peft"),
                ("--merge", merge, "hf"),
                ("--base", base.is_some(), "hf"),
            ] {
                if given {
                    return Err(candle_fsdp::Error::conflict(flag, "--format safetensors", format!("{flag} applies to --format {fmt} only (this export writes one safetensors file)")));
                }
            }
            let s = tools::export_full(&dir, &out, dtype.map(DType::from), overwrite)?;
            println!(
                "exported {} to {}: {} tensors, {} bytes (largest tensor {} bytes)",
                s.checkpoint.display(),
                s.path.display(),
                s.tensors,
                s.bytes,
                s.largest_tensor_bytes
            );
        }
        Command::Import {
            file,
            out,
            world_size,
            strategy,
            buffer_suffixes,
        } => {
            let mut opts = ImportOptions {
                world_size,
                strategy,
                ..Default::default()
            };
            if !buffer_suffixes.is_empty() {
                opts.buffer_suffixes = buffer_suffixes;
            }
            let dir = tools::import_full(&file, &out, &opts)?;
            println!(
                "imported {} to {} (world size {world_size})",
                file.display(),
                dir.display()
            );
            // `--resume` takes the newest checkpoint of a root: say when that is not this one.
            if let Some(newest) = checkpoint::list_complete(&out)?.pop() {
                if newest != dir {
                    eprintln!(
                        "note: {} also holds the newer checkpoint {}, which `--resume` would \
                         load instead; resume from this one with `--resume-from {}`",
                        out.display(),
                        newest.display(),
                        dir.display()
                    );
                }
            }
        }
        Command::Reshard {
            dir,
            world_size,
            out,
        } => {
            let dir = tools::resolve_checkpoint(&dir)?;
            let new = tools::reshard(&dir, &out, world_size)?;
            println!(
                "resharded {} to {} (world size {world_size})",
                dir.display(),
                new.display()
            );
        }
        Command::Diff { a, b } => {
            for p in [&a, &b] {
                if !p.exists() {
                    return Err(candle_fsdp::Error::file(p, "no such file or directory"));
                }
            }
            let identical = match (a.is_dir(), b.is_dir()) {
                (true, true) => {
                    let d = tools::diff_checkpoints(&a, &b)?;
                    print!("{d}");
                    d.identical()
                }
                (false, false) => {
                    let d = fingerprint::diff(&a, &b)?;
                    print!("{d}");
                    d.identical() && !d.common_steps.is_empty()
                }
                _ => {
                    let kind =
                        |p: &std::path::Path| if p.is_dir() { "a directory" } else { "a file" };
                    return Err(candle_fsdp::Error::conflict(
                        format_args!("{} ({})", a.display(), kind(&a)),
                        format_args!("{} ({})", b.display(), kind(&b)),
                        "diff compares two fingerprint files or two checkpoints",
                    ));
                }
            };
            if !identical {
                return Ok(ExitCode::FAILURE);
            }
        }
        Command::Verify { dir } => {
            let report = tools::verify(&dir)?;
            println!("{report}");
            if !report.is_ok() {
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    // A closed pipe (`fsdp-ckpt inspect DIR | head`) ends the tool quietly, as any Unix filter,
    // instead of a panic in `println!` (Rust ignores SIGPIPE by default).
    #[cfg(unix)]
    // SAFETY: restores a signal's default disposition before any other thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("fsdp-ckpt: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A size in bytes: plain digits, or digits (a decimal point allowed) and a unit, `B`, `KB`,
/// `MB`, `GB`, `TB` (powers of 10, as transformers' `convert_file_size_to_int`) or `KiB`,
/// `MiB`, `GiB`, `TiB` (powers of 2); at least 1 byte.
fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = (&t[..split], t[split..].trim());
    let scale: f64 = match unit {
        "" | "B" => 1.0,
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        "TiB" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => {
            return Err(format!(
                "{s:?}: expected bytes or a size with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, \
                 TiB), e.g. 5GB"
            ))
        }
    };
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?}: expected a number before the unit, e.g. 5GB"))?;
    let bytes = (n * scale).round();
    if !(bytes >= 1.0 && bytes < u64::MAX as f64) {
        return Err(format!("{s:?}: must be at least 1 byte"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_read_as_transformers_reads_them() {
        assert_eq!(parse_size("1000"), Ok(1000));
        assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_size("500MB"), Ok(500_000_000));
        assert_eq!(parse_size("1.5KB"), Ok(1500));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert!(parse_size("0").unwrap_err().contains("at least 1 byte"));
        assert!(parse_size("5XB")
            .unwrap_err()
            .contains("expected bytes or a size"));
        assert!(parse_size("GB").unwrap_err().contains("expected a number"));
    }
}
