//! The store's server: the acceptor, one thread per connection, registration and the
//! request handler.

use super::wire::*;
use super::*;

pub(super) struct State {
    world_size: usize,
    /// The job rank 0 belongs to (`TORCHELASTIC_RUN_ID`, empty when unset): a rank of another
    /// job is refused without disturbing this one.
    job: String,
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

pub(super) struct Shared {
    state: Mutex<State>,
    cond: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits on the condition variable until `done(state)` or `wait` has passed (or until the
    /// first wake-up after a thread panicked holding the lock: the callers poll again).
    fn wait_for<'a>(
        &'a self,
        guard: MutexGuard<'a, State>,
        wait: Duration,
        done: impl Fn(&State) -> bool,
    ) -> MutexGuard<'a, State> {
        (self.cond.wait_timeout_while(guard, wait, |st| !done(st)))
            .unwrap_or_else(|p| p.into_inner())
            .0
    }
}

/// Rank 0's server: the acceptor thread and its stop flag.
pub(super) struct Server {
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
}

impl Server {
    /// Binds `port` on the wildcard address of `host`'s family and starts accepting.
    pub(super) fn start(
        host: &str,
        port: u16,
        world_size: usize,
        job: &str,
        display: &str,
    ) -> Result<Server> {
        // A name that does not resolve (yet: a DNS record that appears when the job's pods are
        // ready) binds IPv4's wildcard; the connection below retries the name until the timeout.
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
            .map_err(|e| {
                let message = format!(
                    "cannot serve the store at {display}: binding {bind_addr} failed: {e} \
                     (another job's store, or another program, may hold port {port}: choose \
                     another MASTER_PORT)"
                );
                store_error(display, 0, vec![], message)
            })?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                world_size,
                job: job.to_string(),
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

pub(super) fn accept_loop(listener: TcpListener, shared: Arc<Shared>, stop: Arc<AtomicBool>) {
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

pub(super) fn serve_connection(mut stream: TcpStream, peer: SocketAddr, shared: &Shared) {
    if stream.set_nonblocking(false).is_err() {
        return;
    }
    let _ = stream.set_nodelay(true);
    let mut rank: Option<usize> = None;
    loop {
        let body = match read_frame(&mut stream) {
            Ok(b) => b,
            Err(e) if e.kind() != io::ErrorKind::InvalidData => break,
            Err(e) => {
                let _ = write_frame(&mut stream, &encode(&Reply::Err(e.to_string())));
                close_after_error(&mut stream);
                break;
            }
        };
        let (reply, close) = match (rank, Request::decode(&body)) {
            (_, Err(msg)) => (Reply::Err(format!("malformed request: {msg}")), true),
            (
                None,
                Ok(Request::Hello {
                    rank: r,
                    world_size,
                    job,
                    ..
                }),
            ) => match register(shared, r as usize, world_size as usize, &job, peer) {
                Ok(()) => {
                    rank = Some(r as usize);
                    (Reply::Ok, false)
                }
                Err(msg) => (Reply::Err(msg), true),
            },
            (None, Ok(_)) => (
                Reply::Err("the first request of a connection must be HELLO".into()),
                true,
            ),
            (Some(r), Ok(req)) => (handle(shared, r, req), false),
        };
        if write_frame(&mut stream, &encode(&reply)).is_err() {
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
pub(super) fn close_after_error(stream: &mut TcpStream) {
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

pub(super) fn register(
    shared: &Shared,
    rank: usize,
    world_size: usize,
    job: &str,
    peer: SocketAddr,
) -> std::result::Result<(), String> {
    let mut st = shared.lock();
    let refusal = if job != st.job {
        // Checked first: a rank of another job that shares the port must not take a rank
        // of this one (which the real one would then find "joined twice").
        Some(format!(
            "rank {rank} (from {peer}) belongs to job {job:?}, but the store at this port serves \
             job {:?} (TORCHELASTIC_RUN_ID): two jobs on one MASTER_PORT? give each its own",
            st.job
        ))
    } else if world_size != st.world_size {
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
    match &refusal {
        Some(msg) if st.refused.len() < MAX_NOTES => {
            // Within the notes' bound whatever the jobs' names escape to.
            let note = crate::comm::bootstrap::cut_reason(msg, 4 * MAX_KEY_BYTES);
            st.refused.push(note.to_string())
        }
        Some(_) => {}
        None => st.joined[rank] = Some(peer),
    }
    drop(st);
    shared.cond.notify_all();
    refusal.map_or(Ok(()), Err)
}

pub(super) fn wait_of(ms: u32) -> Duration {
    Duration::from_millis(ms as u64).min(WAIT_SLICE)
}

pub(super) fn handle(shared: &Shared, rank: usize, req: Request) -> Reply {
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
                    notes: st.refused.join("; "),
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
                    notes: String::new(),
                }
            }
        }
    }
}
