//! The vhost-user-net backend against a frontend that plays the guest's driver over shared
//! rings, with an in-memory link: frames the guest sends reach the link byte for byte; frames
//! the link receives land in the guest's receive buffers (single and chained), with what the
//! guest did not accept undone (a partial checksum completed) or dropped and counted (a segment
//! it cannot take, a frame bigger than its buffer); a hostile frontend loses its connection and
//! the next one is served.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lanbus_vhost::net::{offered_features, NET_HDR_LEN};
use lanbus_vhost::{serve_net, NetLink};
use vhost::vhost_user::{Frontend, VhostUserFrontend, VhostUserProtocolFeatures};
use vhost::VhostBackend;
use vm_memory::{Bytes, GuestAddress};

mod common;
use common::{Ring, SharedMem};

const VERSION_1: u64 = 1 << 32;
const PROTOCOL_FEATURES: u64 = 1 << 30;
const CSUM: u64 = 1 << 0;
const GUEST_CSUM: u64 = 1 << 1;
const GUEST_TSO4: u64 = 1 << 7;
const HOST_TSO4: u64 = 1 << 11;

#[derive(Default)]
struct TestLink {
    sent: Mutex<Vec<Vec<u8>>>,
    inbox: Mutex<VecDeque<Vec<u8>>>,
}

impl NetLink for TestLink {
    fn features(&self) -> u64 {
        CSUM | GUEST_CSUM | GUEST_TSO4 | HOST_TSO4
    }
    fn mac(&self) -> [u8; 6] {
        [2, 0, 0, 0, 0, 9]
    }
    fn mtu(&self) -> u16 {
        1500
    }
    fn send(&self, frame: &[u8]) -> std::io::Result<bool> {
        self.sent.lock().unwrap().push(frame.to_vec());
        Ok(true)
    }
    fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn wait_room(&self, _timeout: Duration) -> std::io::Result<bool> {
        Ok(true)
    }
    fn receive(&self, f: &mut dyn FnMut(&[u8])) -> std::io::Result<usize> {
        let frames: Vec<Vec<u8>> = self.inbox.lock().unwrap().drain(..).collect();
        frames.iter().for_each(|x| f(x));
        Ok(frames.len())
    }
    fn wait_received(&self, timeout: Duration) {
        std::thread::sleep(timeout.min(Duration::from_millis(2)));
    }
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(5), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// An Ethernet/IPv4/UDP frame from 10.0.0.1 to 10.0.0.2 carrying `payload`, its UDP checksum
/// field holding only the pseudo-header's sum (a partial checksum, as Linux leaves it).
fn udp_frame(payload: &[u8]) -> (Vec<u8>, u16) {
    let udp_len = 8 + payload.len();
    let mut f = vec![0u8; 14 + 20 + udp_len];
    f[..6].copy_from_slice(&[2, 0, 0, 0, 0, 9]);
    f[6..12].copy_from_slice(&[2, 0, 0, 0, 0, 1]);
    f[12..14].copy_from_slice(&[0x08, 0x00]);
    let ip = &mut f[14..34];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&((20 + udp_len) as u16).to_be_bytes());
    ip[8] = 64;
    ip[9] = 17;
    ip[12..16].copy_from_slice(&[10, 0, 0, 1]);
    ip[16..20].copy_from_slice(&[10, 0, 0, 2]);
    let udp = &mut f[34..];
    udp[0..2].copy_from_slice(&4000u16.to_be_bytes());
    udp[2..4].copy_from_slice(&5000u16.to_be_bytes());
    udp[4..6].copy_from_slice(&(udp_len as u16).to_be_bytes());
    udp[8..].copy_from_slice(payload);
    let sum = |words: &mut dyn Iterator<Item = u16>| {
        let mut s: u32 = words.map(u32::from).sum();
        while s > 0xffff {
            s = (s & 0xffff) + (s >> 16);
        }
        s as u16
    };
    let pseudo = [0x0a00, 0x0001, 0x0a00, 0x0002, 17, udp_len as u16];
    let partial = sum(&mut pseudo.iter().copied());
    // The full checksum: pseudo-header, header (checksum field zero) and payload.
    let body: Vec<u16> =
        f[34..].chunks(2).map(|c| u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])).collect();
    let full = !sum(&mut pseudo.iter().copied().chain(body));
    f[34 + 6..34 + 8].copy_from_slice(&partial.to_be_bytes());
    (f, full)
}

