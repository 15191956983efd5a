//! Tracing of a training step: spans per rank and lane (compute thread, comm streams), exported
//! as a Chrome / Perfetto trace, summarised as overlap figures, and mirrored as NVTX ranges
//! (cargo feature `nvtx`) so that `nsys profile` shows the same names on GPU.
//!
//! Span names are stable and greppable, after FSDP2's profiler ranges: `FSDP::forward fc1`,
//! `FSDP::backward fc1`, `FSDP::all_gather fc1`, `FSDP::reduce_scatter fc1`,
//! `FSDP::optimizer_step`, `FSDP::wait all_gather fc1`; comm streams record the collective as it
//! runs (`all_gather #12 (stream all_gather)`).
//!
//! Exposed communication is the time the compute thread spends waiting on a [`crate::comm::Work`]
//! (the `Wait` spans): communication that was not hidden behind compute.
//!
//! Comm-stream spans come from the process group through [`CommObserver`], which [`Tracer`]
//! implements: install it with [`crate::comm::ProcessGroup::set_observer`] (the FSDP runtime's
//! `set_tracer` does). Each comm stream is a lane named after the stream.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use parking_lot::Mutex;
use serde::Serialize;

use crate::comm::{CommObserver, OpKind, DEFAULT_STREAM};

/// The lane (Chrome trace "thread") a span belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Lane {
    /// The rank's compute thread.
    Compute,
    /// A comm stream, by name (see [`Lane::comm`]).
    Comm(&'static str),
}

/// Lane names of the streams every FSDP run has, in thread-id order after compute.
const KNOWN_STREAMS: [&str; 3] = ["all_gather", "reduce_scatter", DEFAULT_STREAM];

/// Names of the other streams seen so far, in order of first appearance (ids 4, 5, …). Stream
/// names are few and live as long as their group; each distinct name is stored once.
static OTHER_STREAMS: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

/// The interned copy of a stream name, and its position after the known ones.
fn intern(name: &str) -> (&'static str, u32) {
    if let Some(i) = KNOWN_STREAMS.iter().position(|&k| k == name) {
        return (KNOWN_STREAMS[i], i as u32);
    }
    let mut others = OTHER_STREAMS.lock();
    let i = match others.iter().position(|&o| o == name) {
        Some(i) => i,
        None => {
            others.push(Box::leak(name.to_string().into_boxed_str()));
            others.len() - 1
        }
    };
    (others[i], (KNOWN_STREAMS.len() + i) as u32)
}

impl Lane {
    /// The lane of the comm stream named `stream`.
    pub fn comm(stream: &str) -> Lane {
        Lane::Comm(intern(stream).0)
    }

    /// Chrome trace thread id: 0 compute, 1 `all_gather`, 2 `reduce_scatter`, 3 `collective`
    /// (the default stream), then other streams in order of first appearance in this process.
    pub fn tid(self) -> u32 {
        match self {
            Lane::Compute => 0,
            Lane::Comm(s) => 1 + intern(s).1,
        }
    }

    /// Lane name shown in the viewer: `compute`, or the stream's name.
    pub fn name(self) -> &'static str {
        match self {
            Lane::Compute => "compute",
            Lane::Comm(s) => s,
        }
    }
}

/// What a span measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum SpanKind {
    /// A unit's forward compute.
    Forward,
    /// A unit's backward compute (refill or recompute, autograd, gradient flattening).
    Backward,
    /// An all-gather running on its stream.
    AllGather,
    /// A reduce-scatter running on its stream.
    ReduceScatter,
    /// An all-reduce, broadcast, reduce or barrier running on its stream.
    Collective,
    /// The optimizer step.
    OptimizerStep,
    /// The compute thread blocked on a collective (exposed communication).
    Wait,
    /// A zero-length marker: a collective issued.
    Issue,
}

impl SpanKind {
    /// True for spans of communication running on a comm stream.
    pub fn is_comm(self) -> bool {
        matches!(
            self,
            SpanKind::AllGather | SpanKind::ReduceScatter | SpanKind::Collective
        )
    }

    /// True for compute spans.
    pub fn is_compute(self) -> bool {
        matches!(
            self,
            SpanKind::Forward | SpanKind::Backward | SpanKind::OptimizerStep
        )
    }
}

