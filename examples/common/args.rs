//! The flags every example takes, their per-example defaults, and the checks made before any
//! work starts.

use std::ffi::OsString;
use std::path::PathBuf;

use anyhow::Context;
use candle_fsdp::checkpoint;
use candle_fsdp::comm::threads::set_intra_op_threads;
use candle_fsdp::config_file::{self, ConfigError};
use candle_fsdp::launch::{LaunchEnv, Launcher};
use candle_fsdp::{MixedPrecision, ShardingStrategy};
use clap::{Parser, ValueEnum};

/// How micro-batches are accumulated (`--accum-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AccumMode {
    /// Unsharded gradients accumulate locally; one reduce-scatter per optimizer step.
    NoSync,
    /// Every micro-batch is reduce-scattered; the shards accumulate.
    ReduceScatter,
}

/// The flags of the training loop, flattened into each example's own `Args`
/// (`#[command(flatten)]`). `--batch-size`, `--lr` and `--checkpoint-dir` have no default here:
/// each example gives its own through [`parse`]. How long to train is the example's own flag
/// (MNIST's `--epochs`, the GPT's `--max-steps`).
#[derive(Debug, Clone, clap::Args)]
pub struct TrainArgs {
    /// TOML file of flags: keys are the long flag names (`batch_size = 64`); flags on the
    /// command line override it; an unknown key is an error; its `[launch]` table is
    /// fsdp-run's.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Number of ranks: threads of this process (default 2). Under `mpirun` the job's process
    /// count is the world size, and a --world-size that disagrees with it is an error.
    #[arg(long)]
    pub world_size: Option<usize>,
    /// Where the model runs: `cpu`, `cuda` (the GPU `LOCAL_RANK` names, else 0) or `cuda:N`.
    /// On one GPU, `--world-size` ranks share it as threads; under `fsdp-run`/torchrun or
    /// `mpirun`, each process uses its `LOCAL_RANK`'s GPU over NCCL (features `cuda`, `nccl`).
    #[arg(long, default_value = "cpu")]
    pub device: candle_fsdp::device::DeviceSpec,
    /// Seed of initialisation and shuffling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Batch size per rank.
    #[arg(long)]
    pub batch_size: usize,
    /// Learning rate.
    #[arg(long)]
    pub lr: f64,
    /// Where sharded checkpoints go (one `step-<n>/` directory per save).
    #[arg(long)]
    pub checkpoint_dir: PathBuf,
    /// Resume from the newest complete checkpoint in --checkpoint-dir (a mid-epoch one
    /// continues the epoch where it stopped); without it, training starts from scratch.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value_t = false, action = clap::ArgAction::Set)]
    pub resume: bool,
    /// Resume from this checkpoint directory (`<dir>/step-<n>`), whatever run it belongs to
    /// (--resume refuses a --checkpoint-dir holding several runs' checkpoints).
    #[arg(long, value_name = "PATH", conflicts_with = "resume")]
    pub resume_from: Option<PathBuf>,
    /// Also save a checkpoint every N optimizer steps (0: only at the end of each epoch, or of
    /// the run).
    #[arg(long, default_value_t = 0)]
    pub save_every: u64,
    /// Complete checkpoints to keep (0 keeps all).
    #[arg(long, default_value_t = 2)]
    pub keep_last: usize,
    /// Periodic checkpoints (--save-every) save asynchronously: the files are written at the
    /// step boundary, their fsync and the publish happen while training goes on (published at
    /// the next save or at the end).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value_t = false, action = clap::ArgAction::Set)]
    pub async_save: bool,
    /// Sharding strategy: full-shard, shard-grad-op, no-shard, hybrid-shard or
    /// hybrid-shard-grad-op (a hybrid name may carry its shard size: hybrid-shard:4).
    #[arg(long, default_value = "full-shard")]
    pub strategy: ShardingStrategy,
    /// Ranks of one shard group under hybrid-shard / hybrid-shard-grad-op (parameters are
    /// sharded inside the group and replicated across groups); must divide the world size.
    /// Default: the ranks of one machine (the whole world when the job runs on one).
    #[arg(long, value_name = "N")]
    pub shard_size: Option<usize>,
    /// Partial reshard after forward (full-shard, hybrid-shard): keep each unit's parameters
    /// sharded over groups of N ranks between its forward and its backward, whose all-gather
    /// then stays inside that group; N divides the shard group's size.
    #[arg(long, value_name = "N")]
    pub reshard_after_forward: Option<usize>,
    /// Disable forward and backward prefetch.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value_t = false, action = clap::ArgAction::Set)]
    pub no_prefetch: bool,
    /// Mixed precision: f32, bf16, f16 (with a dynamic loss scaler) or bf16-f32-reduce.
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// Micro-batches accumulated per optimizer step.
    #[arg(long, default_value_t = 1)]
    pub grad_accum: usize,
    /// How to accumulate: no-sync (unsharded gradients, one reduce-scatter per step) or
    /// reduce-scatter (every micro-batch reduced, sharded accumulation).
    #[arg(long, value_enum, default_value_t = AccumMode::NoSync)]
    pub accum_mode: AccumMode,
    /// Clip gradients to this total L2 norm (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub clip_grad_norm: f32,
    /// Write a Chrome/Perfetto trace of a few training steps to this JSON file, plus the
    /// timeline picture next to it (same name, .png and .svg), and print overlap figures.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Number of steps traced (after 8 warm-up steps of the first epoch, or of the run, trained;
    /// fewer warm-up steps when the epoch or the run is shorter).
    #[arg(long, default_value_t = 4)]
    pub trace_steps: usize,
    /// Write a run fingerprint to FILE: per optimizer step, unit and rank, the CRC-32C of the
    /// gathered parameters, of the gradient reduction's input and output and of the shard
    /// after the step (rank 0 writes; `fsdp-ckpt diff A B` names where two runs first differ).
    #[arg(long, value_name = "FILE")]
    pub fingerprint: Option<PathBuf>,
    /// Collective timeout in seconds.
    #[arg(long, default_value_t = 300)]
    pub timeout_s: u64,
}

