//! Several ports as one: a node wired to its peers by two or more links (through two switches)
//! keeps its devices, messages and sockets when one link fails.
//!
//! Layer: ports. A [`MultiPort`] joins ports of any kinds (each already keyed, where the fabric
//! is) under one address, the node's: the transport above sees one port and one MAC per peer
//! node, with one sequence space per channel spanning every path. Below, each peer node is known
//! by the MAC of each of its ports, learned from PATH frames ([`PathRepr`]) that carry the node's
//! own address: every port announces its node every [`MultiConfig::announce_every`], and each
//! path in use is probed every [`MultiConfig::probe_every`]; the peer answers on the same path.
//!
//! Sending: a frame for a peer node goes by one of its paths that are up, chosen by smooth
//! weighted round robin in runs of [`RUN_FRAMES`] frames (fewer reorderings for the receiver's
//! selective repeat to absorb); its MACs are rewritten to the path's. A path's weight falls when
//! the peer's answers show frames it lost (fewer arrived than were sent) and climbs back while it
//! delivers, so a lossy or slower path carries less. Broadcasts (heartbeats) go by every port.
//! Receiving: a frame from a known path has its source rewritten to the peer node's address;
//! frames from MACs never announced (a peer with one port and no multipath layer) pass unchanged,
//! and frames for them go by the port they were last heard on (the first port before they are).
//!
//! Failure: a path in use and silent for [`MultiConfig::silence_limit`] while another path to the
//! same node is heard is taken down (if every path is silent, the peer or this host is stalled,
//! and nothing changes here: the transport's liveness decides). The transport learns of it
//! through [`Port::take_failed_peer`] and sends every frame in flight to that node again, by the
//! paths left. A down path is still probed and comes back up at its first answer.
//!
//! Invariants: bytes from the network never panic (a malformed PATH frame is counted and dropped);
//! the node's own frames heard back (two of its ports on one switch) are ignored; the transport
//! never sees a PATH frame.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use lanbus_wire::frame::{self, Kind, PathRepr, PATH_LEN};
use lanbus_wire::{Clock, EtherType, Instant, MacAddr, MonotonicClock};

use crate::{Port, PortCounters, PortError, Result};

const ETH: usize = lanbus_wire::ethernet::HEADER_LEN;
const HDR: usize = ETH + frame::HEADER_LEN;
/// Frames sent in a row by one path before the round robin looks again.
pub const RUN_FRAMES: u32 = 16;
/// Peer MACs without multipath remembered with the port they were heard on.
const MAX_PLAIN: usize = 4096;
/// Peer nodes kept; PATH frames from more are counted and dropped.
const MAX_NODES: usize = 1024;
const MIN_WEIGHT: f64 = 0.05;

/// How a [`MultiPort`] watches its paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MultiConfig {
    /// How often a path in use (or down) is probed.
    pub probe_every: Duration,
    /// How often every port announces the node (and an idle path is probed).
    pub announce_every: Duration,
    /// How long a path in use may stay silent, while another path to the same node is heard,
    /// before it is taken down.
    pub silence_limit: Duration,
}

impl Default for MultiConfig {
    fn default() -> Self {
        MultiConfig {
            probe_every: Duration::from_millis(1),
            announce_every: Duration::from_millis(100),
            silence_limit: Duration::from_millis(6),
        }
    }
}

/// One path to one peer node, as `lanbus status` and the metrics show it.
#[derive(Debug, Clone, PartialEq)]
pub struct PathReport {
    /// Index of the local port (in the order given).
    pub port: usize,
    /// The local port's MAC.
    pub local: MacAddr,
    /// The peer node's address.
    pub node: MacAddr,
    /// The peer's port's MAC on this path.
    pub remote: MacAddr,
    /// Whether frames go by it.
    pub up: bool,
    /// The last probe's round trip.
    pub rtt: Option<Duration>,
    /// Its share of the node's frames relative to the others (1: full).
    pub weight: f64,
    /// Frames sent by it.
    pub tx_frames: u64,
    /// Frames received by it.
    pub rx_frames: u64,
    /// Frames sent by it that the peer did not receive, as its answers report.
    pub lost_frames: u64,
    /// Times it was taken down.
    pub failovers: u64,
}

#[derive(Debug, Clone)]
struct Path {
    remote: MacAddr,
    up: bool,
    heard: Instant,
    /// When a frame of the transport's last came by the path.
    received: Instant,
    /// When a frame first went by the path since it was last heard: silence is counted from
    /// then (an idle path is never silent).
    awaiting: Option<Instant>,
    used: Instant,
    probed: Instant,
    probe_stamp: u64,
    probe_tx: u64,
    /// Our frames sent and the peer's frames received at the last answered probe.
    mark: Option<(u64, u64)>,
    tx_frames: u64,
    rx_frames: u64,
    lost_frames: u64,
    failovers: u64,
    rtt: Option<Duration>,
    /// The round trip the silence limit scales with: it rises at once to a longer sample and
    /// decays by an eighth of the difference toward a shorter one, so a queue that builds on the
    /// path (a slower or busier link) stretches the limit before its probes are late.
    rtt_guard: Duration,
    /// When the newest probe of ours that the peer answered was sent.
    answered_probe: Instant,
    weight: f64,
    credit: f64,
}

