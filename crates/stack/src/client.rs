//! The client library: TCP and UDP through a stack server.
//!
//! Layer: stack (the program's side). [`StackClient::attach`] connects to the server's Unix
//! socket, says which copy unit it wants, and maps the rings the server hands it. Streams
//! implement `std::io::Read` and `Write`; each write copies the program's bytes once, into the
//! ring, one copy unit per request; each read copies once out of the client's queue.
//!
//! A program that forks hands its sockets to the child through the server:
//! [`StackClient::fork_ticket`] before the fork, [`StackClient::forked`] after it in the parent,
//! and in the child, on a new attachment, [`StackClient::adopt`] and the `adopted_*`
//! constructors. Of processes sharing a socket, [`StackClient::want`] says which one waits on it.
//!
//! Invariants: the client never has more than [`crate::server::SEND_CREDIT`] unacknowledged bytes
//! in flight per connection, and tells the server what it read, so neither side grows without
//! bound. A server that goes away turns every blocked call into an error (ECONNRESET for streams,
//! EPIPE for writes), never a hang: waits are sliced and look at the socket between slices.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use lanbus_ring::pipe::{Receiver, Sender};
use lanbus_ring::{recv_fds, CopyMode, EventFd, Region};
use std::os::fd::OwnedFd;

use crate::proto::{Msg, HEADER_LEN};
use crate::server::{RECV_CREDIT, SEND_CREDIT};
use crate::{hello, pipe_offset, Channel, CopyUnit};

/// How long one wait slice lasts before the client checks that the server is still there.
const SLICE: Duration = Duration::from_millis(20);
/// How long a client polls its ring before it sleeps on its doorbell, when a CPU is spare (see
/// [`crate::spare_cpu`]).
const SPIN: Duration = Duration::from_micros(50);

/// One per client: the size difference between the variants does not matter.
#[allow(clippy::large_enum_variant)]
enum Link {
    Shm { to: Sender, from: Receiver, _region: Arc<Region> },
    Socket { read: Vec<u8> },
}

#[derive(Default)]
struct ConnState {
    rx: VecDeque<Vec<u8>>,
    /// Bytes of `rx.front()` already read.
    head: usize,
    eof: bool,
    closed: Option<i32>,
    in_flight: u64,
    consumed: u64,
    /// A zero-copy connection: the last `Placed` (commits counted, the send buffer's tail).
    placed: Option<(u32, u32)>,
}

#[derive(Default)]
struct Book {
    /// Handles something arrived for since the last look (for [`StackClient::set_notify`]).
    touched: Vec<u32>,
    /// Connections whose send credit came back, or that ended, since the last look (for
    /// [`StackClient::set_credit_notify`]).
    credited: Vec<u32>,
    replies: HashMap<u32, Result<(u32, SocketAddr), i32>>,
    /// Answers to `Fork`: fork tickets by request.
    tickets: HashMap<u32, u64>,
    /// Connect requests waiting for their answer: the connection's state exists from the moment
    /// the answer arrives, since its data or its end may come in the same read.
    connecting: HashSet<u32>,
    /// Zero-copy connect requests waiting for their send buffer, and the buffers that came.
    zero_copy_waiting: HashSet<u32>,
    zero_copy_buffers: HashMap<u32, OwnedFd>,
    /// Zero-copy connections' requests, by connection, until the buffer is claimed.
    zero_copy_req: HashMap<u32, u32>,
    conns: HashMap<u32, ConnState>,
    accepted: HashMap<u32, VecDeque<(u32, SocketAddr)>>,
    /// Shared listeners whose backlog has a connection this client has not asked for.
    pending: HashSet<u32>,
    datagrams: HashMap<u32, VecDeque<(SocketAddr, Vec<u8>)>>,
}

impl Book {
    fn dispatch(&mut self, bytes: &[u8]) -> Result<(), String> {
        match Msg::parse(bytes).map_err(|e| e.to_string())? {
            Msg::Opened { req, handle, local } => {
                if self.connecting.remove(&req) {
                    self.conns.insert(handle, ConnState::default());
                }
                if self.zero_copy_waiting.contains(&req) {
                    self.zero_copy_req.insert(handle, req);
                }
                self.replies.insert(req, Ok((handle, local)));
            }
            Msg::Ticket { req, token } => {
                self.tickets.insert(req, token);
            }
            Msg::Failed { req, errno } => {
                self.connecting.remove(&req);
                self.zero_copy_waiting.remove(&req);
                self.zero_copy_buffers.remove(&req);
                self.replies.insert(req, Err(errno));
            }
            Msg::Accepted { listener, conn, peer } => {
                self.touched.push(listener);
                self.conns.insert(conn, ConnState::default());
                self.accepted.entry(listener).or_default().push_back((conn, peer));
            }
            Msg::Pending { listener } => {
                self.touched.push(listener);
                self.pending.insert(listener);
            }
            Msg::Data { conn, data } => {
                self.touched.push(conn);
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.rx.push_back(data.to_vec());
                }
            }
            Msg::Sent { conn, bytes } => {
                // Send credit came back: a writer that found none may write again.
                self.credited.push(conn);
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.in_flight = c.in_flight.saturating_sub(bytes);
                }
            }
            Msg::Placed { conn, commits, tail } => {
                self.touched.push(conn);
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.placed = Some((commits, tail));
                }
            }
            Msg::Eof { conn } => {
                self.touched.push(conn);
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.eof = true;
                }
            }
            Msg::Closed { conn, errno } => {
                self.touched.push(conn);
                // A write now answers the error at once.
                self.credited.push(conn);
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.closed = Some(errno);
                    c.in_flight = 0;
                }
            }
            Msg::UdpData { sock, from, data } => {
                self.touched.push(sock);
                let q = self.datagrams.entry(sock).or_default();
                if q.len() < 4096 {
                    q.push_back((from, data.to_vec()));
                }
            }
            _ => return Err("the server sent a client's message".into()),
        }
        Ok(())
    }
}

