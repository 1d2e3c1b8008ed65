//! Protocol tests: deterministic, on a logical clock, reproducible from their seeds.

use core::time::Duration;

use lanbus_wire::ethernet::{EtherType, EthernetFrame, EthernetRepr, HEADER_LEN as ETH_LEN};
use lanbus_wire::frame::{
    self, Kind, Packet, Repr, Sack, FLAG_ECHO, FLAG_SACK, HEADER_LEN as LB_LEN, RECORD_HEADER_LEN,
};
use lanbus_wire::{Instant, MacAddr};

use crate::testutil::{test_message, Dir, Faults, Node, Pair, SplitNode};
use crate::{stamp, Config, Endpoint, SendError, Seq};

pub(crate) const A: MacAddr = MacAddr::local(1);
pub(crate) const B: MacAddr = MacAddr::local(2);

pub(crate) fn us(n: u64) -> Duration {
    Duration::from_micros(n)
}

pub(crate) fn at_us(n: u64) -> Instant {
    Instant::from_nanos(n * 1000)
}

pub(crate) fn p2p() -> Config {
    let mut c = Config::point_to_point();
    c.rate.enabled = false;
    c
}

/// [`p2p`] with Go-Back-N instead of selective repeat.
pub(crate) fn gbn() -> Config {
    let mut c = p2p();
    c.selective_repeat = false;
    c
}

/// Everything `e` wants to send now.
pub(crate) fn drain(e: &mut Endpoint, now: Instant) -> Vec<Vec<u8>> {
    let mut buf = vec![0u8; e.config().frame_capacity()];
    let mut out = vec![];
    while let Some(n) = e.poll_transmit(now, &mut buf) {
        out.push(buf[..n].to_vec());
    }
    out
}

pub(crate) fn header(frame: &[u8]) -> Repr {
    let eth = EthernetFrame::new_checked(frame).unwrap();
    Repr::parse(&Packet::new_checked(eth.payload()).unwrap()).unwrap()
}

/// An ACK frame from `from` to `to`.
pub(crate) fn ack_frame(from: MacAddr, to: MacAddr, channel: u16, ack: u32, echo: Option<u32>) -> Vec<u8> {
    sack_frame(from, to, channel, ack, echo, &Sack::EMPTY)
}

/// An ACK frame from `from` to `to` that reports the frames `sack` past `ack` held.
pub(crate) fn sack_frame(
    from: MacAddr,
    to: MacAddr,
    channel: u16,
    ack: u32,
    echo: Option<u32>,
    sack: &Sack,
) -> Vec<u8> {
    let bits = sack.as_bytes();
    let mut f = vec![0u8; ETH_LEN + LB_LEN + bits.len()];
    f[ETH_LEN + LB_LEN..].copy_from_slice(bits);
    EthernetRepr { src_addr: from, dst_addr: to, ethertype: EtherType::Lanbus }
        .emit(&mut EthernetFrame::new_unchecked(&mut f[..]));
    Repr {
        kind: Kind::Ack,
        flags: if echo.is_some() { FLAG_ECHO } else { 0 } | if bits.is_empty() { 0 } else { FLAG_SACK },
        group: 0,
        channel,
        sequence: 0,
        ack,
        timestamp: 0,
        echo: echo.unwrap_or(0),
        payload_len: bits.len() as u16,
        hold_us: 0,
        // The epoch every test endpoint has (its config leaves it 0), the receiver's not known.
        epoch: 1,
        peer_epoch: 0,
    }
    .emit(&mut Packet::new_unchecked(&mut f[ETH_LEN..]));
    frame::fill_checksum(&mut f);
    f
}

/// Checks that `got` is exactly messages `0..count` of `len(i)` bytes, in order, on `channel`.
pub(crate) fn assert_stream(
    got: &[(MacAddr, u16, Vec<u8>)],
    from: MacAddr,
    channel: u16,
    count: u64,
    len: impl Fn(u64) -> usize,
) {
    let mine: Vec<_> = got.iter().filter(|m| m.0 == from && m.1 == channel).collect();
    assert_eq!(mine.len() as u64, count, "message count on channel {channel}");
    for (i, m) in mine.iter().enumerate() {
        assert!(m.2 == test_message(i as u64, len(i as u64)), "message {i} on channel {channel} differs");
    }
}

/// The largest fragment a 1500-byte MTU frame carries: a message of this length fills one frame.
const WHOLE_FRAME_MESSAGE: usize = 1500 - LB_LEN - frame::RECORD_HEADER_LEN;

fn mixed_len(i: u64) -> usize {
    match i % 7 {
        0 => 0,
        1 => 3000,
        2 => 1,
        3 => 65_536 * usize::from(i % 70 == 3),
        4 => WHOLE_FRAME_MESSAGE,
        5 => WHOLE_FRAME_MESSAGE + 1,
        _ => 64,
    }
}

#[test]
fn delivers_in_both_modes() {
    let mut p = Pair::endpoints(p2p(), Faults::default(), 1);
    assert!(p.transfer(500, 3, at_us(1_000_000), mixed_len));
    assert_stream(&p.at_b, A, 3, 500, mixed_len);
    let c = p.a.counters();
    assert_eq!((c.retransmitted_frames, c.timeouts, c.fast_retransmits), (0, 0, 0));
    assert_eq!(c.messages_sent, 500);
    assert_eq!(p.b.counters().messages_delivered, 500);
    assert!(c.rtt_samples > 0 && c.rtt_min().unwrap() >= us(10));

    let mut s = Pair::split(p2p(), Faults::default(), 1);
    assert!(s.transfer(500, 3, at_us(1_000_000), mixed_len));
    assert_stream(&s.at_b, A, 3, 500, mixed_len);
}

#[test]
fn packs_small_messages_and_segments_big_ones() {
    let mut a = Endpoint::new(p2p(), A, Instant::ZERO);
    let mut b = Endpoint::new(p2p(), B, Instant::ZERO);
    for i in 0..100 {
        a.send(Instant::ZERO, B, 0, &test_message(i, 64)).unwrap();
    }
    let frames = drain(&mut a, Instant::ZERO);
    // 68 bytes per record, 1460 bytes of payload per frame: 21 per frame.
    assert_eq!(frames.len(), 5);
    assert!(frames.iter().all(|f| f.len() <= 1514));
    for f in &frames {
        b.handle_frame(Instant::ZERO, f);
    }
    for i in 0..100 {
        assert_eq!(b.poll_message().unwrap().data, &test_message(i, 64)[..]);
    }
    assert!(b.poll_message().is_none());
    // Packing off: one frame per message.
    let mut c = p2p();
    c.pack_messages = false;
    let mut a = Endpoint::new(c, A, Instant::ZERO);
    for i in 0..10 {
        a.send(Instant::ZERO, B, 0, &test_message(i, 64)).unwrap();
    }
    assert_eq!(drain(&mut a, Instant::ZERO).len(), 10);
    // A 64 KiB message takes ceil(65536 / 1456) = 46 frames; one byte more is refused.
    let mut a = Endpoint::new(p2p(), A, Instant::ZERO);
    a.send(Instant::ZERO, B, 0, &test_message(9, 65_536)).unwrap();
    assert_eq!(drain(&mut a, Instant::ZERO).len(), 46);
    assert_eq!(a.send(Instant::ZERO, B, 0, &[0; 65_537]), Err(SendError::TooLarge { len: 65_537 }));
    assert_eq!(
        a.send(Instant::ZERO, MacAddr::BROADCAST, 0, b"x"),
        Err(SendError::NotUnicast(MacAddr::BROADCAST))
    );
}

#[test]
fn a_message_in_parts_goes_out_as_the_same_frames() {
    // Parts cut anywhere (empty ones too, across frame boundaries and into a packed frame's
    // tail) make exactly the frames the whole message makes.
    let whole = test_message(5, 20_000);
    let cuts: [&[usize]; 4] = [&[], &[0, 20, 20], &[1455, 1456, 2913], &[19_999]];
    let send_all = |e: &mut Endpoint, parts: &[&[u8]]| {
        e.send(Instant::ZERO, B, 0, &test_message(1, 100)).unwrap();
        e.send_parts(Instant::ZERO, B, 0, parts).unwrap();
    };
    let mut reference = Endpoint::new(p2p(), A, Instant::ZERO);
    send_all(&mut reference, &[&whole]);
    let expected = drain(&mut reference, Instant::ZERO);
    for cut in cuts {
        let mut parts = Vec::new();
        let mut at = 0;
        for &c in cut {
            parts.push(&whole[at..c]);
            at = c;
        }
        parts.push(&whole[at..]);
        let mut a = Endpoint::new(p2p(), A, Instant::ZERO);
        send_all(&mut a, &parts);
        assert_eq!(drain(&mut a, Instant::ZERO), expected, "cut at {cut:?}");
    }
    let mut a = Endpoint::new(p2p(), A, Instant::ZERO);
    let big = [0u8; 40_000];
    assert_eq!(a.send_parts(Instant::ZERO, B, 0, &[&big, &big]), Err(SendError::TooLarge { len: 80_000 }));
}

