//! The afpacket port across a veth pair between two namespaces (needs root; skips without it).

mod common;

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

use common::{frame, frame_typed, len_for, recv_n, recv_pair, send_all, seq_of};
use lanbus_port::afpacket::{AfPacketConfig, AfPacketPort, RxVersion};
use lanbus_port::netns::VethPair;
use lanbus_port::{Port, PortError};

const SECOND: Duration = Duration::from_secs(1);

fn pair_or_skip(test: &str) -> Option<VethPair> {
    match VethPair::create() {
        Ok(p) => Some(p),
        Err(skip) => {
            eprintln!("{test} {skip}");
            None
        }
    }
}

fn open_in(end: &lanbus_port::netns::VethEnd, rx: RxVersion) -> AfPacketPort {
    let config = AfPacketConfig { rx, ..AfPacketConfig::new(&end.ifname) };
    end.netns.run(move || AfPacketPort::open(&config)).unwrap().expect("afpacket port opens")
}

#[test]
fn frames_cross_both_ways_in_order_and_other_traffic_still_works() {
    for rx in [RxVersion::V3, RxVersion::V2] {
        exchange(rx);
    }
}

fn exchange(rx: RxVersion) {
    let Some(pair) = pair_or_skip("frames_cross_both_ways_in_order_and_other_traffic_still_works") else {
        return;
    };
    let mut a = open_in(&pair.a, rx);
    let mut b = open_in(&pair.b, rx);
    assert_eq!((a.mac(), b.mac()), (pair.a.mac, pair.b.mac));
    assert_eq!(a.mtu(), 1500);
    assert!(a.ignores_outgoing_in_kernel() && a.qdisc_bypass(), "Linux 4.20+ has both");
    assert_eq!(attached_filter_len(&a), 4, "the EtherType filter is attached");
    let plain_b: SocketAddr = (pair.b.ipv4, 7001).into();
    let plain_rx = pair.b.netns.run(move || UdpSocket::bind(plain_b)).unwrap().unwrap();
    plain_rx.set_read_timeout(Some(2 * SECOND)).unwrap();

    const BURST: u32 = 64;
    const ROUNDS: u32 = 40;
    for round in 0..ROUNDS {
        let seqs = round * BURST..(round + 1) * BURST;
        let to_b: Vec<Vec<u8>> = seqs.clone().map(|s| frame(b.mac(), a.mac(), s, len_for(s, 1500))).collect();
        let to_a: Vec<Vec<u8>> = seqs.map(|s| frame(a.mac(), b.mac(), s, len_for(s, 1500))).collect();
        send_all(&mut a, &to_b, SECOND);
        send_all(&mut b, &to_a, SECOND);
        let (at_a, at_b) = recv_pair(&mut a, &mut b, BURST as usize, BURST as usize, 5 * SECOND);
        assert_eq!((at_a.len(), at_b.len()), (BURST as usize, BURST as usize), "{rx:?} round {round}");
        assert_eq!(at_b, to_b, "{rx:?} round {round}: frames reach b unchanged and in order");
        assert_eq!(at_a, to_a, "{rx:?} round {round}: frames reach a unchanged and in order");
    }
    // Neither port saw its own frames.
    assert!(recv_n(&mut a, 1, Duration::from_millis(20)).is_empty());
    let total = u64::from(BURST * ROUNDS);
    for p in [&a, &b] {
        let c = p.counters();
        assert_eq!((c.tx_frames, c.rx_frames, c.tx_dropped, c.rx_dropped), (total, total, 0, 0), "{c:?}");
    }
    // The machine's other traffic is untouched while the ports are open.
    pair.a
        .netns
        .run(move || UdpSocket::bind("0.0.0.0:0").unwrap().send_to(b"plain", plain_b).unwrap())
        .unwrap();
    let mut buf = [0u8; 16];
    let (n, _) = plain_rx.recv_from(&mut buf).expect("plain UDP still works");
    assert_eq!(&buf[..n], b"plain");
    // And the ports did not pick the IP traffic up.
    assert!(recv_n(&mut b, 1, Duration::from_millis(20)).is_empty());
    assert_eq!(b.counters().rx_dropped, 0);
}

#[test]
fn malformed_and_foreign_frames_are_not_delivered() {
    for rx in [RxVersion::V3, RxVersion::V2] {
        malformed(rx);
    }
}

