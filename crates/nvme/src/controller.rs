//! The NVMe controller model (device side; runs on the device bridge). NVMe base specification
//! 1.4 (2.0 section numbers in brackets where they moved):
//!
//! - 3.1 [3.1.3] controller registers: CAP, VS, INTMS/INTMC, CC, CSTS, NSSR, AQA, ASQ, ACQ and the
//!   doorbells (DSTRD = 0: SQ y tail at 0x1000 + 8y, CQ y head at 0x1000 + 8y + 4). Registers are
//!   accessed with aligned 4-byte accesses, the 64-bit ones (CAP, ASQ, ACQ) also with aligned
//!   8-byte accesses; anything else is rejected ([`BusError::Rejected`], the bridge answers it
//!   with a Completer Abort / UR). BAR0 is [`BAR0_SIZE`] bytes: registers and doorbells below
//!   [`MSIX_TABLE_OFFSET`], the MSI-X table and PBA above it (served by the bridge's
//!   configuration-space model, not here).
//! - 7.6.1 [3.5.1] initialization, CC.EN 0->1 (validated: CSS, MPS, AQA; invalid values set
//!   CSTS.CFS), 1->0 (controller reset: all queues deleted), CC.SHN (flush, CSTS.SHST complete).
//! - 4.1 [3.3.1] queues: free-running checks of every doorbell value the host writes (an invalid
//!   doorbell write is counted and ignored), phase tags, the SQ head pointer in every completion,
//!   a full completion queue stalls its submission queues until the host frees entries.
//! - 5 admin commands: Create/Delete I/O SQ/CQ, Identify (CNS 0, 1, 2), Get/Set Features, Abort
//!   (reports "not aborted": commands complete synchronously), Get Log Page (error, SMART,
//!   firmware slot), Asynchronous Event Request (held outstanding up to AERL+1; no events are
//!   generated).
//! - 6 NVM commands: Read, Write, Flush, Write Zeroes, Dataset Management (deallocate).
//! - 4.3 PRPs (see [`crate::prp`]); MSI-X: one vector per completion queue, signalled once per
//!   batch of completions posted to it when its IEN bit is set.
//! - 4.7 [8.2] Controller Memory Buffer (optional, [`ControllerConfig::cmb_bytes`]): BAR2 memory
//!   that may hold I/O submission queues, PRP lists and write data (CMBSZ.SQS, LISTS, WDS),
//!   enabled by the host at the bus address it writes to CMBMSC.CBA. Every address the host
//!   gives (queue bases, PRP entries, list pointers) is looked up there first, so a host that
//!   uses it has the controller read nothing across the bus: over the fabric a command costs
//!   posted writes only, no round trip. An access that straddles the buffer's edge fails with
//!   Invalid Use of Controller Memory Buffer.
//!
//! The model is a plain state machine: registers change only in `bar0_write`, all DMA happens
//! inside [`Controller::process`] through the [`HostMemory`] passed in, so the device bridge
//! thread decides when work runs. Nothing the host writes (registers, queue entries, PRP lists)
//! can panic it: every index is bounded before use and every bad command completes with the
//! status the specification names. A DMA failure on a data transfer completes the command with
//! Data Transfer Error; a failure fetching commands or posting completions sets CSTS.CFS
//! (Controller Fatal Status) and stops all processing until the host resets the controller.

use crate::backing::Backing;
use crate::command::{
    decode_admin, decode_io, feature, AdminCommand, Completion, DataPtr, IoCommand, Sqe, CQE_LEN, SQE_LEN,
};
use crate::prp::{self, Run};
use crate::status::Status;
use crate::{BusError, HostMemory, InterruptSink};

/// Register offsets in BAR0 (1.4 section 3.1, Figure 78).
pub mod reg {
    /// Controller Capabilities (64-bit).
    pub const CAP: u64 = 0x00;
    /// Version.
    pub const VS: u64 = 0x08;
    /// Interrupt Mask Set.
    pub const INTMS: u64 = 0x0C;
    /// Interrupt Mask Clear.
    pub const INTMC: u64 = 0x10;
    /// Controller Configuration.
    pub const CC: u64 = 0x14;
    /// Controller Status.
    pub const CSTS: u64 = 0x1C;
    /// NVM Subsystem Reset.
    pub const NSSR: u64 = 0x20;
    /// Admin Queue Attributes.
    pub const AQA: u64 = 0x24;
    /// Admin Submission Queue Base Address (64-bit).
    pub const ASQ: u64 = 0x28;
    /// Admin Completion Queue Base Address (64-bit).
    pub const ACQ: u64 = 0x30;
    /// Controller Memory Buffer Location.
    pub const CMBLOC: u64 = 0x38;
    /// Controller Memory Buffer Size.
    pub const CMBSZ: u64 = 0x3C;
    /// Controller Memory Buffer Memory Space Control (64-bit).
    pub const CMBMSC: u64 = 0x50;
    /// Controller Memory Buffer Status.
    pub const CMBSTS: u64 = 0x58;
    /// First doorbell (SQ 0 tail).
    pub const DOORBELLS: u64 = 0x1000;

    /// Offset of the SQ `qid` tail doorbell (DSTRD = 0).
    pub const fn sq_tail(qid: u16) -> u64 {
        DOORBELLS + 8 * qid as u64
    }
    /// Offset of the CQ `qid` head doorbell (DSTRD = 0).
    pub const fn cq_head(qid: u16) -> u64 {
        DOORBELLS + 8 * qid as u64 + 4
    }
}

/// CC fields (1.4 section 3.1.5).
pub mod cc {
    /// Enable.
    pub const EN: u32 = 1;
    /// I/O Command Set Selected (6:4), Memory Page Size (10:7), Shutdown Notification (15:14),
    /// I/O SQ Entry Size (19:16), I/O CQ Entry Size (23:20): shifts.
    pub const CSS_SHIFT: u32 = 4;
    /// MPS shift.
    pub const MPS_SHIFT: u32 = 7;
    /// SHN shift.
    pub const SHN_SHIFT: u32 = 14;
    /// IOSQES shift.
    pub const IOSQES_SHIFT: u32 = 16;
    /// IOCQES shift.
    pub const IOCQES_SHIFT: u32 = 20;
}

/// CSTS bits (1.4 section 3.1.6).
pub mod csts {
    /// Ready.
    pub const RDY: u32 = 1;
    /// Controller Fatal Status.
    pub const CFS: u32 = 2;
    /// Shutdown Status mask (3:2); 10b = shutdown processing complete.
    pub const SHST_MASK: u32 = 0b1100;
    /// Shutdown processing complete.
    pub const SHST_COMPLETE: u32 = 0b1000;
}

/// Controller Memory Buffer fields (1.4 sections 3.1.11 CMBLOC, 3.1.12 CMBSZ, 3.1.15 CMBMSC,
/// 3.1.16 CMBSTS; 2.0: 3.1.4.12 ..).
pub mod cmb {
    /// The BAR the buffer lives in (CMBLOC.BIR), at offset 0 (CMBLOC.OFST = 0).
    pub const BIR: u8 = 2;
    /// CMBSZ.SQS: submission queues may live in the buffer.
    pub const SQS: u32 = 1;
    /// CMBSZ.LISTS: PRP lists may live in the buffer.
    pub const LISTS: u32 = 1 << 2;
    /// CMBSZ.WDS: data of commands that move data from the host to the NVM may live in it.
    pub const WDS: u32 = 1 << 4;
    /// CMBSZ size-unit code this model reports (SZU = 0: 4 KiB).
    pub const UNIT_BYTES: u64 = 4096;
    /// CMBMSC.CRE: CMBLOC and CMBSZ read as their values (else as zero).
    pub const CRE: u64 = 1;
    /// CMBMSC.CMSE: the controller's memory space is enabled at CMBMSC.CBA.
    pub const CMSE: u64 = 2;
    /// CMBSTS.CBAI: the base address written to CMBMSC.CBA is invalid.
    pub const CBAI: u32 = 1;
    /// CAP.CMBS bit.
    pub const CAP_CMBS: u64 = 1 << 57;
}

