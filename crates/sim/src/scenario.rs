//! The simulator's scenarios: the fault-injected transfer and the two figures of the ExpressEther
//! retransmission paper, each a pure function of its parameters.
//!
//! Layer: simulation. The `lanbus sim ...` commands print and plot what these return; the tests
//! run short versions and assert the paper's qualitative claims.
//!
//! - [`transfer`]: two endpoints joined by the faulty [`lanbus_port::SimWire`] on a logical clock;
//!   every message is checked for content, order and uniqueness.
//! - [`latency_point`] (Fig. 2): one session offering 7 Gbit/s of 128-byte TLPs through one switch
//!   whose output drops frames at random; one-way latency per message.
//! - [`multi_session_point`] (Fig. 3): sessions of 1 MB bursts with exponential gaps into one
//!   switch output port, in the paper's 128-byte TLPs one per frame ([`Framing::Paper`]) or in
//!   64 KiB messages over 1500-byte frames ([`Framing::Jumbo`]); per burst, the time its frames
//!   take back to back at the access rate over the actual time.

use core::time::Duration;
use std::sync::Arc;

use lanbus_port::sim::{SimWire, SimWireConfig, SimWireStats};
use lanbus_port::Port;
use lanbus_transport::{Config, Counters, Endpoint, SendError, PAPER_DUP_ACK_THRESHOLD};
use lanbus_wire::{Clock, Instant, MacAddr, ManualClock};

use crate::host::{BurstHeader, BurstSink, BurstSource, Host, StreamSink, StreamSource};
use crate::stats::Samples;
use crate::traffic::{ConstantRate, PoissonBursts};
use crate::{Forwarding, LinkConfig, Node, Sim, SwitchConfig};

/// The transport's settings for an endpoint on an access link of `rate_bps`: the defaults, point
/// to point, with rate control starting at (and never above) the link's rate.
pub fn transport_for(rate_bps: u64) -> Config {
    let mut c = Config::point_to_point();
    c.rate.line_rate_bps = rate_bps;
    c
}

/// The MAC of simulated host `i` (locally administered, unicast).
pub fn host_mac(i: u16) -> MacAddr {
    let [hi, lo] = i.to_be_bytes();
    MacAddr([0x02, 0x1b, 0x00, 0x00, hi, lo])
}

// ---------------------------------------------------------------------------------------------
// transfer

/// Parameters of [`transfer`].
#[derive(Debug, Clone, PartialEq)]
pub struct TransferParams {
    /// Messages to send from A to B.
    pub messages: u64,
    /// The wire (faults, rate, delay, seed).
    pub wire: SimWireConfig,
    /// The transport's settings (both ends).
    pub transport: Config,
    /// Give up after this much logical time.
    pub time_limit: Duration,
    /// Run over a keyed fabric: both ends behind the authentication layer's core with a fixed
    /// key and seeded randomness (the run still repeats exactly), the transport's checksum off.
    pub keyed: bool,
}

impl TransferParams {
    /// `messages` over a 10 Gbit/s wire with 2 µs of delay and the given fault rates.
    pub fn new(messages: u64, loss: f64, reorder: f64, duplicate: f64, corrupt: f64, seed: u64) -> Self {
        TransferParams {
            messages,
            wire: SimWireConfig {
                rate_bps: 10_000_000_000,
                delay: Duration::from_micros(2),
                loss,
                reorder,
                reorder_delay: Duration::from_micros(20),
                duplicate,
                corrupt,
                mtu: 1500,
                tx_queue_bytes: 256 * 1024,
                seed,
            },
            transport: transport_for(10_000_000_000),
            time_limit: Duration::from_secs(3600),
            keyed: false,
        }
    }
}

/// What [`transfer`] saw.
#[derive(Debug, Clone, PartialEq)]
pub struct TransferReport {
    /// Distinct messages delivered intact.
    pub delivered: u64,
    /// Messages never delivered intact.
    pub lost: u64,
    /// Intact messages delivered again.
    pub duplicated: u64,
    /// Intact messages delivered out of order.
    pub reordered: u64,
    /// Messages delivered with wrong bytes (or from the wrong peer or channel).
    pub corrupted: u64,
    /// Logical time the run took.
    pub elapsed: Duration,
    /// Whether it ended by itself (all delivered and acknowledged) rather than at the time limit.
    pub completed: bool,
    /// What the wire did A → B and B → A.
    pub wire: [SimWireStats; 2],
    /// Transport counters of A (sender) and B (receiver).
    pub counters: [Counters; 2],
    /// Payload bytes delivered.
    pub bytes: u64,
    /// Frames the authentication layers refused (a keyed run; corrupted frames among them).
    pub refused_by_key: u64,
}

impl TransferReport {
    /// Whether every message arrived exactly once, in order, intact.
    pub fn ok(&self) -> bool {
        self.lost == 0 && self.duplicated == 0 && self.reordered == 0 && self.corrupted == 0
    }