struct State {
    link: Link,
    book: Book,
    next_req: u32,
    /// Set when the server went away or broke the protocol.
    gone: Option<String>,
    /// A thread sleeps on the server's doorbell; the others wait on `Inner::arrived`.
    polling: bool,
}

/// Called with a handle when something arrived for it (data, a connection, its end).
type Notify = Box<dyn Fn(u32) + Send + Sync>;

struct Inner {
    notify: std::sync::OnceLock<Notify>,
    credit_notify: std::sync::OnceLock<Notify>,
    state: Mutex<State>,
    /// Signalled whenever messages were taken in, for threads waiting while another polls (the
    /// doorbell wakes one sleeper only).
    arrived: std::sync::Condvar,
    sock: UnixStream,
    server_bell: Option<EventFd>,
    my_bell: Option<EventFd>,
    unit: usize,
    ip: Ipv4Addr,
    prefix: u8,
}

/// A program's attachment to a stack server; cheap to clone (all clones share it).
#[derive(Clone)]
pub struct StackClient {
    inner: Arc<Inner>,
}

fn gone_error() -> io::Error {
    io::Error::from_raw_os_error(libc::ECONNRESET)
}

impl StackClient {
    /// Attaches to the server at `socket` with copy unit `unit`.
    pub fn attach(socket: &Path, unit: CopyUnit) -> io::Result<StackClient> {
        unit.check().map_err(|why| io::Error::new(io::ErrorKind::InvalidInput, why))?;
        let fail = |why: String| io::Error::other(format!("{}: {why}", socket.display()));
        let sock = UnixStream::connect(socket).map_err(|e| fail(format!("no stack server here ({e})")))?;
        sock.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut h = [0u8; hello::LEN];
        h[..8].copy_from_slice(hello::MAGIC);
        h[8] = match unit.channel {
            Channel::SharedMemory => 0,
            Channel::UnixSocket => 1,
        };
        h[12..16].copy_from_slice(&unit.cluster_bytes.to_le_bytes());
        h[16..20].copy_from_slice(&unit.clusters.to_le_bytes());
        (&sock).write_all(&h)?;
        let mut answer = [0u8; hello::ANSWER_LEN];
        let (n, fds) = recv_fds(&sock, &mut answer).map_err(|e| fail(e.to_string()))?;
        if n < 12 || &answer[..8] != hello::MAGIC {
            return Err(fail("the server does not speak the lanbus stack protocol".into()));
        }
        let errno = i32::from_le_bytes(answer[8..12].try_into().expect("4 bytes"));
        if errno != 0 {
            return Err(io::Error::from_raw_os_error(errno));
        }
        if n < hello::ANSWER_LEN {
            (&sock).read_exact(&mut answer[n..])?;
        }
        let ip = Ipv4Addr::new(answer[12], answer[13], answer[14], answer[15]);
        let prefix = answer[16];
        let (link, server_bell, my_bell) = match unit.channel {
            Channel::SharedMemory => {
                let mut fds = fds.into_iter();
                let (Some(mem), Some(server_bell), Some(my_bell)) = (fds.next(), fds.next(), fds.next())
                else {
                    return Err(fail("the server sent no rings".into()));
                };
                let ring = |e: lanbus_ring::Error| fail(e.to_string());
                let region = Arc::new(Region::from_fd(mem).map_err(ring)?);
                let from = Receiver::attach(region.clone(), pipe_offset(unit.bytes(), 0)).map_err(ring)?;
                let to = Sender::attach(region.clone(), pipe_offset(unit.bytes(), 1), CopyMode::Ordinary)
                    .map_err(ring)?;
                (
                    Link::Shm { to, from, _region: region },
                    Some(EventFd::from_fd(server_bell)),
                    Some(EventFd::from_fd(my_bell)),
                )
            }
            Channel::UnixSocket => (Link::Socket { read: Vec::new() }, None, None),
        };
        sock.set_read_timeout(None)?;
        sock.set_nonblocking(true)?;
        let state = State { link, book: Book::default(), next_req: 0, gone: None, polling: false };
        Ok(StackClient {
            inner: Arc::new(Inner {
                notify: std::sync::OnceLock::new(),
                credit_notify: std::sync::OnceLock::new(),
                state: Mutex::new(state),
                arrived: std::sync::Condvar::new(),
                sock,
                server_bell,
                my_bell,
                unit: unit.bytes(),
                ip,
                prefix,
            }),
        })
    }

    /// Sets the function called (on whichever thread reads the server's messages) with a
    /// stream's, listener's or UDP socket's handle when something arrives for it; once.
    pub fn set_notify(&self, notify: impl Fn(u32) + Send + Sync + 'static) {
        let _ = self.inner.notify.set(Box::new(notify));
    }

    /// Sets the function called (as the one of [`set_notify`](Self::set_notify)) with a
    /// connection's handle when its send credit came back or it ended: a write that found no
    /// credit may go on. Once.
    pub fn set_credit_notify(&self, notify: impl Fn(u32) + Send + Sync + 'static) {
        let _ = self.inner.credit_notify.set(Box::new(notify));
    }

    /// Starts a thread that reads the server's messages as they come, so that the notify
    /// function runs without the program calling in (a program polling its own descriptors).
    pub fn spawn_reader(&self) -> io::Result<()> {
        let inner = self.inner.clone();
        std::thread::Builder::new().name("lanbus-stack-reader".into()).spawn(move || loop {
            let mut st = inner.lock();
            if st.gone.is_some() {
                return;
            }
            inner.pump(&mut st);
            drop(inner.wait(st, Duration::from_millis(50)));
        })?;
        Ok(())
    }

