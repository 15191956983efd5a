//! The shared segments of the shared-memory backend: one file per rank and communicator in
//! `/dev/shm` (a header, then the data area the rank copies its buffers into), the peers'
//! mappings of it, the job's abort slot, and the polling wait every barrier uses.
//!
//! Files are created with `O_EXCL` and mode 0600, mapped shared, and unlinked as soon as every
//! rank has mapped them (the mappings stay valid; nothing is left behind in `/dev/shm` even
//! when a process is killed). A rank grows its own data area when a collective needs more
//! (`posix_fallocate` first, so that a full `/dev/shm` is an error naming it, not a `SIGBUS`);
//! peers see the new capacity in the header and map the file again.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};

use crate::alloc::shared::ArenaId;
use crate::error::{Error, Result};

/// Bytes of a segment's header (the data area starts here, page aligned).
pub(super) const HEADER_BYTES: usize = 16 << 10;
/// Longest descriptor a rank posts (a collective's, or a setup operation's with its argument).
pub(super) const DESC_MAX: usize = 7 << 10;
/// Data capacity a segment starts with.
const INITIAL_CAPACITY: usize = 1 << 20;

// Header words (byte offsets).
const ARRIVALS: usize = 0;
const DEPARTED: usize = 8;
const PID: usize = 16;
const CAPACITY: usize = 24;
/// Where this rank's buffer of the current collective is: 0 in the data area, `1 + offset` in
/// its arena (read in place).
const DATA_AT: usize = 32;
/// The rank's arena: `1 + fd` (0: none), and its length.
const ARENA_FD: usize = 40;
const ARENA_LEN: usize = 48;
/// The arena file's `st_dev` and `st_ino` (checked by the peers that open it).
const ARENA_DEV: usize = 80;
const ARENA_INO: usize = 88;
const DESC_LEN: usize = 64;
const DESC: usize = 128;

/// The directory segments live in: `/dev/shm` where it exists, else the temporary directory.
pub(super) fn shm_dir() -> PathBuf {
    let dev_shm = Path::new("/dev/shm");
    if dev_shm.is_dir() {
        dev_shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

fn io_error(what: &str, path: &Path, e: std::io::Error) -> Error {
    Error::InvalidArgument(format!(
        "shared-memory backend: {what} {}: {e}",
        path.display()
    ))
}

/// The atomic word at `off` of the header at `base`.
///
/// # Safety
///
/// `base` is the start of a live mapping of at least [`HEADER_BYTES`] bytes, 8-byte aligned.
unsafe fn word<'a>(base: *mut u8, off: usize) -> &'a AtomicU64 {
    // SAFETY: per the contract; mapped memory is shared, so it is only accessed atomically here.
    unsafe { AtomicU64::from_ptr(base.add(off) as *mut u64) }
}

/// Reserves `bytes` of `file` (so that a full file system is an error now, not a `SIGBUS`).
fn reserve(file: &File, path: &Path, bytes: usize) -> Result<()> {
    file.set_len(bytes as u64)
        .map_err(|e| io_error("cannot size", path, e))?;
    // SAFETY: plain syscall on an open descriptor.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, bytes as libc::off_t) };
    if rc != 0 && rc != libc::EOPNOTSUPP && rc != libc::EINVAL {
        return Err(Error::InvalidArgument(format!(
            "shared-memory backend: cannot reserve {} MiB in {} ({}): is the shared-memory file \
             system full? (`df -h {}`)",
            bytes >> 20,
            path.display(),
            std::io::Error::from_raw_os_error(rc),
            shm_dir().display()
        )));
    }
    Ok(())
}

fn map(file: &File, path: &Path, len: usize) -> Result<MmapRaw> {
    MmapOptions::new()
        .len(len)
        .map_raw(file)
        .map_err(|e| io_error("cannot map", path, e))
}

/// Opens the existing file at `path` for reading and writing (`what` names it in the error).
fn open(path: &Path, what: &str) -> Result<File> {
    (OpenOptions::new().read(true).write(true).open(path)).map_err(|e| io_error(what, path, e))
}

/// Creates the file at `path` (which must not exist; mode 0600), reserves `bytes` in it and
/// maps them; on a failure after the file exists, removes it.
fn create_mapped(path: &Path, bytes: usize) -> Result<(File, MmapRaw)> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| io_error("cannot create", path, e))?;
    let mapped = reserve(&file, path, bytes).and_then(|()| map(&file, path, bytes));
    match mapped {
        Ok(map) => Ok((file, map)),
        Err(e) => {
            let _ = std::fs::remove_file(path);
            Err(e)
        }
    }
}

