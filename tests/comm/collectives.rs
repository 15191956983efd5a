//! Integration tests of the process-group API (`candle_fsdp::comm`) on the in-process thread
//! backend, and of the launcher.
//!
//! Tests named `threads_*` check guarantees only the shared-memory backend gives (rank-ordered
//! bitwise reductions, mismatches detected on every rank, the shared abort slot); the others
//! check the portable contract every backend keeps.
//!
//! Expected values are computed by hand from the inputs (closed formulas or literal arrays), not
//! by calling the code under test.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_fsdp::comm::threads::{new_group, run_ranks, run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::{
    CommObserver, CommStream, Completion, OpKind, ProcessGroup, ProcessGroupExt, ReduceOp, Work,
    DEFAULT_STREAM,
};
use candle_fsdp::error::Phase;
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::trace::{Lane, SpanKind, TraceSession};
use candle_fsdp::{Error, Result};
use half::{bf16, f16};
use parking_lot::Mutex;

const WORLD_SIZES: [usize; 4] = [1, 2, 3, 4];

fn cfg() -> ThreadGroupConfig {
    ThreadGroupConfig::default()
}

fn t<T: candle_core::WithDType>(values: impl IntoIterator<Item = T>) -> Tensor {
    let v: Vec<T> = values.into_iter().collect();
    let n = v.len();
    Tensor::from_vec(v, n, &Device::Cpu).expect("tensor")
}

fn f32_t(values: impl IntoIterator<Item = f32>) -> Tensor {
    t(values)
}

fn zeros(len: usize) -> Tensor {
    zeros_of(DType::F32, len)
}

fn zeros_of(dtype: DType, len: usize) -> Tensor {
    Tensor::zeros(len, dtype, &Device::Cpu).expect("zeros")
}

fn as_f32(t: Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.to_vec1())
        .expect("1-D tensor")
}

/// Value of element `i` on rank `r` in most tests.
fn v(r: usize, i: usize) -> f32 {
    (r * 100 + i) as f32
}

/// A rank's group with the streams these tests use: FSDP's two streams, created here, and the
/// default stream for everything else.
struct Pg {
    pg: Arc<dyn ProcessGroup>,
    ag: CommStream,
    rs: CommStream,
    c: CommStream,
}

impl Pg {
    fn new(pg: &Arc<dyn ProcessGroup>) -> Result<Pg> {
        Ok(Pg {
            ag: pg.new_stream("all_gather")?,
            rs: pg.new_stream("reduce_scatter")?,
            c: pg.default_stream(),
            pg: pg.clone(),
        })
    }

    fn rank(&self) -> usize {
        self.pg.rank()
    }

    fn all_gather(&self, input: Tensor, output: Tensor) -> Work<Tensor> {
        self.pg.all_gather(&self.ag, &input, output)
    }

    fn reduce_scatter(&self, input: Tensor, output: Tensor, op: ReduceOp) -> Work<Tensor> {
        self.pg.reduce_scatter(&self.rs, &input, output, op)
    }

    fn all_reduce(&self, buf: Tensor, op: ReduceOp) -> Work<Tensor> {
        self.pg.all_reduce(&self.c, buf, op)
    }

    fn broadcast(&self, buf: Tensor, root: usize) -> Work<Tensor> {
        self.pg.broadcast(&self.c, buf, root)
    }

    fn reduce(&self, buf: Tensor, root: usize, op: ReduceOp) -> Work<Tensor> {
        self.pg.reduce(&self.c, buf, root, op)
    }

    fn barrier(&self) -> Work<()> {
        self.pg.barrier(&self.c)
    }
}

/// Runs `f` on `ws` ranks, each with its [`Pg`].
fn run<T: Send>(ws: usize, f: impl Fn(&Pg) -> Result<T> + Send + Sync) -> Vec<T> {
    run_ranks_ok(ws, cfg(), |pg| f(&Pg::new(&pg)?)).unwrap()
}

#[test]
fn new_group_validates_world_size_and_reports_ranks() {
    assert!(matches!(new_group(0, cfg()), Err(Error::Value { .. })));
    let groups = new_group(3, cfg()).unwrap();
    for (r, g) in groups.iter().enumerate() {
        assert_eq!(g.rank(), r);
        assert_eq!(g.world_size(), 3);
        assert_eq!(g.timeout(), Some(Duration::from_secs(300)));
        assert_eq!(g.backend(), "threads");
        assert!(g.device().is_cpu());
        assert_eq!(g.default_stream().name(), DEFAULT_STREAM);
        assert_eq!(DEFAULT_STREAM, "collective");
    }
    assert_eq!(
        ThreadGroupConfig::default().timeout,
        Duration::from_secs(300)
    );
    let results = run_ranks(0, cfg(), |_pg| Ok(()));
    assert_eq!(results.len(), 1);
    assert!(matches!(results[0], Err(Error::Value { .. })));
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
            run(ws, |pg| {
                let r = pg.rank();
                let input = f32_t((0..n).map(|i| v(r, i)));
                let out = as_f32(pg.all_gather(input, zeros(ws * n)).wait()?);
                let expected: Vec<f32> =
                    (0..ws).flat_map(|j| (0..n).map(move |i| v(j, i))).collect();
                assert_eq!(out, expected, "ws {ws} n {n} rank {r}");
                Ok(())
            });
        }
    }
    // Literal check for world size 3, 2 elements per rank.
    let outs = run(3, |pg| {
        let r = pg.rank();
        let input = f32_t([v(r, 0), v(r, 1)]);
        Ok(as_f32(pg.all_gather(input, zeros(6)).wait()?))
    });
    for out in outs {
        assert_eq!(out, vec![0.0, 1.0, 100.0, 101.0, 200.0, 201.0]);
    }
}

#[test]
fn all_gather_bf16_and_f16() {
    for ws in WORLD_SIZES {
        run(ws, |pg| {
            let r = pg.rank();
            // Small integers and halves are exact in bf16 and f16.
            let vals: Vec<f32> = (0..4).map(|i| r as f32 * 10.0 + i as f32 * 0.5).collect();
            let expected: Vec<f32> = (0..ws)
                .flat_map(|j| (0..4).map(move |i| j as f32 * 10.0 + i as f32 * 0.5))
                .collect();

            let input = t(vals.iter().map(|&x| bf16::from_f32(x)));
            let out = pg.all_gather(input, zeros_of(DType::BF16, ws * 4)).wait()?;
            assert_eq!(out.dtype(), DType::BF16);
            assert_eq!(as_f32(out), expected);

            let input = t(vals.iter().map(|&x| f16::from_f32(x)));
            let out = pg.all_gather(input, zeros_of(DType::F16, ws * 4)).wait()?;
            assert_eq!(out.dtype(), DType::F16);
            assert_eq!(as_f32(out), expected);
            Ok(())
        });
    }
}

