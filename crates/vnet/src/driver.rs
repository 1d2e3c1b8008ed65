//! The user-space virtio-net driver (host side).
//!
//! Layer: driver over three small traits, as the NVMe driver is: [`Mmio`] reaches the device's
//! BAR0 structures (through the host bridge: memory read and write TLPs), [`DmaMemory`] holds the
//! queues and frame buffers at bus addresses the device reaches by DMA, [`InterruptWait`] waits
//! for MSI-X vectors (eventfds of the host bridge).
//!
//! Initialization follows VIRTIO 1.2 section 3.1.1: reset, ACKNOWLEDGE, DRIVER, features
//! (VERSION_1 required; the offloads, MAC, MTU, STATUS and NOTIFICATION_DATA when offered),
//! FEATURES_OK read back, the device configuration, the two queues (size, areas, MSI-X vector
//! read back, enable), receive buffers posted, DRIVER_OK. Each descriptor owns one buffer of
//! [`MAX_BUFFER`] bytes for good (descriptor i, buffer i), so a frame of any size the offloads
//! allow is one descriptor; the available ring sits right after the descriptor table, so the
//! device reads both at once.
//!
//! Concurrency: the receive and transmit queues are locked separately, so one thread may receive
//! while another transmits.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use lanbus_bridge::dma::{BusError, DmaMemory, InterruptWait};

use crate::virtq::{AVAIL_F_NO_INTERRUPT, DESC_F_WRITE, MAX_SIZE};
use crate::{common, feature, status, MAX_BUFFER, NET_HDR_LEN, RX_QUEUE, TX_QUEUE};

/// MMIO to the device's structures, at bus addresses.
pub trait Mmio: Send + Sync {
    /// Reads `buf.len()` bytes at `addr`.
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), BusError>;
    /// Writes `data` at `addr` (posted).
    fn write(&self, addr: u64, data: &[u8]) -> Result<(), BusError>;
}

/// Where the device's structures are (bus addresses), from its vendor-specific capabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Structures {
    /// Common configuration.
    pub common: u64,
    /// Notification area.
    pub notify: u64,
    /// Its `notify_off_multiplier`.
    pub notify_multiplier: u32,
    /// ISR status.
    pub isr: u64,
    /// Device configuration.
    pub device: u64,
}

/// Why the driver failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DriverError {
    /// MMIO failed (the device is gone or refused the access).
    #[error("bus: {0}")]
    Bus(#[from] BusError),
    /// The device did something the driver cannot work with.
    #[error("device: {0}")]
    Device(String),
    /// The DMA region is too small for the queues and buffers.
    #[error("out of DMA memory for {0}")]
    NoMemory(&'static str),
}

type Result<T, E = DriverError> = std::result::Result<T, E>;

/// The driver's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DriverConfig {
    /// Entries per queue (at most what the device offers; a power of two).
    pub queue_size: u16,
    /// Features the driver will not use even if offered (for measurements without offloads).
    pub refuse: u64,
}

impl Default for DriverConfig {
    fn default() -> Self {
        DriverConfig { queue_size: 128, refuse: 0 }
    }
}

/// The pages a [`DriverConfig`] needs in the DMA region.
pub fn region_pages(cfg: &DriverConfig) -> usize {
    let size = usize::from(cfg.queue_size);
    2 * (size * buffer_pages() + ring_pages(size).0 + ring_pages(size).1)
}

fn buffer_pages() -> usize {
    MAX_BUFFER.div_ceil(4096)
}

/// Pages of (descriptor table and available ring) and of the used ring.
fn ring_pages(size: usize) -> (usize, usize) {
    ((16 * size + 6 + 2 * size).div_ceil(4096), (6 + 8 * size).div_ceil(4096))
}

/// The driver's counters.
#[derive(Debug, Default)]
pub struct NetDriverStats {
    /// Frames handed to the device.
    pub tx_frames: AtomicU64,
    /// Their bytes (without the header).
    pub tx_bytes: AtomicU64,
    /// Frames received from the device.
    pub rx_frames: AtomicU64,
    /// Their bytes (without the header).
    pub rx_bytes: AtomicU64,
    /// Used entries that made no sense (an unknown id, a length beyond the buffer): dropped.
    pub rx_bad: AtomicU64,
    /// Notifications written.
    pub notifies: AtomicU64,
}

