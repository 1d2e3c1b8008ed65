//! The runtime over real ports with loss injected on the lanbus side: 100,000 messages cross each
//! port delivered exactly once, in order and intact, and malformed frames sent by a stranger are
//! counted and dropped while a run goes on.
//!
//! The veth tests (udp, afpacket with TPACKET_V3 and V2 receive rings, afxdp) run between the two
//! namespaces of a [`VethPair`] and need root: without it they print why and return. The loopback
//! udp tests need nothing. Loss: a [`FaultyPort`] on each end drops 1% of the frames it receives
//! and 1% of those it transmits (seeded), so DATA and ACK frames are lost in both directions.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lanbus_port::fault::{FaultConfig, FaultCounters, FaultyPort};
use lanbus_port::netns::VethPair;
use lanbus_port::udp::{UdpConfig, UdpPort};
use lanbus_port::Port;
use lanbus_runtime::{Handler, Outbox, Polling, Runtime, RuntimeConfig, ThreadMode};
use lanbus_transport::{Config, Counters, Message};
use lanbus_wire::MacAddr;

const MESSAGES: u64 = 100_000;
const LOSS: f64 = 0.01;
const CHANNEL: u16 = 3;

/// Message `i`: its index, then bytes derived from it; 200 to 499 bytes long.
fn payload(i: u64) -> Vec<u8> {
    let len = 200 + (i as usize * 7919) % 300;
    let mut v = i.to_be_bytes().to_vec();
    v.extend((8..len).map(|k| (i as usize).wrapping_mul(31).wrapping_add(k) as u8));
    v
}

#[derive(Default)]
struct Seen {
    next: u64,
    first_error: Option<String>,
}

/// Checks every delivered message: from the right peer and channel, the next index, intact.
struct Check {
    from: MacAddr,
    seen: Arc<Mutex<Seen>>,
}

impl Handler for Check {
    fn on_message(&mut self, m: Message<'_>, _out: &mut dyn Outbox) {
        let mut seen = self.seen.lock().unwrap();
        let index = m.data.get(..8).map(|b| u64::from_be_bytes(b.try_into().unwrap()));
        let error = if m.peer != self.from || m.channel != CHANNEL {
            Some(format!("message from {} on channel {}", m.peer, m.channel))
        } else if index != Some(seen.next) {
            Some(format!("expected message {}, got {:?}", seen.next, index))
        } else if m.data != payload(seen.next).as_slice() {
            Some(format!("message {} corrupted", seen.next))
        } else {
            None
        };
        if let Some(e) = error {
            seen.first_error.get_or_insert(e);
        }
        seen.next += 1;
    }
}

/// A handler for the sending side, which receives nothing.
struct Nothing;

impl Handler for Nothing {
    fn on_message(&mut self, m: Message<'_>, _out: &mut dyn Outbox) {
        panic!("the sender received a message from {}", m.peer);
    }
}

fn config(mode: ThreadMode, name: &str, transport: &Config) -> RuntimeConfig {
    RuntimeConfig {
        transport: transport.clone(),
        threads: mode,
        polling: Polling::default(),
        name: name.into(),
        ..RuntimeConfig::default()
    }
}

/// What one run did.
struct Outcome {
    receiver: Counters,
    sender: Counters,
    receiver_port_rx_dropped: u64,
}

