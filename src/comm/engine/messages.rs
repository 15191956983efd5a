//! The collectives of the message-passing host backends (TCP, MPI), written once over a
//! [`Link`]: one rank's point-to-point messages on one communicator.
//!
//! Every collective first exchanges descriptors ([`Link::exchange`]: the [`Post`] every backend
//! validates, so a mismatch is the same [`crate::Error::CollectiveMismatch`] /
//! [`crate::Error::BadBuffer`] on every rank and the group stays usable), then moves the data by
//! direct exchange (`ws` ranks, `n` elements per rank's share, this rank `r`):
//! - **all-gather**: every rank sends its input to every peer, received straight into
//!   `output[j*n..]`; its own part is a local copy.
//! - **reduce-scatter**: every rank sends `input[j*n..(j+1)*n]` to rank `j` and reduces the
//!   shares it receives *in rank order* with the thread backend's kernel
//!   ([`crate::comm::reduce::reduce_raw`]: f32, bf16 and f16 accumulate in f32 and round once),
//!   in segments of [`Link::SEGMENT_BYTES`] per peer (round k+1 is started before segment k is
//!   reduced, so on a link that moves bytes at the start, MPI's, peers are not held up by this
//!   rank's arithmetic; a segment is reduced while still in cache). bf16/f16 travel at their own width and no
//!   transport reduction is involved, so the result is **bitwise the thread backend's**, for
//!   every dtype and op.
//! - **all-reduce**: the reduce-scatter above over `ws` nearly equal chunks, in place, then the
//!   all-gather of the chunks.
//! - **broadcast**: the root sends to every rank. **reduce**: every rank sends to the root,
//!   which reduces in rank order (segmented like reduce-scatter). **barrier**: the descriptor
//!   exchange alone.
//!
//! Each rank sends and receives `(ws - 1) · n` elements per all-gather or reduce-scatter (what
//! ring algorithms move, bandwidth-optimal) in `ws - 1` messages each way: latency grows with
//! the world size, which suits the few-to-tens of CPU processes these backends target.

use candle_core::{DType, Tensor};

use super::group::Operation;
use crate::comm::buffer::{validate, with_checked_bufs, Kind, Post, RawBuf};
use crate::comm::reduce::{chunk, reduce_raw};
use crate::comm::{wire, Call, OpKind, ReduceOp};
use crate::error::{Error, Result};

/// A message of a transfer: the peer (rank of the group), the address and length in bytes.
///
/// A send's bytes stay alive and unchanged, a receive's are written by nobody else, until the
/// transfer completed (or, when it failed, as long as the transport says: see
/// [`Link::failed`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Msg {
    /// Rank of the group at the other end.
    pub peer: usize,
    /// First byte.
    pub ptr: *mut u8,
    /// Length in bytes.
    pub len: usize,
}

// SAFETY: a plain address, dereferenced only by the transfer under the rules above.
unsafe impl Send for Msg {}

impl Msg {
    pub(crate) fn new(peer: usize, ptr: *mut u8, len: usize) -> Msg {
        Msg { peer, ptr, len }
    }

    /// One message to or from each of `peers`: `at(j)` is the address and length of peer `j`'s.
    pub(crate) fn each(peers: &[usize], mut at: impl FnMut(usize) -> (*mut u8, usize)) -> Vec<Msg> {
        let msg = |j| {
            let (ptr, len) = at(j);
            Msg::new(j, ptr, len)
        };
        peers.iter().copied().map(msg).collect()
    }
}

/// One rank's messages on one communicator, for one operation: what a message-passing
/// transport implements.
pub(crate) trait Link: Operation {
    /// Messages started and not yet finished.
    type Pending;
    /// Bytes per peer and round of the reducing exchanges (see the module docs).
    const SEGMENT_BYTES: usize;
    /// Rounds of a reducing exchange whose receive space is in use at once: 2 for a link
    /// whose [`Link::start`] moves bytes (round k+1's receives land while segment k is
    /// reduced), 1 for one that moves them only in [`Link::finish`].
    const ROUNDS_IN_FLIGHT: usize;

    /// The operation's buffers are locked and its exchange is about to start (a link that
    /// gives each operation one deadline starts it here, not while waiting for the locks).
    fn start_clock(&mut self) {}
    /// Sends this rank's `post` to every peer, receives theirs, and validates all of them
    /// ([`decode_and_validate`]).
    fn exchange(&mut self, post: &Post) -> Result<()>;
    /// Starts `sends` and `recvs` (a transport may move nothing before [`Link::finish`]).
    fn start(&mut self, sends: &[Msg], recvs: &[Msg]) -> Result<Self::Pending>;
    /// Completes the messages of `pending`.
    fn finish(&mut self, pending: Self::Pending) -> Result<()>;
    /// Receive space of at least `bytes` bytes, 8-byte aligned, reused across operations (its
    /// contents are not kept).
    fn scratch(&mut self, bytes: usize) -> *mut u8;
    /// The operation failed while its messages may still use `dst` and `src` (the transport
    /// keeps them allocated if it must).
    fn failed(&mut self, dst: &Tensor, src: Option<&Tensor>) {
        let _ = (dst, src);
    }

