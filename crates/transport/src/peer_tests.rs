//! Transport tests about peers: groups, heartbeats, liveness from traffic, restarts.

use core::time::Duration;

use crate::tests::{assert_stream, at_us, header, p2p, us, A, B};
use crate::testutil::{test_message, Dir, Faults, Pair};
use crate::{Config, Endpoint, Event, Role};
use lanbus_wire::frame::Kind;
use lanbus_wire::Instant;

#[test]
fn groups_filter_data_and_can_change_at_run_time() {
    let mut c = Config::default();
    c.rate.enabled = false;
    c.heartbeat.interval = Duration::from_millis(1);
    c.group = 1;
    let mut cb = c.clone();
    cb.group = 2;
    cb.heartbeat.role = Role::Device;
    cb.heartbeat.name = "io-box".into();
    let mut p = Pair::new(
        Endpoint::new(c, A, Instant::ZERO),
        Endpoint::new(cb, B, Instant::ZERO),
        Faults::default(),
        5,
    );
    p.a.send(Instant::ZERO, B, 0, b"hello").unwrap();
    p.run_until(at_us(3000), |_| false);
    assert!(p.at_b.is_empty());
    assert!(p.b.counters().drop_wrong_group > 0);
    assert!(p.events_a.contains(&Event::PeerUp {
        peer: B,
        role: Role::Device,
        group: 2,
        name: "io-box".into()
    }));
    let now = p.now;
    p.b.set_group(1, now);
    assert!(p.run_until(now + Duration::from_millis(200), |p| !p.at_b.is_empty()));
    assert_eq!(p.at_b[0].2, b"hello");
    // A retransmission already in flight may beat B's heartbeat to the other side.
    p.run_until(p.now + us(100), |_| false);
    assert!(p.events_a.contains(&Event::GroupChanged { peer: B, old: 2, new: 1 }), "{:?}", p.events_a);
}

#[test]
fn heartbeats_bring_peers_up_and_expire_them() {
    let mut c = Config::default();
    c.heartbeat.interval = Duration::from_millis(10);
    c.heartbeat.missed_limit = 3;
    let mut p = Pair::endpoints(c, Faults::default(), 6);
    p.run_until(at_us(1000), |_| false);
    assert!(matches!(p.events_a.as_slice(), [Event::PeerUp { peer: B, role: Role::Host, group: 0, .. }]));
    assert!(matches!(p.events_b.as_slice(), [Event::PeerUp { peer: A, .. }]));
    assert_eq!(p.a.receive_half().peers().count(), 1);
    // Data flows while the peer is up.
    p.a.send(p.now, B, 0, b"up").unwrap();
    p.run_until(at_us(2000), |p| !p.at_b.is_empty());
    // B falls silent at t = 25 ms; its last heartbeat was at 20 ms, so it is down at 50 ms.
    p.run_until(at_us(25_000), |_| false);
    p.filter = Some(Box::new(|dir, _| dir == Dir::AtoB));
    p.run_until(at_us(49_000), |_| false);
    assert_eq!(p.events_a.len(), 1, "still up at 49 ms: {:?}", p.events_a);
    p.run_until(at_us(51_000), |_| false);
    assert_eq!(p.events_a.last(), Some(&Event::PeerDown { peer: B }));
    assert_eq!(p.a.receive_half().peers().count(), 0);
    // DATA from a peer that is down is dropped.
    p.filter = None;
    let drops = p.a.counters().drop_unknown_peer;
    p.b.send(p.now, A, 0, b"late").unwrap();
    let mut buf = vec![0u8; 1514];
    while let Some(n) = p.b.poll_transmit(p.now, &mut buf) {
        if header(&buf[..n]).kind == Kind::Data {
            p.a.handle_frame(p.now, &buf[..n]);
        }
    }
    assert_eq!(p.a.counters().drop_unknown_peer, drops + 1);
}