/// Sends `count` messages from `a` to `b` and checks what `b` delivers; optionally runs `during`
/// (say, a stranger sending junk) while the messages flow. Panics on any failure.
fn deliver(
    label: &str,
    a: Box<dyn Port>,
    b: Box<dyn Port>,
    mode: ThreadMode,
    transport: &Config,
    count: u64,
    during: impl FnOnce(),
) -> Outcome {
    // One run at a time: each run is two busy nodes, and on a 2-core machine parallel runs would
    // mostly measure each other (and stretch towards the 20 s limit).
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    let (a_mac, b_mac) = (a.mac(), b.mac());
    let seen = Arc::new(Mutex::new(Seen::default()));
    let rb =
        Runtime::start(b, config(mode, "b", transport), Box::new(Check { from: a_mac, seen: seen.clone() }))
            .unwrap();
    let ra = Runtime::start(a, config(mode, "a", transport), Box::new(Nothing)).unwrap();
    let sender = ra.sender();
    // Queue in slices so the runtime's queue stays small.
    let mut queued = 0;
    let deadline = started + Duration::from_secs(20);
    let mut during = Some(during);
    loop {
        let delivered = seen.lock().unwrap().next;
        if let Some(e) = &seen.lock().unwrap().first_error {
            panic!("{label}: {e}");
        }
        if delivered >= count {
            break;
        }
        if queued < count && queued - delivered.min(queued) < 4096 {
            let end = (queued + 1024).min(count);
            for i in queued..end {
                sender.send(b_mac, CHANNEL, &payload(i));
            }
            queued = end;
            if queued >= count / 4 {
                if let Some(f) = during.take() {
                    f();
                }
            }
            continue;
        }
        assert!(
            Instant::now() < deadline,
            "{label}: only {delivered} of {count} messages in 20 s; sender {:?}; receiver {:?}",
            ra.stats(),
            rb.stats()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(ra.wait_idle(Duration::from_secs(5)), "{label}: the sender never saw its last ACK");
    // A duplicate would arrive now, if at all.
    std::thread::sleep(Duration::from_millis(20));
    let seen = seen.lock().unwrap();
    assert_eq!(seen.first_error, None, "{label}");
    assert_eq!(seen.next, count, "{label}: delivered more than sent");
    let (sa, sb) = (ra.stats(), rb.stats());
    ra.shutdown();
    rb.shutdown();
    eprintln!(
        "{label}: {count} messages in {:.2} s; sender retransmitted {} frames ({} timeouts, {} fast), \
         RTT mean {:?} max {} us; receiver dropped {} out of order, {} duplicates",
        started.elapsed().as_secs_f64(),
        sa.transport.retransmitted_frames,
        sa.transport.timeouts,
        sa.transport.fast_retransmits,
        sa.transport.rtt_mean(),
        sa.transport.rtt_max_ns / 1000,
        sb.transport.drop_out_of_order,
        sb.transport.drop_duplicate,
    );
    Outcome { receiver: sb.transport, sender: sa.transport, receiver_port_rx_dropped: sb.port.rx_dropped }
}

/// Both ports wrapped in 1% receive and 1% transmit loss; checks that loss was injected and
/// recovered from.
fn lossy(label: &str, a: Box<dyn Port>, b: Box<dyn Port>, mode: ThreadMode, transport: &Config, seed: u64) {
    let a = FaultyPort::new(a, FaultConfig::loss(LOSS, seed));
    let b = FaultyPort::new(b, FaultConfig::loss(LOSS, seed + 1));
    let faults: [Arc<FaultCounters>; 2] = [a.fault_counters(), b.fault_counters()];
    let out = deliver(label, Box::new(a), Box::new(b), mode, transport, MESSAGES, || ());
    for (side, f) in ["a", "b"].iter().zip(&faults) {
        assert!(f.rx_dropped() > 0 && f.tx_dropped() > 0, "{label}: no loss injected on {side}");
    }
    assert!(out.sender.retransmitted_frames > 0, "{label}: loss without retransmission");
    assert_eq!(out.receiver.messages_delivered, MESSAGES, "{label}");
}

// ---- udp on loopback: no root needed ----

fn udp_loopback_pair() -> (UdpPort, UdpPort) {
    let any = "127.0.0.1:0".parse().unwrap();
    let mut a = UdpPort::open(&UdpConfig::new(any)).unwrap();
    let mut b = UdpPort::open(&UdpConfig::new(any)).unwrap();
    a.add_peer(b.mac(), b.local_addr()).unwrap();
    b.add_peer(a.mac(), a.local_addr()).unwrap();
    (a, b)
}

#[test]
fn udp_loopback_lossy_run_to_completion() {
    let (a, b) = udp_loopback_pair();
    lossy(
        "udp loopback rtc",
        Box::new(a),
        Box::new(b),
        ThreadMode::RunToCompletion,
        &Config::point_to_point(),
        11,
    );
}

#[test]
fn udp_loopback_lossy_pipeline() {
    let (a, b) = udp_loopback_pair();
    lossy(
        "udp loopback pipeline",
        Box::new(a),
        Box::new(b),
        ThreadMode::Pipeline,
        &Config::point_to_point(),
        13,
    );
}

#[test]
fn udp_loopback_junk_datagrams_are_counted_and_dropped() {
    let (a, b) = udp_loopback_pair();
    let b_addr = b.local_addr();
    const JUNK: u64 = 300;
    let (a, b): (Box<dyn Port>, Box<dyn Port>) = (Box::new(a), Box::new(b));
    let out = deliver(
        "udp loopback junk",
        a,
        b,
        ThreadMode::RunToCompletion,
        &Config::point_to_point(),
        20_000,
        || {
            // A stranger: datagrams of every short length and random garbage.
            let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            for i in 0..JUNK {
                let junk: Vec<u8> = (0..(i % 150) as usize).map(|k| (k as u64 * 131 + i) as u8).collect();
                s.send_to(&junk, b_addr).unwrap();
            }
        },
    );
    assert!(
        out.receiver_port_rx_dropped >= JUNK,
        "only {} of {JUNK} junk datagrams counted as dropped",
        out.receiver_port_rx_dropped
    );
}

// ---- the veth pair: needs root ----

/// Opens `a_spec` in namespace a and `b_spec` in namespace b.
fn open_pair(pair: &VethPair, a_spec: &str, b_spec: &str) -> (Box<dyn Port>, Box<dyn Port>) {
    let (a_spec, b_spec) = (a_spec.to_string(), b_spec.to_string());
    let a = pair.a.netns.run(move || a_spec.parse::<lanbus_port::PortSpec>().and_then(|s| s.open())).unwrap();
    let b = pair.b.netns.run(move || b_spec.parse::<lanbus_port::PortSpec>().and_then(|s| s.open())).unwrap();
    (a.unwrap_or_else(|e| panic!("{e}")), b.unwrap_or_else(|e| panic!("{e}")))
}

/// The specs of one port kind on both ends of `pair`.
fn specs(pair: &VethPair, kind: &str) -> (String, String) {
    let (a, b) = (&pair.a, &pair.b);
    match kind {
        "udp" => (
            format!("udp:{}:7000,peer={}:7000", a.ipv4, b.ipv4),
            format!("udp:{}:7000,peer={}:7000", b.ipv4, a.ipv4),
        ),
        // The default receive ring is TPACKET_V2.
        "afpacket" => (format!("afpacket:{}", a.ifname), format!("afpacket:{}", b.ifname)),
        "afpacket-v3" => (format!("afpacket:{},rx=v3", a.ifname), format!("afpacket:{},rx=v3", b.ifname)),
        "afxdp" => (format!("afxdp:{}", a.ifname), format!("afxdp:{}", b.ifname)),
        other => panic!("unknown kind {other}"),
    }
}

fn veth_lossy(kind: &str, mode: ThreadMode, seed: u64) {
    let label = format!("{kind} veth {mode:?}");
    let pair = match VethPair::create() {
        Ok(p) => p,
        Err(skip) => {
            eprintln!("{label}: {skip}");
            return;
        }
    };
    let (sa, sb) = specs(&pair, kind);
    let (a, b) = open_pair(&pair, &sa, &sb);
    lossy(&label, a, b, mode, &Config::point_to_point(), seed);
}

#[test]
fn udp_veth_lossy_run_to_completion() {
    veth_lossy("udp", ThreadMode::RunToCompletion, 21);
}

#[test]
fn afpacket_v3_veth_lossy_run_to_completion() {
    veth_lossy("afpacket-v3", ThreadMode::RunToCompletion, 31);
}

#[test]
fn afpacket_v2_veth_lossy_run_to_completion() {
    veth_lossy("afpacket", ThreadMode::RunToCompletion, 41);
}

#[test]
fn afpacket_v2_veth_lossy_pipeline() {
    veth_lossy("afpacket", ThreadMode::Pipeline, 43);
}

#[test]
fn afxdp_veth_lossy_run_to_completion() {
    veth_lossy("afxdp", ThreadMode::RunToCompletion, 51);
}

#[test]
fn afxdp_veth_lossy_pipeline() {
    veth_lossy("afxdp", ThreadMode::Pipeline, 53);
}

/// A raw AF_PACKET socket on an interface, for sending arbitrary frames.
struct RawSocket {
    fd: std::os::fd::OwnedFd,
    ifindex: i32,
}

impl RawSocket {
    fn open(ifname: &str) -> RawSocket {
        use std::os::fd::FromRawFd;
        let name = std::ffi::CString::new(ifname).unwrap();
        // SAFETY: `name` is a valid NUL-terminated string for the duration of the call.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        assert!(ifindex != 0, "no interface {ifname}");
        // SAFETY: plain socket creation; the result is checked.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
        assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
        // SAFETY: fd is a fresh descriptor owned by nothing else.
        RawSocket { fd: unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }, ifindex: ifindex as i32 }
    }

    fn send(&self, frame: &[u8]) {
        use std::os::fd::AsRawFd;
        // SAFETY: sockaddr_ll is plain old data; all-zero is a valid value.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_ifindex = self.ifindex;
        addr.sll_halen = 6;
        addr.sll_addr[..6].copy_from_slice(&frame[..6]);
        // SAFETY: `frame` and `addr` are live for the call and their lengths are passed with them.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&addr as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(n, frame.len() as isize, "sendto: {}", std::io::Error::last_os_error());
    }
}

/// Junk frames from a's MAC to b's, EtherType 0x88B5: empty and short payloads, random bytes, and
/// random bytes behind a plausible version byte.
fn junk_frames(a: MacAddr, b: MacAddr, count: u64) -> Vec<Vec<u8>> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        // xorshift64: deterministic junk.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..count)
        .map(|i| {
            let mut f = Vec::new();
            f.extend_from_slice(&b.0);
            f.extend_from_slice(&a.0);
            f.extend_from_slice(&0x88b5u16.to_be_bytes());
            let len = match i % 3 {
                0 => (i % 31) as usize,
                _ => 32 + (next() % 400) as usize,
            };
            f.extend((0..len).map(|_| next() as u8));
            if i % 3 == 2 {
                f[14] = lanbus_wire::frame::VERSION;
            }
            f
        })
        .collect()
}

