//! The user-space NVMe driver (host side; runs over the host bridge). It reaches the controller's
//! BAR0 through [`Bar`] (MMIO read/write TLPs through the host bridge, or direct calls in
//! [`crate::local`]), keeps its queues, PRP lists and data buffers in [`DmaMemory`] (host memory
//! regions the device may DMA to, with their bus addresses: `lanbus_bridge::dma`), and learns of
//! completions from MSI-X interrupts ([`InterruptWait`]) or by polling the completion queues
//! ([`CompletionMode`]).
//!
//! Initialization follows NVMe base specification 1.4 section 7.6.1 [2.0: 3.5.1]: disable and
//! wait for CSTS.RDY = 0 (bounded by CAP.TO), admin queues (AQA, ASQ, ACQ), enable and wait for
//! RDY, Identify Controller, Identify active namespace list, Identify Namespace, Set Features
//! Number of Queues, then Create I/O Completion Queue / Create I/O Submission Queue for each pair.
//!
//! Concurrency: every queue pair sits behind its own lock; a request takes one free pair (a
//! thread tries them round-robin and blocks on one only when all are busy), submits all the
//! commands it needs (a large transfer is split at MDTS and its pieces are in flight together, up
//! to the queue depth), rings the doorbell once and reaps its completions. So N threads have up to
//! N requests in flight on N pairs. A client with many requests at once takes a pair of its own
//! instead ([`NvmeDriver::stream`], in `stream.rs`): one thread submits, rings and reaps any
//! number of requests on it. Completion entries the driver does not expect (a late answer
//! to a command that timed out) are counted and dropped, never matched to a newer command: command
//! identifiers advance monotonically per queue.
//!
//! Every error carries the NVMe status (type, code and the specification's name) or says which
//! wait timed out.
//!
//! This file holds the [`Bar`] trait the driver runs over, initialization, the admin commands it
//! sends, the submission and completion engine and shutdown; the settings, error, identity and
//! counter types are in `types.rs`, the driver's buffers (in host DMA memory or the controller
//! memory buffer) in `memory.rs`, the block I/O methods in `io.rs`, the streams in `stream.rs`.

mod io;
mod memory;
mod stream;
mod types;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub use stream::{Finished, IoStream};
pub use types::{CmbUse, CompletionMode, DriverConfig, DriverError, DriverStats, Identity};

use crate::command::{admin_opcode, feature, Completion, Sqe, CQE_LEN, SQE_LEN};
use crate::controller::{cc, cmb, csts, reg};
use crate::prp;
use crate::status::Status;
use lanbus_bridge::dma::{BusError, DmaMemory, InterruptWait, PageMap, REGION_PAGE};
use memory::{alloc_queue_pair, CmbMemory, DmaBuf};

/// MMIO access to the controller's BAR0, at byte offsets from its start.
pub trait Bar: Send + Sync {
    /// 32-bit read.
    fn read32(&self, offset: u64) -> Result<u32, BusError>;
    /// 64-bit read (CAP, ASQ, ACQ).
    fn read64(&self, offset: u64) -> Result<u64, BusError>;
    /// 32-bit write (registers, doorbells).
    fn write32(&self, offset: u64, value: u32) -> Result<(), BusError>;
    /// 64-bit write (ASQ, ACQ, CMBMSC).
    fn write64(&self, offset: u64, value: u64) -> Result<(), BusError>;
    /// Bus address of the function's memory BAR `bir` as the host assigned it; `None` when it
    /// is not mapped (the driver then leaves a Controller Memory Buffer there unused).
    fn bar_address(&self, bir: u8) -> Option<u64> {
        let _ = bir;
        None
    }
    /// Posted write of `data` at `offset` of memory BAR `bir` (the Controller Memory Buffer).
    fn write_bar(&self, bir: u8, offset: u64, data: &[u8]) -> Result<(), BusError> {
        let _ = (bir, data);
        Err(BusError::Unsupported { addr: offset })
    }
    /// [`Bar::write_bar`] of `data[range]`, bytes the caller shares: a BAR whose writes leave
    /// from another thread copies them there (holding `data` until then) instead of on the
    /// caller's. The default writes them here.
    fn write_bar_shared(
        &self,
        bir: u8,
        offset: u64,
        data: &Arc<Vec<u8>>,
        range: std::ops::Range<usize>,
    ) -> Result<(), BusError> {
        match data.get(range) {
            Some(bytes) => self.write_bar(bir, offset, bytes),
            None => Err(BusError::Unsupported { addr: offset }),
        }
    }
}