/// Size of BAR0 (64-bit, non-prefetchable memory BAR).
pub const BAR0_SIZE: u64 = 0x4000;
/// Offset in BAR0 where the bridge places the MSI-X table.
pub const MSIX_TABLE_OFFSET: u64 = 0x2000;
/// Offset in BAR0 where the bridge places the MSI-X pending bit array.
pub const MSIX_PBA_OFFSET: u64 = 0x3000;
/// PCI vendor ID the model reports (Identify Controller VID/SSVID; the bridge's config space uses
/// the same): 0x1b36, the ID QEMU and other emulators use for emulated devices.
pub const PCI_VENDOR_ID: u16 = 0x1b36;
/// PCI device ID.
pub const PCI_DEVICE_ID: u16 = 0x0010;
/// PCI class code of an NVMe controller (mass storage, NVM, NVM Express).
pub const PCI_CLASS: u32 = 0x01_08_02;

/// The most I/O queue pairs the doorbell area below [`MSIX_TABLE_OFFSET`] can hold is 511; the
/// model caps at this.
pub const MAX_IO_QUEUES: u16 = 255;

/// What the device bridge's configuration-space model needs to present the controller as a PCIe
/// function: IDs, class, BAR0 (64-bit, non-prefetchable memory) and the MSI-X capability with
/// its table and PBA inside BAR0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciInfo {
    /// Vendor ID.
    pub vendor_id: u16,
    /// Device ID.
    pub device_id: u16,
    /// Class code (base class, subclass, programming interface).
    pub class_code: u32,
    /// BAR0 size in bytes.
    pub bar0_size: u64,
    /// MSI-X table size (vectors).
    pub msix_vectors: u16,
    /// MSI-X table offset in BAR0.
    pub msix_table_offset: u64,
    /// MSI-X PBA offset in BAR0.
    pub msix_pba_offset: u64,
    /// Size of BAR2 (64-bit, prefetchable), the Controller Memory Buffer; 0 when there is none.
    pub cmb_bar_size: u64,
}

/// Settings of the model.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// LBA data size in bytes: 512 or 4096.
    pub lba_size: u32,
    /// I/O queue pairs supported (1..=[`MAX_IO_QUEUES`]).
    pub max_io_queues: u16,
    /// Largest queue in entries (CAP.MQES + 1), 2..=65536.
    pub max_queue_entries: u32,
    /// MSI-X table size (vectors), 1..=256 (the table has 4 KiB of BAR0 below the PBA).
    pub msix_vectors: u16,
    /// Maximum Data Transfer Size as a power of two in units of 4 KiB (Identify MDTS), 1..=12.
    pub mdts: u8,
    /// Largest memory page size supported, as CAP.MPSMAX (page = 4 KiB << value), 0..=4.
    pub mps_max: u8,
    /// CAP.TO: worst-case time to become ready, in 500 ms units.
    pub timeout_500ms: u8,
    /// Most SQ entries fetched in one DMA read.
    pub max_fetch: usize,
    /// Controller Memory Buffer in bytes (a multiple of 4 KiB up to 1 GiB; 0: none). It sits at
    /// the start of BAR2 and may hold I/O submission queues, PRP lists and write data (CMBSZ.SQS,
    /// LISTS, WDS): a host that puts them there pushes commands and data to the controller with
    /// posted writes instead of the controller reading them across the fabric.
    pub cmb_bytes: u64,
    /// Serial number (Identify SN, up to 20 ASCII characters).
    pub serial: String,
    /// Model number (Identify MN, up to 40 ASCII characters).
    pub model: String,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            lba_size: 512,
            max_io_queues: 16,
            max_queue_entries: 1024,
            msix_vectors: 17,
            mdts: 8,
            mps_max: 4,
            timeout_500ms: 10,
            max_fetch: 32,
            cmb_bytes: 0,
            serial: "LANBUS0001".into(),
            model: "lanbus NVMe model".into(),
        }
    }
}

/// Counters of the model, for `lanbus status` and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ControllerStats {
    /// Admin commands completed.
    pub admin_commands: u64,
    /// I/O commands completed.
    pub io_commands: u64,
    /// Commands completed with a status other than success.
    pub error_completions: u64,
    /// DMA reads of submission queue entries (each fetches one or more entries).
    pub sq_fetches: u64,
    /// DMA reads and writes that failed.
    pub dma_errors: u64,
    /// Doorbell writes naming a missing queue or an out-of-range value (ignored).
    pub invalid_doorbells: u64,
    /// Register accesses rejected for size or alignment.
    pub rejected_accesses: u64,
    /// MSI-X messages signalled.
    pub interrupts: u64,
    /// Bytes read from the namespace by Read commands.
    pub bytes_read: u64,
    /// Bytes written to the namespace by Write commands.
    pub bytes_written: u64,
    /// Submitted commands dropped when their SQ was deleted while its CQ was full.
    pub dropped_on_deletion: u64,
}

#[derive(Debug, Clone, Copy)]
struct Sq {
    base: u64,
    entries: u32,
    head: u32,
    tail: u32,
    cqid: u16,
}

#[derive(Debug, Clone, Copy)]
struct Cq {
    base: u64,
    entries: u32,
    tail: u32,
    head: u32,
    phase: bool,
    vector: u16,
    interrupts: bool,
    attached_sqs: u32,
}

impl Cq {
    fn free(&self) -> u32 {
        let used = (self.tail + self.entries - self.head) % self.entries;
        self.entries - 1 - used
    }
}

#[derive(Debug, Clone, Copy)]
struct Features {
    arbitration: u32,
    power_management: u32,
    temperature_threshold: u32,
    volatile_write_cache: u32,
    interrupt_coalescing: u32,
    write_atomicity: u32,
    async_event_config: u32,
}

const DEFAULT_FEATURES: Features = Features {
    arbitration: 0,
    power_management: 0,
    temperature_threshold: 0x0157, // 343 K
    volatile_write_cache: 1,
    interrupt_coalescing: 0,
    write_atomicity: 0,
    async_event_config: 0,
};

/// Asynchronous Event Request Limit (0's based) reported in Identify.
const AERL: u8 = 3;
/// Abort Command Limit (0's based) reported in Identify.
const ACL: u8 = 3;

/// The NVMe controller model with one namespace (NSID 1).
pub struct Controller {
    cfg: ControllerConfig,
    backing: Box<dyn Backing>,
    blocks: u64,
    cc: u32,
    csts: u32,
    aqa: u32,
    asq: u64,
    acq: u64,
    intms: u32,
    page: usize,
    sqs: Vec<Option<Sq>>,
    cqs: Vec<Option<Cq>>,
    io_sqs_allowed: u16,
    io_cqs_allowed: u16,
    features: Features,
    outstanding_aers: u8,
    next_sq: usize,
    stats: ControllerStats,
    fetch: Vec<u8>,
    cqes: Vec<u8>,
    data: Vec<u8>,
    runs: Vec<Run>,
    lists: Vec<u8>,
    /// The Controller Memory Buffer's bytes (`cfg.cmb_bytes` of them).
    cmb: Vec<u8>,
    cmbmsc: u64,
    cmbsts: u32,
}

