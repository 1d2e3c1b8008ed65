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
//!
//! This file holds the model's types, its construction and the queue engine (fetching commands,
//! posting completions, signalling MSI-X, moving data through PRPs); the register and doorbell
//! accesses are in `registers.rs`, the admin commands in `admin.rs`, the NVM commands in `io.rs`.

mod admin;
mod io;
mod registers;

use std::collections::HashMap;

use lanbus_bridge::dma::BusError;

use crate::backing::Backing;
use crate::command::{decode_io, Completion, DataPtr, IoCommand, Sqe, CQE_LEN, SQE_LEN};
use crate::prp::{self, Run};
use crate::sgl;
use crate::status::Status;
use crate::{HostMemory, InterruptSink};

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
    /// Write commands whose data went to the namespace from where it lay on the device's side
    /// (the memory buffer, or read ahead for the command), without a copy.
    pub writes_in_place: u64,
    /// Bytes the controller copied: the host's writes into its memory buffer, a command's data
    /// into the controller's own buffer (from host memory, the memory buffer or what was read
    /// ahead for it; not a write's data taken where it lay), its DMA writes into the memory
    /// buffer, and what it reads ahead for a command, where it keeps a copy (from the memory
    /// buffer, or of a list it read to check the command). Its DMA writes to host memory are the
    /// bus's to count.
    pub bytes_copied: u64,
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
    /// Entries fetched by posted processing that it could not run, at most one run of them per
    /// queue: (queue, its base, the head they start at, the entries). The host leaves them alone
    /// until their completions, so the next run takes them from here instead of fetching them
    /// again (while commands of other queues run). Queue changes drop them.
    fetched: Vec<(usize, u64, u32, Vec<u8>)>,
    /// Host memory the commands at the heads of `fetched` will read, read already by posted
    /// processing (from prefetches), by (address, length). A command's run takes what it reads
    /// from here and drops it afterwards; queue changes drop all of it.
    staged: StagedReads,
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
    /// Bytes copied out of and into the buffer for staging and DMA writes (see
    /// [`ControllerStats::bytes_copied`]).
    copied: u64,
}

/// Staged bytes kept at most: enough for several queues' commands waiting on their data.
const MAX_STAGED_BYTES: usize = 16 << 20;

/// Commands behind one that waits for its data that posted processing checks ahead (see
/// `Controller::look_ahead`) at most, the reads it names for them, and the bytes of the writes
/// among them: enough to keep the fabric busy while the first one's data comes, not so many
/// that large writes' data waits staged (at 256 KiB and 1 MiB, 2 MiB ahead ran slower).
const LOOKAHEAD_COMMANDS: usize = 16;
const LOOKAHEAD_READS: usize = 24;
const LOOKAHEAD_BYTES: usize = 1 << 20;

/// Whether posted processing may run a command now (see `Controller::may_run_posted`).
enum Posted {
    /// Yes: all it reads is here (or it fails before reading).
    Run,
    /// Not yet: the reads it waits for (this many) were named for prefetching.
    Wait(usize),
    /// No: it is for the full run.
    No,
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
    fn read_owned(&mut self, addr: u64, len: usize) -> Result<Vec<u8>, BusError> {
        match self.locate(addr, len)? {
            Some(at) => {
                self.copied += len as u64;
                Ok(self.cmb[at..at + len].to_vec())
            }
            None => self.host.read_owned(addr, len),
        }
    }
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), BusError> {
        match self.locate(addr, data.len())? {
            Some(at) => {
                self.cmb[at..at + data.len()].copy_from_slice(data);
                self.copied += data.len() as u64;
                Ok(())
            }
            None => self.host.write(addr, data),
        }
    }
    fn local(&self, addr: u64, len: usize) -> Option<&[u8]> {
        let at = self.locate(addr, len).ok()??;
        Some(&self.cmb[at..at + len])
    }
    fn prefetch(&mut self, addr: u64, len: usize) {
        if let Ok(None) = self.locate(addr, len) {
            self.host.prefetch(addr, len);
        }
    }
}

