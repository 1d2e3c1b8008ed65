//! Hosts that run the real lanbus transport in the simulator, with an application on top.
//!
//! Layer: simulation. [`Endpoint`] itself implements [`Node`] (it is sans-IO with exactly the
//! four calls the engine makes), so a bare endpoint can be dropped into a [`crate::Sim`]. A
//! [`Host`] adds an [`App`]: the traffic source or sink that calls `send` and drains
//! `poll_message`. The app is woken after every frame, every timeout and before every transmit
//! opportunity, so a message refused with `QueueFull` is retried as soon as ACKs free the queue.
//!
//! The apps here carry their own bookkeeping inside the message bytes (send time, index, burst
//! id), so the receiving side measures latency and verifies content without any side channel.

use std::collections::{HashMap, VecDeque};

use lanbus_transport::{Endpoint, SendError};
use lanbus_wire::{Instant, MacAddr};

use crate::stats::Samples;
use crate::traffic::Arrival;
use crate::Node;

impl Node for Endpoint {
    fn handle_frame(&mut self, now: Instant, frame: &[u8]) {
        Endpoint::handle_frame(self, now, frame);
    }
    fn handle_timeout(&mut self, now: Instant) {
        Endpoint::handle_timeout(self, now);
    }
    fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        Endpoint::poll_transmit(self, now, buf)
    }
    fn poll_timeout(&mut self) -> Option<Instant> {
        Endpoint::poll_timeout(self)
    }
}

/// The application on a simulated host.
pub trait App {
    /// Offers due messages to the endpoint and drains what it delivered. Called after every
    /// frame, on every timeout and before every transmit opportunity.
    fn run(&mut self, now: Instant, endpoint: &mut Endpoint);
    /// When the app next has something to do on its own (its next arrival), if ever.
    fn next_wakeup(&self) -> Option<Instant>;
}

/// A transport endpoint with an application.
pub struct Host<A> {
    /// The transport.
    pub endpoint: Endpoint,
    /// The application.
    pub app: A,
}

impl<A> core::fmt::Debug for Host<A> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Host").field("mac", &self.endpoint.local_mac()).finish_non_exhaustive()
    }
}

impl<A: App> Host<A> {
    /// A host running `app` over `endpoint`.
    pub fn new(endpoint: Endpoint, app: A) -> Self {
        Host { endpoint, app }
    }
}

