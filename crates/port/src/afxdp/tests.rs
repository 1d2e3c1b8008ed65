//! Tests of the AF_XDP port over a veth pair between two namespaces (root only; they print why
//! and return otherwise) and of its error paths.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use super::*;
use crate::netns::{VethEnd, VethPair};

/// Makes the pair or prints why the test is skipped.
macro_rules! veth_or_skip {
    ($name:literal) => {
        match VethPair::create() {
            Ok(p) => p,
            Err(skip) => {
                eprintln!("{} {skip}", $name);
                return;
            }
        }
    };
}

const LANBUS: [u8; 2] = [0x88, 0xB5];

fn open_in(end: &VethEnd, options: AfXdpOptions) -> Result<AfXdpPort> {
    let ifname = end.ifname.clone();
    end.netns.run(move || open(&ifname, 0, &options)).expect("thread in the namespace")
}

fn open_ok(end: &VethEnd) -> AfXdpPort {
    open_in(end, AfXdpOptions::default()).unwrap_or_else(|e| panic!("open afxdp on {}: {e}", end.ifname))
}

/// Frame `seq` from `src` to `dst`: lengths vary from 60 bytes to the full MTU, and the payload
/// is a function of `seq` so any corruption or reordering shows.
fn frame(dst: MacAddr, src: MacAddr, seq: u32, mtu: usize) -> Vec<u8> {
    let len = 60 + (seq as usize * 37) % (mtu + 14 - 60 + 1);
    let mut f = Vec::with_capacity(len);
    f.extend_from_slice(&dst.0);
    f.extend_from_slice(&src.0);
    f.extend_from_slice(&LANBUS);
    f.extend_from_slice(&seq.to_be_bytes());
    while f.len() < len {
        f.push((seq as usize).wrapping_mul(31).wrapping_add(f.len()) as u8);
    }
    f
}

/// The driver side of a port in these tests: anything with bursts.
trait Endpoint {
    fn send(&mut self, frames: &[Vec<u8>]) -> usize;
    fn recv(&mut self, out: &mut Vec<Vec<u8>>);
}

impl Endpoint for AfXdpPort {
    fn send(&mut self, frames: &[Vec<u8>]) -> usize {
        let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_slice()).collect();
        self.send_frames(&refs).expect("tx_burst")
    }
    fn recv(&mut self, out: &mut Vec<Vec<u8>>) {
        self.rx_burst(64, &mut |f| out.push(f.to_vec())).expect("rx_burst");
    }
}

/// A plain AF_PACKET socket bound to one EtherType on one interface: the kernel's own path.
struct RawSocket {
    fd: OwnedFd,
}

impl RawSocket {
    /// Opens it in the calling thread's namespace.
    fn open(ifname: &str, ethertype: u16) -> RawSocket {
        let proto = ethertype.to_be() as i32;
        // SAFETY: plain socket(2) call.
        let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto) };
        assert!(raw >= 0, "AF_PACKET socket: {}", io::Error::last_os_error());
        // SAFETY: fresh descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let name = std::ffi::CString::new(ifname).unwrap();
        // SAFETY: valid NUL-terminated name.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        assert!(ifindex > 0, "no {ifname}");
        // SAFETY: all-zero sockaddr_ll is valid.
        let mut sll: libc::sockaddr_ll = unsafe { core::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = ethertype.to_be();
        sll.sll_ifindex = ifindex as i32;
        // SAFETY: live sockaddr_ll of the size passed.
        let rc = unsafe {
            libc::bind(fd.as_raw_fd(), (&raw const sll).cast(), size_of::<libc::sockaddr_ll>() as u32)
        };
        assert_eq!(rc, 0, "bind AF_PACKET: {}", io::Error::last_os_error());
        RawSocket { fd }
    }

    fn recv_timeout(&mut self, timeout: Duration) -> Option<Vec<u8>> {
        let mut pfd = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, timeout.as_millis() as i32) };
        if rc <= 0 {
            return None;
        }
        let mut buf = vec![0u8; 65536];
        // SAFETY: `buf` is writable for its length.
        let n = unsafe {
            libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT)
        };
        if n < 0 {
            return None;
        }
        buf.truncate(n as usize);
        Some(buf)
    }
}

impl Endpoint for RawSocket {
    fn send(&mut self, frames: &[Vec<u8>]) -> usize {
        for f in frames {
            // SAFETY: `f` is readable for its length.
            let n = unsafe { libc::send(self.fd.as_raw_fd(), f.as_ptr().cast(), f.len(), 0) };
            assert_eq!(n, f.len() as isize, "AF_PACKET send: {}", io::Error::last_os_error());
        }
        frames.len()
    }
    fn recv(&mut self, out: &mut Vec<Vec<u8>>) {
        for _ in 0..64 {
            match self.recv_timeout(Duration::ZERO) {
                Some(f) => out.push(f),
                None => break,
            }
        }
    }
}

