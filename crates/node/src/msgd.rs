//! The messaging poller daemon and its clients (the MPI-over-DPDK paper's design): one process
//! owns the port and the transport; the processes of a node attach to it over a Unix socket and
//! shared memory, and need neither the port nor its privileges.
//!
//! A client connects to the daemon's socket; the daemon checks who it is (`SO_PEERCRED`: root,
//! the daemon's own user, or a member of its group), gives it an engine id on the node (ids are
//! not reused while the daemon runs, so a late record for a process that went away is dropped,
//! never delivered to a newcomer), and hands it a memfd with two rings (`lanbus_ring::pipe`, one
//! each way) and two eventfd doorbells. The client runs its own messaging engine
//! ([`lanbus_msg::Engine`]): matching, eager and rendezvous all happen in the process, which
//! polls its own ring (progress is made inside its calls, as libfabric's manual progress). Each
//! ring entry is one record with the peer node's MAC in front (`[MAC 6][record]`): the
//! destination's on the way out, the source's on the way in; an entry with no record after the
//! MAC tells the client that node went down.
//!
//! The daemon forwards: records a client writes go to the transport (or straight to another
//! client of the same node), records the transport delivers go to the client their destination
//! id names. Both ways it is the runtime's thread that moves them, on each of its turns (the
//! poller of the paper); a thread per client only watches the client's ring while that thread
//! sleeps, and checks that the client is still there. A client whose ring holds a record that
//! does not parse, or one claiming another client's id as its source, is disconnected; nothing
//! else is affected. A client that goes away (its socket closes) is forgotten. A daemon that goes away closes every client's socket: their
//! calls fail with [`MsgError::DaemonGone`](crate::msg::MsgError::DaemonGone) instead of waiting.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lanbus_msg::{
    wire, Addr, Claim, Config, Engine, Match, Outcome, RecvBuf, RequestId, RequestMap, SendBuf, Status,
    MSG_CHANNEL,
};
use lanbus_port::Port;
use lanbus_ring::pipe::{PipeConfig, Receiver, Sender as PipeSender};
use lanbus_ring::{peer_cred, recv_fds, send_fds, CopyMode, EventFd, Region};
use lanbus_runtime::{Handler, Outbox, Runtime, RuntimeConfig, Sender};
use lanbus_transport::{Event, Message};
use lanbus_wire::MacAddr;

use crate::msg::MsgError;

/// One ring's shape: entries of a MAC and a whole record (a transport message of up to 64 KiB).
const PIPE: PipeConfig = PipeConfig { slots: 64, buffers: 64, buf_size: 65_600 };
const HELLO: &[u8; 8] = b"LBMSGD\x01\0";
/// The hello: [`HELLO`], the node's MAC, the client's id.
const HELLO_LEN: usize = 16;
/// How long a client waiting for a request keeps polling its ring (yielding the core each time)
/// after the last record before it sleeps on its doorbell: a wake-up costs more than the round
/// trip of a small message.
const POLL: Duration = Duration::from_micros(50);

