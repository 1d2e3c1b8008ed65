//! The host bridge: finds the devices of its group, enumerates them, and lets local users reach
//! them; serves their DMA from host memory regions and turns their MSI-X writes into interrupts.
//!
//! Layer: pcie engine over the runtime. Threads: the runtime's (the receive handler below), one
//! configuration thread (enumeration), and the users' own threads, which block in
//! `config_read`/`mmio_read` until their completions arrive, the device goes, or the completion
//! timeout passes.
//!
//! Enumeration (PCIe Base Specification 7.5.1) runs on the configuration thread: see
//! `host/enumerate.rs`.
//!
//! Invariants: the receive handler never blocks on a user; what a device sends is distrusted (a
//! memory request outside every region is answered with Unsupported Request and counted, an MSI-X
//! write from a MAC that does not own the requester ID is counted and dropped); every request a
//! user makes ends with data, an error status, [`BridgeError::DeviceGone`] or
//! [`BridgeError::Timeout`].

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lanbus_port::Port;
use lanbus_runtime::{Handler, Outbox, Runtime, RuntimeConfig, Sender};
use lanbus_transport::{Event, LentSlice, Message, MessageSource, Role};
use lanbus_wire::MacAddr;

use crate::counters::{add, bump};
use crate::inline::{send_mem_writes, send_mem_writes_shared};
use crate::region::{DmaRegion, Domains, RegionMap};
use crate::{lock, ur_completion, ur_for_raw, BridgeError, BridgeResult, EventFd};
use lanbus_pcie::config::{
    cap_id, command, reg, walk_capabilities, BarKind, MSIX_ENABLE, MSIX_FUNCTION_MASK,
};
use lanbus_pcie::request::{
    each_completion_for_read, read_completion_headers, CompletionScratch, RequestShape,
};
use lanbus_pcie::requester::{Requester, RequesterEvent, TransactionId, TransactionMap};
use lanbus_pcie::{Bdf, CplStatus, Error, Header, Tag, Tlp, TlpKind};

/// The host's own requester ID (the root complex).
pub const HOST_BDF: Bdf = Bdf(0);

mod enumerate;

/// How to run a host bridge.
#[derive(Debug, Clone)]
pub struct HostBridgeConfig {
    /// Our group: we use the devices that announce it.
    pub group: u16,
    /// Our name in heartbeats.
    pub name: String,
    /// Bus addresses for BARs: (base, size).
    pub bar_window: (u64, u64),
    /// Bus addresses that are MSI-X targets: (base, size). Every vector's address is the base.
    pub msix_window: (u64, u64),
    /// Max payload size programmed into devices and used for our completions and writes.
    pub mps: usize,
    /// Max read request size programmed into devices and used for our reads.
    pub mrrs: usize,
    /// Read completion boundary of our completions (64 or 128).
    pub rcb: usize,
    /// How long a user's request may wait for its completions.
    pub completion_timeout: Duration,
    /// The runtime (its transport's group, role and name are set from the fields above).
    pub runtime: RuntimeConfig,
}

impl Default for HostBridgeConfig {
    fn default() -> Self {
        HostBridgeConfig {
            group: 0,
            name: "lanbus-host".into(),
            bar_window: (0xe000_0000, 0x1000_0000),
            msix_window: (0xfee0_0000, 0x10_0000),
            mps: 256,
            mrrs: 512,
            rcb: 64,
            completion_timeout: crate::DEFAULT_COMPLETION_TIMEOUT,
            runtime: RuntimeConfig::default(),
        }
    }
}

/// A BAR as assigned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteBar {
    /// BAR index (0..=5).
    pub index: usize,
    /// Assigned bus address (0 for I/O BARs, which are not assigned).
    pub address: u64,
    /// Size in bytes.
    pub size: u64,
    /// Kind (32/64-bit memory, prefetchable, or I/O).
    pub kind: BarKind,
}

/// A function's MSI-X capability as enumerated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteMsix {
    /// Vectors (table size).
    pub vectors: u16,
    /// BAR of the table, and offset in it.
    pub table_bar: u8,
    /// Offset of the table.
    pub table_offset: u32,
    /// BAR of the PBA.
    pub pba_bar: u8,
    /// Offset of the PBA.
    pub pba_offset: u32,
}

/// A remote PCIe function as the host bridge enumerated it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteFunction {
    /// The device bridge's MAC.
    pub mac: MacAddr,
    /// The device bridge's name.
    pub name: String,
    /// Its group.
    pub group: u16,
    /// The address we gave the function.
    pub bdf: Bdf,
    /// Vendor ID.
    pub vendor_id: u16,
    /// Device ID.
    pub device_id: u16,
    /// Revision ID.
    pub revision_id: u8,
    /// Class code (base << 16 | sub << 8 | interface).
    pub class_code: u32,
    /// Header type (bit 7: multi-function).
    pub header_type: u8,
    /// Subsystem vendor ID.
    pub subsystem_vendor_id: u16,
    /// Subsystem ID.
    pub subsystem_id: u16,
    /// BARs.
    pub bars: Vec<RemoteBar>,
    /// Capabilities: (ID, offset).
    pub capabilities: Vec<(u8, u16)>,
    /// MSI-X, if present (all vectors are assigned).
    pub msix: Option<RemoteMsix>,
    /// Max payload size programmed.
    pub mps: usize,
    /// Max read request size programmed.
    pub mrrs: usize,
}

impl RemoteFunction {
    /// The assigned address of BAR `index`.
    pub fn bar(&self, index: usize) -> Option<RemoteBar> {
        self.bars.iter().find(|b| b.index == index).copied()
    }

    /// MSI-X vectors assigned (0 without MSI-X).
    pub fn msix_vectors(&self) -> u16 {
        self.msix.map_or(0, |m| m.vectors)
    }
}

/// Something users may want to know about devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostEvent {
    /// A function was enumerated and is ready.
    DeviceAdded(RemoteFunction),
    /// A function is gone (its bridge stopped heartbeating or left our group).
    DeviceRemoved {
        /// Its address.
        bdf: Bdf,
        /// Its device bridge.
        mac: MacAddr,
        /// Why.
        reason: String,
    },
}

