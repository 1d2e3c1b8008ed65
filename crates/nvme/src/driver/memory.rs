//! What the driver allocates in DMA memory (host side of the driver): per-request buffers
//! ([`DmaBuf`]), in host memory or in the controller's memory buffer ([`CmbMemory`], NVMe base
//! specification 1.4 section 4.7 [2.0: 8.2], with the bridge's first-fit [`PageMap`] over it),
//! and the memory of a submission / completion queue pair (1.4 section 4.1 [2.0: 3.3.1]). A
//! [`HostRegion`] is the driver's [`DmaMemory`] and, seen from the controller model in the
//! in-process join, its [`HostMemory`].

use lanbus_bridge::dma::{BusError, DmaMemory, HostRegion, PageMap, REGION_PAGE};

use super::{DriverError, QueuePair, Result};
use crate::command::{CQE_LEN, SQE_LEN};
use crate::HostMemory;

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
