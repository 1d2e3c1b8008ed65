//! Statistics counters the bridges' threads bump.

use std::sync::atomic::{AtomicU64, Ordering};

/// Adds one to a statistics counter.
pub(crate) fn bump(c: &AtomicU64) {
    add(c, 1);
}

/// Adds `n` to a statistics counter.
pub(crate) fn add(c: &AtomicU64, n: usize) {
    // Relaxed: a statistics counter orders nothing.
    c.fetch_add(n as u64, Ordering::Relaxed);
}

/// The device bridge's counters (see [`crate::DeviceBridgeStats`] for what each counts).
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) tlps_received: AtomicU64,
    pub(crate) foreign_requests: AtomicU64,
    pub(crate) other_channel: AtomicU64,
    pub(crate) malformed: AtomicU64,
    pub(crate) ur_sent: AtomicU64,
    pub(crate) unclaimed_writes: AtomicU64,
    pub(crate) unexpected_completions: AtomicU64,
    pub(crate) dma_reads: AtomicU64,
    pub(crate) dma_read_failures: AtomicU64,
    pub(crate) dma_writes: AtomicU64,
    pub(crate) dma_writes_dropped: AtomicU64,
    pub(crate) host_changes: AtomicU64,
    pub(crate) served_inline: AtomicU64,
    pub(crate) prefetched_reads: AtomicU64,
    pub(crate) prefetches_used: AtomicU64,
    pub(crate) payload_bytes_copied: AtomicU64,
}
