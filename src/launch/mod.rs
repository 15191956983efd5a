//! One entry point for examples, benches and tests: a [`Launcher`] starts the ranks of a job and
//! runs a closure on each of them with its process group.
//!
//! ```
//! use candle_fsdp::comm::{ProcessGroupExt, ReduceOp};
//! use candle_fsdp::launch::{launch, Launcher};
//!
//! let sums = launch(&Launcher::threads(3), |pg| {
//!     pg.all_reduce_f32s(vec![pg.rank() as f32], ReduceOp::Sum)
//! })?;
//! assert_eq!(sums, vec![vec![3.0]; 3]);
//! # Ok::<(), candle_fsdp::Error>(())
//! ```
//!
//! A launcher that runs every rank in this process ([`Launcher::Threads`]) returns every rank's
//! result; a process-per-rank launcher (`Launcher::Mpi`, feature `mpi`) runs only this process's
//! rank and returns only its result: [`Launcher::local_ranks`] says which ranks the results are
//! for. [`Launcher::from_env`] picks the launcher from how the process was started ([`mod@env`]).
//! Every launcher wraps its backend in [`crate::comm::Instrumented`], so
//! [`crate::comm::ProcessGroup::stats`] works on the groups it hands out.

pub mod env;

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use crate::comm::threads::{run_ranks, ThreadGroupConfig};
use crate::comm::{collect_rank_results, ProcessGroup};
use crate::error::{Error, Result};

pub use env::{LaunchEnv, MpiEnv, TorchrunEnv};

/// How the ranks of a job are started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// `world_size` ranks as threads of this process, on the shared-memory backend
    /// ([`crate::comm::threads`]).
    Threads {
        /// Number of ranks.
        world_size: usize,
        /// Group configuration (collective timeout).
        config: ThreadGroupConfig,
    },
    /// This process's rank of a job started by `mpirun`, on the MPI backend
    /// ([`crate::comm::mpi`]); build it with [`Launcher::mpi`].
    #[cfg(feature = "mpi")]
    Mpi {
        /// This process's rank in `MPI_COMM_WORLD`.
        rank: usize,
        /// Number of processes of the job.
        world_size: usize,
        /// Group configuration (collective timeout).
        config: crate::comm::mpi::MpiConfig,
    },
}

impl Launcher {
    /// `world_size` thread ranks with the default configuration.
    pub fn threads(world_size: usize) -> Launcher {
        Launcher::Threads {
            world_size,
            config: ThreadGroupConfig::default(),
        }
    }

    /// This process's rank of the MPI job (initialising MPI).
    ///
    /// Errors: MPI cannot be initialised or lacks `MPI_THREAD_MULTIPLE`.
    #[cfg(feature = "mpi")]
    pub fn mpi(config: crate::comm::mpi::MpiConfig) -> Result<Launcher> {
        let (rank, world_size) = crate::comm::mpi::world_rank_and_size()?;
        Ok(Launcher::Mpi {
            rank,
            world_size,
            config,
        })
    }

    /// The launcher for how this process was started ([`LaunchEnv::detect`]): `mpirun` gives
    /// `Launcher::Mpi` (feature `mpi`), a plain start gives [`Launcher::Threads`] with
    /// `requested` ranks (or `default_threads`). `timeout` is the collective timeout of either.
    ///
    /// Errors: invalid launcher variables; `requested` disagrees with the launcher's world size;
    /// started by `mpirun` in a build without the `mpi` feature; started torchrun-style (no
    /// backend here takes that bootstrap yet: the NCCL backend will); MPI fails to start.
    pub fn from_env(
        requested: Option<usize>,
        default_threads: usize,
        timeout: Duration,
    ) -> Result<Launcher> {
        let env = LaunchEnv::detect()?;
        let world_size = env.world_size_for(requested, default_threads)?;
        match env {
            LaunchEnv::Local => Ok(Launcher::Threads {
                world_size,
                config: ThreadGroupConfig { timeout },
            }),
            LaunchEnv::Mpi(m) => Launcher::from_mpi_env(&m, timeout),
            LaunchEnv::Torchrun(t) => Err(Error::InvalidArgument(format!(
                "this process was started torchrun-style (RANK={}, WORLD_SIZE={}), which only \
                 the NCCL backend (GPU) will bootstrap from; on CPUs start the job with `mpirun` \
                 and build with `--features mpi`, or unset RANK/WORLD_SIZE to run every rank \
                 as a thread of this process",
                t.rank, t.world_size
            ))),
        }
    }

