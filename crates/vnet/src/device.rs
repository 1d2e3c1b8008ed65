//! The virtio-net function model (device side, in the I/O box).
//!
//! Layer: a sans-IO [`DeviceModel`] of the pcie engine, which the device bridge runs on its
//! receive thread (no worker, no hand-off). Its registers are the virtio 1.x PCI structures in
//! BAR0 ([`crate::layout`]), found by the driver through vendor-specific capabilities; its queues
//! are read and written only by DMA through the [`DeviceIo`] the bridge gives it (memory read and
//! write TLPs), its interrupts are MSI-X messages. A read in flight is state, not a wait: a
//! transmit batch's frames are read while the next batch's rings are (up to three batches).
//!
//! The wire side is a [`Wire`] (a TAP with `IFF_VNET_HDR` in the daemon): frames the driver
//! transmits go to [`Wire::send`] with their `virtio_net_hdr`, so checksum and segmentation
//! offload pass through; frames from the wire arrive through an [`Inbound`] queue that a reader
//! thread fills and that wakes the bridge's receive thread to run the model. A frame waits there until the driver has made
//! a receive buffer available; when the queue is full the reader stops reading and the wire's own
//! queue drops, as a NIC's would.
//!
//! Invariants: nothing the driver writes or leaves in its rings crashes the device: a broken ring
//! sets DEVICE_NEEDS_RESET and raises the configuration vector (VIRTIO 1.2 section 2.1.2), and the
//! device does nothing more until the driver resets it. Counters say what was dropped and why.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use lanbus_pcie::blocking::Waker;
use lanbus_pcie::config::{Bar, BarKind, ConfigSpec, MsixSpec};
use lanbus_pcie::device::{CompleterAbort, DeviceIo, DeviceModel, DmaError, DmaId};
use lanbus_pcie::CplStatus;

use crate::virtq::{Chain, Queue, QueueError};
use crate::{common, feature, layout, status, MAX_BUFFER, NET_HDR_LEN, RX_QUEUE, TX_QUEUE};

/// The offloads the driver accepts from the wire (what the wire may hand over unsegmented or with
/// a partial checksum).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Offloads {
    /// Partial checksums.
    pub csum: bool,
    /// TCPv4 segments larger than the MTU.
    pub tso4: bool,
    /// TCPv6 segments larger than the MTU.
    pub tso6: bool,
    /// Large segments with ECN.
    pub ecn: bool,
}

/// The device's wire: where transmitted frames go.
pub trait Wire: Send {
    /// Sends one frame: a `virtio_net_hdr` ([`NET_HDR_LEN`] bytes) and the Ethernet frame. A wire
    /// may queue it and write it later (the device goes on with its queues meanwhile); errors
    /// it meets then are its own to count.
    fn send(&mut self, frame: Vec<u8>) -> io::Result<()>;
    /// Tells the wire which offloads the driver accepts, so that it hands over frames the driver
    /// can take. Called after feature negotiation and at reset (all off).
    fn set_offloads(&mut self, offloads: Offloads) -> io::Result<()>;
}

/// Frames from the wire waiting for the device, filled by a reader thread.
#[derive(Debug)]
pub struct Inbound {
    frames: Mutex<InboundState>,
    room: Condvar,
    capacity: usize,
}

#[derive(Debug, Default)]
struct InboundState {
    queue: VecDeque<Vec<u8>>,
    waker: Option<Waker>,
    closed: bool,
}

