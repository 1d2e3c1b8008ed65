//! The runtime over an in-memory port pair that drops frames on a fixed schedule: every message
//! arrives once, in order, intact, in both thread models.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use lanbus_port::{Port, PortCounters};
use lanbus_transport::{Config, Message};
use lanbus_wire::MacAddr;

use super::*;

#[derive(Default)]
struct Queue {
    frames: Mutex<VecDeque<Vec<u8>>>,
    ready: Condvar,
}

/// One end of an in-memory link; every `drop_every`-th frame it sends is lost.
struct MemPort {
    mac: MacAddr,
    rx: Arc<Queue>,
    tx: Arc<Queue>,
    drop_every: u64,
    sent: u64,
    counters: PortCounters,
}

fn mem_pair(drop_every: u64) -> (MemPort, MemPort) {
    let (q1, q2) = (Arc::new(Queue::default()), Arc::new(Queue::default()));
    let a = MemPort {
        mac: MacAddr::local(1),
        rx: q1.clone(),
        tx: q2.clone(),
        drop_every,
        sent: 0,
        counters: Default::default(),
    };
    let b =
        MemPort { mac: MacAddr::local(2), rx: q2, tx: q1, drop_every, sent: 0, counters: Default::default() };
    (a, b)
}

impl Port for MemPort {
    fn rx_burst(&mut self, max: usize, on_frame: &mut dyn FnMut(&[u8])) -> lanbus_port::Result<usize> {
        let mut n = 0;
        while n < max {
            let Some(f) = lock(&self.rx.frames).pop_front() else { break };
            on_frame(&f);
            self.counters.rx_frames += 1;
            n += 1;
        }
        Ok(n)
    }

    fn tx_burst(
        &mut self,
        max: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>,
    ) -> lanbus_port::Result<usize> {
        let mut buf = vec![0u8; self.frame_capacity()];
        let mut n = 0;
        while n < max {
            let Some(len) = fill(&mut buf) else { break };
            self.sent += 1;
            n += 1;
            self.counters.tx_frames += 1;
            if self.drop_every != 0 && self.sent.is_multiple_of(self.drop_every) {
                continue;
            }
            lock(&self.tx.frames).push_back(buf[..len].to_vec());
            self.tx.ready.notify_one();
        }
        Ok(n)
    }

    fn wait(&mut self, timeout: Option<Duration>) -> lanbus_port::Result<()> {
        let q = lock(&self.rx.frames);
        if q.is_empty() {
            let _ = self.rx.ready.wait_timeout(q, timeout.unwrap_or(Duration::from_secs(1)));
        }
        Ok(())
    }

    fn mtu(&self) -> usize {
        1500
    }

    fn mac(&self) -> MacAddr {
        self.mac
    }

    fn counters(&self) -> PortCounters {
        self.counters
    }
}

/// Forwards every message to a channel; optionally echoes it back.
struct Forward {
    to: mpsc::Sender<(MacAddr, u16, Vec<u8>)>,
    echo: bool,
}

impl Handler for Forward {
    fn on_message(&mut self, m: Message<'_>, out: &mut dyn Outbox) {
        if self.echo {
            out.send(m.peer, m.channel, m.data);
        }
        let _ = self.to.send((m.peer, m.channel, m.data.to_vec()));
    }
}

fn config(mode: ThreadMode) -> RuntimeConfig {
    RuntimeConfig { transport: Config::point_to_point(), threads: mode, ..RuntimeConfig::default() }
}

fn payload(i: u32) -> Vec<u8> {
    let len = 1 + (i as usize * 7919) % 3000;
    (0..len).map(|k| (i as usize + k) as u8).chain(i.to_be_bytes()).collect()
}

