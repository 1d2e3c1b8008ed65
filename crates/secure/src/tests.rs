//! Two or three guards wired to each other in memory, on a logical clock and seeded randomness.

use std::sync::Arc;
use std::time::Duration;

use lanbus_wire::frame::{self, Kind, FLAG_CHECKSUM, HEADER_LEN as LB_LEN};
use lanbus_wire::{EtherType, Instant, MacAddr};
use proptest::prelude::*;

use crate::guard::{Guard, GuardConfig, TRAILER_LEN};
use crate::{FabricKey, KeyId, KeyRing, Keys, SeededEntropy, Suite};

const HDR: usize = 14 + LB_LEN;

fn key(n: u8) -> FabricKey {
    FabricKey::from_parts(KeyId(u32::from(n)), [n; 32])
}

fn guard(mac: MacAddr, keys: &Arc<Keys>, encrypt: bool, seed: u64) -> Guard {
    let config = GuardConfig { encrypt, suite: Suite::Aes256Gcm, broadcast_counter_start: 1_000 * seed };
    Guard::new(mac, keys.clone(), config, Box::new(SeededEntropy::new(seed)))
}

/// A transport frame from `src` (epoch `epoch`) to `dst` with `payload`, checksummed as the
/// transport writes it, with room for the trailer.
fn frame(src: MacAddr, dst: MacAddr, epoch: u32, kind: Kind, payload: &[u8]) -> (Vec<u8>, usize) {
    let len = HDR + payload.len();
    let mut f = vec![0u8; len + TRAILER_LEN];
    f[..6].copy_from_slice(&dst.0);
    f[6..12].copy_from_slice(&src.0);
    f[12..14].copy_from_slice(&EtherType::LANBUS_RAW.to_be_bytes());
    let mut p = frame::Packet::new_unchecked(&mut f[14..]);
    p.set_version(frame::VERSION);
    p.set_kind(kind);
    p.set_group(3);
    p.set_channel(1);
    p.set_sequence(42);
    p.set_payload_len(payload.len() as u16);
    p.set_epoch(epoch);
    f[HDR..len].copy_from_slice(payload);
    frame::fill_checksum(&mut f[..len]);
    (f, len)
}

struct Node {
    mac: MacAddr,
    epoch: u32,
    guard: Guard,
    keys: Arc<Keys>,
}

impl Node {
    fn new(n: u32, ring: KeyRing, encrypt: bool) -> Node {
        let mac = MacAddr::local(n);
        let keys = Keys::new(ring);
        Node { mac, epoch: 100 + n, guard: guard(mac, &keys, encrypt, u64::from(n)), keys }
    }

    /// Seals a data frame to `dst`; `None` while there is no session.
    fn send(&mut self, now: Instant, dst: MacAddr, payload: &[u8]) -> Option<Vec<u8>> {
        let (mut f, len) = frame(self.mac, dst, self.epoch, Kind::Data, payload);
        let n = self.guard.seal(now, &mut f, len)?;
        f.truncate(n);
        Some(f)
    }

    /// Opens a frame; the delivered frame, if any.
    fn recv(&mut self, now: Instant, f: &[u8]) -> Option<Vec<u8>> {
        let mut scratch = Vec::new();
        self.guard.open(now, f, &mut scratch).map(<[u8]>::to_vec)
    }

    fn outbox(&mut self) -> Vec<Vec<u8>> {
        std::iter::from_fn(|| self.guard.poll_transmit()).collect()
    }
}

/// Runs handshake frames between `a` and `b` until neither has any to send.
fn exchange(now: Instant, a: &mut Node, b: &mut Node) {
    for _ in 0..8 {
        let (from_a, from_b) = (a.outbox(), b.outbox());
        if from_a.is_empty() && from_b.is_empty() {
            return;
        }
        for f in from_a {
            assert!(b.recv(now, &f).is_none(), "handshake frames are consumed");
        }
        for f in from_b {
            assert!(a.recv(now, &f).is_none());
        }
    }
    panic!("the handshake does not settle");
}