    /// The summary line: `delivered=N lost=0 duplicated=0 reordered=0 corrupted=0` when all is well.
    pub fn summary(&self) -> String {
        format!(
            "delivered={} lost={} duplicated={} reordered={} corrupted={}",
            self.delivered, self.lost, self.duplicated, self.reordered, self.corrupted
        )
    }
}

/// Length of transfer message `index`: mostly small (packed several per frame), every 97th one
/// several frames long (segmented).
pub fn transfer_len(index: u64) -> usize {
    if index % 97 == 13 {
        1_000 + (index as usize * 7_919) % 6_000
    } else {
        16 + (index as usize * 7_919) % 300
    }
}

/// Writes transfer message `index` into `buf`: its index, then bytes derived from the index.
pub fn transfer_message(index: u64, buf: &mut Vec<u8>) {
    let len = transfer_len(index);
    buf.clear();
    buf.extend_from_slice(&index.to_be_bytes());
    buf.extend((8..len).map(|j| crate::host::stream_byte(index, j)));
}

/// Sends `params.messages` messages from A to B through the faulty wire and checks each one.
/// `progress` is called now and then with the number of messages delivered so far.
pub fn transfer(params: &TransferParams, progress: &mut dyn FnMut(u64)) -> TransferReport {
    let (a_mac, b_mac) = (host_mac(1), host_mac(2));
    let clock = ManualClock::new();
    let (mut pa, mut pb) = SimWire::pair(params.wire.clone(), Arc::new(clock.clone()), [a_mac, b_mac])
        .expect("transfer parameters are validated by the caller");
    let mut transport = params.transport.clone();
    // A keyed fabric: the tag replaces the CRC, and the trailer needs room in each frame.
    let mut guards = params.keyed.then(|| {
        transport.checksum = false;
        transport.mtu = transport.mtu.min(params.wire.mtu) - lanbus_secure::TRAILER_LEN;
        let keys = lanbus_secure::Keys::new(lanbus_secure::KeyRing::new(
            lanbus_secure::FabricKey::from_parts(lanbus_secure::KeyId(1), [0x1b; 32]),
            [],
        ));
        let guard = |mac, seed| {
            let config = lanbus_secure::GuardConfig {
                encrypt: false,
                suite: lanbus_secure::Suite::Aes256Gcm,
                broadcast_counter_start: 1,
            };
            lanbus_secure::Guard::new(
                mac,
                keys.clone(),
                config,
                Box::new(lanbus_secure::SeededEntropy::new(seed)),
            )
        };
        [guard(a_mac, params.wire.seed), guard(b_mac, params.wire.seed ^ 0x5eed)]
    });
    let mut scratch = Vec::new();
    let mut a = Endpoint::new(transport.clone(), a_mac, Instant::ZERO);
    let mut b = Endpoint::new(transport, b_mac, Instant::ZERO);
    let n = params.messages;
    let mut seen = vec![false; n as usize];
    let mut report = TransferReport {
        delivered: 0,
        lost: 0,
        duplicated: 0,
        reordered: 0,
        corrupted: 0,
        elapsed: Duration::ZERO,
        completed: false,
        wire: [SimWireStats::default(); 2],
        counters: [Counters::default(); 2],
        bytes: 0,
        refused_by_key: 0,
    };
    let mut next_send = 0u64;
    let mut expected = 0u64;
    let mut msg = Vec::new();
    let mut check = Vec::new();
    let limit = Instant::ZERO + params.time_limit;
    let mut last_progress = 0;
    loop {
        let now = clock.now();
        while next_send < n {
            transfer_message(next_send, &mut msg);
            match a.send(now, b_mac, 0, &msg) {
                Ok(()) => next_send += 1,
                Err(SendError::QueueFull) => break,
                Err(e) => panic!("transfer message {next_send} refused: {e}"),
            }
        }
        match &mut guards {
            None => {
                let _ = pa.rx_burst(usize::MAX, &mut |f| a.handle_frame(now, f));
                let _ = pb.rx_burst(usize::MAX, &mut |f| b.handle_frame(now, f));
            }
            Some([ga, gb]) => {
                let _ = pa.rx_burst(usize::MAX, &mut |f| {
                    if let Some(open) = ga.open(now, f, &mut scratch) {
                        a.handle_frame(now, open);
                    }
                });
                let _ = pb.rx_burst(usize::MAX, &mut |f| {
                    if let Some(open) = gb.open(now, f, &mut scratch) {
                        b.handle_frame(now, open);
                    }
                });
            }
        }
        for e in [&mut a, &mut b] {
            if e.poll_timeout().is_some_and(|t| t <= now) {
                e.handle_timeout(now);
            }
        }
        while let Some(m) = b.poll_message() {
            let data = m.data;
            report.bytes += data.len() as u64;
            let index = data.get(..8).map(|h| u64::from_be_bytes(h.try_into().unwrap_or_default()));
            let intact = m.peer == a_mac && m.channel == 0 && index.is_some_and(|i| i < n) && {
                transfer_message(index.unwrap_or(0), &mut check);
                check == data
            };
            let Some(i) = index.filter(|_| intact) else {
                report.corrupted += 1;
                continue;
            };
            if seen[i as usize] {
                report.duplicated += 1;
                continue;
            }
            seen[i as usize] = true;
            report.delivered += 1;
            if i != expected {
                report.reordered += 1;
            }
            expected = expected.max(i + 1);
        }
        match &mut guards {
            None => {
                let _ = pa.tx_burst(usize::MAX, &mut |buf| a.poll_transmit(now, buf));
                let _ = pb.tx_burst(usize::MAX, &mut |buf| b.poll_transmit(now, buf));
            }
            Some([ga, gb]) => {
                for (port, guard, end) in [(&mut pa, &mut *ga, &mut a), (&mut pb, &mut *gb, &mut b)] {
                    let _ = port.tx_burst(usize::MAX, &mut |buf| loop {
                        let room = buf.len() - lanbus_secure::TRAILER_LEN;
                        let len = end.poll_transmit(now, &mut buf[..room])?;
                        if let Some(sealed) = guard.seal(now, buf, len) {
                            return Some(sealed);
                        }
                    });
                    while let Some(f) = guard.poll_transmit() {
                        let _ = port.send_frames(&[&f]);
                    }
                }
            }
        }
        if report.delivered >= last_progress + 10_000 {
            last_progress = report.delivered;
            progress(report.delivered);
        }
        if next_send == n && a.is_idle() && b.is_idle() && pa.rx_pending() == 0 && pb.rx_pending() == 0 {
            report.completed = true;
            break;
        }
        let next = [pa.next_event(), pb.next_event(), a.poll_timeout(), b.poll_timeout()]
            .into_iter()
            .flatten()
            .min();
        let next = match next {
            Some(t) if t > now => t,
            // Something is due now (a frame the callbacks produced, a timer at `now`): go round
            // again without moving time, unless nothing at all is pending.
            Some(_) => now + Duration::from_nanos(1),
            None => break,
        };
        if next > limit {
            break;
        }
        clock.advance_to(next);
    }
    progress(report.delivered);
    report.elapsed = clock.now() - Instant::ZERO;
    report.lost = n - report.delivered;
    report.wire = [pa.tx_stats(), pb.tx_stats()];
    report.counters = [a.counters(), b.counters()];
    if let Some([ga, gb]) = &guards {
        report.refused_by_key = ga.counters().rejected.total() + gb.counters().rejected.total();
    }
    report
}