impl<A: App> Node for Host<A> {
    fn handle_frame(&mut self, now: Instant, frame: &[u8]) {
        self.endpoint.handle_frame(now, frame);
        self.app.run(now, &mut self.endpoint);
    }
    fn handle_timeout(&mut self, now: Instant) {
        if self.endpoint.poll_timeout().is_some_and(|t| t <= now) {
            self.endpoint.handle_timeout(now);
        }
        self.app.run(now, &mut self.endpoint);
    }
    fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        self.app.run(now, &mut self.endpoint);
        self.endpoint.poll_transmit(now, buf)
    }
    fn poll_timeout(&mut self) -> Option<Instant> {
        match (self.endpoint.poll_timeout(), self.app.next_wakeup()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// Bytes at the start of every [`StreamSource`] message: send time (ns) and index, big-endian.
pub const STREAM_HEADER_LEN: usize = 16;

/// The byte at position `j` of stream message `index` (after the header): a function of both,
/// so a misplaced, stale or corrupted message is recognised.
pub fn stream_byte(index: u64, j: usize) -> u8 {
    (index.wrapping_mul(0x9E37_79B9).wrapping_add(j as u64 * 31) >> 3) as u8
}

/// Sends messages to one peer as its arrivals say; each message carries its offer time and index.
/// Messages wait in order in the app while the transport's queue is full (the wait counts in their
/// latency, as a PCIe TLP waits in the bridge).
pub struct StreamSource<I> {
    peer: MacAddr,
    channel: u16,
    arrivals: I,
    /// The next arrival, taken from `arrivals` ahead of time so its instant is known.
    next: Option<Arrival>,
    waiting: VecDeque<(Arrival, u64)>,
    next_index: u64,
    buf: Vec<u8>,
    /// Messages the transport accepted.
    pub accepted: u64,
}

impl<I: Iterator<Item = Arrival>> StreamSource<I> {
    /// A source of `arrivals` toward `peer` on `channel`.
    pub fn new(peer: MacAddr, channel: u16, mut arrivals: I) -> Self {
        StreamSource {
            peer,
            channel,
            next: arrivals.next(),
            arrivals,
            waiting: VecDeque::new(),
            next_index: 0,
            buf: Vec::new(),
            accepted: 0,
        }
    }

    /// Whether every arrival has been offered and accepted.
    pub fn done(&self) -> bool {
        self.waiting.is_empty() && self.next.is_none()
    }
}

impl<I: Iterator<Item = Arrival>> App for StreamSource<I> {
    fn run(&mut self, now: Instant, endpoint: &mut Endpoint) {
        while let Some(a) = self.next.filter(|a| a.at <= now) {
            self.waiting.push_back((a, self.next_index));
            self.next_index += 1;
            self.next = self.arrivals.next();
        }
        while let Some(&(a, index)) = self.waiting.front() {
            let len = a.bytes.max(STREAM_HEADER_LEN);
            self.buf.clear();
            self.buf.extend_from_slice(&a.at.as_nanos().to_be_bytes());
            self.buf.extend_from_slice(&index.to_be_bytes());
            self.buf.extend((STREAM_HEADER_LEN..len).map(|j| stream_byte(index, j)));
            match endpoint.send(now, self.peer, self.channel, &self.buf) {
                Ok(()) => {
                    self.accepted += 1;
                    self.waiting.pop_front();
                }
                Err(SendError::QueueFull) => break,
                Err(e) => panic!("stream source misconfigured: {e}"),
            }
        }
    }
    fn next_wakeup(&self) -> Option<Instant> {
        self.next.map(|a| a.at)
    }
}

/// Receives [`StreamSource`] messages, checks them and records their latency.
#[derive(Debug, Default)]
pub struct StreamSink {
    /// One-way latency of every message (offer to delivery), in µs.
    pub latency_us: Samples,
    /// Messages delivered.
    pub delivered: u64,
    /// Bytes delivered.
    pub bytes: u64,
    /// Messages whose index was not the next expected one (lost, duplicated or reordered).
    pub out_of_order: u64,
    /// Messages whose bytes were wrong.
    pub corrupted: u64,
    /// Time of the last delivery.
    pub last_delivery: Option<Instant>,
    next_index: u64,
}

impl App for StreamSink {
    fn run(&mut self, now: Instant, endpoint: &mut Endpoint) {
        while let Some(m) = endpoint.poll_message() {
            let data = m.data;
            self.delivered += 1;
            self.bytes += data.len() as u64;
            self.last_delivery = Some(now);
            if data.len() < STREAM_HEADER_LEN {
                self.corrupted += 1;
                continue;
            }
            let sent = u64::from_be_bytes(data[0..8].try_into().unwrap_or_default());
            let index = u64::from_be_bytes(data[8..16].try_into().unwrap_or_default());
            if data[STREAM_HEADER_LEN..]
                .iter()
                .enumerate()
                .any(|(j, &b)| b != stream_byte(index, j + STREAM_HEADER_LEN))
            {
                self.corrupted += 1;
                continue;
            }
            if index != self.next_index {
                self.out_of_order += 1;
            }
            self.next_index = index + 1;
            self.latency_us.push(now.as_nanos().saturating_sub(sent) as f64 / 1_000.0);
        }
    }
    fn next_wakeup(&self) -> Option<Instant> {
        None
    }
}

/// Bytes of a burst header: burst number, burst offer time (ns), offset of the message in the
/// burst, burst length; big-endian.
pub const BURST_HEADER_LEN: usize = 24;

/// Where a burst's header travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BurstHeader {
    /// In front of every message, beside `chunk_bytes - BURST_HEADER_LEN` bytes of the burst:
    /// each message says where it belongs (the 64 KiB messages of jumbo framing).
    #[default]
    EveryMessage,
    /// Only at the start of the burst's first message, counted among the burst's bytes; the
    /// other messages are pure burst data, so a burst is exactly `ceil(bytes / chunk_bytes)`
    /// messages (the paper's 128-byte TLPs). The sink finds the boundaries by counting bytes,
    /// which the transport's in-order delivery per peer makes exact.
    FirstMessage,
}

/// Sends bursts (one arrival = one burst of `bytes`) to one peer, cut into messages of at most
/// `chunk_bytes`; bursts are sent one after another in arrival order.
pub struct BurstSource<I> {
    peer: MacAddr,
    channel: u16,
    chunk_bytes: usize,
    header: BurstHeader,
    arrivals: I,
    next: Option<Arrival>,
    /// Bursts offered and not fully accepted: (number, arrival, bytes accepted so far).
    waiting: VecDeque<(u64, Arrival, usize)>,
    next_burst: u64,
    buf: Vec<u8>,
    /// Bursts fully handed to the transport.
    pub bursts_accepted: u64,
}

impl<I: Iterator<Item = Arrival>> BurstSource<I> {
    /// A source of bursts toward `peer` on `channel`, in messages of `chunk_bytes` (at least
    /// [`BURST_HEADER_LEN`] + 1, at most the transport's 64 KiB), a header in every message.
    pub fn new(peer: MacAddr, channel: u16, chunk_bytes: usize, mut arrivals: I) -> Self {
        BurstSource {
            peer,
            channel,
            chunk_bytes: chunk_bytes.max(BURST_HEADER_LEN + 1),
            header: BurstHeader::EveryMessage,
            next: arrivals.next(),
            arrivals,
            waiting: VecDeque::new(),
            next_burst: 0,
            buf: Vec::new(),
            bursts_accepted: 0,
        }
    }

    /// The same source with its headers where `header` says (the sink must be told the same).
    pub fn with_header(mut self, header: BurstHeader) -> Self {
        self.header = header;
        self
    }

    /// Writes the next message of burst `number` (offered as `a`, `done` bytes sent) into `buf`
    /// and returns how many of the burst's bytes it carries.
    fn fill(&mut self, number: u64, a: Arrival, done: usize) -> usize {
        let header = |buf: &mut Vec<u8>, total: usize| {
            buf.extend_from_slice(&number.to_be_bytes());
            buf.extend_from_slice(&a.at.as_nanos().to_be_bytes());
            buf.extend_from_slice(&(done as u32).to_be_bytes());
            buf.extend_from_slice(&(total as u32).to_be_bytes());
        };
        self.buf.clear();
        match self.header {
            BurstHeader::EveryMessage => {
                let take = (a.bytes - done).min(self.chunk_bytes - BURST_HEADER_LEN);
                header(&mut self.buf, a.bytes);
                self.buf.resize(BURST_HEADER_LEN + take, 0);
                take
            }
            BurstHeader::FirstMessage => {
                // A burst is at least its header long.
                let total = a.bytes.max(BURST_HEADER_LEN);
                let take = (total - done).min(self.chunk_bytes);
                if done == 0 {
                    header(&mut self.buf, total);
                }
                self.buf.resize(take, 0);
                take
            }
        }
    }
}

impl<I: Iterator<Item = Arrival>> App for BurstSource<I> {
    fn run(&mut self, now: Instant, endpoint: &mut Endpoint) {
        while let Some(a) = self.next.filter(|a| a.at <= now) {
            self.waiting.push_back((self.next_burst, a, 0));
            self.next_burst += 1;
            self.next = self.arrivals.next();
        }
        while let Some(&(number, a, done)) = self.waiting.front() {
            let take = self.fill(number, a, done);
            match endpoint.send(now, self.peer, self.channel, &self.buf) {
                Ok(()) => {
                    let total = match self.header {
                        BurstHeader::EveryMessage => a.bytes,
                        BurstHeader::FirstMessage => a.bytes.max(BURST_HEADER_LEN),
                    };
                    if done + take == total {
                        self.waiting.pop_front();
                        self.bursts_accepted += 1;
                    } else if let Some(front) = self.waiting.front_mut() {
                        front.2 = done + take;
                    }
                }
                Err(SendError::QueueFull) => break,
                Err(e) => panic!("burst source misconfigured: {e}"),
            }
        }
    }
    fn next_wakeup(&self) -> Option<Instant> {
        self.next.map(|a| a.at)
    }
}

/// A burst that reached the sink whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BurstDone {
    /// The sending host.
    pub peer: MacAddr,
    /// When the burst was offered at the source.
    pub offered: Instant,
    /// When its last byte was delivered here.
    pub completed: Instant,
    /// Its length in bytes.
    pub bytes: usize,
}

