//! The NVMe controller as a PCIe function of the lanbus bridges, and the driver's three traits
//! over a host bridge.
//!
//! Layer: NVMe device and driver glue over the pcie engine (`lanbus_bridge`).
//!
//! - Device side, [`NvmeFunction`]: a [`BlockingDevice`] around a [`Controller`]. Its
//!   configuration space is the controller's [`PciInfo`] (IDs 1b36:0010, class 010802, BAR0 16 KiB
//!   64-bit non-prefetchable, MSI-X with its table and PBA inside BAR0, NVMe base specification
//!   1.4 section 2 and PCIe Base Specification 7.7.2), and BAR2 64-bit prefetchable when the
//!   controller has a Controller Memory Buffer; BAR0 accesses below the MSI-X table go to
//!   `bar0_read`/`bar0_write` (the bridge's function keeps the table and PBA itself), BAR2
//!   accesses to `cmb_read`/`cmb_write`; the controller's DMA and MSI-X go through the bridge
//!   worker's blocking [`HostAccess`], so every command fetch, PRP list, data transfer,
//!   completion entry and interrupt is a TLP (with the memory buffer in use, commands, lists and
//!   write data arrive as the host's posted writes to BAR2 instead of being fetched).
//! - Host side, [`attach`]: the driver's [`Bar`] is MMIO through the host bridge at the BAR0
//!   address enumeration assigned (and at BAR2's for the memory buffer), its [`DmaMemory`](lanbus_bridge::dma::DmaMemory) is a
//!   [`HostRegion`] lent to the bridge as a [`DmaRegion`](lanbus_bridge::DmaRegion) (through
//!   [`RegionView`]) at the region's bus address, and its
//!   [`InterruptWait`] waits on the bridge's MSI-X eventfds (one per vector).
//!
//! Invariants: bus failures become [`BusError`]s (a gone device is [`BusError::Down`], so the
//! driver fails its users instead of waiting); nothing here panics on what the other side sends.

use std::cell::RefCell;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lanbus_bridge::dma::{bridge_error, BusError, HostRegion, InterruptWait, RegionView};
use lanbus_bridge::{BridgeError, EventFd, HostBridge, HostedFunction, RemoteFunction};
use lanbus_bridge::{Lend, LentSlice};
use lanbus_pcie::blocking::{BlockingDevice, HostAccess};
use lanbus_pcie::config::{Bar as PciBar, BarKind, ConfigSpec, MsixSpec};
use lanbus_pcie::device::{CompleterAbort, DmaError};
use lanbus_pcie::{Bdf, CplStatus};

use crate::controller::cmb::BIR as CMB_BIR;
use crate::controller::{ControllerStats, PciInfo, PCI_CLASS};
use crate::driver::{Bar, DriverConfig, DriverError, NvmeDriver};
use crate::{Controller, HostMemory, InterruptSink};

/// A snapshot of a hosted controller's counters, readable from other threads (the device
/// daemon's status): refreshed after every batch of work and every rejected BAR access.
#[derive(Debug, Default)]
pub struct FunctionStats {
    stats: Mutex<(ControllerStats, u64)>,
}

