//! A queue pair reserved for one client with many requests in flight (`NvmeDriver::stream`):
//! requests submitted together and reaped in one pass move the right bytes, the plain calls
//! keep off a reserved pair, a request that does not fit is refused whole, a timed-out request
//! quarantines its buffers, and the pair goes back when the stream ends.

mod common;
use common::*;

use lanbus_nvme::local::{LocalNvme, ProcessMode};
use lanbus_nvme::{CompletionMode, ControllerConfig, DriverConfig, DriverError, Finished};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Reaps until `want` requests finished (or a second passes), waiting on the queue between.
fn reap_all<'d>(s: &mut lanbus_nvme::IoStream<'d>, want: usize) -> Vec<Finished<'d>> {
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while out.len() < want && Instant::now() < deadline {
        s.reap(&mut out).unwrap();
        s.wait(Duration::from_millis(5));
    }
    out
}

fn lent(f: &Finished<'_>) -> Vec<u8> {
    let mut v = Vec::new();
    f.lend(&mut |parts| parts.iter().for_each(|p| v.extend_from_slice(p))).unwrap();
    v
}

#[test]
fn requests_in_flight_together_move_the_right_bytes() {
    // A small MDTS (8 KiB) so that larger requests are several commands.
    let cfg = ControllerConfig { mdts: 1, ..ControllerConfig::default() };
    for completion in [CompletionMode::Interrupt, CompletionMode::Poll] {
        let l = LocalNvme::new(controller(512, 8 * MIB, cfg.clone()), 4096, ProcessMode::Thread);
        let d = l.driver(DriverConfig { io_queues: 3, completion, ..DriverConfig::default() }).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut model = vec![0u8; 8 << 20];
        let mut s = d.stream().expect("a pair to reserve");
        for round in 0..20u64 {
            // A batch of disjoint writes, started with one doorbell.
            let mut written = HashMap::new();
            for i in 0..16u64 {
                let len = 512 * rng.random_range(1..=64usize);
                let offset = (i * (64 << 10)) + 512 * rng.random_range(0..64u64);
                let data = pattern(round * 100 + i, len);
                s.submit_write(i, offset, &data, false).unwrap();
                written.insert(i, (offset, data));
            }
            s.ring().unwrap();
            let done = reap_all(&mut s, 16);
            assert_eq!(done.len(), 16, "round {round}: every write finished");
            for f in &done {
                assert!(f.result.is_ok(), "{:?}", f.result);
                let (offset, data) = &written[&f.tag];
                model[*offset as usize..*offset as usize + data.len()].copy_from_slice(data);
            }
            drop(done);
            // Reads of the same ranges and of ranges around them, all in flight at once.
            let mut asked = HashMap::new();
            for i in 0..16u64 {
                let len = 512 * rng.random_range(1..=128usize);
                let offset = 512 * rng.random_range(0..(16_000 - len as u64 / 512));
                s.submit_read(100 + i, offset, len).unwrap();
                asked.insert(100 + i, (offset as usize, len));
            }
            assert_eq!(s.in_flight(), 16);
            assert_eq!(s.in_flight_bytes(), asked.values().map(|&(_, len)| len).sum::<usize>());
            s.ring().unwrap();
            for f in reap_all(&mut s, 16) {
                assert!(f.result.is_ok(), "{:?}", f.result);
                let (offset, len) = asked[&f.tag];
                assert!(lent(&f) == model[offset..offset + len], "round {round}: read {offset}+{len}");
            }
            assert_eq!((s.in_flight(), s.in_flight_bytes()), (0, 0));
        }
        drop(s);
        // The stage counters see the stream's requests (the driver's time, the writes' copies).
        assert!(d.stats().io_ns.load(Ordering::Relaxed) > 0);
        assert!(d.stats().copy_ns.load(Ordering::Relaxed) > 0);
        drop(d);
        assert_eq!(l.region().pages_in_use(), 0, "every DMA buffer freed");
    }
}