    /// The stack's address and prefix length.
    pub fn local_ip(&self) -> (Ipv4Addr, u8) {
        (self.inner.ip, self.inner.prefix)
    }

    /// Opens a TCP connection to `to` (waits for the handshake; fails with the errno Linux gives).
    pub fn connect(&self, to: impl Into<SocketAddr>) -> io::Result<TcpStream> {
        let to = to.into();
        let (conn, local) = self.inner.request(|req| Msg::Connect { req, to }, true)?;
        Ok(TcpStream { client: self.clone(), conn, local, peer: to, read_timeout: None })
    }

    /// Opens a TCP connection to `to` whose send buffer is shared memory this program writes
    /// into: [`ZeroCopyStream::reserve`] gives the room, [`ZeroCopyStream::commit`] sends what
    /// was written there, and the stack keeps it in place until it is acknowledged, with no copy
    /// between the program and the stack. Shared-memory clients only (`EOPNOTSUPP` otherwise).
    pub fn connect_zero_copy(&self, to: impl Into<SocketAddr>) -> io::Result<ZeroCopyStream> {
        let to = to.into();
        let (conn, local) = self.inner.request(|req| Msg::ConnectZeroCopy { req, to }, true)?;
        let stream = TcpStream { client: self.clone(), conn, local, peer: to, read_timeout: None };
        let inner = &self.inner;
        let mut st = inner.lock();
        let req = st.book.zero_copy_req.remove(&conn);
        if let Some(r) = req {
            st.book.zero_copy_waiting.remove(&r);
        }
        // The buffer was sent before the answer: it is on the socket already.
        let deadline = Instant::now() + Duration::from_secs(10);
        let fd = loop {
            inner.pump(&mut st);
            if let Some(fd) = req.and_then(|r| st.book.zero_copy_buffers.remove(&r)) {
                break fd;
            }
            if st.gone.is_some() || Instant::now() >= deadline {
                return Err(io::Error::other("the stack server sent no zero-copy send buffer"));
            }
            st = inner.wait(st, SLICE);
        };
        drop(st);
        let region = Region::from_fd(fd).map_err(|e| io::Error::other(e.to_string()))?;
        Ok(ZeroCopyStream { stream, region, tail: 0, commits: 0, unplaced: VecDeque::new(), reserved: 0 })
    }

    /// Before a `fork`: asks the server to set aside one more reference to each of this
    /// attachment's sockets for the child, and returns the ticket's secret. The child attaches
    /// anew and claims them with [`adopt`](Self::adopt); the parent says how the fork went with
    /// [`forked`](Self::forked).
    pub fn fork_ticket(&self) -> io::Result<u64> {
        let inner = &self.inner;
        let mut st = inner.lock();
        st.next_req = st.next_req.wrapping_add(1);
        let req = st.next_req;
        inner.send_control(&mut st, &Msg::Fork { req })?;
        loop {
            inner.pump(&mut st);
            if let Some(token) = st.book.tickets.remove(&req) {
                return Ok(token);
            }
            if let Some(Err(errno)) = st.book.replies.remove(&req) {
                return Err(io::Error::from_raw_os_error(errno));
            }
            if st.gone.is_some() {
                return Err(gone_error());
            }
            st = inner.wait(st, SLICE);
        }
    }

    /// After a `fork`: the child of ticket `token` is process `pid` (`None`: the fork failed,
    /// and the ticket's references go). The server frees the ticket if that process ends
    /// without claiming it.
    pub fn forked(&self, token: u64, pid: Option<u32>) -> io::Result<()> {
        let mut st = self.inner.lock();
        self.inner.send_control(&mut st, &Msg::Forked { token, pid: pid.unwrap_or(0) })
    }

    /// In a forked child, on its own new attachment: claims ticket `token`, whose sockets this
    /// client holds from then on; `conns` are the connections among them (their arrivals may
    /// follow the claim at once). Returns how many sockets the ticket held; `EPERM` when it is
    /// not this process's to claim.
    pub fn adopt(&self, token: u64, conns: &[u32]) -> io::Result<u32> {
        {
            let mut st = self.inner.lock();
            for &conn in conns {
                st.book.conns.entry(conn).or_default();
            }
        }
        let (n, _) = self.inner.request(|req| Msg::Adopt { req, token }, false)?;
        Ok(n)
    }

    /// The connection `conn` an [`adopt`](Self::adopt) gave this client.
    pub fn adopted_stream(&self, conn: u32, local: SocketAddr, peer: SocketAddr) -> TcpStream {
        TcpStream { client: self.clone(), conn, local, peer, read_timeout: None }
    }

    /// The listener `handle` an [`adopt`](Self::adopt) gave this client.
    pub fn adopted_listener(&self, handle: u32, local: SocketAddr) -> TcpListener {
        TcpListener { client: self.clone(), handle, local }
    }

    /// The UDP socket `handle` an [`adopt`](Self::adopt) gave this client.
    pub fn adopted_udp(&self, handle: u32, local: SocketAddr) -> UdpSocket {
        UdpSocket { client: self.clone(), handle, local }
    }

    /// Tells the server this program waits on `handle`, a socket it may share with other
    /// processes: a connection's or UDP socket's arrivals come here from now on, and a
    /// listener owes this client one connection. Harmless when nothing is shared.
    pub fn want(&self, handle: u32) -> io::Result<()> {
        let mut st = self.inner.lock();
        st.book.pending.remove(&handle);
        self.inner.send_control(&mut st, &Msg::Want { handle })
    }