/// Host memory as the controller sees it with a Controller Memory Buffer enabled at `base`: an
/// access that lies wholly inside the buffer is served from it, one wholly outside goes to the
/// host, one that straddles its edge fails (Invalid Use of Controller Memory Buffer).
struct CmbView<'a> {
    cmb: &'a mut [u8],
    base: Option<u64>,
    host: &'a mut dyn HostMemory,
}

/// What a [`CmbView`] access across the buffer's edge fails with.
const CMB_EDGE: &str = "an access straddles the controller memory buffer's edge";

impl CmbView<'_> {
    fn locate(&self, addr: u64, len: usize) -> Result<Option<usize>, BusError> {
        let Some(base) = self.base else { return Ok(None) };
        let end = addr.checked_add(len as u64).ok_or(BusError::Unsupported { addr })?;
        let cmb_end = base + self.cmb.len() as u64;
        if addr >= base && end <= cmb_end {
            Ok(Some((addr - base) as usize))
        } else if addr < cmb_end && end > base {
            Err(BusError::Rejected(CMB_EDGE))
        } else {
            Ok(None)
        }
    }
}

impl HostMemory for CmbView<'_> {
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), BusError> {
        match self.locate(addr, buf.len())? {
            Some(at) => {
                buf.copy_from_slice(&self.cmb[at..at + buf.len()]);
                Ok(())
            }
            None => self.host.read(addr, buf),
        }
    }
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), BusError> {
        match self.locate(addr, data.len())? {
            Some(at) => {
                self.cmb[at..at + data.len()].copy_from_slice(data);
                Ok(())
            }
            None => self.host.write(addr, data),
        }
    }
    fn local(&self, addr: u64, len: usize) -> Option<&[u8]> {
        let at = self.locate(addr, len).ok()??;
        Some(&self.cmb[at..at + len])
    }
}

/// Why a controller could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A setting is out of its range.
    #[error("bad NVMe controller setting: {0}")]
    Bad(&'static str),
}

impl Controller {
    /// A controller over `backing`; the namespace has `backing.len() / lba_size` blocks.
    pub fn new(cfg: ControllerConfig, backing: Box<dyn Backing>) -> Result<Controller, ConfigError> {
        if cfg.lba_size != 512 && cfg.lba_size != 4096 {
            return Err(ConfigError::Bad("lba_size must be 512 or 4096"));
        }
        if cfg.max_io_queues == 0 || cfg.max_io_queues > MAX_IO_QUEUES {
            return Err(ConfigError::Bad("max_io_queues must be 1..=255"));
        }
        if !(2..=65536).contains(&cfg.max_queue_entries) {
            return Err(ConfigError::Bad("max_queue_entries must be 2..=65536"));
        }
        if cfg.msix_vectors == 0 || cfg.msix_vectors > 256 {
            return Err(ConfigError::Bad("msix_vectors must be 1..=256"));
        }
        if !(1..=12).contains(&cfg.mdts) || cfg.mps_max > 4 || cfg.max_fetch == 0 {
            return Err(ConfigError::Bad("mdts must be 1..=12, mps_max 0..=4, max_fetch at least 1"));
        }
        if !cfg.cmb_bytes.is_multiple_of(cmb::UNIT_BYTES) || cfg.cmb_bytes > 1 << 30 {
            return Err(ConfigError::Bad("cmb_bytes must be a multiple of 4096 up to 1 GiB"));
        }
        let blocks = backing.len() / u64::from(cfg.lba_size);
        if blocks == 0 {
            return Err(ConfigError::Bad("the backing store is smaller than one block"));
        }
        let n = usize::from(cfg.max_io_queues) + 1;
        Ok(Controller {
            io_sqs_allowed: cfg.max_io_queues,
            io_cqs_allowed: cfg.max_io_queues,
            backing,
            blocks,
            cc: 0,
            csts: 0,
            aqa: 0,
            asq: 0,
            acq: 0,
            intms: 0,
            page: 4096,
            sqs: vec![None; n],
            cqs: vec![None; n],
            features: DEFAULT_FEATURES,
            outstanding_aers: 0,
            next_sq: 0,
            stats: ControllerStats::default(),
            fetch: Vec::new(),
            cqes: Vec::new(),
            data: Vec::new(),
            runs: Vec::new(),
            lists: Vec::new(),
            cmb: vec![0; cfg.cmb_bytes as usize],
            cmbmsc: 0,
            cmbsts: 0,
            cfg,
        })
    }

    /// The settings.
    pub fn config(&self) -> &ControllerConfig {
        &self.cfg
    }

    /// How the bridge presents this controller in configuration space.
    pub fn pci_info(&self) -> PciInfo {
        PciInfo {
            vendor_id: PCI_VENDOR_ID,
            device_id: PCI_DEVICE_ID,
            class_code: PCI_CLASS,
            bar0_size: BAR0_SIZE,
            msix_vectors: self.cfg.msix_vectors,
            msix_table_offset: MSIX_TABLE_OFFSET,
            msix_pba_offset: MSIX_PBA_OFFSET,
            cmb_bar_size: if self.cfg.cmb_bytes == 0 { 0 } else { self.cfg.cmb_bytes.next_power_of_two() },
        }
    }

    /// Namespace size in logical blocks.
    pub fn namespace_blocks(&self) -> u64 {
        self.blocks
    }

    /// Counters.
    pub fn stats(&self) -> ControllerStats {
        self.stats
    }

    /// The backing store (for checks; do not write to it while the host has the namespace).
    pub fn backing_mut(&mut self) -> &mut dyn Backing {
        &mut *self.backing
    }

    /// CAP (1.4 section 3.1.1).
    pub fn cap(&self) -> u64 {
        u64::from(self.cfg.max_queue_entries - 1) & 0xFFFF
            | 1 << 16 // CQR: contiguous queues required
            | u64::from(self.cfg.timeout_500ms) << 24
            | 1 << 37 // CSS: NVM command set
            | u64::from(self.cfg.mps_max) << 52
            | if self.cfg.cmb_bytes > 0 { cmb::CAP_CMBS } else { 0 }
    }

    /// The bus address the Controller Memory Buffer answers at, when the host enabled it.
    fn cmb_base(&self) -> Option<u64> {
        let on = self.cfg.cmb_bytes > 0 && self.cmbmsc & cmb::CMSE != 0 && self.cmbsts & cmb::CBAI == 0;
        on.then_some(self.cmbmsc & !0xFFF)
    }

    fn write_cmbmsc(&mut self, v: u64) {
        if self.cfg.cmb_bytes == 0 {
            return;
        }
        self.cmbmsc = v & !0xFFC;
        let cba = self.cmbmsc & !0xFFF;
        let valid = cba != 0 && cba.checked_add(self.cfg.cmb_bytes).is_some();
        self.cmbsts = if self.cmbmsc & cmb::CMSE != 0 && !valid { cmb::CBAI } else { 0 };
    }

