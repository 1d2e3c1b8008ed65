//! What the user-space drivers over a host bridge share (the NVMe driver and the virtio-net
//! driver): host memory the device reaches by DMA ([`DmaMemory`], and [`HostRegion`], the one in
//! ordinary memory, with its page allocator [`PageMap`]), waiting for MSI-X interrupts
//! ([`InterruptWait`]) and why a bus access failed ([`BusError`]). [`RegionView`] lends a
//! [`HostRegion`] to a host bridge as a [`DmaRegion`]; [`bridge_error`] says what a failed MMIO
//! request is to a driver.
//!
//! Layer: pcie engine, host side, below the drivers. Invariants: DMA memory is addressed by bus
//! address and an access outside it is a [`BusError::Unsupported`], never a panic; each page of a
//! [`HostRegion`] has its own lock, so an access of up to one page that does not cross a page
//! boundary is atomic (a completion entry is never seen half written); an interrupt that fires
//! while nobody waits is remembered.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lanbus_pcie::CplStatus;

use crate::region::DmaRegion;
use crate::{lock, BridgeError};

/// Why a bus transaction failed: a DMA toward the host (device side) or an MMIO access to a BAR
/// (host side). The bridges' users map their PCIe outcomes onto these ([`bridge_error`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BusError {
    /// A non-posted request got no completion in time (PCIe completion timeout).
    #[error("completion timeout")]
    Timeout,
    /// The completer answered Unsupported Request (no memory at that address).
    #[error("unsupported request (no target at address {addr:#x})")]
    Unsupported {
        /// The address that was not claimed.
        addr: u64,
    },
    /// The completer answered Completer Abort, or the access size or alignment is not allowed.
    #[error("access rejected: {0}")]
    Rejected(&'static str),
    /// The link or the peer is down.
    #[error("link down: {0}")]
    Down(String),
    /// Where nothing may wait (a bridge's receive thread), a read whose data is not here yet.
    #[error("the data is not here yet and this caller may not wait for it")]
    NotReady,
}

/// Host memory the device may DMA to: a driver allocates its queues, descriptor lists and data
/// buffers here and addresses them by bus address.
///
/// Contract for implementers: `alloc` returns page-aligned, physically (bus-) contiguous memory;
/// `read` of up to 64 bytes at an aligned address sees a device write of that range all at once
/// (so a completion entry is never seen half written).
pub trait DmaMemory: Send + Sync {
    /// Page size of the allocator (the NVMe driver uses it as the NVMe memory page size; 4096).
    fn page_size(&self) -> usize {
        4096
    }
    /// Allocates `pages` contiguous pages (contents unspecified: a driver writes what it needs,
    /// and zeroes completion queues itself); `None` when the region is exhausted.
    fn alloc(&self, pages: usize) -> Option<u64>;
    /// Frees what `alloc` returned.
    fn free(&self, addr: u64, pages: usize);
    /// Reads host memory at a bus address.
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), BusError>;
    /// Writes host memory at a bus address.
    fn write(&self, addr: u64, data: &[u8]) -> Result<(), BusError>;
    /// Lends the bytes of `runs` (bus address, length), in order, to `f` as slices of the
    /// memory itself, held still for the call. The default copies them into a buffer first.
    fn lend(&self, runs: &[(u64, usize)], f: &mut dyn FnMut(&[&[u8]])) -> Result<(), BusError> {
        let mut buf = vec![0u8; runs.iter().map(|r| r.1).sum()];
        let mut at = 0;
        for &(addr, len) in runs {
            self.read(addr, &mut buf[at..at + len])?;
            at += len;
        }
        f(&[&buf]);
        Ok(())
    }
    /// Whether [`DmaMemory::lend_mut`] lends the memory itself (no copy): a driver then lets a
    /// writer put a write's data straight into its DMA buffer (the NVMe driver's
    /// `IoStream::submit_write_filled`). The default says no, as its `lend_mut` copies.
    fn lends_in_place(&self) -> bool {
        false
    }
    /// Lends the `len` bytes at `addr` to `f` to write in place, as slices of the memory itself
    /// held still for the call, in order. The run is wholly the caller's: what `f` leaves alone
    /// may be left as it was or overwritten. The default lends a zeroed buffer and writes all of
    /// it back.
    fn lend_mut(&self, addr: u64, len: usize, f: &mut dyn FnMut(&mut [&mut [u8]])) -> Result<(), BusError> {
        let mut buf = vec![0u8; len];
        f(&mut [&mut buf]);
        self.write(addr, &buf)
    }
}

