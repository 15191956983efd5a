//! How an NCCL group's ranks meet and hear of each other's failures: the root communicator's
//! unique id broadcast over MPI (feature `mpi`; under `fsdp-run` it comes through the store,
//! `comm::bootstrap`), and the thread that turns a peer's failure notice in the job's store
//! into this group's failure.

use std::sync::Arc;
use std::time::{Duration, Instant};

#[cfg(feature = "mpi")]
use super::raw::UniqueId;
use super::watchdog::{Failure, Family};
use crate::comm::bootstrap;
use crate::comm::store::TcpStore;
use crate::error::{Error, Result};

/// Starts the thread that waits on this rank's inbox in the job's store and fails `family`
/// on a peer's notice; gives the family the store (it publishes this rank's failures there and
/// closes the inbox, stopping the thread, when its last group handle is dropped).
pub(super) fn watch_store(family: &Arc<Family>, store: Arc<TcpStore>) -> Result<()> {
    let weak = Arc::downgrade(family);
    let watcher_store = Arc::clone(&store);
    let rank = store.rank();
    std::thread::Builder::new()
        .name(format!("nccl-notices-{rank}"))
        .spawn(move || loop {
            let started = Instant::now();
            match bootstrap::wait_notice(&*watcher_store) {
                Ok(bootstrap::Notice::Closed) => return,
                Ok(bootstrap::Notice::Failed {
                    rank: failed_rank,
                    reason,
                }) => {
                    if let Some(family) = weak.upgrade() {
                        family.fail(
                            Failure::Rank {
                                failed_rank,
                                reason,
                            },
                            false,
                        );
                    }
                    return;
                }
                Err(e) => {
                    // The store's timeout passed with no notice: wait again. An immediate error
                    // is a lost connection (rank 0's process ended): stop watching.
                    if weak.strong_count() == 0 || started.elapsed() < Duration::from_secs(1) {
                        tracing::debug!("rank {rank}: stopped watching for failure notices: {e}");
                        return;
                    }
                }
            }
        })
        .map_err(|error| Error::SpawnFailed {
            what: format!("the failure-notice watcher of rank {rank}"),
            error,
        })?;
    let _ = family.store.set(store);
    Ok(())
}

/// The root communicator's unique id, broadcast over `MPI_COMM_WORLD` from rank 0, with a
/// status byte first so that a failure of rank 0 fails every rank at once.
#[cfg(feature = "mpi")]
pub(super) fn mpi_unique_id(rank: usize, world_size: usize) -> Result<UniqueId> {
    use crate::comm::engine::peer_failed;
    use crate::comm::mpi::check;
    use mpi::ffi;
    let (mpi_rank, mpi_size) = crate::comm::mpi::world_rank_and_size()?;
    // A rank whose arguments are not MPI's still takes part in the broadcast (the others
    // would wait in it forever), then fails; MPI's rank 0 sends its own as the failure.
    let mut local_error = ((mpi_rank, mpi_size) != (rank, world_size)).then(|| {
        Error::conflict(
            format_args!("NCCL over MPI: rank {rank} of {world_size} requested"),
            format_args!("MPI's rank {mpi_rank} of {mpi_size}"),
            "the rank and world size must be MPI's",
        )
    });
    let mut msg = [0u8; 129];
    if mpi_rank == 0 {
        match local_error.take().map_or_else(UniqueId::new, Err) {
            Ok(id) => msg[1..].copy_from_slice(&id.0),
            Err(e) => {
                msg[0] = 1;
                let text = e.to_string();
                let text = bootstrap::cut_reason(&text, 128).as_bytes();
                msg[1..1 + text.len()].copy_from_slice(text);
                local_error = Some(e);
            }
        }
    }
    // SAFETY: MPI is initialised (world_rank_and_size above) with MPI_THREAD_MULTIPLE; `msg`
    // is a live buffer of 129 bytes on every rank; every rank of MPI_COMM_WORLD calls this
    // broadcast once, from rank 0.
    let rc = unsafe {
        ffi::MPI_Bcast(
            msg.as_mut_ptr().cast(),
            msg.len() as std::ffi::c_int,
            ffi::RSMPI_UINT8_T,
            0,
            ffi::RSMPI_COMM_WORLD,
        )
    };
    check(rc, || "MPI_Bcast (NCCL unique id)".into(), rank)?;
    // Which rank, if any, failed on its own (a non-root rank's arguments; the highest such,
    // plus one): every rank takes part, so that no rank goes on to the communicator's creation
    // while another has given up.
    let mine: u32 = local_error.as_ref().map_or(0, |_| mpi_rank as u32 + 1);
    let mut any = 0u32;
    // SAFETY: as for the broadcast; `mine` and `any` are live `u32`s on every rank and every
    // rank of MPI_COMM_WORLD calls this reduction once, after the broadcast.
    let rc = unsafe {
        ffi::MPI_Allreduce(
            std::ptr::from_ref(&mine).cast(),
            std::ptr::from_mut(&mut any).cast(),
            1,
            ffi::RSMPI_UINT32_T,
            ffi::RSMPI_MAX,
            ffi::RSMPI_COMM_WORLD,
        )
    };
    check(
        rc,
        || "MPI_Allreduce (NCCL bootstrap: any rank's argument error)".into(),
        rank,
    )?;
    if let Some(e) = local_error {
        return Err(e);
    }
    if any != 0 && msg[0] == 0 {
        let op = "bootstrap (NCCL over MPI)";
        let reason = "its rank or world size is not MPI's".to_string();
        return Err(peer_failed(op, rank, (any as usize - 1, reason)));
    }
    if msg[0] != 0 {
        let end = msg[1..].iter().position(|&b| b == 0).map_or(128, |p| p);
        let reason = String::from_utf8_lossy(&msg[1..1 + end]).into_owned();
        let op = "bootstrap (MPI_Bcast of the NCCL unique id)";
        return Err(peer_failed(op, rank, (0, reason)));
    }
    let mut id = [0u8; 128];
    id.copy_from_slice(&msg[1..]);
    Ok(UniqueId(id))
}