impl Inbound {
    /// A queue holding up to `capacity` frames.
    pub fn new(capacity: usize) -> Arc<Inbound> {
        Arc::new(Inbound { frames: Mutex::default(), room: Condvar::new(), capacity: capacity.max(1) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, InboundState> {
        self.frames.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a frame (header and Ethernet frame), waiting up to `wait` for room. Returns false
    /// if there was none (the caller drops it) or the queue was closed.
    pub fn push(&self, frame: Vec<u8>, wait: Duration) -> bool {
        let mut st = self.lock();
        if st.queue.len() >= self.capacity && !st.closed {
            st = self.room.wait_timeout(st, wait).unwrap_or_else(|e| e.into_inner()).0;
        }
        if st.closed || st.queue.len() >= self.capacity {
            return false;
        }
        let was_empty = st.queue.is_empty();
        st.queue.push_back(frame);
        let waker = was_empty.then(|| st.waker.clone()).flatten();
        drop(st);
        if let Some(w) = waker {
            w.wake();
        }
        true
    }

    /// Whether the reader should stop.
    pub fn closed(&self) -> bool {
        self.lock().closed
    }

    /// Frames waiting.
    pub fn len(&self) -> usize {
        self.lock().queue.len()
    }

    /// Whether no frame waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Stops the reader: pushes fail from now on.
    pub fn close(&self) {
        self.lock().closed = true;
        self.room.notify_all();
    }

    fn set_waker(&self, waker: Waker) {
        self.lock().waker = Some(waker);
    }

    fn pop(&self) -> Option<Vec<u8>> {
        let f = self.lock().queue.pop_front();
        if f.is_some() {
            self.room.notify_one();
        }
        f
    }

    fn unpop(&self, frame: Vec<u8>) {
        self.lock().queue.push_front(frame);
    }
}

/// What the device is: its MAC address, MTU and queue size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetConfig {
    /// The MAC address in the device configuration.
    pub mac: [u8; 6],
    /// The MTU in the device configuration.
    pub mtu: u16,
    /// Entries offered per queue (the driver may use fewer).
    pub queue_size: u16,
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig { mac: [0x02, 0x4c, 0x42, 0x00, 0x00, 0x01], mtu: 1500, queue_size: 256 }
    }
}

/// The device's counters, readable from other threads.
#[derive(Debug, Default)]
pub struct NetStats {
    /// Frames the driver transmitted that the wire took (a wire that queues them may still fail
    /// to write one later: that one is counted in `tx_errors` too).
    pub tx_frames: AtomicU64,
    /// Their bytes (without the header).
    pub tx_bytes: AtomicU64,
    /// Frames the wire refused, at once or when it came to write them.
    pub tx_errors: AtomicU64,
    /// Transmit buffers too short or too long to be a frame (used, not sent).
    pub tx_malformed: AtomicU64,
    /// Frames from the wire placed in the driver's receive buffers.
    pub rx_frames: AtomicU64,
    /// Their bytes (without the header).
    pub rx_bytes: AtomicU64,
    /// Frames from the wire larger than the driver's buffer (dropped).
    pub rx_too_big: AtomicU64,
    /// Frames dropped because the device's inbound queue was full (the driver did not take them).
    pub rx_dropped: AtomicU64,
    /// Times the driver broke a queue and the device needed a reset.
    pub broken: AtomicU64,
    /// DMA that failed (host unreachable, timeouts).
    pub dma_errors: AtomicU64,
    /// Interrupts raised.
    pub interrupts: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Chains taken from a queue per round, so that the other queue gets its turn.
const BATCH: usize = 64;

/// Transmit batches whose frames may be read at once: the next batch's rings are read while the
/// last one's frames arrive.
const TX_IN_FLIGHT: usize = 3;

/// What a DMA read in flight is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pending {
    /// Queue `q`'s available index.
    Index(usize),
    /// Queue `q`'s descriptor table (and, when the ring follows it, the ring too).
    Table(usize),
    /// Queue `q`'s available ring.
    Ring(usize),
    /// Piece `piece` of transmit batch `batch`.
    Frame { batch: u64, piece: usize },
}

/// A queue's chains being fetched: the index, then the table and ring.
#[derive(Debug, Default)]
struct Fetch {
    /// Chains to take (known once the index is).
    n: usize,
    table: Option<Vec<u8>>,
    ring: Option<Vec<u8>>,
    /// Whether the table read holds the ring too.
    joined: bool,
}

/// Transmit chains whose frames are being read.
#[derive(Debug)]
struct TxBatch {
    /// (head, 0) of every chain taken, for the used ring.
    used: Vec<(u16, u32)>,
    /// The frames' buffers as their reads end, one per segment.
    pieces: Vec<Option<Vec<u8>>>,
    /// Segments per frame, in order.
    shapes: Vec<usize>,
    /// Reads not ended yet.
    missing: usize,
    /// A read failed: the batch is dropped.
    failed: bool,
    /// The driver asked for no interrupt.
    no_irq: bool,
}

/// The virtio-net device model. Sans-IO: the device bridge runs it on its receive thread; every
/// wait for host memory is a read in flight and the state that says what it is for.
pub struct NetDevice {
    cfg: NetConfig,
    wire: Box<dyn Wire>,
    inbound: Arc<Inbound>,
    stats: Arc<NetStats>,
    device_feature_select: u32,
    driver_feature_select: u32,
    driver_features: u64,
    status: u8,
    config_msix: u16,
    queue_select: u16,
    queues: [Queue; 2],
    isr: u8,
    /// Notified per queue, with the available index the notification carried.
    kicked: [bool; 2],
    notified: [Option<u16>; 2],
    /// Each queue's chains being fetched.
    fetch: [Option<Fetch>; 2],
    /// Reads in flight (a reset forgets them: what they bring is dropped).
    pending: HashMap<DmaId, Pending>,
    /// Transmit batches in order; the first is numbered `tx_first`.
    tx: VecDeque<TxBatch>,
    tx_first: u64,
    /// Receive buffers made available and not yet used.
    rx_chains: VecDeque<Chain>,
    /// A configuration interrupt to raise (the device broke).
    config_irq: bool,
    /// The last failure, for the daemon's log.
    last_error: Arc<Mutex<Option<String>>>,
}

impl NetDevice {
    /// A device with `cfg` sending to `wire` and receiving from `inbound`.
    pub fn new(cfg: NetConfig, wire: Box<dyn Wire>, inbound: Arc<Inbound>) -> NetDevice {
        NetDevice::with_stats(cfg, wire, inbound, Arc::default())
    }

    /// [`NetDevice::new`] counting into `stats` (shared with the wire's reader).
    pub fn with_stats(
        cfg: NetConfig,
        wire: Box<dyn Wire>,
        inbound: Arc<Inbound>,
        stats: Arc<NetStats>,
    ) -> NetDevice {
        let size = cfg.queue_size.clamp(2, crate::virtq::MAX_SIZE).next_power_of_two();
        NetDevice {
            cfg: NetConfig { queue_size: size, ..cfg },
            wire,
            inbound,
            stats,
            device_feature_select: 0,
            driver_feature_select: 0,
            driver_features: 0,
            status: 0,
            config_msix: common::NO_VECTOR,
            queue_select: 0,
            queues: [Queue::new(size), Queue::new(size)],
            isr: 0,
            kicked: [false; 2],
            notified: [None; 2],
            fetch: [None, None],
            pending: HashMap::new(),
            tx: VecDeque::new(),
            tx_first: 0,
            rx_chains: VecDeque::new(),
            config_irq: false,
            last_error: Arc::default(),
        }
    }

    /// The counters, shared.
    pub fn stats(&self) -> Arc<NetStats> {
        self.stats.clone()
    }

    /// The last error the device hit, shared (for the daemon's status).
    pub fn last_error(&self) -> Arc<Mutex<Option<String>>> {
        self.last_error.clone()
    }

    /// The negotiated features (0 before FEATURES_OK).
    pub fn features(&self) -> u64 {
        if self.status & status::FEATURES_OK != 0 {
            self.driver_features
        } else {
            0
        }
    }

    fn reset(&mut self) {
        let size = self.cfg.queue_size;
        self.device_feature_select = 0;
        self.driver_feature_select = 0;
        self.driver_features = 0;
        self.status = 0;
        self.config_msix = common::NO_VECTOR;
        self.queue_select = 0;
        self.queues = [Queue::new(size), Queue::new(size)];
        self.isr = 0;
        self.kicked = [false; 2];
        self.notified = [None; 2];
        self.fetch = [None, None];
        self.pending.clear();
        self.tx.clear();
        self.rx_chains.clear();
        self.config_irq = false;
        if let Err(e) = self.wire.set_offloads(Offloads::default()) {
            self.note(format!("wire offloads: {e}"));
        }
    }

    fn note(&self, why: String) {
        *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
    }

    fn running(&self) -> bool {
        self.status & status::DRIVER_OK != 0 && self.status & status::NEEDS_RESET == 0
    }

    fn selected(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(usize::from(self.queue_select))
    }

    fn common_image(&self) -> [u8; layout::COMMON_LEN as usize] {
        let mut b = [0u8; layout::COMMON_LEN as usize];
        let put16 =
            |b: &mut [u8], at: u64, v: u16| b[at as usize..at as usize + 2].copy_from_slice(&v.to_le_bytes());
        let put32 =
            |b: &mut [u8], at: u64, v: u32| b[at as usize..at as usize + 4].copy_from_slice(&v.to_le_bytes());
        let put64 =
            |b: &mut [u8], at: u64, v: u64| b[at as usize..at as usize + 8].copy_from_slice(&v.to_le_bytes());
        put32(&mut b, common::DEVICE_FEATURE_SELECT, self.device_feature_select);
        let offered = match self.device_feature_select {
            0 => feature::OFFERED as u32,
            1 => (feature::OFFERED >> 32) as u32,
            _ => 0,
        };
        put32(&mut b, common::DEVICE_FEATURE, offered);
        put32(&mut b, common::DRIVER_FEATURE_SELECT, self.driver_feature_select);
        let driver = match self.driver_feature_select {
            0 => self.driver_features as u32,
            1 => (self.driver_features >> 32) as u32,
            _ => 0,
        };
        put32(&mut b, common::DRIVER_FEATURE, driver);
        put16(&mut b, common::CONFIG_MSIX_VECTOR, self.config_msix);
        put16(&mut b, common::NUM_QUEUES, 2);
        b[common::DEVICE_STATUS as usize] = self.status;
        b[common::CONFIG_GENERATION as usize] = 0;
        put16(&mut b, common::QUEUE_SELECT, self.queue_select);
        if let Some(q) = self.queues.get(usize::from(self.queue_select)) {
            put16(&mut b, common::QUEUE_SIZE, q.size);
            put16(&mut b, common::QUEUE_MSIX_VECTOR, q.msix);
            put16(&mut b, common::QUEUE_ENABLE, u16::from(q.enabled));
            put16(&mut b, common::QUEUE_NOTIFY_OFF, self.queue_select);
            put64(&mut b, common::QUEUE_DESC, q.desc);
            put64(&mut b, common::QUEUE_DRIVER, q.driver);
            put64(&mut b, common::QUEUE_DEVICE, q.device);
        }
        b
    }

    fn device_config(&self) -> [u8; layout::DEVICE_LEN as usize] {
        let mut b = [0u8; layout::DEVICE_LEN as usize];
        b[0..6].copy_from_slice(&self.cfg.mac);
        b[6..8].copy_from_slice(&1u16.to_le_bytes()); // VIRTIO_NET_S_LINK_UP
        b[8..10].copy_from_slice(&1u16.to_le_bytes()); // max_virtqueue_pairs
        b[10..12].copy_from_slice(&self.cfg.mtu.to_le_bytes());
        b
    }

    fn write_common(&mut self, offset: u64, data: &[u8]) {
        let mut img = self.common_image();
        let Some(end) = offset.checked_add(data.len() as u64).filter(|e| *e <= layout::COMMON_LEN) else {
            return;
        };
        img[offset as usize..end as usize].copy_from_slice(data);
        let touched = |at: u64, len: u64| offset < at + len && at < end;
        let get16 = |at: u64| u16::from_le_bytes([img[at as usize], img[at as usize + 1]]);
        let get32 =
            |at: u64| u32::from_le_bytes(img[at as usize..at as usize + 4].try_into().unwrap_or_default());
        let get64 =
            |at: u64| u64::from_le_bytes(img[at as usize..at as usize + 8].try_into().unwrap_or_default());
        if touched(common::DEVICE_FEATURE_SELECT, 4) {
            self.device_feature_select = get32(common::DEVICE_FEATURE_SELECT);
        }
        if touched(common::DRIVER_FEATURE_SELECT, 4) {
            self.driver_feature_select = get32(common::DRIVER_FEATURE_SELECT);
        }
        if touched(common::DRIVER_FEATURE, 4) && self.status & status::FEATURES_OK == 0 {
            let v = u64::from(get32(common::DRIVER_FEATURE));
            match self.driver_feature_select {
                0 => self.driver_features = (self.driver_features & !0xffff_ffff) | v,
                1 => self.driver_features = (self.driver_features & 0xffff_ffff) | v << 32,
                _ => {}
            }
        }
        if touched(common::CONFIG_MSIX_VECTOR, 2) {
            let v = get16(common::CONFIG_MSIX_VECTOR);
            self.config_msix = if v < layout::MSIX_VECTORS { v } else { common::NO_VECTOR };
        }
        if touched(common::DEVICE_STATUS, 1) {
            self.set_status(img[common::DEVICE_STATUS as usize]);
        }
        if touched(common::QUEUE_SELECT, 2) {
            self.queue_select = get16(common::QUEUE_SELECT);
        }
        let fixed = self.status & status::DRIVER_OK != 0;
        let max = self.cfg.queue_size;
        if let Some(q) = self.selected().filter(|q| !q.enabled && !fixed) {
            if touched(common::QUEUE_SIZE, 2) {
                q.size = get16(common::QUEUE_SIZE).min(max);
            }
            if touched(common::QUEUE_DESC, 8) {
                q.desc = get64(common::QUEUE_DESC);
            }
            if touched(common::QUEUE_DRIVER, 8) {
                q.driver = get64(common::QUEUE_DRIVER);
            }
            if touched(common::QUEUE_DEVICE, 8) {
                q.device = get64(common::QUEUE_DEVICE);
            }
        }
        if touched(common::QUEUE_MSIX_VECTOR, 2) {
            let v = get16(common::QUEUE_MSIX_VECTOR);
            if let Some(q) = self.selected() {
                q.msix = if v < layout::MSIX_VECTORS { v } else { common::NO_VECTOR };
            }
        }
        if touched(common::QUEUE_ENABLE, 2) && get16(common::QUEUE_ENABLE) == 1 {
            let checked = self.selected().map(|q| (q.check(), q.enabled));
            match checked {
                Some((Ok(()), false)) => {
                    if let Some(q) = self.selected() {
                        q.enabled = true;
                    }
                }
                Some((Err(e), false)) => self.fail(e.to_string()),
                _ => {}
            }
        }
    }

    fn set_status(&mut self, v: u8) {
        if v == 0 {
            self.reset();
            return;
        }
        let newly = v & !self.status;
        // The device's own bit stays until a reset.
        self.status = v | (self.status & status::NEEDS_RESET);
        if newly & status::FEATURES_OK != 0 {
            let ok = self.driver_features & !feature::OFFERED == 0
                && self.driver_features & feature::VERSION_1 != 0;
            if !ok {
                // The driver reads FEATURES_OK back and sees it refused (VIRTIO 1.2 section 3.1.1).
                self.status &= !status::FEATURES_OK;
                return;
            }
            let f = self.driver_features;
            let offloads = Offloads {
                csum: f & feature::GUEST_CSUM != 0,
                tso4: f & feature::GUEST_TSO4 != 0 && f & feature::GUEST_CSUM != 0,
                tso6: f & feature::GUEST_TSO6 != 0 && f & feature::GUEST_CSUM != 0,
                ecn: f & feature::GUEST_ECN != 0,
            };
            if let Err(e) = self.wire.set_offloads(offloads) {
                self.note(format!("wire offloads: {e}"));
            }
        }
    }

    /// The device cannot go on: DEVICE_NEEDS_RESET, and the configuration vector says so.
    fn fail(&mut self, why: String) {
        if self.status & status::NEEDS_RESET == 0 {
            add(&self.stats.broken, 1);
        }
        self.note(why);
        self.status |= status::NEEDS_RESET;
        self.config_irq = true;
        self.rx_chains.clear();
        // Fetches stop here; frames in flight are dropped as they end.
        self.fetch = [None, None];
        self.pending.retain(|_, p| matches!(p, Pending::Frame { .. }));
    }

    fn queue_error(&mut self, e: QueueError) {
        match e {
            QueueError::Broken(why) => self.fail(why),
            QueueError::Bus(e) => {
                add(&self.stats.dma_errors, 1);
                self.note(format!("DMA: {e}"));
                if e == DmaError::HostUnreachable || e == DmaError::BusMasterDisabled {
                    // Nobody to serve until a driver sets the device up again.
                    self.kicked = [false; 2];
                }
            }
        }
    }

    fn interrupt(&mut self, io: &mut DeviceIo, vector: u16) {
        self.isr |= 1;
        if vector != common::NO_VECTOR {
            add(&self.stats.interrupts, 1);
            io.signal_msix(vector);
        }
    }

    /// Runs what can run now: the configuration interrupt, fetches of chains the driver made
    /// available, finished transmit batches, frames from the wire into receive buffers.
    fn pump(&mut self, io: &mut DeviceIo) {
        if std::mem::take(&mut self.config_irq) {
            self.isr |= 2;
            if self.config_msix != common::NO_VECTOR {
                add(&self.stats.interrupts, 1);
                io.signal_msix(self.config_msix);
            }
        }
        if !self.running() {
            self.kicked = [false; 2];
            return;
        }
        for q in [usize::from(TX_QUEUE), usize::from(RX_QUEUE)] {
            if self.may_fetch(q) {
                self.kicked[q] = false;
                if let Err(e) = self.start_fetch(q, io) {
                    self.queue_error(e);
                }
            }
        }
        self.finish_tx(io);
        if self.running() {
            if let Err(e) = self.receive(io) {
                self.queue_error(e);
            }
        }
    }

    /// Whether queue `q` was notified and a fetch of its chains may start.
    fn may_fetch(&self, q: usize) -> bool {
        let room = q != usize::from(TX_QUEUE) || self.tx.len() < TX_IN_FLIGHT;
        self.kicked[q] && self.fetch[q].is_none() && self.queues[q].enabled && room
    }

    /// Starts fetching queue `q`'s chains: the index, unless the notification carried it.
    fn start_fetch(&mut self, q: usize, io: &mut DeviceIo) -> Result<(), QueueError> {
        match self.notified[q] {
            Some(idx) => self.fetch_chains(q, idx, io),
            None => {
                let id = io.dma_read(self.queues[q].driver, 4);
                self.pending.insert(id, Pending::Index(q));
                self.fetch[q] = Some(Fetch::default());
                Ok(())
            }
        }
    }

    /// The index is known: reads the table and ring for the chains it makes available.
    fn fetch_chains(&mut self, q: usize, idx: u16, io: &mut DeviceIo) -> Result<(), QueueError> {
        self.fetch[q] = None;
        let queue = &self.queues[q];
        let ahead = usize::from(queue.available(idx)?);
        let limit = if q == usize::from(TX_QUEUE) {
            BATCH
        } else {
            usize::from(queue.size).saturating_sub(self.rx_chains.len())
        };
        let n = ahead.min(limit);
        if ahead > n {
            // The rest on the next round.
            self.kicked[q] = true;
        }
        if n == 0 {
            return Ok(());
        }
        let joined = queue.ring_follows_table();
        let (table_len, ring_len) = (queue.table_len(), queue.ring_len());
        let (desc, driver) = (queue.desc, queue.driver);
        if joined {
            let id = io.dma_read(desc, table_len + ring_len);
            self.pending.insert(id, Pending::Table(q));
        } else {
            let t = io.dma_read(desc, table_len);
            self.pending.insert(t, Pending::Table(q));
            let r = io.dma_read(driver, ring_len);
            self.pending.insert(r, Pending::Ring(q));
        }
        self.fetch[q] = Some(Fetch { n, table: None, ring: None, joined });
        Ok(())
    }

    /// A read of queue `q`'s areas ended: takes the chains once table and ring are in.
    fn fetched(&mut self, q: usize, io: &mut DeviceIo) -> Result<(), QueueError> {
        if !self.running() {
            return Ok(());
        }
        let Some(f) = self.fetch[q].as_mut() else { return Ok(()) };
        if f.joined {
            if let Some(mut both) = f.table.take() {
                let at = self.queues[q].table_len().min(both.len());
                f.ring = Some(both.split_off(at));
                f.table = Some(both);
            }
        }
        let (Some(table), Some(ring)) = (&f.table, &f.ring) else { return Ok(()) };
        let n = f.n;
        let want_write = q == usize::from(RX_QUEUE);
        let (chains, no_irq) = self.queues[q].take(table, ring, n, want_write)?;
        self.fetch[q] = None;
        if want_write {
            self.rx_chains.extend(chains);
        } else {
            self.start_tx(chains, no_irq, io);
        }
        Ok(())
    }

    /// Transmit: reads every frame of a batch at once (one round trip, not one per frame).
    fn start_tx(&mut self, chains: Vec<Chain>, no_irq: bool, io: &mut DeviceIo) {
        let number = self.tx_first + self.tx.len() as u64;
        let mut batch = TxBatch {
            used: Vec::with_capacity(chains.len()),
            pieces: Vec::new(),
            shapes: Vec::with_capacity(chains.len()),
            missing: 0,
            failed: false,
            no_irq,
        };
        for c in &chains {
            batch.used.push((c.head, 0));
            let len = c.len();
            if len < (NET_HDR_LEN + 14) as u64 || len > MAX_BUFFER as u64 {
                add(&self.stats.tx_malformed, 1);
                continue;
            }
            batch.shapes.push(c.segments.len());
            for s in &c.segments {
                if s.len == 0 {
                    batch.pieces.push(Some(Vec::new()));
                    continue;
                }
                let id = io.dma_read(s.addr, s.len as usize);
                self.pending.insert(id, Pending::Frame { batch: number, piece: batch.pieces.len() });
                batch.pieces.push(None);
                batch.missing += 1;
            }
        }
        self.tx.push_back(batch);
    }

    /// Sends the frames of the transmit batches whose reads all ended, in order, and returns
    /// their buffers to the driver.
    fn finish_tx(&mut self, io: &mut DeviceIo) {
        while self.tx.front().is_some_and(|b| b.missing == 0) {
            let Some(batch) = self.tx.pop_front() else { break };
            self.tx_first += 1;
            if batch.failed || !self.running() {
                // A failed read was counted; its buffers stay with the device until a reset.
                continue;
            }
            let mut pieces = batch.pieces.into_iter().map(Option::unwrap_or_default);
            for n in batch.shapes {
                let mut frame = pieces.next().unwrap_or_default();
                for more in pieces.by_ref().take(n - 1) {
                    frame.extend_from_slice(&more);
                }
                let len = frame.len();
                match self.wire.send(frame) {
                    Ok(()) => {
                        add(&self.stats.tx_frames, 1);
                        add(&self.stats.tx_bytes, len.saturating_sub(NET_HDR_LEN) as u64);
                    }
                    Err(_) => add(&self.stats.tx_errors, 1),
                }
            }
            let q = usize::from(TX_QUEUE);
            for (address, data) in self.queues[q].put_used(&batch.used) {
                io.dma_write(address, data);
            }
            if !batch.no_irq {
                let v = self.queues[q].msix;
                self.interrupt(io, v);
            }
        }
    }

    /// Receive: frames from the wire into the buffers the driver made available.
    fn receive(&mut self, io: &mut DeviceIo) -> Result<(), QueueError> {
        let q = usize::from(RX_QUEUE);
        if !self.queues[q].enabled {
            return Ok(());
        }
        let mut used = Vec::new();
        while used.len() < BATCH && !self.rx_chains.is_empty() {
            let Some(mut frame) = self.inbound.pop() else { break };
            if frame.len() < NET_HDR_LEN {
                continue;
            }
            let Some(chain) = self.rx_chains.front() else {
                self.inbound.unpop(frame);
                break;
            };
            if chain.len() < frame.len() as u64 {
                add(&self.stats.rx_too_big, 1);
                continue;
            }
            let Some(chain) = self.rx_chains.pop_front() else { break };
            // num_buffers: one buffer per frame (no mergeable buffers).
            frame[10..12].copy_from_slice(&1u16.to_le_bytes());
            let len = frame.len();
            add(&self.stats.rx_frames, 1);
            add(&self.stats.rx_bytes, (len - NET_HDR_LEN) as u64);
            used.push((chain.head, len as u32));
            match chain.segments.first() {
                // One buffer holds it (as drivers lay them out): the frame itself is the write.
                Some(s) if s.len as usize >= len => io.dma_write(s.addr, frame),
                _ => {
                    let mut at = 0;
                    for s in &chain.segments {
                        if at == len {
                            break;
                        }
                        let n = (s.len as usize).min(len - at);
                        io.dma_write(s.addr, frame[at..at + n].to_vec());
                        at += n;
                    }
                }
            }
        }
        if used.is_empty() {
            return Ok(());
        }
        for (address, data) in self.queues[q].put_used(&used) {
            io.dma_write(address, data);
        }
        let v = self.queues[q].msix;
        self.interrupt(io, v);
        Ok(())
    }
}

impl DeviceModel for NetDevice {
    fn config_spec(&self) -> ConfigSpec {
        config_spec()
    }

    fn bar_read(
        &mut self,
        bar: usize,
        offset: u64,
        data: &mut [u8],
        _io: &mut DeviceIo,
    ) -> Result<(), CompleterAbort> {
        data.fill(0);
        if bar != usize::from(layout::BAR) {
            return Err(CompleterAbort);
        }
        let copy = |src: &[u8], base: u64, data: &mut [u8]| {
            let start = (offset - base) as usize;
            for (i, b) in data.iter_mut().enumerate() {
                *b = src.get(start + i).copied().unwrap_or(0);
            }
        };
        match offset {
            o if o < layout::COMMON + 0x1000 => copy(&self.common_image(), layout::COMMON, data),
            // Reading the ISR clears it (VIRTIO 1.2 section 4.1.4.5).
            layout::ISR => data[0] = std::mem::take(&mut self.isr),
            o if (layout::DEVICE..layout::DEVICE + 0x1000).contains(&o) => {
                copy(&self.device_config(), layout::DEVICE, data)
            }
            _ => {}
        }
        Ok(())
    }

    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8], io: &mut DeviceIo) {
        if bar != usize::from(layout::BAR) {
            return;
        }
        if offset < layout::COMMON_LEN {
            self.write_common(offset, data);
        } else if (layout::NOTIFY..layout::NOTIFY + 0x1000).contains(&offset) && data.len() >= 2 {
            let q = u16::from_le_bytes([data[0], data[1]]);
            let Some(k) = self.kicked.get_mut(usize::from(q)) else { return };
            *k = true;
            let with_data = self.driver_features & feature::NOTIFICATION_DATA != 0;
            if with_data && data.len() >= 4 {
                self.notified[usize::from(q)] = Some(u16::from_le_bytes([data[2], data[3]]));
            }
        }
        self.pump(io);
    }

