//! Integration tests of the in-process thread backend (`candle_fsdp::comm::threads`).
//!
//! Expected values are computed by hand from the inputs (closed formulas or literal arrays), not
//! by calling the code under test.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::DType;
use candle_fsdp::comm::threads::{
    new_group, run_ranks, run_ranks_ok, ThreadGroupConfig, ThreadProcessGroup,
};
use candle_fsdp::comm::{CommBuffer, ProcessGroup, ReduceOp, Work};
use candle_fsdp::{Error, Result};
use half::{bf16, f16};

const WORLD_SIZES: [usize; 4] = [1, 2, 3, 4];

fn cfg() -> ThreadGroupConfig {
    ThreadGroupConfig::default()
}

fn f32_buf(values: impl IntoIterator<Item = f32>) -> CommBuffer {
    CommBuffer::F32(values.into_iter().collect())
}

fn zeros(len: usize) -> CommBuffer {
    CommBuffer::F32(vec![0.0; len])
}

fn as_f32(buf: CommBuffer) -> Vec<f32> {
    buf.into_f32().expect("f32 buffer")
}

/// Value of element `i` on rank `r` in most tests.
fn v(r: usize, i: usize) -> f32 {
    (r * 100 + i) as f32
}

#[test]
fn new_group_validates_world_size_and_reports_ranks() {
    assert!(matches!(
        new_group(0, cfg()),
        Err(Error::InvalidArgument(_))
    ));
    let groups = new_group(3, cfg()).unwrap();
    for (r, g) in groups.iter().enumerate() {
        assert_eq!(g.rank(), r);
        assert_eq!(g.world_size(), 3);
        assert_eq!(g.timeout(), Duration::from_secs(300));
    }
    assert_eq!(
        ThreadGroupConfig::default().timeout,
        Duration::from_secs(300)
    );
    let results = run_ranks(0, cfg(), |_pg| Ok(()));
    assert_eq!(results.len(), 1);
    assert!(matches!(results[0], Err(Error::InvalidArgument(_))));
}

#[test]
fn run_ranks_names_threads_and_returns_values_by_rank() {
    let out = run_ranks_ok(3, cfg(), |pg| {
        let name = std::thread::current().name().map(str::to_string);
        Ok((pg.rank(), name))
    })
    .unwrap();
    assert_eq!(
        out,
        vec![
            (0, Some("rank-0".to_string())),
            (1, Some("rank-1".to_string())),
            (2, Some("rank-2".to_string())),
        ]
    );
}

#[test]
fn all_gather_f32_every_world_size() {
    for ws in WORLD_SIZES {
        for n in [0usize, 1, 5] {
            run_ranks_ok(ws, cfg(), |pg| {
                let r = pg.rank();
                let input = f32_buf((0..n).map(|i| v(r, i)));
                let out = as_f32(pg.all_gather(input, zeros(ws * n)).wait()?);
                let expected: Vec<f32> =
                    (0..ws).flat_map(|j| (0..n).map(move |i| v(j, i))).collect();
                assert_eq!(out, expected, "ws {ws} n {n} rank {r}");
                Ok(())
            })
            .unwrap();
        }
    }
    // Literal check for world size 3, 2 elements per rank.
    let outs = run_ranks_ok(3, cfg(), |pg| {
        let r = pg.rank();
        let input = f32_buf([v(r, 0), v(r, 1)]);
        Ok(as_f32(pg.all_gather(input, zeros(6)).wait()?))
    })
    .unwrap();
    for out in outs {
        assert_eq!(out, vec![0.0, 1.0, 100.0, 101.0, 200.0, 201.0]);
    }
}

