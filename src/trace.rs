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
            #[cfg(feature = "cuda")]
            gpu: Mutex::new(None),
            #[cfg(feature = "cuda")]
            pending: Mutex::new(Vec::new()),
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
    /// The GPU clock (see [`Tracer::time_on_gpu`]).
    #[cfg(feature = "cuda")]
    gpu: Mutex<Option<gpu::GpuClock>>,
    /// Spans timed by CUDA events, resolved into `spans` by [`Tracer::spans`].
    #[cfg(feature = "cuda")]
    pending: Mutex<Vec<gpu::Pending>>,
}

/// An NVTX range (feature `nvtx`) open until dropped, for `nsys profile` timelines whether or
/// not a Chrome trace is being recorded; without the feature it is nothing and costs nothing.
pub struct NvtxRange(());

impl NvtxRange {
    /// Opens a range named `name()` (the closure runs only with the `nvtx` feature).
    pub fn new(name: impl FnOnce() -> String) -> NvtxRange {
        #[cfg(feature = "nvtx")]
        nvtx::range_push!("{}", name());
        #[cfg(not(feature = "nvtx"))]
        let _ = name;
        NvtxRange(())
    }
}

impl Drop for NvtxRange {
    fn drop(&mut self) {
        #[cfg(feature = "nvtx")]
        nvtx::range_pop!();
    }
}

/// An NVTX instant marker named `name()` (feature `nvtx`; nothing otherwise), e.g. where a
/// collective is issued.
pub fn nvtx_mark(name: impl FnOnce() -> String) {
    #[cfg(feature = "nvtx")]
    nvtx::mark!("{}", name());
    #[cfg(not(feature = "nvtx"))]
    let _ = name;
}

/// A compute-lane span of the runtime: recorded by the tracer when tracing is on (which also
/// opens the NVTX range), else only an NVTX range (feature `nvtx`), else nothing.
pub enum ComputeSpan {
    /// Recorded by a [`Tracer`].
    Traced(SpanGuard),
    /// NVTX only.
    Nvtx(NvtxRange),
}

/// Records its span when dropped. Holds its tracer, so it borrows nothing.
pub struct SpanGuard {
    tracer: Arc<Tracer>,
    lane: Lane,
    kind: SpanKind,
    name: String,
    step: u64,
    start: Instant,
    /// The start event on the compute stream, when the tracer times on a GPU.
    #[cfg(feature = "cuda")]
    gpu_start: Option<cudarc::driver::CudaEvent>,
}

impl Drop for SpanGuard {
    fn drop(&mut self) {
        let end = Instant::now();
        #[cfg(feature = "nvtx")]
        nvtx::range_pop!();
        let t = &self.tracer;
        #[cfg(feature = "cuda")]
        if let Some(start) = self.gpu_start.take() {
            let span = Span {
                rank: t.rank,
                lane: self.lane,
                kind: self.kind,
                name: std::mem::take(&mut self.name),
                step: self.step,
                start_us: (self.start - t.origin).as_secs_f64() * 1e6,
                dur_us: (end - self.start).as_secs_f64() * 1e6,
            };
            t.push_gpu_span(span, start);
            return;
        }
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
            #[cfg(feature = "cuda")]
            gpu_start: if lane == Lane::Compute {
                self.gpu_event()
            } else {
                None
            },
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

    /// A copy of the spans recorded so far, in recording order (spans timed on a GPU come
    /// after the host-timed ones: resolving them waits for their end events).
    pub fn spans(&self) -> Vec<Span> {
        #[cfg(feature = "cuda")]
        self.resolve_gpu_spans();
        self.spans.lock().clone()
    }

    /// Drops every recorded span.
    pub fn clear(&self) {
        #[cfg(feature = "cuda")]
        self.pending.lock().clear();
        self.spans.lock().clear();
    }
}

/// Timing on a GPU (feature `cuda`): the host clock measures when work is *issued*, not when
/// it runs, so compute spans and the collectives of device backends are timed with CUDA events
/// instead, on the session's clock: at [`Tracer::time_on_gpu`] the stream is synchronised once
/// and an origin event recorded, whose host time is known; a span's start is then
/// `origin_host + elapsed(origin, start_event)`. Events are read only when the spans are
/// ([`Tracer::spans`]), so tracing adds no host sync to a step.
#[cfg(feature = "cuda")]
mod gpu {
    use std::sync::Arc;

    use cudarc::driver::{CudaEvent, CudaStream};

    use super::Span;

    /// The compute stream and the origin event of a tracer's GPU clock.
    pub(super) struct GpuClock {
        pub stream: Arc<CudaStream>,
        pub origin: CudaEvent,
        /// Host time of `origin`, µs since the session's origin.
        pub origin_us: f64,
    }

    /// A span whose times come from its two events.
    pub(super) struct Pending {
        pub span: Span,
        pub start: CudaEvent,
        pub end: CudaEvent,
    }

