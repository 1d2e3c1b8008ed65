//! The udp port through loopback (no root) and across a veth pair between two namespaces.

mod common;

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

use common::{frame, frame_typed, len_for, recv_n, recv_pair, send_all, seq_of, warm_up};
use lanbus_port::netns::VethPair;
use lanbus_port::udp::{derived_mac, UdpConfig, UdpPort};
use lanbus_port::Port;
use lanbus_wire::ethernet::HEADER_LEN;
use lanbus_wire::MacAddr;

const SECOND: Duration = Duration::from_secs(1);

fn loopback_pair() -> (UdpPort, UdpPort) {
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let mut a = UdpPort::open(&UdpConfig::new(any)).unwrap();
    let mut b = UdpPort::open(&UdpConfig::new(any)).unwrap();
    a.add_peer(b.mac(), b.local_addr()).unwrap();
    b.add_peer(a.mac(), a.local_addr()).unwrap();
    (a, b)
}

/// Checks a received frame against what the sender built: the port rebuilt the Ethernet header
/// (destination = receiver, source = sender's MAC from the peer table) and the payload is intact.
fn check_received(got: &[u8], want: &[u8], receiver: MacAddr) {
    assert_eq!(&got[0..6], &receiver.0, "destination is the receiver's MAC");
    assert_eq!(&got[6..], &want[6..], "source, EtherType and payload intact");
}

#[test]
fn loopback_exchanges_10000_frames_each_way_in_order() {
    let (mut a, mut b) = loopback_pair();
    const TOTAL: u32 = 10_000;
    const BURST: u32 = 100;
    let mtu = a.mtu();
    let mut seq = 0;
    while seq < TOTAL {
        let a_frames: Vec<Vec<u8>> =
            (seq..seq + BURST).map(|s| frame(b.mac(), a.mac(), s, len_for(s, mtu))).collect();
        let b_frames: Vec<Vec<u8>> =
            (seq..seq + BURST).map(|s| frame(a.mac(), b.mac(), s + TOTAL, len_for(s + TOTAL, mtu))).collect();
        send_all(&mut a, &a_frames, SECOND);
        send_all(&mut b, &b_frames, SECOND);
        let (at_a, at_b) = recv_pair(&mut a, &mut b, BURST as usize, BURST as usize, 5 * SECOND);
        assert_eq!(at_b.len(), BURST as usize, "burst at {seq} reached b");
        assert_eq!(at_a.len(), BURST as usize, "burst at {seq} reached a");
        for (got, want) in at_b.iter().zip(&a_frames) {
            check_received(got, want, b.mac());
        }
        for (got, want) in at_a.iter().zip(&b_frames) {
            check_received(got, want, a.mac());
        }
        seq += BURST;
    }
    for p in [&a, &b] {
        let c = p.counters();
        assert_eq!((c.tx_frames, c.rx_frames), (TOTAL as u64, TOTAL as u64), "{c:?}");
        assert_eq!((c.tx_dropped, c.rx_dropped), (0, 0), "{c:?}");
    }
    // Nothing more is waiting.
    assert_eq!(a.rx_burst(64, &mut |_| panic!("extra frame")).unwrap(), 0);
}

#[test]
fn ipv6_loopback_works_too() {
    let any: SocketAddr = "[::1]:0".parse().unwrap();
    let Ok(mut a) = UdpPort::open(&UdpConfig::new(any)) else {
        eprintln!("ipv6_loopback_works_too skipped: no IPv6 loopback here");
        return;
    };
    let mut b = UdpPort::open(&UdpConfig::new(any)).unwrap();
    a.add_peer(b.mac(), b.local_addr()).unwrap();
    b.add_peer(a.mac(), a.local_addr()).unwrap();
    assert_eq!(a.mtu(), lanbus_port::udp::DEFAULT_MTU_V6);
    let frames: Vec<Vec<u8>> = (0..200).map(|s| frame(b.mac(), a.mac(), s, len_for(s, a.mtu()))).collect();
    send_all(&mut a, &frames, SECOND);
    let got = recv_n(&mut b, 200, 2 * SECOND);
    assert_eq!(got.len(), 200);
    for (g, w) in got.iter().zip(&frames) {
        check_received(g, w, b.mac());
    }
}

