//! Large host allocations in memory the other processes of a job can map: what lets the
//! shared-memory backend ([`crate::comm::shm`]) read a peer's tensor in place, as the thread
//! backend does, instead of copying every input into a segment first.
//!
//! A binary opts in by installing [`SharedLarge`] as its global allocator (the examples do:
//! `Counting(SharedLarge(MiMalloc))`). Nothing changes until a shared-memory group is created:
//! then [`enable`] reserves this process's **arena**, an anonymous shared file
//! (`memfd_create(2)`) mapped once (virtual space only: pages are committed when first
//! written). From then on, allocations of at least [`THRESHOLD`] bytes made inside
//! [`in_shared`] on the allocating thread are carved from it (best fit over the free extents,
//! page-aligned; one that does not fit falls back to the wrapped allocator). The runtime makes
//! its collectives' inputs there: the master shards, their casts for the wire, the flattened
//! gradients (`fsdp::collectives`). Everything else stays with the wrapped allocator (which
//! may give it huge pages; the arena's shared pages are 4 KiB). The peers map the same file
//! read-only through `/proc/<pid>/fd/<fd>` ([`PeerArena::open`]), so an offset in this arena
//! names the same bytes in every process. Without [`SharedLarge`] installed, or with
//! `FSDP_SHM_ARENA=0`, [`enable`] returns `None` and the backend copies as before.
//!
//! Freed blocks keep their pages for the next allocation, as a caching allocator does (a
//! training step frees and allocates the same sizes every step; giving the pages back at each
//! free made the GPT bench take 100× the page faults and run slower: BENCHMARKS §17).
//! [`release_shared`] gives every free page back (`fallocate(2)`, `FALLOC_FL_PUNCH_HOLE`), as
//! `torch.cuda.empty_cache()` does for PyTorch's caching allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::error::{Error, Result};

/// Smallest allocation (bytes) served from the arena inside [`in_shared`]: below it a copy into
/// the segment costs less than a page-granular block (and shm is already level with the thread
/// backend there, BENCHMARKS §1).
pub const THRESHOLD: usize = 64 << 10;
const PAGE: usize = 4096;

/// A global allocator that serves allocations of at least 64 KiB (`THRESHOLD`) made inside
/// [`in_shared`] from this process's shared arena once a shared-memory group has enabled it,
/// and everything else from the allocator it wraps (the system's by default).
///
/// `#[global_allocator] static A: candle_fsdp::alloc::SharedLarge = candle_fsdp::alloc::SharedLarge(std::alloc::System);`
/// It composes with [`super::Counting`]: `Counting(SharedLarge(System))`.
pub struct SharedLarge<A = System>(pub A);

/// Set by [`SharedLarge`]'s first large allocation: the allocator is installed.
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// This process's arena, once [`enable`] made it.
static ARENA: OnceLock<Arena> = OnceLock::new();
/// Serialises [`enable`].
static ENABLING: Mutex<()> = Mutex::new(());