/// Two nodes over an in-memory wire (dropping every `drop_every`th frame, 0: none) whose handlers
/// forward what they receive; returns A, B and what B received (A's receiver is dropped: what A
/// receives is discarded).
fn forward_pair(mode: ThreadMode, drop_every: u64) -> (Runtime, Runtime, Received) {
    let (pa, pb) = mem_pair(drop_every);
    let (ta, _) = mpsc::channel();
    let (tb, rb) = mpsc::channel();
    let a = Runtime::start(Box::new(pa), config(mode), Box::new(Forward { to: ta, echo: false })).unwrap();
    let b = Runtime::start(Box::new(pb), config(mode), Box::new(Forward { to: tb, echo: false })).unwrap();
    (a, b, rb)
}

type Received = mpsc::Receiver<(MacAddr, u16, Vec<u8>)>;

fn one_way(mode: ThreadMode, messages: u32) {
    let (a, b, rb) = forward_pair(mode, 97);
    // In caller mode, the users' threads run the nodes' turns as they poll.
    let stop = Arc::new(AtomicBool::new(false));
    let (a, b) = (Arc::new(a), Arc::new(b));
    let pollers: Vec<_> = [a.clone(), b.clone()]
        .into_iter()
        .filter(|_| mode == ThreadMode::Caller)
        .map(|node| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if node.poll() == 0 {
                        std::thread::yield_now();
                    }
                }
            })
        })
        .collect();
    let sender = a.sender();
    for i in 0..messages {
        sender.send(b.local_mac(), (i % 3) as u16, &payload(i));
    }
    let mut next = [0u32; 3];
    for _ in 0..messages {
        let (peer, channel, data) = rb.recv_timeout(Duration::from_secs(30)).expect("message delivered");
        assert_eq!(peer, a.local_mac());
        let i = u32::from_be_bytes(data[data.len() - 4..].try_into().unwrap());
        assert_eq!(i % 3, u32::from(channel));
        assert_eq!(i, next[channel as usize] * 3 + u32::from(channel), "in order per channel");
        next[channel as usize] += 1;
        assert_eq!(data, payload(i), "intact");
    }
    assert!(rb.recv_timeout(Duration::from_millis(50)).is_err(), "nothing delivered twice");
    assert!(a.wait_idle(Duration::from_secs(10)), "sender drained");
    let stats = a.stats();
    assert!(stats.transport.retransmitted_frames > 0, "the lossy link made it retransmit");
    assert_eq!(stats.backlog_messages, 0);
    stop.store(true, Ordering::Relaxed);
    for p in pollers {
        p.join().unwrap();
    }
}

#[test]
fn run_to_completion_delivers_everything_once_in_order() {
    one_way(ThreadMode::RunToCompletion, 5_000);
}

#[test]
fn pipeline_delivers_everything_once_in_order() {
    one_way(ThreadMode::Pipeline, 5_000);
}

#[test]
fn caller_mode_delivers_everything_once_in_order_as_its_users_poll() {
    one_way(ThreadMode::Caller, 5_000);
}

/// Nobody polls: the helper thread alone runs the turns, a lapse at a time.
#[test]
fn handler_replies_reach_the_peer_in_caller_mode_without_a_caller() {
    echo(ThreadMode::Caller);
}

fn echo(mode: ThreadMode) {
    let (pa, pb) = mem_pair(0);
    let (ta, ra) = mpsc::channel();
    let (tb, _rb) = mpsc::channel();
    let a = Runtime::start(Box::new(pa), config(mode), Box::new(Forward { to: ta, echo: false })).unwrap();
    let b = Runtime::start(Box::new(pb), config(mode), Box::new(Forward { to: tb, echo: true })).unwrap();
    for i in 0..200u32 {
        a.sender().send(b.local_mac(), 7, &payload(i));
        let (peer, channel, data) = ra.recv_timeout(Duration::from_secs(10)).expect("echo");
        assert_eq!((peer, channel), (b.local_mac(), 7));
        assert_eq!(data, payload(i));
    }
}

#[test]
fn handler_replies_reach_the_peer_run_to_completion() {
    echo(ThreadMode::RunToCompletion);
}

#[test]
fn handler_replies_reach_the_peer_pipeline() {
    echo(ThreadMode::Pipeline);
}