/// This rank's segment of one communicator (its data area is what is mapped past the header).
pub(super) struct Segment {
    file: File,
    map: MmapRaw,
    path: PathBuf,
}

impl Segment {
    /// Creates the file at `path` (which must not exist) with the initial capacity, and writes
    /// this process's id into the header.
    pub(super) fn create(path: PathBuf) -> Result<Segment> {
        let (file, map) = create_mapped(&path, HEADER_BYTES + INITIAL_CAPACITY)?;
        let seg = Segment { file, map, path };
        let header = seg.header();
        (header.word(PID)).store(u64::from(std::process::id()), Ordering::Relaxed);
        (header.word(CAPACITY)).store(INITIAL_CAPACITY as u64, Ordering::Release);
        Ok(seg)
    }

    /// Removes the file (every peer has mapped it: the mappings stay valid).
    pub(super) fn unlink(&self) {
        let _ = std::fs::remove_file(&self.path);
    }

    /// The header.
    pub(super) fn header(&self) -> Header {
        Header(self.map.as_mut_ptr())
    }

    /// The data area's address.
    pub(super) fn data(&self) -> *mut u8 {
        // In bounds: the mapping is HEADER_BYTES + capacity long.
        self.map.as_mut_ptr().wrapping_add(HEADER_BYTES)
    }

    /// Grows the data area to hold `bytes` (published to peers with the next arrival).
    ///
    /// Only between collectives of this communicator: peers finished reading the old area.
    pub(super) fn ensure(&mut self, bytes: usize) -> Result<()> {
        let capacity = self.map.len() - HEADER_BYTES;
        if bytes <= capacity {
            return Ok(());
        }
        let capacity = bytes.max(2 * capacity).next_multiple_of(1 << 20);
        reserve(&self.file, &self.path, HEADER_BYTES + capacity)?;
        self.map = map(&self.file, &self.path, HEADER_BYTES + capacity)?;
        (self.header().word(CAPACITY)).store(capacity as u64, Ordering::Release);
        Ok(())
    }
}

/// A segment dropped before every peer mapped it (a setup that failed half-way: a peer died, a
/// store barrier failed) takes its file with it; otherwise the file is gone already.
impl Drop for Segment {
    fn drop(&mut self) {
        self.unlink();
    }
}

/// A peer's segment as this rank maps it.
pub(super) struct PeerMap {
    file: File,
    map: MmapRaw,
    path: PathBuf,
    /// The peer's process id (from its header).
    pub pid: u32,
}

impl PeerMap {
    /// Maps the peer's file at `path`.
    ///
    /// Errors: the file is missing (the peer runs on another machine, or failed before
    /// creating it) or cannot be mapped.
    pub(super) fn open(path: PathBuf) -> Result<PeerMap> {
        let file = open(&path, "cannot open a peer's segment")?;
        let len = file
            .metadata()
            .map_err(|e| io_error("cannot read the size of", &path, e))?
            .len() as usize;
        if len < HEADER_BYTES {
            return Err(Error::InvalidArgument(format!(
                "shared-memory backend: {} is {len} bytes, not a segment",
                path.display()
            )));
        }
        let map = map(&file, &path, len)?;
        let pid = Header(map.as_mut_ptr()).word(PID).load(Ordering::Relaxed) as u32;
        Ok(PeerMap {
            file,
            map,
            path,
            pid,
        })
    }

    /// Maps the file again if the peer grew its data area.
    pub(super) fn refresh(&mut self) -> Result<()> {
        let capacity = self.header().word(CAPACITY).load(Ordering::Acquire) as usize;
        if HEADER_BYTES + capacity > self.map.len() {
            self.map = map(&self.file, &self.path, HEADER_BYTES + capacity)?;
        }
        Ok(())
    }

    /// Bytes of the data area mapped here.
    pub(super) fn data_len(&self) -> usize {
        self.map.len() - HEADER_BYTES
    }

    pub(super) fn header(&self) -> Header {
        Header(self.map.as_mut_ptr())
    }

    pub(super) fn data(&self) -> *mut u8 {
        self.map.as_mut_ptr().wrapping_add(HEADER_BYTES)
    }
}

/// The header words and descriptor slots of one rank's segment, wherever it is mapped.
#[derive(Clone, Copy)]
pub(super) struct Header(pub *mut u8);

impl Header {
    fn word(&self, off: usize) -> &AtomicU64 {
        // SAFETY: every Header is built from a live mapping of at least HEADER_BYTES.
        unsafe { word(self.0, off) }
    }

