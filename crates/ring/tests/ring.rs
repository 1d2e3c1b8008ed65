//! The SPSC ring behaves like a bounded `VecDeque`; indices wrap at 2^32; garbage from a peer in
//! shared memory gives `Error::Corrupt`, never a crash or an out-of-bounds access.
#![cfg(not(loom))]

use std::collections::VecDeque;
use std::sync::Arc;

use lanbus_ring::pipe::{PipeConfig, Receiver, Sender};
use lanbus_ring::spsc::{self, layout};
use lanbus_ring::{channel, Consumer, CopyMode, Error, Producer, Region};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Burst(Vec<u64>),
    Bulk(Vec<u64>),
    Push(u64),
    DequeueBurst(usize),
    DequeueBulk(usize),
    Pop,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        proptest::collection::vec(any::<u64>(), 0..20).prop_map(Op::Burst),
        proptest::collection::vec(any::<u64>(), 0..20).prop_map(Op::Bulk),
        any::<u64>().prop_map(Op::Push),
        (0usize..20).prop_map(Op::DequeueBurst),
        (0usize..20).prop_map(Op::DequeueBulk),
        Just(Op::Pop),
    ]
}

fn check_against_model(p: &mut Producer<u64>, c: &mut Consumer<u64>, ops: &[Op]) {
    let cap = p.capacity();
    let mut model = VecDeque::new();
    for op in ops {
        match op {
            Op::Burst(v) => {
                let n = p.enqueue_burst(v).unwrap();
                assert_eq!(n, v.len().min(cap - model.len()));
                model.extend(&v[..n]);
            }
            Op::Bulk(v) => {
                let ok = p.enqueue_bulk(v).unwrap();
                assert_eq!(ok, v.len() <= cap - model.len());
                if ok {
                    model.extend(v);
                }
            }
            Op::Push(x) => {
                let ok = p.try_push(*x).unwrap();
                assert_eq!(ok, model.len() < cap);
                if ok {
                    model.push_back(*x);
                }
            }
            Op::DequeueBurst(n) => {
                let mut out = vec![0; *n];
                let got = c.dequeue_burst(&mut out).unwrap();
                assert_eq!(got, (*n).min(model.len()));
                let want: Vec<u64> = model.drain(..got).collect();
                assert_eq!(&out[..got], &want[..]);
            }
            Op::DequeueBulk(n) => {
                let mut out = vec![0; *n];
                let ok = c.dequeue_bulk(&mut out).unwrap();
                assert_eq!(ok, *n <= model.len());
                if ok {
                    let want: Vec<u64> = model.drain(..*n).collect();
                    assert_eq!(out, want);
                }
            }
            Op::Pop => assert_eq!(c.try_pop().unwrap(), model.pop_front()),
        }
        assert_eq!(c.len().unwrap(), model.len());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn ring_behaves_like_vecdeque(cap_log in 0u32..5, ops in proptest::collection::vec(op(), 0..200)) {
        let (mut p, mut c) = channel::<u64>(1 << cap_log).unwrap();
        check_against_model(&mut p, &mut c, &ops);
    }

    #[test]
    fn indices_wrap_at_u32_max(start in (u32::MAX - 40)..=u32::MAX, ops in proptest::collection::vec(op(), 0..100)) {
        let region = Arc::new(Region::memfd("wrap", spsc::bytes_needed::<u64>(8)).unwrap());
        spsc::format::<u64>(&region, 0, 8).unwrap();
        // Start both indices just below the wrap, as after 4 billion elements.
        // SAFETY: TAIL and HEAD are u32 fields inside the formatted ring; nobody is attached yet.
        unsafe {
            region.as_ptr().add(layout::TAIL).cast::<u32>().write(start);
            region.as_ptr().add(layout::HEAD).cast::<u32>().write(start);
        }
        let mut p = Producer::<u64>::attach(region.clone(), 0).unwrap();
        let mut c = Consumer::<u64>::attach(region, 0).unwrap();
        check_against_model(&mut p, &mut c, &ops);
    }
}

#[test]
fn garbage_ring_indices_are_errors() {
    let region = Arc::new(Region::memfd("bad-index", spsc::bytes_needed::<u32>(16)).unwrap());
    spsc::format::<u32>(&region, 0, 16).unwrap();
    let mut p = Producer::<u32>::attach(region.clone(), 0).unwrap();
    let mut c = Consumer::<u32>::attach(region.clone(), 0).unwrap();
    assert_eq!(p.enqueue_burst(&[1, 2, 3]).unwrap(), 3);
    let tail = region.as_ptr().wrapping_add(layout::TAIL).cast::<u32>();
    let head = region.as_ptr().wrapping_add(layout::HEAD).cast::<u32>();
    // A peer claims the producer is 1000 elements ahead of the consumer in a 16-slot ring.
    // SAFETY: aligned u32 fields inside the region (a real peer would write them from its process).
    unsafe { tail.write_volatile(1000) };
    let mut out = [0u32; 8];
    assert!(matches!(c.dequeue_burst(&mut out), Err(Error::Corrupt(_))));
    assert!(matches!(c.try_pop(), Err(Error::Corrupt(_))));
    // A peer claims the consumer ran ahead of the producer.
    // SAFETY: as above.
    unsafe { head.write_volatile(500) };
    assert!(matches!(p.enqueue_burst(&[0; 16]), Err(Error::Corrupt(_))));
    // Attaching to the scribbled ring is refused too.
    assert!(matches!(Consumer::<u32>::attach(region.clone(), 0), Err(Error::Corrupt(_))));
    // A wrong element size or magic is refused at attach.
    assert!(matches!(Consumer::<u64>::attach(region.clone(), 0), Err(Error::Corrupt(_))));
    // SAFETY: the magic is the first u32 of the ring.
    unsafe { region.as_ptr().cast::<u32>().write_volatile(0xdead_beef) };
    assert!(matches!(Producer::<u32>::attach(region.clone(), 0), Err(Error::Corrupt(_))));
    // An offset outside the region is refused.
    assert!(Producer::<u32>::attach(region.clone(), region.len()).is_err());
}

#[test]
fn garbage_descriptors_are_errors() {
    let cfg = PipeConfig { slots: 4, buffers: 8, buf_size: 64 };
    let region = Arc::new(Region::memfd("bad-desc", cfg.bytes_needed()).unwrap());
    cfg.format(&region, 0).unwrap();
    let mut tx = Sender::attach(region.clone(), 0, CopyMode::Ordinary).unwrap();
    let mut rx = Receiver::attach(region.clone(), 0).unwrap();
    assert!(tx.send(b"hello").unwrap());
    // The peer rewrites descriptor 0 to name buffer 1_000_000 (outside the 8-buffer pool).
    let desc0 = region.as_ptr().wrapping_add(192).cast::<u32>();
    // SAFETY: the first field of descriptor 0, inside the region.
    unsafe { desc0.write_volatile(1_000_000) };
    assert!(matches!(rx.recv(|_| panic!("garbage delivered")), Err(Error::Corrupt(_))));
    // The receiver handed the bad descriptor back used: the sender sees a buffer it never sent.
    assert!(matches!(tx.reclaim(), Err(Error::Corrupt(_))));
    // A fresh pair; the peer now claims a length past the buffer's end.
    cfg.format(&region, 0).unwrap();
    let mut tx = Sender::attach(region.clone(), 0, CopyMode::Ordinary).unwrap();
    let mut rx = Receiver::attach(region.clone(), 0).unwrap();
    assert!(tx.send(b"hello").unwrap());
    // SAFETY: the len field (third u32) of descriptor 0, inside the region.
    unsafe { desc0.add(2).write_volatile(65) };
    assert!(matches!(rx.recv(|_| panic!("garbage delivered")), Err(Error::Corrupt(_))));
}

#[test]
fn pipe_moves_frames_in_process() {
    let cfg = PipeConfig { slots: 8, buffers: 12, buf_size: 256 };
    let region = Arc::new(Region::anonymous(cfg.bytes_needed()).unwrap());
    cfg.format(&region, 0).unwrap();
    let mut tx = Sender::attach(region.clone(), 0, CopyMode::NonTemporal).unwrap();
    let mut rx = Receiver::attach(region, 0).unwrap();
    let mut got = Vec::new();
    for round in 0..50u32 {
        let mut sent = 0;
        for k in 0..10u32 {
            let frame: Vec<u8> = (0..(round * 7 + k) % 250 + 1).map(|b| (b as u8) ^ (k as u8)).collect();
            if tx.send(&frame).unwrap() {
                sent += 1;
                got.push(frame);
            }
        }
        assert!(sent >= 8, "the queue has 8 slots");
        let mut n = 0;
        while rx.recv(|f| assert_eq!(f, &got[got.len() - sent + n][..])).unwrap() {
            n += 1;
        }
        assert_eq!(n, sent);
        assert!(!rx.has_pending());
    }
}

#[test]
fn two_threads_move_a_million_elements_in_order() {
    let (mut p, mut c) = channel::<u64>(64).unwrap();
    const N: u64 = 300_000;
    let prod = std::thread::spawn(move || {
        let mut next = 0u64;
        let mut buf = [0u64; 32];
        while next < N {
            let k = ((N - next) as usize).min(32);
            for (j, b) in buf[..k].iter_mut().enumerate() {
                *b = next + j as u64;
            }
            let n = p.enqueue_burst(&buf[..k]).unwrap();
            next += n as u64;
            if n == 0 {
                std::thread::yield_now();
            }
        }
    });
    let mut expect = 0u64;
    let mut buf = [0u64; 32];
    while expect < N {
        let n = c.dequeue_burst(&mut buf).unwrap();
        for &v in &buf[..n] {
            assert_eq!(v, expect);
            expect += 1;
        }
        if n == 0 {
            std::thread::yield_now();
        }
    }
    prod.join().unwrap();
}

#[test]
fn eventfd_wakes_a_sleeping_consumer() {
    use lanbus_ring::EventFd;
    let (mut p, mut c) = channel::<u32>(4).unwrap();
    let bell = Arc::new(EventFd::new().unwrap());
    let bell2 = bell.clone();
    let t = std::thread::spawn(move || {
        for i in 0..200u32 {
            while !p.try_push(i).unwrap() {
                std::thread::yield_now();
            }
            if p.wake_needed() {
                bell2.notify().unwrap();
            }
            if i % 16 == 0 {
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
        }
    });
    let mut next = 0;
    while next < 200 {
        // Without the re-check or the notify a wake-up could be lost: the wait would then run to
        // its timeout, which the producer (pausing at most 200 us) never lets happen otherwise.
        let t0 = std::time::Instant::now();
        c.wait(&bell, Some(std::time::Duration::from_secs(3))).unwrap();
        assert!(t0.elapsed() < std::time::Duration::from_millis(2500), "lost wake-up");
        while let Some(v) = c.try_pop().unwrap() {
            assert_eq!(v, next);
            next += 1;
        }
    }
    t.join().unwrap();
}