#[test]
fn a_node_in_another_group_drops_the_traffic() {
    for mode in [ThreadMode::RunToCompletion, ThreadMode::Pipeline] {
        let (a, b, rb) = forward_pair(mode, 0);
        a.sender().send(b.local_mac(), 1, b"before");
        assert_eq!(rb.recv_timeout(Duration::from_secs(10)).unwrap().2, b"before");
        b.set_group(9).unwrap();
        // Let the request reach B's threads before the next frame does.
        std::thread::sleep(Duration::from_millis(50));
        a.sender().send(b.local_mac(), 1, b"after");
        assert!(rb.recv_timeout(Duration::from_millis(300)).is_err(), "{mode:?}: delivered across groups");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while b.stats().transport.drop_wrong_group == 0 {
            assert!(std::time::Instant::now() < deadline, "{mode:?}: wrong-group drops not counted");
            std::thread::sleep(Duration::from_millis(5));
        }
        a.set_group(9).unwrap();
        assert_eq!(
            rb.recv_timeout(Duration::from_secs(10)).unwrap().2,
            b"after",
            "{mode:?}: same group again"
        );
    }
}

/// On ports that carry the group as an 802.1Q VLAN, the runtime keeps the VLAN with the group:
/// set at start, moved by `set_group`, and a group that cannot be a VLAN ID is refused.
#[test]
fn the_group_is_the_vlan_of_a_vlan_port() {
    use lanbus_port::vlan::VlanPort;
    use lanbus_port::{Hub, HubConfig};
    let hub = Hub::new(HubConfig::default()).unwrap();
    let port = |n: u8| Box::new(VlanPort::new(Box::new(hub.port(MacAddr([2, 0, 0, 0, 0x7b, n])))));
    let (pa, pb) = (port(1), port(2));
    let (va, vb) = (pa.vlan_id(), pb.vlan_id());
    let mut cfg = config(ThreadMode::RunToCompletion);
    cfg.transport.group = 7;
    let (ta, _) = mpsc::channel();
    let (tb, rb) = mpsc::channel();
    let a = Runtime::start(pa, cfg.clone(), Box::new(Forward { to: ta, echo: false })).unwrap();
    let b = Runtime::start(pb, cfg.clone(), Box::new(Forward { to: tb, echo: false })).unwrap();
    assert_eq!((va.get(), vb.get()), (7, 7), "the VLAN is the group from the start");
    a.sender().send(b.local_mac(), 1, b"in VLAN 7");
    assert_eq!(rb.recv_timeout(Duration::from_secs(10)).unwrap().2, b"in VLAN 7");
    b.set_group(8).unwrap();
    assert_eq!(vb.get(), 8);
    assert!(b.set_group(4095).is_err(), "no VLAN ID 4095");
    assert_eq!(vb.get(), 8, "a refused group changes nothing");
    a.set_group(8).unwrap();
    a.sender().send(b.local_mac(), 1, b"in VLAN 8");
    assert_eq!(rb.recv_timeout(Duration::from_secs(10)).unwrap().2, b"in VLAN 8");
    cfg.transport.group = 5000;
    let (tc, _) = mpsc::channel();
    assert!(Runtime::start(port(3), cfg, Box::new(Forward { to: tc, echo: false })).is_err());
}