/// One recorded span; times in microseconds since the session's origin.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Span {
    /// Rank that recorded it.
    pub rank: usize,
    /// Lane.
    pub lane: Lane,
    /// Kind.
    pub kind: SpanKind,
    /// Name (see the module docs).
    pub name: String,
    /// Training step (number of training forwards started before it, from 0).
    pub step: u64,
    /// Start, µs since the origin.
    pub start_us: f64,
    /// Duration, µs (0 for [`SpanKind::Issue`]).
    pub dur_us: f64,
}

/// A shared time origin for the tracers of all ranks of one run.
#[derive(Debug, Clone)]
pub struct TraceSession {
    origin: Instant,
}

impl Default for TraceSession {
    fn default() -> Self {
        Self::new()
    }
}

impl TraceSession {
    /// A session whose origin is now.
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
        }
    }

    /// A tracer for `rank` on this session's clock.
    pub fn tracer(&self, rank: usize) -> Arc<Tracer> {
        Arc::new_cyclic(|me| Tracer {
            me: me.clone(),
            rank,
            origin: self.origin,
            spans: Mutex::new(Vec::new()),
            step: AtomicU64::new(0),
            enabled: AtomicBool::new(true),
        })
    }
}

/// One rank's span recorder. Cheap when disabled; thread safe (comm streams record into it).
#[derive(Debug)]
pub struct Tracer {
    /// This tracer, for the span guards its `&self` methods hand out.
    me: Weak<Tracer>,
    rank: usize,
    origin: Instant,
    spans: Mutex<Vec<Span>>,
    step: AtomicU64,
    enabled: AtomicBool,
}

/// Records its span when dropped. Holds its tracer, so it borrows nothing.
pub struct SpanGuard {
    tracer: Arc<Tracer>,
    lane: Lane,
    kind: SpanKind,
    name: String,
    step: u64,
    start: Instant,
}

impl Drop for SpanGuard {
    fn drop(&mut self) {
        let end = Instant::now();
        #[cfg(feature = "nvtx")]
        nvtx::range_pop!();
        let t = &self.tracer;
        let span = Span {
            rank: t.rank,
            lane: self.lane,
            kind: self.kind,
            name: std::mem::take(&mut self.name),
            step: self.step,
            start_us: (self.start - t.origin).as_secs_f64() * 1e6,
            dur_us: (end - self.start).as_secs_f64() * 1e6,
        };
        t.spans.lock().push(span);
    }
}

impl Tracer {
    /// The rank this tracer records for.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Whether spans are being recorded.
    pub fn is_enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// Turns recording on or off.
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
    }

    /// Current step number.
    pub fn step(&self) -> u64 {
        self.step.load(Ordering::Relaxed)
    }

    /// Sets the step number recorded with later spans.
    pub fn set_step(&self, step: u64) {
        self.step.store(step, Ordering::Relaxed);
    }

    /// Starts a span that ends when the guard is dropped (`None` when disabled).
    pub fn span(
        self: &Arc<Self>,
        lane: Lane,
        kind: SpanKind,
        name: impl Into<String>,
    ) -> Option<SpanGuard> {
        if !self.enabled.load(Ordering::Relaxed) {
            return None;
        }
        let name = name.into();
        #[cfg(feature = "nvtx")]
        nvtx::range_push!("{}", name);
        Some(SpanGuard {
            tracer: Arc::clone(self),
            lane,
            kind,
            name,
            step: self.step(),
            start: Instant::now(),
        })
    }

    /// Records a zero-length marker.
    pub fn instant(&self, lane: Lane, kind: SpanKind, name: impl Into<String>) {
        if !self.enabled.load(Ordering::Relaxed) {
            return;
        }
        let span = Span {
            rank: self.rank,
            lane,
            kind,
            name: name.into(),
            step: self.step(),
            start_us: self.origin.elapsed().as_secs_f64() * 1e6,
            dur_us: 0.0,
        };
        self.spans.lock().push(span);
    }

    /// A copy of the spans recorded so far, in recording order.
    pub fn spans(&self) -> Vec<Span> {
        self.spans.lock().clone()
    }

    /// Drops every recorded span.
    pub fn clear(&self) {
        self.spans.lock().clear();
    }
}

