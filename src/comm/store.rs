//! A small TCP key-value store for bootstrapping a process-per-rank job, like PyTorch's
//! `TCPStore`: rank 0 serves it at `MASTER_ADDR:MASTER_PORT`, every rank (rank 0 included)
//! connects to it as a client, and the ranks exchange what they need before their process
//! group exists (the NCCL unique id: rank 0 [`TcpStore::set`]s its 128 bytes, the others
//! [`TcpStore::get`] them).
//!
//! ```no_run
//! use std::time::Duration;
//! use candle_fsdp::comm::store::TcpStore;
//!
//! # fn nccl_unique_id() -> Vec<u8> { vec![0; 128] }
//! # let (rank, world_size) = (0, 2);
//! let store = TcpStore::connect("127.0.0.1", 29500, rank, world_size, Duration::from_secs(30))?;
//! let id = if store.rank() == 0 {
//!     let id = nccl_unique_id();
//!     store.set("nccl_id", &id)?;
//!     id
//! } else {
//!     store.get("nccl_id")?
//! };
//! store.barrier("nccl_init")?;
//! # Ok::<(), candle_fsdp::Error>(())
//! ```
//!
//! # Behaviour
//!
//! - [`TcpStore::connect`] on rank 0 binds the port on every interface of its family (like
//!   `TCPStore`, so that other machines reach it whatever `MASTER_ADDR` resolves to on rank 0's
//!   own machine) and serves from background threads. Every rank then connects to
//!   `addr:port`, retrying until the timeout (rank 0 may start after the others), registers its
//!   rank, and waits until every rank has registered.
//! - One timeout (given to `connect`) bounds each operation: joining, each `get`, each
//!   `barrier`; a `set` (answered at once by a live server) waits for its reply at most that
//!   timeout plus 10 s.
//! - Threads of one rank may share its `TcpStore` (it is `Send + Sync`): their requests take
//!   turns on its one connection, and a `set` waits at most one polling round (100 ms) behind
//!   another thread's waiting `get` or `barrier`.
//! - A key set twice keeps the second value. Keys are UTF-8, at most [`MAX_KEY_BYTES`] bytes;
//!   values at most [`MAX_VALUE_BYTES`] bytes.
//! - A rank whose connection closes (its process exited, or it dropped its `TcpStore`) has
//!   *left*: a barrier waiting for it fails at once instead of at the timeout. A client whose
//!   connection to the server closes (rank 0's process exited) fails its current and later
//!   operations with "lost the connection".
//! - Dropping rank 0's `TcpStore` stops accepting new connections and frees the port once the
//!   acceptor has stopped; clients already connected keep being served until they disconnect,
//!   so rank 0 may drop its store right after `set` without failing a slower rank's `get`.
//! - The store has no authentication: it is for a job's own network.
//!
//! # Errors
//!
//! Every failure is an [`Error::Store`] naming the rank, the store's `host:port` and what is
//! missing: the ranks that did not join or reach a barrier (also in its `missing` field), the key
//! that was not set, the OS error of a bind or connect; arguments that cannot work
//! (`world_size` 0, `rank >= world_size`, port 0, a key or value over the bounds) are
//! [`Error::InvalidArgument`].
//!
//! # Protocol (version 1)
//!
//! Every message is a frame: a `u32` length `n` (big-endian, like every integer here) then `n`
//! bytes of body, `1 <= n <= MAX_FRAME_BYTES`; a longer announced length is refused (an error
//! reply, then the connection is closed) without reading or allocating it. A body is a one-byte
//! opcode and its fields; `bytes` is a `u32` length and that many bytes, `ranks` a `u32` count
//! and that many `u32`s, `strings` a `u32` count and that many `bytes`.
//!
//! | request (client → server) | opcode | fields | replies |
//! |---|---|---|---|
//! | `HELLO` (must come first) | 1 | magic `b"CFSDPKV1"`, rank `u32`, world size `u32` | `OK`, `ERR` |
//! | `SET` | 2 | key `bytes`, value `bytes` | `OK` |
//! | `GET` | 3 | key `bytes`, wait `u32` (ms) | `VALUE`, `NOT_YET` |
//! | `JOINED` | 4 | wait `u32` (ms) | `DONE`, `PENDING` |
//! | `BARRIER` | 5 | name `bytes`, generation `u64`, wait `u32` (ms) | `DONE`, `PENDING` |
//!
//! | reply (server → client) | opcode | fields |
//! |---|---|---|
//! | `OK` | 0x80 | |
//! | `VALUE` | 0x81 | value `bytes` |
//! | `NOT_YET` | 0x82 | |
//! | `DONE` | 0x83 | |
//! | `PENDING` | 0x84 | missing `ranks`, left `ranks`, notes `strings` |
//! | `ERR` | 0xFF | message `bytes` (UTF-8) |
//!
//! The server answers each request before reading the next. A waiting request (`GET`,
//! `JOINED`, `BARRIER`) blocks on the server for at most its `wait` (the client asks for at
//! most 100 ms at a time and repeats until its own deadline, so a connection is never held
//! for long and a dead server is noticed within one round), and answers as soon as the key is
//! set or the ranks are there. `BARRIER` records the sender's arrival at `(name, generation)`;
//! each client counts the barriers of one name, so every rank calling `barrier("x")` for the
//! n-th time meets at generation n. `PENDING` lists the ranks not yet registered (`JOINED`) or
//! not yet arrived (`BARRIER`), which of those have left, and, for `JOINED`, the registrations
//! the server refused (wrong world size, duplicate rank), so that rank 0 can name them.
//! `ERR` to `HELLO` or to a malformed request closes the connection.