/// Sends `count` frames each way between `a` and `b` in bursts of `burst`, both directions in
/// flight at once, and checks every frame arrives once, in order, intact.
fn exchange(
    a: &mut dyn Endpoint,
    a_mac: MacAddr,
    b: &mut dyn Endpoint,
    b_mac: MacAddr,
    count: u32,
    burst: u32,
    mtu: usize,
) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let (mut a_sent, mut b_sent, mut a_got, mut b_got) = (0u32, 0u32, 0u32, 0u32);
    let mut buf = Vec::new();
    while a_got < count || b_got < count {
        assert!(Instant::now() < deadline, "timed out: a got {a_got}, b got {b_got} of {count}");
        // Keep at most one burst in flight per direction so no queue on the path overflows.
        if a_sent == b_got && a_sent < count {
            let n = burst.min(count - a_sent);
            let frames: Vec<_> = (a_sent..a_sent + n).map(|s| frame(b_mac, a_mac, s, mtu)).collect();
            a_sent += a.send(&frames) as u32;
        }
        if b_sent == a_got && b_sent < count {
            let n = burst.min(count - b_sent);
            let frames: Vec<_> = (b_sent..b_sent + n).map(|s| frame(a_mac, b_mac, s, mtu)).collect();
            b_sent += b.send(&frames) as u32;
        }
        buf.clear();
        b.recv(&mut buf);
        for f in buf.drain(..) {
            assert_eq!(f, frame(b_mac, a_mac, b_got, mtu), "a -> b frame {b_got}");
            b_got += 1;
        }
        a.recv(&mut buf);
        for f in buf.drain(..) {
            assert_eq!(f, frame(a_mac, b_mac, a_got, mtu), "b -> a frame {a_got}");
            a_got += 1;
        }
    }
}

#[test]
fn afxdp_on_both_ends_carries_bursts_both_ways() {
    let pair = veth_or_skip!("afxdp_on_both_ends_carries_bursts_both_ways");
    // Auto takes generic XDP on veth (faster there, see `prefers_generic`); native works too.
    for (request, mode) in
        [(XdpModeRequest::Auto, XdpMode::Generic), (XdpModeRequest::Native, XdpMode::Native)]
    {
        let options = AfXdpOptions { xdp_mode: request, ..AfXdpOptions::default() };
        let mut a = open_in(&pair.a, options).unwrap_or_else(|e| panic!("{request:?}: {e}"));
        let mut b = open_in(&pair.b, options).unwrap_or_else(|e| panic!("{request:?}: {e}"));
        assert_eq!((a.xdp_mode(), b.xdp_mode()), (mode, mode), "{request:?}");
        assert_eq!(a.bind_mode(), BindMode::Copy, "veth has no zero-copy");
        assert_eq!(a.mac(), pair.a.mac);
        assert_eq!(b.mac(), pair.b.mac);
        assert_eq!(a.mtu(), 1500);
        let mtu = a.mtu();
        exchange(&mut a, pair.a.mac, &mut b, pair.b.mac, 10_000, 64, mtu);
        let (ca, cb) = (a.counters(), b.counters());
        assert_eq!(
            (ca.tx_frames, ca.rx_frames, cb.tx_frames, cb.rx_frames),
            (10_000, 10_000, 10_000, 10_000)
        );
        let bytes: u64 = (0..10_000).map(|s| frame(pair.b.mac, pair.a.mac, s, mtu).len() as u64).sum();
        assert_eq!((ca.tx_bytes, cb.rx_bytes), (bytes, bytes));
        assert_eq!((ca.rx_dropped, cb.rx_dropped, ca.tx_dropped), (0, 0, 0));
    }
}

#[test]
fn afxdp_against_the_kernels_af_packet() {
    let pair = veth_or_skip!("afxdp_against_the_kernels_af_packet");
    against_af_packet(&pair, 5_000, 32, 1500);
}

/// Exchanges `count` frames (up to `mtu`, in bursts of `burst`) between an afxdp port on end a
/// and a plain AF_PACKET socket on end b.
fn against_af_packet(pair: &VethPair, count: u32, burst: u32, mtu: usize) {
    let mut a = open_ok(&pair.a);
    let b_if = pair.b.ifname.clone();
    let mut raw = pair.b.netns.run(move || RawSocket::open(&b_if, 0x88B5)).unwrap();
    exchange(&mut a, pair.a.mac, &mut raw, pair.b.mac, count, burst, mtu);
    assert_eq!(a.counters().rx_frames, u64::from(count));
}

