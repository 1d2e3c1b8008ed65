//! The stack server: smoltcp on a port, serving clients on a Unix socket.
//!
//! Layer: stack. One thread does everything, in a loop: take new clients, read their requests,
//! let smoltcp process received frames and timers, move bytes between connections and clients,
//! transmit. When nothing moved for a short spin it sleeps in `epoll_wait` on the port, the
//! clients' doorbells and sockets, and the next TCP timer, so an idle server uses no CPU to speak
//! of.
//!
//! Invariants: a client only reaches handles it holds: those it opened, and those a fork ticket
//! it claimed gave it (see `share`); a handle is freed when its last holder lets go of it or goes
//! away. Of a handle's holders, one (its reader) is sent its arrivals; a shared listener hands
//! each connection to exactly one holder that asked for one. A client
//! that breaks the protocol (a message that does not parse, a ring that does not add up, more
//! bytes than its credit) is disconnected and its connections closed, and nothing else changes.
//! Control messages to a client are never dropped: when its ring is full they wait in an outbox;
//! data waits in the connection (TCP's window closes) instead.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use lanbus_port::Port;
use lanbus_ring::pipe::{Receiver, Sender};
use lanbus_ring::{peer_cred, send_fds, CopyMode, EventFd, Region};
use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::socket::{tcp, udp};
use smoltcp::time::Instant;
use smoltcp::wire::{EthernetAddress, HardwareAddress, IpAddress, IpCidr, IpEndpoint};

use crate::buffers::BufferPool;
use crate::device::PortDevice;
use crate::proto::{Msg, HEADER_LEN};
use crate::share::{Claimed, ClientId, Shares};
use crate::{hello, pipe_config, pipe_offset, Channel, CopyUnit};

/// Bytes a client may have given the server for a connection and not yet seen accepted (`Sent`).
pub const SEND_CREDIT: u64 = 4 << 20;
/// Bytes the server may deliver on a connection before the client says it read them.
pub const RECV_CREDIT: u64 = 4 << 20;
/// First port handed out for connects and for listens on port 0.
const EPHEMERAL: u16 = 49152;
/// Fork tickets a client may have made without reporting their child (`Forked`).
const MAX_UNREPORTED_FORKS: usize = 64;
/// How long the loop keeps polling after the last work before it sleeps, when a CPU is spare
/// (see [`crate::spare_cpu`]).
const SPIN: Duration = Duration::from_micros(100);
/// How long a connection's own port stays taken after the connection left TIME-WAIT early
/// (smoltcp's TIME-WAIT lasts as long), so that no new connection from it meets the old one's
/// late segments.
const TIME_WAIT: smoltcp::time::Duration = smoltcp::time::Duration::from_secs(10);
/// How long a corked connection holds bytes back at most (Linux's ceiling, tcp(7)).
const CORK_CEILING: smoltcp::time::Duration = smoltcp::time::Duration::from_millis(200);
/// Bytes a corked connection holds back at most: beyond them full segments go out.
const CORK_BYTES: usize = 64 << 10;

/// Settings of a server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The stack's address and prefix length.
    pub ip: Ipv4Addr,
    /// The prefix length of `ip`'s network.
    pub prefix: u8,
    /// The default route, if any.
    pub gateway: Option<Ipv4Addr>,
    /// An IPv6 address and its prefix length, if the stack speaks IPv6.
    pub ip6: Option<(Ipv6Addr, u8)>,
    /// The IPv6 default route, if any.
    pub gateway6: Option<Ipv6Addr>,
    /// The Unix socket clients attach to.
    pub socket: PathBuf,
    /// Bytes of each TCP connection's receive and send buffer (the window scales to fit).
    pub tcp_buffer_bytes: usize,
    /// Idle time after which a connection probes its peer (TCP keep-alive; at most a third of
    /// `timeout`).
    pub keep_alive: Duration,
    /// How long a connection waits for its peer before it gives up (ETIMEDOUT).
    pub timeout: Duration,
}

impl ServerConfig {
    /// Defaults for an address: 512 KiB buffers (a window the port's receive ring holds whole), keep-alive after 10 s, give up after 30 s.
    pub fn new(ip: Ipv4Addr, prefix: u8, socket: &Path) -> ServerConfig {
        ServerConfig {
            ip,
            prefix,
            gateway: None,
            ip6: None,
            gateway6: None,
            socket: socket.to_path_buf(),
            tcp_buffer_bytes: 512 << 10,
            keep_alive: Duration::from_secs(10),
            timeout: Duration::from_secs(30),
        }
    }
}

/// Counters of a server.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ServerCounters {
    /// Clients attached since start.
    pub clients_attached: u64,
    /// Clients disconnected for breaking the protocol.
    pub clients_broken: u64,
    /// Clients refused (wrong user or a bad hello).
    pub clients_refused: u64,
    /// Connections opened (both ways; a connect counts when it starts, whatever its outcome).
    pub connections_opened: u64,
    /// Connections whose state is gone.
    pub connections_freed: u64,
    /// Frames received from the port.
    pub rx_frames: u64,
    /// Frames sent.
    pub tx_frames: u64,
    /// Runs of segments sent as one segmentation-offloaded frame.
    pub tx_offloaded: u64,
    /// Frames the port dropped on receive (the kernel's ring was full, or not a frame).
    pub rx_dropped: u64,
    /// Frames the port could not send.
    pub tx_dropped: u64,
    /// Connection requests (SYN) dropped while their listener's backlog was full.
    pub syns_dropped: u64,
    /// Bytes clients sent.
    pub tx_bytes: u64,
    /// Bytes delivered to clients.
    pub rx_bytes: u64,
    /// Bytes zero-copy clients committed that the stack sent from where the client wrote them.
    pub zero_copy_bytes: u64,
    /// Fork tickets made (a program with sockets forked).
    pub forks: u64,
    /// Fork tickets claimed by the child.
    pub forks_adopted: u64,
    /// Claims refused (no such ticket, or another process's), and tickets refused to a client
    /// with too many whose child it never reported.
    pub forks_refused: u64,
    /// Bytes zero-copy clients committed that had to be moved first (the stack's send buffer had
    /// emptied and restarted at its beginning before the client learned of it).
    pub zero_copy_moved_bytes: u64,
}

/// One connection as `status` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionInfo {
    /// Local address.
    pub local: Option<SocketAddr>,
    /// Remote address.
    pub remote: Option<SocketAddr>,
    /// TCP state, as smoltcp names it.
    pub state: String,
    /// The client's process id (0 once the client has gone).
    pub pid: i32,
}

/// A snapshot of the server.
#[derive(Debug, Clone, Default)]
pub struct ServerStatus {
    /// Counters.
    pub counters: ServerCounters,
    /// Clients attached now.
    pub clients: usize,
    /// Live TCP connections (listeners excluded).
    pub connections: Vec<ConnectionInfo>,
    /// Listening ports.
    pub listening: Vec<u16>,
}

/// A running server; stops when dropped.
pub struct Server {
    stop: Arc<AtomicBool>,
    status: Arc<Mutex<ServerStatus>>,
    thread: Option<JoinHandle<()>>,
    socket: PathBuf,
}