    /// In a forked child: lets go of the parent's attachment this process inherited, without
    /// touching its state (another thread of the parent may have held its lock at the fork, and
    /// its rings are the parent's). Its socket is closed, so that the server sees the parent's
    /// end when the parent goes; the rest is left as it is, for the parent's sake.
    ///
    /// Every stream, listener and UDP socket made through this client must be forgotten
    /// (`std::mem::forget`) rather than dropped: dropping one would use the parent's rings.
    pub fn abandon_in_child(self) {
        let fds = [
            Some(self.inner.sock.as_raw_fd()),
            self.inner.server_bell.as_ref().map(|b| b.as_fd().as_raw_fd()),
            self.inner.my_bell.as_ref().map(|b| b.as_fd().as_raw_fd()),
        ];
        for fd in fds.into_iter().flatten() {
            // SAFETY: this process's copies of the attachment's descriptors, which nothing in
            // this process uses again (the client is forgotten below, never dropped).
            unsafe { libc::close(fd) };
        }
        std::mem::forget(self);
    }

    /// Sends any message as this client (tests of the server's checks).
    #[cfg(test)]
    pub(crate) fn send_raw(&self, msg: &Msg<'_>) -> io::Result<()> {
        let mut st = self.inner.lock();
        self.inner.send_control(&mut st, msg)
    }

    /// Listens on TCP `port` (0: a free port) with `backlog` connections waiting at most.
    pub fn listen(&self, port: u16, backlog: u16) -> io::Result<TcpListener> {
        let (handle, local) = self.inner.request(|req| Msg::Listen { req, port, backlog }, false)?;
        Ok(TcpListener { client: self.clone(), handle, local })
    }

