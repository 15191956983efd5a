//! Full (unsharded) state dicts: exact round trips at world sizes 1–4 (also loaded at another
//! world size), a plain candle program rebuilding the model from the file, an FSDP model built
//! from a pretrained file (f32 and bf16) reading only its own byte ranges, failed saves that
//! keep the previous file, and clear errors for bad files.

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_fsdp::checkpoint::{build_from_full, fault, load_full, save_full, FULL_FORMAT};
use candle_fsdp::comm::threads::{run_ranks, run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::ProcessGroup;
use candle_fsdp::optim::{AdamW, AdamWConfig, ShardedOptimizer};
use candle_fsdp::unit::UnitSpec;
use candle_fsdp::{FsdpConfig, FsdpModel};
use candle_nn::{VarBuilder, VarMap};
use common::*;

fn tmpdir(tag: &str) -> PathBuf {
    let d = common::tmpdir(&format!("full-{tag}"));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn specs() -> Vec<UnitSpec> {
    units_with_buffer()
}

fn config(seed: u64) -> FsdpConfig {
    FsdpConfig {
        seed,
        ..Default::default()
    }
}

fn model(pg: Arc<dyn ProcessGroup>, seed: u64) -> candle_fsdp::Result<FsdpModel> {
    let mut b = FsdpModel::builder(pg, config(seed));
    for u in specs() {
        b = b.unit_spec(u);
    }
    b.build()
}

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

fn train(model: &mut FsdpModel, data: &[(Tensor, Tensor)]) -> candle_fsdp::Result<()> {
    let mut opt = AdamW::new(AdamWConfig::default());
    let (rank, ws) = (
        model.process_group().rank(),
        model.process_group().world_size(),
    );
    for (x, y) in data {
        let n = x.dim(0)? / ws;
        let logits = model.forward(&x.narrow(0, rank * n, n)?)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &y.narrow(0, rank * n, n)?)?;
        model.backward(&loss)?;
        opt.step(model)?;
        model.zero_grad();
    }
    Ok(())
}

/// Gathered parameters and buffers as (name, f32 values).
fn gathered(model: &mut FsdpModel) -> candle_fsdp::Result<Vec<(String, Vec<f32>)>> {
    Ok(model
        .gather_full_params(false)?
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, to_vec(&t)))
        .collect())
}

/// Bytes of tensor data a rank must read to fill its shards (f32 elements of its shard table
/// times `elem` bytes) plus every buffer (f32).
fn own_bytes(model: &FsdpModel, elem: usize) -> u64 {
    let own: usize = model
        .shards()
        .map(|u| {
            u.layout
                .shard_table(u.shard_index)
                .iter()
                .map(|e| e.numel_in_shard)
                .sum::<usize>()
        })
        .sum();
    let bufs: usize = model
        .shards()
        .flat_map(|u| u.buffers)
        .map(|(_, v)| v.elem_count())
        .sum();
    (elem * own + elem * bufs) as u64
}