impl TrainArgs {
    /// `--strategy` with `--shard-size` applied (a hybrid strategy's size given in either place).
    pub fn sharding_strategy(&self) -> ShardingStrategy {
        match self.shard_size {
            Some(n) => self.strategy.with_shard_size(Some(n)),
            None => self.strategy,
        }
    }
}

/// An example's defaults for the flags of [`TrainArgs`] that have none.
pub struct Defaults {
    /// `--batch-size` (per rank).
    pub batch_size: &'static str,
    /// `--lr`.
    pub lr: &'static str,
    /// Help line of `--lr` (say how the example schedules it; no final period, as clap's).
    pub lr_help: &'static str,
    /// `--checkpoint-dir`.
    pub checkpoint_dir: &'static str,
}

/// Parses the command line, and the `--config` file it names, into an example's `Args` (which
/// flattens [`TrainArgs`]), with that example's [`Defaults`]; exits with clap's message on a
/// parse error of the command line or for `--help`.
///
/// Errors: the config file's, naming the file and the key or flag
/// ([`candle_fsdp::config_file`]).
pub fn parse<A: Parser>(defaults: &Defaults) -> anyhow::Result<A> {
    parse_from(defaults, std::env::args_os().collect())
}

/// [`parse`] of the words `argv` (the program's name first).
pub fn parse_from<A: Parser>(defaults: &Defaults, argv: Vec<OsString>) -> anyhow::Result<A> {
    let mut command = command::<A>(defaults);
    let skip = [config_file::LAUNCH_TABLE];
    let matches = match config_file::parse_with_config(
        &mut command,
        argv,
        config_file::Section::TopLevel { skip: &skip },
    ) {
        Ok(m) => m,
        // The command line's own errors, --help and --version: clap's message and exit code.
        Err(ConfigError::CommandLine(e)) => e.format(&mut command).exit(),
        Err(e) => return Err(e.into()),
    };
    Ok(A::from_arg_matches(&matches).unwrap_or_else(|e| e.format(&mut command).exit()))
}

/// The command of an example's `Args` (which flattens [`TrainArgs`]) with that example's
/// [`Defaults`].
pub fn command<A: Parser>(defaults: &Defaults) -> clap::Command {
    A::command()
        .mut_arg("batch_size", |a| {
            a.default_value(defaults.batch_size).required(false)
        })
        .mut_arg("lr", |a| {
            a.default_value(defaults.lr)
                .required(false)
                .help(defaults.lr_help)
        })
        .mut_arg("checkpoint_dir", |a| {
            a.default_value(defaults.checkpoint_dir).required(false)
        })
}

/// Ranks of a plain (thread) run without --world-size.
const DEFAULT_WORLD_SIZE: usize = 2;

/// How the job runs, decided by [`setup`].
pub struct Setup {
    /// Threads of this process, or this process's rank of an `mpirun` job.
    pub launcher: Launcher,
    /// Compute threads per rank.
    pub intra_op: usize,
}

impl Setup {
    /// True in the process that runs rank 0 (the one that prints).
    pub fn prints(&self) -> bool {
        self.launcher.local_ranks().contains(&0)
    }

    /// The backend and the device, for the first line of output: `threads on cpu`,
    /// `threads on cuda:0`, `nccl on cuda:3`, `mpi on cpu` (`scripts/gpu-check.sh` reads it).
    pub fn device_desc(&self) -> String {
        match self.launcher.gpu() {
            Some(g) => format!("{} on cuda:{g}", self.launcher.backend()),
            None => format!("{} on cpu", self.launcher.backend()),
        }
    }
}