#[test]
fn outputs_are_filled_in_place_and_views_at_an_offset_work() {
    let outs = run(2, |pg| {
        let r = pg.rank();
        // The output is a view at offset 3 of a larger tensor the caller keeps; the input a view
        // at offset 2r of another.
        let big = zeros(10);
        let out_view = big.narrow(0, 3, 4)?;
        let input = f32_t([9.0, 8.0, 7.0, 6.0]).narrow(0, 2 * r, 2)?;
        let out = as_f32(pg.all_gather(input, out_view).wait()?);
        // In-place all-reduce of a view: only the viewed elements change.
        let base = f32_t([1.0, 2.0, 3.0, 4.0]);
        pg.all_reduce(base.narrow(0, 1, 2)?, ReduceOp::Sum).wait()?;
        Ok((out, as_f32(big), as_f32(base)))
    });
    for (out, big, base) in outs {
        assert_eq!(out, vec![9.0, 8.0, 7.0, 6.0]);
        assert_eq!(big, vec![0.0, 0.0, 0.0, 9.0, 8.0, 7.0, 6.0, 0.0, 0.0, 0.0]);
        assert_eq!(base, vec![1.0, 4.0, 6.0, 4.0]);
    }
}

#[test]
fn reduce_scatter_sum_and_avg_every_world_size() {
    let n = 3;
    for ws in WORLD_SIZES {
        run(ws, |pg| {
            let r = pg.rank();
            // input_r[k] = r*100 + k, so output_r[i] = sum_j (j*100 + r*n + i)
            //            = 100 * ws(ws-1)/2 + ws * (r*n + i).
            let input = || f32_t((0..ws * n).map(|k| v(r, k)));
            let sum = as_f32(pg.reduce_scatter(input(), zeros(n), ReduceOp::Sum).wait()?);
            let avg = as_f32(pg.reduce_scatter(input(), zeros(n), ReduceOp::Avg).wait()?);
            for i in 0..n {
                let s = (100 * ws * (ws - 1) / 2 + ws * (r * n + i)) as f32;
                assert_eq!(sum[i], s, "sum ws {ws} rank {r} i {i}");
                // Avg is documented as the sum times 1/ws.
                assert_eq!(avg[i], s * (1.0 / ws as f32), "avg ws {ws} rank {r} i {i}");
            }
            Ok(())
        });
    }
    // Literal values, world size 3, shard of 2: rank 1 gets k = 2, 3 of every rank:
    // (2 + 102 + 202, 3 + 103 + 203) = (306, 309); avg = (102, 103).
    let outs = run(3, |pg| {
        let r = pg.rank();
        let input = || f32_t((0..6).map(|k| v(r, k)));
        let s = as_f32(pg.reduce_scatter(input(), zeros(2), ReduceOp::Sum).wait()?);
        let a = as_f32(pg.reduce_scatter(input(), zeros(2), ReduceOp::Avg).wait()?);
        Ok((s, a))
    });
    assert_eq!(outs[0].0, vec![300.0, 303.0]);
    assert_eq!(outs[1].0, vec![306.0, 309.0]);
    assert_eq!(outs[2].0, vec![312.0, 315.0]);
    assert_eq!(outs[1].1, vec![102.0, 103.0]);
}

#[test]
fn reduce_scatter_max_min_and_empty() {
    for ws in WORLD_SIZES {
        run(ws, |pg| {
            let r = pg.rank();
            // input_r[k] = (-1)^r * (r*100 + k): max is the largest even rank's value, min is
            // the largest odd rank's negated value (or rank 0's when ws == 1).
            let input = || f32_t((0..ws * 2).map(|k| if r % 2 == 0 { v(r, k) } else { -v(r, k) }));
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
            assert_eq!(empty.elem_count(), 0);
            Ok(())
        });
    }
}

#[test]
fn avg_at_world_size_one_is_an_exact_identity() {
    let vals = [0.1f32, 1.0 / 3.0, -7.25e-30, 3.4e38, f32::MIN_POSITIVE];
    let out = run(1, |pg| {
        let rs = as_f32(
            pg.reduce_scatter(f32_t(vals), zeros(vals.len()), ReduceOp::Avg)
                .wait()?,
        );
        let ar = as_f32(pg.all_reduce(f32_t(vals), ReduceOp::Avg).wait()?);
        Ok((rs, ar))
    });
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
            run(ws, |pg| {
                let r = pg.rank();
                for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                    let buf = f32_t((0..len).map(|i| v(r, i)));
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
            });
        }
    }
    // Literal check: world size 3, length 2: sums (0+100+200, 1+101+201).
    let outs = run(3, |pg| {
        let r = pg.rank();
        Ok(as_f32(
            pg.all_reduce(f32_t([v(r, 0), v(r, 1)]), ReduceOp::Sum)
                .wait()?,
        ))
    });
    for out in outs {
        assert_eq!(out, vec![300.0, 303.0]);
    }
}

#[test]
fn all_reduce_half_types() {
    for ws in WORLD_SIZES {
        run(ws, |pg| {
            let r = pg.rank() as f32;
            // bf16: values r + i/4 are exact; the sum ws(ws-1)/2 + ws*i/4 stays exact.
            let vals: Vec<f32> = (0..9).map(|i| r + i as f32 * 0.25).collect();
            let buf = t(vals.iter().map(|&x| bf16::from_f32(x)));
            let out = pg.all_reduce(buf, ReduceOp::Sum).wait()?;
            assert_eq!(out.dtype(), DType::BF16);
            let w = ws as f32;
            let expected: Vec<f32> = (0..9)
                .map(|i| w * (w - 1.0) / 2.0 + w * i as f32 * 0.25)
                .collect();
            assert_eq!(as_f32(out), expected);

            let buf = t(vals.iter().map(|&x| f16::from_f32(x)));
            let out = pg.all_reduce(buf, ReduceOp::Max).wait()?;
            assert_eq!(out.dtype(), DType::F16);
            let expected: Vec<f32> = (0..9).map(|i| (w - 1.0) + i as f32 * 0.25).collect();
            assert_eq!(as_f32(out), expected);
            Ok(())
        });
    }
}

#[test]
fn f64_reduces_in_f64() {
    // 2^51 + r and their sum: exact in f64, not in f32 (24-bit significand).
    let big = 2_251_799_813_685_248.0f64;
    let outs = run(3, |pg| {
        let r = pg.rank() as f64;
        let sum: Vec<f64> = pg
            .all_reduce(t([big + r, 0.5 * r]), ReduceOp::Sum)
            .wait()?
            .to_vec1()?;
        let max: Vec<f64> = pg
            .reduce_scatter(t([big + r, r, -r]), zeros_of(DType::F64, 1), ReduceOp::Max)
            .wait()?
            .to_vec1()?;
        Ok((sum, max))
    });
    for (r, (sum, max)) in outs.into_iter().enumerate() {
        assert_eq!(sum, vec![3.0 * big + 3.0, 1.5]);
        let expected = [big + 2.0, 2.0, 0.0][r];
        assert_eq!(max, vec![expected]);
    }
}