#[test]
fn other_traffic_flows_and_foreign_frames_reach_the_kernel_not_the_socket() {
    for xdp_mode in [XdpModeRequest::Generic, XdpModeRequest::Native] {
        let pair = veth_or_skip!("other_traffic_flows_and_foreign_frames_reach_the_kernel_not_the_socket");
        other_traffic_flows(&pair, AfXdpOptions { xdp_mode, ..AfXdpOptions::default() });
    }
}

fn other_traffic_flows(pair: &VethPair, options: AfXdpOptions) {
    let mut a = open_in(&pair.a, options).expect("open a");
    let _b = open_in(&pair.b, options).expect("open b");

    // UDP (and the ARP it needs) between the namespace addresses, both ways, with both ends
    // running the program.
    let (a_addr, b_addr) = ((pair.a.ipv4, 7101), (pair.b.ipv4, 7102));
    let sa = pair.a.netns.run(move || std::net::UdpSocket::bind(a_addr)).unwrap().unwrap();
    let sb = pair.b.netns.run(move || std::net::UdpSocket::bind(b_addr)).unwrap().unwrap();
    for s in [&sa, &sb] {
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    }
    let mut buf = [0u8; 64];
    sa.send_to(b"a to b", b_addr).unwrap();
    let (n, from) = sb.recv_from(&mut buf).expect("UDP a -> b while XDP is attached");
    assert_eq!((&buf[..n], from), (&b"a to b"[..], std::net::SocketAddr::from(a_addr)));
    sb.send_to(b"b to a", a_addr).unwrap();
    let (n, _) = sa.recv_from(&mut buf).expect("UDP b -> a while XDP is attached");
    assert_eq!(&buf[..n], b"b to a");

    // A non-lanbus frame to a goes to the kernel (an AF_PACKET socket for its EtherType sees it),
    // not to the AF_XDP socket; the lanbus frame sent after it does reach the socket.
    let a_if = pair.a.ifname.clone();
    let mut watch = pair.a.netns.run(move || RawSocket::open(&a_if, 0x88B6)).unwrap();
    let b_if = pair.b.ifname.clone();
    let mut raw = pair.b.netns.run(move || RawSocket::open(&b_if, 0x88B6)).unwrap();
    let mut foreign = frame(pair.a.mac, pair.b.mac, 1, 1500);
    foreign[12..14].copy_from_slice(&[0x88, 0xB6]);
    let lanbus = frame(pair.a.mac, pair.b.mac, 2, 1500);
    raw.send(&[foreign.clone(), lanbus.clone()]);
    let seen = watch.recv_timeout(Duration::from_secs(3)).expect("the kernel got the foreign frame");
    assert_eq!(seen, foreign);
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut got = Vec::new();
    while got.is_empty() && Instant::now() < deadline {
        a.wait(Some(Duration::from_millis(100))).unwrap();
        a.recv(&mut got);
    }
    assert_eq!(got, vec![lanbus], "only the lanbus frame reaches the AF_XDP socket");
}

#[test]
fn program_verdicts_in_the_kernel() {
    let pair = veth_or_skip!("program_verdicts_in_the_kernel");
    let a = open_ok(&pair.a);
    let lanbus = frame(pair.a.mac, pair.b.mac, 0, 1500);
    // The test run delivers on queue 0, where the port's socket is: redirect.
    assert_eq!(a.test_program(&lanbus).unwrap(), bpf::action::XDP_REDIRECT);
    assert_eq!(a.test_program(&lanbus[..14]).unwrap(), bpf::action::XDP_REDIRECT, "header-only frame");
    let mut ipv4 = lanbus.clone();
    ipv4[12..14].copy_from_slice(&[0x08, 0x00]);
    assert_eq!(a.test_program(&ipv4).unwrap(), bpf::action::XDP_PASS);
    let mut swapped = lanbus.clone();
    swapped[12..14].copy_from_slice(&[0xB5, 0x88]);
    assert_eq!(a.test_program(&swapped).unwrap(), bpf::action::XDP_PASS, "byte order matters");
    let mut arp = lanbus.clone();
    arp[12..14].copy_from_slice(&[0x08, 0x06]);
    assert_eq!(a.test_program(&arp[..42]).unwrap(), bpf::action::XDP_PASS);
    // Behind an 802.1Q tag (a group carried as a VLAN): lanbus frames only, and bounds-checked.
    let mut tagged = lanbus[..12].to_vec();
    tagged.extend_from_slice(&[0x81, 0x00, 0x00, 0x07]);
    tagged.extend_from_slice(&lanbus[12..]);
    assert_eq!(a.test_program(&tagged).unwrap(), bpf::action::XDP_REDIRECT);
    let mut tagged_ipv4 = tagged.clone();
    tagged_ipv4[16..18].copy_from_slice(&[0x08, 0x00]);
    assert_eq!(a.test_program(&tagged_ipv4).unwrap(), bpf::action::XDP_PASS);
    assert_eq!(a.test_program(&tagged[..17]).unwrap(), bpf::action::XDP_PASS, "a tag cut short");
}

