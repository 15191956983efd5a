//! Fault injection for tests of failed saves (not part of the stable API).
//!
//! Armed per thread (a rank is a thread of the in-process backend), it makes checkpoint file
//! writes on that thread fail after a budget of bytes, as a full disk or a killed process would.
//! In *crash* mode the writer also skips every clean-up (temporary files and the staging
//! directory stay on disk, as after a `kill -9`).

use std::cell::Cell;

#[derive(Debug, Clone, Copy)]
struct Armed {
    remaining: u64,
    crash: bool,
}

thread_local! {
    static ARMED: Cell<Option<Armed>> = const { Cell::new(None) };
}

/// Makes checkpoint writes on the calling thread fail once `after_bytes` more bytes have been
/// written (the failing write writes the bytes that still fit, then returns an I/O error). With
/// `crash`, nothing written is cleaned up while armed. Stays armed until [`disarm`].
pub fn fail_writes_after(after_bytes: u64, crash: bool) {
    ARMED.with(|a| {
        a.set(Some(Armed {
            remaining: after_bytes,
            crash,
        }))
    });
}

/// Disarms [`fail_writes_after`] on the calling thread.
pub fn disarm() {
    ARMED.with(|a| a.set(None));
}

/// The calling thread's arming, to carry to a thread that writes for it (an asynchronous
/// save's writer): [`carry`] there.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Carried(Option<Armed>);

/// See [`Carried`].
pub(crate) fn carried() -> Carried {
    Carried(ARMED.with(|a| a.get()))
}

/// Arms the calling thread as the thread [`carried`] was taken on.
pub(crate) fn carry(c: Carried) {
    ARMED.with(|a| a.set(c.0));
}

/// Whether the calling thread simulates a crash (no clean-up).
pub(crate) fn crash_mode() -> bool {
    ARMED.with(|a| a.get().is_some_and(|a| a.crash))
}

/// How many of `len` bytes may be written now; `Err` when the budget runs out inside them.
pub(crate) fn allow(len: usize) -> Result<(), usize> {
    ARMED.with(|a| match a.get() {
        None => Ok(()),
        Some(mut armed) => {
            if (len as u64) <= armed.remaining {
                armed.remaining -= len as u64;
                a.set(Some(armed));
                Ok(())
            } else {
                let fit = armed.remaining as usize;
                armed.remaining = 0;
                a.set(Some(armed));
                Err(fit)
            }
        }
    })
}
