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

#[test]
#[ignore]
fn explore_latency() {
    for loss in [0.0, 1e-5, 1e-4, 1e-3, 1e-2] {
        let t = std::time::Instant::now();
        let p = latency_point(&LatencyParams::paper(loss, 200_000, 1), &mut |_| {});
        println!("{p:?} wall {:?}", t.elapsed());
    }
}

#[test]
#[ignore]
fn explore_multi() {
    for rc in [false, true] {
        for s in [1u16, 3, 4, 7, 10, 13] {
            let t = std::time::Instant::now();
            let p =
                multi_session_point(&MultiParams::paper(s, rc, Duration::from_millis(200), 1), &mut |_| {});
            println!("{p:?} wall {:?}", t.elapsed());
        }
    }
}

#[test]
#[ignore]
fn explore_multi_one() {
    let t = std::time::Instant::now();
    let mut last = 0.0;
    let p = multi_session_point(
        &MultiParams::paper(
            std::env::var("S").map_or(3, |s| s.parse().unwrap()),
            std::env::var("RC").is_ok(),
            Duration::from_millis(std::env::var("D").map_or(30, |s| s.parse().unwrap())),
            1,
        ),
        &mut |f| {
            if f - last > 0.05 {
                last = f;
                println!("{f} {:?}", t.elapsed());
            }
        },
    );
    println!("{p:?} wall {:?}", t.elapsed());
}
