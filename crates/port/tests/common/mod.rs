//! Helpers shared by the port integration tests: test frames and bounded receiving.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use lanbus_port::Port;
use lanbus_wire::ethernet::HEADER_LEN;
use lanbus_wire::MacAddr;

/// A lanbus frame from `src` to `dst` whose payload encodes `seq` and is `payload_len` long
/// (at least 8 bytes); every byte after the sequence number depends on it.
pub fn frame(dst: MacAddr, src: MacAddr, seq: u32, payload_len: usize) -> Vec<u8> {
    frame_typed(dst, src, 0x88b5, seq, payload_len)
}

/// As [`frame`] with any EtherType.
pub fn frame_typed(dst: MacAddr, src: MacAddr, ethertype: u16, seq: u32, payload_len: usize) -> Vec<u8> {
    let mut f = Vec::with_capacity(HEADER_LEN + payload_len);
    f.extend_from_slice(&dst.0);
    f.extend_from_slice(&src.0);
    f.extend_from_slice(&ethertype.to_be_bytes());
    f.extend_from_slice(&seq.to_be_bytes());
    f.extend_from_slice(&(payload_len as u32).to_be_bytes());
    for i in 8..payload_len {
        f.push((seq as usize).wrapping_mul(31).wrapping_add(i) as u8);
    }
    f
}

/// The sequence number of a frame built by [`frame`].
pub fn seq_of(frame: &[u8]) -> u32 {
    u32::from_be_bytes(frame[HEADER_LEN..HEADER_LEN + 4].try_into().unwrap())
}

/// A payload length for `seq` between the shortest a port delivers (a lanbus header) and `max`,
/// deterministic.
pub fn len_for(seq: u32, max: usize) -> usize {
    let min = lanbus_port::check::MIN_PAYLOAD_BYTES;
    min + (seq as usize * 7919) % (max - min + 1)
}

/// Receives until `n` frames arrived or `timeout` passed, blocking in `wait` when idle.
pub fn recv_n(port: &mut dyn Port, n: usize, timeout: Duration) -> Vec<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let got = port.rx_burst(n - out.len(), &mut |f| out.push(f.to_vec())).expect("rx_burst");
        if got == 0 {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            port.wait(Some((deadline - now).min(Duration::from_millis(20)))).expect("wait");
        }
    }
    out
}

/// Sends all `frames`, retrying while the port's queue is full, within `timeout`.
pub fn send_all(port: &mut dyn Port, frames: &[Vec<u8>], timeout: Duration) {
    let deadline = Instant::now() + timeout;
    let mut next = 0;
    while next < frames.len() {
        let refs: Vec<&[u8]> = frames[next..].iter().map(|f| f.as_slice()).collect();
        next += port.send_frames(&refs).expect("send_frames");
        if next < frames.len() {
            assert!(Instant::now() < deadline, "could not send {} frames in time", frames.len() - next);
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// Receives on two ports at once (each is driven, as its own daemon would drive it) until `a` has
/// `n_a` frames and `b` has `n_b`, or `timeout` passes.
pub fn recv_pair(
    a: &mut dyn Port,
    b: &mut dyn Port,
    n_a: usize,
    n_b: usize,
    timeout: Duration,
) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let deadline = Instant::now() + timeout;
    let (mut at_a, mut at_b) = (Vec::with_capacity(n_a), Vec::with_capacity(n_b));
    while (at_a.len() < n_a || at_b.len() < n_b) && Instant::now() < deadline {
        let got_a =
            a.rx_burst(n_a.saturating_sub(at_a.len()), &mut |f| at_a.push(f.to_vec())).expect("rx_burst");
        let got_b =
            b.rx_burst(n_b.saturating_sub(at_b.len()), &mut |f| at_b.push(f.to_vec())).expect("rx_burst");
        if got_a + got_b == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    (at_a, at_b)
}

/// Waits until plain UDP datagrams cross a fresh veth pair from a to b (at most 3 s): right after
/// the link comes up the kernel may still drop traffic (carrier and qdisc activation are
/// asynchronous) and neighbour resolution has not happened, which would make the first burst of
/// a test lose datagrams for reasons that are not the port's.
pub fn warm_up(pair: &lanbus_port::netns::VethPair) {
    let to = std::net::SocketAddr::from((pair.b.ipv4, 7999));
    let rx = pair.b.netns.run(move || std::net::UdpSocket::bind(to)).unwrap().unwrap();
    rx.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let tx = pair.a.netns.run(|| std::net::UdpSocket::bind("0.0.0.0:0")).unwrap().unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut buf = [0u8; 8];
    while Instant::now() < deadline {
        tx.send_to(b"warm", to).unwrap();
        if rx.recv_from(&mut buf).is_ok() {
            return;
        }
    }
    panic!("plain UDP does not cross the fresh veth pair within 3 s");
}