use std::collections::{BTreeSet, HashMap};
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Longest key, in bytes (UTF-8).
pub const MAX_KEY_BYTES: usize = 1024;
/// Longest value, in bytes (16 MiB).
pub const MAX_VALUE_BYTES: usize = 16 << 20;
/// Longest frame body either side accepts, in bytes: a value, its key and the fields around
/// them.
pub const MAX_FRAME_BYTES: usize = MAX_VALUE_BYTES + 2 * MAX_KEY_BYTES + 64;

/// Protocol magic and version, sent in `HELLO`.
const MAGIC: &[u8; 8] = b"CFSDPKV1";
/// Longest server-side wait of one request.
const WAIT_SLICE: Duration = Duration::from_millis(100);
/// How long a client waits for a reply beyond the server-side wait it asked for.
const REPLY_GRACE: Duration = Duration::from_secs(10);
/// Registration refusals kept for `PENDING` notes.
const MAX_NOTES: usize = 8;
/// How often the acceptor checks for shutdown.
const ACCEPT_POLL: Duration = Duration::from_millis(20);

mod op {
    pub const HELLO: u8 = 1;
    pub const SET: u8 = 2;
    pub const GET: u8 = 3;
    pub const JOINED: u8 = 4;
    pub const BARRIER: u8 = 5;
    pub const OK: u8 = 0x80;
    pub const VALUE: u8 = 0x81;
    pub const NOT_YET: u8 = 0x82;
    pub const DONE: u8 = 0x83;
    pub const PENDING: u8 = 0x84;
    pub const ERR: u8 = 0xFF;
}

// ---------------------------------------------------------------------------------------------
// Wire format
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq)]
enum Request {
    Hello {
        rank: u32,
        world_size: u32,
    },
    Set {
        key: String,
        value: Vec<u8>,
    },
    Get {
        key: String,
        wait_ms: u32,
    },
    Joined {
        wait_ms: u32,
    },
    Barrier {
        name: String,
        generation: u64,
        wait_ms: u32,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Reply {
    Ok,
    Value(Vec<u8>),
    NotYet,
    Done,
    Pending {
        missing: Vec<u32>,
        left: Vec<u32>,
        notes: Vec<String>,
    },
    Err(String),
}

/// Body encoder.
struct Enc(Vec<u8>);

impl Enc {
    fn new(opcode: u8) -> Enc {
        Enc(vec![opcode])
    }
    fn u32(mut self, v: u32) -> Enc {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Enc {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn bytes(self, b: &[u8]) -> Enc {
        let mut e = self.u32(b.len() as u32);
        e.0.extend_from_slice(b);
        e
    }
    fn ranks(self, r: &[u32]) -> Enc {
        r.iter().fold(self.u32(r.len() as u32), |e, &v| e.u32(v))
    }
}

/// Body decoder; every read checks the remaining length.
struct Dec<'a>(&'a [u8]);

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err(format!(
                "truncated message: {n} more bytes expected, {} left",
                self.0.len()
            ));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn u8(&mut self) -> std::result::Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> std::result::Result<u32, String> {
        Ok(u32::from_be_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> std::result::Result<u64, String> {
        Ok(u64::from_be_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn bytes(&mut self, max: usize, what: &str) -> std::result::Result<&'a [u8], String> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(format!(
                "{what} of {n} bytes exceeds the limit of {max} bytes"
            ));
        }
        self.take(n)
    }
    fn string(&mut self, max: usize, what: &str) -> std::result::Result<String, String> {
        let b = self.bytes(max, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| format!("{what} is not UTF-8"))
    }
    fn ranks(&mut self) -> std::result::Result<Vec<u32>, String> {
        let n = self.u32()? as usize;
        if n > self.0.len() / 4 {
            return Err(format!("rank list of {n} entries exceeds the message"));
        }
        (0..n).map(|_| self.u32()).collect()
    }
    fn end(&self) -> std::result::Result<(), String> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(format!("{} unexpected trailing bytes", self.0.len()))
        }
    }
}