#[test]
fn all_gather_bf16_and_f16() {
    for ws in WORLD_SIZES {
        run_ranks_ok(ws, cfg(), |pg| {
            let r = pg.rank();
            // Small integers and halves are exact in bf16 and f16.
            let vals: Vec<f32> = (0..4).map(|i| r as f32 * 10.0 + i as f32 * 0.5).collect();
            let expected: Vec<f32> = (0..ws)
                .flat_map(|j| (0..4).map(move |i| j as f32 * 10.0 + i as f32 * 0.5))
                .collect();

            let input = CommBuffer::BF16(vals.iter().map(|&x| bf16::from_f32(x)).collect());
            let out = pg
                .all_gather(input, CommBuffer::zeros(DType::BF16, ws * 4)?)
                .wait()?;
            assert_eq!(out.dtype(), DType::BF16);
            assert_eq!(out.to_f32_vec(), expected);

            let input = CommBuffer::F16(vals.iter().map(|&x| f16::from_f32(x)).collect());
            let out = pg
                .all_gather(input, CommBuffer::zeros(DType::F16, ws * 4)?)
                .wait()?;
            assert_eq!(out.dtype(), DType::F16);
            assert_eq!(out.to_f32_vec(), expected);
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn reduce_scatter_sum_and_avg_every_world_size() {
    let n = 3;
    for ws in WORLD_SIZES {
        run_ranks_ok(ws, cfg(), |pg| {
            let r = pg.rank();
            // input_r[k] = r*100 + k, so output_r[i] = sum_j (j*100 + r*n + i)
            //            = 100 * ws(ws-1)/2 + ws * (r*n + i).
            let input = || f32_buf((0..ws * n).map(|k| v(r, k)));
            let sum = as_f32(pg.reduce_scatter(input(), zeros(n), ReduceOp::Sum).wait()?);
            let avg = as_f32(pg.reduce_scatter(input(), zeros(n), ReduceOp::Avg).wait()?);
            for i in 0..n {
                let s = (100 * ws * (ws - 1) / 2 + ws * (r * n + i)) as f32;
                assert_eq!(sum[i], s, "sum ws {ws} rank {r} i {i}");
                // Avg is documented as the f32 sum times 1/ws.
                assert_eq!(avg[i], s * (1.0 / ws as f32), "avg ws {ws} rank {r} i {i}");
            }
            Ok(())
        })
        .unwrap();
    }
    // Literal values, world size 3, shard of 2: rank 1 gets k = 2, 3 of every rank:
    // (2 + 102 + 202, 3 + 103 + 203) = (306, 309); avg = (102, 103).
    let outs = run_ranks_ok(3, cfg(), |pg| {
        let r = pg.rank();
        let input = || f32_buf((0..6).map(|k| v(r, k)));
        let s = as_f32(pg.reduce_scatter(input(), zeros(2), ReduceOp::Sum).wait()?);
        let a = as_f32(pg.reduce_scatter(input(), zeros(2), ReduceOp::Avg).wait()?);
        Ok((s, a))
    })
    .unwrap();
    assert_eq!(outs[0].0, vec![300.0, 303.0]);
    assert_eq!(outs[1].0, vec![306.0, 309.0]);
    assert_eq!(outs[2].0, vec![312.0, 315.0]);
    assert_eq!(outs[1].1, vec![102.0, 103.0]);
}

#[test]
fn reduce_scatter_max_min_and_empty() {
    for ws in WORLD_SIZES {
        run_ranks_ok(ws, cfg(), |pg| {
            let r = pg.rank();
            // input_r[k] = (-1)^r * (r*100 + k): max is the largest even rank's value, min is
            // the largest odd rank's negated value (or rank 0's when ws == 1).
            let input =
                || f32_buf((0..ws * 2).map(|k| if r % 2 == 0 { v(r, k) } else { -v(r, k) }));
            let max = as_f32(pg.reduce_scatter(input(), zeros(2), ReduceOp::Max).wait()?);
            let min = as_f32(pg.reduce_scatter(input(), zeros(2), ReduceOp::Min).wait()?);
            let top_even = (ws - 1) / 2 * 2;
            for i in 0..2 {
                let k = r * 2 + i;
                assert_eq!(max[i], v(top_even, k));
                let expected_min = if ws == 1 {
                    v(0, k)
                } else {
                    -v(ws / 2 * 2 - 1, k)
                };
                assert_eq!(min[i], expected_min);
            }
            let empty = pg
                .reduce_scatter(zeros(0), zeros(0), ReduceOp::Sum)
                .wait()?;
            assert!(empty.is_empty());
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn reduce_scatter_bf16_accumulates_in_f32_and_rounds_once() {
    // 256 + 1 + 1: summed in bf16 step by step this is 256 (257 rounds to even 256, twice);
    // accumulated in f32 and rounded once it is 258, which bf16 represents exactly.
    let outs = run_ranks_ok(3, cfg(), |pg| {
        let x = if pg.rank() == 0 { 256.0 } else { 1.0 };
        let input = CommBuffer::BF16(vec![bf16::from_f32(x); 3]);
        let out = pg
            .reduce_scatter(input, CommBuffer::zeros(DType::BF16, 1)?, ReduceOp::Sum)
            .wait()?;
        Ok(out.to_f32_vec())
    })
    .unwrap();
    for out in outs {
        assert_eq!(out, vec![258.0]);
    }
    // Same for f16 with 2048 + 1 + 1 (f16 spacing is 2 above 2048).
    let outs = run_ranks_ok(3, cfg(), |pg| {
        let x = if pg.rank() == 0 { 2048.0 } else { 1.0 };
        let input = CommBuffer::F16(vec![f16::from_f32(x); 3]);
        let out = pg
            .reduce_scatter(input, CommBuffer::zeros(DType::F16, 1)?, ReduceOp::Sum)
            .wait()?;
        Ok(out.to_f32_vec())
    })
    .unwrap();
    for out in outs {
        assert_eq!(out, vec![2050.0]);
    }
}

#[test]
fn avg_at_world_size_one_is_an_exact_identity() {
    let vals = [0.1f32, 1.0 / 3.0, -7.25e-30, 3.4e38, f32::MIN_POSITIVE];
    let out = run_ranks_ok(1, cfg(), |pg| {
        let rs = as_f32(
            pg.reduce_scatter(f32_buf(vals), zeros(vals.len()), ReduceOp::Avg)
                .wait()?,
        );
        let ar = as_f32(pg.all_reduce(f32_buf(vals), ReduceOp::Avg).wait()?);
        Ok((rs, ar))
    })
    .unwrap();
    assert_eq!(out[0].0, vals.to_vec());
    assert_eq!(out[0].1, vals.to_vec());
}

/// Expected all-reduce of `v(r, i)` over `ws` ranks, by closed formula.
fn all_reduce_expected(op: ReduceOp, ws: usize, i: usize) -> f32 {
    let sum = (100 * ws * (ws - 1) / 2 + ws * i) as f32;
    match op {
        ReduceOp::Sum => sum,
        ReduceOp::Avg => sum * (1.0 / ws as f32),
        ReduceOp::Max => v(ws - 1, i),
        ReduceOp::Min => v(0, i),
    }
}

#[test]
fn all_reduce_every_op_length_and_world_size() {
    for ws in WORLD_SIZES {
        let mut lengths = vec![0, 1, ws - 1, ws + 1, 2 * ws + 1, 100_003];
        lengths.retain(|&l| l != ws - 1 || ws > 1);
        for len in lengths {
            run_ranks_ok(ws, cfg(), |pg| {
                let r = pg.rank();
                for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                    let buf = f32_buf((0..len).map(|i| v(r, i)));
                    let out = as_f32(pg.all_reduce(buf, op).wait()?);
                    assert_eq!(out.len(), len);
                    for (i, &x) in out.iter().enumerate() {
                        assert_eq!(
                            x,
                            all_reduce_expected(op, ws, i),
                            "{op:?} ws {ws} len {len} rank {r} i {i}"
                        );
                    }
                }
                Ok(())
            })
            .unwrap();
        }
    }
    // Literal check: world size 3, length 2: sums (0+100+200, 1+101+201).
    let outs = run_ranks_ok(3, cfg(), |pg| {
        let r = pg.rank();
        Ok(as_f32(
            pg.all_reduce(f32_buf([v(r, 0), v(r, 1)]), ReduceOp::Sum)
                .wait()?,
        ))
    })
    .unwrap();
    for out in outs {
        assert_eq!(out, vec![300.0, 303.0]);
    }
}

#[test]
fn all_reduce_half_types_and_nan() {
    for ws in WORLD_SIZES {
        run_ranks_ok(ws, cfg(), |pg| {
            let r = pg.rank() as f32;
            // bf16: values r + i/4 are exact; the sum ws(ws-1)/2 + ws*i/4 stays exact.
            let vals: Vec<f32> = (0..9).map(|i| r + i as f32 * 0.25).collect();
            let buf = CommBuffer::BF16(vals.iter().map(|&x| bf16::from_f32(x)).collect());
            let out = pg.all_reduce(buf, ReduceOp::Sum).wait()?;
            assert_eq!(out.dtype(), DType::BF16);
            let w = ws as f32;
            let expected: Vec<f32> = (0..9)
                .map(|i| w * (w - 1.0) / 2.0 + w * i as f32 * 0.25)
                .collect();
            assert_eq!(out.to_f32_vec(), expected);

            let buf = CommBuffer::F16(vals.iter().map(|&x| f16::from_f32(x)).collect());
            let out = pg.all_reduce(buf, ReduceOp::Max).wait()?;
            assert_eq!(out.dtype(), DType::F16);
            let expected: Vec<f32> = (0..9).map(|i| (w - 1.0) + i as f32 * 0.25).collect();
            assert_eq!(out.to_f32_vec(), expected);

            // NaN on the last rank propagates through Max, Min and Sum.
            let last = pg.rank() == ws - 1;
            for op in [ReduceOp::Max, ReduceOp::Min, ReduceOp::Sum] {
                let buf = f32_buf([if last { f32::NAN } else { 1.0 }, 2.0]);
                let out = as_f32(pg.all_reduce(buf, op).wait()?);
                assert!(out[0].is_nan(), "{op:?}");
                assert!(!out[1].is_nan());
            }
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn broadcast_from_non_zero_root() {
    for ws in WORLD_SIZES {
        let root = ws - 1;
        for len in [0usize, 1, 7] {
            let outs = run_ranks_ok(ws, cfg(), |pg| {
                let r = pg.rank();
                let buf = f32_buf((0..len).map(|i| v(r, i)));
                Ok(as_f32(pg.broadcast(buf, root).wait()?))
            })
            .unwrap();
            for out in outs {
                assert_eq!(out, (0..len).map(|i| v(root, i)).collect::<Vec<_>>());
            }
        }
    }
    let outs = run_ranks_ok(3, cfg(), |pg| {
        let buf = CommBuffer::BF16(vec![bf16::from_f32(pg.rank() as f32 + 0.5); 2]);
        Ok(pg.broadcast(buf, 1).wait()?.to_f32_vec())
    })
    .unwrap();
    for out in outs {
        assert_eq!(out, vec![1.5, 1.5]);
    }
}

#[test]
fn reduce_to_root_leaves_non_roots_unchanged() {
    for ws in WORLD_SIZES {
        let root = ws / 2;
        let outs = run_ranks_ok(ws, cfg(), |pg| {
            let r = pg.rank();
            let buf = f32_buf((0..5).map(|i| v(r, i)));
            Ok(as_f32(pg.reduce(buf, root, ReduceOp::Sum).wait()?))
        })
        .unwrap();
        for (r, out) in outs.into_iter().enumerate() {
            let expected: Vec<f32> = if r == root {
                (0..5)
                    .map(|i| all_reduce_expected(ReduceOp::Sum, ws, i))
                    .collect()
            } else {
                (0..5).map(|i| v(r, i)).collect()
            };
            assert_eq!(out, expected, "ws {ws} rank {r}");
        }
    }
    // Literal: world size 2, root 1, Avg of (0, 1) and (100, 101) = (50, 51).
    let outs = run_ranks_ok(2, cfg(), |pg| {
        let r = pg.rank();
        Ok(as_f32(
            pg.reduce(f32_buf([v(r, 0), v(r, 1)]), 1, ReduceOp::Avg)
                .wait()?,
        ))
    })
    .unwrap();
    assert_eq!(outs, vec![vec![0.0, 1.0], vec![50.0, 51.0]]);
}

#[test]
fn barrier_separates_phases() {
    for ws in WORLD_SIZES {
        let counter = AtomicUsize::new(0);
        run_ranks_ok(ws, cfg(), |pg| {
            for round in 0..20 {
                counter.fetch_add(1, Ordering::SeqCst);
                pg.barrier().wait()?;
                assert_eq!(counter.load(Ordering::SeqCst), ws * (round + 1));
                pg.barrier().wait()?;
            }
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn streams_are_independent() {
    // Rank 0 issues reduce_scatter then all_gather; rank 1 the opposite order. Each stream
    // executes its own ops in order, so both complete.
    let outs = run_ranks_ok(2, cfg(), |pg| {
        let r = pg.rank();
        let rs = || pg.reduce_scatter(f32_buf([v(r, 0), v(r, 1)]), zeros(1), ReduceOp::Sum);
        let ag = || pg.all_gather(f32_buf([v(r, 0)]), zeros(2));
        let (rs_work, ag_work) = if r == 0 {
            let a = rs();
            let b = ag();
            (a, b)
        } else {
            let b = ag();
            let a = rs();
            (a, b)
        };
        Ok((as_f32(rs_work.wait()?), as_f32(ag_work.wait()?)))
    })
    .unwrap();
    assert_eq!(outs[0], (vec![100.0], vec![0.0, 100.0]));
    assert_eq!(outs[1], (vec![102.0], vec![0.0, 100.0]));
}

#[test]
fn many_back_to_back_async_ops_waited_at_the_end() {
    let rounds = 40;
    for ws in [2usize, 3] {
        run_ranks_ok(ws, cfg(), |pg| {
            let r = pg.rank();
            let mut ags = Vec::new();
            let mut rss = Vec::new();
            let mut ars = Vec::new();
            let mut bars: Vec<Work<()>> = Vec::new();
            for k in 0..rounds {
                let base = (k * 1000) as f32;
                ags.push(pg.all_gather(f32_buf([base + r as f32; 3]), zeros(3 * ws)));
                rss.push(pg.reduce_scatter(
                    f32_buf((0..ws * 2).map(|i| base + v(r, i))),
                    zeros(2),
                    ReduceOp::Sum,
                ));
                ars.push(pg.all_reduce(f32_buf([base, r as f32]), ReduceOp::Max));
                if k % 10 == 0 {
                    bars.push(pg.barrier());
                }
            }
            for b in bars {
                b.wait()?;
            }
            for (k, w) in ags.into_iter().enumerate() {
                let base = (k * 1000) as f32;
                let expected: Vec<f32> = (0..ws).flat_map(|j| [base + j as f32; 3]).collect();
                assert_eq!(as_f32(w.wait()?), expected);
            }
            for (k, w) in rss.into_iter().enumerate() {
                let base = (k * 1000) as f32;
                let out = as_f32(w.wait()?);
                for (i, &x) in out.iter().enumerate() {
                    let idx = r * 2 + i;
                    let expected = ws as f32 * base + (100 * ws * (ws - 1) / 2 + ws * idx) as f32;
                    assert_eq!(x, expected);
                }
            }
            for (k, w) in ars.into_iter().enumerate() {
                assert_eq!(as_f32(w.wait()?), vec![(k * 1000) as f32, (ws - 1) as f32]);
            }
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn works_complete_out_of_wait_order_and_report_completion() {
    run_ranks_ok(2, cfg(), |pg| {
        let a = pg.all_reduce(f32_buf([1.0]), ReduceOp::Sum);
        let b = pg.all_reduce(f32_buf([2.0]), ReduceOp::Sum);
        // Waiting the second first is fine: the stream runs both in order.
        assert_eq!(as_f32(b.wait()?), vec![4.0]);
        assert!(a.is_completed());
        assert_eq!(as_f32(a.wait()?), vec![2.0]);
        // A dropped Work still runs on every rank.
        drop(pg.all_reduce(f32_buf([5.0]), ReduceOp::Sum));
        assert_eq!(
            as_f32(pg.all_reduce(f32_buf([3.0]), ReduceOp::Sum).wait()?),
            vec![6.0]
        );
        Ok(())
    })
    .unwrap();
}

/// Runs `f` on `ws` ranks and returns each rank's result, all of which are required to be Ok
/// at the run level (errors of the collectives are returned as values).
fn collect_errors<F>(ws: usize, f: F) -> Vec<Option<Error>>
where
    F: Fn(&dyn ProcessGroup) -> Result<Option<Error>> + Send + Sync,
{
    run_ranks_ok(ws, cfg(), |pg| f(pg.as_ref())).unwrap()
}

#[test]
fn mismatched_lengths_fail_on_every_rank_and_the_group_stays_usable() {
    let errs = collect_errors(3, |pg| {
        let n = if pg.rank() == 2 { 5 } else { 4 };
        let err = pg.all_gather(zeros(n), zeros(3 * n)).wait().err();
        // The group is still usable afterwards.
        let out = as_f32(pg.all_reduce(f32_buf([1.0]), ReduceOp::Sum).wait()?);
        assert_eq!(out, vec![3.0]);
        Ok(err)
    });
    for (r, e) in errs.into_iter().enumerate() {
        match e {
            Some(Error::CollectiveMismatch {
                op,
                rank,
                found,
                other_rank,
                expected,
            }) => {
                assert_eq!(op, "all_gather #1 (stream all_gather)");
                assert_eq!(rank, 2);
                assert_eq!(other_rank, 0);
                assert!(found.contains('5'), "{found}");
                assert!(expected.contains('4'), "{expected}");
            }
            other => panic!("rank {r}: expected CollectiveMismatch, got {other:?}"),
        }
    }
}

#[test]
fn bad_output_buffer_fails_on_every_rank() {
    let errs = collect_errors(2, |pg| {
        let out_len = if pg.rank() == 1 { 7 } else { 8 };
        Ok(pg.all_gather(zeros(4), zeros(out_len)).wait().err())
    });
    for e in errs {
        match e {
            Some(Error::BadBuffer {
                rank,
                expected,
                found,
                ..
            }) => {
                assert_eq!(rank, 1);
                assert!(expected.starts_with("8 elements"), "{expected}");
                assert_eq!(found, "7 elements");
            }
            other => panic!("expected BadBuffer, got {other:?}"),
        }
    }
    // reduce_scatter with an input that is not world_size x output.
    let errs = collect_errors(2, |pg| {
        Ok(pg
            .reduce_scatter(zeros(5), zeros(2), ReduceOp::Sum)
            .wait()
            .err())
    });
    for e in errs {
        assert!(matches!(e, Some(Error::BadBuffer { rank: 0, .. })), "{e:?}");
    }
    // Output dtype differing from the input dtype.
    let errs = collect_errors(2, |pg| {
        let out = CommBuffer::zeros(DType::BF16, 4)?;
        Ok(pg.all_gather(zeros(2), out).wait().err())
    });
    for e in errs {
        assert!(matches!(e, Some(Error::BadBuffer { rank: 0, .. })), "{e:?}");
    }
}

#[test]
fn mismatched_dtype_op_root_or_collective_fail_on_every_rank() {
    // dtype
    let errs = collect_errors(2, |pg| {
        let dtype = if pg.rank() == 1 {
            DType::F16
        } else {
            DType::F32
        };
        let buf = CommBuffer::zeros(dtype, 3)?;
        Ok(pg.all_reduce(buf, ReduceOp::Sum).wait().err())
    });
    for e in errs {
        assert!(
            matches!(&e, Some(Error::CollectiveMismatch { rank: 1, found, .. }) if found.contains("F16")),
            "{e:?}"
        );
    }
    // reduce op
    let errs = collect_errors(3, |pg| {
        let op = if pg.rank() == 2 {
            ReduceOp::Max
        } else {
            ReduceOp::Sum
        };
        Ok(pg.all_reduce(zeros(3), op).wait().err())
    });
    for e in errs {
        assert!(
            matches!(&e, Some(Error::CollectiveMismatch { rank: 2, found, expected, .. })
                if found.contains("Max") && expected.contains("Sum")),
            "{e:?}"
        );
    }
    // root
    let errs = collect_errors(2, |pg| Ok(pg.broadcast(zeros(3), pg.rank()).wait().err()));
    for e in errs {
        assert!(
            matches!(e, Some(Error::CollectiveMismatch { rank: 1, .. })),
            "{e:?}"
        );
    }
    // root out of range (the same on every rank)
    let errs = collect_errors(2, |pg| Ok(pg.broadcast(zeros(3), 2).wait().err()));
    for e in errs {
        assert!(matches!(e, Some(Error::InvalidArgument(_))), "{e:?}");
    }
    // different collectives on the same stream
    let errs = collect_errors(2, |pg| {
        let err = if pg.rank() == 0 {
            pg.barrier().wait().err()
        } else {
            pg.all_reduce(zeros(2), ReduceOp::Sum).wait().err()
        };
        // Still usable.
        pg.barrier().wait()?;
        Ok(err)
    });
    for e in errs {
        assert!(
            matches!(&e, Some(Error::CollectiveMismatch { rank: 1, found, expected, .. })
                if found.starts_with("all_reduce") && expected.starts_with("barrier")),
            "{e:?}"
        );
    }
}

#[test]
fn a_panicking_rank_aborts_pending_collectives_promptly() {
    let results = run_ranks::<(), _>(2, cfg(), |pg| {
        for k in 0..2 {
            pg.all_gather(zeros(4), zeros(8)).wait()?;
            let _ = k;
        }
        if pg.rank() == 1 {
            std::thread::sleep(Duration::from_millis(200));
            panic!("rank one blew up");
        }
        let start = Instant::now();
        let err = pg.all_gather(zeros(4), zeros(8)).wait().unwrap_err();
        let elapsed = start.elapsed();
        assert!(elapsed < Duration::from_secs(20), "took {elapsed:?}");
        // A collective issued after the abort fails at once.
        let start = Instant::now();
        let again = pg.barrier().wait().unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(matches!(again, Error::PeerFailed { failed_rank: 1, .. }));
        Err(err)
    });
    match &results[0] {
        Err(Error::PeerFailed {
            op,
            rank,
            failed_rank,
            reason,
        }) => {
            assert_eq!(op, "all_gather #3 (stream all_gather)");
            assert_eq!(*rank, 0);
            assert_eq!(*failed_rank, 1);
            assert!(reason.contains("panicked: rank one blew up"), "{reason}");
        }
        other => panic!("rank 0: {other:?}"),
    }
    match &results[1] {
        Err(Error::RankPanicked { rank, message }) => {
            assert_eq!(*rank, 1);
            assert_eq!(message, "rank one blew up");
        }
        other => panic!("rank 1: {other:?}"),
    }
}

#[test]
fn run_ranks_ok_reports_the_root_cause() {
    let err = run_ranks_ok(3, cfg(), |pg| {
        if pg.rank() == 2 {
            panic!("root cause on rank 2");
        }
        pg.all_reduce(zeros(2), ReduceOp::Sum).wait()?;
        Ok(())
    })
    .unwrap_err();
    assert!(
        matches!(&err, Error::RankPanicked { rank: 2, message } if message == "root cause on rank 2"),
        "{err:?}"
    );
}

#[test]
fn a_rank_returning_an_error_aborts_its_peers() {
    let results = run_ranks::<(), _>(3, cfg(), |pg| {
        if pg.rank() == 1 {
            return Err(Error::InvalidArgument("bad batch on rank 1".into()));
        }
        let start = Instant::now();
        let err = pg.all_reduce(zeros(3), ReduceOp::Sum).wait().unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(20));
        Err(err)
    });
    for r in [0, 2] {
        match &results[r] {
            Err(Error::PeerFailed {
                op,
                rank,
                failed_rank,
                reason,
            }) => {
                assert_eq!(op, "all_reduce #1 (stream collective)");
                assert_eq!(*rank, r);
                assert_eq!(*failed_rank, 1);
                assert!(reason.contains("bad batch on rank 1"), "{reason}");
            }
            other => panic!("rank {r}: {other:?}"),
        }
    }
    assert!(matches!(&results[1], Err(Error::InvalidArgument(m)) if m == "bad batch on rank 1"));

    let err = run_ranks_ok(3, cfg(), |pg| {
        if pg.rank() == 1 {
            return Err(Error::InvalidArgument("bad batch on rank 1".into()));
        }
        pg.all_reduce(zeros(3), ReduceOp::Sum).wait()?;
        Ok(())
    })
    .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
}

#[test]
fn a_rank_exiting_early_gives_peer_exited() {
    let results = run_ranks(2, cfg(), |pg| {
        if pg.rank() == 1 {
            return Ok(());
        }
        let start = Instant::now();
        let err = pg.all_gather(zeros(1), zeros(2)).wait().unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(20));
        Err(err)
    });
    match &results[0] {
        Err(Error::PeerExited { op, rank, departed }) => {
            assert_eq!(op, "all_gather #1 (stream all_gather)");
            assert_eq!(*rank, 0);
            assert_eq!(*departed, 1);
        }
        other => panic!("rank 0: {other:?}"),
    }
    assert!(results[1].is_ok());
}

#[test]
fn dropping_handles_with_crossed_pending_ops_does_not_hang() {
    // Rank 0 waits on the all-gather stream, rank 1 on the reduce-scatter stream; dropping both
    // handles closes the idle streams, so each pending op sees its peer exit.
    let mut groups = new_group(2, cfg()).unwrap();
    let g1: Arc<ThreadProcessGroup> = groups.pop().unwrap();
    let g0 = groups.pop().unwrap();
    let w0 = g0.all_gather(zeros(1), zeros(2));
    let w1 = g1.reduce_scatter(zeros(2), zeros(1), ReduceOp::Sum);
    let start = Instant::now();
    let t = std::thread::spawn(move || drop(g1));
    drop(g0);
    t.join().unwrap();
    assert!(start.elapsed() < Duration::from_secs(20));
    assert!(matches!(
        w0.wait(),
        Err(Error::PeerExited { departed: 1, .. })
    ));
    assert!(matches!(
        w1.wait(),
        Err(Error::PeerExited { departed: 0, .. })
    ));
}

#[test]
fn a_late_rank_times_out_the_others() {
    let config = ThreadGroupConfig {
        timeout: Duration::from_millis(300),
    };
    let results = run_ranks(2, config, |pg| {
        if pg.rank() == 1 {
            std::thread::sleep(Duration::from_secs(3));
        }
        let start = Instant::now();
        let r = pg.all_reduce(zeros(4), ReduceOp::Sum).wait();
        Ok((r.err(), start.elapsed()))
    });
    let (err0, elapsed0) = results[0].as_ref().unwrap();
    match err0 {
        Some(Error::Timeout {
            op,
            rank,
            timeout,
            missing,
        }) => {
            assert_eq!(op, "all_reduce #1 (stream collective)");
            assert_eq!(*rank, 0);
            assert_eq!(*timeout, Duration::from_millis(300));
            assert_eq!(missing, &vec![1]);
        }
        other => panic!("rank 0: {other:?}"),
    }
    assert!(*elapsed0 >= Duration::from_millis(300) && *elapsed0 < Duration::from_secs(3));
    // The late rank finds the group aborted by the timeout and fails at once.
    let (err1, elapsed1) = results[1].as_ref().unwrap();
    match err1 {
        Some(Error::PeerFailed {
            failed_rank,
            reason,
            ..
        }) => {
            assert_eq!(*failed_rank, 0);
            assert!(reason.contains("timed out in all_reduce #1"), "{reason}");
        }
        other => panic!("rank 1: {other:?}"),
    }
    assert!(*elapsed1 < Duration::from_secs(1));
}

#[test]
fn stats_count_calls_and_input_bytes() {
    let stats = run_ranks_ok(2, cfg(), |pg| {
        pg.all_gather(zeros(10), zeros(20)).wait()?; // 40 bytes
        pg.all_gather(
            CommBuffer::zeros(DType::BF16, 3)?,
            CommBuffer::zeros(DType::BF16, 6)?,
        )
        .wait()?; // 6 bytes
        pg.reduce_scatter(
            CommBuffer::zeros(DType::BF16, 8)?,
            CommBuffer::zeros(DType::BF16, 4)?,
            ReduceOp::Avg,
        )
        .wait()?; // 16 bytes
        pg.all_reduce(CommBuffer::zeros(DType::F16, 5)?, ReduceOp::Sum)
            .wait()?; // 10 bytes
        pg.broadcast(zeros(2), 0).wait()?; // 8 bytes
        pg.reduce(zeros(1), 1, ReduceOp::Max).wait()?; // 4 bytes
        pg.barrier().wait()?; // 0 bytes
        Ok(pg.stats())
    })
    .unwrap();
    for s in stats {
        assert_eq!(s.all_gather_calls, 2);
        assert_eq!(s.all_gather_bytes, 46);
        assert_eq!(s.reduce_scatter_calls, 1);
        assert_eq!(s.reduce_scatter_bytes, 16);
        assert_eq!(s.other_calls, 4);
        assert_eq!(s.other_bytes, 22);
    }
}