#[test]
fn integer_dtypes_reduce_exactly() {
    let outs = run(3, |pg| {
        let r = pg.rank();
        // i64 beyond f32 (and f64) precision.
        let big = (1i64 << 60) + 1;
        let s: Vec<i64> = pg
            .all_reduce(t([big + r as i64, -(r as i64)]), ReduceOp::Sum)
            .wait()?
            .to_vec1()?;
        let mx: Vec<i64> = pg
            .all_reduce(t([big - r as i64, -(r as i64)]), ReduceOp::Max)
            .wait()?
            .to_vec1()?;
        let mn: Vec<u32> = pg
            .all_reduce(t([4_000_000_000u32 - r as u32, 7]), ReduceOp::Min)
            .wait()?
            .to_vec1()?;
        // u8 sums wrap: 200 + 201 + 202 = 603 = 2*256 + 91.
        let wrap: Vec<u8> = pg
            .all_reduce(t([200u8 + r as u8]), ReduceOp::Sum)
            .wait()?
            .to_vec1()?;
        let bc: Vec<i64> = pg.broadcast(t([big + r as i64]), 2).wait()?.to_vec1()?;
        let gathered: Vec<u32> = pg
            .all_gather(t([r as u32 * 10]), zeros_of(DType::U32, 3))
            .wait()?
            .to_vec1()?;
        Ok((s, mx, mn, wrap, bc, gathered))
    });
    let big = (1i64 << 60) + 1;
    for (s, mx, mn, wrap, bc, gathered) in outs {
        assert_eq!(s, vec![3 * big + 3, -3]);
        assert_eq!(mx, vec![big, 0]);
        assert_eq!(mn, vec![3_999_999_998, 7]);
        assert_eq!(wrap, vec![91]);
        assert_eq!(bc, vec![big + 2]);
        assert_eq!(gathered, vec![0, 10, 20]);
    }
}

#[test]
fn avg_on_integers_is_an_error_naming_the_op() {
    let errs = run(2, |pg| {
        let a = pg.all_reduce(t([1i64, 2]), ReduceOp::Avg).wait().err();
        let b = pg
            .reduce_scatter(t([1u8, 2]), zeros_of(DType::U8, 1), ReduceOp::Avg)
            .wait()
            .err();
        // The group stays usable.
        assert_eq!(pg.pg.all_reduce_i64s(vec![5], ReduceOp::Sum)?, vec![10]);
        Ok((a, b))
    });
    for (a, b) in errs {
        match a {
            Some(e @ Error::DType { .. }) => {
                let m = e.to_string();
                assert!(m.contains("all_reduce #1 (stream collective)"), "{m}");
                assert!(m.contains("Avg") && m.contains("I64"), "{m}");
            }
            other => panic!("expected DType, got {other:?}"),
        }
        assert!(
            matches!(&b, Some(e @ Error::DType { .. }) if e.to_string().contains("reduce_scatter #1") && e.to_string().contains("U8")),
            "{b:?}"
        );
    }
}

#[test]
fn broadcast_from_non_zero_root() {
    for ws in WORLD_SIZES {
        let root = ws - 1;
        for len in [0usize, 1, 7] {
            let outs = run(ws, |pg| {
                let r = pg.rank();
                let buf = f32_t((0..len).map(|i| v(r, i)));
                Ok(as_f32(pg.broadcast(buf, root).wait()?))
            });
            for out in outs {
                assert_eq!(out, (0..len).map(|i| v(root, i)).collect::<Vec<_>>());
            }
        }
    }
    let outs = run(3, |pg| {
        let buf = t(vec![bf16::from_f32(pg.rank() as f32 + 0.5); 2]);
        Ok(as_f32(pg.broadcast(buf, 1).wait()?))
    });
    for out in outs {
        assert_eq!(out, vec![1.5, 1.5]);
    }
}

