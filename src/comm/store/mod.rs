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
//! [`Error::Value`] and [`Error::OutOfRange`].
//!
//! # Protocol (version 4)
//!
//! Every message is a frame: a `u32` length `n` (big-endian) then `n` bytes of body,
//! `1 <= n <= MAX_FRAME_BYTES`; a longer announced length is refused (an error reply, then the
//! connection is closed) without reading or allocating it. A body is one request or reply (the
//! serde-derived enums of `wire.rs`) in [postcard](https://docs.rs/postcard)'s format (serde
//! derives instead of a hand-written codec; postcard's format is documented and stable across
//! its 1.x versions): the variant's index (its opcode, below) then its fields in order; integers
//! are varints, `bytes` and strings a varint length and that many bytes, lists a varint count
//! and that many items, the magic its 8 bytes. A body that is truncated, longer than its
//! message, or over the key, value or note bounds is refused, naming what was wrong.
//!
//! | request (client → server) | opcode | fields | replies |
//! |---|---|---|---|
//! | `Hello` (must come first) | 0 | magic `b"CFSDPKV4"`, rank `u32`, world size `u32`, job (string: `TORCHELASTIC_RUN_ID`) | `Ok`, `Err` |
//! | `Set` | 1 | key string, value `bytes` | `Ok` |
//! | `Get` | 2 | key string, wait `u32` (ms) | `Value`, `NotYet` |
//! | `Joined` | 3 | wait `u32` (ms) | `Done`, `Pending` |
//! | `Barrier` | 4 | name string, generation `u64`, wait `u32` (ms) | `Done`, `Pending` |
//!
//! | reply (server → client) | opcode | fields |
//! |---|---|---|
//! | `Ok` | 0 | |
//! | `Value` | 1 | value `bytes` |
//! | `NotYet` | 2 | |
//! | `Done` | 3 | |
//! | `Pending` | 4 | missing ranks (`u32` list), left ranks (`u32` list), notes (string: the refused registrations, `"; "`-separated) |
//! | `Err` | 5 | message string |
//!
//! The server answers each request before reading the next. A waiting request (`Get`,
//! `Joined`, `Barrier`) blocks on the server for at most its `wait` (the client asks for at
//! most 100 ms at a time and repeats until its own deadline, so a connection is never held
//! for long and a dead server is noticed within one round), and answers as soon as the key is
//! set or the ranks are there. `Barrier` records the sender's arrival at `(name, generation)`;
//! each client counts the barriers of one name, so every rank calling `barrier("x")` for the
//! n-th time meets at generation n. `Pending` lists the ranks not yet registered (`Joined`) or
//! not yet arrived (`Barrier`), which of those have left, and, for `Joined`, the registrations
//! the server refused (wrong world size, duplicate rank), so that rank 0 can name them.
//! `Err` to `Hello` or to a malformed request closes the connection.

use std::collections::{BTreeSet, HashMap};
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::comm::engine::run::deadline_after;
use crate::error::{Error, Result};

/// Longest key, in bytes (UTF-8).
pub const MAX_KEY_BYTES: usize = 1024;
/// Longest value, in bytes (16 MiB).
pub const MAX_VALUE_BYTES: usize = 16 << 20;
/// Longest frame body either side accepts, in bytes: a value, its key and the fields around
/// them.
pub const MAX_FRAME_BYTES: usize = MAX_VALUE_BYTES + 2 * MAX_KEY_BYTES + 64;

/// Protocol magic and version, sent in `Hello`.
const MAGIC: &[u8; 8] = b"CFSDPKV4";
/// Longest server-side wait of one request.
const WAIT_SLICE: Duration = Duration::from_millis(100);
/// How long a client waits for a reply beyond the server-side wait it asked for.
const REPLY_GRACE: Duration = Duration::from_secs(10);
/// Registration refusals kept for `Pending` notes.
const MAX_NOTES: usize = 8;
/// Longest `Pending` notes: [`MAX_NOTES`] refusals of at most four keys' length each, joined by
/// `"; "`.
const MAX_NOTES_BYTES: usize = MAX_NOTES * (4 * MAX_KEY_BYTES + 2);
/// How often the acceptor checks for shutdown.
const ACCEPT_POLL: Duration = Duration::from_millis(20);

/// [`Error::Store`] of `rank` at the store `addr`.
fn store_error(addr: &str, rank: usize, missing: Vec<usize>, message: String) -> Error {
    Error::Store {
        addr: addr.to_string(),
        rank,
        missing,
        message,
    }
}

mod server;
#[cfg(test)]
mod tests;
mod wire;