#[test]
fn a_ping_pong_whose_answers_carry_the_acks_sends_no_ack_frames() {
    // Each side answers within a microsecond, well inside the ACK delay: every ACK rides the
    // answer, however many messages go by (the count toward ack_every_frames starts again
    // with each carried ACK).
    let mut a = Endpoint::new(p2p(), A, Instant::ZERO);
    let mut b = Endpoint::new(p2p(), B, Instant::ZERO);
    let mut t = 0;
    let mut ack_frames = 0;
    let mut hop = |from: &mut Endpoint, to: &mut Endpoint, t: &mut u64, i: u64| {
        *t += 1;
        from.send(at_us(*t), to.local_mac(), 0, &test_message(i, 100)).unwrap();
        let frames = drain(from, at_us(*t));
        ack_frames += frames.iter().filter(|f| header(f).kind == Kind::Ack).count();
        *t += 1;
        for f in &frames {
            to.handle_frame(at_us(*t), f);
        }
        to.handle_timeout(at_us(*t));
        assert_eq!(to.poll_message().unwrap().data, &test_message(i, 100)[..]);
    };
    for i in 0..100 {
        hop(&mut a, &mut b, &mut t, i);
        hop(&mut b, &mut a, &mut t, i);
    }
    assert_eq!(ack_frames, 0);
    assert_eq!(a.counters().acks_carried + b.counters().acks_carried, 199);
    // The last answer's ACK is owed: it goes on its own once the delay is over.
    t += 10;
    a.handle_timeout(at_us(t));
    let frames = drain(&mut a, at_us(t));
    assert_eq!(frames.len(), 1);
    assert_eq!(header(&frames[0]).kind, Kind::Ack);
}

#[test]
fn send_queue_applies_backpressure() {
    let mut c = p2p();
    c.send_queue_frames = 10;
    c.pack_messages = false;
    let mut a = Endpoint::new(c, A, Instant::ZERO);
    for i in 0..10 {
        a.send(Instant::ZERO, B, 0, &test_message(i, 100)).unwrap();
    }
    assert_eq!(a.send(Instant::ZERO, B, 0, b"one more"), Err(SendError::QueueFull));
    // Another channel has its own queue.
    a.send(Instant::ZERO, B, 1, b"other channel").unwrap();
    let frames = drain(&mut a, Instant::ZERO);
    assert_eq!(frames.len(), 11);
    a.handle_frame(at_us(10), &ack_frame(B, A, 0, 3, None));
    a.send(at_us(10), B, 0, b"now it fits").unwrap();
    assert_eq!(a.counters().messages_sent, 12);
}

#[test]
fn window_is_never_exceeded() {
    let mut c = p2p();
    c.window_frames = 4;
    c.pack_messages = false;
    let mut a = Endpoint::new(c.clone(), A, Instant::ZERO);
    for i in 0..20 {
        a.send(Instant::ZERO, B, 0, &test_message(i, 10)).unwrap();
    }
    let seqs: Vec<u32> = drain(&mut a, Instant::ZERO).iter().map(|f| header(f).sequence).collect();
    assert_eq!(seqs, vec![0, 1, 2, 3]);
    a.handle_frame(at_us(10), &ack_frame(B, A, 0, 2, None));
    let seqs: Vec<u32> = drain(&mut a, at_us(10)).iter().map(|f| header(f).sequence).collect();
    assert_eq!(seqs, vec![4, 5]);
    // An ACK for frames never sent is refused.
    a.handle_frame(at_us(11), &ack_frame(B, A, 0, 9, None));
    assert_eq!(a.counters().bad_acks, 1);
    assert!(drain(&mut a, at_us(11)).is_empty());

    // Under random loss: every DATA frame is below (highest ACK value B ever sent) + window.
    for seed in 0..4 {
        let mut p =
            Pair::endpoints(c.clone(), Faults { loss: 0.1, reorder: 0.05, ..Faults::default() }, seed);
        let high_ack = std::rc::Rc::new(std::cell::Cell::new(0u32));
        let h = high_ack.clone();
        p.filter = Some(Box::new(move |dir, f| {
            let r = header(f);
            match (dir, r.kind) {
                (Dir::BtoA, Kind::Ack) => h.set(h.get().max(r.ack)),
                (Dir::AtoB, Kind::Data) => {
                    assert!(r.sequence < h.get() + 4, "seq {} ack {}", r.sequence, h.get())
                }
                _ => {}
            }
            true
        }));
        assert!(p.transfer(300, 0, at_us(5_000_000), |_| 100));
        assert_stream(&p.at_b, A, 0, 300, |_| 100);
    }
}

/// Sends `frames` one-frame messages from a fresh endpoint and returns it with the frames.
pub(crate) fn loaded(config: Config, frames: u64) -> (Endpoint, Vec<Vec<u8>>) {
    let mut a = Endpoint::new(config, A, Instant::ZERO);
    for i in 0..frames {
        a.send(Instant::ZERO, B, 0, &test_message(i, 1000)).unwrap();
    }
    let out = drain(&mut a, Instant::ZERO);
    assert_eq!(out.len() as u64, frames);
    (a, out)
}

/// The retransmission paper's rule: two ACKs with the same number in a row say the frame of
/// that number was lost.
#[test]
fn the_papers_rule_resends_on_the_second_ack_with_the_same_number() {
    let mut c = gbn();
    c.dup_ack_threshold = crate::PAPER_DUP_ACK_THRESHOLD;
    let (mut a, _) = loaded(c, 6);
    a.handle_frame(at_us(10), &ack_frame(B, A, 0, 3, None));
    assert!(drain(&mut a, at_us(10)).is_empty(), "one ACK for 3 is no news of a loss");
    a.handle_frame(at_us(11), &ack_frame(B, A, 0, 3, None));
    let resent: Vec<u32> = drain(&mut a, at_us(11)).iter().map(|f| header(f).sequence).collect();
    assert_eq!(resent, (3..6).collect::<Vec<_>>());
}

#[test]
fn fast_retransmit_after_exactly_n_duplicate_acks() {
    for n in [1u32, 2, 3, 5] {
        let mut c = p2p();
        c.dup_ack_threshold = n;
        let (mut a, _) = loaded(c, 10);
        // Frames 0 and 1 arrive, 2 is lost; each later frame draws a duplicate ACK for 2.
        a.handle_frame(at_us(10), &ack_frame(B, A, 0, 2, None));
        for k in 1..n {
            a.handle_frame(at_us(10 + u64::from(k)), &ack_frame(B, A, 0, 2, None));
            assert!(drain(&mut a, at_us(10 + u64::from(k))).is_empty(), "resent after {k} < {n} duplicates");
        }
        a.handle_frame(at_us(20), &ack_frame(B, A, 0, 2, None));
        let resent: Vec<u32> = drain(&mut a, at_us(20)).iter().map(|f| header(f).sequence).collect();
        assert_eq!(resent, (2..10).collect::<Vec<_>>(), "threshold {n}: go back to 2");
        let cs = a.counters();
        assert_eq!(
            (cs.fast_retransmits, cs.dup_acks_received, cs.retransmitted_frames),
            (1, u64::from(n), 8)
        );
        // More duplicates for the same loss, answering frames sent before the resend (at 0 us),
        // do not resend again.
        for k in 0..5 {
            a.handle_frame(at_us(30 + k), &ack_frame(B, A, 0, 2, Some(stamp(at_us(0)))));
        }
        assert!(drain(&mut a, at_us(40)).is_empty());
        assert_eq!(a.counters().fast_retransmits, 1);
        // Duplicates answering frames sent after the resend (at 20 us) say the resend was lost too.
        for k in 0..n {
            a.handle_frame(at_us(50 + u64::from(k)), &ack_frame(B, A, 0, 2, Some(stamp(at_us(20)))));
        }
        let again: Vec<u32> = drain(&mut a, at_us(60)).iter().map(|f| header(f).sequence).collect();
        assert_eq!(again, (2..10).collect::<Vec<_>>(), "threshold {n}: a lost resend goes back again");
        assert_eq!(a.counters().fast_retransmits, 2);
    }
}

#[test]
fn duplicates_of_a_spurious_go_back_do_not_start_another() {
    // 16 frames arrive but every ACK is lost: the RTO resends them. The receiver answers each
    // resent duplicate with a duplicate ACK for 16; the first releases the window, and the sender
    // moves on to frames 16..32. The other duplicates echo the resends' stamps, older than frame
    // 16's transmission: no news of a loss, so no go-back (which would resend 16..32 and draw the
    // next run of duplicates: a storm).
    let mut c = p2p();
    c.window_frames = 16;
    let mut a = Endpoint::new(c, A, Instant::ZERO);
    for i in 0..32 {
        a.send(Instant::ZERO, B, 0, &test_message(i, 1000)).unwrap();
    }
    assert_eq!(drain(&mut a, Instant::ZERO).len(), 16, "the window holds 16");
    let rto = a.poll_timeout().expect("RTO armed");
    a.handle_timeout(rto);
    let resent = drain(&mut a, rto);
    assert_eq!(resent.len(), 16);
    let resent_at = stamp(rto);
    let t = rto + Duration::from_micros(10);
    a.handle_frame(t, &ack_frame(B, A, 0, 16, Some(resent_at)));
    let fresh: Vec<u32> = drain(&mut a, t).iter().map(|f| header(f).sequence).collect();
    assert_eq!(fresh, (16..32).collect::<Vec<_>>());
    for k in 1..16u64 {
        let tk = t + Duration::from_micros(k);
        a.handle_frame(tk, &ack_frame(B, A, 0, 16, Some(resent_at)));
        assert!(drain(&mut a, tk).is_empty(), "go-back on the echo of an old resend");
    }
    assert_eq!(a.counters().fast_retransmits, 0);
}

#[test]
fn rto_backs_off_within_bounds() {
    let mut c = p2p();
    c.initial_rto = us(300);
    c.min_rto = us(200);
    c.max_rto = us(2000);
    // The timer alone: no probe before it.
    c.tail_loss_probe = false;
    let (mut a, _) = loaded(c, 3);
    let mut fired = vec![];
    let mut last = Instant::ZERO;
    for _ in 0..8 {
        let t = a.poll_timeout().expect("a retransmission timer runs");
        a.handle_timeout(t);
        let frames = drain(&mut a, t);
        // Go-Back-N: everything from the first unacknowledged frame again.
        assert_eq!(frames.iter().map(|f| header(f).sequence).collect::<Vec<_>>(), vec![0, 1, 2]);
        fired.push((t - last).as_micros());
        last = t;
    }
    assert_eq!(fired, vec![300, 600, 1200, 2000, 2000, 2000, 2000, 2000]);
    assert_eq!(a.counters().timeouts, 8);
    // An ACK with an echo ends the backoff; the RTO follows the RTT, bounded below.
    let t = last + us(50);
    let echo = (last.as_nanos() as u32).wrapping_add(0);
    a.handle_frame(t, &ack_frame(B, A, 0, 1, Some(echo)));
    assert_eq!(a.counters().rtt_min(), Some(us(50)));
    assert_eq!(a.poll_timeout(), Some(t + us(200)), "RTO = max(50 + 4*25, 200) us");
}

