//! Communication statistics, counted once for every backend by a wrapper.
//!
//! [`Instrumented`] wraps any [`ProcessGroup`] and counts, at issue, the calls and the bytes this
//! rank contributes to each collective; launchers put it around the backend they create, so
//! [`ProcessGroup::stats`] works on every handle they give out. Sub-groups created through it are
//! wrapped (and counted separately) too.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::{Device, Tensor};

use super::{Call, CommObserver, CommStream, OpKind, ProcessGroup, Work};
use crate::error::Result;

/// Calls and bytes issued by one rank, by kind of collective.
///
/// `*_bytes` count the bytes this rank *contributed* (its input buffer, or its in-place buffer),
/// the quantity NCCL's "algorithm bandwidth" is based on (nccl-tests `PERFORMANCE.md`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommStatsSnapshot {
    /// Number of all-gathers issued.
    pub all_gather_calls: u64,
    /// Bytes of all-gather inputs (this rank's shards).
    pub all_gather_bytes: u64,
    /// Number of reduce-scatters issued.
    pub reduce_scatter_calls: u64,
    /// Bytes of reduce-scatter inputs (this rank's unsharded buffers).
    pub reduce_scatter_bytes: u64,
    /// Number of all-reduce / broadcast / reduce / barrier calls.
    pub other_calls: u64,
    /// Bytes of all-reduce / broadcast / reduce buffers.
    pub other_bytes: u64,
}

impl CommStatsSnapshot {
    /// Every counter of `self` and `other` combined with `f` (a sum over groups, a difference
    /// between two snapshots).
    pub fn zip_with(self, other: Self, f: impl Fn(u64, u64) -> u64) -> Self {
        CommStatsSnapshot {
            all_gather_calls: f(self.all_gather_calls, other.all_gather_calls),
            all_gather_bytes: f(self.all_gather_bytes, other.all_gather_bytes),
            reduce_scatter_calls: f(self.reduce_scatter_calls, other.reduce_scatter_calls),
            reduce_scatter_bytes: f(self.reduce_scatter_bytes, other.reduce_scatter_bytes),
            other_calls: f(self.other_calls, other.other_calls),
            other_bytes: f(self.other_bytes, other.other_bytes),
        }
    }
}

/// `[calls, bytes]` of the all-gathers, of the reduce-scatters and of the other kinds.
#[derive(Debug, Default)]
struct Counters([[AtomicU64; 2]; 3]);

impl Counters {
    fn count(&self, kind: OpKind, bytes: usize) {
        let row = match kind {
            OpKind::AllGather => 0,
            OpKind::ReduceScatter => 1,
            _ => 2,
        };
        let [calls, total] = &self.0[row];
        calls.fetch_add(1, Ordering::Relaxed);
        total.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    fn snapshot(&self) -> CommStatsSnapshot {
        let load = |row: &[AtomicU64; 2]| row.each_ref().map(|c| c.load(Ordering::Relaxed));
        let [[ag_calls, ag_bytes], [rs_calls, rs_bytes], [other_calls, other_bytes]] =
            self.0.each_ref().map(load);
        CommStatsSnapshot {
            all_gather_calls: ag_calls,
            all_gather_bytes: ag_bytes,
            reduce_scatter_calls: rs_calls,
            reduce_scatter_bytes: rs_bytes,
            other_calls,
            other_bytes,
        }
    }
}

fn nbytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// A [`ProcessGroup`] that counts every collective issued through it, then forwards it to the
/// wrapped group unchanged.
pub struct Instrumented<P: ProcessGroup + ?Sized = dyn ProcessGroup> {
    inner: Arc<P>,
    counters: Counters,
}

impl<P: ProcessGroup + ?Sized> Instrumented<P> {
    /// Wraps `inner`, with every counter at zero.
    pub fn new(inner: Arc<P>) -> Self {
        Instrumented {
            inner,
            counters: Counters::default(),
        }
    }

    /// The wrapped group.
    pub fn inner(&self) -> &Arc<P> {
        &self.inner
    }
}

impl<P: ProcessGroup + ?Sized> std::fmt::Debug for Instrumented<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Instrumented")
            .field("backend", &self.inner.backend())
            .field("rank", &self.inner.rank())
            .field("world_size", &self.inner.world_size())
            .field("stats", &self.counters.snapshot())
            .finish()
    }
}

impl<P: ProcessGroup + ?Sized> ProcessGroup for Instrumented<P> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn device(&self) -> &Device {
        self.inner.device()
    }

    fn new_stream(&self, name: &str) -> Result<CommStream> {
        self.inner.new_stream(name)
    }

    fn default_stream(&self) -> CommStream {
        self.inner.default_stream()
    }

    fn issue_call(
        &self,
        stream: &CommStream,
        call: Call,
        buf: Tensor,
        input: Option<&Tensor>,
    ) -> Work<Tensor> {
        self.counters
            .count(call.kind(), nbytes(input.unwrap_or(&buf)));
        self.inner.issue_call(stream, call, buf, input)
    }

    fn barrier(&self, stream: &CommStream) -> Work<()> {
        self.counters.count(OpKind::Barrier, 0);
        self.inner.barrier(stream)
    }

    fn new_group(&self, ranks: &[usize]) -> Result<Option<Arc<dyn ProcessGroup>>> {
        Ok(self.inner.new_group(ranks)?.map(|sub| {
            Arc::new(Instrumented::<dyn ProcessGroup>::new(sub)) as Arc<dyn ProcessGroup>
        }))
    }

    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }

    fn set_observer(&self, observer: Option<Arc<dyn CommObserver>>) {
        self.inner.set_observer(observer)
    }

    fn timeout(&self) -> Option<std::time::Duration> {
        self.inner.timeout()
    }

    fn stats(&self) -> CommStatsSnapshot {
        self.counters.snapshot()
    }
}
