//! Run fingerprints (`FsdpConfig::fingerprint`, issue 35 part 3): the records are the CRC-32C
//! of the values they name (parameters gathered at step 0 = the full model's, the shard after
//! each step = the rank's shard); two runs of one job are identical; a one-bit change in one
//! rank's gradient at step 3 is named exactly by the fingerprint diff (step, unit, phase, rank)
//! and by the checkpoint diff (tensor, element, rank); bad files are named.

use crate::common;

use std::path::{Path, PathBuf};

use candle_core::Tensor;
use candle_fsdp::checkpoint::save_sharded;
use candle_fsdp::checkpoint::tools::diff_checkpoints;
use candle_fsdp::checkpoint::TrainState;
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::fsdp::fingerprint::{self, fault, FingerprintRecord};
use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, FsdpModel, ShardedOptimizer};
use common::{batches, units};

const STEPS: usize = 4;

fn crc(tensors: &[&Tensor]) -> (u32, u64) {
    let mut acc = (0u32, 0u64);
    for t in tensors {
        let bytes: Vec<u8> = t
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        acc = (
            crc32c::crc32c_append(acc.0, &bytes),
            acc.1 + bytes.len() as u64,
        );
    }
    acc
}

/// What a rank computed itself: the step-0 full parameters (name, tensor) and, per step, each
/// unit's shard after the optimizer step (unit name, crc, bytes).
type Seen = (Vec<(String, Tensor)>, Vec<Vec<(String, (u32, u64))>>);

/// `STEPS` AdamW steps at world size 2 with a fingerprint to `fp` (and a flipped bit at step 3
/// on rank 1 with `flip`), then a sharded save to `ckpt`.
fn run(fp: &Path, ckpt: &Path, flip: bool) -> Vec<Seen> {
    let data = batches(STEPS, 8, 35);
    let (fp, ckpt) = (fp.to_path_buf(), ckpt.to_path_buf());
    run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
        let config = FsdpConfig {
            fingerprint: Some(fp.clone()),
            ..Default::default()
        };
        let mut m = FsdpModel::builder(pg.clone(), config)
            .units(units())
            .build()?;
        let mut opt = AdamW::new(AdamWConfig::default());
        let rank = pg.rank();
        if flip && rank == 1 {
            fault::flip_gradient_bit(3, "fc2", 5, 30);
        }
        let initial = m.gather_full_params(false)?.expect("every rank");
        let mut shards = Vec::new();
        for b in &data {
            let n = b.0.dim(0)? / 2;
            let logits = m.forward(&b.0.narrow(0, rank * n, n)?)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &b.1.narrow(0, rank * n, n)?)?;
            m.backward(&loss)?;
            opt.step(&mut m)?;
            m.zero_grad();
            shards.push(
                m.shards()
                    .map(|u| (u.unit_name.to_string(), crc(&[u.param])))
                    .collect(),
            );
        }
        let state = TrainState {
            step: STEPS as u64,
            ..Default::default()
        };
        save_sharded(&ckpt, &m, &opt, &state, 0)?;
        Ok((initial, shards))
    })
    .unwrap()
}

fn find<'a>(
    recs: &'a [FingerprintRecord],
    step: u64,
    unit: &str,
    phase: &str,
    rank: usize,
) -> &'a FingerprintRecord {
    recs.iter()
        .find(|r| r.step == step && r.unit == unit && r.phase == phase && r.rank == rank)
        .unwrap_or_else(|| panic!("no record step {step} {unit} {phase} rank {rank}"))
}

fn paths(root: &Path, tag: &str) -> (PathBuf, PathBuf) {
    (
        root.join(format!("{tag}.fp")),
        root.join(format!("{tag}-ckpt")),
    )
}

