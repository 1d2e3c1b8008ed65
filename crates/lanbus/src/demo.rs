//! `lanbus demo`: the main job until the PCIe path exists. Two transport endpoints on two threads,
//! joined by the simulated wire (10 Gbit/s, 10 µs, 1% loss each way) on the real clock; one sends
//! for a moment, the other checks every message; then a table of goodput, retransmissions and
//! latency. Exits 0 only if every message arrived once, in order, intact.
//!
//! This is the same driver loop a daemon runs over a real port: receive a burst, feed the core,
//! drain its polls, transmit a burst, and block in `Port::wait` when idle.

use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use lanbus_port::sim::{SimPort, SimWire, SimWireConfig};
use lanbus_port::Port;
use lanbus_sim::scenario::host_mac;
use lanbus_sim::stats::Samples;
use lanbus_transport::{Config, Counters, Endpoint, SendError};
use lanbus_wire::{Clock, Instant, MacAddr, MonotonicClock};

/// Arguments of `lanbus demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// How long the sender offers messages, in ms.
    #[arg(long, default_value_t = 1500)]
    duration_ms: u64,
    /// Message size in bytes (at least 16).
    #[arg(long, default_value_t = 1024)]
    size: usize,
    /// Probability that the wire loses a frame, each way.
    #[arg(long, default_value_t = 0.01)]
    loss: f64,
    /// Messages the sender keeps in its send queue at most (bounds the queueing in the latency).
    #[arg(long, default_value_t = 64)]
    in_flight: usize,
    /// Seed of the wire's loss decisions.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// What the sender reports back.
struct SenderResult {
    sent: u64,
    counters: Counters,
}

/// What the receiver reports back.
struct ReceiverResult {
    delivered: u64,
    bad: u64,
    bytes: u64,
    latency_us: Samples,
    first: Option<Instant>,
    last: Option<Instant>,
}

/// The bytes of demo message `index` of `size` bytes, sent at `sent_ns`.
fn fill(buf: &mut Vec<u8>, index: u64, sent_ns: u64, size: usize) {
    buf.clear();
    buf.extend_from_slice(&index.to_be_bytes());
    buf.extend_from_slice(&sent_ns.to_be_bytes());
    buf.extend((16..size).map(|j| lanbus_sim::host::stream_byte(index, j)));
}

/// Runs the demo.
pub fn run(a: DemoArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.size >= 16 && a.size <= 65_536, "--size must be 16..=65536 bytes");
    anyhow::ensure!((0.0..0.5).contains(&a.loss), "--loss must be in 0..0.5");
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let (a_mac, b_mac) = (host_mac(1), host_mac(2));
    let wire = SimWireConfig {
        rate_bps: 10_000_000_000,
        delay: Duration::from_micros(10),
        loss: a.loss,
        seed: a.seed,
        ..SimWireConfig::default()
    };
    let (pa, pb) = SimWire::pair_realtime(wire, clock.clone(), [a_mac, b_mac])?;
    let config = Config::point_to_point();
    let stop_offering = clock.now() + Duration::from_millis(a.duration_ms);
    let give_up = stop_offering + Duration::from_secs(5);
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));

    let sender = {
        let (clock, config, done) = (clock.clone(), config.clone(), done.clone());
        let (size, in_flight) = (a.size, a.in_flight);
        std::thread::spawn(move || {
            sender(pa, b_mac, clock, config, size, in_flight, stop_offering, give_up, &done)
        })
    };
    let receiver = {
        let (clock, config, done) = (clock.clone(), config.clone(), done.clone());
        let size = a.size;
        std::thread::spawn(move || receiver(pb, a_mac, clock, config, size, give_up, &done))
    };
    let s = sender.join().map_err(|_| anyhow::anyhow!("the sender thread panicked"))?;
    let r = receiver.join().map_err(|_| anyhow::anyhow!("the receiver thread panicked"))?;
    let mut lat = r.latency_us;
    let span = match (r.first, r.last) {
        (Some(f), Some(l)) if l > f => (l - f).as_secs_f64(),
        _ => f64::NAN,
    };
    let ok = r.delivered == s.sent && r.bad == 0 && s.sent > 0;
    println!(
        "lanbus demo: two transport endpoints on two threads over a simulated 10 Gbit/s wire, 10 us, {}% loss each way",
        a.loss * 100.0
    );
    let rows: Vec<(&str, String)> = vec![
        ("messages sent", format!("{} x {} B", s.sent, a.size)),
        ("messages delivered intact", format!("{}", r.delivered)),
        ("messages bad (order/content)", format!("{}", r.bad)),
        ("goodput", format!("{:.3} Gbit/s", r.bytes as f64 * 8.0 / span / 1e9)),
        ("data frames sent", format!("{}", s.counters.data_frames_sent)),
        ("retransmitted frames", format!("{}", s.counters.retransmitted_frames)),
        ("fast retransmits / timeouts", format!("{} / {}", s.counters.fast_retransmits, s.counters.timeouts)),
        ("latency p50", format!("{:.1} us", lat.percentile(50.0).unwrap_or(f64::NAN))),
        ("latency p99", format!("{:.1} us", lat.percentile(99.0).unwrap_or(f64::NAN))),
        ("latency max", format!("{:.1} us", lat.max().unwrap_or(f64::NAN))),
    ];
    let w = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    let v = rows.iter().map(|r| r.1.len()).max().unwrap_or(0);
    println!("+-{}-+-{}-+", "-".repeat(w), "-".repeat(v));
    for (k, val) in &rows {
        println!("| {k:<w$} | {val:>v$} |");
    }
    println!("+-{}-+-{}-+", "-".repeat(w), "-".repeat(v));
    println!(
        "(latency: from send() to delivery, through the sender's queue of at most {} messages)",
        a.in_flight
    );
    if ok {
        println!("ok: all {} messages delivered once, in order, intact", s.sent);
        Ok(())
    } else {
        anyhow::bail!("{} of {} messages delivered intact, {} bad", r.delivered, s.sent, r.bad)
    }
}