fn xdp_shown(end: &VethEnd) -> String {
    let out = end.netns.ip(&["link", "show", "dev", &end.ifname]).expect("ip link show");
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[test]
fn the_program_is_detached_on_drop() {
    let pair = veth_or_skip!("the_program_is_detached_on_drop");
    assert!(!xdp_shown(&pair.a).contains("xdp"), "fresh veth has no XDP");
    for xdp_mode in [XdpModeRequest::Auto, XdpModeRequest::Native] {
        let a = open_in(&pair.a, AfXdpOptions { xdp_mode, ..AfXdpOptions::default() }).expect("open");
        let shown = xdp_shown(&pair.a);
        assert!(shown.contains("prog/xdp"), "{xdp_mode:?}: attached while open: {shown}");
        drop(a);
        let shown = xdp_shown(&pair.a);
        assert!(!shown.contains("xdp"), "{xdp_mode:?}: detached after drop: {shown}");
    }
    // And the interface can take a port again.
    drop(open_ok(&pair.a));
}

#[test]
fn an_existing_program_is_not_replaced() {
    let pair = veth_or_skip!("an_existing_program_is_not_replaced");
    let first = open_ok(&pair.a);
    let err = open_in(&pair.a, AfXdpOptions::default()).expect_err("second program on one interface");
    let text = err.to_string();
    assert!(
        matches!(err, PortError::Unavailable { .. }) && text.contains("already has an XDP program"),
        "{text}"
    );
    // The first port's program is still there.
    assert!(xdp_shown(&pair.a).contains("prog/xdp"));
    drop(first);
    // A program in the other mode blocks the first mode Auto tries (generic, on veth), and Auto
    // must not then go on to the other mode and attach beside it.
    let native = AfXdpOptions { xdp_mode: XdpModeRequest::Native, ..AfXdpOptions::default() };
    let first = open_in(&pair.b, native).expect("native on b");
    let err = open_in(&pair.b, AfXdpOptions::default()).expect_err("auto over native");
    assert!(err.to_string().contains("already has an XDP program"), "{err}");
    assert_eq!(first.xdp_mode(), XdpMode::Native);
    let shown = xdp_shown(&pair.b);
    assert!(shown.contains("prog/xdp") && !shown.contains("xdpgeneric"), "{shown}");
}

#[test]
fn a_rejected_program_comes_with_the_verifier_log() {
    if crate::netns::check_root().is_err() {
        eprintln!("a_rejected_program_comes_with_the_verifier_log skipped: needs root (bpf)");
        return;
    }
    // Reads the EtherType without the bounds check: the verifier must refuse it.
    let insns = [
        bpf::Insn::load_u32(bpf::R3, bpf::R1, 0),
        bpf::Insn::load_u16(bpf::R0, bpf::R3, 12),
        bpf::Insn::exit(),
    ];
    let err = bpf::load_xdp_program(&insns, "lanbus_bad", false).expect_err("unchecked packet access");
    assert_eq!(err.source.raw_os_error(), Some(libc::EACCES), "{:?}", err.source);
    assert!(err.log.contains("invalid access to packet"), "{}", err.log);
}

#[test]
fn native_and_generic_ends_work_together() {
    let pair = veth_or_skip!("native_and_generic_ends_work_together");
    let native = AfXdpOptions { xdp_mode: XdpModeRequest::Native, ..AfXdpOptions::default() };
    let mut a = open_in(&pair.a, native).expect("native mode");
    assert_eq!(a.xdp_mode(), XdpMode::Native);
    let shown = xdp_shown(&pair.a);
    assert!(shown.contains("prog/xdp") && !shown.contains("xdpgeneric"), "{shown}");
    let mut b = open_ok(&pair.b);
    assert_eq!(b.xdp_mode(), XdpMode::Generic);
    assert!(xdp_shown(&pair.b).contains("xdpgeneric"), "{}", xdp_shown(&pair.b));
    exchange(&mut a, pair.a.mac, &mut b, pair.b.mac, 1_000, 32, 1500);
}

#[test]
fn jumbo_frames_take_several_umem_frames_both_ways() {
    for xdp_mode in [XdpModeRequest::Generic, XdpModeRequest::Native] {
        let pair = veth_or_skip!("jumbo_frames_take_several_umem_frames_both_ways");
        jumbo_frames(&pair, AfXdpOptions { xdp_mode, ..AfXdpOptions::default() });
    }
}

fn jumbo_frames(pair: &VethPair, options: AfXdpOptions) {
    pair.set_mtu(9000).expect("ip link set mtu");
    let mut a = open_in(&pair.a, options).expect("open a");
    let mut b = open_in(&pair.b, options).expect("open b");
    assert_eq!(a.mtu(), 9000);
    assert!(a.xsk.multi_buffer() && b.xsk.multi_buffer(), "9014-byte frames need three 4 KiB UMEM frames");
    // Lengths from 60 bytes to the full 9014: one, two and three UMEM frames per frame, in
    // bursts that end in the middle of chains.
    exchange(&mut a, pair.a.mac, &mut b, pair.b.mac, 3_000, 16, 9000);
    let (ca, cb) = (a.counters(), b.counters());
    assert_eq!((ca.tx_frames, ca.rx_frames, cb.tx_frames, cb.rx_frames), (3_000, 3_000, 3_000, 3_000));
    let bytes: u64 = (0..3_000).map(|s| frame(pair.b.mac, pair.a.mac, s, 9000).len() as u64).sum();
    assert_eq!((ca.tx_bytes, cb.rx_bytes), (bytes, bytes));
    assert_eq!((a.xsk.bad_descs, b.xsk.bad_descs, ca.tx_dropped), (0, 0, 0));
    // Every transmit slot comes back once the kernel has completed what it sent.
    for port in [&mut a, &mut b] {
        let deadline = Instant::now() + Duration::from_secs(2);
        let (mut free, slots) = port.xsk.tx_slots();
        while free < slots && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
            free = port.xsk.tx_slots().0;
        }
        assert_eq!(free, slots, "transmit slots back");
    }
}