    /// Sends `sends` and receives `recvs`, and waits for all.
    fn transfer(&mut self, sends: &[Msg], recvs: &[Msg]) -> Result<()> {
        let pending = self.start(sends, recvs)?;
        self.finish(pending)
    }
}

/// Decodes every rank's descriptor (`descs[j]`, this rank's own included) and validates them
/// all: the same verdict on every rank.
pub(crate) fn decode_and_validate(op: &str, rank: usize, descs: &[Vec<u8>]) -> Result<()> {
    let posts = (descs.iter().enumerate())
        .map(|(j, d)| wire::decode(d).ok_or_else(|| unreadable(op, j, rank)))
        .collect::<Result<Vec<_>>>()?;
    validate(op, descs.len(), &posts)
}

/// The error of rank `j`'s descriptor that this rank cannot read.
pub(crate) fn unreadable(op: &str, j: usize, rank: usize) -> Error {
    Error::CollectiveMismatch {
        op: op.to_string(),
        rank: j,
        found: "a descriptor this version cannot read".into(),
        other_rank: rank,
        expected: "a candle-fsdp collective descriptor".into(),
    }
}

/// Runs `collective` (`None`: a barrier) on `link`; see the module docs.
pub(crate) fn run<L: Link>(
    link: &mut L,
    collective: Option<(Call, &Tensor, Option<&Tensor>)>,
) -> Result<()> {
    let Some((call, buf, input)) = collective else {
        let post = Post::new(Kind::Op(OpKind::Barrier), link.seq());
        return link.exchange(&post);
    };
    let (kind, seq) = (call.kind(), link.seq());
    let result = with_checked_bufs(
        link,
        kind,
        seq,
        buf,
        input,
        L::exchange,
        |link, dst, src| {
            link.start_clock();
            let post = Post::of_call(call, link.seq(), dst, src);
            link.exchange(&post)?;
            match (call, src) {
                (Call::AllGather, Some(src)) => all_gather(link, src, dst),
                (Call::ReduceScatter(op), Some(src)) => reduce_scatter(link, src, dst, op),
                (Call::AllReduce(op), _) => all_reduce(link, dst, op),
                (Call::Broadcast(root), _) => broadcast(link, dst, root),
                (Call::Reduce(root, op), _) => reduce(link, dst, root, op),
                _ => unreachable!("all-gather and reduce-scatter have an input"),
            }
        },
    );
    if result.is_err() {
        link.failed(buf, input);
    }
    result
}

fn all_gather<L: Link>(link: &mut L, src: RawBuf, out: RawBuf) -> Result<()> {
    let bytes = src.len * src.dtype.size_in_bytes();
    // SAFETY: validated posts: `out` holds ws * src.len elements, distinct from `src`.
    unsafe { std::ptr::copy_nonoverlapping(src.ptr, out.ptr.add(link.rank() * bytes), bytes) };
    let peers = link.peers();
    let sends = Msg::each(&peers, |_| (src.ptr, bytes));
    let recvs = Msg::each(&peers, |j| (out.ptr.wrapping_add(j * bytes), bytes));
    link.transfer(&sends, &recvs)
}

fn reduce_scatter<L: Link>(link: &mut L, src: RawBuf, out: RawBuf, op: ReduceOp) -> Result<()> {
    let (n, es) = (out.len, out.dtype.size_in_bytes());
    let peers = link.peers();
    let sends: Vec<Share> = peers
        .iter()
        .map(|&j| (j, src.ptr.wrapping_add(j * n * es) as *const u8, n))
        .collect();
    let own = src.ptr.wrapping_add(link.rank() * n * es) as *const u8;
    let into = Landing {
        own,
        dst: out.ptr,
        elems: n,
        dtype: out.dtype,
        op,
    };
    reduce_exchange(link, &sends, &peers, into)
}

fn all_reduce<L: Link>(link: &mut L, mine: RawBuf, op: ReduceOp) -> Result<()> {
    let es = mine.dtype.size_in_bytes();
    let (ws, rank) = (link.world_size(), link.rank());
    let (my_start, my_n) = chunk(mine.len, ws, rank);
    let peers = link.peers();
    let at = |start: usize| mine.ptr.wrapping_add(start * es);
    // Phase 1: reduce-scatter of the chunks, in place.
    let sends: Vec<Share> = peers
        .iter()
        .map(|&j| {
            let (s, n) = chunk(mine.len, ws, j);
            (j, at(s) as *const u8, n)
        })
        .collect();
    let own = at(my_start);
    let into = Landing {
        own,
        dst: own,
        elems: my_n,
        dtype: mine.dtype,
        op,
    };
    reduce_exchange(link, &sends, &peers, into)?;
    // Phase 2: all-gather of the reduced chunks.
    let recvs = Msg::each(&peers, |j| {
        let (start, n) = chunk(mine.len, ws, j);
        (at(start), n * es)
    });
    let sends = Msg::each(&peers, |_| (at(my_start), my_n * es));
    link.transfer(&sends, &recvs)
}