/// Counters of a host bridge.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostBridgeStats {
    /// TLPs received.
    pub tlps_received: u64,
    /// Memory reads from devices served from regions.
    pub dma_reads_served: u64,
    /// Memory reads from devices served in a later turn of the runtime's loop than the one
    /// that received them (a device asked for more than a turn serves).
    pub dma_reads_deferred: u64,
    /// Memory writes from devices applied to regions.
    pub dma_writes_applied: u64,
    /// Payload bytes copied out of received TLPs: device memory writes into regions, and the
    /// data of completions.
    pub payload_bytes_copied: u64,
    /// Device memory reads outside every region (answered UR).
    pub unknown_address_reads: u64,
    /// Device memory writes outside every region and the MSI-X window (dropped).
    pub unknown_address_writes: u64,
    /// Unsupported Request completions sent.
    pub ur_sent: u64,
    /// TLPs from peers that are not devices of our group (ignored).
    pub foreign: u64,
    /// Bytes that are not a TLP we handle.
    pub malformed: u64,
    /// Completions matching no request in flight.
    pub unexpected_completions: u64,
    /// Interrupts delivered.
    pub interrupts: u64,
    /// MSI-X writes that name no assigned function and vector (dropped).
    pub spurious_interrupts: u64,
    /// User requests that timed out.
    pub timeouts: u64,
    /// User requests failed because their device went away.
    pub device_gone: u64,
    /// Enumerations that failed.
    pub enumeration_failures: u64,
}

#[derive(Default)]
struct Counters {
    tlps_received: AtomicU64,
    dma_reads_served: AtomicU64,
    dma_reads_deferred: AtomicU64,
    dma_writes_applied: AtomicU64,
    payload_bytes_copied: AtomicU64,
    unknown_address_reads: AtomicU64,
    unknown_address_writes: AtomicU64,
    ur_sent: AtomicU64,
    foreign: AtomicU64,
    malformed: AtomicU64,
    unexpected_completions: AtomicU64,
    interrupts: AtomicU64,
    spurious_interrupts: AtomicU64,
    timeouts: AtomicU64,
    device_gone: AtomicU64,
    enumeration_failures: AtomicU64,
}

/// One device bridge of our group.
struct DevEntry {
    name: String,
    bus: u8,
    /// The channel of this session with the device.
    channel: u16,
    /// Changes every time the device (re)appears, so a stale enumeration is not stored.
    generation: u64,
    functions: Vec<RemoteFunction>,
}

#[derive(Default)]
struct State {
    /// Live peers: role, group, name.
    peers: HashMap<MacAddr, (Role, u16, String)>,
    devices: HashMap<MacAddr, DevEntry>,
    /// Which device bridge owns a bus.
    buses: HashMap<u8, MacAddr>,
    /// BAR ranges in use: (base, size, owner).
    allocations: Vec<(u64, u64, MacAddr)>,
    next_generation: u64,
    /// Sessions opened so far: the next one's channel (see [`State::session_channel`]).
    sessions_opened: u16,
}

impl State {
    /// The channel of a new session with a device: the next of [`crate::PCIE_CHANNELS`] in turn,
    /// so it differs from the device's last 255 sessions with this host. Only the current
    /// session's channel counts on either side, so a late completion or DMA request of an
    /// earlier session (the device unplugged and back, an enumeration given up) is told apart
    /// and dropped. A restarted host starts again from the first; the transport tells its new
    /// incarnation from the old by their epochs, and the device follows the channel its
    /// configuration requests come on.
    fn session_channel(&mut self) -> u16 {
        let n = self.sessions_opened;
        self.sessions_opened = self.sessions_opened.wrapping_add(1);
        crate::PCIE_CHANNEL + (n & 0xff)
    }
}

/// A user waiting for one transaction.
struct Waiter {
    /// The function it is addressed to.
    bdf: Bdf,
    state: Mutex<WaitState>,
    done: Condvar,
    /// Bumped under `state`'s lock at every change (see [`spin_then_wait`]).
    seq: AtomicU64,
}

struct WaitState {
    result: Option<BridgeResult<Vec<u8>>>,
    /// Users sleeping on `done` (only then is a notification worth a system call).
    sleepers: usize,
}

/// Waits on `cv` for `ready` (checked under `m`'s lock) until `deadline`: first spins (yielding)
/// for [`crate::spin_budget`] on `seq`, which whoever changes `m`'s data bumps while holding the
/// lock, so the spinning thread takes the lock only when something changed (a spinning locker
/// would slow the thread that brings the news); then sleeps, with `sleepers` counting sleeping
/// threads so notifiers can skip the system call when there are none. Returns the guard; `ready`
/// may still be false at the deadline.
fn spin_then_wait<'a, T>(
    m: &'a Mutex<T>,
    cv: &Condvar,
    seq: &AtomicU64,
    deadline: Instant,
    sleepers: impl Fn(&mut T) -> &mut usize,
    mut ready: impl FnMut(&mut T) -> bool,
) -> std::sync::MutexGuard<'a, T> {
    let spin_until = (Instant::now() + crate::spin_budget()).min(deadline);
    let mut g = lock(m);
    while !ready(&mut g) && Instant::now() < spin_until {
        // Relaxed: a hint only; the lock taken after a change orders the data.
        let seen = seq.load(Ordering::Relaxed);
        drop(g);
        while seq.load(Ordering::Relaxed) == seen && Instant::now() < spin_until {
            std::thread::yield_now();
        }
        g = lock(m);
    }
    while !ready(&mut g) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        *sleepers(&mut g) += 1;
        g = cv.wait_timeout(g, left).unwrap_or_else(|e| e.into_inner()).0;
        *sleepers(&mut g) -= 1;
    }
    g
}

impl Waiter {
    fn new(bdf: Bdf) -> Waiter {
        Waiter {
            bdf,
            state: Mutex::new(WaitState { result: None, sleepers: 0 }),
            done: Condvar::new(),
            seq: AtomicU64::new(0),
        }
    }

    fn finish(&self, result: BridgeResult<Vec<u8>>) {
        let mut w = lock(&self.state);
        w.result = Some(result);
        // Relaxed: a hint for the spinning user, who then takes the lock.
        self.seq.fetch_add(1, Ordering::Relaxed);
        let sleeping = w.sleepers > 0;
        drop(w);
        if sleeping {
            self.done.notify_all();
        }
    }
}

