//! lanbus rings: the cache-efficient queues every packet and TLP crosses between threads and
//! processes.
//!
//! Layer: rings (above `wire`, below `port` and `transport`). What is here, and the one lesson from
//! the vhost-user cache-efficiency study each piece applies:
//!
//! - [`spsc`]: a single-producer single-consumer ring of [`Pod`] values in the `rte_ring` layout:
//!   producer and consumer indices on their own cache lines with a guard line between (factor (a):
//!   no line written by both cores), cached opposite index, free-running u32 indices, burst and
//!   bulk enqueue/dequeue.
//! - [`virtqueue`]: a virtio 1.1 packed virtqueue of 16-byte [`Desc`]s (buffer id, offset, length,
//!   flags) with avail/used wrap counters: no shared index at all.
//! - [`Pool`]: fixed-size buffers whose metadata lives in the descriptor (factor (d): no header
//!   written into the buffer per packet).
//! - [`Region`]: anonymous memory for one process, memfd memory for two ([`send_fds`] /
//!   [`recv_fds`] pass it with `SCM_RIGHTS`). Every `attach` validates what it reads; every index
//!   a peer writes is checked before use, so a faulty peer gets [`Error::Corrupt`], never an
//!   out-of-bounds access.
//! - [`copy`]: ordinary or non-temporal copies (factor (b)), selectable.
//! - [`EventFd`] and the prepare-wait / re-check / sleep handshake (`notify`).
//! - [`pipe`]: a virtqueue and a pool in one region: a one-way frame pipe.
//! - [`study`]: the vhost-user model of the cache-efficiency study with its five factors
//!   (`lanbus bench vring`).
//!
//! # How a shared-memory port uses this (memif-like `shm` port)
//!
//! The process that creates the link makes one `Region::memfd` of
//! `2 * cfg.bytes_needed()` (rounded to 64) and formats a [`pipe::PipeConfig`] at offset 0 (A to B)
//! and at the second half (B to A), makes two [`EventFd`]s (one doorbell per receiver), and sends
//! the memfd and both eventfds over its Unix socket with [`send_fds`] along with a small hello (the
//! two offsets). The other process [`recv_fds`], maps with [`Region::from_fd`] and attaches: each
//! side is a [`pipe::Sender`] on its outgoing pipe and a [`pipe::Receiver`] on its incoming one.
//! `tx_burst` is `Sender::send_with` (the frame is written straight into a pool buffer), then
//! `if sender.wake_needed() { peer_doorbell.notify() }`; `rx_burst` is `Receiver::recv`; `wait` is
//! `prepare_wait`, re-check `has_pending`, `EventFd::wait`, `finish_wait`. All attach calls and all
//! per-frame reads validate, so the port only has to count [`Error::Corrupt`] as `rx_dropped` (or
//! close the link).
#![deny(missing_docs)]

pub mod copy;
#[cfg(not(loom))]
mod notify;
#[cfg(not(loom))]
pub mod pipe;
#[cfg(not(loom))]
mod pool;
#[cfg(not(loom))]
mod region;
#[cfg(all(feature = "dpdk", not(loom)))]
pub mod rte;
pub mod spsc;
#[cfg(not(loom))]
pub mod study;
mod sync;
pub mod virtqueue;

pub use copy::CopyMode;
#[cfg(not(loom))]
pub use notify::EventFd;
#[cfg(not(loom))]
pub use pool::Pool;
#[cfg(not(loom))]
pub use region::{peer_cred, recv_fds, send_fds, PeerCred, Region, MAX_FDS};
pub use spsc::{channel, Consumer, Producer};
pub use sync::{CacheAligned, CACHE_LINE};
pub use virtqueue::{virtqueue, Desc, Device, Driver};

/// Plain old data: a `Copy` type for which every bit pattern is a valid value and which has no
/// padding, so it can live in memory a peer may overwrite.
///
/// # Safety
/// Implement only for types with no padding bytes, no pointers or references, and no invalid bit
/// patterns (integers, arrays of them, `#[repr(C)]` structs of them without padding).
pub unsafe trait Pod: Copy + Send + Sync + 'static {
    /// The all-zero value.
    fn zeroed() -> Self {
        // SAFETY: by the trait's contract every bit pattern, including all zeros, is valid.
        unsafe { core::mem::zeroed() }
    }
}

macro_rules! pod {
    ($($t:ty),*) => { $(
        // SAFETY: primitive integers: no padding, every bit pattern valid.
        unsafe impl Pod for $t {}
    )* };
}
pod!(u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize);

// SAFETY: arrays of Pod have no padding between elements and every bit pattern valid.
unsafe impl<T: Pod, const N: usize> Pod for [T; N] {}

