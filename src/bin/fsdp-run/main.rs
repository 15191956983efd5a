//! `fsdp-run`: start the processes of a torchrun-style job on this machine (cargo feature
//! `cli`), with torchrun's flags and variables.
//!
//! ```text
//! fsdp-run --nproc-per-node 4 -- target/release/examples/gpt --device cuda
//! fsdp-run --nnodes 2 --node-rank 1 --nproc-per-node 8 --master-addr node0 -- ./train
//! ```
//!
//! For local process `l` of `N` (`--nproc-per-node`) on node `K` (`--node-rank`) of `M`
//! (`--nnodes`) it sets `RANK` = `K·N + l`, `WORLD_SIZE` = `M·N`, `LOCAL_RANK` = `l`,
//! `LOCAL_WORLD_SIZE` = `N`, `GROUP_RANK` = `K`, `MASTER_ADDR`, `MASTER_PORT` (defaults
//! `127.0.0.1`, `29500`), and removes the variables `mpirun` sets (`OMPI_COMM_WORLD_*`,
//! `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALNRANKS`) so that the children are not taken for MPI ranks.
//! Rank 0 serves the job's rendezvous store at `MASTER_ADDR:MASTER_PORT`
//! (`candle_fsdp::comm::store`); `fsdp-run` itself opens no port. On several machines, run
//! one `fsdp-run` per machine with the same `--nnodes`, `--nproc-per-node`, `--master-addr`
//! (node rank 0's address) and `--master-port`, and its own `--node-rank`.
//!
//! - Output: every line a child writes is copied to the same stream of `fsdp-run` (stdout or
//!   stderr), prefixed `[rank R] `; lines of different ranks never mix within a line (a line
//!   longer than 64 KiB is cut into several prefixed lines). Children read no input (stdin
//!   is `/dev/null`).
//! - Failure: when a child exits with a nonzero code or is killed by a signal, `fsdp-run` sends
//!   SIGTERM to the others, SIGKILL to those still running after `--grace-period` seconds
//!   (default 5), and exits with the first failed child's code (a signal `n` gives `128 + n`).
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
//!   first and how, or which signal stopped the job, and which ranks were stopped.
//!
//! Exit status: 0 when every child succeeded; the first failed child's status (above); 2 on a
//! usage error (bad flags, `--node-rank >= --nnodes`, `--nproc-per-node 0`); 127 (126) when
//! the program is not found (not executable), 1 when it cannot be started for another reason:
//! the message names the program and the OS error.

use std::ffi::OsString;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::Parser;

/// Start the processes of a torchrun-style job: sets RANK, WORLD_SIZE, LOCAL_RANK,
/// LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT for each, prefixes their output
/// with their rank, and stops them all when one fails.
#[derive(Debug, Parser)]
#[command(
    name = "fsdp-run",
    version,
    override_usage = "fsdp-run [OPTIONS] -- PROGRAM [ARGS]...",
    after_help = "Example: fsdp-run --nproc-per-node 4 -- target/release/examples/gpt --device cuda\n\
                  Exit status: 0 when every process succeeded; else the first failed process's \
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

mod proc_table;
mod watchdog;

use watchdog::{watchdog_if_asked, Watchdog};

/// One local process.
struct Proc {
    rank: usize,
    child: Child,
    /// Set once reaped.
    status: Option<ExitStatus>,
    /// The signals `fsdp-run` sent it (to report how it was stopped).
    sent: Vec<i32>,
}

/// The job's processes: the ranks (each the leader of its own process group) and everything
/// they started. fsdp-run is a child subreaper (Linux), so a process whose parent exits is
/// re-parented to it: while fsdp-run lives, every process of the job is one of its descendants,
/// found in `/proc` whatever process group or session it moved to.
struct Job {
    procs: Vec<Proc>,
    me: i32,
    watchdog: Option<i32>,
}

impl Job {
    /// The live processes of the job other than the ranks' own (unreaped) processes.
    fn others(&self) -> Vec<proc_table::Info> {
        proc_table::descendants(self.me, self.watchdog)
            .into_iter()
            .filter(|p| {
                !self
                    .procs
                    .iter()
                    .any(|r| r.status.is_none() && r.child.id() as i32 == p.pid)
            })
            .collect()
    }