#[test]
fn a_lost_last_frame_costs_a_probe_not_a_retransmission_timeout() {
    // Requests at queue depth one over a wire with a 20 us round trip and a 5 ms minimum RTO, as
    // the daemons run: every tenth request's only frame is lost. With the probe each loss costs
    // about two round trips; with the timer alone, 5 ms.
    let run = |probe: bool| {
        let mut c = p2p();
        c.min_rto = Duration::from_millis(5);
        c.tail_loss_probe = probe;
        let mut p = Pair::endpoints(c, Faults::default(), 9);
        p.delay = us(10);
        let mut frames_a_to_b = 0u64;
        p.filter = Some(Box::new(move |dir, f| {
            if dir != Dir::AtoB || header(f).kind != Kind::Data {
                return true;
            }
            frames_a_to_b += 1;
            frames_a_to_b % 10 != 5
        }));
        let start = p.now;
        for i in 0..100u64 {
            p.a.send(p.now, B, 3, &test_message(i, 64)).unwrap();
            let deadline = p.now + Duration::from_secs(1);
            assert!(p.run_until(deadline, |p| p.at_b.len() as u64 == i + 1), "request {i} never arrived");
        }
        (p.now - start, p.a.counters())
    };
    let (with_probe, c) = run(true);
    assert!(c.tail_loss_probes >= 10 && c.timeouts == 0, "{c:?}");
    let (timer_only, c) = run(false);
    assert!(c.tail_loss_probes == 0 && c.timeouts >= 10, "{c:?}");
    assert!(with_probe * 10 < timer_only, "probe {with_probe:?}, timer {timer_only:?}");
    assert!(with_probe < Duration::from_millis(10), "{with_probe:?}");
}

#[test]
fn out_of_order_frames_are_discarded_with_a_duplicate_ack() {
    let (_, frames) = loaded(gbn(), 3);
    let mut b = Endpoint::new(gbn(), B, Instant::ZERO);
    b.handle_frame(at_us(1), &frames[1]);
    b.handle_frame(at_us(2), &frames[2]);
    assert!(b.poll_message().is_none());
    let acks = drain(&mut b, at_us(2));
    assert_eq!(acks.len(), 2);
    for f in &acks {
        let r = header(f);
        assert_eq!((r.kind, r.ack), (Kind::Ack, 0));
    }
    b.handle_frame(at_us(3), &frames[0]);
    b.handle_frame(at_us(4), &frames[0]);
    let cs = b.counters();
    assert_eq!(
        (cs.drop_out_of_order, cs.drop_duplicate, cs.messages_delivered, cs.dup_acks_sent),
        (2, 1, 1, 3)
    );
    assert_eq!(b.poll_message().unwrap().data, &test_message(0, 1000)[..]);
    assert!(b.poll_message().is_none());
}

#[test]
fn acks_are_coalesced_by_count_and_by_time() {
    let mut c = p2p();
    c.ack_every_frames = 4;
    c.ack_delay = us(7);
    let (_, frames) = loaded(c.clone(), 6);
    let mut b = Endpoint::new(c, B, Instant::ZERO);
    for (i, f) in frames.iter().enumerate() {
        b.handle_frame(at_us(i as u64), f);
    }
    let acks: Vec<(u32, u16)> =
        drain(&mut b, at_us(5)).iter().map(|f| (header(f).ack, header(f).hold_us)).collect();
    // One ACK after 4 frames, echoing frame 3 (arrived at 3 us), sent at 5 us: held 2 us.
    assert_eq!(acks, vec![(4, 2)], "one ACK after 4 frames");
    // Frames 4 and 5 wait at most ack_delay after frame 4 (t = 4 us).
    assert_eq!(b.poll_timeout(), Some(at_us(11)));
    b.handle_timeout(at_us(11));
    let acks: Vec<(u32, u16)> =
        drain(&mut b, at_us(11)).iter().map(|f| (header(f).ack, header(f).hold_us)).collect();
    // Echoing frame 5 (arrived at 5 us): held 6 us.
    assert_eq!(acks, vec![(6, 6)]);
    assert_eq!(b.poll_timeout(), None);
}

#[test]
fn sequence_numbers_wrap() {
    for (split, seed) in [(false, 3u64), (true, 4)] {
        let mut c = p2p();
        c.initial_sequence = u32::MAX - 20;
        let f = Faults { loss: 0.05, reorder: 0.02, duplicate: 0.02, ..Faults::default() };
        let ok = if split {
            let mut p = Pair::split(c, f, seed);
            let ok = p.transfer(400, 1, at_us(5_000_000), |_| 900);
            assert_stream(&p.at_b, A, 1, 400, |_| 900);
            ok
        } else {
            let mut p = Pair::endpoints(c, f, seed);
            let ok = p.transfer(400, 1, at_us(5_000_000), |_| 900);
            assert_stream(&p.at_b, A, 1, 400, |_| 900);
            ok
        };
        assert!(ok);
    }
    // The first frame carries the configured initial sequence, the 22nd wraps to 0.
    let mut c = p2p();
    c.initial_sequence = u32::MAX - 20;
    let (_, frames) = loaded(c, 23);
    assert_eq!(header(&frames[0]).sequence, u32::MAX - 20);
    assert_eq!(header(&frames[21]).sequence, 0);
    assert_eq!(Seq(u32::MAX) + 1, Seq(0));
}

#[test]
fn corrupted_frames_are_detected_and_recovered() {
    let f = Faults { corrupt: 0.05, ..Faults::default() };
    let mut p = Pair::endpoints(p2p(), f, 11);
    assert!(p.transfer(2000, 0, at_us(10_000_000), |i| (i % 300) as usize));
    assert_stream(&p.at_b, A, 0, 2000, |i| (i % 300) as usize);
    // Every corrupted frame is dropped: mostly by the checksum, some earlier (a flipped EtherType,
    // version, source group bit or length).
    let caught: u64 = [p.a.counters(), p.b.counters()]
        .iter()
        .map(|c| c.drop_bad_checksum + c.drop_bad_frame + c.drop_bad_version + c.drop_not_for_us)
        .sum();
    assert!(
        p.wire.corrupted > 10 && caught == p.wire.corrupted,
        "{} corrupted, {caught} caught",
        p.wire.corrupted
    );
    // Without the checksum flag a checksumming receiver refuses the frame.
    let mut c = p2p();
    c.checksum = false;
    let (_, frames) = loaded(c, 1);
    let mut b = Endpoint::new(p2p(), B, Instant::ZERO);
    b.handle_frame(at_us(1), &frames[0]);
    assert_eq!(b.counters().drop_bad_checksum, 1);
}

#[test]
fn bad_frames_never_panic_and_are_counted() {
    let mut b = Endpoint::new(p2p(), B, Instant::ZERO);
    let (_, frames) = loaded(p2p(), 1);
    let good = &frames[0];
    b.handle_frame(at_us(1), &good[..10]);
    b.handle_frame(at_us(1), &good[..40]);
    let mut wrong_type = good.clone();
    wrong_type[12] = 0x08;
    b.handle_frame(at_us(1), &wrong_type);
    let mut v3 = good.clone();
    v3[ETH_LEN] = 3;
    b.handle_frame(at_us(1), &v3);
    let mut other = good.clone();
    other[0..6].copy_from_slice(&MacAddr::local(9).0);
    frame::fill_checksum(&mut other);
    b.handle_frame(at_us(1), &other);
    let mut kind = good.clone();
    kind[ETH_LEN + 1] = 77;
    frame::fill_checksum(&mut kind);
    b.handle_frame(at_us(1), &kind);
    let mut records = good.clone();
    records[ETH_LEN + LB_LEN + 2] = 0x02; // a LAST fragment with no FIRST
    frame::fill_checksum(&mut records);
    b.handle_frame(at_us(1), &records);
    let c = b.counters();
    assert_eq!(c.drop_bad_frame, 4, "{c:?}");
    assert_eq!((c.drop_bad_version, c.drop_not_for_us, c.drop_unknown_kind), (1, 1, 1));
    assert_eq!(c.messages_delivered, 0);
    // Padding after the payload (Ethernet minimum size) is fine.
    let mut padded = good.clone();
    padded.extend_from_slice(&[0; 20]);
    b.handle_frame(at_us(2), &padded);
    assert_eq!(b.counters().messages_delivered, 1);
}

#[test]
fn rate_control_paces_and_reacts_to_delay() {
    let mut c = p2p();
    c.rate.enabled = true;
    // 50 Mbit/s with a 100 us target: a window of 625 bytes, below one frame, so frames are paced
    // (a flow whose window holds a frame is clocked by its ACKs instead).
    c.rate.line_rate_bps = 50_000_000;
    c.rate.min_rate_bps = 1_000_000;
    c.rate.target_queue_delay = us(100);
    let (mut a, frames) = {
        let mut a = Endpoint::new(c.clone(), A, Instant::ZERO);
        for i in 0..5 {
            a.send(Instant::ZERO, B, 0, &test_message(i, 1000)).unwrap();
        }
        let f = drain(&mut a, Instant::ZERO);
        (a, f)
    };
    assert_eq!(frames.len(), 1, "the window holds one frame");
    // Its ACK (a 10 us round trip, the first: the minimum) frees the window, but the next frame
    // waits for its pacing time: about 1050 bytes at 50 Mbit/s, 168 us after the first.
    a.handle_frame(at_us(20), &ack_frame(B, A, 0, 1, Some(at_us(10).as_nanos() as u32)));
    assert!(drain(&mut a, at_us(20)).is_empty(), "paced");
    let gap = a.poll_timeout().unwrap();
    assert!(gap > at_us(150) && gap <= at_us(200), "next send at {gap:?}");
    assert_eq!(drain(&mut a, gap).len(), 1);
    // A later, bigger round trip cuts the rate.
    let rate0 = a.send_half().pacing_rate_bps(B, 0).unwrap();
    a.handle_frame(at_us(300), &ack_frame(B, A, 0, 2, Some(at_us(100).as_nanos() as u32)));
    let rate1 = a.send_half().pacing_rate_bps(B, 0).unwrap();
    // 200 us against a 10 us minimum and a 110 us target: 1 - 0.8 * 90 / 200.
    assert!((rate1 - rate0 * 0.64).abs() < 1.0, "{rate0} -> {rate1}");
}