type Result<T, E = DriverError> = std::result::Result<T, E>;

struct QueuePair {
    qid: u16,
    entries: u32,
    sq_base: u64,
    cq_base: u64,
    sq_pages: usize,
    cq_pages: usize,
    sq_tail: u32,
    sq_head: u32,
    cq_head: u32,
    phase: bool,
    vector: u16,
    next_cid: u16,
    /// The SQ lives in the Controller Memory Buffer (entries are written with `Bar::write_bar`).
    sq_in_cmb: bool,
}

impl QueuePair {
    fn free_slots(&self) -> u32 {
        self.entries - 1 - (self.sq_tail + self.entries - self.sq_head) % self.entries
    }

    /// The completion entry at the completion queue's head, if the controller has written it
    /// (its phase tag is the current one).
    fn peek_completion(&self, mem: &dyn DmaMemory) -> Result<Option<Completion>> {
        let mut b = [0u8; CQE_LEN];
        mem.read(self.cq_base + u64::from(self.cq_head) * CQE_LEN as u64, &mut b)?;
        let c = Completion::parse(&b);
        Ok((c.phase == self.phase).then_some(c))
    }

    /// Takes the entry at the completion queue's head if it has been written: advances the head
    /// (flipping the phase at the wrap) and the submission queue head it reports.
    fn next_completion(&mut self, mem: &dyn DmaMemory) -> Result<Option<Completion>> {
        let Some(c) = self.peek_completion(mem)? else { return Ok(None) };
        self.cq_head += 1;
        if self.cq_head == self.entries {
            self.cq_head = 0;
            self.phase = !self.phase;
        }
        if u32::from(c.sq_head) < self.entries {
            self.sq_head = u32::from(c.sq_head);
        }
        Ok(Some(c))
    }
}

/// One command of a request with the memory it owns until it completes.
struct Pending<'a> {
    sqe: Sqe,
    data: Option<DmaBuf<'a>>,
    lists: Vec<DmaBuf<'a>>,
    /// A write's data, copied into `data` just before the command goes into its queue (so the
    /// command follows its own data, not the whole request's).
    fill: Option<&'a [u8]>,
}