impl Server {
    /// Starts a server on `port`. Fails if the socket path cannot be bound.
    pub fn start(port: Box<dyn Port>, config: ServerConfig) -> std::io::Result<Server> {
        if config.socket.exists() {
            // A stale socket of an earlier run (a live server would answer a connect).
            if UnixStream::connect(&config.socket).is_ok() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    format!("{}: another stack server is serving this socket", config.socket.display()),
                ));
            }
            std::fs::remove_file(&config.socket)?;
        }
        let listener = UnixListener::bind(&config.socket)?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let status = Arc::new(Mutex::new(ServerStatus::default()));
        let mut core = Core::new(port, config.clone(), listener)?;
        let (stop2, status2) = (stop.clone(), status.clone());
        let thread = std::thread::Builder::new().name("stackd".into()).spawn(move || {
            core.run(&stop2, &status2);
        })?;
        Ok(Server { stop, status, thread: Some(thread), socket: config.socket })
    }

    /// A snapshot of counters and connections (refreshed every 100 ms).
    pub fn status(&self) -> ServerStatus {
        self.status.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Whether the server thread is still running.
    pub fn is_running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Relaxed: a flag the loop polls at least every 100 ms.
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// How the server talks to one client (one per client: the size difference does not matter).
#[allow(clippy::large_enum_variant)]
enum Link {
    Shm {
        to: Sender,
        from: Option<Receiver>,
        client_bell: EventFd,
        server_bell: EventFd,
        _region: Arc<Region>,
    },
    Socket {
        read: Vec<u8>,
        write: VecDeque<u8>,
    },
}

struct Client {
    sock: UnixStream,
    link: Link,
    pid: i32,
    /// Data bytes per message.
    unit: usize,
    /// Control messages that did not fit in the ring yet.
    outbox: VecDeque<Vec<u8>>,
    /// The ring was written since the doorbell was last considered.
    wrote: bool,
    /// Something waited for room toward this client since the loop last slept: the client frees
    /// room without a doorbell, so the loop naps briefly instead of sleeping.
    blocked: bool,
}

impl Client {
    /// Whether nothing waits in front of new messages.
    fn clear(&mut self) -> bool {
        let clear = self.outbox.is_empty()
            && match &self.link {
                Link::Shm { .. } => true,
                Link::Socket { write, .. } => write.len() < 4 * self.unit + 4 * HEADER_LEN,
            };
        self.blocked |= !clear;
        clear
    }

    /// Sends a message now if it fits; `false` when the ring or socket buffer is full.
    fn try_send(&mut self, msg: &Msg<'_>) -> bool {
        match &mut self.link {
            Link::Shm { to, .. } => match to.send_with(|buf| msg.emit(buf)) {
                Ok(Some(_)) => {
                    self.wrote = true;
                    true
                }
                _ => {
                    self.blocked = true;
                    false
                }
            },
            Link::Socket { write, .. } => {
                let len = msg.len();
                let start = write.len();
                write.extend((len as u32).to_le_bytes());
                write.resize(start + 4 + len, 0);
                let (a, b) = write.as_mut_slices();
                if b.is_empty() {
                    msg.emit(&mut a[start + 4..]);
                } else {
                    let mut tmp = vec![0; len];
                    msg.emit(&mut tmp);
                    for (i, byte) in tmp.into_iter().enumerate() {
                        write[start + 4 + i] = byte;
                    }
                }
                true
            }
        }
    }

    /// Sends a control message, queueing it if the ring is full.
    fn control(&mut self, msg: Msg<'_>) {
        if !self.outbox.is_empty() || !self.try_send(&msg) {
            let mut buf = vec![0; msg.len()];
            msg.emit(&mut buf);
            self.outbox.push_back(buf);
        }
    }

    /// Moves queued control messages and socket bytes out; `Err` when the client is gone.
    /// `Ok(true)` when something moved.
    fn flush(&mut self) -> Result<bool, ()> {
        while let Some(buf) = self.outbox.pop_front() {
            let msg = Msg::parse(&buf).expect("emitted by this server");
            if !self.try_send(&msg) {
                self.outbox.push_front(buf);
                break;
            }
        }
        if let Link::Socket { write, .. } = &mut self.link {
            while !write.is_empty() {
                let (a, _) = write.as_slices();
                match (&self.sock).write(a) {
                    Ok(0) => return Err(()),
                    Ok(n) => {
                        write.drain(..n);
                        self.wrote = true;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => return Err(()),
                }
            }
        }
        if let Link::Shm { to, client_bell, .. } = &self.link {
            if self.wrote && to.wake_needed() {
                let _ = client_bell.notify();
            }
        }
        Ok(std::mem::take(&mut self.wrote))
    }
}

enum Handle {
    Conn(Conn),
    Listener(Listener),
    Udp(UdpSock),
}

struct Conn {
    sock: SocketHandle,
    /// Bytes from the clients not yet in smoltcp's send buffer.
    pending: VecDeque<u8>,
    /// Whose the pending bytes are, in order (a shared connection may have several writers, each
    /// with its own send credit).
    pending_owners: VecDeque<(ClientId, usize)>,
    /// Bytes moved into smoltcp and not yet reported with `Sent`, by client.
    unreported: Vec<(ClientId, u64)>,
    /// The reader the state below was last kept for: a new reader starts with the whole receive
    /// credit (what the last one was sent is its own) and is told of the end again.
    reader: Option<ClientId>,
    /// How the connection ended, once the reader was told (`Closed`'s errno): the other holders
    /// are told too.
    ended: Option<i32>,
    /// Bytes the server may still deliver.
    credit: u64,
    /// The connect request to answer when the handshake ends.
    connecting: Option<u32>,
    shutdown: bool,
    fin_seen: bool,
    eof_sent: bool,
    /// The client closed its handle: free the connection when TCP is done.
    orphan: bool,
    last_activity: Instant,
    seen_send_queue: usize,
    seen_recv_queue: usize,
    seen_state: tcp::State,
    /// An orphan seen in TIME-WAIT by an earlier look: freed at the next.
    time_wait_seen: bool,
    /// Corked (`TCP_CORK`) since then: bytes wait in `pending` until they fill `CORK_BYTES`,
    /// the connection is shut down, it is uncorked, or `CORK_CEILING` passed.
    corked: Option<Instant>,
    /// The ephemeral port this connection took (connections a listener accepted share its port).
    own_port: Option<u16>,
    /// A zero-copy connection's shared send buffer.
    zc: Option<ZeroCopy>,
}

/// A zero-copy connection's send buffer: smoltcp's own send buffer, in a memfd the client maps.
/// The client writes its bytes where the buffer's next free position will be and commits them;
/// the stack takes them in place and keeps them until they are acknowledged.
///
/// smoltcp restarts an empty buffer at its beginning; a commit the client made before it learned
/// that the buffer had emptied is then moved (within the buffer) to where the stack expects it,
/// and `Placed` tells the client where the buffer's tail really is. A client wraps to the
/// beginning only once every commit of its is placed, so what it writes never lands on bytes
/// still waiting for an acknowledgement.
struct ZeroCopy {
    /// The mapping smoltcp's send buffer borrows: it outlives the socket (the socket is removed
    /// from the set before its `Conn` is dropped, and `Core` drops its sockets first).
    region: Arc<Region>,
    /// Bytes put into smoltcp's send buffer so far.
    queued: u64,
    /// Of those, bytes reported to the client as acknowledged.
    acked: u64,
    /// Commits taken so far (wrapping), and how many of them `Placed` has reported.
    commits: u32,
    placed: u32,
    /// The send buffer's next free position.
    tail: usize,
}

struct Listener {
    port: u16,
    /// smoltcp sockets listening on the port (one per backlog slot).
    waiting: Vec<SocketHandle>,
    /// Slots whose connection is established and not yet taken, oldest first.
    established: VecDeque<SocketHandle>,
    /// The holders were told (`Pending`) that a connection waits for a taker, and none was
    /// taken since.
    announced: bool,
}

struct UdpSock {
    sock: SocketHandle,
}

struct Core {
    iface: Interface,
    dev: PortDevice,
    sockets: SocketSet<'static>,
    /// The TCP sockets' buffers: declared after `sockets`, which borrow them, so dropped after.
    buffers: BufferPool,
    /// Own ports of connections freed in TIME-WAIT, and when each is free again.
    time_wait_ports: VecDeque<(Instant, u16)>,
    /// When the first corked connection holding bytes reaches the ceiling.
    cork_due: Option<Instant>,
    config: ServerConfig,
    listener: UnixListener,
    me: (u32, u32),
    clients: HashMap<u32, Client>,
    next_client: u32,
    handles: HashMap<u32, Handle>,
    /// Who holds each handle, and the fork tickets.
    shares: Shares,
    next_handle: u32,
    ports_in_use: HashSet<u16>,
    next_port: u16,
    epoll: OwnedFd,
    epoll_fds: HashSet<RawFd>,
    counters: ServerCounters,
    start: std::time::Instant,
    /// Data moved this iteration.
    busy: bool,
}

/// A TCP timestamp: milliseconds of one process-wide clock.
fn tsval() -> u32 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START.get_or_init(std::time::Instant::now).elapsed().as_millis() as u32
}

fn now(start: std::time::Instant) -> Instant {
    Instant::from_micros(start.elapsed().as_micros() as i64)
}

fn endpoint(e: Option<IpEndpoint>) -> Option<SocketAddr> {
    e.map(|e| match e.addr {
        IpAddress::Ipv4(a) => SocketAddr::V4(SocketAddrV4::new(a, e.port)),
        IpAddress::Ipv6(a) => SocketAddr::V6(SocketAddrV6::new(a, e.port, 0, 0)),
    })
}

fn ip_address(ip: IpAddr) -> IpAddress {
    match ip {
        IpAddr::V4(a) => IpAddress::Ipv4(a),
        IpAddr::V6(a) => IpAddress::Ipv6(a),
    }
}

/// "No address": the IPv4 wildcard and port 0.
const NOWHERE: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0));

