//! The collectives of the TCP backend, run on a comm stream's thread (setup operations on the
//! caller's), by direct exchange over the communicator's connections.
//!
//! Every operation starts with a descriptor frame sent to every peer (the [`Post`] the other
//! backends validate, encoded by `comm::wire`, or a goodbye from a rank whose group was
//! dropped); every rank validates every descriptor with the thread backend's code (the same
//! verdict everywhere; the group stays usable after a mismatch), then the data moves
//! (`ws` ranks, this rank `r`):
//! - **all-gather**: every rank sends its input to every peer, received into `output[j*n..]`.
//! - **reduce-scatter**: every rank sends chunk `j` of its input to rank `j` and reduces the
//!   chunks it receives *in rank order* with the thread backend's kernel
//!   ([`crate::comm::reduce::reduce_into`]), in segments of [`SEGMENT_BYTES`] per peer (the
//!   scratch space stays small): bitwise the thread backend's result, for every dtype and op.
//! - **all-reduce**: the reduce-scatter above over `ws` nearly equal chunks, in place, then the
//!   all-gather of the chunks (element-wise the same rank-order reduction: bitwise the thread
//!   backend's).
//! - **broadcast**: the root sends to every rank. **reduce**: every rank sends to the root,
//!   which reduces in rank order (segmented). **barrier**: the descriptor exchange alone.
//!
//! Sockets are non-blocking; [`Ctx::transfer`] writes and reads every peer's queue as the
//! kernel accepts, sleeping in `poll` at most 50 ms at a time, and between two polls looks at
//! the job's failure slot and the deadline (the group's timeout without a byte moving, so a
//! large buffer on a slow network is not cut short). A connection that breaks fails the operation with
//! [`Error::PeerFailed`] naming the peer (or [`Error::PeerExited`] when its group was dropped).

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use candle_core::Tensor;

use super::Core;
use crate::comm::buffer::{validate, with_checked_bufs, Kind, Post, Problem, RawBuf};
use crate::comm::engine::streams::StreamComm;
use crate::comm::reduce::{chunk, reduce_into, with_elem};
use crate::comm::{wire, OpKind, ReduceOp};
use crate::error::{Error, Result};

/// Bytes of a descriptor frame: tag, length, and the first [`INLINE`] bytes of the descriptor
/// (every collective's fits; a setup operation's argument may follow in a second message).
const FRAME: usize = 8 + INLINE;
const INLINE: usize = 128;
const TAG_DESC: u8 = 1;
const TAG_BYE: u8 = 2;
/// Largest setup descriptor accepted from a peer.
const SETUP_MAX: usize = 1 << 20;
/// Segment of the reducing exchanges (bytes per peer and round).
pub(super) const SEGMENT_BYTES: usize = 4 << 20;

/// One communicator of one rank: a connection to every peer (index = rank of the group;
/// `None` at this rank's index) and the receive space of its reductions.
pub(super) struct Comm {
    pub peers: Vec<Option<TcpStream>>,
    pub scratch: Vec<u64>,
}

impl StreamComm for Comm {
    /// Tells every peer this rank is gone from this communicator (best effort).
    fn leave(&mut self, _rank: usize) {
        let mut frame = [0u8; FRAME];
        frame[0] = TAG_BYE;
        for s in self.peers.iter_mut().flatten() {
            let _ = s.set_nonblocking(false);
            let _ = s.set_write_timeout(Some(Duration::from_millis(500)));
            let _ = s.write_all(&frame);
        }
    }
}

/// A message of a transfer: peer, address, bytes.
#[derive(Clone, Copy)]
struct Io {
    peer: usize,
    ptr: *mut u8,
    len: usize,
}

