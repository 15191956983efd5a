//! The runtime chooses the comm stream of each collective (FSDP2's comm context) and the choice
//! reaches the backend; a `CommObserver` sees every collective the model issues, and the
//! model's tracer (an observer too) records them on the comm lanes.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::{CommObserver, OpKind, ProcessGroup};
use candle_fsdp::trace::{Lane, SpanKind, TraceSession};
use candle_fsdp::{CommStreams, FsdpConfig, FsdpModel, ShardingStrategy};

/// Records (stream, kind) of every collective that starts on this rank.
#[derive(Default)]
struct Recorder(Mutex<Vec<(String, OpKind)>>);

impl CommObserver for Recorder {
    fn op_started(&self, stream: &str, kind: OpKind, _op: &str) -> Option<Box<dyn Send>> {
        self.0.lock().unwrap().push((stream.to_string(), kind));
        None
    }
}

fn model(pg: Arc<dyn ProcessGroup>, strategy: ShardingStrategy) -> candle_fsdp::Result<FsdpModel> {
    model_on(pg, strategy, CommStreams::Separate)
}

fn model_on(
    pg: Arc<dyn ProcessGroup>,
    strategy: ShardingStrategy,
    comm_streams: CommStreams,
) -> candle_fsdp::Result<FsdpModel> {
    let config = FsdpConfig {
        sharding_strategy: strategy,
        comm_streams,
        ..FsdpConfig::default()
    };
    FsdpModel::builder(pg, config)
        .unit("a", |vb| candle_nn::linear(4, 8, vb))
        .unit("b", |vb| candle_nn::linear(8, 8, vb))
        .unit("c", |vb| candle_nn::linear(8, 2, vb))
        .build()
}

fn one_step(strategy: ShardingStrategy) -> Vec<(String, OpKind)> {
    run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
        let mut m = model(pg.clone(), strategy)?;
        let rec = Arc::new(Recorder::default());
        pg.set_observer(Some(rec.clone()));
        let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
        let y = m.forward(&x)?;
        m.backward(&y.sum_all()?)?;
        pg.set_observer(None);
        let ops = rec.0.lock().unwrap().clone();
        Ok(ops)
    })
    .unwrap()
    .remove(0)
}

#[test]
fn all_gathers_and_reductions_run_on_the_streams_fsdp_chose() {
    let ops = one_step(ShardingStrategy::FullShard);
    let on = |stream: &str, kind: OpKind| {
        ops.iter()
            .filter(|(s, k)| s == stream && *k == kind)
            .count()
    };
    // 3 gathers in forward, 2 in backward (the last unit keeps its parameters), 3 reductions,
    // and the all-reduce that checks that the ranks gathered the same units (on the all-gather
    // stream, behind the forward's gathers).
    assert_eq!(on("all_gather", OpKind::AllGather), 5, "{ops:?}");
    assert_eq!(on("reduce_scatter", OpKind::ReduceScatter), 3, "{ops:?}");
    assert_eq!(on("all_gather", OpKind::AllReduce), 1, "{ops:?}");
    assert_eq!(ops.len(), 9, "nothing else runs: {ops:?}");

    // SHARD_GRAD_OP gathers each unit once.
    let ops = one_step(ShardingStrategy::ShardGradOp);
    assert_eq!(
        ops.iter()
            .filter(|(s, k)| s == "all_gather" && *k == OpKind::AllGather)
            .count(),
        3,
        "{ops:?}"
    );

    // NO_SHARD all-reduces gradients, on the reduction stream, and gathers nothing (so there
    // is no gather sequence to check either).
    let ops = one_step(ShardingStrategy::NoShard);
    assert!(
        ops.iter()
            .all(|(s, k)| *k == OpKind::AllReduce && s == "reduce_scatter"),
        "{ops:?}"
    );
    assert_eq!(ops.len(), 3, "{ops:?}");
}

