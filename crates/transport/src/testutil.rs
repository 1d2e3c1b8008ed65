//! Transport layer, test support (feature `testing`): a deterministic harness of two transport
//! nodes joined by a simulated wire with seeded loss, reordering, duplication, corruption, ACK
//! loss and an optional bottleneck (rate and drop-tail buffer), driven on a logical clock that
//! jumps to the next event (as quinn's `tests/util.rs` `Pair`).
//!
//! Both modes are covered by the [`Node`] trait: an [`Endpoint`] (single thread) and a
//! [`SplitNode`] (sender and receiver halves that exchange [`Feedback`] through an
//! `std::sync::mpsc` queue, drained only when the sender side runs, as a TX thread would); an
//! [`InPlaceNode`] takes messages as the runtime's run-to-completion loop does, lent straight
//! from the frame where order allows.
//! Everything is reproducible from the seed; nothing here reads a clock.

use core::cmp::Ordering;
use core::time::Duration;
use std::collections::BinaryHeap;
use std::sync::mpsc;

use lanbus_wire::{Instant, MacAddr};

use crate::{Config, Counters, Endpoint, Event, Feedback, ReceiveHalf, SendError, SendHalf};

/// SplitMix64: a tiny seeded generator, enough for fault schedules.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x6a09_e667_f3bc_c909)
    }

    /// 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.next_f64() < p
    }

    /// Uniform in `[0, n)` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// A message whose bytes say which message it is: the index, then a pattern derived from it.
pub fn test_message(index: u64, len: usize) -> Vec<u8> {
    let idx = index.to_le_bytes();
    (0..len)
        .map(|i| idx.get(i).copied().unwrap_or((index as usize).wrapping_mul(31).wrapping_add(i * 7) as u8))
        .collect()
}

/// What a harness node must offer.
pub trait Node {
    /// The node's MAC.
    fn local_mac(&self) -> MacAddr;
    /// Queue a message.
    fn send(&mut self, now: Instant, peer: MacAddr, channel: u16, data: &[u8]) -> Result<(), SendError>;
    /// Take a frame.
    fn handle_frame(&mut self, now: Instant, frame: &[u8]);
    /// Fire timers.
    fn handle_timeout(&mut self, now: Instant);
    /// Write a frame.
    fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize>;
    /// Next timer.
    fn poll_timeout(&self) -> Option<Instant>;
    /// Move delivered messages into `out`.
    fn drain_messages(&mut self, out: &mut Vec<(MacAddr, u16, Vec<u8>)>);
    /// Move events into `out`.
    fn drain_events(&mut self, out: &mut Vec<Event>);
    /// Counters.
    fn counters(&self) -> Counters;
    /// Whether everything sent was acknowledged.
    fn is_idle(&self) -> bool;
    /// Frame buffer size.
    fn frame_capacity(&self) -> usize;
}

impl Node for Endpoint {
    fn local_mac(&self) -> MacAddr {
        Endpoint::local_mac(self)
    }
    fn send(&mut self, now: Instant, peer: MacAddr, channel: u16, data: &[u8]) -> Result<(), SendError> {
        Endpoint::send(self, now, peer, channel, data)
    }
    fn handle_frame(&mut self, now: Instant, frame: &[u8]) {
        Endpoint::handle_frame(self, now, frame)
    }
    fn handle_timeout(&mut self, now: Instant) {
        Endpoint::handle_timeout(self, now)
    }
    fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        Endpoint::poll_transmit(self, now, buf)
    }
    fn poll_timeout(&self) -> Option<Instant> {
        Endpoint::poll_timeout(self)
    }
    fn drain_messages(&mut self, out: &mut Vec<(MacAddr, u16, Vec<u8>)>) {
        while let Some(m) = self.poll_message() {
            out.push((m.peer, m.channel, m.data.to_vec()));
        }
    }
    fn drain_events(&mut self, out: &mut Vec<Event>) {
        while let Some(e) = self.poll_event() {
            out.push(e);
        }
    }
    fn counters(&self) -> Counters {
        Endpoint::counters(self)
    }
    fn is_idle(&self) -> bool {
        Endpoint::is_idle(self)
    }
    fn frame_capacity(&self) -> usize {
        self.config().frame_capacity()
    }
}

