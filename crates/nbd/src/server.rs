//! The NBD server: listeners, connections, the per-connection worker pool, shutdown and counters.
//!
//! Layer: the I/O driver around the pure protocol code ([`crate::proto`], [`crate::handshake`]).
//!
//! Thread model: one accept thread per listener; per connection, a thread that runs the
//! handshake. When the device gives the connection a queue of its own ([`BlockDevice::queue`]),
//! that thread alone then serves every request (`pipeline.rs`). Otherwise a small pool of worker
//! threads (scoped to the connection) serves them as leader and followers: the worker holding the socket's read side reads one request, hands the read side to
//! the next idle worker and runs the request itself, so a request never waits for a thread
//! hand-off (one wake-up less per request than a reader feeding a pool). Workers call the
//! [`BlockDevice`] and write each simple reply, whole, under the connection's writer lock, so
//! replies leave in completion order, which may differ from request order: the client matches
//! them by handle.
//!
//! Invariants: memory held for a connection's in-flight requests is bounded by a byte budget
//! (default 64 MiB, at least twice [`MAX_PAYLOAD_BYTES`]) and by the workers (a request is read
//! only by a worker free to run it); a READ or WRITE above
//! [`MAX_PAYLOAD_BYTES`] is refused (`EINVAL`) before any buffer is allocated, a refused WRITE's
//! payload is read and discarded through a 64 KiB buffer. A client that breaks the protocol (bad
//! magic, oversized option, unusable flags, close in the middle of a request) is disconnected, logged
//! and counted; no other connection notices. Replies to a client that stops reading time out
//! (`write_timeout`) and end that connection only; so does a handshake that takes longer than
//! `handshake_timeout` (a client that connects and says nothing would otherwise hold a slot).
//!
//! Shutdown: stop accepting, shut the read side of every connection (readers see end of stream
//! between requests), let workers finish what was already read and send its replies, then flush
//! every device.