/// Our requests to one device bridge: the PCIe requester (tags, splits, reassembly, timeouts)
/// and the users waiting for its transactions.
struct Session {
    requester: Requester,
    waiters: TransactionMap<Arc<Waiter>>,
}

/// The sessions by device bridge: a host has few, so a list searched by MAC beats hashing on
/// every completion.
#[derive(Default)]
struct Sessions(Vec<(MacAddr, Session)>);

impl Sessions {
    fn get_mut(&mut self, mac: &MacAddr) -> Option<&mut Session> {
        self.0.iter_mut().find(|(m, _)| m == mac).map(|(_, s)| s)
    }

    fn insert(&mut self, mac: MacAddr, session: Session) {
        self.remove(&mac);
        self.0.push((mac, session));
    }

    fn remove(&mut self, mac: &MacAddr) -> Option<Session> {
        let i = self.0.iter().position(|(m, _)| m == mac)?;
        Some(self.0.swap_remove(i).1)
    }
}

/// What a session's requester ended or wants sent, to act on once its lock is released.
#[derive(Default)]
struct Outcome {
    finished: Vec<(Arc<Waiter>, BridgeResult<Vec<u8>>)>,
    tlps: Vec<Tlp>,
}

impl Session {
    /// Drains the requester at `now`: ended transactions with their users, requests to send.
    fn drain(&mut self, sh: &Shared, mac: MacAddr, now: lanbus_wire::time::Instant) -> Outcome {
        let mut out = Outcome::default();
        while let Some(e) = self.requester.poll_event() {
            let (id, result) = match e {
                RequesterEvent::Done { id, data } => (id, Ok(data)),
                RequesterEvent::Failed { id, error } => (id, Err(error)),
            };
            let Some(w) = self.waiters.remove(&id) else { continue };
            let result = result.map_err(|e| sh.bridge_error(e, w.bdf, mac));
            out.finished.push((w, result));
        }
        out.tlps.extend(std::iter::from_fn(|| self.requester.poll_transmit(now)));
        out
    }
}

#[derive(Default)]
struct Vector {
    count: u64,
    eventfd: Option<Arc<EventFd>>,
}

type Callback = Arc<dyn Fn(Bdf, u16) + Send + Sync>;

#[derive(Default)]
struct Interrupts {
    vectors: HashMap<(Bdf, u16), Vector>,
    callbacks: Vec<Callback>,
    /// Users sleeping on `interrupted`.
    sleepers: usize,
}

enum Job {
    Enumerate { mac: MacAddr, generation: u64, bus: u8 },
}

struct Shared {
    config: HostBridgeConfig,
    state: Mutex<State>,
    /// Signalled when devices are added or removed.
    changed: Condvar,
    /// Our requests, per device bridge. Never locked together with `state`.
    sessions: Mutex<Sessions>,
    /// Time zero of the sessions' requesters.
    origin: Instant,
    regions: RwLock<Domains>,
    interrupts: Mutex<Interrupts>,
    interrupted: Condvar,
    /// Bumped under `interrupts`' lock at every interrupt (see [`spin_then_wait`]).
    interrupt_seq: AtomicU64,
    subscribers: Mutex<Vec<mpsc::Sender<HostEvent>>>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    /// The runtime's sender, set once the runtime runs, cleared at shutdown.
    sender_slot: Mutex<Option<Sender>>,
    counters: Counters,
    stop: AtomicBool,
}

impl Shared {
    fn emit(&self, e: HostEvent) {
        lock(&self.subscribers).retain(|s| s.send(e.clone()).is_ok());
    }

    /// A device of our group appeared: give it a bus and queue its enumeration.
    fn add_device(&self, mac: MacAddr, name: String) {
        let mut st = lock(&self.state);
        if st.devices.contains_key(&mac) {
            return;
        }
        let Some(bus) = (1..=255u8).find(|b| !st.buses.contains_key(b)) else {
            bump(&self.counters.enumeration_failures);
            return;
        };
        st.next_generation += 1;
        let generation = st.next_generation;
        st.buses.insert(bus, mac);
        let channel = st.session_channel();
        st.devices.insert(mac, DevEntry { name, bus, channel, generation, functions: Vec::new() });
        drop(st);
        let c = &self.config;
        let requester = Requester::new(HOST_BDF, Tag::COUNT, c.completion_timeout, c.mrrs)
            .expect("the mrrs was checked at start");
        lock(&self.sessions).insert(mac, Session { requester, waiters: TransactionMap::default() });
        if let Some(j) = lock(&self.jobs).as_ref() {
            let _ = j.send(Job::Enumerate { mac, generation, bus });
        }
    }

    /// A device went down or left the group: forget it, fail its requests, tell the users.
    fn remove_device(&self, mac: MacAddr, reason: &str) {
        let mut st = lock(&self.state);
        let Some(d) = st.devices.remove(&mac) else { return };
        st.buses.remove(&d.bus);
        st.allocations.retain(|(_, _, m)| *m != mac);
        drop(st);
        self.changed.notify_all();
        if let Some(mut session) = lock(&self.sessions).remove(&mac) {
            let now = self.now();
            session.requester.abort_all(now, Error::Unreachable(reason.to_string()));
            self.act(mac, None, session.drain(self, mac, now));
        }
        for f in d.functions {
            self.emit(HostEvent::DeviceRemoved { bdf: f.bdf, mac, reason: reason.to_string() });
        }
    }

    /// The device bridge owning `bdf`'s bus, and our session's channel with it.
    fn mac_of(&self, bdf: Bdf) -> BridgeResult<(MacAddr, u16)> {
        let st = lock(&self.state);
        let mac = st.buses.get(&bdf.bus()).copied().ok_or(BridgeError::NoSuchDevice(bdf))?;
        let channel = st.devices.get(&mac).ok_or(BridgeError::NoSuchDevice(bdf))?.channel;
        Ok((mac, channel))
    }

    /// `now` on the sessions' requesters' clock.
    fn now(&self) -> lanbus_wire::time::Instant {
        let since = self.origin.elapsed();
        lanbus_wire::time::Instant::from_nanos(u64::try_from(since.as_nanos()).unwrap_or(u64::MAX))
    }

