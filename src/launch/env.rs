//! How this process was started, read from its environment: by `mpirun` (OpenMPI's
//! `OMPI_COMM_WORLD_*`, or MPICH/Hydra's `PMI_*`), torchrun-style (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), or plainly (every rank a
//! thread of this process).
//!
//! Every variable is validated (integers, ranges, consistency between the two families) and a
//! problem is an [`Error::Env`] that names the variable and its value (or an [`Error::Missing`]
//! or [`Error::Conflict`] naming the variables that are missing or disagree).
//! [`LaunchEnv::world_size_for`] checks a requested world size (the examples' `--world-size`)
//! against the launcher's.

use crate::error::{Error, Result};

/// The torchrun-style variables (as `torchrun` sets them), validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TorchrunEnv {
    /// `RANK`: this process's rank, `< world_size`.
    pub rank: usize,
    /// `WORLD_SIZE`: number of processes of the job, `>= 1`.
    pub world_size: usize,
    /// `LOCAL_RANK`: rank among the processes of this machine (default: `rank`).
    pub local_rank: usize,
    /// `LOCAL_WORLD_SIZE`: processes on this machine (default: `world_size`).
    pub local_world_size: usize,
    /// `MASTER_ADDR`: host of the rendezvous store (NCCL bootstrap), if set.
    pub master_addr: Option<String>,
    /// `MASTER_PORT`: its TCP port, `1..=65535`, if set.
    pub master_port: Option<u16>,
}

/// The variables `mpirun` sets for each process, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpiEnv {
    /// Rank in `MPI_COMM_WORLD`.
    pub rank: usize,
    /// Processes of the job.
    pub world_size: usize,
    /// Processes of the job on this machine.
    pub local_size: usize,
    /// The variable the world size was read from (named in errors).
    pub source: &'static str,
}

/// How this process was started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaunchEnv {
    /// No launcher: every rank runs as a thread of this process.
    Local,
    /// Started by `mpirun` (possibly with torchrun-style variables too, which then agree).
    Mpi(MpiEnv),
    /// Started torchrun-style, without `mpirun`.
    Torchrun(TorchrunEnv),
}

const TORCHRUN_VARS: [&str; 6] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
];

fn parse_usize(get: &dyn Fn(&str) -> Option<String>, var: &str) -> Result<Option<usize>> {
    match get(var) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse::<usize>()
            .map(Some)
            .map_err(|_| Error::env(var, format!("{v:?}"), "is not a non-negative integer")),
    }
}

fn check_rank(rank_var: &str, rank: usize, size_var: &str, size: usize) -> Result<()> {
    if size == 0 {
        return Err(Error::env(
            size_var,
            0,
            "leaves no process: a job needs at least one",
        ));
    }
    if rank >= size {
        return Err(Error::env(
            rank_var,
            rank,
            format!("is out of range for {size_var}={size} (expected 0..{size})"),
        ));
    }
    Ok(())
}

impl TorchrunEnv {
    /// Reads the torchrun-style variables through `get`; `None` when neither `RANK` nor
    /// `WORLD_SIZE` is set (the others alone, which some cluster shells export globally, do not
    /// make a torchrun launch). An empty value counts as unset.
    ///
    /// Errors: one of `RANK` and `WORLD_SIZE` is set without the other; a value is not an
    /// integer;
    /// `RANK >= WORLD_SIZE`, `LOCAL_RANK >= LOCAL_WORLD_SIZE`, `LOCAL_WORLD_SIZE > WORLD_SIZE`;
    /// `MASTER_PORT` outside 1..=65535.
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<TorchrunEnv>> {
        let get = &|v: &str| get(v).filter(|s| !s.trim().is_empty());
        let set: Vec<&str> = TORCHRUN_VARS
            .iter()
            .copied()
            .filter(|v| get(v).is_some())
            .collect();
        if get("RANK").is_none() && get("WORLD_SIZE").is_none() {
            return Ok(None);
        }
        let (Some(rank), Some(world_size)) =
            (parse_usize(get, "RANK")?, parse_usize(get, "WORLD_SIZE")?)
        else {
            let missing: Vec<&str> = ["RANK", "WORLD_SIZE"]
                .into_iter()
                .filter(|v| get(v).is_none())
                .collect();
            return Err(Error::missing(
                format_args!("{} for the torchrun-style launch", missing.join(" and ")),
                format_args!(
                    "{} set, and such a launch sets both RANK and WORLD_SIZE",
                    set.join(", ")
                ),
            ));
        };
        check_rank("RANK", rank, "WORLD_SIZE", world_size)?;
        let local_rank = parse_usize(get, "LOCAL_RANK")?.unwrap_or(rank);
        let local_world_size = parse_usize(get, "LOCAL_WORLD_SIZE")?.unwrap_or(world_size);
        check_rank(
            "LOCAL_RANK",
            local_rank,
            "LOCAL_WORLD_SIZE",
            local_world_size,
        )?;
        if local_world_size > world_size {
            return Err(Error::env(
                "LOCAL_WORLD_SIZE",
                local_world_size,
                format!("is larger than WORLD_SIZE={world_size}"),
            ));
        }
        let master_addr = get("MASTER_ADDR");
        let master_port = match get("MASTER_PORT") {
            None => None,
            Some(p) => match p.trim().parse::<u16>() {
                Ok(port) if port > 0 => Some(port),
                _ => {
                    return Err(Error::env(
                        "MASTER_PORT",
                        format!("{p:?}"),
                        "is not a TCP port (1..=65535)",
                    ))
                }
            },
        };
        Ok(Some(TorchrunEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
        }))
    }
}