    fn dma_read_done(&mut self, id: DmaId, result: Result<&[u8], DmaError>, io: &mut DeviceIo) {
        self.dma_read_done_owned(id, result.map(<[u8]>::to_vec), io);
    }

    fn dma_read_done_owned(&mut self, id: DmaId, result: Result<Vec<u8>, DmaError>, io: &mut DeviceIo) {
        // A read from before a reset brings nothing the device still wants.
        let Some(what) = self.pending.remove(&id) else { return };
        let data = match result {
            Ok(d) => d,
            Err(e) => {
                match what {
                    Pending::Frame { batch, .. } => {
                        if let Some(b) =
                            batch.checked_sub(self.tx_first).and_then(|i| self.tx.get_mut(i as usize))
                        {
                            b.missing -= 1;
                            b.failed = true;
                        }
                    }
                    Pending::Index(q) | Pending::Table(q) | Pending::Ring(q) => {
                        self.fetch[q] = None;
                        self.pending
                            .retain(|_, p| !matches!(p, Pending::Table(x) | Pending::Ring(x) if *x == q));
                    }
                }
                self.queue_error(QueueError::Bus(e));
                self.pump(io);
                return;
            }
        };
        let outcome = match what {
            Pending::Index(q) if data.len() >= 4 => {
                self.fetch_chains(q, u16::from_le_bytes([data[2], data[3]]), io)
            }
            Pending::Index(_) => Err(QueueError::Bus(DmaError::Completion(CplStatus::CompleterAbort))),
            Pending::Table(q) => {
                if let Some(f) = self.fetch[q].as_mut() {
                    f.table = Some(data);
                }
                self.fetched(q, io)
            }
            Pending::Ring(q) => {
                if let Some(f) = self.fetch[q].as_mut() {
                    f.ring = Some(data);
                }
                self.fetched(q, io)
            }
            Pending::Frame { batch, piece } => {
                if let Some(b) = batch.checked_sub(self.tx_first).and_then(|i| self.tx.get_mut(i as usize)) {
                    if let Some(slot) = b.pieces.get_mut(piece) {
                        *slot = Some(data);
                    }
                    b.missing -= 1;
                }
                Ok(())
            }
        };
        if let Err(e) = outcome {
            self.queue_error(e);
        }
        self.pump(io);
    }