struct DrvQueue {
    index: u16,
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    notify: u64,
    vector: u16,
    /// Buffer of descriptor i.
    bufs: Vec<u64>,
    avail_idx: u16,
    last_used: u16,
    /// Descriptors the driver holds (transmit: free to fill).
    free: Vec<u16>,
    /// Available entries written but not yet published.
    unpublished: u16,
    /// Whether the available ring asks for no interrupt (`VIRTQ_AVAIL_F_NO_INTERRUPT`).
    quiet: bool,
    /// Where received frames are copied out to (grown once, reused: no 64 KiB zeroed per poll).
    scratch: Vec<u8>,
}

/// A running virtio-net driver.
pub struct NetDriver {
    mmio: Arc<dyn Mmio>,
    st: Structures,
    mem: Arc<dyn DmaMemory>,
    irq: Arc<dyn InterruptWait>,
    features: u64,
    mac: [u8; 6],
    mtu: u16,
    rx: Mutex<DrvQueue>,
    tx: Mutex<DrvQueue>,
    stats: NetDriverStats,
    stopped: AtomicBool,
}

impl Drop for NetDriver {
    /// Gives the queues' and buffers' memory back (the device must be reset or gone: a stopped
    /// driver's memory may be reused).
    fn drop(&mut self) {
        for q in [&self.rx, &self.tx] {
            let q = lock(q);
            let (rp, up) = ring_pages(usize::from(q.size));
            self.mem.free(q.desc, rp);
            self.mem.free(q.used, up);
            for b in &q.bufs {
                self.mem.free(*b, buffer_pages());
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The MSI-X vector of configuration changes, and of the two queues.
const CONFIG_VECTOR: u16 = 0;
const RX_VECTOR: u16 = 1;
const TX_VECTOR: u16 = 2;

/// What the driver asks for (when offered).
const WANTED: u64 = feature::VERSION_1
    | feature::MAC
    | feature::MTU
    | feature::STATUS
    | feature::CSUM
    | feature::GUEST_CSUM
    | feature::HOST_TSO4
    | feature::HOST_TSO6
    | feature::HOST_ECN
    | feature::GUEST_TSO4
    | feature::GUEST_TSO6
    | feature::GUEST_ECN
    | feature::NOTIFICATION_DATA;

impl NetDriver {
    /// Resets and initializes the device whose structures are at `st`, with its queues and
    /// buffers in `mem`, and waits for its interrupts on `irq` (vector 0 configuration, 1
    /// receive, 2 transmit).
    pub fn new(
        mmio: Arc<dyn Mmio>,
        st: Structures,
        mem: Arc<dyn DmaMemory>,
        irq: Arc<dyn InterruptWait>,
        cfg: DriverConfig,
    ) -> Result<NetDriver> {
        let bus = mmio.clone();
        let mmio = &*bus;
        let c = |off: u64| st.common + off;
        let w8 = |off: u64, v: u8| mmio.write(c(off), &[v]);
        let w16 = |off: u64, v: u16| mmio.write(c(off), &v.to_le_bytes());
        let w32 = |off: u64, v: u32| mmio.write(c(off), &v.to_le_bytes());
        let w64 = |off: u64, v: u64| mmio.write(c(off), &v.to_le_bytes());
        let r8 = |off: u64| -> Result<u8> {
            let mut b = [0u8; 1];
            mmio.read(c(off), &mut b)?;
            Ok(b[0])
        };
        let r16 = |off: u64| -> Result<u16> {
            let mut b = [0u8; 2];
            mmio.read(c(off), &mut b)?;
            Ok(u16::from_le_bytes(b))
        };
        let r32 = |off: u64| -> Result<u32> {
            let mut b = [0u8; 4];
            mmio.read(c(off), &mut b)?;
            Ok(u32::from_le_bytes(b))
        };

        // Reset, and wait for it to be done (the status reads back 0).
        w8(common::DEVICE_STATUS, 0)?;
        let deadline = Instant::now() + Duration::from_secs(2);
        while r8(common::DEVICE_STATUS)? != 0 {
            if Instant::now() > deadline {
                return Err(DriverError::Device("the device does not finish its reset".into()));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        w8(common::DEVICE_STATUS, status::ACKNOWLEDGE)?;
        w8(common::DEVICE_STATUS, status::ACKNOWLEDGE | status::DRIVER)?;
        w32(common::DEVICE_FEATURE_SELECT, 0)?;
        let lo = r32(common::DEVICE_FEATURE)?;
        w32(common::DEVICE_FEATURE_SELECT, 1)?;
        let hi = r32(common::DEVICE_FEATURE)?;
        let offered = u64::from(hi) << 32 | u64::from(lo);
        if offered & feature::VERSION_1 == 0 {
            return Err(DriverError::Device("not a virtio 1.x device (no VERSION_1)".into()));
        }
        let mut features = offered & WANTED & !cfg.refuse;
        // Segmentation needs checksum offload in the same direction (VIRTIO 1.2 section 5.1.3.1).
        if features & feature::CSUM == 0 {
            features &= !(feature::HOST_TSO4 | feature::HOST_TSO6 | feature::HOST_ECN);
        }
        if features & feature::GUEST_CSUM == 0 {
            features &= !(feature::GUEST_TSO4 | feature::GUEST_TSO6 | feature::GUEST_ECN);
        }
        w32(common::DRIVER_FEATURE_SELECT, 0)?;
        w32(common::DRIVER_FEATURE, features as u32)?;
        w32(common::DRIVER_FEATURE_SELECT, 1)?;
        w32(common::DRIVER_FEATURE, (features >> 32) as u32)?;
        let s = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK;
        w8(common::DEVICE_STATUS, s)?;
        if r8(common::DEVICE_STATUS)? & status::FEATURES_OK == 0 {
            return Err(DriverError::Device(format!("the device refused features {features:#x}")));
        }

        let mut dev = [0u8; 12];
        mmio.read(st.device, &mut dev)?;
        let mut mac = [0u8; 6];
        mac.copy_from_slice(&dev[..6]);
        let mtu = if features & feature::MTU != 0 { u16::from_le_bytes([dev[10], dev[11]]) } else { 1500 };

        w16(common::CONFIG_MSIX_VECTOR, CONFIG_VECTOR)?;
        let mut queues = Vec::new();
        for (q, vector) in [(RX_QUEUE, RX_VECTOR), (TX_QUEUE, TX_VECTOR)] {
            w16(common::QUEUE_SELECT, q)?;
            let max = r16(common::QUEUE_SIZE)?;
            let size = cfg.queue_size.min(max).min(MAX_SIZE);
            if size == 0 || !size.is_power_of_two() {
                return Err(DriverError::Device(format!("queue {q}: size {max} offered")));
            }
            let (rp, up) = ring_pages(usize::from(size));
            let desc = mem.alloc(rp).ok_or(DriverError::NoMemory("a descriptor table"))?;
            let used = mem.alloc(up).ok_or(DriverError::NoMemory("a used ring"))?;
            let avail = desc + 16 * u64::from(size);
            mem.write(desc, &vec![0u8; rp * 4096])?;
            mem.write(used, &vec![0u8; up * 4096])?;
            let mut bufs = Vec::with_capacity(usize::from(size));
            for _ in 0..size {
                bufs.push(mem.alloc(buffer_pages()).ok_or(DriverError::NoMemory("frame buffers"))?);
            }
            w16(common::QUEUE_SIZE, size)?;
            w64(common::QUEUE_DESC, desc)?;
            w64(common::QUEUE_DRIVER, avail)?;
            w64(common::QUEUE_DEVICE, used)?;
            w16(common::QUEUE_MSIX_VECTOR, vector)?;
            if r16(common::QUEUE_MSIX_VECTOR)? != vector {
                return Err(DriverError::Device(format!("queue {q}: MSI-X vector {vector} refused")));
            }
            let notify_off = r16(common::QUEUE_NOTIFY_OFF)?;
            let notify = st.notify + u64::from(notify_off) * u64::from(st.notify_multiplier);
            w16(common::QUEUE_ENABLE, 1)?;
            queues.push(DrvQueue {
                index: q,
                size,
                desc,
                avail,
                used,
                notify,
                vector,
                bufs,
                avail_idx: 0,
                last_used: 0,
                free: (0..size).rev().collect(),
                unpublished: 0,
                quiet: false,
                scratch: Vec::new(),
            });
        }
        let tx = queues.pop().ok_or(DriverError::NoMemory("queues"))?;
        let rx = queues.pop().ok_or(DriverError::NoMemory("queues"))?;
        let drv = NetDriver {
            mmio: bus.clone(),
            st,
            mem,
            irq,
            features,
            mac,
            mtu,
            rx: Mutex::new(rx),
            tx: Mutex::new(tx),
            stats: NetDriverStats::default(),
            stopped: AtomicBool::new(false),
        };
        {
            let mut rx = lock(&drv.rx);
            while let Some(d) = rx.free.pop() {
                drv.offer_rx(&mut rx, d)?;
            }
        }
        w8(common::DEVICE_STATUS, s | status::DRIVER_OK)?;
        let mut rx = lock(&drv.rx);
        drv.publish(&mut rx)?;
        drop(rx);
        Ok(drv)
    }

    /// The negotiated features.
    pub fn features(&self) -> u64 {
        self.features
    }

    /// The device's MAC address.
    pub fn mac(&self) -> [u8; 6] {
        self.mac
    }

    /// The device's MTU (1500 unless it reports one).
    pub fn mtu(&self) -> u16 {
        self.mtu
    }

    /// Bus addresses of each queue's descriptor table, available ring and used ring (receive,
    /// then transmit).
    pub fn queue_areas(&self) -> [(u64, u64, u64); 2] {
        let (rx, tx) = (lock(&self.rx), lock(&self.tx));
        [(rx.desc, rx.avail, rx.used), (tx.desc, tx.avail, tx.used)]
    }

    /// The counters.
    pub fn stats(&self) -> &NetDriverStats {
        &self.stats
    }

    /// Whether the driver was stopped or failed.
    pub fn stopped(&self) -> bool {
        self.stopped.load(Ordering::Relaxed)
    }

    /// Reads the device status (DEVICE_NEEDS_RESET says the device gave up).
    pub fn device_status(&self) -> Result<u8> {
        let mut b = [0u8; 1];
        self.mmio.read(self.st.common + common::DEVICE_STATUS, &mut b)?;
        Ok(b[0])
    }

    /// Resets the device (it stops using the queues); the driver is unusable afterwards.
    pub fn stop(&self) -> Result<()> {
        self.stopped.store(true, Ordering::Relaxed);
        self.mmio.write(self.st.common + common::DEVICE_STATUS, &[0])?;
        Ok(())
    }

    fn write_desc(&self, q: &DrvQueue, d: u16, len: u32, flags: u16) -> Result<()> {
        let mut e = [0u8; 16];
        e[0..8].copy_from_slice(&q.bufs[usize::from(d)].to_le_bytes());
        e[8..12].copy_from_slice(&len.to_le_bytes());
        e[12..14].copy_from_slice(&flags.to_le_bytes());
        self.mem.write(q.desc + 16 * u64::from(d), &e)?;
        Ok(())
    }

    /// Puts descriptor `d` in the available ring (published by [`publish`](Self::publish)).
    fn make_available(&self, q: &mut DrvQueue, d: u16) -> Result<()> {
        let slot = q.avail_idx.wrapping_add(q.unpublished) % q.size;
        self.mem.write(q.avail + 4 + 2 * u64::from(slot), &d.to_le_bytes())?;
        q.unpublished += 1;
        Ok(())
    }

    fn offer_rx(&self, q: &mut DrvQueue, d: u16) -> Result<()> {
        self.write_desc(q, d, MAX_BUFFER as u32, DESC_F_WRITE)?;
        self.make_available(q, d)
    }

    /// Publishes the available entries written so far and notifies the device.
    fn publish(&self, q: &mut DrvQueue) -> Result<()> {
        if q.unpublished == 0 {
            return Ok(());
        }
        q.avail_idx = q.avail_idx.wrapping_add(q.unpublished);
        q.unpublished = 0;
        self.mem.write(q.avail + 2, &q.avail_idx.to_le_bytes())?;
        self.stats.notifies.fetch_add(1, Ordering::Relaxed);
        if self.features & feature::NOTIFICATION_DATA != 0 {
            let v = u32::from(q.index) | u32::from(q.avail_idx) << 16;
            self.mmio.write(q.notify, &v.to_le_bytes())?;
        } else {
            self.mmio.write(q.notify, &q.index.to_le_bytes())?;
        }
        Ok(())
    }

    /// Used entries since the last look: (descriptor, length).
    fn take_used(&self, q: &mut DrvQueue) -> Result<Vec<(u16, u32)>> {
        let mut idx = [0u8; 2];
        self.mem.read(q.used + 2, &mut idx)?;
        let idx = u16::from_le_bytes(idx);
        let n = idx.wrapping_sub(q.last_used);
        if n > q.size {
            return Err(DriverError::Device(format!("used index {idx} jumped {n} entries")));
        }
        let mut out = Vec::with_capacity(usize::from(n));
        for k in 0..n {
            let slot = q.last_used.wrapping_add(k) % q.size;
            let mut e = [0u8; 8];
            self.mem.read(q.used + 4 + 8 * u64::from(slot), &mut e)?;
            let id = u32::from_le_bytes([e[0], e[1], e[2], e[3]]);
            let len = u32::from_le_bytes([e[4], e[5], e[6], e[7]]);
            match u16::try_from(id).ok().filter(|d| *d < q.size) {
                Some(d) => out.push((d, len)),
                None => {
                    self.stats.rx_bad.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        q.last_used = idx;
        Ok(out)
    }

    /// Takes back the transmit buffers the device used.
    fn reclaim(&self, q: &mut DrvQueue) -> Result<()> {
        for (d, _) in self.take_used(q)? {
            if !q.free.contains(&d) {
                q.free.push(d);
            }
        }
        Ok(())
    }

    /// Transmit buffers free now (after taking back the ones the device used).
    pub fn tx_room(&self) -> Result<usize> {
        let mut q = lock(&self.tx);
        self.reclaim(&mut q)?;
        Ok(q.free.len())
    }

    /// Queues the frame `fill` writes straight into a free transmit buffer: it gets the buffer
    /// ([`MAX_BUFFER`] bytes, as slices of the DMA memory itself) and returns the frame's length
    /// (a `virtio_net_hdr` and the Ethernet frame), or 0 when it has none. `Ok(None)` when no
    /// buffer is free (`fill` is not called), `Ok(Some(0))` when `fill` had no frame. The device
    /// learns of the frame at [`tx_flush`](Self::tx_flush).
    pub fn tx_fill(&self, fill: &mut dyn FnMut(&mut [&mut [u8]]) -> usize) -> Result<Option<usize>> {
        let mut q = lock(&self.tx);
        let Some(d) = q.free.pop() else { return Ok(None) };
        let mut n = 0;
        let lent = self.mem.lend_mut(q.bufs[usize::from(d)], MAX_BUFFER, &mut |b| n = fill(b));
        if lent.is_err() || !(NET_HDR_LEN..=MAX_BUFFER).contains(&n) {
            q.free.push(d);
            lent?;
            return match n {
                0 => Ok(Some(0)),
                _ => Err(DriverError::Device(format!("a {n}-byte frame"))),
            };
        }
        self.queue_tx(&mut q, d, n)?;
        Ok(Some(n))
    }

    /// Queues `frame` (a `virtio_net_hdr` and the Ethernet frame) for transmission; false when
    /// no buffer is free. The device learns of it at [`tx_flush`](Self::tx_flush).
    pub fn tx_push(&self, frame: &[u8]) -> Result<bool> {
        if frame.len() < NET_HDR_LEN || frame.len() > MAX_BUFFER {
            return Err(DriverError::Device(format!("a {}-byte frame", frame.len())));
        }
        let mut q = lock(&self.tx);
        let Some(d) = q.free.pop() else { return Ok(false) };
        self.mem.write(q.bufs[usize::from(d)], frame)?;
        self.queue_tx(&mut q, d, frame.len())?;
        Ok(true)
    }

    /// Makes descriptor `d`, whose buffer holds a `len`-byte frame, available to the device.
    fn queue_tx(&self, q: &mut DrvQueue, d: u16, len: usize) -> Result<()> {
        self.write_desc(q, d, len as u32, 0)?;
        self.make_available(q, d)?;
        self.stats.tx_frames.fetch_add(1, Ordering::Relaxed);
        self.stats.tx_bytes.fetch_add((len - NET_HDR_LEN) as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Tells the device about the frames queued since the last flush.
    ///
    /// While more than half the transmit buffers are free the driver asks for no interrupt
    /// when the device is done with them (`VIRTQ_AVAIL_F_NO_INTERRUPT`, VIRTIO 1.2 section
    /// 2.7.7): it takes them back as it goes, as Linux's `virtio_net` does. The device reads the
    /// flag with each batch's descriptors, so the batch published when the buffers run out asks
    /// for the interrupt that [`tx_wait`](Self::tx_wait) waits for.
    pub fn tx_flush(&self) -> Result<()> {
        let mut q = lock(&self.tx);
        if q.unpublished == 0 {
            return Ok(());
        }
        self.reclaim(&mut q)?;
        let quiet = q.free.len() > usize::from(q.size) / 2;
        if quiet != q.quiet {
            let flags = if quiet { AVAIL_F_NO_INTERRUPT } else { 0 };
            self.mem.write(q.avail, &flags.to_le_bytes())?;
            q.quiet = quiet;
        }
        self.publish(&mut q)
    }

    /// Waits up to `timeout` for the device to finish transmitting something.
    pub fn tx_wait(&self, timeout: Duration) -> bool {
        let v = lock(&self.tx).vector;
        self.irq.wait_vector(v, timeout)
    }

    /// Hands every frame the device received to `f` (header and Ethernet frame), gives the
    /// buffers back to the device and notifies it. Returns the frames handled.
    pub fn rx_poll(&self, f: &mut dyn FnMut(&[u8])) -> Result<usize> {
        let mut buf = std::mem::take(&mut lock(&self.rx).scratch);
        let handled = self.rx_poll_lent(&mut |pieces| match pieces {
            [whole] => f(whole),
            _ => {
                buf.clear();
                pieces.iter().for_each(|p| buf.extend_from_slice(p));
                f(&buf);
            }
        });
        lock(&self.rx).scratch = buf;
        handled
    }

    /// As [`rx_poll`](Self::rx_poll), but each frame comes as the pieces of DMA memory it lies
    /// in (held still for the call), without a copy.
    pub fn rx_poll_lent(&self, f: &mut dyn FnMut(&[&[u8]])) -> Result<usize> {
        let mut q = lock(&self.rx);
        let used = self.take_used(&mut q)?;
        let mut n = 0;
        for (d, len) in &used {
            let len = *len as usize;
            if (NET_HDR_LEN..=MAX_BUFFER).contains(&len) {
                self.mem.lend(&[(q.bufs[usize::from(*d)], len)], f)?;
                self.stats.rx_frames.fetch_add(1, Ordering::Relaxed);
                self.stats.rx_bytes.fetch_add((len - NET_HDR_LEN) as u64, Ordering::Relaxed);
                n += 1;
            } else {
                self.stats.rx_bad.fetch_add(1, Ordering::Relaxed);
            }
            self.offer_rx(&mut q, *d)?;
        }
        self.publish(&mut q)?;
        Ok(n)
    }

    /// Waits up to `timeout` for the device to receive something.
    pub fn rx_wait(&self, timeout: Duration) -> bool {
        let v = lock(&self.rx).vector;
        self.irq.wait_vector(v, timeout)
    }

    /// Whether the configuration vector fired (the device's status changed) since the last look.
    pub fn config_changed(&self) -> bool {
        self.irq.wait_vector(CONFIG_VECTOR, Duration::ZERO)
    }
}
