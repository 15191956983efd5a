//! Error type shared by every module of the crate.
//!
//! Every variant names the values involved (rank, operation, expected vs found, file), following
//! Candle's convention of errors that carry their context.

use std::path::PathBuf;
use std::time::Duration;

/// Errors raised by candle-fsdp.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Another rank failed (returned an error or panicked) while this rank had a collective
    /// pending or issued a new one afterwards.
    #[error("{op} on rank {rank} aborted: rank {failed_rank} failed: {reason}")]
    PeerFailed {
        /// Operation that was aborted on this rank, e.g. `all_gather #12 (stream all_gather)`.
        op: String,
        /// This rank.
        rank: usize,
        /// The rank that failed first.
        failed_rank: usize,
        /// What that rank reported (its error message or panic payload).
        reason: String,
    },
    /// A rank left the group (its closure returned) while the others still waited for it.
    #[error("{op} on rank {rank}: rank {departed} already exited without joining this collective")]
    PeerExited {
        /// Operation that cannot complete.
        op: String,
        /// This rank.
        rank: usize,
        /// The rank that left.
        departed: usize,
    },
    /// A collective did not complete within the process group's timeout.
    #[error("{op} on rank {rank} timed out after {timeout:?} waiting for ranks {missing:?}")]
    Timeout {
        /// Operation that timed out.
        op: String,
        /// This rank.
        rank: usize,
        /// The configured timeout.
        timeout: Duration,
        /// Ranks that had not arrived.
        missing: Vec<usize>,
    },
    /// Ranks called a collective with incompatible arguments (length, dtype, root, operation).
    #[error("{op}: rank {rank} passed {found} but rank {other_rank} passed {expected}")]
    CollectiveMismatch {
        /// Operation.
        op: String,
        /// Rank whose argument differs.
        rank: usize,
        /// What that rank passed.
        found: String,
        /// Reference rank.
        other_rank: usize,
        /// What the reference rank passed.
        expected: String,
    },
    /// A buffer of the wrong size or dtype was handed to a collective on one rank.
    #[error("{op} on rank {rank}: {what}: expected {expected}, found {found}")]
    BadBuffer {
        /// Operation.
        op: String,
        /// This rank.
        rank: usize,
        /// Which buffer.
        what: String,
        /// Expected length/dtype.
        expected: String,
        /// Found length/dtype.
        found: String,
    },
    /// Invalid configuration or argument.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A rank's closure panicked (reported by [`crate::comm::threads::run_ranks`]).
    #[error("rank {rank} panicked: {message}")]
    RankPanicked {
        /// Rank that panicked.
        rank: usize,
        /// Panic payload as text.
        message: String,
    },
    /// Error from a data or checkpoint file.
    #[error("{path}: {message}")]
    File {
        /// File involved.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// I/O error with the file it concerns. The message includes the OS error, so it is not
    /// repeated as a separate cause.
    #[error("{path}: {error}")]
    Io {
        /// File involved.
        path: PathBuf,
        /// Underlying error.
        error: std::io::Error,
    },
    /// A phase that every rank runs (e.g. loading a checkpoint) failed on other ranks; their own
    /// errors say why. [`crate::comm::threads::run_ranks_ok`] reports theirs rather than this.
    #[error("{path}: {what} failed on rank(s) {failed_ranks:?} (see their errors)")]
    PeersFailed {
        /// What failed.
        what: String,
        /// File or directory involved.
        path: PathBuf,
        /// This rank.
        rank: usize,
        /// Ranks whose phase failed.
        failed_ranks: Vec<usize>,
    },
    /// Error raised by Candle while running a unit.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl Error {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            error: source,
        }
    }

    /// A data or checkpoint file problem.
    pub fn file(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::File {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, Error>;