#[test]
fn reduce_to_root_leaves_non_roots_unchanged() {
    for ws in WORLD_SIZES {
        let root = ws / 2;
        let outs = run(ws, |pg| {
            let r = pg.rank();
            let buf = f32_t((0..5).map(|i| v(r, i)));
            Ok(as_f32(pg.reduce(buf, root, ReduceOp::Sum).wait()?))
        });
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
    let outs = run(2, |pg| {
        let r = pg.rank();
        Ok(as_f32(
            pg.reduce(f32_t([v(r, 0), v(r, 1)]), 1, ReduceOp::Avg)
                .wait()?,
        ))
    });
    assert_eq!(outs, vec![vec![0.0, 1.0], vec![50.0, 51.0]]);
}

#[test]
fn barrier_separates_phases() {
    for ws in WORLD_SIZES {
        let counter = AtomicUsize::new(0);
        run(ws, |pg| {
            for round in 0..20 {
                counter.fetch_add(1, Ordering::SeqCst);
                pg.barrier().wait()?;
                assert_eq!(counter.load(Ordering::SeqCst), ws * (round + 1));
                pg.barrier().wait()?;
            }
            Ok(())
        });
    }
}

#[test]
fn host_helpers_run_on_the_default_stream() {
    let outs = run_ranks_ok(3, cfg(), |pg| {
        let r = pg.rank();
        let sum = pg.all_reduce_f32s(vec![r as f32, 1.0], ReduceOp::Sum)?;
        let max = pg.all_reduce_i64s(vec![-(r as i64)], ReduceOp::Min)?;
        let steps = pg.all_reduce_u64s(vec![(1 << 40) + r as u64], ReduceOp::Max)?;
        // Every u64 round-trips through a broadcast, u64::MAX included.
        let b = pg.broadcast_u64s(vec![u64::MAX - r as u64, 7], 1)?;
        let bf = pg.broadcast_f32s(vec![r as f32 + 0.25], 2)?;
        let red = pg.reduce_f32s(vec![r as f32 + 1.0], 0, ReduceOp::Sum)?;
        let gathered = pg.all_gather_f32s(&[r as f32, -(r as f32)])?;
        pg.barrier_wait()?;
        let too_big = pg.all_reduce_u64s(vec![u64::MAX], ReduceOp::Max).err();
        Ok((sum, max, steps, b, bf, red, gathered, too_big, pg.stats()))
    })
    .unwrap();
    for (r, (sum, max, steps, b, bf, red, gathered, too_big, stats)) in outs.into_iter().enumerate()
    {
        assert_eq!(sum, vec![3.0, 3.0]);
        assert_eq!(max, vec![-2]);
        assert_eq!(steps, vec![(1 << 40) + 2]);
        assert_eq!(b, vec![u64::MAX - 1, 7]);
        assert_eq!(bf, vec![2.25]);
        let expected_red = if r == 0 { 6.0 } else { r as f32 + 1.0 };
        assert_eq!(red, vec![expected_red]);
        assert_eq!(gathered, vec![0.0, -0.0, 1.0, -1.0, 2.0, -2.0]);
        assert!(
            matches!(&too_big, Some(e @ Error::Value { .. }) if e.to_string().contains("does not fit")),
            "{too_big:?}"
        );
        // 7 collectives on the default stream besides the all-gather (the refused u64 never
        // reached the group).
        assert_eq!(stats.all_gather_calls, 1);
        assert_eq!(stats.other_calls, 7);
    }
}

#[test]
fn streams_are_independent() {
    // Rank 0 issues reduce_scatter then all_gather; rank 1 the opposite order. Each stream
    // executes its own ops in order, so both complete.
    let outs = run(2, |pg| {
        let r = pg.rank();
        let rs = || pg.reduce_scatter(f32_t([v(r, 0), v(r, 1)]), zeros(1), ReduceOp::Sum);
        let ag = || pg.all_gather(f32_t([v(r, 0)]), zeros(2));
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
    });
    assert_eq!(outs[0], (vec![100.0], vec![0.0, 100.0]));
    assert_eq!(outs[1], (vec![102.0], vec![0.0, 100.0]));
}

#[test]
fn created_streams_run_on_their_own_named_threads_and_name_their_ops() {
    let outs = run_ranks_ok(2, cfg(), |pg| {
        let a = pg.new_stream("prefetch")?;
        let b = pg.new_stream("grads")?;
        assert_eq!((a.name(), b.name()), ("prefetch", "grads"));
        let names = Arc::new(Mutex::new(Vec::new()));
        struct Names(Arc<Mutex<Vec<(String, String)>>>);
        impl CommObserver for Names {
            fn op_started(&self, _: &str, _: OpKind, op: &str) -> Option<Box<dyn Send>> {
                let thread = std::thread::current().name().unwrap_or("").to_string();
                self.0.lock().push((op.to_string(), thread));
                None
            }
        }
        pg.set_observer(Some(Arc::new(Names(names.clone()))));
        let w = pg.all_reduce(&b, f32_t([1.0]), ReduceOp::Sum);
        pg.barrier(&a).wait()?;
        assert_eq!(as_f32(w.wait()?), vec![2.0]);
        pg.set_observer(None);
        let mut names = names.lock().clone();
        names.sort();
        Ok(names)
    })
    .unwrap();
    for (r, names) in outs.into_iter().enumerate() {
        assert_eq!(
            names,
            vec![
                (
                    "all_reduce #1 (stream grads)".to_string(),
                    format!("rank-{r}-grads")
                ),
                (
                    "barrier #1 (stream prefetch)".to_string(),
                    format!("rank-{r}-prefetch")
                ),
            ]
        );
    }
}

#[test]
fn observer_receives_spans_with_the_stream_names_the_caller_chose() {
    #[derive(Default)]
    struct Recorder {
        events: Mutex<Vec<String>>,
    }
    struct End(Arc<Recorder>, String);
    impl Drop for End {
        fn drop(&mut self) {
            self.0.events.lock().push(format!("end {}", self.1));
        }
    }
    struct Observer(Arc<Recorder>);
    impl CommObserver for Observer {
        fn op_started(&self, stream: &str, kind: OpKind, op: &str) -> Option<Box<dyn Send>> {
            self.0
                .events
                .lock()
                .push(format!("start {stream} {kind:?} {op}"));
            Some(Box::new(End(self.0.clone(), op.to_string())))
        }
    }
    let session = TraceSession::new();
    let outs = run_ranks_ok(2, cfg(), |pg| {
        let r = pg.rank();
        let gathers = pg.new_stream("param_gather")?;
        let recorder = Arc::new(Recorder::default());
        pg.set_observer(Some(Arc::new(Observer(recorder.clone()))));
        pg.all_gather(&gathers, &f32_t([1.0]), zeros(2)).wait()?;
        pg.barrier_wait()?;
        // The tracer is an observer too: one span per collective, on the lane of its stream.
        let tracer = session.tracer(r);
        pg.set_observer(Some(tracer.clone()));
        pg.all_gather(&gathers, &f32_t([1.0]), zeros(2)).wait()?;
        pg.all_reduce_f32s(vec![1.0], ReduceOp::Sum)?;
        pg.set_observer(None);
        pg.barrier_wait()?;
        let events = recorder.events.lock().clone();
        Ok((events, tracer.spans()))
    })
    .unwrap();
    for (events, spans) in outs {
        assert_eq!(
            events,
            vec![
                "start param_gather AllGather all_gather #1 (stream param_gather)",
                "end all_gather #1 (stream param_gather)",
                "start collective Barrier barrier #1 (stream collective)",
                "end barrier #1 (stream collective)",
            ]
        );
        assert_eq!(spans.len(), 2, "{spans:?}");
        assert_eq!(spans[0].lane, Lane::comm("param_gather"));
        assert_eq!(spans[0].lane.name(), "param_gather");
        assert!(spans[0].lane.tid() >= 4);
        assert_eq!(spans[0].kind, SpanKind::AllGather);
        assert_eq!(spans[0].name, "all_gather #2 (stream param_gather)");
        assert_eq!(spans[1].lane, Lane::comm("collective"));
        assert_eq!(spans[1].lane.tid(), 3);
        assert_eq!(spans[1].kind, SpanKind::Collective);
        assert_eq!(spans[1].name, "all_reduce #2 (stream collective)");
    }
    // FSDP's stream names keep their lanes.
    assert_eq!(Lane::comm("all_gather").tid(), 1);
    assert_eq!(Lane::comm("reduce_scatter").tid(), 2);
    assert_eq!(Lane::comm("reduce_scatter").name(), "reduce_scatter");
}

#[test]
fn a_stream_works_only_with_the_group_that_created_it() {
    let a = new_group(1, cfg()).unwrap();
    let b = new_group(1, cfg()).unwrap();
    let err = b[0]
        .all_reduce(&a[0].default_stream(), zeros(1), ReduceOp::Sum)
        .wait()
        .unwrap_err();
    assert!(
        matches!(&err, Error::Value { what, found, .. } if what.contains("\"collective\"") && found.contains("not created by this process group")),
        "{err}"
    );
    // Its own stream works.
    assert_eq!(
        as_f32(
            b[0].all_reduce(&b[0].default_stream(), f32_t([2.0]), ReduceOp::Sum)
                .wait()
                .unwrap()
        ),
        vec![2.0]
    );
}

#[test]
fn many_back_to_back_async_ops_waited_at_the_end() {
    let rounds = 40;
    for ws in [2usize, 3] {
        run(ws, |pg| {
            let r = pg.rank();
            let mut ags = Vec::new();
            let mut rss = Vec::new();
            let mut ars = Vec::new();
            let mut bars: Vec<Work<()>> = Vec::new();
            for k in 0..rounds {
                let base = (k * 1000) as f32;
                ags.push(pg.all_gather(f32_t([base + r as f32; 3]), zeros(3 * ws)));
                rss.push(pg.reduce_scatter(
                    f32_t((0..ws * 2).map(|i| base + v(r, i))),
                    zeros(2),
                    ReduceOp::Sum,
                ));
                ars.push(pg.all_reduce(f32_t([base, r as f32]), ReduceOp::Max));
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
        });
    }
}

#[test]
fn works_complete_out_of_wait_order_and_report_completion() {
    run(2, |pg| {
        let a = pg.all_reduce(f32_t([1.0]), ReduceOp::Sum);
        let b = pg.all_reduce(f32_t([2.0]), ReduceOp::Sum);
        // Waiting the second first is fine: the stream runs both in order.
        assert_eq!(as_f32(b.wait_compute()?), vec![4.0]);
        assert!(a.is_completed());
        assert_eq!(as_f32(a.wait()?), vec![2.0]);
        // A dropped Work still runs on every rank.
        drop(pg.all_reduce(f32_t([5.0]), ReduceOp::Sum));
        assert_eq!(
            as_f32(pg.all_reduce(f32_t([3.0]), ReduceOp::Sum).wait()?),
            vec![6.0]
        );
        Ok(())
    });
}

#[test]
fn work_ready_pending_and_device_completions() {
    let w = Work::ready(Ok(5u32));
    assert!(w.is_completed());
    assert_eq!(w.wait().unwrap(), 5);

    // A completer dropped unused (its stream stopped) gives StreamStopped, not a hang.
    let (w, completer) = Work::<u32>::pending("all_gather #3 (stream x)", 1, "x");
    assert!(!w.is_completed());
    drop(completer);
    assert!(w.is_completed());
    match w.wait() {
        Err(Error::StreamStopped { op, rank, stream }) => {
            assert_eq!(op, "all_gather #3 (stream x)");
            assert_eq!(rank, 1);
            assert_eq!(stream, "x");
        }
        other => panic!("expected StreamStopped, got {other:?}"),
    }

    // Completed from another thread while the host waits.
    let (w, completer) = Work::pending("op", 0, "s");
    let th = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        completer.complete(Ok(7));
    });
    assert_eq!(w.wait_compute().unwrap(), 7);
    th.join().unwrap();

    // A device-style completion: `wait_compute` asks the completion for a compute-stream wait,
    // `wait` for a host wait.
    #[derive(Default)]
    struct Event {
        host: AtomicUsize,
        compute: AtomicUsize,
        fail: bool,
    }
    impl Completion for Event {
        fn is_completed(&self) -> bool {
            self.host.load(Ordering::SeqCst) > 0
        }
        fn wait_host(&self) -> Result<()> {
            self.host.fetch_add(1, Ordering::SeqCst);
            if self.fail {
                return Err(Error::InvalidArgument("device error".into()));
            }
            Ok(())
        }
        fn wait_compute(&self) -> Result<()> {
            self.compute.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }
    let ev = Arc::new(Event::default());
    let w = Work::with_completion(3, ev.clone());
    assert!(!w.is_completed());
    assert_eq!(w.wait_compute().unwrap(), 3);
    assert_eq!(ev.compute.load(Ordering::SeqCst), 1);
    assert_eq!(ev.host.load(Ordering::SeqCst), 0);
    assert_eq!(Work::with_completion(4, ev.clone()).wait().unwrap(), 4);
    assert_eq!(ev.host.load(Ordering::SeqCst), 1);
    let failing = Arc::new(Event {
        fail: true,
        ..Event::default()
    });
    assert!(matches!(
        Work::with_completion(4, failing).wait(),
        Err(Error::InvalidArgument(m)) if m == "device error"
    ));
}

#[test]
fn stats_count_calls_and_input_bytes() {
    let stats = run(2, |pg| {
        pg.all_gather(zeros(10), zeros(20)).wait()?; // 40 bytes
        pg.all_gather(zeros_of(DType::BF16, 3), zeros_of(DType::BF16, 6))
            .wait()?; // 6 bytes
        pg.reduce_scatter(
            zeros_of(DType::BF16, 8),
            zeros_of(DType::BF16, 4),
            ReduceOp::Avg,
        )
        .wait()?; // 16 bytes
        pg.all_reduce(zeros_of(DType::F16, 5), ReduceOp::Sum)
            .wait()?; // 10 bytes
        pg.broadcast(zeros(2), 0).wait()?; // 8 bytes
        pg.reduce(zeros(1), 1, ReduceOp::Max).wait()?; // 4 bytes
        pg.barrier().wait()?; // 0 bytes
        pg.all_reduce(zeros_of(DType::I64, 3), ReduceOp::Max)
            .wait()?; // 24 bytes
        Ok(pg.pg.stats())
    });
    for s in stats {
        assert_eq!(s.all_gather_calls, 2);
        assert_eq!(s.all_gather_bytes, 46);
        assert_eq!(s.reduce_scatter_calls, 1);
        assert_eq!(s.reduce_scatter_bytes, 16);
        assert_eq!(s.other_calls, 5);
        assert_eq!(s.other_bytes, 46);
    }
    // A bare backend handle counts nothing: the wrapper does.
    let bare = new_group(1, cfg()).unwrap();
    bare[0].barrier(&bare[0].default_stream()).wait().unwrap();
    assert_eq!(bare[0].stats(), Default::default());
}

#[test]
fn new_group_splits_a_world_of_four() {
    let outs = run_ranks_ok(4, cfg(), |pg| {
        let r = pg.rank();
        let low = pg.new_group(&[0, 1])?;
        // Ranks are renumbered by position in the list: rank 3 is rank 0 of `high`.
        let high = pg.new_group(&[3, 2])?;
        let sub = match (r < 2, low, high) {
            (true, Some(g), None) | (false, None, Some(g)) => g,
            (_, l, h) => panic!("rank {r}: low {:?} high {:?}", l.is_some(), h.is_some()),
        };
        let sums = sub.all_reduce_f32s(vec![v(r, 0), v(r, 1)], ReduceOp::Sum)?;
        let gathered = sub.all_gather_f32s(&[r as f32])?;
        // The parent group still works, interleaved with the sub-groups.
        let total = pg.all_reduce_f32s(vec![1.0], ReduceOp::Sum)?;
        Ok((
            sub.rank(),
            sub.world_size(),
            sums,
            gathered,
            total,
            sub.stats().other_calls,
        ))
    })
    .unwrap();
    assert_eq!(
        outs[0],
        (0, 2, vec![100.0, 102.0], vec![0.0, 1.0], vec![4.0], 1)
    );
    assert_eq!(
        outs[1],
        (1, 2, vec![100.0, 102.0], vec![0.0, 1.0], vec![4.0], 1)
    );
    assert_eq!(
        outs[2],
        (1, 2, vec![500.0, 502.0], vec![3.0, 2.0], vec![4.0], 1)
    );
    assert_eq!(
        outs[3],
        (0, 2, vec![500.0, 502.0], vec![3.0, 2.0], vec![4.0], 1)
    );
}

#[test]
fn new_group_refuses_bad_lists_on_every_rank() {
    let outs = run_ranks_ok(4, cfg(), |pg| {
        let errs: Vec<Option<Error>> = [&[][..], &[0, 0][..], &[1, 4][..]]
            .iter()
            .map(|ranks| pg.new_group(ranks).err())
            .collect();
        // Still usable, and a good list still works afterwards.
        let all = pg
            .new_group(&[0, 1, 2, 3])?
            .expect("every rank is a member");
        assert_eq!(all.rank(), pg.rank());
        assert_eq!(all.all_reduce_f32s(vec![1.0], ReduceOp::Sum)?, vec![4.0]);
        Ok(errs)
    })
    .unwrap();
    for errs in outs {
        let texts: Vec<String> = errs
            .into_iter()
            .map(|e| match e {
                Some(
                    e @ (Error::Missing { .. } | Error::Value { .. } | Error::OutOfRange { .. }),
                ) => e.to_string(),
                other => panic!("expected a bad-argument error, got {other:?}"),
            })
            .collect();
        assert!(texts[0].contains("at least one rank"), "{}", texts[0]);
        assert!(
            texts[1].contains("rank 0 must be listed once, found listed twice"),
            "{}",
            texts[1]
        );
        assert!(
            texts[2].contains("rank 4 is out of range for world size 4"),
            "{}",
            texts[2]
        );
    }
}

#[test]
fn launcher_runs_every_rank_and_returns_values_by_rank() {
    let launcher = Launcher::threads(3);
    assert_eq!(launcher.world_size(), 3);
    assert_eq!(launcher.local_ranks(), 0..3);
    let out = launch(&launcher, |pg| {
        let sum = pg.all_reduce_f32s(vec![pg.rank() as f32], ReduceOp::Sum)?;
        Ok((pg.rank(), pg.backend(), sum, pg.stats().other_calls))
    })
    .unwrap();
    for (r, o) in out.into_iter().enumerate() {
        assert_eq!(o, (r, "threads", vec![3.0], 1));
    }
    let each = Launcher::Threads {
        world_size: 2,
        config: cfg(),
    }
    .run_each(|pg| {
        if pg.rank() == 1 {
            return Err(Error::InvalidArgument("rank 1 refuses".into()));
        }
        Ok(pg.rank())
    });
    assert!(matches!(each[0], Ok(0)));
    assert!(matches!(&each[1], Err(Error::InvalidArgument(m)) if m == "rank 1 refuses"));
}

#[test]
fn run_ranks_ok_reports_the_root_cause() {
    let err = run_ranks_ok(3, cfg(), |pg| {
        if pg.rank() == 2 {
            panic!("root cause on rank 2");
        }
        pg.all_reduce_f32s(vec![0.0; 2], ReduceOp::Sum)?;
        Ok(())
    })
    .unwrap_err();
    assert!(
        matches!(&err, Error::RankPanicked { rank: 2, message } if message == "root cause on rank 2"),
        "{err:?}"
    );
}

#[test]
fn the_root_cause_is_found_under_in_step_context_and_returned_whole() {
    // Rank 2 fails in a step; ranks 0 and 1 see the echo, also wrapped in step context. Rank 0's
    // echo comes first in rank order, but the root cause is rank 2's whole error.
    let body = |pg: Arc<dyn ProcessGroup>| -> Result<()> {
        if pg.rank() == 2 {
            return Err(Error::InvalidArgument("bad batch".into()).in_step(
                Some("fc1"),
                Phase::Forward,
                4,
            ));
        }
        pg.all_reduce_f32s(vec![0.0], ReduceOp::Sum)
            .map_err(|e| e.in_step(Some("fc2"), Phase::Backward, 4))?;
        Ok(())
    };
    let check = |err: Error| {
        match &err {
            Error::InStep {
                unit, phase, step, ..
            } => {
                assert_eq!(unit.as_deref(), Some("fc1"));
                assert_eq!(*phase, Phase::Forward);
                assert_eq!(*step, 4);
            }
            other => panic!("expected InStep, got {other:?}"),
        }
        assert!(matches!(err.root_cause(), Error::InvalidArgument(m) if m == "bad batch"));
    };
    check(run_ranks_ok(3, cfg(), body).unwrap_err());
    check(launch(&Launcher::threads(3), body).unwrap_err());
    // The echoes themselves are wrapped PeerFailed naming rank 2.
    let results = run_ranks(3, cfg(), body);
    for r in [0, 1] {
        let e = results[r].as_ref().unwrap_err();
        assert!(matches!(e, Error::InStep { .. }), "{e:?}");
        assert!(
            matches!(e.root_cause(), Error::PeerFailed { failed_rank: 2, .. }),
            "{e:?}"
        );
    }
}

/// Runs `f` on `ws` ranks and returns each rank's result, all of which are required to be Ok
/// at the run level (errors of the collectives are returned as values).
fn collect_errors<F>(ws: usize, f: F) -> Vec<Option<Error>>
where
    F: Fn(&Pg) -> Result<Option<Error>> + Send + Sync,
{
    run(ws, f)
}

#[test]
fn threads_reduce_scatter_bf16_accumulates_in_f32_and_rounds_once() {
    // 256 + 1 + 1: summed in bf16 step by step this is 256 (257 rounds to even 256, twice);
    // accumulated in f32 and rounded once it is 258, which bf16 represents exactly.
    let outs = run(3, |pg| {
        let x = if pg.rank() == 0 { 256.0 } else { 1.0 };
        let input = t(vec![bf16::from_f32(x); 3]);
        let out = pg
            .reduce_scatter(input, zeros_of(DType::BF16, 1), ReduceOp::Sum)
            .wait()?;
        Ok(as_f32(out))
    });
    for out in outs {
        assert_eq!(out, vec![258.0]);
    }
    // Same for f16 with 2048 + 1 + 1 (f16 spacing is 2 above 2048).
    let outs = run(3, |pg| {
        let x = if pg.rank() == 0 { 2048.0 } else { 1.0 };
        let input = t(vec![f16::from_f32(x); 3]);
        let out = pg
            .reduce_scatter(input, zeros_of(DType::F16, 1), ReduceOp::Sum)
            .wait()?;
        Ok(as_f32(out))
    });
    for out in outs {
        assert_eq!(out, vec![2050.0]);
    }
}

#[test]
fn threads_reductions_run_in_rank_order_on_every_rank() {
    // In f32, (1e8 + 1) - 1e8 = 0 (1e8 + 1 rounds to 1e8), while 1e8 + (1 - 1e8) = 0 too but
    // (1e8 - 1e8) + 1 = 1: rank order 0, 1, 2 over [1e8, 1, -1e8] gives 0 on every rank and in
    // every chunk of an all-reduce split across ranks.
    let outs = run(3, |pg| {
        let x = [1e8f32, 1.0, -1e8][pg.rank()];
        let ar = as_f32(pg.all_reduce(f32_t([x; 7]), ReduceOp::Sum).wait()?);
        let rs = as_f32(
            pg.reduce_scatter(f32_t([x; 6]), zeros(2), ReduceOp::Sum)
                .wait()?,
        );
        Ok((ar, rs))
    });
    for (ar, rs) in outs {
        assert_eq!(ar, vec![0.0; 7]);
        assert_eq!(rs, vec![0.0; 2]);
    }
}

#[test]
fn threads_max_min_and_sum_propagate_nan() {
    for ws in WORLD_SIZES {
        run(ws, |pg| {
            // NaN on the last rank propagates through Max, Min and Sum.
            let last = pg.rank() == ws - 1;
            for op in [ReduceOp::Max, ReduceOp::Min, ReduceOp::Sum] {
                let buf = f32_t([if last { f32::NAN } else { 1.0 }, 2.0]);
                let out = as_f32(pg.all_reduce(buf, op).wait()?);
                assert!(out[0].is_nan(), "{op:?}");
                assert!(!out[1].is_nan());
            }
            Ok(())
        });
    }
}

#[test]
fn threads_mismatched_lengths_fail_on_every_rank_and_the_group_stays_usable() {
    let errs = collect_errors(3, |pg| {
        let n = if pg.rank() == 2 { 5 } else { 4 };
        let err = pg.all_gather(zeros(n), zeros(3 * n)).wait().err();
        // The group is still usable afterwards.
        let out = as_f32(pg.all_reduce(f32_t([1.0]), ReduceOp::Sum).wait()?);
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
fn threads_bad_output_buffer_fails_on_every_rank() {
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
        Ok(pg
            .all_gather(zeros(2), zeros_of(DType::BF16, 4))
            .wait()
            .err())
    });
    for e in errs {
        assert!(matches!(e, Some(Error::BadBuffer { rank: 0, .. })), "{e:?}");
    }
}

#[test]
fn threads_tensors_a_rank_cannot_use_fail_on_every_rank() {
    // (what rank 1 passes, the buffer named, what is expected)
    type Bad = fn() -> Tensor;
    let cases: [(Bad, &str, &str); 3] = [
        (
            || zeros(6).reshape((2, 3)).unwrap(),
            "buffer",
            "a 1-D tensor",
        ),
        (
            // Every other element of a (3, 2) matrix: 1-D, stride 2.
            || {
                Tensor::arange(0f32, 6., &Device::Cpu)
                    .unwrap()
                    .reshape((3, 2))
                    .unwrap()
                    .narrow(1, 0, 1)
                    .unwrap()
                    .squeeze(1)
                    .unwrap()
            },
            "buffer",
            "a contiguous tensor",
        ),
        (|| zeros_of(DType::F8E4M3, 3), "buffer", "f32, bf16"),
    ];
    for (bad, which, expected_text) in cases {
        let errs = collect_errors(2, |pg| {
            let buf = if pg.rank() == 1 { bad() } else { zeros(3) };
            let err = pg.all_reduce(buf, ReduceOp::Sum).wait().err();
            // Still usable.
            assert_eq!(
                as_f32(pg.all_reduce(f32_t([1.0]), ReduceOp::Sum).wait()?),
                vec![2.0]
            );
            Ok(err)
        });
        for e in errs {
            match e {
                Some(Error::BadBuffer {
                    op,
                    rank,
                    what,
                    expected,
                    ..
                }) => {
                    assert_eq!(op, "all_reduce #1 (stream collective)");
                    assert_eq!(rank, 1);
                    assert_eq!(what, format!("all_reduce {which}"));
                    assert!(expected.starts_with(expected_text), "{expected}");
                }
                other => panic!("expected BadBuffer, got {other:?}"),
            }
        }
    }
    // An output sharing the input's storage (Candle refuses to lock it for writing).
    let errs = collect_errors(2, |pg| {
        let out = zeros(4);
        let input = if pg.rank() == 0 {
            out.narrow(0, 0, 2)?
        } else {
            zeros(2)
        };
        let err = pg.all_gather(input, out).wait().err();
        assert_eq!(
            as_f32(pg.all_gather(f32_t([1.0]), zeros(2)).wait()?),
            vec![1.0, 1.0]
        );
        Ok(err)
    });
    for e in errs {
        assert!(
            matches!(&e, Some(Error::BadBuffer { rank: 0, what, .. }) if what == "all_gather output"),
            "{e:?}"
        );
    }
}

#[test]
fn threads_mismatched_dtype_op_root_or_collective_fail_on_every_rank() {
    // dtype
    let errs = collect_errors(2, |pg| {
        let dtype = if pg.rank() == 1 {
            DType::F16
        } else {
            DType::F32
        };
        Ok(pg
            .all_reduce(zeros_of(dtype, 3), ReduceOp::Sum)
            .wait()
            .err())
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
                if found == "ReduceOp::Max" && expected == "ReduceOp::Sum"),
            "{e:?}"
        );
    }
    // root
    let errs = collect_errors(2, |pg| Ok(pg.broadcast(zeros(3), pg.rank()).wait().err()));
    for e in errs {
        assert!(
            matches!(&e, Some(Error::CollectiveMismatch { rank: 1, found, expected, .. })
                if found == "root 1" && expected == "root 0"),
            "{e:?}"
        );
    }
    // root out of range (the same on every rank)
    let errs = collect_errors(2, |pg| Ok(pg.broadcast(zeros(3), 2).wait().err()));
    for e in errs {
        assert!(matches!(e, Some(Error::OutOfRange { .. })), "{e:?}");
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
fn threads_stream_names_and_group_lists_must_agree() {
    let outs = run_ranks_ok(2, cfg(), |pg| {
        let name = if pg.rank() == 0 { "gather" } else { "scatter" };
        let stream_err = pg.new_stream(name).err();
        let ranks: &[usize] = if pg.rank() == 0 { &[0, 1] } else { &[1, 0] };
        let group_err = pg.new_group(ranks).err();
        // Both failed everywhere, so the next stream is the first one on every rank.
        let s = pg.new_stream("gather")?;
        assert_eq!(
            as_f32(pg.all_reduce(&s, f32_t([1.0]), ReduceOp::Sum).wait()?),
            vec![2.0]
        );
        Ok((stream_err, group_err))
    })
    .unwrap();
    for (stream_err, group_err) in outs {
        let (op, found, expected) = rank1_mismatch(stream_err);
        assert!(op.starts_with("new_stream #1"), "{op}");
        assert_eq!(found, "name \"scatter\"");
        assert_eq!(expected, "name \"gather\"");
        let (_, found, expected) = rank1_mismatch(group_err);
        assert_eq!(found, "ranks [1, 0]");
        assert_eq!(expected, "ranks [0, 1]");
    }
}

/// The operation, found and expected values of a [`Error::CollectiveMismatch`] naming rank 1.
fn rank1_mismatch(e: Option<Error>) -> (String, String, String) {
    match e {
        Some(Error::CollectiveMismatch {
            op,
            rank: 1,
            found,
            expected,
            ..
        }) => (op, found, expected),
        other => panic!("expected CollectiveMismatch of rank 1, got {other:?}"),
    }
}

/// A stream's name may hold any character (a NUL, which no thread name may: the stream's
/// thread is named without it); messages quote a long name or rank list shortened.
#[test]
fn threads_odd_and_long_names_work_and_are_quoted_short() {
    let outs = run_ranks_ok(2, cfg(), |pg| {
        let s = pg.new_stream("bad\0name")?;
        let sum = as_f32(pg.all_reduce(&s, f32_t([1.0]), ReduceOp::Sum).wait()?);
        let long = "n".repeat(if pg.rank() == 0 { 5_000 } else { 6_000 });
        let stream_err = pg.new_stream(&long).err();
        let ranks: Vec<usize> = (0..40).map(|r| r % 2).collect();
        let group_err = pg.new_group(&ranks).err();
        Ok((sum, stream_err, group_err))
    })
    .unwrap();
    let n48 = "n".repeat(48);
    for (sum, stream_err, group_err) in outs {
        assert_eq!(sum, vec![2.0]);
        let (op, found, expected) = rank1_mismatch(stream_err);
        assert!(
            op.starts_with(&format!("new_stream #2 (\"{n48}… (")),
            "{op}"
        );
        assert_eq!(found, format!("name \"{n48}… (6000 bytes)\""));
        assert_eq!(expected, format!("name \"{n48}… (5000 bytes)\""));
        let e = group_err
            .expect("a rank listed twice is refused")
            .to_string();
        assert!(
            e.contains("new_group #3 ([0, 1, 0, 1, 0, 1, 0, 1, … (40 ranks)]): rank 0"),
            "{e}"
        );
    }
}

#[test]
fn threads_a_panicking_rank_aborts_pending_collectives_promptly() {
    let results = run_ranks::<(), _>(2, cfg(), |pg| {
        let pg = Pg::new(&pg)?;
        for _ in 0..2 {
            pg.all_gather(zeros(4), zeros(8)).wait()?;
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
fn threads_a_rank_returning_an_error_aborts_its_peers() {
    let results = run_ranks::<(), _>(3, cfg(), |pg| {
        if pg.rank() == 1 {
            return Err(Error::InvalidArgument("bad batch on rank 1".into()));
        }
        let start = Instant::now();
        let err = pg.all_reduce_f32s(vec![0.0; 3], ReduceOp::Sum).unwrap_err();
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
        pg.all_reduce_f32s(vec![0.0; 3], ReduceOp::Sum)?;
        Ok(())
    })
    .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
}

#[test]
fn threads_an_abort_reaches_sub_groups_naming_the_root_rank() {
    // World 3; sub-group [2, 0]: root rank 2 is its rank 0, root rank 0 its rank 1. Root rank 2
    // aborts through the root group while keeping its sub-group handle; root rank 0, waiting in
    // a sub-group collective, fails promptly naming root rank 2.
    let results = run_ranks(3, cfg(), |pg| {
        let sub = pg.new_group(&[2, 0])?;
        match (pg.rank(), sub) {
            (2, Some(_sub)) => {
                std::thread::sleep(Duration::from_millis(100));
                pg.abort("rank 2 gives up");
                std::thread::sleep(Duration::from_millis(200));
                Ok(None)
            }
            (0, Some(sub)) => {
                let start = Instant::now();
                let err = sub.all_reduce_f32s(vec![1.0], ReduceOp::Sum).err();
                assert!(start.elapsed() < Duration::from_secs(20));
                Ok(err)
            }
            _ => Ok(None),
        }
    });
    match &results[0] {
        Ok(Some(Error::PeerFailed {
            op,
            rank,
            failed_rank,
            reason,
        })) => {
            assert_eq!(op, "all_reduce #1 (stream collective)");
            assert_eq!(*rank, 1, "this rank's number in the sub-group");
            assert_eq!(
                *failed_rank, 2,
                "the failed rank's number in the root group"
            );
            assert_eq!(reason, "rank 2 gives up");
        }
        other => panic!("rank 0: {other:?}"),
    }
}

#[test]
fn threads_a_rank_exiting_early_gives_peer_exited() {
    let results = run_ranks(2, cfg(), |pg| {
        let pg = Pg::new(&pg)?;
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
fn threads_dropping_handles_with_crossed_pending_ops_does_not_hang() {
    // Rank 0 waits on one stream, rank 1 on another; dropping both handles closes the idle
    // streams, so each pending op sees its peer exit.
    let mut groups = new_group(2, cfg()).unwrap();
    let g1: Arc<dyn ProcessGroup> = groups.pop().unwrap();
    let g0 = groups.pop().unwrap();
    let streams = std::thread::scope(|s| {
        let a = s.spawn(|| g0.new_stream("a").unwrap());
        let b = s.spawn(|| g1.new_stream("a").unwrap());
        (a.join().unwrap(), b.join().unwrap())
    });
    let w0 = g0.all_gather(&streams.0, &zeros(1), zeros(2));
    let w1 = g1.reduce_scatter(&g1.default_stream(), &zeros(2), zeros(1), ReduceOp::Sum);
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
    // A stream handle outliving its group: operations on it cannot run.
    drop(streams);
}

#[test]
fn threads_a_late_rank_times_out_the_others() {
    let config = ThreadGroupConfig {
        timeout: Duration::from_millis(300),
    };
    let results = run_ranks(2, config, |pg| {
        if pg.rank() == 1 {
            std::thread::sleep(Duration::from_secs(3));
        }
        let start = Instant::now();
        let r = pg.all_reduce_f32s(vec![0.0; 4], ReduceOp::Sum);
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

/// A world of one rank runs its closure on a worker of rayon's global pool when there is more
/// than one intra-op thread (its kernels' parallel regions then start on an awake worker,
/// decision 68); ranks that share the process keep threads of their own. The result and an
/// error come back the same way.
#[test]
fn a_lone_rank_runs_on_a_pool_worker_and_ranks_that_share_the_process_do_not() {
    let pooled = candle_core::utils::get_num_threads() > 1;
    let lone = run_ranks(1, ThreadGroupConfig::default(), |_| {
        Ok(rayon::current_thread_index())
    });
    assert_eq!(lone.len(), 1);
    assert_eq!(lone[0].as_ref().unwrap().is_some(), pooled, "{lone:?}");
    let shared = run_ranks(2, ThreadGroupConfig::default(), |_| {
        Ok(rayon::current_thread_index())
    });
    assert!(
        shared.iter().all(|r| r.as_ref().unwrap().is_none()),
        "{shared:?}"
    );
    let failed = run_ranks(1, ThreadGroupConfig::default(), |_| -> Result<()> {
        Err(Error::InvalidArgument("on purpose".into()))
    });
    assert!(
        matches!(&failed[0], Err(Error::InvalidArgument(m)) if m == "on purpose"),
        "{failed:?}"
    );
    let panicked = run_ranks(1, ThreadGroupConfig::default(), |_| -> Result<()> {
        panic!("on purpose")
    });
    assert!(
        matches!(&panicked[0], Err(Error::RankPanicked { rank: 0, message }) if message.contains("on purpose")),
        "{panicked:?}"
    );
}