#[test]
fn malformed_and_unknown_datagrams_are_counted_and_dropped() {
    let (mut a, _b) = loopback_pair();
    // A plain socket that a knows as a peer, to send raw datagrams from.
    let raw = UdpSocket::bind("127.0.0.1:0").unwrap();
    let raw_mac = MacAddr::local(0x00ab_cdef);
    a.add_peer(raw_mac, raw.local_addr().unwrap()).unwrap();
    let to = a.local_addr();
    raw.send_to(&[0u8; 10], to).unwrap(); // shorter than a lanbus header
    raw.send_to(&vec![7u8; a.mtu() + 100], to).unwrap(); // longer than the MTU
    let good = frame(a.mac(), raw_mac, 42, 64);
    raw.send_to(&good[HEADER_LEN..], to).unwrap();
    // An unknown sender.
    let stranger = UdpSocket::bind("127.0.0.1:0").unwrap();
    stranger.send_to(&good[HEADER_LEN..], to).unwrap();

    let got = recv_n(&mut a, 2, Duration::from_millis(300));
    assert_eq!(got.len(), 1, "only the good datagram is delivered");
    check_received(&got[0], &good, a.mac());
    assert_eq!(&got[0][6..12], &raw_mac.0);
    assert_eq!(a.counters().rx_dropped, 3);
    assert_eq!(a.unknown_senders(), 1);
}

#[test]
fn transmit_drops_what_udp_cannot_carry() {
    let (mut a, mut b) = loopback_pair();
    let other_type = frame_typed(b.mac(), a.mac(), 0x0800, 1, 64);
    let nobody = frame(MacAddr::local(0x0012_3456), a.mac(), 2, 64);
    let too_long = frame(b.mac(), a.mac(), 3, a.mtu() + 1);
    let ok = frame(b.mac(), a.mac(), 4, 64);
    let sent = a.send_frames(&[&other_type, &nobody, &too_long, &ok]).unwrap();
    // The too-long frame does not fit the buffer, so send_frames skips it itself.
    assert_eq!(sent, 1);
    assert_eq!(a.counters().tx_dropped, 2);
    assert_eq!(a.unknown_destinations(), 1);
    let got = recv_n(&mut b, 4, Duration::from_millis(200));
    assert_eq!(got.len(), 1);
    assert_eq!(seq_of(&got[0]), 4);
}

#[test]
fn broadcast_reaches_every_peer_and_learning_adds_senders() {
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let mut hub = UdpPort::open(&UdpConfig { learn: true, ..UdpConfig::new(any) }).unwrap();
    let mut x = UdpPort::open(&UdpConfig::new(any)).unwrap();
    let mut y = UdpPort::open(&UdpConfig::new(any)).unwrap();
    for p in [&mut x, &mut y] {
        p.add_peer(hub.mac(), hub.local_addr()).unwrap();
    }
    // The hub names nobody: it learns x and y from their first frames (MACs derived from the
    // addresses, which is also how x and y chose their own).
    let (from_x, from_y) = (frame(hub.mac(), x.mac(), 1, 64), frame(hub.mac(), y.mac(), 2, 64));
    send_all(&mut x, &[from_x], SECOND);
    send_all(&mut y, &[from_y], SECOND);
    let got = recv_n(&mut hub, 2, 2 * SECOND);
    assert_eq!(got.len(), 2);
    let mut sources: Vec<MacAddr> = got.iter().map(|f| MacAddr(f[6..12].try_into().unwrap())).collect();
    sources.sort();
    assert_eq!(x.mac(), derived_mac(x.local_addr()));
    let mut want = vec![x.mac(), y.mac()];
    want.sort();
    assert_eq!(sources, want);
    assert_eq!(hub.peers().count(), 2);
    // A broadcast from the hub reaches both.
    let broadcast = frame(MacAddr::BROADCAST, hub.mac(), 9, 100);
    send_all(&mut hub, &[broadcast], SECOND);
    for p in [&mut x, &mut y] {
        let got = recv_n(p, 1, 2 * SECOND);
        assert_eq!(got.len(), 1);
        assert_eq!(seq_of(&got[0]), 9);
        assert_eq!(&got[0][0..6], &p.mac().0, "arrives addressed to the receiver");
    }
    assert_eq!(hub.counters().tx_frames, 1, "one frame, two datagrams");
}

