//! A deterministic discrete-event network simulator that runs sans-IO protocol cores unchanged.
//!
//! Layer: simulation (above the transport, beside the ports). The simulated world is a set of
//! [`Node`]s (anything sans-IO: the real `lanbus-transport` endpoint, or a small test node),
//! output-queued [`Switch`](SwitchConfig)es with finite drop-tail buffers, and full-duplex links
//! with a line rate, a propagation delay and random loss. Time is logical ([`Instant`], ns): the
//! engine pops the earliest event from a binary heap and jumps the clock to it.
//!
//! Invariants:
//! - **Deterministic**: events at the same instant run in the order they were scheduled (a
//!   sequence number breaks ties), and every random decision comes from one ChaCha RNG seeded at
//!   construction, so a run is a pure function of its seed and its inputs.
//! - **Store and forward**: a frame reaches the far end of a link `serialisation + delay` after
//!   its transmission started; a link carries one frame at a time, so a node's transmissions are
//!   back to back at most (the node is asked for its next frame only when its line is free, which
//!   is how a NIC with a one-deep queue pulls from the protocol and how pacing shows on the wire).
//! - **Drop-tail**: a switch output queue holds at most `buffer_bytes` (the frame on the line
//!   included); a frame that does not fit is dropped and counted.
//! - **Bounded**: every run takes a deadline and a cap on events.
//!
//! Modelled after the paper's Fig. 1 (hosts on access links into one Ethernet switch).
#![deny(unsafe_code)]
#![deny(missing_docs)]

pub mod host;
pub mod paths;
pub mod scenario;
pub mod stats;
pub mod traffic;

use core::time::Duration;
use std::collections::{BinaryHeap, HashMap, VecDeque};

use lanbus_wire::{ethernet::HEADER_LEN, Instant, MacAddr};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub use lanbus_port::sim::serialisation;

/// Something that runs in the simulator: a sans-IO state machine with frames in and out.
///
/// The engine calls `handle_frame` for each frame that reaches the node, `handle_timeout` when
/// `poll_timeout`'s instant has come, and `poll_transmit` whenever the node's line is free, until
/// it returns `None`. Instants passed in never decrease.
pub trait Node {
    /// A whole Ethernet frame (header first, no FCS) arrived.
    fn handle_frame(&mut self, now: Instant, frame: &[u8]);
    /// The instant returned by [`Node::poll_timeout`] has come (or passed).
    fn handle_timeout(&mut self, now: Instant);
    /// Writes the next frame to send into `buf` and returns its length, or `None` when there is
    /// nothing to send now (the engine asks again after the next event touching this node).
    fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize>;
    /// When the node next wants `handle_timeout`, if ever.
    fn poll_timeout(&mut self) -> Option<Instant>;
}

/// A simplex link's properties (a connection uses one per direction).
#[derive(Debug, Clone, PartialEq)]
pub struct LinkConfig {
    /// Line rate in bits per second (0: infinitely fast).
    pub rate_bps: u64,
    /// Propagation delay.
    pub delay: Duration,
    /// Probability that a frame is lost on this link.
    pub loss: f64,
    /// Bytes the line carries per frame beyond the frame itself (preamble 8, FCS 4, inter-frame
    /// gap 12 on real Ethernet: 24), counted in serialisation time only.
    pub overhead_bytes: usize,
}

impl Default for LinkConfig {
    /// 10 Gbit/s, 1 µs, no loss, the Ethernet per-frame overhead of 24 bytes.
    fn default() -> Self {
        LinkConfig {
            rate_bps: 10_000_000_000,
            delay: Duration::from_micros(1),
            loss: 0.0,
            overhead_bytes: 24,
        }
    }
}

/// How a switch decides where a frame goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Forwarding {
    /// Learn source MACs per input port; flood unknown and broadcast destinations.
    Learning,
    /// Only the table filled by [`Sim::add_route`]; unknown unicast destinations are dropped and
    /// counted, broadcast is flooded.
    Static,
}

/// A switch's properties.
#[derive(Debug, Clone, PartialEq)]
pub struct SwitchConfig {
    /// Capacity of each output queue in bytes, the frame being transmitted included.
    pub buffer_bytes: usize,
    /// How destinations are found.
    pub forwarding: Forwarding,
    /// Fixed forwarding latency between a frame's full arrival and its enqueueing.
    pub latency: Duration,
}

impl Default for SwitchConfig {
    /// A learning switch with 256 KiB per output port and no forwarding latency.
    fn default() -> Self {
        SwitchConfig { buffer_bytes: 256 * 1024, forwarding: Forwarding::Learning, latency: Duration::ZERO }
    }
}