#[test]
fn records_are_the_checksums_of_the_values_and_a_flipped_bit_is_named() {
    let root = common::tmpdir("fingerprint");
    std::fs::create_dir_all(&root).unwrap();
    let (fa, ca) = paths(&root, "a");
    let (fb, cb) = paths(&root, "b");
    let (fc, cc) = paths(&root, "flip");
    let seen = run(&fa, &ca, false);
    run(&fb, &cb, false);
    run(&fc, &cc, true);
    let a = fingerprint::read(&fa).unwrap();
    assert_eq!(a.world_size, 2);

    // Step 0's gathered parameters are the full model's, on every rank.
    let (initial, shards) = &seen[0];
    for unit in ["fc1", "fc2", "head", "scale"] {
        let params: Vec<&Tensor> = initial
            .iter()
            .filter(|(n, _)| n.starts_with(&format!("{unit}.")))
            .map(|(_, t)| t)
            .collect();
        assert!(!params.is_empty(), "{unit}");
        let (c, bytes) = crc(&params);
        for rank in 0..2 {
            let r = find(&a.records, 0, unit, "params", rank);
            assert_eq!((r.crc32c, r.bytes), (c, bytes), "{unit} rank {rank}");
        }
    }
    // A unit without parameters records nothing.
    assert!(!a.records.iter().any(|r| r.unit == "flatten"));
    // The shard after each step is the rank's shard.
    for (rank, (_, shards_r)) in seen.iter().enumerate() {
        for (step, units) in shards_r.iter().enumerate() {
            for (unit, (c, bytes)) in units.iter().filter(|(u, _)| u != "flatten") {
                let r = find(&a.records, step as u64, unit, "shard", rank);
                assert_eq!(
                    (r.crc32c, r.bytes),
                    (*c, *bytes),
                    "step {step} {unit} {rank}"
                );
            }
        }
    }
    // Every phase of every step, both ranks: 4 units x (params, reduce-in, reduce-out, shard).
    assert_eq!(a.records.len(), STEPS * 2 * 4 * 4, "{:?}", a.records);
    let _ = shards;

    // The same job twice: identical, record for record.
    let same = fingerprint::diff(&fa, &fb).unwrap();
    assert!(same.identical(), "{same}");
    assert_eq!(same.compared, a.records.len());
    assert!(
        same.to_string().starts_with("fingerprints identical"),
        "{same}"
    );
    let same = diff_checkpoints(&ca, &cb).unwrap();
    assert!(same.identical(), "{same}");

    // One bit of rank 1's fc2 gradient at step 3 (the exponent's highest: a zero becomes 2, any
    // other value grows 2^128-fold; a low mantissa bit of a zero gradient would vanish in the
    // optimizer's moments): the first difference is exactly there.
    let d = fingerprint::diff(&fa, &fc).unwrap();
    let first = d.first().expect("a difference");
    assert_eq!(
        (
            first.step,
            first.unit.as_str(),
            first.phase.as_str(),
            first.rank
        ),
        (3, "fc2", "reduce-in", 1),
        "{d}"
    );
    assert!(
        d.to_string()
            .starts_with("first difference: step 3, unit fc2, phase reduce-in, rank 1"),
        "{d}"
    );
    // Nothing before it; after it, fc2's reduced gradient and shard on rank 0, which owns
    // element 5 of fc2's flat buffer, and nothing else (the run ends at step 3).
    let places: Vec<(u64, &str, &str, usize)> = d
        .differences
        .iter()
        .map(|(x, _)| {
            let r = x.as_ref().unwrap();
            (r.step, r.unit.as_str(), r.phase.as_str(), r.rank)
        })
        .collect();
    assert_eq!(
        places,
        [
            (3, "fc2", "reduce-in", 1),
            (3, "fc2", "reduce-out", 0),
            (3, "fc2", "shard", 0)
        ],
        "{d}"
    );

    // The checkpoints: fc2.weight element [0, 5] in rank 0's shard, its value and moments.
    let c = diff_checkpoints(&ca, &cc).unwrap();
    assert!(!c.identical());
    // (tensor, phase, rank, first differing element, elements that differ)
    type Row<'a> = (&'a str, &'a str, usize, Option<Vec<usize>>, usize);
    let tensors: Vec<Row> = c
        .differences
        .iter()
        .map(|t| {
            (
                t.tensor.as_str(),
                t.phase.as_str(),
                t.rank,
                t.first.as_ref().map(|f| f.0.clone()),
                t.differing,
            )
        })
        .collect();
    assert_eq!(
        tensors,
        [
            ("fc2.weight", "param", 0, Some(vec![0, 5]), 1),
            ("fc2.weight", "exp_avg", 0, Some(vec![0, 5]), 1),
            ("fc2.weight", "exp_avg_sq", 0, Some(vec![0, 5]), 1),
        ],
        "{c}"
    );
    let (_, x, y) = c.differences[0].first.clone().unwrap();
    assert_ne!(x.to_bits(), y.to_bits());
    assert!(
        c.differences[0].max_abs > 0.0 && c.differences[0].max_abs < 1.0,
        "{c}"
    );
    assert!(
        c.to_string().contains(
            "\nfirst difference: step 4, unit fc2, phase param, rank 0: tensor fc2.weight, \
             element [0, 5]"
        ),
        "{c}"
    );
    assert!(c.to_string().starts_with("comparing "), "{c}");
}

