//! Starting a thread group and running a job on it: [`new_group`] (and, feature `cuda`,
//! [`new_group_on_gpu`]) create the ranks' handles, [`run_ranks`] / [`run_ranks_ok`] (and
//! [`run_ranks_on_gpu`]) run a closure on each rank in a thread of its own and collect the
//! results, aborting the group when a rank fails or panics. Also the process-level knobs of
//! in-process ranks: [`set_intra_op_threads`] (the cores per rank) and `raise_priority` (comm
//! stream threads ahead of compute).

use crate::comm::engine::{panic_message, run_one};
use std::sync::Arc;
use std::thread;

#[cfg(feature = "cuda")]
use super::cuda;
use super::rendezvous::Shared;
use super::{ThreadGroupConfig, Threads};
use crate::comm::{collect_rank_results, Instrumented, ProcessGroup};
use crate::error::{Error, Result};

/// Creates a group of `world_size` ranks living in this process; element `r` is rank `r`'s
/// handle (each with its default stream running). The handles are bare backends: wrap them in
/// [`Instrumented`] for statistics, as [`run_ranks`] does.
///
/// Errors: [`Error::Value`] when `world_size == 0`; [`Error::SpawnFailed`] when a
/// stream thread cannot be started.
pub fn new_group(
    world_size: usize,
    config: ThreadGroupConfig,
) -> Result<Vec<Arc<dyn ProcessGroup>>> {
    let shared = Shared::root(config.timeout, world_size)?;
    (0..world_size)
        .map(|rank| {
            Threads::group(
                Arc::clone(&shared),
                rank,
                #[cfg(feature = "cuda")]
                None,
            )
        })
        .collect()
}

/// Creates a group of `world_size` ranks living in this process, every rank on GPU `ordinal`
/// with a Candle device of its own (its own compute stream): element `r` is rank `r`'s handle.
/// Buffers of its collectives are 1-D contiguous tensors on the rank's device
/// ([`ProcessGroup::device`]). The handles are bare backends, as from [`new_group`].
///
/// Errors: [`Error::Value`] when `world_size` is 0 or above
/// [`MAX_CUDA_RANKS`]; [`Error::Cuda`] when the GPU cannot be opened or a stream created;
/// [`Error::SpawnFailed`].
#[cfg(feature = "cuda")]
pub fn new_group_on_gpu(
    world_size: usize,
    config: ThreadGroupConfig,
    ordinal: usize,
) -> Result<Vec<Arc<dyn ProcessGroup>>> {
    let shared = Shared::root(config.timeout, world_size)?;
    if world_size > cuda::MAX_CUDA_RANKS {
        return Err(Error::value(
            "the world_size of the thread backend on CUDA",
            format_args!("at most {} (ranks on one GPU)", cuda::MAX_CUDA_RANKS),
            world_size,
        ));
    }
    let devices = (0..world_size)
        .map(|_| cuda::RankCuda::open(ordinal).map(Arc::new))
        .collect::<Result<Vec<_>>>()?;
    devices
        .into_iter()
        .enumerate()
        .map(|(rank, rc)| Threads::group(Arc::clone(&shared), rank, Some(rc)))
        .collect()
}

/// [`run_ranks`] with every rank on GPU `ordinal` ([`new_group_on_gpu`]).
#[cfg(feature = "cuda")]
pub fn run_ranks_on_gpu<T, F>(
    world_size: usize,
    config: ThreadGroupConfig,
    ordinal: usize,
    f: F,
) -> Vec<Result<T>>
where
    T: Send,
    F: Fn(Arc<dyn ProcessGroup>) -> Result<T> + Send + Sync,
{
    match new_group_on_gpu(world_size, config, ordinal) {
        Ok(groups) => run_groups(groups, f),
        Err(e) => vec![Err(e)],
    }
}

/// Runs `f` on `world_size` ranks of a fresh in-process group, one thread per rank (named
/// `rank-{r}`), and returns each rank's result (index = rank). Each rank's handle is wrapped in
/// [`Instrumented`], so [`ProcessGroup::stats`] counts its collectives.
///
/// When `f` returns `Err(e)` on a rank, the group is aborted with `e.to_string()` as the reason;
/// when it panics, the group is aborted with `"panicked: <payload>"` and the rank's result is
/// [`Error::RankPanicked`]. Either way the other ranks' pending and later collectives fail
/// promptly with [`Error::PeerFailed`]. After `f` returns, the rank's handle is dropped (if `f`
/// kept no clone of it): its queued work finishes and the rank is marked departed.
///
/// If the group cannot be created (`world_size == 0`), the result is a single `Err`; a rank
/// whose thread cannot be spawned gets [`Error::SpawnFailed`].
///
/// A world of one rank with more than one intra-op thread (`RAYON_NUM_THREADS`) runs `f` on a
/// worker of rayon's global pool (the rank's thread waits for it): every kernel's parallel
/// region then starts on a worker that is already awake, and splits with the pool's other
/// workers, instead of handing each region from a thread outside the pool to sleeping workers
/// and back (decision 68: the GPT bench step at world size 1, 569–580 → 540–547 ms). Ranks
/// that share one process keep their own threads: a rank blocked in a collective must not hold
/// a worker that another rank's kernels are waiting for.
pub fn run_ranks<T, F>(world_size: usize, config: ThreadGroupConfig, f: F) -> Vec<Result<T>>
where
    T: Send,
    F: Fn(Arc<dyn ProcessGroup>) -> Result<T> + Send + Sync,
{
    match new_group(world_size, config) {
        Ok(groups) => run_groups(groups, f),
        Err(e) => vec![Err(e)],
    }
}