    /// A UDP socket on `port` (0: a free port).
    pub fn bind_udp(&self, port: u16) -> io::Result<UdpSocket> {
        let (handle, local) = self.inner.request(|req| Msg::UdpBind { req, port }, false)?;
        Ok(UdpSocket { client: self.clone(), handle, local })
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads what the server sent; returns whether anything arrived.
    fn pump(&self, st: &mut State) -> bool {
        if st.gone.is_some() {
            return false;
        }
        let mut any = false;
        let State { link, book, gone, .. } = st;
        match link {
            Link::Shm { from, .. } => {
                // The socket carries only zero-copy send buffers (a request id, a size, a memfd);
                // its end is the server's.
                loop {
                    let mut note = [0u8; 8];
                    match recv_fds(&self.sock, &mut note) {
                        Ok((0, _)) => *gone = Some("the stack server went away".into()),
                        Ok((8, fds)) if fds.len() == 1 => {
                            let req = u32::from_le_bytes(note[..4].try_into().expect("4 bytes"));
                            if book.zero_copy_waiting.contains(&req) {
                                book.zero_copy_buffers.extend(fds.into_iter().map(|fd| (req, fd)));
                            }
                            continue;
                        }
                        Ok(_) => *gone = Some("the stack server broke the protocol on its socket".into()),
                        Err(lanbus_ring::Error::Io { source, .. })
                            if source.kind() == io::ErrorKind::WouldBlock => {}
                        Err(e) => *gone = Some(e.to_string()),
                    }
                    break;
                }
                loop {
                    let mut result = Ok(());
                    match from.recv(|bytes| result = book.dispatch(bytes)) {
                        Ok(true) => any = true,
                        Ok(false) => break,
                        Err(e) => result = Err(e.to_string()),
                    }
                    if let Err(e) = result {
                        *gone = Some(format!("the stack server broke the protocol: {e}"));
                        break;
                    }
                }
            }
            Link::Socket { read } => {
                let mut buf = [0u8; 65536];
                loop {
                    match (&self.sock).read(&mut buf) {
                        Ok(0) => {
                            *gone = Some("the stack server went away".into());
                            break;
                        }
                        Ok(n) => read.extend_from_slice(&buf[..n]),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => {
                            *gone = Some(e.to_string());
                            break;
                        }
                    }
                }
                let mut at = 0;
                while read.len() - at >= 4 {
                    let len = u32::from_le_bytes(read[at..at + 4].try_into().expect("4 bytes")) as usize;
                    if read.len() - at - 4 < len {
                        break;
                    }
                    if let Err(e) = book.dispatch(&read[at + 4..at + 4 + len]) {
                        *gone = Some(format!("the stack server broke the protocol: {e}"));
                        break;
                    }
                    at += 4 + len;
                    any = true;
                }
                read.drain(..at);
            }
        }
        if let Some(why) = gone {
            tracing::debug!("stack client: {why}");
            for (h, c) in book.conns.iter_mut() {
                c.closed.get_or_insert(libc::ECONNRESET);
                book.touched.push(*h);
                book.credited.push(*h);
            }
            book.touched.extend(book.accepted.keys().copied());
        }
        if let Some(notify) = self.notify.get() {
            for h in book.touched.drain(..) {
                notify(h);
            }
        } else {
            book.touched.clear();
        }
        if let Some(notify) = self.credit_notify.get() {
            for h in book.credited.drain(..) {
                notify(h);
            }
        } else {
            book.credited.clear();
        }
        if any || gone.is_some() {
            self.arrived.notify_all();
        }
        any
    }

    /// Sends one message; `Ok(false)` when the ring is full (wait and retry).
    fn send(&self, st: &mut State, msg: &Msg<'_>) -> io::Result<bool> {
        if st.gone.is_some() {
            return Err(io::Error::from_raw_os_error(libc::EPIPE));
        }
        match &mut st.link {
            Link::Shm { to, .. } => match to.send_with(|buf| msg.emit(buf)) {
                Ok(Some(_)) => {
                    if to.wake_needed() {
                        if let Some(bell) = &self.server_bell {
                            let _ = bell.notify();
                        }
                    }
                    Ok(true)
                }
                Ok(None) => Ok(false),
                Err(e) => Err(io::Error::other(e.to_string())),
            },
            Link::Socket { .. } => {
                let mut buf = vec![0u8; 4 + msg.len()];
                buf[..4].copy_from_slice(&(msg.len() as u32).to_le_bytes());
                msg.emit(&mut buf[4..]);
                let mut at = 0;
                while at < buf.len() {
                    match (&self.sock).write(&buf[at..]) {
                        Ok(0) => return Err(io::Error::from_raw_os_error(libc::EPIPE)),
                        Ok(n) => at += n,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            // The server reads slowly: wait for room.
                            let mut pfd =
                                libc::pollfd { fd: self.sock.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
                            // SAFETY: pfd is a valid pollfd for the call.
                            unsafe { libc::poll(&mut pfd, 1, 20) };
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(_) => return Err(io::Error::from_raw_os_error(libc::EPIPE)),
                    }
                }
                Ok(true)
            }
        }
    }

    /// Sends a message that must go (control): waits while the ring is full.
    /// The server owes nothing to this lock, so the wait keeps it: other threads of the program
    /// using this client wait too, which a full ring makes them do anyway.
    fn send_control(&self, st: &mut State, msg: &Msg<'_>) -> io::Result<()> {
        let start = Instant::now();
        loop {
            if self.send(st, msg)? {
                return Ok(());
            }
            // A server that takes nothing for this long is as good as gone: an error, not a hang.
            if start.elapsed() > Duration::from_secs(10) {
                return Err(io::Error::from_raw_os_error(libc::ETIMEDOUT));
            }
            self.pump(st);
            if let Some(bell) = &self.server_bell {
                let _ = bell.notify();
            }
            std::thread::sleep(if start.elapsed() < SPIN {
                Duration::ZERO
            } else {
                Duration::from_micros(50)
            });
        }
    }

    /// Waits (at most `slice`) for the server to send something, with the lock released.
    fn wait<'a>(&'a self, mut st: MutexGuard<'a, State>, slice: Duration) -> MutexGuard<'a, State> {
        let spin_until = Instant::now() + if crate::spare_cpu() { SPIN } else { Duration::ZERO };
        while Instant::now() < spin_until {
            if self.pump(&mut st) {
                return st;
            }
            drop(st);
            std::thread::yield_now();
            st = self.lock();
        }
        if st.polling {
            // Another thread sleeps on the doorbell; whoever takes messages in wakes us.
            st = match self.arrived.wait_timeout(st, slice) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
            self.pump(&mut st);
            return st;
        }
        let prepared = match &st.link {
            Link::Shm { from, .. } => {
                from.prepare_wait();
                !from.has_pending()
            }
            Link::Socket { .. } => true,
        };
        if prepared && st.gone.is_none() {
            let fd = match &self.my_bell {
                Some(bell) => bell.as_fd().as_raw_fd(),
                None => self.sock.as_raw_fd(),
            };
            let sock = self.sock.as_raw_fd();
            st.polling = true;
            drop(st);
            let mut fds = [
                libc::pollfd { fd, events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: sock, events: libc::POLLIN, revents: 0 },
            ];
            // SAFETY: fds is a valid array of two pollfds for the call.
            unsafe { libc::poll(fds.as_mut_ptr(), 2, slice.as_millis().max(1) as i32) };
            st = self.lock();
            st.polling = false;
        }
        if let Link::Shm { from, .. } = &st.link {
            from.finish_wait();
        }
        if let Some(bell) = &self.my_bell {
            let _ = bell.wait(Some(Duration::ZERO));
        }
        self.pump(&mut st);
        // The next waiter may poll now.
        self.arrived.notify_all();
        st
    }

    /// Sends a request and waits for its answer.
    fn request(&self, msg: impl FnOnce(u32) -> Msg<'static>, is_conn: bool) -> io::Result<(u32, SocketAddr)> {
        let mut st = self.lock();
        st.next_req = st.next_req.wrapping_add(1);
        let req = st.next_req;
        let msg = msg(req);
        if is_conn {
            st.book.connecting.insert(req);
        }
        if matches!(msg, Msg::ConnectZeroCopy { .. }) {
            st.book.zero_copy_waiting.insert(req);
        }
        if let Err(e) = self.send_control(&mut st, &msg) {
            st.book.connecting.remove(&req);
            st.book.zero_copy_waiting.remove(&req);
            return Err(e);
        }
        loop {
            self.pump(&mut st);
            if let Some(answer) = st.book.replies.remove(&req) {
                return answer.map_err(io::Error::from_raw_os_error);
            }
            if st.gone.is_some() {
                st.book.connecting.remove(&req);
                st.book.zero_copy_waiting.remove(&req);
                return Err(gone_error());
            }
            st = self.wait(st, SLICE);
        }
    }

    fn close(&self, handle: u32, abort: bool) {
        let mut st = self.lock();
        st.book.conns.remove(&handle);
        st.book.accepted.remove(&handle);
        st.book.datagrams.remove(&handle);
        let msg = if abort { Msg::Abort { conn: handle } } else { Msg::Close { handle } };
        let _ = self.send_control(&mut st, &msg);
    }
}

/// A TCP connection through the stack server.
pub struct TcpStream {
    client: StackClient,
    conn: u32,
    local: SocketAddr,
    peer: SocketAddr,
    read_timeout: Option<Duration>,
}

impl TcpStream {
    /// The local address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The remote address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// The server's handle of this connection (what [`StackClient::set_notify`] names).
    pub fn handle(&self) -> u32 {
        self.conn
    }

    /// Bytes waiting to be read, and whether a read would return at once (data, the end, or an
    /// error).
    pub fn readiness(&self) -> (usize, bool) {
        let st = self.client.inner.lock();
        match st.book.conns.get(&self.conn) {
            Some(c) => {
                let bytes = c.rx.iter().map(Vec::len).sum::<usize>() - c.head;
                (bytes, bytes > 0 || c.eof || c.closed.is_some())
            }
            None => (0, true),
        }
    }

    /// Bounds how long `read` waits (`None`: no bound); a read that times out gives `WouldBlock`.
    pub fn set_read_timeout(&mut self, timeout: Option<Duration>) {
        self.read_timeout = timeout;
    }

    /// Whether a write would take bytes at once: send credit is left, or the connection ended
    /// (then a write answers its error at once).
    pub fn writable(&self) -> bool {
        let st = self.client.inner.lock();
        match st.book.conns.get(&self.conn) {
            Some(c) => c.closed.is_some() || c.in_flight < SEND_CREDIT || st.gone.is_some(),
            None => true,
        }
    }

    /// Writes what the send credit takes now, never waiting for more: the count (perhaps short
    /// of `buf`), or `WouldBlock` when there is no credit at all.
    pub fn try_write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let inner = &self.client.inner;
        let mut st = inner.lock();
        inner.pump(&mut st);
        let mut written = 0;
        while written < buf.len() {
            let c = st.book.conns.get(&self.conn).ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
            if let Some(errno) = c.closed {
                if written > 0 {
                    break;
                }
                return Err(io::Error::from_raw_os_error(if errno == 0 { libc::EPIPE } else { errno }));
            }
            let credit = SEND_CREDIT - c.in_flight.min(SEND_CREDIT);
            if credit == 0 {
                break;
            }
            let n = (buf.len() - written).min(credit as usize).min(inner.unit);
            // A full ring is not a full socket: the server empties it promptly, so this waits
            // for it (bounded) rather than answer `WouldBlock` that nothing would end.
            inner.send_control(&mut st, &Msg::Send { conn: self.conn, data: &buf[written..written + n] })?;
            written += n;
            if let Some(c) = st.book.conns.get_mut(&self.conn) {
                c.in_flight += n as u64;
            }
        }
        if written == 0 && !buf.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(written)
    }

    /// This program waits to read: when another process shares the connection, its data comes
    /// here from now on ([`StackClient::want`]).
    pub fn want(&self) -> io::Result<()> {
        self.client.want(self.conn)
    }

    /// Sends FIN after the bytes already written; reads go on.
    pub fn shutdown_write(&self) -> io::Result<()> {
        let inner = &self.client.inner;
        let mut st = inner.lock();
        inner.send_control(&mut st, &Msg::Shutdown { conn: self.conn })
    }

    /// Corks the connection (`TCP_CORK`, tcp(7)) or uncorks it: while corked, the stack holds
    /// what is written back until it fills segments, the connection is shut down or closed, it
    /// is uncorked, or 200 ms passed; a response written in pieces and then closed leaves with
    /// its FIN.
    pub fn set_cork(&self, corked: bool) -> io::Result<()> {
        let inner = &self.client.inner;
        let mut st = inner.lock();
        inner.send_control(&mut st, &Msg::Cork { conn: self.conn, corked })
    }

    /// Waits until every byte written has gone into the stack (not necessarily acknowledged).
    pub fn drain(&self) -> io::Result<()> {
        let inner = &self.client.inner;
        let mut st = inner.lock();
        loop {
            inner.pump(&mut st);
            let Some(c) = st.book.conns.get(&self.conn) else { return Ok(()) };
            if c.in_flight == 0 {
                return Ok(());
            }
            if let Some(errno) = c.closed.filter(|e| *e != 0) {
                return Err(io::Error::from_raw_os_error(errno));
            }
            st = inner.wait(st, SLICE);
        }
    }

    /// Resets the connection (RST) and frees it.
    pub fn abort(self) {
        self.client.inner.close(self.conn, true);
        std::mem::forget(self);
    }
}

impl Read for TcpStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let inner = &self.client.inner;
        let deadline = self.read_timeout.map(|t| Instant::now() + t);
        let mut st = inner.lock();
        loop {
            inner.pump(&mut st);
            let c =
                st.book.conns.get_mut(&self.conn).ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
            if !c.rx.is_empty() {
                let mut n = 0;
                while n < buf.len() {
                    let Some(front) = c.rx.front() else { break };
                    let take = (front.len() - c.head).min(buf.len() - n);
                    buf[n..n + take].copy_from_slice(&front[c.head..c.head + take]);
                    n += take;
                    c.head += take;
                    if c.head == front.len() {
                        c.rx.pop_front();
                        c.head = 0;
                    }
                }
                c.consumed += n as u64;
                if c.consumed >= RECV_CREDIT / 4 {
                    let bytes = std::mem::take(&mut c.consumed);
                    inner.send_control(&mut st, &Msg::Consumed { conn: self.conn, bytes })?;
                }
                return Ok(n);
            }
            if c.eof {
                return Ok(0);
            }
            if let Some(errno) = c.closed {
                return if errno == 0 { Ok(0) } else { Err(io::Error::from_raw_os_error(errno)) };
            }
            if buf.is_empty() {
                return Ok(0);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            st = inner.wait(st, SLICE);
        }
    }
}

