//! Prefetch and the rate limiter, proved from the trace: the order of issue markers and compute
//! spans, the number of units unsharded at once, and bitwise-equal results with prefetch on and
//! off; and from the runtime's memory stats on an 8-block GPT (with and without frozen twins).

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::ProcessGroup;
use candle_fsdp::optim::{AdamW, AdamWConfig, ShardedOptimizer};
use candle_fsdp::trace::{chrome_trace_json, overlap_summary, Lane, Span, SpanKind, TraceSession};
use candle_fsdp::{BackwardPrefetch, FsdpConfig, FsdpModel};

use crate::user_gpt::{batches, builder, make_opt, BlockCfg, Case, DM, V};

const UNITS: usize = 8;
const DIM: usize = 32;

fn model(
    pg: Arc<dyn ProcessGroup>,
    prefetch: bool,
    limit: Option<usize>,
    mode: BackwardPrefetch,
) -> candle_fsdp::Result<FsdpModel> {
    let mut b = FsdpModel::builder(
        pg,
        FsdpConfig {
            seed: 3,
            forward_prefetch: prefetch,
            backward_prefetch: if prefetch {
                mode
            } else {
                BackwardPrefetch::None
            },
            limit_all_gathers: limit,
            // The lanes asserted below are FSDP's two streams (Auto shares one on a machine
            // with no more cores than ranks).
            comm_streams: candle_fsdp::CommStreams::Separate,
            ..Default::default()
        },
    );
    for i in 0..UNITS {
        b = b.unit(format!("u{i}"), |vb| {
            Ok(candle_nn::seq()
                .add(candle_nn::linear(DIM, DIM, vb)?)
                .add(candle_nn::Activation::Silu))
        });
    }
    b.build()
}

/// Two traced training steps; returns (rank 0's spans, final shards, peak units unsharded).
fn run(
    ws: usize,
    prefetch: bool,
    limit: Option<usize>,
    mode: BackwardPrefetch,
) -> (Vec<Span>, Vec<Vec<Vec<f32>>>, usize) {
    let session = TraceSession::new();
    let out = run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
        let rank = pg.rank();
        let mut m = model(pg, prefetch, limit, mode)?;
        m.set_tracer(Some(session.tracer(rank)));
        let mut opt = AdamW::new(AdamWConfig::default());
        let x = Tensor::arange(0f32, (4 * DIM) as f32, &Device::Cpu)?
            .reshape((4, DIM))?
            .affine(0.01 * (rank + 1) as f64, 0.0)?;
        for _ in 0..2 {
            let y = m.forward(&x)?;
            m.backward(&y.sqr()?.mean_all()?)?;
            opt.step(&mut m)?;
            m.zero_grad();
        }
        let spans = m.tracer().unwrap().spans();
        let shards: Vec<Vec<f32>> = m
            .shards()
            .map(|u| u.param.to_vec1::<f32>())
            .collect::<candle_core::Result<_>>()?;
        Ok((spans, shards, m.memory_stats().peak_unsharded_units))
    })
    .unwrap();
    let peak = out.iter().map(|o| o.2).max().unwrap();
    let shards = out.iter().map(|o| o.1.clone()).collect();
    (out.into_iter().next().unwrap().0, shards, peak)
}

fn position(spans: &[Span], kind: SpanKind, name: &str, step: u64) -> usize {
    spans
        .iter()
        .position(|s| s.kind == kind && s.name == name && s.step == step)
        .unwrap_or_else(|| panic!("no {kind:?} span {name} in step {step}"))
}

fn end_us(spans: &[Span], kind: SpanKind, name: &str, step: u64) -> f64 {
    let s = &spans[position(spans, kind, name, step)];
    s.start_us + s.dur_us
}

fn issue_us(spans: &[Span], unit: usize, nth: usize, step: u64) -> f64 {
    spans
        .iter()
        .filter(|s| {
            s.kind == SpanKind::Issue
                && s.name == format!("FSDP::all_gather u{unit}")
                && s.step == step
        })
        .nth(nth)
        .unwrap_or_else(|| panic!("no issue #{nth} of u{unit} in step {step}"))
        .start_us
}