/// Runs `f` on every handle of `groups` (index = rank), one scoped thread per rank; see
/// [`run_ranks`].
fn run_groups<T, F>(groups: Vec<Arc<dyn ProcessGroup>>, f: F) -> Vec<Result<T>>
where
    T: Send,
    F: Fn(Arc<dyn ProcessGroup>) -> Result<T> + Send + Sync,
{
    let f = &f;
    let on_pool = groups.len() == 1 && candle_core::utils::get_num_threads() > 1;
    thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|pg| {
                let rank = pg.rank();
                let pg: Arc<dyn ProcessGroup> = Arc::new(Instrumented::new(pg));
                // On failure the handle moved into the closure is dropped: peers see this rank
                // as departed.
                thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        if on_pool {
                            // On a worker of rayon's global pool (`rayon::scope` runs its body
                            // there; this thread waits). `run_one` catches its own panics, so
                            // none crosses the pool.
                            rayon::scope(|_| run_one(rank, pg, f))
                        } else {
                            run_one(rank, pg, f)
                        }
                    })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Ok(h) => h.join().unwrap_or_else(|p| {
                    Err(Error::RankPanicked {
                        rank,
                        message: panic_message(p.as_ref()),
                    })
                }),
                Err(error) => Err(Error::SpawnFailed {
                    what: format!("the thread of rank {rank}"),
                    error,
                }),
            })
            .collect()
    })
}

/// Like [`run_ranks`], but returns every rank's value (index = rank) or a single error: the root
/// cause of the failure rather than its echoes on the other ranks, chosen by
/// [`collect_rank_results`] (which looks through [`Error::InStep`] context and returns the
/// chosen rank's whole error).
pub fn run_ranks_ok<T, F>(world_size: usize, config: ThreadGroupConfig, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Arc<dyn ProcessGroup>) -> Result<T> + Send + Sync,
{
    collect_rank_results(run_ranks(world_size, config, f))
}

/// Splits the machine's cores between in-process ranks, as `torchrun` does with
/// `OMP_NUM_THREADS`: sets `RAYON_NUM_THREADS` (which Candle's CPU matmul and this crate's CPU
/// kernels read for their intra-op parallelism) to `max(1, available_parallelism / world_size)`
/// unless the user already set it, and returns the value in force.
///
/// Without it every rank's matmul asks the one shared rayon pool for all cores and the ranks
/// queue behind each other (measured on 2 cores at world size 2, MNIST MLP: 5.2 s per epoch
/// instead of 1.1 s). It also caps how long Candle's element-wise thread pool spins waiting for
/// work after each op (`CANDLE_BARRIER_POOL_SPIN_LIMIT`, 25 000 rounds by default, about a
/// millisecond) at [`BARRIER_POOL_SPIN_LIMIT`] unless the user set it: that spinning thread
/// otherwise holds a core that the next matmul's rayon threads need (GPT bench configuration,
/// world size 1 on 2 cores: design/kernels.md). Call it at the start of `main`, before any thread
/// is spawned: changing the environment while other threads read it is not sound on every
/// platform.
pub fn set_intra_op_threads(world_size: usize) -> usize {
    if std::env::var_os("CANDLE_BARRIER_POOL_SPIN_LIMIT").is_none() {
        std::env::set_var(
            "CANDLE_BARRIER_POOL_SPIN_LIMIT",
            BARRIER_POOL_SPIN_LIMIT.to_string(),
        );
    }
    if let Some(n) = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
    {
        return n;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let n = (cores / world_size.max(1)).max(1);
    std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    n
}

/// The spin rounds [`set_intra_op_threads`] gives Candle's element-wise thread pool
/// (`CANDLE_BARRIER_POOL_SPIN_LIMIT`) before its worker sleeps: tens of microseconds instead of
/// Candle's default millisecond.
pub const BARRIER_POOL_SPIN_LIMIT: u32 = 2_000;

/// Asks the kernel to run this comm-stream thread ahead of compute threads (nice -10), the CPU
/// analogue of the high-priority CUDA streams PyTorch FSDP issues its collectives on: a
/// prefetched collective then starts as soon as it is issued even when compute keeps every core
/// busy, instead of waiting until a compute thread blocks. Measured (benches/overlap.rs, 2 cores,
/// world size 2): exposed communication 12.0 % of the step without it, 6.8–9.2 % with it.
/// Needs CAP_SYS_NICE (root has it); without it the thread keeps the default priority.
pub(super) fn raise_priority() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: setpriority with PRIO_PROCESS and who = 0 changes only the calling thread's
        // nice value on Linux; it reads and writes no memory of ours.
        let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, -10) };
        if rc != 0 {
            tracing::debug!(
                "comm stream {:?}: cannot raise its priority ({}); it runs at the default",
                thread::current().name(),
                std::io::Error::last_os_error()
            );
        }
    }
}