/// `a` and `b` with a session, `a` having sent the first frame.
fn pair(encrypt: bool) -> (Node, Node, Instant) {
    let mut a = Node::new(1, KeyRing::new(key(1), []), encrypt);
    let mut b = Node::new(2, KeyRing::new(key(1), []), encrypt);
    let now = Instant::from_nanos(1_000_000);
    // Both transports announce themselves: a member's broadcast, before a session, is held back
    // and starts a handshake; its next one is heard.
    let (mut hb, len) = frame(b.mac, MacAddr::BROADCAST, b.epoch, Kind::Heartbeat, b"hb");
    let n = b.guard.seal(now, &mut hb, len).expect("broadcasts need no session");
    let (mut hb_a, len_a) = frame(a.mac, MacAddr::BROADCAST, a.epoch, Kind::Heartbeat, b"hb");
    let _ = a.guard.seal(now, &mut hb_a, len_a).expect("broadcasts need no session");
    assert!(a.recv(now, &hb[..n]).is_none(), "no liveness before the handshake");
    assert_eq!(a.guard.counters().held_for_handshake, 1);
    assert!(a.send(now, b.mac, b"first").is_none(), "nothing is sent before the handshake");
    exchange(now, &mut a, &mut b);
    assert!(a.guard.is_authenticated(b.mac) && b.guard.is_authenticated(a.mac));
    let (mut hb, len) = frame(b.mac, MacAddr::BROADCAST, b.epoch, Kind::Heartbeat, b"hb 2");
    let n = b.guard.seal(now, &mut hb, len).unwrap();
    assert!(a.recv(now, &hb[..n]).is_some(), "a member's broadcast is heard once in session");
    (a, b, now)
}

#[test]
fn members_handshake_then_frames_flow_both_ways() {
    for encrypt in [false, true] {
        let (mut a, mut b, now) = pair(encrypt);
        let f = a.send(now, b.mac, b"hello, device").unwrap();
        assert_eq!(f[14 + 2] & FLAG_CHECKSUM, 0, "the tag replaces the checksum");
        let on_wire_clear = f.windows(13).any(|w| w == b"hello, device");
        assert_eq!(on_wire_clear, !encrypt, "encrypt={encrypt}");
        let got = b.recv(now, &f).unwrap();
        assert_eq!(&got[HDR..], b"hello, device");
        assert_eq!(got.len(), f.len() - TRAILER_LEN);
        let back = b.send(now, a.mac, b"and back").unwrap();
        assert_eq!(&a.recv(now, &back).unwrap()[HDR..], b"and back");
        assert_eq!(a.guard.counters().sessions_established, 1);
        assert_eq!(b.guard.counters().rejected.total(), 0);
    }
}

#[test]
fn a_replayed_frame_is_counted_and_not_delivered() {
    let (mut a, mut b, now) = pair(false);
    let f = a.send(now, b.mac, b"once").unwrap();
    assert!(b.recv(now, &f).is_some());
    assert!(b.recv(now, &f).is_none());
    assert_eq!(b.guard.counters().rejected.replay, 1);
}

#[test]
fn frames_of_an_earlier_session_are_refused() {
    let (mut a, mut b, now) = pair(false);
    let old = a.send(now, b.mac, b"old").unwrap();
    // a restarts: a new incarnation, a new handshake.
    let mut a2 = Node::new(1, KeyRing::new(key(1), []), false);
    a2.epoch = 999;
    a2.guard = guard(a2.mac, &a2.keys, false, 77);
    assert!(a2.send(now, b.mac, b"new").is_none());
    exchange(now, &mut a2, &mut b);
    let new = a2.send(now, b.mac, b"new").unwrap();
    assert_eq!(&b.recv(now, &new).unwrap()[HDR..], b"new");
    // Past the grace for frames in flight, the old session's frames are refused.
    let later = now + Duration::from_secs(3);
    assert!(b.recv(later, &old).is_none());
    assert_eq!(b.guard.counters().rejected.no_session, 1);
}