fn malformed(rx: RxVersion) {
    let Some(pair) = pair_or_skip("malformed_and_foreign_frames_are_not_delivered") else {
        return;
    };
    // a may send 4 bytes more than b accepts: veth lets such a frame through (mtu + VLAN tag).
    pair.a.netns.ip(&["link", "set", &pair.a.ifname, "mtu", "1504"]).unwrap();
    let mut a = open_in(&pair.a, rx);
    let mut b = open_in(&pair.b, rx);
    assert_eq!((a.mtu(), b.mtu()), (1504, 1500));
    let junk = [
        frame_typed(b.mac(), a.mac(), 0x88b6, 1, 100), // another EtherType: filtered out
        frame_typed(b.mac(), a.mac(), 0x0800, 2, 100), // IPv4 EtherType (not a valid packet)
        frame(b.mac(), a.mac(), 3, 10),                // shorter than a lanbus header
        frame(b.mac(), a.mac(), 4, 1504),              // longer than b's MTU
    ];
    let good = frame(b.mac(), a.mac(), 5, 200);
    let mut all: Vec<&[u8]> = junk.iter().map(|f| f.as_slice()).collect();
    all.push(&good);
    assert_eq!(a.send_frames(&all).unwrap(), 5, "raw ports send any well-sized frame");
    let got = recv_n(&mut b, 5, Duration::from_millis(300));
    assert_eq!(got.len(), 1, "only the lanbus frame of a valid length arrives");
    assert_eq!(seq_of(&got[0]), 5);
    assert_eq!(got[0], good);
    // The short and the long frame reached the ring and were counted; the other EtherTypes
    // never reached it (protocol binding and BPF filter).
    assert_eq!(b.counters().rx_dropped, 2, "{:?}", b.counters());
    assert_eq!(b.kernel_drops(), 0);
    // A frame longer than a's own capacity is refused before it reaches the ring.
    let too_long_for_a = frame(b.mac(), a.mac(), 6, 1505);
    assert_eq!(a.send_frames(&[&too_long_for_a]).unwrap(), 0);
}

#[test]
fn clear_errors_without_privileges_or_a_usable_interface() {
    let Some(pair) = pair_or_skip("clear_errors_without_privileges_or_a_usable_interface") else {
        return;
    };
    // Drop CAP_NET_RAW on one thread only (capabilities are per thread) and try to open.
    let ifname = pair.a.ifname.clone();
    let err = pair
        .a
        .netns
        .run(move || {
            drop_cap_net_raw();
            AfPacketPort::open(&AfPacketConfig::new(&ifname)).map(|_| ())
        })
        .unwrap()
        .expect_err("opens without CAP_NET_RAW");
    assert!(matches!(err, PortError::Unavailable { .. }), "{err}");
    assert!(err.to_string().contains("CAP_NET_RAW") && err.to_string().contains("root"), "{err}");

    let spec = "afpacket:lbnosuchif9".to_string();
    let err = pair
        .a
        .netns
        .run(move || spec.parse::<lanbus_port::PortSpec>().and_then(|s| s.open()).map(|_| ()))
        .unwrap()
        .unwrap_err();
    assert!(err.to_string().contains("no interface named"), "{err}");

    pair.a.netns.ip(&["link", "set", &pair.a.ifname, "down"]).unwrap();
    let spec = format!("afpacket:{}", pair.a.ifname);
    let err = pair
        .a
        .netns
        .run(move || spec.parse::<lanbus_port::PortSpec>().and_then(|s| s.open()).map(|_| ()))
        .unwrap()
        .unwrap_err();
    assert!(err.to_string().contains("is down") && err.to_string().contains("ip link set"), "{err}");

    let err = pair
        .a
        .netns
        .run(|| "afpacket:lo".parse::<lanbus_port::PortSpec>().and_then(|s| s.open()).map(|_| ()))
        .unwrap()
        .unwrap_err();
    assert!(err.to_string().contains("not an Ethernet interface"), "{err}");
}