/// The TLP payload of the retransmission paper's simulations: 128 bytes, one per frame (170
/// bytes with the paper's headers).
pub const PAPER_TLP_BYTES: usize = 128;

// ---------------------------------------------------------------------------------------------
// Fig. 2: latency against loss

/// Parameters of one point of the latency-vs-loss figure.
#[derive(Debug, Clone, PartialEq)]
pub struct LatencyParams {
    /// Probability that the switch's output loses a frame (both directions).
    pub loss: f64,
    /// Messages to send.
    pub messages: u64,
    /// Message (TLP) size in bytes.
    pub message_bytes: usize,
    /// Offered rate in bits per second, counted in `paper_frame_bytes` frames: the paper's
    /// "7 Gbps session" of 128-byte TLPs in 170-byte frames is 5.15 M TLPs per second.
    pub offered_bps: u64,
    /// The frame size the offered rate is counted in (170 in the paper).
    pub paper_frame_bytes: usize,
    /// Each of the two links (host to switch, switch to host).
    pub link: LinkConfig,
    /// Switch output buffer.
    pub switch_buffer_bytes: usize,
    /// The transport's settings.
    pub transport: Config,
    /// Seed of the loss decisions.
    pub seed: u64,
}

impl LatencyParams {
    /// The paper's setting at loss rate `loss`: 10 Gbit/s links of 1 µs each side of the switch,
    /// one TLP per frame (packing off), rate control off (one session cannot congest the switch).
    pub fn paper(loss: f64, messages: u64, seed: u64) -> Self {
        let mut transport = transport_for(LinkConfig::default().rate_bps);
        transport.pack_messages = false;
        transport.rate.enabled = false;
        // The paper's scheme: Go-Back-N, fast retransmit on two ACKs with the same number and
        // the timer, no tail-loss probe.
        transport.selective_repeat = false;
        transport.dup_ack_threshold = PAPER_DUP_ACK_THRESHOLD;
        transport.tail_loss_probe = false;
        LatencyParams {
            loss,
            messages,
            message_bytes: PAPER_TLP_BYTES,
            offered_bps: 7_000_000_000,
            paper_frame_bytes: 170,
            link: LinkConfig::default(),
            switch_buffer_bytes: 1 << 20,
            transport,
            seed,
        }
    }
}

