//! `fsdp-run`: start the processes of a torchrun-style job on this machine (cargo feature
//! `cli`), with torchrun's flags and variables.
//!
//! ```text
//! fsdp-run --nproc-per-node 2 -- target/release/examples/mnist        # CPU: shared memory
//! fsdp-run --nproc-per-node 2 --max-restarts 3 -- target/release/examples/mnist --save-every 100
//! fsdp-run --nproc-per-node 4 -- target/release/examples/gpt --device cuda
//! fsdp-run --nnodes 2 --node-rank 1 --nproc-per-node 8 --master-addr node0 -- ./train
//! fsdp-run --nnodes 2 --node-rank 0 --master-addr node0 -- target/release/examples/mnist  # CPU: TCP
//! ```
//!
//! For local process `l` of `N` (`--nproc-per-node`) on node `K` (`--node-rank`) of `M`
//! (`--nnodes`) it sets `RANK` = `K·N + l`, `WORLD_SIZE` = `M·N`, `LOCAL_RANK` = `l`,
//! `LOCAL_WORLD_SIZE` = `N`, `GROUP_RANK` = `K`, `MASTER_ADDR`, `MASTER_PORT` (defaults
//! `127.0.0.1`, `29500`), and removes the variables `mpirun` sets (`OMPI_COMM_WORLD_*`,
//! `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALNRANKS`) so that the children are not taken for MPI ranks.
//! Rank 0 serves the job's rendezvous store at `MASTER_ADDR:MASTER_PORT`
//! (`candle_fsdp::comm::store`); `fsdp-run` itself opens no port. On one machine it also sets
//! `TORCHELASTIC_RUN_ID` to the job's id (unless set already), so that the store refuses a rank
//! of another job started on the same port instead of letting it take a rank of this one. On several machines, run
//! one `fsdp-run` per machine with the same `--nnodes`, `--nproc-per-node`, `--master-addr`
//! (node rank 0's address) and `--master-port`, and its own `--node-rank`. With `--device cpu`
//! the ranks then meet over TCP (`candle_fsdp::comm::tcp`; one machine's ranks share memory).
//!
//! - Output: every line a child writes is copied to the same stream of `fsdp-run` (stdout or
//!   stderr), prefixed `[rank R] `; lines of different ranks never mix within a line (a line
//!   longer than 64 KiB is cut into several prefixed lines). Children read no input (stdin
//!   is `/dev/null`).
//! - Failure: when a child exits with a nonzero code or is killed by a signal, `fsdp-run` sends
//!   SIGTERM to the others, SIGKILL to those still running after `--grace-period` seconds
//!   (default 5), and exits with the first failed child's code (a signal `n` gives `128 + n`).
//! - Shared memory: after each attempt, the segments a CPU job of the shared-memory backend
//!   left in `/dev/shm` (only a job killed while its ranks were meeting leaves any) are removed.
//! - `--config FILE` reads the `[launch]` table of a TOML file (the examples' `--config` file):
//!   `nproc_per_node`, `nnodes`, `node_rank`, `master_addr`, `master_port`, `max_restarts`,
//!   `grace_period`; flags on the command line override it; an unknown key is an error naming
//!   the key and the file (`candle_fsdp::config_file`, as the examples read the rest).
//! - Elastic restarts (`--max-restarts N`, torchrun's flag): when a child fails (nonzero exit
//!   or a signal), the others are stopped as above and, while restarts are left, every local
//!   process is started again with `TORCHELASTIC_RESTART_COUNT` = the restart's number (0 in
//!   the first attempt) and `TORCHELASTIC_MAX_RESTARTS` = N; a line on stderr says which rank
//!   failed and that the job restarts. The examples then resume from the newest complete
//!   checkpoint. A signal sent to `fsdp-run`, or a program that cannot start, is never
//!   restarted. On several machines each `fsdp-run` restarts its own processes; the ranks of
//!   the other machines fail in turn (their peers are gone) and restart too, so every machine
//!   should be given the same `--max-restarts`.
//! - Signals: SIGINT, SIGTERM and SIGHUP sent to `fsdp-run` are forwarded to every child (each
//!   child runs in its own process group, so a terminal's Ctrl-C reaches the children once,
//!   through `fsdp-run`); children still running after the grace period are killed, and
//!   `fsdp-run` exits with `128 + n` unless a child failed first. A second signal kills the
//!   children at once.
//! - Nothing of the job outlives `fsdp-run` (Linux). It is a child subreaper
//!   (`PR_SET_CHILD_SUBREAPER`), so a process started by a rank whose parent exits is re-parented
//!   to it: every process of the job stays its descendant, found in `/proc`. When the ranks'
//!   processes have exited (succeeded, failed or stopped), every process they left running, in
//!   their process groups or out of them, gets SIGTERM and, after the grace period, SIGKILL,
//!   before `fsdp-run` exits; a process group is signalled whether or not its leader has exited.
//! - If `fsdp-run` is killed with SIGKILL (or crashes), a watchdog does it: a process forked at
//!   the start (named `fsdp-watchdog`, in a process group of its own, ignoring the terminal's
//!   signals) that learns each rank's process group through a pipe and, seeing the pipe close
//!   without a last word, sends SIGTERM to those groups and to every process whose environment
//!   carries the job's `FSDP_RUN_JOB` (set for every rank, inherited by what it starts), then
//!   SIGKILL after the grace period. The ranks' own processes also die at once with
//!   `PR_SET_PDEATHSIG`. Not covered: a process that left its rank's process group *and*
//!   cleared its environment, when `fsdp-run` is killed with SIGKILL (a cgroup would be needed).
//! - The last line on stderr says how the job ended: every rank succeeded, or which rank failed
//!   first and how, or which signal stopped the job, and which ranks were stopped; with
//!   `--max-restarts`, also how many restarts happened and why (`; 1 restart (of at most 3):
//!   rank 1 killed by signal 9 (SIGKILL) after 4.2 s`).
//!
//! Exit status: 0 when every child succeeded; the first failed child's status (above); 2 on a
//! usage error (bad flags, an option it does not know before the program — not taken for the
//! program —, `--node-rank >= --nnodes`, `--nproc-per-node 0`); 127 (126) when
//! the program is not found (not executable), 1 when it cannot be started for another reason:
//! the message names the program and the OS error.