/// An [`Endpoint`] fed through [`Endpoint::handle_frame_delivering`], as the runtime's
/// run-to-completion loop feeds it. Messages lent in place are kept at once; queued ones are
/// taken only on every other [`Node::drain_messages`], so that frames often arrive while older
/// messages still wait and the endpoint must queue behind them (after a run, drain twice).
pub struct InPlaceNode {
    endpoint: Endpoint,
    lent: Vec<(MacAddr, u16, Vec<u8>)>,
    drains: u64,
    /// Messages that were lent in place (the rest went through the queue).
    pub lent_in_place: u64,
}

impl InPlaceNode {
    /// Wraps `endpoint`.
    pub fn new(endpoint: Endpoint) -> Self {
        InPlaceNode { endpoint, lent: Vec::new(), drains: 0, lent_in_place: 0 }
    }
}

impl Node for InPlaceNode {
    fn local_mac(&self) -> MacAddr {
        self.endpoint.local_mac()
    }
    fn send(&mut self, now: Instant, peer: MacAddr, channel: u16, data: &[u8]) -> Result<(), SendError> {
        self.endpoint.send(now, peer, channel, data)
    }
    fn handle_frame(&mut self, now: Instant, frame: &[u8]) {
        let (lent, count) = (&mut self.lent, &mut self.lent_in_place);
        self.endpoint.handle_frame_delivering(now, frame, &mut |m, _| {
            lent.push((m.peer, m.channel, m.data.to_vec()));
            *count += 1;
        });
    }
    fn handle_timeout(&mut self, now: Instant) {
        self.endpoint.handle_timeout(now)
    }
    fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        self.endpoint.poll_transmit(now, buf)
    }
    fn poll_timeout(&self) -> Option<Instant> {
        self.endpoint.poll_timeout()
    }
    fn drain_messages(&mut self, out: &mut Vec<(MacAddr, u16, Vec<u8>)>) {
        // Lent messages came while nothing was queued, so they precede whatever is queued now.
        out.append(&mut self.lent);
        self.drains += 1;
        if self.drains.is_multiple_of(2) {
            self.endpoint.drain_messages(out);
        }
    }
    fn drain_events(&mut self, out: &mut Vec<Event>) {
        self.endpoint.drain_events(out)
    }
    fn counters(&self) -> Counters {
        self.endpoint.counters()
    }
    fn is_idle(&self) -> bool {
        self.endpoint.is_idle()
    }
    fn frame_capacity(&self) -> usize {
        self.endpoint.config().frame_capacity()
    }
}

/// An [`Endpoint`] whose frames are written where they lie ([`Endpoint::poll_transmit_ref`]),
/// a burst of up to `burst` at a time as the runtime hands them to a port that borrows them, and
/// read only after the whole burst was written.
pub struct BorrowedNode {
    endpoint: Endpoint,
    burst: usize,
    ready: std::collections::VecDeque<Vec<u8>>,
}

impl BorrowedNode {
    /// Wraps `endpoint`, polling bursts of up to `burst` frames.
    pub fn new(endpoint: Endpoint, burst: usize) -> Self {
        BorrowedNode { endpoint, burst: burst.max(1), ready: std::collections::VecDeque::new() }
    }
}