#[test]
fn forward_prefetch_issues_the_next_gather_before_the_current_unit_finishes() {
    let (spans, _, _) = run(2, true, Some(2), BackwardPrefetch::BackwardPre);
    for k in 0..UNITS - 1 {
        let issued = issue_us(&spans, k + 1, 0, 1);
        let fwd_end = end_us(&spans, SpanKind::Forward, &format!("FSDP::forward u{k}"), 1);
        assert!(
            issued < fwd_end,
            "u{}'s all-gather issued at {issued} µs, after u{k}'s forward ended at {fwd_end} µs",
            k + 1
        );
    }
}

#[test]
fn backward_pre_prefetch_issues_before_the_current_unit_backward() {
    let (spans, _, _) = run(2, true, Some(2), BackwardPrefetch::BackwardPre);
    // Units 0..=6 are refilled in backward (the last keeps its parameters): u(k-1)'s second gather
    // is issued before u(k)'s backward ends.
    for k in 1..UNITS - 1 {
        let issued = issue_us(&spans, k - 1, 1, 1);
        let bwd_end = end_us(
            &spans,
            SpanKind::Backward,
            &format!("FSDP::backward u{k}"),
            1,
        );
        assert!(
            issued < bwd_end,
            "u{} gathered after u{k}'s backward",
            k - 1
        );
    }
}

#[test]
fn without_prefetch_each_gather_is_issued_after_the_previous_unit_finished() {
    let (spans, _, _) = run(2, false, Some(2), BackwardPrefetch::None);
    for k in 0..UNITS - 1 {
        let issued = issue_us(&spans, k + 1, 0, 1);
        let fwd_end = end_us(&spans, SpanKind::Forward, &format!("FSDP::forward u{k}"), 1);
        assert!(issued >= fwd_end);
    }
}

#[test]
fn the_limiter_bounds_units_unsharded_at_once() {
    for limit in [1, 2, 3] {
        let (_, _, peak) = run(2, true, Some(limit), BackwardPrefetch::BackwardPre);
        assert!(
            peak <= limit.max(2),
            "limit {limit}: {peak} units were unsharded at once"
        );
        if limit >= 2 {
            assert_eq!(peak, limit.min(2), "prefetch uses its slot");
        }
    }
    // With limit 1 nothing is prefetched: one unit at a time, except the last unit's kept
    // graph meeting the first backward gather (2).
    let (spans, _, peak) = run(2, true, Some(1), BackwardPrefetch::BackwardPre);
    assert!(peak <= 2);
    for k in 0..UNITS - 1 {
        let issued = issue_us(&spans, k + 1, 0, 1);
        let fwd_end = end_us(&spans, SpanKind::Forward, &format!("FSDP::forward u{k}"), 1);
        assert!(issued >= fwd_end, "limit 1 must not prefetch u{}", k + 1);
    }
}

#[test]
fn results_are_bitwise_equal_with_prefetch_on_and_off() {
    for ws in [1, 2, 3] {
        let (_, on, _) = run(ws, true, Some(2), BackwardPrefetch::BackwardPre);
        let (_, post, _) = run(ws, true, Some(2), BackwardPrefetch::BackwardPost);
        let (_, off, _) = run(ws, false, None, BackwardPrefetch::None);
        assert_eq!(on, off, "ws {ws}");
        assert_eq!(post, off, "ws {ws}");
    }
}

#[test]
fn trace_has_comm_lanes_and_exports_chrome_json_and_overlap_figures() {
    let (spans, _, _) = run(2, true, Some(2), BackwardPrefetch::BackwardPre);
    let ag = spans
        .iter()
        .filter(|s| s.kind == SpanKind::AllGather && s.step == 1)
        .count();
    // 8 gathers in forward + 7 in backward (the last unit keeps its graph).
    assert_eq!(ag, 2 * UNITS - 1);
    assert!(spans
        .iter()
        .any(|s| s.kind == SpanKind::ReduceScatter && s.lane == Lane::comm("reduce_scatter")));
    assert!(spans.iter().any(|s| s.kind == SpanKind::OptimizerStep));
    let json: serde_json::Value = serde_json::from_str(&chrome_trace_json(&spans)).unwrap();
    let events = json["traceEvents"].as_array().unwrap();
    let complete = events.iter().filter(|e| e["ph"] == "X").count();
    assert_eq!(
        complete,
        spans.iter().filter(|s| s.kind != SpanKind::Issue).count()
    );
    let summary = overlap_summary(&spans);
    assert_eq!(summary.len(), 2, "two steps of rank 0");
    for s in &summary {
        assert!(s.step_s > 0.0 && s.compute_s > 0.0 && s.comm_s > 0.0);
        assert!(s.exposed_s <= s.step_s);
        assert!((0.0..=1.0).contains(&s.overlap_fraction));
    }
    let _ = DType::F32;
}