use std::ffi::OsString;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use candle_fsdp::config_file::{self, ConfigError, Section, LAUNCH_TABLE};
use clap::{CommandFactory, FromArgMatches, Parser};

/// Start the processes of a torchrun-style job: sets RANK, WORLD_SIZE, LOCAL_RANK,
/// LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT for each, prefixes their output
/// with their rank, and stops them all when one fails.
#[derive(Debug, Parser)]
#[command(
    name = "fsdp-run",
    version,
    override_usage = "fsdp-run [OPTIONS] -- PROGRAM [ARGS]...",
    after_help = "Example: fsdp-run --nproc-per-node 4 -- target/release/examples/gpt --device cuda\n\
                  Exit status: 0 when every process succeeded (in the last attempt, with --max-restarts); else the first failed process's \
                  (128 + n for signal n); 2 on a usage error; 127 when PROGRAM is not found."
)]
struct Cli {
    /// Processes to start on this machine (one per GPU).
    #[arg(
        long = "nproc-per-node",
        alias = "nproc_per_node",
        value_name = "N",
        default_value_t = 1
    )]
    nproc_per_node: usize,
    /// Machines of the job, each running one fsdp-run.
    #[arg(long, value_name = "M", default_value_t = 1)]
    nnodes: usize,
    /// This machine's index, 0..M.
    #[arg(
        long = "node-rank",
        alias = "node_rank",
        value_name = "K",
        default_value_t = 0
    )]
    node_rank: usize,
    /// Address of node 0, where rank 0 serves the rendezvous store.
    #[arg(
        long = "master-addr",
        alias = "master_addr",
        value_name = "ADDR",
        default_value = "127.0.0.1"
    )]
    master_addr: String,
    /// TCP port of the rendezvous store (1..=65535).
    #[arg(
        long = "master-port",
        alias = "master_port",
        value_name = "PORT",
        default_value_t = 29500,
        value_parser = clap::value_parser!(u16).range(1..)
    )]
    master_port: u16,
    /// Restart the job up to N times when a process fails (torchrun's --max-restarts): stop
    /// the others, start all again with TORCHELASTIC_RESTART_COUNT set to the restart's number.
    #[arg(
        long = "max-restarts",
        alias = "max_restarts",
        value_name = "N",
        default_value_t = 0
    )]
    max_restarts: usize,
    /// Read the `[launch]` table of this TOML file (keys: nproc_per_node, nnodes, node_rank,
    /// master_addr, master_port, max_restarts, grace_period); flags given here override it.
    #[arg(long, value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    /// Seconds between SIGTERM and SIGKILL when stopping the processes.
    #[arg(long = "grace-period", value_name = "SECONDS", default_value_t = 5.0)]
    grace_period: f64,
    /// The program to start and its arguments (after `--`).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "PROGRAM"
    )]
    command: Vec<OsString>,
}