/// Receives [`BurstSource`] messages from any number of peers and records each completed burst.
#[derive(Debug, Default)]
pub struct BurstSink {
    /// Completed bursts in completion order.
    pub done: Vec<BurstDone>,
    /// Messages that do not fit the burst format: too short for a header, or longer than what is
    /// left of their burst. With headers on first messages only, the peer's burst in progress is
    /// abandoned and the next message taken as a new burst's first.
    pub malformed: u64,
    header: BurstHeader,
    /// With headers on first messages only: per peer, the burst under way (offer time, length,
    /// bytes still to come).
    partial: HashMap<MacAddr, (Instant, usize, usize)>,
}

impl BurstSink {
    /// A sink for sources whose headers are where `header` says.
    pub fn new(header: BurstHeader) -> Self {
        BurstSink { header, ..BurstSink::default() }
    }

    /// Takes one message from `peer` delivered at `now`.
    pub fn handle_message(&mut self, now: Instant, peer: MacAddr, d: &[u8]) {
        let parse = |d: &[u8]| {
            let offered = u64::from_be_bytes(d[8..16].try_into().unwrap_or_default());
            let offset = u32::from_be_bytes(d[16..20].try_into().unwrap_or_default()) as usize;
            let total = u32::from_be_bytes(d[20..24].try_into().unwrap_or_default()) as usize;
            (Instant::from_nanos(offered), offset, total)
        };
        let (offered, total, left) = match (self.header, self.partial.remove(&peer)) {
            (BurstHeader::EveryMessage, _) | (BurstHeader::FirstMessage, None) => {
                if d.len() < BURST_HEADER_LEN {
                    self.malformed += 1;
                    return;
                }
                let (offered, offset, total) = parse(d);
                let carried = match self.header {
                    BurstHeader::EveryMessage => offset + (d.len() - BURST_HEADER_LEN),
                    BurstHeader::FirstMessage => d.len(),
                };
                if carried > total || (self.header == BurstHeader::FirstMessage && offset != 0) {
                    self.malformed += 1;
                    return;
                }
                (offered, total, total - carried)
            }
            (BurstHeader::FirstMessage, Some((offered, total, left))) => {
                if d.len() > left {
                    self.malformed += 1;
                    return;
                }
                (offered, total, left - d.len())
            }
        };
        if left == 0 {
            self.done.push(BurstDone { peer, offered, completed: now, bytes: total });
        } else if self.header == BurstHeader::FirstMessage {
            self.partial.insert(peer, (offered, total, left));
        }
    }
}