/// Sends `count` frames from `a` to `b` in bursts whose sizes cycle through `bursts`, without
/// waiting for one to arrive before sending the next, and checks `b` gets them all once, in
/// order, intact. Returns how many bursts were of one frame.
fn one_way_in_mixed_bursts(a: &mut AfXdpPort, b: &mut AfXdpPort, count: u32, bursts: &[u32]) -> u64 {
    let (a_mac, b_mac, mtu) = (a.mac(), b.mac(), a.mtu());
    let deadline = Instant::now() + Duration::from_secs(10);
    let (mut sent, mut got, mut lone) = (0u32, 0u32, 0u64);
    let mut buf = Vec::new();
    for &n in bursts.iter().cycle() {
        if got == count {
            break;
        }
        assert!(Instant::now() < deadline, "timed out: {got} of {count} frames");
        let n = n.min(count - sent);
        let frames: Vec<_> = (sent..sent + n).map(|s| frame(b_mac, a_mac, s, mtu)).collect();
        let done = Endpoint::send(a, &frames) as u32;
        lone += u64::from(n == 1 && done == 1);
        sent += done;
        b.recv(&mut buf);
        for f in buf.drain(..) {
            assert_eq!(f, frame(b_mac, a_mac, got, mtu), "frame {got}");
            got += 1;
        }
    }
    lone
}

#[test]
fn lone_frames_skip_the_ring_in_copy_mode_and_keep_their_order() {
    let pair = veth_or_skip!("lone_frames_skip_the_ring_in_copy_mode_and_keep_their_order");
    // Bursts of one (the plain AF_PACKET send) right before and after bursts through the ring.
    let bursts = [1, 3, 1, 1, 7, 2, 1, 32];
    for tx in [TxRequest::Auto, TxRequest::Ring] {
        let options = AfXdpOptions { tx, ..AfXdpOptions::default() };
        let mut a = open_in(&pair.a, options).expect("open a");
        let mut b = open_in(&pair.b, options).expect("open b");
        let lone = one_way_in_mixed_bursts(&mut a, &mut b, 3_000, &bursts);
        assert!(lone >= 3_000 / 48 * 4, "{tx:?}: {lone} one-frame bursts");
        let expected = if tx == TxRequest::Auto { lone } else { 0 };
        assert_eq!(a.lone_frames_sent(), expected, "{tx:?}: frames sent around the ring");
        let (ca, cb) = (a.counters(), b.counters());
        assert_eq!(
            (ca.tx_frames, cb.rx_frames, ca.tx_dropped, cb.rx_dropped),
            (3_000, 3_000, 0, 0),
            "{tx:?}"
        );
        let bytes: u64 = (0..3_000).map(|s| frame(pair.b.mac, pair.a.mac, s, 1500).len() as u64).sum();
        assert_eq!((ca.tx_bytes, cb.rx_bytes), (bytes, bytes), "{tx:?}");
    }
    // Jumbo frames: a lone frame of several UMEM frames goes out whole from its slot.
    pair.set_mtu(9000).expect("ip link set mtu");
    let mut a = open_in(&pair.a, AfXdpOptions::default()).expect("open a");
    let mut b = open_in(&pair.b, AfXdpOptions::default()).expect("open b");
    assert!(a.xsk.multi_buffer(), "9014-byte frames take chains");
    let lone = one_way_in_mixed_bursts(&mut a, &mut b, 1_000, &bursts);
    assert_eq!(a.lone_frames_sent(), lone);
    assert_eq!((a.counters().tx_frames, b.counters().rx_frames), (1_000, 1_000));
    let (free, slots) = a.xsk.tx_slots();
    assert!(free + 32 >= slots, "lone frames hand their slots straight back: {free} of {slots} free");
}