impl MpiEnv {
    /// Reads the variables `mpirun` sets (OpenMPI first, then MPICH/Hydra); `None` when this
    /// process was not started by an MPI launcher.
    ///
    /// Errors: a value is not an integer, or the rank is out of range.
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<MpiEnv>> {
        const FAMILIES: [(&str, &str, &str); 2] = [
            (
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            ),
            ("PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS"),
        ];
        for (rank_var, size_var, local_var) in FAMILIES {
            let (Some(rank), Some(world_size)) =
                (parse_usize(get, rank_var)?, parse_usize(get, size_var)?)
            else {
                continue;
            };
            check_rank(rank_var, rank, size_var, world_size)?;
            let local_size = parse_usize(get, local_var)?
                .unwrap_or(world_size)
                .clamp(1, world_size);
            return Ok(Some(MpiEnv {
                rank,
                world_size,
                local_size,
                source: size_var,
            }));
        }
        Ok(None)
    }
}

impl LaunchEnv {
    /// How this process was started, from `get` (e.g. `|v| std::env::var(v).ok()`).
    ///
    /// Errors: an invalid variable (see [`TorchrunEnv::from_vars`], [`MpiEnv::from_vars`]), or
    /// torchrun-style variables that disagree with `mpirun`'s (`RANK` vs the MPI rank,
    /// `WORLD_SIZE` vs the MPI world size).
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> Result<LaunchEnv> {
        let torchrun = TorchrunEnv::from_vars(get)?;
        match (MpiEnv::from_vars(get)?, torchrun) {
            (Some(mpi), Some(t)) => {
                if t.world_size != mpi.world_size || t.rank != mpi.rank {
                    return Err(Error::conflict(
                        format_args!("RANK={} WORLD_SIZE={}", t.rank, t.world_size),
                        format_args!(
                            "mpirun's rank {} of {} ({})",
                            mpi.rank, mpi.world_size, mpi.source
                        ),
                        "they disagree; unset RANK and WORLD_SIZE or make them agree",
                    ));
                }
                Ok(LaunchEnv::Mpi(mpi))
            }
            (Some(mpi), None) => Ok(LaunchEnv::Mpi(mpi)),
            (None, Some(t)) => Ok(LaunchEnv::Torchrun(t)),
            (None, None) => Ok(LaunchEnv::Local),
        }
    }

    /// [`LaunchEnv::from_vars`] over this process's environment.
    pub fn detect() -> Result<LaunchEnv> {
        LaunchEnv::from_vars(&|v| std::env::var(v).ok())
    }

    /// The job's world size given a requested one (`--world-size`, `None` when not given):
    /// the launcher's when a launcher started the process, else `requested` or `default`.
    ///
    /// Errors: `requested` disagrees with the launcher's world size (naming both and the
    /// variable it came from).
    pub fn world_size_for(&self, requested: Option<usize>, default: usize) -> Result<usize> {
        let (launched, source) = match self {
            LaunchEnv::Local => return Ok(requested.unwrap_or(default)),
            LaunchEnv::Mpi(m) => (
                m.world_size,
                format!("mpirun started {} processes", m.world_size),
            ),
            LaunchEnv::Torchrun(t) => (t.world_size, format!("WORLD_SIZE={}", t.world_size)),
        };
        match requested {
            Some(r) if r != launched => Err(Error::InvalidArgument(format!(
                "--world-size {r} disagrees with the launcher ({source}); drop --world-size or \
                 make them agree"
            ))),
            _ => Ok(launched),
        }
    }