    /// The barrier generation the rank reached.
    pub(super) fn arrivals(&self) -> u64 {
        self.word(ARRIVALS).load(Ordering::Acquire)
    }

    /// Publishes arrival at `generation` (everything written before is visible to peers that
    /// see it).
    pub(super) fn arrive(&self, generation: u64) {
        self.word(ARRIVALS).store(generation, Ordering::Release);
    }

    /// True once the rank's handle on the group was dropped.
    pub(super) fn departed(&self) -> bool {
        self.word(DEPARTED).load(Ordering::Acquire) != 0
    }

    pub(super) fn set_departed(&self) {
        self.word(DEPARTED).store(1, Ordering::Release);
    }

    /// Says where this rank's buffer is for the collective it is about to arrive at: `Some`
    /// offset in its arena, `None` in its data area (before [`Header::arrive`]).
    pub(super) fn set_data_at(&self, at: Option<usize>) {
        self.word(DATA_AT)
            .store(at.map_or(0, |off| off as u64 + 1), Ordering::Relaxed);
    }

    /// Where the rank's buffer is (after seeing its arrival): see [`Header::set_data_at`].
    pub(super) fn data_at(&self) -> Option<usize> {
        (self.word(DATA_AT).load(Ordering::Relaxed) as usize).checked_sub(1)
    }

    /// Publishes this rank's arena (before the first barrier its peers map after).
    pub(super) fn set_arena(&self, arena: Option<ArenaId>) {
        let (fd, len) = arena.map_or((0, 0), |a| (a.fd as u64 + 1, a.len as u64));
        let (dev, ino) = arena.map_or((0, 0), |a| (a.dev, a.ino));
        self.word(ARENA_LEN).store(len, Ordering::Relaxed);
        self.word(ARENA_DEV).store(dev, Ordering::Relaxed);
        self.word(ARENA_INO).store(ino, Ordering::Relaxed);
        self.word(ARENA_FD).store(fd, Ordering::Release);
    }

    /// The rank's arena, if it published one.
    pub(super) fn arena(&self) -> Option<ArenaId> {
        let fd = self.word(ARENA_FD).load(Ordering::Acquire).checked_sub(1)?;
        Some(ArenaId {
            fd: fd as i32,
            len: self.word(ARENA_LEN).load(Ordering::Relaxed) as usize,
            dev: self.word(ARENA_DEV).load(Ordering::Relaxed),
            ino: self.word(ARENA_INO).load(Ordering::Relaxed),
        })
    }

    /// The descriptor slot of `generation`'s parity: its first byte and its length word.
    fn desc_slot(&self, generation: u64) -> (*mut u8, &AtomicU64) {
        let parity = (generation % 2) as usize;
        let at = self.0.wrapping_add(DESC + parity * DESC_MAX);
        (at, self.word(DESC_LEN + 8 * parity))
    }

    /// Writes `desc` into the slot of `generation`'s parity (before [`Header::arrive`]).
    pub(super) fn write_desc(&self, generation: u64, desc: &[u8]) {
        let (at, len) = self.desc_slot(generation);
        assert!(desc.len() <= DESC_MAX, "descriptor checked by the caller");
        // SAFETY: the slot lies in the header; only this rank writes it, and peers read it only
        // after seeing the arrival that follows (double-buffered by parity, as the thread
        // backend's posts: a peer reads slot `g % 2` before arriving at `g + 1`, and this rank
        // reaches `g + 2` only after that).
        unsafe { std::ptr::copy_nonoverlapping(desc.as_ptr(), at, desc.len()) };
        len.store(desc.len() as u64, Ordering::Relaxed);
    }

    /// A copy of the descriptor of `generation` (after seeing the arrival).
    pub(super) fn read_desc(&self, generation: u64) -> Vec<u8> {
        let (at, stored) = self.desc_slot(generation);
        let len = (stored.load(Ordering::Relaxed) as usize).min(DESC_MAX);
        let mut out = vec![0u8; len];
        // SAFETY: in the header; stable until this rank arrives at the next generation.
        unsafe { std::ptr::copy_nonoverlapping(at, out.as_mut_ptr(), len) };
        out
    }
}

/// True while process `pid` runs (a zombie, or no such process, is dead).
pub(super) fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next()),
            Some('Z' | 'X')
        ),
        // Without /proc (not Linux), signal 0 tells whether the process exists.
        // SAFETY: plain syscall.
        Err(_) => unsafe { libc::kill(pid as libc::pid_t, 0) == 0 },
    }
}

