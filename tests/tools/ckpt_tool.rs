//! The `fsdp-ckpt` binary, run as a user runs it: `export` of a checkpoint saved at world size 3
//! loads in plain Candle with outputs bit-identical to FSDP at world size 2 (and is
//! byte-identical to `save_full`); `import` then training gives the first loss of
//! `build_from_full`; an offline `reshard` writes the files a live reshard writes; `inspect`
//! output on a known checkpoint; `verify` reporting every problem; each bad-input error; the
//! peak memory of `export`; version-1 checkpoints.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_fsdp::checkpoint::{
    build_from_full, load_latest, load_sharded, save_full, save_sharded, RngState, SamplerState,
    TrainState,
};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::ProcessGroup;
use candle_fsdp::optim::{AdamW, AdamWConfig, OptimizerState, ShardedOptimizer};
use candle_fsdp::{FsdpConfig, FsdpModel, ShardingStrategy};
use candle_nn::{VarBuilder, VarMap};
use common::*;

const BIN: &str = env!("CARGO_BIN_EXE_fsdp-ckpt");

/// Runs `fsdp-ckpt args…`; returns (exit code, stdout, stderr).
fn ckpt(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN)
        .args(args)
        .output()
        .expect("runs fsdp-ckpt");
    (
        out.status.code().expect("exited"),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// Runs `fsdp-ckpt args…` and expects success; returns stdout.
fn ckpt_ok(args: &[&str]) -> String {
    let (code, out, err) = ckpt(args);
    assert_eq!(code, 0, "fsdp-ckpt {args:?} failed:\n{out}\n{err}");
    out
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn tmp(tag: &str) -> PathBuf {
    let d = tmpdir(&format!("tool-{tag}"));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn model(
    pg: Arc<dyn ProcessGroup>,
    seed: u64,
    strategy: ShardingStrategy,
) -> candle_fsdp::Result<FsdpModel> {
    let mut b = FsdpModel::builder(
        pg,
        FsdpConfig {
            seed,
            sharding_strategy: strategy,
            ..Default::default()
        },
    );
    for u in units_with_buffer() {
        b = b.unit_spec(u);
    }
    b.build()
}

/// Sets every buffer to values that depend on its name only (as training would change them).
fn set_buffers(model: &FsdpModel) -> candle_fsdp::Result<()> {
    for u in model.shards() {
        for (name, var) in u.buffers {
            let v: Vec<f32> = (0..var.elem_count())
                .map(|i| 0.01 * (i + name.len()) as f32)
                .collect();
            var.set(&Tensor::from_vec(v, var.shape(), &Device::Cpu)?)?;
        }
    }
    Ok(())
}

/// Trains on `data` (each rank its slice of every global batch); returns each step's loss.
fn train(
    model: &mut FsdpModel,
    opt: &mut AdamW,
    data: &[(Tensor, Tensor)],
) -> candle_fsdp::Result<Vec<f32>> {
    let (rank, ws) = (
        model.process_group().rank(),
        model.process_group().world_size(),
    );
    let mut losses = Vec::new();
    for (x, y) in data {
        let n = x.dim(0)? / ws;
        let logits = model.forward(&x.narrow(0, rank * n, n)?)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &y.narrow(0, rank * n, n)?)?;
        losses.push(loss.to_scalar::<f32>()?);
        model.backward(&loss)?;
        opt.step(model)?;
        model.zero_grad();
    }
    Ok(losses)
}

/// A checkpoint of the test model trained `steps` steps at `ws` (AdamW state, buffers set),
/// saved under `root` at step `steps`.
fn trained_checkpoint(root: &Path, ws: usize, strategy: ShardingStrategy, steps: usize) -> PathBuf {
    let data = batches(steps, 12, 31);
    run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg, 7, strategy)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        train(&mut m, &mut opt, &data)?;
        set_buffers(&m)?;
        let state = TrainState {
            step: steps as u64,
            epoch: 1,
            sampler: Some(SamplerState {
                epoch: 1,
                position: 4,
                world_size: ws,
            }),
            rng: Some(RngState { seed: 7 }),
            ..Default::default()
        };
        save_sharded(root, &m, &opt, &state, 0)
    })
    .unwrap()
    .remove(0)
}