/// Waiting for MSI-X interrupts, with eventfd semantics: a signal that arrives while nobody waits
/// is remembered, so checking a queue and then waiting loses nothing.
pub trait InterruptWait: Send + Sync {
    /// Blocks until `vector` has fired since the last successful wait on it (then consumes the
    /// event and returns true) or `timeout` passes (false).
    fn wait_vector(&self, vector: u16, timeout: Duration) -> bool;
}

/// Host memory for tests, the in-process joins and the drivers over a host bridge: `pages` pages
/// of 4 KiB at bus address `base`, with a first-fit allocator of contiguous pages. Each page has
/// its own lock, so an access of up to one page that does not cross a page boundary is atomic
/// (completion entries, submission entries); concurrent users of different pages do not contend.
pub struct HostRegion {
    base: u64,
    pages: Vec<Mutex<Box<[u8]>>>,
    used: PageMap,
}

/// Page size of a [`HostRegion`].
pub const REGION_PAGE: usize = 4096;

impl HostRegion {
    /// A zeroed region of `pages` pages at bus address `base` (page aligned).
    pub fn new(base: u64, pages: usize) -> HostRegion {
        HostRegion {
            base: base & !(REGION_PAGE as u64 - 1),
            pages: (0..pages).map(|_| Mutex::new(vec![0u8; REGION_PAGE].into_boxed_slice())).collect(),
            used: PageMap::new(pages),
        }
    }

    /// Bus address of the first page.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Size in bytes.
    pub fn len_bytes(&self) -> u64 {
        (self.pages.len() * REGION_PAGE) as u64
    }

    /// Pages currently allocated.
    pub fn pages_in_use(&self) -> usize {
        self.used.in_use()
    }

    fn access(&self, addr: u64, len: usize, mut f: impl FnMut(&mut [u8], usize)) -> Result<(), BusError> {
        let end = addr.checked_add(len as u64).ok_or(BusError::Unsupported { addr })?;
        if addr < self.base || end > self.base + self.len_bytes() {
            return Err(BusError::Unsupported { addr });
        }
        let mut at = addr - self.base;
        let mut done = 0;
        while done < len {
            let page = (at / REGION_PAGE as u64) as usize;
            let off = (at % REGION_PAGE as u64) as usize;
            let n = (len - done).min(REGION_PAGE - off);
            let mut p = lock(&self.pages[page]);
            f(&mut p[off..off + n], done);
            done += n;
            at += n as u64;
        }
        Ok(())
    }
}

impl HostRegion {
    /// Appends `len` bytes at `addr` to `out`, page by page straight from the region (no
    /// zero-filled buffer first). Nothing is appended on an error.
    pub fn read_append(&self, addr: u64, len: usize, out: &mut Vec<u8>) -> Result<(), BusError> {
        out.reserve(len);
        self.access(addr, len, |p, _| out.extend_from_slice(p))
    }
}

impl DmaMemory for HostRegion {
    fn page_size(&self) -> usize {
        REGION_PAGE
    }

    fn alloc(&self, pages: usize) -> Option<u64> {
        self.used.alloc(pages).map(|first| self.base + (first * REGION_PAGE) as u64)
    }

