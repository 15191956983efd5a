//! The watchdog: a process forked before the ranks start that stops what is left of the job
//! when fsdp-run dies without saying so (decision 46).

use super::*;

/// A process forked by fsdp-run before it starts the ranks, that outlives it: when fsdp-run
/// ends without saying so (killed with SIGKILL, or crashed), the watchdog stops what is left of
/// the job: SIGTERM to every rank's process group and to every process carrying the job's
/// [`JOB_VAR`], SIGKILL after the grace period. It learns the groups, and that fsdp-run ended
/// cleanly, through a pipe whose end of EOF is fsdp-run's death; it runs in its own process
/// group and ignores the terminal's signals (SIGINT, SIGHUP, SIGQUIT), which fsdp-run handles.
pub(crate) struct Watchdog {
    pub(crate) pid: i32,
    pipe: std::fs::File,
}

impl Watchdog {
    /// Forks the watchdog. Must run before any thread is started. `None` when the pipe or the
    /// fork fails (the job then runs without one).
    pub(crate) fn start(job: &str, grace: Duration) -> Option<Watchdog> {
        #[cfg(target_os = "linux")]
        return Self::start_linux(job, grace);
        #[cfg(not(target_os = "linux"))]
        {
            let _ = (job, grace);
            None
        }
    }

    /// [`Watchdog::start`] on Linux (`pipe2`, `/proc/self/exe`).
    #[cfg(target_os = "linux")]
    fn start_linux(job: &str, grace: Duration) -> Option<Watchdog> {
        use std::os::fd::FromRawFd;
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: plain syscall filling `fds`; close-on-exec keeps the write end out of the
        // ranks (else the watchdog would never see EOF while one lives).
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return None;
        }
        let launcher = std::process::id() as i32;
        // The watchdog re-executes this program under a name of its own (so that `pkill -f
        // fsdp-run` or `kill -9 $(pgrep fsdp-run)` leave it alone), its task in a variable.
        // Everything exec needs is made before the fork.
        let spec = format!(
            "{WATCHDOG_VAR}={}:{launcher}:{}:{job}",
            fds[0],
            grace.as_secs_f64()
        );
        let c = |s: &[u8]| std::ffi::CString::new(s).ok();
        use std::os::unix::ffi::OsStrExt;
        let mut env: Vec<std::ffi::CString> = std::env::vars_os()
            .filter(|(k, _)| k != WATCHDOG_VAR)
            .filter_map(|(k, v)| c(&[k.as_bytes(), b"=", v.as_bytes()].concat()))
            .collect();
        env.extend(c(spec.as_bytes()));
        let exe = c(b"/proc/self/exe");
        let name = c(WATCHDOG_NAME.as_bytes());
        // SAFETY: fsdp-run has one thread here (no thread is started before), so the child may
        // run ordinary code.
        match unsafe { libc::fork() } {
            -1 => {
                // SAFETY: closing the fds just made.
                unsafe {
                    libc::close(fds[0]);
                    libc::close(fds[1]);
                }
                None
            }
            0 => {
                // SAFETY: the child closes the write end and detaches from the terminal's
                // signals; stdin and stdout are replaced by /dev/null (a reader of fsdp-run's
                // stdout gets EOF when fsdp-run ends); `from_raw_fd` takes the read end once.
                let code = unsafe {
                    libc::close(fds[1]);
                    libc::setpgid(0, 0);
                    for sig in [libc::SIGINT, libc::SIGHUP, libc::SIGQUIT] {
                        libc::signal(sig, libc::SIG_IGN);
                    }
                    let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
                    if null >= 0 {
                        libc::dup2(null, 0);
                        libc::dup2(null, 1);
                        libc::close(null);
                    }
                    if let (Some(exe), Some(name)) = (&exe, &name) {
                        // The read end crosses the exec.
                        libc::fcntl(fds[0], libc::F_SETFD, 0);
                        let argv = [name.as_ptr(), std::ptr::null()];
                        let mut envp: Vec<*const libc::c_char> =
                            env.iter().map(|e| e.as_ptr()).collect();
                        envp.push(std::ptr::null());
                        libc::execve(exe.as_ptr(), argv.as_ptr(), envp.as_ptr());
                    }
                    // No exec (no /proc?): the same work, under fsdp-run's name.
                    watchdog_main(std::fs::File::from_raw_fd(fds[0]), launcher, job, grace)
                };
                // SAFETY: ends the child without running fsdp-run's exit paths.
                unsafe { libc::_exit(code) }
            }
            pid => {
                // SAFETY: the parent closes the read end and owns the write end.
                unsafe { libc::close(fds[0]) };
                Some(Watchdog {
                    pid,
                    pipe: unsafe { std::fs::File::from_raw_fd(fds[1]) },
                })
            }
        }
    }

    /// Tells the watchdog about a rank's process group.
    pub(crate) fn watch(&mut self, pgid: u32) {
        let _ = writeln!(self.pipe, "pgid {pgid}");
    }

    /// Tells the watchdog that fsdp-run stopped the job itself: it exits without doing anything.
    pub(crate) fn release(mut self) {
        let _ = self.pipe.write_all(b"done\n");
    }
}

