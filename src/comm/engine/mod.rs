//! What every host backend runs on, importing no backend: the one group of the host backends
//! and its issue path ([`group`]), their stream threads ([`streams`]), the run rules of an operation
//! and of a rank ([`run`]: a panic or failure aborts the job, never leaving peers waiting; the
//! check of `new_group`'s ranks), the collectives over shared buffers ([`board`]: the thread
//! backend and shm), and the CUDA buffer helpers the thread backend's CUDA path and
//! NCCL share ([`cuda`]). A backend names this module, never another backend
//! (`scripts/check-layers.sh`).

pub(crate) mod board;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
pub(crate) mod group;
pub(crate) mod messages;
pub(crate) mod run;
pub(crate) mod streams;

pub(crate) use run::{check_ranks, panic_message, peer_failed, run_one, run_stream_op};