impl CommObserver for Tracer {
    /// Records the collective as a span on the lane of its stream, named after the operation
    /// (`all_gather #12 (stream all_gather)`); all-reduce, broadcast, reduce and barrier are
    /// [`SpanKind::Collective`].
    fn op_started(&self, stream: &str, kind: OpKind, op: &str) -> Option<Box<dyn Send>> {
        let span_kind = match kind {
            OpKind::AllGather => SpanKind::AllGather,
            OpKind::ReduceScatter => SpanKind::ReduceScatter,
            _ => SpanKind::Collective,
        };
        let me = self.me.upgrade()?;
        me.span(Lane::comm(stream), span_kind, op)
            .map(|g| Box::new(g) as Box<dyn Send>)
    }
}

/// Chrome trace event format ("Trace Event Format", the JSON that chrome://tracing and
/// ui.perfetto.dev open): one process per rank, one thread per lane, complete events (`ph: X`)
/// for spans and instant events (`ph: i`) for markers; times in µs.
pub fn chrome_trace_json(spans: &[Span]) -> String {
    let mut events = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for s in spans {
        if seen.insert((s.rank, s.lane.tid())) {
            events.push(serde_json::json!({
                "ph": "M", "name": "thread_name", "pid": s.rank, "tid": s.lane.tid(),
                "args": {"name": s.lane.name()}
            }));
            events.push(serde_json::json!({
                "ph": "M", "name": "process_name", "pid": s.rank, "tid": 0,
                "args": {"name": format!("rank {}", s.rank)}
            }));
        }
        let cat = format!("{:?}", s.kind);
        if s.kind == SpanKind::Issue {
            events.push(serde_json::json!({
                "ph": "i", "s": "t", "name": s.name, "cat": cat, "pid": s.rank,
                "tid": s.lane.tid(), "ts": s.start_us, "args": {"step": s.step}
            }));
        } else {
            events.push(serde_json::json!({
                "ph": "X", "name": s.name, "cat": cat, "pid": s.rank, "tid": s.lane.tid(),
                "ts": s.start_us, "dur": s.dur_us, "args": {"step": s.step}
            }));
        }
    }
    serde_json::to_string(&serde_json::json!({
        "traceEvents": events,
        "displayTimeUnit": "ms"
    }))
    .expect("trace serialises")
}

/// Overlap figures of one step of one rank (seconds).
///
/// `comm_s` counts each collective from the moment its stream starts it, so it includes waiting
/// for the peers to join; `exposed_s` counts the compute thread's waits, which also include the
/// latency of waking it up. On an oversubscribed machine `exposed_s` can therefore exceed
/// `comm_s`, and `overlap_fraction` is clamped to 0.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct OverlapSummary {
    /// Rank.
    pub rank: usize,
    /// Step.
    pub step: u64,
    /// Wall time from the step's first to its last span end.
    pub step_s: f64,
    /// Sum of compute spans (forward, backward, optimizer step).
    pub compute_s: f64,
    /// Sum of communication spans on the comm streams.
    pub comm_s: f64,
    /// Sum of waits of the compute thread on collectives.
    pub exposed_s: f64,
    /// `1 - exposed / comm` (1 = all communication hidden; 1 when there was none).
    pub overlap_fraction: f64,
}

/// Per (rank, step) overlap figures of `spans`, ordered by rank then step.
pub fn overlap_summary(spans: &[Span]) -> Vec<OverlapSummary> {
    let mut keys: Vec<(usize, u64)> = spans.iter().map(|s| (s.rank, s.step)).collect();
    keys.sort_unstable();
    keys.dedup();
    keys.into_iter()
        .map(|(rank, step)| {
            let mine = spans.iter().filter(|s| s.rank == rank && s.step == step);
            let (mut compute, mut comm, mut exposed) = (0.0, 0.0, 0.0);
            let (mut t0, mut t1) = (f64::INFINITY, f64::NEG_INFINITY);
            for s in mine {
                t0 = t0.min(s.start_us);
                t1 = t1.max(s.start_us + s.dur_us);
                if s.kind.is_compute() {
                    compute += s.dur_us;
                } else if s.kind.is_comm() {
                    comm += s.dur_us;
                } else if s.kind == SpanKind::Wait {
                    exposed += s.dur_us;
                }
            }
            OverlapSummary {
                rank,
                step,
                step_s: (t1 - t0).max(0.0) * 1e-6,
                compute_s: compute * 1e-6,
                comm_s: comm * 1e-6,
                exposed_s: exposed * 1e-6,
                overlap_fraction: if comm > 0.0 {
                    (1.0 - exposed / comm).clamp(0.0, 1.0)
                } else {
                    1.0
                },
            }
        })
        .collect()
}
