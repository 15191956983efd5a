//! The GPT example's pieces: the byte corpus on disk, the model (plain Candle and as FSDP
//! units), and a short FSDP training run at world size 2 (its `--config` file: tests/tools/config_file.rs).

use std::io::Write;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use candle_fsdp::data::text::{Split, TextCorpus};
use candle_fsdp::init::seeded_var_builder;
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::models::gpt::{gelu, lm_loss, FsdpGpt, Gpt, GptConfig};
use candle_fsdp::{
    AdamW, AdamWConfig, FsdpConfig, FsdpModel, Sgd, SgdConfig, ShardedOptimizer, ShardingStrategy,
};
use candle_nn::VarMap;

const CORPUS: &str = "data/shakespeare/shakespeare.txt.gz";

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("candle-fsdp-gpt-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn small(tied: bool) -> GptConfig {
    GptConfig {
        n_layer: 2,
        n_head: 2,
        d_model: 32,
        seq_len: 32,
        tied,
        ..GptConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// The corpus on disk.

#[test]
fn shipped_corpus_splits_off_the_last_five_percent() {
    let c = TextCorpus::load(CORPUS).unwrap();
    // data/shakespeare/README.md: 5,057,198 bytes unzipped.
    assert_eq!(c.len(), 5_057_198);
    assert_eq!(c.split(Split::Val).len(), 252_860);
    assert_eq!(
        c.split(Split::Train).len() + c.split(Split::Val).len(),
        c.len()
    );
    assert!(c.split(Split::Train).is_ascii());
}

#[test]
fn plain_and_gzipped_files_read_alike_and_errors_name_the_file() {
    let dir = tmpdir("files");
    let text = "To be, or not to be, that is the question.\n".repeat(20);
    let plain = dir.join("t.txt");
    std::fs::write(&plain, &text).unwrap();
    let gz = dir.join("t.txt.gz");
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(text.as_bytes()).unwrap();
    std::fs::write(&gz, enc.finish().unwrap()).unwrap();
    let (a, b) = (
        TextCorpus::load(&plain).unwrap(),
        TextCorpus::load(&gz).unwrap(),
    );
    assert_eq!(a.split(Split::Train), b.split(Split::Train));
    assert_eq!(a.split(Split::Val), b.split(Split::Val));
    let (xa, _) = a
        .windows(Split::Train, 3, 16, 1, 0, 2, &Device::Cpu)
        .unwrap();
    let (xb, _) = b
        .windows(Split::Train, 3, 16, 1, 0, 2, &Device::Cpu)
        .unwrap();
    assert_eq!(xa.to_vec2::<u32>().unwrap(), xb.to_vec2::<u32>().unwrap());

    let missing = dir.join("missing.txt");
    let e = TextCorpus::load(&missing).unwrap_err().to_string();
    assert!(e.contains("missing.txt"), "{e}");
    let corrupt = dir.join("corrupt.txt.gz");
    std::fs::write(&corrupt, [0x1f, 0x8b, 8, 0, 1, 2, 3]).unwrap();
    let e = TextCorpus::load(&corrupt).unwrap_err().to_string();
    assert!(e.contains("corrupt.txt.gz") && e.contains("gzip"), "{e}");
    let e = a
        .windows(Split::Val, 2, 100, 0, 0, 0, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("t.txt") && e.contains("validation split"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// The model.

fn plain(cfg: GptConfig) -> (Gpt, VarMap) {
    let vm = VarMap::new();
    let vb = seeded_var_builder(&vm, 0, DType::F32, &Device::Cpu);
    (Gpt::new(cfg, vb).unwrap(), vm)
}

fn ids(b: usize, t: usize, salt: u32) -> Tensor {
    let v: Vec<u32> = (0..(b * t) as u32)
        .map(|i| (i * 7919 + salt * 31) % 256)
        .collect();
    Tensor::from_vec(v, (b, t), &Device::Cpu).unwrap()
}

#[test]
fn parameter_count_and_tied_head() {
    for tied in [true, false] {
        let cfg = small(tied);
        let (_, vm) = plain(cfg);
        let n: usize = vm.all_vars().iter().map(|v| v.elem_count()).sum();
        assert_eq!(n, cfg.num_params(), "tied {tied}");
        let names: Vec<String> = vm.data().lock().unwrap().keys().cloned().collect();
        assert_eq!(
            names.iter().any(|n| n == "lm_head.weight"),
            !tied,
            "{names:?}"
        );
    }
    assert_eq!(GptConfig::benchmark().num_params(), 19_308_544);
}

#[test]
fn attention_is_causal() {
    let (m, _) = plain(small(true));
    let a = ids(2, 12, 0);
    // Change the last 4 tokens: the logits of the first 8 positions must not move.
    let b = Tensor::cat(&[a.narrow(1, 0, 8).unwrap(), ids(2, 4, 5)], 1).unwrap();
    let (la, lb) = (m.forward(&a).unwrap(), m.forward(&b).unwrap());
    assert_eq!(la.dims(), &[2, 12, 256]);
    let diff = (la.narrow(1, 0, 8).unwrap() - lb.narrow(1, 0, 8).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert_eq!(diff, 0.0);
    let later = (la.narrow(1, 8, 4).unwrap() - lb.narrow(1, 8, 4).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(later > 0.0);
    // At initialisation the loss is close to ln 256 = 5.545.
    let loss = lm_loss(&la, &ids(2, 12, 1))
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!((loss - 256f32.ln()).abs() < 0.1, "{loss}");
}

/// The fused GELU against Candle's (values and gradients), in f32 and bf16, on a
/// non-contiguous input.
#[test]
fn fused_gelu_matches_candle() {
    let x = Tensor::arange(-400i64, 400, &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .affine(0.02, 0.0)
        .unwrap()
        .reshape((20, 40))
        .unwrap()
        .t()
        .unwrap();
    // bf16: one unit in the last place at 8 is 1/16.
    for (dtype, tol) in [(DType::F32, 2e-6f32), (DType::BF16, 0.07)] {
        let v = candle_core::Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap();
        let w = Tensor::arange(0f32, 800., &Device::Cpu)
            .unwrap()
            .reshape((40, 20))
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let (a, b) = (gelu(v.as_tensor()).unwrap(), v.as_tensor().gelu().unwrap());
        let diff = |p: &Tensor, q: &Tensor| {
            (p.to_dtype(DType::F32).unwrap() - q.to_dtype(DType::F32).unwrap())
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        assert!(
            diff(&a, &b) <= tol,
            "{dtype:?}: values differ by {}",
            diff(&a, &b)
        );
        let ga = (a * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let gb = (b * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let (ga, gb) = (
            ga.get(v.as_tensor()).unwrap(),
            gb.get(v.as_tensor()).unwrap(),
        );
        // Relative to the gradient's scale (w up to 800).
        let rel = diff(ga, gb) / 800.0;
        assert!(
            rel <= tol,
            "{dtype:?}: gradients differ by {rel} (relative)"
        );
    }
}

#[test]
fn config_validation_names_the_value() {
    let e = GptConfig {
        n_head: 3,
        ..small(true)
    }
    .validate()
    .unwrap_err()
    .to_string();
    assert!(e.contains("n_head 3") && e.contains("d_model 32"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// FSDP: the units against the plain model, and a short training run.

fn fsdp_config(seed: u64) -> FsdpConfig {
    FsdpConfig {
        seed,
        ..Default::default()
    }
}

fn max_abs_diff(a: &[Vec<Vec<f32>>], b: &[Vec<Vec<f32>>]) -> f32 {
    a.iter()
        .flatten()
        .flatten()
        .zip(b.iter().flatten().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// At world size 2 the units give the plain model's logits, and after one SGD step on a batch
/// split over the ranks, the plain model's logits after the same step on the whole batch: the
/// names, the initial values and the gradients agree, the tied `wte.weight`'s being the sum of
/// its embedding and head uses; with the blocks checkpointed (recomputed in the backward) too.
#[test]
fn fsdp_units_match_the_plain_model_before_and_after_a_step() {
    for (tied, checkpointed) in [(true, false), (false, false), (true, true)] {
        let cfg = small(tied);
        let (reference, vm) = plain(cfg);
        let (x, y) = (ids(4, 16, 3), ids(4, 16, 4));
        let before = reference.forward(&x).unwrap().to_vec3::<f32>().unwrap();
        let loss = lm_loss(&reference.forward(&x).unwrap(), &y).unwrap();
        let mut sgd = <candle_nn::SGD as candle_nn::Optimizer>::new(vm.all_vars(), 0.5).unwrap();
        candle_nn::Optimizer::backward_step(&mut sgd, &loss).unwrap();
        let after = reference.forward(&x).unwrap().to_vec3::<f32>().unwrap();
        let got = launch(&Launcher::threads(2), |pg| {
            let rank = pg.rank();
            let gpt = FsdpGpt::new(cfg)?.with_activation_checkpointing(checkpointed);
            let mut model = gpt
                .add_units(FsdpModel::builder(pg, fsdp_config(0)))
                .build()?;
            let first = gpt.logits(&mut model, &x, false)?.to_vec3::<f32>()?;
            let logits = gpt.logits(&mut model, &x.narrow(0, 2 * rank, 2)?, true)?;
            model.backward(&lm_loss(&logits, &y.narrow(0, 2 * rank, 2)?)?)?;
            Sgd::new(SgdConfig {
                lr: 0.5,
                ..Default::default()
            })
            .step(&mut model)?;
            let second = gpt.logits(&mut model, &x, false)?.to_vec3::<f32>()?;
            Ok((first, second))
        })
        .unwrap();
        for (rank, (first, second)) in got.iter().enumerate() {
            let d0 = max_abs_diff(first, &before);
            let d1 = max_abs_diff(second, &after);
            assert!(
                d0 < 1e-5,
                "tied {tied}, checkpointed {checkpointed}, rank {rank}: before the step \
                 |fsdp - plain| {d0}"
            );
            assert!(
                d1 < 1e-4,
                "tied {tied}, checkpointed {checkpointed}, rank {rank}: after the step \
                 |fsdp - plain| {d1}"
            );
        }
        // The step moved the logits (the comparison above is not vacuous).
        assert!(max_abs_diff(&before, &after) > 1e-3);
    }
}

/// Over several steps the units keep matching the plain model where a group binds views
/// instead of variables (decision 66): from the second step on the blocks, whose parameters only
/// the one-node block reads, compute from views of the master shard where no group gathers
/// (world size 1, NO_SHARD) and of the gathered buffer otherwise (freed at reshard, the next
/// gather's buffer moved in); SGD steps on the batch split over the ranks must give the plain
/// model's logits after every step, for FULL_SHARD (also checkpointed: the block is built in the
/// recompute), SHARD_GRAD_OP, NO_SHARD and HYBRID_SHARD.
#[test]
fn views_of_the_shard_after_the_first_step_match_the_plain_model() {
    let cfg = small(false);
    let (x, y) = (ids(4, 16, 5), ids(4, 16, 6));
    let (reference, vm) = plain(cfg);
    let mut sgd = <candle_nn::SGD as candle_nn::Optimizer>::new(vm.all_vars(), 0.1).unwrap();
    let mut want = Vec::new();
    for _ in 0..4 {
        let loss = lm_loss(&reference.forward(&x).unwrap(), &y).unwrap();
        candle_nn::Optimizer::backward_step(&mut sgd, &loss).unwrap();
        want.push(reference.forward(&x).unwrap().to_vec3::<f32>().unwrap());
    }
    let strategies = [
        (1, ShardingStrategy::FullShard, false),
        (1, ShardingStrategy::FullShard, true),
        (2, ShardingStrategy::NoShard, false),
        (2, ShardingStrategy::FullShard, false),
        (2, ShardingStrategy::FullShard, true),
        (2, ShardingStrategy::ShardGradOp, false),
        (
            4,
            ShardingStrategy::HybridShard {
                shard_size: Some(2),
            },
            false,
        ),
    ];
    let mut unchecked = std::collections::HashMap::new();
    for (ws, strategy, checkpointed) in strategies {
        let got = launch(&Launcher::threads(ws), |pg| {
            let rank = pg.rank();
            let gpt = FsdpGpt::new(cfg)?.with_activation_checkpointing(checkpointed);
            let config = FsdpConfig {
                sharding_strategy: strategy,
                ..fsdp_config(0)
            };
            let mut model = gpt.add_units(FsdpModel::builder(pg, config)).build()?;
            let mut sgd = Sgd::new(SgdConfig {
                lr: 0.1,
                ..Default::default()
            });
            let per = 4 / ws;
            let mut after = Vec::new();
            for _ in 0..4 {
                let rows = |t: &Tensor| t.narrow(0, per * rank, per);
                let logits = gpt.logits(&mut model, &rows(&x)?, true)?;
                model.zero_grad();
                model.backward(&lm_loss(&logits, &rows(&y)?)?)?;
                sgd.step(&mut model)?;
                after.push(gpt.logits(&mut model, &x, false)?.to_vec3::<f32>()?);
            }
            Ok(after)
        })
        .unwrap();
        for (rank, steps) in got.iter().enumerate() {
            for (step, (g, w)) in steps.iter().zip(&want).enumerate() {
                let d = max_abs_diff(g, w);
                assert!(
                    d < 2e-4,
                    "world size {ws}, {strategy:?}, checkpointed {checkpointed}, rank {rank}, \
                     after step {}: |fsdp - plain| {d}",
                    step + 1
                );
            }
        }
        // A checkpointed block computes its forward with the node's kernel too (nothing tracks
        // gradients there), so the run is the unchecked run's, bit for bit.
        let key = (ws, format!("{strategy:?}"));
        if checkpointed {
            assert!(
                unchecked.get(&key) == Some(&got),
                "world size {ws}, {strategy:?}: checkpointed run differs from the unchecked one"
            );
        } else {
            unchecked.insert(key, got);
        }
    }
}

#[test]
fn trains_at_world_size_2_with_falling_loss() {
    let corpus = TextCorpus::load(CORPUS).unwrap();
    let cfg = small(true);
    let steps = 12u64;
    let losses = launch(&Launcher::threads(2), |pg| {
        let rank = pg.rank();
        let gpt = FsdpGpt::new(cfg)?;
        let mut model = gpt
            .add_units(FsdpModel::builder(pg, fsdp_config(0)))
            .build()?;
        let mut opt = AdamW::new(AdamWConfig {
            lr: 3e-3,
            beta2: 0.95,
            weight_decay: 0.1,
            ..Default::default()
        });
        let mut losses = Vec::new();
        for step in 0..steps {
            let (x, y) =
                corpus.windows(Split::Train, 8, cfg.seq_len, 0, rank, step, &Device::Cpu)?;
            let logits = gpt.logits(&mut model, &x, true)?;
            let loss = lm_loss(&logits, &y)?;
            model.backward(&loss)?;
            opt.step(&mut model)?;
            model.zero_grad();
            losses.push(loss.to_scalar::<f32>()?);
        }
        Ok(losses)
    })
    .unwrap();
    eprintln!("losses per rank: {losses:?}");
    for (rank, l) in losses.iter().enumerate() {
        assert!(l.iter().all(|v| v.is_finite()), "rank {rank}: {l:?}");
        let last3 = l[l.len() - 3..].iter().sum::<f32>() / 3.0;
        assert!(
            last3 < l[0] - 0.5,
            "rank {rank}: mean of the last 3 losses {last3} is not 0.5 below the first {}: {l:?}",
            l[0]
        );
    }
}

#[path = "../../examples/common/trace_window.rs"]
mod trace_window;

/// `--trace` in a run shorter than the warm-up (issue 20: `gpt --max-steps 5 --trace t.json
/// --trace-steps 2` trained and then failed with "no span was traced"): the window lies inside
/// the run whatever its length, and is the usual one in a long run.
#[test]
fn the_trace_window_lies_inside_any_run() {
    use trace_window::{trace_window, TRACE_WARMUP_STEPS};
    assert_eq!(trace_window(5, 2), 3..5);
    assert_eq!(trace_window(1, 4), 0..1);
    assert_eq!(
        trace_window(100, 4),
        TRACE_WARMUP_STEPS..TRACE_WARMUP_STEPS + 4
    );
    assert_eq!(
        trace_window(TRACE_WARMUP_STEPS + 4, 4),
        TRACE_WARMUP_STEPS..TRACE_WARMUP_STEPS + 4
    );
    assert!(trace_window(0, 4).is_empty());
    for steps in 1..40 {
        for n in 1..10 {
            let w = trace_window(steps, n);
            assert!(
                !w.is_empty() && w.end <= steps,
                "{steps} steps, {n} traced: {w:?}"
            );
            assert_eq!(w.len(), n.min(steps), "{steps} steps, {n} traced: {w:?}");
        }
    }
}