use std::collections::HashMap;
use std::io::{self, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use lanbus_block::BlockDevice;

mod pipeline;
use crate::handshake::{negotiate, ExportInfo, HandshakeError, Outcome};
use crate::proto::*;
use crate::Error;

/// A connected byte stream: TCP or Unix.
#[derive(Debug)]
pub enum Stream {
    /// TCP (with `TCP_NODELAY`).
    Tcp(TcpStream),
    /// Unix domain stream socket.
    Unix(UnixStream),
}

impl Stream {
    /// A second handle to the same socket.
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }

    /// Shuts down one or both directions.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.shutdown(how),
            Stream::Unix(s) => s.shutdown(how),
        }
    }

    /// Sets the read timeout.
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(t),
            Stream::Unix(s) => s.set_read_timeout(t),
        }
    }

    /// Sets the write timeout.
    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_write_timeout(t),
            Stream::Unix(s) => s.set_write_timeout(t),
        }
    }

    /// The socket's descriptor.
    fn raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
        }
    }

    fn peer(&self) -> String {
        match self {
            Stream::Tcp(s) => s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "tcp".into()),
            Stream::Unix(_) => "unix".into(),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write_vectored(bufs),
            Stream::Unix(s) => s.write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A bound listening socket to serve on.
#[derive(Debug)]
pub enum Listener {
    /// TCP (bind it to loopback unless the export is meant for the network: NBD has no auth).
    Tcp(TcpListener),
    /// Unix domain socket.
    Unix(UnixListener),
}

impl From<TcpListener> for Listener {
    fn from(l: TcpListener) -> Self {
        Listener::Tcp(l)
    }
}
impl From<UnixListener> for Listener {
    fn from(l: UnixListener) -> Self {
        Listener::Unix(l)
    }
}

/// Bytes a Unix connection may hold on its way to the client: a few of the largest replies (a 1
/// MiB read and its header). A local socket keeps the system's default (about 200 KiB) and does
/// not grow it as TCP grows its own, so a larger reply went out in turns with the client's
/// reads, each turn a wake-up on both sides.
const SEND_BUFFER_BYTES: libc::c_int = 4 << 20;

/// Gives a Unix connection [`SEND_BUFFER_BYTES`] of send buffer: `SO_SNDBUFFORCE` when the
/// process may (`CAP_NET_ADMIN`), else `SO_SNDBUF`, which the system caps at
/// `net.core.wmem_max`. Failing both leaves the default, which works, only slower.
#[allow(unsafe_code)] // one setsockopt(2): the standard library has no call for the option
fn widen_send_buffer(s: &UnixStream) {
    use std::os::fd::AsRawFd;
    for option in [libc::SO_SNDBUFFORCE, libc::SO_SNDBUF] {
        // SAFETY: a valid socket and an int option of the size given.
        let r = unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                option,
                (&SEND_BUFFER_BYTES as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r == 0 {
            return;
        }
    }
}

/// Where to connect to wake a blocked `accept` at shutdown.
#[derive(Debug, Clone)]
enum WakeAddr {
    Tcp(SocketAddr),
    Unix(PathBuf),
    Unknown,
}

impl Listener {
    fn accept(&self) -> io::Result<Stream> {
        match self {
            Listener::Tcp(l) => {
                let (s, _) = l.accept()?;
                s.set_nodelay(true)?;
                Ok(Stream::Tcp(s))
            }
            Listener::Unix(l) => {
                let s = l.accept()?.0;
                widen_send_buffer(&s);
                Ok(Stream::Unix(s))
            }
        }
    }

    fn wake_addr(&self) -> WakeAddr {
        match self {
            Listener::Tcp(l) => match l.local_addr() {
                Ok(mut a) => {
                    if a.ip().is_unspecified() {
                        a.set_ip(if a.is_ipv4() {
                            std::net::Ipv4Addr::LOCALHOST.into()
                        } else {
                            std::net::Ipv6Addr::LOCALHOST.into()
                        });
                    }
                    WakeAddr::Tcp(a)
                }
                Err(_) => WakeAddr::Unknown,
            },
            Listener::Unix(l) => match l.local_addr().ok().and_then(|a| a.as_pathname().map(PathBuf::from)) {
                Some(p) => WakeAddr::Unix(p),
                None => WakeAddr::Unknown,
            },
        }
    }
}

/// One exported device.
pub struct Export {
    name: String,
    description: Option<String>,
    device: Arc<dyn BlockDevice>,
    read_only: bool,
}

impl Export {
    /// Exports `device` under `name` (the first export of a server is also the default one,
    /// reached by the empty name).
    pub fn new(name: impl Into<String>, device: Arc<dyn BlockDevice>) -> Self {
        let read_only = device.read_only();
        Export { name: name.into(), description: None, device, read_only }
    }

    /// A description shown by `NBD_OPT_LIST` and `NBD_INFO_DESCRIPTION`.
    pub fn description(mut self, d: impl Into<String>) -> Self {
        self.description = Some(d.into());
        self
    }

    /// Exports read-only even if the device is writable.
    pub fn read_only(mut self, read_only: bool) -> Self {
        self.read_only = read_only || self.device.read_only();
        self
    }

    fn info(&self) -> ExportInfo {
        let dev = &self.device;
        let mut flags = TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH;
        if self.read_only {
            flags |= TFLAG_READ_ONLY;
        } else {
            flags |= TFLAG_SEND_FUA | TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES;
        }
        if dev.flush_covers_all_connections() {
            flags |= TFLAG_CAN_MULTI_CONN;
        }
        let min = dev.block_size().max(1);
        ExportInfo {
            name: self.name.clone(),
            description: self.description.clone(),
            size_bytes: dev.size_bytes() - dev.size_bytes() % u64::from(min),
            transmission_flags: flags,
            min_block: min,
            preferred_block: dev.preferred_block_size().max(min),
            max_payload: MAX_PAYLOAD_BYTES,
        }
    }

    fn limits(&self) -> ExportLimits {
        let info = self.info();
        ExportLimits {
            size_bytes: info.size_bytes,
            min_block: info.min_block,
            max_payload: info.max_payload,
            read_only: self.read_only,
        }
    }
}

/// A snapshot of the server's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Connections accepted (including refused ones).
    pub connections_accepted: u64,
    /// Connections open now.
    pub connections_active: u64,
    /// Connections closed at once because `max_connections` were open.
    pub connections_refused: u64,
    /// Handshakes that reached transmission.
    pub handshakes_completed: u64,
    /// READ requests.
    pub requests_read: u64,
    /// WRITE requests.
    pub requests_write: u64,
    /// FLUSH requests.
    pub requests_flush: u64,
    /// TRIM requests.
    pub requests_trim: u64,
    /// WRITE_ZEROES requests.
    pub requests_write_zeroes: u64,
    /// DISC requests.
    pub requests_disc: u64,
    /// Requests refused by the checks (bad range, alignment, flags, unknown command...).
    pub requests_refused: u64,
    /// Bytes returned by successful READs.
    pub bytes_read: u64,
    /// Bytes stored by successful WRITEs.
    pub bytes_written: u64,
    /// Device operations that failed (the client got the errno).
    pub device_errors: u64,
    /// Nanoseconds spent reading WRITE payloads from clients.
    pub payload_ns: u64,
    /// Nanoseconds spent in the device's reads and writes (for a write given to a queue in
    /// pieces, from the end of its payload to its last piece finishing).
    pub device_ns: u64,
    /// Nanoseconds spent sending replies (READ data included).
    pub reply_ns: u64,
    /// Clients disconnected for breaking the protocol (bad magic or flags, oversized option,
    /// unknown export by name, close in the middle of a request).
    pub protocol_disconnects: u64,
}

/// Counters, updated with `Relaxed` ordering: they are statistics, read only as a snapshot, and
/// nothing else is synchronised through them (except the decrement of `connections_active`, see
/// `bump_down`).
#[derive(Default)]
struct Counters {
    connections_accepted: AtomicU64,
    connections_active: AtomicU64,
    connections_refused: AtomicU64,
    handshakes_completed: AtomicU64,
    requests_read: AtomicU64,
    requests_write: AtomicU64,
    requests_flush: AtomicU64,
    requests_trim: AtomicU64,
    requests_write_zeroes: AtomicU64,
    requests_disc: AtomicU64,
    requests_refused: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    device_errors: AtomicU64,
    payload_ns: AtomicU64,
    device_ns: AtomicU64,
    reply_ns: AtomicU64,
    protocol_disconnects: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl Counters {
    fn snapshot(&self) -> Stats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Stats {
            connections_accepted: g(&self.connections_accepted),
            // Acquire: pairs with the Release decrement in `bump_down`.
            connections_active: self.connections_active.load(Ordering::Acquire),
            connections_refused: g(&self.connections_refused),
            handshakes_completed: g(&self.handshakes_completed),
            requests_read: g(&self.requests_read),
            requests_write: g(&self.requests_write),
            requests_flush: g(&self.requests_flush),
            requests_trim: g(&self.requests_trim),
            requests_write_zeroes: g(&self.requests_write_zeroes),
            requests_disc: g(&self.requests_disc),
            requests_refused: g(&self.requests_refused),
            bytes_read: g(&self.bytes_read),
            bytes_written: g(&self.bytes_written),
            device_errors: g(&self.device_errors),
            payload_ns: g(&self.payload_ns),
            device_ns: g(&self.device_ns),
            reply_ns: g(&self.reply_ns),
            protocol_disconnects: g(&self.protocol_disconnects),
        }
    }
}

#[derive(Debug, Clone)]
struct Config {
    workers_per_connection: usize,
    queue_depth: usize,
    inflight_bytes_per_connection: u64,
    max_connections: u64,
    write_timeout: Duration,
    handshake_timeout: Duration,
}

/// Builds a [`Server`].
pub struct ServerBuilder {
    exports: Vec<Export>,
    config: Config,
}

impl ServerBuilder {
    /// Adds an export (the first one is the default export).
    pub fn export(mut self, export: Export) -> Self {
        self.exports.push(export);
        self
    }

    /// Worker threads per connection, i.e. requests executed in parallel per connection (default
    /// 4), for devices without a queue per connection ([`BlockDevice::queue`]).
    pub fn workers_per_connection(mut self, n: usize) -> Self {
        self.config.workers_per_connection = n.max(1);
        self
    }

    /// Kept for compatibility; has no effect. A request is read only by a worker free to run it
    /// (leader/followers), so the requests in flight on a connection are at most its workers.
    pub fn queue_depth(mut self, n: usize) -> Self {
        self.config.queue_depth = n.max(1);
        self
    }

    /// Payload bytes a connection may hold for in-flight requests (default 64 MiB; raised to at
    /// least 32 MiB so that a maximal request fits).
    pub fn inflight_bytes_per_connection(mut self, n: u64) -> Self {
        self.config.inflight_bytes_per_connection = n.max(u64::from(MAX_PAYLOAD_BYTES));
        self
    }

    /// Connections served at once; more are closed at once and counted (default 64).
    pub fn max_connections(mut self, n: u64) -> Self {
        self.config.max_connections = n;
        self
    }

    /// How long a reply may block on a client that does not read (default 30 s).
    pub fn write_timeout(mut self, t: Duration) -> Self {
        self.config.write_timeout = t;
        self
    }

    /// How long a client may take to finish the handshake (default 30 s).
    pub fn handshake_timeout(mut self, t: Duration) -> Self {
        self.config.handshake_timeout = t.max(Duration::from_millis(1));
        self
    }

    /// Checks the exports and builds the server.
    pub fn build(self) -> Result<Server, Error> {
        if self.exports.is_empty() {
            return Err(Error::Config("a server needs at least one export".into()));
        }
        for (i, e) in self.exports.iter().enumerate() {
            if e.name.len() > MAX_NAME_BYTES || e.name.contains('\0') {
                return Err(Error::Config(format!("export name {:?} is too long or has NUL", e.name)));
            }
            if self.exports[..i].iter().any(|o| o.name == e.name) {
                return Err(Error::Config(format!("export name {:?} is used twice", e.name)));
            }
            let bs = e.device.block_size();
            if !bs.is_power_of_two() || bs > 1 << 16 {
                return Err(Error::Config(format!("export {:?}: block size {bs} is unusable", e.name)));
            }
        }
        let infos = self.exports.iter().map(Export::info).collect();
        Ok(Server {
            inner: Arc::new(Inner {
                exports: self.exports,
                infos,
                config: self.config,
                counters: Counters::default(),
                stopping: AtomicBool::new(false),
                registry: Mutex::new(Registry::default()),
            }),
        })
    }
}

#[derive(Default)]
struct Registry {
    next_id: u64,
    connections: HashMap<u64, (Stream, JoinHandle<()>)>,
    acceptors: Vec<(WakeAddr, JoinHandle<()>)>,
}

struct Inner {
    exports: Vec<Export>,
    infos: Vec<ExportInfo>,
    config: Config,
    counters: Counters,
    /// Set once by `shutdown` (under the registry lock, which orders it against registrations);
    /// read `Relaxed` elsewhere only to decide whether an error is worth logging.
    stopping: AtomicBool,
    registry: Mutex<Registry>,
}

impl Inner {
    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        // The registry holds no invariant a panicking thread could break half-way.
        self.registry.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// An NBD server: exports, counters, and the threads serving its listeners. Cheap to clone (all
/// clones are the same server). Dropping the handles does not stop it: call [`Server::shutdown`].
#[derive(Clone)]
pub struct Server {
    inner: Arc<Inner>,
}

impl Server {
    /// Starts building a server.
    pub fn builder() -> ServerBuilder {
        ServerBuilder {
            exports: Vec::new(),
            config: Config {
                workers_per_connection: 4,
                queue_depth: 64,
                inflight_bytes_per_connection: 64 << 20,
                max_connections: 64,
                write_timeout: Duration::from_secs(30),
                handshake_timeout: Duration::from_secs(30),
            },
        }
    }

    /// Serves `listener` on a new thread until [`Server::shutdown`]. May be called for several
    /// listeners (a Unix socket and a TCP port, say).
    pub fn serve(&self, listener: impl Into<Listener>) -> Result<(), Error> {
        let listener = listener.into();
        let wake = listener.wake_addr();
        let mut reg = self.inner.registry();
        if self.inner.stopping.load(Ordering::Relaxed) {
            return Err(Error::Config("the server is shut down".into()));
        }
        let inner = Arc::clone(&self.inner);
        let thread = std::thread::Builder::new()
            .name("nbd-accept".into())
            .spawn(move || accept_loop(&inner, listener))
            .map_err(Error::Io)?;
        reg.acceptors.push((wake, thread));
        Ok(())
    }

    /// The counters now.
    pub fn stats(&self) -> Stats {
        self.inner.counters.snapshot()
    }

    /// Stops accepting, lets every connection finish the requests it has read (their replies are
    /// sent), closes the connections, flushes every writable device and returns the final
    /// counters. Idempotent.
    pub fn shutdown(&self) -> Result<Stats, Error> {
        let (acceptors, connections) = {
            let mut reg = self.inner.registry();
            self.inner.stopping.store(true, Ordering::Relaxed);
            (std::mem::take(&mut reg.acceptors), std::mem::take(&mut reg.connections))
        };
        for (wake, _) in &acceptors {
            // A connection wakes the blocked accept(), which then sees `stopping`.
            match wake {
                WakeAddr::Tcp(a) => drop(TcpStream::connect_timeout(a, Duration::from_secs(1))),
                WakeAddr::Unix(p) => drop(UnixStream::connect(p)),
                WakeAddr::Unknown => {}
            }
        }
        for (wake, thread) in acceptors {
            if matches!(wake, WakeAddr::Unknown) {
                tracing::warn!("cannot wake an accept thread on an unnamed socket; left running");
                continue;
            }
            let _ = thread.join();
        }
        for (stream, _) in connections.values() {
            let _ = stream.shutdown(Shutdown::Read);
        }
        for (_, (_, thread)) in connections {
            let _ = thread.join();
        }
        let mut first_error = None;
        for e in &self.inner.exports {
            if !e.read_only {
                if let Err(err) = e.device.flush() {
                    tracing::warn!("flush of export {:?} failed: {err}", e.name);
                    first_error.get_or_insert(Error::Flush(e.name.clone(), err));
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(self.stats()),
        }
    }
}

fn accept_loop(inner: &Arc<Inner>, listener: Listener) {
    loop {
        let stream = match listener.accept() {
            Ok(s) => s,
            Err(e) => {
                if inner.stopping.load(Ordering::Relaxed) {
                    return;
                }
                tracing::warn!("accept failed: {e}");
                // Out of descriptors or similar: do not spin.
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let mut reg = inner.registry();
        if inner.stopping.load(Ordering::Relaxed) {
            return;
        }
        bump(&inner.counters.connections_accepted, 1);
        if reg.connections.len() as u64 >= inner.config.max_connections {
            bump(&inner.counters.connections_refused, 1);
            tracing::warn!("refusing {}: {} connections open", stream.peer(), reg.connections.len());
            continue;
        }
        let control = match stream.try_clone() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("cannot clone a socket: {e}");
                continue;
            }
        };
        let id = reg.next_id;
        reg.next_id += 1;
        let conn_inner = Arc::clone(inner);
        // Spawned under the registry lock: the thread's final deregistration waits for the insert.
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-conn-{id}"))
            .spawn(move || run_connection(&conn_inner, id, stream));
        match spawned {
            Ok(thread) => {
                bump(&inner.counters.connections_active, 1);
                reg.connections.insert(id, (control, thread));
            }
            Err(e) => tracing::warn!("cannot start a connection thread: {e}"),
        }
    }
}

/// Why a connection ended badly.
#[derive(Debug)]
enum ConnError {
    Handshake(HandshakeError),
    Protocol(ProtocolError),
    /// The client closed in the middle of a request.
    Truncated(&'static str),
    Io(io::Error),
}

impl std::fmt::Display for ConnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnError::Handshake(e) => write!(f, "handshake: {e}"),
            ConnError::Protocol(e) => write!(f, "{e}"),
            ConnError::Truncated(what) => write!(f, "closed in the middle of {what}"),
            ConnError::Io(e) => write!(f, "I/O: {e}"),
        }
    }
}

enum Ended {
    Aborted,
    Disconnected,
    ClosedBetweenRequests,
}

fn run_connection(inner: &Arc<Inner>, id: u64, stream: Stream) {
    let peer = stream.peer();
    let result = serve_connection(inner, stream);
    let stopping = inner.stopping.load(Ordering::Relaxed);
    match result {
        Ok(Ended::Aborted) | Ok(Ended::Disconnected) | Ok(Ended::ClosedBetweenRequests) => {}
        Err(ConnError::Io(e)) if !stopping => tracing::info!("conn {id} ({peer}): I/O error: {e}"),
        Err(ConnError::Io(_)) | Err(ConnError::Handshake(HandshakeError::Closed)) => {}
        Err(ConnError::Handshake(HandshakeError::Io(e))) => {
            if !stopping {
                if matches!(e.kind(), io::ErrorKind::UnexpectedEof | io::ErrorKind::TimedOut) {
                    bump(&inner.counters.protocol_disconnects, 1);
                }
                tracing::info!("conn {id} ({peer}): handshake ended: {e}");
            }
        }
        Err(e) if stopping && matches!(e, ConnError::Truncated(_)) => {}
        Err(e) => {
            bump(&inner.counters.protocol_disconnects, 1);
            tracing::info!("conn {id} ({peer}): disconnected: {e}");
        }
    }
    // Deregister before the count drops, so that a caller who sees no active connection can rely
    // on the slot being free for `max_connections`.
    inner.registry().connections.remove(&id);
    bump_down(&inner.counters.connections_active);
}

/// Release: pairs with the Acquire load of `connections_active` in `Counters::snapshot`, so that
/// whoever sees the count drop also sees the connection's deregistration before it.
fn bump_down(c: &AtomicU64) {
    c.fetch_sub(1, Ordering::Release);
}

fn serve_connection(inner: &Arc<Inner>, stream: Stream) -> Result<Ended, ConnError> {
    let mut writer = stream.try_clone().map_err(ConnError::Io)?;
    writer.set_write_timeout(Some(inner.config.write_timeout)).map_err(ConnError::Io)?;
    // Each read of the handshake waits at most until the deadline.
    let deadline = Some(std::time::Instant::now() + inner.config.handshake_timeout);
    let mut reader = BufReader::with_capacity(128 << 10, DeadlineReader { inner: stream, deadline });
    let index = match negotiate(&mut reader, &mut writer, &inner.infos) {
        Ok(Outcome::Transmit(i)) => i,
        Ok(Outcome::Aborted) => return Ok(Ended::Aborted),
        Err(e) => return Err(ConnError::Handshake(e)),
    };
    // Transmission: connections may idle for as long as the client likes.
    reader.get_mut().deadline_off().map_err(ConnError::Io)?;
    bump(&inner.counters.handshakes_completed, 1);
    let export = &inner.exports[index];
    let limits = export.limits();
    let conn = Conn {
        counters: &inner.counters,
        device: &*export.device,
        writer: Mutex::new(writer),
        budget: Budget::new(inner.config.inflight_bytes_per_connection),
        broken: AtomicBool::new(false),
    };
    let result = match export.device.queue() {
        // A device queue of the connection's own: one thread for every request in flight.
        Some(mut queue) => {
            let inbox = pipeline::Inbox::new(reader.get_ref().inner.raw_fd(), reader.buffer());
            conn.pipeline(inbox, &mut *queue, &limits)
        }
        None => {
            // Leader/followers: whichever worker holds the reader reads one request, lets the
            // next idle worker take the reader, and executes the request itself. A request is
            // run by the thread that read it, with no hand-off (and no wake-up of another
            // thread) in between.
            let reader = Mutex::new(Leader { reader, ended: None });
            std::thread::scope(|scope| {
                for _ in 1..inner.config.workers_per_connection {
                    let (conn, reader, limits) = (&conn, &reader, &limits);
                    scope.spawn(move || conn.worker(reader, limits));
                }
                conn.worker(&reader, &limits);
            });
            reader.into_inner().unwrap_or_else(|p| p.into_inner()).ended.unwrap_or(Ok(Ended::Disconnected))
        }
    };
    // Workers are joined: every reply is sent. A client that leaves gets its writes flushed.
    if !export.read_only {
        if let Err(e) = export.device.flush() {
            bump(&inner.counters.device_errors, 1);
            tracing::warn!("flush at disconnect of export {:?} failed: {e}", export.name);
        }
    }
    result
}

/// A reader that fails with `TimedOut` once a deadline passes (the handshake's), until the
/// deadline is switched off for the transmission phase.
struct DeadlineReader {
    inner: Stream,
    deadline: Option<std::time::Instant>,
}

impl DeadlineReader {
    fn deadline_off(&mut self) -> io::Result<()> {
        self.deadline = None;
        self.inner.set_read_timeout(None)
    }
}

impl Read for DeadlineReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let timed_out = || io::Error::new(io::ErrorKind::TimedOut, "handshake took too long");
        if let Some(deadline) = self.deadline {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(timed_out());
            }
            self.inner.set_read_timeout(Some(left))?;
        }
        match self.inner.read(buf) {
            Err(e) if self.deadline.is_some() && e.kind() == io::ErrorKind::WouldBlock => Err(timed_out()),
            r => r,
        }
    }
}