/// Identifies a node in a [`Sim`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub usize);

/// Identifies a switch in a [`Sim`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SwitchId(pub usize);

/// A port of a switch, numbered in the order links were attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SwitchPort(pub usize);

/// Where a link ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Node(usize),
    Switch(usize, usize),
}

/// What a link counted. Counters only grow.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Frames put on the line.
    pub frames: u64,
    /// Bytes of those frames (without the per-frame overhead).
    pub bytes: u64,
    /// Frames lost at random.
    pub lost: u64,
    /// Time the line was busy, in ns.
    pub busy_ns: u64,
}

/// What one switch output port counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Frames enqueued.
    pub enqueued: u64,
    /// Frames dropped because the buffer was full.
    pub dropped: u64,
    /// Largest occupancy seen, in bytes.
    pub max_bytes: usize,
}

/// What a switch counted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SwitchStats {
    /// Frames received on any port.
    pub received: u64,
    /// Unicast frames whose destination the static table does not know.
    pub unknown_destination: u64,
    /// Frames too short to hold an Ethernet header.
    pub malformed: u64,
    /// Per output port.
    pub ports: Vec<QueueStats>,
}

impl SwitchStats {
    /// Frames dropped on all output ports for lack of buffer.
    pub fn dropped(&self) -> u64 {
        self.ports.iter().map(|p| p.dropped).sum()
    }
}

#[derive(Debug)]
struct Link {
    config: LinkConfig,
    /// The node transmitting on this link, when it is a node's uplink.
    from_node: Option<usize>,
    to: End,
    /// Frames waiting behind the one on the line (switch-side links only: a node is asked for a
    /// frame only when its line is free).
    queue: VecDeque<Vec<u8>>,
    /// Bytes waiting in `queue` plus the frame on the line (which travels in its `Arrive`
    /// event, so it is never copied).
    queued_bytes: usize,
    /// Length of the frame on the line, while `busy`.
    on_line_bytes: usize,
    busy: bool,
    stats: LinkStats,
}

#[derive(Debug)]
struct Switch {
    config: SwitchConfig,
    /// Output link of each port.
    out_links: Vec<usize>,
    table: HashMap<MacAddr, usize>,
    stats: SwitchStats,
}

struct NodeSlot<N> {
    node: N,
    out_link: Option<usize>,
    /// The instant of the earliest timer event in the heap for this node, if any.
    timer: Option<Instant>,
}

#[derive(Debug)]
enum Event {
    /// A frame fully arrived at a link's far end.
    Arrive { link: usize, frame: Vec<u8> },
    /// A switch finished processing a frame from `in_port`.
    Forward { switch: usize, in_port: usize, frame: Vec<u8> },
    /// A link's line finished its frame.
    LineFree { link: usize },
    /// A node's timer.
    Timer { node: usize },
}

struct Scheduled {
    at: Instant,
    seq: u64,
    event: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Scheduled {}
impl Ord for Scheduled {
    fn cmp(&self, other: &Self) -> core::cmp::Ordering {
        // Reversed for the max-heap: earliest first, then first scheduled first.
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<core::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// Why a run stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// The deadline was reached.
    Deadline,
    /// No events are left: the world is quiet for ever.
    Idle,
    /// The event cap was reached (the run may be livelocked).
    EventCap,
    /// The caller's condition became true.
    Condition,
}

/// The simulated world.
pub struct Sim<N> {
    now: Instant,
    heap: BinaryHeap<Scheduled>,
    seq: u64,
    rng: ChaCha8Rng,
    nodes: Vec<NodeSlot<N>>,
    switches: Vec<Switch>,
    links: Vec<Link>,
    /// Transmit buffer lent to nodes: large enough for any frame.
    tx_buf: Vec<u8>,
    /// Buffers of frames that reached a node or were dropped, emptied for the next frames: a
    /// run moves millions of frames, and a buffer each from the allocator costs more than
    /// moving them.
    spare: Vec<Vec<u8>>,
    events: u64,
}

impl<N> core::fmt::Debug for Sim<N> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Sim")
            .field("now", &self.now)
            .field("nodes", &self.nodes.len())
            .field("switches", &self.switches.len())
            .field("pending", &self.heap.len())
            .finish_non_exhaustive()
    }
}

/// The largest frame a node may write (a jumbo frame and then some).
pub const MAX_FRAME: usize = 9216 + HEADER_LEN;