    /// A memory read of the Controller Memory Buffer (BAR2) at `offset`.
    pub fn cmb_read(&self, offset: u64, buf: &mut [u8]) -> Result<(), BusError> {
        let at = self.cmb_range(offset, buf.len())?;
        buf.copy_from_slice(&self.cmb[at..at + buf.len()]);
        Ok(())
    }

    /// A memory write of the Controller Memory Buffer (BAR2) at `offset`: the host placing
    /// submission queue entries, PRP lists or write data there. Never does DMA or work.
    pub fn cmb_write(&mut self, offset: u64, data: &[u8]) -> Result<(), BusError> {
        let at = self.cmb_range(offset, data.len())?;
        self.cmb[at..at + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn cmb_range(&self, offset: u64, len: usize) -> Result<usize, BusError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.cmb.len() as u64 => Ok(offset as usize),
            _ => Err(BusError::Unsupported { addr: offset }),
        }
    }

    fn enabled(&self) -> bool {
        self.csts & csts::RDY != 0 && self.csts & csts::CFS == 0
    }

    /// True when doorbells have made work pending that [`Controller::process`] would do.
    pub fn has_work(&self) -> bool {
        self.enabled()
            && self.sqs.iter().flatten().any(|sq| {
                sq.head != sq.tail && self.cqs[usize::from(sq.cqid)].is_some_and(|cq| cq.free() > 0)
            })
    }

    fn check_access(&mut self, offset: u64, len: usize) -> Result<(), BusError> {
        let ok = match len {
            4 => offset.is_multiple_of(4),
            8 => matches!(offset, reg::CAP | reg::ASQ | reg::ACQ | reg::CMBMSC),
            _ => false,
        };
        if offset >= MSIX_TABLE_OFFSET {
            return Err(BusError::Unsupported { addr: offset });
        }
        if !ok {
            self.stats.rejected_accesses += 1;
            return Err(BusError::Rejected("NVMe registers take aligned 4-byte (or 8-byte 64-bit) accesses"));
        }
        Ok(())
    }

    fn read_reg64(&self, offset: u64) -> u64 {
        match offset {
            reg::CAP => self.cap(),
            reg::ASQ => self.asq,
            reg::ACQ => self.acq,
            reg::CMBMSC => self.cmbmsc,
            _ => 0,
        }
    }

    fn read_reg32(&self, offset: u64) -> u32 {
        match offset {
            0x00 | 0x04 | 0x28 | 0x2C | 0x30 | 0x34 | 0x50 | 0x54 => {
                (self.read_reg64(offset & !7) >> ((offset & 4) * 8)) as u32
            }
            reg::VS => 0x0001_0400,
            reg::INTMS | reg::INTMC => self.intms,
            reg::CC => self.cc,
            reg::CSTS => self.csts,
            reg::AQA => self.aqa,
            reg::CMBLOC if self.cmbmsc & cmb::CRE != 0 => u32::from(cmb::BIR),
            reg::CMBSZ if self.cmbmsc & cmb::CRE != 0 => {
                cmb::SQS | cmb::LISTS | cmb::WDS | ((self.cfg.cmb_bytes / cmb::UNIT_BYTES) as u32) << 12
            }
            reg::CMBSTS => self.cmbsts,
            _ => 0,
        }
    }

