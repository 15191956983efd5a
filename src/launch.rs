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
//! result; a process-per-rank launcher (MPI, in a later backend) runs only this process's rank
//! and returns only its result: [`Launcher::local_ranks`] says which ranks the results are for.
//! Every launcher wraps its backend in [`crate::comm::Instrumented`], so
//! [`crate::comm::ProcessGroup::stats`] works on the groups it hands out.

use std::ops::Range;
use std::sync::Arc;

use crate::comm::threads::{run_ranks, ThreadGroupConfig};
use crate::comm::{collect_rank_results, ProcessGroup};
use crate::error::Result;

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
}

impl Launcher {
    /// `world_size` thread ranks with the default configuration.
    pub fn threads(world_size: usize) -> Launcher {
        Launcher::Threads {
            world_size,
            config: ThreadGroupConfig::default(),
        }
    }

    /// Number of ranks of the job.
    pub fn world_size(&self) -> usize {
        match self {
            Launcher::Threads { world_size, .. } => *world_size,
        }
    }

    /// The ranks this process runs, whose results [`Launcher::run`] returns (in this order):
    /// all of them for [`Launcher::Threads`].
    pub fn local_ranks(&self) -> Range<usize> {
        match self {
            Launcher::Threads { world_size, .. } => 0..*world_size,
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
