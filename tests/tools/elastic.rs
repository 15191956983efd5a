//! The MNIST example under `fsdp-run` on CPU (the shared-memory backend, issue 24): the same
//! losses, accuracy and final checkpoint bytes as the in-process thread run; and a job whose
//! rank 1 is killed with SIGKILL mid-run, restarted by `--max-restarts`, resuming from its
//! newest checkpoint and ending exactly as the uninterrupted run. Both write a run fingerprint
//! (`--fingerprint`), which `fsdp-ckpt diff` finds identical to the thread run's: every step
//! for the shm run, the steps after the resume for the restarted one (issue 35).
//!
//! The example binary is the one `cargo test` builds next to this test binary
//! (`target/release/examples/mnist`); the data is the repository's `data/mnist`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::fsdp_run::{finish, last_line, BIN};

/// Flags of every run here: two epochs of 118 steps, a checkpoint every 20 steps.
const FLAGS: [&str; 6] = ["--epochs", "2", "--batch-size", "256", "--save-every", "20"];

fn mnist() -> PathBuf {
    crate::common::example_bin(
        "mnist",
        "cargo build --release --example mnist` (`cargo test` builds the examples",
    )
}

fn data_dir() -> String {
    format!("{}/data/mnist", env!("CARGO_MANIFEST_DIR"))
}

fn free_port() -> String {
    crate::common::free_port().to_string()
}

/// A fingerprint file path for the run `tag` (its directory created).
fn fingerprint_path(tag: &str) -> PathBuf {
    let d = crate::common::tmpdir(&format!("{tag}-fp"));
    std::fs::create_dir_all(&d).unwrap();
    d.join("run.fp")
}

/// `fsdp-ckpt diff a b`: exit code and stdout + stderr.
fn ckpt_diff(a: &Path, b: &Path) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fsdp-ckpt"))
        .arg("diff")
        .args([a, b])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// The uninterrupted reference: the thread run (world size 2 in one process); its stdout,
/// checkpoint directory and fingerprint file.
fn reference() -> &'static (String, PathBuf, PathBuf) {
    static REF: OnceLock<(String, PathBuf, PathBuf)> = OnceLock::new();
    REF.get_or_init(|| {
        let dir = crate::common::tmpdir("elastic-reference");
        let fp = fingerprint_path("elastic-reference");
        let out = Command::new(mnist())
            .args(FLAGS)
            .args(["--world-size", "2", "--data-dir", &data_dir()])
            .arg("--checkpoint-dir")
            .arg(&dir)
            .arg("--fingerprint")
            .arg(&fp)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        (stdout, dir, fp)
    })
}

/// `train loss … test accuracy …%` of every epoch line (the times differ between runs).
fn epoch_results(out: &str) -> Vec<String> {
    out.lines()
        .filter_map(|l| {
            let i = l.find("train loss")?;
            let j = l.find("  epoch time")?;
            Some(l[i..j].to_string())
        })
        .collect()
}

/// The bytes of every shard file of `dir`'s final checkpoint equal the reference's.
fn assert_same_final_checkpoint(dir: &Path) {
    let last = "step-00000236";
    let (_, ref_dir, _) = reference();
    for r in 0..2 {
        let name = format!("shard-0000{r}-of-00002.safetensors");
        let want = std::fs::read(ref_dir.join(last).join(&name)).unwrap();
        let got = std::fs::read(dir.join(last).join(&name)).unwrap();
        assert!(
            want == got,
            "{name} of {last} differs from the thread run's"
        );
    }
}

