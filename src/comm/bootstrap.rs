//! What a process-per-rank job exchanges through its key-value store before and while its
//! device process group runs (the NCCL backend, torchrun-style launches): the communicator's
//! unique id, shared by rank 0, and the failure notices that make a peer's failure stop every
//! rank instead of leaving them to time out.
//!
//! The protocol is independent of NCCL (it moves bytes through any [`KeyValueStore`], e.g.
//! [`TcpStore`]), so it is built and tested without a GPU:
//!
//! - **Shared value** ([`share_from_rank0`]): rank 0 makes the value and sets
//!   `key` to `[0] ++ value`; if making it fails, it sets `[1] ++ message`, so that the other
//!   ranks fail at once with rank 0's reason instead of waiting for the store's timeout. The
//!   other ranks `get` the key and check the length.
//! - **Notices** ([`Notice`]): each rank has an inbox key, [`inbox_key`]`(rank)`, that its
//!   watcher thread waits on. A rank that fails sets every *other* rank's inbox to
//!   `Failed { rank, reason }` ([`publish_failure`]); a rank that ends sets its *own* inbox to
//!   `Closed` ([`close_inbox`]), which stops its watcher. Encoding: postcard (serde).

use crate::comm::engine::peer_failed;
use crate::comm::store::TcpStore;
use crate::error::{Error, Result};

/// The operations of a key-value store the bootstrap needs ([`TcpStore`] has them).
pub trait KeyValueStore: Send + Sync {
    /// Sets `key` to `value`.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// The value of `key`, waiting until some rank sets it (or the store's timeout).
    fn get(&self, key: &str) -> Result<Vec<u8>>;
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
}

impl KeyValueStore for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        TcpStore::set(self, key, value)
    }
    fn get(&self, key: &str) -> Result<Vec<u8>> {
        TcpStore::get(self, key)
    }
    fn rank(&self) -> usize {
        TcpStore::rank(self)
    }
    fn world_size(&self) -> usize {
        TcpStore::world_size(self)
    }
}

/// Key of the NCCL unique id of a job's root communicator.
pub const UNIQUE_ID_KEY: &str = "candle-fsdp/nccl/unique-id";