#[test]
fn a_node_without_the_key_gets_nothing_through() {
    let (mut a, mut b, now) = pair(false);
    let mut rogue = Node::new(9, KeyRing::new(key(7), []), false);
    // Its broadcasts, its handshake and its frames are all refused.
    let (mut hb, len) = frame(rogue.mac, MacAddr::BROADCAST, rogue.epoch, Kind::Heartbeat, b"hb");
    let n = rogue.guard.seal(now, &mut hb, len).unwrap();
    assert!(b.recv(now, &hb[..n]).is_none());
    assert!(rogue.send(now, b.mac, b"let me in").is_none());
    for f in rogue.outbox() {
        assert!(b.recv(now, &f).is_none());
    }
    assert!(b.outbox().is_empty(), "no answer to a HELLO under an unknown key");
    let (plain, len) = frame(rogue.mac, b.mac, rogue.epoch, Kind::Data, b"unsealed");
    assert!(b.recv(now, &plain[..len]).is_none());
    let r = b.guard.counters().rejected;
    assert_eq!((r.unknown_key, r.unsealed), (2, 1), "{r:?}");
    // A rogue holding a key of the same id but another secret fails the proof.
    let mut forger = Node::new(9, KeyRing::new(FabricKey::from_parts(KeyId(1), [0x55; 32]), []), false);
    assert!(forger.send(now, b.mac, b"x").is_none());
    for f in forger.outbox() {
        assert!(b.recv(now, &f).is_none());
    }
    assert_eq!(b.guard.counters().rejected.bad_handshake, 1);
    // The members carry on.
    let f = a.send(now, b.mac, b"still here").unwrap();
    assert!(b.recv(now, &f).is_some());
}

#[test]
fn an_impostor_with_a_members_mac_and_a_new_epoch_changes_nothing() {
    let (mut a, mut b, now) = pair(false);
    let (mut f, len) = frame(a.mac, b.mac, 4242, Kind::Data, b"I restarted");
    frame::fill_checksum(&mut f[..len]);
    assert!(b.recv(now, &f[..len]).is_none());
    // Sealed-looking, with the session's id, but forged.
    let good = a.send(now, b.mac, b"real").unwrap();
    let mut forged = good.clone();
    forged[14 + 32..14 + 36].copy_from_slice(&4242u32.to_be_bytes());
    assert!(b.recv(now, &forged).is_none());
    assert!(
        b.recv(now, &good).is_some(),
        "the real frame, with the counter the forgery claimed, still passes"
    );
    // A replayed HELLO of the real member makes an offer that is never taken.
    let mut a_again = Node::new(1, KeyRing::new(key(1), []), false);
    a_again.guard = guard(a.mac, &a.keys, false, 5);
    assert!(a_again.send(now, b.mac, b"x").is_none());
    let hello = a_again.outbox();
    for f in &hello {
        assert!(b.recv(now, f).is_none());
    }
    for f in b.outbox() {
        assert!(a.recv(now, &f).is_none(), "a is not initiating: the REPLY is refused");
    }
    let f = a.send(now, b.mac, b"session kept").unwrap();
    assert_eq!(&b.recv(now, &f).unwrap()[HDR..], b"session kept");
}

#[test]
fn rotation_in_three_steps_keeps_sessions_going() {
    let (mut a, mut b, mut now) = pair(false);
    let mut sent = 0u32;
    let mut step = |a: &mut Node, b: &mut Node, now: Instant| {
        for _ in 0..3 {
            // Handshake frames the seals start are exchanged like any other frames.
            if let Some(f) = a.send(now, b.mac, &sent.to_be_bytes()) {
                assert!(b.recv(now, &f).is_some(), "frame {sent} lost");
                sent += 1;
            }
            exchange(now, a, b);
            if let Some(f) = b.send(now, a.mac, b"ack") {
                assert!(a.recv(now, &f).is_some());
            }
            exchange(now, a, b);
        }
    };
    // Step 1: both accept key 2, at different moments.
    b.keys.replace(KeyRing::new(key(1), [key(2)]));
    step(&mut a, &mut b, now);
    a.keys.replace(KeyRing::new(key(1), [key(2)]));
    step(&mut a, &mut b, now);
    // Step 2: a sends under key 2 first, b later; each re-keys its sessions.
    a.keys.replace(KeyRing::new(key(2), [key(1)]));
    step(&mut a, &mut b, now);
    b.keys.replace(KeyRing::new(key(2), [key(1)]));
    step(&mut a, &mut b, now);
    // Step 3: key 1 dropped.
    now += Duration::from_secs(3);
    a.keys.replace(KeyRing::new(key(2), []));
    step(&mut a, &mut b, now);
    b.keys.replace(KeyRing::new(key(2), []));
    step(&mut a, &mut b, now);
    assert!(sent >= 15, "only {sent} frames went through");
    for n in [&a, &b] {
        let r = n.guard.report();
        assert_eq!(r.peers[0].key_id, Some(KeyId(2)));
        assert_eq!(r.counters.rejected.total(), 0, "{:?}", r.counters);
    }
}