/// Capacity of a worker's request and reply buffers kept for the next request.
const KEEP_BUFFER_BYTES: usize = 4 << 20;

/// The connection's reading side, held by one worker at a time, and how reading ended.
struct Leader<R> {
    reader: R,
    /// Set by the worker that saw the stream end (or fail); the others then stop.
    ended: Option<Result<Ended, ConnError>>,
}

/// One request read and about to run.
struct Job {
    handle: u64,
    action: Action,
    /// The WRITE payload (empty otherwise).
    payload: Vec<u8>,
    /// Budget bytes to give back once replied.
    budget_bytes: u64,
}

/// A byte budget: the reader takes from it before allocating a payload, workers give back.
struct Budget {
    available: Mutex<u64>,
    freed: Condvar,
}

impl Budget {
    fn new(total: u64) -> Self {
        Budget { available: Mutex::new(total), freed: Condvar::new() }
    }

    /// Waits until `n` bytes (never more than the total) are free and takes them.
    fn take(&self, n: u64) {
        let mut a = self.available.lock().unwrap_or_else(|p| p.into_inner());
        while *a < n {
            a = self.freed.wait(a).unwrap_or_else(|p| p.into_inner());
        }
        *a -= n;
    }

    fn give(&self, n: u64) {
        *self.available.lock().unwrap_or_else(|p| p.into_inner()) += n;
        self.freed.notify_one();
    }

