//! NVMe for lanbus: the controller model that runs on the device bridge (the "I/O box") and the
//! user-space driver that runs on the host, written against small traits so that they can be
//! joined in-process ([`local`]) or through the PCIe bridges over the fabric.
//!
//! Layering (`docs/architecture.md` describes the bridges):
//!
//! ```text
//!   host:   NvmeDriver ── Bar (MMIO to BAR0) ── DmaMemory (queues, PRP lists, data) ── InterruptWait
//!                 │               │                                   ▲                      ▲
//!            (host bridge: MRd/MWr TLPs)                       (device DMA lands here)  (MSI-X MWr)
//!                 ▼               ▼                                   │                      │
//!   device: Controller::bar0_read/bar0_write        Controller::process(HostMemory, InterruptSink)
//! ```
//!
//! - [`controller`]: the NVMe controller model (NVMe base specification 1.4, with the 2.0 section
//!   numbers where they differ): registers, admin and I/O queues, PRPs ([`prp`]) and SGLs
//!   ([`sgl`]: Data Block, Segment and Last Segment descriptors), MSI-X per CQ, a namespace
//!   over a [`backing::Backing`] store. All host-memory traffic goes through [`HostMemory`], which
//!   the device bridge implements with memory read/write TLPs.
//! - [`command`]: the pure decoder of 64-byte submission queue entries and the completion queue
//!   entry codec (`command::fuzz_command`, built for the fuzzer and the unit tests, is the fuzz target's body).
//! - [`driver`]: the host-side driver over [`driver::Bar`], and the DMA memory and interrupt waits
//!   of `lanbus_bridge::dma` ([`lanbus_bridge::dma::DmaMemory`],
//!   [`lanbus_bridge::dma::InterruptWait`]), which the virtio-net driver shares.
//! - [`local`]: the in-process join (no fabric): the `local` row of `lanbus bench nvme`.
//! - [`pcie`]: the controller as a function of the device bridge, and the driver over the host
//!   bridge (the fabric join).
//!
//! ```
//! use lanbus_nvme::local::{LocalNvme, ProcessMode};
//! use lanbus_nvme::{Controller, ControllerConfig, DriverConfig, RamBacking};
//!
//! // A 4 MiB RAM namespace with 4 KiB blocks, its controller run on a device thread.
//! let cfg = ControllerConfig { lba_size: 4096, ..ControllerConfig::default() };
//! let ctrl = Controller::new(cfg, Box::new(RamBacking::new(4 << 20))).unwrap();
//! let local = LocalNvme::new(ctrl, 2048, ProcessMode::Thread);
//! let drv = local.driver(DriverConfig::default()).unwrap();
//! drv.write_at(10_000, b"hello, remote disk", false).unwrap();
//! drv.flush().unwrap();
//! let mut back = [0u8; 18];
//! drv.read_at(10_000, &mut back).unwrap();
//! assert_eq!(&back, b"hello, remote disk");
//! // Errors carry the NVMe status.
//! let e = drv.submit_io_raw(0, lanbus_nvme::Sqe { opcode: 0x7e, nsid: 1, ..Default::default() }).unwrap();
//! assert_eq!(e.status, lanbus_nvme::Status::INVALID_OPCODE);
//! ```
#![deny(unsafe_code)]
#![deny(missing_docs)]

pub mod backing;
pub mod command;
pub mod controller;
pub mod driver;
pub mod local;
pub mod pcie;
pub mod prp;
pub mod sgl;
pub mod status;

pub use backing::{Backing, FileBacking, RamBacking};
#[cfg(any(test, fuzzing))]
pub use command::fuzz_command;
pub use command::{Completion, Sqe};
pub use controller::{Controller, ControllerConfig, ControllerStats, PciInfo};
pub use driver::{Bar, CompletionMode, DriverConfig, DriverError, Finished, IoStream, NvmeDriver};
pub use status::Status;

use lanbus_bridge::dma::BusError;

/// DMA toward host memory, as the controller model sees it. The device bridge implements it with
/// memory read requests (waiting for their completions) and posted memory writes; the in-process
/// join implements it over a [`lanbus_bridge::dma::HostRegion`].
///
/// Contract for implementers: `read` fills the whole buffer or fails; `write` applies the whole
/// buffer or fails; a write of up to 64 bytes is seen by the host all at once (a completion queue
/// entry is never observed half written), and writes become visible to the host in the order they
/// were issued (PCIe posted-write ordering), so a completion entry never overtakes its data.
/// Failures never panic the controller: a failed data transfer completes the command with status
/// Data Transfer Error, a failed command fetch or completion post sets CSTS.CFS.
pub trait HostMemory {
    /// Reads `buf.len()` bytes of host memory at bus address `addr`.
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), BusError>;
    /// Reads `len` bytes at `addr` into a buffer of their own: a memory whose reads arrive in
    /// buffers hands that one over instead of copying it. The default reads into a fresh one.
    fn read_owned(&mut self, addr: u64, len: usize) -> Result<Vec<u8>, BusError> {
        let mut buf = vec![0; len];
        self.read(addr, &mut buf)?;
        Ok(buf)
    }
    /// Writes `data` to host memory at bus address `addr`.
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), BusError>;
    /// The `len` bytes at bus address `addr` if they are on the device's side already (in its
    /// own memory, the Controller Memory Buffer, or read ahead for the command that asks), for the
    /// controller to use in place instead of reading a copy. `None` (the default) means: use
    /// [`HostMemory::read`].
    fn local(&self, addr: u64, len: usize) -> Option<&[u8]> {
        let _ = (addr, len);
        None
    }
    /// The controller will soon read exactly these `len` bytes at `addr` (a submission queue's
    /// new entries, a PRP list, a write's data), which the host leaves alone until then: a memory
    /// that can start that read now does, and the next read of exactly that range takes its
    /// result. A hint; the default ignores it.
    fn prefetch(&mut self, addr: u64, len: usize) {
        let _ = (addr, len);
    }
}

/// MSI-X signalling, as the controller model sees it. The device bridge looks the vector up in
/// the function's MSI-X table (masking, pending bits) and sends the message write to the host.
pub trait InterruptSink {
    /// Signals MSI-X table entry `vector` (always below the configured table size).
    fn signal_msix(&mut self, vector: u16);
}
