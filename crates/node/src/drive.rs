//! The remote NVMe drive: the controller model as a device bridge's function, the user-space
//! driver on a host bridge, and the namespace as an NBD [`BlockDevice`].
//!
//! Layer: assembly, above `lanbus_nvme::pcie`, `lanbus_bridge` and `lanbus_nbd`. The daemons,
//! `lanbus demo`, `lanbus bench nvme` and the real-client tests all build the drive through the
//! functions here, so they measure and test the same path.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use lanbus_bridge::{HostBridge, HostedFunction, RemoteFunction};
use lanbus_nbd::{BlockDevice, BlockQueue, DeviceError, Errno, Reaped};
use lanbus_nvme::backing::{BackingTime, Timed};
use lanbus_nvme::pcie::{attach, FunctionStats, NvmeFunction};
use lanbus_nvme::{
    Backing, CompletionMode, Controller, ControllerConfig, DriverConfig, DriverError, FileBacking, Finished,
    HostRegion, IoStream, NvmeDriver, RamBacking,
};

use crate::{parse_size, Error, Result};

/// Bus address of the host memory region the driver's queues and buffers live in.
pub const DMA_REGION_BASE: u64 = 0x10_0000_0000;
/// Pages (4 KiB) of that region: 64 MiB, room for many NBD requests of the driver's window.
pub const DMA_REGION_PAGES: usize = 16 * 1024;

/// The namespace of an NVMe driver as an NBD block device.
pub struct NvmeBlock {
    drv: Arc<NvmeDriver>,
}

impl NvmeBlock {
    /// Exports `drv`'s namespace.
    pub fn new(drv: Arc<NvmeDriver>) -> NvmeBlock {
        NvmeBlock { drv }
    }
}

fn nbd_error(e: DriverError) -> DeviceError {
    let errno = match e.errno() {
        22 => Errno::Inval,
        12 => Errno::NoMem,
        95 => Errno::NotSup,
        _ => Errno::Io,
    };
    DeviceError::Device { errno, message: e.to_string() }
}

impl BlockDevice for NvmeBlock {
    fn size_bytes(&self) -> u64 {
        self.drv.size_bytes()
    }
    fn block_size(&self) -> u32 {
        self.drv.block_size()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> core::result::Result<(), DeviceError> {
        self.drv.read_at(offset, buf).map_err(nbd_error)
    }
    fn read_lent(
        &self,
        offset: u64,
        len: usize,
        reply: &mut dyn FnMut(&[&[u8]]),
    ) -> Option<core::result::Result<(), DeviceError>> {
        self.drv.read_lent(offset, len, reply).map(|r| r.map_err(nbd_error))
    }
    fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> core::result::Result<(), DeviceError> {
        self.drv.write_at(offset, data, fua).map_err(nbd_error)
    }
    fn flush(&self) -> core::result::Result<(), DeviceError> {
        self.drv.flush().map_err(nbd_error)
    }
    fn trim(&self, offset: u64, len: u64) -> core::result::Result<(), DeviceError> {
        self.drv.trim_at(offset, len).map_err(nbd_error)
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool) -> core::result::Result<(), DeviceError> {
        self.drv.write_zeroes_at(offset, len, may_trim).map_err(nbd_error)
    }
    fn queue(&self) -> Option<Box<dyn BlockQueue + '_>> {
        let stream = self.drv.stream()?;
        Some(Box::new(NvmeQueue { stream, finished: Vec::new() }))
    }
}

/// An NBD connection's requests in flight on a queue pair of the driver's reserved for it.
struct NvmeQueue<'d> {
    stream: IoStream<'d>,
    finished: Vec<Finished<'d>>,
}

/// Bytes an NBD connection keeps in flight on its queue pair: more large requests at once gain
/// nothing once the fabric is busy, and their buffers only push each other out of the caches.
const QUEUE_INFLIGHT_BYTES: usize = 4 << 20;

impl NvmeQueue<'_> {
    /// Whether a request of `len` bytes may go in now: the queue has entries for it, and the
    /// bytes in flight stay within [`QUEUE_INFLIGHT_BYTES`] (a request alone always may).
    fn room_for(&self, len: usize) -> bool {
        let s = &self.stream;
        s.room_for(len) && (s.in_flight() == 0 || s.in_flight_bytes() + len <= QUEUE_INFLIGHT_BYTES)
    }

    /// `Ok(false)` when the request must wait for room (queue entries or DMA memory) that
    /// requests in flight will free.
    fn submitted(&self, r: core::result::Result<(), DriverError>) -> core::result::Result<bool, DeviceError> {
        match r {
            Ok(()) => Ok(true),
            Err(DriverError::OutOfDmaMemory(_)) if self.stream.in_flight() > 0 => Ok(false),
            Err(e) => Err(nbd_error(e)),
        }
    }
}

