//! The connections of the TCP backend: this rank's listener and the address it publishes, the
//! connection meshes of the communicators (one TCP connection per pair of ranks and
//! communicator), and the control plane that carries failures between the ranks of a job.
//!
//! **Listener.** Every rank of a job listens on an ephemeral port of the address its peers
//! reach it by ([`local_ip`]) and publishes `host:port` in the job's store. A background thread
//! accepts connections; each starts with a hello (a magic word, the key of the communicator it
//! belongs to, the connecting rank's job rank) and waits in a mailbox until the communicator's
//! creation takes it ([`mesh`]). In a mesh, a rank connects to every lower rank and accepts from
//! every higher one, so no two ranks wait for each other.
//!
//! **Control plane.** Every pair of ranks of the job has one more connection, watched by a
//! thread of each rank: [`Net::abort`] sends `(failed rank, reason)` over every one of them, and
//! a connection that ends without the goodbye a dropped group sends means its process died (a
//! `kill -9`). Either way the failure is recorded in this process's slot ([`Net::failure`]),
//! which every wait of every collective looks at: the pending and later collectives of every
//! rank fail with [`crate::Error::PeerFailed`] naming the failed rank.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::comm::bootstrap::cut_reason;
use crate::comm::engine::peer_failed;
use crate::error::{Error, Result};

/// First bytes of every connection of the backend.
const MAGIC: &[u8; 8] = b"CFSDPTC1";
/// Control frames: a failure, a goodbye.
const CTL_ABORT: u8 = 1;
const CTL_BYE: u8 = 2;
/// Key of the control plane's mesh.
pub(super) const CONTROL_KEY: &str = "control";

/// Variable naming the address this rank is reached by (an IP address or a host name).
pub const ADDR_VAR: &str = "FSDP_TCP_ADDR";
/// Variable naming the network interface whose (first IPv4, else IPv6) address this rank is
/// reached by.
pub const IFNAME_VAR: &str = "FSDP_TCP_IFNAME";

fn io_err(what: String, e: std::io::Error) -> Error {
    Error::InvalidArgument(format!("tcp backend: {what}: {e}"))
}

/// The address peers reach this rank by: [`ADDR_VAR`] if set, else the address of the interface
/// [`IFNAME_VAR`] names, else the address of the interface the route toward the store
/// (`master:port`) leaves by.
pub(super) fn local_ip(master: &str, port: u16) -> Result<IpAddr> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    if let Some(addr) = var(ADDR_VAR) {
        let addr = addr.trim();
        return match addr.parse::<IpAddr>() {
            Ok(ip) => Ok(ip),
            Err(_) => (addr, 0)
                .to_socket_addrs()
                .map_err(|e| io_err(format!("{ADDR_VAR}={addr:?} does not resolve"), e))?
                .next()
                .map(|a| a.ip())
                .ok_or_else(|| {
                    Error::env(
                        ADDR_VAR,
                        format_args!("{addr:?}"),
                        "resolves to no address (the tcp backend's address of this rank)",
                    )
                }),
        };
    }
    if let Some(name) = var(IFNAME_VAR) {
        return interface_ip(name.trim());
    }
    let target = (master, port)
        .to_socket_addrs()
        .map_err(|e| {
            io_err(
                format!("the store's address {master:?} does not resolve"),
                e,
            )
        })?
        .next()
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "tcp backend: the store's address {master:?} resolves to no address"
            ))
        })?;
    let bind: SocketAddr = match target {
        SocketAddr::V4(_) => "0.0.0.0:0".parse().expect("literal"),
        SocketAddr::V6(_) => "[::]:0".parse().expect("literal"),
    };
    // Connecting a UDP socket sends nothing: it only picks the route, hence the source address.
    let probe = UdpSocket::bind(bind).map_err(|e| io_err("cannot open a UDP socket".into(), e))?;
    probe.connect(target).map_err(|e| {
        io_err(
            format!("no route toward the store at {target} (set {ADDR_VAR} or {IFNAME_VAR})"),
            e,
        )
    })?;
    let ip = probe
        .local_addr()
        .map_err(|e| io_err("cannot read the UDP socket's address".into(), e))?
        .ip();
    Ok(ip)
}