    /// A failed transaction as the user sees it (counted).
    fn bridge_error(&self, error: Error, bdf: Bdf, mac: MacAddr) -> BridgeError {
        match error {
            Error::CompletionTimeout => {
                bump(&self.counters.timeouts);
                BridgeError::Timeout(self.config.completion_timeout)
            }
            Error::CompletionStatus(status) => BridgeError::Completion(status),
            Error::Unreachable(_) => {
                bump(&self.counters.device_gone);
                BridgeError::DeviceGone { bdf, mac }
            }
            e => BridgeError::BadCompletion(e),
        }
    }

    /// Finishes the users of ended transactions and sends what the requester released, through
    /// `out` (the receive thread) or the runtime's sender (a user thread).
    fn act(&self, mac: MacAddr, out: Option<&mut dyn Outbox>, outcome: Outcome) {
        for (w, result) in outcome.finished {
            w.finish(result);
        }
        if outcome.tlps.is_empty() {
            return;
        }
        let Some(channel) = lock(&self.state).devices.get(&mac).map(|d| d.channel) else { return };
        match out {
            Some(out) => {
                for t in &outcome.tlps {
                    if let Ok(bytes) = t.encode() {
                        out.send(mac, channel, &bytes);
                    }
                }
            }
            None => {
                if let Ok(sender) = self.sender() {
                    let _ = crate::send_tlps(&sender, mac, channel, &outcome.tlps);
                }
            }
        }
    }

    /// Starts a transaction with `bdf`'s device bridge (`start` builds it in the session's
    /// requester), sends its requests and waits until it ends: with its bytes, an error status,
    /// the device gone, or a timeout. The requester guarantees the end; a waiting user runs the
    /// session's timeouts when they are due.
    fn transact(
        &self,
        bdf: Bdf,
        start: impl FnOnce(&mut Requester, lanbus_wire::time::Instant) -> lanbus_pcie::Result<TransactionId>,
    ) -> BridgeResult<Vec<u8>> {
        let (mac, channel) = self.mac_of(bdf)?;
        let sender = self.sender()?;
        let waiter = Arc::new(Waiter::new(bdf));
        let tlps = {
            let mut sessions = lock(&self.sessions);
            let s = sessions.get_mut(&mac).ok_or(BridgeError::DeviceGone { bdf, mac })?;
            let now = self.now();
            let id = start(&mut s.requester, now).map_err(|e| BridgeError::BadRequest(e.to_string()))?;
            s.waiters.insert(id, waiter.clone());
            std::iter::from_fn(|| s.requester.poll_transmit(now)).collect::<Vec<_>>()
        };
        crate::send_tlps(&sender, mac, channel, &tlps)?;
        // Nothing of a new transaction is due before one completion timeout (the fast path
        // takes no lock to learn that); after that the requester says when to look again.
        let mut due = Instant::now() + self.config.completion_timeout;
        loop {
            let mut w = spin_then_wait(
                &waiter.state,
                &waiter.done,
                &waiter.seq,
                due,
                |w| &mut w.sleepers,
                |w| w.result.is_some(),
            );
            if let Some(result) = w.result.take() {
                return result;
            }
            drop(w);
            let outcome = {
                let mut sessions = lock(&self.sessions);
                let Some(s) = sessions.get_mut(&mac) else {
                    drop(sessions);
                    let w = lock(&waiter.state).result.take();
                    return w.unwrap_or(Err(BridgeError::DeviceGone { bdf, mac }));
                };
                let now = self.now();
                s.requester.handle_timeout(now);
                due = match s.requester.poll_timeout() {
                    Some(t) => self.origin + Duration::from_nanos(t.as_nanos()),
                    None => Instant::now() + self.config.completion_timeout,
                };
                s.drain(self, mac, now)
            };
            self.act(mac, None, outcome);
        }
    }

    fn sender(&self) -> BridgeResult<Sender> {
        lock(&self.sender_slot).clone().ok_or(BridgeError::Shutdown)
    }

    fn config_read(&self, bdf: Bdf, register: u16) -> BridgeResult<u32> {
        let r = register & !3;
        let d = self.transact(bdf, |req, now| req.config_read(now, bdf, r, 0xf))?;
        Ok(u32::from_le_bytes([d[0], d[1], d[2], d[3]]))
    }

    fn config_write(&self, bdf: Bdf, register: u16, first_be: u8, value: u32) -> BridgeResult<()> {
        let r = register & !3;
        self.transact(bdf, |req, now| req.config_write(now, bdf, r, first_be, value.to_le_bytes()))?;
        Ok(())
    }

    fn mmio_read(&self, bdf: Bdf, address: u64, buf: &mut [u8]) -> BridgeResult<()> {
        let data = self.transact(bdf, |req, now| req.read(now, address, buf.len()))?;
        buf.copy_from_slice(&data);
        Ok(())
    }

    fn mmio_write(&self, bdf: Bdf, address: u64, data: &[u8]) -> BridgeResult<()> {
        let (mac, channel) = self.mac_of(bdf)?;
        let sender = self.sender()?;
        send_mem_writes(&sender, mac, channel, HOST_BDF, address, data, self.config.mps)
            .map_err(|e| BridgeError::BadRequest(e.to_string()))
    }

    fn mmio_write_shared(&self, bdf: Bdf, address: u64, data: &LentSlice) -> BridgeResult<()> {
        let (mac, channel) = self.mac_of(bdf)?;
        let sender = self.sender()?;
        send_mem_writes_shared(&sender, mac, channel, HOST_BDF, address, data, self.config.mps)
            .map_err(|e| BridgeError::BadRequest(e.to_string()))
    }
}

/// The receive side: serves device DMA, routes completions, never waits for a user.
struct HostHandler {
    shared: Arc<Shared>,
    /// Where replies are encoded before the outbox copies them (reused: no allocation per TLP).
    scratch: Vec<u8>,
    /// The buffers completions for device reads are built in (reused).
    completions: CompletionScratch,
    /// Device reads waiting for a later turn of the runtime's loop (peer, channel, request),
    /// oldest first: see [`SERVE_PER_TURN`].
    deferred: VecDeque<(MacAddr, u16, Tlp)>,
    /// Bytes of device reads served in this turn.
    served: usize,
}