impl Node for BorrowedNode {
    fn local_mac(&self) -> MacAddr {
        self.endpoint.local_mac()
    }
    fn send(&mut self, now: Instant, peer: MacAddr, channel: u16, data: &[u8]) -> Result<(), SendError> {
        self.endpoint.send(now, peer, channel, data)
    }
    fn handle_frame(&mut self, now: Instant, frame: &[u8]) {
        self.endpoint.handle_frame(now, frame)
    }
    fn handle_timeout(&mut self, now: Instant) {
        self.endpoint.handle_timeout(now)
    }
    fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        if self.ready.is_empty() {
            let mut refs = Vec::new();
            while refs.len() < self.burst {
                let Some(at) = self.endpoint.poll_transmit_ref(now) else { break };
                refs.push(at);
            }
            self.ready.extend(refs.iter().map(|&at| self.endpoint.frame(at).concat()));
            if !refs.is_empty() {
                self.endpoint.frames_left(now);
            }
        }
        let frame = self.ready.pop_front()?;
        buf[..frame.len()].copy_from_slice(&frame);
        Some(frame.len())
    }
    fn poll_timeout(&self) -> Option<Instant> {
        self.endpoint.poll_timeout()
    }
    fn drain_messages(&mut self, out: &mut Vec<(MacAddr, u16, Vec<u8>)>) {
        self.endpoint.drain_messages(out)
    }
    fn drain_events(&mut self, out: &mut Vec<Event>) {
        self.endpoint.drain_events(out)
    }
    fn counters(&self) -> Counters {
        self.endpoint.counters()
    }
    fn is_idle(&self) -> bool {
        self.endpoint.is_idle() && self.ready.is_empty()
    }
    fn frame_capacity(&self) -> usize {
        self.endpoint.config().frame_capacity()
    }
}

/// An endpoint split into halves that talk through an mpsc queue.
pub struct SplitNode {
    tx: SendHalf,
    rx: ReceiveHalf,
    to_tx: mpsc::Sender<Feedback>,
    from_rx: mpsc::Receiver<Feedback>,
    mac: MacAddr,
    capacity: usize,
}

impl SplitNode {
    /// Splits `endpoint`.
    pub fn new(endpoint: Endpoint) -> Self {
        let mac = endpoint.local_mac();
        let capacity = endpoint.config().frame_capacity();
        let (tx, rx) = endpoint.split();
        let (to_tx, from_rx) = mpsc::channel();
        SplitNode { tx, rx, to_tx, from_rx, mac, capacity }
    }

    /// Receiver side: move feedback into the queue.
    fn push_feedback(&mut self) {
        while let Some(f) = self.rx.poll_feedback() {
            self.to_tx.send(f).expect("the receiving end lives in self");
        }
    }

    /// Sender side: apply queued feedback.
    fn pull_feedback(&mut self, now: Instant) {
        while let Ok(f) = self.from_rx.try_recv() {
            self.tx.handle_feedback(now, f);
        }
    }
}

impl Node for SplitNode {
    fn local_mac(&self) -> MacAddr {
        self.mac
    }
    fn send(&mut self, now: Instant, peer: MacAddr, channel: u16, data: &[u8]) -> Result<(), SendError> {
        self.tx.send(now, peer, channel, data)
    }
    fn handle_frame(&mut self, now: Instant, frame: &[u8]) {
        self.rx.handle_frame(now, frame);
        self.push_feedback();
    }
    fn handle_timeout(&mut self, now: Instant) {
        self.rx.handle_timeout(now);
        self.push_feedback();
        self.pull_feedback(now);
        self.tx.handle_timeout(now);
    }
    fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        self.pull_feedback(now);
        self.tx.poll_transmit(now, buf)
    }
    fn poll_timeout(&self) -> Option<Instant> {
        match (self.tx.poll_timeout(), self.rx.poll_timeout()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
    fn drain_messages(&mut self, out: &mut Vec<(MacAddr, u16, Vec<u8>)>) {
        while let Some(m) = self.rx.poll_message() {
            out.push((m.peer, m.channel, m.data.to_vec()));
        }
    }
    fn drain_events(&mut self, out: &mut Vec<Event>) {
        while let Some(e) = self.rx.poll_event() {
            out.push(e);
        }
    }
    fn counters(&self) -> Counters {
        let mut c = self.tx.counters();
        c.merge(&self.rx.counters());
        c
    }
    fn is_idle(&self) -> bool {
        self.tx.is_idle()
    }
    fn frame_capacity(&self) -> usize {
        self.capacity
    }
}

/// Fault probabilities of the simulated wire, per frame.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Faults {
    /// Frame lost.
    pub loss: f64,
    /// Frame delayed by up to `reorder_delay` more (so later frames overtake it).
    pub reorder: f64,
    /// Frame delivered twice.
    pub duplicate: f64,
    /// One random bit of the frame flipped.
    pub corrupt: f64,
    /// ACK frames additionally lost.
    pub ack_loss: f64,
}

