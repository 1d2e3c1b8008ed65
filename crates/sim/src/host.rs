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

use std::collections::VecDeque;

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

/// Bytes at the start of every burst chunk: burst number, burst offer time (ns), offset of the
/// chunk in the burst, burst length; big-endian.
pub const BURST_HEADER_LEN: usize = 24;

/// Sends bursts (one arrival = one burst of `bytes`) to one peer, cut into messages of at most
/// `chunk_bytes`; bursts are sent one after another in arrival order.
pub struct BurstSource<I> {
    peer: MacAddr,
    channel: u16,
    chunk_bytes: usize,
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
    /// [`BURST_HEADER_LEN`] + 1, at most the transport's 64 KiB).
    pub fn new(peer: MacAddr, channel: u16, chunk_bytes: usize, mut arrivals: I) -> Self {
        BurstSource {
            peer,
            channel,
            chunk_bytes: chunk_bytes.max(BURST_HEADER_LEN + 1),
            next: arrivals.next(),
            arrivals,
            waiting: VecDeque::new(),
            next_burst: 0,
            buf: Vec::new(),
            bursts_accepted: 0,
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
        while let Some((number, a, done)) = self.waiting.front_mut() {
            // The header rides in every chunk, so a chunk carries chunk_bytes - header of the burst.
            let room = self.chunk_bytes - BURST_HEADER_LEN;
            let take = (a.bytes - *done).min(room);
            self.buf.clear();
            self.buf.extend_from_slice(&number.to_be_bytes());
            self.buf.extend_from_slice(&a.at.as_nanos().to_be_bytes());
            self.buf.extend_from_slice(&(*done as u32).to_be_bytes());
            self.buf.extend_from_slice(&(a.bytes as u32).to_be_bytes());
            self.buf.resize(BURST_HEADER_LEN + take, 0);
            match endpoint.send(now, self.peer, self.channel, &self.buf) {
                Ok(()) => {
                    *done += take;
                    if *done == a.bytes {
                        self.waiting.pop_front();
                        self.bursts_accepted += 1;
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

/// Receives [`BurstSource`] chunks from any number of peers and records each completed burst.
#[derive(Debug, Default)]
pub struct BurstSink {
    /// Completed bursts in completion order.
    pub done: Vec<BurstDone>,
    /// Chunks too short to carry the burst header.
    pub malformed: u64,
}

impl App for BurstSink {
    fn run(&mut self, now: Instant, endpoint: &mut Endpoint) {
        while let Some(m) = endpoint.poll_message() {
            let d = m.data;
            if d.len() < BURST_HEADER_LEN {
                self.malformed += 1;
                continue;
            }
            let offered = u64::from_be_bytes(d[8..16].try_into().unwrap_or_default());
            let offset = u32::from_be_bytes(d[16..20].try_into().unwrap_or_default()) as usize;
            let total = u32::from_be_bytes(d[20..24].try_into().unwrap_or_default()) as usize;
            if offset + (d.len() - BURST_HEADER_LEN) == total {
                self.done.push(BurstDone {
                    peer: m.peer,
                    offered: Instant::from_nanos(offered),
                    completed: now,
                    bytes: total,
                });
            }
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
}
