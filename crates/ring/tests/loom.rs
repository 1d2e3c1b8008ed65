//! Loom models of the SPSC ring's index protocol, the packed virtqueue's flag protocol and the
//! wait/wake handshake. Run with:
//! `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p lanbus-ring --release --test loom`
//!
//! Under loom the slots and descriptor bodies are loom cells, so a slot read not ordered after
//! its write by the Release/Acquire index (or flags) protocol fails the model, as does a value
//! read out of order. Each model is small (capacity 2, a few elements) to keep runs bounded.
#![cfg(loom)]

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;

use lanbus_ring::{channel, virtqueue, Desc};

fn bounded() -> loom::model::Builder {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b
}

#[test]
fn spsc_delivers_in_order_through_wraparound() {
    bounded().check(|| {
        let (mut p, mut c) = channel::<u64>(2).unwrap();
        let producer = thread::spawn(move || {
            let mut next = 1u64;
            while next <= 3 {
                if p.try_push(next).unwrap() {
                    next += 1;
                } else {
                    thread::yield_now();
                }
            }
        });
        let mut expect = 1u64;
        while expect <= 3 {
            match c.try_pop().unwrap() {
                Some(v) => {
                    assert_eq!(v, expect);
                    expect += 1;
                }
                None => thread::yield_now(),
            }
        }
        producer.join().unwrap();
    });
}

#[test]
fn spsc_bursts_never_overrun() {
    bounded().check(|| {
        let (mut p, mut c) = channel::<u64>(2).unwrap();
        let producer = thread::spawn(move || {
            let items = [10u64, 11, 12];
            let mut sent = 0;
            while sent < items.len() {
                let n = p.enqueue_burst(&items[sent..]).unwrap();
                if n == 0 {
                    thread::yield_now();
                }
                sent += n;
            }
        });
        let mut got = Vec::new();
        let mut out = [0u64; 2];
        while got.len() < 3 {
            let n = c.dequeue_burst(&mut out).unwrap();
            if n == 0 {
                thread::yield_now();
            }
            got.extend_from_slice(&out[..n]);
        }
        assert_eq!(got, [10, 11, 12]);
        producer.join().unwrap();
    });
}

#[test]
fn virtqueue_round_trip_with_wrap_counters() {
    bounded().check(|| {
        let (mut driver, mut device) = virtqueue(2).unwrap();
        let dev = thread::spawn(move || {
            let mut served = 0;
            while served < 3 {
                match device.poll_avail().unwrap() {
                    Some(d) => {
                        device.push_used(&Desc { len: d.len + 100, ..d }).unwrap();
                        served += 1;
                    }
                    None => thread::yield_now(),
                }
            }
        });
        let mut offered = 0u32;
        let mut back = Vec::new();
        while back.len() < 3 {
            if offered < 3
                && driver.add_avail(&Desc { buffer: offered, len: offered, ..Desc::default() }).unwrap()
            {
                offered += 1;
                continue;
            }
            match driver.poll_used().unwrap() {
                Some(d) => back.push((d.buffer, d.len)),
                None => thread::yield_now(),
            }
        }
        assert_eq!(back, [(0, 100), (1, 101), (2, 102)]);
        dev.join().unwrap();
    });
}

/// The prepare-wait / re-check / sleep handshake never loses a wake-up: the "eventfd" is a flag
/// the consumer may only block on (spin) after its re-check found the ring empty.
#[test]
fn wake_up_is_never_lost() {
    bounded().check(|| {
        let (mut p, mut c) = channel::<u64>(2).unwrap();
        let bell = Arc::new(AtomicBool::new(false));
        let bell2 = bell.clone();
        let producer = thread::spawn(move || {
            assert!(p.try_push(7).unwrap());
            if p.wake_needed() {
                // SeqCst stands in for the eventfd write/read pair (a syscall is a full barrier).
                bell2.store(true, Ordering::SeqCst);
            }
        });
        loop {
            if let Some(v) = c.try_pop().unwrap() {
                assert_eq!(v, 7);
                break;
            }
            c.prepare_wait();
            if c.is_empty().unwrap() {
                // Sleep: only the bell can wake us. A lost wake-up spins forever, which loom reports.
                while !bell.load(Ordering::SeqCst) {
                    thread::yield_now();
                }
            }
            c.finish_wait();
        }
        producer.join().unwrap();
    });
}