/// Checks every flag and output path before any work (so a typo fails now, not after an epoch),
/// picks the launcher from `--device` and how the process was started (threads on the CPU or
/// one GPU, `mpirun`, NCCL under `fsdp-run`), says what `--resume` will find, and splits this
/// machine's cores between the ranks on it
/// (`set_intra_op_threads`).
pub fn setup(args: &TrainArgs) -> anyhow::Result<Setup> {
    super::alloc::keep_freed_memory();
    let env = LaunchEnv::detect()?;
    let world_size = env.world_size_for(args.world_size, DEFAULT_WORLD_SIZE)?;
    validate(args, &env, world_size)?;
    // Before MPI starts its threads: the environment is only read afterwards.
    let intra_op = set_intra_op_threads(env.ranks_on_this_machine(world_size));
    // `--device` and how the process was started choose the backend: threads (on the CPU or
    // sharing one GPU), MPI, or NCCL with one process per GPU.
    let launcher = Launcher::for_device(
        args.device,
        &env,
        args.world_size,
        DEFAULT_WORLD_SIZE,
        std::time::Duration::from_secs(args.timeout_s),
    )?;
    // A GPU that is not there fails now, naming the flag, not after the data is loaded.
    #[cfg(feature = "cuda")]
    if let Some(gpu) = launcher.gpu() {
        candle_fsdp::device::cuda::check_ordinal(gpu)
            .map_err(|e| anyhow::anyhow!("--device {}: {e}", args.device))?;
    }
    if launcher.local_ranks().contains(&0) {
        check_checkpoint_dir(args)?;
    }
    Ok(Setup { launcher, intra_op })
}

/// The flag checks, each naming the flag and the value found.
/// Most in-process thread ranks the examples start (each rank has 3 comm-stream threads).
const MAX_THREAD_RANKS: usize = 256;

fn validate(args: &TrainArgs, env: &LaunchEnv, world_size: usize) -> anyhow::Result<()> {
    anyhow::ensure!(
        *env != LaunchEnv::Local || (1..=MAX_THREAD_RANKS).contains(&world_size),
        "--world-size must be between 1 and {MAX_THREAD_RANKS} (in-process thread ranks, each \
         with its own comm-stream threads), found {world_size}"
    );
    anyhow::ensure!(args.batch_size >= 1, "--batch-size must be at least 1");
    anyhow::ensure!(args.grad_accum >= 1, "--grad-accum must be at least 1");
    anyhow::ensure!(
        args.lr.is_finite() && args.lr > 0.0,
        "--lr must be a positive finite number, found {}",
        args.lr
    );
    anyhow::ensure!(
        args.clip_grad_norm.is_finite() && args.clip_grad_norm >= 0.0,
        "--clip-grad-norm must be a finite number >= 0 (0 = off), found {}",
        args.clip_grad_norm
    );
    anyhow::ensure!(args.timeout_s >= 1, "--timeout-s must be at least 1");
    if let Some(n) = args.shard_size {
        anyhow::ensure!(
            args.strategy.is_hybrid(),
            "--shard-size {n} needs --strategy hybrid-shard or hybrid-shard-grad-op (found {})",
            args.strategy
        );
    }
    // The size given by --shard-size or in the strategy's name (hybrid-shard:4).
    let strategy = args.sharding_strategy();
    if let Some(n) = strategy.shard_size() {
        anyhow::ensure!(n >= 1, "--shard-size must be at least 1, found {n}");
        anyhow::ensure!(
            world_size.is_multiple_of(n),
            "--shard-size {n} does not divide the world size {world_size}"
        );
    }
    if let Some(k) = args.reshard_after_forward {
        anyhow::ensure!(
            strategy.reshards_after_forward(),
            "--reshard-after-forward {k} needs --strategy full-shard or hybrid-shard (found \
             {strategy}, which does not reshard after forward)"
        );
        anyhow::ensure!(
            k >= 1,
            "--reshard-after-forward must be at least 1, found {k}"
        );
        // The shard group: the world under full-shard, --shard-size under hybrid-shard (the
        // runtime checks its default, the ranks of one machine).
        let group = match strategy {
            ShardingStrategy::FullShard => Some(world_size),
            s => s.shard_size(),
        };
        if let Some(g) = group {
            anyhow::ensure!(
                g.is_multiple_of(k),
                "--reshard-after-forward {k} does not divide the shard group's {g} ranks \
                 ({}); choose a divisor of {g}",
                if strategy == ShardingStrategy::FullShard {
                    "the world size under full-shard"
                } else {
                    "--shard-size"
                }
            );
        }
    }
    MixedPrecision::from_name(&args.precision)?;
    if args.trace.is_some() {
        anyhow::ensure!(args.trace_steps >= 1, "--trace-steps must be at least 1");
    }
    for (flag, path, what) in [
        ("--trace", &args.trace, "a .json file path"),
        ("--fingerprint", &args.fingerprint, "a file path"),
    ] {
        if let Some(p) = path {
            check_output_file(flag, p, what)?;
        }
    }
    Ok(())
}