#[test]
fn rate_control_leaves_out_the_time_the_receiver_held_a_frame() {
    let mut c = p2p();
    c.rate.enabled = true;
    c.rate.line_rate_bps = 50_000_000;
    c.rate.min_rate_bps = 1_000_000;
    c.rate.target_queue_delay = us(100);
    let mut a = Endpoint::new(c, A, Instant::ZERO);
    for i in 0..5 {
        a.send(Instant::ZERO, B, 0, &test_message(i, 1000)).unwrap();
    }
    let _ = drain(&mut a, Instant::ZERO);
    let held = |ack: u32, echo: Instant, hold_us: u16| {
        let mut f = ack_frame(B, A, 0, ack, Some(echo.as_nanos() as u32));
        Packet::new_unchecked(&mut f[ETH_LEN..]).set_hold_us(hold_us);
        frame::fill_checksum(&mut f);
        f
    };
    let rate0 = a.send_half().pacing_rate_bps(B, 0).unwrap();
    a.handle_frame(at_us(20), &held(1, at_us(10), 0));
    let gap = a.poll_timeout().unwrap();
    assert_eq!(drain(&mut a, gap).len(), 1, "the second frame at its pacing time");
    // A 200 us round trip of which the receiver held the frame 190 us (its thread was not
    // scheduled): 10 us on the fabric, no queue, no cut. The timer still counts all of it.
    a.handle_frame(at_us(300), &held(2, at_us(100), 190));
    let rate1 = a.send_half().pacing_rate_bps(B, 0).unwrap();
    assert!(rate1 >= rate0, "{rate0} -> {rate1}");
    assert_eq!(a.counters().rtt_max(), Some(us(200)));
    // Held 50 us of 200: 150 us on the fabric. The threshold is the 10 us minimum, the 100 us
    // target and the hosts' smoothed share (0, then 190 / 8, then that plus (50 - 23.75) / 8 =
    // 27.03 us): 137.03 us, so 1 - 0.8 * 12.97 / 150.
    assert!(!drain(&mut a, at_us(400)).is_empty());
    a.handle_frame(at_us(600), &held(3, at_us(400), 50));
    let rate2 = a.send_half().pacing_rate_bps(B, 0).unwrap();
    let threshold = 10.0 + 100.0 + (190.0 / 8.0 + (50.0 - 190.0 / 8.0) / 8.0);
    let want = rate1 * (1.0 - 0.8 * (150.0 - threshold) / 150.0);
    assert!((rate2 - want).abs() < want * 1e-5, "{rate1} -> {rate2}, want {want}");
}

/// A frame that waited after it was written for its burst to leave (the driver says when with
/// `frames_left`) waited on this host: rate control does not read that wait as a queue.
#[test]
fn rate_control_leaves_out_the_time_a_frame_waited_for_its_burst_to_leave() {
    for told in [true, false] {
        let mut c = p2p();
        c.rate.enabled = true;
        c.rate.line_rate_bps = 1_000_000_000;
        c.rate.target_queue_delay = us(20);
        let mut a = Endpoint::new(c, A, Instant::ZERO);
        // A first exchange: 10 us there and back, the minimum.
        a.send(Instant::ZERO, B, 0, &test_message(0, 1000)).unwrap();
        let _ = drain(&mut a, Instant::ZERO);
        a.frames_left(Instant::ZERO);
        a.handle_frame(at_us(10), &ack_frame(B, A, 0, 1, Some(0)));
        let rate0 = a.send_half().pacing_rate_bps(B, 0).unwrap();
        // The next frame is written at 1000 us, leaves with its burst 200 us later and is
        // answered 10 us after that.
        a.send(at_us(1000), B, 0, &test_message(1, 1000)).unwrap();
        let _ = drain(&mut a, at_us(1000));
        if told {
            a.frames_left(at_us(1200));
        }
        a.handle_frame(at_us(1210), &ack_frame(B, A, 0, 2, Some(at_us(1000).as_nanos() as u32)));
        let rate1 = a.send_half().pacing_rate_bps(B, 0).unwrap();
        if told {
            assert!(rate1 >= rate0, "no queue on the fabric: {rate0} -> {rate1}");
        } else {
            assert!(rate1 < rate0, "read as a queue when not told: {rate0} -> {rate1}");
        }
        assert_eq!(a.counters().rtt_max(), Some(us(210)), "the timer counts the whole round trip");
    }
}

/// With the port's receive timestamps, neither end's wait before it read a frame counts as the
/// fabric's: the receiver's hold runs from when the DATA frame arrived, and the sender adds the
/// time the ACK waited before it was read. Without them the same waits cut the rate.
#[test]
fn rate_control_leaves_out_the_time_frames_waited_unread_at_either_end() {
    // One exchange starting at `t0`: the DATA frame takes 10 us to b, which reads it `wait` later
    // and answers; the ACK takes 10 us back and waits `wait` before a reads it. Returns a's
    // pacing rate after it and the ACK's reported hold.
    fn exchange(
        a: &mut Endpoint,
        b: &mut Endpoint,
        i: u64,
        t0: Instant,
        wait: Duration,
        stamps: bool,
    ) -> (f64, u16) {
        a.send(t0, B, 0, &test_message(i, 1000)).unwrap();
        let data = drain(a, t0).pop().unwrap();
        let (reached, read) = (t0 + us(10), t0 + us(10) + wait);
        if stamps {
            b.handle_frame_at(read, reached, &data);
        } else {
            b.handle_frame(read, &data);
        }
        // b's ACK goes when its coalescing delay is over.
        let t = b.poll_timeout().unwrap();
        b.handle_timeout(t);
        let ack = drain(b, t).pop().unwrap();
        let hold = Packet::new_checked(&ack[ETH_LEN..]).unwrap().hold_us();
        let (reached, read) = (t + us(10), t + us(10) + wait);
        if stamps {
            a.handle_frame_at(read, reached, &ack);
        } else {
            a.handle_frame(read, &ack);
        }
        (a.send_half().pacing_rate_bps(B, 0).unwrap(), hold)
    }
    for stamps in [true, false] {
        let mut c = p2p();
        c.rate.enabled = true;
        c.rate.line_rate_bps = 1_000_000_000;
        c.rate.target_queue_delay = us(100);
        let (mut a, mut b) = (Endpoint::new(c.clone(), A, Instant::ZERO), Endpoint::new(c, B, Instant::ZERO));
        // A first exchange without waits: the minimum round trip.
        let (rate0, _) = exchange(&mut a, &mut b, 0, at_us(0), Duration::ZERO, stamps);
        // Both threads wait 300 us for a core before they read.
        let (rate1, hold) = exchange(&mut a, &mut b, 1, at_us(1000), us(300), stamps);
        if stamps {
            assert!(hold >= 300, "b held the frame from its arrival: {hold} us");
            assert!(rate1 >= rate0, "no queue on the fabric: {rate0} -> {rate1}");
        } else {
            assert!(rate1 < rate0, "read as a queue without the stamps: {rate0} -> {rate1}");
        }
        assert!(a.counters().rtt_max().unwrap() >= us(600), "the timer counts the whole round trip");
    }
}

#[test]
fn traffic_in_both_directions_and_many_channels() {
    let f = Faults { loss: 0.02, reorder: 0.02, duplicate: 0.01, corrupt: 0.01, ack_loss: 0.05 };
    let mut p = Pair::endpoints(p2p(), f, 21);
    for round in 0..50u64 {
        for ch in 0..4u16 {
            let i = round;
            p.a.send(p.now, B, ch, &test_message(i, (i as usize * 37 + usize::from(ch)) % 2000)).unwrap();
            p.b.send(p.now, A, ch, &test_message(i, (i as usize * 37 + usize::from(ch)) % 2000)).unwrap();
        }
        p.step();
    }
    assert!(p.run_until_idle(at_us(10_000_000)));
    for ch in 0..4u16 {
        let len = move |i: u64| (i as usize * 37 + usize::from(ch)) % 2000;
        assert_stream(&p.at_b, A, ch, 50, len);
        assert_stream(&p.at_a, B, ch, 50, len);
    }
}

#[test]
fn frames_written_where_they_lie_cross_a_faulty_wire_in_both_directions() {
    // Bursts of frames read only after the whole burst was written (ACKs in the half's own
    // buffers, DATA frames in their channels' queues), retransmitted and probed in place.
    for (seed, burst) in [(31, 1), (32, 4), (33, 32)] {
        let f = Faults { loss: 0.03, reorder: 0.02, duplicate: 0.01, corrupt: 0.01, ack_loss: 0.05 };
        let mut p = Pair::borrowed(p2p(), f, seed, burst);
        let len = |i: u64, ch: u16| (i as usize * 53 + usize::from(ch) * 700) % 3000;
        for round in 0..60u64 {
            for ch in 0..3u16 {
                p.a.send(p.now, B, ch, &test_message(round, len(round, ch))).unwrap();
                p.b.send(p.now, A, ch, &test_message(round, len(round, ch))).unwrap();
            }
            p.step();
        }
        assert!(p.run_until_idle(at_us(20_000_000)), "burst {burst}");
        for ch in 0..3u16 {
            assert_stream(&p.at_b, A, ch, 60, move |i| len(i, ch));
            assert_stream(&p.at_a, B, ch, 60, move |i| len(i, ch));
        }
        let c = p.a.counters();
        assert!(c.retransmitted_frames > 0 && c.ack_frames_sent > 0, "burst {burst}: {c:?}");
    }
}