    /// Ranks of the job that run on this machine (to split its cores between them): the world
    /// size for [`LaunchEnv::Local`] (all threads of this process), the launcher's local size
    /// otherwise.
    pub fn ranks_on_this_machine(&self, world_size: usize) -> usize {
        match self {
            LaunchEnv::Local => world_size,
            LaunchEnv::Mpi(m) => m.local_size,
            LaunchEnv::Torchrun(t) => t.local_world_size,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn plain_process_is_local() {
        let e = LaunchEnv::from_vars(&env(&[])).unwrap();
        assert_eq!(e, LaunchEnv::Local);
        assert_eq!(e.world_size_for(None, 2).unwrap(), 2);
        assert_eq!(e.world_size_for(Some(3), 2).unwrap(), 3);
        assert_eq!(e.ranks_on_this_machine(3), 3);
    }

    #[test]
    fn mpirun_world_size_wins_and_a_mismatch_is_an_error() {
        let e = LaunchEnv::from_vars(&env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ]))
        .unwrap();
        assert_eq!(e.world_size_for(None, 4).unwrap(), 2);
        assert_eq!(e.world_size_for(Some(2), 4).unwrap(), 2);
        let err = e.world_size_for(Some(3), 4).unwrap_err().to_string();
        assert_eq!(
            err,
            "invalid argument: --world-size 3 disagrees with the launcher (mpirun started 2 \
             processes); drop --world-size or make them agree"
        );
        assert_eq!(e.ranks_on_this_machine(2), 2);
    }

    #[test]
    fn torchrun_variables_are_validated() {
        let t = TorchrunEnv::from_vars(&env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((t.rank, t.world_size, t.local_rank), (3, 8, 1));
        assert_eq!(t.master_port, Some(29500));
        let cases: [(&[(&str, &str)], &str); 6] = [
            (
                &[("RANK", "2"), ("WORLD_SIZE", "2")],
                "RANK=2 is out of range for WORLD_SIZE=2",
            ),
            (&[("RANK", "x"), ("WORLD_SIZE", "2")], "RANK=\"x\" is not"),
            (
                &[("RANK", "0"), ("LOCAL_RANK", "0")],
                "no WORLD_SIZE for the torchrun-style launch; RANK, LOCAL_RANK set",
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "70000")],
                "MASTER_PORT=\"70000\" is not a TCP port",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_WORLD_SIZE", "4"),
                ],
                "LOCAL_WORLD_SIZE=4 is larger than WORLD_SIZE=2",
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "x")],
                "MASTER_PORT=\"x\" is not a TCP port",
            ),
        ];
        for (vars, expected) in cases {
            let err = TorchrunEnv::from_vars(&env(vars)).unwrap_err().to_string();
            assert!(err.contains(expected), "{vars:?}: {err}");
        }
    }

    #[test]
    fn stray_or_empty_variables_are_no_launch() {
        for vars in [
            &[("MASTER_ADDR", "node0"), ("MASTER_PORT", "29500")][..],
            &[("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "8")][..],
            &[("RANK", ""), ("WORLD_SIZE", " ")][..],
        ] {
            assert_eq!(
                LaunchEnv::from_vars(&env(vars)).unwrap(),
                LaunchEnv::Local,
                "{vars:?}"
            );
        }
    }

    #[test]
    fn torchrun_and_mpirun_must_agree() {
        let err = LaunchEnv::from_vars(&env(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("RANK=0 WORLD_SIZE=4 with mpirun's rank 0 of 2"),
            "{err}"
        );
        let e = LaunchEnv::from_vars(&env(&[("RANK", "1"), ("WORLD_SIZE", "2")])).unwrap();
        assert!(matches!(e, LaunchEnv::Torchrun(_)));
        assert_eq!(
            e.world_size_for(Some(4), 2).unwrap_err().to_string(),
            "invalid argument: --world-size 4 disagrees with the launcher (WORLD_SIZE=2); drop \
             --world-size or make them agree"
        );
    }
}