impl Write for TcpStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let inner = &self.client.inner;
        let mut st = inner.lock();
        let mut written = 0;
        loop {
            inner.pump(&mut st);
            let c = st.book.conns.get(&self.conn).ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
            if let Some(errno) = c.closed {
                let errno = if errno == 0 { libc::EPIPE } else { errno };
                return if written > 0 { Ok(written) } else { Err(io::Error::from_raw_os_error(errno)) };
            }
            let credit = SEND_CREDIT - c.in_flight.min(SEND_CREDIT);
            if written == buf.len() {
                return Ok(written);
            }
            if credit > 0 {
                let n = (buf.len() - written).min(credit as usize).min(inner.unit);
                if inner.send(&mut st, &Msg::Send { conn: self.conn, data: &buf[written..written + n] })? {
                    written += n;
                    if let Some(c) = st.book.conns.get_mut(&self.conn) {
                        c.in_flight += n as u64;
                    }
                    continue;
                }
            }
            if written > 0 {
                return Ok(written);
            }
            st = inner.wait(st, SLICE);
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for TcpStream {
    fn drop(&mut self) {
        self.client.inner.close(self.conn, false);
    }
}

/// A TCP connection whose send buffer is shared memory between this program and the stack
/// server ([`StackClient::connect_zero_copy`]): the program writes its bytes where the stack
/// will send them from, so nothing is copied between the two. Reads work as on a [`TcpStream`].
pub struct ZeroCopyStream {
    stream: TcpStream,
    region: Region,
    /// Where the next byte goes in the send buffer.
    tail: usize,
    /// Commits made (counted from 1, wrapping), and those the server has not placed yet with
    /// their sizes.
    commits: u32,
    unplaced: VecDeque<(u32, usize)>,
    /// Bytes the last `reserve` offered.
    reserved: usize,
}

impl ZeroCopyStream {
    /// The send buffer's size.
    pub fn capacity(&self) -> usize {
        self.region.len()
    }

    /// The connection (addresses, readiness, handle).
    pub fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// Bounds how long `read` waits (`None`: no bound); a read that times out gives `WouldBlock`.
    pub fn set_read_timeout(&mut self, timeout: Option<Duration>) {
        self.stream.set_read_timeout(timeout);
    }

    /// Waits for room in the send buffer and returns it: write from its start, then
    /// [`commit`](Self::commit) what was written. The stack keeps committed bytes in place until
    /// the peer acknowledges them; only then is their room offered again.
    pub fn reserve(&mut self) -> io::Result<&mut [u8]> {
        let inner = &self.stream.client.inner;
        let cap = self.region.len();
        let mut st = inner.lock();
        let room = loop {
            inner.pump(&mut st);
            let c = st
                .book
                .conns
                .get_mut(&self.stream.conn)
                .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
            if let Some(errno) = c.closed {
                return Err(io::Error::from_raw_os_error(if errno == 0 { libc::EPIPE } else { errno }));
            }
            if let Some((placed, tail)) = c.placed.take() {
                while self.unplaced.front().is_some_and(|&(n, _)| placed.wrapping_sub(n) as i32 >= 0) {
                    self.unplaced.pop_front();
                }
                // Commits the server has not placed yet may still have to be moved from where
                // this side wrote them: until they are placed, this side goes on from its own
                // tail (never behind the stack's, and it does not wrap meanwhile).
                if self.unplaced.is_empty() {
                    self.tail = tail as usize % cap;
                }
            }
            let in_flight = c.in_flight as usize;
            if in_flight == 0 && self.unplaced.is_empty() {
                // Everything is placed and acknowledged: the stack's buffer is empty, and smoltcp
                // starts an empty buffer again at its beginning.
                self.tail = 0;
            }
            // After a wrap the beginning is written only once every commit is placed: until then
            // the stack's buffer may have restarted there (see the server's `ZeroCopy`).
            let unsure = self.tail == 0 && !self.unplaced.is_empty();
            let room = cap.saturating_sub(in_flight).min(cap - self.tail);
            if room > 0 && !unsure {
                break room;
            }
            if st.gone.is_some() {
                return Err(gone_error());
            }
            st = inner.wait(st, SLICE);
        };
        drop(st);
        self.reserved = room;
        // SAFETY: [tail, tail + room) lies inside the mapping, and the stack reads it only after
        // it is committed; `&mut self` keeps the slice from outliving the next reserve or commit.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.region.as_ptr().add(self.tail), room) })
    }

    /// Sends the first `n` bytes of the room the last [`reserve`](Self::reserve) gave.
    pub fn commit(&mut self, n: usize) -> io::Result<()> {
        if n > self.reserved {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("committing {n} bytes of {} reserved", self.reserved),
            ));
        }
        if n == 0 {
            return Ok(());
        }
        let inner = &self.stream.client.inner;
        let mut st = inner.lock();
        let conn = self.stream.conn;
        inner.send_control(&mut st, &Msg::Commit { conn, offset: self.tail as u32, bytes: n as u32 })?;
        if let Some(c) = st.book.conns.get_mut(&conn) {
            c.in_flight += n as u64;
        }
        self.commits = self.commits.wrapping_add(1);
        self.unplaced.push_back((self.commits, n));
        self.tail = (self.tail + n) % self.region.len();
        self.reserved = 0;
        Ok(())
    }

    /// Sends FIN after the bytes committed; reads go on.
    pub fn shutdown_write(&self) -> io::Result<()> {
        self.stream.shutdown_write()
    }

    /// Waits until the peer acknowledged every byte committed.
    pub fn drain(&self) -> io::Result<()> {
        self.stream.drain()
    }
}

