//! The device and the driver joined in-process, without a fabric: MMIO calls the model, its DMA
//! goes to a [`HostRegion`], its MSI-X to counters the driver waits on. Every MMIO write runs
//! the device's pending work before it returns; [`LocalNic::pump`] runs it for frames that
//! arrived on the wire. For tests and the fuzz target.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use lanbus_bridge::dma::{BusError, DmaMemory, HostRegion, InterruptWait};
use lanbus_pcie::device::{DeviceIo, DeviceModel, DmaError, DmaId, HostRequest, IoOp};
use lanbus_pcie::CplStatus;

use crate::device::{Inbound, NetConfig, NetDevice, Offloads, Wire};
use crate::driver::{region_pages, DriverConfig, DriverError, Mmio, NetDriver, Structures};
use crate::layout;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A wire that keeps what was sent.
#[derive(Debug, Default, Clone)]
pub struct RecordingWire {
    /// Frames sent, with their headers.
    pub sent: Arc<Mutex<Vec<Vec<u8>>>>,
    /// The offloads last set.
    pub offloads: Arc<Mutex<Offloads>>,
}

impl Wire for RecordingWire {
    fn send(&mut self, frame: Vec<u8>) -> std::io::Result<()> {
        lock(&self.sent).push(frame);
        Ok(())
    }
    fn set_offloads(&mut self, offloads: Offloads) -> std::io::Result<()> {
        *lock(&self.offloads) = offloads;
        Ok(())
    }
}

/// MSI-X counters per vector, waited on like eventfds.
#[derive(Debug, Default)]
struct Vectors {
    fired: Mutex<Vec<u64>>,
    cv: Condvar,
}

impl InterruptWait for Vectors {
    fn wait_vector(&self, vector: u16, timeout: Duration) -> bool {
        let mut f = lock(&self.fired);
        let v = usize::from(vector);
        if f.get(v).copied().unwrap_or(0) == 0 && !timeout.is_zero() {
            f = self.cv.wait_timeout(f, timeout).unwrap_or_else(|e| e.into_inner()).0;
        }
        match f.get_mut(v) {
            Some(n) if *n > 0 => {
                *n = 0;
                true
            }
            _ => false,
        }
    }
}

/// Where BAR0 sits on the in-process bus.
const BAR_BASE: u64 = 0x1000_0000;
/// Where host memory starts.
const MEM_BASE: u64 = 0x1_0000_0000;

struct Join {
    dev: Mutex<Local>,
    mem: Arc<HostRegion>,
    irq: Arc<Vectors>,
}

/// The model, the handle its DMA and interrupts queue in, and the reads a test holds back.
struct Local {
    dev: NetDevice,
    io: DeviceIo,
    /// Whether reads wait in `held` for [`LocalNic::release_reads`] instead of being answered.
    hold: bool,
    held: Vec<(DmaId, u64, usize)>,
}

impl Join {
    /// Serves what the model asked of the host (reads answered at once from host memory) until
    /// it has nothing left to do.
    fn run(&self, l: &mut Local) {
        let Local { dev, io, hold, held } = l;
        for _ in 0..100_000 {
            if dev.has_work() {
                dev.poll(io);
            }
            let Some(op) = io.next_op() else {
                if dev.has_work() {
                    continue;
                }
                return;
            };
            match op {
                IoOp::Dma(HostRequest::Read { id, address, len }) if *hold => held.push((id, address, len)),
                IoOp::Dma(HostRequest::Read { id, address, len }) => self.answer(dev, io, id, address, len),
                IoOp::Dma(HostRequest::Write { address, data }) => {
                    // Posted: a write nowhere is dropped, as on a bus.
                    let _ = DmaMemory::write(&*self.mem, address, &data);
                }
                IoOp::Interrupt(vector) => {
                    let mut f = lock(&self.irq.fired);
                    let v = usize::from(vector);
                    if f.len() <= v {
                        f.resize(v + 1, 0);
                    }
                    f[v] += 1;
                    self.irq.cv.notify_all();
                }
            }
        }
    }
}

impl Join {
    /// Answers a read from host memory.
    fn answer(&self, dev: &mut NetDevice, io: &mut DeviceIo, id: DmaId, address: u64, len: usize) {
        let mut buf = vec![0u8; len];
        let result = DmaMemory::read(&*self.mem, address, &mut buf)
            .map(|()| buf)
            .map_err(|_| DmaError::Completion(CplStatus::UnsupportedRequest));
        dev.dma_read_done_owned(id, result, io);
    }
}

impl Mmio for Join {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), BusError> {
        let off = addr
            .checked_sub(BAR_BASE)
            .filter(|o| *o < layout::BAR_SIZE)
            .ok_or(BusError::Unsupported { addr })?;
        let mut l = lock(&self.dev);
        let Local { dev, io, .. } = &mut *l;
        dev.bar_read(0, off, buf, io).map_err(|_| BusError::Rejected("completer abort"))
    }
    fn write(&self, addr: u64, data: &[u8]) -> Result<(), BusError> {
        let off = addr
            .checked_sub(BAR_BASE)
            .filter(|o| *o < layout::BAR_SIZE)
            .ok_or(BusError::Unsupported { addr })?;
        let mut l = lock(&self.dev);
        let Local { dev, io, .. } = &mut *l;
        dev.bar_write(0, off, data, io);
        self.run(&mut l);
        Ok(())
    }
}

