//! What every host backend's operations and ranks run through: a stream operation's panic
//! turned into an error that aborts the job, a process rank's closure whose failure aborts its
//! group, the error of a peer's failure, and the rank-list check of `new_group`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use crate::comm::{Instrumented, ProcessGroup};
use crate::error::{Error, Result};

/// The text of a panic payload (`&str` or `String`), or a placeholder.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "<non-string panic payload>".to_string()
    }
}

/// [`Error::PeerFailed`]: operation `op` of rank `rank` stopped because `failed_rank` failed
/// first with `reason`.
pub(crate) fn peer_failed(
    op: impl std::fmt::Display,
    rank: usize,
    (failed_rank, reason): (usize, String),
) -> Error {
    Error::PeerFailed {
        op: op.to_string(),
        rank,
        failed_rank,
        reason,
    }
}

/// Runs the body of operation `op` of rank `rank` on its comm stream's thread: a panic in it
/// becomes [`Error::RankPanicked`] (`"{op}: {panic message}"`) after `on_panic` has been given
/// that message (the backend aborts the job with it, so peers never wait on this rank).
pub(crate) fn run_stream_op<T>(
    op: &str,
    rank: usize,
    body: impl FnOnce() -> Result<T>,
    on_panic: impl FnOnce(&str),
) -> Result<T> {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|payload| {
        let message = format!("{op}: {}", panic_message(payload.as_ref()));
        on_panic(&message);
        Err(Error::RankPanicked { rank, message })
    })
}

/// Runs `f` on rank `rank`'s group `pg`: an error or a panic aborts the group (with the
/// error's message, or `"panicked: …"`) so that peers never wait on this rank, and the rank's
/// handle is dropped before returning.
pub(crate) fn run_one<T, F>(rank: usize, pg: Arc<dyn ProcessGroup>, f: &F) -> Result<T>
where
    F: Fn(Arc<dyn ProcessGroup>) -> Result<T>,
{
    let result = match catch_unwind(AssertUnwindSafe(|| f(Arc::clone(&pg)))) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => {
            pg.abort(&e.message());
            Err(e)
        }
        Err(payload) => {
            let message = panic_message(payload.as_ref());
            pg.abort(&format!("panicked: {message}"));
            Err(Error::RankPanicked { rank, message })
        }
    };
    drop(pg);
    result
}

/// Checks the rank list of `new_group` (the same on every rank once lists agree).
pub(crate) fn check_ranks(op: &str, ranks: &[usize], world_size: usize) -> Result<()> {
    if ranks.is_empty() {
        return Err(Error::missing(
            format_args!("rank in the {op} sub-group"),
            "a sub-group needs at least one rank",
        ));
    }
    if let Some(&r) = ranks.iter().find(|&&r| r >= world_size) {
        return Err(Error::out_of_range(
            format_args!("{op}: rank"),
            r,
            "world size",
            world_size,
        ));
    }
    for (i, r) in ranks.iter().enumerate() {
        if ranks[..i].contains(r) {
            return Err(Error::value(
                format_args!("{op}: rank {r}"),
                "listed once",
                "listed twice",
            ));
        }
    }
    Ok(())
}

/// Runs `f` on this process's rank `rank` of a process-per-rank job, given the group its
/// backend connected (wrapped in [`Instrumented`]) or why it could not; returns its result
/// (one element). When `f` fails or panics, the job is aborted with the error's text.
pub(crate) fn run_process_rank<G, T, F>(rank: usize, group: Result<Arc<G>>, f: F) -> Vec<Result<T>>
where
    G: ProcessGroup + ?Sized + 'static,
    F: Fn(Arc<dyn ProcessGroup>) -> Result<T>,
{
    match group {
        Ok(group) => {
            let pg: Arc<dyn ProcessGroup> = Arc::new(Instrumented::new(group));
            vec![run_one(rank, pg, &f)]
        }
        Err(e) => vec![Err(e)],
    }
}

/// `timeout` from now; a timeout too large for the clock (e.g. `u64::MAX` seconds) means a
/// century.
pub(crate) fn deadline_after(timeout: std::time::Duration) -> std::time::Instant {
    let now = std::time::Instant::now();
    (now.checked_add(timeout))
        .unwrap_or_else(|| now + std::time::Duration::from_secs(100 * 365 * 24 * 3600))
}

/// Checks `rank` against `world_size` (`what`: the group, named in the error).
pub(crate) fn check_rank(what: &str, rank: usize, world_size: usize) -> Result<()> {
    match rank < world_size {
        true => Ok(()),
        false => Err(Error::out_of_range(
            format_args!("{what}: rank"),
            rank,
            "world size",
            world_size,
        )),
    }
}