    fn has_work(&self) -> bool {
        if self.config_irq {
            return true;
        }
        if !self.running() {
            return self.kicked.iter().any(|k| *k);
        }
        (0..2).any(|q| self.may_fetch(q))
            || self.tx.front().is_some_and(|b| b.missing == 0)
            || (self.queues[usize::from(RX_QUEUE)].enabled
                && !self.rx_chains.is_empty()
                && !self.inbound.is_empty())
    }

    fn poll(&mut self, io: &mut DeviceIo) {
        self.pump(io);
    }

    fn set_waker(&mut self, waker: Waker) {
        self.inbound.set_waker(waker);
    }
}

/// A virtio PCI capability body (after the ID and next pointer): `cap_len`, `cfg_type`, `bar`,
/// `id`, padding, offset, length, and `extra` (the notification multiplier).
fn virtio_cap(cfg_type: u8, offset: u64, length: u64, extra: Option<u32>) -> Vec<u8> {
    let mut b = vec![0u8, cfg_type, layout::BAR, 0, 0, 0];
    b.extend_from_slice(&(offset as u32).to_le_bytes());
    b.extend_from_slice(&(length as u32).to_le_bytes());
    if let Some(x) = extra {
        b.extend_from_slice(&x.to_le_bytes());
    }
    b
}

