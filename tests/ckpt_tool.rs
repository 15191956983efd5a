//! The `fsdp-ckpt` binary, run as a user runs it: `export` of a checkpoint saved at world size 3
//! loads in plain Candle with outputs bit-identical to FSDP at world size 2 (and is
//! byte-identical to `save_full`); `import` then training gives the first loss of
//! `build_from_full`; an offline `reshard` writes the files a live reshard writes; `inspect`
//! output on a known checkpoint; `verify` reporting every problem; each bad-input error; the
//! peak memory of `export`.

mod common;

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
        h = (u.ctor)(vb.pp(&u.name))?.forward_t(&h, false)?;
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
    // An import of the exported file gives back the same model; under NO_SHARD every unit is
    // one shard in rank 0's file.
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