#[test]
fn reserved_pairs_are_left_to_their_stream_and_given_back() {
    let l = local(512, 4 * MIB, ProcessMode::Thread);
    let d = l.driver(DriverConfig { io_queues: 3, ..DriverConfig::default() }).unwrap();
    // The first pair stays with the plain calls: two of three can be reserved.
    let a = d.stream().unwrap();
    let mut b = d.stream().unwrap();
    assert!(d.stream().is_none(), "the first pair is never reserved");
    // Plain calls from threads meanwhile, while `b` has requests in flight: none of them may
    // take `b`'s completions (it would count them as stray and `b` would wait forever).
    let data = pattern(3, 64 << 10);
    for i in 0..8u64 {
        b.submit_write(i, i * (64 << 10), &data, false).unwrap();
    }
    b.ring().unwrap();
    std::thread::scope(|sc| {
        for t in 0..4u64 {
            let d = &d;
            sc.spawn(move || {
                let mine = pattern(10 + t, 4096);
                for k in 0..50u64 {
                    let at = (2 * MIB) + (t * 64 + k % 64) * 4096;
                    d.write_at(at, &mine, false).unwrap();
                    let mut back = vec![0u8; 4096];
                    d.read_at(at, &mut back).unwrap();
                    assert!(back == mine);
                }
            });
        }
    });
    let done = reap_all(&mut b, 8);
    assert_eq!(done.len(), 8);
    assert!(done.iter().all(|f| f.result.is_ok()));
    drop(done);
    assert_eq!(d.stats().stray_completions.load(Ordering::Relaxed), 0);
    drop(a);
    drop(b);
    // Both pairs are free again.
    let _a = d.stream().unwrap();
    let _b = d.stream().unwrap();
    assert!(d.stream().is_none());
}

#[test]
fn requests_that_do_not_fit_are_refused_whole() {
    let l = local(512, 4 * MIB, ProcessMode::Thread);
    let d = l
        .driver(DriverConfig {
            io_queues: 2,
            queue_entries: 8,
            max_inflight_bytes: 1 << 20,
            ..DriverConfig::default()
        })
        .unwrap();
    let mut s = d.stream().unwrap();
    let bad = |r: Result<(), DriverError>| matches!(r, Err(DriverError::InvalidArgument(_)));
    assert!(bad(s.submit_read(1, 100, 512)), "misaligned");
    assert!(bad(s.submit_read(1, 0, 0)), "empty");
    assert!(bad(s.submit_read(1, 4 * MIB - 512, 1024)), "past the end");
    assert!(bad(s.submit_read(1, 0, 2 << 20)), "larger than a request may be");
    // Seven entries fit a queue of eight; the eighth request waits for room.
    for t in 0..7 {
        assert!(s.room_for(4096));
        s.submit_read(t, t * 4096, 4096).unwrap();
    }
    assert!(!s.room_for(4096));
    assert!(bad(s.submit_read(7, 0, 4096)), "no room");
    assert!(bad(s.submit_read(3, 0, 4096)), "a tag in flight");
    assert_eq!(s.in_flight(), 7, "a refused request leaves nothing behind");
    s.ring().unwrap();
    assert_eq!(reap_all(&mut s, 7).len(), 7);
    assert!(s.room_for(4096));
}

#[test]
fn a_request_that_times_out_quarantines_its_buffers() {
    let l = local(512, 4 * MIB, ProcessMode::Thread);
    let d = l
        .driver(DriverConfig {
            io_queues: 2,
            io_timeout: Duration::from_millis(50),
            ..DriverConfig::default()
        })
        .unwrap();
    let mut s = d.stream().unwrap();
    l.pause(true);
    s.submit_read(9, 0, 8192).unwrap();
    s.ring().unwrap();
    let done = reap_all(&mut s, 1);
    assert_eq!(done.len(), 1);
    assert!(matches!(done[0].result, Err(DriverError::Timeout(_))), "{:?}", done[0].result);
    assert!(d.stats().quarantined_pages.load(Ordering::Relaxed) >= 2);
    drop(done);
    l.pause(false);
    // The late completion is dropped as stray; the stream goes on.
    s.submit_write(10, 0, &[4u8; 512], false).unwrap();
    s.ring().unwrap();
    let done = reap_all(&mut s, 1);
    assert!(done[0].result.is_ok());
    drop(done);
    let deadline = Instant::now() + Duration::from_secs(2);
    while d.stats().stray_completions.load(Ordering::Relaxed) == 0 && Instant::now() < deadline {
        let mut out = Vec::new();
        s.reap(&mut out).unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(d.stats().stray_completions.load(Ordering::Relaxed), 1);
}

#[test]
fn a_large_write_starts_piece_by_piece_and_small_ones_wait_for_the_ring() {
    // Write data in the memory buffer: a write goes in pieces of `pipelined_write_bytes`.
    let cfg = ControllerConfig { cmb_bytes: 16 * MIB, ..ControllerConfig::default() };
    let l = LocalNvme::new(controller(512, 32 * MIB, cfg), 8192, ProcessMode::Thread);
    let d = l.driver(DriverConfig { io_queues: 2, ..DriverConfig::default() }).unwrap();
    let mut s = d.stream().unwrap();
    // A 4 KiB write waits for the doorbell.
    s.submit_write(1, 0, &pattern(1, 4096), false).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let mut out = Vec::new();
    s.reap(&mut out).unwrap();
    assert!(out.is_empty(), "a small write went before the ring");
    // A 1 MiB write's pieces start as their data is in: all of it is written without a ring.
    let big = pattern(2, 1 << 20);
    s.submit_write(2, MIB, &big, false).unwrap();
    let done = reap_all(&mut s, 2);
    assert_eq!(done.len(), 2, "the big write's last doorbell announced the small one too");
    assert!(done.iter().all(|f| f.result.is_ok()));
    drop(done);
    s.submit_read(3, MIB, 1 << 20).unwrap();
    s.ring().unwrap();
    let done = reap_all(&mut s, 1);
    assert!(lent(&done[0]) == big);
}

/// A `fill` for `IoStream::submit_write_filled` that puts `data` into the slices it is lent,
/// in order, records how many bytes each call took, and fails its call number `fail_at`.
fn filler<'a>(
    data: &'a [u8],
    calls: &'a mut Vec<usize>,
    fail_at: Option<usize>,
) -> impl FnMut(&mut [&mut [u8]]) -> bool + 'a {
    let mut at = 0;
    move |slices| {
        if fail_at == Some(calls.len()) {
            calls.push(0);
            return false;
        }
        let n: usize = slices.iter().map(|s| s.len()).sum();
        for s in slices.iter_mut() {
            let len = s.len();
            s.copy_from_slice(&data[at..at + len]);
            at += len;
        }
        calls.push(n);
        true
    }
}