thread_local! {
    /// Depth of [`in_shared`] scopes on this thread (const-initialised, no destructor: safe to
    /// read inside the allocator).
    static SCOPE: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Runs `f` with this thread's allocations of at least 64 KiB (`THRESHOLD`) served from the
/// shared arena (when [`SharedLarge`] is installed and a shared-memory group enabled it; else
/// `f` runs unchanged). Wrap the creation of tensors a collective reads (its input; an
/// all-reduce's buffer): the shared-memory backend then lets the peers read them in place
/// instead of copying them into its segment. Scopes nest.
pub fn in_shared<R>(f: impl FnOnce() -> R) -> R {
    struct Exit;
    impl Drop for Exit {
        fn drop(&mut self) {
            SCOPE.with(|s| s.set(s.get() - 1));
        }
    }
    SCOPE.with(|s| s.set(s.get() + 1));
    let _exit = Exit;
    f()
}

/// True once this process has an arena (a shared-memory group was created with
/// [`SharedLarge`] installed).
pub fn is_shared_enabled() -> bool {
    ARENA.get().is_some()
}

// SAFETY: arena blocks are disjoint, page aligned (≥ any layout alignment served from it) and
// inside the arena's live mapping; every other call is forwarded to the wrapped allocator, and
// a pointer goes back to whichever allocator its address says made it.
unsafe impl<A: GlobalAlloc> GlobalAlloc for SharedLarge<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if let Some(p) = arena_for(layout).and_then(|a| a.alloc(layout.size(), false)) {
            return p;
        }
        // SAFETY: forwarded unchanged.
        unsafe { self.0.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if let Some(p) = arena_for(layout).and_then(|a| a.alloc(layout.size(), true)) {
            return p;
        }
        // SAFETY: forwarded unchanged.
        unsafe { self.0.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // Only blocks of at least THRESHOLD bytes can be the arena's.
        let arena = match layout.size() >= THRESHOLD {
            true => ARENA.get().filter(|a| a.contains(ptr)),
            false => None,
        };
        match arena {
            Some(a) => a.free(ptr, layout.size()),
            // SAFETY: not the arena's: the wrapped allocator made it with this layout.
            None => unsafe { self.0.dealloc(ptr, layout) },
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let in_arena = layout.size() >= THRESHOLD && ARENA.get().is_some_and(|a| a.contains(ptr));
        // SAFETY: `new_size` is non-zero and fits `isize` (GlobalAlloc's contract).
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        // Outside `in_shared`, a block of the wrapped allocator stays with it (it may grow in
        // place).
        if !in_arena && arena_for(new_layout).is_none() {
            // SAFETY: forwarded unchanged: the wrapped allocator made `ptr`.
            return unsafe { self.0.realloc(ptr, layout, new_size) };
        }
        // SAFETY: a fresh block of `new_layout`; the old one is live with `layout`.
        unsafe {
            let new = self.alloc(new_layout);
            if !new.is_null() {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
            new
        }
    }
}

/// The arena, when `layout` is one it serves (enabled, large enough, alignment ≤ a page).
/// Small blocks, nearly every allocation of a step, leave after one comparison.
#[inline(always)]
fn arena_for(layout: Layout) -> Option<&'static Arena> {
    if layout.size() < THRESHOLD {
        return None;
    }
    if !INSTALLED.load(Ordering::Relaxed) {
        INSTALLED.store(true, Ordering::Relaxed);
    }
    if layout.align() > PAGE {
        return None;
    }
    let arena = ARENA.get()?;
    (SCOPE.try_with(|s| s.get()).unwrap_or(0) > 0).then_some(arena)
}

/// What a peer needs to map this process's arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ArenaId {
    /// The file's descriptor in this process (`/proc/<pid>/fd/<fd>`).
    pub fd: i32,
    /// Bytes of the file (the arena's reserved size).
    pub len: usize,
    /// The file's identity (`st_dev`, `st_ino`): what a peer checks the file it opened
    /// against (in another PID namespace `/proc/<pid>` may be another process).
    pub dev: u64,
    pub ino: u64,
}

/// `(st_dev, st_ino)` of an open file.
fn identity(file: &std::fs::File) -> std::io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = file.metadata()?;
    Ok((m.dev(), m.ino()))
}

/// Makes this process's arena (once; later calls return the same) when [`SharedLarge`] is the
/// global allocator; `None` when it is not, when `FSDP_SHM_ARENA=0` turns it off, or when the
/// arena cannot be made (no `memfd`, an address-space limit): the shared-memory backend then
/// copies, as without it.
///
/// Errors: `FSDP_SHM_ARENA` set to anything but `1`/`true`/`on`/`yes` or `0`/`false`/`off`/`no`
/// (any case) — [`Error::Env`].
pub(crate) fn enable() -> Result<Option<ArenaId>> {
    if let Some(v) = std::env::var_os("FSDP_SHM_ARENA") {
        let text = v.to_string_lossy().trim().to_ascii_lowercase();
        match text.as_str() {
            "1" | "true" | "on" | "yes" => {}
            "0" | "false" | "off" | "no" => return Ok(None),
            _ => {
                return Err(Error::env(
                    "FSDP_SHM_ARENA",
                    format_args!("{v:?}"),
                    "is not 1/true/on/yes or 0/false/off/no (whether the shared-memory \
                     backend reads peers' comm buffers in place)",
                ))
            }
        }
    }
    // A large block through the global allocator marks `SharedLarge` as installed.
    drop(std::hint::black_box(Vec::<u8>::with_capacity(THRESHOLD)));
    if !INSTALLED.load(Ordering::Relaxed) {
        return Ok(None);
    }
    let _one = ENABLING.lock().unwrap_or_else(|e| e.into_inner());
    if ARENA.get().is_none() {
        let Ok(arena) = Arena::create(reserve_bytes()) else {
            return Ok(None);
        };
        let _ = ARENA.set(arena);
    }
    Ok(ARENA.get().map(Arena::id))
}