impl BlockQueue for NvmeQueue<'_> {
    fn max_request_bytes(&self) -> usize {
        self.stream.max_request_bytes()
    }
    fn in_flight(&self) -> usize {
        self.stream.in_flight()
    }
    fn submit_read(&mut self, tag: u64, offset: u64, len: usize) -> core::result::Result<bool, DeviceError> {
        if !self.room_for(len) {
            return Ok(false);
        }
        let r = self.stream.submit_read(tag, offset, len);
        self.submitted(r)
    }
    fn submit_write(
        &mut self,
        tag: u64,
        offset: u64,
        data: &[u8],
        fua: bool,
    ) -> core::result::Result<bool, DeviceError> {
        if !self.room_for(data.len()) {
            return Ok(false);
        }
        let r = self.stream.submit_write(tag, offset, data, fua);
        self.submitted(r)
    }
    fn submit_write_shared(
        &mut self,
        tag: u64,
        offset: u64,
        data: &Arc<Vec<u8>>,
        fua: bool,
    ) -> core::result::Result<bool, DeviceError> {
        if !self.room_for(data.len()) {
            return Ok(false);
        }
        let r = self.stream.submit_write_shared(tag, offset, data, fua);
        self.submitted(r)
    }
    fn submit_write_filled(
        &mut self,
        tag: u64,
        offset: u64,
        len: usize,
        fua: bool,
        fill: &mut dyn FnMut(&mut [&mut [u8]]) -> bool,
    ) -> Option<core::result::Result<bool, DeviceError>> {
        if !self.stream.writes_in_place() {
            return None;
        }
        if !self.room_for(len) {
            return Some(Ok(false));
        }
        let r = self.stream.submit_write_filled(tag, offset, len, fua, fill)?;
        Some(self.submitted(r))
    }
    fn write_piece_bytes(&self) -> Option<usize> {
        self.stream.write_piece_bytes()
    }
    fn start(&mut self) -> core::result::Result<(), DeviceError> {
        self.stream.ring().map_err(nbd_error)
    }
    fn reap(&mut self, done: &mut dyn FnMut(u64, Reaped<'_>)) -> core::result::Result<usize, DeviceError> {
        let n = self.stream.reap(&mut self.finished).map_err(nbd_error)?;
        for f in self.finished.drain(..) {
            let tag = f.tag;
            match f.result {
                Ok(()) => {
                    if let Err(e) = f.lend(&mut |data| done(tag, Ok(data))) {
                        done(tag, Err(nbd_error(e)));
                    }
                }
                Err(ref e) => done(tag, Err(nbd_error(e.clone()))),
            }
        }
        Ok(n)
    }
    fn wait(&mut self, timeout: Duration) {
        self.stream.wait(timeout);
    }
}

/// Where the namespace's blocks live: `file=PATH[,size=SIZE]` or `ram=SIZE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NvmeBacking {
    /// A file (created with `size` if given and missing or shorter; else used whole).
    File {
        /// The file.
        path: PathBuf,
        /// Its size, if given.
        size: Option<u64>,
    },
    /// RAM of this many bytes.
    Ram(u64),
}

impl std::str::FromStr for NvmeBacking {
    type Err = Error;
    fn from_str(s: &str) -> Result<NvmeBacking> {
        let expected = || Error::BadSpec(format!("{s:?}: expected file=PATH[,size=SIZE] or ram=SIZE"));
        let mut parts = s.split(',');
        let first = parts.next().unwrap_or("");
        let (kind, value) = first.split_once('=').ok_or_else(expected)?;
        let mut size = None;
        for p in parts {
            match p.split_once('=') {
                Some(("size", v)) => size = Some(parse_size(v)?),
                _ => {
                    return Err(Error::BadSpec(format!("unknown option {p:?} in {s:?}: expected size=SIZE")))
                }
            }
        }
        match kind {
            "file" if !value.is_empty() => Ok(NvmeBacking::File { path: value.into(), size }),
            "ram" if size.is_none() => Ok(NvmeBacking::Ram(parse_size(value)?)),
            _ => Err(expected()),
        }
    }
}