impl Core {
    fn new(port: Box<dyn Port>, config: ServerConfig, listener: UnixListener) -> std::io::Result<Core> {
        let mac = port.mac();
        let mut dev = PortDevice::new(port);
        let start = std::time::Instant::now();
        let mut iface_config = Config::new(HardwareAddress::Ethernet(EthernetAddress(mac.0)));
        iface_config.random_seed = mac
            .0
            .iter()
            .fold(0x9e37_79b9_7f4a_7c15u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
            ^ std::process::id() as u64;
        let mut iface = Interface::new(iface_config, &mut dev, now(start));
        iface.update_ip_addrs(|addrs| {
            let _ = addrs.push(IpCidr::new(IpAddress::Ipv4(config.ip), config.prefix));
            if let Some((ip6, prefix6)) = config.ip6 {
                let _ = addrs.push(IpCidr::new(IpAddress::Ipv6(ip6), prefix6));
            }
        });
        if let Some(gw) = config.gateway6 {
            iface
                .routes_mut()
                .add_default_ipv6_route(gw)
                .map_err(|_| std::io::Error::other("the route table is full"))?;
        }
        if let Some(gw) = config.gateway {
            iface
                .routes_mut()
                .add_default_ipv4_route(gw)
                .map_err(|_| std::io::Error::other("the route table is full"))?;
        }
        // SAFETY: epoll_create1 has no memory preconditions; the result is checked.
        let epfd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if epfd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let epoll = unsafe { OwnedFd::from_raw_fd(epfd) };
        let mut core = Core {
            iface,
            dev,
            sockets: SocketSet::new(Vec::new()),
            buffers: BufferPool::new(config.tcp_buffer_bytes),
            time_wait_ports: VecDeque::new(),
            cork_due: None,
            config,
            listener,
            me: own_ids(),
            clients: HashMap::new(),
            next_client: 0,
            handles: HashMap::new(),
            shares: Shares::default(),
            next_handle: 0,
            ports_in_use: HashSet::new(),
            next_port: EPHEMERAL,
            epoll,
            epoll_fds: HashSet::new(),
            counters: ServerCounters::default(),
            start,
            busy: false,
        };
        core.watch(core.listener.as_raw_fd());
        if let Some(fd) = core.dev.port().readiness_fd() {
            core.watch(fd);
        }
        Ok(core)
    }

    fn watch(&mut self, fd: RawFd) {
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: fd as u64 };
        // SAFETY: ev is a valid epoll_event; fd is open (owned by the caller's object).
        if unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) } == 0 {
            self.epoll_fds.insert(fd);
        }
    }

    fn unwatch(&mut self, fd: RawFd) {
        if self.epoll_fds.remove(&fd) {
            // SAFETY: removing a descriptor registered above; a null event is allowed for DEL.
            unsafe {
                libc::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_DEL, fd, core::ptr::null_mut())
            };
        }
    }

    fn run(&mut self, stop: &AtomicBool, status: &Mutex<ServerStatus>) {
        let mut idle_since = std::time::Instant::now();
        // Whether this idle spell may poll (looked up once per spell).
        let mut may_spin: Option<bool> = None;
        let mut last_status = std::time::Instant::now() - Duration::from_secs(1);
        // Relaxed: a flag polled every iteration.
        while !stop.load(Ordering::Relaxed) {
            self.busy = false;
            self.accept_clients();
            self.serve_clients();
            let t = now(self.start);
            if self.dev.fill() {
                self.busy = true;
            }
            // Received frames a burst at a time, each burst's ACKs sent before the next.
            for _ in 0..8 {
                self.dev.refill_budget();
                self.iface.poll(t, &mut self.dev, &mut self.sockets);
                if !self.dev.fill() {
                    break;
                }
            }
            self.service_handles(t);
            self.dev.refill_budget();
            self.iface.poll(t, &mut self.dev, &mut self.sockets);
            if self.dev.flush() {
                self.busy = true;
            }
            self.flush_clients();
            if last_status.elapsed() >= Duration::from_millis(100) {
                self.reap_tickets();
                *status.lock().unwrap_or_else(|p| p.into_inner()) = self.status();
                last_status = std::time::Instant::now();
            }
            if self.busy {
                idle_since = std::time::Instant::now();
                may_spin = None;
            } else if idle_since.elapsed() >= SPIN || !*may_spin.get_or_insert_with(crate::spare_cpu) {
                self.sleep();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Sleeps until a frame, a client or a TCP timer needs the loop (at most 100 ms).
    fn sleep(&mut self) {
        let t = now(self.start);
        let mut delay =
            self.iface.poll_delay(t, &self.sockets).map_or(100_000, |d| d.total_micros()).min(100_000);
        if let Some(due) = self.cork_due {
            delay = delay.min(if due > t { (due - t).total_micros() } else { 0 });
        }
        for c in self.clients.values_mut() {
            if std::mem::take(&mut c.blocked) {
                delay = delay.min(500);
            }
        }
        if delay == 0 {
            return;
        }
        for c in self.clients.values() {
            if let Link::Shm { from: Some(from), .. } = &c.link {
                from.prepare_wait();
            }
        }
        let pending = self.clients.values().any(|c| match &c.link {
            Link::Shm { from: Some(from), .. } => from.has_pending(),
            _ => false,
        });
        if !pending {
            if self.dev.port().readiness_fd().is_some() {
                // A doorbell port rings only when asked; a waiting frame means no sleep.
                if self.dev.port_mut().arm_readiness() {
                    let mut events = [libc::epoll_event { events: 0, u64: 0 }; 16];
                    let ms = delay.div_ceil(1000).clamp(1, 100) as i32;
                    // SAFETY: events is a live array of 16 entries.
                    unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), events.as_mut_ptr(), 16, ms) };
                }
                self.dev.port_mut().disarm_readiness();
            } else {
                let _ = self.dev.port_mut().wait(Some(Duration::from_micros(delay.min(1000))));
            }
        }
        for c in self.clients.values() {
            if let Link::Shm { from: Some(from), server_bell, .. } = &c.link {
                from.finish_wait();
                let _ = server_bell.wait(Some(Duration::ZERO));
            }
        }
    }

    fn accept_clients(&mut self) {
        while let Ok((sock, _)) = self.listener.accept() {
            match self.attach(sock) {
                Ok(()) => self.counters.clients_attached += 1,
                Err(why) => {
                    self.counters.clients_refused += 1;
                    tracing::info!("stack client refused: {why}");
                }
            }
            self.busy = true;
        }
    }

    fn attach(&mut self, sock: UnixStream) -> Result<(), String> {
        let cred = peer_cred(&sock).map_err(|e| e.to_string())?;
        let refuse = |sock: &UnixStream, errno: i32| {
            let mut answer = [0u8; hello::ANSWER_LEN];
            answer[..8].copy_from_slice(hello::MAGIC);
            answer[8..12].copy_from_slice(&errno.to_le_bytes());
            let _ = (&*sock).write_all(&answer);
        };
        if !(cred.uid == 0 || cred.uid == self.me.0 || cred.gid == self.me.1) {
            refuse(&sock, libc::EACCES);
            return Err(format!(
                "process {} (uid {}) is not in the server's user or group",
                cred.pid, cred.uid
            ));
        }
        sock.set_read_timeout(Some(Duration::from_millis(500))).map_err(|e| e.to_string())?;
        let mut h = [0u8; hello::LEN];
        (&sock).read_exact(&mut h).map_err(|e| format!("no hello: {e}"))?;
        if &h[..8] != hello::MAGIC {
            return Err("not a lanbus stack client".into());
        }
        let channel = match h[8] {
            0 => Channel::SharedMemory,
            1 => Channel::UnixSocket,
            _ => {
                refuse(&sock, libc::EINVAL);
                return Err("unknown channel".into());
            }
        };
        let unit = CopyUnit {
            cluster_bytes: u32::from_le_bytes(h[12..16].try_into().expect("4 bytes")),
            clusters: u32::from_le_bytes(h[16..20].try_into().expect("4 bytes")),
            channel,
        };
        if let Err(why) = unit.check() {
            refuse(&sock, libc::EINVAL);
            return Err(why);
        }
        let mut answer = [0u8; hello::ANSWER_LEN];
        answer[..8].copy_from_slice(hello::MAGIC);
        answer[12..16].copy_from_slice(&self.config.ip.octets());
        answer[16] = self.config.prefix;
        let io = |e: lanbus_ring::Error| e.to_string();
        let link = match channel {
            Channel::SharedMemory => {
                let cfg = pipe_config(unit.bytes());
                let region =
                    Arc::new(Region::memfd("lanbus-stack", pipe_offset(unit.bytes(), 2)).map_err(io)?);
                cfg.format(&region, pipe_offset(unit.bytes(), 0)).map_err(io)?;
                cfg.format(&region, pipe_offset(unit.bytes(), 1)).map_err(io)?;
                let to = Sender::attach(region.clone(), pipe_offset(unit.bytes(), 0), CopyMode::Ordinary)
                    .map_err(io)?;
                let from = Receiver::attach(region.clone(), pipe_offset(unit.bytes(), 1)).map_err(io)?;
                let (server_bell, client_bell) = (EventFd::new().map_err(io)?, EventFd::new().map_err(io)?);
                let memfd = region.fd().ok_or("the region has no memfd")?;
                send_fds(&sock, &answer, &[memfd, server_bell.as_fd(), client_bell.as_fd()]).map_err(io)?;
                Link::Shm { to, from: Some(from), client_bell, server_bell, _region: region }
            }
            Channel::UnixSocket => {
                (&sock).write_all(&answer).map_err(|e| e.to_string())?;
                Link::Socket { read: Vec::new(), write: VecDeque::new() }
            }
        };
        sock.set_nonblocking(true).map_err(|e| e.to_string())?;
        let id = loop {
            self.next_client = self.next_client.wrapping_add(1).max(1);
            if !self.clients.contains_key(&self.next_client) {
                break self.next_client;
            }
        };
        self.watch(sock.as_raw_fd());
        if let Link::Shm { server_bell, .. } = &link {
            self.watch(server_bell.as_fd().as_raw_fd());
        }
        let client = Client {
            sock,
            link,
            pid: cred.pid,
            unit: unit.bytes(),
            outbox: VecDeque::new(),
            wrote: false,
            blocked: false,
        };
        self.clients.insert(id, client);
        tracing::info!("stack client {id} (pid {}) attached, copy unit {unit}", cred.pid);
        Ok(())
    }

    /// Reads every client's requests; disconnects clients that went away or broke the protocol.
    fn serve_clients(&mut self) {
        let ids: Vec<u32> = self.clients.keys().copied().collect();
        for id in ids {
            if let Err(why) = self.serve_client(id) {
                self.drop_client(id, &why);
            }
        }
    }

    fn serve_client(&mut self, id: u32) -> Result<(), String> {
        let Some(client) = self.clients.get_mut(&id) else { return Ok(()) };
        // EOF on the socket: the client is gone (in both channels).
        match &mut client.link {
            Link::Shm { from, .. } => {
                let mut probe = [0u8; 1];
                // A program that writes and exits at once has its last requests in the ring
                // when its end shows on the socket: they are served before it is let go (its
                // last bytes are sent, its closes close), as the kernel sends what a program
                // wrote before it exited.
                let departed: Option<String> = match (&client.sock).read(&mut probe) {
                    Ok(0) => Some("closed its socket".into()),
                    Ok(_) => return Err("wrote on its socket after the hello".into()),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
                    // A client that dies with replies unread resets its end: it went away, it did
                    // not break the protocol.
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                        Some("closed its socket with replies unread".into())
                    }
                    Err(e) => return Err(e.to_string()),
                };
                let mut from = from.take().expect("put back below");
                let mut result = Ok(());
                // A departed client adds nothing more: its ring is read to the end (bounded by
                // the ring's size).
                let burst = if departed.is_some() { usize::MAX } else { 256 };
                for _ in 0..burst {
                    let mut msg_result = Ok(());
                    match from.recv(|bytes| msg_result = self.handle_bytes(id, bytes)) {
                        Ok(true) => {
                            self.busy = true;
                            if let Err(e) = msg_result {
                                result = Err(e);
                                break;
                            }
                        }
                        Ok(false) => break,
                        Err(e) => {
                            result = Err(format!("its ring: {e}"));
                            break;
                        }
                    }
                }
                if let Some(Client { link: Link::Shm { from: slot, .. }, .. }) = self.clients.get_mut(&id) {
                    *slot = Some(from);
                }
                result.and(departed.map_or(Ok(()), Err))
            }
            Link::Socket { .. } => {
                // As over shared memory: what came before the end is served first.
                let mut departed: Option<String> = None;
                // Zeroed here, not for every client on every pass of the loop: 64 KiB of zeroes
                // per shared-memory client per pass was a few percent of a busy loop's time.
                let mut buf = [0u8; 65536];
                loop {
                    let Some(client) = self.clients.get_mut(&id) else { return Ok(()) };
                    let Link::Socket { read, .. } = &mut client.link else { unreachable!() };
                    // At most a few messages' worth buffered: the rest stays in the socket.
                    if read.len() > 2 * (HEADER_LEN + client.unit) + 8 {
                        break;
                    }
                    match (&client.sock).read(&mut buf) {
                        Ok(0) => {
                            departed = Some("closed its socket".into());
                            break;
                        }
                        Ok(n) => {
                            read.extend_from_slice(&buf[..n]);
                            self.busy = true;
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                            departed = Some("closed its socket with replies unread".into());
                            break;
                        }
                        Err(e) => return Err(e.to_string()),
                    }
                }
                let Some(client) = self.clients.get_mut(&id) else { return Ok(()) };
                let Link::Socket { read, .. } = &mut client.link else { unreachable!() };
                let mut bytes = std::mem::take(read);
                let mut at = 0;
                let mut result = Ok(());
                while bytes.len() - at >= 4 {
                    let len = u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes")) as usize;
                    if len > HEADER_LEN + crate::proto::MAX_PAYLOAD {
                        result = Err(format!("a message of {len} bytes"));
                        break;
                    }
                    if bytes.len() - at - 4 < len {
                        break;
                    }
                    if let Err(e) = self.handle_bytes(id, &bytes[at + 4..at + 4 + len]) {
                        result = Err(e);
                        break;
                    }
                    at += 4 + len;
                }
                bytes.drain(..at);
                if let Some(Client { link: Link::Socket { read, .. }, .. }) = self.clients.get_mut(&id) {
                    *read = bytes;
                }
                result.and(departed.map_or(Ok(()), Err))
            }
        }
    }

    fn handle_bytes(&mut self, id: u32, bytes: &[u8]) -> Result<(), String> {
        let msg = Msg::parse(bytes).map_err(|e| e.to_string())?;
        self.handle(id, msg)
    }

    /// The handle `h` if client `id` holds it.
    fn owned(&mut self, id: u32, h: u32) -> Option<&mut Handle> {
        if !self.shares.holds(h, id) {
            return None;
        }
        self.handles.get_mut(&h)
    }

    fn new_handle(&mut self) -> u32 {
        loop {
            self.next_handle = self.next_handle.wrapping_add(1).max(1);
            if !self.handles.contains_key(&self.next_handle) {
                return self.next_handle;
            }
        }
    }

    fn free_port(&mut self) -> Option<u16> {
        for _ in 0..=(u16::MAX - EPHEMERAL) {
            let p = self.next_port;
            self.next_port = if p == u16::MAX { EPHEMERAL } else { p + 1 };
            if !self.ports_in_use.contains(&p) {
                return Some(p);
            }
        }
        None
    }

    /// A TCP socket with the server's settings and buffers from the pool (`tx`, if given, as
    /// its send buffer instead), and the mappings it borrows: hand both to
    /// [`add_tcp`](Self::add_tcp), or drop the socket and then recycle the mappings.
    fn tcp_socket(&mut self, tx: Option<tcp::SocketBuffer<'static>>) -> (tcp::Socket<'static>, Vec<Region>) {
        let mut lent = Vec::new();
        // SAFETY: the mappings go back to the caller with the socket, which `add_tcp` keeps
        // lent until the socket leaves the set (`remove_tcp`), or which the caller recycles
        // after dropping the socket.
        let (rx, r) = unsafe { self.buffers.take() };
        lent.extend(r);
        let tx = match tx {
            Some(tx) => tx,
            None => {
                // SAFETY: as above.
                let (tx, r) = unsafe { self.buffers.take() };
                lent.extend(r);
                tx
            }
        };
        let mut s = tcp::Socket::new(rx, tx);
        s.set_congestion_control(tcp::CongestionControl::Cubic);
        s.set_nagle_enabled(false);
        s.set_ack_delay(None);
        // smoltcp aborts a keep-alive connection whose peer is silent for the timeout, so probe
        // often enough that a live peer always answers in time.
        s.set_keep_alive(Some(self.config.keep_alive.min(self.config.timeout / 3).into()));
        s.set_timeout(Some(self.config.timeout.into()));
        // Timestamps from one clock for every connection (RFC 7323): a new connection on a
        // 4-tuple the peer still holds in TIME-WAIT then carries a newer one, which is what
        // lets Linux take its SYN (at thousands of connects a second the ephemeral ports come
        // round within Linux's 60 s of TIME-WAIT).
        s.set_tsval_generator(Some(tsval));
        (s, lent)
    }

    /// Puts a socket made by [`tcp_socket`](Self::tcp_socket) in the set.
    fn add_tcp(&mut self, (s, lent): (tcp::Socket<'static>, Vec<Region>)) -> SocketHandle {
        let h = self.sockets.add(s);
        self.buffers.lend(h, lent);
        h
    }

    /// Removes a TCP socket from the set and takes its buffers back.
    fn remove_tcp(&mut self, h: SocketHandle) {
        drop(self.sockets.remove(h));
        self.buffers.give_back(h);
    }

    /// Opens a connection for client `id`'s request `req`; `zc` is its shared send buffer.
    fn connect(&mut self, id: u32, req: u32, to: SocketAddr, zc: Option<ZeroCopy>, t: Instant) {
        let Some(local_port) = self.free_port() else {
            self.reply(id, Msg::Failed { req, errno: libc::EADDRNOTAVAIL });
            return;
        };
        let tx = zc.as_ref().map(|zc| {
            // SAFETY: the slice is the whole mapping `zc.region`, which the connection keeps
            // until its socket is removed from the set (see `ZeroCopy::region`). The client
            // may write it at any time: what it writes is its own stream's bytes, which the
            // stack only copies into frames, so a misbehaving client garbles only its stream.
            let buf = unsafe { std::slice::from_raw_parts_mut(zc.region.as_ptr(), zc.region.len()) };
            tcp::SocketBuffer::new(buf)
        });
        let (mut s, lent) = self.tcp_socket(tx);
        let remote = IpEndpoint::new(ip_address(to.ip()), to.port());
        if let Err(e) = s.connect(self.iface.context(), remote, local_port) {
            tracing::debug!("connect to {to}: {e}");
            drop(s);
            self.buffers.recycle(lent);
            let errno =
                if to.port() == 0 || to.ip().is_unspecified() { libc::EINVAL } else { libc::ENETUNREACH };
            self.reply(id, Msg::Failed { req, errno });
            return;
        }
        let sock = self.add_tcp((s, lent));
        self.ports_in_use.insert(local_port);
        self.counters.connections_opened += 1;
        let h = self.new_handle();
        let conn = Conn { own_port: Some(local_port), zc, ..Conn::new(id, sock, Some(req), t) };
        self.handles.insert(h, Handle::Conn(conn));
        self.shares.open(h, id);
    }

    /// A zero-copy send buffer for client `id`, its memfd passed over the client's socket as a
    /// message of the request id and the buffer's size. Shared-memory clients only.
    fn zero_copy_buffer(&mut self, id: u32, req: u32) -> Result<ZeroCopy, i32> {
        let client = self.clients.get(&id).ok_or(libc::EINVAL)?;
        if !matches!(client.link, Link::Shm { .. }) {
            return Err(libc::EOPNOTSUPP);
        }
        let region = Region::memfd("lanbus-stack-zero-copy", self.config.tcp_buffer_bytes)
            .map_err(|_| libc::ENOMEM)?;
        let len = u32::try_from(region.len()).map_err(|_| libc::EINVAL)?;
        let mut note = [0u8; 8];
        note[..4].copy_from_slice(&req.to_le_bytes());
        note[4..].copy_from_slice(&len.to_le_bytes());
        let fd = region.fd().ok_or(libc::ENOMEM)?;
        send_fds(&client.sock, &note, &[fd]).map_err(|_| libc::ENOBUFS)?;
        Ok(ZeroCopy { region: Arc::new(region), queued: 0, acked: 0, commits: 0, placed: 0, tail: 0 })
    }

    /// Takes `bytes` bytes a zero-copy client wrote at `offset` of its send buffer into the stack.
    fn commit(&mut self, id: u32, conn: u32, offset: usize, bytes: usize) -> Result<(), String> {
        if self.owned(id, conn).is_none() {
            // A connection that closed under the client: its bytes have nowhere to go.
            return Ok(());
        }
        let Some(Handle::Conn(c)) = self.handles.get_mut(&conn) else { return Ok(()) };
        if c.shutdown {
            return Err("committed after shutting the connection down".into());
        }
        let sock = c.sock;
        let Some(zc) = c.zc.as_mut() else {
            return Err("committed on a connection without zero copy".into());
        };
        let cap = zc.region.len();
        if bytes == 0 || offset >= cap || bytes > cap - offset {
            return Err(format!("committed {bytes} bytes at {offset} of a {cap}-byte send buffer"));
        }
        let s = self.sockets.get_mut::<tcp::Socket>(sock);
        let queued = s.send_queue();
        // The bytes waiting for an acknowledgement sit just before the tail (smoltcp's buffer is a
        // ring): a commit whose bytes overlap them was written over unacknowledged data.
        let start = (zc.tail + cap - queued % cap) % cap;
        let overlaps = |a: usize, b: usize| offset < b && a < offset + bytes;
        let over_waiting = queued > 0
            && if start + queued <= cap {
                overlaps(start, start + queued)
            } else {
                overlaps(start, cap) || overlaps(0, start + queued - cap)
            };
        if over_waiting {
            return Err("committed bytes over data still waiting for an acknowledgement".into());
        }
        let base = zc.region.as_ptr();
        let result = s.send(|buf| {
            let at = buf.as_ptr() as usize - base as usize;
            if bytes > buf.len() {
                return (0, Err(format!("committed {bytes} bytes where {} are free", buf.len())));
            }
            if at != offset {
                // SAFETY: both ranges lie inside the mapping (checked above, and smoltcp's slice
                // is part of it); `copy` allows them to overlap.
                unsafe { std::ptr::copy(base.add(offset), buf.as_mut_ptr(), bytes) };
            }
            (bytes, Ok(at))
        });
        match result {
            Ok(Ok(at)) => {
                zc.tail = (at + bytes) % cap;
                zc.queued += bytes as u64;
                zc.commits = zc.commits.wrapping_add(1);
                self.counters.tx_bytes += bytes as u64;
                if at == offset {
                    self.counters.zero_copy_bytes += bytes as u64;
                } else {
                    self.counters.zero_copy_moved_bytes += bytes as u64;
                }
                Ok(())
            }
            Ok(Err(why)) => Err(why),
            // Not connected any more: the bytes are dropped, as a closed connection's are.
            Err(_) => Ok(()),
        }
    }

    fn reply(&mut self, id: u32, msg: Msg<'_>) {
        if let Some(c) = self.clients.get_mut(&id) {
            c.control(msg);
        }
    }

    fn handle(&mut self, id: u32, msg: Msg<'_>) -> Result<(), String> {
        let t = now(self.start);
        match msg {
            Msg::Connect { req, to } => self.connect(id, req, to, None, t),
            Msg::ConnectZeroCopy { req, to } => {
                let zc = match self.zero_copy_buffer(id, req) {
                    Ok(zc) => zc,
                    Err(errno) => {
                        self.reply(id, Msg::Failed { req, errno });
                        return Ok(());
                    }
                };
                self.connect(id, req, to, Some(zc), t);
            }
            Msg::Commit { conn, offset, bytes } => self.commit(id, conn, offset as usize, bytes as usize)?,
            Msg::Listen { req, port, backlog } => {
                let port = if port == 0 { self.free_port().unwrap_or(0) } else { port };
                if port == 0 || self.ports_in_use.contains(&port) {
                    self.reply(id, Msg::Failed { req, errno: libc::EADDRINUSE });
                    return Ok(());
                }
                let mut waiting = Vec::new();
                for _ in 0..backlog.clamp(1, 128) {
                    let (mut s, lent) = self.tcp_socket(None);
                    if s.listen(port).is_err() {
                        drop(s);
                        self.buffers.recycle(lent);
                        break;
                    }
                    waiting.push(self.add_tcp((s, lent)));
                }
                self.ports_in_use.insert(port);
                let h = self.new_handle();
                self.handles.insert(
                    h,
                    Handle::Listener(Listener {
                        port,
                        waiting,
                        established: VecDeque::new(),
                        announced: false,
                    }),
                );
                self.shares.open(h, id);
                self.reply(
                    id,
                    Msg::Opened { req, handle: h, local: SocketAddr::new(self.config.ip.into(), port) },
                );
            }
            Msg::UdpBind { req, port } => {
                let port = if port == 0 { self.free_port().unwrap_or(0) } else { port };
                if port == 0 || self.ports_in_use.contains(&port) {
                    self.reply(id, Msg::Failed { req, errno: libc::EADDRINUSE });
                    return Ok(());
                }
                let meta = || vec![udp::PacketMetadata::EMPTY; 256];
                let mut s = udp::Socket::new(
                    udp::PacketBuffer::new(meta(), vec![0; 1 << 20]),
                    udp::PacketBuffer::new(meta(), vec![0; 1 << 20]),
                );
                if s.bind(port).is_err() {
                    self.reply(id, Msg::Failed { req, errno: libc::EINVAL });
                    return Ok(());
                }
                let sock = self.sockets.add(s);
                self.ports_in_use.insert(port);
                let h = self.new_handle();
                self.handles.insert(h, Handle::Udp(UdpSock { sock }));
                self.shares.open(h, id);
                self.reply(
                    id,
                    Msg::Opened { req, handle: h, local: SocketAddr::new(self.config.ip.into(), port) },
                );
            }
            Msg::Send { conn, data } => {
                let Some(Handle::Conn(c)) = self.owned(id, conn) else {
                    // A connection that closed under the client: its bytes have nowhere to go.
                    return Ok(());
                };
                if c.shutdown {
                    return Err("sent after shutting the connection down".into());
                }
                if c.zc.is_some() {
                    return Err("sent bytes on a zero-copy connection (it commits them)".into());
                }
                let mine: usize = c.pending_owners.iter().filter(|(o, _)| *o == id).map(|(_, n)| n).sum();
                if mine as u64 + data.len() as u64 > SEND_CREDIT {
                    return Err("sent beyond its credit".into());
                }
                self.counters.tx_bytes += data.len() as u64;
                // Straight from the client's ring into smoltcp's send buffer when nothing waits
                // before these bytes and the connection is not corked; only what does not fit
                // (or is held back) is kept aside.
                let Some(Handle::Conn(c)) = self.handles.get_mut(&conn) else { return Ok(()) };
                let taken = if c.pending.is_empty() && c.corked.is_none() {
                    self.sockets.get_mut::<tcp::Socket>(c.sock).send_slice(data).unwrap_or(0)
                } else {
                    0
                };
                c.report(id, taken as u64);
                if taken < data.len() {
                    c.pending.extend(&data[taken..]);
                    c.pending_owners.push_back((id, data.len() - taken));
                }
            }
            Msg::Consumed { conn, bytes } => {
                // Only the reader's reads return credit: an earlier reader reading what it was
                // sent before gives back nothing the new one was counted for.
                let reader = self.shares.reader(conn) == Some(id);
                if let Some(Handle::Conn(c)) = self.owned(id, conn).filter(|_| reader) {
                    if c.reader == Some(id) {
                        c.credit = (c.credit + bytes).min(RECV_CREDIT);
                    }
                }
            }
            Msg::Shutdown { conn } => {
                if let Some(Handle::Conn(c)) = self.owned(id, conn) {
                    c.shutdown = true;
                }
            }
            Msg::Close { handle } => self.close_handle(id, handle, false),
            Msg::Abort { conn } => self.close_handle(id, conn, true),
            Msg::Fork { req } => {
                // A fork reports its child at once: a client with this many unreported is not
                // forking, and each ticket costs the server memory.
                if self.shares.unreported(id) >= MAX_UNREPORTED_FORKS {
                    self.counters.forks_refused += 1;
                    self.reply(id, Msg::Failed { req, errno: libc::EAGAIN });
                    return Ok(());
                }
                let token = self.new_token();
                // A zero-copy connection's send buffer is one mapping between one program and
                // the stack: it stays with the parent.
                let handles: Vec<u32> = self
                    .shares
                    .held_by(id)
                    .into_iter()
                    .filter(|h| !matches!(self.handles.get(h), Some(Handle::Conn(c)) if c.zc.is_some()))
                    .collect();
                self.shares.fork(token, id, &handles);
                self.counters.forks += 1;
                self.reply(id, Msg::Ticket { req, token });
            }
            Msg::Forked { token, pid } => match self.shares.forked(token, id, (pid != 0).then_some(pid)) {
                Ok(freed) => {
                    for h in freed {
                        self.free_handle(h, false);
                    }
                }
                // The child may have claimed the ticket before the parent's report came; a report
                // about another client's ticket changes nothing either.
                Err(_) => tracing::debug!("stack client {id}: report of a fork ticket it has no more"),
            },
            Msg::Adopt { req, token } => {
                let pid = self.clients.get(&id).map_or(0, |c| c.pid) as u32;
                match self.shares.claim(token, id, pid) {
                    Ok(Claimed { handles, ended }) => {
                        self.counters.forks_adopted += 1;
                        // What ended while only the ticket held it: the child hears it as a
                        // connection closed under it.
                        for (conn, errno) in ended {
                            self.reply(id, Msg::Closed { conn, errno });
                        }
                        // A connection waiting in a shared backlog is announced again, so that
                        // the new holder hears of it too.
                        for h in &handles {
                            if let Some(Handle::Listener(l)) = self.handles.get_mut(h) {
                                l.announced = false;
                            }
                        }
                        let n = handles.len() as u32;
                        self.reply(id, Msg::Opened { req, handle: n, local: NOWHERE });
                    }
                    Err(why) => {
                        self.counters.forks_refused += 1;
                        tracing::info!("stack client {id} (pid {pid}): fork ticket refused: {why:?}");
                        self.reply(id, Msg::Failed { req, errno: libc::EPERM });
                    }
                }
            }
            Msg::Cork { conn, corked } => {
                if let Some(Handle::Conn(c)) = self.owned(id, conn) {
                    c.corked = if corked { Some(c.corked.unwrap_or(t)) } else { None };
                    self.busy |= !corked;
                }
            }
            Msg::Want { handle } => {
                let listener = matches!(self.handles.get(&handle), Some(Handle::Listener(_)));
                self.shares.want(handle, id, listener);
            }
            Msg::UdpSend { sock, to, data } => {
                if let Some(Handle::Udp(u)) = self.owned(id, sock) {
                    let handle = u.sock;
                    let s = self.sockets.get_mut::<udp::Socket>(handle);
                    let to = IpEndpoint::new(ip_address(to.ip()), to.port());
                    // A full send buffer drops the datagram, as UDP may.
                    let _ = s.send_slice(data, to);
                    self.counters.tx_bytes += data.len() as u64;
                }
            }
            Msg::Opened { .. }
            | Msg::Ticket { .. }
            | Msg::Placed { .. }
            | Msg::Failed { .. }
            | Msg::Accepted { .. }
            | Msg::Pending { .. }
            | Msg::Data { .. }
            | Msg::Sent { .. }
            | Msg::Eof { .. }
            | Msg::Closed { .. }
            | Msg::UdpData { .. } => return Err("sent a message only the server sends".into()),
        }
        Ok(())
    }

    /// Client `id` is done with `h`. When it was the last holder, a connection closes (FIN
    /// after queued bytes, or RST when `abort`) and is freed when TCP is done with it; listeners
    /// and UDP sockets go at once. Other holders keep it as it is.
    fn close_handle(&mut self, id: u32, h: u32, abort: bool) {
        if self.shares.release(h, id) {
            self.free_handle(h, abort);
        }
    }

    /// Nobody holds `h` any more: close it.
    fn free_handle(&mut self, h: u32, abort: bool) {
        match self.handles.get_mut(&h) {
            Some(Handle::Conn(c)) => {
                c.orphan = true;
                c.shutdown = true;
                if abort {
                    c.pending.clear();
                    c.pending_owners.clear();
                    self.sockets.get_mut::<tcp::Socket>(c.sock).abort();
                }
            }
            Some(Handle::Listener(_)) => {
                if let Some(Handle::Listener(l)) = self.handles.remove(&h) {
                    for s in l.waiting {
                        self.sockets.get_mut::<tcp::Socket>(s).abort();
                        self.remove_tcp(s);
                    }
                    self.ports_in_use.remove(&l.port);
                    self.dev.backlog_room.remove(&l.port);
                }
            }
            Some(Handle::Udp(_)) => {
                if let Some(Handle::Udp(u)) = self.handles.remove(&h) {
                    let s = self.sockets.remove(u.sock);
                    if let smoltcp::socket::Socket::Udp(s) = s {
                        self.ports_in_use.remove(&s.endpoint().port);
                    }
                }
            }
            None => {}
        }
    }

    fn drop_client(&mut self, id: u32, why: &str) {
        let Some(client) = self.clients.remove(&id) else { return };
        if !why.starts_with("closed its socket") {
            self.counters.clients_broken += 1;
            tracing::warn!("stack client {id} (pid {}) disconnected: {why}", client.pid);
        } else {
            tracing::info!("stack client {id} (pid {}) went away", client.pid);
        }
        self.unwatch(client.sock.as_raw_fd());
        if let Link::Shm { server_bell, .. } = &client.link {
            self.unwatch(server_bell.as_fd().as_raw_fd());
        }
        // What it held alone closes; what other processes hold stays theirs.
        for h in self.shares.client_gone(id) {
            // Unread data at exit makes Linux reset the connection; otherwise it closes.
            let abort = matches!(self.handles.get(&h), Some(Handle::Conn(c))
                if self.sockets.get::<tcp::Socket>(c.sock).recv_queue() > 0);
            self.free_handle(h, abort);
        }
    }

    /// A fresh fork ticket's secret: unguessable, so that only the child the parent passed it
    /// to can claim the parent's sockets.
    fn new_token(&mut self) -> u64 {
        loop {
            let mut token = 0u64;
            // SAFETY: getrandom writes at most 8 bytes into the live u64.
            let n = unsafe { libc::getrandom((&mut token as *mut u64).cast(), 8, 0) };
            if n != 8 {
                // No kernel randomness (never on Linux 3.17+): still unique, if guessable.
                self.next_handle = self.next_handle.wrapping_add(1);
                token = (self.start.elapsed().as_nanos() as u64) ^ (u64::from(self.next_handle) << 32);
            }
            if token != 0 && self.shares.fork(token, 0, &[]) {
                // Reserved by an empty ticket of nobody's; the caller's replaces it.
                self.shares.release_ticket(token);
                return token;
            }
        }
    }

    /// Frees the tickets whose child ended (or is a zombie) without claiming them.
    fn reap_tickets(&mut self) {
        for (token, pid) in self.shares.children() {
            if !process_alive(pid) {
                tracing::debug!("fork ticket of process {pid} released: it ended unclaimed");
                for h in self.shares.release_ticket(token) {
                    self.free_handle(h, false);
                }
            }
        }
    }

    /// Moves bytes between connections and clients and reports state changes.
    fn service_handles(&mut self, t: Instant) {
        let hs: Vec<u32> = self.handles.keys().copied().collect();
        let mut free = Vec::new();
        let mut accepted = Vec::new();
        self.cork_due = None;
        for h in hs {
            match self.handles.get_mut(&h) {
                Some(Handle::Conn(c)) => {
                    let s = self.sockets.get_mut::<tcp::Socket>(c.sock);
                    let reader = self.shares.reader(h);
                    if reader != c.reader {
                        // A new reader: what the last one was sent is its own to read (and
                        // counted against nothing any more); the end is the new one's to hear.
                        c.reader = reader;
                        c.credit = RECV_CREDIT;
                        c.eof_sent = false;
                    }
                    let client = reader.and_then(|r| self.clients.get_mut(&r));
                    if service_conn(h, c, s, client, t, &mut self.counters, self.config.timeout) {
                        self.busy = true;
                    }
                    if let Some(since) = c.corked.filter(|_| !c.pending.is_empty()) {
                        let due = since + CORK_CEILING;
                        self.cork_due = Some(self.cork_due.map_or(due, |d| d.min(due)));
                    }
                    // Send credit goes back to whoever wrote the bytes.
                    for (owner, bytes) in c.unreported.drain(..) {
                        if let Some(cl) = self.clients.get_mut(&owner) {
                            cl.control(Msg::Sent { conn: h, bytes });
                        }
                    }
                    if let Some(errno) = c.ended.take() {
                        // The reader was told; the other holders hear it too, and the handle
                        // is nobody's any more (it is freed once TCP is done).
                        for &other in self.shares.holders(h) {
                            if Some(other) != reader {
                                if let Some(cl) = self.clients.get_mut(&other) {
                                    cl.control(Msg::Closed { conn: h, errno });
                                }
                            }
                        }
                        self.shares.forget(h, errno);
                    }
                    if c.orphan && s.state() == tcp::State::Closed {
                        free.push(h);
                    } else if c.orphan && s.state() == tcp::State::TimeWait {
                        // Nobody holds it and its last ACK went out in the poll that followed
                        // the last look: a socket left for smoltcp's ten seconds of TIME-WAIT
                        // would keep its buffers, and every later segment would be matched
                        // against it, so that at thousands of connections a second the loop
                        // spent its time on the dead ones.
                        if c.time_wait_seen {
                            free.push(h);
                        }
                        c.time_wait_seen = true;
                    }
                }
                Some(Handle::Listener(l)) => {
                    let mut room = 0;
                    for slot in l.waiting.iter() {
                        let s = self.sockets.get_mut::<tcp::Socket>(*slot);
                        match s.state() {
                            tcp::State::Listen => room += 1,
                            tcp::State::SynReceived => {}
                            tcp::State::Closed => {
                                // Reset during the handshake: listen again.
                                let _ = s.listen(l.port);
                                room += 1;
                            }
                            _ => {
                                if !l.established.contains(slot) {
                                    l.established.push_back(*slot);
                                }
                            }
                        }
                    }
                    // A connection reset before it was taken waits no more (its slot listens
                    // again, above).
                    let sockets = &self.sockets;
                    l.established.retain(|slot| {
                        !matches!(
                            sockets.get::<tcp::Socket>(*slot).state(),
                            tcp::State::Listen | tcp::State::SynReceived | tcp::State::Closed
                        )
                    });
                    // Shared: a connection waits in the backlog until a holder asks for one, and
                    // they are handed out in the order they were established (a kernel's accept
                    // queue is one): in slot order, a connection in a late slot waited while the
                    // early slots, refilled, were served again and again.
                    let mut untaken = false;
                    while let Some(&slot) = l.established.front() {
                        let Some(client) = self.shares.take_accepter(h) else {
                            untaken = true;
                            break;
                        };
                        l.established.pop_front();
                        accepted.push((h, client, l.port, slot));
                        l.announced = false;
                        // A fresh slot listens in its place below.
                        room += 1;
                    }
                    self.dev.backlog_room.insert(l.port, room);
                    if untaken && !l.announced {
                        // Every holder that has not asked hears of it: an event loop waiting
                        // on the listener then asks (its placeholder polls readable).
                        l.announced = true;
                        for c in self.shares.unasked(h) {
                            if let Some(cl) = self.clients.get_mut(&c) {
                                cl.control(Msg::Pending { listener: h });
                                self.busy = true;
                            }
                        }
                    }
                }
                Some(Handle::Udp(u)) => {
                    let s = self.sockets.get_mut::<udp::Socket>(u.sock);
                    let Some(client) = self.shares.reader(h).and_then(|r| self.clients.get_mut(&r)) else {
                        continue;
                    };
                    while client.clear() && s.can_recv() {
                        let Ok((data, meta)) = s.recv() else { break };
                        let from = endpoint(Some(meta.endpoint)).unwrap_or(NOWHERE);
                        let data = &data[..data.len().min(client.unit)];
                        self.counters.rx_bytes += data.len() as u64;
                        client.control(Msg::UdpData { sock: h, from, data });
                        self.busy = true;
                    }
                }
                None => {}
            }
        }
        for (listener, client, port, slot) in accepted {
            let (mut fresh, lent) = self.tcp_socket(None);
            let _ = fresh.listen(port);
            let fresh = self.add_tcp((fresh, lent));
            if let Some(Handle::Listener(l)) = self.handles.get_mut(&listener) {
                if let Some(w) = l.waiting.iter_mut().find(|w| **w == slot) {
                    *w = fresh;
                }
            }
            let peer = endpoint(self.sockets.get::<tcp::Socket>(slot).remote_endpoint()).unwrap_or(NOWHERE);
            let h = self.new_handle();
            self.handles.insert(h, Handle::Conn(Conn::new(client, slot, None, t)));
            self.shares.open(h, client);
            self.counters.connections_opened += 1;
            if let Some(c) = self.clients.get_mut(&client) {
                c.control(Msg::Accepted { listener, conn: h, peer });
            }
            self.busy = true;
        }
        for h in free {
            if let Some(Handle::Conn(c)) = self.handles.remove(&h) {
                let in_time_wait = self.sockets.get::<tcp::Socket>(c.sock).state() == tcp::State::TimeWait;
                self.remove_tcp(c.sock);
                if let Some(port) = c.own_port {
                    if in_time_wait {
                        self.time_wait_ports.push_back((t + TIME_WAIT, port));
                    } else {
                        self.ports_in_use.remove(&port);
                    }
                }
                self.counters.connections_freed += 1;
            }
        }
        while let Some(&(until, port)) = self.time_wait_ports.front() {
            if until > t {
                break;
            }
            self.time_wait_ports.pop_front();
            self.ports_in_use.remove(&port);
        }
    }

    fn flush_clients(&mut self) {
        let mut gone = Vec::new();
        for (&id, c) in self.clients.iter_mut() {
            match c.flush() {
                Ok(true) => self.busy = true,
                Ok(false) => {}
                Err(()) => gone.push(id),
            }
        }
        for id in gone {
            self.drop_client(id, "closed its socket while the server wrote");
        }
    }

    fn status(&mut self) -> ServerStatus {
        let link = self.dev.counters();
        self.counters.rx_frames = link.rx_frames;
        self.counters.tx_frames = link.tx_frames;
        self.counters.tx_offloaded = link.offloaded;
        let port = self.dev.port().counters();
        self.counters.rx_dropped = port.rx_dropped;
        self.counters.tx_dropped = port.tx_dropped;
        self.counters.syns_dropped = self.dev.syns_dropped;
        let mut connections = Vec::new();
        let mut listening = Vec::new();
        for h in self.handles.values() {
            match h {
                Handle::Conn(c) => {
                    let s = self.sockets.get::<tcp::Socket>(c.sock);
                    connections.push(ConnectionInfo {
                        local: endpoint(s.local_endpoint()),
                        remote: endpoint(s.remote_endpoint()),
                        state: s.state().to_string(),
                        pid: c.reader.and_then(|r| self.clients.get(&r)).map_or(0, |cl| cl.pid),
                    });
                }
                Handle::Listener(l) => listening.push(l.port),
                Handle::Udp(_) => {}
            }
        }
        listening.sort_unstable();
        ServerStatus { counters: self.counters, clients: self.clients.len(), connections, listening }
    }
}