fn plain_forward(vb: VarBuilder, x: &Tensor) -> candle_core::Result<Tensor> {
    let mut h = x.clone();
    for u in units_with_buffer() {
        h = (u.ctor)(vb.pp(&u.name))?.forward1(&h, false)?;
    }
    Ok(h)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn export_of_a_ws3_checkpoint_loads_in_plain_candle_bit_identical_to_fsdp_at_ws2() {
    let dir = tmp("export");
    let ckpt_dir = trained_checkpoint(&dir.join("ckpt"), 3, ShardingStrategy::FullShard, 2);
    let out = dir.join("model.safetensors");
    let printed = ckpt_ok(&["export", s(&ckpt_dir), "--out", s(&out)]);
    let size = std::fs::metadata(&out).unwrap().len();
    assert_eq!(
        printed,
        format!(
            "exported {} to {}: 8 tensors, {size} bytes (largest tensor 1040 bytes)\n",
            ckpt_dir.display(),
            out.display()
        )
    );
    // FSDP at world size 2: the checkpoint loaded (a live reshard 3 → 2), evaluated; and the
    // library's own full save of that model.
    let x = &batches(1, 5, 32)[0].0;
    let library_full = dir.join("library.safetensors");
    let fsdp_out = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg, 99, ShardingStrategy::FullShard)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        load_sharded(&ckpt_dir, &mut m, &mut opt)?;
        save_full(&library_full, &m)?;
        Ok(to_vec(&m.forward_eval(x)?))
    })
    .unwrap()
    .remove(0);
    // A plain, unwrapped Candle program.
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[&out], DType::F32, &Device::Cpu) }.unwrap();
    let plain_out = to_vec(&plain_forward(vb, x).unwrap());
    assert_eq!(bits(&plain_out), bits(&fsdp_out));
    assert_eq!(
        std::fs::read(&out).unwrap(),
        std::fs::read(&library_full).unwrap(),
        "export is byte-identical to save_full"
    );
    // --dtype bf16 / f16: every tensor is Candle's own conversion of the f32 one.
    let f32s = candle_core::safetensors::load(&out, &Device::Cpu).unwrap();
    for (flag, dtype, meta) in [("bf16", DType::BF16, "BF16"), ("f16", DType::F16, "F16")] {
        let path = dir.join(format!("model-{flag}.safetensors"));
        ckpt_ok(&[
            "export",
            s(&dir.join("ckpt")),
            "--out",
            s(&path),
            "--dtype",
            flag,
        ]);
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(header.metadata().as_ref().unwrap()["dtype"], meta);
        assert_eq!(st.len(), f32s.len());
        for (name, t) in &f32s {
            let view = st.tensor(name).unwrap();
            assert_eq!(view.shape(), t.dims(), "{name}");
            let want = t.to_dtype(dtype).unwrap();
            let want: Vec<u8> = match dtype {
                DType::BF16 => want
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<half::bf16>()
                    .unwrap()
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
                _ => want
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<half::f16>()
                    .unwrap()
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            };
            assert_eq!(view.data(), &want[..], "{flag} {name}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A "pretrained" model made by plain Candle (its own random init; VarMap saves its tensors in
/// hash order, not model order), with the buffer set.
fn pretrained(dir: &Path) -> PathBuf {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    for u in units_with_buffer() {
        (u.ctor)(vb.pp(&u.name)).unwrap();
    }
    varmap
        .data()
        .lock()
        .unwrap()
        .get("shift.running_mean")
        .unwrap()
        .set(&Tensor::new(&[0.5f32, -0.25, 0.125, 1.0, 2.0, -1.0, 0.0], &Device::Cpu).unwrap())
        .unwrap();
    let path = dir.join("pretrained.safetensors");
    varmap.save(&path).unwrap();
    path
}

#[test]
fn import_then_training_gives_the_first_loss_of_build_from_full() {
    let dir = tmp("import");
    let file = pretrained(&dir);
    let root = dir.join("imported");
    let printed = ckpt_ok(&["import", s(&file), "--out", s(&root), "--world-size", "3"]);
    let step0 = root.join("step-00000000");
    assert_eq!(
        printed,
        format!(
            "imported {} to {} (world size 3)\n",
            file.display(),
            step0.display()
        )
    );
    let data = batches(2, 8, 33);
    let config = FsdpConfig::default();
    // Reference: the model built straight from the file, at world size 2.
    let (want_losses, want_params) = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let (mut m, _) = build_from_full(pg, config.clone(), units_with_buffer(), &file)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        let losses = train(&mut m, &mut opt, &data)?;
        Ok((losses, m.gather_full_params(false)?))
    })
    .unwrap()
    .remove(0);
    // The imported checkpoint (world size 3) resumed at world size 2, as `--resume` does.
    let (losses, params) = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg, 12345, ShardingStrategy::FullShard)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        let loaded = load_latest(&root, &mut m, &mut opt)?.expect("a checkpoint");
        assert_eq!(loaded.dir, step0);
        assert_eq!((loaded.meta.train.step, loaded.meta.world_size), (0, 3));
        let losses = train(&mut m, &mut opt, &data)?;
        Ok((losses, m.gather_full_params(false)?))
    })
    .unwrap()
    .remove(0);
    assert_eq!(bits(&losses), bits(&want_losses), "losses");
    let (params, want_params) = (params.unwrap(), want_params.unwrap());
    assert_eq!(params.len(), want_params.len());
    for ((n, t), (wn, wt)) in params.iter().zip(&want_params) {
        assert_eq!(n, wn);
        assert_eq!(bits(&to_vec(t)), bits(&to_vec(wt)), "{n} after 2 steps");
    }
    // Under NO_SHARD every unit is one shard in rank 0's file; exported back, the model is the
    // file's, value for value.
    let root2 = dir.join("imported-no-shard");
    ckpt_ok(&[
        "import",
        s(&file),
        "--out",
        s(&root2),
        "--world-size",
        "2",
        "--strategy",
        "no-shard",
    ]);
    let meta = candle_fsdp::checkpoint::read_meta(&root2.join("step-00000000")).unwrap();
    assert_eq!(meta.strategy.as_deref(), Some("no-shard"));
    assert!(meta.units.iter().all(|u| u.world_size == 1));
    let exported = dir.join("back.safetensors");
    ckpt_ok(&["export", s(&root2), "--out", s(&exported)]);
    let a = candle_core::safetensors::load(&exported, &Device::Cpu).unwrap();
    let b = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
    assert_eq!(a.len(), b.len());
    for (name, t) in &b {
        assert_eq!(bits(&to_vec(&a[name])), bits(&to_vec(t)), "{name}");
    }
    // A bf16 model file: parameters imported as f32 masters (exact widening), buffers kept in
    // their dtype; exported back as saved.
    let bf16 = dir.join("bf16.safetensors");
    ckpt_ok(&["export", s(&root), "--out", s(&bf16), "--dtype", "bf16"]);
    let root3 = dir.join("imported-bf16");
    ckpt_ok(&["import", s(&bf16), "--out", s(&root3), "--world-size", "2"]);
    let widened = dir.join("widened.safetensors");
    ckpt_ok(&["export", s(&root3), "--out", s(&widened)]);
    let a = candle_core::safetensors::load(&widened, &Device::Cpu).unwrap();
    assert_eq!(a.len(), b.len());
    for (name, t) in &b {
        let dtype = if name.ends_with("running_mean") {
            DType::BF16
        } else {
            DType::F32
        };
        assert_eq!(a[name].dtype(), dtype, "{name}");
        let want = t.to_dtype(DType::BF16).unwrap();
        assert_eq!(bits(&to_vec(&a[name])), bits(&to_vec(&want)), "{name}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every file of two checkpoint directories, by name.
fn files_of(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

type Loaded = (Vec<Vec<f32>>, OptimizerState, Vec<(String, Vec<f32>)>);

fn load_at(dir: &Path, ws: usize, strategy: ShardingStrategy) -> Vec<Loaded> {
    run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg, 99, strategy)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        load_sharded(dir, &mut m, &mut opt)?;
        let bufs = m
            .shards()
            .flat_map(|u| {
                u.buffers
                    .iter()
                    .map(|(n, v)| (n.clone(), to_vec(v.as_tensor())))
            })
            .collect();
        Ok((
            m.shards().map(|u| to_vec(u.param)).collect(),
            opt.state()?,
            bufs,
        ))
    })
    .unwrap()
}

