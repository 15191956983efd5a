//! The `fsdp-run` launcher, run as a user runs it (feature `cli`), with small `sh -c` scripts
//! as children: the variables each child sees, the `[rank R] ` prefixes on both streams (whole
//! lines, long lines cut), a failing child stopping its siblings quickly with its exit code
//! propagated, signal deaths, SIGKILL after the grace period, SIGINT/SIGTERM forwarded, bad
//! flags, a program that cannot start, and a whole job bootstrapping through the TCP store
//! (this test binary re-executed as the ranks).

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_fsdp-run");

/// Runs `fsdp-run args…`; returns (exit code, stdout, stderr, seconds). Panics after 60 s.
fn run(args: &[&str]) -> (i32, String, String, f64) {
    run_env(args, &[])
}

fn run_env(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String, f64) {
    let start = Instant::now();
    let mut cmd = Command::new(BIN);
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.spawn().expect("starts fsdp-run");
    let (code, out, err) = finish(child, Duration::from_secs(60));
    (code, out, err, start.elapsed().as_secs_f64())
}

/// Waits for `child` (killing it after `limit`), reading both pipes.
pub(crate) fn finish(mut child: Child, limit: Duration) -> (i32, String, String) {
    let read = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = Vec::new();
            let _ = r.read_to_end(&mut s);
            String::from_utf8_lossy(&s).into_owned()
        })
    };
    let out = child.stdout.take().map(|s| read(Box::new(s)));
    let err = child.stderr.take().map(|s| read(Box::new(s)));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("fsdp-run still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    (
        status.code().expect("fsdp-run exits, it is not killed"),
        out.map(|h| h.join().unwrap()).unwrap_or_default(),
        err.map(|h| h.join().unwrap()).unwrap_or_default(),
    )
}

pub(crate) fn last_line(s: &str) -> &str {
    s.lines().last().unwrap_or("")
}

