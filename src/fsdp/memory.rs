//! Memory accounting of unsharded parameters, tied to buffer lifetimes.
//!
//! Every unshard of a unit holds one `UnshardGuard` from the moment its all-gather output is
//! allocated (the gather is issued) until its parameters are freed again (reshard). The guard adds
//! the unit's unsharded bytes to the shared `MemoryAccount` when created and removes them when
//! dropped, so the counters cannot drift: an error half way through a step drops the guards with
//! the state that owned them.

use std::sync::Arc;

use parking_lot::Mutex;

/// Counters of memory on this rank, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes of master and gradient shards held now (f32: 4 bytes an element).
    pub sharded_bytes: usize,
    /// Bytes of unsharded (gathered) parameters alive now, in their `param_dtype`.
    pub unsharded_bytes: usize,
    /// Highest `unsharded_bytes` since the last reset of the peak.
    pub peak_unsharded_bytes: usize,
    /// Bytes of unsharded f32 gradients accumulated while gradient sync is off
    /// (`FsdpModel::set_requires_gradient_sync`), held until the next synchronised backward.
    pub unsharded_grad_bytes: usize,
    /// Highest number of units unsharded at once.
    pub peak_unsharded_units: usize,
    /// Units unsharded now.
    pub unsharded_units: usize,
}

/// The shared counters that guards update (one per model).
#[derive(Debug, Clone, Default)]
pub(crate) struct MemoryAccount {
    stats: Arc<Mutex<MemoryStats>>,
}

impl MemoryAccount {
    /// Counts one more unit of `bytes` unsharded until the returned guard is dropped.
    pub(crate) fn unshard(&self, bytes: usize) -> UnshardGuard {
        self.unshard_counted(bytes, true)
    }

    /// As [`MemoryAccount::unshard`]; `unit: false` counts the bytes but not a unit (a frozen
    /// twin, gathered with its unit: the rate limiter counts units, not groups).
    pub(crate) fn unshard_counted(&self, bytes: usize, unit: bool) -> UnshardGuard {
        let mut m = self.stats.lock();
        m.unsharded_bytes += bytes;
        m.unsharded_units += usize::from(unit);
        m.peak_unsharded_bytes = m.peak_unsharded_bytes.max(m.unsharded_bytes);
        m.peak_unsharded_units = m.peak_unsharded_units.max(m.unsharded_units);
        UnshardGuard {
            account: self.clone(),
            bytes,
            unit,
        }
    }

    /// The counters now (`sharded_bytes` is filled in by the model).
    pub(crate) fn snapshot(&self) -> MemoryStats {
        *self.stats.lock()
    }

    /// Units unsharded now (what the rate limiter compares with its limit).
    pub(crate) fn unsharded_units(&self) -> usize {
        self.stats.lock().unsharded_units
    }

    /// Resets the peaks to the current values.
    pub(crate) fn reset_peak(&self) {
        let mut m = self.stats.lock();
        m.peak_unsharded_bytes = m.unsharded_bytes;
        m.peak_unsharded_units = m.unsharded_units;
    }
}

/// One unit's unsharded memory; released when dropped (see the module docs).
#[derive(Debug)]
pub(crate) struct UnshardGuard {
    account: MemoryAccount,
    bytes: usize,
    unit: bool,
}

impl Drop for UnshardGuard {
    fn drop(&mut self) {
        let mut m = self.account.stats.lock();
        m.unsharded_bytes -= self.bytes;
        m.unsharded_units -= usize::from(self.unit);
    }
}