    /// Bytes free now.
    fn available(&self) -> u64 {
        *self.available.lock().unwrap_or_else(|p| p.into_inner())
    }
}

struct Conn<'a> {
    counters: &'a Counters,
    device: &'a dyn BlockDevice,
    writer: Mutex<Stream>,
    budget: Budget,
    /// Set `Relaxed` when a reply could not be written; the reader then stops (the socket is also
    /// shut down, which is what actually wakes it).
    broken: AtomicBool,
}

fn read_full(r: &mut impl Read, buf: &mut [u8], what: &'static str) -> Result<(), ConnError> {
    r.read_exact(buf).map_err(|e| read_error(e, what))
}

/// The connection's error when reading `what` failed with `e`.
fn read_error(e: io::Error, what: &'static str) -> ConnError {
    match e.kind() {
        io::ErrorKind::UnexpectedEof => ConnError::Truncated(what),
        _ => ConnError::Io(e),
    }
}

impl Conn<'_> {
    /// Reads the next request: `Ok(Some(job))` to run, `Ok(None)` when it was refused and
    /// answered already, `Err` when reading ends (the client left, or broke the protocol).
    fn next_request(
        &self,
        reader: &mut impl Read,
        limits: &ExportLimits,
        spare: &mut Vec<u8>,
    ) -> Result<Option<Job>, Result<Ended, ConnError>> {
        match self.next_header(reader, limits)? {
            Some((handle, action)) => self.read_payload(reader, handle, action, spare).map(Some).map_err(Err),
            None => Ok(None),
        }
    }

    /// Reads the next request's header: `Ok(Some((handle, action)))` to run (a write's payload
    /// still to be read), `Ok(None)` when it was refused and answered already (its payload
    /// read and dropped), `Err` as for [`Conn::next_request`].
    fn next_header(
        &self,
        reader: &mut impl Read,
        limits: &ExportLimits,
    ) -> Result<Option<(u64, Action)>, Result<Ended, ConnError>> {
        let mut hb = [0u8; RequestHeader::LEN];
        if self.broken.load(Ordering::Relaxed) {
            return Err(Err(ConnError::Io(io::Error::new(io::ErrorKind::BrokenPipe, "reply failed"))));
        }
        // End of stream before the first byte of a header: the client left between requests.
        loop {
            match reader.read(&mut hb[..1]) {
                Ok(0) => return Err(Ok(Ended::ClosedBetweenRequests)),
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Err(ConnError::Io(e))),
            }
        }
        read_full(reader, &mut hb[1..], "a request header").map_err(Err)?;
        let header = RequestHeader::parse(&hb).map_err(|e| Err(ConnError::Protocol(e)))?;
        let counter = match header.command {
            Command::Read => Some(&self.counters.requests_read),
            Command::Write => Some(&self.counters.requests_write),
            Command::Flush => Some(&self.counters.requests_flush),
            Command::Trim => Some(&self.counters.requests_trim),
            Command::WriteZeroes => Some(&self.counters.requests_write_zeroes),
            Command::Disc => Some(&self.counters.requests_disc),
            Command::Unknown(_) => None,
        };
        if let Some(c) = counter {
            bump(c, 1);
        }
        match check_request(&header, limits) {
            Ok(Action::Disconnect) => Err(Ok(Ended::Disconnected)),
            Ok(action) => Ok(Some((header.handle, action))),
            Err(errno) => {
                bump(&self.counters.requests_refused, 1);
                discard(reader, header.payload_len()).map_err(Err)?;
                self.send(&reply_header(header.handle, errno.as_u32())).map_err(Err)?;
                Ok(None)
            }
        }
    }

    /// Takes the budget a request read by [`Conn::next_header`] needs and reads its payload
    /// (a write's) into `spare`'s memory.
    fn read_payload(
        &self,
        reader: &mut impl Read,
        handle: u64,
        action: Action,
        spare: &mut Vec<u8>,
    ) -> Result<Job, ConnError> {
        let (budget_bytes, payload) = match action {
            Action::Read { length, .. } => {
                self.budget.take(u64::from(length));
                (u64::from(length), Vec::new())
            }
            Action::Write { length, .. } => {
                self.budget.take(u64::from(length));
                // At most MAX_PAYLOAD_BYTES, checked above, and within the budget.
                let mut payload = std::mem::take(spare);
                payload.resize(length as usize, 0);
                let start = std::time::Instant::now();
                let read = read_full(reader, &mut payload, "a WRITE payload");
                bump(&self.counters.payload_ns, start.elapsed().as_nanos() as u64);
                if let Err(e) = read {
                    self.budget.give(u64::from(length));
                    return Err(e);
                }
                (u64::from(length), payload)
            }
            _ => (0, Vec::new()),
        };
        Ok(Job { handle, action, payload, budget_bytes })
    }

    fn send(&self, bytes: &[u8]) -> Result<(), ConnError> {
        self.send_parts(&[bytes])
    }

    /// Sends `parts` one after the other as one reply (no other reply between them), with as
    /// few system calls as the socket takes (`writev`).
    fn send_parts(&self, parts: &[&[u8]]) -> Result<(), ConnError> {
        let mut w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        match write_all_parts(&mut *w, parts) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.broken.store(true, Ordering::Relaxed);
                // Wake the reader: nobody can be answered on this connection any more.
                let _ = w.shutdown(Shutdown::Both);
                Err(ConnError::Io(e))
            }
        }
    }

    /// One worker: takes the reader when it is free, reads a request, gives the reader up and
    /// runs the request; stops once reading has ended.
    fn worker<R: Read>(&self, leader: &Mutex<Leader<R>>, limits: &ExportLimits) {
        // Buffers kept from one request to the next (a fresh large one costs page faults).
        let mut spare = Vec::new();
        let mut reply = Vec::new();
        loop {
            let job = {
                let mut l = leader.lock().unwrap_or_else(|p| p.into_inner());
                if l.ended.is_some() {
                    return;
                }
                match self.next_request(&mut l.reader, limits, &mut spare) {
                    Ok(Some(job)) => job,
                    Ok(None) => continue,
                    Err(end) => {
                        l.ended = Some(end);
                        return;
                    }
                }
            };
            // A failed send marks the connection broken; the remaining jobs still run and release
            // their budget, which keeps the reader from waiting forever.
            if !self.read_lent(&job) {
                self.execute(&job, &mut reply);
                let start = std::time::Instant::now();
                let _ = self.send(&reply);
                bump(&self.counters.reply_ns, start.elapsed().as_nanos() as u64);
            }
            self.budget.give(job.budget_bytes);
            spare = job.payload;
            for b in [&mut spare, &mut reply] {
                // Keep what typical requests need, not the largest one ever seen.
                if b.capacity() > KEEP_BUFFER_BYTES {
                    *b = Vec::new();
                }
            }
        }
    }

    /// Runs a READ whose data the device lends ([`BlockDevice::read_lent`]) and sends its reply
    /// from where the data lies; false when this is no such request (nothing was done then).
    fn read_lent(&self, job: &Job) -> bool {
        let Action::Read { offset, length } = job.action else { return false };
        let c = self.counters;
        let start = std::time::Instant::now();
        let mut reply_ns = 0;
        let header = reply_header(job.handle, 0);
        let lent = self.device.read_lent(offset, length as usize, &mut |data| {
            let sending = std::time::Instant::now();
            let mut parts = Vec::with_capacity(data.len() + 1);
            parts.push(&header[..]);
            parts.extend_from_slice(data);
            let _ = self.send_parts(&parts);
            reply_ns = sending.elapsed().as_nanos() as u64;
        });
        let Some(result) = lent else { return false };
        bump(&c.device_ns, (start.elapsed().as_nanos() as u64).saturating_sub(reply_ns));
        bump(&c.reply_ns, reply_ns);
        match result {
            Ok(()) => bump(&c.bytes_read, length.into()),
            Err(e) => {
                bump(&c.device_errors, 1);
                let started = std::time::Instant::now();
                let _ = self.send(&reply_header(job.handle, Errno::of(&e).as_u32()));
                bump(&c.reply_ns, started.elapsed().as_nanos() as u64);
            }
        }
        true
    }

    /// Runs one request and puts the complete reply (header and, for READ, the data) in `out`.
    fn execute(&self, job: &Job, out: &mut Vec<u8>) {
        let dev = self.device;
        let c = self.counters;
        let result = match job.action {
            Action::Read { offset, length } => {
                // Every byte is overwritten by the read (or the reply is cut to its header).
                out.resize(SimpleReply::LEN + length as usize, 0);
                let start = std::time::Instant::now();
                let read = dev.read_at(offset, &mut out[SimpleReply::LEN..]);
                bump(&c.device_ns, start.elapsed().as_nanos() as u64);
                match read {
                    Ok(()) => {
                        bump(&c.bytes_read, length.into());
                        SimpleReply { error: 0, handle: job.handle }.emit_into(out);
                        return;
                    }
                    Err(e) => Err(e),
                }
            }
            Action::Write { offset, length, fua } => {
                let start = std::time::Instant::now();
                let r = dev.write_at(offset, &job.payload, fua);
                bump(&c.device_ns, start.elapsed().as_nanos() as u64);
                if r.is_ok() {
                    bump(&c.bytes_written, length.into());
                }
                r
            }
            Action::Flush => dev.flush(),
            Action::Trim { offset, length, fua } => {
                dev.trim(offset, length.into()).and_then(|()| if fua { dev.flush() } else { Ok(()) })
            }
            Action::WriteZeroes { offset, length, fua, may_trim } => dev
                .write_zeroes(offset, length.into(), may_trim)
                .and_then(|()| if fua { dev.flush() } else { Ok(()) }),
            Action::Disconnect => Ok(()),
        };
        let error = match result {
            Ok(()) => 0,
            Err(e) => {
                bump(&c.device_errors, 1);
                Errno::of(&e).as_u32()
            }
        };
        out.clear();
        out.extend_from_slice(&reply_header(job.handle, error));
    }
}

