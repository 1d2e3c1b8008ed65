//! Engine tests with small hand-written nodes (the real transport is exercised in `transport`).

use super::*;

/// Sends `count` frames of `len` bytes to `dst`, one every `gap` (or back to back when zero),
/// and records what it receives.
struct Blaster {
    mac: MacAddr,
    dst: MacAddr,
    len: usize,
    count: u64,
    sent: u64,
    gap: Duration,
    next_at: Instant,
    received: Vec<(Instant, u64)>,
}

impl Blaster {
    fn new(mac: u8, dst: u8, len: usize, count: u64, gap: Duration) -> Self {
        Blaster {
            mac: MacAddr([2, 0, 0, 0, 0, mac]),
            dst: MacAddr([2, 0, 0, 0, 0, dst]),
            len,
            count,
            sent: 0,
            gap,
            next_at: Instant::ZERO,
            received: Vec::new(),
        }
    }
}

impl Node for Blaster {
    fn handle_frame(&mut self, now: Instant, frame: &[u8]) {
        assert_eq!(&frame[0..6], &self.mac.0, "a frame for someone else reached {:?}", self.mac);
        let seq = u64::from_be_bytes(frame[14..22].try_into().unwrap());
        self.received.push((now, seq));
    }
    fn handle_timeout(&mut self, _now: Instant) {}
    fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        if self.sent == self.count || now < self.next_at {
            return None;
        }
        buf[0..6].copy_from_slice(&self.dst.0);
        buf[6..12].copy_from_slice(&self.mac.0);
        buf[12..14].copy_from_slice(&0x88B5u16.to_be_bytes());
        buf[14..22].copy_from_slice(&self.sent.to_be_bytes());
        self.sent += 1;
        self.next_at = now + self.gap;
        Some(self.len)
    }
    fn poll_timeout(&mut self) -> Option<Instant> {
        (self.sent < self.count && !self.gap.is_zero()).then_some(self.next_at)
    }
}

const FAR: Instant = Instant::from_nanos(60_000_000_000);

#[test]
fn back_to_back_link_honours_rate_and_delay() {
    let mut sim = Sim::new(1);
    let a = sim.add_node(Blaster::new(1, 2, 125, 100, Duration::ZERO));
    let b = sim.add_node(Blaster::new(2, 1, 125, 0, Duration::ZERO));
    let link =
        LinkConfig { rate_bps: 1_000_000_000, delay: Duration::from_micros(3), loss: 0.0, overhead_bytes: 0 };
    sim.connect_nodes(a, b, link);
    assert_eq!(sim.run_until(FAR, 1_000_000), Stop::Idle);
    let got = &sim.node(b).received;
    assert_eq!(got.len(), 100);
    for (k, &(t, seq)) in got.iter().enumerate() {
        assert_eq!(seq, k as u64);
        // 125 bytes at 1 Gbit/s: 1 µs each, back to back, plus 3 µs of flight.
        assert_eq!(t.as_nanos(), (k as u64 + 1) * 1_000 + 3_000);
    }
    let up = sim.uplink_stats(a).unwrap();
    assert_eq!((up.frames, up.bytes, up.busy_ns), (100, 12_500, 100_000));
}

#[test]
fn overhead_counts_in_serialisation() {
    let mut sim = Sim::new(1);
    let a = sim.add_node(Blaster::new(1, 2, 100, 2, Duration::ZERO));
    let b = sim.add_node(Blaster::new(2, 1, 100, 0, Duration::ZERO));
    let link = LinkConfig { rate_bps: 1_000_000_000, delay: Duration::ZERO, loss: 0.0, overhead_bytes: 25 };
    sim.connect_nodes(a, b, link);
    sim.run_until(FAR, 1_000);
    let times: Vec<u64> = sim.node(b).received.iter().map(|r| r.0.as_nanos()).collect();
    assert_eq!(times, [1_000, 2_000]);
}

#[test]
fn pacing_by_timer() {
    let mut sim = Sim::new(1);
    let a = sim.add_node(Blaster::new(1, 2, 125, 10, Duration::from_micros(10)));
    let b = sim.add_node(Blaster::new(2, 1, 125, 0, Duration::ZERO));
    let link = LinkConfig { rate_bps: 1_000_000_000, delay: Duration::ZERO, loss: 0.0, overhead_bytes: 0 };
    sim.connect_nodes(a, b, link);
    sim.run_until(FAR, 10_000);
    let times: Vec<u64> = sim.node(b).received.iter().map(|r| r.0.as_nanos()).collect();
    let expect: Vec<u64> = (0..10).map(|k| k * 10_000 + 1_000).collect();
    assert_eq!(times, expect);
}

/// Two senders at line rate into one output port of a switch.
fn incast(buffer_bytes: usize, seed: u64) -> (Sim<Blaster>, SwitchId, [NodeId; 3]) {
    let mut sim = Sim::new(seed);
    let sw = sim.add_switch(SwitchConfig { buffer_bytes, ..Default::default() });
    let link =
        LinkConfig { rate_bps: 1_000_000_000, delay: Duration::from_micros(1), loss: 0.0, overhead_bytes: 0 };
    let sink = sim.add_node(Blaster::new(9, 1, 100, 0, Duration::ZERO));
    let port = sim.connect_to_switch(sink, sw, link.clone());
    sim.add_route(sw, MacAddr([2, 0, 0, 0, 0, 9]), port);
    let a = sim.add_node(Blaster::new(1, 9, 1000, 1000, Duration::ZERO));
    sim.connect_to_switch(a, sw, link.clone());
    let b = sim.add_node(Blaster::new(2, 9, 1000, 1000, Duration::ZERO));
    sim.connect_to_switch(b, sw, link);
    (sim, sw, [sink, a, b])
}