#[allow(clippy::too_many_arguments)]
fn sender(
    mut port: SimPort,
    peer: MacAddr,
    clock: Arc<dyn Clock>,
    config: Config,
    size: usize,
    in_flight: usize,
    stop_offering: Instant,
    give_up: Instant,
    done: &std::sync::atomic::AtomicBool,
) -> SenderResult {
    let mut ep = Endpoint::new(config, port.mac(), clock.now());
    let mut next = 0u64;
    let mut buf = Vec::with_capacity(size);
    // Frames per message, to turn the queue bound into frames.
    let frames_per_msg = size.div_ceil(ep.config().mtu - 40).max(1);
    loop {
        let now = clock.now();
        let mut work = port.rx_burst(64, &mut |f| ep.handle_frame(now, f)).unwrap_or(0) > 0;
        if ep.poll_timeout().is_some_and(|t| t <= now) {
            ep.handle_timeout(now);
        }
        if now < stop_offering {
            while ep.send_half().queued_frames(peer, 0) < in_flight * frames_per_msg {
                fill(&mut buf, next, now.as_nanos(), size);
                match ep.send(now, peer, 0, &buf) {
                    Ok(()) => {
                        next += 1;
                        work = true;
                    }
                    Err(SendError::QueueFull) => break,
                    Err(e) => panic!("demo message refused: {e}"),
                }
            }
        } else if ep.is_idle() || now > give_up {
            break;
        }
        work |= port.tx_burst(64, &mut |b| ep.poll_transmit(now, b)).unwrap_or(0) > 0;
        if !work {
            let wake = ep.poll_timeout().map_or(Duration::from_millis(1), |t| t - now);
            let _ = port.wait(Some(wake.min(Duration::from_millis(1))));
        }
    }
    done.store(true, std::sync::atomic::Ordering::Release); // pairs with the receiver's Acquire load
    SenderResult { sent: next, counters: ep.counters() }
}

fn receiver(
    mut port: SimPort,
    peer: MacAddr,
    clock: Arc<dyn Clock>,
    config: Config,
    size: usize,
    give_up: Instant,
    done: &std::sync::atomic::AtomicBool,
) -> ReceiverResult {
    let mut ep = Endpoint::new(config, port.mac(), clock.now());
    let mut r = ReceiverResult {
        delivered: 0,
        bad: 0,
        bytes: 0,
        latency_us: Samples::new(),
        first: None,
        last: None,
    };
    let mut expect = 0u64;
    let mut check = Vec::with_capacity(size);
    loop {
        let now = clock.now();
        let mut work = port.rx_burst(64, &mut |f| ep.handle_frame(now, f)).unwrap_or(0) > 0;
        if ep.poll_timeout().is_some_and(|t| t <= now) {
            ep.handle_timeout(now);
        }
        while let Some(m) = ep.poll_message() {
            work = true;
            let d = m.data;
            let index = d.get(..8).map_or(u64::MAX, |h| u64::from_be_bytes(h.try_into().unwrap_or_default()));
            let sent = d.get(8..16).map_or(0, |h| u64::from_be_bytes(h.try_into().unwrap_or_default()));
            fill(&mut check, index, sent, size);
            if m.peer != peer || index != expect || check != d {
                r.bad += 1;
                continue;
            }
            expect += 1;
            r.delivered += 1;
            r.bytes += d.len() as u64;
            r.first.get_or_insert(now);
            r.last = Some(now);
            r.latency_us.push(now.as_nanos().saturating_sub(sent) as f64 / 1e3);
        }
        work |= port.tx_burst(64, &mut |b| ep.poll_transmit(now, b)).unwrap_or(0) > 0;
        // Acquire: pairs with the sender's Release store, after which it sends nothing more.
        if done.load(std::sync::atomic::Ordering::Acquire) && ep.is_idle() && port.rx_pending() == 0 {
            break;
        }
        if now > give_up {
            break;
        }
        if !work {
            let wake = ep.poll_timeout().map_or(Duration::from_millis(1), |t| t - now);
            let _ = port.wait(Some(wake.min(Duration::from_millis(1))));
        }
    }
    r
}