fn header(flags: u8, gso: u8, csum_start: u16, csum_offset: u16) -> Vec<u8> {
    let mut h = vec![0u8; NET_HDR_LEN];
    h[0] = flags;
    h[1] = gso;
    h[6..8].copy_from_slice(&csum_start.to_le_bytes());
    h[8..10].copy_from_slice(&csum_offset.to_le_bytes());
    h
}

#[test]
fn frames_cross_both_ways_and_what_the_guest_did_not_accept_is_undone_or_dropped() {
    assert_eq!(
        offered_features(CSUM | GUEST_CSUM | GUEST_TSO4 | HOST_TSO4)
            & (CSUM | GUEST_CSUM | GUEST_TSO4 | HOST_TSO4),
        CSUM | GUEST_CSUM | GUEST_TSO4 | HOST_TSO4
    );
    assert_eq!(offered_features(HOST_TSO4) & HOST_TSO4, 0, "segmentation offload needs the checksum offload");

    let path = std::env::temp_dir().join(format!("lanbus-vhost-net-{}.sock", std::process::id()));
    let link = Arc::new(TestLink::default());
    let server = serve_net(&path, link.clone()).unwrap();

    // As QEMU's virtio-net does: a ring enabled before the features are set, a reply asked for.
    // It is answered, and the connection goes on.
    let mut raw = UnixStream::connect(&path).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let message = |request: u32, flags: u32, body: &[u8]| {
        [&request.to_le_bytes()[..], &flags.to_le_bytes(), &(body.len() as u32).to_le_bytes(), body].concat()
    };
    let enable = [0u32.to_le_bytes(), 1u32.to_le_bytes()].concat();
    raw.write_all(&message(18, 0x1 | 0x8, &enable)).unwrap();
    let mut reply = [0u8; 20];
    raw.read_exact(&mut reply).unwrap();
    assert_eq!(reply[..12], message(18, 0x1 | 0x4, &[0; 8])[..12]);
    assert_eq!(reply[12..], [0; 8], "acknowledged");
    raw.write_all(&message(1, 0x1, &[])).unwrap();
    raw.read_exact(&mut reply).unwrap();
    assert_eq!(u32::from_le_bytes(reply[..4].try_into().unwrap()), 1, "GET_FEATURES answered after it");
    assert_ne!(u64::from_le_bytes(reply[12..].try_into().unwrap()) & PROTOCOL_FEATURES, 0);
    drop(raw);
    let shared = SharedMem::new("net", 1 << 20);
    let mut f = Frontend::connect(&path, 2).unwrap();
    f.set_owner().unwrap();
    let offered = f.get_features().unwrap();
    assert_ne!(offered & GUEST_TSO4, 0);
    // The guest takes neither receive offload: checksums are completed for it, segments dropped.
    f.set_features(VERSION_1 | PROTOCOL_FEATURES | CSUM | HOST_TSO4).unwrap();
    f.get_protocol_features().unwrap();
    f.set_protocol_features(VhostUserProtocolFeatures::REPLY_ACK).unwrap();
    shared.share(&mut f);
    let mut rx = Ring::setup(&mut f, &shared, 0, 0, true);
    let mut tx = Ring::setup(&mut f, &shared, 1, 0x4000, true);

    // Transmit: a header and a frame in two descriptors reach the link as one buffer.
    let (frame, _) = udp_frame(b"from the guest");
    let hdr = header(1, 0, 34, 6);
    shared.mem.write_slice(&hdr, GuestAddress(0x10000)).unwrap();
    shared.mem.write_slice(&frame, GuestAddress(0x11000)).unwrap();
    let head = tx.chain(&[(0x10000, NET_HDR_LEN as u32, false), (0x11000, frame.len() as u32, false)]);
    tx.publish(head);
    assert_eq!(tx.next_used().0, u32::from(head));
    assert_eq!(link.sent.lock().unwrap().as_slice(), &[[hdr.clone(), frame.clone()].concat()]);
    // A descriptor outside guest memory: dropped, counted, the buffer still returned.
    let head = tx.chain(&[(1 << 40, 64, false)]);
    tx.publish(head);
    assert_eq!(tx.next_used().0, u32::from(head));
    assert_eq!(server.stats().tx_dropped.load(Ordering::Relaxed), 1);

    // Receive into a chain of two buffers: a frame with a partial checksum arrives complete.
    let payload: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
    let (frame, full) = udp_frame(&payload);
    link.inbox.lock().unwrap().push_back([header(1, 0, 34, 6), frame.clone()].concat());
    let head = rx.chain(&[(0x20000, 100, true), (0x21000, 4000, true)]);
    rx.publish(head);
    let (id, len) = rx.next_used();
    assert_eq!((id, len as usize), (u32::from(head), NET_HDR_LEN + frame.len()));
    let mut got = vec![0u8; len as usize];
    shared.mem.read_slice(&mut got[..100], GuestAddress(0x20000)).unwrap();
    shared.mem.read_slice(&mut got[100..], GuestAddress(0x21000)).unwrap();
    assert_eq!(got[0] & 1, 0, "the checksum is no longer partial");
    assert_eq!(u16::from_le_bytes([got[10], got[11]]), 1, "num_buffers");
    let udp_sum = u16::from_be_bytes([got[NET_HDR_LEN + 40], got[NET_HDR_LEN + 41]]);
    assert_eq!(udp_sum, full, "the completed checksum is the UDP checksum");
    assert_eq!(got[NET_HDR_LEN..NET_HDR_LEN + 40], frame[..40]);
    assert_eq!(got[NET_HDR_LEN + 42..], frame[42..]);

    // A coalesced segment the guest did not accept and a frame bigger than its buffer: dropped;
    // the frame after them arrives in the buffer.
    let (small, _) = udp_frame(b"small");
    let (big, _) = udp_frame(&[7u8; 3000]);
    link.inbox.lock().unwrap().extend([
        [header(0, 1, 0, 0), frame.clone()].concat(),
        [header(0, 0, 0, 0), big].concat(),
        [header(0, 0, 0, 0), small.clone()].concat(),
    ]);
    let first = rx.chain(&[(0x30000, 2048, true)]);
    rx.publish(first);
    let second = rx.chain(&[(0x31000, 2048, true)]);
    rx.publish(second);
    assert_eq!(rx.next_used(), (u32::from(first), 0), "the big frame's buffer comes back empty");
    assert_eq!(rx.next_used(), (u32::from(second), (NET_HDR_LEN + small.len()) as u32));
    let mut got = vec![0u8; small.len()];
    shared.mem.read_slice(&mut got, GuestAddress(0x31000 + NET_HDR_LEN as u64)).unwrap();
    assert_eq!(got, small);
    let st = server.stats();
    wait_for("the counters", || st.rx_dropped.load(Ordering::Relaxed) == 2);
    assert_eq!(st.rx_frames.load(Ordering::Relaxed), 2);
    assert_eq!(st.tx_frames.load(Ordering::Relaxed), 1);
    assert_eq!(st.acked_features.load(Ordering::Relaxed) & (GUEST_CSUM | GUEST_TSO4), 0);
    drop(f);

    // A frontend that sends garbage loses its connection; the next one is served.
    let mut s = UnixStream::connect(&path).unwrap();
    s.write_all(&[0xff; 64]).unwrap();
    drop(s);
    let f = Frontend::connect(&path, 2).unwrap();
    f.set_owner().unwrap();
    assert_eq!(f.get_features().unwrap(), offered);
    wait_for("the connections", || st.connections.load(Ordering::Relaxed) >= 4);
    drop(f);
    server.stop();
    assert!(!path.exists(), "the socket goes with the server");
}