/// Bytes of device reads the host serves in one turn of its runtime's loop; the rest wait for
/// the next turns (oldest first), whose frames leave between them. A device reads a whole
/// transfer at once (a 1 MiB write's data is 256 read requests in one frame), and the runtime
/// transmits only when a turn's messages are handled: served in one go, every completion was
/// copied into frames and checksummed before the first left, while the device, which checks
/// and stores each as it comes, waited (its first completion came about halfway through the
/// read). In turns, the device works on the first frames while the host builds the next.
/// 128 KiB: two 64 KB frames a turn; 64 KiB was no faster, and each turn costs a system call.
const SERVE_PER_TURN: usize = 128 * 1024;

/// Device reads kept waiting at most; a device that asks for more than this is served at once
/// (as it would be without turns), so that requests from a peer cannot grow the queue without
/// bound.
const DEFERRED_MAX: usize = 4096;

impl HostHandler {
    fn send(&mut self, out: &mut dyn Outbox, peer: MacAddr, channel: u16, tlp: &Tlp) {
        self.scratch.resize(tlp.buffer_len(), 0);
        if let Ok(n) = tlp.emit(&mut self.scratch) {
            out.send(peer, channel, &self.scratch[..n]);
        }
    }

    fn ur(&mut self, out: &mut dyn Outbox, peer: MacAddr, channel: u16, tlp: &Tlp) {
        bump(&self.shared.counters.ur_sent);
        self.send(out, peer, channel, &ur_completion(HOST_BDF, tlp.requester_id(), tlp.tag));
    }

    /// Serves device read `tlp` from `peer` on `channel` from the regions: its completions, or
    /// UR.
    fn serve_read(&mut self, out: &mut dyn Outbox, peer: MacAddr, channel: u16, tlp: &Tlp) {
        let sh = self.shared.clone();
        let c = &sh.counters;
        let Header::Mem(h) = &tlp.header else { return };
        let shape = RequestShape::of_memory(h, tlp.length_dw);
        let (first, len) = shape.byte_range();
        let want = h.address.saturating_add(first);
        let domains = sh.regions.read().unwrap_or_else(|e| e.into_inner());
        let regions = domains.of(h.requester_id);
        if regions.find(want, (len as u64).max(1)).is_none() {
            drop(domains);
            bump(&c.unknown_address_reads);
            self.ur(out, peer, channel, tlp);
            return;
        }
        self.served += len;
        let HostHandler { scratch, completions, .. } = self;
        // The usual read: each completion's payload copied once, from the region
        // straight into the transport's frame.
        if let Ok(pieces) = read_completion_headers(tlp, HOST_BDF, sh.config.mps, sh.config.rcb) {
            if !pieces.is_empty() {
                for (cpl, address, n) in &pieces {
                    scratch.resize(cpl.header_len(), 0);
                    let h = cpl.emit_header(scratch);
                    let mut source = FromRegion {
                        header: &scratch[..h],
                        regions,
                        want: (want, len as u64),
                        address: *address,
                        len: *n,
                    };
                    out.send_from(peer, channel, &mut source);
                }
                drop(domains);
                bump(&c.dma_reads_served);
                return;
            }
        }
        let served = each_completion_for_read(
            tlp,
            HOST_BDF,
            sh.config.mps,
            sh.config.rcb,
            completions,
            |a, buf| regions.read_dws(want, len as u64, a, buf).ok_or(()),
            |cpl, payload| {
                // The header here, the payload straight from the region's copy: each
                // byte is copied once more, into the transport.
                scratch.resize(cpl.header_len(), 0);
                let n = cpl.emit_header(scratch);
                out.send_parts(peer, channel, &[&scratch[..n], payload]);
            },
        );
        drop(domains);
        match served {
            Ok(()) => bump(&c.dma_reads_served),
            Err(_) => self.ur(out, peer, channel, tlp),
        }
    }

    fn complete(&self, peer: MacAddr, tlp: &Tlp, out: &mut dyn Outbox) {
        let sh = &self.shared;
        let outcome = {
            let mut sessions = lock(&sh.sessions);
            let now = sh.now();
            let accepted =
                sessions.get_mut(&peer).map(|s| s.requester.handle_completion(now, tlp).map(|()| s));
            match accepted {
                Some(Ok(s)) => s.drain(sh, peer, now),
                _ => {
                    bump(&sh.counters.unexpected_completions);
                    return;
                }
            }
        };
        sh.act(peer, Some(out), outcome);
    }

    fn interrupt(&self, peer: MacAddr, requester: Bdf, data: &[u8]) {
        let sh = &self.shared;
        let owner = lock(&sh.state).buses.get(&requester.bus()).copied();
        let vector = (data.len() == 4).then(|| u32::from_le_bytes([data[0], data[1], data[2], data[3]]));
        let ok_vector = |v: u32| {
            lock(&sh.state).devices.get(&peer).is_some_and(|d| {
                d.functions.iter().any(|f| f.bdf == requester && v < u32::from(f.msix_vectors()))
            })
        };
        let (Some(owner), Some(v)) = (owner, vector) else {
            bump(&sh.counters.spurious_interrupts);
            return;
        };
        if owner != peer || !ok_vector(v) {
            bump(&sh.counters.spurious_interrupts);
            return;
        }
        let v = v as u16;
        bump(&sh.counters.interrupts);
        let (callbacks, sleepers) = {
            let mut irq = lock(&sh.interrupts);
            let e = irq.vectors.entry((requester, v)).or_default();
            e.count += 1;
            if let Some(fd) = &e.eventfd {
                fd.signal();
            }
            // Relaxed: a hint for spinning waiters, who then take the lock.
            sh.interrupt_seq.fetch_add(1, Ordering::Relaxed);
            (irq.callbacks.clone(), irq.sleepers)
        };
        if sleepers > 0 {
            sh.interrupted.notify_all();
        }
        for cb in callbacks {
            cb(requester, v);
        }
    }
}

/// A completion as the transport takes it: its header, then its payload read from host memory
/// straight into the frame ([`RegionMap::append_dws`]).
struct FromRegion<'a> {
    header: &'a [u8],
    regions: &'a RegionMap,
    /// The bytes the read request enabled (address, length).
    want: (u64, u64),
    /// The payload's DWs.
    address: u64,
    len: usize,
}

