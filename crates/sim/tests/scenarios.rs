//! Short versions of the scenarios with the real transport, asserting what the paper claims.

use core::time::Duration;

use lanbus_sim::scenario::{
    latency_point, multi_session_point, transfer, LatencyParams, MultiParams, TransferParams,
};

#[test]
fn transfer_with_faults_delivers_everything_once_in_order() {
    let params = TransferParams::new(20_000, 0.05, 0.02, 0.01, 0.001, 7);
    let report = transfer(&params, &mut |_| {});
    println!("{report:?}");
    assert!(report.completed);
    assert_eq!(report.summary(), "delivered=20000 lost=0 duplicated=0 reordered=0 corrupted=0");
    assert!(report.wire[0].lost > 0 && report.wire[0].corrupted > 0 && report.wire[0].duplicated > 0);
    assert!(report.counters[0].retransmitted_frames > 0);
    assert_eq!(transfer(&params, &mut |_| {}), report, "same seed, same run");
}

/// The same over a keyed fabric: the member handshake first, then every frame sealed; corrupted
/// frames fail their tags and are refused by the authentication layer, and the run repeats exactly.
#[test]
fn a_keyed_transfer_with_faults_delivers_everything_and_repeats() {
    let mut params = TransferParams::new(20_000, 0.05, 0.02, 0.01, 0.002, 7);
    params.keyed = true;
    let report = transfer(&params, &mut |_| {});
    assert!(report.completed, "{report:?}");
    assert_eq!(report.summary(), "delivered=20000 lost=0 duplicated=0 reordered=0 corrupted=0");
    assert!(report.wire[0].corrupted > 0 && report.refused_by_key > 0, "{report:?}");
    assert_eq!(report.counters[1].drop_bad_checksum, 0, "nothing corrupted reached the transport");
    assert_eq!(transfer(&params, &mut |_| {}), report, "same seed, same run");
}

#[test]
fn fig2_latency_flat_up_to_1e5_and_growing_from_1e3() {
    let run = |loss| latency_point(&LatencyParams::paper(loss, 150_000, 1), &mut |_| {});
    let base = run(0.0);
    let low = run(1e-5);
    let high = run(1e-3);
    for p in [&base, &low, &high] {
        println!("{p:?}");
        assert_eq!(p.delivered, 150_000);
        assert_eq!(p.errors, 0);
    }
    assert_eq!(base.retransmitted_frames, 0);
    // The loss-free latency is the path: two hops of a 178-byte frame plus propagation.
    assert!(base.mean_us > 2.0 && base.mean_us < base.base_rtt_us, "{base:?}");
    assert!(low.lost_frames > 0, "the run must see a loss at 1e-5: {low:?}");
    assert!(low.mean_us <= base.mean_us * 1.1 && low.p99_us <= base.p99_us * 1.1, "{low:?} vs {base:?}");
    assert!(high.mean_us > base.mean_us * 1.1, "{high:?}");
    assert!(high.p99_us > base.p99_us * 2.0, "{high:?}");
    assert!(high.retransmitted_frames > low.retransmitted_frames);
}

/// Fig. 2 with selective repeat: a loss costs the frame lost, not the window behind it, so
/// goodput holds at 1e-2 and the tail of latency grows far less than Go-Back-N's at 1e-3.
#[test]
fn fig2_selective_repeat_keeps_goodput_at_1e2_and_the_tail_short_at_1e3() {
    let run = |loss, selective| {
        let mut p = LatencyParams::paper(loss, 150_000, 1);
        p.transport.selective_repeat = selective;
        let r = latency_point(&p, &mut |_| {});
        println!("{r:?}");
        assert_eq!((r.delivered, r.errors), (150_000, 0));
        r
    };
    let base = run(0.0, true);
    let sr_1e3 = run(1e-3, true);
    let sr_1e2 = run(1e-2, true);
    let gbn_1e3 = run(1e-3, false);
    let gbn_1e2 = run(1e-2, false);
    assert!(sr_1e2.goodput_gbps >= 0.9 * base.goodput_gbps, "{sr_1e2:?} vs {base:?}");
    assert!(sr_1e3.p99_us <= 2.5 * base.p99_us, "{sr_1e3:?} vs {base:?}");
    assert!(gbn_1e3.p99_us > sr_1e3.p99_us, "{gbn_1e3:?}");
    assert!(gbn_1e2.retransmitted_frames > 10 * sr_1e2.retransmitted_frames, "{gbn_1e2:?}");
}

#[test]
fn fig3_without_rate_control_the_switch_drops_and_with_it_the_slowest_bursts_do_better() {
    let duration = Duration::from_millis(150);
    // In the paper's frames a session keeps at most its window of 128 TLPs (24 KB) in flight, so
    // the 128 KiB buffer overflows only when six or more bursts overlap (here from 8 sessions on).
    for sessions in [8u16, 9] {
        let off = multi_session_point(&MultiParams::paper(sessions, false, duration, 1), &mut |_| {});
        let on = multi_session_point(&MultiParams::paper(sessions, true, duration, 1), &mut |_| {});
        println!("{off:?}\n{on:?}");
        assert!(off.utilization > 0.25);
        assert!(off.bursts > 10 && off.incomplete == 0 && on.incomplete == 0);
        assert!(off.mean_ratio < 0.9, "without rate control beyond 20%: {off:?}");
        assert!(on.switch_drops * 10 < off.switch_drops, "rate control drops less: {on:?} vs {off:?}");
        // The slowest tenth of the bursts gets more of the link; the mean stays (overlapping
        // bursts share the link either way; without rate control the drops decide who waits).
        assert!(on.p10_ratio > off.p10_ratio, "the slowest bursts do better: {on:?} vs {off:?}");
        assert!(on.mean_ratio > 0.95 * off.mean_ratio, "{on:?} vs {off:?}");
    }
    // Alone on the switch, a burst runs at the access rate: only waiting for the same session's
    // previous burst keeps the ratio below 1, as on the ideal fabric.
    let alone = multi_session_point(&MultiParams::paper(1, false, duration, 1), &mut |_| {});
    assert!(alone.mean_ratio > 0.99 * alone.ideal_mean_ratio, "{alone:?}");
    assert!(alone.mean_ratio <= 1.0, "{alone:?}");
    assert_eq!(alone.switch_drops, 0);
}