/// Sum of the transport's drop counters that a malformed frame can land in.
fn malformed_drops(c: &Counters) -> u64 {
    c.drop_bad_frame
        + c.drop_bad_version
        + c.drop_unknown_kind
        + c.drop_bad_checksum
        + c.drop_not_for_us
        + c.drop_wrong_group
        + c.drop_unknown_peer
        + c.drop_too_many_channels
}

fn veth_junk(kind: &str) {
    let label = format!("{kind} veth junk");
    let pair = match VethPair::create() {
        Ok(p) => p,
        Err(skip) => {
            eprintln!("{label}: {skip}");
            return;
        }
    };
    let (sa, sb) = specs(&pair, kind);
    let (a, b) = open_pair(&pair, &sa, &sb);
    const JUNK: u64 = 300;
    let frames = junk_frames(pair.a.mac, pair.b.mac, JUNK);
    let ifname = pair.a.ifname.clone();
    let netns = &pair.a.netns;
    let out = deliver(&label, a, b, ThreadMode::RunToCompletion, &Config::point_to_point(), 20_000, || {
        netns
            .run(move || {
                let raw = RawSocket::open(&ifname);
                for f in &frames {
                    raw.send(f);
                }
            })
            .unwrap();
    });
    let counted = malformed_drops(&out.receiver) + out.receiver_port_rx_dropped;
    assert!(
        counted >= JUNK,
        "{label}: {JUNK} junk frames sent, {counted} counted as dropped; receiver {:?}",
        out.receiver
    );
}

#[test]
fn afpacket_v2_junk_frames_are_counted_and_dropped() {
    veth_junk("afpacket");
}

#[test]
fn afxdp_junk_frames_are_counted_and_dropped() {
    veth_junk("afxdp");
}