    fn free(&self, addr: u64, pages: usize) {
        if let Some(first) = addr.checked_sub(self.base).map(|o| (o / REGION_PAGE as u64) as usize) {
            self.used.free(first, pages);
        }
    }

    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), BusError> {
        self.access(addr, buf.len(), |p, at| buf[at..at + p.len()].copy_from_slice(p))
    }

    fn write(&self, addr: u64, data: &[u8]) -> Result<(), BusError> {
        self.access(addr, data.len(), |p, at| p.copy_from_slice(&data[at..at + p.len()]))
    }

    /// Locks every page the runs cover (each lock is taken once, in the runs' order, and held
    /// for the call: a DMA write into one of them waits until `f` returns) and lends their
    /// bytes where they lie.
    fn lend(&self, runs: &[(u64, usize)], f: &mut dyn FnMut(&[&[u8]])) -> Result<(), BusError> {
        let mut pages = Vec::new();
        let mut spans = Vec::new();
        // The highest page locked: a page above it is new without a search (the usual case:
        // a buffer's pages in rising order).
        let mut highest = None;
        for &(addr, len) in runs {
            let end = addr.checked_add(len as u64).ok_or(BusError::Unsupported { addr })?;
            if addr < self.base || end > self.base + self.len_bytes() {
                return Err(BusError::Unsupported { addr });
            }
            let mut at = addr - self.base;
            let mut left = len;
            while left > 0 {
                let page = (at / REGION_PAGE as u64) as usize;
                let off = (at % REGION_PAGE as u64) as usize;
                let n = left.min(REGION_PAGE - off);
                // Runs of one request are distinct buffers, so a page comes once; a page met
                // again (overlapping runs) reuses its guard instead of locking it twice.
                let seen = highest.is_some_and(|h| page <= h);
                let found = if seen { pages.iter().position(|&(p, _)| p == page) } else { None };
                let held = match found {
                    Some(i) => i,
                    None => {
                        pages.push((page, lock(&self.pages[page])));
                        highest = highest.max(Some(page));
                        pages.len() - 1
                    }
                };
                spans.push((held, off, n));
                at += n as u64;
                left -= n;
            }
        }
        let slices: Vec<&[u8]> = spans.iter().map(|&(held, off, n)| &pages[held].1[off..off + n]).collect();
        f(&slices);
        Ok(())
    }

    fn lends_in_place(&self) -> bool {
        true
    }

    /// Locks the run's pages in order (held for the call, like [`lend`](DmaMemory::lend)) and
    /// lends them for writing where they lie.
    fn lend_mut(&self, addr: u64, len: usize, f: &mut dyn FnMut(&mut [&mut [u8]])) -> Result<(), BusError> {
        let end = addr.checked_add(len as u64).ok_or(BusError::Unsupported { addr })?;
        if addr < self.base || end > self.base + self.len_bytes() {
            return Err(BusError::Unsupported { addr });
        }
        let first = ((addr - self.base) / REGION_PAGE as u64) as usize;
        let last = (end - self.base).div_ceil(REGION_PAGE as u64) as usize;
        let mut guards: Vec<_> = self.pages[first..last].iter().map(lock).collect();
        let mut off = ((addr - self.base) % REGION_PAGE as u64) as usize;
        let mut left = len;
        let mut slices = Vec::with_capacity(guards.len());
        for g in &mut guards {
            let n = left.min(REGION_PAGE - off);
            slices.push(&mut g[off..off + n]);
            left -= n;
            off = 0;
        }
        f(&mut slices);
        Ok(())
    }
}

/// First-fit allocation of runs of pages: the lowest free run, so that buffers are reused while
/// they are still in the CPU's caches (with one request at a time the same pages serve every
/// request). Searching on from where the last run ended instead walked the whole region, every
/// buffer cold, and `bench nvme` read less per second with it (over afxdp and in-process).
/// Reuse at once is safe for the NVMe driver: the buffers of a command that timed out are
/// quarantined, never freed.
pub struct PageMap {
    /// Whether each page is used, and an index below which every page is used.
    state: Mutex<(Vec<bool>, usize)>,
}

impl PageMap {
    /// `pages` free pages.
    pub fn new(pages: usize) -> PageMap {
        PageMap { state: Mutex::new((vec![false; pages], 0)) }
    }

    /// Index of the first of `pages` free pages, now used.
    pub fn alloc(&self, pages: usize) -> Option<usize> {
        let mut g = lock(&self.state);
        let (used, full_below) = &mut *g;
        let n = used.len();
        if pages == 0 || pages > n {
            return None;
        }
        let mut run = 0;
        for i in *full_below..n {
            run = if used[i] { 0 } else { run + 1 };
            if run == pages {
                let first = i + 1 - pages;
                used[first..=i].iter_mut().for_each(|u| *u = true);
                if first == *full_below {
                    *full_below = i + 1;
                }
                return Some(first);
            }
        }
        None
    }

    /// Frees `pages` pages from index `first` (out-of-range indices are ignored).
    pub fn free(&self, first: usize, pages: usize) {
        let mut g = lock(&self.state);
        let (used, full_below) = &mut *g;
        if let Some(s) = used.get_mut(first..first.saturating_add(pages)) {
            s.iter_mut().for_each(|u| *u = false);
            *full_below = (*full_below).min(first);
        }
    }

    /// Pages allocated now.
    pub fn in_use(&self) -> usize {
        lock(&self.state).0.iter().filter(|u| **u).count()
    }
}

/// A [`HostRegion`] lent to a host bridge: device reads and writes at `base + offset` land in it.
pub struct RegionView(pub Arc<HostRegion>);

impl DmaRegion for RegionView {
    fn len(&self) -> u64 {
        self.0.len_bytes()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) {
        // The bridge keeps accesses inside the region; a failure would leave zeroes.
        if DmaMemory::read(&*self.0, self.0.base() + offset, buf).is_err() {
            buf.fill(0);
        }
    }
    fn write(&self, offset: u64, data: &[u8]) {
        let _ = DmaMemory::write(&*self.0, self.0.base() + offset, data);
    }
    fn append(&self, offset: u64, len: usize, out: &mut Vec<u8>) {
        if self.0.read_append(self.0.base() + offset, len, out).is_err() {
            out.resize(out.len() + len, 0);
        }
    }
}