/// One point of the latency-vs-loss figure.
#[derive(Debug, Clone, PartialEq)]
pub struct LatencyPoint {
    /// The loss rate.
    pub loss: f64,
    /// Mean one-way latency (offer to delivery), µs.
    pub mean_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// Largest, µs.
    pub max_us: f64,
    /// Round trip of a data frame and its ACK with empty queues, µs.
    pub base_rtt_us: f64,
    /// Application bytes delivered per second of the run, Gbit/s.
    pub goodput_gbps: f64,
    /// DATA frames sent again.
    pub retransmitted_frames: u64,
    /// Frames the switch output lost at random.
    pub lost_frames: u64,
    /// Messages delivered (all of them unless the run hit its bound).
    pub delivered: u64,
    /// Messages delivered out of order or corrupted (must be 0).
    pub errors: u64,
    /// Size of a data frame on the wire (Ethernet header included, overhead excluded).
    pub frame_bytes: usize,
}

/// The simulated world of the figures: hosts of either kind of app.
// A simulation holds a handful of these; their sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum FigureHost {
    /// A stream source (Fig. 2 sender).
    Source(Host<StreamSource<ConstantRate>>),
    /// A stream sink (Fig. 2 receiver).
    Sink(Host<StreamSink>),
    /// A burst source (Fig. 3 sender).
    Bursts(Host<BurstSource<PoissonBursts>>),
    /// A burst sink (Fig. 3 receiver).
    BurstSink(Host<BurstSink>),
}

impl Node for FigureHost {
    fn handle_frame(&mut self, now: Instant, frame: &[u8]) {
        match self {
            FigureHost::Source(h) => h.handle_frame(now, frame),
            FigureHost::Sink(h) => h.handle_frame(now, frame),
            FigureHost::Bursts(h) => h.handle_frame(now, frame),
            FigureHost::BurstSink(h) => h.handle_frame(now, frame),
        }
    }
    fn handle_timeout(&mut self, now: Instant) {
        match self {
            FigureHost::Source(h) => h.handle_timeout(now),
            FigureHost::Sink(h) => h.handle_timeout(now),
            FigureHost::Bursts(h) => h.handle_timeout(now),
            FigureHost::BurstSink(h) => h.handle_timeout(now),
        }
    }
    fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        match self {
            FigureHost::Source(h) => h.poll_transmit(now, buf),
            FigureHost::Sink(h) => h.poll_transmit(now, buf),
            FigureHost::Bursts(h) => h.poll_transmit(now, buf),
            FigureHost::BurstSink(h) => h.poll_transmit(now, buf),
        }
    }
    fn poll_timeout(&mut self) -> Option<Instant> {
        match self {
            FigureHost::Source(h) => h.poll_timeout(),
            FigureHost::Sink(h) => h.poll_timeout(),
            FigureHost::Bursts(h) => h.poll_timeout(),
            FigureHost::BurstSink(h) => h.poll_timeout(),
        }
    }
}

impl FigureHost {
    fn endpoint(&self) -> &Endpoint {
        match self {
            FigureHost::Source(h) => &h.endpoint,
            FigureHost::Sink(h) => &h.endpoint,
            FigureHost::Bursts(h) => &h.endpoint,
            FigureHost::BurstSink(h) => &h.endpoint,
        }
    }
}