/// Moves as many bytes of `queue`'s messages (the last one first) as `step` moves without
/// blocking; returns whether any moved, or why the connection broke.
fn pump(
    queue: &mut Vec<Io>,
    mut step: impl FnMut(&Io) -> std::io::Result<usize>,
) -> std::result::Result<bool, String> {
    let mut moved = false;
    while let Some(m) = queue.last_mut() {
        match step(m) {
            Ok(0) => return Err("end of stream".into()),
            Ok(n) => {
                m.ptr = m.ptr.wrapping_add(n);
                m.len -= n;
                moved = true;
                if m.len == 0 {
                    queue.pop();
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(moved)
}

/// One collective (or setup operation) on one rank.
pub(super) struct Ctx<'a> {
    pub core: &'a Core,
    pub comm: &'a mut Comm,
    pub seq: u64,
    pub op: &'a str,
}

impl Ctx<'_> {
    fn rank(&self) -> usize {
        self.core.rank
    }

    fn ws(&self) -> usize {
        self.core.world_size
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.core.timeout
    }

    fn peer_failed(&self, (failed_rank, reason): (usize, String)) -> Error {
        Error::PeerFailed {
            op: self.op.to_string(),
            rank: self.rank(),
            failed_rank,
            reason,
        }
    }

    /// The error of peer `j`'s goodbye on this communicator: the job's failure if one is
    /// recorded by the time the control plane has `j`'s goodbye too (a failing rank aborts
    /// before it drops its group: its reason travels ahead on the control connection), else
    /// [`Error::PeerExited`].
    fn departed(&self, j: usize) -> Error {
        let net = &self.core.net;
        let until = Instant::now() + Duration::from_secs(1);
        while net.failure().is_none()
            && !net.departed(self.core.root_ranks[j])
            && Instant::now() < until
        {
            std::thread::sleep(Duration::from_millis(2));
        }
        match net.failure() {
            Some(f) => self.peer_failed(f),
            None => Error::PeerExited {
                op: self.op.to_string(),
                rank: self.rank(),
                departed: j,
            },
        }
    }

    /// The error of a connection to peer `j` that broke (`what`): the job's recorded failure
    /// if the control plane reports one within a second (a peer's abort travels there), a
    /// departure if `j`'s group was dropped, else `j`'s death (recorded for the job).
    fn lost(&self, j: usize, what: &str) -> Error {
        let net = &self.core.net;
        let job_rank = self.core.root_ranks[j];
        let until = Instant::now() + Duration::from_secs(1);
        loop {
            if let Some(f) = net.failure() {
                return self.peer_failed(f);
            }
            if net.departed(job_rank) {
                return Error::PeerExited {
                    op: self.op.to_string(),
                    rank: self.rank(),
                    departed: j,
                };
            }
            if Instant::now() >= until {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let reason = format!(
            "its process ended without reporting an error (killed by a signal, or it exited \
             in the middle of the job): the connection to it ({}) broke: {what}",
            net.addrs[job_rank]
        );
        net.fail(job_rank, &reason);
        self.peer_failed((job_rank, reason))
    }

    /// Sends `sends` and receives `recvs` (each peer's messages in order); fails with
    /// [`Error::Timeout`] when no byte moved for the group's timeout.
    fn transfer(&mut self, sends: &[Io], recvs: &[Io]) -> Result<()> {
        let mut deadline = self.deadline();
        let ws = self.ws();
        let mut sq: Vec<Vec<Io>> = vec![Vec::new(); ws];
        let mut rq: Vec<Vec<Io>> = vec![Vec::new(); ws];
        for m in sends.iter().rev().filter(|m| m.len > 0) {
            sq[m.peer].push(*m);
        }
        for m in recvs.iter().rev().filter(|m| m.len > 0) {
            rq[m.peer].push(*m);
        }
        loop {
            let mut moved = false;
            for j in 0..ws {
                if sq[j].is_empty() && rq[j].is_empty() {
                    continue;
                }
                let s = self.comm.peers[j].as_ref();
                let broke = (|| {
                    let s = s.expect("a peer's connection");
                    // SAFETY: the caller keeps `m.ptr[..m.len]` alive and unchanged.
                    moved |= pump(&mut sq[j], |m| {
                        (&*s).write(unsafe { std::slice::from_raw_parts(m.ptr, m.len) })
                    })?;
                    // SAFETY: the caller gives this rank `m.ptr[..m.len]` to write, untouched
                    // by anybody else until the transfer returns.
                    moved |= pump(&mut rq[j], |m| {
                        (&*s).read(unsafe { std::slice::from_raw_parts_mut(m.ptr, m.len) })
                    })?;
                    Ok::<(), String>(())
                })();
                if let Err(what) = broke {
                    return Err(self.lost(j, &what));
                }
            }
            let busy: Vec<usize> = (0..ws)
                .filter(|&j| !sq[j].is_empty() || !rq[j].is_empty())
                .collect();
            if busy.is_empty() {
                return Ok(());
            }
            if let Some(f) = self.core.net.failure() {
                return Err(self.peer_failed(f));
            }
            let now = Instant::now();
            if moved {
                deadline = now + self.core.timeout;
            } else if now >= deadline {
                let reason = format!("timed out in {}", self.op);
                self.core
                    .net
                    .abort(self.core.root_ranks[self.rank()], &reason);
                return Err(Error::Timeout {
                    op: self.op.to_string(),
                    rank: self.rank(),
                    timeout: self.core.timeout,
                    missing: busy,
                });
            }
            let mut fds: Vec<libc::pollfd> = busy
                .iter()
                .map(|&j| libc::pollfd {
                    fd: self.comm.peers[j].as_ref().expect("peer").as_raw_fd(),
                    events: (if sq[j].is_empty() { 0 } else { libc::POLLOUT })
                        | (if rq[j].is_empty() { 0 } else { libc::POLLIN }),
                    revents: 0,
                })
                .collect();
            let wait = (deadline - now).min(Duration::from_millis(50));
            // SAFETY: `fds` is a live array of `fds.len()` pollfds.
            unsafe {
                libc::poll(
                    fds.as_mut_ptr(),
                    fds.len() as libc::nfds_t,
                    wait.as_millis().max(1) as libc::c_int,
                )
            };
        }
    }

    /// Sends this rank's `post` (with `setup_bytes`, the setup argument) to every peer,
    /// receives theirs and validates all of them (the same verdict on every rank).
    pub(super) fn exchange(&mut self, post: &Post, setup_bytes: &[u8]) -> Result<()> {
        if let Some(f) = self.core.net.failure() {
            return Err(self.peer_failed(f));
        }
        let (ws, rank) = (self.ws(), self.rank());
        let desc = wire::encode(post, setup_bytes);
        let mut mine = vec![0u8; FRAME];
        mine[0] = TAG_DESC;
        mine[4..8].copy_from_slice(&(desc.len() as u32).to_le_bytes());
        let head = desc.len().min(INLINE);
        mine[8..8 + head].copy_from_slice(&desc[..head]);
        let mut frames = vec![vec![0u8; FRAME]; ws];
        let peers: Vec<usize> = (0..ws).filter(|&j| j != rank).collect();
        let sends: Vec<Io> = peers
            .iter()
            .map(|&j| Io {
                peer: j,
                ptr: mine.as_mut_ptr(),
                len: FRAME,
            })
            .collect();
        let recvs: Vec<Io> = peers
            .iter()
            .map(|&j| Io {
                peer: j,
                ptr: frames[j].as_mut_ptr(),
                len: FRAME,
            })
            .collect();
        self.transfer(&sends, &recvs)?;
        if let Some(&j) = peers.iter().find(|&&j| frames[j][0] == TAG_BYE) {
            return Err(self.departed(j));
        }
        // The rest of long (setup) descriptors.
        let lens: Vec<usize> = frames
            .iter()
            .map(|f| u32::from_le_bytes(f[4..8].try_into().expect("4 bytes")) as usize)
            .collect();
        if let Some(&j) = peers
            .iter()
            .find(|&&j| frames[j][0] != TAG_DESC || lens[j] > SETUP_MAX)
        {
            return Err(Error::CollectiveMismatch {
                op: self.op.to_string(),
                rank: j,
                found: "a descriptor this version cannot read".into(),
                other_rank: rank,
                expected: "a candle-fsdp collective descriptor".into(),
            });
        }
        let mut descs: Vec<Vec<u8>> = (0..ws)
            .map(|j| match j == rank {
                true => desc.clone(),
                false => {
                    let mut d = frames[j][8..8 + lens[j].min(INLINE)].to_vec();
                    d.resize(lens[j], 0);
                    d
                }
            })
            .collect();
        if desc.len() > INLINE || peers.iter().any(|&j| lens[j] > INLINE) {
            let sends: Vec<Io> = match desc.len() > INLINE {
                true => peers
                    .iter()
                    .map(|&j| Io {
                        peer: j,
                        ptr: desc[INLINE..].as_ptr() as *mut u8,
                        len: desc.len() - INLINE,
                    })
                    .collect(),
                false => Vec::new(),
            };
            let recvs: Vec<Io> = descs
                .iter_mut()
                .enumerate()
                .filter(|(j, d)| *j != rank && d.len() > INLINE)
                .map(|(j, d)| Io {
                    peer: j,
                    ptr: d[INLINE..].as_mut_ptr(),
                    len: d.len() - INLINE,
                })
                .collect();
            self.transfer(&sends, &recvs)?;
        }
        let mut posts = Vec::with_capacity(ws);
        for (j, d) in descs.iter().enumerate() {
            let Some(p) = wire::decode(d) else {
                return Err(Error::CollectiveMismatch {
                    op: self.op.to_string(),
                    rank: j,
                    found: "a descriptor this version cannot read".into(),
                    other_rank: rank,
                    expected: "a candle-fsdp collective descriptor".into(),
                });
            };
            posts.push(p);
        }
        validate(self.op, ws, &posts)
    }

    /// Reports a local `problem` through the exchange (every rank fails the same way).
    fn fail_with(&mut self, kind: Kind, problem: Problem) -> Error {
        let mut post = Post::new(kind, self.seq);
        post.problem = Some(problem);
        match self.exchange(&post, &[]) {
            Err(e) => e,
            Ok(()) => unreachable!("validation fails on a post with a problem"),
        }
    }

    /// Runs collective `kind` on `dst` (written; `which` names it) and `src` (read), both
    /// locked for the whole call; a buffer this rank cannot use takes part in the exchange
    /// only to report why.
    fn with_storage(
        &mut self,
        kind: OpKind,
        dst: &Tensor,
        which: &'static str,
        src: Option<&Tensor>,
        body: impl FnOnce(&mut Self, RawBuf, Option<RawBuf>) -> Result<()>,
    ) -> Result<()> {
        with_checked_bufs(self, kind, dst, which, src, Self::fail_with, body)
    }

    fn post(&self, kind: OpKind) -> Post {
        Post::new(Kind::Op(kind), self.seq)
    }

    /// Reduces, for every rank `j`, elements `ranges[j]` of the ranks' `src` onto rank `j`:
    /// this rank's range, reduced over the ranks in order, lands at `dst` (which may be this
    /// rank's own range of `src`, exactly). `root`: only that rank receives and reduces (the
    /// others send it their range `ranges[root]`).
    fn reduce_ranges(
        &mut self,
        src: RawBuf,
        ranges: &[(usize, usize)],
        dst: *mut u8,
        op: ReduceOp,
        root: Option<usize>,
    ) -> Result<()> {
        let (ws, rank) = (self.ws(), self.rank());
        let size = src.dtype.size_in_bytes();
        let seg = (SEGMENT_BYTES / size).max(1);
        let receives = root.is_none_or(|r| r == rank);
        let (_, mine) = ranges[rank];
        let need = if receives { (ws - 1) * seg * size } else { 0 };
        if self.comm.scratch.len() * 8 < need {
            self.comm.scratch = vec![0u64; need.div_ceil(8)];
        }
        let scratch = self.comm.scratch.as_mut_ptr() as *mut u8;
        let longest = ranges.iter().map(|r| r.1).max().unwrap_or(0);
        let mut off = 0;
        while off < longest {
            let sends: Vec<Io> = (0..ws)
                .filter(|&j| j != rank && root.is_none_or(|r| r == j))
                .filter(|&j| off < ranges[j].1)
                .map(|j| Io {
                    peer: j,
                    ptr: src.ptr.wrapping_add((ranges[j].0 + off) * size),
                    len: seg.min(ranges[j].1 - off) * size,
                })
                .collect();
            let n = seg.min(mine.saturating_sub(off));
            let slot = |j: usize| scratch.wrapping_add((j - usize::from(j > rank)) * seg * size);
            let recvs: Vec<Io> = match receives && n > 0 {
                true => (0..ws)
                    .filter(|&j| j != rank)
                    .map(|j| Io {
                        peer: j,
                        ptr: slot(j),
                        len: n * size,
                    })
                    .collect(),
                false => Vec::new(),
            };
            self.transfer(&sends, &recvs)?;
            if receives && n > 0 {
                let own = src.ptr.wrapping_add((ranges[rank].0 + off) * size);
                let srcs: Vec<*const u8> = (0..ws)
                    .map(|j| match j == rank {
                        true => own as *const u8,
                        false => slot(j) as *const u8,
                    })
                    .collect();
                let out = dst.wrapping_add(off * size);
                // SAFETY: every source holds `n` elements (this rank's input, locked, or the
                // scratch filled just now); `out` is this rank's locked output (or exactly its
                // own source), written by nobody else.
                with_elem!(src.dtype, T => unsafe {
                    let srcs: Vec<*const T> = srcs.iter().map(|p| *p as *const T).collect();
                    reduce_into::<T>(&srcs, out as *mut T, n, op, ws)
                });
            }
            off += seg;
        }
        Ok(())
    }

    pub(super) fn all_gather(&mut self, input: &Tensor, output: &Tensor) -> Result<()> {
        let kind = OpKind::AllGather;
        self.with_storage(kind, output, "output", Some(input), |ctx, out, src| {
            let src = src.expect("all-gather has an input");
            let mut post = ctx.post(kind);
            post.input = Some(src);
            post.output = Some(out);
            ctx.exchange(&post, &[])?;
            let (ws, rank) = (ctx.ws(), ctx.rank());
            let bytes = src.len * src.dtype.size_in_bytes();
            // SAFETY: validated posts: `out` holds ws * src.len elements, distinct from `src`.
            unsafe {
                std::ptr::copy_nonoverlapping(src.ptr, out.ptr.add(rank * bytes), bytes);
            }
            let peers = (0..ws).filter(|&j| j != rank);
            let sends: Vec<Io> = peers
                .clone()
                .map(|j| Io {
                    peer: j,
                    ptr: src.ptr,
                    len: bytes,
                })
                .collect();
            let recvs: Vec<Io> = peers
                .map(|j| Io {
                    peer: j,
                    ptr: out.ptr.wrapping_add(j * bytes),
                    len: bytes,
                })
                .collect();
            ctx.transfer(&sends, &recvs)
        })
    }

    pub(super) fn reduce_scatter(
        &mut self,
        input: &Tensor,
        output: &Tensor,
        op: ReduceOp,
    ) -> Result<()> {
        let kind = OpKind::ReduceScatter;
        self.with_storage(kind, output, "output", Some(input), |ctx, out, src| {
            let src = src.expect("reduce-scatter has an input");
            let mut post = ctx.post(kind);
            post.input = Some(src);
            post.output = Some(out);
            post.op = Some(op);
            ctx.exchange(&post, &[])?;
            let ranges: Vec<(usize, usize)> =
                (0..ctx.ws()).map(|j| (j * out.len, out.len)).collect();
            ctx.reduce_ranges(src, &ranges, out.ptr, op, None)
        })
    }

    pub(super) fn all_reduce(&mut self, buf: &Tensor, op: ReduceOp) -> Result<()> {
        let kind = OpKind::AllReduce;
        self.with_storage(kind, buf, "buffer", None, |ctx, mine, _| {
            let mut post = ctx.post(kind);
            post.input = Some(mine);
            post.op = Some(op);
            ctx.exchange(&post, &[])?;
            let (ws, rank) = (ctx.ws(), ctx.rank());
            let size = mine.dtype.size_in_bytes();
            let ranges: Vec<(usize, usize)> = (0..ws).map(|j| chunk(mine.len, ws, j)).collect();
            let own = mine.ptr.wrapping_add(ranges[rank].0 * size);
            ctx.reduce_ranges(mine, &ranges, own, op, None)?;
            // All-gather of the reduced chunks.
            let peers = (0..ws).filter(|&j| j != rank);
            let sends: Vec<Io> = peers
                .clone()
                .map(|j| Io {
                    peer: j,
                    ptr: own,
                    len: ranges[rank].1 * size,
                })
                .collect();
            let recvs: Vec<Io> = peers
                .map(|j| Io {
                    peer: j,
                    ptr: mine.ptr.wrapping_add(ranges[j].0 * size),
                    len: ranges[j].1 * size,
                })
                .collect();
            ctx.transfer(&sends, &recvs)
        })
    }

    pub(super) fn broadcast(&mut self, buf: &Tensor, root: usize) -> Result<()> {
        let kind = OpKind::Broadcast;
        self.with_storage(kind, buf, "buffer", None, |ctx, mine, _| {
            let mut post = ctx.post(kind);
            post.input = Some(mine);
            post.root = Some(root);
            ctx.exchange(&post, &[])?;
            let bytes = mine.len * mine.dtype.size_in_bytes();
            let (ws, rank) = (ctx.ws(), ctx.rank());
            let io = |peer| Io {
                peer,
                ptr: mine.ptr,
                len: bytes,
            };
            match rank == root {
                true => {
                    let sends: Vec<Io> = (0..ws).filter(|&j| j != root).map(io).collect();
                    ctx.transfer(&sends, &[])
                }
                false => ctx.transfer(&[], &[io(root)]),
            }
        })
    }

    pub(super) fn reduce(&mut self, buf: &Tensor, root: usize, op: ReduceOp) -> Result<()> {
        let kind = OpKind::Reduce;
        self.with_storage(kind, buf, "buffer", None, |ctx, mine, _| {
            let mut post = ctx.post(kind);
            post.input = Some(mine);
            post.op = Some(op);
            post.root = Some(root);
            ctx.exchange(&post, &[])?;
            // Every rank's "range" is the whole buffer; only the root receives and reduces.
            let ranges = vec![(0, mine.len); ctx.ws()];
            ctx.reduce_ranges(mine, &ranges, mine.ptr, op, Some(root))
        })
    }

    pub(super) fn barrier(&mut self) -> Result<()> {
        let post = self.post(OpKind::Barrier);
        self.exchange(&post, &[])
    }
}