#[test]
fn the_models_tracer_receives_the_comm_spans_on_its_streams_lanes() {
    let session = TraceSession::new();
    let spans = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = model(pg.clone(), ShardingStrategy::FullShard)?;
        let tracer = session.tracer(pg.rank());
        m.set_tracer(Some(tracer.clone()));
        let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
        let y = m.forward(&x)?;
        m.backward(&y.sum_all()?)?;
        m.set_tracer(None);
        Ok(tracer.spans())
    })
    .unwrap()
    .remove(0);
    let count = |lane: &str, kind: SpanKind| {
        spans
            .iter()
            .filter(|s| s.lane == Lane::comm(lane) && s.kind == kind)
            .count()
    };
    assert_eq!(count("all_gather", SpanKind::AllGather), 5);
    assert_eq!(count("reduce_scatter", SpanKind::ReduceScatter), 3);
    assert!(spans
        .iter()
        .any(|s| s.kind == SpanKind::Forward && s.name == "FSDP::forward a"));
}

/// `CommStreams::Shared` runs the reductions on the all-gathers' stream, behind them in issue
/// order, with the same results bit for bit as separate streams (and `Auto` picks one of the
/// two: the same results too).
#[test]
fn shared_comm_streams_run_the_reductions_behind_the_gathers_with_the_same_results() {
    let run = |streams: CommStreams| {
        run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
            let mut m = model_on(pg.clone(), ShardingStrategy::FullShard, streams)?;
            let rec = Arc::new(Recorder::default());
            pg.set_observer(Some(rec.clone()));
            let x = Tensor::arange(0f32, 12., &Device::Cpu)?.reshape((3, 4))?;
            let y = m.forward(&x)?;
            m.backward(&y.sum_all()?)?;
            pg.set_observer(None);
            let grads: Vec<Vec<u32>> = m
                .shards()
                .map(|s| {
                    let g = s.grad.expect("a gradient shard");
                    g.to_vec1::<f32>()
                        .map(|v| v.iter().map(|x| x.to_bits()).collect())
                })
                .collect::<candle_core::Result<_>>()?;
            let ops = rec.0.lock().unwrap().clone();
            Ok((ops, grads, m.config().comm_streams))
        })
        .unwrap()
    };
    let separate = run(CommStreams::Separate);
    let shared = run(CommStreams::Shared);
    let auto = run(CommStreams::Auto);
    for r in 0..2 {
        assert_eq!(
            shared[r].1, separate[r].1,
            "rank {r}: gradient shards differ"
        );
        assert_eq!(
            auto[r].1, separate[r].1,
            "rank {r}: gradient shards differ (auto)"
        );
        let ops = &shared[r].0;
        assert!(
            ops.iter().all(|(s, _)| s == "all_gather"),
            "rank {r}: {ops:?}"
        );
        let count = |o: &[(String, OpKind)], kind| o.iter().filter(|(_, k)| *k == kind).count();
        for kind in [OpKind::AllGather, OpKind::ReduceScatter, OpKind::AllReduce] {
            assert_eq!(
                count(ops, kind),
                count(&separate[r].0, kind),
                "rank {r}: {ops:?}"
            );
        }
        assert_eq!(count(ops, OpKind::ReduceScatter), 3, "rank {r}: {ops:?}");
        assert_eq!(ops.len(), separate[r].0.len(), "rank {r}: {ops:?}");
        // The model reports what `Auto` became, and its reductions ran where that says.
        let on_own_stream = auto[r].0.iter().any(|(s, _)| s == "reduce_scatter");
        match auto[r].2 {
            CommStreams::Shared => assert!(!on_own_stream, "rank {r}: {:?}", auto[r].0),
            CommStreams::Separate => assert!(on_own_stream, "rank {r}: {:?}", auto[r].0),
            CommStreams::Auto => panic!("rank {r}: Auto left undecided after the build"),
        }
    }
}
