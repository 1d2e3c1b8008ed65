//! The hot path does not allocate: after a warm-up, moving messages through two endpoints (send,
//! transmit, receive, deliver, ACK) performs no heap allocation at all. Counted with a global
//! allocator that counts the calls made on this test's thread.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use lanbus_transport::{Config, Endpoint};
use lanbus_wire::{Instant, MacAddr};

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    // try_with: the thread-local may already be gone while a thread exits.
    let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: every method forwards to the system allocator with the caller's arguments unchanged;
// counting touches only a const-initialised thread-local Cell, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: same contract as ours, passed through.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` through us with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: `ptr` came from `System` with `layout`; the caller guarantees `new_size`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(|c| c.get())
}

/// Moves `count` messages of sizes from `sizes` from `a` to `b`, with time advancing 1 us per
/// round so coalesced ACKs fire; returns the messages delivered.
fn pump(
    a: &mut Endpoint,
    b: &mut Endpoint,
    now: &mut Instant,
    buf: &mut [u8],
    count: u64,
    sizes: &[usize],
) -> u64 {
    let msg = [0x42u8; 65_536];
    let peer = b.local_mac();
    let (mut sent, mut got) = (0u64, 0u64);
    while got < count {
        while sent < count && a.send(*now, peer, 0, &msg[..sizes[sent as usize % sizes.len()]]).is_ok() {
            sent += 1;
        }
        while let Some(n) = a.poll_transmit(*now, buf) {
            b.handle_frame(*now, &buf[..n]);
            while let Some(m) = b.poll_message() {
                assert_eq!(m.data.len(), sizes[got as usize % sizes.len()]);
                got += 1;
            }
        }
        while let Some(n) = b.poll_transmit(*now, buf) {
            a.handle_frame(*now, &buf[..n]);
        }
        *now += core::time::Duration::from_micros(1);
        a.handle_timeout(*now);
        b.handle_timeout(*now);
    }
    got
}

#[test]
fn steady_state_moves_messages_without_allocating() {
    let mut now = Instant::ZERO;
    let mut c = Config::point_to_point();
    c.rate.enabled = false;
    let mut a = Endpoint::new(c.clone(), MacAddr::local(1), now);
    let mut b = Endpoint::new(c.clone(), MacAddr::local(2), now);
    let mut buf = vec![0u8; c.frame_capacity()];
    let sizes = [64, 1024, 0, 3000, 65_536, 200];
    // The counter sees this thread's allocations.
    let probe = allocations();
    drop(std::hint::black_box(vec![1u8; 10]));
    assert_eq!(allocations(), probe + 1);
    assert_eq!(pump(&mut a, &mut b, &mut now, &mut buf, 6_000, &sizes), 6_000);
    let before = allocations();
    assert_eq!(pump(&mut a, &mut b, &mut now, &mut buf, 12_000, &sizes), 12_000);
    assert_eq!(allocations() - before, 0, "the hot path allocated");
    assert_eq!(a.counters().retransmitted_frames, 0);
}