impl App for BurstSink {
    fn run(&mut self, now: Instant, endpoint: &mut Endpoint) {
        while let Some(m) = endpoint.poll_message() {
            self.handle_message(now, m.peer, m.data);
        }
    }
    fn next_wakeup(&self) -> Option<Instant> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LinkConfig, Sim, Stop, SwitchConfig};
    use lanbus_transport::Config;

    #[test]
    fn bare_endpoints_run_in_the_engine() {
        let (a_mac, b_mac) = (MacAddr([2, 0, 0, 0, 0, 1]), MacAddr([2, 0, 0, 0, 0, 2]));
        let mut sim: Sim<Endpoint> = Sim::new(4);
        let sw = sim.add_switch(SwitchConfig::default());
        let a = sim.add_node(Endpoint::new(Config::point_to_point(), a_mac, Instant::ZERO));
        let b = sim.add_node(Endpoint::new(Config::point_to_point(), b_mac, Instant::ZERO));
        let lossy = LinkConfig { loss: 0.02, ..LinkConfig::default() };
        sim.connect_to_switch(a, sw, lossy.clone());
        sim.connect_to_switch(b, sw, lossy);
        let mut got = Vec::new();
        for round in 0..50u32 {
            for k in 0..20u32 {
                let msg = (round * 20 + k).to_be_bytes();
                let now = sim.now();
                sim.node_mut(a).send(now, b_mac, 3, &msg).unwrap();
            }
            sim.touch(a);
            let until = sim.now() + core::time::Duration::from_micros(200);
            assert_ne!(sim.run_until(until, 1_000_000), Stop::EventCap);
            while let Some(m) = sim.node_mut(b).poll_message() {
                assert_eq!((m.peer, m.channel), (a_mac, 3));
                got.push(u32::from_be_bytes(m.data.try_into().unwrap()));
            }
        }
        sim.run_until(sim.now() + core::time::Duration::from_millis(50), 1_000_000);
        while let Some(m) = sim.node_mut(b).poll_message() {
            got.push(u32::from_be_bytes(m.data.try_into().unwrap()));
        }
        assert_eq!(got, (0..1000).collect::<Vec<u32>>());
        assert!(sim.node(a).counters().retransmitted_frames > 0, "the links lost frames");
        assert!(sim.node(a).is_idle());
    }

    fn header(number: u64, offered_ns: u64, offset: u32, total: u32) -> Vec<u8> {
        let mut h = Vec::new();
        h.extend_from_slice(&number.to_be_bytes());
        h.extend_from_slice(&offered_ns.to_be_bytes());
        h.extend_from_slice(&offset.to_be_bytes());
        h.extend_from_slice(&total.to_be_bytes());
        h
    }

    #[test]
    fn a_sink_finds_bursts_with_a_header_in_every_message() {
        let peer = MacAddr([2, 0, 0, 0, 0, 1]);
        let mut sink = BurstSink::new(BurstHeader::EveryMessage);
        let mut first = header(0, 500, 0, 100);
        first.resize(BURST_HEADER_LEN + 60, 0);
        let mut last = header(0, 500, 60, 100);
        last.resize(BURST_HEADER_LEN + 40, 0);
        sink.handle_message(Instant::from_nanos(1_000), peer, &first);
        assert!(sink.done.is_empty());
        sink.handle_message(Instant::from_nanos(2_000), peer, &last);
        let done = BurstDone {
            peer,
            offered: Instant::from_nanos(500),
            completed: Instant::from_nanos(2_000),
            bytes: 100,
        };
        assert_eq!(sink.done, [done]);
        // Too short for a header, or carrying past the burst's end: counted, not recorded.
        sink.handle_message(Instant::from_nanos(3_000), peer, &[0; 10]);
        let mut over = header(1, 500, 90, 100);
        over.resize(BURST_HEADER_LEN + 20, 0);
        sink.handle_message(Instant::from_nanos(3_000), peer, &over);
        assert_eq!((sink.done.len(), sink.malformed), (1, 2));
    }

    #[test]
    fn a_sink_counts_the_bytes_of_bursts_with_a_header_in_the_first_message() {
        let (a, b) = (MacAddr([2, 0, 0, 0, 0, 1]), MacAddr([2, 0, 0, 0, 0, 2]));
        let mut sink = BurstSink::new(BurstHeader::FirstMessage);
        let t = Instant::from_nanos;
        // A 300-byte burst from each peer in 128-byte messages, interleaved: 128 + 128 + 44.
        let mut first = header(0, 7, 0, 300);
        first.resize(128, 0);
        sink.handle_message(t(10), a, &first);
        sink.handle_message(t(11), b, &first);
        sink.handle_message(t(12), a, &[0; 128]);
        sink.handle_message(t(13), b, &[0; 128]);
        sink.handle_message(t(14), b, &[0; 44]);
        assert_eq!(sink.done, [BurstDone { peer: b, offered: t(7), completed: t(14), bytes: 300 }]);
        sink.handle_message(t(15), a, &[0; 44]);
        assert_eq!(sink.done[1], BurstDone { peer: a, offered: t(7), completed: t(15), bytes: 300 });
        // A burst that is all header completes in its first message.
        sink.handle_message(t(16), a, &header(1, 9, 0, 24));
        assert_eq!(sink.done[2], BurstDone { peer: a, offered: t(9), completed: t(16), bytes: 24 });
        assert_eq!(sink.malformed, 0);
        // More than the burst has left abandons it; the next message opens a new burst.
        sink.handle_message(t(17), a, &first);
        sink.handle_message(t(18), a, &[0; 200]);
        // A first message too short, longer than its burst, or not at offset 0.
        sink.handle_message(t(19), a, &[0; 10]);
        let mut long = header(2, 9, 0, 50);
        long.resize(60, 0);
        sink.handle_message(t(20), a, &long);
        sink.handle_message(t(21), a, &header(2, 9, 8, 300));
        assert_eq!((sink.done.len(), sink.malformed), (3, 4));
    }

    #[test]
    fn a_source_with_headers_on_first_messages_sends_whole_chunks_of_the_burst() {
        let (a_mac, b_mac) = (MacAddr([2, 0, 0, 0, 0, 1]), MacAddr([2, 0, 0, 0, 0, 2]));
        let mut transport = Config::point_to_point();
        transport.pack_messages = false;
        let arrivals =
            [Arrival { at: Instant::ZERO, bytes: 1_000 }, Arrival { at: Instant::from_nanos(1), bytes: 10 }];
        let mut source =
            BurstSource::new(b_mac, 0, 128, arrivals.into_iter()).with_header(BurstHeader::FirstMessage);
        let mut a = Endpoint::new(transport.clone(), a_mac, Instant::ZERO);
        let mut b = Endpoint::new(transport, b_mac, Instant::ZERO);
        let now = Instant::from_nanos(1);
        source.run(now, &mut a);
        assert_eq!(source.bursts_accepted, 2);
        let mut buf = vec![0u8; Config::point_to_point().frame_capacity()];
        while let Some(n) = a.poll_transmit(now, &mut buf) {
            b.handle_frame(now, &buf[..n]);
        }
        let mut lens = Vec::new();
        let mut sink = BurstSink::new(BurstHeader::FirstMessage);
        while let Some(m) = b.poll_message() {
            lens.push(m.data.len());
            sink.handle_message(now, m.peer, m.data);
        }
        // 1000 bytes: seven of 128 and one of 104; the 10-byte burst grows to its header.
        assert_eq!(lens, [128, 128, 128, 128, 128, 128, 128, 104, 24]);
        let sizes: Vec<usize> = sink.done.iter().map(|d| d.bytes).collect();
        assert_eq!((sizes, sink.malformed), (vec![1_000, 24], 0));
    }
}