impl Conn {
    fn new(client: u32, sock: SocketHandle, connecting: Option<u32>, t: Instant) -> Conn {
        Conn {
            sock,
            pending: VecDeque::new(),
            pending_owners: VecDeque::new(),
            unreported: Vec::new(),
            reader: Some(client),
            ended: None,
            credit: RECV_CREDIT,
            connecting,
            shutdown: false,
            fin_seen: false,
            eof_sent: false,
            orphan: false,
            last_activity: t,
            own_port: None,
            seen_send_queue: 0,
            seen_recv_queue: 0,
            seen_state: tcp::State::Closed,
            time_wait_seen: false,
            corked: None,
            zc: None,
        }
    }

    /// Counts `bytes` of `client`'s as taken into the stack, to be reported with `Sent`.
    fn report(&mut self, client: ClientId, bytes: u64) {
        if bytes == 0 {
            return;
        }
        match self.unreported.iter_mut().find(|(c, _)| *c == client) {
            Some((_, n)) => *n += bytes,
            None => self.unreported.push((client, bytes)),
        }
    }

    /// `n` pending bytes went into the stack: they count as their writers'.
    fn took_pending(&mut self, mut n: usize) {
        while n > 0 {
            let Some((owner, len)) = self.pending_owners.front_mut() else { break };
            let take = n.min(*len);
            let owner = *owner;
            *len -= take;
            n -= take;
            if *len == 0 {
                self.pending_owners.pop_front();
            }
            self.report(owner, take as u64);
        }
    }
}