/// Processes whose command line contains `pattern` (left behind by a test).
fn processes_matching(pattern: &str) -> String {
    Command::new("pgrep")
        .args(["-f", pattern])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

const PRINT_ENV: &str = "echo \"R=$RANK W=$WORLD_SIZE L=$LOCAL_RANK LW=$LOCAL_WORLD_SIZE \
                         G=$GROUP_RANK A=$MASTER_ADDR P=$MASTER_PORT \
                         MPI=${OMPI_COMM_WORLD_RANK-unset}${PMI_RANK-unset}\"";

#[test]
fn each_child_sees_its_torchrun_variables() {
    let (code, out, err, _) = run_env(
        &[
            "--nproc-per-node",
            "2",
            "--nnodes",
            "3",
            "--node-rank",
            "1",
            "--master-addr",
            "10.1.2.3",
            "--master-port",
            "1234",
            "--",
            "sh",
            "-c",
            PRINT_ENV,
        ],
        // mpirun's variables, which would make the children MPI ranks, are removed.
        &[("OMPI_COMM_WORLD_RANK", "5"), ("PMI_RANK", "5")],
    );
    assert_eq!(code, 0, "{err}");
    let lines: BTreeSet<&str> = out.lines().collect();
    assert_eq!(
        lines,
        BTreeSet::from([
            "[rank 2] R=2 W=6 L=0 LW=2 G=1 A=10.1.2.3 P=1234 MPI=unsetunset",
            "[rank 3] R=3 W=6 L=1 LW=2 G=1 A=10.1.2.3 P=1234 MPI=unsetunset",
        ]),
        "{out}"
    );
    assert!(
        last_line(&err)
            .starts_with("fsdp-run: all 2 processes (ranks 2, 3) finished successfully in "),
        "{err}"
    );

    // torchrun's defaults, and its underscore spellings.
    let (code, out, _, _) = run(&["--", "sh", "-c", PRINT_ENV]);
    assert_eq!(code, 0);
    assert_eq!(
        out,
        "[rank 0] R=0 W=1 L=0 LW=1 G=0 A=127.0.0.1 P=29500 MPI=unsetunset\n"
    );
    let (code, out, _, _) = run(&[
        "--nproc_per_node=2",
        "--node_rank=0",
        "--master_port=4000",
        "sh",
        "-c",
        "echo $RANK:$MASTER_PORT",
    ]);
    assert_eq!(code, 0);
    let lines: BTreeSet<&str> = out.lines().collect();
    assert_eq!(
        lines,
        BTreeSet::from(["[rank 0] 0:4000", "[rank 1] 1:4000"])
    );
}

#[test]
fn arguments_reach_the_program_unchanged() {
    let (code, out, _, _) = run(&[
        "--",
        "sh",
        "-c",
        "printf '<%s>' \"$@\"; echo",
        "sh",
        "--nproc-per-node",
        "-x",
        "two words",
        "",
    ]);
    assert_eq!(code, 0);
    assert_eq!(out, "[rank 0] <--nproc-per-node><-x><two words><>\n");
}

#[test]
fn every_line_of_both_streams_is_prefixed_whole() {
    // 3 ranks × 400 lines of 2 KB on stdout and short ones on stderr, written concurrently, and
    // a last line without a newline.
    let script = "pad=$(head -c 2000 /dev/zero | tr '\\0' x); i=0; \
                  while [ $i -lt 400 ]; do echo \"out $RANK $i $pad\"; echo \"err $RANK $i\" >&2; \
                  i=$((i+1)); done; printf 'tail %s' $RANK";
    let (code, out, err, _) = run(&["--nproc-per-node", "3", "--", "sh", "-c", script]);
    assert_eq!(code, 0, "{err}");
    let pad = "x".repeat(2000);
    let mut seen = BTreeSet::new();
    for line in out.lines() {
        let (prefix, rest) = line.split_at(line.find("] ").expect("prefixed") + 2);
        let rank: usize = prefix
            .strip_prefix("[rank ")
            .and_then(|p| p.strip_suffix("] "))
            .expect("[rank R] ")
            .parse()
            .unwrap();
        if let Some(t) = rest.strip_prefix("tail ") {
            assert_eq!(t, rank.to_string());
            seen.insert((rank, usize::MAX));
            continue;
        }
        let parts: Vec<&str> = rest.splitn(4, ' ').collect();
        assert_eq!(parts[0], "out", "{line:.80}");
        assert_eq!(
            parts[1],
            rank.to_string(),
            "a line of another rank: {line:.80}"
        );
        assert_eq!(parts[3], pad, "a line mixed with another: {line:.80}");
        assert!(seen.insert((rank, parts[2].parse::<usize>().unwrap())));
    }
    assert_eq!(seen.len(), 3 * 401);
    let err_lines: Vec<&str> = err.lines().collect();
    assert_eq!(err_lines.len(), 3 * 400 + 1, "{err:.400}");
    for line in &err_lines[..err_lines.len() - 1] {
        let rank = &line[6..7];
        assert!(
            line.starts_with(&format!("[rank {rank}] err {rank} ")),
            "{line}"
        );
    }
}

#[test]
fn a_line_longer_than_64_kib_is_cut_into_prefixed_lines() {
    let (code, out, _, _) = run(&[
        "--",
        "sh",
        "-c",
        "head -c 100000 /dev/zero | tr '\\0' y; echo; echo after",
    ]);
    assert_eq!(code, 0);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0], format!("[rank 0] {}", "y".repeat(65536)));
    assert_eq!(lines[1], format!("[rank 0] {}", "y".repeat(100000 - 65536)));
    assert_eq!(lines[2], "[rank 0] after");
}