impl MessageSource for FromRegion<'_> {
    fn len(&self) -> usize {
        self.header.len() + self.len
    }

    fn append_to(&mut self, f: &mut Vec<u8>, mut at: usize, mut n: usize) {
        let h = self.header.len();
        if at < h {
            let k = (h - at).min(n);
            f.extend_from_slice(&self.header[at..at + k]);
            (at, n) = (at + k, n - k);
        }
        if n > 0 {
            let (want, want_len) = self.want;
            let from = self.address + (at - h) as u64;
            if self.regions.append_dws(want, want_len, from, n, f).is_none() {
                // Checked before the first completion left; a region never goes meanwhile.
                f.resize(f.len() + n, 0);
            }
        }
    }
}

impl Handler for HostHandler {
    /// Serves the device reads that wait for their turn (see [`SERVE_PER_TURN`]); the turn ends
    /// here.
    fn poll(&mut self, out: &mut dyn Outbox) -> usize {
        let mut n = 0;
        while self.served < SERVE_PER_TURN {
            let Some((peer, channel, tlp)) = self.deferred.pop_front() else { break };
            n += 1;
            // A device that went or came back on a new channel meanwhile gets nothing.
            let current = lock(&self.shared.state).devices.get(&peer).is_some_and(|d| d.channel == channel);
            if current {
                self.serve_read(out, peer, channel, &tlp);
            } else {
                bump(&self.shared.counters.foreign);
            }
        }
        self.served = 0;
        n
    }

    fn on_message(&mut self, m: Message<'_>, out: &mut dyn Outbox) {
        let sh = self.shared.clone();
        let c = &sh.counters;
        // Only the current session's channel with a device of our group counts.
        if lock(&sh.state).devices.get(&m.peer).is_none_or(|d| d.channel != m.channel) {
            bump(&c.foreign);
            return;
        }
        bump(&c.tlps_received);
        // A DMA write's payload is copied once, from the frame into host memory.
        let (mut tlp, payload) = match Tlp::decode_borrowed(m.data) {
            Ok(t) => t,
            Err(_) => {
                bump(&c.malformed);
                if let Some(ur) = ur_for_raw(m.data, HOST_BDF) {
                    bump(&c.ur_sent);
                    self.send(out, m.peer, m.channel, &ur);
                }
                return;
            }
        };
        if tlp.kind.is_completion() {
            tlp.data = payload.to_vec();
            add(&c.payload_bytes_copied, payload.len());
        }
        match (&tlp.kind, &tlp.header) {
            (TlpKind::Cpl | TlpKind::CplD, _) => self.complete(m.peer, &tlp, out),
            (TlpKind::MRd32 | TlpKind::MRd64, Header::Mem(_)) => {
                let busy = !self.deferred.is_empty() || self.served >= SERVE_PER_TURN;
                if busy && self.deferred.len() < DEFERRED_MAX {
                    bump(&c.dma_reads_deferred);
                    self.deferred.push_back((m.peer, m.channel, tlp));
                    return;
                }
                self.serve_read(out, m.peer, m.channel, &tlp);
            }
            (TlpKind::MWr32 | TlpKind::MWr64, Header::Mem(h)) => {
                let shape = RequestShape::of_memory(h, tlp.length_dw);
                let (first, len) = shape.byte_range();
                let at = h.address.saturating_add(first);
                let Some(bytes) = payload.get(first as usize..first as usize + len) else {
                    bump(&c.malformed);
                    return;
                };
                let (mb, ms) = sh.config.msix_window;
                if at.checked_sub(mb).is_some_and(|o| o < ms) {
                    self.interrupt(m.peer, h.requester_id, bytes);
                    return;
                }
                let domains = sh.regions.read().unwrap_or_else(|e| e.into_inner());
                match domains.of(h.requester_id).find(at, len as u64) {
                    Some((r, off)) => {
                        r.write(off, bytes);
                        bump(&c.dma_writes_applied);
                        add(&c.payload_bytes_copied, bytes.len());
                    }
                    None => bump(&c.unknown_address_writes),
                }
            }
            _ if crate::is_non_posted(&tlp) => self.ur(out, m.peer, m.channel, &tlp),
            _ => bump(&c.malformed),
        }
    }

    fn on_event(&mut self, event: &Event, _out: &mut dyn Outbox) {
        let sh = &self.shared;
        let group = sh.config.group;
        match event {
            Event::PeerUp { peer, role, group: g, name } => {
                lock(&sh.state).peers.insert(*peer, (*role, *g, name.clone()));
                if *role == Role::Device && *g == group {
                    sh.add_device(*peer, name.clone());
                }
            }
            Event::PeerDown { peer } => {
                lock(&sh.state).peers.remove(peer);
                sh.remove_device(*peer, "stopped heartbeating");
            }
            Event::PeerRestarted { peer, .. } => {
                // A device bridge came back as a new incarnation: its functions are new too. The
                // old session's requests fail, and the device is enumerated again.
                let info = lock(&sh.state).peers.get(peer).cloned();
                sh.remove_device(*peer, "restarted");
                if let Some((Role::Device, g, name)) = info {
                    if g == group {
                        sh.add_device(*peer, name);
                    }
                }
            }
            Event::GroupChanged { peer, new, .. } => {
                let info = {
                    let mut st = lock(&sh.state);
                    st.peers.get_mut(peer).map(|p| {
                        p.1 = *new;
                        (p.0, p.2.clone())
                    })
                };
                match info {
                    Some((Role::Device, name)) if *new == group => sh.add_device(*peer, name),
                    _ if *new != group => sh.remove_device(*peer, &format!("moved to group {new}")),
                    _ => {}
                }
            }
            _ => {}
        }
    }
}

/// A running host bridge. Dropping it stops its threads.
pub struct HostBridge {
    shared: Arc<Shared>,
    runtime: Option<Runtime>,
    config_thread: Option<JoinHandle<()>>,
}

