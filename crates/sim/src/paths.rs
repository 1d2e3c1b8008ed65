//! Several paths between two hosts: the real transport over the real multipath layer
//! ([`MultiPort`]), each path a simulated wire of its own rate, delay and loss, all on one logical
//! clock.
//!
//! Host A sends to host B, whose transport answers with its ACKs; every path is a
//! [`SimWire`] pair, and a path may be cut at a set time (its frames then vanish both ways, as
//! with a pulled cable). Two experiments: [`transfer`] measures the goodput of a bulk transfer;
//! [`latency`] the delivery time of 4 KiB messages sent at a steady rate. Both run in steps of one
//! microsecond of simulated time, deterministically for a seed.

use std::sync::Arc;
use std::time::Duration;

use lanbus_port::{MultiConfig, MultiPort, Port, PortCounters, SimPort, SimWire, SimWireConfig};
use lanbus_transport::{Config, Endpoint, SendError};
use lanbus_wire::{Clock, Instant, MacAddr, ManualClock};

use crate::stats::Samples;

/// One path between the two hosts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PathSpec {
    /// Line rate each way.
    pub rate_bps: u64,
    /// One-way delay.
    pub delay: Duration,
    /// Probability that a frame is lost, each way.
    pub loss: f64,
    /// When the path is cut for good (from the start of the run), if it is.
    pub cut_at: Option<Duration>,
}

impl PathSpec {
    /// A clean path of `rate_bps` and `delay`.
    pub fn clean(rate_bps: u64, delay: Duration) -> PathSpec {
        PathSpec { rate_bps, delay, loss: 0.0, cut_at: None }
    }
}

/// What a run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct PathsReport {
    /// Bytes delivered to B in order.
    pub bytes: u64,
    /// Simulated time from the first message to the last delivery.
    pub elapsed: Duration,
    /// Frames the transport sent again (all causes).
    pub retransmitted: u64,
    /// Frames sent again because a path failed.
    pub path_resends: u64,
    /// Paths A took down.
    pub failovers: u64,
    /// Frames A sent by each path.
    pub tx_per_path: Vec<u64>,
    /// Delivery times of messages (latency runs only), µs.
    pub latency_us: Samples,
    /// A's paths at the end.
    pub paths: Vec<lanbus_port::PathReport>,
}