/// Resolves a command's data pointer, PRPs or an SGL, into the runs of host memory it names.
fn walk_ptr(
    mem: &mut dyn HostMemory,
    ptr: DataPtr,
    len: usize,
    page: usize,
    runs: &mut Vec<Run>,
    scratch: &mut Vec<u8>,
) -> Result<(), Status> {
    if ptr.sgl {
        sgl::walk(mem, sgl::sgl1(ptr.prp1, ptr.prp2), len, runs, scratch)
    } else {
        prp::walk(mem, ptr.prp1, ptr.prp2, len, page, runs, scratch)
    }
}

/// Host memory read ahead for a command, by (address, length).
type StagedReads = HashMap<(u64, usize), Vec<u8>>;

/// Posted processing's view of host memory while it checks a command: reads come from what is
/// staged, from the buffer, or from a prefetch that ended (then staged for the command's run);
/// a read whose data is not here yet is noted in `missing` and fails.
struct Probe<'a, 'b> {
    mem: &'a mut CmbView<'b>,
    staged: &'a mut StagedReads,
    missing: Vec<(u64, usize)>,
}

impl Probe<'_, '_> {
    /// Makes sure `len` bytes at `addr` are here for the command's run without reading them
    /// now: staged already, in the buffer, or a prefetch that ended (staged then). The check of
    /// a command is made again as each of its pieces arrives, so it must not cost what its
    /// bytes do each time.
    fn stage(&mut self, addr: u64, len: usize) -> Result<(), BusError> {
        if self.staged.contains_key(&(addr, len)) || matches!(self.mem.locate(addr, len), Ok(Some(_))) {
            return Ok(());
        }
        // The buffer the data arrived in, handed over as it is.
        match self.mem.read_owned(addr, len) {
            Ok(bytes) => {
                self.staged.insert((addr, len), bytes);
                Ok(())
            }
            Err(BusError::NotReady) => {
                // A list may name one page twice: one prefetch brings it for both.
                if !self.missing.contains(&(addr, len)) {
                    self.missing.push((addr, len));
                }
                Err(BusError::NotReady)
            }
            Err(e) => Err(e),
        }
    }
}

impl HostMemory for Probe<'_, '_> {
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), BusError> {
        if let Some(bytes) = self.staged.get(&(addr, buf.len())) {
            buf.copy_from_slice(bytes);
            return Ok(());
        }
        match self.mem.read(addr, buf) {
            Ok(()) => {
                if !matches!(self.mem.locate(addr, buf.len()), Ok(Some(_))) {
                    self.staged.insert((addr, buf.len()), buf.to_vec());
                    self.mem.copied += buf.len() as u64;
                }
                Ok(())
            }
            Err(BusError::NotReady) => {
                self.missing.push((addr, buf.len()));
                Err(BusError::NotReady)
            }
            Err(e) => Err(e),
        }
    }
    fn write(&mut self, addr: u64, _: &[u8]) -> Result<(), BusError> {
        // Checking a command writes nothing.
        Err(BusError::Unsupported { addr })
    }
}

/// Host memory for a command's run, with what posted processing staged for it: a read of exactly
/// a staged range takes the staged bytes (as often as the command names it; the stage is
/// dropped after the run).
struct Staged<'a, 'b> {
    mem: &'a mut CmbView<'b>,
    staged: &'a mut StagedReads,
    /// The staged ranges the run read.
    used: Vec<(u64, usize)>,
}