/// Writing copies into the shared send buffer (the one copy a POSIX `send` needs).
impl Write for ZeroCopyStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let room = self.reserve()?;
        let n = room.len().min(buf.len());
        room[..n].copy_from_slice(&buf[..n]);
        self.commit(n)?;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Read for ZeroCopyStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.read(buf)
    }
}

/// A TCP listener through the stack server.
pub struct TcpListener {
    client: StackClient,
    handle: u32,
    local: SocketAddr,
}

impl TcpListener {
    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Waits for the next connection (at most `timeout` when given: then `TimedOut`).
    pub fn accept_timeout(&self, timeout: Option<Duration>) -> io::Result<(TcpStream, SocketAddr)> {
        let inner = &self.client.inner;
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = inner.lock();
        let mut asked = false;
        loop {
            inner.pump(&mut st);
            let queued = st.book.accepted.get_mut(&self.handle).and_then(|q| q.pop_front());
            if queued.is_none() && !asked && st.gone.is_none() {
                // The server hands a connection only to a holder that asks: once per call.
                st.book.pending.remove(&self.handle);
                inner.send_control(&mut st, &Msg::Want { handle: self.handle })?;
                asked = true;
            }
            if let Some((conn, peer)) = queued {
                let stream = TcpStream {
                    client: self.client.clone(),
                    conn,
                    local: self.local,
                    peer,
                    read_timeout: None,
                };
                return Ok((stream, peer));
            }
            if st.gone.is_some() {
                return Err(gone_error());
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(io::ErrorKind::TimedOut.into());
            }
            st = inner.wait(st, SLICE);
        }
    }