/// Why a ring operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The peer left shared memory in a state no correct peer produces (an index out of range, a
    /// bad magic, a descriptor outside the pool). Nothing out of bounds was touched.
    #[error("peer corrupted shared memory: {0}")]
    Corrupt(&'static str),
    /// This side broke the API's contract (capacity not a power of two, frame too long...).
    #[error("misuse: {0}")]
    Misuse(&'static str),
    /// The operating system refused an operation (mmap, memfd, eventfd, sendmsg).
    #[error("{op}: {source}")]
    Io {
        /// The operation that failed.
        op: &'static str,
        /// The operating system's error.
        source: std::io::Error,
    },
}

impl Error {
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) fn io(op: &'static str, source: std::io::Error) -> Self {
        Error::Io { op, source }
    }
}

/// Result of a ring operation.
pub type Result<T> = core::result::Result<T, Error>;

/// Fuzz entry (`fuzz/fuzz_targets/shared_region.rs`, and the property test `garbage_region`): a
/// peer writes `data` over a formatted region holding a pipe and an SPSC ring, at offsets the data
/// itself chooses, between and after operations of this side. Whatever it writes, every attach
/// and every operation returns a value or an error: no panic, no out-of-bounds access.
///
/// Layout of `data`: repeated records of `[offset: u16 le][len: u8][len bytes]`.
#[cfg(not(loom))]
#[cfg(any(test, fuzzing))]
pub fn fuzz_shared_region(data: &[u8]) {
    use std::sync::Arc;
    let cfg = pipe::PipeConfig { slots: 8, buffers: 16, buf_size: 128 };
    let ring_at = cfg.bytes_needed().next_multiple_of(64);
    let Ok(region) = Region::memfd("fuzz", ring_at + spsc::bytes_needed::<u64>(8)) else { return };
    let region = Arc::new(region);
    let (Ok(()), Ok(())) = (cfg.format(&region, 0), spsc::format::<u64>(&region, ring_at, 8)) else { return };
    let (Ok(mut tx), Ok(mut rx)) = (
        pipe::Sender::attach(region.clone(), 0, CopyMode::Ordinary),
        pipe::Receiver::attach(region.clone(), 0),
    ) else {
        return;
    };
    let (Ok(mut p), Ok(mut c)) =
        (Producer::<u64>::attach(region.clone(), ring_at), Consumer::<u64>::attach(region.clone(), ring_at))
    else {
        return;
    };
    let mut rest = data;
    let mut k = 0u8;
    loop {
        k = k.wrapping_add(1);
        let _ = tx.send(&[k; 60]);
        let _ = p.enqueue_burst(&[k as u64; 3]);
        // The "peer" writes one record.
        let [o0, o1, len, tail @ ..] = rest else { break };
        let len = (*len as usize).min(tail.len());
        let at = u16::from_le_bytes([*o0, *o1]) as usize % region.len();
        let len = len.min(region.len() - at);
        // SAFETY: `at..at+len` lies inside the mapped region (both clamped above). This process
        // plays the faulty peer; the handles read shared memory only volatilely and validate it.
        unsafe { core::ptr::copy_nonoverlapping(tail.as_ptr(), region.as_ptr().add(at), len) };
        rest = &tail[len..];
        let _ = rx.recv(|f| assert!(f.len() <= 128, "a frame longer than the buffers was delivered"));
        let _ = tx.reclaim();
        let mut out = [0u64; 4];
        if let Ok(n) = c.dequeue_burst(&mut out) {
            assert!(n <= 4);
        }
    }
    // Attaching afresh to the scribbled region validates instead of trusting.
    let _ = pipe::Receiver::attach(region.clone(), 0).map(|mut r| r.recv(|_| ()));
    let _ = pipe::Sender::attach(region.clone(), 0, CopyMode::NonTemporal).map(|mut s| s.send(&[1; 10]));
    let _ = Consumer::<u64>::attach(region.clone(), ring_at).map(|mut c| c.try_pop());
    let _ = Producer::<u64>::attach(region, ring_at).map(|mut p| p.try_push(1));
}

#[cfg(test)]
mod fuzz_tests {
    use proptest::prelude::*;

    proptest! {
        /// Whatever bytes a peer writes over a pipe and a ring, attaching and using them returns
        /// values or errors and never panics or faults (the same function is the fuzz target).
        #[test]
        fn garbage_region(data in proptest::collection::vec(any::<u8>(), 0..600)) {
            super::fuzz_shared_region(&data);
        }

        /// The same with records aimed at the headers and descriptors, where garbage matters most.
        #[test]
        fn garbage_region_headers(records in proptest::collection::vec((0u16..700, proptest::collection::vec(any::<u8>(), 1..16)), 0..30)) {
            let mut data = Vec::new();
            for (at, bytes) in records {
                data.extend_from_slice(&at.to_le_bytes());
                data.push(bytes.len() as u8);
                data.extend_from_slice(&bytes);
            }
            super::fuzz_shared_region(&data);
        }
    }
}