/// A device and its host memory, in-process.
pub struct LocalNic {
    join: Arc<Join>,
    inbound: Arc<Inbound>,
    wire: RecordingWire,
}

impl LocalNic {
    /// A device with `cfg` and host memory for a driver with `drv`.
    pub fn new(cfg: NetConfig, drv: &DriverConfig) -> LocalNic {
        let wire = RecordingWire::default();
        let inbound = Inbound::new(1024);
        let dev = NetDevice::new(cfg, Box::new(wire.clone()), inbound.clone());
        let mem = Arc::new(HostRegion::new(MEM_BASE, region_pages(drv) + 4));
        let dev = Mutex::new(Local { dev, io: DeviceIo::default(), hold: false, held: Vec::new() });
        LocalNic { join: Arc::new(Join { dev, mem, irq: Arc::default() }), inbound, wire }
    }

    /// Starts a driver on the device.
    pub fn driver(&self, cfg: DriverConfig) -> Result<NetDriver, DriverError> {
        let st = Structures {
            common: BAR_BASE + layout::COMMON,
            notify: BAR_BASE + layout::NOTIFY,
            notify_multiplier: layout::NOTIFY_MULTIPLIER,
            isr: BAR_BASE + layout::ISR,
            device: BAR_BASE + layout::DEVICE,
        };
        NetDriver::new(self.join.clone(), st, self.join.mem.clone(), self.join.irq.clone(), cfg)
    }

    /// Frames the device sent to its wire so far (taken).
    pub fn take_sent(&self) -> Vec<Vec<u8>> {
        std::mem::take(&mut *lock(&self.wire.sent))
    }

    /// The offloads the device last set on its wire.
    pub fn wire_offloads(&self) -> Offloads {
        *lock(&self.wire.offloads)
    }

    /// A frame (header and Ethernet frame) arrives on the device's wire.
    pub fn arrive(&self, frame: Vec<u8>) -> bool {
        self.inbound.push(frame, Duration::ZERO)
    }

    /// Runs the device's pending work (frames that arrived).
    pub fn pump(&self) {
        let mut l = lock(&self.join.dev);
        self.join.run(&mut l);
    }

    /// Holds the device's DMA reads back from now on (`true`), until released, so that a test
    /// chooses when and in what order they end; `false` answers them at once again.
    pub fn hold_reads(&self, hold: bool) {
        lock(&self.join.dev).hold = hold;
    }

    /// Answers the reads held back so far (the newest alone with `newest_only`), then runs the
    /// device; returns how many were answered. Reads the device starts meanwhile are held.
    pub fn release_reads(&self, newest_only: bool) -> usize {
        let mut l = lock(&self.join.dev);
        let take = if newest_only { l.held.len().saturating_sub(1) } else { 0 };
        let ready: Vec<_> = l.held.drain(take..).collect();
        let Local { dev, io, .. } = &mut *l;
        for &(id, address, len) in &ready {
            self.join.answer(dev, io, id, address, len);
        }
        self.join.run(&mut l);
        ready.len()
    }

    /// The device's counters.
    pub fn stats(&self) -> Arc<crate::NetStats> {
        lock(&self.join.dev).dev.stats()
    }

    /// Host memory, for tests that play a hostile driver.
    pub fn memory(&self) -> &HostRegion {
        &self.join.mem
    }

    /// An MMIO write to BAR0 at `offset` (a hostile driver's register writes).
    pub fn bar_write(&self, offset: u64, data: &[u8]) {
        let _ = Mmio::write(&*self.join, BAR_BASE + offset, data);
    }

    /// An MMIO read of BAR0 at `offset`.
    pub fn bar_read(&self, offset: u64, buf: &mut [u8]) {
        let _ = Mmio::read(&*self.join, BAR_BASE + offset, buf);
    }
}

/// The fuzz target's body: a driver sets the device up with 8-entry queues, then `data` is
/// written over both queues' rings and descriptor tables (a hostile driver), frames arrive, and
/// both queues are notified with indices taken from `data`. The device must not crash; a broken
/// ring leaves it needing a reset.
pub fn fuzz_rings(data: &[u8]) {
    let cfg = DriverConfig { queue_size: 8, refuse: 0 };
    let nic = LocalNic::new(NetConfig { queue_size: 8, ..NetConfig::default() }, &cfg);
    let Ok(drv) = nic.driver(cfg) else { return };
    let areas = drv.queue_areas();
    let mut rest = data;
    for (desc, _, used) in areas {
        // Descriptor table and available ring (contiguous), then the used ring's first bytes.
        for (at, len) in [(desc, 16 * 8 + 4 + 2 * 8), (used, 4 + 8 * 8)] {
            let n = rest.len().min(len);
            let _ = DmaMemory::write(nic.memory(), at, &rest[..n]);
            rest = &rest[n..];
        }
    }
    for (i, chunk) in rest.chunks(4).take(8).enumerate() {
        let mut v = [0u8; 4];
        v[..chunk.len()].copy_from_slice(chunk);
        v[0] = (i % 2) as u8;
        v[1] = 0;
        let _ = nic.arrive(vec![0u8; 12 + 60 + i * 100]);
        nic.bar_write(layout::NOTIFY + u64::from(v[0]) * u64::from(layout::NOTIFY_MULTIPLIER), &v);
        nic.pump();
    }
}