#[test]
fn udp_across_a_veth_pair_leaves_other_traffic_alone() {
    let pair = match VethPair::create() {
        Ok(p) => p,
        Err(skip) => {
            eprintln!("udp_across_a_veth_pair_leaves_other_traffic_alone {skip}");
            return;
        }
    };
    warm_up(&pair);
    let (ip_a, ip_b) = (pair.a.ipv4, pair.b.ipv4);
    let spec_a = format!("udp:{ip_a}:7000,peer={ip_b}:7000");
    let spec_b = format!("udp:{ip_b}:7000,peer={ip_a}:7000");
    // Typed ports (the spec parser made their configurations) so that a failure can say more.
    let config_a = UdpConfig::parse(spec_a.strip_prefix("udp:").unwrap()).unwrap();
    let config_b = UdpConfig::parse(spec_b.strip_prefix("udp:").unwrap()).unwrap();
    let mut a = pair.a.netns.run(move || UdpPort::open(&config_a)).unwrap().unwrap();
    let mut b = pair.b.netns.run(move || UdpPort::open(&config_b)).unwrap().unwrap();
    // Ordinary traffic between the namespaces still flows while the ports are open.
    let plain_b: SocketAddr = (ip_b, 7001).into();
    let plain_rx = pair.b.netns.run(move || UdpSocket::bind(plain_b)).unwrap().unwrap();
    plain_rx.set_read_timeout(Some(2 * SECOND)).unwrap();

    let mtu = a.mtu();
    for round in 0..20u32 {
        let to_b: Vec<Vec<u8>> =
            (0..50).map(|i| round * 50 + i).map(|s| frame(b.mac(), a.mac(), s, len_for(s, mtu))).collect();
        let to_a: Vec<Vec<u8>> =
            (0..50).map(|i| round * 50 + i).map(|s| frame(a.mac(), b.mac(), s, len_for(s, mtu))).collect();
        send_all(&mut a, &to_b, SECOND);
        send_all(&mut b, &to_a, SECOND);
        // Both ports are driven while receiving: the first burst may wait for ARP, and datagrams
        // the kernel could not take yet go out on the port's next call.
        let (at_a, at_b) = recv_pair(&mut a, &mut b, 50, 50, 5 * SECOND);
        assert_eq!(
            (at_a.len(), at_b.len()),
            (50, 50),
            "round {round}: a {:?} pending {} error {:?}; b {:?} pending {} error {:?}",
            a.counters(),
            a.has_pending(),
            a.last_tx_error(),
            b.counters(),
            b.has_pending(),
            b.last_tx_error()
        );
        for (got, want) in at_b.iter().zip(&to_b) {
            check_received(got, want, b.mac());
        }
        for (got, want) in at_a.iter().zip(&to_a) {
            check_received(got, want, a.mac());
        }
    }
    pair.a
        .netns
        .run(move || UdpSocket::bind("0.0.0.0:0").unwrap().send_to(b"plain", plain_b).unwrap())
        .unwrap();
    let mut buf = [0u8; 16];
    let (n, _) = plain_rx.recv_from(&mut buf).expect("plain UDP still works");
    assert_eq!(&buf[..n], b"plain");
    // A frame of another EtherType cannot travel as lanbus-over-UDP: dropped and counted.
    let arp_like = frame_typed(b.mac(), a.mac(), 0x0806, 1, 64);
    assert_eq!(a.send_frames(&[&arp_like]).unwrap(), 0);
    assert_eq!(a.counters().tx_dropped, 1);
    assert!(recv_n(&mut b, 1, Duration::from_millis(100)).is_empty());
    assert_eq!(b.counters().rx_frames, 1000);
}