/// Bytes of the abort slot file.
const ABORT_BYTES: usize = 8 << 10;
const ABORT_MAX_REASON: usize = ABORT_BYTES - 64;

/// The job's first failure, shared by every group of the job (the root group and its
/// sub-groups): state (0 none, 1 being written, 2 set), the failed rank (of the root group),
/// the reason.
pub(super) struct AbortSlot {
    /// The mapping (it outlives its file descriptor, closed once mapped: POSIX).
    map: MmapRaw,
    /// The file rank 0 created (removed, if still there, when the slot is dropped: a setup
    /// that failed before every rank opened it).
    created: Option<PathBuf>,
}

impl Drop for AbortSlot {
    fn drop(&mut self) {
        if let Some(path) = &self.created {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl AbortSlot {
    /// Creates the slot file at `path` (rank 0).
    pub(super) fn create(path: &Path) -> Result<AbortSlot> {
        let (_, map) = create_mapped(path, ABORT_BYTES)?;
        Ok(AbortSlot {
            map,
            created: Some(path.to_path_buf()),
        })
    }

    /// Maps the slot file at `path` (the other ranks).
    pub(super) fn open(path: &Path) -> Result<AbortSlot> {
        let file = open(path, "cannot open")?;
        Ok(AbortSlot {
            map: map(&file, path, ABORT_BYTES)?,
            created: None,
        })
    }

    /// A slot of this process only (a group of one rank).
    pub(super) fn private() -> Result<AbortSlot> {
        let map = MmapOptions::new()
            .len(ABORT_BYTES)
            .map_anon()
            .map_err(|e| Error::InvalidArgument(format!("cannot map anonymous memory: {e}")))?;
        Ok(AbortSlot {
            map: map.into(),
            created: None,
        })
    }

    fn state(&self) -> &AtomicU64 {
        // SAFETY: mapped ABORT_BYTES, page aligned.
        unsafe { word(self.map.as_mut_ptr(), 0) }
    }

    /// Records `(rank, reason)` unless a failure is already recorded.
    pub(super) fn set(&self, rank: usize, reason: &str) {
        if self
            .state()
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        let reason = crate::comm::bootstrap::cut_reason(reason, ABORT_MAX_REASON);
        let base = self.map.as_mut_ptr();
        // SAFETY: within the mapping; only the winner of the exchange above writes.
        unsafe {
            word(base, 8).store(rank as u64, Ordering::Relaxed);
            word(base, 16).store(reason.len() as u64, Ordering::Relaxed);
            std::ptr::copy_nonoverlapping(reason.as_ptr(), base.add(64), reason.len());
        }
        self.state().store(2, Ordering::Release);
    }

    /// The recorded failure, if any.
    pub(super) fn get(&self) -> Option<(usize, String)> {
        if self.state().load(Ordering::Acquire) != 2 {
            return None;
        }
        let base = self.map.as_mut_ptr();
        // SAFETY: within the mapping; written once before state 2 (seen above).
        unsafe {
            let rank = word(base, 8).load(Ordering::Relaxed) as usize;
            let len = (word(base, 16).load(Ordering::Relaxed) as usize).min(ABORT_MAX_REASON);
            let bytes = std::slice::from_raw_parts(base.add(64), len);
            Some((rank, String::from_utf8_lossy(bytes).into_owned()))
        }
    }
}

/// How often a waiting rank checks that the missing peers' processes still run.
pub(super) const LIVENESS_EVERY: std::time::Duration = std::time::Duration::from_millis(20);

#[cfg(test)]
mod tests {
    use super::*;

    fn path(tag: &str) -> PathBuf {
        shm_dir().join(format!("candle-fsdp-test-{}-{tag}", std::process::id()))
    }

    #[test]
    fn a_segment_or_abort_slot_dropped_before_unlinking_removes_its_file() {
        // A setup that fails half-way (a peer died before a store barrier) drops what it made:
        // nothing may stay in /dev/shm.
        let seg_path = path("segment");
        let seg = Segment::create(seg_path.clone()).unwrap();
        assert!(seg_path.exists());
        drop(seg);
        assert!(!seg_path.exists(), "{} left behind", seg_path.display());

        let slot_path = path("abort");
        let slot = AbortSlot::create(&slot_path).unwrap();
        let peer = AbortSlot::open(&slot_path).unwrap();
        drop(peer);
        assert!(
            slot_path.exists(),
            "a peer's slot removed the creator's file"
        );
        slot.set(1, "gone");
        drop(slot);
        assert!(!slot_path.exists(), "{} left behind", slot_path.display());
    }
}