#[test]
fn a_failing_child_stops_the_others_and_its_code_is_the_exit_code() {
    // Rank 1 fails after 0.3 s; ranks 0 and 2 sleep in a child of their shell (stopping the
    // shell alone would leave the sleep holding the output pipe).
    let script = "if [ $RANK = 1 ]; then sleep 0.3; echo 'rank 1 gives up' >&2; exit 3; fi; \
                  sleep 61.25; echo never";
    let (code, out, err, secs) = run(&["--nproc-per-node", "3", "--", "sh", "-c", script]);
    assert_eq!(code, 3, "{err}");
    assert!(secs < 4.0, "took {secs:.1} s");
    assert!(!out.contains("never"), "{out}");
    assert!(err.contains("[rank 1] rank 1 gives up\n"), "{err}");
    let summary = last_line(&err);
    assert!(
        summary.starts_with("fsdp-run: rank 1 failed first: exited with code 3 after 0.")
            && summary.ends_with(
                "; stopped the others: rank 0 killed by signal 15 (SIGTERM), rank 2 killed by \
                 signal 15 (SIGTERM)"
            ),
        "{summary}"
    );
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(processes_matching("sleep 61.25"), "", "processes left");
}

#[test]
fn a_rank_that_ended_successfully_before_a_failure_is_named() {
    // Rank 1 exits 0 at once; rank 0 fails 0.5 s later (as it would after waiting for rank 1
    // in a rendezvous): the summary says rank 1 had already ended (before, it was not named).
    let script = "if [ $RANK = 1 ]; then exit 0; fi; sleep 0.5; exit 4";
    let (code, _, err, _) = run(&["--nproc-per-node", "2", "--", "sh", "-c", script]);
    assert_eq!(code, 4, "{err}");
    let summary = last_line(&err);
    assert!(
        summary.starts_with("fsdp-run: rank 0 failed first: exited with code 4 after 0.")
            && summary.contains(
                "; rank 1 (after 0.0 s) had exited successfully before it: peers may wait \
                 for such a rank until their timeout"
            ),
        "{summary}"
    );
}

#[test]
fn a_child_ignoring_sigterm_is_killed_after_the_grace_period() {
    let script = "if [ $RANK = 1 ]; then sleep 0.3; exit 5; fi; trap '' TERM; sleep 62.25";
    let (code, _, err, secs) = run(&[
        "--nproc-per-node",
        "2",
        "--grace-period",
        "1",
        "--",
        "sh",
        "-c",
        script,
    ]);
    assert_eq!(code, 5, "{err}");
    assert!((1.2..5.0).contains(&secs), "took {secs:.1} s");
    assert!(
        last_line(&err).ends_with(
            "; stopped the others: rank 0 killed with SIGKILL after the grace period of 1 s"
        ),
        "{err}"
    );
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(processes_matching("sleep 62.25"), "", "processes left");
}

#[test]
fn a_child_killed_by_a_signal_gives_128_plus_the_signal() {
    let (code, _, err, _) = run(&[
        "--nproc-per-node",
        "2",
        "--",
        "sh",
        "-c",
        "[ $RANK = 0 ] && kill -9 $$; sleep 63.25",
    ]);
    assert_eq!(code, 137, "{err}");
    assert!(
        last_line(&err).starts_with("fsdp-run: rank 0 failed first: killed by signal 9 (SIGKILL)")
            && last_line(&err)
                .ends_with("stopped the others: rank 1 killed by signal 15 (SIGTERM)"),
        "{err}"
    );
    let (code, _, err, _) = run(&["--", "sh", "-c", "kill -USR1 $$"]);
    assert_eq!(code, 138, "{err}");
    assert!(
        last_line(&err).starts_with("fsdp-run: rank 0 failed first: killed by signal 10 (SIGUSR1)"),
        "{err}"
    );
}