/// Rank 0 makes a value with `make` and shares it under `key`; every rank returns it. The value
/// must have `len` bytes.
///
/// Errors: `make` fails (on rank 0 its own error; on the others "rank 0 could not …" with rank
/// 0's message); the store's errors (a rank or the key missing within the timeout); a value of
/// the wrong length ([`Error::Shape`] naming the key).
pub fn share_from_rank0(
    store: &dyn KeyValueStore,
    key: &str,
    len: usize,
    make: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<Vec<u8>> {
    let op = format!("bootstrap (store key {key:?})");
    let checked = || make().and_then(|v| check_len(key, &v, len).map(|()| v));
    let value = share(store, key, op, checked)?;
    check_len(key, &value, len)?;
    Ok(value)
}

/// Rank 0 makes a value with `make` and [`publish`]es it under `key`; the other ranks read it
/// ([`read_published`]: rank 0's error fails their operation `op`).
pub(crate) fn share(
    store: &dyn KeyValueStore,
    key: &str,
    op: impl std::fmt::Display,
    make: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<Vec<u8>> {
    if store.rank() != 0 {
        return read_published(store, key, 0, op);
    }
    let made = make();
    publish(store, key, made.as_ref())?;
    made
}

/// Sets `key` to `[0] ++ value` when `made` is a value, else to `[1] ++` its error's text (best
/// effort: the readers then fail at once instead of at the store's timeout).
pub(crate) fn publish(
    store: &dyn KeyValueStore,
    key: &str,
    made: std::result::Result<impl AsRef<[u8]>, impl std::fmt::Display>,
) -> Result<()> {
    match made {
        Ok(value) => store.set(key, &[&[0u8][..], value.as_ref()].concat()),
        Err(e) => {
            let _ = store.set(key, &[&[1u8][..], e.to_string().as_bytes()].concat());
            Ok(())
        }
    }
}

/// The value rank `from` set under `key` with [`publish`]; its error's text makes
/// [`Error::PeerFailed`] (operation `op` of this rank).
pub(crate) fn read_published(
    store: &dyn KeyValueStore,
    key: &str,
    from: usize,
    op: impl std::fmt::Display,
) -> Result<Vec<u8>> {
    let mut msg = store.get(key)?;
    match msg.first() {
        Some(0) => {
            msg.remove(0);
            Ok(msg)
        }
        Some(1) => {
            let reason = String::from_utf8_lossy(&msg[1..]).into_owned();
            Err(peer_failed(op, store.rank(), (from, reason)))
        }
        _ => Err(Error::value(
            format_args!("store key {key:?}"),
            "a value of this version of candle-fsdp",
            "another value (another version's or program's store?)",
        )),
    }
}

fn check_len(key: &str, value: &[u8], len: usize) -> Result<()> {
    if value.len() != len {
        return Err(Error::shape(
            format_args!("store key {key:?}"),
            format_args!("{len} bytes"),
            value.len(),
        ));
    }
    Ok(())
}

/// A message in a rank's inbox.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Notice {
    /// The rank itself ended normally: its watcher stops.
    Closed,
    /// Rank `rank` (of the root group) failed with `reason`.
    Failed {
        /// The failed rank.
        rank: usize,
        /// Its error message.
        reason: String,
    },
}

impl Notice {
    /// The bytes stored in an inbox.
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).expect("a notice always encodes")
    }

    /// Parses an inbox value.
    ///
    /// Errors: not a notice ([`Error::Value`] naming what was found).
    pub fn decode(bytes: &[u8]) -> Result<Notice> {
        match postcard::take_from_bytes(bytes) {
            Ok((notice, [])) => Ok(notice),
            _ => Err(Error::value(
                "an inbox value",
                "a notice (`Closed`, or `Failed` with the rank and the reason, in postcard)",
                format_args!(
                    "{:?}, not a failure notice",
                    String::from_utf8_lossy(&bytes[..bytes.len().min(64)])
                ),
            )),
        }
    }
}

/// Longest reason a notice carries, in bytes (longer ones are cut at a character boundary).
pub const MAX_REASON_BYTES: usize = 4096;

/// `reason` cut to at most `max` bytes, at a character boundary.
pub(crate) fn cut_reason(reason: &str, max: usize) -> &str {
    let mut cut = reason.len().min(max);
    while !reason.is_char_boundary(cut) {
        cut -= 1;
    }
    &reason[..cut]
}

/// The inbox key of `rank`.
pub fn inbox_key(rank: usize) -> String {
    format!("candle-fsdp/notice/{rank}")
}

/// Tells every rank but `failed_rank` that it failed with `reason`.
///
/// Errors: the store's (the first one; every inbox is still attempted).
pub fn publish_failure(store: &dyn KeyValueStore, failed_rank: usize, reason: &str) -> Result<()> {
    let msg = Notice::Failed {
        rank: failed_rank,
        reason: cut_reason(reason, MAX_REASON_BYTES).to_string(),
    }
    .encode();
    let mut first = None;
    for r in (0..store.world_size()).filter(|&r| r != failed_rank) {
        if let Err(e) = store.set(&inbox_key(r), &msg) {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

/// Puts `Closed` in this rank's own inbox (its watcher stops).
///
/// Errors: the store's.
pub fn close_inbox(store: &dyn KeyValueStore) -> Result<()> {
    store.set(&inbox_key(store.rank()), &Notice::Closed.encode())
}

/// Waits for a notice in this rank's inbox (up to the store's timeout).
///
/// Errors: the store's (the timeout, a lost connection); a malformed value.
pub fn wait_notice(store: &dyn KeyValueStore) -> Result<Notice> {
    Notice::decode(&store.get(&inbox_key(store.rank()))?)
}