#[test]
fn a_resumed_run_is_compared_on_the_steps_both_recorded() {
    let root = common::tmpdir("fingerprint-steps");
    std::fs::create_dir_all(&root).unwrap();
    let write = |name: &str, body: &str| {
        let p = root.join(name);
        std::fs::write(
            &p,
            format!("{}\n# world_size 1\n{body}", fingerprint::FORMAT_LINE),
        )
        .unwrap();
        p
    };
    let full = write(
        "full.fp",
        "0\tfc1\tparams\t0\t0000000a\t8\n1\tfc1\tparams\t0\t0000000b\t8\n2\tfc1\tparams\t0\t0000000c\t8\n",
    );
    let resumed = write(
        "resumed.fp",
        "1\tfc1\tparams\t0\t0000000b\t8\n2\tfc1\tparams\t0\t0000000c\t8\n",
    );
    let d = fingerprint::diff(&full, &resumed).unwrap();
    assert!(d.identical(), "{d}");
    assert_eq!(d.compared, 2);
    assert_eq!(d.only_a.iter().copied().collect::<Vec<_>>(), [0]);
    let text = d.to_string();
    assert!(
        text.contains("steps 1..=2") && text.contains("only the first file has step 0"),
        "{text}"
    );

    let other = write("other.fp", "2\tfc1\tparams\t0\t0000000d\t8\n");
    let d = fingerprint::diff(&full, &other).unwrap();
    assert_eq!(
        d.first().unwrap().to_string(),
        "step 2, unit fc1, phase params, rank 0"
    );
    assert!(
        d.to_string()
            .contains("crc32c 0000000c (8 bytes) vs crc32c 0000000d (8 bytes)"),
        "{d}"
    );
    // Records in another order within a step are matched by place.
    let reordered = write(
        "reordered.fp",
        "0\tfc2\tparams\t0\t00000001\t8\n0\tfc1\tparams\t0\t0000000a\t8\n",
    );
    let d = fingerprint::diff(&full, &reordered).unwrap();
    assert_eq!(d.differing, 1, "{d}");
    assert_eq!(d.differences[0].0, None, "{d}");
    assert_eq!(d.differences[0].1.as_ref().unwrap().unit, "fc2", "{d}");
}