#[test]
fn a_frame_sent_again_carries_no_ack_from_its_first_transmission() {
    // The frame stored for retransmission is the one sent: what the first transmission carried
    // (an ACK and an echo) must not go out again with it.
    let mut a = Endpoint::new(p2p(), A, Instant::ZERO);
    let mut b = Endpoint::new(p2p(), B, Instant::ZERO);
    b.send(at_us(0), A, 0, b"request").unwrap();
    for f in drain(&mut b, at_us(0)) {
        a.handle_frame(at_us(1), &f);
    }
    assert_eq!(a.poll_message().unwrap().data, b"request");
    // The answer carries the request's ACK; the wire loses it.
    a.send(at_us(2), B, 0, b"answer").unwrap();
    let at = a.poll_transmit_ref(at_us(2)).expect("the answer");
    let first = a.frame(at).concat();
    assert!(a.poll_transmit_ref(at_us(2)).is_none());
    a.frames_left(at_us(2));
    let h = header(&first);
    assert_eq!((h.kind, h.flags & frame::FLAG_ACK != 0), (Kind::Data, true));
    // Its timer fires: it goes again, with nothing owed.
    let mut t = 2;
    let again = loop {
        t += 100;
        a.handle_timeout(at_us(t));
        if let Some(at) = a.poll_transmit_ref(at_us(t)) {
            break a.frame(at).concat();
        }
        assert!(t < 1_000_000, "no retransmission");
    };
    let h = header(&again);
    assert_eq!(h.kind, Kind::Data);
    assert_eq!(h.flags & (frame::FLAG_ACK | FLAG_ECHO), 0, "{h:?}");
    assert_eq!((h.ack, h.echo, h.hold_us), (0, 0, 0));
    assert!(frame::verify_checksum(&again));
    assert_eq!(first.len(), again.len());
    b.handle_frame(at_us(t + 1), &again);
    assert_eq!(b.poll_message().unwrap().data, b"answer");
}

/// How a test feeds frames to the receiving side.
#[derive(Debug, Clone, Copy)]
enum Mode {
    /// `Endpoint::handle_frame`, messages polled.
    Endpoint,
    /// Sender and receiver halves apart, feedback through a queue.
    Split,
    /// `Endpoint::handle_frame_delivering`, as the run-to-completion runtime does.
    InPlace,
}

/// How each side recovers from loss in a schedule: (sender, receiver) use selective repeat.
/// The split and in-place modes run the sender's setting on both sides.
type Recovery = (bool, bool);

#[allow(clippy::too_many_arguments)]
fn run_schedule(
    mode: Mode,
    recovery: Recovery,
    f: Faults,
    seed: u64,
    count: u64,
    size: usize,
    ack_every: u32,
) {
    let mut c = p2p();
    c.initial_sequence = u32::MAX - (seed as u32 % 64);
    c.ack_every_frames = ack_every;
    c.window_frames = 32;
    c.selective_repeat = recovery.0;
    let len = move |i: u64| (i as usize * 131 + seed as usize) % (size + 1);
    let deadline = at_us(60_000_000);
    let (ok, got, a_counters) = match mode {
        Mode::Split => {
            let mut p = Pair::split(c, f, seed);
            let ok = p.transfer(count, 9, deadline, len);
            (ok, p.at_b, p.a.counters())
        }
        Mode::Endpoint => {
            let mut cb = c.clone();
            cb.selective_repeat = recovery.1;
            let (a, b) = (Endpoint::new(c, A, Instant::ZERO), Endpoint::new(cb, B, Instant::ZERO));
            let mut p = Pair::new(a, b, f, seed);
            let ok = p.transfer(count, 9, deadline, len);
            (ok, p.at_b, p.a.counters())
        }
        Mode::InPlace => {
            let mut p = Pair::in_place(c, f, seed);
            let ok = p.transfer(count, 9, deadline, len);
            for _ in 0..2 {
                p.b.drain_messages(&mut p.at_b);
            }
            (ok, p.at_b, p.a.counters())
        }
    };
    assert!(ok, "transfer did not finish: {a_counters:?}");
    assert_stream(&got, A, 9, count, len);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 24, ..Default::default() })]

    #[test]
    fn exactly_once_in_order_intact_under_faults(
        mode in proptest::sample::select(vec![Mode::Endpoint, Mode::Split, Mode::InPlace]),
        recovery in proptest::sample::select(vec![(true, true), (false, false), (true, false), (false, true)]),
        loss in 0.0f64..0.15, reorder in 0.0f64..0.1, duplicate in 0.0f64..0.1,
        corrupt in 0.0f64..0.05, ack_loss in 0.0f64..0.3,
        seed in 0u64..1_000_000, size in proptest::sample::select(vec![16usize, 200, 3000]),
        ack_every in 1u32..6,
    ) {
        let f = Faults { loss, reorder, duplicate, corrupt, ack_loss };
        run_schedule(mode, recovery, f, seed, 150, size, ack_every);
    }
}

#[test]
fn harsh_schedule_both_modes() {
    let f = Faults { loss: 0.2, reorder: 0.1, duplicate: 0.1, corrupt: 0.05, ack_loss: 0.3 };
    for mode in [Mode::Endpoint, Mode::Split, Mode::InPlace] {
        for recovery in [(true, true), (false, false)] {
            run_schedule(mode, recovery, f, 99, 300, 2000, 3);
        }
    }
    run_schedule(Mode::Endpoint, (true, false), f, 98, 300, 2000, 3);
    run_schedule(Mode::Endpoint, (false, true), f, 97, 300, 2000, 3);
}

/// Many frames into a slow link with a small buffer: with rate control the sender backs off
/// before the buffer overflows; without it the window's worth of frames overflows it again and
/// again.
#[test]
fn rate_control_avoids_overflowing_a_bottleneck() {
    let run = |rate_control: bool| {
        let mut c = Config::point_to_point();
        c.rate.enabled = rate_control;
        c.pack_messages = false;
        let mut p = Pair::endpoints(c, Faults::default(), 8);
        p.bottleneck = Some(crate::testutil::Bottleneck { rate_bps: 1_000_000_000, buffer_bytes: 64 * 1024 });
        assert!(p.transfer(1500, 0, at_us(60_000_000), |_| 1400));
        assert_stream(&p.at_b, A, 0, 1500, |_| 1400);
        (p.wire.queue_drops, p.a.counters().retransmitted_frames, p.now, p.wire.max_queue_delay)
    };
    let (drops_off, rtx_off, t_off, _) = run(false);
    let (drops_on, rtx_on, t_on, qd_on) = run(true);
    assert!(drops_off > 100, "without rate control the buffer overflows: {drops_off}");
    assert!(drops_on * 4 < drops_off, "drops {drops_on} with vs {drops_off} without");
    assert!(rtx_on * 4 < rtx_off, "retransmissions {rtx_on} with vs {rtx_off} without");
    assert!(t_on <= t_off, "completion {t_on:?} with vs {t_off:?} without");
    assert!(qd_on < us(600), "queueing delay stays bounded: {qd_on:?}");
}

/// Valid frames of every kind for mutation.
fn sample_frames() -> Vec<Vec<u8>> {
    let mut a = Endpoint::new(Config::default(), A, Instant::ZERO);
    a.send(Instant::ZERO, B, 1, &test_message(0, 3000)).unwrap();
    a.send(Instant::ZERO, B, 1, &test_message(1, 10)).unwrap();
    a.send(Instant::ZERO, B, 1, b"").unwrap();
    let mut out = drain(&mut a, Instant::ZERO); // heartbeat + 3 DATA frames
    out.push(ack_frame(B, A, 1, 1, Some(5)));
    out
}

/// Up to 5 (position, byte) overwrites.
fn mutations() -> impl proptest::strategy::Strategy<Value = Vec<(usize, u8)>> {
    proptest::collection::vec((0usize..1600, proptest::num::u8::ANY), 0..6)
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, ..Default::default() })]

    /// Whatever a peer sends, the endpoint counts and drops or accepts it, and never panics.
    #[test]
    fn mutated_frames_never_panic(
        picks in proptest::collection::vec(
            (0usize..5, mutations(), proptest::bool::ANY, 0usize..1600),
            1..12,
        ),
        heartbeats in proptest::bool::ANY,
    ) {
        let frames = sample_frames();
        let mut c = Config::default();
        c.heartbeat.enabled = heartbeats;
        let mut b = Endpoint::new(c, B, Instant::ZERO);
        let mut buf = vec![0u8; 1514];
        for (k, (which, muts, fix, cut)) in picks.into_iter().enumerate() {
            let mut f = frames[which % frames.len()].clone();
            for (at, v) in muts {
                let n = f.len();
                f[at % n] = v;
            }
            f.truncate(cut.max(1));
            if fix && f.len() >= ETH_LEN + LB_LEN {
                let plen = usize::from(u16::from_be_bytes([f[ETH_LEN + 24], f[ETH_LEN + 25]]));
                let end = (ETH_LEN + LB_LEN + plen).min(f.len());
                frame::fill_checksum(&mut f[..end]);
            }
            let now = at_us(k as u64);
            b.handle_frame(now, &f);
            b.handle_timeout(now);
            // Take only some messages now and then, so the arena holds leftovers.
            for _ in 0..(k % 3) {
                let _ = b.poll_message();
            }
            while b.poll_event().is_some() {}
            while b.poll_transmit(now, &mut buf).is_some() {}
        }
        let c = b.counters();
        proptest::prop_assert!(c.frames_received >= c.drops());
    }
}