fn reshard_case(from: usize, to: usize, strategy: ShardingStrategy) {
    let dir = tmp(&format!("reshard-{from}-{to}"));
    let ckpt_dir = trained_checkpoint(&dir.join("ckpt"), from, strategy, 2);
    // Offline.
    let offline_root = dir.join("offline");
    let printed = ckpt_ok(&[
        "reshard",
        s(&ckpt_dir),
        "--world-size",
        &to.to_string(),
        "--out",
        s(&offline_root),
    ]);
    let offline = offline_root.join("step-00000002");
    assert_eq!(
        printed,
        format!(
            "resharded {} to {} (world size {to})\n",
            ckpt_dir.display(),
            offline.display()
        )
    );
    // Live: load at the new world size, save the loaded state.
    let live_root = dir.join("live");
    let live = run_ranks_ok(to, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg, 99, strategy)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        let loaded = load_sharded(&ckpt_dir, &mut m, &mut opt)?;
        save_sharded(&live_root, &m, &opt, &loaded.meta.train, 0)
    })
    .unwrap()
    .remove(0);
    let (a, b) = (files_of(&offline), files_of(&live));
    assert_eq!(
        a.iter().map(|(n, _)| n).collect::<Vec<_>>(),
        b.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        if name == "meta.json" {
            // Equal but for the save time, which each records as its own.
            let parse = |bytes: &[u8]| {
                let mut v: serde_json::Value = serde_json::from_slice(bytes).unwrap();
                let t = v.as_object_mut().unwrap().remove("saved_at_unix_ms");
                assert!(t.is_some_and(|t| t.as_u64().is_some()), "a save time");
                v
            };
            assert!(
                parse(x) == parse(y),
                "{from} → {to} {strategy:?}: meta.json differs"
            );
            continue;
        }
        assert!(x == y, "{from} → {to} {strategy:?}: {name} differs");
    }
    // And loading the offline result equals loading the original at the new world size.
    let (x, y) = (
        load_at(&offline, to, strategy),
        load_at(&ckpt_dir, to, strategy),
    );
    assert_eq!(x, y, "{from} → {to} {strategy:?}: loaded state");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn offline_reshard_writes_what_a_live_reshard_writes() {
    reshard_case(3, 2, ShardingStrategy::FullShard);
    reshard_case(2, 4, ShardingStrategy::ShardGradOp);
    reshard_case(1, 3, ShardingStrategy::FullShard);
    reshard_case(2, 3, ShardingStrategy::NoShard);
}