#[test]
fn jumbo_frames_match_the_kernels_af_packet() {
    let pair = veth_or_skip!("jumbo_frames_match_the_kernels_af_packet");
    pair.set_mtu(16000).expect("ip link set mtu");
    against_af_packet(&pair, 1_000, 8, 16000);
}

#[test]
fn an_mtu_beyond_a_chain_of_umem_frames_is_refused() {
    let pair = veth_or_skip!("an_mtu_beyond_a_chain_of_umem_frames_is_refused");
    pair.set_mtu(40000).expect("ip link set mtu");
    // 17 frames of 2048 bytes hold 30,464 bytes of frame after the headroom.
    let small = AfXdpOptions { frame_size: 2048, ..AfXdpOptions::default() };
    let err = open_in(&pair.a, small).unwrap_err();
    assert!(err.to_string().contains("at most 17 UMEM frames"), "{err}");
    assert!(!xdp_shown(&pair.a).contains("xdp"), "{}", xdp_shown(&pair.a));
    // 40,014-byte frames take 11 frames of 4 KiB: 8 per half cannot hold four such chains.
    let few = AfXdpOptions { frame_count: 16, ring_size: 16, ..AfXdpOptions::default() };
    let err = open_in(&pair.a, few).unwrap_err();
    assert!(matches!(err, PortError::Misuse(_)) && err.to_string().contains("at least 44 frames"), "{err}");
    let a = open_ok(&pair.a);
    assert_eq!(a.mtu(), 40000);
}

#[test]
fn missing_interface_and_bad_queue_say_what_is_wrong() {
    let pair = veth_or_skip!("missing_interface_and_bad_queue_say_what_is_wrong");
    let err = pair.a.netns.run(|| open("lbnope0", 0, &AfXdpOptions::default())).unwrap().unwrap_err();
    assert!(err.to_string().contains("no interface \"lbnope0\""), "{err}");
    let ifname = pair.a.ifname.clone();
    let err = pair.a.netns.run(move || open(&ifname, 7, &AfXdpOptions::default())).unwrap().unwrap_err();
    assert!(err.to_string().contains("cannot bind to queue 7"), "{err}");
    // The failed open left nothing attached.
    assert!(!xdp_shown(&pair.a).contains("xdp"), "{}", xdp_shown(&pair.a));
    let bad = AfXdpOptions { frame_size: 3000, ..AfXdpOptions::default() };
    assert!(matches!(open("lo", 0, &bad), Err(PortError::Misuse(_))));
}

/// Drops every capability of the calling thread (capabilities are per thread on Linux, so the
/// rest of the test process keeps root).
fn drop_all_capabilities() {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let header = Header { version: 0x2008_0522, pid: 0 }; // _LINUX_CAPABILITY_VERSION_3
    let data = [Data { effective: 0, permitted: 0, inheritable: 0 }; 2];
    // SAFETY: capset reads one header and two data structs, both live.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &raw const header, data.as_ptr()) };
    assert_eq!(rc, 0, "capset: {}", io::Error::last_os_error());
}

#[test]
fn without_capabilities_it_says_it_needs_root() {
    let pair = veth_or_skip!("without_capabilities_it_says_it_needs_root");
    let ifname = pair.a.ifname.clone();
    let err = pair
        .a
        .netns
        .run(move || {
            drop_all_capabilities();
            open(&ifname, 0, &AfXdpOptions::default())
        })
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, PortError::Unavailable { .. }) && err.to_string().contains("needs root"), "{err}");
}

