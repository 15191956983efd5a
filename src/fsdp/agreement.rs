//! Rank agreement, "agree, then act": ranks that disagree fail at once, all with the same
//! error, instead of issuing different collectives and hanging until the timeout.
//! - at build, [`agree_on_model`]: every rank built the same model;
//! - after each forward, `issue_agreement` / `finish_agreement`: every rank all-gathered the
//!   same groups in the same order.
//!
//! Both compare one [`Fingerprint`] (FNV-1a 64-bit, [`crate::init::fnv1a64`]) with one
//! all-reduce of two integers: the maximum of `h` and of `M - h` give the largest and the
//! smallest fingerprint over the ranks, which are equal when every rank has the same.

use candle_core::Tensor;

use super::config::ShardingStrategy;
use super::model::FsdpModel;
use super::param_group::ParamGroup;
use crate::comm::{ProcessGroup, ProcessGroupExt, ReduceOp};
use crate::error::{Error, Phase, Result};
use crate::init::{fnv1a64_update, FNV1A64_OFFSET};

/// An FNV-1a (64-bit) hash built piece by piece.
pub(super) struct Fingerprint(u64);

impl Fingerprint {
    pub(super) fn new() -> Self {
        Fingerprint(FNV1A64_OFFSET)
    }

    /// Adds `bytes` as they are.
    pub(super) fn bytes(&mut self, bytes: &[u8]) {
        self.0 = fnv1a64_update(self.0, bytes);
    }

    /// Adds one field: `bytes`, then a 0xff separator (no UTF-8 string contains that byte).
    pub(super) fn field(&mut self, bytes: &[u8]) {
        self.bytes(bytes);
        self.bytes(&[0xff]);
    }

    pub(super) fn finish(&self) -> u64 {
        self.0
    }
}

impl FsdpModel {
    /// Issues the check that every rank all-gathered the same units in the same order in the
    /// forward that just ran (a collective: one all-reduce of two integers on the all-gather
    /// stream; [`FsdpModel::finish_agreement`] waits for it). Ranks that called different units
    /// of equal shapes would otherwise have computed on shards mixed from both. On the all-gather
    /// stream, a rank that issued more all-gathers than another meets this all-reduce with one of
    /// them, which the backends refuse at once as a mismatch instead of both waiting for the
    /// timeout. (A rank may call a unit more often than another as long as the gathers match,
    /// e.g. a second call of a unit whose parameters are still present.) `None` at world size 1
    /// and when no group is sharded (NO_SHARD): no rank can gather anything then (the ranks
    /// agreed on the layouts at build), and the check would cost a collective a step for nothing.
    pub(super) fn issue_agreement(&self) -> Option<(i64, crate::comm::Work<Tensor>)> {
        if self.comm.shard_pg().world_size() == 1
            || self.units.iter().all(|u| u.flat().layout().world_size == 1)
        {
            return None;
        }
        let mut fp = Fingerprint::new();
        for &g in self.scheduler.gathered_now() {
            fp.bytes(&(g as u64).to_le_bytes());
        }
        let mask = i64::MAX >> 1;
        let fp = (fp.finish() & mask as u64) as i64;
        let work = match Tensor::new(&[fp, mask - fp], &candle_core::Device::Cpu)
            .and_then(|t| t.to_device(&self.config.device))
        {
            Ok(t) => self
                .comm
                .shard_pg()
                .all_reduce(&self.comm.all_gather, t, ReduceOp::Max),
            Err(e) => crate::comm::Work::ready(Err(e.into())),
        };
        Some((mask, work))
    }

    /// Waits for [`FsdpModel::issue_agreement`]'s all-reduce and fails when the ranks differ.
    pub(super) fn finish_agreement(
        &self,
        agreement: Option<(i64, crate::comm::Work<Tensor>)>,
        phase: Phase,
    ) -> Result<()> {
        let Some((mask, work)) = agreement else {
            return Ok(());
        };
        let r = work
            .wait()
            .and_then(|t| crate::device::read_small::<i64>(&t))
            .map_err(|e| self.at(e, None, phase))?;
        if r[0] != mask - r[1] {
            let tape = self.scheduler.tape_now();
            let names: Vec<&str> = tape
                .iter()
                .take(32)
                .map(|&m| self.members[m].spec.name.as_str())
                .collect();
            let more = if tape.len() > 32 { ", ..." } else { "" };
            return Err(self.at(
                Error::RanksDisagree {
                    what: "all-gathered different units in this forward",
                    rank: self.pg.rank(),
                    detail: format!(
                        "called [{}{more}]; every rank must call the same units in the same order",
                        names.join(", ")
                    ),
                },
                None,
                phase,
            ));
        }
        Ok(())
    }
}

/// Checks that every rank built the same model (a collective: one all-reduce of two integers on
/// the default stream). Ranks that disagree would otherwise issue different collectives and
/// hang until the timeout; here every rank fails at once with the same error.
///
/// The fingerprint is FNV-1a (64-bit) over the strategy and each unit's name, parameter names
/// and shapes, and buffer names, in order.
pub(super) fn agree_on_model(
    pg: &dyn ProcessGroup,
    units: &[ParamGroup],
    strategy: ShardingStrategy,
) -> Result<()> {
    if pg.world_size() == 1 {
        return Ok(());
    }
    let mut fp = Fingerprint::new();
    fp.field(format!("{strategy:?}").as_bytes());
    for u in units {
        fp.field(u.name().as_bytes());
        for p in &u.flat().layout().params {
            fp.field(p.name.as_bytes());
            fp.field(format!("{:?}", p.shape.dims()).as_bytes());
        }
        for (b, _) in u.buffers() {
            fp.field(b.as_bytes());
        }
    }
    let h = fp.finish();
    // Max of h and of (M - h) give the largest and the smallest fingerprint in one all-reduce.
    let m = u64::MAX >> 1;
    let fp = h & m;
    let r = pg.all_reduce_u64s(vec![fp, m - fp], ReduceOp::Max)?;
    let (max, min) = (r[0], m - r[1]);
    if max != min {
        return Err(Error::RanksDisagree {
            what: "built different models",
            rank: pg.rank(),
            detail: format!(
                "has {} units (unit names, parameter names or shapes, buffers or sharding \
                 strategy differ); every rank must build the same model in the same order",
                units.len()
            ),
        });
    }
    Ok(())
}