/// What a failed bridge request is to a driver (the NVMe driver's, and the NIC driver's): the
/// [`BusError`] of an MMIO access at `addr`.
pub fn bridge_error(e: BridgeError, addr: u64) -> BusError {
    match e {
        BridgeError::Timeout(_) => BusError::Timeout,
        BridgeError::Completion(CplStatus::UnsupportedRequest) => BusError::Unsupported { addr },
        BridgeError::Completion(_) => BusError::Rejected("the device answered Completer Abort"),
        BridgeError::BadRequest(_) => BusError::Rejected("request the bridge cannot build"),
        other => BusError::Down(other.to_string()),
    }
}

#[cfg(test)]
mod page_map_tests {
    use super::PageMap;

    /// The lowest run of `pages` free pages, by a plain scan from 0.
    fn lowest_run(used: &[bool], pages: usize) -> Option<usize> {
        (0..used.len()).find(|&s| s + pages <= used.len() && used[s..s + pages].iter().all(|u| !u))
    }

    proptest::proptest! {
        /// Any sequence of allocations and frees gives exactly what a plain first-fit scan does.
        #[test]
        fn allocates_the_lowest_free_run(ops in proptest::collection::vec((proptest::bool::ANY, 1usize..9, 0usize..64), 1..300)) {
            let map = PageMap::new(48);
            let mut model = vec![false; 48];
            let mut live: Vec<(usize, usize)> = Vec::new();
            for (alloc, pages, pick) in ops {
                if alloc || live.is_empty() {
                    let want = lowest_run(&model, pages);
                    let got = map.alloc(pages);
                    proptest::prop_assert_eq!(got, want);
                    if let Some(first) = got {
                        model[first..first + pages].iter_mut().for_each(|u| *u = true);
                        live.push((first, pages));
                    }
                } else {
                    let (first, pages) = live.swap_remove(pick % live.len());
                    map.free(first, pages);
                    model[first..first + pages].iter_mut().for_each(|u| *u = false);
                }
                proptest::prop_assert_eq!(map.in_use(), model.iter().filter(|u| **u).count());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_lends_runs_in_order_and_refuses_what_lies_outside() {
        let r = HostRegion::new(0x10_0000, 4);
        let bytes: Vec<u8> = (0..4 * REGION_PAGE).map(|i| (i % 251) as u8).collect();
        DmaMemory::write(&r, 0x10_0000, &bytes).unwrap();
        // Runs out of order, across page edges, and two on one page (locked once).
        let runs = [(0x10_0000 + 9000, 5000), (0x10_0000 + 10, 100), (0x10_0000 + 200, 4000)];
        let mut got = Vec::new();
        r.lend(&runs, &mut |slices| slices.iter().for_each(|s| got.extend_from_slice(s))).unwrap();
        let want: Vec<u8> =
            runs.iter().flat_map(|&(a, n)| bytes[(a - 0x10_0000) as usize..][..n].iter().copied()).collect();
        assert_eq!(got, want);
        let mut called = false;
        assert!(r.lend(&[(0x10_0000 + 3 * 4096, 4097)], &mut |_| called = true).is_err());
        assert!(r.lend(&[(u64::MAX - 10, 100)], &mut |_| called = true).is_err());
        assert!(!called);
    }

    #[test]
    fn a_region_lends_a_run_for_writing_page_by_page_and_refuses_what_lies_outside() {
        let r = HostRegion::new(0x10_0000, 4);
        let mut sizes = Vec::new();
        r.lend_mut(0x10_0000 + 4000, 4096 + 200, &mut |slices| {
            sizes = slices.iter().map(|s| s.len()).collect();
            let mut k = 0u8;
            for s in slices.iter_mut() {
                for b in s.iter_mut() {
                    *b = k;
                    k = k.wrapping_add(1);
                }
            }
        })
        .unwrap();
        assert_eq!(sizes, [96, 4096, 104], "the run is cut at page boundaries");
        let mut back = vec![0u8; 4096 + 200];
        DmaMemory::read(&r, 0x10_0000 + 4000, &mut back).unwrap();
        assert!(back.iter().enumerate().all(|(i, b)| *b == i as u8), "written where it lies");
        let mut called = false;
        assert!(r.lend_mut(0x10_0000 + 3 * 4096, 4097, &mut |_| called = true).is_err());
        assert!(r.lend_mut(u64::MAX - 10, 100, &mut |_| called = true).is_err());
        assert!(!called);
        r.lend_mut(0x10_0000 + 4 * 4096, 0, &mut |s| assert!(s.iter().all(|s| s.is_empty()))).unwrap();
    }
}
