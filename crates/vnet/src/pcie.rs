//! The NIC across the bridges: the device model as a device bridge's function, the driver over a
//! host bridge, and the driver exported as a TAP on the host.
//!
//! Layer: glue over `lanbus_bridge`. [`attach`] finds the virtio structures through the
//! function's vendor-specific capabilities (read with configuration requests), lends a
//! [`HostRegion`] to the host bridge for the queues and buffers, and waits on the bridge's MSI-X
//! eventfds. [`TapExport`] moves frames between a host TAP and the driver on two threads.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use lanbus_bridge::dma::{bridge_error, BusError, HostRegion, InterruptWait, RegionView};
use lanbus_bridge::{BridgeError, EventFd, HostBridge, HostedFunction, RemoteFunction};
use lanbus_pcie::config::cap_id;
use lanbus_pcie::Bdf;

use crate::device::{NetConfig, NetDevice, NetStats, Offloads};
use crate::driver::{region_pages, DriverConfig, DriverError, Mmio, NetDriver, Structures};
use crate::tap::{Tap, TapWire};
use crate::{feature, layout};

/// Frames the I/O box holds for the host before its TAP's own queue takes over.
const INBOUND_FRAMES: usize = 512;

/// The last error a device hit, shared with the daemon's status.
pub type LastError = Arc<Mutex<Option<String>>>;

/// A virtio-net function whose wire is TAP `name` in the I/O box, ready for a device bridge; its
/// counters and last error.
pub fn tap_function(
    name: &str,
    cfg: NetConfig,
) -> std::io::Result<(HostedFunction, Arc<NetStats>, LastError)> {
    let stats = Arc::new(NetStats::default());
    let wire = TapWire::open(name, cfg.mtu, INBOUND_FRAMES, stats.clone())?;
    let inbound = wire.inbound();
    let dev = NetDevice::with_stats(cfg, Box::new(wire), inbound, stats.clone());
    let last = dev.last_error();
    let f = HostedFunction::model(dev).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok((f, stats, last))
}

/// Whether `f` is a virtio-net function.
pub fn is_nic(f: &RemoteFunction) -> bool {
    f.vendor_id == crate::VENDOR_ID && f.device_id == crate::DEVICE_ID
}

struct RemoteMmio {
    bridge: Arc<HostBridge>,
    bdf: Bdf,
}

impl Mmio for RemoteMmio {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), BusError> {
        self.bridge.mmio_read(self.bdf, addr, buf).map_err(|e| bridge_error(e, addr))
    }
    fn write(&self, addr: u64, data: &[u8]) -> Result<(), BusError> {
        self.bridge.mmio_write(self.bdf, addr, data).map_err(|e| bridge_error(e, addr))
    }
}

struct Vectors(Vec<Arc<EventFd>>);

impl InterruptWait for Vectors {
    fn wait_vector(&self, vector: u16, timeout: Duration) -> bool {
        match self.0.get(usize::from(vector)) {
            Some(fd) => fd.take() > 0 || (!timeout.is_zero() && fd.wait(timeout) > 0),
            None => false,
        }
    }
}