    /// A timing event recorded on `stream`: created with `CU_EVENT_DEFAULT`, since cudarc's
    /// default (`record_event(None)`) disables timing and `elapsed_ms` would fail on it.
    pub(super) fn timing_event(stream: &CudaStream) -> Option<CudaEvent> {
        crate::device::cuda::record(stream, true).ok()
    }
}

#[cfg(feature = "cuda")]
impl std::fmt::Debug for gpu::GpuClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuClock(origin {:.1} us)", self.origin_us)
    }
}

#[cfg(feature = "cuda")]
impl std::fmt::Debug for gpu::Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pending({})", self.span.name)
    }
}

#[cfg(feature = "cuda")]
impl Tracer {
    /// Times compute spans with CUDA events on `stream` (the compute stream) from now on, and
    /// lets device backends time their collectives ([`CommObserver::times_device_ops`]).
    /// Synchronises `stream` once, to pin the GPU clock to the host's.
    ///
    /// Errors: the driver's ([`crate::Error::Cuda`]).
    pub fn time_on_gpu(
        &self,
        stream: std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> crate::Result<()> {
        let cuda =
            |e: cudarc::driver::DriverError| crate::Error::Cuda(format!("trace clock: {e:?}"));
        stream.synchronize().map_err(cuda)?;
        let origin = stream
            .record_event(Some(crate::device::cuda::event_flags(true)))
            .map_err(cuda)?;
        origin.synchronize().map_err(cuda)?;
        // A clock whose events cannot be timed would leave every GPU span on its issue time
        // with no duration: refuse it here (the caller keeps host timing) rather than then.
        origin.elapsed_ms(&origin).map_err(cuda)?;
        let origin_us = self.origin.elapsed().as_secs_f64() * 1e6;
        *self.gpu.lock() = Some(gpu::GpuClock {
            stream,
            origin,
            origin_us,
        });
        Ok(())
    }

    /// A timing event on the compute stream, when a GPU clock is set.
    fn gpu_event(&self) -> Option<cudarc::driver::CudaEvent> {
        self.gpu
            .lock()
            .as_ref()
            .and_then(|c| gpu::timing_event(&c.stream))
    }

    /// Queues a compute span that started at event `start` and ends now on the compute stream.
    fn push_gpu_span(&self, span: Span, start: cudarc::driver::CudaEvent) {
        match self.gpu_event() {
            Some(end) => self.pending.lock().push(gpu::Pending { span, start, end }),
            None => self.spans.lock().push(span),
        }
    }

    /// Records a collective of a device backend, timed by `start` and `end`, events recorded
    /// around it on its comm stream (the lane named `stream`).
    pub fn device_span(
        &self,
        stream: &str,
        kind: SpanKind,
        name: impl Into<String>,
        start: cudarc::driver::CudaEvent,
        end: cudarc::driver::CudaEvent,
    ) {
        if !self.is_enabled() {
            return;
        }
        let span = Span {
            rank: self.rank,
            lane: Lane::comm(stream),
            kind,
            name: name.into(),
            step: self.step(),
            start_us: self.origin.elapsed().as_secs_f64() * 1e6,
            dur_us: 0.0,
        };
        self.pending.lock().push(gpu::Pending { span, start, end });
    }

    /// Resolves the pending GPU spans into host-clock spans (waits for their end events). A
    /// span whose events cannot be read keeps its host times (a warning is logged).
    fn resolve_gpu_spans(&self) {
        let pending = std::mem::take(&mut *self.pending.lock());
        if pending.is_empty() {
            return;
        }
        let clock = self.gpu.lock();
        let mut spans = self.spans.lock();
        for mut p in pending {
            if let Some(c) = clock.as_ref() {
                let times = p.end.synchronize().and_then(|_| {
                    Ok((c.origin.elapsed_ms(&p.start)?, p.start.elapsed_ms(&p.end)?))
                });
                match times {
                    Ok((start_ms, dur_ms)) => {
                        p.span.start_us = c.origin_us + f64::from(start_ms) * 1e3;
                        p.span.dur_us = f64::from(dur_ms) * 1e3;
                    }
                    Err(e) => {
                        tracing::warn!("trace: CUDA event of {} unreadable: {e:?}", p.span.name)
                    }
                }
            }
            spans.push(p.span);
        }
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
        // Timing on a GPU: the device backend reports the collective with its events
        // (`device_op`); a host span would only time the enqueue.
        #[cfg(feature = "cuda")]
        if self.times_device_ops() {
            return None;
        }
        let me = self.me.upgrade()?;
        me.span(Lane::comm(stream), span_kind, op)
            .map(|g| Box::new(g) as Box<dyn Send>)
    }

    #[cfg(feature = "cuda")]
    fn times_device_ops(&self) -> bool {
        self.is_enabled() && self.gpu.lock().is_some()
    }

    #[cfg(feature = "cuda")]
    fn device_op(
        &self,
        stream: &str,
        kind: OpKind,
        op: &str,
        start: cudarc::driver::CudaEvent,
        end: cudarc::driver::CudaEvent,
    ) {
        let span_kind = match kind {
            OpKind::AllGather => SpanKind::AllGather,
            OpKind::ReduceScatter => SpanKind::ReduceScatter,
            _ => SpanKind::Collective,
        };
        self.device_span(stream, span_kind, op, start, end);
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