#[test]
fn a_peer_busy_sending_data_is_never_declared_down_without_its_heartbeats() {
    let mut c = Config::default();
    c.heartbeat.interval = Duration::from_millis(10);
    c.heartbeat.missed_limit = 3;
    let mut p = Pair::endpoints(c, Faults::default(), 7);
    p.run_until(at_us(1000), |_| false);
    assert!(matches!(p.events_a.as_slice(), [Event::PeerUp { peer: B, .. }]));
    // From 1 ms on every heartbeat of B is lost, but B streams data to A for 200 ms (more than
    // six times the 30 ms lifetime): its DATA frames keep it up.
    p.filter = Some(Box::new(|dir, f| dir == Dir::AtoB || header(f).kind != Kind::Heartbeat));
    let mut next_message = 0u64;
    while p.now < at_us(200_000) {
        while p.b.send(p.now, A, 1, &test_message(next_message, 200)).is_ok() {
            next_message += 1;
        }
        let next = p.now + us(500);
        p.run_until(next, |_| false);
    }
    assert!(p.a.counters().messages_delivered > 500, "{:?}", p.a.counters());
    assert_eq!(p.a.counters().drop_unknown_peer, 0);
    assert_eq!(p.events_a.len(), 1, "no PeerDown while data flows: {:?}", p.events_a);
    // Now B falls silent altogether. Its last frame left at most one 10 ms clock step before
    // this, so A declares it down between 20 and 30 ms from now, not earlier.
    let silent = p.now;
    p.filter = Some(Box::new(|dir, _| dir == Dir::AtoB));
    p.run_until(silent + us(19_000), |_| false);
    assert_eq!(p.events_a.len(), 1, "still up 19 ms after: {:?}", p.events_a);
    p.run_until(silent + us(32_000), |_| false);
    assert_eq!(p.events_a.last(), Some(&Event::PeerDown { peer: B }));
}

#[test]
fn a_peer_restarted_with_the_same_mac_is_recognised_and_its_channels_start_afresh() {
    let mut c = p2p();
    c.epoch = 7;
    let mut p = Pair::endpoints(c.clone(), Faults::default(), 8);
    assert!(p.transfer(100, 2, at_us(100_000), |_| 100));
    for i in 0..20 {
        p.b.send(p.now, A, 2, &test_message(i, 50)).unwrap();
    }
    assert!(p.run_until_idle(p.now + us(100_000)));
    assert_eq!((p.at_b.len(), p.at_a.len()), (100, 20));
    // A frame of B's first incarnation, still on its way when B restarts.
    p.b.send(p.now, A, 2, b"from the first life").unwrap();
    let mut buf = vec![0u8; 1514];
    let n = p.b.poll_transmit(p.now, &mut buf).unwrap();
    let old_frame = buf[..n].to_vec();

    // B restarts with the same MAC and a new epoch; A has not noticed yet.
    c.epoch = 9;
    p.b = Endpoint::new(c, B, p.now);
    p.at_b.clear();
    // A's next messages go to B's old incarnation: B drops them and answers with its epoch, A
    // recognises the restart and starts the channel afresh (those messages are gone with it).
    for i in 0..5 {
        p.a.send(p.now, B, 2, &test_message(1000 + i, 100)).unwrap();
    }
    p.run_until(p.now + us(1000), |p| !p.events_a.is_empty());
    assert_eq!(p.events_a, vec![Event::PeerRestarted { peer: B, epoch: 9 }]);
    assert!(p.b.counters().drop_stale_epoch >= 1, "{:?}", p.b.counters());
    assert!(p.at_b.is_empty(), "nothing of the old channel is delivered");
    assert_eq!(p.a.counters().peer_restarts, 1);
    // The data path works again: a fresh stream arrives whole and in order.
    assert!(p.transfer(100, 2, p.now + us(100_000), |_| 100));
    assert_stream(&p.at_b, A, 2, 100, |_| 100);
    // And B's first incarnation's frame, arriving late, is dropped.
    let (before, delivered) = (p.a.counters().drop_stale_epoch, p.a.counters().messages_delivered);
    p.a.handle_frame(p.now, &old_frame);
    assert_eq!(p.a.counters().drop_stale_epoch, before + 1);
    assert_eq!(p.a.counters().messages_delivered, delivered);
    assert_eq!(p.events_a.len(), 1, "no second restart: {:?}", p.events_a);
}