#[test]
fn full_round_trip_at_world_sizes_1_to_4() {
    for ws in 1..=4 {
        let dir = tmpdir(&format!("rt{ws}"));
        let path = dir.join("model.safetensors");
        let data = batches(2, 4 * ws, 21);
        let saved = run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
            let mut m = model(pg, 7)?;
            train(&mut m, &data)?;
            set_buffers(&m)?;
            let size = save_full(&path, &m)?;
            Ok((size, gathered(&mut m)?))
        })
        .unwrap();
        let (size, reference) = &saved[0];
        assert_eq!(*size, Some(std::fs::metadata(&path).unwrap().len()));
        assert!(saved[1..].iter().all(|s| s.0.is_none()));
        // The file holds exactly the gathered parameters and buffers, original names and
        // shapes, f32.
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(&path) }.unwrap();
        assert_eq!(st.tensors().len(), reference.len());
        for (name, values) in reference {
            let t = st.load(name, &Device::Cpu).unwrap();
            assert_eq!(t.dtype(), DType::F32, "{name}");
            assert_eq!(&to_vec(&t), values, "{name}");
        }
        let bytes = std::fs::read(&path).unwrap();
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let info = header.metadata().clone().unwrap();
        assert_eq!(info["format"], FULL_FORMAT);
        assert_eq!(info["dtype"], "F32");
        assert_eq!(
            header.info("fc1.weight").unwrap().shape,
            vec![13, 20],
            "original shape"
        );
        // Loaded into differently initialised models at this and at another world size, and
        // built from the file.
        for to in [ws, ws % 4 + 1] {
            let loaded = run_ranks_ok(to, ThreadGroupConfig::default(), |pg| {
                let mut m = model(pg.clone(), 99)?;
                let stats = load_full(&path, &mut m)?;
                assert_eq!(stats.files_opened, 1);
                assert_eq!(stats.data_bytes, own_bytes(&m, 4), "only its own ranges");
                let a = gathered(&mut m)?;
                let (mut b, stats) = build_from_full(pg, config(99), specs(), &path)?;
                assert_eq!(stats.data_bytes, own_bytes(&b, 4), "only its own ranges");
                Ok((a, gathered(&mut b)?))
            })
            .unwrap();
            for (r, (a, b)) in loaded.iter().enumerate() {
                assert_eq!(a, reference, "{ws} -> {to} rank {r}: load_full");
                assert_eq!(b, reference, "{ws} -> {to} rank {r}: build_from_full");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

fn plain_forward(vb: VarBuilder, x: &Tensor) -> candle_core::Result<Tensor> {
    let mut h = x.clone();
    for u in specs() {
        h = (u.ctor)(vb.pp(&u.name))?.forward1(&h, false)?;
    }
    Ok(h)
}

#[test]
fn plain_candle_rebuilds_the_model_from_the_full_file() {
    let dir = tmpdir("plain");
    let path = dir.join("model.safetensors");
    let data = batches(3, 8, 22);
    let x = &batches(1, 5, 23)[0].0;
    let fsdp_out = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg, 7)?;
        train(&mut m, &data)?;
        set_buffers(&m)?;
        save_full(&path, &m)?;
        Ok(to_vec(&m.forward_eval(x)?))
    })
    .unwrap()
    .remove(0);
    // A plain, unwrapped candle program: mmaped VarBuilder + the same constructors.
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[&path], DType::F32, &Device::Cpu) }.unwrap();
    let plain_out = to_vec(&plain_forward(vb, x).unwrap());
    assert_eq!(plain_out, fsdp_out);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A "pretrained" model made by plain candle (its own random init), saved with candle.
fn pretrained(dir: &Path) -> (VarMap, PathBuf) {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    for u in specs() {
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
    (varmap, path)
}

#[test]
fn fsdp_model_built_from_a_pretrained_file() {
    let dir = tmpdir("pretrained");
    let (varmap, path) = pretrained(&dir);
    let x = &batches(1, 6, 24)[0].0;
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let plain_out = to_vec(&plain_forward(vb, x).unwrap());
    let values: HashMap<String, Vec<f32>> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), to_vec(v.as_tensor())))
        .collect();
    for ws in 1..=3 {
        let outs = run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
            let (mut m, stats) = build_from_full(pg, config(0), specs(), &path)?;
            assert_eq!(stats.data_bytes, own_bytes(&m, 4), "only its own ranges");
            for (name, v) in gathered(&mut m)? {
                assert_eq!(v, values[&name], "{name}");
            }
            Ok(to_vec(&m.forward_eval(x)?))
        })
        .unwrap();
        for o in outs {
            assert_eq!(o, plain_out, "ws {ws}");
        }
    }
    // A bf16 file is converted to f32 on read.
    let bf16: HashMap<String, Tensor> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().to_dtype(DType::BF16).unwrap()))
        .collect();
    let bf16_path = dir.join("pretrained-bf16.safetensors");
    candle_core::safetensors::save(&bf16, &bf16_path).unwrap();
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let (mut m, stats) = build_from_full(pg, config(0), specs(), &bf16_path)?;
        assert_eq!(stats.data_bytes, own_bytes(&m, 2), "only its own ranges");
        for (name, v) in gathered(&mut m)? {
            assert_eq!(v, to_vec(&bf16[&name].to_dtype(DType::F32)?), "{name}");
        }
        Ok(())
    })
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_failed_full_save_keeps_the_previous_file() {
    let dir = tmpdir("failsave");
    let path = dir.join("model.safetensors");
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        save_full(&path, &model(pg, 7)?)
    })
    .unwrap();
    let before = std::fs::read(&path).unwrap();
    for crash in [false, true] {
        let results = run_ranks(2, ThreadGroupConfig::default(), |pg| {
            let m = model(pg.clone(), 8)?;
            if pg.rank() == 0 {
                fault::fail_writes_after(before.len() as u64 / 2, crash);
            }
            let r = save_full(&path, &m);
            fault::disarm();
            r
        });
        assert!(results.iter().all(|r| r.is_err()), "{results:?}");
        let e = results[0].as_ref().unwrap_err().to_string();
        assert!(
            e.contains("model.safetensors") && e.contains("injected"),
            "{e}"
        );
        assert_eq!(
            std::fs::read(&path).unwrap(),
            before,
            "previous file intact"
        );
        let left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n != "model.safetensors")
            .collect();
        // An error removes the temporary file; a crash leaves it, under a hidden name.
        assert_eq!(left.len(), usize::from(crash), "{left:?}");
        run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
            load_full(&path, &mut model(pg, 9)?)
        })
        .unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The error of loading `path` with `load_full` (rank 0 of 2) and of `build_from_full`.
