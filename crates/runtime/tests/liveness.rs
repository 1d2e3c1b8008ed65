//! Liveness from traffic on a real port: a sender whose heartbeats are suppressed stays up at its
//! peer for a whole 1 GiB transfer, because every frame it sends is a sign of life, and is
//! declared down once it falls silent. Needs root (a veth pair between two namespaces); without
//! it the test says why and returns.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lanbus_port::netns::VethPair;
use lanbus_port::{Port, Result as PortResult};
use lanbus_runtime::{Handler, Outbox, Runtime, RuntimeConfig};
use lanbus_transport::{Config, Event, Message};
use lanbus_wire::ethernet::HEADER_LEN as ETH_LEN;
use lanbus_wire::frame::Kind;
use lanbus_wire::MacAddr;

const CHANNEL: u16 = 5;
const MESSAGE: usize = 64 * 1024;
const MESSAGES: u64 = 16 * 1024; // 1 GiB

/// A port that, once `muffled` is set, drops the heartbeats it is asked to send (and nothing else).
struct Muffled {
    inner: Box<dyn Port>,
    muffled: Arc<AtomicBool>,
}

fn is_heartbeat(frame: &[u8]) -> bool {
    frame.len() > ETH_LEN + 1
        && frame[12..14] == [0x88, 0xb5]
        && Kind::from(frame[ETH_LEN + 1]) == Kind::Heartbeat
}

// Only the transmit path is Muffled's; everything else forwards to the inner port.
impl lanbus_port::Layer for Muffled {
    type Inner = Box<dyn Port>;
    /// Heartbeats are dropped in `tx_burst`, so every frame sent must pass through it.
    const REWRITES_TX: bool = true;

    fn inner(&self) -> &Box<dyn Port> {
        &self.inner
    }
    fn inner_mut(&mut self) -> &mut Box<dyn Port> {
        &mut self.inner
    }
    fn tx_burst(
        &mut self,
        max: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>,
    ) -> PortResult<usize> {
        let muffled = self.muffled.load(Ordering::Relaxed);
        Port::tx_burst(&mut self.inner, max, &mut |buf| loop {
            let len = fill(buf)?;
            if !(muffled && is_heartbeat(&buf[..len])) {
                return Some(len);
            }
        })
    }
}

#[derive(Default)]
struct Seen {
    messages: u64,
    bad: u64,
    events: Vec<(Instant, Event)>,
}

/// Counts the messages that arrive in order with the right length, and records peer events.
struct Watch(Arc<Mutex<Seen>>);

impl Handler for Watch {
    fn on_message(&mut self, m: Message<'_>, _out: &mut dyn Outbox) {
        let mut s = self.0.lock().unwrap();
        let index = m.data.get(..8).map(|b| u64::from_be_bytes(b.try_into().unwrap()));
        if m.channel != CHANNEL || m.data.len() != MESSAGE || index != Some(s.messages) {
            s.bad += 1;
        }
        s.messages += 1;
    }
    fn on_event(&mut self, event: &Event, _out: &mut dyn Outbox) {
        self.0.lock().unwrap().events.push((Instant::now(), event.clone()));
    }
}

fn went_down(seen: &Mutex<Seen>, peer: MacAddr) -> Option<Instant> {
    seen.lock()
        .unwrap()
        .events
        .iter()
        .find_map(|(t, e)| matches!(e, Event::PeerDown { peer: p } if *p == peer).then_some(*t))
}

fn is_up(seen: &Mutex<Seen>, peer: MacAddr) -> bool {
    seen.lock().unwrap().events.iter().any(|(_, e)| matches!(e, Event::PeerUp { peer: p, .. } if *p == peer))
}