#[test]
fn send_all_delivers_a_batch_in_order_in_both_modes() {
    for mode in [ThreadMode::RunToCompletion, ThreadMode::Pipeline] {
        let (a, b, rb) = forward_pair(mode, 0);
        // Batches sent while the node is busy and after it went idle (parked): none is lost.
        for round in 0..20u32 {
            let batch: Vec<Vec<u8>> = (0..5).map(|i| payload(round * 5 + i)).collect();
            a.sender().send_all(b.local_mac(), 4, batch.iter().map(|m| m.as_slice()));
            for (i, want) in batch.iter().enumerate() {
                let (_, channel, data) = rb.recv_timeout(Duration::from_secs(10)).expect("delivered");
                assert_eq!(channel, 4);
                assert_eq!(&data, want, "{mode:?}: round {round} message {i}");
            }
            if round % 4 == 0 {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        a.sender().send_all(b.local_mac(), 4, std::iter::empty());
        assert!(a.wait_idle(Duration::from_secs(10)));
    }
}

#[test]
fn shared_messages_arrive_whole_in_order_with_owned_ones_and_are_let_go() {
    for mode in [ThreadMode::RunToCompletion, ThreadMode::Pipeline] {
        let (a, b, rb) = forward_pair(mode, 7);
        let buffer: Arc<Vec<u8>> = Arc::new((0..40_000u32).map(|i| (i * 7 + i / 251) as u8).collect());
        for round in 0..12usize {
            // Heads, slices and zero tails of every size, some empty, owned messages between.
            let shared: Vec<(Vec<u8>, usize, usize, usize)> = (0..4)
                .map(|i| {
                    let k = round * 4 + i;
                    (vec![k as u8; k % 5 * 9], k * 613 % 30_000, (k * 2_741) % 9_000, k % 3 * 3)
                })
                .collect();
            let want: Vec<Vec<u8>> = shared
                .iter()
                .map(|(head, start, len, zeros)| {
                    [head.as_slice(), &buffer[*start..start + len], &vec![0; *zeros]].concat()
                })
                .collect();
            a.sender().send_owned(b.local_mac(), 2, [payload(round as u32)]);
            let lent = Arc::clone(&buffer) as Arc<dyn lanbus_transport::Lend>;
            a.sender().send_shared(
                b.local_mac(),
                2,
                shared.into_iter().map(|(head, start, len, zeros)| {
                    (head, LentSlice::new(Arc::clone(&lent), start..start + len), zeros)
                }),
            );
            let (_, _, first) = rb.recv_timeout(Duration::from_secs(10)).expect("delivered");
            assert_eq!(first, payload(round as u32), "{mode:?}: round {round}");
            for (i, want) in want.iter().enumerate() {
                let (_, channel, data) = rb.recv_timeout(Duration::from_secs(10)).expect("delivered");
                assert_eq!(channel, 2);
                assert_eq!(&data, want, "{mode:?}: round {round} shared message {i}");
            }
        }
        assert!(a.wait_idle(Duration::from_secs(10)));
        assert_eq!(Arc::strong_count(&buffer), 1, "{mode:?}: the shared bytes are still held");
    }
}

/// Replies to every message and, from `poll`, sends what another thread left in `pending`; every
/// message it hands to its outbox carries the order it was handed in.
struct Stamping {
    pending: Arc<Mutex<Vec<u32>>>,
    next: u32,
    polls: Arc<std::sync::atomic::AtomicU64>,
    /// Where `poll` sends.
    to: MacAddr,
}

impl Stamping {
    fn stamp(&mut self, out: &mut dyn Outbox, peer: MacAddr, what: u32) {
        let mut m = self.next.to_be_bytes().to_vec();
        m.extend_from_slice(&what.to_be_bytes());
        self.next += 1;
        out.send(peer, 9, &m);
    }
}

impl Handler for Stamping {
    fn on_message(&mut self, m: Message<'_>, out: &mut dyn Outbox) {
        self.stamp(out, m.peer, u32::MAX);
    }

    fn poll(&mut self, out: &mut dyn Outbox) -> usize {
        self.polls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let items: Vec<u32> = std::mem::take(&mut *self.pending.lock().unwrap());
        for i in &items {
            self.stamp(out, self.to, *i);
        }
        items.len()
    }
}

#[test]
fn handler_poll_runs_when_woken_and_its_output_keeps_the_handlers_order() {
    for mode in [ThreadMode::RunToCompletion, ThreadMode::Pipeline] {
        let (pa, pb) = mem_pair(0);
        let (ta, ra) = mpsc::channel();
        let a =
            Runtime::start(Box::new(pa), config(mode), Box::new(Forward { to: ta, echo: false })).unwrap();
        let pending = Arc::new(Mutex::new(Vec::new()));
        let polls = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let handler = Stamping { pending: pending.clone(), next: 0, polls: polls.clone(), to: a.local_mac() };
        let b = Runtime::start(Box::new(pb), config(mode), Box::new(handler)).unwrap();
        let mut seen = 0u32;
        let mut expect = |ra: &mpsc::Receiver<(MacAddr, u16, Vec<u8>)>, what: u32| {
            let (peer, channel, data) = ra.recv_timeout(Duration::from_secs(10)).expect("delivered");
            assert_eq!((peer, channel), (MacAddr::local(2), 9));
            let stamp = u32::from_be_bytes(data[..4].try_into().unwrap());
            let got = u32::from_be_bytes(data[4..].try_into().unwrap());
            assert_eq!((stamp, got), (seen, what), "{mode:?}: handed out in this order");
            seen += 1;
        };
        for i in 0..50u32 {
            // Left by another thread while the node idles (parked after a few rounds): the
            // wake-up alone makes the handler's thread send it, no frame needed.
            pending.lock().unwrap().push(i);
            b.sender().wake_handler();
            expect(&ra, i);
            // Then a message, whose reply follows in the handler's order.
            a.sender().send(b.local_mac(), 3, b"ping");
            expect(&ra, u32::MAX);
            if i % 10 == 0 {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        assert!(polls.load(std::sync::atomic::Ordering::Relaxed) >= 50);
    }
}

#[test]
fn a_port_stamp_becomes_the_arrival_on_the_runtime_clock() {
    let now = Instant::from_nanos(5_000_000);
    // Stamped 30 us before the wall clock was read: arrived 30 us before now.
    assert_eq!(crate::arrival(now, 1_000_030_000, 1_000_000_000), Instant::from_nanos(4_970_000));
    // A stamp from the future, a second old or more, or older than the runtime's clock: now, or
    // the clock's start.
    assert_eq!(crate::arrival(now, 1_000_000_000, 1_000_000_001), now);
    assert_eq!(crate::arrival(now, 3_000_000_000, 1_000_000_000), now);
    assert_eq!(crate::arrival(now, 1_900_000_000, 1_000_000_000), Instant::ZERO);
}

#[test]
fn caller_mode_helper_looks_less_often_while_the_user_polls_and_at_once_again_when_it_stops() {
    let mut s = LapseSchedule::new();
    let busy: Vec<Duration> = (0..8).map(|_| s.after_look(true)).collect();
    let ms = Duration::from_millis;
    assert_eq!(busy, [ms(2), ms(4), ms(8), ms(16), ms(16), ms(16), ms(16), ms(16)]);
    assert_eq!(busy.iter().max(), Some(&CALLER_LAPSE_MAX));
    // The user stopped: the next look is a lapse away, and so is every one after while it stays away.
    assert_eq!(s.after_look(false), CALLER_LAPSE);
    assert_eq!(s.after_look(false), CALLER_LAPSE);
    assert_eq!(s.after_look(true), ms(2));
}

/// A user that polls for a while and then stops: the helper, backed off to its longest sleep,
/// serves the node within that sleep.
#[test]
fn caller_mode_helper_takes_over_after_a_busy_user_stops() {
    let (pa, pb) = mem_pair(0);
    let (ta, ra) = mpsc::channel();
    let (tb, _rb) = mpsc::channel();
    let a =
        Runtime::start(Box::new(pa), config(ThreadMode::Caller), Box::new(Forward { to: ta, echo: false }))
            .unwrap();
    let b =
        Runtime::start(Box::new(pb), config(ThreadMode::Caller), Box::new(Forward { to: tb, echo: true }))
            .unwrap();
    // Both users poll long enough for their helpers to back off all the way.
    let until = std::time::Instant::now() + CALLER_LAPSE_MAX * 4;
    while std::time::Instant::now() < until {
        a.poll();
        b.poll();
    }
    // Now nobody polls: the helpers alone carry the echo.
    for i in 0..20u32 {
        a.sender().send(b.local_mac(), 7, &payload(i));
        let (_, _, data) = ra.recv_timeout(Duration::from_secs(10)).expect("echo");
        assert_eq!(data, payload(i));
    }
}
