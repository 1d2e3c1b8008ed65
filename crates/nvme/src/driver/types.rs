//! The driver's value types (host side): its settings ([`DriverConfig`], [`CompletionMode`]), its
//! error ([`DriverError`], which carries the NVMe status), what Identify reported
//! ([`Identity`]), what it keeps in the controller's memory buffer ([`CmbUse`]) and its counters
//! ([`DriverStats`]). All of them are public as `lanbus_nvme::driver::*`.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use lanbus_bridge::dma::BusError;

use crate::status::Status;

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
    /// Use the controller's Controller Memory Buffer when it has one (CAP.CMBS) and the
    /// [`Bar`](super::Bar) maps it: I/O submission queues, PRP lists and write data go there with
    /// posted writes, so the controller reads none of them across the bus.
    pub use_cmb: bool,
    /// Largest command of a write whose data goes into the Controller Memory Buffer: a larger
    /// write is split into commands of this size, each submitted as soon as its data is posted,
    /// so the controller writes one to its store while the next still crosses the bus. 0 keeps
    /// commands as large as MDTS allows. Data in host memory is split so only when its caller
    /// puts it there as it arrives
    /// ([`IoStream::submit_write_filled`](super::IoStream::submit_write_filled)): the controller
    /// fetches one piece while the next arrives. Data already whole in host memory is not split
    /// (smaller commands would only add round trips).
    pub pipelined_write_bytes: usize,
    /// Describe a buffer of more than two memory pages with one SGL Data Block descriptor when
    /// the controller takes SGLs (Identify Controller SGLS), instead of PRPs whose list the
    /// controller must read first: with the list in host memory, one round trip less a command.
    pub use_sgl: bool,
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
            pipelined_write_bytes: 256 << 10,
            use_sgl: true,
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
    /// The controller takes SGLs for the data of I/O commands (Identify Controller SGLS).
    pub sgl: bool,
}

/// What the driver keeps in the controller's memory buffer
/// ([`NvmeDriver::cmb_in_use`](super::NvmeDriver::cmb_in_use)).
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
    /// Nanoseconds spent in reads and writes, from building their commands to the last
    /// completion with the data copied out (for a stream's requests: time with at least one
    /// in flight, counted once however many overlap).
    pub io_ns: AtomicU64,
    /// Nanoseconds of those spent copying data between the caller's buffers and DMA memory.
    pub copy_ns: AtomicU64,
    /// Bytes the driver copied into and out of its DMA memory in host memory (data, queue
    /// entries); not those it wrote to the drive's memory buffer, which go into the fabric's
    /// frames, nor those it lent (a read's data handed out where it landed).
    pub copy_bytes: AtomicU64,
}