impl Request {
    fn encode(&self) -> Vec<u8> {
        match self {
            Request::Hello { rank, world_size } => {
                let mut e = Enc::new(op::HELLO);
                e.0.extend_from_slice(MAGIC);
                e.u32(*rank).u32(*world_size).0
            }
            Request::Set { key, value } => Enc::new(op::SET).bytes(key.as_bytes()).bytes(value).0,
            Request::Get { key, wait_ms } => {
                Enc::new(op::GET).bytes(key.as_bytes()).u32(*wait_ms).0
            }
            Request::Joined { wait_ms } => Enc::new(op::JOINED).u32(*wait_ms).0,
            Request::Barrier {
                name,
                generation,
                wait_ms,
            } => {
                Enc::new(op::BARRIER)
                    .bytes(name.as_bytes())
                    .u64(*generation)
                    .u32(*wait_ms)
                    .0
            }
        }
    }

    fn decode(body: &[u8]) -> std::result::Result<Request, String> {
        let mut d = Dec(body);
        let req = match d.u8()? {
            op::HELLO => {
                if d.take(MAGIC.len())? != MAGIC {
                    return Err("not a candle-fsdp store client (bad magic)".into());
                }
                Request::Hello {
                    rank: d.u32()?,
                    world_size: d.u32()?,
                }
            }
            op::SET => Request::Set {
                key: d.string(MAX_KEY_BYTES, "key")?,
                value: d.bytes(MAX_VALUE_BYTES, "value")?.to_vec(),
            },
            op::GET => Request::Get {
                key: d.string(MAX_KEY_BYTES, "key")?,
                wait_ms: d.u32()?,
            },
            op::JOINED => Request::Joined { wait_ms: d.u32()? },
            op::BARRIER => Request::Barrier {
                name: d.string(MAX_KEY_BYTES, "barrier name")?,
                generation: d.u64()?,
                wait_ms: d.u32()?,
            },
            other => return Err(format!("unknown request opcode {other:#04x}")),
        };
        d.end()?;
        Ok(req)
    }
}

impl Reply {
    fn encode(&self) -> Vec<u8> {
        match self {
            Reply::Ok => vec![op::OK],
            Reply::Value(v) => Enc::new(op::VALUE).bytes(v).0,
            Reply::NotYet => vec![op::NOT_YET],
            Reply::Done => vec![op::DONE],
            Reply::Pending {
                missing,
                left,
                notes,
            } => {
                notes
                    .iter()
                    .fold(
                        Enc::new(op::PENDING)
                            .ranks(missing)
                            .ranks(left)
                            .u32(notes.len() as u32),
                        |e, n| e.bytes(n.as_bytes()),
                    )
                    .0
            }
            Reply::Err(m) => Enc::new(op::ERR).bytes(m.as_bytes()).0,
        }
    }

    fn decode(body: &[u8]) -> std::result::Result<Reply, String> {
        let mut d = Dec(body);
        let reply = match d.u8()? {
            op::OK => Reply::Ok,
            op::VALUE => Reply::Value(d.bytes(MAX_VALUE_BYTES, "value")?.to_vec()),
            op::NOT_YET => Reply::NotYet,
            op::DONE => Reply::Done,
            op::PENDING => {
                let missing = d.ranks()?;
                let left = d.ranks()?;
                let n = d.u32()? as usize;
                if n > MAX_NOTES {
                    return Err(format!("{n} notes exceed the limit of {MAX_NOTES}"));
                }
                let notes = (0..n)
                    .map(|_| d.string(MAX_KEY_BYTES * 4, "note"))
                    .collect::<std::result::Result<_, _>>()?;
                Reply::Pending {
                    missing,
                    left,
                    notes,
                }
            }
            op::ERR => {
                Reply::Err(String::from_utf8_lossy(d.bytes(MAX_FRAME_BYTES, "error")?).into())
            }
            other => return Err(format!("unknown reply opcode {other:#04x}")),
        };
        d.end()?;
        Ok(reply)
    }
}

/// Why a frame could not be read.
#[derive(Debug)]
enum FrameError {
    /// The socket failed or closed (`UnexpectedEof` for a clean close).
    Io(io::Error),
    /// The announced length is 0 or over [`MAX_FRAME_BYTES`].
    BadLength(u32),
}

fn write_frame(w: &mut impl Write, body: &[u8]) -> io::Result<()> {
    debug_assert!(!body.is_empty() && body.len() <= MAX_FRAME_BYTES);
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_be_bytes());
    buf.extend_from_slice(body);
    w.write_all(&buf)?;
    w.flush()
}

fn read_frame(r: &mut impl Read) -> std::result::Result<Vec<u8>, FrameError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).map_err(FrameError::Io)?;
    let n = u32::from_be_bytes(len);
    if n == 0 || n as usize > MAX_FRAME_BYTES {
        return Err(FrameError::BadLength(n));
    }
    let mut body = vec![0u8; n as usize];
    r.read_exact(&mut body).map_err(FrameError::Io)?;
    Ok(body)
}

// ---------------------------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------------------------

struct State {
    world_size: usize,
    kv: HashMap<String, Vec<u8>>,
    /// Peer address of each registered rank.
    joined: Vec<Option<SocketAddr>>,
    /// Ranks whose connection has closed.
    left: Vec<bool>,
    /// Refused registrations, for rank 0's join error.
    refused: Vec<String>,
    /// Arrivals at each `(name, generation)` barrier.
    barriers: HashMap<(String, u64), BTreeSet<usize>>,
}