#[test]
fn switch_drops_when_its_buffer_overflows() {
    let (mut sim, sw, [sink, _, _]) = incast(20_000, 1);
    assert_eq!(sim.run_until(FAR, 1_000_000), Stop::Idle);
    let stats = sim.switch_stats(sw).clone();
    let delivered = sim.node(sink).received.len() as u64;
    let to_sink = stats.ports[0];
    // Twice the output rate arrives: about half must be dropped, and all the rest delivered.
    assert!(to_sink.dropped > 900 && to_sink.dropped < 1100, "{to_sink:?}");
    assert_eq!(delivered + to_sink.dropped, 2000);
    assert!(to_sink.max_bytes <= 20_000);
    // The output never idled while frames were queued: the sink got them at line rate.
    let last = sim.node(sink).received.last().unwrap().0;
    let first = sim.node(sink).received[0].0;
    assert_eq!((last - first).as_nanos() as u64, (delivered - 1) * 8_000);
}

#[test]
fn big_buffer_drops_nothing() {
    let (mut sim, sw, [sink, _, _]) = incast(4_000_000, 1);
    sim.run_until(FAR, 1_000_000);
    assert_eq!(sim.switch_stats(sw).dropped(), 0);
    assert_eq!(sim.node(sink).received.len(), 2000);
}

#[test]
fn learning_switch_floods_then_learns() {
    let mut sim = Sim::new(1);
    let sw = sim.add_switch(SwitchConfig::default());
    let link = LinkConfig::default();
    // 1 sends to 2 after 2 has spoken once (to 1, flooded to 3 as well since 1 is unknown yet).
    let n2 = sim.add_node(Blaster::new(2, 1, 64, 1, Duration::ZERO));
    sim.connect_to_switch(n2, sw, link.clone());
    sim.run_until(Instant::from_nanos(100_000), 1_000);
    let n1 = sim.add_node(Blaster::new(1, 2, 64, 5, Duration::ZERO));
    let n3 = sim.add_node(Blaster::new(3, 1, 64, 0, Duration::ZERO));
    sim.connect_to_switch(n1, sw, link.clone());
    sim.connect_to_switch(n3, sw, link);
    sim.run_until(FAR, 10_000);
    assert_eq!(sim.node(n2).received.len(), 5);
    // Node 3 would have panicked on a frame for someone else; it got none.
    assert!(sim.node(n3).received.is_empty());
}

#[test]
fn static_switch_drops_unknown_destinations() {
    let mut sim = Sim::new(1);
    let sw = sim.add_switch(SwitchConfig { forwarding: Forwarding::Static, ..Default::default() });
    let n1 = sim.add_node(Blaster::new(1, 2, 64, 3, Duration::ZERO));
    let n2 = sim.add_node(Blaster::new(2, 7, 64, 4, Duration::ZERO));
    sim.connect_to_switch(n1, sw, LinkConfig::default());
    let p2 = sim.connect_to_switch(n2, sw, LinkConfig::default());
    sim.add_route(sw, MacAddr([2, 0, 0, 0, 0, 2]), p2);
    sim.run_until(FAR, 10_000);
    assert_eq!(sim.node(n2).received.len(), 3);
    assert_eq!(sim.switch_stats(sw).unknown_destination, 4);
}

#[test]
fn random_loss_at_its_rate_and_deterministic() {
    let run = |seed| {
        let mut sim = Sim::new(seed);
        let a = sim.add_node(Blaster::new(1, 2, 64, 20_000, Duration::ZERO));
        let b = sim.add_node(Blaster::new(2, 1, 64, 0, Duration::ZERO));
        sim.connect_nodes(a, b, LinkConfig { loss: 0.1, ..Default::default() });
        sim.run_until(FAR, 1_000_000);
        (sim.uplink_stats(a).unwrap().lost, sim.node(b).received.clone())
    };
    let (lost, got) = run(5);
    assert!((1800..2200).contains(&lost), "{lost}");
    assert_eq!(got.len() as u64 + lost, 20_000);
    assert_eq!(run(5), (lost, got.clone()));
    assert_ne!(run(6).1, got);
}

#[test]
fn runs_are_bounded() {
    let mut sim = Sim::new(1);
    let a = sim.add_node(Blaster::new(1, 2, 64, 1_000, Duration::ZERO));
    let b = sim.add_node(Blaster::new(2, 1, 64, 0, Duration::ZERO));
    sim.connect_nodes(a, b, LinkConfig::default());
    assert_eq!(sim.run_until(FAR, 10), Stop::EventCap);
    assert_eq!(sim.run_until(Instant::from_nanos(5_000), u64::MAX), Stop::Deadline);
    assert_eq!(sim.now(), Instant::from_nanos(5_000));
    assert_eq!(sim.run_while(FAR, u64::MAX, |s| s.node(b).received.len() < 100), Stop::Condition);
    assert_eq!(sim.node(b).received.len(), 100);
}

#[test]
fn pacing_faster_than_the_line_does_not_spin() {
    // The node's pacing deadline passes while its line is still busy: the engine must wait for
    // the line, not fire the timer again and again at the same instant.
    let mut sim = Sim::new(1);
    let a = sim.add_node(Blaster::new(1, 2, 125, 50, Duration::from_nanos(100)));
    let b = sim.add_node(Blaster::new(2, 1, 125, 0, Duration::ZERO));
    let link = LinkConfig { rate_bps: 1_000_000_000, delay: Duration::ZERO, loss: 0.0, overhead_bytes: 0 };
    sim.connect_nodes(a, b, link);
    assert_eq!(sim.run_until(FAR, 10_000), Stop::Idle);
    assert_eq!(sim.node(b).received.len(), 50);
    assert!(sim.events() < 1_000, "{} events for 50 frames", sim.events());
}