    /// A memory read of BAR0 at `offset` (registers; doorbells read as zero).
    pub fn bar0_read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), BusError> {
        self.check_access(offset, buf.len())?;
        if buf.len() == 8 {
            buf.copy_from_slice(&self.read_reg64(offset).to_le_bytes());
        } else {
            buf.copy_from_slice(&self.read_reg32(offset).to_le_bytes());
        }
        Ok(())
    }

    /// A memory write of BAR0 at `offset`: registers and doorbells. Never does DMA; doorbells
    /// only make work pending for [`Controller::process`].
    pub fn bar0_write(&mut self, offset: u64, data: &[u8]) -> Result<(), BusError> {
        self.check_access(offset, data.len())?;
        if data.len() == 8 {
            let v = u64::from_le_bytes(data.try_into().unwrap_or([0; 8]));
            if offset == reg::CMBMSC {
                self.write_cmbmsc(v);
                return Ok(());
            }
            self.write_reg32(offset, v as u32);
            self.write_reg32(offset + 4, (v >> 32) as u32);
        } else {
            let v = u32::from_le_bytes(data.try_into().unwrap_or([0; 4]));
            self.write_reg32(offset, v);
        }
        Ok(())
    }

    fn write_reg32(&mut self, offset: u64, v: u32) {
        let set_half = |r: &mut u64, hi: bool, v: u32| {
            if hi {
                *r = (*r & 0xFFFF_FFFF) | u64::from(v) << 32;
            } else {
                // Bits 11:0 are reserved: queues are 4 KiB aligned.
                *r = (*r & !0xFFFF_FFFF) | u64::from(v & !0xFFF);
            }
        };
        match offset {
            // INTMS/INTMC are for pin-based and MSI interrupts; with MSI-X the host shall not
            // use them (1.4 section 3.1.3): kept only so that reads return what was written.
            reg::INTMS => self.intms |= v,
            reg::INTMC => self.intms &= !v,
            reg::CC => self.write_cc(v),
            reg::AQA => self.aqa = v & 0x0FFF_0FFF,
            0x28 | 0x2C => set_half(&mut self.asq, offset == 0x2C, v),
            0x30 | 0x34 => set_half(&mut self.acq, offset == 0x34, v),
            0x50 => self.write_cmbmsc((self.cmbmsc & !0xFFFF_FFFF) | u64::from(v)),
            0x54 => self.write_cmbmsc((self.cmbmsc & 0xFFFF_FFFF) | u64::from(v) << 32),
            o if o >= reg::DOORBELLS => self.doorbell(o, v),
            _ => {} // read-only or reserved: ignored
        }
    }

    fn write_cc(&mut self, v: u32) {
        let was = self.cc & cc::EN != 0;
        let now = v & cc::EN != 0;
        self.cc = v & 0x00FF_FFF1;
        if was && !now {
            self.reset();
        } else if !was && now {
            self.enable();
        }
        let shn = (v >> cc::SHN_SHIFT) & 3;
        if shn != 0 && self.csts & csts::SHST_MASK == 0 {
            // Normal or abrupt shutdown: commands complete synchronously, so all that is left
            // is to make the namespace's data durable.
            if self.backing.flush().is_err() {
                self.csts |= csts::CFS;
            }
            self.csts = (self.csts & !csts::SHST_MASK) | csts::SHST_COMPLETE;
        } else if shn == 0 {
            self.csts &= !csts::SHST_MASK;
        }
    }

    fn enable(&mut self) {
        let css = (self.cc >> cc::CSS_SHIFT) & 7;
        let mps = (self.cc >> cc::MPS_SHIFT) & 0xF;
        let asqs = self.aqa & 0xFFF;
        let acqs = (self.aqa >> 16) & 0xFFF;
        if css != 0 || mps > u32::from(self.cfg.mps_max) || asqs == 0 || acqs == 0 {
            self.csts |= csts::CFS;
            return;
        }
        self.page = 4096 << mps;
        let page_mask = self.page as u64 - 1;
        if self.asq & page_mask != 0 || self.acq & page_mask != 0 {
            self.csts |= csts::CFS;
            return;
        }
        self.sqs[0] = Some(Sq { base: self.asq, entries: asqs + 1, head: 0, tail: 0, cqid: 0 });
        self.cqs[0] = Some(Cq {
            base: self.acq,
            entries: acqs + 1,
            tail: 0,
            head: 0,
            phase: true,
            vector: 0,
            interrupts: true,
            attached_sqs: 1,
        });
        self.csts = (self.csts & !csts::SHST_MASK) | csts::RDY;
    }

    /// Controller reset (CC.EN 1 -> 0, 1.4 section 7.3.2): queues deleted, volatile state back
    /// to defaults. The namespace's data stays.
    fn reset(&mut self) {
        self.sqs.iter_mut().for_each(|q| *q = None);
        self.cqs.iter_mut().for_each(|q| *q = None);
        self.csts = 0;
        self.io_sqs_allowed = self.cfg.max_io_queues;
        self.io_cqs_allowed = self.cfg.max_io_queues;
        self.features = DEFAULT_FEATURES;
        self.outstanding_aers = 0;
        self.next_sq = 0;
    }

    fn doorbell(&mut self, offset: u64, v: u32) {
        let index = (offset - reg::DOORBELLS) / 4;
        let qid = (index / 2) as usize;
        let is_cq = index % 2 == 1;
        if !self.enabled() {
            self.stats.invalid_doorbells += 1;
            return;
        }
        let ok = if is_cq {
            match self.cqs.get_mut(qid) {
                Some(Some(cq)) if v < cq.entries => {
                    // The new head must lie within the entries posted so far.
                    let posted = (cq.tail + cq.entries - cq.head) % cq.entries;
                    let advance = (v + cq.entries - cq.head) % cq.entries;
                    if advance <= posted {
                        cq.head = v;
                        true
                    } else {
                        false
                    }
                }
                _ => false,
            }
        } else {
            match self.sqs.get_mut(qid) {
                Some(Some(sq)) if v < sq.entries => {
                    sq.tail = v;
                    true
                }
                _ => false,
            }
        };
        if !ok {
            self.stats.invalid_doorbells += 1;
        }
    }

    /// Does the work doorbells made pending: for each submission queue in turn (admin first,
    /// then round robin), fetches up to `max_fetch` entries in one DMA read, executes them, posts
    /// their completions in one or two DMA writes and signals the CQ's MSI-X vector once.
    /// Returns the number of commands completed (0: nothing to do). Call it again while it
    /// returns more than zero.
    pub fn process(&mut self, mem: &mut dyn HostMemory, irq: &mut dyn InterruptSink) -> usize {
        if !self.enabled() {
            return 0;
        }
        self.process_in(mem, irq, false)
    }

    /// The part of [`process`](Self::process) that reads no host memory and is quick: the Read
    /// and Write commands (without FUA) of submission queues in the Controller Memory Buffer
    /// whose PRP lists (and, for a write, data) lie there too; their data for the host and their
    /// completions are posted writes. It stops at the first other command (that one and the rest stay for
    /// `process`, so [`has_work`](Self::has_work) stays true) and never runs admin commands. A
    /// caller that must not wait (a bridge's receive thread) runs this and leaves the rest to a
    /// thread that may.
    pub fn process_posted(&mut self, mem: &mut dyn HostMemory, irq: &mut dyn InterruptSink) -> usize {
        if !self.enabled() || self.cmb_base().is_none() {
            return 0;
        }
        self.process_in(mem, irq, true)
    }

    fn process_in(
        &mut self,
        mem: &mut dyn HostMemory,
        irq: &mut dyn InterruptSink,
        posted_only: bool,
    ) -> usize {
        let mut cmb = std::mem::take(&mut self.cmb);
        let mut view = CmbView { cmb: &mut cmb, base: self.cmb_base(), host: mem };
        let done = self.process_queues(&mut view, irq, posted_only);
        self.cmb = cmb;
        done
    }

    fn process_queues(
        &mut self,
        mem: &mut CmbView<'_>,
        irq: &mut dyn InterruptSink,
        posted_only: bool,
    ) -> usize {
        let mut done = if posted_only { 0 } else { self.run_sq(0, mem, irq, false) };
        let n = self.sqs.len();
        for i in 0..n - 1 {
            if !self.enabled() {
                break;
            }
            let qid = 1 + (self.next_sq + i) % (n - 1);
            done += self.run_sq(qid, mem, irq, posted_only);
        }
        self.next_sq = (self.next_sq + 1) % (n - 1);
        done
    }

    /// Whether I/O command `sqe` may run where nothing may wait: it reads no host memory (its
    /// PRP list, if any, lies in the Controller Memory Buffer, and so does its data if the
    /// controller reads it) and it only reads or writes the backing store (no Flush, FUA, Write
    /// Zeroes or Dataset Management: a disk may take its time over those). A command that will
    /// fail before any transfer qualifies too. Conservative: what it cannot tell (a PRP list
    /// outside the buffer) does not.
    fn may_run_posted(&mut self, sqe: &Sqe, mem: &mut CmbView<'_>) -> bool {
        let lba = self.cfg.lba_size as usize;
        let (data, len, reads_data) = match decode_io(sqe) {
            Err(_) => return true,
            Ok(IoCommand::ReadWrite { fua: false, write, blocks, data, .. }) => {
                (data, blocks as usize * lba, write)
            }
            Ok(_) => return false,
        };
        if len > self.mdts_bytes() {
            return true;
        }
        /// Host memory that cannot be reached.
        struct Unreachable;
        impl HostMemory for Unreachable {
            fn read(&mut self, addr: u64, _: &mut [u8]) -> Result<(), BusError> {
                Err(BusError::Unsupported { addr })
            }
            fn write(&mut self, addr: u64, _: &[u8]) -> Result<(), BusError> {
                Err(BusError::Unsupported { addr })
            }
        }
        let mut local = CmbView { cmb: &mut *mem.cmb, base: mem.base, host: &mut Unreachable };
        let (mut runs, mut lists) = (std::mem::take(&mut self.runs), std::mem::take(&mut self.lists));
        let walked = prp::walk(&mut local, data.prp1, data.prp2, len, self.page, &mut runs, &mut lists);
        let local = walked.is_ok()
            && (!reads_data || runs.iter().all(|&(a, n)| matches!(local.locate(a, n), Ok(Some(_)))));
        (self.runs, self.lists) = (runs, lists);
        local
    }

    fn fatal(&mut self) {
        self.stats.dma_errors += 1;
        self.csts |= csts::CFS;
    }

    /// Runs up to `max_fetch` commands of submission queue `qid` and posts their completions;
    /// with `posted_only`, only while they read no host memory (the queue itself included).
    /// Returns the number of commands run.
    fn run_sq(
        &mut self,
        qid: usize,
        mem: &mut CmbView<'_>,
        irq: &mut dyn InterruptSink,
        posted_only: bool,
    ) -> usize {
        let Some(sq) = self.sqs[qid] else { return 0 };
        let Some(cq) = self.cqs[usize::from(sq.cqid)] else { return 0 };
        let pending = (sq.tail + sq.entries - sq.head) % sq.entries;
        let n = pending.min(sq.entries - sq.head).min(cq.free()).min(self.cfg.max_fetch as u32) as usize;
        if n == 0 {
            return 0;
        }
        let at = sq.base + u64::from(sq.head) * SQE_LEN as u64;
        if posted_only && !matches!(mem.locate(at, n * SQE_LEN), Ok(Some(_))) {
            return 0;
        }
        let mut fetch = std::mem::take(&mut self.fetch);
        fetch.resize(n * SQE_LEN, 0);
        self.stats.sq_fetches += 1;
        if mem.read(at, &mut fetch).is_err() {
            self.fetch = fetch;
            self.fatal();
            return 0;
        }
        let mut cqes = std::mem::take(&mut self.cqes);
        cqes.clear();
        let mut head = sq.head;
        let mut ran = 0;
        for raw in fetch.chunks_exact(SQE_LEN) {
            let mut b = [0u8; SQE_LEN];
            b.copy_from_slice(raw);
            let sqe = Sqe::parse(&b);
            if posted_only && !self.may_run_posted(&sqe, mem) {
                break;
            }
            ran += 1;
            head = (head + 1) % sq.entries;
            let result = if qid == 0 { self.exec_admin(&sqe, mem, irq) } else { self.exec_io(&sqe, mem) };
            if qid == 0 {
                self.stats.admin_commands += 1;
            } else {
                self.stats.io_commands += 1;
            }
            let (dw0, status) = match result {
                Ok(Some(dw0)) => (dw0, Status::SUCCESS),
                Ok(None) => continue, // held outstanding (Asynchronous Event Request)
                Err(status) => (0, status),
            };
            if !status.is_success() {
                self.stats.error_completions += 1;
            }
            let cqe = Completion {
                dw0,
                dw1: 0,
                sq_head: head as u16,
                sq_id: qid as u16,
                cid: sqe.cid,
                phase: false,
                status,
            };
            let mut out = [0u8; CQE_LEN];
            cqe.emit(&mut out);
            cqes.extend_from_slice(&out);
        }
        self.fetch = fetch;
        if let Some(Some(sq)) = self.sqs.get_mut(qid) {
            sq.head = head;
        }
        // Post to the CQ as it is now (an admin command in this batch cannot delete CQ 0, and an
        // I/O batch runs no admin commands).
        let posted = cqes.len() / CQE_LEN;
        let cqid = usize::from(sq.cqid);
        if posted > 0 {
            let Some(mut cq) = self.cqs[cqid] else {
                self.cqes = cqes;
                return ran;
            };
            let mut at = 0;
            let mut ok = true;
            while at < posted && ok {
                let run = (posted - at).min((cq.entries - cq.tail) as usize);
                for e in cqes[at * CQE_LEN..(at + run) * CQE_LEN].chunks_exact_mut(CQE_LEN) {
                    // Phase tag: DW3 bit 16 = byte 14 bit 0.
                    e[14] = (e[14] & !1) | u8::from(cq.phase);
                }
                let addr = cq.base + u64::from(cq.tail) * CQE_LEN as u64;
                ok = mem.write(addr, &cqes[at * CQE_LEN..(at + run) * CQE_LEN]).is_ok();
                cq.tail += run as u32;
                if cq.tail == cq.entries {
                    cq.tail = 0;
                    cq.phase = !cq.phase;
                }
                at += run;
            }
            self.cqs[cqid] = Some(cq);
            if !ok {
                self.fatal();
            } else if cq.interrupts {
                self.stats.interrupts += 1;
                irq.signal_msix(cq.vector);
            }
        }
        self.cqes = cqes;
        ran
    }

    /// Moves `len` bytes between host memory at the command's PRPs and `self.data[..len]`.
    fn transfer(
        &mut self,
        mem: &mut dyn HostMemory,
        ptr: DataPtr,
        len: usize,
        to_host: bool,
    ) -> Result<(), Status> {
        self.walk(mem, ptr, len)?;
        self.copy_runs(mem, to_host)
    }

    /// Walks the PRPs of a `len`-byte transfer into `self.runs`.
    fn walk(&mut self, mem: &mut dyn HostMemory, ptr: DataPtr, len: usize) -> Result<(), Status> {
        let mut runs = std::mem::take(&mut self.runs);
        let mut lists = std::mem::take(&mut self.lists);
        let walked = prp::walk(mem, ptr.prp1, ptr.prp2, len, self.page, &mut runs, &mut lists);
        self.lists = lists;
        self.runs = runs;
        if walked == Err(Status::DATA_TRANSFER_ERROR) {
            self.stats.dma_errors += 1;
        }
        walked
    }

    /// Copies between `self.data` and the runs walked (to them when `to_host`).
    fn copy_runs(&mut self, mem: &mut dyn HostMemory, to_host: bool) -> Result<(), Status> {
        let mut at = 0usize;
        for &(addr, n) in &self.runs {
            let r = if to_host {
                mem.write(addr, &self.data[at..at + n])
            } else {
                mem.read(addr, &mut self.data[at..at + n])
            };
            if let Err(e) = r {
                self.stats.dma_errors += 1;
                return Err(if e == BusError::Rejected(CMB_EDGE) {
                    Status::INVALID_CMB_USE
                } else {
                    Status::DATA_TRANSFER_ERROR
                });
            }
            at += n;
        }
        Ok(())
    }

    fn check_nsid(&self, nsid: u32) -> Result<(), Status> {
        if nsid == 1 {
            Ok(())
        } else {
            Err(Status::INVALID_NAMESPACE)
        }
    }

    fn check_range(&self, slba: u64, blocks: u64) -> Result<(), Status> {
        match slba.checked_add(blocks) {
            Some(end) if end <= self.blocks => Ok(()),
            _ => Err(Status::LBA_OUT_OF_RANGE),
        }
    }

    fn mdts_bytes(&self) -> usize {
        4096usize << self.cfg.mdts
    }

    fn exec_io(&mut self, sqe: &Sqe, mem: &mut dyn HostMemory) -> Result<Option<u32>, Status> {
        let lba = u64::from(self.cfg.lba_size);
        match decode_io(sqe)? {
            IoCommand::ReadWrite { write, nsid, slba, blocks, fua, data } => {
                self.check_nsid(nsid)?;
                self.check_range(slba, u64::from(blocks))?;
                let len = blocks as usize * self.cfg.lba_size as usize;
                if len > self.mdts_bytes() {
                    return Err(Status::INVALID_FIELD);
                }
                if self.data.len() < len {
                    self.data.resize(len, 0);
                }
                if write {
                    self.walk(mem, data, len)?;
                    // Data in one piece of the memory buffer goes to the backing store from
                    // there, without a copy.
                    let in_place = match self.runs[..] {
                        [(addr, n)] => mem.local(addr, n),
                        _ => None,
                    };
                    let written = match in_place {
                        Some(bytes) => self.backing.write_at(slba * lba, bytes),
                        None => {
                            self.copy_runs(mem, false)?;
                            self.backing.write_at(slba * lba, &self.data[..len])
                        }
                    };
                    written.map_err(|_| Status::WRITE_FAULT)?;
                    if fua {
                        self.backing.flush().map_err(|_| Status::WRITE_FAULT)?;
                    }
                    self.stats.bytes_written += len as u64;
                } else {
                    self.backing
                        .read_at(slba * lba, &mut self.data[..len])
                        .map_err(|_| Status::UNRECOVERED_READ_ERROR)?;
                    self.transfer(mem, data, len, true)?;
                    self.stats.bytes_read += len as u64;
                }
                Ok(Some(0))
            }
            IoCommand::Flush { nsid } => {
                if nsid != 0xFFFF_FFFF {
                    self.check_nsid(nsid)?;
                }
                self.backing.flush().map_err(|_| Status::WRITE_FAULT)?;
                Ok(Some(0))
            }
            IoCommand::WriteZeroes { nsid, slba, blocks, deallocate, fua } => {
                self.check_nsid(nsid)?;
                self.check_range(slba, u64::from(blocks))?;
                let (off, len) = (slba * lba, u64::from(blocks) * lba);
                let r = if deallocate {
                    self.backing.deallocate(off, len)
                } else {
                    self.backing.write_zeroes(off, len)
                };
                r.map_err(|_| Status::WRITE_FAULT)?;
                if fua {
                    self.backing.flush().map_err(|_| Status::WRITE_FAULT)?;
                }
                Ok(Some(0))
            }
            IoCommand::DatasetManagement { nsid, ranges, deallocate, data } => {
                self.check_nsid(nsid)?;
                let len = usize::from(ranges) * 16;
                if self.data.len() < len {
                    self.data.resize(len, 0);
                }
                self.transfer(mem, data, len, false)?;
                let mut list = [(0u64, 0u64); 256];
                for (i, r) in self.data[..len].chunks_exact(16).enumerate() {
                    let blocks = u64::from(u32::from_le_bytes([r[4], r[5], r[6], r[7]]));
                    let slba = u64::from_le_bytes(r[8..16].try_into().unwrap_or([0; 8]));
                    self.check_range(slba, blocks)?;
                    list[i] = (slba, blocks);
                }
                if deallocate {
                    for &(slba, blocks) in &list[..usize::from(ranges)] {
                        if blocks > 0 {
                            self.backing
                                .deallocate(slba * lba, blocks * lba)
                                .map_err(|_| Status::WRITE_FAULT)?;
                        }
                    }
                }
                Ok(Some(0))
            }
        }
    }

    fn exec_admin(
        &mut self,
        sqe: &Sqe,
        mem: &mut CmbView<'_>,
        irq: &mut dyn InterruptSink,
    ) -> Result<Option<u32>, Status> {
        match decode_admin(sqe)? {
            AdminCommand::CreateCq { qid, entries, base, contiguous, interrupts, vector } => {
                if qid == 0 || qid > self.io_cqs_allowed || self.cqs[usize::from(qid)].is_some() {
                    return Err(Status::INVALID_QUEUE_ID);
                }
                self.check_queue(entries, base, contiguous, (self.cc >> cc::IOCQES_SHIFT) & 0xF, 4)?;
                if vector >= self.cfg.msix_vectors {
                    return Err(Status::INVALID_VECTOR);
                }
                self.cqs[usize::from(qid)] = Some(Cq {
                    base,
                    entries,
                    tail: 0,
                    head: 0,
                    phase: true,
                    vector,
                    interrupts,
                    attached_sqs: 0,
                });
                Ok(Some(0))
            }
            AdminCommand::CreateSq { qid, entries, base, contiguous, cqid } => {
                if qid == 0 || qid > self.io_sqs_allowed || self.sqs[usize::from(qid)].is_some() {
                    return Err(Status::INVALID_QUEUE_ID);
                }
                if cqid == 0 || cqid > self.io_cqs_allowed || self.cqs[usize::from(cqid)].is_none() {
                    return Err(Status::CQ_INVALID);
                }
                self.check_queue(entries, base, contiguous, (self.cc >> cc::IOSQES_SHIFT) & 0xF, 6)?;
                if let Some(cq) = self.cqs[usize::from(cqid)].as_mut() {
                    cq.attached_sqs += 1;
                }
                self.sqs[usize::from(qid)] = Some(Sq { base, entries, head: 0, tail: 0, cqid });
                Ok(Some(0))
            }
            AdminCommand::DeleteSq { qid } => {
                if qid == 0 || qid > self.cfg.max_io_queues {
                    return Err(Status::INVALID_QUEUE_ID);
                }
                if self.sqs[usize::from(qid)].is_none() {
                    return Err(Status::INVALID_QUEUE_ID);
                }
                // 1.4 section 5.6: commands submitted to the queue complete (or are aborted)
                // before the deletion does. Commands run synchronously, so run what the host
                // submitted; entries that find the CQ full are dropped and counted.
                while self.run_sq(usize::from(qid), mem, irq, false) > 0 {}
                let sq = self.sqs[usize::from(qid)].take().ok_or(Status::INVALID_QUEUE_ID)?;
                if sq.head != sq.tail {
                    self.stats.dropped_on_deletion +=
                        u64::from((sq.tail + sq.entries - sq.head) % sq.entries);
                }
                if let Some(cq) = self.cqs[usize::from(sq.cqid)].as_mut() {
                    cq.attached_sqs -= 1;
                }
                Ok(Some(0))
            }
            AdminCommand::DeleteCq { qid } => {
                if qid == 0 || qid > self.cfg.max_io_queues {
                    return Err(Status::INVALID_QUEUE_ID);
                }
                match self.cqs[usize::from(qid)] {
                    None => Err(Status::INVALID_QUEUE_ID),
                    Some(cq) if cq.attached_sqs > 0 => Err(Status::INVALID_QUEUE_DELETION),
                    Some(_) => {
                        self.cqs[usize::from(qid)] = None;
                        Ok(Some(0))
                    }
                }
            }
            AdminCommand::Identify { cns, nsid, data } => {
                let page = self.identify(cns, nsid)?;
                self.data.resize(page.len().max(self.data.len()), 0);
                self.data[..4096].copy_from_slice(&page);
                self.transfer(mem, data, 4096, true)?;
                Ok(Some(0))
            }
            AdminCommand::Abort { sqid, .. } => {
                if usize::from(sqid) >= self.sqs.len() || self.sqs[usize::from(sqid)].is_none() {
                    return Err(Status::INVALID_QUEUE_ID);
                }
                // DW0 bit 0 set: the command was not aborted (it had already completed, or it
                // will be executed when fetched).
                Ok(Some(1))
            }
            AdminCommand::SetFeatures { fid, save, value } => {
                if save {
                    return Err(Status::FEATURE_NOT_SAVEABLE);
                }
                self.set_feature(fid, value).map(Some)
            }
            AdminCommand::GetFeatures { fid, select } => {
                let current = self.get_feature(fid, &self.features)?;
                Ok(Some(match select {
                    0 | 2 => current,
                    1 => self.get_feature(fid, &DEFAULT_FEATURES)?,
                    _ => 0b100, // changeable, not saveable, not namespace specific
                }))
            }
            AdminCommand::GetLogPage { lid, len_bytes, offset_bytes, data } => {
                let log = self.log_page(lid)?;
                if offset_bytes >= log.len() as u64 || len_bytes as usize > self.mdts_bytes() {
                    return Err(Status::INVALID_FIELD);
                }
                let len = len_bytes as usize;
                self.data.clear();
                self.data.resize(len, 0);
                let from = &log[offset_bytes as usize..];
                let n = from.len().min(len);
                self.data[..n].copy_from_slice(&from[..n]);
                self.transfer(mem, data, len, true)?;
                Ok(Some(0))
            }
            AdminCommand::AsyncEventRequest => {
                if self.outstanding_aers > AERL {
                    return Err(Status::AER_LIMIT);
                }
                self.outstanding_aers += 1;
                Ok(None)
            }
        }
    }

    fn check_queue(
        &self,
        entries: u32,
        base: u64,
        contiguous: bool,
        es: u32,
        want_es: u32,
    ) -> Result<(), Status> {
        if entries < 2 || entries > self.cfg.max_queue_entries {
            return Err(Status::INVALID_QUEUE_SIZE);
        }
        // CAP.CQR = 1: only physically contiguous queues; the entry size must be programmed.
        if !contiguous || es != want_es || base == 0 {
            return Err(Status::INVALID_FIELD);
        }
        if base & (self.page as u64 - 1) != 0 {
            return Err(Status::PRP_OFFSET_INVALID);
        }
        Ok(())
    }

    fn set_feature(&mut self, fid: u8, value: u32) -> Result<u32, Status> {
        let f = &mut self.features;
        match fid {
            feature::NUMBER_OF_QUEUES => {
                let (nsqr, ncqr) = (value & 0xFFFF, value >> 16);
                if nsqr == 0xFFFF || ncqr == 0xFFFF {
                    return Err(Status::INVALID_FIELD);
                }
                if self.sqs[1..].iter().any(Option::is_some) || self.cqs[1..].iter().any(Option::is_some) {
                    return Err(Status::COMMAND_SEQUENCE_ERROR);
                }
                let max = u32::from(self.cfg.max_io_queues);
                self.io_sqs_allowed = (nsqr + 1).min(max) as u16;
                self.io_cqs_allowed = (ncqr + 1).min(max) as u16;
                return self.get_feature(fid, &self.features);
            }
            feature::ARBITRATION => f.arbitration = value,
            feature::POWER_MANAGEMENT => {
                // One power state (NPSS = 0).
                if value & 0x1F != 0 {
                    return Err(Status::INVALID_FIELD);
                }
                f.power_management = value & 0xFF;
            }
            feature::TEMPERATURE_THRESHOLD => f.temperature_threshold = value & 0x3F_FFFF,
            feature::VOLATILE_WRITE_CACHE => f.volatile_write_cache = value & 1,
            feature::INTERRUPT_COALESCING => f.interrupt_coalescing = value & 0xFFFF,
            feature::WRITE_ATOMICITY => f.write_atomicity = value & 1,
            feature::ASYNC_EVENT_CONFIG => f.async_event_config = value,
            _ => return Err(Status::INVALID_FIELD),
        }
        Ok(0)
    }

    fn get_feature(&self, fid: u8, f: &Features) -> Result<u32, Status> {
        Ok(match fid {
            feature::NUMBER_OF_QUEUES => {
                u32::from(self.io_sqs_allowed - 1) | u32::from(self.io_cqs_allowed - 1) << 16
            }
            feature::ARBITRATION => f.arbitration,
            feature::POWER_MANAGEMENT => f.power_management,
            feature::TEMPERATURE_THRESHOLD => f.temperature_threshold,
            feature::VOLATILE_WRITE_CACHE => f.volatile_write_cache,
            feature::INTERRUPT_COALESCING => f.interrupt_coalescing,
            feature::WRITE_ATOMICITY => f.write_atomicity,
            feature::ASYNC_EVENT_CONFIG => f.async_event_config,
            _ => return Err(Status::INVALID_FIELD),
        })
    }

    fn log_page(&self, lid: u8) -> Result<Vec<u8>, Status> {
        match lid {
            // Error Information: one all-zero entry (no errors logged).
            0x01 => Ok(vec![0; 64]),
            0x02 => {
                // SMART / Health: composite temperature 300 K, data units in thousands of 512 B.
                let mut p = vec![0u8; 512];
                p[1..3].copy_from_slice(&300u16.to_le_bytes());
                p[3] = 100; // available spare
                p[4] = 10; // spare threshold
                let units = |b: u64| u128::from(b.div_ceil(512_000));
                p[32..48].copy_from_slice(&units(self.stats.bytes_read).to_le_bytes());
                p[48..64].copy_from_slice(&units(self.stats.bytes_written).to_le_bytes());
                Ok(p)
            }
            0x03 => {
                let mut p = vec![0u8; 512];
                p[0] = 1; // slot 1 active
                p[8..16].copy_from_slice(&fixed::<8>(env!("CARGO_PKG_VERSION")));
                Ok(p)
            }
            _ => Err(Status::INVALID_LOG_PAGE),
        }
    }

    fn identify(&self, cns: u8, nsid: u32) -> Result<[u8; 4096], Status> {
        let mut p = [0u8; 4096];
        match cns {
            0x00 => {
                self.check_nsid(nsid)?;
                let b = self.blocks.to_le_bytes();
                p[0..8].copy_from_slice(&b); // NSZE
                p[8..16].copy_from_slice(&b); // NCAP
                p[16..24].copy_from_slice(&b); // NUSE
                p[24] = 0; // NSFEAT
                p[25] = 0; // NLBAF: one format (0's based)
                p[26] = 0; // FLBAS: format 0, no metadata
                p[33] = 0b1001; // DLFEAT: deallocated blocks read as zero; Write Zeroes may deallocate
                let lbads = self.cfg.lba_size.trailing_zeros();
                p[128..132].copy_from_slice(&(lbads << 16).to_le_bytes()); // LBAF0: MS 0, LBADS, RP 0
            }
            0x01 => {
                p[0..2].copy_from_slice(&PCI_VENDOR_ID.to_le_bytes());
                p[2..4].copy_from_slice(&PCI_VENDOR_ID.to_le_bytes());
                p[4..24].copy_from_slice(&fixed::<20>(&self.cfg.serial));
                p[24..64].copy_from_slice(&fixed::<40>(&self.cfg.model));
                p[64..72].copy_from_slice(&fixed::<8>(env!("CARGO_PKG_VERSION")));
                p[72] = 6; // RAB
                p[77] = self.cfg.mdts;
                p[78..80].copy_from_slice(&1u16.to_le_bytes()); // CNTLID
                p[80..84].copy_from_slice(&0x0001_0400u32.to_le_bytes()); // VER
                p[111] = 1; // CNTRLTYPE: I/O controller
                p[258] = ACL;
                p[259] = AERL;
                p[260] = 0b010; // FRMW: one firmware slot, writable
                p[261] = 0; // LPA
                p[262] = 0; // ELPE: 1 entry (0's based)
                p[263] = 0; // NPSS: one power state
                p[512] = 0x66; // SQES
                p[513] = 0x44; // CQES
                p[514..516].copy_from_slice(&(self.cfg.max_queue_entries.min(65535) as u16).to_le_bytes());
                p[516..520].copy_from_slice(&1u32.to_le_bytes()); // NN
                p[520..522].copy_from_slice(&0b1100u16.to_le_bytes()); // ONCS: DSM, Write Zeroes
                p[525] = 1; // VWC present
                p[526..528].copy_from_slice(&0u16.to_le_bytes()); // AWUN
                let subnqn = format!("nqn.2024-01.io.lanbus:nvme:{}", self.cfg.serial);
                let n = subnqn.len().min(255);
                p[768..768 + n].copy_from_slice(&subnqn.as_bytes()[..n]);
                // Power state 0: 25 W (units of 0.01 W).
                p[2048..2050].copy_from_slice(&2500u16.to_le_bytes());
            }
            0x02 => {
                if nsid >= 0xFFFF_FFFE {
                    return Err(Status::INVALID_NAMESPACE);
                }
                if nsid < 1 {
                    p[0..4].copy_from_slice(&1u32.to_le_bytes());
                }
            }
            _ => return Err(Status::INVALID_FIELD),
        }
        Ok(p)
    }
}

/// An ASCII field padded with spaces (Identify strings).
fn fixed<const N: usize>(s: &str) -> [u8; N] {
    let mut out = [b' '; N];
    for (o, c) in out.iter_mut().zip(s.bytes().filter(|c| c.is_ascii_graphic() || *c == b' ')) {
        *o = c;
    }
    out
}