    /// Sends `sig` to every process group of the job, whether or not its leader (the rank's
    /// process) has exited, and to the job's processes outside them; `others` are
    /// [`Job::others`], read by the caller.
    fn signal_all(&mut self, sig: i32, others: &[proc_table::Info]) {
        for p in &mut self.procs {
            if p.status.is_none() {
                // SAFETY: plain syscall; the group id is the unreaped child's pid.
                unsafe {
                    libc::kill(-(p.child.id() as libc::pid_t), sig);
                }
                p.sent.push(sig);
            }
        }
        let outside: Vec<proc_table::Info> = others
            .iter()
            .copied()
            .filter(|o| {
                // Not in a group signalled above.
                !self
                    .procs
                    .iter()
                    .any(|r| r.status.is_none() && r.child.id() as i32 == o.pgid)
            })
            .collect();
        let ranks: Vec<i32> = self.procs.iter().map(|r| r.child.id() as i32).collect();
        proc_table::signal(&outside, |g| ranks.contains(&g), sig);
    }

    /// Reaps every child that exited (the ranks, and orphans re-parented to fsdp-run); returns
    /// the ranks' indices and statuses, in the order they were reaped.
    fn reap(&mut self) -> Vec<(usize, ExitStatus)> {
        let mut reaped = Vec::new();
        loop {
            let mut status: libc::c_int = 0;
            // SAFETY: plain syscall writing `status`.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if pid <= 0 {
                break;
            }
            if let Some(i) = self
                .procs
                .iter()
                .position(|p| p.status.is_none() && p.child.id() as i32 == pid)
            {
                let s = ExitStatus::from_raw(status);
                self.procs[i].status = Some(s);
                reaped.push((i, s));
            } else if Some(pid) == self.watchdog {
                self.watchdog = None;
            }
        }
        reaped
    }
}

/// Why the job is ending.
enum Ending {
    /// A child failed while the job was running.
    Failed {
        rank: usize,
        status: ExitStatus,
        /// Seconds since the start.
        after: f64,
    },
    /// `fsdp-run` received a signal, `after` seconds since the start.
    Signal { sig: i32, after: f64 },
    /// A rank's program could not be started (the message is printed): exit with `code`.
    StartFailed { code: i32 },
}

/// Most processes `fsdp-run` starts on one node (a typo such as `--nproc-per-node 100000`
/// would otherwise exhaust the machine's processes and threads).
const MAX_PROCS_PER_NODE: usize = 1024;

/// Longest `--grace-period`, in seconds (one hour).
const MAX_GRACE_S: f64 = 3600.0;

fn usage_error(msg: &str) -> ! {
    eprintln!("fsdp-run: error: {msg}");
    std::process::exit(2);
}