/// Runs one point of Fig. 2. `progress` gets the fraction done now and then.
pub fn latency_point(p: &LatencyParams, progress: &mut dyn FnMut(f64)) -> LatencyPoint {
    let (src_mac, dst_mac) = (host_mac(1), host_mac(2));
    let mut sim: Sim<FigureHost> = Sim::new(p.seed);
    let sw = sim.add_switch(SwitchConfig {
        buffer_bytes: p.switch_buffer_bytes,
        forwarding: Forwarding::Static,
        latency: Duration::ZERO,
    });
    // Messages per second: the offered rate counted in the paper's frame size.
    let rate_msgs = p.offered_bps as f64 / (p.paper_frame_bytes as f64 * 8.0);
    let app_rate_bps = (rate_msgs * p.message_bytes as f64 * 8.0) as u64;
    let arrivals = ConstantRate::new(Instant::ZERO, p.message_bytes, app_rate_bps, p.messages);
    let src = sim.add_node(FigureHost::Source(Host::new(
        Endpoint::new(p.transport.clone(), src_mac, Instant::ZERO),
        StreamSource::new(dst_mac, 0, arrivals),
    )));
    let dst = sim.add_node(FigureHost::Sink(Host::new(
        Endpoint::new(p.transport.clone(), dst_mac, Instant::ZERO),
        StreamSink::default(),
    )));
    // Loss happens at the switch output (the links from the switch), as in the paper.
    let access = LinkConfig { loss: 0.0, ..p.link.clone() };
    let lossy = LinkConfig { loss: p.loss, ..p.link.clone() };
    let src_port = sim.connect_to_switch(src, sw, access.clone());
    let dst_port = sim.connect_to_switch(dst, sw, access);
    sim.set_downlink_config(sw, src_port, lossy.clone());
    sim.set_downlink_config(sw, dst_port, lossy);
    sim.add_route(sw, src_mac, src_port);
    sim.add_route(sw, dst_mac, dst_port);

    let frame_bytes =
        lanbus_wire::ethernet::HEADER_LEN + lanbus_wire::frame::HEADER_LEN + 4 + p.message_bytes;
    let ack_bytes = (lanbus_wire::ethernet::HEADER_LEN + lanbus_wire::frame::HEADER_LEN).max(60);
    let hop = |len: usize| crate::serialisation(len + p.link.overhead_bytes, p.link.rate_bps) + p.link.delay;
    let base_rtt = 2 * hop(frame_bytes) + 2 * hop(ack_bytes);

    let offered_for = Duration::from_secs_f64(p.messages as f64 / rate_msgs);
    let deadline = Instant::ZERO + offered_for * 4 + Duration::from_millis(200);
    let steps = 50u32;
    for k in 1..=steps {
        let until = Instant::ZERO + offered_for * k / steps;
        let until = if k == steps { deadline } else { until };
        sim.run_while(until, u64::MAX, |s| match s.node(dst) {
            FigureHost::Sink(h) => h.app.delivered < p.messages,
            _ => false,
        });
        progress(f64::from(k) / f64::from(steps));
    }
    let (sink, ()) = match sim.node_mut(dst) {
        FigureHost::Sink(h) => (std::mem::take(&mut h.app), ()),
        _ => unreachable!("node kinds are fixed at construction"),
    };
    let src_counters = sim.node(src).endpoint().counters();
    let mut lat = sink.latency_us;
    let lost_frames = sim.downlink_stats(sw, src_port).lost + sim.downlink_stats(sw, dst_port).lost;
    let span = sink.last_delivery.map(|t| t - Instant::ZERO).unwrap_or(Duration::from_nanos(1));
    LatencyPoint {
        loss: p.loss,
        mean_us: lat.mean().unwrap_or(f64::NAN),
        p99_us: lat.percentile(99.0).unwrap_or(f64::NAN),
        max_us: lat.max().unwrap_or(f64::NAN),
        base_rtt_us: base_rtt.as_secs_f64() * 1e6,
        goodput_gbps: (sink.delivered * p.message_bytes as u64) as f64 * 8.0 / span.as_secs_f64() / 1e9,
        retransmitted_frames: src_counters.retransmitted_frames,
        lost_frames,
        delivered: sink.delivered,
        errors: sink.out_of_order + sink.corrupted,
        frame_bytes,
    }
}

// ---------------------------------------------------------------------------------------------
// Fig. 3: many sessions through one switch port

/// How the multi-session figure cuts its bursts into frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// The paper's: the burst in 128-byte TLPs, one per frame (186 bytes with lanbus's headers,
    /// where the paper's are 170), its header only in its first TLP.
    Paper,
    /// lanbus's bulk framing: 64 KiB messages, each with the burst header, over 1500-byte frames
    /// with packing.
    Jumbo,
}

impl Framing {
    /// The messages a burst is cut into, the header rule, and the transport's MTU and packing.
    fn settings(self) -> (usize, BurstHeader, usize, bool) {
        match self {
            Framing::Paper => (
                PAPER_TLP_BYTES,
                BurstHeader::FirstMessage,
                lanbus_wire::frame::HEADER_LEN + lanbus_wire::frame::RECORD_HEADER_LEN + PAPER_TLP_BYTES,
                false,
            ),
            Framing::Jumbo => (65_536, BurstHeader::EveryMessage, 1500, true),
        }
    }
}

/// Parameters of one point of the multi-session figure.
#[derive(Debug, Clone, PartialEq)]
pub struct MultiParams {
    /// Sending hosts, each one session to the common receiver.
    pub sessions: u16,
    /// Burst size (1 MB in the paper).
    pub burst_bytes: usize,
    /// Mean gap between burst arrivals of one session (11.4 ms in the paper).
    pub mean_gap: Duration,
    /// Bursts arriving before this are counted (the run continues until they complete).
    pub duration: Duration,
    /// Bursts offered in the first `warmup` are not counted.
    pub warmup: Duration,
    /// Every link.
    pub link: LinkConfig,
    /// The switch output buffer per port.
    pub switch_buffer_bytes: usize,
    /// How bursts are cut into messages and frames (the transport's MTU and packing follow it:
    /// set it with [`MultiParams::set_framing`]).
    pub framing: Framing,
    /// Message size the bursts are cut into.
    pub chunk_bytes: usize,
    /// The transport's settings (rate control on or off is here).
    pub transport: Config,
    /// Seed of the burst arrivals.
    pub seed: u64,
}