/// Instructions in the classic BPF program attached to the port's socket.
fn attached_filter_len(port: &AfPacketPort) -> usize {
    use std::os::fd::AsRawFd;
    let mut len: libc::socklen_t = 0;
    // SAFETY: SO_GET_FILTER with a zero length only reports the program's length in `len`.
    let rc = unsafe {
        libc::getsockopt(
            port.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_GET_FILTER,
            core::ptr::null_mut(),
            &mut len,
        )
    };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    len as usize
}

/// Removes CAP_NET_RAW from the calling thread's effective set.
fn drop_cap_net_raw() {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
    const CAP_NET_RAW: u32 = 13;
    let mut header = Header { version: LINUX_CAPABILITY_VERSION_3, pid: 0 };
    let mut data = [Data::default(); 2];
    // SAFETY: capget/capset with a version-3 header and two data words, as the ABI requires;
    // pid 0 means the calling thread.
    unsafe {
        assert_eq!(libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()), 0);
        data[0].effective &= !(1 << CAP_NET_RAW);
        assert_eq!(libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()), 0);
    }
}

#[test]
fn a_burst_larger_than_the_transmit_ring_arrives_whole() {
    for rx in [RxVersion::V3, RxVersion::V2] {
        let Some(pair) = pair_or_skip("a_burst_larger_than_the_transmit_ring_arrives_whole") else {
            return;
        };
        let mut a = open_in(&pair.a, rx);
        let mut b = open_in(&pair.b, rx);
        // 1000 frames against a 256-slot transmit ring: the port stops when the ring is full and
        // send_all retries; the receive rings (4 MiB of V3 blocks, 1024 V2 slots) hold them all.
        let frames: Vec<Vec<u8>> = (0..1000).map(|s| frame(b.mac(), a.mac(), s, len_for(s, 1400))).collect();
        send_all(&mut a, &frames, 5 * SECOND);
        let got = recv_n(&mut b, frames.len(), 5 * SECOND);
        assert_eq!(got.len(), frames.len(), "{rx:?}: {:?}, kernel drops {}", b.counters(), b.kernel_drops());
        assert!(got == frames, "{rx:?}: frames changed or reordered");
        assert_eq!(a.counters().tx_frames, 1000);
    }
}

#[test]
fn single_frames_and_bursts_interleave_in_order() {
    let Some(pair) = pair_or_skip("single_frames_and_bursts_interleave_in_order") else {
        return;
    };
    let mut a = open_in(&pair.a, RxVersion::V2);
    let mut b = open_in(&pair.b, RxVersion::V2);
    assert!(a.sends_single_frames_directly(), "the ring-less socket opens as root");
    // A frame alone costs one system call, its own send: the ring has nothing to kick.
    let lone = frame(b.mac(), a.mac(), 0, len_for(0, 1500));
    send_all(&mut a, &[lone], SECOND);
    assert_eq!(a.kicks(), 0, "a lone frame kicks the transmit ring");
    assert_eq!(recv_n(&mut b, 1, 5 * SECOND).len(), 1);
    // Bursts of 1..=12 frames: each burst's first frame leaves through the ring-less socket, the
    // rest through the ring, and they must arrive as sent.
    let mut seq = 0u32;
    let mut sent = 0usize;
    for burst in (1..=12u32).cycle().take(60) {
        let frames: Vec<Vec<u8>> =
            (seq..seq + burst).map(|s| frame(b.mac(), a.mac(), s, len_for(s, 1500))).collect();
        send_all(&mut a, &frames, SECOND);
        seq += burst;
        sent += frames.len();
    }
    let got = recv_n(&mut b, sent, 5 * SECOND);
    assert_eq!(got.len(), sent);
    for (i, f) in got.iter().enumerate() {
        assert_eq!(seq_of(f), i as u32, "frame {i} out of order");
        assert_eq!(f.len(), 14 + len_for(i as u32, 1500), "frame {i} intact");
    }
    assert_eq!(a.counters().tx_frames, sent as u64 + 1, "the bursts and the lone frame");
    assert_eq!(a.counters().tx_dropped, 0);
}