/// Waits at most `ms` milliseconds for an event on `fds` (`poll(2)`; an error or a signal
/// ends the wait like an event).
pub(super) fn poll(fds: &mut [libc::pollfd], ms: libc::c_int) {
    // SAFETY: `fds` is a live array of `fds.len()` pollfds.
    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
}

/// The first IPv4 (else IPv6) address of interface `name`.
fn interface_ip(name: &str) -> Result<IpAddr> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: plain call with an out-pointer; freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io_err(
            "cannot list the network interfaces".into(),
            std::io::Error::last_os_error(),
        ));
    }
    let (mut v4, mut v6) = (None, None);
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: a NUL-terminated name of the list.
        let ifname = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
        if ifname.to_bytes() != name.as_bytes() {
            continue;
        }
        // SAFETY: `ifa_addr` points to a sockaddr of the family it names.
        unsafe {
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET if v4.is_none() => {
                    let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    v4 = Some(IpAddr::from(
                        u32::from_be(sin.sin_addr.s_addr).to_be_bytes(),
                    ));
                }
                libc::AF_INET6 if v6.is_none() => {
                    let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    v6 = Some(IpAddr::from(sin6.sin6_addr.s6_addr));
                }
                _ => {}
            }
        }
    }
    // SAFETY: the list getifaddrs returned, freed once.
    unsafe { libc::freeifaddrs(head) };
    v4.or(v6).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "tcp backend: {IFNAME_VAR}={name:?}: no such interface with an IP address"
        ))
    })
}

/// Connections accepted and not yet taken: `(communicator key, job rank)` → stream.
#[derive(Default)]
struct Mailbox {
    conns: Mutex<HashMap<(String, usize), TcpStream>>,
    arrived: Condvar,
    /// Hellos being read (each on a thread of its own; at most [`MAX_HELLOS`]).
    hellos: AtomicUsize,
}

/// How many connections' hellos are read at once; a connection past them is closed (a flood
/// of connections that send nothing must not start a thread each).
const MAX_HELLOS: usize = 64;

/// How long a connection may take to send its whole hello.
const HELLO_WITHIN: Duration = Duration::from_secs(10);

/// Fills `buf` from `s` by `deadline` (a read timeout alone bounds each read, not the whole).
fn read_exact_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[at..])? {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n => at += n,
        }
    }
    Ok(())
}

/// Reads a connection's hello, whole within [`HELLO_WITHIN`]: `(key, job rank)`.
fn read_hello(s: &mut TcpStream) -> std::io::Result<(String, usize)> {
    let deadline = Instant::now() + HELLO_WITHIN;
    let mut head = [0u8; 16];
    read_exact_by(s, &mut head, deadline)?;
    if &head[..8] != MAGIC {
        return Err(std::io::Error::other("not a candle-fsdp tcp connection"));
    }
    let len = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes")) as usize;
    let rank = u32::from_le_bytes(head[12..16].try_into().expect("4 bytes")) as usize;
    if len > 4096 {
        return Err(std::io::Error::other("hello key too long"));
    }
    let mut key = vec![0u8; len];
    read_exact_by(s, &mut key, deadline)?;
    Ok((String::from_utf8_lossy(&key).into_owned(), rank))
}