#[test]
fn a_file_that_is_not_a_fingerprint_is_named_with_its_line() {
    let root = common::tmpdir("fingerprint-bad");
    std::fs::create_dir_all(&root).unwrap();
    let p = root.join("x.fp");
    std::fs::write(&p, "hello\n").unwrap();
    let e = fingerprint::read(&p).unwrap_err().to_string();
    assert!(
        e.contains("x.fp") && e.contains("line 1") && e.contains("not a fingerprint file"),
        "{e}"
    );
    std::fs::write(
        &p,
        format!(
            "{}\n# world_size 2\n0\tfc1\tparams\t0\tzz\t8\n",
            fingerprint::FORMAT_LINE
        ),
    )
    .unwrap();
    let e = fingerprint::read(&p).unwrap_err().to_string();
    assert!(e.contains("line 3") && e.contains("bad crc32c"), "{e}");
    std::fs::write(
        &p,
        format!(
            "{}\n# world_size 2\n0\tfc1\tparams\n",
            fingerprint::FORMAT_LINE
        ),
    )
    .unwrap();
    let e = fingerprint::read(&p).unwrap_err().to_string();
    assert!(
        e.contains("line 3") && e.contains("6 tab-separated fields"),
        "{e}"
    );
    // What a file written by a run cannot hold, each named with its line.
    let body = |records: &str| format!("{}\n# world_size 2\n{records}", fingerprint::FORMAT_LINE);
    let one = "0\tfc1\tparams\t0\t0000000a\t8\n";
    for (records, what, line) in [
        (format!("{one}{one}"), "appears twice", 4),
        (
            format!("{one}{}", body(one)),
            "a header line among the records",
            4,
        ),
        (
            format!("{one}1\tfc1\tparams\t0\t0000000a\t8\n{one}"),
            "steps out of order",
            5,
        ),
        (
            "0\tfc1\tparams\t2\t0000000a\t8\n".to_string(),
            "rank 2 in a file of world size 2",
            3,
        ),
        (
            "0\tfc1\tbogus\t0\t0000000a\t8\n".to_string(),
            "unknown phase",
            3,
        ),
        (
            "0\tfc1\tparams#0\t0\t0000000a\t8\n".to_string(),
            "unknown phase",
            3,
        ),
    ] {
        std::fs::write(&p, body(&records)).unwrap();
        let e = fingerprint::read(&p).unwrap_err().to_string();
        assert!(
            e.contains(what) && e.contains(&format!("line {line}:")) && e.contains("x.fp"),
            "{what}: {e}"
        );
    }
    std::fs::write(&p, format!("{}\n{one}", fingerprint::FORMAT_LINE)).unwrap();
    let e = fingerprint::read(&p).unwrap_err().to_string();
    assert!(e.contains("before the `# world_size` line"), "{e}");
    let e = fingerprint::read(&root.join("missing.fp"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing.fp"), "{e}");
    // A fingerprint path in a directory that does not exist fails the build, naming it.
    let e = run_ranks_ok(1, ThreadGroupConfig::default(), {
        let p = root.join("no-such-dir").join("x.fp");
        move |pg| {
            let config = FsdpConfig {
                fingerprint: Some(p.clone()),
                ..Default::default()
            };
            Ok(FsdpModel::builder(pg, config)
                .units(units())
                .build()
                .err()
                .map(|e| e.to_string()))
        }
    })
    .unwrap();
    let e = e[0].clone().expect("refused");
    assert!(
        e.contains("no-such-dir") && e.contains("fingerprint file"),
        "{e}"
    );
}

/// A step the grad scaler skips (an infinite loss at step 1) is a step of the fingerprint: its
/// shards are the step before's, the next steps keep their numbers and no phase repeats; a
/// file already at the path is kept as `path.1`; a loaded checkpoint sets the next step's
/// number to its training step.
#[test]
fn skipped_steps_are_steps_and_an_earlier_file_is_kept() {
    use candle_fsdp::checkpoint::load_sharded;
    use candle_fsdp::grad_scaler::{GradScalerConfig, ShardedGradScaler};
    let root = common::tmpdir("fingerprint-skip");
    std::fs::create_dir_all(&root).unwrap();
    let fp = root.join("run.fp");
    std::fs::write(&fp, "an earlier run\n").unwrap();
    let data = batches(3, 8, 5);
    let (f, ckpt) = (fp.clone(), root.join("ckpt"));
    run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
        let config = FsdpConfig {
            fingerprint: Some(f.clone()),
            ..Default::default()
        };
        let mut m = FsdpModel::builder(pg.clone(), config.clone())
            .units(units())
            .build()?;
        let mut opt = AdamW::new(AdamWConfig::default());
        let mut scaler = ShardedGradScaler::new(GradScalerConfig::default())?;
        let rank = pg.rank();
        let mut skipped = Vec::new();
        for (s, b) in data.iter().enumerate() {
            let n = b.0.dim(0)? / 2;
            let mut x = b.0.narrow(0, rank * n, n)?;
            if s == 1 {
                x = (x * f64::INFINITY)?;
            }
            let logits = m.forward(&x)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &b.1.narrow(0, rank * n, n)?)?;
            m.backward(&scaler.scale_loss(&loss)?)?;
            skipped.push(!scaler.step(&mut m, &mut opt)?);
            m.zero_grad();
        }
        assert_eq!(skipped, [false, true, false]);
        let state = TrainState {
            step: 3,
            ..Default::default()
        };
        let dir = save_sharded(&ckpt, &m, &opt, &state, 0)?;
        // A run resumed from it numbers its first step 3.
        let mut m2 = FsdpModel::builder(pg, config).units(units()).build()?;
        let mut opt2 = AdamW::new(AdamWConfig::default());
        load_sharded(&dir, &mut m2, &mut opt2)?;
        let b = &data[2];
        let n = b.0.dim(0)? / 2;
        let logits = m2.forward(&b.0.narrow(0, rank * n, n)?)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &b.1.narrow(0, rank * n, n)?)?;
        m2.backward(&loss)?;
        opt2.step(&mut m2)?;
        Ok(())
    })
    .unwrap();
    // The first run's file was kept aside when the second model was built, and the file that
    // was there before either as run.fp.1.
    assert_eq!(
        std::fs::read_to_string(root.join("run.fp.1")).unwrap(),
        "an earlier run\n"
    );
    let first = fingerprint::read(&root.join("run.fp.2")).unwrap();
    let steps: Vec<u64> = first.records.iter().map(|r| r.step).collect();
    assert_eq!(steps.iter().max(), Some(&2));
    assert!(
        first.records.iter().all(|r| !r.phase.contains('#')),
        "{:?}",
        first.records
    );
    for unit in ["fc1", "fc2", "head", "scale"] {
        for rank in 0..2 {
            let s0 = find(&first.records, 0, unit, "shard", rank);
            let s1 = find(&first.records, 1, unit, "shard", rank);
            let s2 = find(&first.records, 2, unit, "shard", rank);
            assert_eq!(
                s0.crc32c, s1.crc32c,
                "{unit}: the skipped step changed nothing"
            );
            // (Rank 1's piece of `scale`, one element, is all padding.)
            if unit != "scale" || rank == 0 {
                assert_ne!(s1.crc32c, s2.crc32c, "{unit}: step 2 stepped");
            }
        }
    }
    let resumed = fingerprint::read(&fp).unwrap();
    assert!(!resumed.records.is_empty());
    assert!(
        resumed.records.iter().all(|r| r.step == 3),
        "{:?}",
        resumed.records
    );
}