impl HostMemory for Staged<'_, '_> {
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), BusError> {
        match self.staged.get(&(addr, buf.len())) {
            Some(bytes) => {
                buf.copy_from_slice(bytes);
                self.used.push((addr, buf.len()));
                Ok(())
            }
            None => self.mem.read(addr, buf),
        }
    }
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), BusError> {
        self.mem.write(addr, data)
    }
    /// Staged bytes are here already, like the memory buffer's.
    fn local(&self, addr: u64, len: usize) -> Option<&[u8]> {
        match self.staged.get(&(addr, len)) {
            Some(bytes) => Some(bytes),
            None => self.mem.local(addr, len),
        }
    }
    fn prefetch(&mut self, addr: u64, len: usize) {
        self.mem.prefetch(addr, len);
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
            fetched: Vec::new(),
            staged: StagedReads::new(),
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

    /// The part of [`process`](Self::process) that waits for no host memory and is quick: the
    /// Read and Write commands (without FUA) of the I/O queues, as long as what they read (the
    /// entries, a PRP list, a write's data) lies in the Controller Memory Buffer or is already
    /// here (`mem` answers [`BusError::NotReady`] for what is not: a prefetch has not brought it
    /// yet); their data for the host and their completions are posted writes. What is not here
    /// yet is named with [`HostMemory::prefetch`] (the very read a later call, or `process`, will
    /// make), and what was read is kept for that call. It stops at the first other command (that
    /// one and the rest stay for `process`, so [`has_work`](Self::has_work) stays true) and
    /// never runs admin commands. A caller that must not wait (a bridge's receive thread) runs
    /// this, again when a prefetch ends, and leaves the rest to a thread that may.
    pub fn process_posted(&mut self, mem: &mut dyn HostMemory, irq: &mut dyn InterruptSink) -> usize {
        if !self.enabled() {
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
        let mut view = CmbView { cmb: &mut cmb, base: self.cmb_base(), host: mem, copied: 0 };
        let done = self.process_queues(&mut view, irq, posted_only);
        self.stats.bytes_copied += view.copied;
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
            let mut ran = self.run_sq(qid, mem, irq, posted_only);
            done += ran;
            // Posted processing that ran all it had fetched goes on with the entries rung
            // meanwhile: their fetch is named here, not left to a thread that would wait for it.
            while posted_only && ran > 0 && self.enabled() && !self.fetched.iter().any(|&(q, ..)| q == qid) {
                ran = self.run_sq(qid, mem, irq, true);
                done += ran;
            }
        }
        self.next_sq = (self.next_sq + 1) % (n - 1);
        done
    }

    /// Whether I/O command `sqe` may run where nothing may wait: whatever it reads of host memory
    /// (its PRP list, a write's data) is here already, read from the Controller Memory Buffer or
    /// brought by a prefetch (`mem` reads only such data), and it only reads or writes the backing
    /// store (no Flush, FUA, Write Zeroes or Dataset Management: a disk may take its time over
    /// those). What it read is staged for the command's run; what is not here yet is named for
    /// prefetching, and the command waits for it (a later call, or the full run, goes on from
    /// what was staged). A command that will fail before any transfer qualifies too.
    fn may_run_posted(&mut self, sqe: &Sqe, mem: &mut CmbView<'_>) -> Posted {
        let lba = self.cfg.lba_size as usize;
        let (data, len, reads_data) = match decode_io(sqe) {
            Err(_) => return Posted::Run,
            Ok(IoCommand::ReadWrite { fua: false, write, blocks, data, .. }) => {
                (data, blocks as usize * lba, write)
            }
            Ok(_) => return Posted::No,
        };
        if len > self.mdts_bytes() {
            return Posted::Run;
        }
        let (mut runs, mut lists) = (std::mem::take(&mut self.runs), std::mem::take(&mut self.lists));
        let mut probe = Probe { mem, staged: &mut self.staged, missing: Vec::new() };
        let walked = walk_ptr(&mut probe, data, len, self.page, &mut runs, &mut lists);
        let mut ok = walked.is_ok();
        if ok && reads_data {
            for &(a, n) in &runs {
                if probe.stage(a, n).is_err() && probe.missing.is_empty() {
                    ok = false;
                    break;
                }
            }
        }
        let missing = std::mem::take(&mut probe.missing);
        (self.runs, self.lists) = (runs, lists);
        if !missing.is_empty() {
            for &(a, n) in &missing {
                mem.prefetch(a, n);
            }
            return Posted::Wait(missing.len());
        }
        if ok {
            Posted::Run
        } else {
            Posted::No
        }
    }

    /// Posted processing stopped at a command waiting for its data: checks the read and write
    /// commands fetched behind it (`entries`) the same way, so that what they read is staged as
    /// it arrives and what has not come is named now, and their round trips overlap the first
    /// one's instead of following it. The host leaves a command's PRP list and a write's data
    /// alone until its completion, so what is read ahead stays true. It stops at the first other
    /// command, after [`LOOKAHEAD_COMMANDS`], and once the writes it passed carry
    /// [`LOOKAHEAD_BYTES`] (staged or on their way) or it named [`LOOKAHEAD_READS`] reads.
    fn look_ahead(&mut self, entries: &[u8], mem: &mut CmbView<'_>) {
        let lba = self.cfg.lba_size as usize;
        let (mut reads, mut bytes) = (0, 0);
        for raw in entries.chunks_exact(SQE_LEN).take(LOOKAHEAD_COMMANDS) {
            let mut b = [0u8; SQE_LEN];
            b.copy_from_slice(raw);
            let sqe = Sqe::parse(&b);
            match decode_io(&sqe) {
                Ok(IoCommand::ReadWrite { fua: false, write, blocks, .. }) => {
                    if write {
                        bytes += blocks as usize * lba;
                    }
                }
                _ => break,
            }
            if let Posted::Wait(named) = self.may_run_posted(&sqe, mem) {
                reads += named;
            }
            if reads >= LOOKAHEAD_READS || bytes >= LOOKAHEAD_BYTES {
                break;
            }
        }
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
        let mut fetch = std::mem::take(&mut self.fetch);
        let held = self.fetched.iter().position(|&(q, ..)| q == qid).map(|i| self.fetched.swap_remove(i));
        match held {
            Some((_, base, head, entries)) if (base, head) == (sq.base, sq.head) => {
                let n = n.min(entries.len() / SQE_LEN);
                fetch.clear();
                fetch.extend_from_slice(&entries[..n * SQE_LEN]);
            }
            _ => {
                fetch.resize(n * SQE_LEN, 0);
                if let Err(e) = mem.read(at, &mut fetch) {
                    self.fetch = fetch;
                    if posted_only {
                        // Posted processing reads host memory only where the data is already
                        // here (a prefetch that ended). Otherwise it names the read the next run
                        // will make: the entries lie in host memory, and the host leaves them
                        // alone until their completions say they were fetched.
                        if matches!(e, BusError::NotReady) {
                            mem.prefetch(at, n * SQE_LEN);
                        }
                    } else {
                        self.fatal();
                    }
                    return 0;
                }
                self.stats.sq_fetches += 1;
            }
        }
        let n = fetch.len() / SQE_LEN;
        let mut cqes = std::mem::take(&mut self.cqes);
        cqes.clear();
        let mut head = sq.head;
        let mut ran = 0;
        for raw in fetch.chunks_exact(SQE_LEN) {
            let mut b = [0u8; SQE_LEN];
            b.copy_from_slice(raw);
            let sqe = Sqe::parse(&b);
            if posted_only {
                match self.may_run_posted(&sqe, mem) {
                    Posted::Run => {}
                    Posted::Wait(_) => {
                        let rest = (ran + 1) * SQE_LEN;
                        self.look_ahead(&fetch[rest..], mem);
                        break;
                    }
                    Posted::No => break,
                }
            }
            ran += 1;
            head = (head + 1) % sq.entries;
            let result = if qid == 0 {
                self.exec_admin(&sqe, mem, irq)
            } else {
                let mut staged = std::mem::take(&mut self.staged);
                let mut view = Staged { mem, staged: &mut staged, used: Vec::new() };
                let result = self.exec_io(&sqe, &mut view);
                // What this command read is done with; what other queues' commands staged
                // stays for their runs (bounded: should it grow past that, it goes, and those
                // commands read their data again).
                let used = std::mem::take(&mut view.used);
                for key in used.iter().chain(self.runs.iter()) {
                    staged.remove(key);
                }
                if staged.keys().map(|&(_, n)| n).sum::<usize>() > MAX_STAGED_BYTES {
                    staged.clear();
                }
                self.staged = staged;
                result
            };
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
        if ran < n {
            // Posted processing stopped at a command it may not run: the worker's run starts
            // from these entries.
            self.fetched.push((qid, sq.base, head, fetch[ran * SQE_LEN..].to_vec()));
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

    /// Moves `len` bytes between host memory at the command's data pointer (PRPs or SGL) and `self.data[..len]`.
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

    /// Walks the data pointer (PRPs or SGL) of a `len`-byte transfer into `self.runs`.
    fn walk(&mut self, mem: &mut dyn HostMemory, ptr: DataPtr, len: usize) -> Result<(), Status> {
        let mut runs = std::mem::take(&mut self.runs);
        let mut lists = std::mem::take(&mut self.lists);
        let walked = walk_ptr(mem, ptr, len, self.page, &mut runs, &mut lists);
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
                let r = mem.read(addr, &mut self.data[at..at + n]);
                if r.is_ok() {
                    self.stats.bytes_copied += n as u64;
                }
                r
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

    fn mdts_bytes(&self) -> usize {
        4096usize << self.cfg.mdts
    }
}