impl<N: Node> Sim<N> {
    /// An empty world at time zero whose random decisions follow `seed`.
    pub fn new(seed: u64) -> Self {
        Sim {
            now: Instant::ZERO,
            heap: BinaryHeap::new(),
            seq: 0,
            rng: ChaCha8Rng::seed_from_u64(seed),
            nodes: Vec::new(),
            switches: Vec::new(),
            links: Vec::new(),
            tx_buf: vec![0; MAX_FRAME],
            spare: Vec::new(),
            events: 0,
        }
    }

    /// The current logical time.
    pub fn now(&self) -> Instant {
        self.now
    }

    /// Events processed so far.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// Adds a node (not yet connected).
    pub fn add_node(&mut self, node: N) -> NodeId {
        self.nodes.push(NodeSlot { node, out_link: None, timer: None });
        let id = self.nodes.len() - 1;
        self.kick(id);
        NodeId(id)
    }

    /// Adds a switch with no ports yet.
    pub fn add_switch(&mut self, config: SwitchConfig) -> SwitchId {
        self.switches.push(Switch {
            config,
            out_links: Vec::new(),
            table: HashMap::new(),
            stats: SwitchStats::default(),
        });
        SwitchId(self.switches.len() - 1)
    }

    fn add_link(&mut self, config: LinkConfig, from_node: Option<usize>, to: End) -> usize {
        self.links.push(Link {
            config,
            from_node,
            to,
            queue: VecDeque::new(),
            queued_bytes: 0,
            on_line_bytes: 0,
            busy: false,
            stats: LinkStats::default(),
        });
        self.links.len() - 1
    }

    /// Connects two nodes back to back with one link each way (both with `config`).
    ///
    /// # Panics
    /// If either node is already connected (a node has one interface).
    pub fn connect_nodes(&mut self, a: NodeId, b: NodeId, config: LinkConfig) {
        assert!(self.nodes[a.0].out_link.is_none() && self.nodes[b.0].out_link.is_none(), "node has a link");
        let ab = self.add_link(config.clone(), Some(a.0), End::Node(b.0));
        let ba = self.add_link(config, Some(b.0), End::Node(a.0));
        self.nodes[a.0].out_link = Some(ab);
        self.nodes[b.0].out_link = Some(ba);
        self.kick(a.0);
        self.kick(b.0);
    }

    /// Connects a node to a new port of a switch, with `config` both ways. Returns the port.
    ///
    /// # Panics
    /// If the node is already connected.
    pub fn connect_to_switch(&mut self, node: NodeId, switch: SwitchId, config: LinkConfig) -> SwitchPort {
        assert!(self.nodes[node.0].out_link.is_none(), "node has a link");
        let port = self.switches[switch.0].out_links.len();
        let up = self.add_link(config.clone(), Some(node.0), End::Switch(switch.0, port));
        let down = self.add_link(config, None, End::Node(node.0));
        self.nodes[node.0].out_link = Some(up);
        let sw = &mut self.switches[switch.0];
        sw.out_links.push(down);
        sw.stats.ports.push(QueueStats::default());
        self.kick(node.0);
        SwitchPort(port)
    }

    /// Connects two switches with a link each way.
    pub fn connect_switches(
        &mut self,
        a: SwitchId,
        b: SwitchId,
        config: LinkConfig,
    ) -> (SwitchPort, SwitchPort) {
        let pa = self.switches[a.0].out_links.len();
        let pb = self.switches[b.0].out_links.len();
        let ab = self.add_link(config.clone(), None, End::Switch(b.0, pb));
        let ba = self.add_link(config, None, End::Switch(a.0, pa));
        self.switches[a.0].out_links.push(ab);
        self.switches[a.0].stats.ports.push(QueueStats::default());
        self.switches[b.0].out_links.push(ba);
        self.switches[b.0].stats.ports.push(QueueStats::default());
        (SwitchPort(pa), SwitchPort(pb))
    }

    /// Changes the link from a switch port toward what it connects to (say, to make only the
    /// switch's output lossy).
    pub fn set_downlink_config(&mut self, switch: SwitchId, port: SwitchPort, config: LinkConfig) {
        let link = self.switches[switch.0].out_links[port.0];
        self.links[link].config = config;
    }

    /// Adds a forwarding entry: frames for `mac` leave `switch` by `port`.
    pub fn add_route(&mut self, switch: SwitchId, mac: MacAddr, port: SwitchPort) {
        self.switches[switch.0].table.insert(mac, port.0);
    }