/// The paper's pipeline: B's receiver and sender halves on two threads exchanging feedback through
/// a queue, A on a third; real clock, lossless channels standing in for the wire. The interleaving
/// varies from run to run; the outcome (all messages, in order, intact) may not.
#[test]
fn halves_run_on_their_own_threads() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{mpsc, Arc};
    use std::thread;

    use lanbus_wire::{Clock, MonotonicClock};

    use crate::{Feedback, ReceiveHalf, SendHalf};

    fn assert_send<T: Send>() {}
    assert_send::<SendHalf>();
    assert_send::<ReceiveHalf>();
    assert_send::<Endpoint>();

    const COUNT: u64 = 3000;
    let len = |i: u64| (i as usize * 53) % 2500;
    let clock = MonotonicClock::new();
    let give_up = std::time::Instant::now() + Duration::from_secs(60);
    let (b_tx, b_rx) = Endpoint::new(p2p(), B, clock.now()).split();
    let (wire_to_b, b_frames) = mpsc::channel::<Vec<u8>>();
    let (feedback_out, feedback_in) = mpsc::channel::<Feedback>();
    let (wire_to_a, a_frames) = mpsc::channel::<Vec<u8>>();
    let stop = Arc::new(AtomicBool::new(false));

    let receiver = thread::spawn(move || {
        let mut rx = b_rx;
        let mut got = 0u64;
        while got < COUNT && std::time::Instant::now() < give_up {
            if let Ok(f) = b_frames.recv_timeout(Duration::from_micros(200)) {
                rx.handle_frame(clock.now(), &f);
            }
            let now = clock.now();
            if rx.poll_timeout().is_some_and(|t| t <= now) {
                rx.handle_timeout(now);
            }
            while let Some(m) = rx.poll_message() {
                assert_eq!(m.data, &test_message(got, len(got))[..], "message {got}");
                got += 1;
            }
            while let Some(f) = rx.poll_feedback() {
                feedback_out.send(f).unwrap();
            }
        }
        // Flush the last coalesced ACK.
        let t = rx.poll_timeout();
        if let Some(t) = t {
            while clock.now() < t {
                thread::yield_now();
            }
            rx.handle_timeout(clock.now());
        }
        while let Some(f) = rx.poll_feedback() {
            feedback_out.send(f).unwrap();
        }
        got
    });
    let stop_tx = stop.clone();
    let sender = thread::spawn(move || {
        let mut tx = b_tx;
        let mut buf = vec![0u8; 1514];
        // Acquire pairs with the main thread's Release store: nothing else is shared, so this only
        // makes the stop visible.
        while !stop_tx.load(Ordering::Acquire) {
            let now = clock.now();
            while let Ok(f) = feedback_in.try_recv() {
                tx.handle_feedback(now, f);
            }
            if tx.poll_timeout().is_some_and(|t| t <= now) {
                tx.handle_timeout(now);
            }
            while let Some(n) = tx.poll_transmit(now, &mut buf) {
                let _ = wire_to_a.send(buf[..n].to_vec());
            }
            thread::sleep(Duration::from_micros(50));
        }
    });

    let mut a = Endpoint::new(p2p(), A, clock.now());
    let mut buf = vec![0u8; 1514];
    let mut sent = 0u64;
    while !(sent == COUNT && a.is_idle()) && std::time::Instant::now() < give_up {
        let now = clock.now();
        while sent < COUNT && a.send(now, B, 4, &test_message(sent, len(sent))).is_ok() {
            sent += 1;
        }
        while let Ok(f) = a_frames.try_recv() {
            a.handle_frame(now, &f);
        }
        if a.poll_timeout().is_some_and(|t| t <= now) {
            a.handle_timeout(now);
        }
        let mut idle = true;
        while let Some(n) = a.poll_transmit(now, &mut buf) {
            // The receiver thread may be gone after the last message: late resends go nowhere.
            let _ = wire_to_b.send(buf[..n].to_vec());
            idle = false;
        }
        if idle {
            thread::sleep(Duration::from_micros(50));
        }
    }
    stop.store(true, Ordering::Release);
    sender.join().unwrap();
    assert_eq!(receiver.join().unwrap(), COUNT);
    assert!(a.is_idle(), "A saw every ACK: {:?}", a.counters());
}

/// A frame that completes a segmented message and carries whole ones after it; the application
/// takes one message, a frame arrives, then it takes the rest: every message intact.
#[test]
fn partial_draining_across_frames_keeps_messages_intact() {
    let mut a = Endpoint::new(p2p(), A, Instant::ZERO);
    let mut b = Endpoint::new(p2p(), B, Instant::ZERO);
    let sizes = [2000usize, 30, 40, 50, 3000, 60, 70];
    for (i, &n) in sizes.iter().enumerate() {
        a.send(Instant::ZERO, B, 0, &test_message(i as u64, n)).unwrap();
    }
    let frames = drain(&mut a, Instant::ZERO);
    assert!(frames.len() >= 4);
    let mut got = vec![];
    for (k, f) in frames.iter().enumerate() {
        b.handle_frame(at_us(k as u64), f);
        // Take at most one message per frame, leaving the rest in the arena.
        if let Some(m) = b.poll_message() {
            got.push(m.data.to_vec());
        }
    }
    while let Some(m) = b.poll_message() {
        got.push(m.data.to_vec());
    }
    assert_eq!(got.len(), sizes.len());
    for (i, &n) in sizes.iter().enumerate() {
        assert!(got[i] == test_message(i as u64, n), "message {i}");
    }
}

/// Hands `frame` to `e` and answers its one message `expect` with `reply`: from inside
/// `handle_frame_delivering` when `lend` (as the run-to-completion runtime's handlers do: the
/// reply is queued while the request is still lent from the frame), else by polling it first.
fn answer(e: &mut Endpoint, t: Instant, frame: &[u8], lend: bool, expect: &str, to: MacAddr, reply: &str) {
    if lend {
        let mut lent = 0;
        e.handle_frame_delivering(t, frame, &mut |m, tx| {
            assert_eq!(m.data, expect.as_bytes());
            tx.send(t, to, 3, reply.as_bytes()).unwrap();
            lent += 1;
        });
        assert_eq!(lent, 1, "{expect}: lent, not queued");
        assert!(e.poll_message().is_none());
    } else {
        e.handle_frame(t, frame);
        assert_eq!(e.poll_message().unwrap().data, expect.as_bytes());
        e.send(t, to, 3, reply.as_bytes()).unwrap();
    }
}

/// Request/response: each reply carries the ACK of its request and each next request the ACK of
/// the reply, so a round trip is two frames, the coalesced ACKs are never sent, and no carried
/// ACK counts as a duplicate; the same whether replies are sent after polling or while the
/// request is lent from its frame.
#[test]
fn replies_carry_the_ack_of_their_request() {
    for lend in [false, true] {
        let (mut a, mut b) = (Endpoint::new(p2p(), A, at_us(0)), Endpoint::new(p2p(), B, at_us(0)));
        let mut t = 0;
        a.send(at_us(t), B, 3, b"ping 0").unwrap();
        for round in 0..50u32 {
            let to_b = drain(&mut a, at_us(t));
            assert_eq!(to_b.len(), 1, "round {round}: one frame a -> b");
            let h = header(&to_b[0]);
            assert_eq!(h.kind, Kind::Data);
            assert_eq!(h.flags & frame::FLAG_ACK != 0, round > 0, "round {round}: carries the reply's ACK");
            if round > 0 {
                assert_eq!((h.ack, h.flags & FLAG_ECHO != 0), (round, true));
            }
            t += 2;
            answer(&mut b, at_us(t), &to_b[0], lend, &format!("ping {round}"), A, &format!("pong {round}"));
            let to_a = drain(&mut b, at_us(t));
            assert_eq!(to_a.len(), 1, "round {round}: one frame b -> a");
            let h = header(&to_a[0]);
            assert_eq!((h.kind, h.ack, h.flags & frame::FLAG_ACK != 0), (Kind::Data, round + 1, true));
            t += 2;
            // a's next request is queued at once (lent) or after the coalescing timer (polled).
            let next = format!("ping {}", round + 1);
            if lend {
                answer(&mut a, at_us(t), &to_a[0], lend, &format!("pong {round}"), B, &next);
                assert_eq!(a.send_half().queued_frames(B, 3), 1, "round {round}: only the next request");
            } else {
                a.handle_frame(at_us(t), &to_a[0]);
                assert_eq!(a.poll_message().unwrap().data, format!("pong {round}").as_bytes());
                assert_eq!(
                    a.send_half().queued_frames(B, 3),
                    0,
                    "round {round}: the request is acknowledged"
                );
            }
            // b's coalescing timer fires: the ACK it owed went out in the reply already.
            t += 10;
            b.handle_timeout(at_us(t));
            assert!(drain(&mut b, at_us(t)).is_empty(), "round {round}: no separate ACK from b");
            if !lend {
                a.send(at_us(t), B, 3, next.as_bytes()).unwrap();
            }
        }
        let (ca, cb) = (a.counters(), b.counters());
        assert_eq!((ca.ack_frames_sent, cb.ack_frames_sent), (0, 0));
        // a's first request had nothing to carry; its 51st (queued, not sent) would carry the last.
        assert_eq!((ca.acks_carried, cb.acks_carried), (49, 50));
        assert_eq!((ca.dup_acks_received, cb.dup_acks_received, ca.retransmitted_frames), (0, 0, 0));
        assert_eq!(ca.rtt_samples, 50, "every carried ACK gives an RTT sample");
        assert_eq!((ca.messages_delivered, cb.messages_delivered), (50, 50));
    }
}