/// `fsdp-ckpt inspect` on a checkpoint whose every number is known: the test model (8
/// tensors, 396 parameter elements) trained 3 steps at world size 2 under SHARD_GRAD_OP with
/// AdamW, saved with a sampler position and a seed. Optimizer state: 2 kinds × 6 units (empty
/// ones included) × 2 ranks = 24 tensors of the padded unit sizes 274 + 100 + 28 + 2 = 404
/// elements, 2 × 404 × 4 = 3232 bytes. The shard files' sizes are pinned by the format
/// (deterministic headers) and checked against `meta.json` too; `meta.json`'s own size is read
/// from the disk, because it holds each tensor's CRC-32C as a decimal number whose width
/// depends on the trained values (and so on the CPU's matmul kernels).
#[test]
fn inspect_output_on_a_known_checkpoint() {
    let dir = tmp("inspect");
    let ckpt_dir = trained_checkpoint(&dir, 2, ShardingStrategy::ShardGradOp, 3);
    let out = ckpt_ok(&["inspect", s(&dir)]);
    let saved_at = candle_fsdp::checkpoint::read_meta(&ckpt_dir)
        .unwrap()
        .saved_at_unix_ms
        .expect("a save time");
    let meta_bytes = std::fs::metadata(ckpt_dir.join("meta.json")).unwrap().len();
    let want = r#"checkpoint DIR
  format version    3
  run id            none
  saved at          SAVED ms after the Unix epoch
  step              3
  epochs completed  1
  world size        2
  strategy          shard-grad-op
  master dtype      F32
  frozen base       none
  mixed precision   {"buffer_dtype":"f32","cast_forward_inputs":true,"param_dtype":"f32","reduce_dtype":"f32"}
  sampler           epoch 1, 4 entries of each rank's list consumed at world size 2
  seed              7
  lr scheduler      none
  grad scaler       none
  extra             none
  optimizer         AdamW (groups: default lr 0.001); step 3; 24 tensors, 3232 bytes over all ranks
tensors (parameters: 7 tensors, 396 elements, 1584 bytes; buffers: 1 tensor, 7 elements, 28 bytes):
  fc1.weight          [13, 20]  F32   1040 bytes
  fc1.bias            [13]      F32     52 bytes
  fc2.weight          [7, 13]   F32    364 bytes
  fc2.bias            [7]       F32     28 bytes
  shift.running_mean  [7]       F32     28 bytes  buffer
  head.weight         [3, 7]    F32     84 bytes
  head.bias           [3]       F32     12 bytes
  scale.w             [1]       F32      4 bytes
files:
  meta.json                         META bytes
  shard-00000-of-00002.safetensors  3916 bytes
  shard-00001-of-00002.safetensors  3808 bytes
total on disk: TOTAL bytes (12.5 KiB)
"#
    .replace("DIR", s(&ckpt_dir))
    .replace("SAVED", &saved_at.to_string())
    .replace("META", &meta_bytes.to_string())
    .replace("TOTAL", &(meta_bytes + 3916 + 3808).to_string());
    assert_eq!(out, want);
    let meta = candle_fsdp::checkpoint::read_meta(&ckpt_dir).unwrap();
    let sizes: Vec<u64> = meta.files.iter().map(|f| f.bytes).collect();
    assert_eq!(sizes, [3916, 3808]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `fsdp-ckpt args…`, expects exit status 1 and one error line; returns it without the
/// `fsdp-ckpt: error: ` prefix.
fn ckpt_err(args: &[&str]) -> String {
    let (code, out, err) = ckpt(args);
    assert_eq!(code, 1, "fsdp-ckpt {args:?} should fail:\n{out}\n{err}");
    assert_eq!(out, "", "{args:?}");
    err.strip_prefix("fsdp-ckpt: error: ")
        .and_then(|e| e.strip_suffix('\n'))
        .unwrap_or_else(|| panic!("{args:?}: unexpected stderr {err:?}"))
        .to_string()
}

/// Byte range of tensor `name`'s data in safetensors file `path`.
fn data_range(path: &Path, name: &str) -> std::ops::Range<usize> {
    let bytes = std::fs::read(path).unwrap();
    let (n, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let (a, b) = header.info(name).unwrap().data_offsets;
    8 + n + a..8 + n + b
}

/// Rewrites one shard file without tensor `drop` (and records its new size in `meta.json`).
fn drop_tensor(ckpt: &Path, file: &str, drop: &str) {
    let path = ckpt.join(file);
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let tensors: Vec<_> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != drop)
        .collect();
    let out = safetensors::serialize(tensors, header.metadata().clone()).unwrap();
    std::fs::write(&path, &out).unwrap();
    let meta_path = ckpt.join("meta.json");
    let mut meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&meta_path).unwrap()).unwrap();
    for f in meta["files"].as_array_mut().unwrap() {
        if f["name"] == file {
            f["bytes"] = serde_json::json!(out.len());
        }
    }
    std::fs::write(&meta_path, serde_json::to_vec_pretty(&meta).unwrap()).unwrap();
}

