//! The TCP backend's [`Link`]: one rank's messages on one communicator's connections, over
//! which the collectives of `comm::engine::messages` run (setup operations on the caller's
//! thread).
//!
//! Every operation starts with a descriptor frame sent to every peer (the [`Post`] the other
//! backends validate, encoded by `comm::wire`, or a goodbye from a rank whose group was
//! dropped). Sockets are non-blocking; [`Ctx::transfer_now`] writes and reads every peer's queue
//! as the kernel accepts, sleeping in `poll` at most 50 ms at a time, and between two polls
//! looks at the job's failure slot and the deadline (the group's timeout without a byte moving,
//! so a large buffer on a slow network is not cut short). A connection that breaks fails the
//! operation with [`Error::PeerFailed`] naming the peer (or [`Error::PeerExited`] when its
//! group was dropped).

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::Tcp;
use crate::comm::buffer::Post;
use crate::comm::engine::group::{OpCtx, Operation};
use crate::comm::engine::messages::{decode_and_validate, unreadable, Link, Msg};
use crate::comm::engine::{self, streams::StreamComm};
use crate::comm::wire;
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
const SEGMENT_BYTES: usize = 4 << 20;

/// One communicator of one rank: a connection to every peer (index = rank of the group;
/// `None` at this rank's index) and the receive space of its reductions.
pub(crate) struct Comm {
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

/// Moves as many bytes of `queue`'s messages (the last one first) as `step` moves without
/// blocking; returns whether any moved, or why the connection broke.
fn pump(
    queue: &mut Vec<Msg>,
    mut step: impl FnMut(&Msg) -> std::io::Result<usize>,
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
pub(super) type Ctx<'a> = OpCtx<'a, Tcp>;

impl Ctx<'_> {
    fn deadline(&self) -> Instant {
        engine::run::deadline_after(self.core.place.timeout)
    }

    fn peer_failed(&self, failure: (usize, String)) -> Error {
        engine::peer_failed(self.op, self.rank(), failure)
    }

    /// The error of peer `j` gone from this communicator: its goodbye (`broke`: `None`) or a
    /// broken connection to it (`broke`: what happened). The job's failure if the control plane
    /// reports one within a second (a failing rank aborts before it drops its group, and a
    /// peer's abort travels there), else [`Error::PeerExited`] if `j`'s group was dropped (or
    /// it said goodbye), else `j`'s death (recorded for the job).
    fn gone(&self, j: usize, broke: Option<&str>) -> Error {
        let net = &self.core.net;
        let job_rank = self.core.root_ranks[j];
        let until = Instant::now() + Duration::from_secs(1);
        while net.failure().is_none() && !net.departed(job_rank) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(2));
        }
        if let Some(f) = net.failure() {
            return self.peer_failed(f);
        }
        let Some(what) = broke.filter(|_| !net.departed(job_rank)) else {
            let (op, rank) = (self.op.to_string(), self.rank());
            return Error::PeerExited {
                op,
                rank,
                departed: j,
            };
        };
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
    fn transfer_now(&mut self, sends: &[Msg], recvs: &[Msg]) -> Result<()> {
        let mut deadline = self.deadline();
        let ws = self.world_size();
        let mut sq: Vec<Vec<Msg>> = vec![Vec::new(); ws];
        let mut rq: Vec<Vec<Msg>> = vec![Vec::new(); ws];
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
                broke.map_err(|what| self.gone(j, Some(&what)))?;
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
                deadline = self.deadline();
            } else if now >= deadline {
                let reason = format!("timed out in {}", self.op);
                self.core
                    .net
                    .abort(self.core.root_ranks[self.rank()], &reason);
                return Err(Error::Timeout {
                    op: self.op.to_string(),
                    rank: self.rank(),
                    timeout: self.core.place.timeout,
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
            super::net::poll(&mut fds, wait.as_millis().max(1) as libc::c_int);
        }
    }
}

impl Link for Ctx<'_> {
    /// The messages to move: a TCP transfer moves bytes only while it is finished.
    type Pending = (Vec<Msg>, Vec<Msg>);
    const SEGMENT_BYTES: usize = SEGMENT_BYTES;
    /// Bytes move only while a transfer is finished.
    const ROUNDS_IN_FLIGHT: usize = 1;

    /// Sends this rank's `post` to every peer, receives theirs and validates all of them (the
    /// same verdict on every rank).
    fn exchange(&mut self, post: &Post) -> Result<()> {
        let rank = self.rank();
        let desc = wire::encode_within(post, SETUP_MAX);
        if let Some(f) = self.core.net.failure() {
            return Err(self.peer_failed(f));
        }
        let mut mine = [0u8; FRAME];
        mine[0] = TAG_DESC;
        mine[4..8].copy_from_slice(&(desc.len() as u32).to_le_bytes());
        let head = desc.len().min(INLINE);
        mine[8..8 + head].copy_from_slice(&desc[..head]);
        let mut frames = vec![[0u8; FRAME]; self.world_size()];
        let peers = self.peers();
        let sends = Msg::each(&peers, |_| (mine.as_mut_ptr(), FRAME));
        let recvs = Msg::each(&peers, |j| (frames[j].as_mut_ptr(), FRAME));
        self.transfer_now(&sends, &recvs)?;
        if let Some(&j) = peers.iter().find(|&&j| frames[j][0] == TAG_BYE) {
            return Err(self.gone(j, None));
        }
        let announced = |f: &[u8; FRAME]| u32::from_le_bytes(f[4..8].try_into().expect("4 bytes"));
        if let Some(&j) = (peers.iter())
            .find(|&&j| frames[j][0] != TAG_DESC || announced(&frames[j]) as usize > SETUP_MAX)
        {
            return Err(unreadable(self.op, j, rank));
        }
        // The rest of long (setup) descriptors, sent after the frame.
        let mut descs: Vec<Vec<u8>> = (frames.iter().enumerate())
            .map(|(j, f)| match j == rank {
                true => desc.clone(),
                false => {
                    let len = announced(f) as usize;
                    let mut d = f[8..8 + len.min(INLINE)].to_vec();
                    d.resize(len, 0);
                    d
                }
            })
            .collect();
        let rest = desc.get(INLINE..).unwrap_or_default();
        let sends = Msg::each(&peers, |_| (rest.as_ptr() as *mut u8, rest.len()));
        let recvs = Msg::each(&peers, |j| match descs[j].get_mut(INLINE..) {
            Some(rest) => (rest.as_mut_ptr(), rest.len()),
            None => (std::ptr::null_mut(), 0),
        });
        self.transfer_now(&sends, &recvs)?;
        decode_and_validate(self.op, rank, &descs)
    }

    fn start(&mut self, sends: &[Msg], recvs: &[Msg]) -> Result<Self::Pending> {
        Ok((sends.to_vec(), recvs.to_vec()))
    }

    fn finish(&mut self, (sends, recvs): Self::Pending) -> Result<()> {
        self.transfer_now(&sends, &recvs)
    }

    fn scratch(&mut self, bytes: usize) -> *mut u8 {
        if self.comm.scratch.len() * 8 < bytes {
            self.comm.scratch = vec![0u64; bytes.div_ceil(8)];
        }
        self.comm.scratch.as_mut_ptr() as *mut u8
    }
}