struct Shared {
    state: Mutex<State>,
    cond: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits on the condition variable until `done(state)` or `wait` has passed.
    fn wait_for<'a>(
        &'a self,
        mut guard: MutexGuard<'a, State>,
        wait: Duration,
        done: impl Fn(&State) -> bool,
    ) -> MutexGuard<'a, State> {
        let deadline = Instant::now() + wait;
        while !done(&guard) {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            guard = self
                .cond
                .wait_timeout(guard, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        guard
    }
}

/// Rank 0's server: the acceptor thread and its stop flag.
struct Server {
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
}

impl Server {
    /// Binds `port` on the wildcard address of `host`'s family and starts accepting.
    fn start(host: &str, port: u16, world_size: usize, display: &str) -> Result<Server> {
        let wildcard = match (host, port)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
        {
            Some(SocketAddr::V6(_)) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        };
        let bind_addr = SocketAddr::new(wildcard, port);
        let listener = TcpListener::bind(bind_addr)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| Error::Store {
                addr: display.to_string(),
                rank: 0,
                missing: vec![],
                message: format!(
                    "cannot serve the store at {display}: binding {bind_addr} failed: {e} \
                     (another job's store, or another program, may hold port {port}: choose \
                     another MASTER_PORT)"
                ),
            })?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                world_size,
                kv: HashMap::new(),
                joined: vec![None; world_size],
                left: vec![false; world_size],
                refused: Vec::new(),
                barriers: HashMap::new(),
            }),
            cond: Condvar::new(),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let acceptor = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("fsdp-store-accept".into())
                .spawn(move || accept_loop(listener, shared, stop))
                .map_err(|error| Error::SpawnFailed {
                    what: format!("the acceptor thread of the store at {display}"),
                    error,
                })?
        };
        Ok(Server {
            stop,
            acceptor: Some(acceptor),
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => {
                let shared = shared.clone();
                // A connection whose thread cannot start is dropped: its client sees the
                // connection close and reports it.
                let _ = std::thread::Builder::new()
                    .name("fsdp-store-conn".into())
                    .spawn(move || serve_connection(stream, peer, &shared));
            }
            // WouldBlock, or a transient failure (EMFILE, ECONNABORTED): wait and go on.
            Err(_) => std::thread::sleep(ACCEPT_POLL),
        }
    }
}

fn serve_connection(mut stream: TcpStream, peer: SocketAddr, shared: &Shared) {
    if stream.set_nonblocking(false).is_err() {
        return;
    }
    let _ = stream.set_nodelay(true);
    let mut rank: Option<usize> = None;
    loop {
        let body = match read_frame(&mut stream) {
            Ok(b) => b,
            Err(FrameError::Io(_)) => break,
            Err(FrameError::BadLength(n)) => {
                let msg =
                    format!("frame of {n} bytes refused: lengths are 1..={MAX_FRAME_BYTES} bytes");
                let _ = write_frame(&mut stream, &Reply::Err(msg).encode());
                close_after_error(&mut stream);
                break;
            }
        };
        let (reply, close) = match Request::decode(&body) {
            Err(msg) => (Reply::Err(format!("malformed request: {msg}")), true),
            Ok(req) => match (rank, req) {
                (
                    None,
                    Request::Hello {
                        rank: r,
                        world_size,
                    },
                ) => match register(shared, r as usize, world_size as usize, peer) {
                    Ok(()) => {
                        rank = Some(r as usize);
                        (Reply::Ok, false)
                    }
                    Err(msg) => (Reply::Err(msg), true),
                },
                (None, _) => (
                    Reply::Err("the first request of a connection must be HELLO".into()),
                    true,
                ),
                (Some(r), req) => (handle(shared, r, req), false),
            },
        };
        if write_frame(&mut stream, &reply.encode()).is_err() {
            break;
        }
        if close {
            close_after_error(&mut stream);
            break;
        }
    }
    if let Some(r) = rank {
        shared.lock().left[r] = true;
        shared.cond.notify_all();
    }
}