fn errors(path: &Path) -> (String, String) {
    let a = run_ranks(2, ThreadGroupConfig::default(), |pg| {
        load_full(path, &mut model(pg, 0)?).map(|_| ())
    })
    .remove(0)
    .unwrap_err()
    .to_string();
    let b = run_ranks(2, ThreadGroupConfig::default(), |pg| {
        build_from_full(pg, config(0), specs(), path).map(|_| ())
    })
    .remove(0)
    .unwrap_err()
    .to_string();
    (a, b)
}

#[test]
fn bad_full_files_give_errors_naming_file_tensor_and_values() {
    let dir = tmpdir("bad");
    let (varmap, good) = pretrained(&dir);
    let tensors: HashMap<String, Tensor> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect();
    let write = |name: &str, edit: &dyn Fn(&mut HashMap<String, Tensor>)| -> PathBuf {
        let mut t = tensors.clone();
        edit(&mut t);
        let p = dir.join(name);
        candle_core::safetensors::save(&t, &p).unwrap();
        p
    };
    let check = |path: &Path, needles: &[&str]| {
        let (a, b) = errors(path);
        for e in [a, b] {
            for n in needles {
                assert!(e.contains(n), "{n:?} not in: {e}");
            }
        }
    };
    // Missing file.
    check(
        &dir.join("nope.safetensors"),
        &["nope.safetensors", "No such file"],
    );
    // Truncated file.
    let bytes = std::fs::read(&good).unwrap();
    let cut = dir.join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() - 10]).unwrap();
    check(&cut, &["cut.safetensors", "corrupt or truncated"]);
    std::fs::write(&cut, &bytes[..5]).unwrap();
    check(
        &cut,
        &["cut.safetensors", "corrupt or truncated", "5 bytes"],
    );
    // Corrupt header.
    let mut garbled = bytes.clone();
    garbled[8..20].copy_from_slice(b"garbage!!!!!");
    let bad = dir.join("garbled.safetensors");
    std::fs::write(&bad, &garbled).unwrap();
    check(&bad, &["garbled.safetensors", "corrupt"]);
    // A parameter missing.
    let p = write("missing.safetensors", &|t| {
        t.remove("head.bias");
    });
    check(
        &p,
        &[
            "missing.safetensors",
            "missing from the file",
            "head.bias",
            "shape [3]",
        ],
    );
    // An extra tensor.
    let p = write("extra.safetensors", &|t| {
        t.insert(
            "head.gamma".into(),
            Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap(),
        );
    });
    check(
        &p,
        &[
            "extra.safetensors",
            "not parameters or buffers",
            "head.gamma (F32, shape [4])",
        ],
    );
    // A shape mismatch.
    let p = write("shape.safetensors", &|t| {
        let w = t["head.weight"].t().unwrap().contiguous().unwrap();
        t.insert("head.weight".into(), w);
    });
    check(
        &p,
        &[
            "shape.safetensors",
            "head.weight",
            "expected shape [3, 7]",
            "found [7, 3]",
        ],
    );
    // A dtype mismatch.
    let p = write("dtype.safetensors", &|t| {
        let b = t["head.bias"].to_dtype(DType::I64).unwrap();
        t.insert("head.bias".into(), b);
    });
    check(
        &p,
        &[
            "dtype.safetensors",
            "head.bias",
            "expected dtype F32",
            "found I64",
        ],
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_full_file_is_byte_identical_whatever_the_world_size_and_strategy() {
    use candle_fsdp::ShardingStrategy::*;
    let dir = tmpdir("identical");
    let mut files = Vec::new();
    for (i, (ws, strategy)) in [
        (1, FullShard),
        (3, FullShard),
        (2, NoShard),
        (2, ShardGradOp),
    ]
    .into_iter()
    .enumerate()
    {
        let path = dir.join(format!("{i}.safetensors"));
        run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
            let mut b = FsdpModel::builder(
                pg,
                FsdpConfig {
                    seed: 7,
                    sharding_strategy: strategy,
                    ..Default::default()
                },
            );
            for u in specs() {
                b = b.unit_spec(u);
            }
            save_full(&path, &b.build()?)
        })
        .unwrap();
        files.push(std::fs::read(&path).unwrap());
    }
    for (i, f) in files.iter().enumerate() {
        assert!(f == &files[0], "file {i} differs from file 0");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