/// Variables of `mpirun` that `launch::env` reads, removed from the children's environment.
const MPI_VARS: [&str; 6] = [
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALNRANKS",
];

/// Signals forwarded to the children.
const FORWARDED: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// The last signal received and not yet handled (0: none).
static RECEIVED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    RECEIVED.store(sig, Ordering::SeqCst);
}

fn install_signal_handlers() {
    for sig in FORWARDED {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe; the
        // sigaction struct is zeroed then filled.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as libc::sighandler_t;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        _ => return format!("signal {sig}"),
    };
    format!("signal {sig} ({name})")
}

/// `exited with code 3`, `killed by signal 9 (SIGKILL)`.
fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(s)) => format!("killed by {}", signal_name(s)),
        _ => format!("ended with {status}"),
    }
}

/// The exit code a shell would report for `status`.
fn exit_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(c), _) => c,
        (None, Some(s)) => 128 + s,
        _ => 1,
    }
}

fn ranks_list(ranks: &[usize]) -> String {
    let mut s = String::new();
    for (i, r) in ranks.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str(&r.to_string());
    }
    if ranks.len() == 1 {
        format!("rank {s}")
    } else {
        format!("ranks {s}")
    }
}

/// Longest line copied as one; longer ones are cut.
const MAX_LINE: usize = 64 << 10;

/// Copies `src` to this process's stdout (or stderr) line by line, each prefixed `[rank R] `
/// and written whole under the stream's lock. Keeps draining `src` if the output fails, so the
/// child never blocks on a full pipe.
fn pump(src: impl Read, rank: usize, to_stderr: bool) {
    let mut reader = BufReader::with_capacity(MAX_LINE, src);
    let prefix = format!("[rank {rank}] ");
    let mut line = Vec::with_capacity(256);
    let mut output_ok = true;
    loop {
        line.clear();
        line.extend_from_slice(prefix.as_bytes());
        // Read up to and including a newline, at most MAX_LINE bytes.
        let mut got = 0;
        let mut eof = false;
        loop {
            let buf = match reader.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    eof = true;
                    break;
                }
            };
            if buf.is_empty() {
                eof = true;
                break;
            }
            let room = MAX_LINE - got;
            let (n, complete) = match buf.iter().take(room).position(|&b| b == b'\n') {
                Some(i) => (i + 1, true),
                None => (buf.len().min(room), false),
            };
            line.extend_from_slice(&buf[..n]);
            reader.consume(n);
            got += n;
            if complete || got >= MAX_LINE {
                break;
            }
        }
        if got == 0 {
            break;
        }
        if line.last() != Some(&b'\n') {
            line.push(b'\n');
        }
        if output_ok {
            output_ok = if to_stderr {
                io::stderr().lock().write_all(&line).is_ok()
            } else {
                let mut out = io::stdout().lock();
                out.write_all(&line).and_then(|()| out.flush()).is_ok()
            };
        }
        if eof {
            break;
        }
    }
}

/// The environment variable that marks every process of a job (`<fsdp-run's pid>-<start time
/// in ns>`): inherited by whatever the ranks start, it lets the watchdog find processes that
/// left their rank's process group after fsdp-run is gone.
const JOB_VAR: &str = "FSDP_RUN_JOB";

mod attempt;
mod proc_table;
mod watchdog;

use attempt::{run_attempt, Attempt};
use watchdog::{watchdog_if_asked, Watchdog};

/// Most processes `fsdp-run` starts on one node (a typo such as `--nproc-per-node 100000`
/// would otherwise exhaust the machine's processes and threads).
const MAX_PROCS_PER_NODE: usize = 1024;

/// Longest `--grace-period`, in seconds (one hour).
const MAX_GRACE_S: f64 = 3600.0;

