//! Rank agreement, "agree, then act": ranks that disagree fail at once, each naming its own
//! side, instead of issuing different collectives and hanging until the timeout.
//! - at build, [`agree_on_model`]: every rank built the same model under the same
//!   schedule-shaping [`FsdpConfig`] fields (strategy, seed, prefetching, mixed precision, …);
//! - after each forward, `issue_agreement` / `finish_agreement`: every rank all-gathered the
//!   same groups in the same order.
//!
//! Both compare [`Fingerprint`]s (FNV-1a 64-bit, [`crate::init::fnv1a64`]) with one all-reduce:
//! for each fingerprint `h`, the maximum of `h` and of `M - h` give the largest and the smallest
//! over the ranks, which are equal when every rank has the same.

use candle_core::Tensor;

use super::config::FsdpConfig;
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

/// Checks that every rank built the same model under the same schedule-shaping configuration
/// (a collective: one all-reduce of `2 × 10` integers on the default stream). Ranks that
/// disagree would otherwise issue different collectives (a prefetch in another order, another
/// wire dtype, a secondary group) and hang until the timeout, or silently compute on a model
/// initialised differently; here every rank fails at once, naming each field that differs and
/// its own value of it.
///
/// Each field is an FNV-1a (64-bit) fingerprint: the model's over each unit's name, options
/// (mixed-precision policy, `reshard_after_forward`, frozen), parameter names and shapes and
/// buffer names, in order; each [`FsdpConfig`] field's over its `Debug` form. The device, the
/// memory budget and the fingerprint file's path may differ between ranks (whether runs are
/// fingerprinted at all may not: recording adds collectives).
///
/// Errors: [`Error::RanksDisagree`], `what` = `built different models` when the models differ,
/// `configured FSDP differently` when only the configurations do.
pub(super) fn agree_on_model(
    pg: &dyn ProcessGroup,
    units: &[ParamGroup],
    config: &FsdpConfig,
) -> Result<()> {
    if pg.world_size() == 1 {
        return Ok(());
    }
    let mut model = Fingerprint::new();
    for u in units {
        model.field(u.name().as_bytes());
        // A policy inherited from the config is the config's field's to compare.
        let policy = if u.policy() == &config.mixed_precision {
            "the config's".to_string()
        } else {
            format!("{:?}", u.policy())
        };
        let options = format!("{policy} {} {}", u.reshard_after_forward, u.is_frozen());
        model.field(options.as_bytes());
        for p in &u.flat().layout().params {
            model.field(p.name.as_bytes());
            model.field(format!("{:?}", p.shape.dims()).as_bytes());
        }
        for (b, _) in u.buffers() {
            model.field(b.as_bytes());
        }
    }
    let c = config;
    let fields: [(&str, String); 10] = [
        ("sharding_strategy", format!("{:?}", c.sharding_strategy)),
        ("seed", c.seed.to_string()),
        ("forward_prefetch", c.forward_prefetch.to_string()),
        ("backward_prefetch", format!("{:?}", c.backward_prefetch)),
        ("limit_all_gathers", format!("{:?}", c.limit_all_gathers)),
        (
            "reshard_after_forward_ranks",
            format!("{:?}", c.reshard_after_forward_ranks),
        ),
        ("mixed_precision", format!("{:?}", c.mixed_precision)),
        ("frozen_storage", format!("{:?}", c.frozen_storage)),
        ("comm_streams", format!("{:?}", c.comm_streams)),
        (
            "fingerprint",
            if c.fingerprint.is_some() {
                "set"
            } else {
                "unset"
            }
            .to_string(),
        ),
    ];
    let hash = |v: &str| {
        let mut f = Fingerprint::new();
        f.field(v.as_bytes());
        f.finish()
    };
    let hashes: Vec<u64> = std::iter::once(model.finish())
        .chain(fields.iter().map(|(_, v)| hash(v)))
        .collect();
    // Max of h and of (M - h) give the largest and the smallest fingerprint in one all-reduce.
    let m = u64::MAX >> 1;
    let mut both: Vec<u64> = hashes.iter().map(|h| h & m).collect();
    both.extend(hashes.iter().map(|h| m - (h & m)));
    let r = pg.all_reduce_u64s(both, ReduceOp::Max)?;
    let n = hashes.len();
    let differs = |i: usize| r[i] != m - r[n + i];
    let config_diff: Vec<String> = fields
        .iter()
        .enumerate()
        .filter(|&(i, _)| differs(i + 1))
        .map(|(_, (name, v))| format!("{name} = {v}"))
        .collect();
    if differs(0) {
        let also = if config_diff.is_empty() {
            String::new()
        } else {
            format!(
                "; FsdpConfig fields differ too, this rank's: {}",
                config_diff.join(", ")
            )
        };
        return Err(Error::RanksDisagree {
            what: "built different models",
            rank: pg.rank(),
            detail: format!(
                "has {} units (unit names or options, parameter names or shapes, or buffers \
                 differ){also}; every rank must build the same model in the same order",
                units.len()
            ),
        });
    }
    if !config_diff.is_empty() {
        return Err(Error::RanksDisagree {
            what: "configured FSDP differently",
            rank: pg.rank(),
            detail: format!(
                "has {} (the FsdpConfig fields that differ between the ranks); every rank must \
                 pass the same FsdpConfig (its device, memory budget and fingerprint path \
                 excepted)",
                config_diff.join(", ")
            ),
        });
    }
    Ok(())
}