    /// The node.
    pub fn node(&self, id: NodeId) -> &N {
        &self.nodes[id.0].node
    }

    /// The node, mutably; call [`Sim::touch`] afterwards if the change may give it work.
    pub fn node_mut(&mut self, id: NodeId) -> &mut N {
        &mut self.nodes[id.0].node
    }

    /// Lets the engine notice that a node changed outside an event (new data to send, say).
    pub fn touch(&mut self, id: NodeId) {
        self.kick(id.0);
    }

    /// The nodes in the order they were added.
    pub fn nodes(&self) -> impl Iterator<Item = &N> {
        self.nodes.iter().map(|s| &s.node)
    }

    /// A switch's counters.
    pub fn switch_stats(&self, id: SwitchId) -> &SwitchStats {
        &self.switches[id.0].stats
    }

    /// Counters of the link from `node` toward its peer or switch.
    pub fn uplink_stats(&self, node: NodeId) -> Option<LinkStats> {
        self.nodes[node.0].out_link.map(|l| self.links[l].stats)
    }

    /// Counters of the link from a switch port toward what it connects to.
    pub fn downlink_stats(&self, switch: SwitchId, port: SwitchPort) -> LinkStats {
        self.links[self.switches[switch.0].out_links[port.0]].stats
    }

    fn schedule(&mut self, at: Instant, event: Event) {
        self.seq += 1;
        self.heap.push(Scheduled { at, seq: self.seq, event });
    }

    /// Runs until the deadline, no events are left, or `max_events` events were processed.
    pub fn run_until(&mut self, deadline: Instant, max_events: u64) -> Stop {
        self.run_while(deadline, max_events, |_| true)
    }

    /// Like [`Sim::run_until`], and also stops (with [`Stop::Condition`]) as soon as `go_on`
    /// returns false; it is checked after every event.
    pub fn run_while(
        &mut self,
        deadline: Instant,
        max_events: u64,
        mut go_on: impl FnMut(&Self) -> bool,
    ) -> Stop {
        let mut processed = 0u64;
        loop {
            if !go_on(self) {
                return Stop::Condition;
            }
            let Some(next) = self.heap.peek() else { return Stop::Idle };
            if next.at > deadline {
                self.now = self.now.max(deadline);
                return Stop::Deadline;
            }
            if processed == max_events {
                return Stop::EventCap;
            }
            let Some(Scheduled { at, event, .. }) = self.heap.pop() else { return Stop::Idle };
            self.now = at;
            processed += 1;
            self.events += 1;
            self.dispatch(event);
        }
    }

    fn dispatch(&mut self, event: Event) {
        match event {
            Event::Arrive { link, frame } => {
                // Random loss is decided when the frame comes off the line.
                let loss = self.links[link].config.loss;
                if loss > 0.0 && self.rng.random_bool(loss) {
                    self.links[link].stats.lost += 1;
                    self.recycle(frame);
                    return;
                }
                match self.links[link].to {
                    End::Node(n) => {
                        let now = self.now;
                        self.nodes[n].node.handle_frame(now, &frame);
                        self.recycle(frame);
                        self.kick(n);
                    }
                    End::Switch(s, port) => {
                        let latency = self.switches[s].config.latency;
                        if latency.is_zero() {
                            self.forward(s, port, frame);
                        } else {
                            self.schedule(
                                self.now + latency,
                                Event::Forward { switch: s, in_port: port, frame },
                            );
                        }
                    }
                }
            }
            Event::Forward { switch, in_port, frame } => self.forward(switch, in_port, frame),
            Event::LineFree { link } => {
                let l = &mut self.links[link];
                l.busy = false;
                l.queued_bytes -= core::mem::take(&mut l.on_line_bytes);
                if l.queue.is_empty() {
                    // A node's link: ask the node for its next frame.
                    if let Some(n) = self.links[link].from_node {
                        self.kick(n);
                    }
                } else {
                    self.start_line(link);
                }
            }
            Event::Timer { node } => {
                let slot = &mut self.nodes[node];
                if slot.timer != Some(self.now) {
                    // Superseded by an earlier timer that already ran.
                    return;
                }
                slot.timer = None;
                if slot.node.poll_timeout().is_some_and(|t| t <= self.now) {
                    slot.node.handle_timeout(self.now);
                }
                self.kick(node);
            }
        }
    }