/// One connection's work for one iteration; returns whether anything moved.
fn service_conn(
    h: u32,
    c: &mut Conn,
    s: &mut tcp::Socket<'static>,
    client: Option<&mut Client>,
    t: Instant,
    counters: &mut ServerCounters,
    timeout: Duration,
) -> bool {
    // Signs of the peer since the last iteration: bytes it acknowledged (the send queue shrank)
    // or sent (the receive queue grew), or a state change. Retransmitting into silence is not one.
    // (A connection that just closed emptied its queues itself: that is no sign either.)
    let peer_seen =
        s.send_queue() < c.seen_send_queue || s.recv_queue() > c.seen_recv_queue || s.state() != c.seen_state;
    if peer_seen && s.state() != tcp::State::Closed {
        c.last_activity = t;
    }
    let moved = move_bytes(h, c, s, client, t, counters, timeout);
    (c.seen_send_queue, c.seen_recv_queue, c.seen_state) = (s.send_queue(), s.recv_queue(), s.state());
    moved
}

/// [`service_conn`]'s work: bytes both ways, answers and state changes to the client.
fn move_bytes(
    h: u32,
    c: &mut Conn,
    s: &mut tcp::Socket<'static>,
    client: Option<&mut Client>,
    t: Instant,
    counters: &mut ServerCounters,
    timeout: Duration,
) -> bool {
    let mut moved = false;
    // A corked connection's bytes wait until they would fill segments, the end follows them, or
    // the ceiling passed.
    let held =
        c.corked.is_some_and(|since| t < since + CORK_CEILING) && !c.shutdown && c.pending.len() < CORK_BYTES;
    if !held && c.corked.is_some() && !c.pending.is_empty() {
        // Sent as Linux sends at the ceiling; the next bytes are held anew.
        c.corked = Some(t);
    }
    // The client's bytes into smoltcp's send buffer.
    while !held && !c.pending.is_empty() && s.can_send() {
        let (a, _) = c.pending.as_slices();
        let n = s.send_slice(a).unwrap_or(0);
        if n == 0 {
            break;
        }
        c.pending.drain(..n);
        c.took_pending(n);
        moved = true;
    }
    // smoltcp in LAST-ACK drops every acknowledgement that acknowledges nothing new, window
    // updates included: a FIN sent from CLOSE-WAIT behind bytes the peer's shut window holds back
    // would strand them until the timeout. So from CLOSE-WAIT the FIN waits for the bytes' ACK.
    let close_now = match s.state() {
        tcp::State::Established => true,
        tcp::State::CloseWait => s.send_queue() == 0,
        _ => false,
    };
    if c.shutdown && c.pending.is_empty() && close_now {
        s.close();
    }
    let state = s.state();
    if matches!(
        state,
        tcp::State::CloseWait | tcp::State::LastAck | tcp::State::Closing | tcp::State::TimeWait
    ) {
        c.fin_seen = true;
    }
    if c.orphan {
        // Nobody reads any more: drain what arrives so the peer is not stalled.
        while s.can_recv() {
            if s.recv(|b| (b.len(), ())).is_err() {
                break;
            }
        }
        return moved;
    }
    // Held only by a fork ticket for now: what arrives waits for the child (the window closes).
    let Some(client) = client else { return moved };
    if let Some(req) = c.connecting {
        match state {
            tcp::State::SynSent | tcp::State::SynReceived => return moved,
            tcp::State::Closed => {
                let errno =
                    if t - c.last_activity >= timeout.into() { libc::ETIMEDOUT } else { libc::ECONNREFUSED };
                client.control(Msg::Failed { req, errno });
                c.connecting = None;
                c.orphan = true;
                // Nobody else can hold a connection still connecting: the handle just goes.
                c.ended = Some(errno);
                return true;
            }
            _ => {
                let local = endpoint(s.local_endpoint()).unwrap_or(NOWHERE);
                client.control(Msg::Opened { req, handle: h, local });
                c.connecting = None;
                moved = true;
            }
        }
    }
    if let Some(zc) = c.zc.as_mut() {
        // Acknowledged bytes left smoltcp's send buffer: their room is the client's again.
        let acked = zc.queued.saturating_sub(s.send_queue() as u64);
        if acked > zc.acked {
            client.control(Msg::Sent { conn: h, bytes: acked - zc.acked });
            zc.acked = acked;
        }
        if zc.placed != zc.commits {
            client.control(Msg::Placed { conn: h, commits: zc.commits, tail: zc.tail as u32 });
            zc.placed = zc.commits;
        }
    }
    // Received bytes to the client, within its credit and its ring's room.
    while c.credit > 0 && s.can_recv() && client.clear() {
        let limit = (c.credit as usize).min(client.unit);
        let sent = s.recv(|buf| {
            let n = buf.len().min(limit);
            let ok = client.try_send(&Msg::Data { conn: h, data: &buf[..n] });
            (if ok { n } else { 0 }, if ok { n } else { 0 })
        });
        match sent {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                c.credit -= n as u64;
                counters.rx_bytes += n as u64;
                moved = true;
            }
        }
    }
    // The peer's FIN and then its RST can arrive in one poll: a peer that closed answers the ACK
    // it no longer expects (ours, repeated for its retransmitted FIN) with a reset, and the socket
    // goes from FIN-WAIT straight to CLOSED. smoltcp's receive side still knows the FIN came; with
    // every byte of ours acknowledged, nothing was lost and the connection ended cleanly.
    // (Asked once the bytes before the FIN are delivered: until then smoltcp answers as open.)
    if state == tcp::State::Closed
        && !c.fin_seen
        && s.send_queue() == 0
        && s.recv_queue() == 0
        && matches!(s.recv(|_| (0, ())), Err(tcp::RecvError::Finished))
    {
        c.fin_seen = true;
    }
    if c.fin_seen && !c.eof_sent && s.recv_queue() == 0 {
        client.control(Msg::Eof { conn: h });
        c.eof_sent = true;
        moved = true;
    }
    if state == tcp::State::Closed && !c.orphan && s.recv_queue() == 0 {
        // The peer's FIN ends a connection cleanly; anything else that closed it (its RST, or
        // silence past the timeout) is an error even after this side shut its half down.
        let errno = if c.fin_seen {
            0
        } else if t - c.last_activity >= timeout.into() {
            libc::ETIMEDOUT
        } else {
            libc::ECONNRESET
        };
        client.control(Msg::Closed { conn: h, errno });
        c.orphan = true;
        c.ended = Some(errno);
        moved = true;
    }
    moved
}