#[test]
fn udp_broadcast_address_reaches_a_port_bound_to_any() {
    let Ok(pair) = VethPair::create()
        .map_err(|skip| eprintln!("udp_broadcast_address_reaches_a_port_bound_to_any {skip}"))
    else {
        return;
    };
    // a listens on 0.0.0.0 (the only way to receive IPv4 broadcasts), so it names its own MAC and
    // learns senders; b names a as a peer under a's MAC and also broadcasts to the subnet.
    warm_up(&pair);
    let a_mac = MacAddr::local(0x00aa_0001);
    let spec_a = format!("udp:0.0.0.0:7100,mac={a_mac},learn");
    let spec_b = format!("udp:{}:7100,peer={a_mac}@{}:7100,bcast=10.77.0.255:7100", pair.b.ipv4, pair.a.ipv4);
    let mut a = pair
        .a
        .netns
        .run(move || spec_a.parse::<lanbus_port::PortSpec>().and_then(|s| s.open()))
        .unwrap()
        .unwrap();
    let mut b = pair
        .b
        .netns
        .run(move || spec_b.parse::<lanbus_port::PortSpec>().and_then(|s| s.open()))
        .unwrap()
        .unwrap();
    assert_eq!(a.mac(), a_mac);
    let hello = frame(MacAddr::BROADCAST, b.mac(), 1, 80);
    send_all(&mut *b, std::slice::from_ref(&hello), SECOND);
    // Once as a unicast to the named peer, once through the subnet broadcast address.
    let got = recv_n(&mut *a, 2, 2 * SECOND);
    assert_eq!(got.len(), 2, "{:?}", a.counters());
    for g in &got {
        check_received(g, &hello, a_mac);
        assert_eq!(&g[6..12], &b.mac().0, "b was learned under its derived MAC, which is its own");
    }
    // a can answer b now that it learned it.
    send_all(&mut *a, &[frame(b.mac(), a_mac, 2, 80)], SECOND);
    let back = recv_n(&mut *b, 1, 2 * SECOND);
    assert_eq!(back.len(), 1);
    assert_eq!(seq_of(&back[0]), 2);
}

#[test]
fn frames_the_kernel_cannot_take_yet_stay_queued_and_block_new_ones() {
    let Ok(pair) = VethPair::create().map_err(|skip| eprintln!("frames_the_kernel_cannot_take_yet {skip}"))
    else {
        return;
    };
    // A peer address nobody answers ARP for: datagrams wait in the neighbour queue and hold the
    // (tiny) send buffer, so the socket soon says EAGAIN.
    let black_hole = MacAddr::local(0x0099_0099);
    let config =
        UdpConfig::parse(&format!("{}:7200,peer={black_hole}@10.77.0.99:7200", pair.a.ipv4)).unwrap();
    let mut a = pair.a.netns.run(move || UdpPort::open(&config)).unwrap().unwrap();
    use std::os::fd::AsRawFd;
    let one: libc::c_int = 1;
    // SAFETY: setsockopt on our own socket with a live c_int.
    let rc = unsafe {
        libc::setsockopt(
            a.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            &one as *const libc::c_int as *const libc::c_void,
            core::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0);
    let frames: Vec<Vec<u8>> = (0..20).map(|s| frame(black_hole, a.mac(), s, 1400)).collect();
    let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_slice()).collect();
    assert_eq!(a.send_frames(&refs).unwrap(), 20, "the port takes a burst it has slots for");
    assert!(a.has_pending(), "the kernel refused some: they wait in the port");
    let extra = frame(black_hole, a.mac(), 99, 64);
    assert_eq!(a.send_frames(&[&extra]).unwrap(), 0, "no new frames while old ones wait");
    assert_eq!(a.counters().tx_frames, 20);
    assert_eq!(a.counters().tx_dropped, 0);
}