impl PathsReport {
    /// Goodput, bits per second.
    pub fn goodput_bps(&self) -> f64 {
        self.bytes as f64 * 8.0 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// A port that loses everything from a set time on (the wire's cable pulled).
struct Cuttable {
    port: SimPort,
    clock: Arc<dyn Clock>,
    cut_at: Option<Instant>,
}

impl Cuttable {
    fn cut(&self) -> bool {
        self.cut_at.is_some_and(|t| self.clock.now() >= t)
    }
}

impl Port for Cuttable {
    fn rx_burst(&mut self, max: usize, on_frame: &mut dyn FnMut(&[u8])) -> lanbus_port::Result<usize> {
        if self.cut() {
            return self.port.rx_burst(max, &mut |_| {}).map(|_| 0);
        }
        self.port.rx_burst(max, on_frame)
    }

    fn tx_burst(
        &mut self,
        max: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>,
    ) -> lanbus_port::Result<usize> {
        if self.cut() {
            let mut buf = vec![0u8; self.port.frame_capacity()];
            let mut n = 0;
            while n < max && fill(&mut buf).is_some() {
                n += 1;
            }
            return Ok(n);
        }
        self.port.tx_burst(max, fill)
    }

    fn wait(&mut self, timeout: Option<Duration>) -> lanbus_port::Result<()> {
        self.port.wait(timeout)
    }

    fn mtu(&self) -> usize {
        self.port.mtu()
    }

    fn mac(&self) -> MacAddr {
        self.port.mac()
    }

    fn counters(&self) -> PortCounters {
        self.port.counters()
    }
}

struct Side {
    ep: Endpoint,
    port: MultiPort,
    buf: Vec<u8>,
}

impl Side {
    /// Receives what arrived, serves failed paths and timers; calls `on_message` per message.
    fn receive(&mut self, now: Instant, on_message: &mut dyn FnMut(&[u8])) {
        let ep = &mut self.ep;
        let _ = self.port.rx_burst(256, &mut |f| ep.handle_frame(now, f));
        while let Some(peer) = self.port.take_failed_peer() {
            self.ep.resend_in_flight(peer);
        }
        if self.ep.poll_timeout().is_some_and(|t| t <= now) {
            self.ep.handle_timeout(now);
        }
        while let Some(m) = self.ep.poll_message() {
            on_message(m.data);
        }
    }

    fn transmit(&mut self, now: Instant) {
        let (ep, buf) = (&mut self.ep, &mut self.buf);
        for _ in 0..64 {
            let Some(n) = ep.poll_transmit(now, buf) else { break };
            if self.port.send_frames(&[&buf[..n]]).unwrap_or(0) == 0 {
                break;
            }
        }
    }
}

/// How the simulated hosts watch their paths. Tighter than a daemon's default: a simulated host's
/// threads never wait for a core, so a path silent for half a millisecond (a dozen round trips
/// here) is down, where a daemon on a loaded machine waits 6 ms before it believes so.
pub const SIM_PATHS: MultiConfig = MultiConfig {
    probe_every: Duration::from_micros(100),
    announce_every: Duration::from_millis(10),
    silence_limit: Duration::from_micros(500),
};

const MAC_A: u8 = 0xa0;
const MAC_B: u8 = 0xb0;

fn mac(host: u8, path: usize) -> MacAddr {
    MacAddr([0x02, 0x1b, 0x70, 0, host, path as u8])
}

fn build(paths: &[PathSpec], seed: u64) -> (Arc<ManualClock>, Side, Side) {
    let clock = Arc::new(ManualClock::new());
    let dyn_clock: Arc<dyn Clock> = clock.clone();
    let mut a_ports: Vec<Box<dyn Port>> = Vec::new();
    let mut b_ports: Vec<Box<dyn Port>> = Vec::new();
    for (i, p) in paths.iter().enumerate() {
        let config = SimWireConfig {
            rate_bps: p.rate_bps,
            delay: p.delay,
            loss: p.loss,
            seed: seed.wrapping_add(i as u64 * 7919),
            tx_queue_bytes: 256 << 10,
            ..SimWireConfig::default()
        };
        let (a, b) =
            SimWire::pair(config, dyn_clock.clone(), [mac(MAC_A, i), mac(MAC_B, i)]).expect("a valid wire");
        let cut_at = p.cut_at.map(|d| Instant::ZERO + d);
        a_ports.push(Box::new(Cuttable { port: a, clock: dyn_clock.clone(), cut_at }));
        b_ports.push(Box::new(Cuttable { port: b, clock: dyn_clock.clone(), cut_at }));
    }
    let rate: u64 = paths.iter().map(|p| p.rate_bps).sum();
    let mut config = Config::point_to_point();
    config.rate.line_rate_bps = rate;
    config.dup_ack_threshold = lanbus_port::multi::RUN_FRAMES;
    config.min_rto = Duration::from_millis(5);
    let side = |ports, host| {
        let port = MultiPort::with_clock(ports, SIM_PATHS, dyn_clock.clone()).expect("two paths or more");
        let ep = Endpoint::new(config.clone(), mac(host, 0), Instant::ZERO);
        Side { ep, port, buf: vec![0u8; config.frame_capacity()] }
    };
    let a = side(a_ports, MAC_A);
    let b = side(b_ports, MAC_B);
    (clock, a, b)
}

fn report(a: &Side, bytes: u64, elapsed: Duration, latency_us: Samples) -> PathsReport {
    let c = a.ep.counters();
    let paths = a.port.paths();
    let mut tx_per_path = vec![0; paths.iter().map(|p| p.port + 1).max().unwrap_or(0)];
    for p in &paths {
        tx_per_path[p.port] += p.tx_frames;
    }
    PathsReport {
        bytes,
        elapsed,
        retransmitted: c.retransmitted_frames,
        path_resends: c.path_resends,
        failovers: paths.iter().map(|p| p.failovers).sum(),
        tx_per_path,
        latency_us,
        paths,
    }
}

/// Sends `bytes` from A to B in 64 KiB messages over `paths`; the run ends at the last delivery
/// or after `limit` of simulated time.
pub fn transfer(paths: &[PathSpec], bytes: u64, seed: u64, limit: Duration) -> PathsReport {
    let (clock, mut a, mut b) = build(paths, seed);
    let msg = vec![0x5au8; 64 << 10];
    let (mut queued, mut delivered) = (0u64, 0u64);
    let step = Duration::from_micros(1);
    let end = Instant::ZERO + limit;
    while delivered < bytes && clock.now() < end {
        let now = clock.now();
        a.receive(now, &mut |_| {});
        b.receive(now, &mut |m| delivered += m.len() as u64);
        while queued < bytes {
            match a.ep.send(now, mac(MAC_B, 0), 1, &msg) {
                Ok(()) => queued += msg.len() as u64,
                Err(SendError::QueueFull) => break,
                Err(e) => panic!("sending: {e}"),
            }
        }
        a.transmit(now);
        b.transmit(now);
        clock.advance(step);
    }
    let elapsed = clock.now().saturating_duration_since(Instant::ZERO);
    report(&a, delivered, elapsed, Samples::default())
}

/// Sends `count` messages of `size` bytes from A to B, one every `every`, and measures each one's
/// delivery time.
pub fn latency(paths: &[PathSpec], size: usize, count: u64, every: Duration, seed: u64) -> PathsReport {
    let (clock, mut a, mut b) = build(paths, seed);
    let step = Duration::from_micros(1);
    let mut sent_at: Vec<Instant> = Vec::with_capacity(count as usize);
    let mut lat = Samples::default();
    let mut bytes = 0u64;
    let mut next = Instant::ZERO + Duration::from_millis(1);
    let limit = Instant::ZERO + every * (count as u32 + 100) + Duration::from_secs(1);
    while (lat.len() as u64) < count && clock.now() < limit {
        let now = clock.now();
        a.receive(now, &mut |_| {});
        b.receive(now, &mut |m| {
            let i = u64::from_be_bytes(m[..8].try_into().expect("8 bytes")) as usize;
            lat.push(now.saturating_duration_since(sent_at[i]).as_secs_f64() * 1e6);
            bytes += m.len() as u64;
        });
        if (sent_at.len() as u64) < count && now >= next {
            let mut msg = vec![0u8; size.max(8)];
            msg[..8].copy_from_slice(&(sent_at.len() as u64).to_be_bytes());
            if a.ep.send(now, mac(MAC_B, 0), 1, &msg).is_ok() {
                sent_at.push(now);
                next += every;
            }
        }
        a.transmit(now);
        b.transmit(now);
        clock.advance(step);
    }
    let elapsed = clock.now().saturating_duration_since(Instant::ZERO);
    report(&a, bytes, elapsed, lat)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GBIT: u64 = 1_000_000_000;

    fn path(delay_us: u64) -> PathSpec {
        PathSpec::clean(GBIT, Duration::from_micros(delay_us))
    }

    #[test]
    fn four_paths_with_one_at_five_percent_loss_keep_the_goodput_of_three_clean_ones() {
        let limit = Duration::from_secs(2);
        let bytes = 24 << 20;
        let three = transfer(&[path(10), path(20), path(30)], bytes, 1, limit);
        let lossy = PathSpec { loss: 0.05, ..path(15) };
        let four = transfer(&[path(10), path(20), path(30), lossy], bytes, 1, limit);
        assert_eq!((three.bytes, four.bytes), (bytes, bytes), "{three:?} {four:?}");
        let ratio = four.goodput_bps() / three.goodput_bps();
        assert!(ratio >= 0.9, "four paths, one lossy: {ratio:.2}x three clean ({four:?} against {three:?})");
        assert!(
            four.tx_per_path[3] < four.tx_per_path[0],
            "the lossy path carries less: {:?}",
            four.tx_per_path
        );
    }

    #[test]
    fn with_one_path_cut_the_tail_latency_of_4k_messages_stays_within_3x() {
        let every = Duration::from_micros(50);
        let paths = [path(10), path(10), path(10), path(10)];
        let mut clean = latency(&paths, 4096, 2000, every, 2);
        let mut cut_paths = paths;
        cut_paths[1].cut_at = Some(Duration::from_millis(40));
        let mut cut = latency(&cut_paths, 4096, 2000, every, 2);
        assert_eq!(cut.failovers, 1, "{cut:?}");
        assert!(cut.path_resends > 0, "the frames in flight went again");
        let p99_clean = clean.latency_us.percentile(99.0).expect("samples");
        let p99_cut = cut.latency_us.percentile(99.0).expect("samples");
        assert!(
            p99_cut <= 3.0 * p99_clean,
            "p99 {p99_cut:.1} µs with a path cut against {p99_clean:.1} µs without"
        );
    }
}