impl Path {
    fn new(remote: MacAddr, now: Instant) -> Path {
        Path {
            remote,
            up: true,
            heard: now,
            received: Instant::ZERO,
            awaiting: None,
            used: Instant::ZERO,
            probed: Instant::ZERO,
            probe_stamp: 0,
            probe_tx: 0,
            mark: None,
            tx_frames: 0,
            rx_frames: 0,
            lost_frames: 0,
            failovers: 0,
            rtt: None,
            rtt_guard: Duration::ZERO,
            answered_probe: Instant::ZERO,
            weight: 1.0,
            credit: 0.0,
        }
    }

    /// Takes in an answer's report of frames received: a loss sample, and the weight.
    fn on_report(&mut self, probe_tx: u64, peer_rx: u64) {
        if let Some((tx0, rx0)) = self.mark {
            let sent = probe_tx.wrapping_sub(tx0);
            let got = peer_rx.wrapping_sub(rx0).min(sent);
            if sent < 32 {
                return;
            }
            self.lost_frames += sent - got;
            let loss = (sent - got) as f64 / sent as f64;
            self.weight =
                if loss > 0.02 { (self.weight * 0.7).max(MIN_WEIGHT) } else { (self.weight + 0.1).min(1.0) };
        }
        self.mark = Some((probe_tx, peer_rx));
    }
}

struct Peer {
    node: MacAddr,
    /// By local port index.
    paths: Vec<Option<Path>>,
    current: usize,
    run_left: u32,
}

/// Frames the multipath layer itself counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MultiCounters {
    /// PATH frames received and taken in.
    pub path_frames: u64,
    /// PATH frames refused (malformed, or from more nodes than are kept).
    pub path_dropped: u64,
    /// Paths taken down.
    pub failovers: u64,
    /// Sends and receives a port refused (its link down, mostly); the other ports carried on.
    pub port_errors: u64,
}

/// The paths' state; apart from the ports so that both can be borrowed at once.
struct State {
    node: MacAddr,
    macs: Vec<MacAddr>,
    config: MultiConfig,
    peers: Vec<Peer>,
    by_node: HashMap<MacAddr, usize>,
    by_remote: HashMap<(usize, MacAddr), usize>,
    plain: HashMap<MacAddr, usize>,
    /// The group and epoch the transport stamps, for the PATH frames (learned from its frames).
    stamp: Option<(u16, u32)>,
    failed: VecDeque<MacAddr>,
    next_announce: Instant,
    announced: u32,
    next_tick: Instant,
    counters: MultiCounters,
    rx_scratch: Vec<u8>,
    /// When each port's receive queue was last found empty: a path is judged silent only up to
    /// then (after this host stalled, frames still waiting in a queue are not silence).
    drained: Vec<Instant>,
}

/// Several ports joined under one address; see the module docs.
pub struct MultiPort {
    ports: Vec<Box<dyn Port>>,
    state: State,
    clock: Arc<dyn Clock>,
    scratch: Vec<Vec<u8>>,
    heads: Vec<Vec<u8>>,
    rx_next: usize,
    epoll: Option<OwnedFd>,
    timer: Option<OwnedFd>,
}

fn mac_at(b: &[u8], at: usize) -> MacAddr {
    let mut m = [0u8; 6];
    m.copy_from_slice(&b[at..at + 6]);
    MacAddr(m)
}

fn is_lanbus(f: &[u8]) -> bool {
    f.len() >= HDR && u16::from_be_bytes([f[12], f[13]]) == EtherType::LANBUS_RAW && f[ETH] == frame::VERSION
}

impl MultiPort {
    /// Joins `ports` (at least two) under the first one's MAC, on the real clock.
    pub fn new(ports: Vec<Box<dyn Port>>, config: MultiConfig) -> Result<MultiPort> {
        MultiPort::with_clock(ports, config, Arc::new(MonotonicClock::new()))
    }

    /// As [`MultiPort::new`], on `clock` (the simulator's).
    pub fn with_clock(
        ports: Vec<Box<dyn Port>>,
        config: MultiConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<MultiPort> {
        if ports.len() < 2 {
            return Err(PortError::BadSpec {
                spec: format!("{} port(s)", ports.len()),
                why: "several paths need at least two ports".into(),
            });
        }
        let macs: Vec<MacAddr> = ports.iter().map(|p| p.mac()).collect();
        for (i, m) in macs.iter().enumerate() {
            if macs[..i].contains(m) {
                return Err(PortError::BadSpec {
                    spec: m.to_string(),
                    why: "two ports have the same MAC: each path needs a MAC of its own".into(),
                });
            }
        }
        let fds: Option<Vec<RawFd>> = ports.iter().map(|p| p.readiness_fd()).collect();
        let (epoll, timer) = match fds {
            Some(fds) => {
                let (e, t) = epoll_over(&fds).map_err(|e| PortError::io("epoll over the paths' ports", e))?;
                (Some(e), Some(t))
            }
            None => (None, None),
        };
        let now = clock.now();
        Ok(MultiPort {
            state: State {
                node: macs[0],
                macs,
                config,
                peers: Vec::new(),
                by_node: HashMap::new(),
                by_remote: HashMap::new(),
                plain: HashMap::new(),
                stamp: None,
                failed: VecDeque::new(),
                next_announce: now,
                announced: 0,
                next_tick: now,
                counters: MultiCounters::default(),
                rx_scratch: Vec::new(),
                drained: vec![now; ports.len()],
            },
            ports,
            clock,
            scratch: Vec::new(),
            heads: Vec::new(),
            rx_next: 0,
            epoll,
            timer,
        })
    }

    /// The layer's own counters.
    pub fn multi_counters(&self) -> MultiCounters {
        self.state.counters
    }

    /// Probes, announcements and the silence check, when due.
    fn tick(&mut self, now: Instant) {
        if now < self.state.next_tick {
            return;
        }
        self.state.next_tick = now + self.state.config.probe_every / 4;
        let mut out: Vec<(usize, Vec<u8>)> = Vec::new();
        self.state.housekeeping(now, &mut out);
        for (port, f) in out {
            let _ = self.ports[port].send_frames(&[&f]);
        }
    }

    /// The earliest time [`MultiPort::tick`] has work.
    fn next_deadline(&self, now: Instant) -> Instant {
        let active = self.state.peers.iter().flat_map(|p| p.paths.iter().flatten()).any(|p| {
            !p.up || now.saturating_duration_since(p.used.max(p.received)) < self.state.config.announce_every
        });
        if active {
            now + self.state.config.probe_every
        } else {
            self.state.next_announce.max(now)
        }
    }

    /// Sends each port its frames. A port that fails (its link is down: the kernel refuses)
    /// loses its frames, as a cut cable would, and the others still send theirs.
    fn send_groups(&mut self, groups: &[Vec<[&[u8]; 2]>]) {
        for (i, g) in groups.iter().enumerate() {
            if !g.is_empty() && self.ports[i].tx_borrowed_parts(g).is_err() {
                self.state.counters.port_errors += 1;
            }
        }
    }
}

impl State {
    fn peer_index(&mut self, node: MacAddr) -> Option<usize> {
        if let Some(&i) = self.by_node.get(&node) {
            return Some(i);
        }
        if self.peers.len() >= MAX_NODES {
            return None;
        }
        self.peers.push(Peer { node, paths: vec![None; self.macs.len()], current: 0, run_left: 0 });
        self.by_node.insert(node, self.peers.len() - 1);
        Some(self.peers.len() - 1)
    }

