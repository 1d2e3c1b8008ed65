//! DPDK's `rte_ring` as a peer to measure [`crate::spsc`] against (cargo feature `dpdk`).
//!
//! Layer: rings, for benchmarks only. A single-producer single-consumer `rte_ring` (DPDK 22.11 from
//! Debian's libdpdk-dev) made by `rte_ring_init` in memory of its own, driven through the C shim
//! `dpdk/rte_ring_shim.c` with the calls DPDK's `ring_perf_autotest` times
//! (`rte_ring_sp_enqueue_bulk` / `rte_ring_sc_dequeue_bulk` of 8-byte values). The halves have the
//! same shape as ours, so `lanbus bench ring` runs both through one loop. Each call crosses into C
//! (a direct call; DPDK's own test inlines it), which adds a function call's cost to each of
//! rte_ring's.

use std::sync::Arc;

use crate::{Error, Result};

mod ffi {
    use core::ffi::{c_uint, c_void};

    /// `struct rte_ring`, only ever behind a pointer.
    #[repr(C)]
    pub struct RteRing {
        _opaque: [u8; 0],
    }

    extern "C" {
        pub fn lb_rte_ring_new(count: c_uint) -> *mut RteRing;
        pub fn lb_rte_ring_free(r: *mut RteRing);
        pub fn lb_rte_ring_sp_enqueue_bulk(r: *mut RteRing, objs: *const *mut c_void, n: c_uint) -> c_uint;
        pub fn lb_rte_ring_sc_dequeue_bulk(r: *mut RteRing, objs: *mut *mut c_void, n: c_uint) -> c_uint;
    }
}

/// Owns the ring's memory; freed when both halves are gone.
struct Owned(*mut ffi::RteRing);

// SAFETY: the pointer is to heap memory owned by this value; rte_ring's SP/SC calls are made by one
// producer and one consumer thread at a time (the halves are not Clone), as DPDK allows.
unsafe impl Send for Owned {}
// SAFETY: as above: shared between the two halves, each calling only its own side's functions.
unsafe impl Sync for Owned {}

impl Drop for Owned {
    fn drop(&mut self) {
        // SAFETY: made by lb_rte_ring_new, freed once (the last Arc owner drops it).
        unsafe { ffi::lb_rte_ring_free(self.0) }
    }
}

/// The producing half of an `rte_ring` (the single producer).
pub struct RteProducer(Arc<Owned>);

/// The consuming half of an `rte_ring` (the single consumer).
pub struct RteConsumer(Arc<Owned>);

/// A new empty SP/SC `rte_ring` of `count` slots (a power of two; like DPDK's, it holds
/// `count - 1`).
pub fn channel(count: u32) -> Result<(RteProducer, RteConsumer)> {
    if !count.is_power_of_two() || count < 2 {
        return Err(Error::Misuse("rte_ring size must be a power of two of at least 2"));
    }
    // SAFETY: a plain allocation and rte_ring_init; NULL on failure, checked below.
    let r = unsafe { ffi::lb_rte_ring_new(count) };
    if r.is_null() {
        return Err(Error::Misuse("rte_ring_init failed"));
    }
    let owned = Arc::new(Owned(r));
    Ok((RteProducer(owned.clone()), RteConsumer(owned)))
}

impl RteProducer {
    /// Enqueues all of `items` or none (`rte_ring_sp_enqueue_bulk`); returns whether it did.
    #[inline]
    pub fn enqueue_bulk(&mut self, items: &[u64]) -> bool {
        let n = items.len() as core::ffi::c_uint;
        // SAFETY: the ring is alive (we hold an Arc); `items` is valid for n 8-byte reads (u64 and
        // pointers have the same size and alignment on the 64-bit targets DPDK supports); we are
        // the only producer (&mut self, not Clone).
        unsafe { ffi::lb_rte_ring_sp_enqueue_bulk(self.0 .0, items.as_ptr().cast(), n) == n }
    }
}

impl RteConsumer {
    /// Fills all of `out` or takes nothing (`rte_ring_sc_dequeue_bulk`); returns whether it did.
    #[inline]
    pub fn dequeue_bulk(&mut self, out: &mut [u64]) -> bool {
        let n = out.len() as core::ffi::c_uint;
        // SAFETY: as enqueue_bulk; `out` is valid for n 8-byte writes; we are the only consumer.
        unsafe { ffi::lb_rte_ring_sc_dequeue_bulk(self.0 .0, out.as_mut_ptr().cast(), n) == n }
    }
}

const _: () = assert!(core::mem::size_of::<u64>() == core::mem::size_of::<*mut core::ffi::c_void>());

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bulk_is_all_or_nothing_and_fifo() {
        let (mut p, mut c) = channel(8).unwrap();
        let mut out = [0u64; 4];
        assert!(!c.dequeue_bulk(&mut out), "empty");
        assert!(p.enqueue_bulk(&[1, 2, 3, 4]));
        assert!(!p.enqueue_bulk(&[5, 6, 7, 8]), "an 8-slot rte_ring holds 7");
        assert!(p.enqueue_bulk(&[5, 6, 7]));
        assert!(c.dequeue_bulk(&mut out));
        assert_eq!(out, [1, 2, 3, 4]);
        assert!(!c.dequeue_bulk(&mut out), "only 3 left");
        let mut three = [0u64; 3];
        assert!(c.dequeue_bulk(&mut three));
        assert_eq!(three, [5, 6, 7]);
        assert!(channel(6).is_err());
    }
}
