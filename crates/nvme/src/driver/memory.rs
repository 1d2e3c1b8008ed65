//! Host DMA memory (host side of the driver). [`HostRegion`] is the host memory of tests and the
//! in-process join: it is the driver's [`DmaMemory`] and, seen from the controller model, its
//! [`HostMemory`]. The rest is what the driver allocates there: per-request buffers ([`DmaBuf`]),
//! in host memory or in the controller's memory buffer ([`CmbMemory`], NVMe base specification
//! 1.4 section 4.7 [2.0: 8.2]), the first-fit page allocator both use ([`PageMap`]), and the
//! memory of a submission / completion queue pair (1.4 section 4.1 [2.0: 3.3.1]).

use std::sync::Mutex;

use super::{lock, DmaMemory, DriverError, QueuePair, Result};
use crate::command::{CQE_LEN, SQE_LEN};
use crate::{BusError, HostMemory};

/// Host memory for tests and the in-process join: `pages` pages of 4 KiB at bus address `base`,
/// with a first-fit allocator of contiguous pages. Each page has its own lock, so an access of up
/// to one page that does not cross a page boundary is atomic (completion entries, submission
/// entries); concurrent users of different pages do not contend.
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

/// The device's view of a [`HostRegion`] (DMA from the controller model, in-process).
impl HostMemory for &HostRegion {
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), BusError> {
        DmaMemory::read(*self, addr, buf)
    }
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), BusError> {
        DmaMemory::write(*self, addr, data)
    }
}

/// Where a buffer lives: host memory the controller reads by DMA, or its own memory buffer.
#[derive(Clone, Copy)]
enum Pool<'a> {
    Host(&'a dyn DmaMemory),
    Cmb(&'a CmbMemory),
}

/// A DMA buffer owned by one request; freed on drop.
pub(super) struct DmaBuf<'a> {
    pool: Pool<'a>,
    pub(super) addr: u64,
    pub(super) pages: usize,
}

impl<'a> DmaBuf<'a> {
    pub(super) fn new(mem: &'a dyn DmaMemory, bytes: usize) -> Result<DmaBuf<'a>> {
        let pages = bytes.div_ceil(mem.page_size()).max(1);
        let addr = mem.alloc(pages).ok_or(DriverError::OutOfDmaMemory(pages))?;
        Ok(DmaBuf { pool: Pool::Host(mem), addr, pages })
    }

    /// A buffer in the controller memory buffer when `cmb` has room, else in host memory.
    pub(super) fn prefer_cmb(
        cmb: Option<&'a CmbMemory>,
        mem: &'a dyn DmaMemory,
        bytes: usize,
    ) -> Result<DmaBuf<'a>> {
        if let Some(c) = cmb {
            let pages = bytes.div_ceil(REGION_PAGE).max(1);
            if let Some(addr) = c.pages.alloc(pages).map(|i| c.base + (i * REGION_PAGE) as u64) {
                return Ok(DmaBuf { pool: Pool::Cmb(c), addr, pages });
            }
        }
        DmaBuf::new(mem, bytes)
    }
}

impl Drop for DmaBuf<'_> {
    fn drop(&mut self) {
        match self.pool {
            Pool::Host(mem) => mem.free(self.addr, self.pages),
            Pool::Cmb(c) => c.pages.free(((self.addr - c.base) / REGION_PAGE as u64) as usize, self.pages),
        }
    }
}

/// First-fit allocation of runs of pages: the lowest free run, so that buffers are reused while
/// they are still in the CPU's caches (with one request at a time the same pages serve every
/// request). Searching on from where the last run ended instead walked the whole region, every
/// buffer cold, and `bench nvme` read less per second with it (over afxdp and in-process).
/// Reuse at once is safe: the buffers of a command that timed out are quarantined, never freed.
pub(super) struct PageMap {
    /// Whether each page is used, and an index below which every page is used.
    state: Mutex<(Vec<bool>, usize)>,
}

impl PageMap {
    pub(super) fn new(pages: usize) -> PageMap {
        PageMap { state: Mutex::new((vec![false; pages], 0)) }
    }

    /// Index of the first of `pages` free pages, now used.
    pub(super) fn alloc(&self, pages: usize) -> Option<usize> {
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
    pub(super) fn free(&self, first: usize, pages: usize) {
        let mut g = lock(&self.state);
        let (used, full_below) = &mut *g;
        if let Some(s) = used.get_mut(first..first.saturating_add(pages)) {
            s.iter_mut().for_each(|u| *u = false);
            *full_below = (*full_below).min(first);
        }
    }

    pub(super) fn in_use(&self) -> usize {
        lock(&self.state).0.iter().filter(|u| **u).count()
    }
}

/// The controller's memory buffer as the driver uses it (NVMe 1.4 section 4.7 [2.0: 8.2]): bus
/// address, the BAR it is written through, what may live there, and a page allocator over it.
pub(super) struct CmbMemory {
    /// Bus address of its first byte (CMBMSC.CBA).
    pub(super) base: u64,
    /// The BAR (CMBLOC.BIR) and the buffer's offset in it.
    pub(super) bir: u8,
    pub(super) bar_offset: u64,
    pub(super) sqs: bool,
    pub(super) lists: bool,
    pub(super) write_data: bool,
    pub(super) bytes: u64,
    pub(super) pages: PageMap,
}

impl CmbMemory {
    pub(super) fn contains(&self, addr: u64) -> bool {
        addr.checked_sub(self.base).is_some_and(|o| o < self.bytes)
    }
}

/// Allocates the submission and completion queue of pair `qid` in host memory, the completion
/// queue zeroed.
pub(super) fn alloc_queue_pair(
    mem: &dyn DmaMemory,
    qid: u16,
    entries: u32,
    vector: u16,
) -> Result<QueuePair> {
    let page = mem.page_size();
    let sq_pages = (entries as usize * SQE_LEN).div_ceil(page);
    let cq_pages = (entries as usize * CQE_LEN).div_ceil(page);
    let sq_base = mem.alloc(sq_pages).ok_or(DriverError::OutOfDmaMemory(sq_pages))?;
    let Some(cq_base) = mem.alloc(cq_pages) else {
        mem.free(sq_base, sq_pages);
        return Err(DriverError::OutOfDmaMemory(cq_pages));
    };
    // Phase tags start at 0: the controller's first pass writes 1.
    if let Err(e) = mem.write(cq_base, &vec![0u8; cq_pages * page]) {
        mem.free(sq_base, sq_pages);
        mem.free(cq_base, cq_pages);
        return Err(e.into());
    }
    Ok(QueuePair {
        qid,
        entries,
        sq_base,
        cq_base,
        sq_pages,
        cq_pages,
        sq_tail: 0,
        sq_head: 0,
        cq_head: 0,
        phase: true,
        vector,
        next_cid: 0,
        sq_in_cmb: false,
    })
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
