//! The 2-D layout of HYBRID_SHARD (FSDP2's device mesh `(replicate, shard)`): the world of
//! `W = R × S` ranks cut into `R` *shard groups* of `S` consecutive ranks (world rank
//! `r·S + s` is rank `s` of shard group `r`), and `S` *replica groups* joining the ranks of
//! equal position `s` in every shard group. Parameters are sharded over the shard group;
//! gradients, once reduce-scattered inside it, are all-reduced over the replica group.
//!
//! Every other strategy has a one-dimensional mesh: the shard group is the world, there is no
//! replica group.
//!
//! With a partial reshard after forward ([`super::FsdpConfig::reshard_after_forward_ranks`]
//! `= k`), each shard group is further cut into *secondary groups* of `k` consecutive ranks:
//! what a unit keeps between its forward and its backward is sharded over this smaller group.

use std::sync::Arc;

use super::config::ShardingStrategy;
use crate::comm::{ProcessGroup, ProcessGroupExt, ReduceOp};
use crate::error::{Error, Result};

/// This rank's view of the mesh: its shard group, its replica group (hybrid only) and which
/// replica it belongs to.
pub(crate) struct Mesh {
    /// The group the FlatParameters are sharded over (the world unless hybrid).
    pub shard: Arc<dyn ProcessGroup>,
    /// The group of this rank's replicas (`None` unless hybrid with more than one replica).
    pub replica: Option<Arc<dyn ProcessGroup>>,
    /// Which shard group this rank is in (`0..R`; 0 unless hybrid).
    pub replica_index: usize,
    /// The secondary group of a partial reshard after forward (`None` without one).
    pub secondary: Option<Arc<dyn ProcessGroup>>,
}

impl Mesh {
    /// The mesh of `strategy` over `world` (a collective under the hybrid strategies: the ranks
    /// agree on the shard size, then create the `R` shard groups and the `S` replica groups
    /// with [`ProcessGroup::new_group`], in that order, on every rank).
    ///
    /// Errors: a shard size of 0 or one that does not divide the world size (naming both); the
    /// launch environment cannot be read (default shard size); ranks asking for different
    /// shard sizes; a sub-group that cannot be created.
    pub(crate) fn new(
        world: &Arc<dyn ProcessGroup>,
        strategy: ShardingStrategy,
        partial: Option<usize>,
    ) -> Result<Mesh> {
        let mut mesh = Self::shard_and_replicas(world, strategy)?;
        if let Some(k) = partial.filter(|_| strategy.reshards_after_forward()) {
            mesh.secondary = mesh.secondary_groups(world, k)?;
        }
        Ok(mesh)
    }

    /// The shard and replica groups (see [`Mesh::new`]).
    fn shard_and_replicas(
        world: &Arc<dyn ProcessGroup>,
        strategy: ShardingStrategy,
    ) -> Result<Mesh> {
        let flat = |world: &Arc<dyn ProcessGroup>| Mesh {
            shard: world.clone(),
            replica: None,
            replica_index: 0,
            secondary: None,
        };
        if !strategy.is_hybrid() {
            return Ok(flat(world));
        }
        let ws = world.world_size();
        let s = match strategy.shard_size() {
            Some(s) => s,
            None => crate::launch::LaunchEnv::detect()?.ranks_on_this_machine(ws),
        };
        if s == 0 || !ws.is_multiple_of(s) {
            return Err(Error::InvalidArgument(format!(
                "{strategy}: shard size {s} does not divide the world size {ws}; choose a shard \
                 size that divides {ws} (the ranks of one machine, usually)"
            )));
        }
        if ws > 1 {
            // Max of s and of (M - s): the largest and the smallest shard size asked for.
            let m = u64::MAX >> 1;
            let r = world.all_reduce_u64s(vec![s as u64, m - s as u64], ReduceOp::Max)?;
            if r[0] != m - r[1] {
                return Err(Error::RanksDisagree {
                    what: "asked for different HYBRID_SHARD shard sizes",
                    rank: world.rank(),
                    detail: format!(
                        "asked for {s}, others from {} to {}; every rank must use the same \
                         --shard-size",
                        m - r[1],
                        r[0]
                    ),
                });
            }
        }
        if s == ws {
            return Ok(flat(world));
        }
        let replicas = ws / s;
        let mut shard = None;
        for r in 0..replicas {
            let ranks: Vec<usize> = (r * s..(r + 1) * s).collect();
            if let Some(g) = world.new_group(&ranks)? {
                shard = Some(g);
            }
        }
        let mut replica = None;
        for i in 0..s {
            let ranks: Vec<usize> = (0..replicas).map(|r| r * s + i).collect();
            if let Some(g) = world.new_group(&ranks)? {
                replica = Some(g);
            }
        }
        let missing = || Error::Internal("a rank is in no shard or replica group".into());
        Ok(Mesh {
            shard: shard.ok_or_else(missing)?,
            replica: Some(replica.ok_or_else(missing)?),
            replica_index: world.rank() / s,
            secondary: None,
        })
    }

    /// This rank's secondary group of `k` ranks (a collective: every shard group's secondary
    /// groups are created in order on every rank); `None` when `k` is the shard group's size
    /// (plain FULL_SHARD).
    ///
    /// Errors: `k` of 0 or not dividing the shard group's size (naming both).
    fn secondary_groups(
        &self,
        world: &Arc<dyn ProcessGroup>,
        k: usize,
    ) -> Result<Option<Arc<dyn ProcessGroup>>> {
        let s = self.shard_size();
        if k == 0 || !s.is_multiple_of(k) {
            return Err(Error::InvalidArgument(format!(
                "reshard_after_forward_ranks {k} does not divide the shard group's {s} ranks; \
                 choose a divisor of {s} (the ranks of one machine, usually)"
            )));
        }
        if k == s {
            return Ok(None);
        }
        let mut mine = None;
        for first in (0..world.world_size()).step_by(k) {
            let ranks: Vec<usize> = (first..first + k).collect();
            if let Some(g) = world.new_group(&ranks)? {
                mine = Some(g);
            }
        }
        Ok(mine)
    }

    /// Ranks of one shard group.
    pub(crate) fn shard_size(&self) -> usize {
        self.shard.world_size()
    }

    /// Number of replicas (shard groups).
    #[cfg(test)]
    pub(crate) fn replicas(&self) -> usize {
        self.replica.as_ref().map_or(1, |g| g.world_size())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::threads::{run_ranks_ok, ThreadGroupConfig};

    #[test]
    fn ranks_are_laid_out_replica_major() {
        let out = run_ranks_ok(6, ThreadGroupConfig::default(), |pg| {
            let m = Mesh::new(
                &pg,
                ShardingStrategy::HybridShard {
                    shard_size: Some(2),
                },
                None,
            )?;
            Ok((
                m.shard.rank(),
                m.shard_size(),
                m.replica.as_ref().map(|g| g.rank()),
                m.replicas(),
                m.replica_index,
            ))
        })
        .unwrap();
        for (w, &(s, ss, r, rs, ri)) in out.iter().enumerate() {
            assert_eq!(
                (s, ss, r, rs, ri),
                (w % 2, 2, Some(w / 2), 3, w / 2),
                "rank {w}"
            );
        }
    }

    #[test]
    fn a_shard_size_that_does_not_divide_the_world_names_both() {
        let e = run_ranks_ok(4, ThreadGroupConfig::default(), |pg| {
            Mesh::new(
                &pg,
                ShardingStrategy::HybridShard {
                    shard_size: Some(3),
                },
                None,
            )
            .map(|_| ())
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("shard size 3 does not divide the world size 4"),
            "{e}"
        );
    }
}
