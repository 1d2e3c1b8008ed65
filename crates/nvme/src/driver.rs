//! The user-space NVMe driver (host side; runs over the host bridge). It reaches the controller's
//! BAR0 through [`Bar`] (MMIO read/write TLPs through the host bridge, or direct calls in
//! [`crate::local`]), keeps its queues, PRP lists and data buffers in [`DmaMemory`] (host memory
//! regions the device may DMA to, with their bus addresses), and learns of completions from MSI-X
//! interrupts ([`InterruptWait`]) or by polling the completion queues ([`CompletionMode`]).
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
//! N requests in flight on N pairs. Completion entries the driver does not expect (a late answer
//! to a command that timed out) are counted and dropped, never matched to a newer command: command
//! identifiers advance monotonically per queue.
//!
//! Every error carries the NVMe status (type, code and the specification's name) or says which
//! wait timed out.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::command::{admin_opcode, feature, nvm_opcode, Completion, Sqe, CQE_LEN, SQE_LEN};
use crate::controller::{cc, cmb, csts, reg};
use crate::prp;
use crate::status::Status;
use crate::{BusError, HostMemory};

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
}

/// Host memory the device may DMA to: the driver allocates its queues, PRP lists and data
/// buffers here and addresses them by bus address.
///
/// Contract for implementers: `alloc` returns page-aligned, physically (bus-) contiguous memory;
/// `read` of up to 64 bytes at an aligned address sees a device write of that range all at once
/// (so a completion entry is never seen half written).
pub trait DmaMemory: Send + Sync {
    /// Page size of the allocator (the driver uses it as the NVMe memory page size; 4096).
    fn page_size(&self) -> usize {
        4096
    }
    /// Allocates `pages` contiguous pages (contents unspecified: the driver writes what it
    /// needs, and zeroes completion queues itself); `None` when the region is exhausted.
    fn alloc(&self, pages: usize) -> Option<u64>;
    /// Frees what `alloc` returned.
    fn free(&self, addr: u64, pages: usize);
    /// Reads host memory at a bus address.
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), BusError>;
    /// Writes host memory at a bus address.
    fn write(&self, addr: u64, data: &[u8]) -> Result<(), BusError>;
}

/// Waiting for MSI-X interrupts, with eventfd semantics: a signal that arrives while nobody waits
/// is remembered, so checking a queue and then waiting loses nothing.
pub trait InterruptWait: Send + Sync {
    /// Blocks until `vector` has fired since the last successful wait on it (then consumes the
    /// event and returns true) or `timeout` passes (false).
    fn wait_vector(&self, vector: u16, timeout: Duration) -> bool;
}

/// How the driver learns of completions. Every CQ has interrupts enabled (IEN) either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompletionMode {
    /// Sleep on the queue's MSI-X vector.
    Interrupt,
    /// Poll the completion queue's phase tag in host memory for
    /// [`DriverConfig::poll_spin`] (spinning, then yielding the CPU), then sleep on the MSI-X
    /// vector as [`CompletionMode::Interrupt`] does: a completion that comes soon is seen
    /// without a wake-up, a slow one costs no more CPU than that.
    Poll,
}

/// Settings of the driver.
#[derive(Debug, Clone)]
pub struct DriverConfig {
    /// I/O queue pairs wanted (the controller may grant fewer).
    pub io_queues: u16,
    /// Entries per I/O queue (capped by CAP.MQES + 1).
    pub queue_entries: u32,
    /// Admin queue entries.
    pub admin_entries: u32,
    /// Completion by interrupt or polling.
    pub completion: CompletionMode,
    /// MSI-X vectors the function has (from its MSI-X capability): vector 0 is the admin
    /// queue's; I/O queue i gets vector 1 + (i - 1) mod (vectors - 1), or 0 if there is one.
    pub msix_vectors: u16,
    /// Time an I/O request may take before it fails with [`DriverError::Timeout`].
    pub io_timeout: Duration,
    /// Most data one request has in flight (its DMA buffers): a larger read or write goes in
    /// windows of this size. Size the DMA region for (threads x this) plus the queues.
    pub max_inflight_bytes: usize,
    /// Time an admin command may take.
    pub admin_timeout: Duration,
    /// How long [`CompletionMode::Poll`] polls before it sleeps on the interrupt.
    pub poll_spin: Duration,
    /// Use the controller's Controller Memory Buffer when it has one (CAP.CMBS) and the [`Bar`]
    /// maps it: I/O submission queues, PRP lists and write data go there with posted writes,
    /// so the controller reads none of them across the bus.
    pub use_cmb: bool,
}