/// Whether process `pid` still runs (a zombie has ended: it only waits to be reaped).
fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the command's closing parenthesis.
        Ok(stat) => stat.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => false,
    }
}

/// This process's effective user and group, read through a socket pair's credentials.
fn own_ids() -> (u32, u32) {
    match UnixStream::pair().ok().and_then(|(a, _b)| peer_cred(&a).ok()) {
        Some(c) => (c.uid, c.gid),
        None => (u32::MAX, u32::MAX),
    }
}

#[cfg(test)]
mod closing {
    use smoltcp::phy::{Loopback, Medium};

    use super::*;

    /// Two smoltcp sockets on one loopback interface: `ours` is serviced like a client's
    /// connection, `theirs` plays the peer.
    struct Net {
        dev: Loopback,
        iface: Interface,
        sockets: SocketSet<'static>,
        t: Instant,
    }

    impl Net {
        fn new() -> Net {
            let mut dev = Loopback::new(Medium::Ethernet);
            let config = Config::new(EthernetAddress([2, 0, 0, 0, 0, 1]).into());
            let mut iface = Interface::new(config, &mut dev, Instant::ZERO);
            iface.update_ip_addrs(|a| a.push(IpCidr::new(IpAddress::v4(127, 0, 0, 1), 8)).unwrap());
            Net { dev, iface, sockets: SocketSet::new(vec![]), t: Instant::ZERO }
        }