/// The ACK a frame carries frees the sender's queue before the frame's messages are lent, as it
/// does before `poll_message`: a reply sent from inside the callback finds the room.
#[test]
fn a_lent_request_frees_the_queue_its_ack_covers_before_the_reply() {
    let mut c = p2p();
    c.send_queue_frames = 4;
    // a owes the ACK (not due yet), so it rides on a's request rather than in an ACK frame.
    c.ack_every_frames = 64;
    c.ack_delay = us(1000);
    let (mut a, mut b) = (Endpoint::new(c.clone(), A, at_us(0)), Endpoint::new(c, B, at_us(0)));
    // b's queue is full of four unacknowledged 1400-byte messages, one frame each.
    for i in 0..4 {
        b.send(at_us(0), A, 3, &test_message(i, 1400)).unwrap();
    }
    assert_eq!(b.send(at_us(0), A, 3, &test_message(4, 1400)), Err(SendError::QueueFull));
    for f in drain(&mut b, at_us(0)) {
        a.handle_frame(at_us(5), &f);
    }
    while a.poll_message().is_some() {}
    // a's request carries the ACK of all four.
    a.send(at_us(5), B, 3, b"request").unwrap();
    let to_b = drain(&mut a, at_us(5));
    assert_eq!(to_b.len(), 1);
    assert_eq!((header(&to_b[0]).kind, header(&to_b[0]).ack), (Kind::Data, 4));
    let mut replied = None;
    b.handle_frame_delivering(at_us(10), &to_b[0], &mut |m, tx| {
        assert_eq!(m.data, b"request");
        replied = Some(tx.send(at_us(10), A, 3, &test_message(4, 1400)));
    });
    assert_eq!(replied, Some(Ok(())), "the reply is queued: the request's ACK freed the queue");
}

/// Messages lent in place and messages queued (fragments, frames that arrive while older
/// messages wait) come out as one stream, in order, under loss and reordering.
#[test]
fn messages_lent_in_place_keep_their_order_with_queued_ones() {
    let f = Faults { loss: 0.05, reorder: 0.05, duplicate: 0.02, ..Faults::default() };
    let mut p = Pair::in_place(p2p(), f, 17);
    assert!(p.transfer(700, 3, at_us(10_000_000), mixed_len));
    for _ in 0..2 {
        p.b.drain_messages(&mut p.at_b);
    }
    assert_stream(&p.at_b, A, 3, 700, mixed_len);
    let lent = p.b.lent_in_place;
    assert!((5..700).contains(&lent), "both paths taken: {lent} of 700 lent in place");
    assert_eq!(p.b.counters().messages_delivered, 700);
}

/// An owed ACK that went out in an ACK frame is not carried again later (its echo would be
/// stale), and a lone message is still acknowledged after the ACK delay.
#[test]
fn an_ack_frame_settles_the_owed_ack() {
    let (mut a, mut b) = (Endpoint::new(p2p(), A, at_us(0)), Endpoint::new(p2p(), B, at_us(0)));
    // b has sent on the channel before, so it has a send channel that could carry ACKs.
    b.send(at_us(0), A, 3, b"hello").unwrap();
    for f in drain(&mut b, at_us(0)) {
        a.handle_frame(at_us(1), &f);
    }
    let _ = a.poll_message();
    a.send(at_us(1), B, 3, b"request").unwrap();
    for f in drain(&mut a, at_us(1)) {
        b.handle_frame(at_us(2), &f);
    }
    let _ = b.poll_message();
    b.handle_timeout(at_us(20));
    let acks = drain(&mut b, at_us(20));
    assert_eq!(acks.len(), 1);
    assert_eq!(header(&acks[0]).kind, Kind::Ack);
    b.send(at_us(30), A, 3, b"late reply").unwrap();
    let data = drain(&mut b, at_us(30));
    assert_eq!(data.len(), 1);
    assert_eq!(header(&data[0]).flags & frame::FLAG_ACK, 0, "nothing owed any more");
}

/// Everything `n` wants to send now (any harness node).
fn drain_node<N: Node>(n: &mut N, now: Instant) -> Vec<Vec<u8>> {
    let mut buf = vec![0u8; n.frame_capacity()];
    let mut out = vec![];
    while let Some(len) = n.poll_transmit(now, &mut buf) {
        out.push(buf[..len].to_vec());
    }
    out
}

/// Requests one way, replies the other, on one channel; a's request 6 of a burst of 16 is lost
/// while b has replies queued on the channel. b answers each of the 10 later requests with a
/// duplicate ACK frame of its own (none is carried on a reply, none merged into another), so a
/// fast-retransmits at once instead of waiting for its RTO. Returns a's counters.
fn lost_request_amid_replies<N: Node>(mut a: N, mut b: N) -> crate::Counters {
    // Warm-up: b's reply carries the ACK of a's first request, so b has ACKed on the channel.
    a.send(at_us(0), B, 3, b"warm-up").unwrap();
    for f in drain_node(&mut a, at_us(0)) {
        b.handle_frame(at_us(5), &f);
    }
    b.send(at_us(5), A, 3, b"warm-up reply").unwrap();
    for f in drain_node(&mut b, at_us(5)) {
        a.handle_frame(at_us(10), &f);
    }
    let mut warm_up = vec![];
    a.drain_messages(&mut warm_up);
    b.drain_messages(&mut warm_up);
    assert_eq!(warm_up.len(), 2);
    let mut t = at_us(20);
    for i in 0..16 {
        a.send(t, B, 3, &test_message(i, 1000)).unwrap();
        b.send(t, A, 3, &test_message(100 + i, 1000)).unwrap();
    }
    let burst = drain_node(&mut a, t);
    assert_eq!(burst.len(), 16);
    t += us(5);
    if b.poll_timeout().is_some_and(|d| d <= t) {
        b.handle_timeout(t);
    }
    // b takes the burst whole (as a driver receiving a batch does), then transmits.
    for f in burst.iter().filter(|f| header(f).sequence != 6) {
        b.handle_frame(t, f);
    }
    let mut to_a = drain_node(&mut b, t);
    let dup_ack_frames = to_a.iter().filter(|f| header(f).kind == Kind::Ack && header(f).ack == 6).count();
    assert!(dup_ack_frames >= 10, "b sent {dup_ack_frames} ACK frames for 6, not one per later request");
    // Lockstep on a 5 us wire until everything is delivered and acknowledged.
    let (mut at_a, mut at_b) = (vec![], vec![]);
    let mut to_b: Vec<Vec<u8>> = vec![];
    for _ in 0..10_000 {
        if to_a.is_empty() && to_b.is_empty() {
            if a.is_idle() && b.is_idle() {
                break;
            }
            let next = [a.poll_timeout(), b.poll_timeout()].into_iter().flatten().min();
            t = next.expect("a timer while not idle").max(t);
        } else {
            t += us(5);
        }
        for f in to_b.drain(..) {
            b.handle_frame(t, &f);
        }
        for f in to_a.drain(..) {
            a.handle_frame(t, &f);
        }
        a.drain_messages(&mut at_a);
        b.drain_messages(&mut at_b);
        for n in [&mut a, &mut b] {
            if n.poll_timeout().is_some_and(|d| d <= t) {
                n.handle_timeout(t);
            }
        }
        to_b = drain_node(&mut a, t);
        to_a = drain_node(&mut b, t);
    }
    assert!(a.is_idle() && b.is_idle(), "not done: a {:?} b {:?}", a.counters(), b.counters());
    assert_stream(&at_b, A, 3, 16, |_| 1000);
    assert_eq!(at_a.iter().filter(|m| m.1 == 3).count(), 16);
    a.counters()
}

#[test]
fn duplicate_acks_are_never_carried_so_fast_retransmit_fires() {
    let endpoints =
        lost_request_amid_replies(Endpoint::new(p2p(), A, at_us(0)), Endpoint::new(p2p(), B, at_us(0)));
    let split = lost_request_amid_replies(
        SplitNode::new(Endpoint::new(p2p(), A, at_us(0))),
        SplitNode::new(Endpoint::new(p2p(), B, at_us(0))),
    );
    for c in [endpoints, split] {
        assert!(c.fast_retransmits > 0, "recovered by fast retransmit: {c:?}");
        assert_eq!(c.timeouts, 0, "no RTO needed: {c:?}");
    }
}

/// An ACK that is due at once (here for b's 4th request in a row) may ride on a reply only if
/// that reply goes out in the same `poll_transmit`. b's only reply is being resent after its RTO
/// when the ACK falls due, another channel's ACK is due too, and a's late ACK of the reply arrives
/// after b's first `poll_transmit`, leaving b nothing to send on the channel: the due ACK must
/// still reach a (before the fix it sat in the channel's owed slot until a's RTO).
#[test]
fn a_due_ack_is_not_stranded_when_its_carrier_does_not_go() {
    let (mut a, mut b) = (Endpoint::new(p2p(), A, at_us(0)), Endpoint::new(p2p(), B, at_us(0)));
    a.send(at_us(0), B, 3, b"request").unwrap();
    for f in drain(&mut a, at_us(0)) {
        b.handle_frame(at_us(5), &f);
    }
    let _ = b.poll_message();
    b.send(at_us(5), A, 3, b"reply").unwrap();
    let reply = drain(&mut b, at_us(5));
    assert_eq!(reply.len(), 1);
    a.handle_frame(at_us(10), &reply[0]);
    let _ = a.poll_message();
    // a's coalesced ACK of the reply: held back on the wire for a while.
    a.handle_timeout(at_us(20));
    let late_ack = drain(&mut a, at_us(20));
    assert_eq!(late_ack.len(), 1);
    assert_eq!((header(&late_ack[0]).kind, header(&late_ack[0]).ack), (Kind::Ack, 1));
    // b's coalescing timer for the request: the reply carried that ACK already.
    b.handle_timeout(at_us(20));
    assert!(drain(&mut b, at_us(20)).is_empty());
    // The reply's RTO fires at b: it goes back to resend the reply.
    let rto = b.poll_timeout().expect("RTO armed");
    b.handle_timeout(rto);
    // a sends a request on channel 4, then four on channel 3 (one frame each).
    a.send(rto, B, 4, b"other").unwrap();
    for f in drain(&mut a, rto) {
        b.handle_frame(rto, &f);
    }
    for i in 0..4 {
        a.send(rto, B, 3, &test_message(i, 1000)).unwrap();
    }
    let requests = drain(&mut a, rto);
    assert_eq!(requests.len(), 4);
    // The fourth makes b's ACK due at once; channel 4's ACK falls due too.
    let t = rto + us(5);
    for f in &requests {
        b.handle_frame(t, f);
    }
    b.handle_timeout(t);
    let mut buf = vec![0u8; b.config().frame_capacity()];
    let n = b.poll_transmit(t, &mut buf).expect("an ACK is due");
    let mut to_a = vec![buf[..n].to_vec()];
    // a's ACK of the reply arrives now: b has nothing left to send on channel 3.
    b.handle_frame(t, &late_ack[0]);
    to_a.extend(drain(&mut b, t));
    for f in &to_a {
        a.handle_frame(t + us(5), f);
    }
    assert_eq!(a.send_half().queued_frames(B, 3), 0, "the four requests are acknowledged: {to_a:?}");
}