fn usage_error(msg: &str) -> ! {
    eprintln!("fsdp-run: error: {msg}");
    std::process::exit(2);
}

/// The first word of PROGRAM when it looks like an option and was not placed after `--`: an
/// option fsdp-run does not know, which clap takes for the program (the program's own
/// arguments may start with `-`, so PROGRAM accepts hyphens).
fn unknown_option(args: &[OsString], command: &[OsString]) -> Option<String> {
    let first = command.first()?.to_string_lossy();
    let after_separator = (args.len().checked_sub(command.len() + 1))
        .and_then(|i| args.get(i))
        .is_some_and(|a| a == "--");
    (first.starts_with('-') && !after_separator).then(|| first.into_owned())
}

fn main() {
    watchdog_if_asked();
    let mut command = Cli::command();
    let args: Vec<OsString> = std::env::args_os().collect();
    let matches = match config_file::parse_with_config(
        &mut command,
        args.clone(),
        Section::Table(LAUNCH_TABLE),
    ) {
        Ok(m) => m,
        Err(ConfigError::CommandLine(e)) => e.format(&mut command).exit(),
        Err(e) => usage_error(&e.to_string()),
    };
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.format(&mut command).exit());
    if let Some(option) = unknown_option(&args, &cli.command) {
        let name = option
            .split('=')
            .next()
            .unwrap_or_default()
            .replace('_', "-");
        let hint = if name == "--standalone" || name.starts_with("--rdzv") {
            "; torchrun's rendezvous flags are not supported: start each node with --nnodes N \
             --node-rank R --master-addr HOST --master-port PORT"
        } else if ["-m", "--module", "--no-python", "--run-path"].contains(&name.as_str()) {
            "; fsdp-run starts any program as it is: write the command itself (e.g. `-- python \
             -m pkg.train`)"
        } else {
            ""
        };
        usage_error(&format!(
            "unrecognized option {option:?} (`fsdp-run --help` lists the options; the program \
             and its arguments go after `--`){hint}"
        ));
    }
    if cli.nproc_per_node == 0 {
        usage_error("--nproc-per-node 0: a job needs at least one process per node");
    }
    if cli.nnodes == 0 {
        usage_error("--nnodes 0: a job needs at least one node");
    }
    if cli.node_rank >= cli.nnodes {
        usage_error(&format!(
            "--node-rank {} must be less than --nnodes {} (node ranks are 0..{})",
            cli.node_rank, cli.nnodes, cli.nnodes
        ));
    }
    if cli.master_addr.trim().is_empty() {
        usage_error("--master-addr is empty");
    }
    if !(cli.grace_period.is_finite() && (0.0..=MAX_GRACE_S).contains(&cli.grace_period)) {
        usage_error(&format!(
            "--grace-period {}: expected a number of seconds from 0 to {MAX_GRACE_S}",
            cli.grace_period
        ));
    }
    if cli.nproc_per_node > MAX_PROCS_PER_NODE {
        usage_error(&format!(
            "--nproc-per-node {}: at most {MAX_PROCS_PER_NODE} processes per node (one per GPU \
             is the usual count)",
            cli.nproc_per_node
        ));
    }
    let Some(world_size) = cli.nnodes.checked_mul(cli.nproc_per_node) else {
        usage_error("--nnodes × --nproc-per-node overflows");
    };
    let grace = Duration::from_secs_f64(cli.grace_period);
    let start = Instant::now();
    let parent = std::process::id() as libc::pid_t;
    // Orphans of the job re-parent to fsdp-run, which then finds and stops them (Linux).
    #[cfg(target_os = "linux")]
    // SAFETY: plain syscall.
    unsafe {
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1);
    }
    let job_id = format!(
        "{parent}-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    // Before any thread and before the signal handlers (the watchdog must not inherit them).
    let mut watchdog = Watchdog::start(&job_id, grace);
    install_signal_handlers();
    let mut restarts: Vec<String> = Vec::new();
    let code = loop {
        match run_attempt(
            &cli,
            world_size,
            grace,
            &job_id,
            parent,
            &mut watchdog,
            start,
            &restarts,
        ) {
            Attempt::Exit(code) => break code,
            Attempt::Restart(why) => restarts.push(why),
        }
    };
    if let Some(w) = watchdog {
        w.release();
    }
    std::process::exit(code);
}