impl MultiParams {
    /// The paper's workload with `sessions` sessions, rate control on or off, in the paper's
    /// frames.
    pub fn paper(sessions: u16, rate_control: bool, duration: Duration, seed: u64) -> Self {
        let mut transport = transport_for(LinkConfig::default().rate_bps);
        transport.rate.enabled = rate_control;
        // The simulated links lose frames but never flip bits: the frame checksum would only
        // cost time (a tenth of a run at a million frames a burst).
        transport.checksum = false;
        // The paper's scheme: Go-Back-N, fast retransmit on two ACKs with the same number, no
        // tail-loss probe.
        transport.selective_repeat = false;
        transport.dup_ack_threshold = PAPER_DUP_ACK_THRESHOLD;
        transport.tail_loss_probe = false;
        let mut p = MultiParams {
            sessions,
            burst_bytes: 1_000_000,
            mean_gap: Duration::from_micros(11_400),
            duration,
            warmup: Duration::from_millis(5),
            link: LinkConfig::default(),
            switch_buffer_bytes: 128 * 1024,
            framing: Framing::Paper,
            chunk_bytes: 0,
            transport,
            seed,
        };
        p.set_framing(Framing::Paper);
        p
    }

    /// Cuts the bursts as `framing` says: message size, header rule, MTU and packing.
    pub fn set_framing(&mut self, framing: Framing) {
        let (chunk_bytes, _, mtu, pack) = framing.settings();
        self.framing = framing;
        self.chunk_bytes = chunk_bytes;
        self.transport.mtu = mtu;
        self.transport.pack_messages = pack;
    }

    /// Offered load over the receiver's link counted in the bytes the line carries: the bursts in
    /// their frames with the per-frame overhead ([`MultiParams::burst_wire_bytes`]).
    pub fn line_utilization(&self) -> f64 {
        self.utilization() * self.burst_wire_bytes() as f64 / self.burst_bytes.max(1) as f64
    }

    /// Bytes one burst takes on the line when nothing is lost: its messages' data and headers in
    /// the frames the transport cuts them into, each frame with the link's per-frame overhead
    /// (packing of a message's tail with the next one's head left out).
    pub fn burst_wire_bytes(&self) -> u64 {
        let (_, header, _, _) = self.framing.settings();
        let frame_header = lanbus_wire::ethernet::HEADER_LEN
            + lanbus_wire::frame::HEADER_LEN
            + lanbus_wire::frame::RECORD_HEADER_LEN
            + self.link.overhead_bytes;
        let fragment =
            self.transport.mtu - lanbus_wire::frame::HEADER_LEN - lanbus_wire::frame::RECORD_HEADER_LEN;
        let message = |len: usize| (len + len.div_ceil(fragment).max(1) * frame_header) as u64;
        let chunk = self.chunk_bytes.max(crate::host::BURST_HEADER_LEN + 1);
        match header {
            BurstHeader::FirstMessage => {
                let total = self.burst_bytes.max(crate::host::BURST_HEADER_LEN);
                let full = total / chunk;
                let rest = total % chunk;
                full as u64 * message(chunk) + if rest > 0 { message(rest) } else { 0 }
            }
            BurstHeader::EveryMessage => {
                let room = chunk - crate::host::BURST_HEADER_LEN;
                let (full, rest) = (self.burst_bytes / room, self.burst_bytes % room);
                let with_header = |n: usize| message(n + crate::host::BURST_HEADER_LEN);
                full as u64 * with_header(room) + if rest > 0 { with_header(rest) } else { 0 }
            }
        }
    }

    /// Offered load over the receiver's link in the paper's terms: sessions × burst bytes per
    /// mean gap / link rate (each of the paper's sessions is 0.7 Gbit/s of data).
    pub fn utilization(&self) -> f64 {
        f64::from(self.sessions) * self.burst_bytes as f64 * 8.0
            / self.mean_gap.as_secs_f64()
            / self.link.rate_bps as f64
    }
}

/// One point of the multi-session figure.
#[derive(Debug, Clone, PartialEq)]
pub struct MultiPoint {
    /// Sessions.
    pub sessions: u16,
    /// Offered utilisation of the switch output port ([`MultiParams::utilization`]).
    pub utilization: f64,
    /// The same counted in the frames on the line ([`MultiParams::line_utilization`]).
    pub line_utilization: f64,
    /// Whether rate control was on.
    pub rate_control: bool,
    /// Mean over bursts of (burst at access rate) / (actual completion time).
    pub mean_ratio: f64,
    /// 10th percentile of the same.
    pub p10_ratio: f64,
    /// The mean ratio the same bursts get from an ideal fabric ([`ideal_sharing`]): equal shares
    /// of the port, nothing lost.
    pub ideal_mean_ratio: f64,
    /// Bursts counted.
    pub bursts: usize,
    /// Bursts offered in the counted window that never completed (must be 0).
    pub incomplete: usize,
    /// Frames the switch dropped for lack of buffer.
    pub switch_drops: u64,
    /// DATA frames sent again, all senders.
    pub retransmitted_frames: u64,
    /// Retransmission timeouts, all senders.
    pub timeouts: u64,
}