impl FunctionStats {
    /// The controller's counters and the number of BAR accesses it refused.
    pub fn get(&self) -> (ControllerStats, u64) {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An NVMe controller as a PCIe function with synchronous DMA (host it with
/// [`HostedFunction::blocking`], or use [`NvmeFunction::hosted`]).
pub struct NvmeFunction {
    ctrl: Controller,
    info: PciInfo,
    refused: u64,
    stats: Arc<FunctionStats>,
}

impl NvmeFunction {
    /// Wraps `ctrl`.
    pub fn new(ctrl: Controller) -> NvmeFunction {
        let info = ctrl.pci_info();
        NvmeFunction { ctrl, info, refused: 0, stats: Arc::new(FunctionStats::default()) }
    }

    /// The counters, shared.
    pub fn stats(&self) -> Arc<FunctionStats> {
        self.stats.clone()
    }

    /// The function ready for a device bridge, and its counters.
    pub fn hosted(ctrl: Controller) -> lanbus_pcie::Result<(HostedFunction, Arc<FunctionStats>)> {
        let f = NvmeFunction::new(ctrl);
        let stats = f.stats();
        Ok((HostedFunction::blocking(f)?, stats))
    }

    fn publish(&self) {
        *self.stats.stats.lock().unwrap_or_else(|e| e.into_inner()) = (self.ctrl.stats(), self.refused);
    }
}

/// The configuration space of an NVMe controller with this [`PciInfo`].
pub fn config_spec(info: &PciInfo) -> ConfigSpec {
    let mut spec = ConfigSpec::new(info.vendor_id, info.device_id, info.class_code)
        .with_bar(0, PciBar { kind: BarKind::Memory64 { prefetchable: false }, size: info.bar0_size });
    if info.cmb_bar_size > 0 {
        let bar = PciBar { kind: BarKind::Memory64 { prefetchable: true }, size: info.cmb_bar_size };
        spec = spec.with_bar(usize::from(CMB_BIR), bar);
    }
    // Any payload size PCIe allows: the host picks (a software bridge pays per TLP).
    spec.max_payload_supported = 4096;
    spec = spec.with_msix(MsixSpec {
        table_size: info.msix_vectors,
        table_bar: 0,
        table_offset: info.msix_table_offset as u32,
        pba_bar: 0,
        pba_offset: info.msix_pba_offset as u32,
    });
    spec.interrupt_pin = 1;
    spec
}

/// What a failed DMA of the bridge is to the controller.
fn bus_error(e: DmaError, addr: u64) -> BusError {
    match e {
        DmaError::Timeout => BusError::Timeout,
        DmaError::Completion(CplStatus::UnsupportedRequest) => BusError::Unsupported { addr },
        DmaError::Completion(_) => BusError::Rejected("the host answered Completer Abort"),
        DmaError::BusMasterDisabled => BusError::Rejected("bus mastering is disabled"),
        DmaError::HostUnreachable => BusError::Down("host unreachable".into()),
        DmaError::WouldBlock => BusError::NotReady,
        _ => BusError::Down(e.to_string()),
    }
}

/// The worker's [`HostAccess`] shared by the controller's memory and interrupt views, so that
/// interrupts stay in order with the writes before them.
struct Shared<'a, 'b>(&'a RefCell<&'b mut dyn HostAccess>);

impl HostMemory for Shared<'_, '_> {
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), BusError> {
        self.0.borrow_mut().read(addr, buf).map_err(|e| bus_error(e, addr))
    }
    fn read_owned(&mut self, addr: u64, len: usize) -> Result<Vec<u8>, BusError> {
        let mut got = self.0.borrow_mut().read_owned(&[(addr, len)]).map_err(|e| bus_error(e, addr))?;
        match got.pop() {
            Some(bytes) if bytes.len() == len && got.is_empty() => Ok(bytes),
            _ => Err(BusError::Rejected("a read returned the wrong length")),
        }
    }
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), BusError> {
        self.0.borrow_mut().write(addr, data).map_err(|e| bus_error(e, addr))
    }
    fn prefetch(&mut self, addr: u64, len: usize) {
        self.0.borrow_mut().prefetch(addr, len);
    }
}

impl InterruptSink for Shared<'_, '_> {
    fn signal_msix(&mut self, vector: u16) {
        self.0.borrow_mut().signal_msix(vector);
    }
}

impl BlockingDevice for NvmeFunction {
    fn config_spec(&self) -> ConfigSpec {
        config_spec(&self.info)
    }

    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) -> Result<(), CompleterAbort> {
        let r = match bar {
            0 => self.ctrl.bar0_read(offset, data),
            b if b == usize::from(CMB_BIR) => self.ctrl.cmb_read(offset, data),
            _ => return Err(CompleterAbort),
        };
        match r {
            Ok(()) => Ok(()),
            Err(_) => {
                self.refused += 1;
                self.publish();
                Err(CompleterAbort)
            }
        }
    }

    /// Register reads, doorbells and the memory buffer are plain memory work; other register
    /// writes are not (CC may reset the controller or shut it down, which flushes the backing).
    fn serves_inline(&self, bar: usize, offset: u64, write: bool) -> bool {
        match bar {
            0 => !write || offset >= crate::controller::reg::DOORBELLS,
            b => b == usize::from(CMB_BIR),
        }
    }

    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
        let r = match bar {
            0 => self.ctrl.bar0_write(offset, data),
            b if b == usize::from(CMB_BIR) => self.ctrl.cmb_write(offset, data),
            _ => Err(BusError::Unsupported { addr: offset }),
        };
        if r.is_err() {
            // Posted: nobody to tell; counted.
            self.refused += 1;
            self.publish();
        }
    }

    fn has_work(&self) -> bool {
        self.ctrl.has_work()
    }

    fn process(&mut self, host: &mut dyn HostAccess) -> usize {
        let cell = RefCell::new(host);
        let mut mem = Shared(&cell);
        let mut irq = Shared(&cell);
        let done = self.ctrl.process(&mut mem, &mut irq);
        self.publish();
        done
    }

    fn process_posted(&mut self, host: &mut dyn HostAccess) -> usize {
        let cell = RefCell::new(host);
        let mut mem = Shared(&cell);
        let mut irq = Shared(&cell);
        let done = self.ctrl.process_posted(&mut mem, &mut irq);
        if done > 0 {
            self.publish();
        }
        done
    }
}

/// BAR0 of a remote NVMe function, through the host bridge.
pub struct RemoteBar0 {
    bridge: Arc<HostBridge>,
    bdf: Bdf,
    base: u64,
    /// Bus addresses of the function's memory BARs (for the Controller Memory Buffer).
    bars: [Option<u64>; 6],
}