/// The variable that makes this program the watchdog (see [`Watchdog::start`]):
/// `<read fd>:<fsdp-run's pid>:<grace period in s>:<job id>`.
const WATCHDOG_VAR: &str = "FSDP_RUN_WATCHDOG";

/// The watchdog's command line and process name.
const WATCHDOG_NAME: &str = "fsdp-watchdog";

/// Runs the watchdog when this process is one (re-executed by [`Watchdog::start`]): never
/// returns then.
pub(crate) fn watchdog_if_asked() {
    use std::os::fd::FromRawFd;
    let Some(spec) = std::env::var_os(WATCHDOG_VAR) else {
        return;
    };
    let spec = spec.to_string_lossy().into_owned();
    let mut f = spec.splitn(4, ':');
    let (Some(fd), Some(launcher), Some(grace), Some(job)) = (
        f.next().and_then(|v| v.parse::<i32>().ok()),
        f.next().and_then(|v| v.parse::<i32>().ok()),
        f.next().and_then(|v| v.parse::<f64>().ok()),
        f.next(),
    ) else {
        eprintln!("fsdp-run: error: {WATCHDOG_VAR}={spec:?} is not a watchdog's task");
        std::process::exit(2);
    };
    #[cfg(target_os = "linux")]
    // SAFETY: plain syscall with a NUL-terminated name.
    unsafe {
        libc::prctl(libc::PR_SET_NAME, c"fsdp-watchdog".as_ptr());
    }
    // SAFETY: the fd is the pipe's read end, passed by the launcher to this process only.
    let pipe = unsafe { std::fs::File::from_raw_fd(fd) };
    let code = watchdog_main(pipe, launcher, job, Duration::from_secs_f64(grace));
    std::process::exit(code);
}

/// The watchdog's life (see [`Watchdog`]); returns its exit code.
fn watchdog_main(pipe: std::fs::File, launcher: i32, job: &str, grace: Duration) -> i32 {
    let mut pgids: Vec<i32> = Vec::new();
    for line in BufReader::new(pipe).lines() {
        let Ok(line) = line else { break };
        if line == "done" {
            return 0;
        }
        if let Some(g) = line.strip_prefix("pgid ").and_then(|g| g.parse().ok()) {
            pgids.push(g);
        }
    }
    // fsdp-run ended without stopping the job.
    let me = std::process::id() as i32;
    let entry = format!("{JOB_VAR}={job}");
    let left = || -> Vec<proc_table::Info> {
        proc_table::all()
            .into_iter()
            .filter(|p| {
                p.pid != me
                    && (pgids.contains(&p.pgid) || proc_table::has_env(p.pid, entry.as_bytes()))
            })
            .collect()
    };
    let wait_until_gone = |until: Instant| loop {
        let l = left();
        if l.is_empty() || Instant::now() >= until {
            return l;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let procs = left();
    if procs.is_empty() {
        return 0;
    }
    eprintln!(
        "fsdp-run: watchdog: fsdp-run (pid {launcher}) ended without stopping its job; sending \
         SIGTERM to its {} remaining process{}, SIGKILL after {} s",
        procs.len(),
        if procs.len() == 1 { "" } else { "es" },
        grace.as_secs_f64()
    );
    proc_table::signal(&procs, |g| pgids.contains(&g), libc::SIGTERM);
    let procs = wait_until_gone(Instant::now() + grace);
    if procs.is_empty() {
        return 0;
    }
    proc_table::signal(&procs, |g| pgids.contains(&g), libc::SIGKILL);
    let procs = wait_until_gone(Instant::now() + Duration::from_secs(5));
    if !procs.is_empty() {
        eprintln!(
            "fsdp-run: watchdog: {} processes of the job survived SIGKILL (uninterruptible?): {:?}",
            procs.len(),
            procs.iter().map(|p| p.pid).collect::<Vec<_>>()
        );
        return 1;
    }
    0
}