#[test]
fn bad_input_gives_errors_naming_the_file_and_the_problem() {
    let dir = tmp("bad");
    let out = dir.join("out.safetensors");
    let o = s(&out);
    let r = s(&dir);
    // A missing directory, a file, an empty directory, one with only an interrupted save.
    let missing = dir.join("missing");
    let empty = dir.join("empty");
    std::fs::create_dir_all(empty.join(".step-00000005.partial")).unwrap();
    std::fs::create_dir_all(dir.join("empty2")).unwrap();
    let file = dir.join("file.txt");
    std::fs::write(&file, "not a checkpoint").unwrap();
    let m = s(&missing);
    for args in [
        vec!["inspect", m],
        vec!["export", m, "--out", o],
        vec!["reshard", m, "--world-size", "2", "--out", r],
        vec!["verify", m],
    ] {
        assert_eq!(
            ckpt_err(&args),
            format!("{m}: no such directory"),
            "{args:?}"
        );
    }
    assert_eq!(
        ckpt_err(&["export", s(&file), "--out", o]),
        format!(
            "{}: not a directory: expected a checkpoint directory (holding meta.json) or a \
             checkpoint root (holding step-N directories)",
            file.display()
        )
    );
    assert_eq!(
        ckpt_err(&["inspect", s(&dir.join("empty2"))]),
        format!(
            "{}: not a checkpoint: no meta.json in it and no complete checkpoint \
             (step-N/meta.json) under it",
            dir.join("empty2").display()
        )
    );
    assert_eq!(
        ckpt_err(&["verify", s(&empty)]),
        format!(
            "{}: not a checkpoint: no meta.json in it and no complete checkpoint \
             (step-N/meta.json) under it; interrupted saves found (no meta.json written): \
             .step-00000005.partial",
            empty.display()
        )
    );
    // Damaged metadata.
    let bad_meta = dir.join("bad-meta");
    std::fs::create_dir_all(&bad_meta).unwrap();
    std::fs::write(bad_meta.join("meta.json"), "{not json").unwrap();
    assert_eq!(
        ckpt_err(&["inspect", s(&bad_meta)]),
        format!(
            "{}: not valid checkpoint metadata (JSON): key must be a string at line 1 column 2",
            bad_meta.join("meta.json").display()
        )
    );
    // Damaged shard files: truncated, a corrupt header of the recorded size, missing.
    let ckpt_dir = trained_checkpoint(&dir.join("ckpt"), 2, ShardingStrategy::FullShard, 1);
    let f1 = ckpt_dir.join("shard-00001-of-00002.safetensors");
    let good = std::fs::read(&f1).unwrap();
    std::fs::write(&f1, &good[..good.len() - 10]).unwrap();
    assert_eq!(
        ckpt_err(&["export", s(&ckpt_dir), "--out", o]),
        format!(
            "{}: truncated or corrupt: expected {} bytes (as recorded in meta.json), found {}",
            f1.display(),
            good.len(),
            good.len() - 10
        )
    );
    let mut corrupt = good.clone();
    corrupt[8..12].copy_from_slice(b"oops");
    std::fs::write(&f1, &corrupt).unwrap();
    let e = ckpt_err(&["reshard", s(&ckpt_dir), "--world-size", "3", "--out", r]);
    assert!(
        e.starts_with(&format!(
            "{}: corrupt or truncated safetensors file: invalid JSON in header: ",
            f1.display()
        )),
        "{e}"
    );
    std::fs::remove_file(&f1).unwrap();
    assert_eq!(
        ckpt_err(&["export", s(&ckpt_dir), "--out", o]),
        format!("{}: No such file or directory (os error 2)", f1.display())
    );
    std::fs::write(&f1, &good).unwrap();
    // A tensor the metadata lists, missing from its file.
    drop_tensor(&ckpt_dir, "shard-00000-of-00002.safetensors", "param.1");
    assert_eq!(
        ckpt_err(&["export", s(&ckpt_dir), "--out", o]),
        format!(
            "{}: tensor param.1 is missing (expected F32 of shape [137])",
            ckpt_dir.join("shard-00000-of-00002.safetensors").display()
        )
    );
    assert!(!out.exists(), "nothing written on error");
    // Outputs: a directory that does not exist; a checkpoint that already exists.
    let ok_dir = trained_checkpoint(&dir.join("ok"), 2, ShardingStrategy::FullShard, 1);
    let nowhere = dir.join("nowhere").join("model.safetensors");
    assert_eq!(
        ckpt_err(&["export", s(&ok_dir), "--out", s(&nowhere)]),
        format!(
            "{}: No such file or directory (os error 2)",
            nowhere.display()
        )
    );
    // A file that exists is not replaced without --overwrite (its bytes stay), then is.
    let kept = dir.join("kept.safetensors");
    std::fs::write(&kept, "the user's own file").unwrap();
    assert_eq!(
        ckpt_err(&["export", s(&ok_dir), "--out", s(&kept)]),
        format!(
            "{}: exists: an export does not replace a file unless given --overwrite",
            kept.display()
        )
    );
    assert_eq!(std::fs::read(&kept).unwrap(), b"the user's own file");
    ckpt_ok(&["export", s(&ok_dir), "--out", s(&kept), "--overwrite"]);
    assert!(candle_core::safetensors::load(&kept, &Device::Cpu).is_ok());
    assert!(ckpt_err(&[
        "export",
        s(&ok_dir),
        "--out",
        s(&dir),
        "--format",
        "hf",
        "--overwrite"
    ])
    .contains("--overwrite applies to --format safetensors only"));
    std::fs::remove_file(&kept).unwrap();
    assert_eq!(
        ckpt_err(&["export", s(&ok_dir), "--out", s(&dir)]),
        format!(
            "{}: is a directory: --out names the file to write (e.g. DIR/model.safetensors)",
            dir.display()
        )
    );
    assert_eq!(
        ckpt_err(&[
            "reshard",
            s(&ok_dir),
            "--world-size",
            "3",
            "--out",
            s(&dir.join("ok"))
        ]),
        format!(
            "{}: already exists: remove it or choose another output directory",
            ok_dir.display()
        )
    );
    assert_eq!(
        ckpt_err(&["reshard", s(&ok_dir), "--world-size", "0", "--out", r]),
        "invalid argument: world size must be at least 1, found 0"
    );
    // Import: a missing file, a directory, not safetensors, an integer tensor.
    assert_eq!(
        ckpt_err(&["import", m, "--out", r, "--world-size", "2"]),
        format!("{m}: No such file or directory (os error 2)")
    );
    assert_eq!(
        ckpt_err(&["import", r, "--out", r, "--world-size", "2"]),
        format!("{r}: is a directory: expected a safetensors model file")
    );
    let e = ckpt_err(&["import", s(&file), "--out", r, "--world-size", "2"]);
    assert!(
        e.starts_with(&format!(
            "{}: corrupt or truncated safetensors file: ",
            file.display()
        )),
        "{e}"
    );
    let ints = dir.join("ints.safetensors");
    let t = Tensor::new(&[1i64, 2], &Device::Cpu).unwrap();
    let w = Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
    candle_core::safetensors::save(
        &std::collections::HashMap::from([
            ("bn.num_batches_tracked".to_string(), t),
            ("bn.weight".to_string(), w),
        ]),
        &ints,
    )
    .unwrap();
    assert_eq!(
        ckpt_err(&["import", s(&ints), "--out", r, "--world-size", "2"]),
        format!(
            "{}: tensor bn.num_batches_tracked: expected a float dtype (F32, BF16, F16, F64), \
             found I64 (a model file holds float parameters and buffers only)",
            ints.display()
        )
    );
    // Nothing was left behind by the failed writes.
    let mut left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(
        left,
        [
            "bad-meta",
            "ckpt",
            "empty",
            "empty2",
            "file.txt",
            "ints.safetensors",
            "ok"
        ]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn verify_reports_every_problem_and_exits_non_zero() {
    let dir = tmp("verify");
    let ckpt_dir = trained_checkpoint(&dir, 3, ShardingStrategy::FullShard, 1);
    // Sound: every tensor read (6 units × (param + 2 optimizer kinds) × 3 ranks + 1 buffer).
    let (code, out, _) = ckpt(&["verify", s(&dir)]);
    let data: u64 = (0..3)
        .map(|r| {
            let f = ckpt_dir.join(format!("shard-0000{r}-of-00003.safetensors"));
            let bytes = std::fs::read(&f).unwrap();
            let (n, _) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
            (bytes.len() - 8 - n) as u64
        })
        .sum();
    assert_eq!(
        (code, out),
        (
            0,
            format!(
                "checkpoint {}: 3 shard files, 55 tensors, {data} bytes of tensor data read\n\
                 no problem found\n",
                ckpt_dir.display()
            )
        )
    );
    // Three problems in three files: a NaN in a parameter shard (same size), a missing
    // optimizer tensor, a truncated file. At world size 3, fc1's 273 elements are shards of 91,
    // fc2's 99 of 33. The truncated file is not read; the other two are, all but the missing
    // tensor (35 tensors).
    let f0 = ckpt_dir.join("shard-00000-of-00003.safetensors");
    let f1 = ckpt_dir.join("shard-00001-of-00003.safetensors");
    let f2 = ckpt_dir.join("shard-00002-of-00003.safetensors");
    let mut bytes = std::fs::read(&f2).unwrap();
    let range = data_range(&f2, "param.2");
    let at = range.start + 5 * 4;
    bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&f2, &bytes).unwrap();
    // The NaN also changes the tensor's CRC-32C from the one recorded at save time.
    let recorded =
        candle_fsdp::checkpoint::read_meta(&ckpt_dir).unwrap().files[2].crc32c["param.2"];
    let now = crc32c::crc32c(&bytes[range]);
    drop_tensor(
        &ckpt_dir,
        "shard-00001-of-00003.safetensors",
        "optim.exp_avg.1",
    );
    let good = std::fs::read(&f0).unwrap();
    std::fs::write(&f0, &good[..100]).unwrap();
    let (code, out, _) = ckpt(&["verify", s(&ckpt_dir)]);
    assert_eq!(code, 1, "{out}");
    let data_left = data - (good.len() as u64) + 8 + {
        let (n, _) = safetensors::SafeTensors::read_metadata(&good).unwrap();
        n as u64
    } - 4 * 91;
    assert_eq!(
        out,
        format!(
            "checkpoint {}: 2 shard files, 35 tensors, {data_left} bytes of tensor data read\n\
             problem: {}: truncated or corrupt: expected {} bytes (as recorded in meta.json), \
             found 100\n\
             problem: {}: tensor optim.exp_avg.1 is missing (expected F32 of shape [91])\n\
             problem: {}: tensor param.2: 1 non-finite value(s) of 33 (the first, NaN, at \
             element 5)\n\
             problem: {}: tensor param.2: CRC-32C {now:08x} of its data differs from the \
             {recorded:08x} recorded in meta.json (the data changed after the save)\n\
             4 problems found\n",
            ckpt_dir.display(),
            f0.display(),
            good.len(),
            f1.display(),
            f2.display(),
            f2.display(),
        )
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The bytes the data of [`synthetic_full`]'s file repeats (256 KiB of finite f32 values).
#[cfg(target_os = "linux")]
fn pattern() -> Vec<u8> {
    (0..1 << 16)
        .flat_map(|i: u32| ((i % 1999) as f32 * 1e-3 - 1.0).to_le_bytes())
        .collect()
}

/// Writes a full model file of `layers` × (`l<i>.weight` [d, d], `l<i>.bias` [d]) in f32,
/// streamed ([`pattern`] repeated); returns (bytes of the largest tensor, file size, where
/// the data starts).
#[cfg(target_os = "linux")]
fn synthetic_full(path: &Path, layers: usize, d: usize) -> (u64, u64, u64) {
    use std::io::Write;
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    let mut tensors = Vec::new();
    for i in 0..layers {
        for (name, shape) in [
            (format!("l{i}.weight"), vec![d, d]),
            (format!("l{i}.bias"), vec![d]),
        ] {
            let n = shape.iter().product::<usize>() * 4;
            header.insert(
                name,
                serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + n]}),
            );
            tensors.push(n);
            offset += n;
        }
    }
    let mut json = serde_json::to_vec(&header).unwrap();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    f.write_all(&(json.len() as u64).to_le_bytes()).unwrap();
    f.write_all(&json).unwrap();
    let chunk = pattern();
    let mut left = offset;
    while left > 0 {
        let n = left.min(chunk.len());
        f.write_all(&chunk[..n]).unwrap();
        left -= n;
    }
    f.flush().unwrap();
    let start = (8 + json.len()) as u64;
    (
        *tensors.iter().max().unwrap() as u64,
        start + offset as u64,
        start,
    )
}