#[test]
fn borrowed_frames_leave_in_order_between_ring_bursts() {
    let Some(pair) = pair_or_skip("borrowed_frames_leave_in_order_between_ring_bursts") else {
        return;
    };
    let mut a = open_in(&pair.a, RxVersion::V2);
    let mut b = open_in(&pair.b, RxVersion::V2);
    assert!(a.borrows_frames(), "the ring-less socket opens as root");
    // Bursts of 1..=40 frames sent from the caller's memory (more than one sendmmsg's 32),
    // every third burst through the transmit ring instead; all arrive as sent.
    let mut seq = 0u32;
    let mut sent = 0usize;
    for (i, burst) in (1..=40u32).enumerate() {
        let frames: Vec<Vec<u8>> =
            (seq..seq + burst).map(|s| frame(b.mac(), a.mac(), s, len_for(s, 1500))).collect();
        if i % 3 == 2 {
            send_all(&mut a, &frames, SECOND);
        } else {
            let borrowed: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
            assert_eq!(a.tx_borrowed(&borrowed).unwrap(), frames.len());
        }
        seq += burst;
        sent += frames.len();
        // Keep the receive ring from filling: take what arrived so far.
        let got = recv_n(&mut b, frames.len(), 5 * SECOND);
        assert_eq!(got, frames, "burst {i} arrived whole and in order");
    }
    assert_eq!(a.counters().tx_frames, sent as u64);
    // Frames the port cannot carry are dropped and counted, the rest still go.
    let good = frame(b.mac(), a.mac(), seq, 100);
    let too_long = vec![0u8; a.frame_capacity() + 1];
    assert_eq!(a.tx_borrowed(&[&too_long, &good, &[0u8; 4]]).unwrap(), 3);
    assert_eq!(recv_n(&mut b, 1, 5 * SECOND), vec![good]);
    assert_eq!(a.counters().tx_dropped, 2);
}

#[test]
fn frames_in_two_pieces_arrive_joined() {
    let Some(pair) = pair_or_skip("frames_in_two_pieces_arrive_joined") else {
        return;
    };
    let mut a = open_in(&pair.a, RxVersion::V2);
    let mut b = open_in(&pair.b, RxVersion::V2);
    // Each frame cut in two at a different place (the second piece empty too, and a lone
    // frame of each kind); bursts past one sendmmsg's 32.
    let mut seq = 0u32;
    for burst in [1u32, 1, 5, 40] {
        let frames: Vec<Vec<u8>> =
            (seq..seq + burst).map(|s| frame(b.mac(), a.mac(), s, len_for(s, 1500))).collect();
        let parts: Vec<[&[u8]; 2]> = frames
            .iter()
            .enumerate()
            .map(|(i, f)| f.split_at(if i % 4 == 3 { f.len() } else { 14 + (i * 37) % (f.len() - 14) }))
            .map(|(h, t)| [h, t])
            .collect();
        assert_eq!(a.tx_borrowed_parts(&parts).unwrap(), frames.len());
        assert_eq!(recv_n(&mut b, frames.len(), 5 * SECOND), frames, "burst of {burst} joined and in order");
        seq += burst;
    }
    // A frame too long in its two pieces is dropped and counted; the rest go.
    let good = frame(b.mac(), a.mac(), seq, 100);
    let big = vec![0u8; a.frame_capacity()];
    assert_eq!(a.tx_borrowed_parts(&[[&big, &[0u8; 1]], [&good[..20], &good[20..]]]).unwrap(), 2);
    assert_eq!(recv_n(&mut b, 1, 5 * SECOND), vec![good]);
    assert_eq!(a.counters().tx_dropped, 1);
}

#[test]
fn a_window_of_the_largest_frames_waits_whole_in_the_receive_ring() {
    let Some(pair) = pair_or_skip("a_window_of_the_largest_frames_waits_whole_in_the_receive_ring") else {
        return;
    };
    pair.set_mtu(65000).unwrap();
    let mut a = open_in(&pair.a, RxVersion::V2);
    let mut b = open_in(&pair.b, RxVersion::V2);
    // Twice the transport's default window of 64 KB frames, sent while the receiver does not
    // poll (a receiving thread a scheduling slice late): the ring holds them all.
    let frames: Vec<Vec<u8>> = (0..256).map(|s| frame(b.mac(), a.mac(), s, 65000)).collect();
    send_all(&mut a, &frames, 5 * SECOND);
    let got = recv_n(&mut b, frames.len(), 5 * SECOND);
    assert_eq!(got.len(), frames.len(), "{:?}, kernel drops {}", b.counters(), b.kernel_drops());
    assert!(got == frames, "frames changed or reordered");
}