/// The function's configuration space: a modern virtio-net device (1af4:1041, revision 1,
/// class 020000), BAR0 64-bit with every structure, MSI-X inside BAR0, and the vendor-specific
/// capabilities that point at the structures (VIRTIO 1.2 section 4.1.4).
pub fn config_spec() -> ConfigSpec {
    let mut spec = ConfigSpec::new(crate::VENDOR_ID, crate::DEVICE_ID, crate::CLASS_CODE)
        .with_bar(
            usize::from(layout::BAR),
            Bar { kind: BarKind::Memory64 { prefetchable: false }, size: layout::BAR_SIZE },
        )
        .with_msix(MsixSpec {
            table_size: layout::MSIX_VECTORS,
            table_bar: layout::BAR,
            table_offset: layout::MSIX_TABLE,
            pba_bar: layout::BAR,
            pba_offset: layout::MSIX_PBA,
        })
        .with_vendor_cap(virtio_cap(layout::CAP_COMMON, layout::COMMON, layout::COMMON_LEN, None))
        .with_vendor_cap(virtio_cap(
            layout::CAP_NOTIFY,
            layout::NOTIFY,
            2 * u64::from(layout::NOTIFY_MULTIPLIER),
            Some(layout::NOTIFY_MULTIPLIER),
        ))
        .with_vendor_cap(virtio_cap(layout::CAP_ISR, layout::ISR, 1, None))
        .with_vendor_cap(virtio_cap(layout::CAP_DEVICE, layout::DEVICE, layout::DEVICE_LEN, None));
    spec.revision_id = 1;
    spec.subsystem_id = 0x40 + 1;
    spec.max_payload_supported = 4096;
    spec.interrupt_pin = 1;
    spec
}