/// The user-space NVMe driver: one controller, namespace 1, several I/O queue pairs. All
/// methods take `&self` and may be called from many threads.
pub struct NvmeDriver {
    bar: Arc<dyn Bar>,
    mem: Arc<dyn DmaMemory>,
    irq: Arc<dyn InterruptWait>,
    cfg: DriverConfig,
    page: usize,
    ready_timeout: Duration,
    identity: Identity,
    admin: Mutex<QueuePair>,
    io: Vec<Mutex<QueuePair>>,
    /// Which I/O queue pairs an [`IoStream`] holds (the plain calls leave them alone).
    reserved: Vec<AtomicBool>,
    cmb: Option<CmbMemory>,
    next_queue: AtomicUsize,
    shut_down: AtomicBool,
    stats: DriverStats,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a queue lock leaves the queue consistent enough to keep using (the
    // worst case is a stray completion, which is dropped): recover from poisoning.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn ascii(b: &[u8]) -> String {
    String::from_utf8_lossy(b).trim_end_matches([' ', '\0']).to_string()
}

impl NvmeDriver {
    /// Resets and initializes the controller behind `bar` and creates the I/O queues.
    pub fn new(
        bar: Arc<dyn Bar>,
        mem: Arc<dyn DmaMemory>,
        irq: Arc<dyn InterruptWait>,
        cfg: DriverConfig,
    ) -> Result<NvmeDriver> {
        if cfg.io_queues == 0 || cfg.queue_entries < 2 || cfg.admin_entries < 2 || cfg.msix_vectors == 0 {
            return Err(DriverError::InvalidArgument(
                "io_queues, msix_vectors >= 1; queue entries >= 2".into(),
            ));
        }
        let cap = bar.read64(reg::CAP)?;
        let mqes = (cap & 0xFFFF) as u32 + 1;
        let ready_timeout = Duration::from_millis(500 * ((cap >> 24) & 0xFF).max(1));
        if cap & (1 << 37) == 0 {
            return Err(DriverError::Unsupported("CAP.CSS lacks the NVM command set".into()));
        }
        let page = mem.page_size();
        let mpsmin = 4096usize << ((cap >> 48) & 0xF);
        let mpsmax = 4096usize << ((cap >> 52) & 0xF);
        if page < mpsmin || page > mpsmax || !page.is_power_of_two() {
            return Err(DriverError::Unsupported(format!(
                "memory page size {page} outside CAP.MPSMIN..MPSMAX"
            )));
        }
        let mps = page.trailing_zeros() - 12;

        // Disable, then wait for !RDY.
        let cc_now = bar.read32(reg::CC)?;
        if cc_now & cc::EN != 0 {
            bar.write32(reg::CC, cc_now & !cc::EN)?;
        }
        wait_csts(&*bar, ready_timeout, |c| c & csts::RDY == 0, "CSTS.RDY = 0 after disable")?;

        let admin_entries = cfg.admin_entries.min(mqes).min(4096);
        let admin = alloc_queue_pair(&*mem, 0, admin_entries, 0)?;
        bar.write32(reg::AQA, (admin_entries - 1) | ((admin_entries - 1) << 16))?;
        bar.write64(reg::ASQ, admin.sq_base)?;
        bar.write64(reg::ACQ, admin.cq_base)?;
        let cc_val = cc::EN | (mps << cc::MPS_SHIFT) | (6 << cc::IOSQES_SHIFT) | (4 << cc::IOCQES_SHIFT);
        bar.write32(reg::CC, cc_val)?;
        wait_csts(&*bar, ready_timeout, |c| c & csts::RDY != 0, "CSTS.RDY = 1 after enable")?;

        let mut drv = NvmeDriver {
            bar,
            mem,
            irq,
            page,
            ready_timeout,
            identity: Identity {
                serial: String::new(),
                model: String::new(),
                firmware: String::new(),
                max_transfer_bytes: 0,
                volatile_write_cache: false,
                oncs: 0,
                nsid: 0,
                blocks: 0,
                lba_size: 0,
                sgl: false,
            },
            admin: Mutex::new(admin),
            io: Vec::new(),
            reserved: Vec::new(),
            cmb: None,
            next_queue: AtomicUsize::new(0),
            shut_down: AtomicBool::new(false),
            stats: DriverStats::default(),
            cfg,
        };
        drv.identify()?;
        if drv.cfg.use_cmb && cap & cmb::CAP_CMBS != 0 {
            drv.cmb = drv.map_cmb()?;
        }
        drv.create_io_queues(mqes)?;
        Ok(drv)
    }