/// Which way a frame travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Dir {
    /// From `a` to `b`.
    AtoB,
    /// From `b` to `a`.
    BtoA,
}

struct InFlight {
    at: Instant,
    id: u64,
    dir: Dir,
    bytes: Vec<u8>,
}

impl PartialEq for InFlight {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.id) == (o.at, o.id)
    }
}
impl Eq for InFlight {}
impl PartialOrd for InFlight {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for InFlight {
    fn cmp(&self, o: &Self) -> Ordering {
        // Reversed: BinaryHeap is a max-heap, we want the earliest first.
        (o.at, o.id).cmp(&(self.at, self.id))
    }
}

/// What the wire did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WireStats {
    /// Frames put on the wire.
    pub frames: u64,
    /// Frames lost (random loss, ACK loss, filter).
    pub lost: u64,
    /// Frames delayed for reordering.
    pub reordered: u64,
    /// Frames duplicated.
    pub duplicated: u64,
    /// Frames corrupted.
    pub corrupted: u64,
    /// Frames dropped because the bottleneck's buffer was full.
    pub queue_drops: u64,
    /// Largest queueing delay a frame met at the bottleneck.
    pub max_queue_delay: Duration,
}

/// A rate-limited link with a drop-tail buffer in each direction (an output-queued switch port).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bottleneck {
    /// Link rate, bits per second.
    pub rate_bps: u64,
    /// Bytes the buffer holds; a frame that does not fit is dropped.
    pub buffer_bytes: u64,
}

/// Decides per frame whether the wire drops it (`false` = drop), for targeted tests.
pub type Filter = Box<dyn FnMut(Dir, &[u8]) -> bool>;

/// Two nodes and the wire between them.
pub struct Pair<A: Node, B: Node> {
    /// Node `a`.
    pub a: A,
    /// Node `b`.
    pub b: B,
    /// The logical clock.
    pub now: Instant,
    /// One-way delay of every frame.
    pub delay: Duration,
    /// Extra delay of a reordered frame (uniform up to this).
    pub reorder_delay: Duration,
    /// Random faults.
    pub faults: Faults,
    /// Optional per-frame drop decision.
    pub filter: Option<Filter>,
    /// Optional rate limit and finite buffer in each direction.
    pub bottleneck: Option<Bottleneck>,
    link_free: [Instant; 2],
    /// Messages `a` received.
    pub at_a: Vec<(MacAddr, u16, Vec<u8>)>,
    /// Messages `b` received.
    pub at_b: Vec<(MacAddr, u16, Vec<u8>)>,
    /// Events at `a`.
    pub events_a: Vec<Event>,
    /// Events at `b`.
    pub events_b: Vec<Event>,
    /// What the wire did.
    pub wire: WireStats,
    rng: Rng,
    heap: BinaryHeap<InFlight>,
    next_id: u64,
    buf: Vec<u8>,
}

impl<N: Node> Pair<N, N> {
    /// Two endpoints `MacAddr::local(1)` and `local(2)` with the same config, each made a node by
    /// `node`.
    fn of(config: Config, faults: Faults, seed: u64, node: impl Fn(Endpoint) -> N) -> Self {
        let now = Instant::ZERO;
        let a = node(Endpoint::new(config.clone(), MacAddr::local(1), now));
        let b = node(Endpoint::new(config, MacAddr::local(2), now));
        Pair::new(a, b, faults, seed)
    }
}