impl HostBridge {
    /// Starts the runtime on `port` and the configuration thread.
    pub fn start(port: Box<dyn Port>, config: HostBridgeConfig) -> BridgeResult<HostBridge> {
        for (what, v) in [("mps", config.mps), ("mrrs", config.mrrs)] {
            if !v.is_power_of_two() || !(128..=4096).contains(&v) {
                return Err(BridgeError::BadRequest(format!("{what} {v}: a power of two in 128..=4096")));
            }
        }
        if config.rcb != 64 && config.rcb != 128 {
            return Err(BridgeError::BadRequest(format!("rcb {}: 64 or 128", config.rcb)));
        }
        let (jobs_tx, jobs_rx) = mpsc::channel();
        let mut rc = config.runtime.clone();
        rc.transport.group = config.group;
        rc.transport.heartbeat.enabled = true;
        rc.transport.heartbeat.role = Role::Host;
        rc.transport.heartbeat.name = config.name.clone();
        let shared = Arc::new(Shared {
            config,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            sessions: Mutex::new(Sessions::default()),
            origin: Instant::now(),
            regions: RwLock::new(Domains::default()),
            interrupts: Mutex::new(Interrupts::default()),
            interrupted: Condvar::new(),
            interrupt_seq: AtomicU64::new(0),
            subscribers: Mutex::new(Vec::new()),
            jobs: Mutex::new(Some(jobs_tx)),
            sender_slot: Mutex::new(None),
            counters: Counters::default(),
            stop: AtomicBool::new(false),
        });
        let runtime = Runtime::start(
            port,
            rc,
            Box::new(HostHandler {
                shared: shared.clone(),
                scratch: Vec::new(),
                completions: CompletionScratch::default(),
                deferred: VecDeque::new(),
                served: 0,
            }),
        )
        .map_err(|e| BridgeError::Start(e.to_string()))?;
        *lock(&shared.sender_slot) = Some(runtime.sender());
        let sh = shared.clone();
        let name = format!("{}-cfg", shared.config.name);
        let t = std::thread::Builder::new()
            .name(name)
            .spawn(move || enumerate::config_thread(sh, jobs_rx))
            .map_err(|e| BridgeError::Start(e.to_string()))?;
        Ok(HostBridge { shared, runtime: Some(runtime), config_thread: Some(t) })
    }

    /// Our MAC address.
    pub fn local_mac(&self) -> MacAddr {
        self.runtime.as_ref().expect("running").local_mac()
    }

    /// The enumerated functions, by address.
    pub fn devices(&self) -> Vec<RemoteFunction> {
        let st = lock(&self.shared.state);
        let mut v: Vec<RemoteFunction> = st.devices.values().flat_map(|d| d.functions.clone()).collect();
        v.sort_by_key(|f| f.bdf);
        v
    }

    /// The function at `bdf`, if enumerated.
    pub fn device(&self, bdf: Bdf) -> Option<RemoteFunction> {
        self.devices().into_iter().find(|f| f.bdf == bdf)
    }

