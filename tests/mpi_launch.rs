//! Whole MPI jobs started with `mpirun` from a plain `cargo test --features mpi` (feature `mpi`;
//! needs `mpirun` on PATH): a rank that fails ends every process with its message, and a world
//! size that disagrees with the launcher is an error.
//!
//! Each job runs one `#[ignore]`d helper test of this binary under `mpirun`.
#![cfg(feature = "mpi")]

mod common;

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use candle_core::Module;
use candle_fsdp::comm::{ProcessGroupExt, ReduceOp};
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::optim::{AdamW, AdamWConfig, ShardedOptimizer};
use candle_fsdp::unit::UnitSpec;
use candle_fsdp::{FsdpConfig, FsdpModel};
use common::*;

/// Runs `helper` of this test binary under `mpirun -n <n>`; returns (success, output, seconds).
/// The ranks share mpirun's output: helpers print each line in one write ([`eprint_line`]).
/// A job still running after 120 s is killed and fails the test.
fn mpirun(n: usize, helper: &str) -> (bool, String, f64) {
    mpirun_mode(n, helper, "")
}

/// [`mpirun`] with `FSDP_TEST_MODE=<mode>` in every rank's environment.
fn mpirun_mode(n: usize, helper: &str, mode: &str) -> (bool, String, f64) {
    let exe = std::env::current_exe().expect("test binary path");
    let start = Instant::now();
    let mut child = Command::new("mpirun")
        .env("FSDP_TEST_MODE", mode)
        // Candle attaches stack traces to its errors: the messages must stay readable with them.
        .env("RUST_BACKTRACE", "1")
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-n",
            &n.to_string(),
        ])
        .arg(&exe)
        .args([
            "--ignored",
            "--exact",
            helper,
            "--test-threads=1",
            "--nocapture",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun on PATH (Debian: apt-get install openmpi-bin)");
    let deadline = start + Duration::from_secs(120);
    loop {
        if child.try_wait().expect("waitpid").is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("mpirun -n {n} {helper} still running after 120 s: a rank hangs");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("mpirun output");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text, start.elapsed().as_secs_f64())
}

/// Forward calls of the failing unit in this process (one rank per process under MPI).
static FORWARDS: AtomicU64 = AtomicU64::new(0);

/// A unit that multiplies by 1 and fails at its 6th forward (step 5) on rank `fail_rank`.
struct FailAt {
    rank: usize,
    fail_rank: usize,
}

impl Module for FailAt {
    fn forward(&self, xs: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
        let n = FORWARDS.fetch_add(1, Ordering::SeqCst);
        if self.rank == self.fail_rank && n == 5 {
            candle_core::bail!("injected failure in the user's module");
        }
        Ok(xs.clone())
    }
}

#[test]
#[ignore = "a rank of an MPI job: run by rank_error_ends_every_process"]
fn helper_rank1_fails_at_step5() {
    let launcher = Launcher::from_env(None, 1, Duration::from_secs(60)).unwrap();
    let result = launch(&launcher, |pg| {
        let rank = pg.rank();
        let mut b = FsdpModel::builder(pg.clone(), FsdpConfig::default());
        for (i, u) in units().into_iter().enumerate() {
            b = b.unit_spec(u);
            if i == 2 {
                b = b.unit_spec(UnitSpec::new("user_block", move |_vb| {
                    Ok(FailAt { rank, fail_rank: 1 })
                }));
            }
        }
        let mut model = b.build()?;
        let mut optim = AdamW::new(AdamWConfig::default());
        for (x, y) in batches(20, 4 * pg.world_size(), 3) {
            let x = x.narrow(0, rank * 4, 4)?;
            let y = y.narrow(0, rank * 4, 4)?;
            let loss = candle_nn::loss::cross_entropy(&model.forward(&x)?, &y)?;
            model.backward(&loss)?;
            optim.step(&mut model)?;
            model.zero_grad();
        }
        Ok(())
    });
    let rank = launcher.local_ranks().start;
    if let Err(e) = result {
        report_rank_error(rank, &e);
        std::process::exit(1);
    }
}

#[test]
fn rank_error_ends_every_process() {
    let (ok, out, secs) = mpirun(2, "helper_rank1_fails_at_step5");
    assert!(!ok, "the job must fail:\n{out}");
    assert!(secs < 30.0, "the job took {secs:.1} s to end:\n{out}");
    // The failing rank names its unit, phase and step...
    assert!(
        out.contains(
            "rank 1: error: forward of unit user_block at step 5: injected failure in the user's \
             module"
        ),
        "{out}"
    );
    // ... and the other rank says which rank failed, with that message.
    // (Two processes share the terminal: libtest's own text may precede the line.)
    let rank0 = out
        .lines()
        .find_map(|l| l.find("rank 0: error: ").map(|i| &l[i..]))
        .unwrap_or_else(|| panic!("rank 0 printed no error:\n{out}"));
    assert!(
        rank0.contains(
            "aborted: rank 1 failed: forward of unit user_block at step 5: injected failure"
        ),
        "{rank0}"
    );
    // The failing rank's stack trace stays on that rank: the notice carries its message only.
    assert!(
        rank0
            .trim_end()
            .ends_with("injected failure in the user's module"),
        "{rank0}"
    );
    // No process of the job is left: mpirun may return while the rank it killed is still
    // exiting, so each is given 5 s to be gone (a rank that hangs never goes).
    let exe = std::env::current_exe().unwrap();
    let pattern = format!("{} --ignored --exact helper_rank1_fails", exe.display());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = Command::new("pgrep")
            .args(["-f", &pattern])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default();
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "processes left 5 s after mpirun returned: {left}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
#[ignore = "a rank of an MPI job: run by world_size_flag_must_match_mpirun"]
fn helper_world_size_3() {
    match Launcher::from_env(Some(3), 2, Duration::from_secs(60)) {
        Ok(l) => {
            launch(&l, |pg| pg.barrier_wait()).unwrap();
            eprint_line(&format!("accepted world size {}", l.world_size()));
        }
        Err(e) => {
            eprint_line(&format!("error: {}", e.message()));
            std::process::exit(2);
        }
    }
}

#[test]
fn world_size_flag_must_match_mpirun() {
    let (ok, out, _) = mpirun(2, "helper_world_size_3");
    assert!(!ok, "{out}");
    assert!(
        out.contains(
            "error: invalid argument: --world-size 3 disagrees with the launcher (mpirun \
             started 2 processes); drop --world-size or make them agree"
        ),
        "{out}"
    );
    let (ok, out, _) = mpirun(3, "helper_world_size_3");
    assert!(ok, "{out}");
    assert!(out.contains("accepted world size 3"), "{out}");
}

#[test]
#[ignore = "a rank of an MPI job: run by ranks_that_never_join_end_the_job"]
fn helper_late_or_failed_rank() {
    let launcher = Launcher::from_env(None, 1, Duration::from_secs(2)).unwrap();
    let rank = launcher.local_ranks().start;
    if rank == 1 {
        match std::env::var("FSDP_TEST_MODE").as_deref() {
            // An error of the program before it reaches `launch` (bad data path, say).
            Ok("error-before-launch") => {
                eprint_line("rank 1: error: cannot load the data");
                std::process::exit(1);
            }
            // Arrives long after the others gave up waiting (a slow node).
            _ => std::thread::sleep(Duration::from_secs(8)),
        }
    }
    let result = launch(&launcher, |pg| pg.barrier_wait());
    if let Err(e) = result {
        report_rank_error(rank, &e);
        std::process::exit(1);
    }
}

/// A rank that fails before `launch`, or arrives after the others' timeout, ends the job with
/// an error on the others naming it, instead of a hang in `MPI_Finalize` or `MPI_Comm_idup`.
#[test]
fn ranks_that_never_join_end_the_job() {
    let (ok, out, secs) = mpirun_mode(2, "helper_late_or_failed_rank", "error-before-launch");
    assert!(!ok, "{out}");
    assert!(secs < 30.0, "took {secs:.1} s:\n{out}");
    assert!(out.contains("rank 1: error: cannot load the data"), "{out}");
    assert!(
        out.contains(
            "aborted: rank 1 failed: the process of rank 1 exited before its part of the job \
             completed"
        ),
        "{out}"
    );
    let (ok, out, secs) = mpirun_mode(2, "helper_late_or_failed_rank", "late");
    assert!(!ok, "{out}");
    assert!(secs < 30.0, "took {secs:.1} s:\n{out}");
    assert!(
        out.contains("on rank 0 timed out after 2s waiting for ranks [1]"),
        "{out}"
    );
}

#[test]
#[ignore = "a rank of an MPI job: run by a_setup_argument_over_the_limit_is_one_error_naming_it"]
fn helper_long_stream_name() {
    let launcher = Launcher::from_env(None, 1, Duration::from_secs(20)).unwrap();
    let rank = launcher.local_ranks().start;
    let name = "n".repeat(70_000);
    let (e, sum) = launch(&launcher, |pg| {
        let e = pg.new_stream(&name).map(|_| ()).unwrap_err();
        // Refused alike on every rank: the group stays usable.
        Ok((e, pg.all_reduce_f32s(vec![1.0], ReduceOp::Sum)?))
    })
    .unwrap()
    .remove(0);
    eprint_line(&format!("rank {rank}: error: {e}"));
    eprint_line(&format!("rank {rank}: then all_reduce {sum:?}"));
}

/// A setup argument longer than the peers' descriptor receives (64 KiB) is not sent: a short
/// post reports it instead (it made the peers' receives fail with MPI's truncation error), so
/// every rank gets the same error naming its size and the limit, and the group stays usable.
#[test]
fn a_setup_argument_over_the_limit_is_one_error_naming_it() {
    let (ok, out, secs) = mpirun(2, "helper_long_stream_name");
    assert!(ok, "{out}");
    assert!(secs < 30.0, "took {secs:.1} s:\n{out}");
    // The name quoted short (its first 48 bytes and its length): mpirun's output a pipe's worth.
    let name = format!("{}… (70000 bytes)", "n".repeat(48));
    for r in 0..2 {
        let want = format!(
            "rank {r}: error: new_stream #1 ({name:?}) on rank 0: new_stream setup argument: \
             expected at most 65523 bytes (the backend's limit: a descriptor of at most 65536 \
             bytes), found 70000 bytes (a descriptor of 70013 bytes)"
        );
        assert!(out.contains(&want), "{out}");
        assert!(
            out.contains(&format!("rank {r}: then all_reduce [2.0]")),
            "{out}"
        );
    }
    assert!(!out.to_lowercase().contains("truncat"), "{out}");
}