/// Why [`attach`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AttachError {
    /// The function is not a usable virtio-net device.
    #[error("{0} is not a usable virtio-net device: {1}")]
    NotNic(Bdf, String),
    /// The host bridge refused the region, an eventfd or a configuration read.
    #[error("host bridge: {0}")]
    Bridge(#[from] BridgeError),
    /// The driver could not set the device up.
    #[error("virtio-net driver: {0}")]
    Driver(#[from] DriverError),
}

/// Reads the virtio structures' bus addresses from `f`'s vendor-specific capabilities.
pub fn structures(bridge: &HostBridge, f: &RemoteFunction) -> Result<Structures, AttachError> {
    let bad = |why: &str| AttachError::NotNic(f.bdf, why.to_string());
    let (mut common, mut notify, mut isr, mut device) = (None, None, None, None);
    for &(id, at) in &f.capabilities {
        if id != cap_id::VENDOR {
            continue;
        }
        let dw0 = bridge.config_read(f.bdf, at)?;
        let dw1 = bridge.config_read(f.bdf, at + 4)?;
        let offset = u64::from(bridge.config_read(f.bdf, at + 8)?);
        let cfg_type = (dw0 >> 24) as u8;
        let bar = (dw1 & 0xff) as usize;
        let Some(b) = f.bar(bar) else { continue };
        let addr = b.address + offset;
        match cfg_type {
            layout::CAP_COMMON => common = common.or(Some(addr)),
            layout::CAP_NOTIFY => {
                let mult = bridge.config_read(f.bdf, at + 16)?;
                notify = notify.or(Some((addr, mult)));
            }
            layout::CAP_ISR => isr = isr.or(Some(addr)),
            layout::CAP_DEVICE => device = device.or(Some(addr)),
            _ => {}
        }
    }
    let (notify, notify_multiplier) = notify.ok_or_else(|| bad("no notification capability"))?;
    Ok(Structures {
        common: common.ok_or_else(|| bad("no common configuration capability"))?,
        notify,
        notify_multiplier,
        isr: isr.ok_or_else(|| bad("no ISR capability"))?,
        device: device.ok_or_else(|| bad("no device configuration capability"))?,
    })
}

/// Bus address of the region the NIC driver's queues and buffers live in (apart from the NVMe
/// driver's).
pub const REGION_BASE: u64 = 0x20_0000_0000;

/// Starts the virtio-net driver on remote function `f` of `bridge`.
pub fn attach(
    bridge: &Arc<HostBridge>,
    f: &RemoteFunction,
    cfg: DriverConfig,
) -> Result<NetDriver, AttachError> {
    if !is_nic(f) {
        return Err(AttachError::NotNic(f.bdf, format!("{:04x}:{:04x}", f.vendor_id, f.device_id)));
    }
    let st = structures(bridge, f)?;
    let vectors = f.msix_vectors();
    if vectors < 3 {
        return Err(AttachError::NotNic(f.bdf, format!("{vectors} MSI-X vectors, 3 needed")));
    }
    let fds = (0..vectors).map(|v| bridge.interrupt_eventfd(f.bdf, v)).collect::<Result<Vec<_>, _>>()?;
    for fd in &fds {
        fd.take();
    }
    let region = Arc::new(HostRegion::new(REGION_BASE, region_pages(&cfg) + 16));
    bridge.remove_region(REGION_BASE);
    bridge.add_region(REGION_BASE, Arc::new(RegionView(region.clone())))?;
    let mmio = Arc::new(RemoteMmio { bridge: bridge.clone(), bdf: f.bdf });
    Ok(NetDriver::new(mmio, st, region, Arc::new(Vectors(fds)), cfg)?)
}

/// Frames a transmit round takes from the TAP before it notifies the device.
const TX_BATCH: usize = 32;

/// A driver exported as a host TAP: what the kernel sends through the TAP goes to the device,
/// what the device receives comes out of the TAP. Stops (and resets the device) when dropped.
pub struct TapExport {
    driver: Arc<NetDriver>,
    tap: Arc<Tap>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    error: Arc<Mutex<Option<String>>>,
}

impl TapExport {
    /// Sets `tap` to the device's MAC and MTU and to the offloads the driver negotiated, turns its
    /// carrier on, and starts moving frames.
    pub fn start(driver: Arc<NetDriver>, tap: Arc<Tap>) -> std::io::Result<TapExport> {
        let f = driver.features();
        tap.configure(Some(driver.mac()), Some(driver.mtu()), true)?;
        tap.set_offloads(Offloads {
            csum: f & feature::CSUM != 0,
            tso4: f & feature::HOST_TSO4 != 0,
            tso6: f & feature::HOST_TSO6 != 0,
            ecn: f & feature::HOST_ECN != 0,
        })?;
        tap.set_carrier(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let error = Arc::new(Mutex::new(None));
        let mut threads = Vec::new();
        {
            let (d, t, s, e) = (driver.clone(), tap.clone(), stop.clone(), error.clone());
            threads.push(std::thread::Builder::new().name("nic-tx".into()).spawn(move || {
                if let Err(err) = transmit_loop(&d, &t, &s) {
                    *e.lock().unwrap_or_else(|x| x.into_inner()) = Some(err.to_string());
                }
            })?);
        }
        {
            let (d, t, s, e) = (driver.clone(), tap.clone(), stop.clone(), error.clone());
            threads.push(std::thread::Builder::new().name("nic-rx".into()).spawn(move || {
                if let Err(err) = receive_loop(&d, &t, &s) {
                    *e.lock().unwrap_or_else(|x| x.into_inner()) = Some(err.to_string());
                }
            })?);
        }
        Ok(TapExport { driver, tap, stop, threads, error })
    }

    /// The driver.
    pub fn driver(&self) -> &Arc<NetDriver> {
        &self.driver
    }

    /// What stopped a thread, if one stopped.
    pub fn error(&self) -> Option<String> {
        self.error.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Stops moving frames, turns the carrier off and, if `reset`, resets the device (not when it
    /// is gone: nobody would answer).
    pub fn stop(mut self, reset: bool) {
        self.halt(reset);
    }

    fn halt(&mut self, reset: bool) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let _ = self.tap.set_carrier(false);
        if reset {
            let _ = self.driver.stop();
        }
    }
}

impl Drop for TapExport {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.halt(false);
        }
    }
}

fn transmit_loop(drv: &NetDriver, tap: &Tap, stop: &AtomicBool) -> Result<(), DriverError> {
    // Each frame is read from the TAP straight into its transmit buffer in DMA memory.
    // A read the kernel refuses ends the batch; the next wait says whether the TAP is still there.
    let mut read = |bufs: &mut [&mut [u8]]| tap.read_vectored_now(bufs).ok().flatten().unwrap_or(0);
    while !stop.load(Ordering::Relaxed) {
        if drv.tx_room()? == 0 {
            drv.tx_wait(Duration::from_millis(10));
            continue;
        }
        if !tap.wait(Duration::from_millis(100)).unwrap_or(false) {
            continue;
        }
        let mut queued = 0;
        while queued < TX_BATCH && !stop.load(Ordering::Relaxed) {
            match drv.tx_fill(&mut read)? {
                Some(0) => break,
                Some(_) => queued += 1,
                None => {
                    drv.tx_flush()?;
                    while drv.tx_room()? == 0 && !stop.load(Ordering::Relaxed) {
                        drv.tx_wait(Duration::from_millis(10));
                    }
                }
            }
        }
        drv.tx_flush()?;
    }
    Ok(())
}

fn receive_loop(drv: &NetDriver, tap: &Tap, stop: &AtomicBool) -> Result<(), DriverError> {
    while !stop.load(Ordering::Relaxed) {
        // Each frame is written to the TAP from the DMA memory it was received into.
        let n = drv.rx_poll_lent(&mut |pieces| {
            // A frame the kernel refuses is the kernel's drop, counted on the interface.
            let _ = tap.write_vectored(pieces);
        })?;
        if n == 0 {
            drv.rx_wait(Duration::from_millis(100));
        }
    }
    Ok(())
}