    fn identify(&mut self) -> Result<()> {
        let ctrl = self.identify_page(1, 0)?;
        let mdts = ctrl[77];
        let max_transfer_bytes = if mdts == 0 { 1 << 20 } else { (4096usize << mdts).min(1 << 24) };
        if ctrl[512] & 0xF > 6 || ctrl[512] >> 4 < 6 || ctrl[513] & 0xF > 4 || ctrl[513] >> 4 < 4 {
            return Err(DriverError::Unsupported("SQES/CQES do not allow 64/16-byte entries".into()));
        }
        let list = self.identify_page(2, 0)?;
        let nsid = u32::from_le_bytes([list[0], list[1], list[2], list[3]]);
        if nsid == 0 {
            return Err(DriverError::Unsupported("the controller has no active namespace".into()));
        }
        let ns = self.identify_page(0, nsid)?;
        let blocks = u64::from_le_bytes(ns[0..8].try_into().unwrap_or([0; 8]));
        let format = usize::from(ns[26] & 0xF);
        let lbaf = u32::from_le_bytes(ns[128 + 4 * format..132 + 4 * format].try_into().unwrap_or([0; 4]));
        let lbads = (lbaf >> 16) & 0xFF;
        if lbaf & 0xFFFF != 0 || !(9..=16).contains(&lbads) || blocks == 0 {
            return Err(DriverError::Unsupported(format!(
                "namespace format (LBAF {lbaf:#x}, {blocks} blocks)"
            )));
        }
        self.identity = Identity {
            serial: ascii(&ctrl[4..24]),
            model: ascii(&ctrl[24..64]),
            firmware: ascii(&ctrl[64..72]),
            max_transfer_bytes,
            volatile_write_cache: ctrl[525] & 1 != 0,
            oncs: u16::from_le_bytes([ctrl[520], ctrl[521]]),
            nsid,
            blocks,
            lba_size: 1 << lbads,
            sgl: ctrl[536] & 0b11 != 0,
        };
        Ok(())
    }

    /// Enables the Controller Memory Buffer at the bus address its BAR has (CMBMSC.CRE, then
    /// CBA and CMSE) when the [`Bar`] maps that BAR; `None` leaves it unused.
    fn map_cmb(&self) -> Result<Option<CmbMemory>> {
        self.bar.write64(reg::CMBMSC, cmb::CRE)?;
        let loc = self.bar.read32(reg::CMBLOC)?;
        let sz = self.bar.read32(reg::CMBSZ)?;
        let szu = (sz >> 8) & 0xF;
        let bir = (loc & 7) as u8;
        let Some(bar) = self.bar.bar_address(bir).filter(|_| szu <= 6) else {
            self.bar.write64(reg::CMBMSC, 0)?;
            return Ok(None);
        };
        let unit = 4096u64 << (4 * szu);
        let bar_offset = u64::from(loc >> 12) * unit;
        let bytes = u64::from(sz >> 12) * unit;
        let base = bar + bar_offset;
        let pages = (bytes / REGION_PAGE as u64).min(1 << 20) as usize;
        if pages == 0 || self.page != REGION_PAGE || base & 0xFFF != 0 {
            self.bar.write64(reg::CMBMSC, 0)?;
            return Ok(None);
        }
        self.bar.write64(reg::CMBMSC, base | cmb::CRE | cmb::CMSE)?;
        if self.bar.read32(reg::CMBSTS)? & cmb::CBAI != 0 {
            self.bar.write64(reg::CMBMSC, 0)?;
            return Ok(None);
        }
        Ok(Some(CmbMemory {
            base,
            bir,
            bar_offset,
            sqs: sz & cmb::SQS != 0,
            lists: sz & cmb::LISTS != 0,
            write_data: sz & cmb::WDS != 0,
            bytes: (pages * REGION_PAGE) as u64,
            pages: PageMap::new(pages),
        }))
    }

    /// Writes `data` at bus address `addr`: through the BAR when it lies in the controller
    /// memory buffer, else into host memory.
    /// [`NvmeDriver::put`] of `data[range]`, bytes the caller shares (see
    /// [`Bar::write_bar_shared`]).
    fn put_shared(&self, addr: u64, data: &Arc<Vec<u8>>, range: std::ops::Range<usize>) -> Result<()> {
        match &self.cmb {
            Some(c) if c.contains(addr) => {
                self.bar.write_bar_shared(c.bir, c.bar_offset + (addr - c.base), data, range)?
            }
            _ => match data.get(range) {
                Some(bytes) => self.put(addr, bytes)?,
                None => return Err(DriverError::InvalidArgument("a write's range outside its data".into())),
            },
        }
        Ok(())
    }