/// Accepts connections into `mailbox` until `stop` (the listener polled every 10 ms). Each
/// connection's hello is read on a thread of its own (whole within [`HELLO_WITHIN`], at most
/// [`MAX_HELLOS`] at once), so that a connection that sends nothing (a port scanner, a stray
/// client) does not hold up the peers' behind it.
fn accept_loop(listener: TcpListener, mailbox: Arc<Mailbox>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((_, _)) if mailbox.hellos.load(Ordering::Acquire) >= MAX_HELLOS => {}
            Ok((mut s, _)) => {
                mailbox.hellos.fetch_add(1, Ordering::AcqRel);
                let mb = Arc::clone(&mailbox);
                let hello = move || {
                    let _ = s.set_nonblocking(false);
                    let read = read_hello(&mut s);
                    let _ = s.set_read_timeout(None);
                    if let Ok(id) = read {
                        mb.conns.lock().insert(id, s);
                        mb.arrived.notify_all();
                    }
                    mb.hellos.fetch_sub(1, Ordering::AcqRel);
                };
                // Without a thread the connection is dropped: its peer fails naming this rank.
                if let Err(e) = std::thread::Builder::new()
                    .name("tcp-hello".into())
                    .spawn(hello)
                {
                    mailbox.hellos.fetch_sub(1, Ordering::AcqRel);
                    tracing::warn!("tcp: cannot start a thread to read a connection's hello: {e}");
                }
            }
            // None waiting (`WouldBlock`), or a transient error: look again.
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// This process's side of a job: its listener, the peers' addresses, the control plane and the
/// failure slot shared by every group (root and sub-groups) of the job.
pub(super) struct Net {
    /// This process's rank of the job.
    pub rank: usize,
    /// `ip:port` of every rank of the job.
    pub addrs: Vec<String>,
    /// The listener (it stops accepting when the `Net` is dropped).
    listening: Listening,
    /// Control connections (writing side), by job rank.
    control: Vec<Option<Mutex<TcpStream>>>,
    /// The job's first failure: `(job rank, reason)`.
    failure: OnceLock<(usize, String)>,
    /// Job ranks whose groups were dropped (their goodbye arrived).
    departed: Vec<AtomicBool>,
}

impl Net {
    /// Binds this rank's listener on `ip` (an ephemeral port) and starts accepting; returns
    /// the listener's address and a function completing the `Net` once every rank's address
    /// is known.
    pub(super) fn listen(ip: IpAddr) -> Result<(SocketAddr, Listening)> {
        let listener = TcpListener::bind((ip, 0))
            .map_err(|e| io_err(format!("cannot listen on {ip} (an ephemeral port)"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| io_err("cannot read the listener's address".into(), e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| io_err("cannot configure the listener".into(), e))?;
        let mailbox = Arc::new(Mailbox::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (m, s) = (Arc::clone(&mailbox), Arc::clone(&stop));
        std::thread::Builder::new()
            .name("tcp-accept".into())
            .spawn(move || accept_loop(listener, m, s))
            .map_err(|error| Error::SpawnFailed {
                what: "the tcp backend's accept thread".into(),
                error,
            })?;
        Ok((addr, Listening { mailbox, stop }))
    }

    /// The failure recorded for this job, if any: `(job rank, reason)`.
    pub(super) fn failure(&self) -> Option<(usize, String)> {
        self.failure.get().cloned()
    }

    /// Records `(rank, reason)` as the job's failure in this process unless one is recorded;
    /// true if this call recorded it.
    pub(super) fn fail(&self, rank: usize, reason: &str) -> bool {
        self.failure.set((rank, reason.to_string())).is_ok()
    }

    /// Records `(rank, reason)` and sends it to every other rank of the job.
    pub(super) fn abort(&self, rank: usize, reason: &str) {
        if !self.fail(rank, reason) {
            return;
        }
        let mut frame = vec![CTL_ABORT];
        let reason = cut_reason(reason, 1 << 16).as_bytes();
        frame.extend_from_slice(&(rank as u32).to_le_bytes());
        frame.extend_from_slice(&(reason.len() as u32).to_le_bytes());
        frame.extend_from_slice(reason);
        self.send_control(&frame);
    }

    fn send_control(&self, frame: &[u8]) {
        for c in self.control.iter().flatten() {
            let _ = c.lock().write_all(frame);
        }
    }

    /// True once rank `j`'s goodbye arrived (its groups were dropped).
    pub(super) fn departed(&self, j: usize) -> bool {
        self.departed[j].load(Ordering::Acquire)
    }

    /// Takes the connection of `key` from job rank `from`, waiting until `deadline`.
    fn take(&self, key: &str, from: usize, deadline: Instant) -> Option<TcpStream> {
        let id = (key.to_string(), from);
        let mailbox = &self.listening.mailbox;
        let mut conns = mailbox.conns.lock();
        loop {
            if let Some(s) = conns.remove(&id) {
                return Some(s);
            }
            let now = Instant::now();
            if now >= deadline || self.failure.get().is_some() {
                return None;
            }
            let wait = (deadline - now).min(Duration::from_millis(50));
            mailbox.arrived.wait_for(&mut conns, wait);
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        self.send_control(&[CTL_BYE, 0, 0, 0, 0, 0, 0, 0, 0]);
    }
}

/// A listener accepting until it is dropped (with the `Net` [`Listening::join`] makes of it).
pub(super) struct Listening {
    mailbox: Arc<Mailbox>,
    stop: Arc<AtomicBool>,
}

impl Drop for Listening {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

impl Listening {
    /// The job's `Net` for this rank (`rank`, every rank's `addrs`): connects the control
    /// plane (waiting at most until `deadline`) and starts watching it.
    pub(super) fn join(
        self,
        rank: usize,
        addrs: Vec<String>,
        deadline: Instant,
    ) -> Result<Arc<Net>> {
        let ws = addrs.len();
        let mut net = Net {
            rank,
            addrs,
            listening: self,
            control: Vec::new(),
            failure: OnceLock::new(),
            departed: (0..ws).map(|_| AtomicBool::new(false)).collect(),
        };
        let members: Vec<usize> = (0..ws).collect();
        let conns = mesh(&net, CONTROL_KEY, &members, rank, deadline)?;
        let mut readers = Vec::new();
        for (j, c) in conns.into_iter().enumerate() {
            let Some(c) = c else {
                net.control.push(None);
                continue;
            };
            let _ = c.set_nonblocking(false);
            let _ = c.set_write_timeout(Some(Duration::from_secs(2)));
            let reader = c.try_clone().map_err(|e| {
                io_err(
                    format!("cannot clone the control connection to rank {j}"),
                    e,
                )
            })?;
            let _ = reader.set_read_timeout(Some(Duration::from_secs(2)));
            readers.push((j, reader));
            net.control.push(Some(Mutex::new(c)));
        }
        let net = Arc::new(net);
        let weak = Arc::downgrade(&net);
        std::thread::Builder::new()
            .name(format!("tcp-control-{rank}"))
            .spawn(move || watch_control(weak, readers))
            .map_err(|error| Error::SpawnFailed {
                what: "the tcp backend's control thread".into(),
                error,
            })?;
        Ok(net)
    }
}

/// Reads one control frame: `Ok(None)` at a goodbye.
fn read_frame(s: &mut TcpStream) -> std::io::Result<Option<(usize, String)>> {
    let mut head = [0u8; 9];
    s.read_exact(&mut head)?;
    if head[0] == CTL_BYE {
        return Ok(None);
    }
    let rank = u32::from_le_bytes(head[1..5].try_into().expect("4 bytes")) as usize;
    let len = u32::from_le_bytes(head[5..9].try_into().expect("4 bytes")) as usize;
    let mut reason = vec![0u8; len.min(1 << 16)];
    s.read_exact(&mut reason)?;
    Ok(Some((rank, String::from_utf8_lossy(&reason).into_owned())))
}

/// The control thread: waits for frames on every control connection; records failures, and
/// the death of a rank whose connection ends without a goodbye. Ends with the `Net`.
fn watch_control(net: Weak<Net>, mut conns: Vec<(usize, TcpStream)>) {
    let mut done = vec![false; conns.len()];
    loop {
        let mut fds: Vec<libc::pollfd> = conns
            .iter()
            .zip(&done)
            .map(|((_, s), &d)| libc::pollfd {
                fd: if d { -1 } else { s.as_raw_fd() },
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        poll(&mut fds, 50);
        // Gone once the `Net` is dropped.
        let Some(net) = net.upgrade() else { return };
        for (i, fd) in fds.iter().enumerate() {
            if done[i] || fd.revents == 0 {
                continue;
            }
            let (j, s) = &mut conns[i];
            match read_frame(s) {
                Ok(Some((rank, reason))) => {
                    net.fail(rank, &reason);
                }
                Ok(None) => {
                    net.departed[*j].store(true, Ordering::Release);
                    done[i] = true;
                }
                Err(e) => {
                    done[i] = true;
                    net.fail(
                        *j,
                        &format!(
                            "its process ended without reporting an error (killed by a signal, \
                             or it exited in the middle of the job): its connection from {} \
                             closed ({e})",
                            net.addrs[*j]
                        ),
                    );
                }
            }
        }
    }
}

/// Connects the ranks `members` (job ranks; this rank is `members[me]`) pairwise for the
/// communicator `key`: one connection to every other member (index = member position, `None`
/// at `me`), non-blocking, without Nagle's delay.
///
/// Errors: a lower member's listener cannot be reached, or a higher one's connection does not
/// arrive by `deadline` (naming the member and its address), or the job failed meanwhile.
pub(super) fn mesh(
    net: &Net,
    key: &str,
    members: &[usize],
    me: usize,
    deadline: Instant,
) -> Result<Vec<Option<TcpStream>>> {
    let mut conns: Vec<Option<TcpStream>> = (0..members.len()).map(|_| None).collect();
    let unreachable = |j: usize, what: String| {
        Error::InvalidArgument(format!(
            "tcp backend: rank {} (job rank) cannot connect to rank {} at {} for {key}: {what}",
            net.rank, members[j], net.addrs[members[j]]
        ))
    };
    for j in 0..me {
        let addr = &net.addrs[members[j]];
        let target: SocketAddr = addr
            .parse()
            .map_err(|_| unreachable(j, "not an address".into()))?;
        let mut s = loop {
            let wait = deadline.saturating_duration_since(Instant::now());
            match TcpStream::connect_timeout(&target, wait.max(Duration::from_millis(1))) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline || net.failure().is_some() => {
                    return Err(unreachable(j, e.to_string()))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&(key.len() as u32).to_le_bytes());
        hello.extend_from_slice(&(net.rank as u32).to_le_bytes());
        hello.extend_from_slice(key.as_bytes());
        s.write_all(&hello)
            .map_err(|e| unreachable(j, e.to_string()))?;
        conns[j] = Some(s);
    }
    for (j, conn) in conns.iter_mut().enumerate().skip(me + 1) {
        *conn = net.take(key, members[j], deadline);
        if conn.is_none() {
            if let Some(failure) = net.failure() {
                let op = format_args!("tcp connection setup ({key})");
                return Err(peer_failed(op, net.rank, failure));
            }
            return Err(Error::InvalidArgument(format!(
                "tcp backend: rank {} (job rank) got no connection from rank {} ({}) for {key} \
                 in time",
                net.rank, members[j], net.addrs[members[j]]
            )));
        }
    }
    for s in conns.iter().flatten() {
        s.set_nodelay(true)
            .and_then(|()| s.set_nonblocking(true))
            .and_then(|()| s.set_read_timeout(None))
            .map_err(|e| io_err("cannot configure a connection".into(), e))?;
    }
    Ok(conns)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection that sends nothing does not hold up the hello of one behind it (the
    /// hellos were read one after another, each for up to 10 s).
    #[test]
    fn a_silent_connection_does_not_delay_the_next_hello() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let mailbox = Arc::new(Mailbox::default());
        let stop = Arc::new(AtomicBool::new(false));
        let acceptor = {
            let (mailbox, stop) = (Arc::clone(&mailbox), Arc::clone(&stop));
            std::thread::spawn(move || accept_loop(listener, mailbox, stop))
        };
        let _silent = TcpStream::connect(addr).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let mut peer = TcpStream::connect(addr).unwrap();
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&3u32.to_le_bytes());
        hello.extend_from_slice(&1u32.to_le_bytes());
        hello.extend_from_slice(b"g-c");
        peer.write_all(&hello).unwrap();
        let start = Instant::now();
        let key = ("g-c".to_string(), 1);
        let mut conns = mailbox.conns.lock();
        while !conns.contains_key(&key) && start.elapsed() < Duration::from_secs(20) {
            mailbox
                .arrived
                .wait_for(&mut conns, Duration::from_millis(100));
        }
        let waited = start.elapsed();
        assert!(conns.contains_key(&key), "the hello never arrived");
        assert!(waited < Duration::from_secs(5), "arrived after {waited:?}");
        drop(conns);
        stop.store(true, Ordering::Release);
        acceptor.join().unwrap();
    }
}