/// Runs one point of Fig. 3. `progress` gets the fraction done now and then.
pub fn multi_session_point(p: &MultiParams, progress: &mut dyn FnMut(f64)) -> MultiPoint {
    let mut sim: Sim<FigureHost> = Sim::new(p.seed);
    let sw = sim.add_switch(SwitchConfig {
        buffer_bytes: p.switch_buffer_bytes,
        forwarding: Forwarding::Static,
        latency: Duration::ZERO,
    });
    let sink_mac = host_mac(0);
    let sink = sim.add_node(FigureHost::BurstSink(Host::new(
        Endpoint::new(p.transport.clone(), sink_mac, Instant::ZERO),
        BurstSink::new(p.framing.settings().1),
    )));
    let port = sim.connect_to_switch(sink, sw, p.link.clone());
    sim.add_route(sw, sink_mac, port);
    let stop = Instant::ZERO + p.duration;
    let mut senders = Vec::new();
    for i in 1..=p.sessions {
        let mac = host_mac(i);
        let seed = p.seed.wrapping_mul(1_000_003).wrapping_add(u64::from(i));
        let arrivals = PoissonBursts::new(seed, Instant::ZERO, p.burst_bytes, p.mean_gap, stop);
        let node = sim.add_node(FigureHost::Bursts(Host::new(
            Endpoint::new(p.transport.clone(), mac, Instant::ZERO),
            BurstSource::new(sink_mac, 0, p.chunk_bytes, arrivals).with_header(p.framing.settings().1),
        )));
        let port = sim.connect_to_switch(node, sw, p.link.clone());
        sim.add_route(sw, mac, port);
        senders.push(node);
    }
    // Run the arrival window, then let the counted bursts finish (bounded).
    let steps = 50u32;
    for k in 1..=steps {
        sim.run_until(Instant::ZERO + p.duration * k / steps, u64::MAX);
        progress(0.9 * f64::from(k) / f64::from(steps));
    }
    let drain_limit = stop + Duration::from_secs(2);
    sim.run_while(drain_limit, u64::MAX, |s| s.nodes().any(|n| !n.endpoint().is_idle()));
    progress(1.0);

    let warm = Instant::ZERO + p.warmup;
    // The ideal time of a burst: its frames back to back at the access rate.
    let burst_bits = p.burst_wire_bytes() as f64 * 8.0;
    let ideal = burst_bits / p.link.rate_bps as f64;
    let mut ratios = Samples::new();
    let done = match sim.node(sink) {
        FigureHost::BurstSink(h) => h.app.done.clone(),
        _ => unreachable!("node kinds are fixed at construction"),
    };
    for d in done.iter().filter(|d| d.offered >= warm && d.offered < stop) {
        ratios.push(ideal / (d.completed - d.offered).as_secs_f64());
    }
    let mut offered = 0usize;
    let mut retransmitted = 0;
    let mut timeouts = 0;
    for &n in &senders {
        if let FigureHost::Bursts(h) = sim.node(n) {
            let c = h.endpoint.counters();
            retransmitted += c.retransmitted_frames;
            timeouts += c.timeouts;
        }
    }
    // Count the offered bursts of the window again from the same seeds (the generators are pure),
    // and run them through an ideal fabric.
    let secs = |t: Instant| t.as_nanos() as f64 / 1e9;
    let mut sessions = Vec::new();
    for i in 1..=p.sessions {
        let seed = p.seed.wrapping_mul(1_000_003).wrapping_add(u64::from(i));
        let arrivals: Vec<f64> = PoissonBursts::new(seed, Instant::ZERO, p.burst_bytes, p.mean_gap, stop)
            .map(|a| secs(a.at))
            .collect();
        offered += arrivals.iter().filter(|&&at| at >= secs(warm)).count();
        sessions.push(arrivals);
    }
    let ideal_mean_ratio =
        ideal_sharing(&sessions, burst_bits, p.link.rate_bps as f64, secs(warm), secs(stop));
    MultiPoint {
        sessions: p.sessions,
        utilization: p.utilization(),
        line_utilization: p.line_utilization(),
        rate_control: p.transport.rate.enabled,
        mean_ratio: ratios.mean().unwrap_or(f64::NAN),
        p10_ratio: ratios.percentile(10.0).unwrap_or(f64::NAN),
        ideal_mean_ratio,
        bursts: ratios.len(),
        incomplete: offered.saturating_sub(ratios.len()),
        switch_drops: sim.switch_stats(sw).dropped(),
        retransmitted_frames: retransmitted,
        timeouts,
    }
}