/// Starts fsdp-run with `args`, waits for `ready` lines on its stdout, then sends it `sig`.
fn signal_after_ready(args: &[&str], ready: usize, sig: i32) -> (i32, String, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stdout).lines() {
            let line = line.unwrap();
            if line.ends_with("ready") {
                let _ = tx.send(());
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    for _ in 0..ready {
        rx.recv_timeout(Duration::from_secs(30))
            .expect("children ready");
    }
    // SAFETY: plain syscall on our own child.
    unsafe {
        libc::kill(child.id() as libc::pid_t, sig);
    }
    let (code, _, err) = finish(child, Duration::from_secs(30));
    (code, reader.join().unwrap(), err)
}

#[test]
fn sigterm_is_forwarded_to_every_child() {
    let script = "trap 'echo got TERM; exit 0' TERM; echo ready; while :; do sleep 0.1; done";
    let (code, out, err) = signal_after_ready(
        &["--nproc-per-node", "2", "--", "sh", "-c", script],
        2,
        libc::SIGTERM,
    );
    assert_eq!(code, 143, "{err}");
    assert!(
        out.contains("[rank 0] got TERM\n") && out.contains("[rank 1] got TERM\n"),
        "{out}"
    );
    let summary = last_line(&err);
    assert!(
        summary.starts_with("fsdp-run: received signal 15 (SIGTERM) after ")
            && summary.ends_with(
                "and forwarded it; rank 0 exited with code 0, rank 1 exited with code 0"
            ),
        "{summary}"
    );
}

#[test]
fn sigint_is_forwarded_once() {
    // A child counting the SIGINTs it gets: one, although fsdp-run and the child share the
    // test's process group (the child has its own).
    let script = "n=0; trap 'n=$((n+1))' INT; echo ready; sleep 1; echo \"got $n INT\"; exit 0";
    let (code, out, err) = signal_after_ready(&["--", "sh", "-c", script], 1, libc::SIGINT);
    assert_eq!(code, 130, "{err}");
    assert!(out.contains("[rank 0] got 1 INT\n"), "{out}");
    assert!(
        last_line(&err).contains("received signal 2 (SIGINT)"),
        "{err}"
    );
    // Children that do not handle it die of it.
    let (code, _, err) = signal_after_ready(
        &[
            "--nproc-per-node",
            "2",
            "--",
            "sh",
            "-c",
            "echo ready; exec sleep 64.25",
        ],
        2,
        libc::SIGINT,
    );
    assert_eq!(code, 130, "{err}");
    assert!(
        last_line(&err).ends_with(
            "forwarded it; rank 0 killed by signal 2 (SIGINT), rank 1 killed by signal 2 (SIGINT)"
        ),
        "{err}"
    );
}

#[test]
fn bad_flags_are_usage_errors() {
    for (args, expected) in [
        (
            &["--nnodes", "2", "--node-rank", "2", "--", "true"][..],
            "fsdp-run: error: --node-rank 2 must be less than --nnodes 2 (node ranks are 0..2)",
        ),
        (
            &["--nproc-per-node", "0", "--", "true"][..],
            "fsdp-run: error: --nproc-per-node 0: a job needs at least one process per node",
        ),
        (&["--nnodes", "0", "--", "true"][..], "--nnodes 0"),
        (
            &["--master-port", "0", "--", "true"][..],
            "invalid value '0' for '--master-port <PORT>': 0 is not in 1..=65535",
        ),
        (
            &["--nproc-per-node", "100000", "--", "true"][..],
            "--nproc-per-node 100000: at most 1024 processes per node",
        ),
        (
            &["--grace-period", "1e30", "--", "true"][..],
            "expected a number of seconds from 0 to 3600",
        ),
        (
            &["--master-port", "70000", "--", "true"][..],
            "invalid value '70000'",
        ),
        (
            &["--nproc-per-node", "gpu", "--", "true"][..],
            "invalid value 'gpu'",
        ),
        (
            &["--grace-period", "-1", "--", "true"][..],
            "--grace-period",
        ),
        (&[][..], "required"),
        (&["--nproc-per-node", "2"][..], "required"),
        // An option fsdp-run does not know is not taken for the program (the breaker's F1).
        (
            &["--bogus", "1", "--", "true"][..],
            "unrecognized option \"--bogus\" (`fsdp-run --help` lists the options",
        ),
        (
            &["--nproc-per-node", "2", "--max-restart", "3", "true"][..],
            "unrecognized option \"--max-restart\"",
        ),
        (
            &["--standalone", "--", "true"][..],
            "torchrun's rendezvous flags are not supported",
        ),
        (
            &["--rdzv_endpoint=h:1", "true"][..],
            "torchrun's rendezvous flags are not supported",
        ),
        (
            &["-m", "pkg.train"][..],
            "fsdp-run starts any program as it is",
        ),
    ] {
        let (code, out, err, _) = run(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(expected), "{args:?}: {err}");
        assert_eq!(out, "");
    }
}

#[test]
fn a_program_that_cannot_start_is_named_with_the_os_error() {
    let (code, out, err, _) = run(&[
        "--nproc-per-node",
        "2",
        "--",
        "/nonexistent/fsdp-run-prog",
        "x",
    ]);
    assert_eq!(code, 127);
    assert_eq!(out, "");
    assert_eq!(
        err,
        "fsdp-run: error: cannot start \"/nonexistent/fsdp-run-prog\" (rank 0): No such file or \
         directory (os error 2)\n"
    );
    let (code, _, err, _) = run(&["--", "fsdp-run-no-such-program-on-path"]);
    assert_eq!(code, 127);
    assert!(
        err.contains("cannot start \"fsdp-run-no-such-program-on-path\" (rank 0)"),
        "{err}"
    );
    // A file without the execute bit.
    let path = std::env::temp_dir().join(format!("fsdp-run-not-executable-{}", std::process::id()));
    std::fs::write(&path, "#!/bin/sh\n").unwrap();
    let (code, _, err, _) = run(&["--", path.to_str().unwrap()]);
    std::fs::remove_file(&path).unwrap();
    assert_eq!(code, 126, "{err}");
    assert!(err.contains("Permission denied"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// A whole job: the ranks bootstrap through the store at MASTER_ADDR:MASTER_PORT.
// ---------------------------------------------------------------------------------------------

#[test]
#[ignore = "a rank started by fsdp-run in ranks_started_by_fsdp_run_bootstrap_through_the_store"]
fn helper_store_rank() {
    use candle_fsdp::comm::store::TcpStore;
    use candle_fsdp::launch::{LaunchEnv, TorchrunEnv};
    let t = TorchrunEnv::from_vars(&|v| std::env::var(v).ok())
        .unwrap()
        .expect("started torchrun-style");
    assert!(matches!(
        LaunchEnv::detect().unwrap(),
        LaunchEnv::Torchrun(_)
    ));
    // On CPU, ranks started torchrun-style take the shared-memory backend.
    let launcher =
        candle_fsdp::launch::Launcher::from_env(None, 1, Duration::from_secs(5)).unwrap();
    assert_eq!(
        (
            launcher.backend(),
            launcher.world_size(),
            launcher.local_ranks()
        ),
        ("shm", t.world_size, t.rank..t.rank + 1)
    );
    let store = TcpStore::connect(
        t.master_addr.as_deref().unwrap(),
        t.master_port.unwrap(),
        t.rank,
        t.world_size,
        Duration::from_secs(30),
    )
    .unwrap();
    if t.rank == 0 {
        store.set("nccl_id", &[42u8; 128]).unwrap();
    }
    let id = store.get("nccl_id").unwrap();
    store.barrier("init").unwrap();
    println!(
        "rank {} of {} (local {} of {}): id of {} bytes, sum {}",
        t.rank,
        t.world_size,
        t.local_rank,
        t.local_world_size,
        id.len(),
        id.iter().map(|&b| b as u32).sum::<u32>()
    );
}

#[test]
fn ranks_started_by_fsdp_run_bootstrap_through_the_store() {
    let port = crate::common::free_port().to_string();
    let exe = std::env::current_exe().unwrap();
    let (code, out, err, _) = run(&[
        "--nproc-per-node",
        "3",
        "--master-port",
        &port,
        "--",
        exe.to_str().unwrap(),
        "--ignored",
        "--exact",
        crate::common::test_path(module_path!(), "helper_store_rank").as_str(),
        "--nocapture",
        "--test-threads=1",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    for r in 0..3 {
        // libtest's own "test helper_store_rank ... " may precede the helper's text.
        let line = out
            .lines()
            .find(|l| l.contains(&format!("rank {r} of 3")))
            .unwrap_or_else(|| panic!("no line of rank {r}:\n{out}"));
        assert!(
            line.starts_with(&format!("[rank {r}] "))
                && line.ends_with(&format!(
                    "rank {r} of 3 (local {r} of 3): id of 128 bytes, sum 5376"
                )),
            "{line}"
        );
    }
}

// ---- Nothing of the job outlives fsdp-run (issue 20, item 3) -------------------------------

/// Pids of the processes whose whole command line is `sleep <secs>` (a duration unique to one
/// test identifies its processes).
fn sleeps(secs: &str) -> Vec<String> {
    let pattern = format!("^sleep {}$", secs.replace('.', "\\."));
    let out = Command::new("pgrep")
        .args(["-f", &pattern])
        .output()
        .expect("pgrep runs");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// Polls until no `sleep <secs>` is left, up to `limit`; returns what is left then.
fn sleeps_left_after(secs: &str, limit: Duration) -> Vec<String> {
    let deadline = Instant::now() + limit;
    loop {
        let left = sleeps(secs);
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Starts fsdp-run with `args` and waits until `n` sleeps of `secs` run (the ranks' children).
fn start_with_sleeps(args: &[&str], secs: &str, n: usize) -> Child {
    let child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starts fsdp-run");
    let deadline = Instant::now() + Duration::from_secs(30);
    while sleeps(secs).len() < n {
        assert!(Instant::now() < deadline, "the ranks' sleeps never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

#[test]
fn fsdp_run_killed_with_sigkill_leaves_no_process_of_the_job() {
    // The case: each rank's shell waits for a sleep it started (PR_SET_PDEATHSIG
    // reaches only the shell). Rank 2's sleep also ignores SIGTERM: it needs the SIGKILL after
    // the grace period.
    let script = "if [ $RANK = 2 ]; then (trap '' TERM; exec sleep 59.371) & wait $!; \
                  else sleep 59.371 & wait $!; fi";
    let mut child = start_with_sleeps(
        &[
            "--nproc-per-node",
            "3",
            "--grace-period",
            "1",
            "--",
            "sh",
            "-c",
            script,
        ],
        "59.371",
        3,
    );
    // SAFETY: plain syscall on our own child.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGKILL);
    }
    let _ = child.wait();
    let left = sleeps_left_after("59.371", Duration::from_secs(6));
    if !left.is_empty() {
        let _ = Command::new("kill").arg("-9").args(&left).status();
    }
    assert!(
        left.is_empty(),
        "processes of the job left running: {left:?}"
    );
}

#[test]
fn after_ctrl_c_every_process_group_is_stopped_even_when_its_leader_exited() {
    // SIGINT reaches each rank's process group; the shells die of it, their sleeps (background
    // jobs of a non-interactive shell ignore SIGINT) stay in the groups. Rank 1's sleep ignores
    // SIGTERM too.
    let script = "if [ $RANK = 1 ]; then (trap '' TERM; exec sleep 59.372) & wait $!; \
                  else sleep 59.372 & wait $!; fi";
    let started = Instant::now();
    let child = start_with_sleeps(
        &[
            "--nproc-per-node",
            "2",
            "--grace-period",
            "1",
            "--",
            "sh",
            "-c",
            script,
        ],
        "59.372",
        2,
    );
    // SAFETY: plain syscall on our own child.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGINT);
    }
    let (code, _, err) = finish(child, Duration::from_secs(30));
    let secs = started.elapsed().as_secs_f64();
    // fsdp-run ends only when nothing of the job is left.
    let left = sleeps("59.372");
    if !left.is_empty() {
        let _ = Command::new("kill").arg("-9").args(&left).status();
    }
    assert!(
        left.is_empty(),
        "processes of the job left running: {left:?}\n{err}"
    );
    assert_eq!(code, 130, "an interrupted job is not a success: {err}");
    assert!(secs < 10.0, "took {secs:.1} s");
    let summary = last_line(&err);
    assert!(
        summary.starts_with("fsdp-run: received signal 2 (SIGINT) after ")
            && summary.contains("rank 0 killed by signal 2 (SIGINT)")
            && summary.contains("rank 1 killed by signal 2 (SIGINT)")
            && summary.contains("2 processes left in the ranks' process groups")
            && summary.contains("SIGKILL after the grace period of 1 s"),
        "{summary}"
    );
}

#[test]
fn processes_left_by_ranks_that_succeeded_are_stopped_at_the_end() {
    // The ranks exit 0 at once, leaving a sleep each (one in a session of its own, out of the
    // rank's process group): fsdp-run stops them before it exits, and still reports success.
    let script = "if [ $RANK = 1 ]; then setsid sleep 59.373 & else sleep 59.373 & fi; \
                  sleep 0.3; exit 0";
    let (code, _, err, secs) = run(&[
        "--nproc-per-node",
        "2",
        "--grace-period",
        "1",
        "--",
        "sh",
        "-c",
        script,
    ]);
    let left = sleeps("59.373");
    if !left.is_empty() {
        let _ = Command::new("kill").arg("-9").args(&left).status();
    }
    assert!(
        left.is_empty(),
        "processes of the job left running: {left:?}\n{err}"
    );
    assert_eq!(code, 0, "{err}");
    assert!(secs < 8.0, "took {secs:.1} s");
    let summary = last_line(&err);
    assert!(
        summary.starts_with("fsdp-run: all 2 processes (ranks 0, 1) finished successfully")
            && summary.contains("stopped 2 processes they left running"),
        "{summary}"
    );
}

// ---- Elastic restarts (issue 24, item 2) ---------------------------------------------------

#[test]
fn max_restarts_starts_every_process_again_with_the_restart_count() {
    // Rank 1 fails in attempts 0 and 1 and succeeds in attempt 2. It fails only once rank 0
    // has printed its line of the attempt (a marker file): otherwise, on a loaded machine, the
    // restart may stop rank 0 before its shell has started, and its line is rightly never
    // printed (fsdp-run loses no line a rank wrote; it cannot print one never written).
    let dir = std::env::temp_dir().join(format!("fsdp-run-restarts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = format!(
        "c=$TORCHELASTIC_RESTART_COUNT; echo \"attempt $c of $TORCHELASTIC_MAX_RESTARTS\"; \
         if [ $RANK = 0 ]; then touch {d}/printed-$c; fi; \
         if [ $RANK = 1 ] && [ $c -lt 2 ]; then i=0; \
           while [ ! -e {d}/printed-$c ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done; \
           exit 3; fi; sleep 0.3",
        d = dir.display()
    );
    let (code, out, err, _) = run(&[
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        "--grace-period",
        "1",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(code, 0, "{out}\n{err}");
    for attempt in 0..3 {
        for rank in 0..2 {
            assert!(
                out.contains(&format!("[rank {rank}] attempt {attempt} of 3")),
                "{out}"
            );
        }
    }
    for restart in 1..=2 {
        assert!(
            err.contains(&format!(
                "restarting all 2 processes (restart {restart} of at most 3)"
            )),
            "{err}"
        );
    }
    let summary = last_line(&err);
    assert!(
        summary.starts_with("fsdp-run: all 2 processes (ranks 0, 1) finished successfully in")
            && summary.contains("; 2 restarts (of at most 3): rank 1 exited with code 3 after")
            && summary.matches("rank 1 exited with code 3 after").count() == 2,
        "{summary}"
    );
}

#[test]
fn when_the_restarts_run_out_the_last_failure_ends_the_job() {
    let (code, out, err, _) = run(&["--max-restarts", "1", "--", "sh", "-c", "exit 4"]);
    assert_eq!(code, 4, "{out}\n{err}");
    assert!(
        err.contains("restarting all 1 process (restart 1 of at most 1)"),
        "{err}"
    );
    let summary = last_line(&err);
    assert!(
        summary.starts_with("fsdp-run: rank 0 failed first: exited with code 4 after")
            && summary.contains("; 1 restart (of at most 1): rank 0 exited with code 4 after"),
        "{summary}"
    );
}

// ---- --config FILE: the [launch] table (issue 24, item 4) ------------------------------------

#[test]
fn the_launch_table_of_a_config_file_sets_the_launch_and_flags_override_it() {
    let dir = crate::common::tmpdir("fsdp-run-config");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("job.toml");
    std::fs::write(
        &file,
        "# The examples' keys are top-level; fsdp-run reads [launch].\nepochs = 3\n\n[launch]\n\
         nproc_per_node = 3\nmaster_addr = \"localhost\"\nmaster_port = 29877\n",
    )
    .unwrap();
    let file = file.to_str().unwrap();
    let (code, out, err, _) = run(&["--config", file, "--", "sh", "-c", PRINT_ENV]);
    assert_eq!(code, 0, "{err}");
    for r in 0..3 {
        assert!(
            out.contains(&format!(
                "[rank {r}] R={r} W=3 L={r} LW=3 G=0 A=localhost P=29877 "
            )),
            "{out}"
        );
    }
    let (code, out, err, _) = run(&[
        "--config",
        file,
        "--nproc-per-node",
        "2",
        "--master-port",
        "29878",
        "--",
        "sh",
        "-c",
        PRINT_ENV,
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(!out.contains("[rank 2]"), "{out}");
    for r in 0..2 {
        assert!(
            out.contains(&format!(
                "[rank {r}] R={r} W=2 L={r} LW=2 G=0 A=localhost P=29878 "
            )),
            "{out}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn config_file_errors_name_the_key_and_the_file() {
    let dir = crate::common::tmpdir("fsdp-run-config-errors");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("bad.toml");
    std::fs::write(&file, "[launch]\nnprocs_per_node = 2\n").unwrap();
    let path = file.to_str().unwrap();
    let (code, _, err, _) = run(&["--config", path, "--", "true"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&format!(
            "fsdp-run: error: config file {path}: unknown key nprocs_per_node"
        )) && err.contains("[launch]"),
        "{err}"
    );
    std::fs::write(&file, "[launch]\nmax_restarts = \"two\"\n").unwrap();
    let (code, _, err, _) = run(&["--config", path, "--", "true"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&format!("config file {path}: ")) && err.contains("--max-restarts"),
        "{err}"
    );
    let missing = dir.join("missing.toml");
    let missing = missing.to_str().unwrap();
    let (code, _, err, _) = run(&["--config", missing, "--", "true"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&format!("config file {missing}: cannot read it")),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn shared_memory_segments_a_job_left_are_removed() {
    // What a rank of the shared-memory backend killed while the ranks meet leaves behind:
    // files named after rank 0's pid (here the child's own, `$$`).
    let (code, out, err, _) = run(&[
        "--",
        "sh",
        "-c",
        "touch /dev/shm/candle-fsdp-$$-123-g-c0-r0 && echo $$",
    ]);
    assert_eq!(code, 0, "{err}");
    let pid = out.trim().trim_start_matches("[rank 0] ");
    let left = std::path::Path::new("/dev/shm").join(format!("candle-fsdp-{pid}-123-g-c0-r0"));
    assert!(!left.exists(), "{} left behind", left.display());
}
