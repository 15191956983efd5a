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
//! A launcher that runs every rank in this process ([`Launcher::Threads`], and
//! `Launcher::ThreadsOnGpu` with feature `cuda`) returns every rank's result; a process-per-rank
//! launcher (`Launcher::Mpi`, feature `mpi`; `Launcher::Nccl`, feature `nccl`) runs only this
//! process's rank and returns only its result: [`Launcher::local_ranks`] says which ranks the
//! results are for. [`Launcher::from_env`] picks the launcher from how the process was started
//! ([`mod@env`]); [`Launcher::for_device`] also takes the examples' `--device` into account.
//! Every launcher wraps its backend in [`crate::comm::Instrumented`], so
//! [`crate::comm::ProcessGroup::stats`] works on the groups it hands out.
//!
//! # Which launcher (`--device` × how the process was started)
//!
//! | `--device` | started plainly | torchrun-style (`fsdp-run`, `torchrun`) | by `mpirun` |
//! |---|---|---|---|
//! | `cpu` | `Threads`: `--world-size` threads | `Shm` (ranks of one machine); `Tcp` (ranks on several machines: `LOCAL_WORLD_SIZE < WORLD_SIZE`) | `Mpi` (feature `mpi`) |
//! | `cuda[:N]` | `ThreadsOnGpu`: `--world-size` threads on one GPU (feature `cuda`) | `Nccl`, unique id over the TCP store at `MASTER_ADDR:MASTER_PORT` (feature `nccl`) | `Nccl`, unique id over MPI (features `nccl`, `mpi`), else over the store if `MASTER_ADDR`/`MASTER_PORT` are set |
//!
//! The GPU of a process: `cuda:N` if given; else `LOCAL_RANK` (torchrun-style), or
//! `OMPI_COMM_WORLD_LOCAL_RANK` / `MPI_LOCALRANKID` (under `mpirun`), else 0. NCCL refuses two
//! ranks on one GPU, so `cuda:N` with several processes on a machine is an error naming the
//! way out.

pub mod env;