impl Pair<Endpoint, Endpoint> {
    /// Two single-threaded endpoints `MacAddr::local(1)` and `local(2)` with the same config.
    pub fn endpoints(config: Config, faults: Faults, seed: u64) -> Self {
        Pair::of(config, faults, seed, |e| e)
    }
}

impl Pair<SplitNode, SplitNode> {
    /// Two split endpoints `MacAddr::local(1)` and `local(2)` with the same config.
    pub fn split(config: Config, faults: Faults, seed: u64) -> Self {
        Pair::of(config, faults, seed, SplitNode::new)
    }
}

impl Pair<InPlaceNode, InPlaceNode> {
    /// Two endpoints `MacAddr::local(1)` and `local(2)` fed as the run-to-completion loop feeds
    /// them, with the same config.
    pub fn in_place(config: Config, faults: Faults, seed: u64) -> Self {
        Pair::of(config, faults, seed, InPlaceNode::new)
    }
}

impl Pair<BorrowedNode, BorrowedNode> {
    /// Two endpoints `MacAddr::local(1)` and `local(2)` whose frames are written where they lie,
    /// `burst` at a time, with the same config.
    pub fn borrowed(config: Config, faults: Faults, seed: u64, burst: usize) -> Self {
        Pair::of(config, faults, seed, |e| BorrowedNode::new(e, burst))
    }
}

impl<A: Node, B: Node> Pair<A, B> {
    /// Joins two nodes; the wire's one-way delay is 5 µs, reordered frames up to 20 µs more.
    pub fn new(a: A, b: B, faults: Faults, seed: u64) -> Self {
        let cap = a.frame_capacity().max(b.frame_capacity());
        Pair {
            a,
            b,
            now: Instant::ZERO,
            delay: Duration::from_micros(5),
            reorder_delay: Duration::from_micros(20),
            faults,
            filter: None,
            bottleneck: None,
            link_free: [Instant::ZERO; 2],
            at_a: Vec::new(),
            at_b: Vec::new(),
            events_a: Vec::new(),
            events_b: Vec::new(),
            wire: WireStats::default(),
            rng: Rng::new(seed),
            heap: BinaryHeap::new(),
            next_id: 0,
            buf: vec![0; cap],
        }
    }

    fn put(&mut self, dir: Dir, len: usize) {
        self.wire.frames += 1;
        let mut bytes = self.buf[..len].to_vec();
        if let Some(f) = &mut self.filter {
            if !f(dir, &bytes) {
                self.wire.lost += 1;
                return;
            }
        }
        let is_ack = bytes.get(15) == Some(&2);
        let f = self.faults;
        if self.rng.chance(f.loss) || (is_ack && self.rng.chance(f.ack_loss)) {
            self.wire.lost += 1;
            return;
        }
        let mut at = self.now + self.delay;
        if let Some(bn) = self.bottleneck {
            let lane = dir as usize;
            let start = self.link_free[lane].max(self.now);
            let queued_ns = (start - self.now).as_nanos() as u64;
            let backlog_bytes = queued_ns.saturating_mul(bn.rate_bps) / 8_000_000_000;
            if backlog_bytes + bytes.len() as u64 > bn.buffer_bytes {
                self.wire.queue_drops += 1;
                return;
            }
            self.wire.max_queue_delay = self.wire.max_queue_delay.max(start - self.now);
            let tx = Duration::from_nanos(bytes.len() as u64 * 8_000_000_000 / bn.rate_bps.max(1));
            self.link_free[lane] = start + tx;
            at = start + tx + self.delay;
        }
        if self.rng.chance(f.reorder) {
            self.wire.reordered += 1;
            at += Duration::from_nanos(1 + self.rng.below(self.reorder_delay.as_nanos() as u64));
        }
        if self.rng.chance(f.corrupt) && !bytes.is_empty() {
            self.wire.corrupted += 1;
            let bit = self.rng.below(bytes.len() as u64 * 8) as usize;
            bytes[bit / 8] ^= 1 << (bit % 8);
        }
        if self.rng.chance(f.duplicate) {
            self.wire.duplicated += 1;
            let id = self.next_id;
            self.next_id += 1;
            self.heap.push(InFlight { at: at + Duration::from_nanos(100), id, dir, bytes: bytes.clone() });
        }
        let id = self.next_id;
        self.next_id += 1;
        self.heap.push(InFlight { at, id, dir, bytes });
    }