#[test]
fn a_gibibyte_without_heartbeats_is_never_taken_for_a_dead_peer() {
    let pair = match VethPair::create() {
        Ok(p) => p,
        Err(skip) => {
            eprintln!("liveness: {skip}");
            return;
        }
    };
    pair.set_mtu(9000).unwrap();
    let (sa, sb) = (format!("afpacket:{}", pair.a.ifname), format!("afpacket:{}", pair.b.ifname));
    let a = pair
        .a
        .netns
        .run(move || sa.parse::<lanbus_port::PortSpec>().and_then(|s| s.open()))
        .unwrap()
        .unwrap();
    let b = pair
        .b
        .netns
        .run(move || sb.parse::<lanbus_port::PortSpec>().and_then(|s| s.open()))
        .unwrap()
        .unwrap();
    let (a_mac, b_mac) = (a.mac(), b.mac());
    // A peer is down after 3 silent heartbeat intervals of 10 ms: 30 ms without a frame.
    let mut transport = Config { mtu: 65_535, ..Config::default() };
    transport.heartbeat.interval = Duration::from_millis(10);
    transport.heartbeat.missed_limit = 3;
    let config = |name: &str| RuntimeConfig {
        transport: transport.clone(),
        name: name.into(),
        ..RuntimeConfig::default()
    };
    let muffled = Arc::new(AtomicBool::new(false));
    let a = Box::new(Muffled { inner: a, muffled: muffled.clone() });
    let (at_a, at_b) = (Arc::new(Mutex::new(Seen::default())), Arc::new(Mutex::new(Seen::default())));
    let rb = Runtime::start(b, config("b"), Box::new(Watch(at_b.clone()))).unwrap();
    let ra = Runtime::start(a, config("a"), Box::new(Watch(at_a.clone()))).unwrap();
    let started = Instant::now();
    while !(is_up(&at_b, a_mac) && is_up(&at_a, b_mac)) {
        assert!(started.elapsed() < Duration::from_secs(10), "the peers never heard each other");
        std::thread::sleep(Duration::from_millis(5));
    }
    // From now on a sends no heartbeat: only its DATA frames say it is alive.
    muffled.store(true, Ordering::Relaxed);
    let sender = ra.sender();
    let mut message = vec![0u8; MESSAGE];
    let (mut queued, transfer) = (0u64, Instant::now());
    loop {
        let delivered = at_b.lock().unwrap().messages;
        if delivered >= MESSAGES {
            break;
        }
        assert!(
            transfer.elapsed() < Duration::from_secs(120),
            "only {delivered} of {MESSAGES} messages in 120 s: {:?} / {:?}",
            ra.stats(),
            rb.stats()
        );
        if queued < MESSAGES && queued - delivered < 64 {
            for i in queued..(queued + 16).min(MESSAGES) {
                message[..8].copy_from_slice(&i.to_be_bytes());
                sender.send(b_mac, CHANNEL, &message);
            }
            queued = (queued + 16).min(MESSAGES);
        } else {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    let took = transfer.elapsed();
    let seen = at_b.lock().unwrap().bad;
    assert_eq!(seen, 0, "messages out of order or cut");
    assert!(ra.wait_idle(Duration::from_secs(5)), "the sender never saw its last ACK");
    let done = Instant::now();
    assert_eq!(went_down(&at_b, a_mac), None, "a was declared down during the transfer ({took:?})");
    eprintln!(
        "liveness: 1 GiB in {:.2} s with a's heartbeats suppressed, {} frames from a",
        took.as_secs_f64(),
        ra.stats().transport.frames_sent
    );
    // Silent now, a is declared down within its lifetime (and some scheduling slack): the test
    // above could have failed.
    while went_down(&at_b, a_mac).is_none() {
        assert!(done.elapsed() < Duration::from_secs(2), "a, silent, was never declared down");
        std::thread::sleep(Duration::from_millis(5));
    }
    let after = went_down(&at_b, a_mac).unwrap().saturating_duration_since(done);
    eprintln!("liveness: a silent peer was declared down {after:?} after its last frame was acknowledged");
    assert!(went_down(&at_a, b_mac).is_none(), "b, still sending heartbeats, was declared down");
    ra.shutdown();
    rb.shutdown();
}