    /// The server's handle of this listener.
    pub fn handle(&self) -> u32 {
        self.handle
    }

    /// This program waits to accept: the next connection nobody else asked for first comes
    /// here ([`StackClient::want`]). `accept` asks by itself when nothing waits.
    pub fn want(&self) -> io::Result<()> {
        self.client.want(self.handle)
    }

    /// Whether `accept` would return at once.
    pub fn ready(&self) -> bool {
        let st = self.client.inner.lock();
        st.gone.is_some() || st.book.accepted.get(&self.handle).is_some_and(|q| !q.is_empty())
    }

    /// Whether the server said that a connection waits in the backlog of this shared listener
    /// and this program has not asked for one since ([`want`](Self::want)).
    pub fn pending(&self) -> bool {
        self.client.inner.lock().book.pending.contains(&self.handle)
    }

    /// Waits for the next connection.
    pub fn accept(&self) -> io::Result<(TcpStream, SocketAddr)> {
        self.accept_timeout(None)
    }
}

impl Drop for TcpListener {
    fn drop(&mut self) {
        self.client.inner.close(self.handle, false);
    }
}

/// A UDP socket through the stack server.
pub struct UdpSocket {
    client: StackClient,
    handle: u32,
    local: SocketAddr,
}

impl UdpSocket {
    /// The address it is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The server's handle of this socket.
    pub fn handle(&self) -> u32 {
        self.handle
    }

    /// This program waits to receive: when another process shares the socket, its datagrams
    /// come here from now on ([`StackClient::want`]).
    pub fn want(&self) -> io::Result<()> {
        self.client.want(self.handle)
    }

    /// Whether a datagram is waiting.
    pub fn ready(&self) -> bool {
        let st = self.client.inner.lock();
        st.book.datagrams.get(&self.handle).is_some_and(|q| !q.is_empty())
    }

    /// Sends a datagram (at most the copy unit, and within the link's MTU).
    pub fn send_to(&self, data: &[u8], to: impl Into<SocketAddr>) -> io::Result<usize> {
        let to = to.into();
        let inner = &self.client.inner;
        if data.len() > inner.unit {
            return Err(io::Error::from_raw_os_error(libc::EMSGSIZE));
        }
        let mut st = inner.lock();
        inner.send_control(&mut st, &Msg::UdpSend { sock: self.handle, to, data })?;
        Ok(data.len())
    }

    /// Receives a datagram, waiting at most `timeout` (`None`: no bound; then `WouldBlock`).
    pub fn recv_from(&self, buf: &mut [u8], timeout: Option<Duration>) -> io::Result<(usize, SocketAddr)> {
        let inner = &self.client.inner;
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = inner.lock();
        loop {
            inner.pump(&mut st);
            if let Some((from, data)) = st.book.datagrams.get_mut(&self.handle).and_then(|q| q.pop_front()) {
                let n = data.len().min(buf.len());
                buf[..n].copy_from_slice(&data[..n]);
                return Ok((n, from));
            }
            if st.gone.is_some() {
                return Err(gone_error());
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            st = inner.wait(st, SLICE);
        }
    }
}

impl Drop for UdpSocket {
    fn drop(&mut self) {
        self.client.inner.close(self.handle, false);
    }
}

/// Bytes of one message header, for callers sizing buffers.
pub const MESSAGE_HEADER_BYTES: usize = HEADER_LEN;

#[cfg(test)]
mod book_tests {
    use super::*;

    fn feed(book: &mut Book, msg: Msg) {
        let mut buf = vec![0u8; msg.len()];
        msg.emit(&mut buf).unwrap();
        book.dispatch(&buf).unwrap();
    }

    /// A connection's first bytes and its reset may arrive in the same read as the answer to
    /// its connect, before the caller has picked the answer up: none of it may be lost.
    #[test]
    fn what_follows_a_connects_answer_in_one_read_is_kept() {
        let mut book = Book::default();
        book.connecting.insert(7);
        let local = SocketAddr::V4(std::net::SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 40000));
        feed(&mut book, Msg::Opened { req: 7, handle: 3, local });
        feed(&mut book, Msg::Data { conn: 3, data: b"hello" });
        feed(&mut book, Msg::Closed { conn: 3, errno: libc::ECONNRESET });
        assert_eq!(book.replies.remove(&7), Some(Ok((3, local))));
        let c = &book.conns[&3];
        assert_eq!(c.rx.front().map(|d| &d[..]), Some(&b"hello"[..]));
        assert_eq!(c.closed, Some(libc::ECONNRESET));
        assert!(book.connecting.is_empty());
        // A listener's answer makes no connection.
        book.connecting.insert(8);
        feed(&mut book, Msg::Failed { req: 8, errno: libc::ECONNREFUSED });
        feed(&mut book, Msg::Opened { req: 9, handle: 4, local });
        assert!(!book.conns.contains_key(&4) && book.connecting.is_empty());
    }
}