/// Byte offset of `bytes` bytes at `ptr` in this process's arena, when they lie inside it.
pub(crate) fn offset_of(ptr: *const u8, bytes: usize) -> Option<usize> {
    let a = ARENA.get()?;
    let off = (ptr as usize).checked_sub(a.base as usize)?;
    (off.checked_add(bytes)? <= a.len).then_some(off)
}

/// The address of byte `off` of this process's arena (`None` without one, or out of it).
pub(crate) fn own_at(off: usize, bytes: usize) -> Option<*mut u8> {
    let a = ARENA.get()?;
    (off.checked_add(bytes)? <= a.len).then(|| a.base.wrapping_add(off))
}

/// Gives the pages of every freed block of this process's arena back to the system (they are
/// kept for reuse otherwise); returns the bytes of freed blocks inside the arena (the pages
/// above its highest live block are given back too). 0 without an arena.
pub fn release_shared() -> usize {
    ARENA.get().map_or(0, |a| a.release().0)
}

/// Bytes now allocated from this process's arena (0 without one).
pub fn shared_bytes() -> usize {
    ARENA.get().map_or(0, |a| a.lock().live)
}

/// The arena's reserved size: twice the machine's memory, at least 1 GiB, at most 1 TiB
/// (address space only; the file is sparse).
fn reserve_bytes() -> usize {
    // SAFETY: plain sysconf calls.
    let (pages, size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let ram = (pages.max(0) as usize).saturating_mul(size.max(0) as usize);
    ram.saturating_mul(2).clamp(1 << 30, 1 << 40)
}

/// Free and used extents of an arena (byte offsets).
struct Extents {
    /// Offset → length of every free extent below `top`, none adjacent to another.
    free: BTreeMap<usize, usize>,
    /// End of the highest extent handed out.
    top: usize,
    /// Pages at or above this offset hold zeros (never written, or punched).
    clean: usize,
    /// Bytes handed out and not freed.
    live: usize,
}

/// One process's arena: a shared file mapped read-write here.
pub(crate) struct Arena {
    base: *mut u8,
    len: usize,
    /// The shared file (`memfd_create`).
    file: std::fs::File,
    /// The file's `(st_dev, st_ino)`.
    dev: u64,
    ino: u64,
    extents: Mutex<Extents>,
}

// SAFETY: the mapping lives as long as the arena; `extents` guards every change of who owns
// which bytes.
unsafe impl Send for Arena {}
// SAFETY: as above.
unsafe impl Sync for Arena {}

impl Arena {
    /// Creates a sparse shared file of `len` bytes and maps it.
    pub(crate) fn create(len: usize) -> std::io::Result<Arena> {
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: plain syscall.
        let fd = unsafe { libc::memfd_create(c"candle-fsdp-arena".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nobody else owns (closed with the file from here on).
        let file = unsafe { std::fs::File::from_raw_fd(fd) };
        file.set_len(len as u64)?;
        let (dev, ino) = identity(&file)?;
        // SAFETY: maps the file's `len` bytes; checked below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Arena {
            base: base.cast(),
            len,
            file,
            dev,
            ino,
            extents: Mutex::new(Extents {
                free: BTreeMap::new(),
                top: 0,
                clean: 0,
                live: 0,
            }),
        })
    }

    fn id(&self) -> ArenaId {
        ArenaId {
            fd: std::os::fd::AsRawFd::as_raw_fd(&self.file),
            len: self.len,
            dev: self.dev,
            ino: self.ino,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Extents> {
        self.extents.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn contains(&self, ptr: *mut u8) -> bool {
        (ptr as usize).wrapping_sub(self.base as usize) < self.len
    }

    /// A block of `size` bytes (page aligned; zeroed when `zero`), or `None` when the arena
    /// is full.
    pub(crate) fn alloc(&self, size: usize, zero: bool) -> Option<*mut u8> {
        let size = size.checked_next_multiple_of(PAGE)?;
        let (off, dirty) = {
            let mut e = self.lock();
            let best = e
                .free
                .iter()
                .filter(|&(_, &len)| len >= size)
                .min_by_key(|&(_, &len)| len)
                .map(|(&off, &len)| (off, len));
            let off = match best {
                Some((off, len)) => {
                    e.free.remove(&off);
                    if len > size {
                        e.free.insert(off + size, len - size);
                    }
                    off
                }
                None => {
                    let off = e.top;
                    if off.checked_add(size)? > self.len {
                        return None;
                    }
                    e.top = off + size;
                    off
                }
            };
            e.live += size;
            // Bytes of the block that may hold an earlier block's data.
            let dirty = e.clean.saturating_sub(off).min(size);
            e.clean = e.clean.max(off + size);
            (off, dirty)
        };
        let p = self.base.wrapping_add(off);
        if zero && dirty > 0 {
            // SAFETY: the block is this caller's now and lies inside the mapping.
            unsafe { std::ptr::write_bytes(p, 0, dirty) };
        }
        Some(p)
    }

    /// Returns the block of `size` bytes at `ptr` (from [`Arena::alloc`]).
    pub(crate) fn free(&self, ptr: *mut u8, size: usize) {
        let size = size.next_multiple_of(PAGE);
        let mut off = ptr as usize - self.base as usize;
        let mut e = self.lock();
        e.live -= size;
        let mut len = size;
        if let Some((&prev, &plen)) = e.free.range(..off).next_back() {
            if prev + plen == off {
                e.free.remove(&prev);
                off = prev;
                len += plen;
            }
        }
        if let Some(next_len) = e.free.remove(&(off + len)) {
            len += next_len;
        }
        if off + len == e.top {
            e.top = off;
        } else {
            e.free.insert(off, len);
        }
    }

    /// Gives the pages of every free extent, and of everything above the top, back to the
    /// system; returns the bytes of free extents and the top's offset before.
    fn release(&self) -> (usize, usize) {
        let mut e = self.lock();
        let mut free = 0;
        for (&off, &len) in &e.free {
            self.punch(off, len);
            free += len;
        }
        if e.clean > e.top {
            self.punch(e.top, e.clean - e.top);
            e.clean = e.top;
        }
        (free, e.top)
    }

    /// Gives the pages of `len` bytes at `off` back to the system (they read as zeros after).
    fn punch(&self, off: usize, len: usize) {
        // SAFETY: plain syscall on the arena's descriptor, inside its size. A failure keeps the
        // pages, which is only memory.
        unsafe {
            libc::fallocate(
                std::os::fd::AsRawFd::as_raw_fd(&self.file),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off as libc::off_t,
                len as libc::off_t,
            );
        }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: the mapping this value made (the process's own arena is a static and never
        // dropped; only tests' arenas are); the file closes itself.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// A peer's arena as this process maps it (read-only).
pub(crate) struct PeerArena {
    base: *mut u8,
    len: usize,
}

// SAFETY: a read-only mapping owned by this value.
unsafe impl Send for PeerArena {}
// SAFETY: as above.
unsafe impl Sync for PeerArena {}

impl PeerArena {
    /// Maps the arena `id` of process `pid` (through `/proc/<pid>/fd/<fd>`).
    ///
    /// Errors: the file cannot be opened (another user's process, no `/proc`); it is not the
    /// arena `id` names (another file or process behind that path: another PID namespace), or
    /// it is this process's own arena; it is shorter than `id.len`; it cannot be mapped.
    pub(crate) fn open(pid: u32, id: ArenaId) -> std::io::Result<PeerArena> {
        let file = std::fs::File::open(format!("/proc/{pid}/fd/{}", id.fd))?;
        let found = identity(&file)?;
        if found != (id.dev, id.ino) {
            return Err(std::io::Error::other(format!(
                "/proc/{pid}/fd/{} is not the peer's arena (file {found:?}, expected {:?}): \
                 another PID namespace?",
                id.fd,
                (id.dev, id.ino)
            )));
        }
        if ARENA.get().is_some_and(|own| (own.dev, own.ino) == found) {
            return Err(std::io::Error::other(format!(
                "/proc/{pid}/fd/{} is this process's own arena: another PID namespace?",
                id.fd
            )));
        }
        let size = file.metadata()?.len() as usize;
        if size < id.len {
            return Err(std::io::Error::other(format!(
                "the peer's arena is {size} bytes, not {}",
                id.len
            )));
        }
        // SAFETY: maps `id.len` bytes of an open file, read-only; checked below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                id.len,
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                std::os::fd::AsRawFd::as_raw_fd(&file),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(PeerArena {
            base: base.cast(),
            len: id.len,
        })
    }

    /// The address of byte `off` here, when `bytes` bytes from it lie inside the arena.
    pub(crate) fn at(&self, off: usize, bytes: usize) -> Option<*mut u8> {
        (off.checked_add(bytes)? <= self.len).then(|| self.base.wrapping_add(off))
    }
}

impl Drop for PeerArena {
    fn drop(&mut self) {
        // SAFETY: the mapping this value made; nothing borrows it past the value.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_disjoint_reused_best_fit_and_coalesced() {
        let a = Arena::create(64 << 20).unwrap();
        let base = a.base as usize;
        let off = |p: *mut u8| p as usize - base;
        let x = a.alloc(PAGE, false).unwrap();
        let y = a.alloc(3 * PAGE + 1, false).unwrap();
        let z = a.alloc(PAGE, false).unwrap();
        assert_eq!((off(x), off(y), off(z)), (0, PAGE, 5 * PAGE));
        a.free(y, 3 * PAGE + 1);
        // Best fit: a 2-page block goes into the 4-page hole, the rest stays free.
        let w = a.alloc(2 * PAGE, false).unwrap();
        assert_eq!(off(w), PAGE);
        assert_eq!(a.lock().free.get(&(3 * PAGE)), Some(&(2 * PAGE)));
        // Freeing w coalesces with the hole after it; freeing z lowers the top to x's end.
        a.free(w, 2 * PAGE);
        assert_eq!(a.lock().free.get(&PAGE), Some(&(4 * PAGE)));
        a.free(z, PAGE);
        let e = a.lock();
        assert_eq!((e.top, e.free.len(), e.live), (PAGE, 0, PAGE));
    }

    #[test]
    fn zeroed_blocks_are_zero_after_reuse_and_a_full_arena_says_none() {
        let a = Arena::create(16 * PAGE).unwrap();
        let x = a.alloc(8 * PAGE, false).unwrap();
        // SAFETY: the block is ours, 8 pages.
        unsafe { std::ptr::write_bytes(x, 0xAB, 8 * PAGE) };
        a.free(x, 8 * PAGE);
        let y = a.alloc(8 * PAGE, true).unwrap();
        assert_eq!(y, x);
        // SAFETY: as above.
        let bytes = unsafe { std::slice::from_raw_parts(y, 8 * PAGE) };
        assert!(bytes.iter().all(|&b| b == 0));
        assert!(a.alloc(9 * PAGE, false).is_none());
        assert!(a.alloc(8 * PAGE, false).is_some());
    }

    #[test]
    fn release_gives_the_free_pages_back_and_they_read_zero() {
        let a = Arena::create(1 << 20).unwrap();
        let x = a.alloc(2 * PAGE, false).unwrap();
        let _y = a.alloc(PAGE, false).unwrap();
        // SAFETY: the block is ours, 2 pages.
        unsafe { std::ptr::write_bytes(x, 0xCD, 2 * PAGE) };
        a.free(x, 2 * PAGE);
        assert_eq!(a.release(), (2 * PAGE, 3 * PAGE));
        // Not asked to zero: the punched pages read as zeros anyway.
        let z = a.alloc(2 * PAGE, false).unwrap();
        assert_eq!(z, x);
        // SAFETY: as above.
        let bytes = unsafe { std::slice::from_raw_parts(z, 2 * PAGE) };
        assert!(bytes.iter().all(|&b| b == 0));
    }

    #[test]
    fn a_peer_mapping_reads_what_the_owner_wrote() {
        let a = Arena::create(1 << 20).unwrap();
        let x = a.alloc(PAGE, false).unwrap();
        // SAFETY: the block is ours.
        unsafe { *x.add(7) = 42 };
        let peer = PeerArena::open(std::process::id(), a.id()).unwrap();
        let p = peer.at(x as usize - a.base as usize, PAGE).unwrap();
        // SAFETY: a live read-only mapping of the same page.
        assert_eq!(unsafe { *p.add(7) }, 42);
        assert!(peer.at(1 << 20, 1).is_none());
        // Another file behind the path (another PID namespace) is refused, naming it.
        let wrong = ArenaId {
            ino: a.id().ino + 1,
            ..a.id()
        };
        let e = PeerArena::open(std::process::id(), wrong).err().unwrap();
        assert!(e.to_string().contains("is not the peer's arena"), "{e}");
    }
}
