//! Throughput of the in-process thread backend: all-gather of a 64 MiB output and
//! reduce-scatter (f32, Avg) of a 64 MiB input, at world sizes 2 and 4.
//!
//! The group, its comm stream and the tensors are created once per benchmark. Each rank lives in
//! a persistent worker thread; `iter_custom` sends every worker the number of iterations to run
//! and gets back the time each one spent inside the collectives (issue to `wait` return, after a
//! barrier on the default stream that lines the ranks up); the slowest rank's time is reported.
//! The output tensor moves into each collective and comes back out of `wait`, so it is reused.
//! The worker checks the output it timed after every batch, and the main thread asserts that
//! check.
//!
//! Throughput is bytes of the 64 MiB buffer per collective (output for all-gather, input for
//! reduce-scatter).

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_fsdp::comm::threads::{new_group, ThreadGroupConfig};
use candle_fsdp::comm::{CommStream, ProcessGroup, ProcessGroupExt, ReduceOp};
use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use crossbeam::channel::{unbounded, Receiver, Sender};

const BYTES: usize = 64 << 20;
const ELEMS: usize = BYTES / 4;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Op {
    AllGather,
    ReduceScatter,
}

/// Input pattern: small integers, so sums and averages are exact in f32.
fn value(rank: usize, i: usize) -> f32 {
    ((i % 1024) + rank) as f32
}

struct Worker {
    pg: Arc<dyn ProcessGroup>,
    stream: CommStream,
    op: Op,
    input: Tensor,
    output: Option<Tensor>,
}

impl Worker {
    fn new(pg: Arc<dyn ProcessGroup>, op: Op) -> Worker {
        let ws = pg.world_size();
        let r = pg.rank();
        let (in_len, out_len) = match op {
            Op::AllGather => (ELEMS / ws, ELEMS),
            Op::ReduceScatter => (ELEMS, ELEMS / ws),
        };
        let input: Vec<f32> = (0..in_len).map(|i| value(r, i)).collect();
        let input = Tensor::from_vec(input, in_len, &Device::Cpu).expect("input");
        let output = Some(Tensor::zeros(out_len, DType::F32, &Device::Cpu).expect("output"));
        // A collective: every worker creates it at the same time.
        let stream = pg
            .new_stream(match op {
                Op::AllGather => "all_gather",
                Op::ReduceScatter => "reduce_scatter",
            })
            .expect("stream");
        Worker {
            pg,
            stream,
            op,
            input,
            output,
        }
    }

    /// Runs `iters` collectives; returns the time spent in them and whether the last output is
    /// right.
    fn run(&mut self, iters: u64) -> (Duration, bool) {
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            let output = self.output.take().expect("output buffer");
            self.pg.barrier_wait().expect("barrier");
            let start = Instant::now();
            let (s, input) = (&self.stream, &self.input);
            let out = match self.op {
                Op::AllGather => self.pg.all_gather(s, input, output),
                Op::ReduceScatter => self.pg.reduce_scatter(s, input, output, ReduceOp::Avg),
            }
            .wait()
            .expect("collective");
            total += start.elapsed();
            self.output = Some(out);
        }
        (total, self.check())
    }

    fn check(&self) -> bool {
        let ws = self.pg.world_size();
        let r = self.pg.rank();
        let Some(Ok(out)) = self.output.as_ref().map(|t| t.to_vec1::<f32>()) else {
            return false;
        };
        match self.op {
            Op::AllGather => {
                let n = ELEMS / ws;
                out.iter()
                    .enumerate()
                    .all(|(k, &x)| x == value(k / n, k % n))
            }
            Op::ReduceScatter => {
                // Avg over ranks j of ((r*n + i) % 1024 + j) = (r*n + i) % 1024 + (ws-1)/2.
                let n = ELEMS / ws;
                let offset = (ws - 1) as f32 / 2.0;
                out.iter()
                    .enumerate()
                    .all(|(i, &x)| x == ((r * n + i) % 1024) as f32 + offset)
            }
        }
    }
}

/// Persistent rank threads driving one collective.
struct Harness {
    cmds: Vec<Sender<u64>>,
    results: Receiver<(Duration, bool)>,
    threads: Vec<JoinHandle<()>>,
}

impl Harness {
    fn new(world_size: usize, op: Op) -> Harness {
        let groups = new_group(world_size, ThreadGroupConfig::default()).expect("group");
        let (res_tx, results) = unbounded();
        let mut cmds = Vec::new();
        let mut threads = Vec::new();
        for pg in groups {
            let (tx, rx) = unbounded::<u64>();
            let res_tx = res_tx.clone();
            cmds.push(tx);
            threads.push(
                std::thread::Builder::new()
                    .name(format!("bench-rank-{}", pg.rank()))
                    .spawn(move || {
                        let mut worker = Worker::new(pg, op);
                        for iters in rx {
                            if res_tx.send(worker.run(iters)).is_err() {
                                break;
                            }
                        }
                    })
                    .expect("spawn"),
            );
        }
        Harness {
            cmds,
            results,
            threads,
        }
    }

    /// Runs `iters` collectives on every rank; returns the slowest rank's time.
    fn run(&self, iters: u64) -> Duration {
        for tx in &self.cmds {
            tx.send(iters).expect("worker alive");
        }
        let mut slowest = Duration::ZERO;
        for _ in 0..self.cmds.len() {
            let (t, ok) = self.results.recv().expect("worker result");
            assert!(ok, "collective produced a wrong result");
            slowest = slowest.max(t);
        }
        slowest
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.cmds.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn bench_collectives(c: &mut Criterion) {
    let mut group = c.benchmark_group("collectives_64MiB_f32");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sampling_mode(SamplingMode::Flat)
        .throughput(Throughput::Bytes(BYTES as u64));
    for (op, name) in [
        (Op::AllGather, "all_gather"),
        (Op::ReduceScatter, "reduce_scatter_avg"),
    ] {
        for ws in [2usize, 4] {
            let harness = Harness::new(ws, op);
            // One checked run before timing.
            harness.run(1);
            group.bench_function(BenchmarkId::new(name, format!("ws{ws}")), |b| {
                b.iter_custom(|iters| harness.run(iters))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_collectives);
criterion_main!(benches);