#[test]
fn a_broadcast_reaches_members_once() {
    let (mut a, mut b, now) = pair(true);
    let (mut hb, len) = frame(a.mac, MacAddr::BROADCAST, a.epoch, Kind::Heartbeat, b"heartbeat");
    let n = a.guard.seal(now, &mut hb, len).unwrap();
    assert_eq!(&b.recv(now, &hb[..n]).unwrap()[HDR..], b"heartbeat");
    assert!(b.recv(now, &hb[..n]).is_none());
    assert_eq!(b.guard.counters().rejected.replay, 1);
    // A port that carries no Ethernet header (udp) delivers it with its own MAC as destination.
    let (mut hb, len) = frame(a.mac, MacAddr::BROADCAST, a.epoch, Kind::Heartbeat, b"heartbeat 2");
    let n = a.guard.seal(now, &mut hb, len).unwrap();
    hb[..6].copy_from_slice(&b.mac.0);
    let got = b.recv(now, &hb[..n]).unwrap();
    assert_eq!((&got[..6], &got[HDR..]), (&b.mac.0[..], &b"heartbeat 2"[..]));
    // A heartbeat claiming another incarnation of a peer with a session is refused.
    let (mut old, len) = frame(a.mac, MacAddr::BROADCAST, 7, Kind::Heartbeat, b"heartbeat");
    let mut forger = guard(a.mac, &a.keys, true, 3);
    let n = forger.seal(now, &mut old, len).unwrap();
    // (sealed by a member's key for another epoch: its counter is older, so a replay too)
    assert!(b.recv(now, &old[..n]).is_none());
}

#[test]
fn a_responder_that_never_sent_takes_its_epoch_from_its_first_frame() {
    let mut a = Node::new(1, KeyRing::new(key(1), []), false);
    let mut b = Node::new(2, KeyRing::new(key(1), []), false);
    let now = Instant::from_nanos(5);
    assert!(a.send(now, b.mac, b"x").is_none());
    exchange(now, &mut a, &mut b);
    let f = a.send(now, b.mac, b"x").unwrap();
    assert!(b.recv(now, &f).is_some());
    let f = b.send(now, a.mac, b"y").unwrap();
    assert!(a.recv(now, &f).is_some());
    // From then on the epoch is pinned: a frame sealed for another incarnation is refused.
    let (mut other, len) = frame(b.mac, a.mac, b.epoch + 1, Kind::Data, b"z");
    let n = b.guard.seal(now, &mut other, len).unwrap();
    assert!(a.recv(now, &other[..n]).is_none());
    assert_eq!(a.guard.counters().rejected.stale_epoch, 1);
}

#[test]
fn a_groups_broadcasts_reach_only_that_group_and_its_peers_in_session() {
    let (mut a, mut b, now) = pair(false);
    let mut c = Node::new(3, KeyRing::new(key(1), []), false);
    // c is in group 4 (its first frame says so); a and b in group 3.
    let (mut f, len) = frame(c.mac, MacAddr::BROADCAST, c.epoch, Kind::Heartbeat, b"group 4");
    f[14 + 4..14 + 6].copy_from_slice(&4u16.to_be_bytes());
    let n = c.guard.seal(now, &mut f, len).unwrap();
    assert!(b.recv(now, &f[..n]).is_none());
    assert_eq!(b.guard.counters().drop_other_group, 1);
    // a moves to group 4: b, in session with it, still hears of the move.
    let (mut f, len) = frame(a.mac, MacAddr::BROADCAST, a.epoch, Kind::Heartbeat, b"moved");
    f[14 + 4..14 + 6].copy_from_slice(&4u16.to_be_bytes());
    let n = a.guard.seal(now, &mut f, len).unwrap();
    assert!(b.recv(now, &f[..n]).is_some());
}