/// Writes every byte of `parts`, in order, with `writev` (a short write resumes where it
/// stopped).
fn write_all_parts(w: &mut impl Write, parts: &[&[u8]]) -> io::Result<()> {
    // At most this many slices a call (Linux's IOV_MAX is 1024).
    const MAX_SLICES: usize = 1024;
    let mut slices: Vec<io::IoSlice<'_>> =
        parts.iter().filter(|p| !p.is_empty()).map(|p| io::IoSlice::new(p)).collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let n = rest.len().min(MAX_SLICES);
        match w.write_vectored(&rest[..n]) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "the socket took no bytes")),
            Ok(k) => io::IoSlice::advance_slices(&mut rest, k),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn reply_header(handle: u64, error: u32) -> [u8; SimpleReply::LEN] {
    let mut out = [0u8; SimpleReply::LEN];
    SimpleReply { error, handle }.emit_into(&mut out);
    out
}

/// Reads and drops `n` bytes through a small buffer (a refused WRITE's payload).
fn discard(r: &mut impl Read, n: u32) -> Result<(), ConnError> {
    let mut left = u64::from(n);
    let mut sink = [0u8; 64 << 10];
    while left > 0 {
        let k = left.min(sink.len() as u64) as usize;
        read_full(r, &mut sink[..k], "a refused WRITE payload")?;
        left -= k as u64;
    }
    Ok(())
}