impl Default for DriverConfig {
    fn default() -> Self {
        DriverConfig {
            io_queues: 4,
            queue_entries: 256,
            admin_entries: 32,
            completion: CompletionMode::Interrupt,
            msix_vectors: 17,
            io_timeout: Duration::from_secs(30),
            max_inflight_bytes: 4 << 20,
            admin_timeout: Duration::from_secs(10),
            poll_spin: Duration::from_micros(50),
            use_cmb: true,
        }
    }
}

/// What went wrong in the driver.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DriverError {
    /// The controller completed a command with an error status.
    #[error("NVMe command {opcode:#04x} on queue {qid} failed: {status}")]
    Status {
        /// The NVMe status (type, code, name).
        status: Status,
        /// Opcode of the failed command.
        opcode: u8,
        /// Submission queue it was on (0 = admin).
        qid: u16,
    },
    /// A wait timed out.
    #[error("timed out waiting for {0}")]
    Timeout(String),
    /// An MMIO or host-memory access failed.
    #[error("bus error: {0}")]
    Bus(#[from] BusError),
    /// CSTS.CFS: the controller hit a fatal error; reset it (build a new driver).
    #[error("controller fatal status (CSTS.CFS) set; the controller must be reset")]
    ControllerFatal,
    /// The DMA memory region has no room for the buffer.
    #[error("out of DMA memory ({0} contiguous pages wanted)")]
    OutOfDmaMemory(usize),
    /// The controller lacks something the driver needs.
    #[error("controller not supported: {0}")]
    Unsupported(String),
    /// The caller passed a bad argument (out of range, misaligned, wrong length).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl DriverError {
    /// The POSIX errno that best describes the failure to a block-device client (NBD replies,
    /// for example): `EINVAL` for bad arguments and out-of-range or invalid-field statuses,
    /// `ETIMEDOUT` for timeouts, `ENOMEM` for exhausted DMA memory, `ENOTSUP` for missing
    /// features, `EIO` for everything else.
    pub fn errno(&self) -> i32 {
        const EIO: i32 = 5;
        const ENOMEM: i32 = 12;
        const EINVAL: i32 = 22;
        const ENOTSUP: i32 = 95;
        const ETIMEDOUT: i32 = 110;
        match self {
            DriverError::InvalidArgument(_) => EINVAL,
            DriverError::Status { status, .. }
                if status.same_code(Status::LBA_OUT_OF_RANGE)
                    || status.same_code(Status::INVALID_FIELD)
                    || status.same_code(Status::INVALID_NAMESPACE) =>
            {
                EINVAL
            }
            DriverError::Timeout(_) => ETIMEDOUT,
            DriverError::OutOfDmaMemory(_) => ENOMEM,
            DriverError::Unsupported(_) => ENOTSUP,
            _ => EIO,
        }
    }
}

type Result<T, E = DriverError> = std::result::Result<T, E>;

/// What Identify said about the controller and namespace 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// Serial number.
    pub serial: String,
    /// Model number.
    pub model: String,
    /// Firmware revision.
    pub firmware: String,
    /// Maximum data transfer size in bytes.
    pub max_transfer_bytes: usize,
    /// A volatile write cache is present (Flush matters).
    pub volatile_write_cache: bool,
    /// Optional NVM command support bits (ONCS).
    pub oncs: u16,
    /// The namespace used.
    pub nsid: u32,
    /// Namespace size in logical blocks.
    pub blocks: u64,
    /// Logical block size in bytes.
    pub lba_size: u32,
}

/// What the driver keeps in the controller's memory buffer ([`NvmeDriver::cmb_in_use`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmbUse {
    /// Size of the buffer.
    pub bytes: u64,
    /// I/O submission queues live there.
    pub submission_queues: bool,
    /// PRP lists live there.
    pub prp_lists: bool,
    /// Write data lives there.
    pub write_data: bool,
    /// Pages allocated now.
    pub pages_in_use: usize,
}