        fn socket(&mut self) -> SocketHandle {
            let mut s = tcp::Socket::new(
                tcp::SocketBuffer::new(vec![0; 4096]),
                tcp::SocketBuffer::new(vec![0; 4096]),
            );
            s.set_ack_delay(None);
            self.sockets.add(s)
        }

        fn tcp(&mut self, h: SocketHandle) -> &mut tcp::Socket<'static> {
            self.sockets.get_mut(h)
        }

        fn poll(&mut self) {
            self.t += smoltcp::time::Duration::from_millis(1);
            self.iface.poll(self.t, &mut self.dev, &mut self.sockets);
        }

        fn egress(&mut self) {
            self.iface.poll_egress(self.t, &mut self.dev, &mut self.sockets);
        }
    }

    fn client() -> Client {
        let (sock, _) = UnixStream::pair().unwrap();
        Client {
            sock,
            link: Link::Socket { read: Vec::new(), write: VecDeque::new() },
            pid: 0,
            unit: 4096,
            outbox: VecDeque::new(),
            wrote: false,
            blocked: false,
        }
    }

    /// The messages the client was sent, as (data received, end of stream seen, errno closed with).
    fn told(client: &Client) -> (Vec<u8>, bool, Option<i32>) {
        let Link::Socket { write, .. } = &client.link else { unreachable!() };
        let bytes: Vec<u8> = write.iter().copied().collect();
        let (mut data, mut eof, mut closed) = (Vec::new(), false, None);
        let mut at = 0;
        while at < bytes.len() {
            let len = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
            match Msg::parse(&bytes[at + 4..at + 4 + len]).unwrap() {
                Msg::Data { data: d, .. } => data.extend_from_slice(d),
                Msg::Eof { .. } => eof = true,
                Msg::Closed { errno, .. } => closed = Some(errno),
                Msg::Sent { .. } => {}
                other => panic!("unexpected {other:?}"),
            }
            at += 4 + len;
        }
        (data, eof, closed)
    }

    /// A connection from `ours`, serviced for client connection 7, to `theirs`, established.
    struct Connected {
        net: Net,
        ours: SocketHandle,
        theirs: SocketHandle,
        c: Conn,
        client: Client,
        counters: ServerCounters,
    }

    impl Connected {
        fn new() -> Connected {
            let mut net = Net::new();
            let (ours, theirs) = (net.socket(), net.socket());
            net.tcp(theirs).listen(1234).unwrap();
            let cx = net.iface.context();
            net.sockets
                .get_mut::<tcp::Socket>(ours)
                .connect(cx, (IpAddress::v4(127, 0, 0, 1), 1234), 49152)
                .unwrap();
            let c = Conn::new(1, ours, None, net.t);
            let mut me =
                Connected { net, ours, theirs, c, client: client(), counters: ServerCounters::default() };
            for _ in 0..10 {
                me.net.poll();
                me.service();
            }
            assert_eq!(me.net.tcp(theirs).state(), tcp::State::Established);
            me
        }

        /// One iteration of the server's work for the connection.
        fn service(&mut self) {
            let (t, timeout) = (self.net.t, Duration::from_secs(15));
            let s = self.net.sockets.get_mut(self.ours);
            service_conn(7, &mut self.c, s, Some(&mut self.client), t, &mut self.counters, timeout);
        }
    }

    #[test]
    fn a_fin_and_a_reset_in_one_poll_end_the_connection_cleanly() {
        let mut p = Connected::new();
        let (ours, theirs) = (p.ours, p.theirs);
        // Ours sends and shuts its half down; the peer reads it all and sees the FIN.
        p.c.pending.extend(b"hello");
        p.c.shutdown = true;
        for _ in 0..10 {
            p.service();
            p.net.poll();
        }
        p.service();
        assert_eq!(p.net.tcp(ours).state(), tcp::State::FinWait2);
        let mut got = [0; 16];
        let n = p.net.tcp(theirs).recv_slice(&mut got).unwrap();
        assert_eq!(&got[..n], b"hello");

        // The peer answers, closes, and then resets (as Linux does when our repeated ACK of its
        // FIN finds its socket gone): FIN and RST wait together for ours's next poll.
        p.net.tcp(theirs).send_slice(b"back").unwrap();
        p.net.tcp(theirs).close();
        p.net.egress();
        p.net.tcp(theirs).abort();
        p.net.egress();
        p.net.poll();
        assert_eq!(p.net.tcp(ours).state(), tcp::State::Closed, "the FIN and the RST came in one poll");

        p.service();
        assert_eq!(told(&p.client), (b"back".to_vec(), true, Some(0)));
    }

    #[test]
    fn a_reset_before_the_fin_is_an_error() {
        let mut p = Connected::new();
        p.net.tcp(p.theirs).abort();
        p.net.egress();
        p.net.poll();
        assert_eq!(p.net.tcp(p.ours).state(), tcp::State::Closed);
        p.service();
        assert_eq!(told(&p.client), (Vec::new(), false, Some(libc::ECONNRESET)));
    }
}