/// The mean throughput ratio the bursts of `sessions` (each session's arrival times, seconds, in
/// order) get from an ideal fabric: the switch port's `rate_bps` shared equally among the
/// sessions with a burst under way at every instant (fluid processor sharing), a session's bursts
/// one after another, nothing lost, no overhead. The ratio is the simulation's: a burst's time at
/// the full rate over its time from offer to completion, for bursts offered in `[warm, stop)`.
/// Sharing alone keeps it below 1 (with Poisson arrivals at utilisation u, a burst's mean time
/// is its ideal time over 1 - u). It is what fair sharing gives without loss or overhead; when
/// the port is offered more than it carries, a control that lets some bursts finish first (each
/// flow's ACK clock) gets a higher mean than equal shares do.
pub fn ideal_sharing(sessions: &[Vec<f64>], burst_bits: f64, rate_bps: f64, warm: f64, stop: f64) -> f64 {
    let ideal = burst_bits / rate_bps;
    // Per session: the index of its head burst and, while it is under way, the bits left.
    let mut next = vec![0usize; sessions.len()];
    let mut left: Vec<Option<f64>> = vec![None; sessions.len()];
    let mut now = 0.0f64;
    let mut ratios = Vec::new();
    loop {
        let active = left.iter().flatten().count();
        let completion =
            left.iter().flatten().fold(f64::INFINITY, |m, &l| m.min(now + l * active as f64 / rate_bps));
        let arrival = (0..sessions.len())
            .filter(|&i| left[i].is_none())
            .filter_map(|i| sessions[i].get(next[i]).map(|&at| (at.max(now), i)))
            .min_by(|a, b| a.0.total_cmp(&b.0));
        let t = match arrival {
            Some((at, _)) if at <= completion => at,
            _ if completion.is_finite() => completion,
            _ => break,
        };
        if active > 0 {
            let served = (t - now) * rate_bps / active as f64;
            for l in left.iter_mut().flatten() {
                *l -= served;
            }
        }
        now = t;
        if let Some((at, i)) = arrival.filter(|(at, _)| *at <= completion) {
            debug_assert!(at <= now);
            left[i] = Some(burst_bits);
            continue;
        }
        // Bursts done (within a rounding error of a bit); each session's next starts if offered.
        for i in 0..sessions.len() {
            if left[i].is_some_and(|l| l <= 1e-6) {
                let offered = sessions[i][next[i]];
                if offered >= warm && offered < stop {
                    ratios.push(ideal / (now - offered));
                }
                next[i] += 1;
                left[i] = sessions[i].get(next[i]).filter(|&&at| at <= now).map(|_| burst_bits);
            }
        }
    }
    if ratios.is_empty() {
        f64::NAN
    } else {
        ratios.iter().sum::<f64>() / ratios.len() as f64
    }
}

#[cfg(test)]
mod ideal_tests {
    use super::{ideal_sharing, Framing, MultiParams};
    use core::time::Duration;

    #[test]
    fn a_burst_on_the_line_is_its_frames_with_their_overhead() {
        let mut p = MultiParams::paper(1, false, Duration::from_millis(10), 1);
        // 7812 TLPs of 128 bytes and one of 64, each with 14 + 40 + 4 bytes of headers and 24 of
        // preamble, FCS and gap.
        assert_eq!(p.burst_wire_bytes(), 7812 * (128 + 82) + (64 + 82));
        let ratio = p.line_utilization() / p.utilization();
        assert!((ratio - 1.640666).abs() < 1e-9, "{ratio}");
        // 15 messages of 65 512 burst bytes and one of 17 320, each with its 24-byte header, in
        // fragments of 1456 bytes: 46 frames each, and 12.
        p.set_framing(Framing::Jumbo);
        assert_eq!((p.chunk_bytes, p.transport.mtu, p.transport.pack_messages), (65_536, 1500, true));
        assert_eq!(p.burst_wire_bytes(), 15 * (65_536 + 46 * 82) + (17_344 + 12 * 82));
    }

    #[test]
    fn alone_a_burst_gets_the_full_rate_and_two_at_once_share_it() {
        // 1 Mbit at 1 Mbit/s: a second alone.
        assert_eq!(ideal_sharing(&[vec![0.0]], 1e6, 1e6, 0.0, 10.0), 1.0);
        // Two sessions offering at the same instant: both finish at 2 s, ratio 0.5.
        assert_eq!(ideal_sharing(&[vec![0.0], vec![0.0]], 1e6, 1e6, 0.0, 10.0), 0.5);
        // The second starts half-way: the first has 0.5 left, both share, the first ends at 1.5
        // (ratio 1/1.5), the second has 0.5 left alone and ends at 2.0 (ratio 1/1.5).
        let r = ideal_sharing(&[vec![0.0], vec![0.5]], 1e6, 1e6, 0.0, 10.0);
        assert!((r - 1.0 / 1.5).abs() < 1e-9, "{r}");
        // One session's bursts queue behind each other: the second waits for the first.
        let r = ideal_sharing(&[vec![0.0, 0.0]], 1e6, 1e6, 0.0, 10.0);
        assert!((r - (1.0 + 0.5) / 2.0).abs() < 1e-9, "{r}");
        // Only bursts offered in the window count.
        assert_eq!(ideal_sharing(&[vec![0.0], vec![5.0]], 1e6, 1e6, 4.0, 10.0), 1.0);
    }
}
