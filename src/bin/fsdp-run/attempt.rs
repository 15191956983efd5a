//! One attempt of a job: start the local processes, copy their output, wait for them, stop
//! them all when one fails or a signal arrives, and report how the attempt ended: the summary
//! line (the job's last word), or, when restarts are left after a failure, the line announcing
//! the restart.

use std::io::{self, Read};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::watchdog::Watchdog;
use super::{
    describe, exit_code, proc_table, pump, ranks_list, signal_name, Cli, JOB_VAR, MPI_VARS,
    RECEIVED,
};

/// One local process.
struct Proc {
    rank: usize,
    child: Child,
    /// Set once reaped.
    status: Option<ExitStatus>,
    /// When it was reaped.
    ended: Option<Instant>,
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
        // One time for the pass: `waitpid`'s order is not the order of the exits.
        let now = Instant::now();
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
                self.procs[i].ended = Some(now);
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

/// Removes the shared-memory segments a job of the shm backend left in `/dev/shm` (named
/// `candle-fsdp-<pid of rank 0>-…`): a job removes them once every rank mapped them, so only a
/// job killed while its ranks were meeting leaves any.
fn remove_segments(procs: &[Proc]) {
    let Ok(entries) = std::fs::read_dir("/dev/shm") else {
        return;
    };
    let prefixes: Vec<String> = procs
        .iter()
        .map(|p| format!("candle-fsdp-{}-", p.child.id()))
        .collect();
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if prefixes.iter().any(|p| name.starts_with(p.as_str())) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// How an attempt ended.
pub(crate) enum Attempt {
    /// The job is over; exit with this code (the summary line is printed).
    Exit(i32),
    /// A rank failed and restarts are left: why (for the summary line of the job).
    Restart(String),
}

/// `; 2 restarts (rank 1 killed by signal 9 (SIGKILL) after 3.1 s; …)`, or nothing when the
/// job was not restarted.
fn restarts_note(restarts: &[String], max: usize) -> String {
    match restarts.len() {
        0 if max == 0 => String::new(),
        0 => format!("; 0 restarts (of at most {max})"),
        n => format!(
            "; {n} restart{} (of at most {max}): {}",
            if n == 1 { "" } else { "s" },
            restarts.join("; ")
        ),
    }
}

/// Runs attempt `restart` (0 the first) of the job: `start` is the job's start, `restarts`
/// the reasons of the earlier restarts.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_attempt(
    cli: &Cli,
    world_size: usize,
    grace: Duration,
    job_id: &str,
    parent: libc::pid_t,
    watchdog: &mut Option<Watchdog>,
    start: Instant,
    restarts: &[String],
) -> Attempt {
    let restart = restarts.len();
    let program = &cli.command[0];
    let args = &cli.command[1..];
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
            .env(JOB_VAR, job_id)
            .env("TORCHELASTIC_RESTART_COUNT", restart.to_string())
            .env("TORCHELASTIC_MAX_RESTARTS", cli.max_restarts.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        for v in MPI_VARS {
            cmd.env_remove(v);
        }
        // One machine: the job's own id, so that the store refuses a rank of another job
        // started on the same port (several machines keep what the user set, as torchrun's
        // --rdzv-id: every node must agree).
        if cli.nnodes == 1 && std::env::var_os("TORCHELASTIC_RUN_ID").is_none() {
            cmd.env("TORCHELASTIC_RUN_ID", job_id);
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
        if let Some(w) = watchdog.as_mut() {
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
            ended: None,
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
    // Let the output threads copy what the children wrote last (a process the child started
    // in another session may hold a pipe open: do not wait for it long).
    let deadline = Instant::now() + Duration::from_secs(2);
    for _ in 0..pumps {
        let left = deadline.saturating_duration_since(Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            break;
        }
    }
    remove_segments(&job.procs);

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
    // The ranks seen to have ended successfully in an earlier pass than the failed rank `failed`:
    // peers waiting for them in a rendezvous or collective fail only at its timeout.
    let ended_before = |failed: usize| -> String {
        let Some(failed_at) = procs
            .iter()
            .find(|p| p.rank == failed)
            .and_then(|p| p.ended)
        else {
            return String::new();
        };
        let early: Vec<String> = (procs.iter())
            .filter(|p| p.rank != failed && p.sent.is_empty())
            .filter(|p| p.status.is_some_and(|s| s.success()))
            .filter_map(|p| Some((p.rank, p.ended?)))
            .filter(|&(_, t)| t < failed_at)
            .map(|(rank, t)| format!("rank {rank} (after {:.1} s)", (t - start).as_secs_f64()))
            .collect();
        match early.is_empty() {
            true => String::new(),
            false => format!(
                "; {} had exited successfully before it: peers may wait for such a rank until \
                 their timeout",
                early.join(", ")
            ),
        }
    };
    let left_in_groups = || -> String {
        how_left().map_or(String::new(), |(count, how)| {
            format!("; {count} left in the ranks' process groups or started by them: stopped with {how}")
        })
    };
    let code = match ending {
        None => {
            eprintln!(
                "fsdp-run: all {} finished successfully in {elapsed:.1} s{}{}",
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
                )),
                restarts_note(restarts, cli.max_restarts)
            );
            0
        }
        Some(Ending::StartFailed { code }) => code,
        Some(Ending::Failed {
            rank,
            status,
            after,
        }) if restart < cli.max_restarts => {
            let others = stopped(procs, Some(rank));
            eprintln!(
                "fsdp-run: rank {rank} failed first: {} after {after:.1} s{}{}{}; restarting \
                 all {} (restart {} of at most {})",
                describe(status),
                ended_before(rank),
                if others.is_empty() {
                    String::new()
                } else {
                    format!("; stopped the others: {others}")
                },
                left_in_groups(),
                if procs.len() == 1 {
                    "1 process".to_string()
                } else {
                    format!("{} processes", procs.len())
                },
                restart + 1,
                cli.max_restarts
            );
            return Attempt::Restart(format!(
                "rank {rank} {} after {after:.1} s",
                describe(status)
            ));
        }
        Some(Ending::Failed {
            rank,
            status,
            after,
        }) => {
            let others = stopped(procs, Some(rank));
            eprintln!(
                "fsdp-run: rank {rank} failed first: {} after {after:.1} s{}{}{}{}",
                describe(status),
                ended_before(rank),
                if others.is_empty() {
                    String::new()
                } else {
                    format!("; stopped the others: {others}")
                },
                left_in_groups(),
                restarts_note(restarts, cli.max_restarts)
            );
            exit_code(status)
        }
        Some(Ending::Signal { sig, after }) => {
            let ranks = stopped(procs, None);
            eprintln!(
                "fsdp-run: received {} after {after:.1} s and forwarded it; {}{}{}",
                signal_name(sig),
                if ranks.is_empty() {
                    "every process had already exited successfully".to_string()
                } else {
                    ranks
                },
                left_in_groups(),
                restarts_note(restarts, cli.max_restarts)
            );
            128 + sig
        }
    };
    Attempt::Exit(code)
}