#[test]
fn a_write_filled_in_place_goes_in_pieces_and_stops_where_its_data_does() {
    // Data in host memory: the caller puts it into the DMA buffers, a piece at a time.
    let l = LocalNvme::new(controller(512, 8 * MIB, ControllerConfig::default()), 8192, ProcessMode::Thread);
    let d = l.driver(DriverConfig { io_queues: 2, ..DriverConfig::default() }).unwrap();
    let mut s = d.stream().unwrap();
    assert!(s.writes_in_place());
    let big = pattern(4, 1 << 20);
    let mut calls = Vec::new();
    s.submit_write_filled(1, MIB, 1 << 20, false, &mut filler(&big, &mut calls, None)).unwrap().unwrap();
    assert_eq!(calls, [256 << 10; 4], "one call per piece of `pipelined_write_bytes`");
    let done = reap_all(&mut s, 1);
    assert!(done[0].result.is_ok(), "{:?}", done[0].result);
    drop(done);
    let copied = d.stats().copy_bytes.load(Ordering::Relaxed);
    assert!(copied < 4096, "the driver copied no data, only queue entries: {copied}");
    // The data stops after the first piece: that piece is written, the write fails, and the
    // pieces after it are never submitted.
    let other = pattern(5, 1 << 20);
    calls.clear();
    s.submit_write_filled(2, MIB, 1 << 20, false, &mut filler(&other, &mut calls, Some(1))).unwrap().unwrap();
    assert_eq!(calls, [256 << 10, 0]);
    let done = reap_all(&mut s, 1);
    assert!(done[0].result.is_err(), "the write whose data stopped failed");
    drop(done);
    // No data at all: nothing submitted.
    calls.clear();
    let r = s.submit_write_filled(3, 0, 8192, false, &mut filler(&other, &mut calls, Some(0))).unwrap();
    assert!(r.is_err() && s.in_flight() == 0, "{r:?}");
    // A bad range: refused before any data is asked for.
    calls.clear();
    let r = s.submit_write_filled(4, 8 * MIB, 4096, false, &mut filler(&other, &mut calls, None)).unwrap();
    assert!(r.is_err() && calls.is_empty(), "{r:?}");
    s.submit_read(5, MIB, 1 << 20).unwrap();
    s.ring().unwrap();
    let done = reap_all(&mut s, 1);
    let mut want = other[..256 << 10].to_vec();
    want.extend_from_slice(&big[256 << 10..]);
    assert!(lent(&done[0]) == want, "the first piece of the stopped write, the rest of the first");
    drop(done);
    drop(s);
    drop(d);
    assert_eq!(l.region().pages_in_use(), 0, "every DMA buffer freed");

    // Write data in the memory buffer: not taken this way.
    let cfg = ControllerConfig { cmb_bytes: 16 * MIB, ..ControllerConfig::default() };
    let l = LocalNvme::new(controller(512, 8 * MIB, cfg), 8192, ProcessMode::Thread);
    let d = l.driver(DriverConfig { io_queues: 2, ..DriverConfig::default() }).unwrap();
    let mut s = d.stream().unwrap();
    assert!(!s.writes_in_place());
    assert!(s.submit_write_filled(1, 0, 4096, false, &mut |_| true).is_none());
}