    /// Waits until at least `count` functions are enumerated (or `timeout` passes) and returns
    /// them.
    pub fn wait_devices(&self, count: usize, timeout: Duration) -> Vec<RemoteFunction> {
        let deadline = Instant::now() + timeout;
        let mut st = lock(&self.shared.state);
        loop {
            let n: usize = st.devices.values().map(|d| d.functions.len()).sum();
            let left = deadline.saturating_duration_since(Instant::now());
            if n >= count || left.is_zero() {
                break;
            }
            st = self.shared.changed.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        drop(st);
        self.devices()
    }

    /// Waits until no function of device bridge `mac` is present (or `timeout` passes);
    /// whether it is gone.
    pub fn wait_gone(&self, mac: MacAddr, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = lock(&self.shared.state);
        loop {
            if !st.devices.contains_key(&mac) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = self.shared.changed.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// A stream of device events from now on.
    pub fn subscribe(&self) -> mpsc::Receiver<HostEvent> {
        let (tx, rx) = mpsc::channel();
        lock(&self.shared.subscribers).push(tx);
        rx
    }

    /// Reads the configuration DW at `register` (rounded down to a DW) of `bdf`.
    pub fn config_read(&self, bdf: Bdf, register: u16) -> BridgeResult<u32> {
        self.shared.config_read(bdf, register)
    }

    /// Writes the configuration DW at `register` of `bdf`, bytes enabled by `first_be`; waits
    /// for its completion.
    pub fn config_write(&self, bdf: Bdf, register: u16, first_be: u8, value: u32) -> BridgeResult<()> {
        self.shared.config_write(bdf, register, first_be, value)
    }

    /// Reads `buf.len()` bytes of `bdf`'s memory space at `address` (split by MRRS, at most 4 KiB
    /// per request and never across 4 KiB; waits for every completion).
    pub fn mmio_read(&self, bdf: Bdf, address: u64, buf: &mut [u8]) -> BridgeResult<()> {
        self.shared.mmio_read(bdf, address, buf)
    }

    /// Writes `data` to `bdf`'s memory space at `address` (posted, split by MPS).
    pub fn mmio_write(&self, bdf: Bdf, address: u64, data: &[u8]) -> BridgeResult<()> {
        self.shared.mmio_write(bdf, address, data)
    }

    /// [`HostBridge::mmio_write`] of bytes the caller shares: the runtime's thread copies them
    /// straight into the transport's frames (the caller's thread copies nothing) and lets go of
    /// `data` once they are in. Writes from one thread stay in order with its other writes.
    pub fn mmio_write_shared(&self, bdf: Bdf, address: u64, data: &LentSlice) -> BridgeResult<()> {
        self.shared.mmio_write_shared(bdf, address, data)
    }

    /// Reads a little-endian 32-bit register.
    pub fn mmio_read32(&self, bdf: Bdf, address: u64) -> BridgeResult<u32> {
        let mut b = [0u8; 4];
        self.mmio_read(bdf, address, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    /// Writes a little-endian 32-bit register.
    pub fn mmio_write32(&self, bdf: Bdf, address: u64, value: u32) -> BridgeResult<()> {
        self.mmio_write(bdf, address, &value.to_le_bytes())
    }

    /// Lends `region` to devices at bus address `bus_addr` (every function without a DMA domain
    /// of its own reaches it).
    pub fn add_region(&self, bus_addr: u64, region: Arc<dyn DmaRegion>) -> BridgeResult<()> {
        let mut r = self.shared.regions.write().unwrap_or_else(|e| e.into_inner());
        r.shared.add(bus_addr, region).map_err(BridgeError::BadRequest)
    }

    /// Takes back the region at `bus_addr`; whether there was one.
    pub fn remove_region(&self, bus_addr: u64) -> bool {
        self.shared.regions.write().unwrap_or_else(|e| e.into_inner()).shared.remove(bus_addr)
    }

    /// Gives function `bdf` a DMA domain of its own (`true`), at first empty: from then on its
    /// memory requests reach only the regions added with [`add_domain_region`](Self::add_domain_region),
    /// and none of the shared ones, as an IOMMU confines a function passed through to a VM. With
    /// `false` the domain and its regions are dropped and the function reaches the shared regions
    /// again.
    pub fn set_dma_domain(&self, bdf: Bdf, own: bool) {
        let mut r = self.shared.regions.write().unwrap_or_else(|e| e.into_inner());
        if own {
            r.private.entry(bdf).or_default();
        } else {
            r.private.remove(&bdf);
        }
    }

    /// Lends `region` at bus address `bus_addr` to function `bdf` alone (its domain, see
    /// [`set_dma_domain`](Self::set_dma_domain)); fails if the function has no domain or the
    /// range overlaps one of its regions.
    pub fn add_domain_region(&self, bdf: Bdf, bus_addr: u64, region: Arc<dyn DmaRegion>) -> BridgeResult<()> {
        let mut r = self.shared.regions.write().unwrap_or_else(|e| e.into_inner());
        let map = r
            .private
            .get_mut(&bdf)
            .ok_or_else(|| BridgeError::BadRequest(format!("{bdf} has no DMA domain")))?;
        map.add(bus_addr, region).map_err(BridgeError::BadRequest)
    }

    /// Takes back the region at `bus_addr` of `bdf`'s domain; whether there was one.
    pub fn remove_domain_region(&self, bdf: Bdf, bus_addr: u64) -> bool {
        let mut r = self.shared.regions.write().unwrap_or_else(|e| e.into_inner());
        r.private.get_mut(&bdf).is_some_and(|m| m.remove(bus_addr))
    }

    /// Delivers MSI-X vector `vector` of `bdf` to `target` from now on (`None`: to no eventfd;
    /// [`interrupt_eventfd`](Self::interrupt_eventfd) then makes a fresh one). The descriptor
    /// must be non-blocking: the receive thread signals it.
    pub fn route_interrupt(&self, bdf: Bdf, vector: u16, target: Option<Arc<EventFd>>) {
        lock(&self.shared.interrupts).vectors.entry((bdf, vector)).or_default().eventfd = target;
    }

    /// The eventfd MSI-X vector `vector` of `bdf` is delivered to (made on first use).
    pub fn interrupt_eventfd(&self, bdf: Bdf, vector: u16) -> BridgeResult<Arc<EventFd>> {
        let mut irq = lock(&self.shared.interrupts);
        let v = irq.vectors.entry((bdf, vector)).or_default();
        if v.eventfd.is_none() {
            v.eventfd = Some(Arc::new(EventFd::new().map_err(|e| BridgeError::Start(e.to_string()))?));
        }
        Ok(v.eventfd.clone().expect("set above"))
    }

    /// Calls `f(bdf, vector)` on every interrupt, on the receive thread: it must not block.
    pub fn on_interrupt(&self, f: impl Fn(Bdf, u16) + Send + Sync + 'static) {
        lock(&self.shared.interrupts).callbacks.push(Arc::new(f));
    }

    /// Interrupts received so far on `bdf`'s `vector`.
    pub fn interrupt_count(&self, bdf: Bdf, vector: u16) -> u64 {
        lock(&self.shared.interrupts).vectors.get(&(bdf, vector)).map_or(0, |v| v.count)
    }

    /// Waits until `bdf`'s `vector` has seen at least `count` interrupts (or `timeout` passes);
    /// returns the count.
    pub fn wait_interrupts(&self, bdf: Bdf, vector: u16, count: u64, timeout: Duration) -> u64 {
        let deadline = Instant::now() + timeout;
        let seen = |irq: &mut Interrupts| irq.vectors.get(&(bdf, vector)).map_or(0, |v| v.count);
        let mut irq = spin_then_wait(
            &self.shared.interrupts,
            &self.shared.interrupted,
            &self.shared.interrupt_seq,
            deadline,
            |irq| &mut irq.sleepers,
            |irq| seen(irq) >= count,
        );
        seen(&mut irq)
    }

    /// The counters.
    pub fn stats(&self) -> HostBridgeStats {
        let c = &self.shared.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        HostBridgeStats {
            tlps_received: g(&c.tlps_received),
            dma_reads_served: g(&c.dma_reads_served),
            dma_reads_deferred: g(&c.dma_reads_deferred),
            dma_writes_applied: g(&c.dma_writes_applied),
            payload_bytes_copied: g(&c.payload_bytes_copied),
            unknown_address_reads: g(&c.unknown_address_reads),
            unknown_address_writes: g(&c.unknown_address_writes),
            ur_sent: g(&c.ur_sent),
            foreign: g(&c.foreign),
            malformed: g(&c.malformed),
            unexpected_completions: g(&c.unexpected_completions),
            interrupts: g(&c.interrupts),
            spurious_interrupts: g(&c.spurious_interrupts),
            timeouts: g(&c.timeouts),
            device_gone: g(&c.device_gone),
            enumeration_failures: g(&c.enumeration_failures),
        }
    }

    /// The runtime's counters (transport and port).
    pub fn runtime_stats(&self) -> lanbus_runtime::Stats {
        self.runtime.as_ref().expect("running").stats()
    }

    /// Each path to each peer node, where the bridge has several ports (empty otherwise).
    pub fn paths(&self) -> Vec<lanbus_port::PathReport> {
        self.runtime.as_ref().map(|r| r.paths()).unwrap_or_default()
    }

    /// The 802.1Q VLAN the bridge's frames carry (`None`: untagged).
    pub fn vlan(&self) -> Option<u16> {
        self.runtime.as_ref().and_then(|r| r.vlan())
    }

    /// Stops the threads.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        // Release pairs with the Acquire in the configuration thread.
        self.shared.stop.store(true, Ordering::Release);
        lock(&self.shared.jobs).take();
        *lock(&self.shared.sender_slot) = None;
        if let Some(r) = self.runtime.take() {
            r.shutdown();
        }
        // Fail whatever users still wait for.
        let macs: Vec<MacAddr> = lock(&self.shared.state).devices.keys().copied().collect();
        for m in macs {
            self.shared.remove_device(m, "host bridge shut down");
        }
        if let Some(t) = self.config_thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for HostBridge {
    fn drop(&mut self) {
        self.stop();
    }
}