#[test]
fn a_panicking_receive_callback_loses_and_repeats_nothing() {
    let pair = veth_or_skip!("a_panicking_receive_callback_loses_and_repeats_nothing");
    let mut a = open_ok(&pair.a);
    let mut b = open_ok(&pair.b);
    let frames: Vec<_> = (0..8).map(|s| frame(pair.b.mac, pair.a.mac, s, 1500)).collect();
    assert_eq!(a.send(&frames), 8);
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut got = Vec::new();
    let mut panicked = false;
    // Seven arrive: the frame lent when the callback panicked is consumed.
    while got.len() < 7 && Instant::now() < deadline {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            b.rx_burst(64, &mut |f| {
                if got.len() == 3 && !panicked {
                    panicked = true;
                    panic!("callback fails on purpose");
                }
                got.push(f.to_vec());
            })
        }));
        assert!(outcome.is_ok() || panicked);
    }
    assert!(panicked, "the callback did panic");
    // The frame lent during the panic is gone (it was the caller's to keep); every other frame
    // arrives once, in order.
    let expected: Vec<_> =
        frames.iter().enumerate().filter(|(i, _)| *i != 3).map(|(_, f)| f.clone()).collect();
    assert_eq!(got[..3], expected[..3]);
    assert_eq!(got[3..].len(), 4);
    assert_eq!(got[3..], expected[3..]);
    // The UMEM frames all came back: a long exchange still runs.
    exchange(&mut a, pair.a.mac, &mut b, pair.b.mac, 5_000, 64, 1500);
}

#[test]
fn busy_polling_can_be_switched_on() {
    let pair = veth_or_skip!("busy_polling_can_be_switched_on");
    let busy =
        AfXdpOptions { busy_poll: Some(BusyPoll { usecs: 20, budget: 64 }), ..AfXdpOptions::default() };
    let mut a = open_in(&pair.a, busy).expect("busy-polling socket");
    let mut b = open_in(&pair.b, busy).expect("busy-polling socket");
    exchange(&mut a, pair.a.mac, &mut b, pair.b.mac, 2_000, 32, 1500);
    // Every transmit is a kick of the socket, lone frames too (that kick is what busy-polls).
    exchange(&mut a, pair.a.mac, &mut b, pair.b.mac, 500, 1, 1500);
    assert_eq!((a.lone_frames_sent(), b.lone_frames_sent()), (0, 0));
}

/// Not a test on its own: the child process of `the_program_goes_when_the_process_is_killed`
/// (run by it inside the namespace, with the interface in `LANBUS_AFXDP_HOLD`). Without that
/// variable it does nothing.
#[test]
#[ignore = "helper process for the_program_goes_when_the_process_is_killed"]
fn helper_hold_port_open() {
    let Ok(ifname) = std::env::var("LANBUS_AFXDP_HOLD") else { return };
    let port = open(&ifname, 0, &AfXdpOptions::default()).expect("child opens the port");
    println!("ready {:?}", port.xdp_mode());
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn the_program_goes_when_the_process_is_killed() {
    use std::io::BufRead;
    let pair = veth_or_skip!("the_program_goes_when_the_process_is_killed");
    let exe = std::env::current_exe().unwrap();
    let mut child = pair
        .a
        .netns
        .command(exe.to_str().unwrap())
        .args(["--exact", "afxdp::tests::helper_hold_port_open", "--ignored", "--nocapture"])
        .env("LANBUS_AFXDP_HOLD", &pair.a.ifname)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = lines.by_ref().map_while(|l| l.ok()).any(|l| l.starts_with("ready"));
    assert!(ready, "child opened the port");
    assert!(xdp_shown(&pair.a).contains("prog/xdp"), "attached by the child");
    child.kill().unwrap(); // SIGKILL: no destructor runs
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(2);
    while xdp_shown(&pair.a).contains("xdp") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!xdp_shown(&pair.a).contains("xdp"), "{}", xdp_shown(&pair.a));
    drop(open_ok(&pair.a));
}

#[test]
fn netlink_attachment_carries_frames_refuses_to_replace_and_detaches() {
    for (xdp_mode, mode) in
        [(XdpModeRequest::Auto, XdpMode::Generic), (XdpModeRequest::Native, XdpMode::Native)]
    {
        let pair = veth_or_skip!("netlink_attachment_carries_frames_refuses_to_replace_and_detaches");
        netlink_attachment(
            &pair,
            AfXdpOptions { xdp_mode, attach: AttachRequest::Netlink, ..Default::default() },
            mode,
        );
    }
}

fn netlink_attachment(pair: &VethPair, netlink: AfXdpOptions, mode: XdpMode) {
    let mut a = open_in(&pair.a, netlink).expect("attach through rtnetlink");
    assert_eq!(a.xdp_mode(), mode);
    assert!(xdp_shown(&pair.a).contains("prog/xdp"), "{}", xdp_shown(&pair.a));
    for attach in [AttachRequest::Netlink, AttachRequest::Link] {
        let err = open_in(&pair.a, AfXdpOptions { attach, ..AfXdpOptions::default() }).expect_err("replace");
        assert!(err.to_string().contains("already has an XDP program"), "{attach:?}: {err}");
    }
    let mut b = open_ok(&pair.b);
    exchange(&mut a, pair.a.mac, &mut b, pair.b.mac, 2_000, 64, 1500);
    // Dropped on this thread, outside the namespace: the netlink socket from attach time is used.
    drop(a);
    assert!(!xdp_shown(&pair.a).contains("xdp"), "{}", xdp_shown(&pair.a));
}