    fn put(&self, addr: u64, data: &[u8]) -> Result<()> {
        match &self.cmb {
            Some(c) if c.contains(addr) => self.bar.write_bar(c.bir, c.bar_offset + (addr - c.base), data)?,
            _ => {
                self.mem.write(addr, data)?;
                // Statistics counter: Relaxed, nothing is ordered by it.
                self.stats.copy_bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    fn free_queue_pair(&self, q: &QueuePair) {
        match self.cmb.as_ref().filter(|_| q.sq_in_cmb) {
            Some(c) => c.pages.free(((q.sq_base - c.base) / REGION_PAGE as u64) as usize, q.sq_pages),
            None => self.mem.free(q.sq_base, q.sq_pages),
        }
        self.mem.free(q.cq_base, q.cq_pages);
    }

    /// Whether the driver uses a Controller Memory Buffer (and for what).
    pub fn cmb_in_use(&self) -> Option<CmbUse> {
        self.cmb.as_ref().map(|c| CmbUse {
            bytes: c.bytes,
            submission_queues: c.sqs,
            prp_lists: c.lists,
            write_data: c.write_data,
            pages_in_use: c.pages.in_use(),
        })
    }

    fn identify_page(&self, cns: u32, nsid: u32) -> Result<Vec<u8>> {
        let buf = DmaBuf::new(&*self.mem, 4096)?;
        let plan = prp::build(buf.addr, 4096, self.page, &[]);
        let mut sqe =
            Sqe { opcode: admin_opcode::IDENTIFY, nsid, prp1: plan.prp1, prp2: plan.prp2, ..Sqe::default() };
        sqe.cdw[0] = cns;
        self.admin_checked(sqe)?;
        let mut out = vec![0u8; 4096];
        self.mem.read(buf.addr, &mut out)?;
        Ok(out)
    }

    fn create_io_queues(&mut self, mqes: u32) -> Result<()> {
        let want = u32::from(self.cfg.io_queues - 1);
        let c = self.admin_checked(Sqe {
            opcode: admin_opcode::SET_FEATURES,
            cdw: [u32::from(feature::NUMBER_OF_QUEUES), want | want << 16, 0, 0, 0, 0],
            ..Sqe::default()
        })?;
        let granted = (c.dw0 & 0xFFFF).min(c.dw0 >> 16) + 1;
        let n = granted.min(u32::from(self.cfg.io_queues)) as u16;
        let entries = self.cfg.queue_entries.min(mqes);
        // Poll mode sleeps on the interrupt too once it has polled long enough.
        let interrupts = true;
        for qid in 1..=n {
            let vector =
                if self.cfg.msix_vectors > 1 { 1 + (qid - 1) % (self.cfg.msix_vectors - 1) } else { 0 };
            let mut qp = alloc_queue_pair(&*self.mem, qid, entries, vector)?;
            if let Some(c) = self.cmb.as_ref().filter(|c| c.sqs) {
                if let Some(i) = c.pages.alloc(qp.sq_pages) {
                    self.mem.free(qp.sq_base, qp.sq_pages);
                    qp.sq_base = c.base + (i * REGION_PAGE) as u64;
                    qp.sq_in_cmb = true;
                }
            }
            let size = (entries - 1) << 16 | u32::from(qid);
            let r = self.admin_checked(Sqe {
                opcode: admin_opcode::CREATE_CQ,
                prp1: qp.cq_base,
                cdw: [size, 1 | u32::from(interrupts) << 1 | u32::from(vector) << 16, 0, 0, 0, 0],
                ..Sqe::default()
            });
            let r = r.and_then(|_| {
                self.admin_checked(Sqe {
                    opcode: admin_opcode::CREATE_SQ,
                    prp1: qp.sq_base,
                    cdw: [size, 1 | u32::from(qid) << 16, 0, 0, 0, 0],
                    ..Sqe::default()
                })
            });
            if let Err(e) = r {
                self.free_queue_pair(&qp);
                return Err(e);
            }
            self.io.push(Mutex::new(qp));
            self.reserved.push(AtomicBool::new(false));
        }
        Ok(())
    }

    /// What Identify reported.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// Number of I/O queue pairs in use.
    pub fn io_queue_count(&self) -> usize {
        self.io.len()
    }

    /// Counters.
    pub fn stats(&self) -> &DriverStats {
        &self.stats
    }

    /// The DMA memory the driver allocates from (for tests that build their own commands).
    pub fn dma(&self) -> &Arc<dyn DmaMemory> {
        &self.mem
    }

    /// Namespace size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.identity.blocks * u64::from(self.identity.lba_size)
    }

    /// Logical block size in bytes.
    pub fn block_size(&self) -> u32 {
        self.identity.lba_size
    }

    /// Submits one admin command and waits for its completion, whatever its status.
    pub fn submit_admin_raw(&self, sqe: Sqe) -> Result<Completion> {
        let mut q = lock(&self.admin);
        let mut cmds = [Pending { sqe, data: None, lists: Vec::new(), fill: None }];
        Ok(self.run(&mut q, &mut cmds, self.cfg.admin_timeout)?[0])
    }

    /// Submits one command on I/O queue pair `index` (0-based; qid = index + 1) and waits for its
    /// completion, whatever its status. The caller owns any memory its PRPs point to.
    pub fn submit_io_raw(&self, index: usize, sqe: Sqe) -> Result<Completion> {
        let q = self
            .io
            .get(index)
            .ok_or_else(|| DriverError::InvalidArgument(format!("no I/O queue {index}")))?;
        let mut q = lock(q);
        let mut cmds = [Pending { sqe, data: None, lists: Vec::new(), fill: None }];
        Ok(self.run(&mut q, &mut cmds, self.cfg.io_timeout)?[0])
    }

    fn admin_checked(&self, sqe: Sqe) -> Result<Completion> {
        let c = self.submit_admin_raw(sqe)?;
        if c.status.is_success() {
            Ok(c)
        } else {
            Err(DriverError::Status { status: c.status, opcode: sqe.opcode, qid: 0 })
        }
    }

    /// Runs `cmds` on queue `q`: submits as many as fit, rings once, reaps, repeats. Returns the
    /// completions in command order.
    fn run(&self, q: &mut QueuePair, cmds: &mut [Pending<'_>], timeout: Duration) -> Result<Vec<Completion>> {
        let r = self.run_inner(q, cmds, timeout);
        if r.is_err() {
            // The controller may still DMA to these buffers later (a late completion after a
            // timeout): never hand them out again.
            for p in cmds.iter_mut() {
                for b in p.data.take().into_iter().chain(p.lists.drain(..)) {
                    // Statistics counter: Relaxed, nothing is ordered by it.
                    self.stats.quarantined_pages.fetch_add(b.pages as u64, Ordering::Relaxed);
                    std::mem::forget(b);
                }
            }
        }
        r
    }

    fn run_inner(
        &self,
        q: &mut QueuePair,
        cmds: &mut [Pending<'_>],
        timeout: Duration,
    ) -> Result<Vec<Completion>> {
        let deadline = Instant::now() + timeout;
        let mut results: Vec<Option<Completion>> = vec![None; cmds.len()];
        // (cid, index) of commands in flight.
        let mut inflight: Vec<(u16, usize)> = Vec::with_capacity(cmds.len().min(q.entries as usize));
        let mut next = 0;
        let mut done = 0;
        let mut spins = 0u32;
        let mut poll_since = Instant::now();
        let mut batch: Vec<u8> = Vec::new();
        while done < cmds.len() {
            if next < cmds.len() && q.free_slots() > 0 {
                // Entries go out in runs of consecutive slots: one write per run.
                let mut first = q.sq_tail;
                batch.clear();
                while next < cmds.len() && q.free_slots() > 0 {
                    // A command with data to copy first goes alone: its data, its entry, the
                    // doorbell, so the controller starts on it while the next one's data is
                    // copied (over a fabric, posted into its memory buffer).
                    if let (Some(fill), Some(buf)) = (cmds[next].fill.take(), &cmds[next].data) {
                        let start = Instant::now();
                        self.put(buf.addr, fill)?;
                        // Statistics counter: Relaxed, nothing is ordered by it.
                        self.stats.copy_ns.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    }
                    let sqe = &mut cmds[next].sqe;
                    sqe.cid = q.next_cid;
                    q.next_cid = q.next_cid.wrapping_add(1);
                    batch.extend_from_slice(&sqe.to_bytes());
                    q.sq_tail = (q.sq_tail + 1) % q.entries;
                    inflight.push((sqe.cid, next));
                    next += 1;
                    let data_next = next < cmds.len() && cmds[next].fill.is_some();
                    if q.sq_tail == 0 || data_next {
                        self.put(q.sq_base + u64::from(first) * SQE_LEN as u64, &batch)?;
                        batch.clear();
                        first = q.sq_tail;
                        if data_next {
                            break;
                        }
                    }
                }
                if !batch.is_empty() {
                    self.put(q.sq_base + u64::from(first) * SQE_LEN as u64, &batch)?;
                }
                self.bar.write32(reg::sq_tail(q.qid), q.sq_tail)?;
            }
            // Reap everything posted.
            let mut reaped = 0;
            while let Some(c) = q.next_completion(&*self.mem)? {
                reaped += 1;
                match inflight.iter().position(|&(cid, _)| cid == c.cid) {
                    Some(i) if c.sq_id == q.qid => {
                        let (_, index) = inflight.swap_remove(i);
                        results[index] = Some(c);
                        done += 1;
                    }
                    // Statistics counters: Relaxed, nothing is ordered by them.
                    _ => _ = self.stats.stray_completions.fetch_add(1, Ordering::Relaxed),
                }
            }
            if reaped > 0 {
                self.bar.write32(reg::cq_head(q.qid), q.cq_head)?;
                spins = 0;
                continue;
            }
            if next < cmds.len() && q.free_slots() > 0 {
                continue; // more to submit before waiting
            }
            if done == cmds.len() {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                if self.bar.read32(reg::CSTS)? & csts::CFS != 0 {
                    return Err(DriverError::ControllerFatal);
                }
                return Err(DriverError::Timeout(format!(
                    "{} of {} commands on queue {} (opcode {:#04x})",
                    cmds.len() - done,
                    cmds.len(),
                    q.qid,
                    cmds[0].sqe.opcode
                )));
            }
            let polling = q.qid != 0 && self.cfg.completion == CompletionMode::Poll;
            if polling && spins == 0 {
                poll_since = Instant::now();
            }
            if polling && poll_since.elapsed() < self.cfg.poll_spin {
                // Poll the phase tag: spin briefly, then give the CPU to whoever delivers the
                // completion (on a small machine that may be the bridge's own thread).
                spins += 1;
                if spins < 64 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            } else {
                // Short slices: a vector shared by several queues may have its event consumed
                // by another waiter, and the controller may have died (CFS) without a word.
                let slice = (deadline - now).min(Duration::from_millis(5));
                if self.irq.wait_vector(q.vector, slice) {
                    self.stats.interrupts.fetch_add(1, Ordering::Relaxed);
                } else if self.bar.read32(reg::CSTS)? & csts::CFS != 0 {
                    return Err(DriverError::ControllerFatal);
                }
            }
        }
        // Statistics counter: Relaxed, nothing is ordered by it.
        self.stats.commands.fetch_add(cmds.len() as u64, Ordering::Relaxed);
        Ok(results
            .into_iter()
            .map(|c| {
                c.unwrap_or(Completion {
                    dw0: 0,
                    dw1: 0,
                    sq_head: 0,
                    sq_id: 0,
                    cid: 0,
                    phase: false,
                    status: Status::INTERNAL_ERROR,
                })
            })
            .collect())
    }

    /// Takes a free I/O queue pair (trying each once from a rotating start), or waits for one.
    /// Pairs an [`IoStream`] holds are skipped: the flag is read under the pair's lock, and a
    /// stream takes that lock once after setting it, so no plain request is left on its pair.
    fn pick_queue(&self) -> MutexGuard<'_, QueuePair> {
        // Relaxed: the counter only spreads threads over queues; the locks order the queues.
        let start = self.next_queue.fetch_add(1, Ordering::Relaxed);
        let n = self.io.len();
        // Acquire: pairs with the stream's reservation (see above).
        let free = |i: usize| !self.reserved[i].load(Ordering::Acquire);
        for i in 0..n {
            let i = (start + i) % n;
            if let Ok(g) = self.io[i].try_lock() {
                if free(i) {
                    return g;
                }
            }
        }
        let i = start % n;
        let g = lock(&self.io[i]);
        if free(i) {
            return g;
        }
        drop(g);
        // The first pair is never reserved.
        lock(&self.io[0])
    }

    /// Runs I/O commands on one queue pair and turns the first error status into an error.
    fn run_io(&self, cmds: &mut [Pending<'_>]) -> Result<Vec<Completion>> {
        let mut q = self.pick_queue();
        let qid = q.qid;
        let done = self.run(&mut q, cmds, self.cfg.io_timeout)?;
        drop(q);
        for (c, p) in done.iter().zip(cmds.iter()) {
            if !c.status.is_success() {
                return Err(DriverError::Status { status: c.status, opcode: p.sqe.opcode, qid });
            }
        }
        Ok(done)
    }

    /// Orderly shutdown (1.4 section 7.6.2): deletes the I/O queues, sets CC.SHN to normal
    /// shutdown and waits for CSTS.SHST = complete (the controller has made its data durable).
    /// Called by drop if not called before; later calls do nothing.
    pub fn shutdown(&self) -> Result<()> {
        // AcqRel: the first caller wins; nothing else is published through this flag.
        if self.shut_down.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        if self.bar.read32(reg::CSTS)? & csts::CFS != 0 {
            return Err(DriverError::ControllerFatal);
        }
        for q in self.io.iter().rev() {
            let q = lock(q);
            let qid = u32::from(q.qid);
            self.admin_checked(Sqe {
                opcode: admin_opcode::DELETE_SQ,
                cdw: [qid, 0, 0, 0, 0, 0],
                ..Sqe::default()
            })?;
            self.admin_checked(Sqe {
                opcode: admin_opcode::DELETE_CQ,
                cdw: [qid, 0, 0, 0, 0, 0],
                ..Sqe::default()
            })?;
        }
        let c = self.bar.read32(reg::CC)?;
        self.bar.write32(reg::CC, (c & !(3 << cc::SHN_SHIFT)) | 1 << cc::SHN_SHIFT)?;
        wait_csts(
            &*self.bar,
            self.ready_timeout,
            |s| s & csts::SHST_MASK == csts::SHST_COMPLETE,
            "CSTS.SHST = complete",
        )?;
        Ok(())
    }
}

impl Drop for NvmeDriver {
    fn drop(&mut self) {
        let _ = self.shutdown();
        for q in self.io.iter().chain(std::iter::once(&self.admin)) {
            self.free_queue_pair(&lock(q));
        }
    }
}

fn wait_csts(bar: &dyn Bar, timeout: Duration, done: impl Fn(u32) -> bool, what: &str) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let s = bar.read32(reg::CSTS)?;
        if done(s) {
            return Ok(());
        }
        if s & csts::CFS != 0 && s != u32::MAX {
            return Err(DriverError::ControllerFatal);
        }
        if Instant::now() >= deadline {
            return Err(DriverError::Timeout(format!("{what} (CSTS {s:#x}, CAP.TO {timeout:?})")));
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}