fn broadcast<L: Link>(link: &mut L, mine: RawBuf, root: usize) -> Result<()> {
    let whole = |_| (mine.ptr, mine.len * mine.dtype.size_in_bytes());
    match link.rank() == root {
        true => link.transfer(&Msg::each(&link.peers(), whole), &[]),
        false => link.transfer(&[], &Msg::each(&[root], whole)),
    }
}

fn reduce<L: Link>(link: &mut L, mine: RawBuf, root: usize, op: ReduceOp) -> Result<()> {
    let into = |elems| Landing {
        own: mine.ptr,
        dst: mine.ptr,
        elems,
        dtype: mine.dtype,
        op,
    };
    match link.rank() == root {
        true => {
            let peers = link.peers();
            reduce_exchange(link, &[], &peers, into(mine.len))
        }
        false => reduce_exchange(
            link,
            &[(root, mine.ptr as *const u8, mine.len)],
            &[],
            into(0),
        ),
    }
}

/// A share this rank sends: peer, first byte, elements.
type Share = (usize, *const u8, usize);

/// Where a reducing exchange lands on this rank: `elems` elements of `dtype`, its own
/// contribution read at `own`, the result written at `dst` (equal to `own` or disjoint from
/// every source), reduced with `op`.
#[derive(Clone, Copy)]
struct Landing {
    own: *const u8,
    dst: *mut u8,
    elems: usize,
    dtype: DType,
    op: ReduceOp,
}

/// The reduction exchange behind reduce-scatter, all-reduce and reduce, in segments of
/// [`Link::SEGMENT_BYTES`]: in round k every rank sends segment k of each `sends` share to its
/// peer and receives segment k of its own share from every rank in `recv_from`, then reduces
/// segment k over all ranks in rank order into `into.dst`. Round k+1 is started before segment
/// k is reduced ([`Link::ROUNDS_IN_FLIGHT`] scratch buffers of one segment per peer). Every rank
/// runs the same number of rounds (the longest share's segments), so the rounds cannot
/// deadlock.
fn reduce_exchange<L: Link>(
    link: &mut L,
    sends: &[Share],
    recv_from: &[usize],
    into: Landing,
) -> Result<()> {
    let es = into.dtype.size_in_bytes();
    let seg = (L::SEGMENT_BYTES / es).max(1);
    let longest = sends.iter().map(|s| s.2).fold(into.elems, usize::max);
    let rounds = longest.div_ceil(seg);
    let (ws, rank) = (link.world_size(), link.rank());
    let stride = (seg * es).div_ceil(8) * 8;
    let slots = match recv_from.is_empty() {
        true => 0,
        false => L::ROUNDS_IN_FLIGHT * (ws - 1),
    };
    let scratch = link.scratch(slots * stride);
    // Scratch slot of peer `j` (not this rank) for round `k`, alternating between the rounds
    // in flight.
    let slot = |k: usize, j: usize| {
        let peer = j - usize::from(j > rank);
        scratch.wrapping_add(((k % L::ROUNDS_IN_FLIGHT) * (ws - 1) + peer) * stride)
    };
    let piece = |k: usize, elems: usize| elems.saturating_sub(k * seg).min(seg);
    let start_round = |link: &mut L, k: usize| {
        let recv_n = piece(k, into.elems);
        let recvs: Vec<Msg> = recv_from
            .iter()
            .filter(|_| recv_n > 0)
            .map(|&j| Msg::new(j, slot(k, j), recv_n * es))
            .collect();
        let sends: Vec<Msg> = sends
            .iter()
            .filter(|s| piece(k, s.2) > 0)
            .map(|&(peer, ptr, elems)| {
                let ptr = ptr.wrapping_add(k * seg * es) as *mut u8;
                Msg::new(peer, ptr, piece(k, elems) * es)
            })
            .collect();
        link.start(&sends, &recvs)
    };
    let mut next = (rounds > 0).then(|| start_round(link, 0)).transpose()?;
    for k in 0..rounds {
        let current = next.take().expect("round k was started");
        link.finish(current)?;
        if k + 1 < rounds {
            next = Some(start_round(link, k + 1)?);
        }
        let recv_n = piece(k, into.elems);
        if recv_n == 0 {
            continue;
        }
        let srcs: Vec<*const u8> = (0..ws)
            .map(|j| match j == rank {
                true => into.own.wrapping_add(k * seg * es),
                false => slot(k, j) as *const u8,
            })
            .collect();
        let out = RawBuf {
            ptr: into.dst.wrapping_add(k * seg * es),
            len: recv_n,
            dtype: into.dtype,
        };
        // SAFETY: each source holds `recv_n` elements of the dtype (a received segment in an
        // 8-byte aligned scratch slot that round k+1 does not touch, or this rank's own share at
        // an element boundary); `out` is this rank's write-locked destination, equal to its own
        // source or disjoint from every source, and disjoint from the scratch and from every
        // segment round k+1 sends.
        unsafe { reduce_raw(out, &srcs, into.op, ws) };
    }
    Ok(())
}