    #[cfg(feature = "mpi")]
    fn from_mpi_env(m: &MpiEnv, timeout: Duration) -> Result<Launcher> {
        let launcher = Launcher::mpi(crate::comm::mpi::MpiConfig { timeout })?;
        if launcher.world_size() != m.world_size {
            return Err(Error::InvalidArgument(format!(
                "MPI reports a world of {} processes but {}={}",
                launcher.world_size(),
                m.source,
                m.world_size
            )));
        }
        Ok(launcher)
    }

    #[cfg(not(feature = "mpi"))]
    fn from_mpi_env(m: &MpiEnv, _timeout: Duration) -> Result<Launcher> {
        Err(Error::InvalidArgument(format!(
            "this process was started by mpirun ({}={}) but candle-fsdp was built without \
             the `mpi` feature: rebuild with `--features mpi`",
            m.source, m.world_size
        )))
    }

    /// Number of ranks of the job.
    pub fn world_size(&self) -> usize {
        match self {
            Launcher::Threads { world_size, .. } => *world_size,
            #[cfg(feature = "mpi")]
            Launcher::Mpi { world_size, .. } => *world_size,
        }
    }

    /// Backend name of the groups it hands out (`"threads"`, `"mpi"`).
    pub fn backend(&self) -> &'static str {
        match self {
            Launcher::Threads { .. } => "threads",
            #[cfg(feature = "mpi")]
            Launcher::Mpi { .. } => "mpi",
        }
    }

    /// The ranks this process runs, whose results [`Launcher::run`] returns (in this order):
    /// all of them for [`Launcher::Threads`].
    pub fn local_ranks(&self) -> Range<usize> {
        match self {
            Launcher::Threads { world_size, .. } => 0..*world_size,
            #[cfg(feature = "mpi")]
            Launcher::Mpi { rank, .. } => *rank..*rank + 1,
        }
    }

    /// Runs `f` on every local rank with its process group and returns each one's result
    /// (index = position in [`Launcher::local_ranks`]). A rank whose `f` fails or panics aborts
    /// the group, so its peers fail promptly instead of waiting for it.
    ///
    /// If the group cannot be created, the result is a single `Err`.
    pub fn run_each<T, F>(&self, f: F) -> Vec<Result<T>>
    where
        T: Send,
        F: Fn(Arc<dyn ProcessGroup>) -> Result<T> + Send + Sync,
    {
        match *self {
            Launcher::Threads { world_size, config } => run_ranks(world_size, config, f),
            #[cfg(feature = "mpi")]
            Launcher::Mpi { config, .. } => crate::comm::mpi::run(config, f),
        }
    }

    /// Like [`Launcher::run_each`], but returns the local ranks' values or one error: the root
    /// cause of the failure, as chosen by [`collect_rank_results`] (the failing rank's whole
    /// error, also when wrapped in [`crate::Error::InStep`]).
    pub fn run<T, F>(&self, f: F) -> Result<Vec<T>>
    where
        T: Send,
        F: Fn(Arc<dyn ProcessGroup>) -> Result<T> + Send + Sync,
    {
        collect_rank_results(self.run_each(f))
    }
}

/// Runs `f` on the ranks of `launcher` ([`Launcher::run`]).
pub fn launch<T, F>(launcher: &Launcher, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Arc<dyn ProcessGroup>) -> Result<T> + Send + Sync,
{
    launcher.run(f)
}