    /// A PATH frame for `dst` leaving by `port`.
    fn path_frame(&self, port: usize, dst: MacAddr, repr: &PathRepr) -> Option<Vec<u8>> {
        let (group, epoch) = self.stamp?;
        let mut f = vec![0u8; HDR + PATH_LEN];
        f[..6].copy_from_slice(&dst.0);
        f[6..12].copy_from_slice(&self.macs[port].0);
        f[12..14].copy_from_slice(&EtherType::LANBUS_RAW.to_be_bytes());
        let h = &mut f[ETH..];
        h[0] = frame::VERSION;
        h[1] = Kind::Path.into();
        h[4..6].copy_from_slice(&group.to_be_bytes());
        h[24..26].copy_from_slice(&(PATH_LEN as u16).to_be_bytes());
        h[32..36].copy_from_slice(&epoch.to_be_bytes());
        repr.emit(&mut f[HDR..]);
        Some(f)
    }

    fn housekeeping(&mut self, now: Instant, out: &mut Vec<(usize, Vec<u8>)>) {
        let c = self.config;
        let stamp_ns = now.as_nanos();
        if now >= self.next_announce && self.stamp.is_some() {
            for port in 0..self.macs.len() {
                let repr =
                    PathRepr { node: self.node, port: port as u8, answer: false, stamp_ns, received: 0 };
                if let Some(f) = self.path_frame(port, MacAddr::BROADCAST, &repr) {
                    out.push((port, f));
                    // Every frame sent by a path counts, so that the peer's count of frames
                    // received compares with it.
                    for peer in &mut self.peers {
                        if let Some(p) = peer.paths[port].as_mut() {
                            p.tx_frames += 1;
                        }
                    }
                }
            }
            self.announced += 1;
            // The first few come quickly, so that a starting peer learns the paths at once.
            let every = if self.announced < 3 { c.announce_every / 10 } else { c.announce_every };
            self.next_announce = now + every;
        }
        let mut failed = Vec::new();
        for pi in 0..self.peers.len() {
            // The peer answered a probe sent by another path after frames began to wait on this
            // one: it is there and serving its paths, so this path's silence is the path's. (A
            // peer that stalled answers nothing; the few frames it still sends meanwhile may all
            // go by one path, and say nothing about the others.)
            let answered_elsewhere = |peer: &Peer, except: usize, since: Instant| {
                peer.paths.iter().enumerate().any(|(k, p)| {
                    k != except && p.as_ref().is_some_and(|p| p.up && p.answered_probe >= since)
                })
            };
            for port in 0..self.macs.len() {
                let peer = &self.peers[pi];
                let Some(path) = peer.paths[port].as_ref() else { continue };
                // In use: frames went by it either way lately. A node probes a path it only
                // receives on too, so that its peer, whose frames may wait or drop in a congested
                // queue, still hears it by the path's other direction.
                let in_use = now.saturating_duration_since(path.used.max(path.received)) < c.announce_every;
                // A few round trips, and never less than the configured limit.
                let limit = c.silence_limit.max(path.rtt_guard * 4);
                let fails = path.awaiting.is_some_and(|since| {
                    path.up
                        && in_use
                        && self.drained[port].saturating_duration_since(since) > limit
                        && answered_elsewhere(peer, port, since)
                });
                let every = if !path.up {
                    c.probe_every * 4
                } else if in_use {
                    c.probe_every
                } else {
                    c.announce_every
                };
                let due = now.saturating_duration_since(path.probed) >= every;
                let (remote, received) = (path.remote, path.rx_frames);
                let node = peer.node;
                let probe = if due {
                    let repr =
                        PathRepr { node: self.node, port: port as u8, answer: false, stamp_ns, received };
                    self.path_frame(port, remote, &repr)
                } else {
                    None
                };
                let path = self.peers[pi].paths[port].as_mut().expect("checked above");
                if fails {
                    path.up = false;
                    path.failovers += 1;
                    path.mark = None;
                    self.counters.failovers += 1;
                    failed.push(node);
                    eprintln!(
                        "lanbus: path {port} to node {node} down: nothing heard by it for {:.1} ms after frames went \
                         by it, while the node answered by another path",
                        now.saturating_duration_since(path.awaiting.unwrap_or(path.heard)).as_secs_f64() * 1e3,
                    );
                }
                if due {
                    if let Some(f) = probe {
                        out.push((port, f));
                        path.tx_frames += 1;
                        path.awaiting.get_or_insert(now);
                    }
                    path.probed = now;
                    path.probe_stamp = stamp_ns;
                    path.probe_tx = path.tx_frames;
                }
            }
        }
        for node in failed {
            if !self.failed.contains(&node) {
                self.failed.push_back(node);
            }
        }
    }