/// The bootstrap protocol over a key-value store, now [`crate::comm::bootstrap`] (re-exported
/// here so that `candle_fsdp::launch::bootstrap` keeps working).
pub use crate::comm::bootstrap;
/// The TCP key-value store, now [`crate::comm::store`] (re-exported here so that
/// `candle_fsdp::launch::store` keeps working).
pub use crate::comm::store;

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use crate::comm::threads::{run_ranks, ThreadGroupConfig};
use crate::comm::{collect_rank_results, ProcessGroup};
use crate::device::DeviceSpec;
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
    /// `world_size` ranks as threads of this process sharing GPU `gpu`, each with a Candle
    /// device of its own, on the thread backend on CUDA tensors
    /// ([`crate::comm::threads::new_group_on_gpu`]); build it with [`Launcher::threads_on_gpu`].
    #[cfg(feature = "cuda")]
    ThreadsOnGpu {
        /// Number of ranks (at most [`crate::comm::threads::MAX_CUDA_RANKS`]).
        world_size: usize,
        /// The GPU's ordinal.
        gpu: usize,
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
    /// This process's rank of a job of CPU processes on one machine started torchrun-style
    /// (`fsdp-run`, `torchrun`), on the shared-memory backend ([`crate::comm::shm`]), which
    /// meets its peers through the TCP store at `addr:port`; [`Launcher::for_device`] builds it
    /// from the environment.
    Shm {
        /// This process's rank.
        rank: usize,
        /// Number of processes of the job.
        world_size: usize,
        /// `MASTER_ADDR` (leaked once per launcher so that the launcher stays `Copy`).
        addr: &'static str,
        /// `MASTER_PORT`.
        port: u16,
        /// Group configuration (collective timeout).
        config: crate::comm::shm::ShmConfig,
    },
    /// This process's rank of a job of CPU processes on several machines started
    /// torchrun-style (`fsdp-run --nnodes N`, `torchrun`; `LOCAL_WORLD_SIZE < WORLD_SIZE`), on
    /// the TCP backend ([`crate::comm::tcp`]), which meets its peers through the TCP store at
    /// `addr:port`; [`Launcher::for_device`] builds it from the environment.
    Tcp {
        /// This process's rank.
        rank: usize,
        /// Number of processes of the job.
        world_size: usize,
        /// `MASTER_ADDR` (leaked once per launcher so that the launcher stays `Copy`).
        addr: &'static str,
        /// `MASTER_PORT`.
        port: u16,
        /// Group configuration (collective timeout).
        config: crate::comm::tcp::TcpConfig,
    },
    /// This process's rank of a job of one process per GPU (started torchrun-style or by
    /// `mpirun`), on the NCCL backend ([`crate::comm::nccl`]); [`Launcher::for_device`] builds
    /// it from the environment.
    #[cfg(feature = "nccl")]
    Nccl {
        /// This process's rank.
        rank: usize,
        /// Number of processes of the job.
        world_size: usize,
        /// This process's GPU.
        gpu: usize,
        /// How the unique id reaches every rank.
        bootstrap: crate::comm::nccl::NcclBootstrap,
        /// Group configuration (watchdog timeout).
        config: crate::comm::nccl::NcclConfig,
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

    /// `world_size` thread ranks sharing GPU `gpu`, with the default configuration.
    #[cfg(feature = "cuda")]
    pub fn threads_on_gpu(world_size: usize, gpu: usize) -> Launcher {
        Launcher::ThreadsOnGpu {
            world_size,
            gpu,
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

    /// The CPU launcher for how this process was started ([`LaunchEnv::detect`]): `mpirun`
    /// gives `Launcher::Mpi` (feature `mpi`), a torchrun-style start (`fsdp-run`, `torchrun`)
    /// gives [`Launcher::Shm`], a plain start gives [`Launcher::Threads`] with `requested`
    /// ranks (or `default_threads`). `timeout` is the collective timeout.
    ///
    /// Errors: invalid launcher variables; `requested` disagrees with the launcher's world size;
    /// started by `mpirun` in a build without the `mpi` feature; started torchrun-style
    /// without `MASTER_ADDR`/`MASTER_PORT` (see [`Launcher::for_device`]);
    /// MPI fails to start.
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
            LaunchEnv::Torchrun(t) => shm_launcher(&t, timeout),
        }
    }

    /// The launcher for the examples' `--device` and how this process was started (see the
    /// [module docs](self) for the table): [`Launcher::for_device_with`] over this process's
    /// environment.
    ///
    /// Errors: see [`Launcher::for_device_with`].
    pub fn for_device(
        device: DeviceSpec,
        env: &LaunchEnv,
        requested: Option<usize>,
        default_threads: usize,
        timeout: Duration,
    ) -> Result<Launcher> {
        Launcher::for_device_with(device, env, requested, default_threads, timeout, &|v| {
            std::env::var(v).ok()
        })
    }

    /// The launcher for `device` in a process started as `env`, with `requested` ranks
    /// (`--world-size`) or `default_threads` for a plain start; `timeout` is the collective
    /// timeout; `get` reads the variables `env` does not carry (the local rank under `mpirun`,
    /// `MASTER_ADDR`/`MASTER_PORT` for a store bootstrap under `mpirun`, `LOCAL_RANK` for a
    /// plain start). Only `--device cpu` under `mpirun` has a side effect: it initialises MPI.
    ///
    /// Errors ([`Error::Conflict`], [`Error::Env`], [`Error::Missing`], each naming the way out): `requested` disagrees
    /// with the launcher; `--device cpu` under a torchrun-style launch of several ranks without
    /// `MASTER_ADDR`/`MASTER_PORT`; `--device cuda` in a
    /// build without `cuda`, or one process per GPU without `nccl` (or under `mpirun` without
    /// `mpi` nor `MASTER_ADDR`/`MASTER_PORT`); `cuda:N` with several processes on the machine
    /// (NCCL refuses two ranks on one GPU); a torchrun-style job of several ranks without
    /// `MASTER_ADDR`/`MASTER_PORT`; more thread ranks on one GPU than the backend runs; a local
    /// rank variable that is not an integer, or none under `mpirun` with several processes on
    /// the machine.
    pub fn for_device_with(
        device: DeviceSpec,
        env: &LaunchEnv,
        requested: Option<usize>,
        default_threads: usize,
        timeout: Duration,
        get: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Launcher> {
        let world_size = env.world_size_for(requested, default_threads)?;
        let gpu = match device {
            DeviceSpec::Cpu => {
                return match env {
                    LaunchEnv::Local => Ok(Launcher::Threads {
                        world_size,
                        config: ThreadGroupConfig { timeout },
                    }),
                    LaunchEnv::Mpi(m) => Launcher::from_mpi_env(m, timeout),
                    LaunchEnv::Torchrun(t) => shm_launcher(t, timeout),
                }
            }
            DeviceSpec::Cuda(n) => n,
        };
        let spec = device.to_string();
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (gpu, get);
            Err(no_gpu_path(&spec))
        }
        #[cfg(feature = "cuda")]
        match env {
            LaunchEnv::Local => {
                let gpu = match gpu {
                    Some(n) => n,
                    None => local_rank_from(get, &["LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"])?
                        .unwrap_or(0),
                };
                gpu_threads_launcher(&spec, world_size, gpu, timeout)
            }
            LaunchEnv::Torchrun(t) => {
                let how = format!(
                    "torchrun-style (RANK={}, WORLD_SIZE={})",
                    t.rank, t.world_size
                );
                need_nccl(&spec, &how)?;
                let gpu = one_rank_per_gpu(&spec, gpu, t.local_world_size, "LOCAL_WORLD_SIZE")?
                    .unwrap_or(t.local_rank);
                let store = match (&t.master_addr, t.master_port) {
                    (Some(addr), Some(port)) => Some((addr.clone(), port)),
                    _ => None,
                };
                if store.is_none() && t.world_size > 1 {
                    return Err(Error::conflict(&how, format!("--device {spec} but MASTER_ADDR and MASTER_PORT are not both set"), "the NCCL unique id travels through the TCP store rank 0 serves there (fsdp-run and torchrun set both)"));
                }
                nccl_launcher(
                    &spec,
                    &how,
                    t.rank,
                    t.world_size,
                    gpu,
                    store,
                    false,
                    timeout,
                )
            }
            LaunchEnv::Mpi(m) => {
                let how = format!("by mpirun (rank {} of {})", m.rank, m.world_size);
                need_nccl(&spec, &how)?;
                let gpu = match one_rank_per_gpu(&spec, gpu, m.local_size, "the mpirun local size")?
                {
                    Some(n) => n,
                    None => match local_rank_from(
                        get,
                        &[
                            "OMPI_COMM_WORLD_LOCAL_RANK",
                            "MPI_LOCALRANKID",
                            "LOCAL_RANK",
                        ],
                    )? {
                        Some(n) => n,
                        None if m.local_size == 1 => 0,
                        None => {
                            return Err(Error::missing("local rank variable (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, LOCAL_RANK)", format!("started by mpirun with {} processes on this machine and --device {spec}, one says which GPU this process uses: set LOCAL_RANK", m.local_size)))
                        }
                    },
                };
                let store = master_from(get)?;
                nccl_launcher(&spec, &how, m.rank, m.world_size, gpu, store, true, timeout)
            }
        }
    }

    #[cfg(feature = "mpi")]
    fn from_mpi_env(m: &MpiEnv, timeout: Duration) -> Result<Launcher> {
        let launcher = Launcher::mpi(crate::comm::mpi::MpiConfig { timeout })?;
        if launcher.world_size() != m.world_size {
            return Err(Error::shape(
                "MPI's world size",
                format!("{} (the launcher's {})", m.world_size, m.source),
                launcher.world_size(),
            ));
        }
        Ok(launcher)
    }

    #[cfg(not(feature = "mpi"))]
    fn from_mpi_env(m: &MpiEnv, _timeout: Duration) -> Result<Launcher> {
        Err(Error::conflict(
            format!(
                "this process was started by mpirun ({}={})",
                m.source, m.world_size
            ),
            "this build",
            "candle-fsdp was built without the `mpi` feature: rebuild with `--features mpi`",
        ))
    }

    /// Number of ranks of the job.
    pub fn world_size(&self) -> usize {
        match self {
            Launcher::Threads { world_size, .. } => *world_size,
            #[cfg(feature = "cuda")]
            Launcher::ThreadsOnGpu { world_size, .. } => *world_size,
            #[cfg(feature = "mpi")]
            Launcher::Mpi { world_size, .. } => *world_size,
            Launcher::Shm { world_size, .. } => *world_size,
            Launcher::Tcp { world_size, .. } => *world_size,
            #[cfg(feature = "nccl")]
            Launcher::Nccl { world_size, .. } => *world_size,
        }
    }

    /// Backend name of the groups it hands out (`"threads"`, `"shm"`, `"mpi"`, `"nccl"`).
    pub fn backend(&self) -> &'static str {
        match self {
            Launcher::Threads { .. } => "threads",
            #[cfg(feature = "cuda")]
            Launcher::ThreadsOnGpu { .. } => "threads",
            #[cfg(feature = "mpi")]
            Launcher::Mpi { .. } => "mpi",
            Launcher::Shm { .. } => "shm",
            Launcher::Tcp { .. } => "tcp",
            #[cfg(feature = "nccl")]
            Launcher::Nccl { .. } => "nccl",
        }
    }

    /// The GPU the ranks of this process use (`None`: the CPU).
    pub fn gpu(&self) -> Option<usize> {
        match self {
            Launcher::Threads { .. } => None,
            #[cfg(feature = "cuda")]
            Launcher::ThreadsOnGpu { gpu, .. } => Some(*gpu),
            #[cfg(feature = "mpi")]
            Launcher::Mpi { .. } => None,
            Launcher::Shm { .. } => None,
            Launcher::Tcp { .. } => None,
            #[cfg(feature = "nccl")]
            Launcher::Nccl { gpu, .. } => Some(*gpu),
        }
    }

    /// The ranks this process runs, whose results [`Launcher::run`] returns (in this order):
    /// all of them for the thread launchers.
    pub fn local_ranks(&self) -> Range<usize> {
        match self {
            Launcher::Threads { world_size, .. } => 0..*world_size,
            #[cfg(feature = "cuda")]
            Launcher::ThreadsOnGpu { world_size, .. } => 0..*world_size,
            #[cfg(feature = "mpi")]
            Launcher::Mpi { rank, .. } => *rank..*rank + 1,
            Launcher::Shm { rank, .. } => *rank..*rank + 1,
            Launcher::Tcp { rank, .. } => *rank..*rank + 1,
            #[cfg(feature = "nccl")]
            Launcher::Nccl { rank, .. } => *rank..*rank + 1,
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
            #[cfg(feature = "cuda")]
            Launcher::ThreadsOnGpu {
                world_size,
                gpu,
                config,
            } => crate::comm::threads::run_ranks_on_gpu(world_size, config, gpu, f),
            #[cfg(feature = "mpi")]
            Launcher::Mpi { config, .. } => crate::comm::mpi::run(config, f),
            Launcher::Shm {
                rank,
                world_size,
                addr,
                port,
                config,
            } => crate::comm::shm::run(rank, world_size, addr, port, config, f),
            Launcher::Tcp {
                rank,
                world_size,
                addr,
                port,
                config,
            } => crate::comm::tcp::run(rank, world_size, addr, port, config, f),
            #[cfg(feature = "nccl")]
            Launcher::Nccl {
                rank,
                world_size,
                gpu,
                bootstrap,
                config,
            } => crate::comm::nccl::run(rank, world_size, gpu, bootstrap, config, f),
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

/// The launcher of a CPU process started torchrun-style: [`Launcher::Shm`] when every rank
/// runs on this machine, [`Launcher::Tcp`] when the ranks span machines
/// (`LOCAL_WORLD_SIZE < WORLD_SIZE`, e.g. `fsdp-run --nnodes N`).
///
/// Errors: several ranks without `MASTER_ADDR` and `MASTER_PORT`.
fn shm_launcher(t: &TorchrunEnv, timeout: Duration) -> Result<Launcher> {
    let (addr, port) = match (&t.master_addr, t.master_port) {
        (Some(addr), Some(port)) => (addr.trim().to_string(), port),
        _ if t.world_size == 1 => (String::new(), 1),
        _ => {
            return Err(Error::conflict(format!("this process was started torchrun-style (RANK={}, WORLD_SIZE={})", t.rank, t.world_size), "--device cpu but MASTER_ADDR and MASTER_PORT are not both set", "the processes meet through the TCP store rank 0 serves there (fsdp-run and torchrun set both)"))
        }
    };
    let addr: &'static str = Box::leak(addr.into_boxed_str());
    if t.local_world_size < t.world_size {
        return Ok(Launcher::Tcp {
            rank: t.rank,
            world_size: t.world_size,
            addr,
            port,
            config: crate::comm::tcp::TcpConfig { timeout },
        });
    }
    Ok(Launcher::Shm {
        rank: t.rank,
        world_size: t.world_size,
        addr,
        port,
        config: crate::comm::shm::ShmConfig { timeout },
    })
}

/// The first of `vars` that is set, as a GPU ordinal.
#[cfg(feature = "cuda")]
fn local_rank_from(get: &dyn Fn(&str) -> Option<String>, vars: &[&str]) -> Result<Option<usize>> {
    for var in vars {
        if let Some(v) = get(var).filter(|v| !v.trim().is_empty()) {
            return v.trim().parse().map(Some).map_err(|_| {
                Error::env(
                    var,
                    format!("{v:?}"),
                    "is not a non-negative integer (the GPU of this process)",
                )
            });
        }
    }
    Ok(None)
}

/// `gpu` (an explicit `cuda:N`), refused when `local` processes share the machine: NCCL runs
/// one rank per GPU.
#[cfg(feature = "cuda")]
fn one_rank_per_gpu(
    spec: &str,
    gpu: Option<usize>,
    local: usize,
    local_name: &str,
) -> Result<Option<usize>> {
    match gpu {
        // The wording is pinned by tests/comm/gpu_comm_host.rs.
        Some(n) if local > 1 => Err(Error::InvalidArgument(format!(
            "--device {spec} puts the {local} processes of this machine ({local_name} = {local}) \
             on GPU {n}, but NCCL refuses two ranks on one GPU: use --device cuda (each process \
             takes the GPU of its local rank), or run the ranks as threads of one process \
             sharing the GPU (no launcher, --world-size {local})"
        ))),
        other => Ok(other),
    }
}

/// `MASTER_ADDR` and `MASTER_PORT` through `get`, when both are set.
#[cfg(feature = "cuda")]
fn master_from(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<(String, u16)>> {
    let addr = get("MASTER_ADDR").filter(|v| !v.trim().is_empty());
    let port = get("MASTER_PORT").filter(|v| !v.trim().is_empty());
    match (addr, port) {
        (Some(addr), Some(port)) => match port.trim().parse::<u16>() {
            Ok(p) if p > 0 => Ok(Some((addr.trim().to_string(), p))),
            _ => Err(Error::env(
                "MASTER_PORT",
                format!("{port:?}"),
                "is not a TCP port (1..=65535)",
            )),
        },
        _ => Ok(None),
    }
}

/// The thread launcher on GPU `gpu` (feature `cuda`).
#[cfg(feature = "cuda")]
fn gpu_threads_launcher(
    spec: &str,
    world_size: usize,
    gpu: usize,
    timeout: Duration,
) -> Result<Launcher> {
    let max = crate::comm::threads::MAX_CUDA_RANKS;
    if world_size == 0 || world_size > max {
        return Err(Error::conflict(
            format!("--device {spec}"),
            format!("--world-size {world_size}"),
            format!("the ranks of one process share the GPU as threads, 1 to {max} of them"),
        ));
    }
    Ok(Launcher::ThreadsOnGpu {
        world_size,
        gpu,
        config: ThreadGroupConfig { timeout },
    })
}

#[cfg(not(feature = "cuda"))]
fn no_gpu_path(spec: &str) -> Error {
    Error::InvalidArgument(format!(
        "--device {spec}: this build has no GPU path; rebuild with `--features cuda` (ranks as \
         threads on one GPU) or `--features nccl` (one process per GPU); see README, \"The GPU \
         path\""
    ))
}

/// The NCCL launcher of rank `rank` of `world_size` on GPU `gpu`, its unique id made locally
/// (one rank), over MPI (`under_mpi`, feature `mpi`), or over the store at `store`.
#[cfg(feature = "nccl")]
#[allow(clippy::too_many_arguments)]
fn nccl_launcher(
    _spec: &str,
    how: &str,
    rank: usize,
    world_size: usize,
    gpu: usize,
    store: Option<(String, u16)>,
    under_mpi: bool,
    timeout: Duration,
) -> Result<Launcher> {
    use crate::comm::nccl::{NcclBootstrap, NcclConfig};
    let bootstrap = if world_size == 1 {
        NcclBootstrap::Single
    } else if let Some(b) = under_mpi.then(mpi_bootstrap).flatten() {
        b
    } else if let Some((addr, port)) = store {
        // Leaked once per launcher (a few bytes) so that the launcher stays `Copy`.
        let addr: &'static str = Box::leak(addr.into_boxed_str());
        NcclBootstrap::Store { addr, port }
    } else {
        return Err(Error::conflict(format!("this process was started {how}"), "one GPU per process", "the NCCL unique id travels over MPI (rebuild with `--features nccl,mpi`) or through a TCP store (set MASTER_ADDR and MASTER_PORT to rank 0's host and a free port)"));
    };
    Ok(Launcher::Nccl {
        rank,
        world_size,
        gpu,
        bootstrap,
        config: NcclConfig { timeout },
    })
}

/// The MPI bootstrap, in a build that has it.
#[cfg(feature = "nccl")]
fn mpi_bootstrap() -> Option<crate::comm::nccl::NcclBootstrap> {
    #[cfg(feature = "mpi")]
    return Some(crate::comm::nccl::NcclBootstrap::Mpi);
    #[cfg(not(feature = "mpi"))]
    None
}

/// Ok when one process per GPU can run (feature `nccl`); else the error saying how to rebuild.
#[cfg(feature = "cuda")]
fn need_nccl(spec: &str, how: &str) -> Result<()> {
    if cfg!(feature = "nccl") {
        return Ok(());
    }
    Err(Error::conflict(format!("this process was started {how}"), format!("--device {spec}"), "one process per GPU needs the NCCL backend; rebuild with `--features nccl` (and `mpi` to bootstrap over MPI under mpirun), or run the ranks as threads sharing one GPU (no launcher, --world-size N)"))
}

/// Without NCCL, [`need_nccl`] refused before any call.
#[cfg(all(feature = "cuda", not(feature = "nccl")))]
#[allow(clippy::too_many_arguments)]
fn nccl_launcher(
    spec: &str,
    how: &str,
    _: usize,
    _: usize,
    _: usize,
    _: Option<(String, u16)>,
    _: bool,
    _: Duration,
) -> Result<Launcher> {
    need_nccl(spec, how).map(|()| unreachable!("need_nccl refuses without the `nccl` feature"))
}

/// Runs `f` on the ranks of `launcher` ([`Launcher::run`]).
pub fn launch<T, F>(launcher: &Launcher, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Arc<dyn ProcessGroup>) -> Result<T> + Send + Sync,
{
    launcher.run(f)
}
