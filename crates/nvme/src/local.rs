//! The in-process join of driver and controller model, no fabric: the driver's [`Bar`] calls the
//! controller's `bar0_read`/`bar0_write` directly, [`HostRegion`] is the memory both see (the
//! driver through [`DmaMemory`], the controller through [`crate::HostMemory`]), and MSI-X goes to
//! [`MsixEvents`]. This is the `local` row of `lanbus bench nvme` and the harness of the tests.
//!
//! The controller's work ([`Controller::process`]) runs either inline, in the thread that wrote a
//! doorbell, right after the write ([`ProcessMode::Inline`]), or on a device thread woken by
//! doorbell writes through a condition variable ([`ProcessMode::Thread`]), which is how the
//! device bridge runs it. The controller sits behind one mutex (the device bridge serializes
//! BAR accesses and DMA the same way); the thread mode releases it between batches so that
//! doorbell writes from other threads get in.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lanbus_bridge::dma::{BusError, DmaMemory, HostRegion, InterruptWait};

use crate::controller::{cmb, reg, Controller};
use crate::driver::{Bar, DriverConfig, DriverError, NvmeDriver};
use crate::InterruptSink;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where the controller's work runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessMode {
    /// In the thread that rang the doorbell, before the doorbell write returns.
    Inline,
    /// On a device thread woken by doorbell writes.
    Thread,
}

/// MSI-X delivery in-process: a counter per vector with eventfd semantics and a condition
/// variable to wake waiters.
pub struct MsixEvents {
    pending: Mutex<Vec<u64>>,
    cv: Condvar,
}

impl MsixEvents {
    /// Events for `vectors` vectors.
    pub fn new(vectors: u16) -> MsixEvents {
        MsixEvents { pending: Mutex::new(vec![0; usize::from(vectors)]), cv: Condvar::new() }
    }

    /// Records a signal of `vector` (out-of-range vectors are ignored) and wakes waiters.
    pub fn signal(&self, vector: u16) {
        let mut p = lock(&self.pending);
        if let Some(c) = p.get_mut(usize::from(vector)) {
            *c += 1;
            self.cv.notify_all();
        }
    }
}

impl InterruptSink for &MsixEvents {
    fn signal_msix(&mut self, vector: u16) {
        self.signal(vector);
    }
}