fn main() {
    watchdog_if_asked();
    let cli = Cli::parse();
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
    let program = &cli.command[0];
    let args = &cli.command[1..];

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
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let mut job = Job {
        procs: Vec::with_capacity(cli.nproc_per_node),
        me: parent,
        watchdog: watchdog.as_ref().map(|w| w.pid),
    };
    let mut ending: Option<Ending> = None;
    for local in 0..cli.nproc_per_node {
        let rank = cli.node_rank * cli.nproc_per_node + local;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", cli.nproc_per_node.to_string())
            .env("GROUP_RANK", cli.node_rank.to_string())
            .env("MASTER_ADDR", &cli.master_addr)
            .env("MASTER_PORT", cli.master_port.to_string())
            .env(JOB_VAR, &job_id)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        for v in MPI_VARS {
            cmd.env_remove(v);
        }
        // SAFETY: the closure runs in the forked child before exec and calls only
        // async-signal-safe functions (prctl, getppid, _exit).
        #[cfg(target_os = "linux")]
        unsafe {
            cmd.pre_exec(move || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                let code = match e.kind() {
                    io::ErrorKind::NotFound => 127,
                    io::ErrorKind::PermissionDenied => 126,
                    _ => 1,
                };
                eprintln!(
                    "fsdp-run: error: cannot start {:?} (rank {rank}): {e}",
                    program.to_string_lossy()
                );
                // Stop the ranks already started (below, as any ending).
                ending = Some(Ending::StartFailed { code });
                break;
            }
        };
        if let Some(w) = &mut watchdog {
            w.watch(child.id());
        }
        for (src, to_stderr) in [
            (
                child
                    .stdout
                    .take()
                    .map(|s| Box::new(s) as Box<dyn Read + Send>),
                false,
            ),
            (
                child
                    .stderr
                    .take()
                    .map(|s| Box::new(s) as Box<dyn Read + Send>),
                true,
            ),
        ] {
            if let Some(src) = src {
                let tx = done_tx.clone();
                std::thread::spawn(move || {
                    pump(src, rank, to_stderr);
                    let _ = tx.send(());
                });
            }
        }
        job.procs.push(Proc {
            rank,
            child,
            status: None,
            sent: Vec::new(),
        });
    }
    drop(done_tx);
    let pumps = job.procs.len() * 2;

    let mut kill_at: Option<Instant> = None;
    if matches!(ending, Some(Ending::StartFailed { .. })) {
        let others = job.others();
        job.signal_all(libc::SIGTERM, &others);
        kill_at = Some(Instant::now() + grace);
    }
    let mut killed_hard = false;
    let mut killed_on_second_signal = false;
    // Once every rank's process has exited: when, the processes they left running (each
    // counted once), and how many of those needed SIGKILL.
    let mut all_exited_at: Option<Instant> = None;
    let mut leftovers: std::collections::BTreeSet<i32> = std::collections::BTreeSet::new();
    let mut leftovers_killed = 0usize;
    let mut last_scan = Instant::now();
    loop {
        let sig = RECEIVED.swap(0, Ordering::SeqCst);
        if sig != 0 {
            let others = job.others();
            if matches!(ending, Some(Ending::Signal { .. })) {
                // A second signal: no more waiting.
                leftovers_killed += others.iter().filter(|o| leftovers.contains(&o.pid)).count();
                job.signal_all(libc::SIGKILL, &others);
                killed_hard = true;
                killed_on_second_signal = true;
            } else {
                if ending.is_none() {
                    ending = Some(Ending::Signal {
                        sig,
                        after: start.elapsed().as_secs_f64(),
                    });
                }
                job.signal_all(sig, &others);
                kill_at.get_or_insert(Instant::now() + grace);
            }
        }
        for (i, status) in job.reap() {
            if !status.success() && ending.is_none() {
                ending = Some(Ending::Failed {
                    rank: job.procs[i].rank,
                    status,
                    after: start.elapsed().as_secs_f64(),
                });
                let others = job.others();
                job.signal_all(libc::SIGTERM, &others);
                kill_at = Some(Instant::now() + grace);
            }
        }
        if job.procs.iter().all(|p| p.status.is_some()) {
            // The ranks are done; whatever they left running is stopped before fsdp-run
            // exits: SIGTERM, SIGKILL after the grace period. What a signal just sent is
            // stopping gets a moment to go first.
            let now = Instant::now();
            let since = *all_exited_at.get_or_insert(now);
            if now.duration_since(last_scan) >= Duration::from_millis(50) || since == now {
                last_scan = now;
                let others = job.others();
                if others.is_empty() {
                    break;
                }
                if now.duration_since(since) >= Duration::from_millis(200) {
                    let new: Vec<proc_table::Info> = others
                        .iter()
                        .copied()
                        .filter(|o| !leftovers.contains(&o.pid))
                        .collect();
                    if !new.is_empty() && !killed_hard {
                        leftovers.extend(new.iter().map(|o| o.pid));
                        job.signal_all(libc::SIGTERM, &new);
                        kill_at.get_or_insert(now + grace);
                    }
                }
                if killed_hard && kill_at.is_some_and(|at| now >= at + Duration::from_secs(5)) {
                    eprintln!(
                        "fsdp-run: error: {} processes of the job survived SIGKILL (uninterruptible?): {:?}",
                        others.len(),
                        others.iter().map(|o| o.pid).collect::<Vec<_>>()
                    );
                    break;
                }
            }
        }
        if let Some(at) = kill_at {
            if Instant::now() >= at && !killed_hard {
                let others = job.others();
                leftovers_killed += others.iter().filter(|o| leftovers.contains(&o.pid)).count();
                job.signal_all(libc::SIGKILL, &others);
                killed_hard = true;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    if let Some(w) = watchdog {
        w.release();
    }
    // Let the output threads copy what the children wrote last (a process the child started
    // in another session may hold a pipe open: do not wait for it long).
    let deadline = Instant::now() + Duration::from_secs(2);
    for _ in 0..pumps {
        let left = deadline.saturating_duration_since(Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            break;
        }
    }

    let procs = &job.procs;
    let elapsed = start.elapsed().as_secs_f64();
    let stopped = |procs: &[Proc], except: Option<usize>| -> String {
        let mut parts = Vec::new();
        for p in procs.iter().filter(|p| Some(p.rank) != except) {
            let status = p.status.expect("every child was reaped");
            if p.sent.is_empty() {
                if !status.success() {
                    parts.push(format!("rank {} {}", p.rank, describe(status)));
                }
                continue;
            }
            let how = if p.sent.contains(&libc::SIGKILL)
                && status.signal() == Some(libc::SIGKILL)
                && killed_on_second_signal
            {
                "killed with SIGKILL on a second signal".to_string()
            } else if p.sent.contains(&libc::SIGKILL) && status.signal() == Some(libc::SIGKILL) {
                format!(
                    "killed with SIGKILL after the grace period of {} s",
                    grace.as_secs_f64()
                )
            } else {
                describe(status)
            };
            parts.push(format!("rank {} {how}", p.rank));
        }
        parts.join(", ")
    };
    // The processes the ranks left running ("3 processes") and how they were stopped
    // ("SIGTERM, 1 with SIGKILL after the grace period of 1 s"); None when there were none.
    let how_left = || -> Option<(String, String)> {
        if leftovers.is_empty() {
            return None;
        }
        let n = leftovers.len();
        let count = format!("{n} {}", if n == 1 { "process" } else { "processes" });
        let how = if leftovers_killed == 0 {
            "SIGTERM".to_string()
        } else if killed_on_second_signal {
            format!("SIGTERM, {leftovers_killed} with SIGKILL on a second signal")
        } else {
            format!(
                "SIGTERM, {leftovers_killed} with SIGKILL after the grace period of {} s",
                grace.as_secs_f64()
            )
        };
        Some((count, how))
    };
    let left_in_groups = || -> String {
        how_left().map_or(String::new(), |(count, how)| {
            format!("; {count} left in the ranks' process groups or started by them: stopped with {how}")
        })
    };
    let code = match ending {
        None => {
            eprintln!(
                "fsdp-run: all {} finished successfully in {elapsed:.1} s{}",
                if procs.len() == 1 {
                    format!("1 process (rank {})", procs[0].rank)
                } else {
                    format!(
                        "{} processes ({})",
                        procs.len(),
                        ranks_list(&procs.iter().map(|p| p.rank).collect::<Vec<_>>())
                    )
                },
                how_left().map_or(String::new(), |(count, how)| format!(
                    "; stopped {count} they left running (with {how})"
                ))
            );
            0
        }
        Some(Ending::StartFailed { code }) => code,
        Some(Ending::Failed {
            rank,
            status,
            after,
        }) => {
            let others = stopped(procs, Some(rank));
            eprintln!(
                "fsdp-run: rank {rank} failed first: {} after {after:.1} s{}{}",
                describe(status),
                if others.is_empty() {
                    String::new()
                } else {
                    format!("; stopped the others: {others}")
                },
                left_in_groups()
            );
            exit_code(status)
        }
        Some(Ending::Signal { sig, after }) => {
            let ranks = stopped(procs, None);
            eprintln!(
                "fsdp-run: received {} after {after:.1} s and forwarded it; {}{}",
                signal_name(sig),
                if ranks.is_empty() {
                    "every process had already exited successfully".to_string()
                } else {
                    ranks
                },
                left_in_groups()
            );
            128 + sig
        }
    };
    std::process::exit(code);
}