    /// Takes in a PATH frame that came by `port`; may write an answer into `out`.
    fn on_path(&mut self, now: Instant, port: usize, f: &[u8], out: &mut Vec<(usize, Vec<u8>)>) {
        let len = usize::from(u16::from_be_bytes([f[ETH + 24], f[ETH + 25]]));
        let Some(payload) = f.get(HDR..HDR + len) else {
            self.counters.path_dropped += 1;
            return;
        };
        let Ok(repr) = PathRepr::parse(payload) else {
            self.counters.path_dropped += 1;
            return;
        };
        let remote = mac_at(f, 6);
        if repr.node == self.node || self.macs.contains(&remote) || remote.is_multicast() {
            return;
        }
        let Some(pi) = self.peer_index(repr.node) else {
            self.counters.path_dropped += 1;
            return;
        };
        self.counters.path_frames += 1;
        self.plain.remove(&remote);
        let peer = &mut self.peers[pi];
        let path = peer.paths[port].get_or_insert_with(|| Path::new(remote, now));
        if path.remote != remote {
            let old = path.remote;
            *path = Path::new(remote, now);
            self.by_remote.remove(&(port, old));
        }
        self.by_remote.insert((port, remote), pi);
        path.heard = now;
        path.awaiting = None;
        path.rx_frames += 1;
        if repr.answer {
            if repr.stamp_ns == path.probe_stamp && repr.stamp_ns != 0 {
                let rtt = Duration::from_nanos(now.as_nanos().saturating_sub(repr.stamp_ns));
                path.rtt = Some(rtt);
                path.answered_probe = Instant::from_nanos(repr.stamp_ns);
                path.rtt_guard =
                    if rtt >= path.rtt_guard { rtt } else { path.rtt_guard - (path.rtt_guard - rtt) / 8 };
                let probe_tx = path.probe_tx;
                path.on_report(probe_tx, repr.received);
            }
            if !path.up {
                path.up = true;
                path.mark = None;
                eprintln!("lanbus: path {port} to node {} up again", repr.node);
            }
        } else {
            let answer = PathRepr {
                node: self.node,
                port: port as u8,
                answer: true,
                stamp_ns: repr.stamp_ns,
                received: path.rx_frames,
            };
            if let Some(a) = self.path_frame(port, remote, &answer) {
                out.push((port, a));
                if let Some(p) = self.peers[pi].paths[port].as_mut() {
                    p.tx_frames += 1;
                }
            }
        }
    }

    /// Where a frame for `dst` goes: the ports and the MAC each rewrites the destination to;
    /// `None` as the MAC keeps the destination (broadcasts, plain peers).
    fn route(&mut self, now: Instant, dst: MacAddr, to: &mut Vec<(usize, Option<MacAddr>)>) {
        to.clear();
        if dst.is_multicast() {
            let ports = self.macs.len();
            for peer in &mut self.peers {
                for p in peer.paths.iter_mut().flatten() {
                    p.tx_frames += 1;
                }
            }
            to.extend((0..ports).map(|i| (i, None)));
            return;
        }
        let Some(&pi) = self.by_node.get(&dst) else {
            // A node with one port, by the port it was heard on (else the first: a copy on
            // every port would reach a node with several as frames from strangers).
            to.push((self.plain.get(&dst).copied().unwrap_or(0), None));
            return;
        };
        let peer = &mut self.peers[pi];
        let usable = |p: &Option<Path>| p.as_ref().is_some_and(|p| p.up);
        if peer.run_left == 0 || !usable(&peer.paths[peer.current]) {
            // Smooth weighted round robin over the paths that are up.
            let mut sum = 0.0;
            let mut best: Option<(usize, f64)> = None;
            for (k, p) in peer.paths.iter_mut().enumerate() {
                let Some(p) = p.as_mut().filter(|p| p.up) else { continue };
                p.credit += p.weight;
                sum += p.weight;
                if best.is_none_or(|(_, c)| p.credit > c) {
                    best = Some((k, p.credit));
                }
            }
            match best {
                Some((k, _)) => {
                    if let Some(p) = peer.paths[k].as_mut() {
                        p.credit -= sum;
                    }
                    peer.current = k;
                    peer.run_left = RUN_FRAMES;
                }
                None => {
                    // No path is up: every known one.
                    for (k, p) in peer.paths.iter_mut().enumerate() {
                        if let Some(p) = p.as_mut() {
                            p.tx_frames += 1;
                            p.used = now;
                            p.awaiting.get_or_insert(now);
                            to.push((k, Some(p.remote)));
                        }
                    }
                    return;
                }
            }
        }
        peer.run_left -= 1;
        let k = peer.current;
        let p = peer.paths[k].as_mut().expect("chosen above");
        p.tx_frames += 1;
        p.used = now;
        p.awaiting.get_or_insert(now);
        to.push((k, Some(p.remote)));
    }