/// Counters of the driver.
#[derive(Debug, Default)]
pub struct DriverStats {
    /// Commands submitted.
    pub commands: AtomicU64,
    /// Completion entries that matched no outstanding command (dropped).
    pub stray_completions: AtomicU64,
    /// Interrupt waits that returned with an event.
    pub interrupts: AtomicU64,
    /// DMA pages never freed because a command using them failed without a completion (the
    /// device might still write to them).
    pub quarantined_pages: AtomicU64,
}

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
}

/// Where a buffer lives: host memory the controller reads by DMA, or its own memory buffer.
#[derive(Clone, Copy)]
enum Pool<'a> {
    Host(&'a dyn DmaMemory),
    Cmb(&'a CmbMemory),
}

/// A DMA buffer owned by one request; freed on drop.
struct DmaBuf<'a> {
    pool: Pool<'a>,
    addr: u64,
    pages: usize,
}

impl<'a> DmaBuf<'a> {
    fn new(mem: &'a dyn DmaMemory, bytes: usize) -> Result<DmaBuf<'a>> {
        let pages = bytes.div_ceil(mem.page_size()).max(1);
        let addr = mem.alloc(pages).ok_or(DriverError::OutOfDmaMemory(pages))?;
        Ok(DmaBuf { pool: Pool::Host(mem), addr, pages })
    }

    /// A buffer in the controller memory buffer when `cmb` has room, else in host memory.
    fn prefer_cmb(cmb: Option<&'a CmbMemory>, mem: &'a dyn DmaMemory, bytes: usize) -> Result<DmaBuf<'a>> {
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
struct PageMap {
    /// Whether each page is used, and an index below which every page is used.
    state: Mutex<(Vec<bool>, usize)>,
}

impl PageMap {
    fn new(pages: usize) -> PageMap {
        PageMap { state: Mutex::new((vec![false; pages], 0)) }
    }

    /// Index of the first of `pages` free pages, now used.
    fn alloc(&self, pages: usize) -> Option<usize> {
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
    fn free(&self, first: usize, pages: usize) {
        let mut g = lock(&self.state);
        let (used, full_below) = &mut *g;
        if let Some(s) = used.get_mut(first..first.saturating_add(pages)) {
            s.iter_mut().for_each(|u| *u = false);
            *full_below = (*full_below).min(first);
        }
    }

    fn in_use(&self) -> usize {
        lock(&self.state).0.iter().filter(|u| **u).count()
    }
}

/// The controller's memory buffer as the driver uses it (NVMe 1.4 section 4.7 [2.0: 8.2]): bus
/// address, the BAR it is written through, what may live there, and a page allocator over it.
struct CmbMemory {
    /// Bus address of its first byte (CMBMSC.CBA).
    base: u64,
    /// The BAR (CMBLOC.BIR) and the buffer's offset in it.
    bir: u8,
    bar_offset: u64,
    sqs: bool,
    lists: bool,
    write_data: bool,
    bytes: u64,
    pages: PageMap,
}

impl CmbMemory {
    fn contains(&self, addr: u64) -> bool {
        addr.checked_sub(self.base).is_some_and(|o| o < self.bytes)
    }
}

/// One command of a request with the memory it owns until it completes.
struct Pending<'a> {
    sqe: Sqe,
    data: Option<DmaBuf<'a>>,
    lists: Vec<DmaBuf<'a>>,
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
            },
            admin: Mutex::new(admin),
            io: Vec::new(),
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
    fn put(&self, addr: u64, data: &[u8]) -> Result<()> {
        match &self.cmb {
            Some(c) if c.contains(addr) => self.bar.write_bar(c.bir, c.bar_offset + (addr - c.base), data)?,
            _ => self.mem.write(addr, data)?,
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
        let mut cmds = [Pending { sqe, data: None, lists: Vec::new() }];
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
        let mut cmds = [Pending { sqe, data: None, lists: Vec::new() }];
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
                    let sqe = &mut cmds[next].sqe;
                    sqe.cid = q.next_cid;
                    q.next_cid = q.next_cid.wrapping_add(1);
                    batch.extend_from_slice(&sqe.to_bytes());
                    q.sq_tail = (q.sq_tail + 1) % q.entries;
                    inflight.push((sqe.cid, next));
                    next += 1;
                    if q.sq_tail == 0 {
                        self.put(q.sq_base + u64::from(first) * SQE_LEN as u64, &batch)?;
                        batch.clear();
                        first = 0;
                    }
                }
                if !batch.is_empty() {
                    self.put(q.sq_base + u64::from(first) * SQE_LEN as u64, &batch)?;
                }
                self.bar.write32(reg::sq_tail(q.qid), q.sq_tail)?;
            }
            // Reap everything posted.
            let mut reaped = 0;
            loop {
                let mut b = [0u8; CQE_LEN];
                self.mem.read(q.cq_base + u64::from(q.cq_head) * CQE_LEN as u64, &mut b)?;
                let c = Completion::parse(&b);
                if c.phase != q.phase {
                    break;
                }
                q.cq_head += 1;
                if q.cq_head == q.entries {
                    q.cq_head = 0;
                    q.phase = !q.phase;
                }
                reaped += 1;
                if u32::from(c.sq_head) < q.entries {
                    q.sq_head = u32::from(c.sq_head);
                }
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
    fn pick_queue(&self) -> MutexGuard<'_, QueuePair> {
        // Relaxed: the counter only spreads threads over queues; the locks order the queues.
        let start = self.next_queue.fetch_add(1, Ordering::Relaxed);
        let n = self.io.len();
        for i in 0..n {
            if let Ok(g) = self.io[(start + i) % n].try_lock() {
                return g;
            }
        }
        lock(&self.io[start % n])
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

    fn check_blocks(&self, lba: u64, blocks: u64) -> Result<()> {
        match lba.checked_add(blocks) {
            Some(end) if end <= self.identity.blocks => Ok(()),
            _ => Err(DriverError::InvalidArgument(format!(
                "blocks {lba}..+{blocks} beyond the namespace's {} blocks",
                self.identity.blocks
            ))),
        }
    }

    /// A read or write command for `len` bytes at `lba` with a fresh DMA buffer (written with
    /// `data` for a write).
    fn rw_command(
        &self,
        write: bool,
        lba: u64,
        len: usize,
        data: Option<&[u8]>,
        fua: bool,
    ) -> Result<Pending<'_>> {
        let cmb = self.cmb.as_ref();
        let buf = match data {
            Some(_) => DmaBuf::prefer_cmb(cmb.filter(|c| c.write_data), &*self.mem, len)?,
            None => DmaBuf::new(&*self.mem, len)?,
        };
        let n = prp::list_pages_needed(buf.addr, len, self.page);
        let mut lists = Vec::with_capacity(n);
        for _ in 0..n {
            lists.push(DmaBuf::prefer_cmb(cmb.filter(|c| c.lists), &*self.mem, self.page)?);
        }
        let addrs: Vec<u64> = lists.iter().map(|l| l.addr).collect();
        let plan = prp::build(buf.addr, len, self.page, &addrs);
        for (addr, bytes) in &plan.lists {
            self.put(*addr, bytes)?;
        }
        if let Some(d) = data {
            self.put(buf.addr, d)?;
        }
        let blocks = (len / self.identity.lba_size as usize) as u32;
        let sqe = Sqe {
            opcode: if write { nvm_opcode::WRITE } else { nvm_opcode::READ },
            nsid: self.identity.nsid,
            prp1: plan.prp1,
            prp2: plan.prp2,
            cdw: [lba as u32, (lba >> 32) as u32, (blocks - 1) | u32::from(fua) << 30, 0, 0, 0],
            ..Sqe::default()
        };
        Ok(Pending { sqe, data: Some(buf), lists })
    }

    /// Bytes of one request in flight at once: whole commands, at least one.
    fn window_bytes(&self) -> usize {
        let chunk = self.chunk_bytes();
        (self.cfg.max_inflight_bytes / chunk).max(1) * chunk
    }

    fn chunk_bytes(&self) -> usize {
        let lba = self.identity.lba_size as usize;
        self.identity.max_transfer_bytes.min(65536 * lba) / lba * lba
    }

    /// Reads `buf.len()` bytes (a multiple of the block size) starting at block `lba`.
    pub fn read(&self, lba: u64, buf: &mut [u8]) -> Result<()> {
        let bs = self.identity.lba_size as usize;
        if !buf.len().is_multiple_of(bs) {
            return Err(DriverError::InvalidArgument(format!(
                "read length {} is not a multiple of {bs}",
                buf.len()
            )));
        }
        self.check_blocks(lba, (buf.len() / bs) as u64)?;
        let chunk = self.chunk_bytes();
        let window = self.window_bytes();
        for (w, group) in buf.chunks_mut(window).enumerate() {
            let lba = lba + (w * window / bs) as u64;
            let mut cmds = Vec::new();
            for (i, part) in group.chunks(chunk).enumerate() {
                cmds.push(self.rw_command(false, lba + (i * chunk / bs) as u64, part.len(), None, false)?);
            }
            self.run_io(&mut cmds)?;
            for (part, cmd) in group.chunks_mut(chunk).zip(&cmds) {
                if let Some(d) = &cmd.data {
                    self.mem.read(d.addr, part)?;
                }
            }
        }
        Ok(())
    }

    /// Writes `data` (a multiple of the block size) starting at block `lba`; with `fua` the data
    /// is durable when this returns.
    pub fn write(&self, lba: u64, data: &[u8], fua: bool) -> Result<()> {
        let bs = self.identity.lba_size as usize;
        if !data.len().is_multiple_of(bs) {
            return Err(DriverError::InvalidArgument(format!(
                "write length {} is not a multiple of {bs}",
                data.len()
            )));
        }
        self.check_blocks(lba, (data.len() / bs) as u64)?;
        let chunk = self.chunk_bytes();
        let window = self.window_bytes();
        for (w, group) in data.chunks(window).enumerate() {
            let lba = lba + (w * window / bs) as u64;
            let mut cmds = Vec::new();
            for (i, part) in group.chunks(chunk).enumerate() {
                cmds.push(self.rw_command(
                    true,
                    lba + (i * chunk / bs) as u64,
                    part.len(),
                    Some(part),
                    fua,
                )?);
            }
            self.run_io(&mut cmds)?;
        }
        Ok(())
    }

    /// Flush: everything written so far is durable.
    pub fn flush(&self) -> Result<()> {
        let sqe = Sqe { opcode: nvm_opcode::FLUSH, nsid: self.identity.nsid, ..Sqe::default() };
        self.run_io(&mut [Pending { sqe, data: None, lists: Vec::new() }])?;
        Ok(())
    }

    /// Write Zeroes over `blocks` blocks at `lba` (split in commands of 65536 blocks); with
    /// `deallocate` the controller may deallocate them (they read back as zeroes either way).
    pub fn write_zeroes(&self, lba: u64, blocks: u64, deallocate: bool) -> Result<()> {
        self.check_blocks(lba, blocks)?;
        let mut cmds = Vec::new();
        let mut at = 0;
        while at < blocks {
            let n = (blocks - at).min(65536);
            let l = lba + at;
            let sqe = Sqe {
                opcode: nvm_opcode::WRITE_ZEROES,
                nsid: self.identity.nsid,
                cdw: [l as u32, (l >> 32) as u32, (n as u32 - 1) | u32::from(deallocate) << 25, 0, 0, 0],
                ..Sqe::default()
            };
            cmds.push(Pending { sqe, data: None, lists: Vec::new() });
            at += n;
        }
        self.run_io(&mut cmds)?;
        Ok(())
    }

    /// Dataset Management with the Deallocate attribute over `blocks` blocks at `lba`: they read
    /// back as zeroes afterwards.
    pub fn deallocate(&self, lba: u64, blocks: u64) -> Result<()> {
        self.check_blocks(lba, blocks)?;
        let mut ranges = Vec::new();
        let mut at = 0;
        while at < blocks {
            let n = (blocks - at).min(u64::from(u32::MAX));
            ranges.push((lba + at, n as u32));
            at += n;
        }
        let mut cmds = Vec::new();
        for group in ranges.chunks(256) {
            let buf = DmaBuf::new(&*self.mem, 4096)?;
            let mut bytes = Vec::with_capacity(group.len() * 16);
            for &(slba, n) in group {
                bytes.extend_from_slice(&0u32.to_le_bytes());
                bytes.extend_from_slice(&n.to_le_bytes());
                bytes.extend_from_slice(&slba.to_le_bytes());
            }
            self.mem.write(buf.addr, &bytes)?;
            let sqe = Sqe {
                opcode: nvm_opcode::DATASET_MANAGEMENT,
                nsid: self.identity.nsid,
                prp1: buf.addr,
                cdw: [group.len() as u32 - 1, 1 << 2, 0, 0, 0, 0],
                ..Sqe::default()
            };
            cmds.push(Pending { sqe, data: Some(buf), lists: Vec::new() });
        }
        if !cmds.is_empty() {
            self.run_io(&mut cmds)?;
        }
        Ok(())
    }

    fn byte_range(&self, offset: u64, len: usize) -> Result<()> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.size_bytes() => Ok(()),
            _ => Err(DriverError::InvalidArgument(format!(
                "bytes {offset}..+{len} beyond the namespace's {} bytes",
                self.size_bytes()
            ))),
        }
    }

    /// Reads `buf.len()` bytes at byte `offset` (any alignment; split into blocks and
    /// MDTS-sized commands in flight together).
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.byte_range(offset, buf.len())?;
        let bs = u64::from(self.identity.lba_size);
        if offset.is_multiple_of(bs) && (buf.len() as u64).is_multiple_of(bs) {
            return self.read(offset / bs, buf);
        }
        let first = offset / bs;
        let end = (offset + buf.len() as u64).div_ceil(bs);
        let mut tmp = vec![0u8; ((end - first) * bs) as usize];
        self.read(first, &mut tmp)?;
        let skip = (offset - first * bs) as usize;
        buf.copy_from_slice(&tmp[skip..skip + buf.len()]);
        Ok(())
    }

    /// Writes `data` at byte `offset`. Partial blocks at either end are read, merged and written
    /// back (not atomic against a concurrent write to the same block).
    pub fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.byte_range(offset, data.len())?;
        let bs = u64::from(self.identity.lba_size);
        if offset.is_multiple_of(bs) && (data.len() as u64).is_multiple_of(bs) {
            return self.write(offset / bs, data, fua);
        }
        let first = offset / bs;
        let end = (offset + data.len() as u64).div_ceil(bs);
        let mut tmp = vec![0u8; ((end - first) * bs) as usize];
        let bsz = bs as usize;
        self.read(first, &mut tmp[..bsz])?;
        if end - first > 1 {
            let last = tmp.len() - bsz;
            self.read(end - 1, &mut tmp[last..])?;
        }
        let skip = (offset - first * bs) as usize;
        tmp[skip..skip + data.len()].copy_from_slice(data);
        self.write(first, &tmp, fua)
    }

    /// Zeroes `len` bytes at byte `offset`: whole blocks with Write Zeroes (deallocating them if
    /// `may_trim`), partial ones by read-modify-write.
    pub fn write_zeroes_at(&self, offset: u64, len: u64, may_trim: bool) -> Result<()> {
        self.byte_range(offset, usize::try_from(len).unwrap_or(usize::MAX))?;
        let bs = u64::from(self.identity.lba_size);
        let end = offset + len;
        let a = offset.div_ceil(bs) * bs;
        let b = (end / bs) * bs;
        if a >= b {
            return self.write_at(offset, &vec![0u8; len as usize], false);
        }
        if offset < a {
            self.write_at(offset, &vec![0u8; (a - offset) as usize], false)?;
        }
        self.write_zeroes(a / bs, (b - a) / bs, may_trim)?;
        if b < end {
            self.write_at(b, &vec![0u8; (end - b) as usize], false)?;
        }
        Ok(())
    }

    /// Deallocates the whole blocks inside `len` bytes at `offset` (a hint: partial blocks at the
    /// ends are left as they are).
    pub fn trim_at(&self, offset: u64, len: u64) -> Result<()> {
        self.byte_range(offset, usize::try_from(len).unwrap_or(usize::MAX))?;
        let bs = u64::from(self.identity.lba_size);
        let a = offset.div_ceil(bs);
        let b = (offset + len) / bs;
        if a < b {
            self.deallocate(a, b - a)?;
        }
        Ok(())
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

fn alloc_queue_pair(mem: &dyn DmaMemory, qid: u16, entries: u32, vector: u16) -> Result<QueuePair> {
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