/// Runs `fsdp-ckpt args…` as a child and returns its peak resident set size in bytes
/// (`ru_maxrss` of that child alone, from `wait4`).
#[cfg(target_os = "linux")]
#[allow(clippy::zombie_processes)] // reaped by `wait4` below, which also gives its rusage
fn peak_rss_of(args: &[&str]) -> u64 {
    use std::io::Read;
    let mut child = Command::new(BIN)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (mut out, mut err) = (String::new(), String::new());
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let mut status = 0;
    // SAFETY: plain FFI call with valid out-pointers; `child` is our own, not yet reaped.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as i32, "wait4");
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "fsdp-ckpt {args:?} failed:\n{out}\n{err}"
    );
    usage.ru_maxrss as u64 * 1024
}

/// Imports a synthetic `layers × Linear(d, d)` model at world size 3, exports it back, checks
/// the tensor data came back unchanged and returns the peak RSS of import and export, the largest tensor and
/// the model file's size (bytes).
#[cfg(target_os = "linux")]
fn export_peak(tag: &str, layers: usize, d: usize) -> (u64, u64, u64, u64) {
    let dir = tmp(tag);
    let file = dir.join("model.safetensors");
    let (largest, size, data_start) = synthetic_full(&file, layers, d);
    let root = dir.join("ckpt");
    let import = peak_rss_of(&["import", s(&file), "--out", s(&root), "--world-size", "3"]);
    // The model file is no longer needed: at most two copies of the model on disk at once.
    std::fs::remove_file(&file).unwrap();
    let out = dir.join("exported.safetensors");
    let export = peak_rss_of(&["export", s(&root), "--out", s(&out)]);
    // The same tensor data, byte for byte.
    {
        use std::io::{Read, Seek, SeekFrom};
        let mut f = std::fs::File::open(&out).unwrap();
        let mut n = [0u8; 8];
        f.read_exact(&mut n).unwrap();
        let start = 8 + u64::from_le_bytes(n);
        let len = std::fs::metadata(&out).unwrap().len() - start;
        assert_eq!(len, size - data_start, "data size");
        f.seek(SeekFrom::Start(start)).unwrap();
        let want = pattern();
        let mut got = vec![0u8; want.len()];
        let mut left = len as usize;
        while left > 0 {
            let n = left.min(want.len());
            f.read_exact(&mut got[..n]).unwrap();
            assert!(got[..n] == want[..n], "exported data differs");
            left -= n;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    (import, export, largest, size)
}

/// The peak memory of `export` (and of `import`) of a ≥ 100 M-parameter checkpoint stays below
/// twice its largest tensor plus a constant (16 MiB): 10 × Linear(3200, 3200), 102.4 M
/// parameters, 409.7 MB, largest tensor 40.96 MB, saved at world size 3. Holding the model, or
/// reading it through a memory map, would exceed the bound (97.9 MiB) four times over. About
/// 1.2 GB of disk writes, 0.8 GB on disk at once; `--nocapture` prints the figures.
#[cfg(target_os = "linux")]
#[test]
fn export_memory_of_a_100m_parameter_checkpoint() {
    let t = std::time::Instant::now();
    let (import, export, largest, size) = export_peak("mem-100m", 10, 3200);
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!(
        "100M-parameter model ({:.1} MiB, largest tensor {:.1} MiB): peak RSS import {:.1} MiB, \
         export {:.1} MiB ({:.1} s in all)",
        mib(size),
        mib(largest),
        mib(import),
        mib(export),
        t.elapsed().as_secs_f64()
    );
    let bound = 2 * largest + (16 << 20);
    assert!(4 * bound < size);
    assert!(export < bound, "export peak RSS {export} ≥ {bound}");
    assert!(import < bound, "import peak RSS {import} ≥ {bound}");
}

/// Version-1 checkpoints (no strategy, no optimizer list, no file sizes in `meta.json`): export,
/// reshard and verify give what they give for the same checkpoint in version 2; inspect finds
/// the optimizer from the files.
#[test]
fn version_1_checkpoints_work_too() {
    let dir = tmp("v1");
    let data = batches(2, 8, 6);
    let v2 = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut b = FsdpModel::builder(pg, FsdpConfig::default());
        for u in units() {
            b = b.unit_spec(u);
        }
        let mut m = b.build()?;
        let mut opt = AdamW::new(AdamWConfig::default());
        train(&mut m, &mut opt, &data)?;
        save_sharded(
            &dir.join("v2"),
            &m,
            &opt,
            &TrainState {
                step: 2,
                ..Default::default()
            },
            0,
        )
    })
    .unwrap()
    .remove(0);
    // The same files with meta.json as version 1 wrote it.
    let v1 = dir.join("v1").join("step-00000002");
    std::fs::create_dir_all(&v1).unwrap();
    for f in [
        "shard-00000-of-00002.safetensors",
        "shard-00001-of-00002.safetensors",
    ] {
        std::fs::copy(v2.join(f), v1.join(f)).unwrap();
    }
    let meta = candle_fsdp::checkpoint::read_meta(&v2).unwrap();
    let json = serde_json::json!({
        "format_version": 1,
        "world_size": 2,
        "step": 2,
        "epoch": 0,
        "units": meta.units.iter().map(|u| serde_json::json!({
            "name": u.name,
            "padded_numel": u.padded_numel,
            "shard_numel": u.shard_numel,
            "params": u.params.iter().map(|p| serde_json::json!({
                "name": p.name, "shape": p.shape, "offset": p.offset,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "extra": {},
    });
    std::fs::write(
        v1.join("meta.json"),
        serde_json::to_vec_pretty(&json).unwrap(),
    )
    .unwrap();
    let (a, b) = (dir.join("a.safetensors"), dir.join("b.safetensors"));
    ckpt_ok(&["export", s(&v2), "--out", s(&a)]);
    ckpt_ok(&["export", s(&v1), "--out", s(&b)]);
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    let (r2, r1) = (dir.join("r2"), dir.join("r1"));
    ckpt_ok(&["reshard", s(&v2), "--world-size", "3", "--out", s(&r2)]);
    ckpt_ok(&["reshard", s(&v1), "--world-size", "3", "--out", s(&r1)]);
    let (f2, f1) = (
        files_of(&r2.join("step-00000002")),
        files_of(&r1.join("step-00000002")),
    );
    let shards = |f: &[(String, Vec<u8>)]| -> Vec<(String, Vec<u8>)> {
        f.iter()
            .filter(|(n, _)| n != "meta.json")
            .cloned()
            .collect()
    };
    assert_eq!(shards(&f1).len(), 3);
    assert!(shards(&f1) == shards(&f2), "resharded shard files differ");
    // 5 units × (param + 2 optimizer kinds) × 2 files, read whole in both versions.
    let out = ckpt_ok(&["verify", s(&v1)]);
    assert_eq!(
        out.replace(s(&v1), "DIR"),
        ckpt_ok(&["verify", s(&v2)]).replace(s(&v2), "DIR")
    );
    assert!(out.contains(": 2 shard files, 30 tensors, "), "{out}");
    assert!(out.ends_with("\nno problem found\n"), "{out}");
    let out = ckpt_ok(&["inspect", s(&v1)]);
    assert!(
        out.contains(
            "  strategy          not recorded (full-shard or shard-grad-op: parameters sharded)\n"
        ),
        "{out}"
    );
    assert!(
        out.contains("  optimizer         AdamW (exp_avg, exp_avg_sq); step 2; 20 tensors, "),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A flipped bit that leaves a finite value (the low mantissa bit of one element) is found by
/// the tensor's CRC-32C alone.
#[test]
fn verify_finds_a_flipped_bit_by_its_checksum() {
    let dir = tmp("verify-bit");
    let ckpt_dir = trained_checkpoint(&dir, 2, ShardingStrategy::FullShard, 1);
    let f1 = ckpt_dir.join("shard-00001-of-00002.safetensors");
    let mut bytes = std::fs::read(&f1).unwrap();
    let at = data_range(&f1, "param.1").start + 3 * 4;
    bytes[at] ^= 1;
    std::fs::write(&f1, &bytes).unwrap();
    let (code, out, _) = ckpt(&["verify", s(&ckpt_dir)]);
    assert_eq!(code, 1, "{out}");
    let problems: Vec<&str> = out.lines().filter(|l| l.starts_with("problem: ")).collect();
    assert_eq!(problems.len(), 1, "{out}");
    assert!(
        problems[0].starts_with(&format!(
            "problem: {}: tensor param.1: CRC-32C ",
            f1.display()
        )) && problems[0].ends_with("recorded in meta.json (the data changed after the save)"),
        "{out}"
    );
    // `export` and `reshard` refuse it before writing anything, rather than carrying the
    // flipped bit into files with fresh checksums that would then verify clean.
    let out_file = dir.join("model.safetensors");
    let e = ckpt_err(&["export", s(&ckpt_dir), "--out", s(&out_file)]);
    assert!(
        e.contains(&format!("{}: tensor param.1: CRC-32C ", f1.display())),
        "{e}"
    );
    assert!(!out_file.exists(), "nothing written");
    let out_root = dir.join("resharded");
    let e = ckpt_err(&[
        "reshard",
        s(&ckpt_dir),
        "--world-size",
        "3",
        "--out",
        s(&out_root),
    ]);
    assert!(e.contains("tensor param.1: CRC-32C "), "{e}");
    assert!(
        candle_fsdp::checkpoint::list_complete(&out_root)
            .unwrap()
            .is_empty(),
        "no checkpoint written"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `export` refuses an output inside the checkpoint it reads (it would overwrite a shard), and
/// `verify` reports a negative Adam second moment (with the checksum it breaks).
#[test]
fn export_into_the_checkpoint_and_negative_second_moments_are_caught() {
    let dir = tmp("export-into");
    let ckpt_dir = trained_checkpoint(&dir, 2, ShardingStrategy::FullShard, 1);
    let shard = ckpt_dir.join("shard-00000-of-00002.safetensors");
    let before = std::fs::read(&shard).unwrap();
    let (code, _, err) = ckpt(&["export", s(&dir), "--out", s(&shard)]);
    assert_ne!(code, 0);
    assert!(
        err.contains(&format!(
            "{}: is inside the checkpoint being exported ({}): choose an output outside it",
            shard.display(),
            ckpt_dir.display()
        )),
        "{err}"
    );
    assert_eq!(std::fs::read(&shard).unwrap(), before, "shard untouched");

    let mut bytes = before.clone();
    let at = data_range(&shard, "optim.exp_avg_sq.1").start + 2 * 4;
    bytes[at..at + 4].copy_from_slice(&(-1.0f32).to_le_bytes());
    std::fs::write(&shard, &bytes).unwrap();
    let (code, out, _) = ckpt(&["verify", s(&ckpt_dir)]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(
            "tensor optim.exp_avg_sq.1: 1 negative value(s) of 137 in a second moment, which \
             cannot be negative (the first, -1, at element 2)"
        ),
        "{out}"
    );
    assert!(out.contains("tensor optim.exp_avg_sq.1: CRC-32C "), "{out}");
    assert!(out.ends_with("2 problems found\n"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--max-shard-size` and `--hf-config` belong to `--format hf`: given to the single-file export
/// they are refused, naming the flag (they were ignored without a word), and nothing is
/// written; `--max-shard-size 0` is clap's error naming the flag (it was the library's
/// `max_shard_bytes must be at least 1`).
#[test]
fn hf_only_export_flags_are_refused_elsewhere_and_zero_shard_size_named() {
    let root = tmp("hf-only-flags");
    let dir = trained_checkpoint(&root.join("ckpt"), 2, ShardingStrategy::FullShard, 1);
    let out = root.join("model.safetensors");
    for (flag, value) in [("--max-shard-size", "1000"), ("--hf-config", "config.json")] {
        let (code, _, err) = ckpt(&["export", s(&dir), "--out", s(&out), flag, value]);
        assert_eq!(code, 1, "{err}");
        assert!(
            err.contains(&format!("{flag} applies to --format hf only")),
            "{err}"
        );
        assert!(!out.exists());
    }
    let (code, _, err) = ckpt(&[
        "export",
        s(&dir),
        "--format",
        "hf",
        "--out",
        s(&root.join("hf")),
        "--max-shard-size",
        "0",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--max-shard-size"), "{err}");
    assert!(!root.join("hf").exists());
    let _ = std::fs::remove_dir_all(&root);
}