#[test]
fn may_transmit_says_when_a_frame_could_go() {
    let mut a = Endpoint::new(p2p(), A, Instant::ZERO);
    let mut b = Endpoint::new(p2p(), B, Instant::ZERO);
    assert!(!a.may_transmit(at_us(0)), "nothing queued");
    a.send(at_us(0), B, 0, b"request").unwrap();
    assert!(a.may_transmit(at_us(0)), "a message queued");
    let frames = drain(&mut a, at_us(0));
    assert!(!a.may_transmit(at_us(0)), "everything sent");
    for f in &frames {
        b.handle_frame(at_us(1), f);
    }
    assert_eq!(b.poll_message().unwrap().data, b"request");
    // The ACK waits for its delay, then is due.
    assert!(!b.may_transmit(at_us(1)));
    let mut t = 1;
    while !b.may_transmit(at_us(t)) {
        t += 1;
        b.handle_timeout(at_us(t));
        assert!(t < 1_000_000, "no ACK came due");
    }
    assert!(b.poll_transmit_ref(at_us(t)).is_some(), "the ACK");
    b.frames_left(at_us(t));
    assert!(!b.may_transmit(at_us(t)));
    // Whenever it says no, nothing goes: over a run with a lost frame, timers and all.
    a.send(at_us(t), B, 0, b"lost").unwrap();
    let _ = drain(&mut a, at_us(t));
    for step in 0..20_000u64 {
        let now = at_us(t + step * 10);
        a.handle_timeout(now);
        let may = a.may_transmit(now);
        let sent = a.poll_transmit_ref(now).is_some();
        assert!(may || !sent, "a frame went at {now:?} though none could");
        a.frames_left(now);
        if sent {
            return;
        }
    }
    panic!("the lost frame never went again");
}

/// Messages whose bodies stay in lent memory arrive whole and in order among copied ones, over
/// loss, reordering and corruption; the transport holds the memory until the last frame that
/// reads it is acknowledged, and then lets go of it.
#[test]
fn lent_messages_arrive_whole_and_are_let_go_once_acknowledged() {
    use std::sync::Arc;

    use crate::{Lend, LentSlice};

    for (seed, config) in [(1, p2p()), (2, gbn()), (3, p2p())] {
        let faults = Faults { loss: 0.05, reorder: 0.05, corrupt: 0.01, ..Faults::default() };
        let mut p = Pair::endpoints(config.clone(), faults, seed);
        let owner: Arc<dyn Lend> = Arc::new(test_message(seed, 200_000));
        let mut expected = Vec::new();
        let mut queued = 0;
        let mut at = 0;
        // Lent messages of every size from empty to the largest, each with a head of its own,
        // and a small copied message after each (nothing may be packed behind lent bytes).
        let sizes = [0, 1, 900, config.max_payload(), 9000, 40_000, 65_000];
        for (i, &n) in sizes.iter().cycle().take(30).enumerate() {
            let n = n.min(owner.bytes().len() - at);
            let head = [i as u8; 12];
            let body = LentSlice::new(Arc::clone(&owner), at..at + n);
            let small = test_message(i as u64, 30);
            loop {
                match p.a.send_lent(p.now, B, 0, &head, body.clone()) {
                    Ok(()) => break,
                    Err(SendError::QueueFull) => assert!(p.step(), "stalled with a full queue"),
                    Err(e) => panic!("send_lent: {e}"),
                }
            }
            expected.push([&head[..], &owner.bytes()[at..at + n]].concat());
            while p.a.send(p.now, B, 0, &small) == Err(SendError::QueueFull) {
                assert!(p.step(), "stalled with a full queue");
            }
            expected.push(small);
            at = (at + n) % 100_000;
            queued += 2;
        }
        assert!(Arc::strong_count(&owner) > 1, "queued frames hold the memory");
        assert!(p.run_until_idle(at_us(60_000_000)), "seed {seed}: not all acknowledged");
        let got: Vec<Vec<u8>> = p.at_b.iter().map(|(_, _, m)| m.clone()).collect();
        assert_eq!(got.len(), queued);
        assert!(got == expected, "seed {seed}: messages differ");
        assert!(p.wire.lost > 0 && p.wire.corrupted > 0, "the faults were exercised");
        assert_eq!(Arc::strong_count(&owner), 1, "every frame let go of the lent memory");
    }
}

/// A frame with lent bytes is handed out in two pieces that make the frame a copy would give.
#[test]
fn a_lent_frame_in_place_is_the_copied_frame() {
    use std::sync::Arc;

    use crate::{Lend, LentSlice};

    let owner: Arc<dyn Lend> = Arc::new(test_message(7, 5000));
    let mut copied = Endpoint::new(p2p(), A, Instant::ZERO);
    let mut lent = Endpoint::new(p2p(), A, Instant::ZERO);
    copied.send_parts(Instant::ZERO, B, 0, &[b"head", owner.bytes()]).unwrap();
    lent.send_lent(Instant::ZERO, B, 0, b"head", LentSlice::new(Arc::clone(&owner), 0..5000)).unwrap();
    let want = drain(&mut copied, at_us(1));
    let mut got = Vec::new();
    while let Some(at) = lent.poll_transmit_ref(at_us(1)) {
        let [head, body] = lent.frame(at);
        assert!(!body.is_empty(), "the body stays lent");
        got.push([head, body].concat());
    }
    assert_eq!(got, want);
    assert!(got.len() > 1);
    assert_eq!(Arc::strong_count(&owner), 1 + got.len(), "each unacknowledged frame holds the memory");
    // Giving up on the peer drops its frames, and with them the references.
    lent.abandon_peer(B);
    assert_eq!(Arc::strong_count(&owner), 1);
    assert!(lent.poll_transmit_ref(at_us(2)).is_none(), "nothing is left to send to it");
}

/// The counters say which bytes were copied: into frames (all but the lent ones) and out of
/// them (a message lent from its frame costs nothing; one in the arena once; one put together
/// from several frames twice).
#[test]
fn the_counters_tell_copied_bytes_from_lent_ones() {
    use std::sync::Arc;

    use crate::{Lend, LentSlice};

    let owner: Arc<dyn Lend> = Arc::new(test_message(3, 5000));
    let mut a = Endpoint::new(p2p(), A, Instant::ZERO);
    let mut b = Endpoint::new(p2p(), B, Instant::ZERO);
    a.send_lent(Instant::ZERO, B, 0, b"head", LentSlice::new(Arc::clone(&owner), 0..5000)).unwrap();
    a.send(Instant::ZERO, B, 1, &[7; 100]).unwrap();
    let c = a.counters();
    assert_eq!((c.bytes_sent, c.bytes_lent), (5104, 5000));

    // The large message spans frames: copied as each piece arrives, then once more whole.
    let mut lent = 0;
    for f in drain(&mut a, at_us(1)) {
        b.handle_frame_delivering(at_us(2), &f, &mut |m, _| lent += m.data.len());
    }
    let mut arena = 0;
    while let Some(m) = b.poll_message() {
        arena += m.data.len();
    }
    assert_eq!((lent, arena), (100, 5004), "the small message lent, the large one put together");
    assert_eq!(b.counters().bytes_delivered, 5104);
    assert_eq!(b.counters().bytes_copied_on_delivery, 2 * 5004);

    // Without lending, a frame of whole messages is copied once, records' headers and all.
    a.send(at_us(3), B, 1, &[8; 100]).unwrap();
    for f in drain(&mut a, at_us(3)) {
        b.handle_frame(at_us(4), &f);
    }
    assert_eq!(b.poll_message().map(|m| m.data.len()), Some(100));
    assert_eq!(b.counters().bytes_copied_on_delivery, 2 * 5004 + 100 + RECORD_HEADER_LEN as u64);
}

proptest::proptest! {
    /// A gathered message read in pieces of any size is its four parts put together.
    #[test]
    fn a_gathered_message_reads_as_its_parts_in_any_pieces(
        head in proptest::collection::vec(proptest::num::u8::ANY, 0..40),
        gap in 0usize..8,
        body in proptest::collection::vec(proptest::num::u8::ANY, 0..300),
        tail in 0usize..8,
        piece in 1usize..64,
    ) {
        use crate::MessageSource;
        let mut g = crate::Gathered { head: &head, gap, body: &body, tail };
        let want = [head.as_slice(), &vec![0; gap], &body, &vec![0; tail]].concat();
        proptest::prop_assert_eq!(g.len(), want.len());
        let mut got = vec![0xEE];
        let mut at = 0;
        while at < want.len() {
            let n = piece.min(want.len() - at);
            g.append_to(&mut got, at, n);
            at += n;
        }
        proptest::prop_assert_eq!(&got[1..], &want[..]);
    }
}