    /// Starts transmitting the frame at the head of a switch-side queue.
    fn start_line(&mut self, link: usize) {
        let now = self.now;
        let l = &mut self.links[link];
        let Some(frame) = l.queue.pop_front() else { return };
        l.busy = true;
        l.on_line_bytes = frame.len();
        let ser = serialisation(frame.len() + l.config.overhead_bytes, l.config.rate_bps);
        l.stats.frames += 1;
        l.stats.bytes += frame.len() as u64;
        l.stats.busy_ns += ser.as_nanos() as u64;
        let arrive = now + ser + l.config.delay;
        self.schedule(now + ser, Event::LineFree { link });
        self.schedule(arrive, Event::Arrive { link, frame });
    }

    fn forward(&mut self, s: usize, in_port: usize, frame: Vec<u8>) {
        let sw = &mut self.switches[s];
        sw.stats.received += 1;
        if frame.len() < HEADER_LEN {
            sw.stats.malformed += 1;
            return;
        }
        let dst = MacAddr(frame[0..6].try_into().unwrap_or([0; 6]));
        let src = MacAddr(frame[6..12].try_into().unwrap_or([0; 6]));
        if sw.config.forwarding == Forwarding::Learning && !is_multicast(src) {
            sw.table.insert(src, in_port);
        }
        let outs: Vec<usize> = if is_multicast(dst) {
            (0..sw.out_links.len()).filter(|&p| p != in_port).collect()
        } else if let Some(&p) = sw.table.get(&dst) {
            // The common case, a known unicast destination, without a list.
            if p != in_port {
                self.enqueue(s, p, frame);
            }
            return;
        } else if sw.config.forwarding == Forwarding::Learning {
            (0..sw.out_links.len()).filter(|&p| p != in_port).collect()
        } else {
            sw.stats.unknown_destination += 1;
            vec![]
        };
        let n = outs.len();
        let mut frame = Some(frame);
        for (i, port) in outs.into_iter().enumerate() {
            let bytes =
                if i + 1 == n { frame.take().unwrap_or_default() } else { frame.clone().unwrap_or_default() };
            self.enqueue(s, port, bytes);
        }
    }

    fn enqueue(&mut self, s: usize, port: usize, frame: Vec<u8>) {
        let sw = &mut self.switches[s];
        let link = sw.out_links[port];
        let q = &mut sw.stats.ports[port];
        let l = &mut self.links[link];
        if l.queued_bytes + frame.len() > sw.config.buffer_bytes {
            q.dropped += 1;
            self.recycle(frame);
            return;
        }
        q.enqueued += 1;
        l.queued_bytes += frame.len();
        q.max_bytes = q.max_bytes.max(l.queued_bytes);
        l.queue.push_back(frame);
        if !l.busy {
            self.start_line(link);
        }
    }

    /// Keeps a frame's buffer for a later frame (a bounded number of them).
    fn recycle(&mut self, mut frame: Vec<u8>) {
        if self.spare.len() < 4096 {
            frame.clear();
            self.spare.push(frame);
        }
    }

    /// Gives a node the chance to transmit (if its line is free) and re-arms its timer.
    fn kick(&mut self, n: usize) {
        let now = self.now;
        if let Some(link) = self.nodes[n].out_link {
            if !self.links[link].busy {
                if let Some(len) = self.nodes[n].node.poll_transmit(now, &mut self.tx_buf) {
                    let len = len.min(self.tx_buf.len());
                    let mut frame = self.spare.pop().unwrap_or_default();
                    frame.extend_from_slice(&self.tx_buf[..len]);
                    let l = &mut self.links[link];
                    l.queued_bytes += len;
                    l.queue.push_back(frame);
                    self.start_line(link);
                }
            }
        }
        let line_busy = self.nodes[n].out_link.is_some_and(|l| self.links[l].busy);
        let slot = &mut self.nodes[n];
        if let Some(t) = slot.node.poll_timeout() {
            // A deadline already due after the timeout was handled means "I want to transmit"
            // (pacing allows the next frame): the line's LineFree event asks the node when the
            // line is busy; when it is free the node was just asked, so come back a nanosecond
            // later rather than spin at this instant.
            let t = match t {
                t if t > now => t,
                _ if line_busy => return,
                _ => now + Duration::from_nanos(1),
            };
            if slot.timer.is_none_or(|s| t < s) {
                slot.timer = Some(t);
                self.schedule(t, Event::Timer { node: n });
            }
        }
    }
}

/// Group (multicast and broadcast) addresses have the low bit of the first byte set.
fn is_multicast(mac: MacAddr) -> bool {
    mac.0[0] & 1 == 1
}

#[cfg(test)]
mod tests;