use server::*;
use wire::*;

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
    let addrs = (host, port).to_socket_addrs().map_err(|e| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!("{host:?} does not resolve: {e}"),
        )
    })?;
    for a in addrs {
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
    /// - `world_size` 0, port 0, an empty `addr`: [`Error::Value`]; `rank >= world_size`:
    ///   [`Error::OutOfRange`];
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
            return Err(Error::value(
                "store: world size",
                "at least 1 (a job needs at least one rank)",
                0,
            ));
        }
        crate::comm::engine::run::check_rank("store", rank, world_size)?;
        if port == 0 {
            return Err(Error::value(
                "store: port",
                "a fixed port that every rank knows (MASTER_PORT)",
                0,
            ));
        }
        if addr.trim().is_empty() {
            return Err(Error::value(
                "store: address",
                "rank 0's host (MASTER_ADDR)",
                format!("{addr:?}"),
            ));
        }
        if world_size > u32::MAX as usize {
            return Err(Error::value(
                "store: world size",
                format!("at most {}", u32::MAX),
                world_size,
            ));
        }
        let job = std::env::var("TORCHELASTIC_RUN_ID").unwrap_or_default();
        Self::connect_as(addr, port, rank, world_size, timeout, &job)
    }

    /// [`TcpStore::connect`] as a rank of `job` (what `TORCHELASTIC_RUN_ID` says there).
    pub(crate) fn connect_as(
        addr: &str,
        port: u16,
        rank: usize,
        world_size: usize,
        timeout: Duration,
        job: &str,
    ) -> Result<TcpStore> {
        let deadline = deadline_after(timeout);
        // `[::1]` as a URL writes it: the address is what is inside the brackets.
        let addr = (addr.strip_prefix('[').and_then(|a| a.strip_suffix(']'))).unwrap_or(addr);
        let display = display_addr(addr, port);
        let server = (rank == 0).then(|| Server::start(addr, port, world_size, job, &display));
        let server = server.transpose()?;
        let store_err = |message: String| store_error(&display, rank, vec![], message);
        // Connect, retrying with a growing pause (20 ms .. 500 ms).
        let mut pause = Duration::from_millis(20);
        let mut warned = false;
        let stream = loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            match connect_once(addr, port, remaining.min(Duration::from_secs(5))) {
                Ok(s) => break s,
                Err(e) => {
                    // Rank 0 serves the store: the only thing it can wait for is its name.
                    let unresolved = rank == 0 && e.kind() == io::ErrorKind::NotFound;
                    if unresolved && !warned {
                        warned = true;
                        // (`display` would name tracing's own function inside the macro.)
                        let served_at = &display;
                        tracing::warn!(
                            "rank 0 serves the store at {served_at}, but {e}; retrying for up \
                             to {} (MASTER_ADDR must name rank 0's machine)",
                            secs(timeout)
                        );
                    }
                    let remaining = deadline.saturating_duration_since(Instant::now());
                    if remaining.is_zero() && unresolved {
                        return Err(store_err(format!(
                            "rank 0 serves the store at {display}, but the name did not \
                             resolve on this machine within {}: {e} (MASTER_ADDR / \
                             --master-addr must name rank 0's machine: its host name or one of \
                             its addresses)",
                            secs(timeout)
                        )));
                    }
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
            magic: *MAGIC,
            rank: rank as u32,
            world_size: world_size as u32,
            job: job.to_string(),
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
                        format!("; the store refused: {notes}")
                    };
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> = missing.iter().map(|&r| r as usize).collect();
                        let message = format!(
                            "ranks {missing:?} of {world_size} did not join the store at \
                             {display} within {}{refused}",
                            secs(timeout)
                        );
                        return Err(store_error(&display, rank, missing, message));
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
    /// ([`Error::Value`]); the connection to the store is lost or no reply comes
    /// within the timeout ([`Error::Store`]).
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key, "key")?;
        if value.len() > MAX_VALUE_BYTES {
            return Err(Error::value(
                format!("store: the value of key {key:?}"),
                format!("at most {MAX_VALUE_BYTES} bytes"),
                format!("{} bytes", value.len()),
            ));
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
    /// Errors: a key over [`MAX_KEY_BYTES`] bytes ([`Error::Value`]); the key is not
    /// set within the timeout (naming the key and the store's address), or the connection is
    /// lost ([`Error::Store`]).
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        check_key(key, "key")?;
        let deadline = deadline_after(self.timeout);
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
    /// Errors: a name over [`MAX_KEY_BYTES`] bytes ([`Error::Value`]); ranks did not
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
        let deadline = deadline_after(self.timeout);
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
                    return Err(store_error(&self.addr, self.rank, missing, message));
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
        store_error(&self.addr, self.rank, vec![], message)
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

    /// Sends `req` and reads its reply, waiting at most `wait + REPLY_GRACE` for it. An `Err`
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
        let reply_wait = wait.saturating_add(REPLY_GRACE);
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
            write_frame(&mut conn.stream, &encode(req)).map_err(io_err)?;
            let body = read_frame(&mut conn.stream).map_err(|e| match e.kind() {
                io::ErrorKind::InvalidData => {
                    format!(
                        "the server at {} is not a candle-fsdp store: {e}",
                        self.addr
                    )
                }
                _ => io_err(e),
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
        return Err(Error::value(
            format!("store: {what}"),
            format!("at most {MAX_KEY_BYTES} bytes"),
            format!("{} bytes", key.len()),
        ));
    }
    Ok(())
}