    /// Takes in a frame that came by `port`: `Some` with the bytes to deliver (rewritten into the
    /// scratch buffer where needed), `None` when the layer consumed it.
    fn on_frame(
        &mut self,
        now: Instant,
        port: usize,
        f: &[u8],
        out: &mut Vec<(usize, Vec<u8>)>,
    ) -> Option<bool> {
        if !is_lanbus(f) {
            return Some(false);
        }
        if Kind::from(f[ETH + 1]) == Kind::Path {
            self.on_path(now, port, f, out);
            return None;
        }
        let src = mac_at(f, 6);
        let Some(&pi) = self.by_remote.get(&(port, src)) else {
            let room = self.plain.len() < MAX_PLAIN || self.plain.contains_key(&src);
            if !src.is_multicast() && !self.macs.contains(&src) && !self.by_node.contains_key(&src) && room {
                self.plain.insert(src, port);
            }
            return Some(false);
        };
        let peer = &mut self.peers[pi];
        if let Some(p) = peer.paths[port].as_mut() {
            p.heard = now;
            p.received = now;
            p.awaiting = None;
            p.rx_frames += 1;
        }
        let node = peer.node;
        let dst = mac_at(f, 0);
        let new_dst = if dst == self.macs[port] { self.node } else { dst };
        if node == src && new_dst == dst {
            return Some(false);
        }
        self.rx_scratch.clear();
        self.rx_scratch.extend_from_slice(f);
        self.rx_scratch[..6].copy_from_slice(&new_dst.0);
        self.rx_scratch[6..12].copy_from_slice(&node.0);
        Some(true)
    }
}

/// An epoll descriptor over `fds` and a timer descriptor (also in it).
fn epoll_over(fds: &[RawFd]) -> std::io::Result<(OwnedFd, OwnedFd)> {
    // SAFETY: plain system calls; each returned descriptor is checked and owned at once.
    unsafe {
        let e = libc::epoll_create1(libc::EPOLL_CLOEXEC);
        if e < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let epoll = OwnedFd::from_raw_fd(e);
        let t = libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC);
        if t < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let timer = OwnedFd::from_raw_fd(t);
        for &fd in fds.iter().chain([&timer.as_raw_fd()]) {
            let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: fd as u64 };
            if libc::epoll_ctl(e, libc::EPOLL_CTL_ADD, fd, &mut ev) < 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok((epoll, timer))
    }
}

impl Port for MultiPort {
    fn rx_burst(&mut self, max: usize, on_frame: &mut dyn FnMut(&[u8])) -> Result<usize> {
        self.rx_burst_stamped(max, &mut |f, _| on_frame(f))
    }

    fn rx_burst_stamped(
        &mut self,
        max: usize,
        on_frame: &mut dyn FnMut(&[u8], Option<u64>),
    ) -> Result<usize> {
        let now = self.clock.now();
        self.tick(now);
        let mut out = Vec::new();
        let mut delivered = 0;
        let n = self.ports.len();
        for k in 0..n {
            if delivered >= max {
                break;
            }
            let i = (self.rx_next + k) % n;
            let want = max - delivered;
            let state = &mut self.state;
            let r = self.ports[i].rx_burst_stamped(want, &mut |f, stamp| match state
                .on_frame(now, i, f, &mut out)
            {
                Some(false) => {
                    delivered += 1;
                    on_frame(f, stamp);
                }
                Some(true) => {
                    delivered += 1;
                    on_frame(&state.rx_scratch, stamp);
                }
                None => {}
            });
            match r {
                Ok(got) if got < want => self.state.drained[i] = now,
                Ok(_) => {}
                // A port whose link is down may refuse: the others are still read.
                Err(_) => {
                    self.state.drained[i] = now;
                    self.state.counters.port_errors += 1;
                }
            }
        }
        self.rx_next = (self.rx_next + 1) % n;
        for (port, f) in out {
            if self.ports[port].send_frames(&[&f]).is_err() {
                self.state.counters.port_errors += 1;
            }
        }
        Ok(delivered)
    }