/// Ends a connection after an error reply so that the client reads the reply: closing a socket
/// with unread input resets the connection, which can discard the reply before the client reads
/// it. So: shut the sending side, then drain the client's bytes (at most 1 MiB, 200 ms).
fn close_after_error(stream: &mut TcpStream) {
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    let mut sink = [0u8; 8192];
    let mut drained = 0;
    while drained < (1 << 20) {
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
}

fn register(
    shared: &Shared,
    rank: usize,
    world_size: usize,
    peer: SocketAddr,
) -> std::result::Result<(), String> {
    let mut st = shared.lock();
    let refusal = if world_size != st.world_size {
        Some(format!(
            "rank {rank} (from {peer}) asked to join with world size {world_size}, but the store \
             (served by rank 0) has world size {}",
            st.world_size
        ))
    } else if rank >= st.world_size {
        Some(format!(
            "rank {rank} (from {peer}) is out of range for world size {}",
            st.world_size
        ))
    } else {
        st.joined[rank]
            .map(|first| format!("rank {rank} joined twice: from {first} and again from {peer}"))
    };
    match refusal {
        Some(msg) => {
            if st.refused.len() < MAX_NOTES {
                st.refused.push(msg.clone());
            }
            drop(st);
            shared.cond.notify_all();
            Err(msg)
        }
        None => {
            st.joined[rank] = Some(peer);
            drop(st);
            shared.cond.notify_all();
            Ok(())
        }
    }
}

fn wait_of(ms: u32) -> Duration {
    Duration::from_millis(ms as u64).min(WAIT_SLICE)
}

fn handle(shared: &Shared, rank: usize, req: Request) -> Reply {
    match req {
        Request::Hello { .. } => {
            Reply::Err(format!("this connection already registered rank {rank}"))
        }
        Request::Set { key, value } => {
            shared.lock().kv.insert(key, value);
            shared.cond.notify_all();
            Reply::Ok
        }
        Request::Get { key, wait_ms } => {
            let st = shared.wait_for(shared.lock(), wait_of(wait_ms), |s| s.kv.contains_key(&key));
            match st.kv.get(&key) {
                Some(v) => Reply::Value(v.clone()),
                None => Reply::NotYet,
            }
        }
        Request::Joined { wait_ms } => {
            let all = |s: &State| s.joined.iter().all(Option::is_some);
            let st = shared.wait_for(shared.lock(), wait_of(wait_ms), |s| {
                all(s) || !s.refused.is_empty()
            });
            if all(&st) {
                Reply::Done
            } else {
                Reply::Pending {
                    missing: (0..st.world_size)
                        .filter(|&r| st.joined[r].is_none())
                        .map(|r| r as u32)
                        .collect(),
                    left: vec![],
                    notes: st.refused.clone(),
                }
            }
        }
        Request::Barrier {
            name,
            generation,
            wait_ms,
        } => {
            let key = (name, generation);
            let mut st = shared.lock();
            st.barriers.entry(key.clone()).or_default().insert(rank);
            drop(st);
            shared.cond.notify_all();
            let missing = |s: &State| -> Vec<usize> {
                let arrived = &s.barriers[&key];
                (0..s.world_size).filter(|r| !arrived.contains(r)).collect()
            };
            let st = shared.wait_for(shared.lock(), wait_of(wait_ms), |s| {
                missing(s).iter().all(|&r| s.left[r]) // none missing, or only ones that left
            });
            let missing = missing(&st);
            if missing.is_empty() {
                Reply::Done
            } else {
                Reply::Pending {
                    left: missing
                        .iter()
                        .filter(|&&r| st.left[r])
                        .map(|&r| r as u32)
                        .collect(),
                    missing: missing.into_iter().map(|r| r as u32).collect(),
                    notes: vec![],
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------------------------

/// The client's connection, and why it is unusable after an error that may have left it out
/// of step with the server.
struct Conn {
    stream: TcpStream,
    broken: Option<String>,
}

/// One rank's handle on the job's key-value store (see the [module docs](self) for the
/// protocol and behaviour). `Send + Sync`: threads of a rank may share it; their requests take
/// turns on the one connection.
pub struct TcpStore {
    conn: Mutex<Conn>,
    /// Threads waiting for `conn`: a polling request (a `get` or `barrier` waiting for others)
    /// lets them go first, so that a `set` from another thread of the rank is not held up by a
    /// `get` that polls in a loop.
    queued: AtomicUsize,
    /// Generation of each barrier name: how many times this rank called it.
    barriers: Mutex<HashMap<String, u64>>,
    /// `host:port`, as named in errors.
    addr: String,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    /// Rank 0's server (dropped after `conn`, by field order).
    _server: Option<Server>,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStore")
            .field("addr", &self.addr)
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("timeout", &self.timeout)
            .field("serves", &self._server.is_some())
            .finish()
    }
}

/// `1.5 s`, `30 s`.
fn secs(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

fn display_addr(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

fn connect_once(host: &str, port: u16, wait: Duration) -> io::Result<TcpStream> {
    let mut last = io::Error::new(
        io::ErrorKind::NotFound,
        format!("{host} resolves to no address"),
    );
    for a in (host, port).to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, wait.max(Duration::from_millis(1))) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

impl TcpStore {
    /// Joins the store of a job of `world_size` ranks at `addr:port` as `rank`: rank 0 first
    /// binds `port` (on every interface of `addr`'s family) and serves the store from
    /// background threads; every rank, rank 0 included, connects to `addr:port` (retrying
    /// until `timeout` passes, as rank 0 may start later), registers its rank, and returns once
    /// every rank has registered. `timeout` (wall-clock) then also bounds each later
    /// [`set`](TcpStore::set), [`get`](TcpStore::get) and [`barrier`](TcpStore::barrier).
    ///
    /// Errors ([`Error::Store`] unless said otherwise):
    /// - `world_size` 0, `rank >= world_size`, port 0, an empty `addr`:
    ///   [`Error::InvalidArgument`];
    /// - rank 0 cannot bind the port: names `addr:port` and the OS error;
    /// - the store cannot be reached within `timeout`: names `addr:port` and the last OS
    ///   error;
    /// - the server refuses the registration (a different world size than rank 0's, a rank
    ///   already registered): names both values;
    /// - not every rank registered within `timeout`: names the missing ranks ("ranks [2, 3]
    ///   of 4 did not join the store at 10.0.0.1:29500 within 30 s"), also in
    ///   [`Error::Store`]'s `missing`, and on rank 0 any registration the server refused;
    /// - the connection is lost or the peer is not a candle-fsdp store.
    pub fn connect(
        addr: &str,
        port: u16,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<TcpStore> {
        if world_size == 0 {
            return Err(Error::InvalidArgument(
                "store: world size 0: a job needs at least one rank".into(),
            ));
        }
        if rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "store: rank {rank} is out of range for world size {world_size} (expected \
                 0..{world_size})"
            )));
        }
        if port == 0 {
            return Err(Error::InvalidArgument(
                "store: port 0: the store needs a fixed port that every rank knows \
                 (MASTER_PORT)"
                    .into(),
            ));
        }
        if addr.trim().is_empty() {
            return Err(Error::InvalidArgument(
                "store: empty address: the store needs rank 0's host (MASTER_ADDR)".into(),
            ));
        }
        if world_size > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "store: world size {world_size} is too large"
            )));
        }
        let deadline = Instant::now() + timeout;
        let display = display_addr(addr, port);
        let server = if rank == 0 {
            Some(Server::start(addr, port, world_size, &display)?)
        } else {
            None
        };
        let store_err = |message: String| Error::Store {
            addr: display.clone(),
            rank,
            missing: vec![],
            message,
        };
        // Connect, retrying with a growing pause (20 ms .. 500 ms).
        let mut pause = Duration::from_millis(20);
        let stream = loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            match connect_once(addr, port, remaining.min(Duration::from_secs(5))) {
                Ok(s) => break s,
                Err(e) => {
                    let remaining = deadline.saturating_duration_since(Instant::now());
                    if remaining.is_zero() {
                        return Err(store_err(format!(
                            "could not connect to the store at {display} within {}: {e} \
                             (rank 0 serves it: is rank 0 running, and is {addr} its address?)",
                            secs(timeout)
                        )));
                    }
                    std::thread::sleep(pause.min(remaining));
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
            }
        };
        let _ = stream.set_nodelay(true);
        let store = TcpStore {
            queued: AtomicUsize::new(0),
            conn: Mutex::new(Conn {
                stream,
                broken: None,
            }),
            barriers: Mutex::new(HashMap::new()),
            addr: display.clone(),
            rank,
            world_size,
            timeout,
            _server: server,
        };
        let hello = Request::Hello {
            rank: rank as u32,
            world_size: world_size as u32,
        };
        match store.call(&hello, "joining", Duration::ZERO)? {
            Reply::Ok => {}
            other => return Err(store.unexpected(&other, "joining")),
        }
        loop {
            let wait = store.slice(deadline);
            match store.call(&Request::Joined { wait_ms: ms(wait) }, "joining", wait)? {
                Reply::Done => return Ok(store),
                Reply::Pending { missing, notes, .. } => {
                    let refused = if notes.is_empty() {
                        String::new()
                    } else {
                        format!("; the store refused: {}", notes.join("; "))
                    };
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> = missing.iter().map(|&r| r as usize).collect();
                        return Err(Error::Store {
                            addr: display.clone(),
                            rank,
                            message: format!(
                                "ranks {missing:?} of {world_size} did not join the store at \
                                 {display} within {}{refused}",
                                secs(timeout)
                            ),
                            missing,
                        });
                    }
                    if !notes.is_empty() {
                        // Keep waiting (the refused client may be another job's), but do not
                        // spin: the server answers at once while refusals are recorded.
                        std::thread::sleep(wait);
                    }
                }
                other => return Err(store.unexpected(&other, "joining")),
            }
        }
    }

    /// Sets `key` to `value` (replacing an earlier value), visible to every rank's
    /// [`get`](TcpStore::get) once this returns.
    ///
    /// Errors: a key over [`MAX_KEY_BYTES`] or a value over [`MAX_VALUE_BYTES`] bytes
    /// ([`Error::InvalidArgument`]); the connection to the store is lost or no reply comes
    /// within the timeout ([`Error::Store`]).
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key, "key")?;
        if value.len() > MAX_VALUE_BYTES {
            return Err(Error::InvalidArgument(format!(
                "store: the value of key {key:?} has {} bytes, over the limit of \
                 {MAX_VALUE_BYTES} bytes",
                value.len()
            )));
        }
        let what = format!("set of key {key:?}");
        let req = Request::Set {
            key: key.to_string(),
            value: value.to_vec(),
        };
        match self.call(&req, &what, self.timeout)? {
            Reply::Ok => Ok(()),
            other => Err(self.unexpected(&other, &what)),
        }
    }

    /// The value of `key`, waiting until some rank sets it or the timeout passes.
    ///
    /// Errors: a key over [`MAX_KEY_BYTES`] bytes ([`Error::InvalidArgument`]); the key is not
    /// set within the timeout (naming the key and the store's address), or the connection is
    /// lost ([`Error::Store`]).
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        check_key(key, "key")?;
        let deadline = Instant::now() + self.timeout;
        let what = format!("get of key {key:?}");
        loop {
            let wait = self.slice(deadline);
            let req = Request::Get {
                key: key.to_string(),
                wait_ms: ms(wait),
            };
            match self.call(&req, &what, wait)? {
                Reply::Value(v) => return Ok(v),
                Reply::NotYet if Instant::now() >= deadline => {
                    return Err(self.error(format!(
                        "key {key:?} was not set in the store at {} within {}",
                        self.addr,
                        secs(self.timeout)
                    )))
                }
                Reply::NotYet => {}
                other => return Err(self.unexpected(&other, &what)),
            }
        }
    }

    /// Waits until every rank has called `barrier(name)` as many times as this rank has
    /// (each name counts its own calls), or the timeout passes.
    ///
    /// Errors: a name over [`MAX_KEY_BYTES`] bytes ([`Error::InvalidArgument`]); ranks did not
    /// arrive within the timeout, or left the store (their process exited or dropped its
    /// store) before arriving: names them ([`Error::Store`], also in `missing`); the
    /// connection is lost.
    pub fn barrier(&self, name: &str) -> Result<()> {
        check_key(name, "barrier name")?;
        let generation = {
            let mut b = self.barriers.lock().unwrap_or_else(|p| p.into_inner());
            let g = b.entry(name.to_string()).or_insert(0);
            *g += 1;
            *g
        };
        let deadline = Instant::now() + self.timeout;
        let what = format!("barrier {name:?}");
        loop {
            let wait = self.slice(deadline);
            let req = Request::Barrier {
                name: name.to_string(),
                generation,
                wait_ms: ms(wait),
            };
            match self.call(&req, &what, wait)? {
                Reply::Done => return Ok(()),
                Reply::Pending { missing, left, .. } => {
                    let timed_out = Instant::now() >= deadline;
                    if left.is_empty() && !timed_out {
                        continue;
                    }
                    let missing: Vec<usize> = missing.iter().map(|&r| r as usize).collect();
                    let left: Vec<usize> = left.iter().map(|&r| r as usize).collect();
                    let message = if left.is_empty() {
                        format!(
                            "ranks {missing:?} of {} did not arrive at barrier {name:?} of the \
                             store at {} within {}",
                            self.world_size,
                            self.addr,
                            secs(self.timeout)
                        )
                    } else {
                        format!(
                            "ranks {left:?} of {} left the store at {} (their process exited or \
                             dropped its store) before arriving at barrier {name:?}; ranks \
                             {missing:?} had not arrived",
                            self.world_size, self.addr
                        )
                    };
                    return Err(Error::Store {
                        addr: self.addr.clone(),
                        rank: self.rank,
                        missing,
                        message,
                    });
                }
                other => return Err(self.unexpected(&other, &what)),
            }
        }
    }

    /// This rank, `0..world_size`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks of the job.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    fn error(&self, message: String) -> Error {
        Error::Store {
            addr: self.addr.clone(),
            rank: self.rank,
            missing: vec![],
            message,
        }
    }

    fn unexpected(&self, reply: &Reply, what: &str) -> Error {
        self.error(format!(
            "unexpected reply from the store at {} to {what}: {reply:?}",
            self.addr
        ))
    }

    /// The server-side wait of the next polling request: at most [`WAIT_SLICE`], at most
    /// what is left until `deadline`.
    fn slice(&self, deadline: Instant) -> Duration {
        deadline
            .saturating_duration_since(Instant::now())
            .min(WAIT_SLICE)
    }

    /// Sends `req` and reads its reply, waiting at most `wait + REPLY_GRACE` for it. An `ERR`
    /// reply becomes an error; an I/O or protocol error marks the connection broken.
    fn call(&self, req: &Request, what: &str, wait: Duration) -> Result<Reply> {
        let polling = matches!(
            req,
            Request::Get { .. } | Request::Joined { .. } | Request::Barrier { .. }
        );
        if polling {
            // Give way to requests queued behind the previous round of this polling loop (at
            // most one slice, in case the count is held by another poller).
            let give_way = Instant::now() + WAIT_SLICE;
            while self.queued.load(Ordering::SeqCst) > 0 && Instant::now() < give_way {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        self.queued.fetch_add(1, Ordering::SeqCst);
        let conn = self.conn.lock();
        self.queued.fetch_sub(1, Ordering::SeqCst);
        let mut conn = conn.unwrap_or_else(|p| p.into_inner());
        if let Some(why) = &conn.broken {
            return Err(self.error(format!(
                "cannot run {what}: the connection to the store at {} failed earlier: {why}",
                self.addr
            )));
        }
        let reply_wait = wait + REPLY_GRACE;
        let result = (|| -> std::result::Result<Reply, String> {
            let io_err = |e: io::Error| -> String {
                match e.kind() {
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => format!(
                        "the store at {} did not answer {what} within {}",
                        self.addr,
                        secs(reply_wait)
                    ),
                    io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::BrokenPipe => format!(
                        "lost the connection to the store at {} during {what} ({e}): rank 0, \
                         which serves the store, exited or dropped it",
                        self.addr
                    ),
                    _ => format!(
                        "the connection to the store at {} failed during {what}: {e}",
                        self.addr
                    ),
                }
            };
            conn.stream
                .set_read_timeout(Some(reply_wait))
                .map_err(io_err)?;
            conn.stream
                .set_write_timeout(Some(reply_wait))
                .map_err(io_err)?;
            write_frame(&mut conn.stream, &req.encode()).map_err(io_err)?;
            let body = read_frame(&mut conn.stream).map_err(|e| match e {
                FrameError::Io(e) => io_err(e),
                FrameError::BadLength(n) => format!(
                    "the server at {} is not a candle-fsdp store: it announced a reply of {n} \
                     bytes",
                    self.addr
                ),
            })?;
            Reply::decode(&body).map_err(|e| {
                format!(
                    "the server at {} is not a candle-fsdp store (or speaks another version): \
                     {e}",
                    self.addr
                )
            })
        })();
        match result {
            Ok(Reply::Err(msg)) => {
                conn.broken = Some(format!("the store refused {what}: {msg}"));
                Err(self.error(format!("the store at {} refused {what}: {msg}", self.addr)))
            }
            Ok(reply) => Ok(reply),
            Err(message) => {
                conn.broken = Some(message.clone());
                Err(self.error(message))
            }
        }
    }
}

fn ms(d: Duration) -> u32 {
    d.as_millis().min(u32::MAX as u128) as u32
}

fn check_key(key: &str, what: &str) -> Result<()> {
    if key.len() > MAX_KEY_BYTES {
        return Err(Error::InvalidArgument(format!(
            "store: {what} of {} bytes is over the limit of {MAX_KEY_BYTES} bytes",
            key.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        let reqs = [
            Request::Hello {
                rank: 3,
                world_size: 4,
            },
            Request::Set {
                key: "nccl_id".into(),
                value: (0..128).collect(),
            },
            Request::Get {
                key: "k".into(),
                wait_ms: 250,
            },
            Request::Joined { wait_ms: 7 },
            Request::Barrier {
                name: "init".into(),
                generation: 2,
                wait_ms: 0,
            },
        ];
        for r in reqs {
            assert_eq!(Request::decode(&r.encode()).unwrap(), r);
        }
        let replies = [
            Reply::Ok,
            Reply::Value(vec![1, 2, 3]),
            Reply::NotYet,
            Reply::Done,
            Reply::Pending {
                missing: vec![2, 3],
                left: vec![3],
                notes: vec!["rank 1 joined twice".into()],
            },
            Reply::Err("no".into()),
        ];
        for r in replies {
            assert_eq!(Reply::decode(&r.encode()).unwrap(), r);
        }
    }

    #[test]
    fn malformed_messages_are_refused() {
        assert!(Request::decode(&[op::HELLO, b'X'])
            .unwrap_err()
            .contains("truncated"));
        let mut hello = Request::Hello {
            rank: 0,
            world_size: 1,
        }
        .encode();
        hello[1] = b'Z';
        assert!(Request::decode(&hello).unwrap_err().contains("bad magic"));
        // A key announcing 4 GiB.
        let mut get = vec![op::GET];
        get.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(Request::decode(&get)
            .unwrap_err()
            .contains("exceeds the limit of 1024 bytes"));
        assert!(Request::decode(&[0x42]).unwrap_err().contains("unknown"));
        let mut extra = Request::Joined { wait_ms: 1 }.encode();
        extra.push(0);
        assert!(Request::decode(&extra).unwrap_err().contains("trailing"));
        // Frame lengths.
        let mut huge = &(u32::MAX).to_be_bytes()[..];
        assert!(matches!(
            read_frame(&mut huge),
            Err(FrameError::BadLength(u32::MAX))
        ));
        let mut zero = &0u32.to_be_bytes()[..];
        assert!(matches!(
            read_frame(&mut zero),
            Err(FrameError::BadLength(0))
        ));
    }

    #[test]
    fn addresses_and_durations_print_plainly() {
        assert_eq!(display_addr("10.0.0.1", 29500), "10.0.0.1:29500");
        assert_eq!(display_addr("::1", 29500), "[::1]:29500");
        assert_eq!(secs(Duration::from_secs(30)), "30 s");
        assert_eq!(secs(Duration::from_millis(1500)), "1.5 s");
    }
}