/// An output file `p` of `flag` can be created: not a directory, in a directory that exists.
fn check_output_file(flag: &str, p: &std::path::Path, what: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        !p.is_dir(),
        "{flag} {}: is a directory, expected {what}",
        p.display()
    );
    let dir = p.parent().filter(|d| !d.as_os_str().is_empty());
    anyhow::ensure!(
        dir.is_none_or(|d| d.is_dir()),
        "{flag} {}: directory {} does not exist",
        p.display(),
        dir.map(|d| d.display().to_string()).unwrap_or_default()
    );
    Ok(())
}

/// Checks that `--checkpoint-dir` can be written (it, or the nearest directory above it that
/// exists, where the first save creates it: a run that fails before saving leaves no empty
/// directory behind), and prints what `--resume` (or its absence) means for the checkpoints
/// already there.
fn check_checkpoint_dir(args: &TrainArgs) -> anyhow::Result<()> {
    let dir = &args.checkpoint_dir;
    // `symlink_metadata`: a dangling link is something in the way, not a path to create.
    let there = |p: &std::path::Path| p.symlink_metadata().is_ok();
    anyhow::ensure!(
        dir.is_dir() || !there(dir),
        "--checkpoint-dir {}: exists and is not a directory{}",
        dir.display(),
        if dir.exists() {
            ""
        } else {
            " (a dangling link?)"
        }
    );
    let mut writes_in = dir.as_path();
    while !there(writes_in) {
        match writes_in.parent() {
            Some(p) if !p.as_os_str().is_empty() => writes_in = p,
            _ => {
                writes_in = std::path::Path::new(".");
                break;
            }
        }
    }
    anyhow::ensure!(
        writes_in.is_dir(),
        "--checkpoint-dir {}: cannot be created ({} is not a directory)",
        dir.display(),
        writes_in.display()
    );
    let probe = writes_in.join(format!(".candle-fsdp-write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").with_context(|| {
        format!(
            "--checkpoint-dir {}: not writable ({} is not)",
            dir.display(),
            writes_in.display()
        )
    })?;
    let _ = std::fs::remove_file(&probe);
    if let Some(from) = &args.resume_from {
        anyhow::ensure!(
            from.join(checkpoint::META_FILE).is_file(),
            "--resume-from {}: not a complete checkpoint (no {})",
            from.display(),
            checkpoint::META_FILE
        );
        return Ok(());
    }
    let existing = checkpoint::list_complete(dir)?;
    match (
        args.resume || super::trainer::restart_count() > 0,
        existing.last(),
    ) {
        (true, None) => {
            // A checkpoint that failed to load was renamed `step-<n>.damaged[-<i>]`. An
            // explicit --resume cannot mean starting over (under `fsdp-run --max-restarts` a
            // restart would retrain from step 0 unnoticed): refuse, as PyTorch's DCP load
            // fails each time. (A restart of a run started without --resume goes on from
            // scratch, as its first attempt did, whatever an older run left set aside.)
            let mut damaged: Vec<String> = std::fs::read_dir(dir)
                .into_iter()
                .flatten()
                .flatten()
                .filter(|e| e.path().is_dir())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("step-") && n.contains(".damaged"))
                .collect();
            damaged.sort();
            anyhow::ensure!(
                !args.resume || damaged.is_empty(),
                "--resume: every checkpoint in {} was set aside as damaged by an earlier load \
                 ({}; `fsdp-ckpt verify <that directory>` says why): repair one and rename it \
                 back, or move them away (or leave out --resume) to start from scratch",
                dir.display(),
                damaged.join(", ")
            );
            let set_aside = match damaged.is_empty() {
                true => String::new(),
                false => format!(" (set aside as damaged: {})", damaged.join(", ")),
            };
            println!(
                "--resume: no complete checkpoint in {}{set_aside}: starting from scratch",
                dir.display()
            )
        }
        (false, Some(last)) => println!(
            "note: {} already holds checkpoints (newest {}); this run starts from scratch and \
             saves beside them (a checkpoint of the same step is kept, renamed \
             step-<n>.run-<its run id>; pass --resume to continue from the newest)",
            dir.display(),
            last.display()
        ),
        _ => {}
    }
    Ok(())
}