impl RemoteBar0 {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), BusError> {
        let addr = self.base + offset;
        self.bridge.mmio_read(self.bdf, addr, buf).map_err(|e| bridge_error(e, addr))
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), BusError> {
        let addr = self.base + offset;
        self.bridge.mmio_write(self.bdf, addr, data).map_err(|e| bridge_error(e, addr))
    }
}

impl Bar for RemoteBar0 {
    fn read32(&self, offset: u64) -> Result<u32, BusError> {
        let mut b = [0u8; 4];
        self.read(offset, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }
    fn read64(&self, offset: u64) -> Result<u64, BusError> {
        let mut b = [0u8; 8];
        self.read(offset, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }
    fn write32(&self, offset: u64, value: u32) -> Result<(), BusError> {
        self.write(offset, &value.to_le_bytes())
    }
    fn write64(&self, offset: u64, value: u64) -> Result<(), BusError> {
        self.write(offset, &value.to_le_bytes())
    }
    fn bar_address(&self, bir: u8) -> Option<u64> {
        self.bars.get(usize::from(bir)).copied().flatten()
    }
    fn write_bar(&self, bir: u8, offset: u64, data: &[u8]) -> Result<(), BusError> {
        let base = self.bar_address(bir).ok_or(BusError::Unsupported { addr: offset })?;
        let addr = base.checked_add(offset).ok_or(BusError::Unsupported { addr: offset })?;
        self.bridge.mmio_write(self.bdf, addr, data).map_err(|e| bridge_error(e, addr))
    }
    fn write_bar_shared(
        &self,
        bir: u8,
        offset: u64,
        data: &Arc<Vec<u8>>,
        range: std::ops::Range<usize>,
    ) -> Result<(), BusError> {
        let base = self.bar_address(bir).ok_or(BusError::Unsupported { addr: offset })?;
        let addr = base.checked_add(offset).ok_or(BusError::Unsupported { addr: offset })?;
        if range.start > range.end || range.end > data.len() {
            return Err(BusError::Unsupported { addr });
        }
        let bytes = LentSlice::new(Arc::clone(data) as Arc<dyn Lend>, range);
        self.bridge.mmio_write_shared(self.bdf, addr, &bytes).map_err(|e| bridge_error(e, addr))
    }
}

/// MSI-X of a remote function: one bridge eventfd per vector.
pub struct RemoteInterrupts {
    fds: Vec<Arc<EventFd>>,
}

impl InterruptWait for RemoteInterrupts {
    fn wait_vector(&self, vector: u16, timeout: Duration) -> bool {
        match self.fds.get(usize::from(vector)) {
            Some(fd) => fd.take() > 0 || fd.wait(timeout) > 0,
            None => false,
        }
    }
}

/// Why [`attach`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AttachError {
    /// The function is not an NVMe controller or lacks BAR0 or MSI-X.
    #[error("{0} is not a usable NVMe controller: {1}")]
    NotNvme(Bdf, String),
    /// The host bridge refused the DMA region or an eventfd.
    #[error("host bridge: {0}")]
    Bridge(#[from] BridgeError),
    /// The driver could not initialize the controller.
    #[error("NVMe driver: {0}")]
    Driver(#[from] DriverError),
}

/// Starts the NVMe driver on remote function `f` of `bridge`: lends `region` to the bridge at its
/// bus address (taking back a region left there by an earlier attach), waits on the function's
/// MSI-X eventfds, and initializes the controller (reset, admin queue, Identify, I/O queues).
/// `cfg.msix_vectors` is set from the function's MSI-X table.
pub fn attach(
    bridge: &Arc<HostBridge>,
    f: &RemoteFunction,
    region: Arc<HostRegion>,
    mut cfg: DriverConfig,
) -> Result<NvmeDriver, AttachError> {
    if f.class_code != PCI_CLASS {
        return Err(AttachError::NotNvme(f.bdf, format!("class {:06x}, not 010802", f.class_code)));
    }
    let bar0 = f.bar(0).ok_or_else(|| AttachError::NotNvme(f.bdf, "no BAR0".into()))?;
    let vectors = f.msix_vectors();
    if vectors == 0 {
        return Err(AttachError::NotNvme(f.bdf, "no MSI-X".into()));
    }
    let fds = (0..vectors).map(|v| bridge.interrupt_eventfd(f.bdf, v)).collect::<Result<Vec<_>, _>>()?;
    for fd in &fds {
        fd.take();
    }
    bridge.remove_region(region.base());
    bridge.add_region(region.base(), Arc::new(RegionView(region.clone())))?;
    cfg.msix_vectors = vectors;
    let mut bars = [None; 6];
    for (i, b) in bars.iter_mut().enumerate() {
        *b = f.bar(i).map(|b| b.address);
    }
    let bar = Arc::new(RemoteBar0 { bridge: bridge.clone(), bdf: f.bdf, base: bar0.address, bars });
    let drv = NvmeDriver::new(bar, region, Arc::new(RemoteInterrupts { fds }), cfg)?;
    Ok(drv)
}