#[test]
fn simultaneous_hellos_settle_on_one_session() {
    let mut a = Node::new(1, KeyRing::new(key(1), []), false);
    let mut b = Node::new(2, KeyRing::new(key(1), []), false);
    let now = Instant::from_nanos(5);
    for n in [&mut a, &mut b] {
        let (mut hb, len) = frame(n.mac, MacAddr::BROADCAST, n.epoch, Kind::Heartbeat, b"");
        let _ = n.guard.seal(now, &mut hb, len);
    }
    assert!(a.send(now, b.mac, b"x").is_none());
    assert!(b.send(now, a.mac, b"y").is_none());
    exchange(now, &mut a, &mut b);
    let f = a.send(now, b.mac, b"x").unwrap();
    assert!(b.recv(now, &f).is_some());
    let f = b.send(now, a.mac, b"y").unwrap();
    assert!(a.recv(now, &f).is_some());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any single flipped bit of a sealed frame (headers, payload, counter, tag) keeps it from the
    /// transport.
    #[test]
    fn an_altered_frame_is_never_delivered(bit in 0usize..(HDR + 32 + TRAILER_LEN) * 8, encrypt in any::<bool>()) {
        let (mut a, mut b, now) = pair(encrypt);
        let mut f = a.send(now, b.mac, &[0x5a; 32]).unwrap();
        f[bit / 8] ^= 1 << (bit % 8);
        let dst_changed = bit < 48;
        let got = b.recv(now, &f);
        prop_assert!(got.is_none(), "bit {} (dst changed: {})", bit, dst_changed);
    }

    /// Any bytes at all: the guard neither panics nor delivers.
    #[test]
    fn arbitrary_bytes_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let (_a, mut b, now) = pair(false);
        prop_assert!(b.recv(now, &bytes).is_none());
    }

    /// The replay window against a model: a counter passes once, and never once the window has
    /// moved more than its width past it.
    #[test]
    fn replay_window_matches_a_model(counters in proptest::collection::vec(0u64..600, 1..200)) {
        let mut w = crate::ReplayWindow::default();
        let mut seen = std::collections::BTreeSet::new();
        for c in counters {
            let top = seen.iter().next_back().copied();
            let fresh = !seen.contains(&c) && top.is_none_or(|t| c + crate::REPLAY_WINDOW > t);
            prop_assert_eq!(w.check(c), fresh, "counter {}", c);
            if fresh {
                w.commit(c);
                seen.insert(c);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Two members that both send from the start, their frames (handshake messages among them)
    /// delivered in any order and some lost: once the wire is quiet and clean, frames flow both
    /// ways under one session and none is refused.
    #[test]
    fn any_interleaving_settles_on_one_session(ops in proptest::collection::vec((0u8..7, any::<u16>()), 1..120), epoch_known in any::<bool>()) {
        let mut a = Node::new(1, KeyRing::new(key(1), []), false);
        let mut b = Node::new(2, KeyRing::new(key(1), []), false);
        let mut now = Instant::from_nanos(1_000);
        if epoch_known {
            for n in [&mut a, &mut b] {
                let (mut hb, len) = frame(n.mac, MacAddr::BROADCAST, n.epoch, Kind::Heartbeat, b"");
                let _ = n.guard.seal(now, &mut hb, len);
            }
        }
        let (mut to_b, mut to_a): (Vec<Vec<u8>>, Vec<Vec<u8>>) = (Vec::new(), Vec::new());
        for (op, pick) in ops {
            now += Duration::from_millis(7);
            match op {
                0 => to_b.extend(a.send(now, b.mac, b"from a")),
                1 => to_a.extend(b.send(now, a.mac, b"from b")),
                2 if !to_b.is_empty() => { let f = to_b.remove(usize::from(pick) % to_b.len()); let _ = b.recv(now, &f); }
                3 if !to_a.is_empty() => { let f = to_a.remove(usize::from(pick) % to_a.len()); let _ = a.recv(now, &f); }
                4 if !to_b.is_empty() => { to_b.remove(usize::from(pick) % to_b.len()); }
                5 if !to_a.is_empty() => { to_a.remove(usize::from(pick) % to_a.len()); }
                _ => {}
            }
            to_b.extend(a.outbox());
            to_a.extend(b.outbox());
        }
        // The wire goes quiet and clean: in-flight frames arrive, and the nodes keep sending
        // (the transport sends again what was not acknowledged) until both get through.
        for f in to_b.drain(..) { let _ = b.recv(now, &f); }
        for f in to_a.drain(..) { let _ = a.recv(now, &f); }
        let mut through = (false, false);
        for _ in 0..20 {
            now += Duration::from_millis(50);
            if let Some(f) = a.send(now, b.mac, b"a") { through.0 |= b.recv(now, &f).is_some(); }
            if let Some(f) = b.send(now, a.mac, b"b") { through.1 |= a.recv(now, &f).is_some(); }
            exchange(now, &mut a, &mut b);
        }
        prop_assert!(through.0 && through.1, "a->b {} b->a {}", through.0, through.1);
        // From here on nothing is refused.
        let refused = (a.guard.counters().rejected.total(), b.guard.counters().rejected.total());
        for _ in 0..5 {
            now += Duration::from_secs(1);
            let f = a.send(now, b.mac, b"a").expect("a session");
            prop_assert!(b.recv(now, &f).is_some());
            let f = b.send(now, a.mac, b"b").expect("a session");
            prop_assert!(a.recv(now, &f).is_some());
            exchange(now, &mut a, &mut b);
        }
        prop_assert_eq!(refused, (a.guard.counters().rejected.total(), b.guard.counters().rejected.total()));
    }
}

/// Frames on their way one way along an in-memory wire.
type Queue = Arc<std::sync::Mutex<std::collections::VecDeque<Vec<u8>>>>;

/// One end of an in-memory wire between two ports; `borrows` says whether it sends frames
/// where the caller keeps them.
struct WireEnd {
    mac: MacAddr,
    borrows: bool,
    out: Queue,
    inq: Queue,
    counters: lanbus_port::PortCounters,
}

impl lanbus_port::Port for WireEnd {
    fn rx_burst(&mut self, max: usize, on_frame: &mut dyn FnMut(&[u8])) -> lanbus_port::Result<usize> {
        let mut n = 0;
        while n < max {
            let Some(f) = self.inq.lock().unwrap().pop_front() else { break };
            on_frame(&f);
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
            self.out.lock().unwrap().push_back(buf[..len].to_vec());
            n += 1;
        }
        self.counters.tx_frames += n as u64;
        Ok(n)
    }
    fn borrows_frames(&self) -> bool {
        self.borrows
    }
    fn tx_borrowed(&mut self, frames: &[&[u8]]) -> lanbus_port::Result<usize> {
        assert!(self.borrows, "borrowed frames handed to a port that copies");
        self.counters.tx_frames += frames.len() as u64;
        self.out.lock().unwrap().extend(frames.iter().map(|f| f.to_vec()));
        Ok(frames.len())
    }
    fn wait(&mut self, _: Option<Duration>) -> lanbus_port::Result<()> {
        Ok(())
    }
    fn mtu(&self) -> usize {
        9000
    }
    fn mac(&self) -> MacAddr {
        self.mac
    }
    fn counters(&self) -> lanbus_port::PortCounters {
        self.counters
    }
}

#[test]
fn borrowed_frames_in_two_pieces_are_sealed_whole_and_arrive_whole() {
    use lanbus_port::Port as _;
    let (ab, ba): (Queue, Queue) = (Arc::default(), Arc::default());
    let (mac_a, mac_b) = (MacAddr::local(1), MacAddr::local(2));
    let end = |mac, borrows, out: &Queue, inq: &Queue| WireEnd {
        mac,
        borrows,
        out: out.clone(),
        inq: inq.clone(),
        counters: Default::default(),
    };
    for encrypt in [false, true] {
        let keys = Keys::new(KeyRing::new(key(1), []));
        let mut a = crate::SecurePort::new(Box::new(end(mac_a, true, &ab, &ba)), keys.clone(), encrypt);
        let mut b = crate::SecurePort::new(Box::new(end(mac_b, false, &ba, &ab)), keys, encrypt);
        assert!(a.borrows_frames() && !b.borrows_frames());
        // Forty frames (more than one burst), each a header piece and a body piece.
        let frames: Vec<(Vec<u8>, Vec<u8>)> = (0..40u8)
            .map(|i| {
                let body = vec![i; 100 + usize::from(i) * 50];
                let (f, len) = frame(mac_a, mac_b, 7, Kind::Data, &body);
                (f[..HDR].to_vec(), f[HDR..len].to_vec())
            })
            .collect();
        let parts: Vec<[&[u8]; 2]> = frames.iter().map(|(h, b)| [&h[..], &b[..]]).collect();
        let mut got = Vec::new();
        for _ in 0..10 {
            // Until the handshake ends the frames are lost, as on a wire; then all arrive.
            assert_eq!(a.tx_borrowed_parts(&parts).unwrap(), parts.len());
            b.rx_burst(usize::MAX, &mut |f| got.push(f.to_vec())).unwrap();
            a.rx_burst(usize::MAX, &mut |_| {}).unwrap();
            if !got.is_empty() {
                break;
            }
        }
        assert_eq!(got.len(), frames.len(), "encrypt={encrypt}");
        for (g, (h, body)) in got.iter().zip(&frames) {
            assert_eq!(&g[HDR..], &body[..]);
            assert_eq!(g[..12], h[..12]);
        }
    }
}
