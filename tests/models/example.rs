//! The examples as a user runs them (mostly llama): `--eval-file` with `--max-steps 0` prints
//! transformers' loss at world sizes 2 and 3; fine-tune from `--from-hf`, publish with
//! `fsdp-ckpt export --format hf`, and the published directory evaluates to the loss the run
//! printed; bad flags and inputs are refused at the start, naming them.
//!
//! The example's binary is the one `cargo test` builds beside this test
//! (`target/<profile>/examples/llama`); when it was not built (`cargo test --test models`
//! alone) the tests say so and pass.

use std::path::PathBuf;
use std::process::Command;

use super::common::tmpdir;
use super::fixture;

/// The example's binary, or why there is none.
fn example() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let path = exe.parent()?.parent()?.join("examples").join("llama");
    if path.is_file() {
        Some(path)
    } else {
        println!(
            "SKIPPED: {} not built (cargo test builds the examples; cargo build --release \
             --example llama)",
            path.display()
        );
        None
    }
}

/// Runs the example with `args`; returns stdout (stderr in the panic message on failure).
fn run(bin: &PathBuf, args: &[&str]) -> String {
    let o = Command::new(bin)
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "llama {args:?} failed:\n{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

/// Runs the example with `args`, which must fail; returns stderr.
fn fails(bin: &PathBuf, args: &[&str]) -> String {
    let o = Command::new(bin)
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(!o.status.success(), "llama {args:?} succeeded");
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The value of the `eval loss X` line.
fn eval_loss(out: &str) -> f64 {
    out.lines()
        .find_map(|l| l.strip_prefix("eval loss "))
        .unwrap_or_else(|| panic!("no eval loss line in:\n{out}"))
        .trim()
        .parse()
        .unwrap()
}

/// Asserts that two `eval loss` lines of one model at different world sizes agree. The runs
/// group the windows differently (say 2 ranks with batches of 2 against 3 ranks of one window
/// each), so their f32 sums and the matmuls' row blocks may round a few ulps apart (an ulp of
/// 4.5 is 4.8e-7, the line prints 6 decimals); a weight lost, mis-scaled or transposed on the
/// way moves the loss by far more, as the few training steps before it did (> 1e-4).
fn assert_same_eval(got: f64, want: f64, what: &str) {
    assert!(
        (got - want).abs() <= 4e-6,
        "{what}: eval loss {got} against {want}"
    );
}

fn expected_eval() -> (f64, String) {
    let text = std::fs::read_to_string(fixture("llama-mha").join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    (
        v["eval"]["loss"].as_f64().unwrap(),
        v["eval"]["seq_len"].as_u64().unwrap().to_string(),
    )
}

#[test]
fn eval_only_prints_transformers_loss_at_world_sizes_2_and_3() {
    let Some(bin) = example() else { return };
    let (want, seq_len) = expected_eval();
    let dir = fixture("llama-mha");
    let eval = dir.join("eval.txt");
    for ws in ["2", "3"] {
        let out = run(
            &bin,
            &[
                "--world-size",
                ws,
                "--from-hf",
                dir.to_str().unwrap(),
                "--eval-file",
                eval.to_str().unwrap(),
                "--max-steps",
                "0",
                "--seq-len",
                &seq_len,
                "--batch-size",
                "4",
            ],
        );
        assert!(out.contains("tokens: tokenizer.json"), "{out}");
        let got = eval_loss(&out);
        assert!(
            (got - want).abs() < 1e-4,
            "ws {ws}: eval loss {got}, transformers {want}"
        );
    }
}

#[test]
fn fine_tune_export_and_reload_evaluates_to_the_same_loss() {
    let Some(bin) = example() else { return };
    let (initial, seq_len) = expected_eval();
    let root = tmpdir("llama-example");
    let (dir, ckpt, published) = (
        fixture("llama-mha"),
        root.join("ckpt"),
        root.join("published"),
    );
    let eval = dir.join("eval.txt");
    let out = run(
        &bin,
        &[
            "--world-size",
            "2",
            "--from-hf",
            dir.to_str().unwrap(),
            "--data",
            eval.to_str().unwrap(),
            "--eval-file",
            eval.to_str().unwrap(),
            "--max-steps",
            "3",
            "--warmup-steps",
            "1",
            "--lr",
            "1e-2",
            "--seq-len",
            &seq_len,
            "--batch-size",
            "2",
            "--sample-len",
            "8",
            "--prompt",
            "KING",
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
        ],
    );
    let tuned = eval_loss(&out);
    assert!(
        (tuned - initial).abs() > 1e-3,
        "training changed nothing: {tuned}"
    );
    let o = Command::new(env!("CARGO_BIN_EXE_fsdp-ckpt"))
        .arg("export")
        .arg(&ckpt)
        .args(["--format", "hf", "--out"])
        .arg(&published)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::copy(dir.join("tokenizer.json"), published.join("tokenizer.json")).unwrap();
    let out = run(
        &bin,
        &[
            "--world-size",
            "3",
            "--from-hf",
            published.to_str().unwrap(),
            "--eval-file",
            eval.to_str().unwrap(),
            "--max-steps",
            "0",
            "--seq-len",
            &seq_len,
        ],
    );
    assert_same_eval(
        eval_loss(&out),
        tuned,
        "the published model is the fine-tuned one",
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// An `--eval-file` too short for one window is refused at the start, naming the file and the
/// token counts, before the model is loaded and before any step is trained (it used to fail
/// after the whole fine-tune, at the evaluation); an empty file likewise.
#[test]
fn short_eval_file_is_refused_before_training() {
    let Some(bin) = example() else { return };
    let root = tmpdir("llama-example-short-eval");
    std::fs::create_dir_all(&root).unwrap();
    let dir = fixture("llama-mha");
    for (name, text, tokens) in [("short.txt", "To be", 5), ("empty.txt", "", 0)] {
        let eval = root.join(name);
        std::fs::write(&eval, text).unwrap();
        let ckpt = root.join("ckpt");
        let o = Command::new(&bin)
            .args(["--world-size", "2", "--from-hf", dir.to_str().unwrap()])
            .args(["--data", dir.join("eval.txt").to_str().unwrap()])
            .args(["--eval-file", eval.to_str().unwrap()])
            .args(["--max-steps", "2", "--seq-len", "16", "--sample-len", "0"])
            .args(["--checkpoint-dir", ckpt.to_str().unwrap()])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap();
        let (out, err) = (
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
        );
        assert!(!o.status.success(), "{out}");
        assert!(
            err.contains(&format!(
                "--eval-file {}: {tokens} tokens, too few for one window of --seq-len 16 (17 tokens",
                eval.display()
            )),
            "{err}"
        );
        assert!(!out.contains("step "), "trained before refusing:\n{out}");
        assert!(!ckpt.exists(), "the refused run left {}", ckpt.display());
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// A `--checkpoint-dir` that cannot be made is refused at the start, naming what is in the
/// way; a fresh one is not made before the first save.
#[test]
fn checkpoint_dir_that_cannot_be_made_is_named() {
    let Some(bin) = example() else { return };
    let root = tmpdir("llama-example-ckpt-dir");
    std::fs::create_dir_all(&root).unwrap();
    let file = root.join("a-file");
    std::fs::write(&file, "mine").unwrap();
    let dir = fixture("llama-mha");
    for (ckpt, want) in [
        (
            file.clone(),
            format!(
                "--checkpoint-dir {}: exists and is not a directory",
                file.display()
            ),
        ),
        (
            file.join("ckpt"),
            format!(
                "--checkpoint-dir {}: cannot be created ({} is not a directory)",
                file.join("ckpt").display(),
                file.display()
            ),
        ),
    ] {
        let err = fails(
            &bin,
            &[
                "--world-size",
                "1",
                "--from-hf",
                dir.to_str().unwrap(),
                "--data",
                dir.join("eval.txt").to_str().unwrap(),
                "--checkpoint-dir",
                ckpt.to_str().unwrap(),
            ],
        );
        assert!(err.contains(&want), "{err}");
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"mine");
    let _ = std::fs::remove_dir_all(&root);
}

/// The hybrid flags are checked at the start, naming the flag: a zero `--shard-size` (was
/// "does not divide"), a `--reshard-after-forward` of 0 or not dividing the shard group (was
/// the runtime's `reshard_after_forward_ranks`, after the data was loaded), and
/// `--reshard-after-forward` under a strategy that does not reshard after forward (was
/// silently ignored, while `--shard-size` under a non-hybrid strategy is refused).
#[test]
fn hybrid_flags_are_checked_naming_the_flag() {
    let Some(bin) = example() else { return };
    let cases: [(&[&str], &str); 5] = [
        (
            &["--strategy", "hybrid-shard", "--shard-size", "0"],
            "--shard-size must be at least 1, found 0",
        ),
        (
            &["--reshard-after-forward", "0"],
            "--reshard-after-forward must be at least 1, found 0",
        ),
        (
            &["--reshard-after-forward", "3"],
            "--reshard-after-forward 3 does not divide the shard group's 4 ranks (the world size \
             under full-shard)",
        ),
        (
            &["--strategy", "no-shard", "--reshard-after-forward", "2"],
            "--reshard-after-forward 2 needs --strategy full-shard or hybrid-shard (found \
             no-shard",
        ),
        (
            &[
                "--strategy",
                "shard-grad-op",
                "--reshard-after-forward",
                "2",
            ],
            "--reshard-after-forward 2 needs --strategy full-shard or hybrid-shard (found \
             shard-grad-op",
        ),
    ];
    let root = tmpdir("llama-example-hybrid-flags");
    for (flags, want) in cases {
        let o = Command::new(&bin)
            .args(["--world-size", "4", "--max-steps", "1", "--sample-len", "0"])
            .args(["--checkpoint-dir", root.join("ckpt").to_str().unwrap()])
            .args(flags)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{flags:?} ran");
        assert!(err.contains(want), "{flags:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// `mnist_cnn --epochs 0` (or a resume with every epoch done) says there is nothing to train,
/// as `mnist` does; it printed "final test accuracy NaN% after 0 epoch(s), mean epoch time
/// -0.0s".
#[test]
fn mnist_cnn_with_nothing_to_train_says_so() {
    let Some(llama) = example() else { return };
    let bin = llama.with_file_name("mnist_cnn");
    if !bin.is_file() {
        println!("SKIPPED: {} not built", bin.display());
        return;
    }
    let root = tmpdir("mnist-cnn-zero-epochs");
    let o = Command::new(&bin)
        .args(["--epochs", "0", "--world-size", "1"])
        .args(["--checkpoint-dir", root.to_str().unwrap()])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        out.contains("nothing to train: --epochs 0 asks for none"),
        "{out}"
    );
    assert!(!out.contains("NaN"), "{out}");
    let _ = std::fs::remove_dir_all(&root);
}

/// A `--from-hf` path that does not exist, or is a file (the weights file itself, a common
/// slip), is named with the flag (it was "DIR/config.json: Not a directory (os error 20)").
#[test]
fn from_hf_path_that_is_not_a_directory_is_named() {
    let Some(bin) = example() else { return };
    let weights = fixture("llama-mha").join("model.safetensors");
    let missing = fixture("no-such-model");
    for (path, what) in [
        (&weights, "not a directory"),
        (&missing, "no such directory"),
    ] {
        let o = Command::new(&bin)
            .args(["--from-hf", path.to_str().unwrap(), "--max-steps", "0"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success());
        assert!(
            err.contains(&format!(
                "--from-hf {}: {what} (expected a Hugging Face model directory",
                path.display()
            )),
            "{err}"
        );
    }
    // A directory without config.json: a checkpoint (a common mix-up) is called one.
    let root = tmpdir("llama-example-from-ckpt");
    let ckpt = root.join("step-00000001");
    std::fs::create_dir_all(&ckpt).unwrap();
    std::fs::write(ckpt.join("meta.json"), "{}").unwrap();
    let empty = root.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    for (dir, want) in [
        (
            &ckpt,
            "it is a candle-fsdp checkpoint, not a Hugging Face directory",
        ),
        (&empty, "not a Hugging Face model directory"),
    ] {
        let o = Command::new(&bin)
            .args(["--from-hf", dir.to_str().unwrap(), "--max-steps", "0"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success());
        assert!(
            err.contains(&format!(
                "--from-hf {}: no config.json in it: {want}",
                dir.display()
            )),
            "{err}"
        );
    }
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn resuming_a_checkpoint_with_another_model_names_both() {
    let Some(bin) = example() else { return };
    let (_, seq_len) = expected_eval();
    let root = tmpdir("llama-example-other");
    let (llama, ckpt) = (fixture("llama-mha"), root.join("ckpt"));
    let eval = llama.join("eval.txt");
    // Qwen3 of the same vocabulary, with the Llama's character tokenizer beside it.
    let qwen3 = root.join("qwen3");
    std::fs::create_dir_all(&qwen3).unwrap();
    for f in std::fs::read_dir(fixture("family-qwen3")).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), qwen3.join(f.file_name())).unwrap();
    }
    std::fs::copy(llama.join("tokenizer.json"), qwen3.join("tokenizer.json")).unwrap();
    let common = |dir: &PathBuf| -> Vec<String> {
        [
            "--world-size",
            "1",
            "--from-hf",
            dir.to_str().unwrap(),
            "--data",
            eval.to_str().unwrap(),
            "--max-steps",
            "1",
            "--seq-len",
            &seq_len,
            "--batch-size",
            "2",
            "--sample-len",
            "0",
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
        ]
        .map(String::from)
        .to_vec()
    };
    let args = common(&llama);
    run(&bin, &args.iter().map(String::as_str).collect::<Vec<_>>());
    let mut args = common(&qwen3);
    let steps = args.iter().position(|a| a == "--max-steps").unwrap() + 1;
    args[steps] = "2".into();
    args.push("--resume".into());
    let err = fails(&bin, &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        err.contains("is a checkpoint of another model: a LlamaForCausalLM")
            && err.contains("this run's is a Qwen3ForCausalLM")
            && err.contains("qwen3/config.json"),
        "{err}"
    );
    // The same parameters as a Mistral (a window): resumed, the note naming what changes.
    let mistral = root.join("mistral");
    std::fs::create_dir_all(&mistral).unwrap();
    for f in std::fs::read_dir(&llama).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), mistral.join(f.file_name())).unwrap();
    }
    let path = mistral.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["architectures"] = serde_json::json!(["MistralForCausalLM"]);
    config["model_type"] = serde_json::json!("mistral");
    config["sliding_window"] = serde_json::json!(3);
    std::fs::write(&path, config.to_string()).unwrap();
    let mut args = common(&mistral);
    args[steps] = "2".into();
    args.push("--resume".into());
    let out = run(&bin, &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        out.contains("differs from")
            && out.contains("family: \"llama\" → \"mistral\"")
            && out.contains("sliding_window: none → 3")
            && out.contains("resumed from"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_non_utf8_eval_file_is_bytes_for_bytes_and_named_for_a_tokenizer() {
    let Some(bin) = example() else { return };
    let root = tmpdir("llama-example-bytes");
    std::fs::create_dir_all(&root).unwrap();
    let file = root.join("eval.bin");
    // 200 repetitions of "abc", two bytes that are no UTF-8, "def".
    let bytes: Vec<u8> = (0..200)
        .flat_map(|_| [b'a', b'b', b'c', 0xff, 0xfe, b'd', b'e', b'f'])
        .collect();
    std::fs::write(&file, &bytes).unwrap();
    let ckpt = root.join("ckpt");
    // Bytes are the tokens of a from-scratch model: every byte evaluates.
    let out = run(
        &bin,
        &[
            "--eval-file",
            file.to_str().unwrap(),
            "--max-steps",
            "0",
            "--seq-len",
            "16",
            "--n-layer",
            "1",
            "--d-model",
            "32",
            "--n-head",
            "2",
            "--n-kv-head",
            "2",
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
        ],
    );
    let loss = eval_loss(&out);
    assert!(loss.is_finite() && loss > 0.0, "{out}");
    // A tokenizer needs text: the first byte that is not UTF-8 is named.
    let llama = fixture("llama-mha");
    let err = fails(
        &bin,
        &[
            "--from-hf",
            llama.to_str().unwrap(),
            "--eval-file",
            file.to_str().unwrap(),
            "--max-steps",
            "0",
            "--seq-len",
            "16",
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
        ],
    );
    assert!(
        err.contains("eval.bin: not UTF-8 text (byte 3 is not part of a UTF-8 character)"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// `--data FILE.jsonl`: supervised examples whose completions the model learns (the
/// per-token validation loss on them falls well below a uniform guess over the 256 byte
/// tokens, ln 256 = 5.55), also packed (`--pack`), and a bad line is named before training.
#[test]
fn supervised_jsonl_data_trains_on_the_completions() {
    let Some(bin) = example() else { return };
    let dir = super::common::tmpdir("example-sft");
    std::fs::create_dir_all(&dir).unwrap();
    let data = dir.join("sums.jsonl");
    let lines: Vec<String> = (0..120)
        .map(|i| {
            let (a, b) = (i % 11, (i * 7) % 13);
            format!(
                "{{\"prompt\": \"{a}+{b}=\", \"completion\": \"{}\\n\"}}",
                a + b
            )
        })
        .collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    let ckpt = dir.join("ckpt");
    let out = run(
        &bin,
        &[
            "--world-size",
            "2",
            "--data",
            data.to_str().unwrap(),
            "--seq-len",
            "16",
            "--batch-size",
            "8",
            "--max-steps",
            "40",
            "--lr",
            "3e-3",
            "--eval-interval",
            "40",
            "--log-interval",
            "40",
            "--sample-len",
            "0",
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
        ],
    );
    let val: f64 = out
        .lines()
        .find_map(|l| l.split("val loss ").nth(1))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no val loss line:\n{out}"));
    assert!(
        val < 3.0,
        "per-token validation loss {val} after 40 steps:\n{out}"
    );
    // Packed: several examples per sequence of 32 tokens, learning as well.
    let packed = run(
        &bin,
        &[
            "--world-size",
            "2",
            "--data",
            data.to_str().unwrap(),
            "--pack",
            "--checkpoint-dir",
            dir.join("ckpt-packed").to_str().unwrap(),
            "--seq-len",
            "32",
            "--batch-size",
            "3",
            "--max-steps",
            "40",
            "--lr",
            "3e-3",
            "--eval-interval",
            "40",
            "--log-interval",
            "40",
            "--sample-len",
            "0",
        ],
    );
    assert!(
        packed.contains("packing: 114 training examples into "),
        "{packed}"
    );
    let val: f64 = packed
        .lines()
        .find_map(|l| l.split("val loss ").nth(1))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no val loss line:\n{packed}"));
    assert!(
        val < 3.0,
        "packed: validation loss {val} after 40 steps:\n{packed}"
    );
    let e = fails(&bin, &["--pack", "--max-steps", "1"]);
    assert!(e.contains("--pack packs supervised examples"), "{e}");
    std::fs::write(
        &data,
        "{\"prompt\": \"1+1=\", \"completion\": \"2\"}\n{\"prompt\": \"x\"}\n",
    )
    .unwrap();
    let e = fails(
        &bin,
        &[
            "--data",
            data.to_str().unwrap(),
            "--max-steps",
            "1",
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
        ],
    );
    assert!(e.contains("sums.jsonl") && e.contains("line 2"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The README's LoRA path: the llama example with the README's LoRA flags trains only the
/// adapters, `fsdp-ckpt export --format peft --base-model DIR` writes PEFT's directory, and the
/// base plus that adapter (`--lora-from`) evaluates at world size 3 to the loss the run printed.
#[test]
fn readme_lora_commands_train_export_and_reload_the_adapters() {
    let Some(bin) = example() else { return };
    let (initial, seq_len) = expected_eval();
    let root = tmpdir("llama-example-lora");
    let (dir, ckpt, adapter) = (
        fixture("llama-mha"),
        root.join("lora"),
        root.join("my-adapter"),
    );
    let eval = dir.join("eval.txt");
    let lora = [
        "--lora-rank",
        "16",
        "--lora-alpha",
        "32",
        "--lora-targets",
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
    ];
    let mut args = vec![
        "--world-size",
        "2",
        "--from-hf",
        dir.to_str().unwrap(),
        "--data",
        eval.to_str().unwrap(),
        "--eval-file",
        eval.to_str().unwrap(),
        "--max-steps",
        "3",
        "--warmup-steps",
        "1",
        "--lr",
        "1e-2",
        "--seq-len",
        &seq_len,
        "--batch-size",
        "2",
        "--sample-len",
        "0",
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
    ];
    args.extend(lora);
    let out = run(&bin, &args);
    let tuned = eval_loss(&out);
    assert!(
        (tuned - initial).abs() > 1e-4,
        "training the adapters changed nothing: {tuned}"
    );
    let o = Command::new(env!("CARGO_BIN_EXE_fsdp-ckpt"))
        .arg("export")
        .arg(&ckpt)
        .args(["--format", "peft", "--out"])
        .arg(&adapter)
        .arg("--base-model")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        assert!(adapter.join(f).is_file(), "{f} missing");
    }
    let eval_ckpt = root.join("eval-ckpt");
    let mut args = vec![
        "--world-size",
        "3",
        "--from-hf",
        dir.to_str().unwrap(),
        "--lora-from",
        adapter.to_str().unwrap(),
        "--eval-file",
        eval.to_str().unwrap(),
        "--max-steps",
        "0",
        "--seq-len",
        &seq_len,
        "--checkpoint-dir",
        eval_ckpt.to_str().unwrap(),
    ];
    args.extend(lora);
    let out = run(&bin, &args);
    assert_same_eval(
        eval_loss(&out),
        tuned,
        "base + exported adapter = the tuned model",
    );
    // Resumed over a base stored otherwise (bf16): it continues, saying so.
    let mut args = vec![
        "--world-size",
        "1",
        "--from-hf",
        dir.to_str().unwrap(),
        "--data",
        eval.to_str().unwrap(),
        "--max-steps",
        "4",
        "--seq-len",
        &seq_len,
        "--batch-size",
        "2",
        "--sample-len",
        "0",
        "--base-dtype",
        "bf16",
        "--resume",
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
    ];
    args.extend(lora);
    let out = run(&bin, &args);
    assert!(
        out.contains(
            "was trained over a base stored as --base-dtype f32; this run stores it as bf16"
        ) && out.contains("resumed from"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&root);
}