#[test]
fn the_kernels_explanation_reaches_the_error() {
    let pair = veth_or_skip!("the_kernels_explanation_reaches_the_error");
    // Loopback has no native XDP; give it an MTU the UMEM frames hold so attaching is what fails.
    pair.a.netns.ip(&["link", "set", "dev", "lo", "mtu", "1500"]).unwrap();
    let native = AfXdpOptions { xdp_mode: XdpModeRequest::Native, ..AfXdpOptions::default() };
    let netlink = AfXdpOptions { attach: AttachRequest::Netlink, ..native };
    let err = pair.a.netns.run(move || open("lo", 0, &netlink)).unwrap().unwrap_err();
    // "(kernel: Underlying driver does not support XDP in native mode)" on Linux 6.18.
    let text = err.to_string();
    assert!(text.contains("has no native XDP") && text.contains("(kernel: "), "{text}");
    let err = pair.a.netns.run(move || open("lo", 0, &native)).unwrap().unwrap_err();
    assert!(err.to_string().contains("has no native XDP"), "{err}");
    // Auto falls back to generic mode there.
    let port = pair.a.netns.run(|| open("lo", 0, &AfXdpOptions::default())).unwrap().expect("generic on lo");
    assert_eq!(port.xdp_mode(), XdpMode::Generic);
}

#[test]
fn wait_sleeps_until_a_frame_or_the_timeout() {
    let pair = veth_or_skip!("wait_sleeps_until_a_frame_or_the_timeout");
    let mut a = open_ok(&pair.a);
    let mut b = open_ok(&pair.b);
    let t0 = Instant::now();
    a.wait(Some(Duration::from_millis(60))).unwrap();
    let slept = t0.elapsed();
    assert!(slept >= Duration::from_millis(50), "returned early without a frame: {slept:?}");
    let (a_mac, b_mac) = (pair.a.mac, pair.b.mac);
    let sender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(b.send(&[frame(a_mac, b_mac, 0, 1500)]), 1);
        b
    });
    let t0 = Instant::now();
    let mut got = Vec::new();
    while got.is_empty() && t0.elapsed() < Duration::from_secs(5) {
        a.wait(Some(Duration::from_secs(5))).unwrap();
        a.recv(&mut got);
    }
    assert!(t0.elapsed() < Duration::from_secs(2), "woke {:?} after the frame was sent", t0.elapsed());
    assert_eq!(got, vec![frame(a_mac, b_mac, 0, 1500)]);
    drop(sender.join().unwrap());
}

#[test]
fn the_fill_ring_is_topped_up_a_line_at_a_time_and_small_umems_get_every_frame() {
    let pair = veth_or_skip!("the_fill_ring_is_topped_up_a_line_at_a_time_and_small_umems_get_every_frame");
    // Default: 2048 receive frames, returned 8 at a time with 16-23 held back. Small: 16 receive
    // frames, each returned at once (holding any back would starve the kernel).
    let small = AfXdpOptions { frame_count: 32, ring_size: 16, ..AfXdpOptions::default() };
    for (options, rx_frames, held, batch) in
        [(AfXdpOptions::default(), 2048, 16..=23, 8), (small, 16, 0..=0, 1)]
    {
        let mut a = open_in(&pair.a, options).expect("open a");
        let mut b = open_in(&pair.b, options).expect("open b");
        let (h, producer) = b.xsk.fill_state();
        assert!(held.contains(&h), "{rx_frames} frames: {h} held after the first fill");
        assert_eq!(producer, rx_frames - h, "the first fill gives the kernel the rest");
        let mtu = a.mtu();
        // Several times around the ring, one burst in flight at a time.
        let count = 3 * rx_frames + 5;
        exchange(&mut a, pair.a.mac, &mut b, pair.b.mac, count, 7, mtu);
        let (h, producer) = b.xsk.fill_state();
        assert!(held.contains(&h), "{rx_frames} frames: {h} held after {count} received");
        assert_eq!(producer % batch, 0, "whole batches only");
        // Every frame received went back except those held: the kernel consumed `count` entries.
        assert_eq!(producer.wrapping_sub(count), rx_frames - h, "{rx_frames} frames: entries lost");
    }
}
