//! Selective repeat: the receiver holds frames past a hole and reports them, the sender resends
//! only the frames lost. Deterministic, on a logical clock.

use lanbus_wire::frame::{Kind, Sack};
use lanbus_wire::Instant;

use crate::tests::{assert_stream, at_us, drain, gbn, header, loaded, p2p, sack_frame, A, B};
use crate::testutil::{test_message, Faults, Pair};
use crate::{stamp, Endpoint};

/// A SACK reporting the frames `held` (sequence numbers) past cumulative ACK `ack`.
fn held(ack: u32, held: &[u32]) -> Sack {
    let mut s = Sack::EMPTY;
    for &seq in held {
        s.set((seq - ack - 1) as usize);
    }
    s
}

/// The sequence numbers of the DATA frames `e` sends now.
fn resent(e: &mut Endpoint, now: Instant) -> Vec<u32> {
    drain(e, now).iter().map(|f| header(f).sequence).collect()
}

#[test]
fn out_of_order_frames_are_held_reported_and_delivered_when_the_hole_fills() {
    let (_, frames) = loaded(p2p(), 5);
    let mut b = Endpoint::new(p2p(), B, Instant::ZERO);
    // Frame 0 is lost; 1, 2 and 4 arrive (3 is lost too).
    for (t, i) in [(1, 1), (2, 2), (3, 4)] {
        b.handle_frame(at_us(t), &frames[i]);
    }
    assert!(b.poll_message().is_none(), "nothing is delivered past the hole");
    let acks = drain(&mut b, at_us(3));
    assert_eq!(acks.len(), 3, "each frame past the hole is answered at once");
    let last = &acks[2];
    assert_eq!((header(last).kind, header(last).ack), (Kind::Ack, 0));
    let eth_payload = &last[lanbus_wire::ethernet::HEADER_LEN..];
    let sack = Sack::parse(lanbus_wire::frame::Packet::new_checked(eth_payload).unwrap().payload());
    assert_eq!(sack, held(0, &[1, 2, 4]));
    // A duplicate of a held frame is counted, not held twice.
    b.handle_frame(at_us(4), &frames[2]);
    // The hole fills: 0, 1 and 2 come out in order; 4 waits for 3.
    b.handle_frame(at_us(5), &frames[0]);
    let got: Vec<Vec<u8>> = std::iter::from_fn(|| b.poll_message().map(|m| m.data.to_vec())).collect();
    assert_eq!(got, (0..3).map(|i| test_message(i, 1000)).collect::<Vec<_>>());
    let ack = drain(&mut b, at_us(5)).pop().unwrap();
    assert_eq!(header(&ack).ack, 3, "the ACK goes at once when a hole fills");
    b.handle_frame(at_us(6), &frames[3]);
    assert_eq!(b.poll_message().unwrap().data, &test_message(3, 1000)[..]);
    assert_eq!(b.poll_message().unwrap().data, &test_message(4, 1000)[..]);
    let c = b.counters();
    assert_eq!((c.frames_held, c.drop_out_of_order, c.drop_duplicate, c.messages_delivered), (3, 0, 1, 5));
}

#[test]
fn the_sender_resends_only_the_frames_found_lost() {
    let (mut a, _) = loaded(p2p(), 10);
    // All ten went at 0 us; 2 and 5 were lost. Reports arrive as the receiver holds 3, 4, ...
    a.handle_frame(at_us(10), &sack_frame(B, A, 0, 2, Some(0), &held(2, &[3])));
    assert_eq!(
        resent(&mut a, at_us(10)),
        [] as [u32; 0],
        "one frame past the hole is not enough (threshold 2)"
    );
    a.handle_frame(at_us(11), &sack_frame(B, A, 0, 2, Some(0), &held(2, &[3, 4])));
    assert_eq!(resent(&mut a, at_us(11)), [2]);
    a.handle_frame(at_us(12), &sack_frame(B, A, 0, 2, Some(0), &held(2, &[3, 4, 6, 7, 8, 9])));
    assert_eq!(resent(&mut a, at_us(12)), [5], "the hole at 2 was resent after these frames went: no news");
    let c = a.counters();
    assert_eq!((c.fast_retransmits, c.retransmitted_frames, c.timeouts), (2, 2, 0));
    // 2 arrives; the receiver still lacks 5.
    a.handle_frame(at_us(20), &sack_frame(B, A, 0, 5, Some(stamp(at_us(11))), &held(5, &[6, 7, 8, 9])));
    assert_eq!(resent(&mut a, at_us(20)), [] as [u32; 0]);
    // New frames 10 and 11 are held, sent after 5's resend: that resend was lost too.
    for i in 10..12 {
        a.send(at_us(21), B, 0, &test_message(i, 1000)).unwrap();
    }
    assert_eq!(resent(&mut a, at_us(21)), [10, 11]);
    a.handle_frame(
        at_us(30),
        &sack_frame(B, A, 0, 5, Some(stamp(at_us(21))), &held(5, &[6, 7, 8, 9, 10, 11])),
    );
    assert_eq!(resent(&mut a, at_us(30)), [5]);
    // Everything arrives.
    a.handle_frame(at_us(40), &sack_frame(B, A, 0, 12, Some(stamp(at_us(30))), &Sack::EMPTY));
    assert!(a.is_idle());
    assert_eq!(a.counters().retransmitted_frames, 3);
}

#[test]
fn a_timeout_forgets_the_reports_and_goes_back() {
    let mut c = p2p();
    c.tail_loss_probe = false;
    let (mut a, _) = loaded(c, 6);
    a.handle_frame(at_us(10), &sack_frame(B, A, 0, 0, Some(0), &held(0, &[2, 3])));
    assert_eq!(resent(&mut a, at_us(10)), [0, 1], "two frames held after each");
    // The receiver may have let go of what it held: on the timer everything goes again.
    let rto = a.poll_timeout().unwrap();
    a.handle_timeout(rto);
    assert_eq!(resent(&mut a, rto), [0, 1, 2, 3, 4, 5]);
    assert_eq!(a.counters().timeouts, 1);
    // After the go-back, frames reported held are skipped.
    let (mut a, _) = loaded(p2p(), 6);
    let t = a.poll_timeout().unwrap();
    a.handle_timeout(t);
    let mut buf = vec![0u8; a.config().frame_capacity()];
    let first = a.poll_transmit(t, &mut buf).map(|n| header(&buf[..n]).sequence);
    assert_eq!(first, Some(0));
    a.handle_frame(t, &sack_frame(B, A, 0, 0, Some(stamp(t)), &held(0, &[1, 2, 4])));
    assert_eq!(resent(&mut a, t), [3, 5], "1, 2 and 4 are held: not sent again");
}

/// Over a lossy, reordering wire, selective repeat delivers the same stream as Go-Back-N with
/// far fewer frames sent again.
#[test]
fn selective_repeat_resends_far_less_than_go_back_n() {
    let f = Faults { loss: 0.02, ..Faults::default() };
    let run = |c| {
        let mut p = Pair::endpoints(c, f, 7);
        assert!(p.transfer(3000, 0, at_us(60_000_000), |_| 1000));
        assert_stream(&p.at_b, A, 0, 3000, |_| 1000);
        (p.a.counters().retransmitted_frames, p.now)
    };
    let (sr, t_sr) = run(p2p());
    let (gbn, t_gbn) = run(gbn());
    assert!(sr * 4 < gbn, "resends: {sr} selective, {gbn} go-back-n");
    assert!(t_sr < t_gbn, "completion: {t_sr:?} selective, {t_gbn:?} go-back-n");
}