impl InterruptWait for MsixEvents {
    fn wait_vector(&self, vector: u16, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut p = lock(&self.pending);
        loop {
            match p.get_mut(usize::from(vector)) {
                None => return false,
                Some(c) if *c > 0 => {
                    *c = 0;
                    return true;
                }
                Some(_) => {}
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            p = self.cv.wait_timeout(p, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

struct Shared {
    ctrl: Mutex<Controller>,
    region: Arc<HostRegion>,
    irq: Arc<MsixEvents>,
    mode: ProcessMode,
    doorbell: Mutex<bool>,
    wake: Condvar,
    // Written by `LocalNvme::drop`, read by the device thread after each wake-up; the doorbell
    // mutex and condvar carry the wake-up, so Relaxed would do, but SeqCst keeps it obvious.
    stop: AtomicBool,
    // Set by `LocalNvme::pause`: doorbells are recorded but no work runs (tests of timeouts).
    // Relaxed: `pause` writes it and the device thread reads it under the controller mutex,
    // which orders them; the doorbell path reads it only to decide whether to start work.
    paused: AtomicBool,
}

impl Shared {
    fn run_inline(&self, ctrl: &mut Controller) {
        let mut mem = &*self.region;
        let mut irq = &*self.irq;
        while ctrl.process(&mut mem, &mut irq) > 0 {}
    }
}

/// The driver's BAR0 in-process: direct calls into the controller.
pub struct LocalBar {
    shared: Arc<Shared>,
}

impl LocalBar {
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), BusError> {
        let mut ctrl = lock(&self.shared.ctrl);
        ctrl.bar0_write(offset, data)?;
        if offset >= reg::DOORBELLS && !self.shared.paused.load(Ordering::Relaxed) {
            match self.shared.mode {
                ProcessMode::Inline => self.shared.run_inline(&mut ctrl),
                ProcessMode::Thread => {
                    drop(ctrl);
                    *lock(&self.shared.doorbell) = true;
                    self.shared.wake.notify_one();
                }
            }
        }
        Ok(())
    }
}

impl Bar for LocalBar {
    fn read32(&self, offset: u64) -> Result<u32, BusError> {
        let mut b = [0u8; 4];
        lock(&self.shared.ctrl).bar0_read(offset, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }
    fn read64(&self, offset: u64) -> Result<u64, BusError> {
        let mut b = [0u8; 8];
        lock(&self.shared.ctrl).bar0_read(offset, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }
    fn write32(&self, offset: u64, value: u32) -> Result<(), BusError> {
        self.write(offset, &value.to_le_bytes())
    }
    fn write64(&self, offset: u64, value: u64) -> Result<(), BusError> {
        self.write(offset, &value.to_le_bytes())
    }
    fn bar_address(&self, bir: u8) -> Option<u64> {
        (bir == cmb::BIR && lock(&self.shared.ctrl).pci_info().cmb_bar_size > 0).then_some(LOCAL_CMB_ADDRESS)
    }
    fn write_bar(&self, bir: u8, offset: u64, data: &[u8]) -> Result<(), BusError> {
        if bir != cmb::BIR {
            return Err(BusError::Unsupported { addr: offset });
        }
        lock(&self.shared.ctrl).cmb_write(offset, data)
    }
}

/// Bus address of the controller memory buffer's BAR in the in-process join (above the host
/// region, which starts at 0x1_0000_0000).
pub const LOCAL_CMB_ADDRESS: u64 = 0x80_0000_0000;

/// A controller model, the host memory it DMAs to, its MSI-X events and (in thread mode) its
/// device thread, ready for a driver.
pub struct LocalNvme {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl LocalNvme {
    /// Joins `ctrl` with a host region of `region_pages` 4 KiB pages at bus address
    /// 0x1_0000_0000 (so 32-bit truncation bugs show).
    pub fn new(ctrl: Controller, region_pages: usize, mode: ProcessMode) -> LocalNvme {
        let vectors = ctrl.config().msix_vectors;
        let shared = Arc::new(Shared {
            ctrl: Mutex::new(ctrl),
            region: Arc::new(HostRegion::new(0x1_0000_0000, region_pages)),
            irq: Arc::new(MsixEvents::new(vectors)),
            mode,
            doorbell: Mutex::new(false),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            paused: AtomicBool::new(false),
        });
        let thread = (mode == ProcessMode::Thread).then(|| {
            let s = shared.clone();
            std::thread::Builder::new()
                .name("nvme-device".into())
                .spawn(move || device_thread(&s))
                .expect("spawning the device thread")
        });
        LocalNvme { shared, thread }
    }

    /// The BAR0 a driver uses.
    pub fn bar(&self) -> Arc<dyn Bar> {
        Arc::new(LocalBar { shared: self.shared.clone() })
    }

    /// The host memory region.
    pub fn region(&self) -> Arc<HostRegion> {
        self.shared.region.clone()
    }

    /// The MSI-X events.
    pub fn interrupts(&self) -> Arc<MsixEvents> {
        self.shared.irq.clone()
    }

    /// The controller (lock it to look at counters or to call `process` by hand).
    pub fn controller(&self) -> MutexGuard<'_, Controller> {
        lock(&self.shared.ctrl)
    }

    /// Runs the controller's pending work now (for tests that write doorbells by hand in
    /// thread mode, this is what the device thread does).
    pub fn process_now(&self) -> usize {
        let mut ctrl = lock(&self.shared.ctrl);
        let mut mem = &*self.shared.region;
        let mut irq = &*self.shared.irq;
        ctrl.process(&mut mem, &mut irq)
    }

    /// Stops (true) or resumes (false) running the controller's work on doorbell writes; a
    /// resumed controller runs what is pending at the next doorbell write or [`Self::process_now`].
    pub fn pause(&self, paused: bool) {
        let _ctrl = lock(&self.shared.ctrl);
        self.shared.paused.store(paused, Ordering::Relaxed);
    }

    /// A driver over this controller (reset, init, I/O queues).
    pub fn driver(&self, cfg: DriverConfig) -> Result<NvmeDriver, DriverError> {
        let mem: Arc<dyn DmaMemory> = self.shared.region.clone();
        let irq: Arc<dyn InterruptWait> = self.shared.irq.clone();
        NvmeDriver::new(self.bar(), mem, irq, cfg)
    }
}

fn device_thread(s: &Shared) {
    loop {
        {
            let mut rung = lock(&s.doorbell);
            while !*rung && !s.stop.load(Ordering::SeqCst) {
                rung = s.wake.wait(rung).unwrap_or_else(|e| e.into_inner());
            }
            if s.stop.load(Ordering::SeqCst) {
                return;
            }
            *rung = false;
        }
        let mut mem = &*s.region;
        let mut irq = &*s.irq;
        loop {
            let mut ctrl = lock(&s.ctrl);
            // Checked under the controller lock, which `pause` also takes: once `pause(true)`
            // returns, no more work runs.
            if s.paused.load(Ordering::Relaxed) || ctrl.process(&mut mem, &mut irq) == 0 {
                break;
            }
        }
    }
}

impl Drop for LocalNvme {
    fn drop(&mut self) {
        // SeqCst: pairs with the loads in `device_thread`; the doorbell mutex orders the wake-up.
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _g = lock(&self.shared.doorbell);
            self.shared.wake.notify_all();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