impl std::fmt::Display for NvmeBacking {
    /// The spec's own form: `file=PATH[,size=BYTES]` or `ram=BYTES`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NvmeBacking::File { path, size: Some(n) } => write!(f, "file={},size={n}", path.display()),
            NvmeBacking::File { path, size: None } => write!(f, "file={}", path.display()),
            NvmeBacking::Ram(n) => write!(f, "ram={n}"),
        }
    }
}

/// Size of the controller's memory buffer (BAR2): the driver puts its submission queues, PRP
/// lists and write data there (8 requests of the driver's 2 MiB window), so commands and write
/// data reach the drive with posted writes rather than by the drive reading them.
pub const CMB_BYTES: u64 = 16 << 20;

/// A controller model over `backing` with `lba_size`-byte blocks (512 or 4096).
pub fn controller(backing: &NvmeBacking, lba_size: u32) -> Result<Controller> {
    controller_over(open_backing(backing)?, lba_size)
}

/// [`controller`], with a handle on the time its backing store spends in reads and writes (for
/// measurements of where a command's time goes).
pub fn controller_timed(backing: &NvmeBacking, lba_size: u32) -> Result<(Controller, Arc<BackingTime>)> {
    let (store, time) = Timed::new(open_backing(backing)?);
    Ok((controller_over(Box::new(store), lba_size)?, time))
}

fn open_backing(backing: &NvmeBacking) -> Result<Box<dyn Backing>> {
    Ok(match backing {
        NvmeBacking::Ram(n) => Box::new(RamBacking::new(*n)),
        NvmeBacking::File { path, size: Some(n) } => {
            Box::new(FileBacking::open(path, *n).map_err(|source| Error::Backing {
                path: path.clone(),
                hint: "",
                source,
            })?)
        }
        NvmeBacking::File { path, size: None } => {
            Box::new(FileBacking::open_existing(path).map_err(|source| Error::Backing {
                path: path.clone(),
                hint: " (give size=SIZE to create it)",
                source,
            })?)
        }
    })
}

fn controller_over(store: Box<dyn Backing>, lba_size: u32) -> Result<Controller> {
    if store.len() < u64::from(lba_size) {
        return Err(Error::BadSpec(format!("the backing store is smaller than one {lba_size}-byte block")));
    }
    let cfg = ControllerConfig { lba_size, cmb_bytes: CMB_BYTES, ..ControllerConfig::default() };
    Controller::new(cfg, store).map_err(|e| Error::Nvme(e.to_string()))
}

/// The controller as a function for a device bridge.
pub fn nvme_function(ctrl: Controller) -> Result<(HostedFunction, Arc<FunctionStats>)> {
    NvmeFunction::hosted(ctrl).map_err(|e| Error::Nvme(e.to_string()))
}

/// How the daemons' driver learns of completions: polling the completion queue for a short
/// while, then sleeping on MSI-X (the fastest of the two in `lanbus bench nvme`: a completion
/// that arrives while the driver polls costs no wake-up).
pub const COMPLETION: CompletionMode = CompletionMode::Poll;

/// The driver settings the daemons use.
pub fn driver_config() -> DriverConfig {
    DriverConfig {
        // The first pair serves the plain calls; each of the others can be one NBD
        // connection's own (`NvmeDriver::stream`).
        io_queues: 8,
        io_timeout: Duration::from_secs(10),
        max_inflight_bytes: 2 << 20,
        completion: COMPLETION,
        ..DriverConfig::default()
    }
}

/// Starts the NVMe driver on function `f` of `host`.
pub fn start_driver(host: &Arc<HostBridge>, f: &RemoteFunction) -> Result<Arc<NvmeDriver>> {
    start_driver_with(host, f, driver_config())
}

/// Starts the NVMe driver on function `f` of `host` with settings `cfg`.
pub fn start_driver_with(
    host: &Arc<HostBridge>,
    f: &RemoteFunction,
    cfg: DriverConfig,
) -> Result<Arc<NvmeDriver>> {
    let region = Arc::new(HostRegion::new(DMA_REGION_BASE, DMA_REGION_PAGES));
    let drv = attach(host, f, region, cfg).map_err(|source| Error::Driver { bdf: f.bdf, source })?;
    Ok(Arc::new(drv))
}

/// Whether `f` is an NVMe controller.
pub fn is_nvme(f: &RemoteFunction) -> bool {
    f.class_code == 0x01_08_02
}