#[test]
fn mnist_under_fsdp_run_on_cpu_matches_the_thread_run_bitwise() {
    let dir = crate::common::tmpdir("elastic-shm");
    let fp = fingerprint_path("elastic-shm");
    let (code, out, err) = {
        let child = Command::new(BIN)
            .args(["--nproc-per-node", "2", "--master-port", &free_port(), "--"])
            .arg(mnist())
            .args(FLAGS)
            .args(["--data-dir", &data_dir(), "--resume", "--checkpoint-dir"])
            .arg(&dir)
            .arg("--fingerprint")
            .arg(&fp)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        finish(child, Duration::from_secs(120))
    };
    assert_eq!(code, 0, "{out}\n{err}");
    // --resume with no checkpoint yet starts from scratch.
    assert!(
        out.contains("[rank 0] --resume: no complete checkpoint in")
            && out.contains("starting from scratch"),
        "{out}"
    );
    assert!(out.contains("world size 2 (shm on cpu)"), "{out}");
    let (reference, ref_dir, ref_fp) = reference();
    let epochs = epoch_results(&out);
    assert_eq!(epochs.len(), 2, "{out}");
    assert_eq!(epochs, epoch_results(reference));
    assert_eq!(
        crate::common::final_accuracy(&out),
        crate::common::final_accuracy(reference)
    );
    assert_same_final_checkpoint(&dir);
    // Every record of every step (3 units x 4 phases x 2 ranks x 236 steps) is the thread
    // run's; so is every tensor of the final checkpoint.
    let (code, text) = ckpt_diff(ref_fp, &fp);
    assert_eq!(code, 0, "{text}");
    assert_eq!(
        text.trim(),
        "fingerprints identical: 5664 records, steps 0..=235"
    );
    let (code, text) = ckpt_diff(ref_dir, &dir);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("\ncheckpoints identical: 18 tensors"),
        "{text}"
    );
    // A run of other data (another seed) differs from step 0, named.
    let other = fingerprint_path("elastic-shm-other");
    let run = Command::new(mnist())
        .args([
            "--epochs",
            "1",
            "--batch-size",
            "256",
            "--seed",
            "1",
            "--world-size",
            "2",
        ])
        .args(["--data-dir", &data_dir(), "--checkpoint-dir"])
        .arg(dir.join("other"))
        .arg("--fingerprint")
        .arg(&other)
        .output()
        .unwrap();
    assert!(run.status.success());
    let (code, text) = ckpt_diff(&fp, &other);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.starts_with("first difference: step 0, unit fc1, phase params, rank 0\n"),
        "{text}"
    );
    assert!(
        text.contains("only the first file has steps 118..=235"),
        "{text}"
    );
    // A fingerprint file against a checkpoint is a usage mistake, named.
    let (code, text) = ckpt_diff(&fp, &dir);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("diff compares two fingerprint files or two checkpoints")
            && text.contains("run.fp (a file) with "),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The process of the rank `rank` of attempt `restart` among the children of `parent`.
fn rank_process(parent: u32, rank: usize, restart: usize) -> Option<i32> {
    let children = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
        .unwrap_or_default();
    children
        .split_whitespace()
        .filter_map(|p| p.parse::<i32>().ok())
        .find(|pid| {
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            let has = |entry: String| env.split(|&b| b == 0).any(|e| e == entry.as_bytes());
            has(format!("RANK={rank}")) && has(format!("TORCHELASTIC_RESTART_COUNT={restart}"))
        })
}