    fn tx_burst(&mut self, max: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> Result<usize> {
        let now = self.clock.now();
        self.tick(now);
        let cap = self.frame_capacity();
        let mut lens = Vec::new();
        while lens.len() < max {
            if self.scratch.len() <= lens.len() {
                self.scratch.push(vec![0u8; cap]);
            }
            let buf = &mut self.scratch[lens.len()];
            buf.resize(cap, 0);
            match fill(&mut buf[..cap]) {
                Some(len) => lens.push(len.min(cap)),
                None => break,
            }
        }
        let scratch = std::mem::take(&mut self.scratch);
        let parts: Vec<[&[u8]; 2]> =
            lens.iter().enumerate().map(|(i, &l)| [&scratch[i][..l], &[][..]]).collect();
        let r = self.tx_borrowed_parts(&parts);
        drop(parts);
        self.scratch = scratch;
        r
    }

    fn borrows_frames(&self) -> bool {
        self.ports.iter().all(|p| p.borrows_frames())
    }

    fn tx_borrowed(&mut self, frames: &[&[u8]]) -> Result<usize> {
        let parts: Vec<[&[u8]; 2]> = frames.iter().map(|f| [*f, &[][..]]).collect();
        self.tx_borrowed_parts(&parts)
    }

    fn tx_borrowed_parts(&mut self, frames: &[[&[u8]; 2]]) -> Result<usize> {
        let now = self.clock.now();
        // PATH frames carry the transport's group and epoch (a keyed layer below seals under
        // them). Learned before the announcements go, which then precede the first frames on
        // every wire: a peer knows each path before a frame of ours comes by it.
        if let Some([head, _]) = frames.iter().rev().find(|[h, _]| is_lanbus(h)) {
            let group = u16::from_be_bytes([head[ETH + 4], head[ETH + 5]]);
            let epoch = u32::from_be_bytes(head[ETH + 32..ETH + 36].try_into().expect("4 bytes"));
            if self.state.stamp.is_none() {
                self.state.next_tick = now;
            }
            self.state.stamp = Some((group, epoch));
        }
        self.tick(now);
        let n = self.ports.len();
        // First every rewritten head, then the groups that point into them.
        let mut plan: Vec<(usize, usize, Option<usize>)> = Vec::with_capacity(frames.len());
        let mut heads_used = 0;
        let mut to = Vec::new();
        for (fi, [head, _]) in frames.iter().enumerate() {
            if head.len() < 14 {
                plan.push((fi, 0, None));
                continue;
            }
            self.state.route(now, mac_at(head, 0), &mut to);
            for &(port, dst) in &to {
                let src = self.state.macs[port];
                let keep_dst = dst.is_none_or(|d| d.0 == head[..6]);
                if keep_dst && src.0 == head[6..12] {
                    plan.push((fi, port, None));
                    continue;
                }
                if self.heads.len() <= heads_used {
                    self.heads.push(Vec::new());
                }
                let h = &mut self.heads[heads_used];
                h.clear();
                h.extend_from_slice(head);
                if let Some(d) = dst {
                    h[..6].copy_from_slice(&d.0);
                }
                h[6..12].copy_from_slice(&src.0);
                plan.push((fi, port, Some(heads_used)));
                heads_used += 1;
            }
        }
        let heads = std::mem::take(&mut self.heads);
        let mut groups: Vec<Vec<[&[u8]; 2]>> = vec![Vec::new(); n];
        for &(fi, port, h) in &plan {
            let [head, body] = frames[fi];
            let head = h.map_or(head, |h| &heads[h][..]);
            groups[port].push([head, body]);
        }
        self.send_groups(&groups);
        drop(groups);
        self.heads = heads;
        Ok(frames.len())
    }

    fn wait(&mut self, timeout: Option<Duration>) -> Result<()> {
        let now = self.clock.now();
        let until = self.next_deadline(now).saturating_duration_since(now);
        let limit = timeout.map_or(until, |t| t.min(until));
        match &self.epoll {
            Some(e) => {
                let mut ev = libc::epoll_event { events: 0, u64: 0 };
                let ms = limit.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
                // SAFETY: one event buffer of the size given; the descriptor is ours.
                let _ = unsafe { libc::epoll_wait(e.as_raw_fd(), &mut ev, 1, ms) };
                Ok(())
            }
            None => self.ports[0].wait(Some(limit.min(Duration::from_millis(1)))),
        }
    }

    fn mtu(&self) -> usize {
        self.ports.iter().map(|p| p.mtu()).min().unwrap_or(0)
    }

    fn frame_capacity(&self) -> usize {
        self.ports.iter().map(|p| p.frame_capacity()).min().unwrap_or(0)
    }

    fn readiness_fd(&self) -> Option<RawFd> {
        self.epoll.as_ref().map(|e| e.as_raw_fd())
    }

    fn arm_readiness(&mut self) -> bool {
        let mut sleep = true;
        for p in &mut self.ports {
            sleep &= p.arm_readiness();
        }
        if let Some(t) = &self.timer {
            let now = self.clock.now();
            let d = self.next_deadline(now).saturating_duration_since(now).max(Duration::from_micros(50));
            let spec = libc::itimerspec {
                it_interval: libc::timespec { tv_sec: 0, tv_nsec: 0 },
                it_value: libc::timespec {
                    tv_sec: d.as_secs() as libc::time_t,
                    tv_nsec: d.subsec_nanos() as libc::c_long,
                },
            };
            // SAFETY: arms our own timer descriptor with a valid itimerspec.
            unsafe { libc::timerfd_settime(t.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
        }
        sleep
    }

    fn disarm_readiness(&mut self) {
        for p in &mut self.ports {
            p.disarm_readiness();
        }
        if let Some(t) = &self.timer {
            let mut n = 0u64;
            // SAFETY: reads 8 bytes into a u64 from our own non-blocking timer descriptor.
            let _ = unsafe { libc::read(t.as_raw_fd(), (&mut n as *mut u64).cast(), 8) };
        }
    }

    fn mac(&self) -> MacAddr {
        self.state.node
    }

    fn authenticates(&self) -> bool {
        self.ports.iter().all(|p| p.authenticates())
    }

    fn counters(&self) -> PortCounters {
        let mut c = PortCounters::default();
        for p in &self.ports {
            let o = p.counters();
            c.rx_frames += o.rx_frames;
            c.rx_bytes += o.rx_bytes;
            c.tx_frames += o.tx_frames;
            c.tx_bytes += o.tx_bytes;
            c.rx_dropped += o.rx_dropped;
            c.tx_dropped += o.tx_dropped;
            c.rx_filtered += o.rx_filtered;
        }
        c.rx_dropped += self.state.counters.path_dropped;
        c
    }

    fn take_failed_peer(&mut self) -> Option<MacAddr> {
        self.state.failed.pop_front()
    }

    fn paths(&self) -> Vec<PathReport> {
        let mut v = Vec::new();
        for peer in &self.state.peers {
            for (port, p) in peer.paths.iter().enumerate() {
                let Some(p) = p else { continue };
                v.push(PathReport {
                    port,
                    local: self.state.macs[port],
                    node: peer.node,
                    remote: p.remote,
                    up: p.up,
                    rtt: p.rtt,
                    weight: p.weight,
                    tx_frames: p.tx_frames,
                    rx_frames: p.rx_frames,
                    lost_frames: p.lost_frames,
                    failovers: p.failovers,
                });
            }
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;
    use crate::{Hub, HubConfig};

    struct Manual(AtomicU64);

    impl Clock for Manual {
        fn now(&self) -> Instant {
            Instant::from_nanos(self.0.load(Ordering::Relaxed))
        }
    }

    fn mac(n: u8) -> MacAddr {
        MacAddr([2, 0, 0, 0, 0, n])
    }

    /// A lanbus DATA frame (group 7, epoch 9) with an 8-byte payload.
    fn data(dst: MacAddr, src: MacAddr, tag: u8) -> Vec<u8> {
        let mut f = vec![0u8; HDR + 8];
        f[..6].copy_from_slice(&dst.0);
        f[6..12].copy_from_slice(&src.0);
        f[12..14].copy_from_slice(&EtherType::LANBUS_RAW.to_be_bytes());
        f[ETH] = frame::VERSION;
        f[ETH + 1] = Kind::Data.into();
        f[ETH + 4..ETH + 6].copy_from_slice(&7u16.to_be_bytes());
        f[ETH + 24..ETH + 26].copy_from_slice(&8u16.to_be_bytes());
        f[ETH + 32..ETH + 36].copy_from_slice(&9u32.to_be_bytes());
        f[HDR] = tag;
        f
    }

    struct Pair {
        hubs: [Hub; 2],
        clock: Arc<Manual>,
        a: MultiPort,
        b: MultiPort,
    }

    /// Nodes A (ports 0xa0, 0xa1) and B (0xb0, 0xb1), each port on its own switch.
    fn pair() -> Pair {
        let hubs = [Hub::new(HubConfig::default()).unwrap(), Hub::new(HubConfig::default()).unwrap()];
        let clock = Arc::new(Manual(AtomicU64::new(1_000_000)));
        let node = |x: u8| {
            let ports: Vec<Box<dyn Port>> =
                vec![Box::new(hubs[0].port(mac(x))), Box::new(hubs[1].port(mac(x + 1)))];
            MultiPort::with_clock(ports, MultiConfig::default(), clock.clone()).unwrap()
        };
        let (a, b) = (node(0xa0), node(0xb0));
        Pair { hubs, clock, a, b }
    }

    impl Pair {
        /// Advances the clock by `us` and lets both nodes receive; returns what each delivered.
        fn step(&mut self, us: u64) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
            self.clock.0.fetch_add(us * 1000, Ordering::Relaxed);
            let mut got = (Vec::new(), Vec::new());
            for _ in 0..3 {
                self.a.rx_burst(256, &mut |f| got.0.push(f.to_vec())).unwrap();
                self.b.rx_burst(256, &mut |f| got.1.push(f.to_vec())).unwrap();
            }
            got
        }

        /// Both nodes announce themselves and learn each other's paths.
        fn meet(&mut self) {
            let hello_a = data(MacAddr::BROADCAST, self.a.mac(), 0);
            let hello_b = data(MacAddr::BROADCAST, self.b.mac(), 0);
            self.a.tx_borrowed(&[&hello_a]).unwrap();
            self.b.tx_borrowed(&[&hello_b]).unwrap();
            for _ in 0..4 {
                self.step(200);
            }
        }
    }

    #[test]
    fn a_nodes_frames_spread_over_both_paths_and_arrive_under_its_address() {
        let mut p = pair();
        p.meet();
        let paths = p.a.paths();
        assert_eq!(paths.len(), 2, "{paths:?}");
        assert!(paths.iter().all(|r| r.up && r.node == mac(0xb0)), "{paths:?}");
        let frames: Vec<Vec<u8>> = (0..64).map(|i| data(mac(0xb0), mac(0xa0), i)).collect();
        let refs: Vec<&[u8]> = frames.iter().map(|f| &f[..]).collect();
        assert_eq!(p.a.tx_borrowed(&refs).unwrap(), 64);
        let (_, got) = p.step(10);
        let data: Vec<&Vec<u8>> =
            got.iter().filter(|f| f[ETH + 1] == u8::from(Kind::Data) && f[..6] != [0xff; 6]).collect();
        assert_eq!(data.len(), 64, "every frame arrives once");
        assert!(
            data.iter().all(|f| f[..6] == mac(0xb0).0 && f[6..12] == mac(0xa0).0),
            "under the nodes' addresses"
        );
        assert!(
            got.iter().all(|f| f[ETH + 1] != u8::from(Kind::Path)),
            "no PATH frame reaches the transport"
        );
        let rx: Vec<u64> = p.b.paths().iter().map(|r| r.rx_frames).collect();
        assert!(rx.iter().all(|&n| n >= 16), "both paths carried frames: {rx:?}");
    }

    #[test]
    fn a_cut_path_is_taken_down_the_peer_reported_and_traffic_moves_then_returns() {
        let mut p = pair();
        p.meet();
        p.hubs[1].set_link(mac(0xa1), false);
        let mut delivered = 0;
        let mut failed = None;
        for i in 0..40u8 {
            let f = data(mac(0xb0), mac(0xa0), i);
            p.a.tx_borrowed(&[&f]).unwrap();
            let back = data(mac(0xa0), mac(0xb0), i);
            p.b.tx_borrowed(&[&back]).unwrap();
            let (_, got) = p.step(500);
            delivered +=
                got.iter().filter(|f| f[ETH + 1] == u8::from(Kind::Data) && f[..6] == mac(0xb0).0).count();
            failed = failed.or(p.a.take_failed_peer());
        }
        assert_eq!(failed, Some(mac(0xb0)), "the transport is told which node to resend to");
        let down: Vec<PathReport> = p.a.paths().into_iter().filter(|r| !r.up).collect();
        assert_eq!(down.len(), 1, "{:?}", p.a.paths());
        assert_eq!((down[0].port, down[0].failovers), (1, 1));
        assert!(delivered >= 25, "after the failover every frame arrives: {delivered} of 40");
        // After the failover, none is lost.
        let before = delivered;
        for i in 0..10u8 {
            p.a.tx_borrowed(&[&data(mac(0xb0), mac(0xa0), i)]).unwrap();
        }
        let (_, got) = p.step(100);
        let now = got.iter().filter(|f| f[ETH + 1] == u8::from(Kind::Data) && f[..6] == mac(0xb0).0).count();
        assert_eq!(now, 10, "{before}");
        p.hubs[1].set_link(mac(0xa1), true);
        for _ in 0..20 {
            p.step(1000);
        }
        assert!(p.a.paths().iter().all(|r| r.up), "the path came back: {:?}", p.a.paths());
        assert!(p.multi_quiet());
    }

    impl Pair {
        fn multi_quiet(&self) -> bool {
            self.a.multi_counters().path_dropped == 0 && self.b.multi_counters().path_dropped == 0
        }
    }

    #[test]
    fn silence_on_every_path_takes_none_down() {
        let mut p = pair();
        p.meet();
        p.hubs[0].set_link(mac(0xb0), false);
        p.hubs[1].set_link(mac(0xb1), false);
        for i in 0..30u8 {
            p.a.tx_borrowed(&[&data(mac(0xb0), mac(0xa0), i)]).unwrap();
            p.step(1000);
        }
        assert!(p.a.paths().iter().all(|r| r.up), "a stalled peer is the transport's to judge");
        assert_eq!(p.a.take_failed_peer(), None);
    }

    #[test]
    fn a_path_idle_for_a_while_is_not_silent_when_it_carries_frames_again() {
        let mut p = pair();
        p.meet();
        // A quiet second: only announcements, no frame to B, no probe of an unused path.
        for _ in 0..100 {
            p.step(10_000);
        }
        for i in 0..40u8 {
            p.a.tx_borrowed(&[&data(mac(0xb0), mac(0xa0), i)]).unwrap();
            p.step(100);
            assert_eq!(p.a.take_failed_peer(), None, "{:?}", p.a.paths());
        }
    }

    #[test]
    fn frames_still_queued_after_a_stall_are_not_silence() {
        let mut p = pair();
        p.meet();
        // A talks to B by both paths, then stalls for 10 ms while B's frames wait in both queues.
        let frames: Vec<Vec<u8>> = (0..64).map(|i| data(mac(0xb0), mac(0xa0), i)).collect();
        let refs: Vec<&[u8]> = frames.iter().map(|f| &f[..]).collect();
        p.a.tx_borrowed(&refs).unwrap();
        p.b.rx_burst(256, &mut |_| {}).unwrap();
        let back: Vec<Vec<u8>> = (0..64).map(|i| data(mac(0xa0), mac(0xb0), i)).collect();
        let refs: Vec<&[u8]> = back.iter().map(|f| &f[..]).collect();
        p.b.tx_borrowed(&refs).unwrap();
        p.clock.0.fetch_add(10_000_000, Ordering::Relaxed);
        // A reads one frame at a time, its housekeeping running between the reads.
        for _ in 0..200 {
            p.a.rx_burst(1, &mut |_| {}).unwrap();
            p.clock.0.fetch_add(300_000, Ordering::Relaxed);
            assert_eq!(p.a.take_failed_peer(), None, "{:?}", p.a.paths());
        }
        assert!(p.a.paths().iter().all(|r| r.up));
    }

    #[test]
    fn malformed_path_frames_are_counted_and_never_delivered() {
        let mut p = pair();
        p.meet();
        let mut bad = data(mac(0xa0), mac(0xb0), 0);
        bad[ETH + 1] = Kind::Path.into();
        let mut port = p.hubs[0].port(mac(0x77));
        port.send_frames(&[&bad]).unwrap();
        let (got, _) = p.step(10);
        assert!(got.iter().all(|f| f[ETH + 1] != u8::from(Kind::Path)));
        assert_eq!(p.a.multi_counters().path_dropped, 1);
    }

    #[test]
    fn one_port_or_two_with_one_mac_is_refused() {
        let hub = Hub::new(HubConfig::default()).unwrap();
        let one: Vec<Box<dyn Port>> = vec![Box::new(hub.port(mac(1)))];
        assert!(MultiPort::new(one, MultiConfig::default()).is_err());
        let same: Vec<Box<dyn Port>> = vec![Box::new(hub.port(mac(1))), Box::new(hub.port(mac(1)))];
        assert!(MultiPort::new(same, MultiConfig::default()).is_err());
    }
}