// The runtime's memory stats on a user's 8-block GPT (tests/common/user_gpt.rs): forward prefetch
// holds two blocks, nothing stays unsharded after backward, frozen twin groups keep prefetch.

/// Per step of rank 0: memory stats after forward, after backward, after the optimizer step.
fn memory_probe(
    freeze: Vec<String>,
) -> Vec<(
    candle_fsdp::MemoryStats,
    candle_fsdp::MemoryStats,
    candle_fsdp::MemoryStats,
)> {
    let mut c = Case::gpt(8, BlockCfg::default(), false);
    c.rows = 4;
    c.freeze = freeze.clone();
    let stats = run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
        let mut model = builder(&c, pg.clone()).build()?;
        let mut opt = make_opt(false);
        let data = batches(c.rows, 3);
        let mut out = Vec::new();
        let r = pg.rank();
        for (s, b) in data.iter().enumerate() {
            model.reset_peak();
            let rows: Vec<Tensor> = b
                .iter()
                .map(|t| t.narrow(0, r * 2, 2))
                .collect::<candle_core::Result<_>>()?;
            let p = c.program.clone();
            let loss = model.forward_with(|f| p(&mut |n, xs| f.call(n, xs), &rows, s))?;
            let after_fwd = model.memory_stats();
            model.backward(&loss)?;
            let after_bwd = model.memory_stats();
            opt.step(&mut model)?;
            model.zero_grad();
            out.push((after_fwd, after_bwd, model.memory_stats()));
        }
        Ok(out)
    })
    .unwrap();
    for (s, (f, b, _)) in stats[0].iter().enumerate() {
        println!("freeze {freeze:?} step {s}:\n after fwd {f:?}\n after bwd {b:?}");
    }
    stats.into_iter().next().unwrap()
}

/// Bytes of one block's parameters (f32).
const BLOCK_BYTES: usize = 4
    * (2 * DM
        + DM * 3 * DM
        + 3 * DM
        + DM * DM
        + DM
        + 2 * DM
        + DM * 4 * DM
        + 4 * DM
        + 4 * DM * DM
        + DM);

#[test]
fn memory_stats_show_forward_prefetch_and_nothing_unsharded_after_backward() {
    for (s, (f, b, end)) in memory_probe(Vec::new()).iter().enumerate() {
        assert_eq!(
            b.unsharded_bytes, 0,
            "step {s}: unsharded bytes after backward: {b:?}"
        );
        assert_eq!(b.unsharded_units, 0, "{b:?}");
        assert_eq!(end.unsharded_bytes, 0);
        assert!(b.peak_unsharded_units <= 2, "step {s}: {b:?}");
        // Forward prefetch at work: a block computes while the next one is gathered.
        assert!(f.peak_unsharded_bytes >= 2 * BLOCK_BYTES, "step {s}: {f:?}");
        assert!(
            b.peak_unsharded_bytes <= 2 * BLOCK_BYTES + 4 * V * DM,
            "step {s}: {b:?}"
        );
    }
}

/// Freezing one tensor per block (h*.ln1.*) gives every block a frozen twin group. The forward
/// must still prefetch the next block while one computes: its peak of unsharded bytes stays two
/// blocks (less the frozen tensors), and backward holds at most 2 units. (When
/// `limit_all_gathers` (2) counted groups, a block's own two groups exhausted it and the next
/// block was never prefetched: the forward peak dropped to one block, all-gathers exposed.)
#[test]
fn frozen_twin_groups_keep_forward_prefetch() {
    for (s, (f, b, end)) in memory_probe(vec!["h*.ln1.*".to_string()])
        .iter()
        .enumerate()
    {
        assert_eq!(b.unsharded_bytes, 0, "step {s}: {b:?}");
        assert_eq!(end.unsharded_bytes, 0);
        assert!(
            f.peak_unsharded_bytes >= 2 * BLOCK_BYTES - 4 * 2 * DM * 8,
            "step {s}: forward peak {} bytes < two blocks ({} bytes): no forward prefetch: {f:?}",
            f.peak_unsharded_bytes,
            2 * BLOCK_BYTES
        );
        assert!(b.peak_unsharded_units <= 2, "step {s}: {b:?}");
    }
}