    fn transmit_all(&mut self) -> bool {
        let mut any = false;
        let now = self.now;
        while let Some(n) = self.a.poll_transmit(now, &mut self.buf) {
            self.put(Dir::AtoB, n);
            any = true;
        }
        while let Some(n) = self.b.poll_transmit(now, &mut self.buf) {
            self.put(Dir::BtoA, n);
            any = true;
        }
        any
    }

    /// Frames on the wire.
    pub fn in_flight(&self) -> usize {
        self.heap.len()
    }

    /// One round at the current time (timers, transmissions, arrivals); if nothing happened the
    /// clock jumps to the next event. Returns false when there is no event left at all.
    pub fn step(&mut self) -> bool {
        let now = self.now;
        let mut did = false;
        if self.a.poll_timeout().is_some_and(|t| t <= now) {
            self.a.handle_timeout(now);
            did = true;
        }
        if self.b.poll_timeout().is_some_and(|t| t <= now) {
            self.b.handle_timeout(now);
            did = true;
        }
        did |= self.transmit_all();
        while self.heap.peek().is_some_and(|f| f.at <= now) {
            let f = self.heap.pop().expect("peeked");
            match f.dir {
                Dir::AtoB => {
                    self.b.handle_frame(now, &f.bytes);
                    self.b.drain_messages(&mut self.at_b);
                    self.b.drain_events(&mut self.events_b);
                }
                Dir::BtoA => {
                    self.a.handle_frame(now, &f.bytes);
                    self.a.drain_messages(&mut self.at_a);
                    self.a.drain_events(&mut self.events_a);
                }
            }
            did = true;
        }
        self.a.drain_events(&mut self.events_a);
        self.b.drain_events(&mut self.events_b);
        if did {
            return true;
        }
        let next = [self.heap.peek().map(|f| f.at), self.a.poll_timeout(), self.b.poll_timeout()]
            .into_iter()
            .flatten()
            .min();
        match next {
            // A timer that stays due without doing anything would spin: nudge the clock.
            Some(t) => self.now = t.max(now + Duration::from_nanos(1)),
            None => return false,
        }
        true
    }

    /// Steps until `done(self)` holds, the clock passes `deadline`, or no event is left. Returns
    /// whether `done` held.
    pub fn run_until(&mut self, deadline: Instant, mut done: impl FnMut(&Self) -> bool) -> bool {
        loop {
            if done(self) {
                return true;
            }
            if self.now > deadline || !self.step() {
                return done(self);
            }
        }
    }

    /// Steps until both nodes are idle and the wire is empty, or `deadline`.
    pub fn run_until_idle(&mut self, deadline: Instant) -> bool {
        self.run_until(deadline, |p| p.a.is_idle() && p.b.is_idle() && p.heap.is_empty())
    }

    /// Sends `count` messages of `len(i)` bytes from `a` to `b` on `channel`, feeding them as the
    /// send queue allows, until all are acknowledged or `deadline`. Returns whether all went.
    pub fn transfer(
        &mut self,
        count: u64,
        channel: u16,
        deadline: Instant,
        len: impl Fn(u64) -> usize,
    ) -> bool {
        let peer = self.b.local_mac();
        let mut i = 0;
        loop {
            while i < count {
                let m = test_message(i, len(i));
                match self.a.send(self.now, peer, channel, &m) {
                    Ok(()) => i += 1,
                    Err(SendError::QueueFull) => break,
                    Err(e) => panic!("send failed: {e}"),
                }
            }
            if i == count {
                return self.run_until_idle(deadline);
            }
            if self.now > deadline || !self.step() {
                return false;
            }
        }
    }
}