fn pipe_offset(k: usize) -> usize {
    k * PIPE.bytes_needed().next_multiple_of(4096)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn ring_io(e: lanbus_ring::Error) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

/// What the daemon counts.
#[derive(Debug, Default)]
pub struct DaemonCounters {
    /// Clients that attached.
    pub attached: AtomicU64,
    /// Clients refused (not the daemon's user or group, or the hand-over failed).
    pub refused: AtomicU64,
    /// Clients disconnected for writing records that do not parse or claim another id.
    pub disconnected_hostile: AtomicU64,
    /// Records from the network for no attached client (dropped).
    pub no_such_client: AtomicU64,
    /// Records forwarded from clients.
    pub from_clients: AtomicU64,
    /// Records handed to clients.
    pub to_clients: AtomicU64,
}

fn bump(c: &AtomicU64) {
    // Relaxed: a statistic.
    c.fetch_add(1, Ordering::Relaxed);
}

/// The daemon's side of one client.
struct Client {
    /// Entries for the client: the ring, and what waits for room in it (in order).
    to_client: Mutex<(PipeSender, VecDeque<Vec<u8>>)>,
    /// The client's doorbell, rung when its ring may have entries.
    client_bell: EventFd,
    /// Other nodes it exchanged records with: told when it goes.
    peers: Mutex<HashSet<MacAddr>>,
    /// The client's ring toward the daemon. The runtime's thread takes its records on each of
    /// its turns (so they go out in order, with no hand-off between threads); while that thread
    /// sleeps, the client's serving thread watches the ring and wakes it.
    from_client: Mutex<Receiver>,
    /// The doorbell the client rings when the ring's reader sleeps (the runtime's thread rings
    /// it too, to hand the watch back to the serving thread when it goes to sleep).
    daemon_bell: EventFd,
    /// The client wrote something that is not one of its records: it is disconnected.
    hostile: AtomicBool,
}

impl Client {
    /// Queues `[mac][record]` for the client, in order behind anything waiting for room.
    fn deliver(&self, mac: MacAddr, record: &[u8]) {
        let mut g = lock(&self.to_client);
        let (ring, waiting) = &mut *g;
        let len = 6 + record.len();
        // Straight into the ring when nothing waits before it; queued (a copy) otherwise.
        let placed = waiting.is_empty()
            && matches!(
                ring.send_with(|buf| {
                    let slot = buf.get_mut(..len)?;
                    slot[..6].copy_from_slice(&mac.0);
                    slot[6..].copy_from_slice(record);
                    Some(len)
                }),
                Ok(Some(_))
            );
        if !placed {
            let mut entry = Vec::with_capacity(len);
            entry.extend_from_slice(&mac.0);
            entry.extend_from_slice(record);
            waiting.push_back(entry);
            flush(ring, waiting);
        }
        if ring.wake_needed() {
            let _ = self.client_bell.notify();
        }
    }

    /// Moves what waits into the ring as room allows; true if anything still waits.
    fn flush(&self) -> bool {
        let mut g = lock(&self.to_client);
        let (ring, waiting) = &mut *g;
        let moved = flush(ring, waiting);
        if moved && ring.wake_needed() {
            let _ = self.client_bell.notify();
        }
        !waiting.is_empty()
    }
}

/// Moves entries from `waiting` into `ring` while it has room; whether any moved.
fn flush(ring: &mut PipeSender, waiting: &mut VecDeque<Vec<u8>>) -> bool {
    let _ = ring.reclaim();
    let mut moved = false;
    while let Some(entry) = waiting.front() {
        match ring.send(entry) {
            Ok(true) => {
                waiting.pop_front();
                moved = true;
            }
            _ => break,
        }
    }
    moved
}

struct Shared {
    mac: MacAddr,
    clients: Mutex<HashMap<u16, Arc<Client>>>,
    /// Changes whenever a client comes or goes (the runtime's thread keeps its own list).
    generation: AtomicU64,
    /// The runtime's thread is taking turns (not asleep): it takes the clients' records itself.
    turning: AtomicBool,
    counters: DaemonCounters,
    stop: AtomicBool,
}

impl Shared {
    fn client(&self, id: u16) -> Option<Arc<Client>> {
        lock(&self.clients).get(&id).cloned()
    }

    fn add_client(&self, id: u16, client: Arc<Client>) {
        lock(&self.clients).insert(id, client);
        self.generation.fetch_add(1, Ordering::Release);
    }

    fn remove_client(&self, id: u16) {
        lock(&self.clients).remove(&id);
        self.generation.fetch_add(1, Ordering::Release);
    }

    /// Takes client `id`'s records out of its ring and hands each to `emit` (the destination
    /// node and the record) or, for another client of this node, straight to that client.
    /// Returns the records taken; a client that wrote something that is not its own record is
    /// marked hostile and its serving thread woken to disconnect it.
    fn take_records(
        &self,
        id: u16,
        client: &Client,
        ring: &mut Receiver,
        emit: &mut dyn FnMut(MacAddr, &[u8]),
    ) -> usize {
        let mut taken = 0;
        let mut hostile = client.hostile.load(Ordering::Relaxed);
        while !hostile {
            let got = ring.recv(|entry| {
                let Some((mac, record)) = entry.split_first_chunk::<6>() else {
                    hostile = true;
                    return;
                };
                match wire::Record::parse(record) {
                    Ok((route, _)) if route.src == id => {
                        let dest = MacAddr(*mac);
                        bump(&self.counters.from_clients);
                        if dest == self.mac {
                            match self.client(route.dst) {
                                Some(c) => c.deliver(self.mac, record),
                                None => bump(&self.counters.no_such_client),
                            }
                        } else {
                            lock(&client.peers).insert(dest);
                            emit(dest, record);
                        }
                    }
                    _ => hostile = true,
                }
            });
            match got {
                Ok(true) if !hostile => taken += 1,
                Ok(false) => break,
                _ => hostile = true,
            }
        }
        if hostile && !client.hostile.swap(true, Ordering::Relaxed) {
            let _ = client.daemon_bell.notify();
        }
        taken
    }
}

struct DaemonHandler {
    shared: Arc<Shared>,
    /// The clients as of `generation`.
    clients: Vec<(u16, Arc<Client>)>,
    generation: u64,
}

impl Handler for DaemonHandler {
    fn on_message(&mut self, message: Message<'_>, _out: &mut dyn Outbox) {
        if message.channel != MSG_CHANNEL {
            return;
        }
        if wire::destination(message.data) == Some(0) {
            // For every engine here (an engine of that node is gone).
            let clients: Vec<_> = lock(&self.shared.clients).values().cloned().collect();
            for c in clients {
                c.deliver(message.peer, message.data);
            }
            return;
        }
        match wire::destination(message.data).and_then(|id| self.shared.client(id)) {
            Some(c) => {
                c.deliver(message.peer, message.data);
                lock(&c.peers).insert(message.peer);
                bump(&self.shared.counters.to_clients);
            }
            None => bump(&self.shared.counters.no_such_client),
        }
    }

    fn on_event(&mut self, event: &Event, _out: &mut dyn Outbox) {
        if let Event::PeerDown { peer } | Event::PeerRestarted { peer, .. } = event {
            let clients: Vec<_> = lock(&self.shared.clients).values().cloned().collect();
            for c in clients {
                c.deliver(*peer, &[]);
            }
        }
    }

    /// The clients' records go out from here, in order with everything else this thread sends.
    fn poll(&mut self, out: &mut dyn Outbox) -> usize {
        let shared = &*self.shared;
        if !shared.turning.load(Ordering::Relaxed) {
            shared.turning.store(true, Ordering::SeqCst);
        }
        let generation = shared.generation.load(Ordering::Acquire);
        if generation != self.generation {
            self.generation = generation;
            self.clients = lock(&shared.clients).iter().map(|(id, c)| (*id, c.clone())).collect();
        }
        let mut taken = 0;
        for (id, c) in &self.clients {
            // A serving thread holding the ring is handing a record over: the next turn takes it.
            if let Ok(mut ring) = c.from_client.try_lock() {
                taken += shared.take_records(*id, c, &mut ring, &mut |dest, record| {
                    out.send(dest, MSG_CHANNEL, record);
                });
            }
        }
        taken
    }

    /// The thread goes to sleep: the serving threads watch the rings until it wakes.
    fn parking(&mut self) {
        // SeqCst: a serving thread that sees the flag still set is woken by the bell below.
        self.shared.turning.store(false, Ordering::SeqCst);
        for (_, c) in &self.clients {
            let _ = c.daemon_bell.notify();
        }
    }
}

/// The messaging daemon: a port, its transport and the clients attached over `socket`.
pub struct MsgDaemon {
    shared: Arc<Shared>,
    runtime: Option<Runtime>,
    accept: Option<JoinHandle<()>>,
    path: PathBuf,
}

impl MsgDaemon {
    /// Starts the daemon on `port`, taking clients at the Unix socket `socket` (a stale file
    /// there is replaced).
    pub fn start(port: Box<dyn Port>, socket: &Path, runtime: RuntimeConfig) -> std::io::Result<MsgDaemon> {
        let shared = Arc::new(Shared {
            mac: port.mac(),
            clients: Mutex::new(HashMap::new()),
            generation: AtomicU64::new(0),
            turning: AtomicBool::new(false),
            counters: DaemonCounters::default(),
            stop: AtomicBool::new(false),
        });
        if UnixStream::connect(socket).is_err() {
            let _ = std::fs::remove_file(socket);
        }
        let listener = UnixListener::bind(socket)?;
        listener.set_nonblocking(true)?;
        let runtime = Runtime::start(
            port,
            runtime,
            Box::new(DaemonHandler { shared: shared.clone(), clients: Vec::new(), generation: 0 }),
        )?;
        let sender = runtime.sender();
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("msgd-accept".into())
            .spawn(move || accept_loop(&s, &listener, &sender))?;
        Ok(MsgDaemon { shared, runtime: Some(runtime), accept: Some(accept), path: socket.to_path_buf() })
    }

    /// The node's MAC address (every client's address has it).
    pub fn mac(&self) -> MacAddr {
        self.shared.mac
    }

    /// Clients attached now.
    pub fn clients(&self) -> usize {
        lock(&self.shared.clients).len()
    }

    /// The daemon's counters.
    pub fn counters(&self) -> &DaemonCounters {
        &self.shared.counters
    }

    /// The runtime's counters.
    pub fn runtime_stats(&self) -> lanbus_runtime::Stats {
        self.runtime.as_ref().map(Runtime::stats).unwrap_or_default()
    }
}

impl Drop for MsgDaemon {
    fn drop(&mut self) {
        // Relaxed: polled by the daemon's threads; joining them orders the rest.
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
        if let Some(rt) = self.runtime.take() {
            rt.wait_idle(Duration::from_secs(1));
            rt.shutdown();
        }
    }
}

/// Whether the process at the other end may attach: root, the daemon's user (`me`), or its
/// group.
fn allowed(sock: &UnixStream, me: (u32, u32)) -> bool {
    let Ok(cred) = peer_cred(sock) else { return false };
    cred.uid == 0 || cred.uid == me.0 || cred.gid == me.1
}

/// This process's effective user and group, read through a socket pair's credentials.
fn own_ids() -> (u32, u32) {
    match UnixStream::pair().ok().and_then(|(a, _b)| peer_cred(&a).ok()) {
        Some(c) => (c.uid, c.gid),
        None => (u32::MAX, u32::MAX),
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: &UnixListener, sender: &Sender) {
    let mut threads: Vec<JoinHandle<()>> = Vec::new();
    let mut next_id: u16 = 0;
    let me = own_ids();
    // Relaxed: a flag polled between accepts.
    while !shared.stop.load(Ordering::Relaxed) {
        let sock = match listener.accept() {
            Ok((sock, _)) => sock,
            Err(_) => {
                std::thread::sleep(Duration::from_millis(5));
                threads.retain(|t| !t.is_finished());
                continue;
            }
        };
        if !allowed(&sock, me) {
            bump(&shared.counters.refused);
            continue;
        }
        // Ids go up and are not reused while the daemon runs (until they wrap after 65,535).
        let id = loop {
            next_id = next_id.wrapping_add(1).max(1);
            if !lock(&shared.clients).contains_key(&next_id) {
                break next_id;
            }
        };
        match attach(shared, sock, id, sender.clone()) {
            Ok(t) => {
                bump(&shared.counters.attached);
                threads.push(t);
            }
            Err(_) => bump(&shared.counters.refused),
        }
    }
    for t in threads {
        let _ = t.join();
    }
}

/// Hands client `id` its memory and doorbells and starts the thread that serves it.
fn attach(
    shared: &Arc<Shared>,
    sock: UnixStream,
    id: u16,
    sender: Sender,
) -> std::io::Result<JoinHandle<()>> {
    let region = Arc::new(Region::memfd("lanbus-msgd", pipe_offset(2)).map_err(ring_io)?);
    PIPE.format(&region, pipe_offset(0)).map_err(ring_io)?;
    PIPE.format(&region, pipe_offset(1)).map_err(ring_io)?;
    let to_client =
        PipeSender::attach(region.clone(), pipe_offset(0), CopyMode::Ordinary).map_err(ring_io)?;
    let from_client = Receiver::attach(region.clone(), pipe_offset(1)).map_err(ring_io)?;
    let (daemon_bell, client_bell) = (EventFd::new().map_err(ring_io)?, EventFd::new().map_err(ring_io)?);
    let mut hello = [0u8; HELLO_LEN];
    hello[..8].copy_from_slice(HELLO);
    hello[8..14].copy_from_slice(&shared.mac.0);
    hello[14..16].copy_from_slice(&id.to_le_bytes());
    let memfd = region.fd().ok_or_else(|| std::io::Error::other("the region has no memfd"))?;
    let client = Arc::new(Client {
        to_client: Mutex::new((to_client, VecDeque::new())),
        client_bell,
        peers: Mutex::new(HashSet::new()),
        from_client: Mutex::new(from_client),
        daemon_bell,
        hostile: AtomicBool::new(false),
    });
    // Known before the client can act on its hello (it may ask at once who is attached).
    shared.add_client(id, client.clone());
    let fds = [memfd, client.daemon_bell.as_fd(), client.client_bell.as_fd()];
    if let Err(e) = send_fds(&sock, &hello, &fds).map_err(ring_io) {
        shared.remove_client(id);
        return Err(e);
    }
    let shared = shared.clone();
    std::thread::Builder::new().name(format!("msgd-client-{id}")).spawn(move || {
        serve_client(&shared, &client, sock, &sender);
        shared.remove_client(id);
        say_gone(&shared, id, &lock(&client.peers), &sender);
    })
}

/// Tells the engines that may wait on client `id` that it is gone: every local client, and
/// every node it exchanged records with (all their engines: destination 0).
fn say_gone(shared: &Shared, id: u16, talked_to: &HashSet<MacAddr>, sender: &Sender) {
    let mut gone = Vec::new();
    wire::Record::Gone.emit(wire::Route { src: id, dst: 0 }, &mut gone);
    let clients: Vec<_> = lock(&shared.clients).values().cloned().collect();
    for c in clients {
        c.deliver(shared.mac, &gone);
    }
    for &mac in talked_to {
        sender.send(mac, MSG_CHANNEL, &gone);
    }
}

/// Serves a client until it goes away, misbehaves or the daemon stops: moves what waits for
/// room in its ring, checks now and then that it is still there, and, while the runtime's thread
/// sleeps, watches the client's ring and wakes that thread when a record arrives (the runtime's
/// thread takes every record itself, so they leave in the order the client wrote them).
fn serve_client(shared: &Shared, client: &Client, mut sock: UnixStream, sender: &Sender) {
    let _ = sock.set_nonblocking(true);
    let mut last_check = Instant::now();
    // Relaxed: a flag polled once per round.
    while !shared.stop.load(Ordering::Relaxed) {
        if client.hostile.load(Ordering::Relaxed) {
            bump(&shared.counters.disconnected_hostile);
            return;
        }
        let waiting = client.flush();
        // Has the client gone? (Checked at most every few milliseconds.)
        if last_check.elapsed() > Duration::from_millis(5) {
            last_check = Instant::now();
            let mut b = [0u8; 1];
            match sock.read(&mut b) {
                Ok(0) => return,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                _ => return,
            }
        }
        let nap = if waiting { Duration::from_micros(200) } else { Duration::from_millis(5) };
        // SeqCst: pairs with the store in `DaemonHandler::parking`, which rings the bell after it.
        if shared.turning.load(Ordering::SeqCst) {
            // The runtime's thread takes the records; it rings the bell when it goes to sleep.
            let _ = client.daemon_bell.wait(Some(nap));
            continue;
        }
        let ring = lock(&client.from_client);
        ring.prepare_wait();
        let pending = ring.has_pending();
        drop(ring);
        if pending {
            lock(&client.from_client).finish_wait();
            sender.wake_handler();
            // Give the runtime's thread the core to take over (it marks itself turning).
            std::thread::yield_now();
            continue;
        }
        let _ = client.daemon_bell.wait(Some(nap));
        lock(&client.from_client).finish_wait();
    }
}

/// A process's messaging endpoint through the node's daemon.
pub struct MsgClient {
    engine: Engine,
    to_daemon: PipeSender,
    from_daemon: Receiver,
    daemon_bell: EventFd,
    my_bell: EventFd,
    sock: UnixStream,
    finished: RequestMap<Outcome>,
    gone: bool,
}

impl MsgClient {
    /// Attaches to the daemon at `socket` with engine settings `cfg`.
    pub fn connect(socket: &Path, cfg: Config) -> Result<MsgClient, MsgError> {
        let attach = |why: String| MsgError::Attach(format!("{}: {why}", socket.display()));
        let sock = UnixStream::connect(socket).map_err(|e| attach(e.to_string()))?;
        sock.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| attach(e.to_string()))?;
        let mut hello = [0u8; HELLO_LEN];
        let (n, fds) = recv_fds(&sock, &mut hello).map_err(|e| attach(e.to_string()))?;
        if n != HELLO_LEN || &hello[..8] != HELLO || fds.len() != 3 {
            return Err(attach("the daemon refused this process or does not speak lanbus msgd".into()));
        }
        let mut fds = fds.into_iter();
        let (Some(mem), Some(daemon_bell), Some(my_bell)) = (fds.next(), fds.next(), fds.next()) else {
            return Err(attach("missing descriptors".into()));
        };
        let region = Arc::new(Region::from_fd(mem).map_err(|e| attach(e.to_string()))?);
        let from_daemon =
            Receiver::attach(region.clone(), pipe_offset(0)).map_err(|e| attach(e.to_string()))?;
        let to_daemon = PipeSender::attach(region, pipe_offset(1), CopyMode::Ordinary)
            .map_err(|e| attach(e.to_string()))?;
        let mac = MacAddr(hello[8..14].try_into().expect("6 bytes"));
        let id = u16::from_le_bytes([hello[14], hello[15]]);
        sock.set_nonblocking(true).map_err(|e| attach(e.to_string()))?;
        Ok(MsgClient {
            engine: Engine::new(Addr { mac, id }, cfg),
            to_daemon,
            from_daemon,
            daemon_bell: EventFd::from_fd(daemon_bell),
            my_bell: EventFd::from_fd(my_bell),
            sock,
            finished: RequestMap::default(),
            gone: false,
        })
    }

    /// This endpoint's address.
    pub fn addr(&self) -> Addr {
        self.engine.addr()
    }

    /// The engine's counters.
    pub fn counters(&self) -> lanbus_msg::Counters {
        self.engine.counters()
    }

    /// Moves records both ways and collects finished requests; returns whether anything moved.
    pub fn progress(&mut self) -> Result<bool, MsgError> {
        if self.gone {
            return Err(MsgError::DaemonGone);
        }
        let _ = self.to_daemon.reclaim();
        // Each record goes into the ring behind its node's MAC, written there straight from
        // the engine (a DATA record from the message being sent); one the ring has no room
        // for stays in the engine, first in line.
        let ring = &mut self.to_daemon;
        let sent = self.engine.transmit(&mut |dest, parts| {
            let written = ring.send_with(|buf| {
                let len = 6 + parts.iter().map(|p| p.len()).sum::<usize>();
                let entry = buf.get_mut(..len)?;
                entry[..6].copy_from_slice(&dest.0);
                let mut at = 6;
                for p in parts {
                    entry[at..at + p.len()].copy_from_slice(p);
                    at += p.len();
                }
                Some(len)
            });
            matches!(written, Ok(Some(_)))
        }) > 0;
        let mut moved = sent;
        if sent && self.to_daemon.wake_needed() {
            let _ = self.daemon_bell.notify();
        }
        let engine = &mut self.engine;
        loop {
            let got = self.from_daemon.recv(|entry| {
                if let Some((mac, record)) = entry.split_first_chunk::<6>() {
                    if record.is_empty() {
                        engine.peer_down(MacAddr(*mac));
                    } else {
                        engine.handle_message(MacAddr(*mac), record);
                    }
                }
            });
            match got {
                Ok(true) => moved = true,
                _ => break,
            }
        }
        while let Some(c) = self.engine.poll_completion() {
            self.finished.insert(c.id, c.outcome);
            moved = true;
        }
        Ok(moved)
    }

    /// Whether the daemon closed the connection.
    fn daemon_gone(&mut self) -> bool {
        let mut b = [0u8; 1];
        self.gone |= match self.sock.read(&mut b) {
            Ok(0) => true,
            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
            Ok(_) => false,
        };
        self.gone
    }

    /// Starts sending `data` to `dest` in `context` with `tag` (read until the send completes).
    pub fn isend(
        &mut self,
        dest: Addr,
        context: u32,
        tag: u64,
        data: impl SendBuf,
    ) -> Result<RequestId, MsgError> {
        let id = self.engine.send(dest, context, tag, data);
        self.progress()?;
        Ok(id)
    }

    /// Posts a receive of at most `capacity` bytes.
    pub fn irecv(&mut self, m: Match, capacity: usize) -> Result<RequestId, MsgError> {
        let id = self.engine.post_recv(m, capacity);
        self.progress()?;
        Ok(id)
    }

    /// Posts a receive into `buf` (see [`Engine::post_recv_into`]): the bytes land there
    /// straight from the ring.
    pub fn irecv_into(&mut self, m: Match, buf: Box<dyn RecvBuf>) -> Result<RequestId, MsgError> {
        let id = self.engine.post_recv_into(m, buf);
        self.progress()?;
        Ok(id)
    }

    /// The first waiting message `m` takes, if any.
    pub fn probe(&mut self, m: Match) -> Result<Option<Status>, MsgError> {
        self.progress()?;
        Ok(self.engine.probe(m))
    }

    /// Cancels a posted receive nothing matched yet.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        let done = self.engine.cancel(id);
        let _ = self.progress();
        done
    }

    /// Takes the first waiting message `m` takes out of matching (MPI_Mprobe).
    pub fn claim(&mut self, m: Match) -> Result<Option<(Claim, Status)>, MsgError> {
        self.progress()?;
        Ok(self.engine.claim(m))
    }

    /// Receives a claimed message into at most `capacity` bytes (MPI_Mrecv).
    pub fn recv_claimed(&mut self, claim: Claim, capacity: usize) -> Result<Option<RequestId>, MsgError> {
        let id = self.engine.recv_claimed(claim, capacity);
        self.progress()?;
        Ok(id)
    }

    /// Every finished request not yet waited for or taken, in no particular order.
    pub fn take_finished(&mut self) -> Vec<(RequestId, Outcome)> {
        let mut out = Vec::new();
        self.take_finished_into(&mut out);
        out
    }

    /// Appends every finished request not yet waited for or taken to `out`.
    pub fn take_finished_into(&mut self, out: &mut Vec<(RequestId, Outcome)>) {
        out.extend(self.finished.drain());
    }

    /// Waits until request `id` finishes, at most `timeout`, making progress meanwhile.
    pub fn wait(&mut self, id: RequestId, timeout: Duration) -> Result<Outcome, MsgError> {
        let start = Instant::now();
        let mut active = Instant::now();
        loop {
            let moved = self.progress()?;
            if let Some(o) = self.finished.remove(&id) {
                return match o {
                    Outcome::Failed(why) => Err(MsgError::Failed { id, why }),
                    Outcome::Cancelled => Err(MsgError::Cancelled(id)),
                    o => Ok(o),
                };
            }
            if moved {
                active = Instant::now();
                continue;
            }
            if active.elapsed() < POLL {
                std::thread::yield_now();
                continue;
            }
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(MsgError::Timeout(id, timeout));
            }
            if self.daemon_gone() {
                return Err(MsgError::DaemonGone);
            }
            if self.engine.has_records() {
                // Records waiting for room in the ring: the daemon frees it without a word, and
                // a stream refills it at once, so give the daemon the core rather than nap.
                std::thread::yield_now();
                continue;
            }
            self.from_daemon.prepare_wait();
            if !self.from_daemon.has_pending() {
                let _ = self.my_bell.wait(Some(left.min(Duration::from_millis(5))));
            }
            self.from_daemon.finish_wait();
        }
    }

    /// Sends and waits until the data is handed on.
    pub fn send(
        &mut self,
        dest: Addr,
        context: u32,
        tag: u64,
        data: Vec<u8>,
        timeout: Duration,
    ) -> Result<(), MsgError> {
        let id = self.isend(dest, context, tag, data)?;
        self.wait(id, timeout).map(|_| ())
    }

    /// Receives the next message `m` takes (at most `capacity` bytes): its status, its bytes and
    /// whether it was truncated.
    pub fn recv(
        &mut self,
        m: Match,
        capacity: usize,
        timeout: Duration,
    ) -> Result<(Status, Vec<u8>, bool), MsgError> {
        let id = self.irecv(m, capacity)?;
        match self.wait(id, timeout)? {
            Outcome::Received { status, data, truncated, .. } => Ok((status, data, truncated)),
            // `wait` turns Failed and Cancelled into errors; the engine never ends a receive Sent.
            other => unreachable!("a receive ends received, failed or cancelled, not {other:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lanbus_msg::Source;

    const T: Duration = Duration::from_secs(10);

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("lanbus-msgd-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn free_port() -> u16 {
        std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    fn runtime(name: &str) -> RuntimeConfig {
        let mut c = crate::config::msgd_runtime_config(name);
        c.transport.heartbeat.enabled = false;
        c
    }

    /// Two daemons over udp on loopback, their sockets in `dir`.
    fn two_daemons(dir: &Path) -> (MsgDaemon, MsgDaemon) {
        // A free port may be taken by a test running beside this one before it is bound again:
        // then try another pair.
        let (pa, pb) = (0..20)
            .find_map(|_| {
                let (p, q) = (free_port(), free_port());
                let pa = format!("udp:127.0.0.1:{p},peer=127.0.0.1:{q}")
                    .parse::<lanbus_port::PortSpec>()
                    .and_then(|s| s.open())
                    .ok()?;
                let pb = format!("udp:127.0.0.1:{q},peer=127.0.0.1:{p}")
                    .parse::<lanbus_port::PortSpec>()
                    .and_then(|s| s.open())
                    .ok()?;
                Some((pa, pb))
            })
            .expect("two free UDP ports on loopback");
        let a = MsgDaemon::start(pa, &dir.join("a.sock"), runtime("msgd-a")).unwrap();
        let b = MsgDaemon::start(pb, &dir.join("b.sock"), runtime("msgd-b")).unwrap();
        (a, b)
    }

    fn bytes(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(13) ^ seed).collect()
    }

    #[test]
    fn clients_of_two_daemons_and_of_one_exchange_messages() {
        let dir = scratch("two");
        let (da, db) = two_daemons(&dir);
        let mut a1 = MsgClient::connect(&dir.join("a.sock"), Config::default()).unwrap();
        let mut a2 = MsgClient::connect(&dir.join("a.sock"), Config::default()).unwrap();
        let mut b1 = MsgClient::connect(&dir.join("b.sock"), Config::default()).unwrap();
        assert_eq!((a1.addr().mac, b1.addr().mac), (da.mac(), db.mac()));
        assert_ne!(a1.addr().id, a2.addr().id);
        let to_b = b1.addr();
        let echo = std::thread::spawn(move || {
            for _ in 0..4 {
                let (st, data, truncated) = b1.recv(Match::any_tag(Source::Any, 0), 1 << 20, T).unwrap();
                assert!(!truncated);
                b1.send(st.source, 0, st.tag + 1, data, T).unwrap();
            }
            b1
        });
        for (i, len) in [0usize, 100, 20_000, 300_000].into_iter().enumerate() {
            let data = bytes(len, i as u8);
            a1.send(to_b, 0, 10 * i as u64, data.clone(), T).unwrap();
            let (st, back, _) =
                a1.recv(Match::exact(Source::Only(to_b), 0, 10 * i as u64 + 1), 1 << 20, T).unwrap();
            assert_eq!((st.source, st.len as usize), (to_b, len));
            assert!(back == data, "{len} bytes came back intact");
        }
        let b1 = echo.join().unwrap();
        assert_eq!(b1.counters().received, 4);
        // Two processes of one node: straight through the daemon, no wire.
        // New DATA frames only: ACKs, heartbeats and resends of the exchange above may still go
        // out meanwhile (a loaded machine delays them).
        let new_data = || {
            let t = da.runtime_stats().transport;
            t.data_frames_sent - t.retransmitted_frames
        };
        let sent_before = new_data();
        a1.send(a2.addr(), 3, 7, bytes(50, 9), T).unwrap();
        let (st, data, _) = a2.recv(Match::any_tag(Source::Any, 3), 64, T).unwrap();
        assert_eq!((st.source, st.tag, data), (a1.addr(), 7, bytes(50, 9)));
        assert_eq!(new_data(), sent_before, "no new DATA frame on the wire");
        // Relaxed: statistics.
        assert!(da.counters().from_clients.load(Ordering::Relaxed) >= 5);
        drop((a1, a2, b1, da, db));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_client_that_goes_away_is_forgotten_and_its_id_not_reused() {
        let dir = scratch("gone");
        let (da, _db) = two_daemons(&dir);
        let c1 = MsgClient::connect(&dir.join("a.sock"), Config::default()).unwrap();
        let id1 = c1.addr().id;
        assert_eq!(da.clients(), 1);
        drop(c1);
        let t = Instant::now();
        while da.clients() > 0 {
            assert!(t.elapsed() < T, "the daemon still holds a client that went away");
            std::thread::sleep(Duration::from_millis(5));
        }
        let c2 = MsgClient::connect(&dir.join("a.sock"), Config::default()).unwrap();
        assert_ne!(c2.addr().id, id1, "a new process never gets the id of one that went away");
        drop(c2);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn requests_waiting_on_a_process_that_went_away_fail_on_every_node() {
        let dir = scratch("peer-gone");
        let (_da, _db) = two_daemons(&dir);
        let doomed = MsgClient::connect(&dir.join("a.sock"), Config::default()).unwrap();
        let mut local = MsgClient::connect(&dir.join("a.sock"), Config::default()).unwrap();
        let mut remote = MsgClient::connect(&dir.join("b.sock"), Config::default()).unwrap();
        let gone = doomed.addr();
        // The remote process announces a rendezvous message to it and waits for one from it;
        // so does the local one.
        let send = remote.isend(gone, 0, 1, bytes(100_000, 1)).unwrap();
        let recv = remote.irecv(Match::any_tag(Source::Only(gone), 0), 8).unwrap();
        let local_recv = local.irecv(Match::any_tag(Source::Only(gone), 0), 8).unwrap();
        let any = remote.irecv(Match::any_tag(Source::Any, 9), 8).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        drop(doomed);
        let failed = |r: Result<Outcome, MsgError>| matches!(r, Err(MsgError::Failed { why: lanbus_msg::Failure::EndpointGone(a), .. }) if a == gone);
        assert!(failed(remote.wait(send, T)), "the send to it fails");
        assert!(failed(remote.wait(recv, T)), "the receive from it fails");
        assert!(failed(local.wait(local_recv, T)), "on its own node too");
        assert!(
            matches!(remote.wait(any, Duration::from_millis(50)), Err(MsgError::Timeout(..))),
            "a receive from any source stays posted"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_client_writing_garbage_is_disconnected_and_no_one_else_is_affected() {
        let dir = scratch("hostile");
        let (da, _db) = two_daemons(&dir);
        let sock = dir.join("a.sock");
        let mut bad = MsgClient::connect(&sock, Config::default()).unwrap();
        let mut c2 = MsgClient::connect(&sock, Config::default()).unwrap();
        let mut c3 = MsgClient::connect(&sock, Config::default()).unwrap();
        // A record claiming another client's id, then bytes that are no record at all.
        let mut forged = da.mac().0.to_vec();
        wire::Record::Eager { context: 0, tag: 0, data: b"x" }
            .emit(wire::Route { src: c2.addr().id, dst: c3.addr().id }, &mut forged);
        assert!(bad.to_daemon.send(&forged).unwrap());
        assert!(bad.to_daemon.send(&[1, 2, 3]).unwrap());
        let _ = bad.daemon_bell.notify();
        let r = bad.irecv(Match::any_tag(Source::Any, 0), 8).unwrap();
        assert!(matches!(bad.wait(r, T), Err(MsgError::DaemonGone)));
        // Relaxed: a statistic.
        assert_eq!(da.counters().disconnected_hostile.load(Ordering::Relaxed), 1);
        assert_eq!(
            c3.probe(Match::any_tag(Source::Any, 0)).unwrap(),
            None,
            "the forged record never arrived"
        );
        c2.send(c3.addr(), 0, 1, bytes(10, 1), T).unwrap();
        let (st, data, _) = c3.recv(Match::any_tag(Source::Any, 0), 64, T).unwrap();
        assert_eq!((st.source, data), (c2.addr(), bytes(10, 1)));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn clients_get_errors_not_hangs_when_the_daemon_goes() {
        let dir = scratch("daemon-gone");
        let (da, _db) = two_daemons(&dir);
        let mut c = MsgClient::connect(&dir.join("a.sock"), Config::default()).unwrap();
        let r = c.irecv(Match::any_tag(Source::Any, 0), 8).unwrap();
        drop(da);
        let t = Instant::now();
        assert!(matches!(c.wait(r, T), Err(MsgError::DaemonGone)));
        assert!(t.elapsed() < Duration::from_secs(2));
        assert!(matches!(c.isend(c.addr(), 0, 0, vec![]), Err(MsgError::DaemonGone)));
        assert!(MsgClient::connect(&dir.join("a.sock"), Config::default()).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