#[test]
fn a_rank_killed_with_sigkill_restarts_and_ends_like_the_uninterrupted_run() {
    let dir = crate::common::tmpdir("elastic-restart");
    let fp = fingerprint_path("elastic-restart");
    let child = Command::new(BIN)
        .args(["--nproc-per-node", "2", "--max-restarts", "2"])
        .args(["--master-port", &free_port(), "--"])
        .arg(mnist())
        .args(FLAGS)
        .args(["--data-dir", &data_dir(), "--checkpoint-dir"])
        .arg(&dir)
        .arg("--fingerprint")
        .arg(&fp)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Once the first checkpoint is complete (renamed from its staging directory
    // `.step-<n>.partial`, which holds `meta.json` a moment before), kill rank 1.
    let deadline = Instant::now() + Duration::from_secs(60);
    let victim = loop {
        let saved = candle_fsdp::checkpoint::list_complete(&dir).is_ok_and(|c| !c.is_empty());
        if let (true, Some(pid)) = (saved, rank_process(child.id(), 1, 0)) {
            break pid;
        }
        assert!(Instant::now() < deadline, "no checkpoint after 60 s");
        std::thread::sleep(Duration::from_millis(5));
    };
    // SAFETY: plain syscall on a child process of the job.
    unsafe { libc::kill(victim, libc::SIGKILL) };
    let (code, out, err) = finish(child, Duration::from_secs(120));
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        err.contains("fsdp-run: rank 1 failed first: killed by signal 9 (SIGKILL) after")
            && err.contains("restarting all 2 processes (restart 1 of at most 2)"),
        "{err}"
    );
    let summary = last_line(&err);
    assert!(
        summary.starts_with("fsdp-run: all 2 processes (ranks 0, 1) finished successfully in")
            && summary
                .contains("; 1 restart (of at most 2): rank 1 killed by signal 9 (SIGKILL) after"),
        "{summary}"
    );
    // The restart resumed from a checkpoint of this run, and ended as the uninterrupted run.
    assert!(out.contains("[rank 0] resumed from"), "{out}");
    let (reference, _, ref_fp) = reference();
    assert_eq!(
        crate::common::final_accuracy(&out),
        crate::common::final_accuracy(reference)
    );
    assert_same_final_checkpoint(&dir);
    // The restarted attempt wrote the fingerprint from the step it resumed at: those steps
    // are the uninterrupted run's, record for record; the killed attempt's file was kept
    // beside it (`run.fp.1`), and the steps it completed are the uninterrupted run's too.
    let (code, text) = ckpt_diff(ref_fp, &fp);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.starts_with("fingerprints identical: ")
            && text.contains("only the first file has steps 0..="),
        "{text}"
    );
    let (code, text) = ckpt_diff(ref_fp, &fp.with_extension("fp.1"));
    assert_eq!(code, 0, "{text}");
    assert!(
        text.starts_with("fingerprints identical: ") && text.contains("steps 0..="),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `--resume` whose only checkpoint was found damaged fails naming where it was set aside,
/// and so does the next `--resume` (it used to start from scratch: under `--max-restarts` a
/// restart retrained from step 0).
#[test]
fn a_resume_after_a_damaged_checkpoint_names_what_was_set_aside() {
    let dir = crate::common::tmpdir("damaged-resume");
    let run = |extra: &[&str]| {
        let child = Command::new(mnist())
            .args([
                "--epochs",
                "1",
                "--batch-size",
                "1024",
                "--data-dir",
                &data_dir(),
            ])
            .arg("--checkpoint-dir")
            .arg(&dir)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        finish(child, Duration::from_secs(120))
    };
    let (code, out, err) = run(&[]);
    assert_eq!(code, 0, "{out}\n{err}");
    let steps: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join(candle_fsdp::checkpoint::META_FILE).is_file())
        .collect();
    assert!(
        !steps.is_empty(),
        "no checkpoint written in {}",
        dir.display()
    );
    for step in &steps {
        for shard in std::fs::read_dir(step).unwrap().flatten() {
            let path = shard.path();
            if path.extension().is_some_and(|e| e == "safetensors") {
                let bytes = std::fs::read(&path).unwrap();
                std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
            }
        }
    }
    let (code, out, err) = run(&["--resume"]);
    assert_ne!(code, 0, "a damaged checkpoint was loaded:\n{out}\n{err}");
    let text = format!("{out}{err}");
    assert!(
        text.contains("safetensors") && text.contains(".damaged"),
        "{out}\n{err}"
    );
    let (code, out, err) = run(&["--resume"]);
    assert_ne!(
        code, 0,
        "a --resume without a good checkpoint started over:\n{out}"
    );
    assert!(
        err.contains("was set aside as damaged by an earlier load (step-")
            && err.contains(".damaged")
            && err.contains("leave out --resume) to start from scratch"),
        "{err}"
    );
}
