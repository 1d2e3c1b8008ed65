//! The device bridge: hosts PCIe functions in an I/O box and serves the host of its group.
//!
//! Layer: pcie engine over the runtime. Threads: the runtime's (which run [`DevHandler`], the
//! receive side, and every sans-IO model inline), one worker per blocking function, and one timer
//! thread when a function runs inline.
//!
//! - The receive handler parses each TLP and routes it: configuration type 0 requests by
//!   function number (function number = index in the list given to [`DeviceBridge::start`]),
//!   memory requests to the function whose BAR claims the address (from a decode snapshot
//!   refreshed after every configuration write), completions to the function named by the
//!   requester ID. It answers at once with Unsupported Request what no function claims and every
//!   non-posted request of a type it does not serve (I/O, type 1 configuration, undecodable
//!   requests), so the host never waits in silence.
//! - A sans-IO model ([`HostedFunction::model`]: the DMA engine, the virtio-net function) never
//!   blocks, so it runs inline on the receive thread (`bridge/inline.rs`): the handler serves its
//!   requests, feeds its read completions and runs it, and the TLPs it sends go out through the
//!   handler's outbox in the same burst (no thread hand-off, no queue, no wake-up per TLP). The
//!   timer thread fails its reads that see no completion within the completion timeout and runs
//!   the model, but sends nothing: it wakes the receive thread, whose [`Handler::poll`] sends what
//!   the model sent, in order with the function's other TLPs (only the receive thread sends
//!   them). Work from outside the bus (a frame on a NIC's wire) wakes the receive thread the same
//!   way, through the model's waker, and that thread runs the model in its next poll.
//! - A blocking model ([`HostedFunction::blocking`], the NVMe controller) has a worker thread that
//!   answers its function's queued requests, then runs it: DMA reads are split by the programmed
//!   max read request size into tagged MRd TLPs whose completions are reassembled
//!   ([`lanbus_pcie::ReadReassembly`]; the split, reassembly and expiry are `inline::Reads`, shared
//!   with the inline path); writes are split by max payload size into posted MWr TLPs; MSI-X
//!   is a write of the vector's message. Its blocking read waits on the worker, never on the
//!   receive thread; the receive side notifies the worker only when it sleeps. The model sits
//!   behind a lock the worker holds while it runs it and the receive thread only tries: when it
//!   gets it and nothing is queued for the worker, it serves a memory request itself (a doorbell,
//!   data for device memory, a register read) and runs the work that reads no host memory
//!   ([`lanbus_pcie::blocking::BlockingDevice::process_posted`]: an NVMe command whose queue and PRPs
//!   lie in the drive's memory buffer), so the common command needs no thread hand-off. The
//!   model says which accesses are quick enough for that thread
//!   ([`lanbus_pcie::blocking::BlockingDevice::serves_inline`]: not a register write that may flush
//!   storage), and `process_posted` leaves slow commands (Flush, FUA) to the worker, so
//!   heartbeats and ACKs never wait for a disk. What it sends goes behind what the worker sent:
//!   straight to the handler's outbox when the sender's queue is drained (run to completion),
//!   queued on the sender otherwise.
//!
//! Host selection: the bridge announces role Device and its group in heartbeats. Its host is a
//! live Host of the same group (the first heard; a request from a host of the group before its
//! heartbeat was seen makes that host current). Requests from any other peer are ignored and
//! counted. When the host goes down, leaves the group, or the bridge's own group changes, every
//! DMA read in flight fails at once with [`DmaError::HostUnreachable`].

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lanbus_port::Port;
use lanbus_runtime::{Handler, Outbox, Runtime, RuntimeConfig, Sender, ThreadMode};
use lanbus_transport::{Event, Message, Role};
use lanbus_wire::MacAddr;

use crate::counters::{add, bump, Counters};
use crate::hosted::{decode_table, decodes, serve, Hosted, HostedFunction, OpId, Path};
use crate::inline::{send_mem_writes, InlinePath, TlpOut};
use crate::reads::Reads;
use crate::{lock, ur_completion, ur_for_raw, BridgeError, BridgeResult, PCIE_CHANNEL, PCIE_CHANNELS};
use lanbus_pcie::blocking::Waker;
use lanbus_pcie::device::DmaError;
use lanbus_pcie::request::RequestShape;
use lanbus_pcie::{Bdf, CplStatus, Header, Tag, Tlp, TlpKind};

/// How to run a device bridge.
#[derive(Debug, Clone)]
pub struct DeviceBridgeConfig {
    /// The group whose host we serve.
    pub group: u16,
    /// Our name in heartbeats.
    pub name: String,
    /// The runtime (its transport's group, role and name are set from the fields above).
    pub runtime: RuntimeConfig,
    /// How long a DMA read may go without progress before it fails with a timeout (a read that
    /// waits for a free tag that long fails too). Inline functions check it every
    /// min(10 ms, timeout / 4), at least every millisecond: a timeout under 4 ms is met late by up
    /// to 1 ms.
    pub completion_timeout: Duration,
    /// Tags each function may have in flight (at most 1024).
    pub tags_per_function: u16,
}

impl Default for DeviceBridgeConfig {
    fn default() -> Self {
        DeviceBridgeConfig {
            group: 0,
            name: "lanbus-device".into(),
            runtime: RuntimeConfig::default(),
            completion_timeout: crate::DEFAULT_COMPLETION_TIMEOUT,
            tags_per_function: 256,
        }
    }
}

/// Counters of a device bridge.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceBridgeStats {
    /// TLPs received from our host.
    pub tlps_received: u64,
    /// Messages from peers that are not our current host (ignored).
    pub foreign_requests: u64,
    /// Messages on other channels (ignored).
    pub other_channel: u64,
    /// Bytes that are not a TLP this bridge serves.
    pub malformed: u64,
    /// Unsupported Request completions sent by the receive side.
    pub ur_sent: u64,
    /// Posted writes no function claims (dropped).
    pub unclaimed_writes: u64,
    /// Completions that match no read in flight.
    pub unexpected_completions: u64,
    /// DMA reads the functions issued (whole reads, before splitting).
    pub dma_reads: u64,
    /// DMA reads that failed (timeout, host gone, error status).
    pub dma_read_failures: u64,
    /// DMA writes sent (whole writes, MSI-X included).
    pub dma_writes: u64,
    /// DMA writes dropped because there was no host.
    pub dma_writes_dropped: u64,
    /// Times the current host changed (set or lost).
    pub host_changes: u64,
    /// Memory requests to blocking functions served on the receive thread (with the work they
    /// started that reads no host memory) instead of by the function's worker.
    pub served_inline: u64,
    /// DMA reads the receive thread started for a blocking function before its work asked for
    /// them (what its commands will read in host memory: an NVMe queue's new entries, a PRP
    /// list, a write's data).
    pub prefetched_reads: u64,
    /// Of those, the reads then used (on the receive thread or by the worker) instead of
    /// reading again.
    pub prefetches_used: u64,
    /// Payload bytes copied out of received TLPs: DMA read completions into their read's
    /// buffer, and requests that wait for a blocking function's worker (those served on the
    /// receive thread are handed to the function in the frame).
    pub payload_bytes_copied: u64,
}

/// Who we serve.
struct Session {
    group: u16,
    host: Option<MacAddr>,
    /// The channel our host last used (we answer and issue DMA on it).
    channel: u16,
    /// Live peers: role and group.
    peers: HashMap<MacAddr, (Role, u16)>,
}

/// What the receive side and a function's worker share.
struct FnState {
    /// Requests for the function, with the peer that sent them.
    inbox: VecDeque<(MacAddr, u16, Tlp)>,
    /// The worker's DMA reads (the receive side feeds their completions; unused inline).
    reads: Reads,
    /// Memory ranges the function decodes (refreshed by the worker after configuration writes).
    bars: Vec<(u64, u64)>,
    /// The function's ID as its host addressed it.
    bdf: Bdf,
    stop: bool,
    /// Whether and for what the worker sleeps on `wake` (only then is a notification worth a
    /// system call).
    sleeping: Sleep,
    /// The receive thread left the model work only the worker may do (it reads host memory or
    /// may wait for storage).
    kicked: bool,
}

/// What the worker sleeps for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sleep {
    /// It runs.
    No,
    /// For work: a request, a kick, a read that ended, a timeout.
    ForWork,
    /// For the DMA read it waits for in the middle of running the model: only that read's end (or
    /// a failure, or the bridge stopping) lets it go on; new work waits for the model to return,
    /// so waking it for that would cost a context switch and do nothing.
    ForRead,
}

struct FnShared {
    state: Mutex<FnState>,
    wake: Condvar,
    /// A sans-IO model, run on the receive thread (no worker); `None` for a blocking model,
    /// which has a worker.
    inline: Option<Mutex<InlineFn>>,
    /// A blocking model, shared by its worker and the receive thread (which only ever tries the
    /// lock: it must not wait for a worker that may wait for a completion it has to deliver).
    blocking: Option<Mutex<BlockingFn>>,
}

impl FnShared {
    /// Wakes the worker if it sleeps for work. Called after publishing work under `state`'s lock.
    fn notify(&self, st: std::sync::MutexGuard<'_, FnState>) {
        let sleeping = st.sleeping;
        drop(st);
        if sleeping == Sleep::ForWork {
            self.wake.notify_all();
        }
    }

    /// Wakes the worker if it sleeps at all: its reads changed (`Reads` says when that matters).
    fn notify_reads(&self, st: std::sync::MutexGuard<'_, FnState>) {
        let sleeping = st.sleeping;
        drop(st);
        if sleeping != Sleep::No {
            self.wake.notify_all();
        }
    }
}

/// A sans-IO function run inline on the receive thread, with its fabric path.
struct InlineFn {
    index: usize,
    hosted: Box<dyn Hosted>,
    path: InlinePath,
}

impl InlineFn {
    /// Takes the session snapshot (host, channel) for what follows.
    fn session(&mut self, session: (Option<MacAddr>, u16)) -> &mut Self {
        (self.path.host, self.path.channel) = session;
        self
    }

    /// Serves a configuration or memory request from `peer` on `channel`, then runs the model.
    fn request(
        &mut self,
        f: &FnShared,
        counters: &Counters,
        peer: MacAddr,
        channel: u16,
        tlp: &Tlp,
        payload: &[u8],
    ) {
        let (me, replies) =
            serve_request(self.index, &mut *self.hosted, f, counters, &mut self.path, tlp, payload);
        self.path.me = me;
        for r in &replies {
            self.path.out.push(peer, channel, r);
        }
        self.run();
    }

    fn run(&mut self) {
        self.hosted.run(&mut self.path);
    }

    /// Runs the model; returns the units of work done.
    fn hosted_run(&mut self) -> usize {
        self.hosted.run(&mut self.path)
    }

    /// Hands what the function sent to `out`.
    fn flush(&mut self, out: &mut dyn Outbox) {
        self.path.out.drain(|peer, channel, bytes| out.send(peer, channel, bytes));
    }
}

/// A blocking model, and the path the receive thread runs its posted-only work through.
struct BlockingFn {
    index: usize,
    hosted: Box<dyn Hosted>,
    /// Used for writes only: reads are refused before they reach it.
    posted: InlinePath,
}

impl BlockingFn {
    /// Serves memory request `tlp` from `peer` on the receive thread, then runs the part of the
    /// work it started that needs no host read (a doorbell's commands whose data lies in device
    /// memory, say). What it sends goes after everything the worker sent: straight to `out`
    /// when `direct` (nothing the worker sent still waits in `sender`'s queue), queued on
    /// `sender` otherwise. Returns whether work is left for the worker.
    fn serve_here(
        &mut self,
        f: &FnShared,
        counters: &Counters,
        req: &Incoming<'_>,
        sender: &Sender,
        direct: Option<&mut dyn Outbox>,
    ) -> bool {
        let Incoming { session, peer, channel, ref tlp, payload } = *req;
        let (_, replies) =
            serve_request(self.index, &mut *self.hosted, f, counters, &mut self.posted, tlp, payload);
        for r in &replies {
            self.posted.out.push(peer, channel, r);
        }
        self.run_here(f, session, sender, direct)
    }

    /// Runs, on the receive thread, the model's work that needs no host read to wait: what it
    /// reads must be here already (a prefetch that ended). The reads it names for later are
    /// started at once on the worker's reads, so that their round trip overlaps whatever comes
    /// next. Sends as [`BlockingFn::serve_here`] does. Returns whether work is left for the
    /// worker now: not while a prefetch is on its way (its end brings the receive thread back
    /// here).
    fn run_here(
        &mut self,
        f: &FnShared,
        session: (Option<MacAddr>, u16),
        sender: &Sender,
        direct: Option<&mut dyn Outbox>,
    ) -> bool {
        let path = &mut self.posted;
        (path.host, path.channel) = session;
        let config = self.hosted.config();
        path.set_limits(config.max_payload_size(), config.max_read_request_size());
        {
            let mut st = lock(&f.state);
            path.me = st.bdf;
            path.set_ready(st.reads.take_ready_prefetches());
        }
        let mut direct = direct;
        match direct.as_deref_mut() {
            Some(out) => self.hosted.run_posted(&mut DirectPath { path: &mut *path, out }),
            None => self.hosted.run_posted(path),
        };
        path.set_ready(Vec::new());
        let (prefetches, mrrs) = path.take_prefetches();
        let mut awaiting_prefetch = false;
        if !prefetches.is_empty() {
            let now = Instant::now();
            let mut st = lock(&f.state);
            for (address, len) in prefetches {
                st.reads.prefetch(address, len, mrrs, now);
            }
            let (out, me) = (&mut path.out, path.me);
            st.reads.pump(session.0, me, now, |host, tlp| out.push(host, session.1, tlp));
            awaiting_prefetch = st.reads.prefetch_in_flight();
        }
        match direct {
            Some(out) => path.out.drain(|peer, channel, bytes| out.send(peer, channel, bytes)),
            None => path.out.send_via(sender),
        }
        self.hosted.wants_run() && !awaiting_prefetch
    }
}

/// A blocking function's [`InlinePath`] while nothing of its worker's waits to be sent: its DMA
/// writes go into the transport straight from the function's buffer
/// ([`InlinePath::write_direct`]), everything else through the path.
struct DirectPath<'a> {
    path: &'a mut InlinePath,
    out: &'a mut dyn Outbox,
}

impl Path for DirectPath<'_> {
    fn start_read(&mut self, address: u64, len: usize) -> OpId {
        self.path.start_read(address, len)
    }

    fn start_reads(&mut self, reads: &[(u64, usize)]) -> Vec<OpId> {
        self.path.start_reads(reads)
    }

    fn write(&mut self, address: u64, data: &[u8]) -> Result<(), DmaError> {
        self.path.write_direct(&mut *self.out, address, data)
    }

    fn poll_read(&mut self) -> Option<(OpId, Result<Vec<u8>, DmaError>)> {
        self.path.poll_read()
    }

    fn wait_read(&mut self, op: OpId) -> Result<Vec<u8>, DmaError> {
        self.path.wait_read(op)
    }

    fn set_limits(&mut self, mps: usize, mrrs: usize) {
        self.path.set_limits(mps, mrrs);
    }

    fn prefetch(&mut self, address: u64, len: usize) {
        self.path.prefetch(address, len);
    }

    fn read_ready(&mut self, address: u64, len: usize) -> Option<Vec<u8>> {
        self.path.read_ready(address, len)
    }
}

/// Serves configuration or memory request `tlp` to function `index` (inline or on its worker):
/// records the ID its host addressed it by and, after a configuration write, its decode table and
/// the limits of its `path`. Returns that ID and the replies (Unsupported Requests counted).
fn serve_request(
    index: usize,
    hosted: &mut dyn Hosted,
    f: &FnShared,
    counters: &Counters,
    path: &mut dyn Path,
    tlp: &Tlp,
    payload: &[u8],
) -> (Bdf, Vec<Tlp>) {
    let me = match (&tlp.kind, &tlp.header) {
        (TlpKind::CfgRd0 | TlpKind::CfgWr0, Header::Config(h)) => {
            let bdf = Bdf::new(h.completer_id.bus(), h.completer_id.device(), index as u8)
                .unwrap_or(h.completer_id);
            lock(&f.state).bdf = bdf;
            bdf
        }
        _ => lock(&f.state).bdf,
    };
    let replies = serve(hosted, me, tlp, payload);
    if tlp.kind == TlpKind::CfgWr0 {
        lock(&f.state).bars = decode_table(hosted);
        path.set_limits(hosted.config().max_payload_size(), hosted.config().max_read_request_size());
    }
    for r in &replies {
        if r.header_status_is_ur() {
            bump(&counters.ur_sent);
        }
    }
    (me, replies)
}

struct Shared {
    session: Mutex<Session>,
    fns: Vec<Arc<FnShared>>,
    counters: Arc<Counters>,
    timeout: Duration,
    /// Stops the timer thread of the inline functions.
    ticker_stop: Mutex<bool>,
    ticker_wake: Condvar,
    /// The timer thread left output in an inline function's `path.out` for the receive thread
    /// to send (in order with the function's other TLPs: only that thread sends them).
    flush_due: AtomicBool,
    /// An inline function asked to be run (outside work arrived, see
    /// [`lanbus_pcie::device::DeviceModel::has_work`]): the receive thread runs it in its next
    /// [`Handler::poll`].
    run_due: AtomicBool,
    /// The runtime's sender, once it runs: blocking functions' TLPs go through it.
    sender: OnceLock<Sender>,
    /// The handler runs on the thread that sends (run to completion): its outbox keeps order
    /// with the sender's queue once that is drained.
    run_to_completion: bool,
}

impl Shared {
    /// Fails every read in flight (the host is gone). Called with the session locked.
    fn fail_all(&self) {
        for f in &self.fns {
            if let Some(inl) = &f.inline {
                let mut g = lock(inl);
                // No host: the model's reaction (a write, an interrupt) is dropped and counted.
                g.session((None, PCIE_CHANNEL)).path.fail_all();
                g.run();
                g.path.out.drain(|_, _, _| {});
                continue;
            }
            lock(&f.state).reads.fail_all(DmaError::HostUnreachable);
            f.wake.notify_all();
        }
    }

    /// Drops the current host (if any) and picks another live host of our group.
    fn lose_host(&self, s: &mut Session) {
        if s.host.take().is_some() {
            bump(&self.counters.host_changes);
            self.fail_all();
        }
        self.pick_host(s);
    }

    fn pick_host(&self, s: &mut Session) {
        if s.host.is_some() {
            return;
        }
        let mut hosts: Vec<MacAddr> =
            s.peers.iter().filter(|(_, (r, g))| *r == Role::Host && *g == s.group).map(|(m, _)| *m).collect();
        hosts.sort();
        if let Some(h) = hosts.first() {
            s.host = Some(*h);
            bump(&self.counters.host_changes);
        }
    }
}

/// A request from our host as the receive side routes it: the TLP decoded in place (its `data`
/// empty) and its payload, still in the frame.
struct Incoming<'a> {
    session: (Option<MacAddr>, u16),
    peer: MacAddr,
    channel: u16,
    tlp: Tlp,
    payload: &'a [u8],
}

/// The receive side: routes TLPs, never waits for a model.
struct DevHandler {
    shared: Arc<Shared>,
}

impl DevHandler {
    fn send(&self, out: &mut dyn Outbox, peer: MacAddr, channel: u16, tlp: &Tlp) {
        if let Ok(bytes) = tlp.encode() {
            out.send(peer, channel, &bytes);
        }
    }

    fn ur(&self, out: &mut dyn Outbox, peer: MacAddr, channel: u16, tlp: &Tlp) {
        bump(&self.shared.counters.ur_sent);
        let me = self.shared.fns.first().map_or(Bdf(0), |f| lock(&f.state).bdf);
        self.send(out, peer, channel, &ur_completion(me, tlp.requester_id(), tlp.tag));
    }

    /// Hands a configuration or memory request to its function: served here if it runs inline,
    /// queued to its worker otherwise.
    fn to_function(&self, f: &FnShared, req: Incoming<'_>, out: &mut dyn Outbox) {
        match &f.inline {
            Some(inl) => {
                let Incoming { session, peer, channel, tlp, payload } = req;
                let mut g = lock(inl);
                g.session(session).request(f, &self.shared.counters, peer, channel, &tlp, payload);
                g.flush(out);
            }
            None => self.to_blocking(f, req, out),
        }
    }

    /// Hands a request to a blocking function: a memory request (a doorbell, data for device
    /// memory, a register read) is served here when the worker is not running the model and
    /// nothing is queued before it (so requests keep their order), along with the work it starts
    /// that needs no host read; everything else goes to the worker's queue (configuration
    /// requests always: they change the limits of the worker's path).
    fn to_blocking(&self, f: &FnShared, req: Incoming<'_>, out: &mut dyn Outbox) {
        // What the request touches, for the model to say whether it is quick.
        let access = match (&req.tlp.kind, &req.tlp.header) {
            (TlpKind::MRd32 | TlpKind::MRd64 | TlpKind::MWr32 | TlpKind::MWr64, Header::Mem(h)) => {
                let (first, len) = RequestShape::of_memory(h, req.tlp.length_dw).byte_range();
                Some((h.address.saturating_add(first), len.max(1), req.tlp.kind.has_data()))
            }
            _ => None,
        };
        let model = match (&f.blocking, self.shared.sender.get(), access) {
            (Some(m), Some(sender), Some((address, len, write))) => match m.try_lock() {
                Ok(g) => Some((g, sender)),
                Err(TryLockError::Poisoned(e)) => Some((e.into_inner(), sender)),
                Err(TryLockError::WouldBlock) => None,
            }
            .filter(|(g, _)| g.hosted.serves_inline(address, len, write)),
            _ => None,
        };
        let mut st = lock(&f.state);
        if let Some((mut model, sender)) = model {
            // The inbox is drained only under the model's lock, which we hold: an empty one
            // means every earlier request has been served.
            if st.inbox.is_empty() {
                drop(st);
                let c = &self.shared.counters;
                bump(&c.served_inline);
                // The worker sends only under the model's lock, which we hold.
                let direct = (self.shared.run_to_completion && sender.is_drained()).then_some(out);
                if !model.serve_here(f, c, &req, sender, direct) {
                    return;
                }
                st = lock(&f.state);
                st.kicked = true;
                f.notify(st);
                return;
            }
        }
        let Incoming { peer, channel, mut tlp, payload, .. } = req;
        tlp.data = payload.to_vec();
        add(&self.shared.counters.payload_bytes_copied, payload.len());
        st.inbox.push_back((peer, channel, tlp));
        f.notify(st);
    }

    /// Feeds a completion, decoded in place (`payload` still in the frame), to the read it ends.
    fn complete(
        &self,
        peer: MacAddr,
        tlp: &Tlp,
        payload: &[u8],
        session: (Option<MacAddr>, u16),
        out: &mut dyn Outbox,
    ) {
        let Header::Completion(c) = &tlp.header else { return };
        let Some(f) = self.shared.fns.get(usize::from(c.requester_id.function())) else {
            bump(&self.shared.counters.unexpected_completions);
            return;
        };
        if let Some(inl) = &f.inline {
            let mut g = lock(inl);
            if g.session(session).path.complete(peer, tlp, payload) {
                g.run();
                g.flush(out);
            } else {
                bump(&self.shared.counters.unexpected_completions);
            }
            return;
        }
        let mut st = lock(&f.state);
        if !st.reads.complete(peer, tlp, payload, Instant::now()) {
            bump(&self.shared.counters.unexpected_completions);
            return;
        }
        let prefetched = st.reads.prefetch_ready();
        if st.reads.tag_freed() {
            // The freed tag goes to the read that waits for one from here: waking the worker for
            // it would cost a context switch per piece, and would have it run the model (with
            // its blocking reads) while the receive thread's prefetches are on their way.
            self.pump_reads(&mut st, session, out);
        }
        // The worker collects a read it waits for (a partial completion needs nothing of it).
        if st.reads.changed() {
            f.notify_reads(st);
        } else {
            drop(st);
        }
        if prefetched {
            self.run_prefetched(f, session, out);
        }
    }

    /// Sends the read requests of a blocking function that wait for tags, as far as tags are
    /// free, from the receive thread.
    fn pump_reads(&self, st: &mut FnState, session: (Option<MacAddr>, u16), out: &mut dyn Outbox) {
        let Some(sender) = self.shared.sender.get() else { return };
        let mut batch = TlpOut::default();
        st.reads.pump(session.0, st.bdf, Instant::now(), |host, tlp| batch.push(host, session.1, tlp));
        if self.shared.run_to_completion && sender.is_drained() {
            batch.drain(|peer, channel, bytes| out.send(peer, channel, bytes));
        } else {
            batch.send_via(sender);
        }
    }

    /// A prefetch for a blocking function ended: runs the work that waited for it here, as
    /// [`DevHandler::to_blocking`] runs a doorbell's, when the worker is not running the model
    /// and nothing is queued for it; otherwise the worker's run takes it.
    fn run_prefetched(&self, f: &FnShared, session: (Option<MacAddr>, u16), out: &mut dyn Outbox) {
        let (Some(model), Some(sender)) = (&f.blocking, self.shared.sender.get()) else { return };
        let mut model = match model.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            // The worker runs the model: the prefetch is its to claim, or to drop and read again.
            Err(TryLockError::WouldBlock) => return,
        };
        let mut st = lock(&f.state);
        if st.inbox.is_empty() {
            drop(st);
            let direct = (self.shared.run_to_completion && sender.is_drained()).then_some(out);
            if !model.run_here(f, session, sender, direct) {
                return;
            }
            st = lock(&f.state);
        }
        st.kicked = true;
        f.notify(st);
    }
}

impl Handler for DevHandler {
    fn on_message(&mut self, m: Message<'_>, out: &mut dyn Outbox) {
        let c = &self.shared.counters;
        if !PCIE_CHANNELS.contains(&m.channel) {
            bump(&c.other_channel);
            return;
        }
        // The session stays locked while the TLP is dispatched (lock order: session, then
        // function), so a host lost meanwhile on another thread (`set_group`) is never put back
        // by this snapshot.
        let mut s = lock(&self.shared.session);
        let session = {
            match s.host {
                Some(h) if h == m.peer => {
                    // A host opens every session with configuration requests on a fresh channel;
                    // other traffic may still be retransmissions of an older session, so only
                    // configuration requests move our DMA to their channel.
                    if m.data.first().is_some_and(|b| b & 0x1e == 0x04) {
                        s.channel = m.channel;
                    }
                }
                None if s.peers.get(&m.peer).is_none_or(|(r, g)| *r == Role::Host && *g == s.group) => {
                    // A host of our group (the transport drops other groups' data) that spoke
                    // before its heartbeat event reached us.
                    s.host = Some(m.peer);
                    s.channel = m.channel;
                    bump(&c.host_changes);
                }
                _ => {
                    bump(&c.foreign_requests);
                    return;
                }
            }
            (s.host, s.channel)
        };
        bump(&c.tlps_received);
        // Decoded in place: a write's payload is copied once, to where it goes.
        let (tlp, payload) = match Tlp::decode_borrowed(m.data) {
            Ok(t) => t,
            Err(_) => {
                bump(&c.malformed);
                let me = self.shared.fns.first().map_or(Bdf(0), |f| lock(&f.state).bdf);
                if let Some(ur) = ur_for_raw(m.data, me) {
                    bump(&c.ur_sent);
                    self.send(out, m.peer, m.channel, &ur);
                }
                return;
            }
        };
        match (&tlp.kind, &tlp.header) {
            (TlpKind::CfgRd0 | TlpKind::CfgWr0, Header::Config(h)) => {
                match self.shared.fns.get(usize::from(h.completer_id.function())) {
                    Some(f) => {
                        let req = Incoming { session, peer: m.peer, channel: m.channel, tlp, payload };
                        self.to_function(f, req, out)
                    }
                    None => self.ur(out, m.peer, m.channel, &tlp),
                }
            }
            (TlpKind::MRd32 | TlpKind::MRd64 | TlpKind::MWr32 | TlpKind::MWr64, Header::Mem(h)) => {
                let len = u64::from(tlp.length_dw.max(1)) * 4;
                let target =
                    self.shared.fns.iter().find(|f| decodes(&lock(&f.state).bars, h.address, len)).cloned();
                match target {
                    Some(f) => {
                        let req = Incoming { session, peer: m.peer, channel: m.channel, tlp, payload };
                        self.to_function(&f, req, out)
                    }
                    None if crate::is_non_posted(&tlp) => self.ur(out, m.peer, m.channel, &tlp),
                    None => bump(&c.unclaimed_writes),
                }
            }
            (TlpKind::Cpl | TlpKind::CplD, _) => self.complete(m.peer, &tlp, payload, session, out),
            _ if crate::is_non_posted(&tlp) => self.ur(out, m.peer, m.channel, &tlp),
            _ => bump(&c.malformed),
        }
    }

    fn poll(&mut self, out: &mut dyn Outbox) -> usize {
        // Acquire pairs with the Release stores in `ticker` and the inline functions' wakers.
        let run = self.shared.run_due.swap(false, Ordering::Acquire);
        if !self.shared.flush_due.swap(false, Ordering::Acquire) && !run {
            return 0;
        }
        let mut n = 0;
        // Lock order: session, then function (see `ticker`).
        let s = run.then(|| lock(&self.shared.session));
        for f in &self.shared.fns {
            if let Some(inl) = &f.inline {
                let mut g = lock(inl);
                if let Some(s) = &s {
                    if g.hosted.wants_run() {
                        n += g.session((s.host, s.channel)).hosted_run();
                    }
                }
                n += usize::from(!g.path.out.is_empty());
                g.flush(out);
            }
        }
        n
    }

    fn on_event(&mut self, event: &Event, _out: &mut dyn Outbox) {
        let mut s = lock(&self.shared.session);
        match event {
            Event::PeerUp { peer, role, group, .. } => {
                s.peers.insert(*peer, (*role, *group));
                self.shared.pick_host(&mut s);
            }
            Event::PeerDown { peer } => {
                s.peers.remove(peer);
                if s.host == Some(*peer) {
                    self.shared.lose_host(&mut s);
                }
            }
            Event::PeerRestarted { peer, .. } if s.host == Some(*peer) => {
                // Our host came back as a new incarnation: what we were doing for the old one
                // fails, and the new one is served once it enumerates us again.
                self.shared.lose_host(&mut s);
            }
            Event::GroupChanged { peer, new, .. } => {
                if let Some(p) = s.peers.get_mut(peer) {
                    p.1 = *new;
                }
                if s.host == Some(*peer) && *new != s.group {
                    self.shared.lose_host(&mut s);
                } else {
                    self.shared.pick_host(&mut s);
                }
            }
            _ => {}
        }
    }
}

/// The fabric [`Path`] of one function's worker: its reads live in the function state's
/// [`Reads`] (the receive side feeds their completions); the worker pumps, expires and collects
/// them, and sends every TLP of the function through the runtime's [`Sender`], in order.
struct FabricPath {
    shared: Arc<Shared>,
    f: Arc<FnShared>,
    sender: Sender,
    out: TlpOut,
    mps: usize,
    mrrs: usize,
}

impl FabricPath {
    /// Fails the reads that stalled, sends read TLPs for the reads' pieces while tags are free,
    /// and clears the "changed" mark the worker wakes on.
    fn pump(&mut self) {
        let now = Instant::now();
        {
            let s = lock(&self.shared.session);
            let (host, channel) = (s.host, s.channel);
            let mut st = lock(&self.f.state);
            let me = st.bdf;
            let out = &mut self.out;
            st.reads.expire(now);
            st.reads.pump(host, me, now, |host, tlp| out.push(host, channel, tlp));
            st.reads.take_changed();
        }
        self.out.send_via(&self.sender);
    }
}

impl Path for FabricPath {
    fn start_read(&mut self, address: u64, len: usize) -> OpId {
        let id = {
            let mut st = lock(&self.f.state);
            match st.reads.claim(address, len) {
                Some(op) => op,
                None => st.reads.start(address, len, self.mrrs, Instant::now()),
            }
        };
        self.pump();
        id
    }

    fn start_reads(&mut self, reads: &[(u64, usize)]) -> Vec<OpId> {
        let now = Instant::now();
        let ids = {
            let mut st = lock(&self.f.state);
            reads
                .iter()
                .map(|&(address, len)| match st.reads.claim(address, len) {
                    Some(op) => op,
                    None => st.reads.start(address, len, self.mrrs, now),
                })
                .collect()
        };
        self.pump();
        ids
    }

    fn write(&mut self, address: u64, data: &[u8]) -> Result<(), DmaError> {
        let c = &self.shared.counters;
        let (host, channel) = {
            let s = lock(&self.shared.session);
            (s.host, s.channel)
        };
        let Some(host) = host else {
            bump(&c.dma_writes_dropped);
            return Err(DmaError::HostUnreachable);
        };
        let me = lock(&self.f.state).bdf;
        // Encoded straight from `data` into buffers the sender queue takes as they are (`out`
        // is empty here: `pump` flushes it every time).
        send_mem_writes(&self.sender, host, channel, me, address, data, self.mps)
            .map_err(|_| DmaError::Completion(CplStatus::UnsupportedRequest))?;
        bump(&c.dma_writes);
        Ok(())
    }

    fn poll_read(&mut self) -> Option<(OpId, Result<Vec<u8>, DmaError>)> {
        if let Some(r) = lock(&self.f.state).reads.poll() {
            return Some(r);
        }
        self.pump();
        lock(&self.f.state).reads.poll()
    }

    fn wait_read(&mut self, op: OpId) -> Result<Vec<u8>, DmaError> {
        loop {
            self.pump();
            let limit = {
                let mut st = lock(&self.f.state);
                if let Some(r) = st.reads.take(op) {
                    return r;
                }
                st.reads.next_deadline().unwrap_or_else(|| Instant::now() + self.shared.timeout)
            };
            let spin_until = Instant::now() + crate::spin_budget();
            let mut st = lock(&self.f.state);
            if st.stop {
                return Err(DmaError::HostUnreachable);
            }
            // Completions usually come within a round trip: look again for a while (yielding the
            // core) before sleeping, when a core is to spare (see `spin_budget`).
            while !st.reads.changed() && !st.stop && Instant::now() < spin_until.min(limit) {
                drop(st);
                std::thread::yield_now();
                st = lock(&self.f.state);
            }
            if !st.reads.changed() && !st.stop {
                let wait = limit.saturating_duration_since(Instant::now());
                st.sleeping = Sleep::ForRead;
                st.reads.set_awaiting(Some(op));
                let (mut st, _) = self.f.wake.wait_timeout(st, wait).unwrap_or_else(|e| e.into_inner());
                st.reads.set_awaiting(None);
                st.sleeping = Sleep::No;
            }
        }
    }

    fn set_limits(&mut self, mps: usize, mrrs: usize) {
        self.mps = mps;
        self.mrrs = mrrs;
    }
}

/// How often the timer thread of the inline functions checks their completion timeouts: every
/// 10 ms, or a quarter of a shorter timeout (at least every millisecond).
fn tick(timeout: Duration) -> Duration {
    (timeout / 4).clamp(Duration::from_millis(1), Duration::from_millis(10))
}

/// The inline functions' timer: fails their reads that made no progress within the completion
/// timeout (the receive thread only runs when a message arrives). It sends nothing itself: what
/// the functions send in reaction stays in their output, and the receive thread, woken, sends it
/// in order with the rest (`DevHandler::poll`).
fn ticker(shared: Arc<Shared>, sender: Sender) {
    let tick = tick(shared.timeout);
    loop {
        {
            let stop = lock(&shared.ticker_stop);
            if *stop {
                return;
            }
            let (stop, _) = shared.ticker_wake.wait_timeout(stop, tick).unwrap_or_else(|e| e.into_inner());
            if *stop {
                return;
            }
        }
        let now = Instant::now();
        let mut flush = false;
        // Lock order: session, then function; the session stays locked while a function uses its
        // snapshot, so a host lost meanwhile is never put back.
        let s = lock(&shared.session);
        for f in &shared.fns {
            let Some(inl) = &f.inline else { continue };
            let mut g = lock(inl);
            if g.path.next_deadline().is_some_and(|d| d <= now) {
                g.session((s.host, s.channel)).path.expire(now);
                g.run();
            }
            flush |= !g.path.out.is_empty();
        }
        drop(s);
        if flush {
            // Release pairs with the Acquire swap in `DevHandler::poll`.
            shared.flush_due.store(true, Ordering::Release);
            sender.wake_handler();
        }
    }
}

/// A blocking function's worker: answers the requests queued for it and runs the model (its
/// reads wait here), taking turns with the receive thread, which serves what it can inline.
fn worker(index: usize, shared: Arc<Shared>, sender: Sender) {
    let f = shared.fns[index].clone();
    let Some(model) = &f.blocking else { return };
    let (mps, mrrs) = {
        let m = lock(model);
        (m.hosted.config().max_payload_size(), m.hosted.config().max_read_request_size())
    };
    let mut path = FabricPath {
        shared: shared.clone(),
        f: f.clone(),
        sender: sender.clone(),
        out: TlpOut::default(),
        mps,
        mrrs,
    };
    let mut idle_runs = 0u32;
    // Whether the model had work left after its last run (read under its lock, then).
    let mut wants_run = true;
    loop {
        let spin_until = Instant::now() + crate::spin_budget();
        let leave_model = {
            let mut st = lock(&f.state);
            loop {
                if st.stop {
                    return;
                }
                let due = st.reads.next_deadline().is_some_and(|d| d <= Instant::now());
                if !st.inbox.is_empty()
                    || st.reads.changed()
                    || due
                    || st.kicked
                    || (wants_run && idle_runs == 0)
                {
                    break;
                }
                if Instant::now() < spin_until {
                    // Look again for a while (yielding the core) before sleeping, when a core is
                    // to spare (see `spin_budget`): a request or completion usually follows
                    // within a round trip.
                    drop(st);
                    std::thread::yield_now();
                    st = lock(&f.state);
                    continue;
                }
                let wait = match st.reads.next_deadline() {
                    Some(d) => d.saturating_duration_since(Instant::now()),
                    None if wants_run => Duration::from_millis(1),
                    None => Duration::from_millis(100),
                };
                st.sleeping = Sleep::ForWork;
                let (g, timeout) = f.wake.wait_timeout(st, wait).unwrap_or_else(|e| e.into_inner());
                st = g;
                st.sleeping = Sleep::No;
                if timeout.timed_out() {
                    idle_runs = 0;
                    break;
                }
            }
            // Woken by nothing but a deadline or a read while the receive thread's prefetches
            // are on their way: the work they are for is the receive thread's when they land
            // (run here, the model would read them again, blocking, and drop them).
            let leave = !st.kicked && st.inbox.is_empty() && st.reads.prefetch_in_flight();
            st.kicked = false;
            leave
        };
        // Lock order: model, then state (the receive thread only tries the model's lock).
        let mut m = lock(model);
        if leave_model && !lock(&f.state).reads.prefetch_ready() {
            path.pump();
            drop(m);
            // A prefetch that landed while this thread held the model could not run on the
            // receive thread (it only tries the lock): it is this thread's to run, at once.
            let mut st = lock(&f.state);
            st.kicked |= st.reads.prefetch_ready();
            drop(st);
            idle_runs = idle_runs.saturating_add(1);
            continue;
        }
        let inbox: Vec<(MacAddr, u16, Tlp)> = lock(&f.state).inbox.drain(..).collect();
        for (peer, channel, tlp) in inbox {
            let (_, replies) =
                serve_request(index, &mut *m.hosted, &f, &shared.counters, &mut path, &tlp, &tlp.data);
            for r in &replies {
                path.out.push(peer, channel, r);
            }
            path.out.send_via(&sender);
        }
        // Expired reads fail and freed tags go to waiting reads even if the model does not poll.
        path.pump();
        let work = m.hosted.run(&mut path);
        wants_run = m.hosted.wants_run();
        // Prefetches are made for the run after them (the receive thread makes them only while
        // the model's lock is free): what this run did not use is stale now.
        lock(&f.state).reads.drop_prefetches();
        drop(m);
        idle_runs = if work == 0 { idle_runs.saturating_add(1) } else { 0 };
    }
}

trait StatusExt {
    fn header_status_is_ur(&self) -> bool;
}

impl StatusExt for Tlp {
    fn header_status_is_ur(&self) -> bool {
        matches!(&self.header, Header::Completion(c) if c.status == CplStatus::UnsupportedRequest)
    }
}

/// A running device bridge. Dropping it stops its threads.
pub struct DeviceBridge {
    runtime: Option<Runtime>,
    shared: Arc<Shared>,
    /// The functions' workers and the timer thread.
    workers: Vec<JoinHandle<()>>,
}

impl DeviceBridge {
    /// Starts the runtime on `port` and one worker per function (function number = index).
    pub fn start(
        port: Box<dyn Port>,
        config: DeviceBridgeConfig,
        functions: Vec<HostedFunction>,
    ) -> BridgeResult<DeviceBridge> {
        if functions.is_empty() || functions.len() > 8 {
            return Err(BridgeError::BadRequest(format!(
                "a device bridge hosts 1 to 8 functions, not {}",
                functions.len()
            )));
        }
        let mut functions = functions;
        if functions.len() > 1 {
            // Enumeration probes functions 1 to 7 only of a multi-function device.
            for f in &mut functions {
                f.inner.set_multi_function();
            }
        }
        let tags = config.tags_per_function.clamp(1, Tag::COUNT);
        let counters = Arc::new(Counters::default());
        let mut workers = Vec::new();
        let fns: Vec<Arc<FnShared>> = functions
            .into_iter()
            .enumerate()
            .map(|(i, f)| {
                let bdf = Bdf::new(0, 0, i as u8).unwrap_or_default();
                let (mps, mrrs) =
                    (f.inner.config().max_payload_size(), f.inner.config().max_read_request_size());
                let path = InlinePath::new(bdf, counters.clone(), config.completion_timeout, tags, mps, mrrs);
                let (inline, blocking) = if f.inner.blocking() {
                    workers.push(i);
                    (None, Some(Mutex::new(BlockingFn { index: i, hosted: f.inner, posted: path })))
                } else {
                    (Some(Mutex::new(InlineFn { index: i, hosted: f.inner, path })), None)
                };
                Arc::new(FnShared {
                    state: Mutex::new(FnState {
                        inbox: VecDeque::new(),
                        reads: Reads::new(counters.clone(), config.completion_timeout, tags),
                        bars: Vec::new(),
                        bdf,
                        stop: false,
                        sleeping: Sleep::No,
                        kicked: false,
                    }),
                    wake: Condvar::new(),
                    inline,
                    blocking,
                })
            })
            .collect();
        for f in &fns {
            if let Some(m) = &f.blocking {
                // Weak: the waker lives inside the function it wakes.
                let weak = Arc::downgrade(f);
                lock(m).hosted.set_waker(Waker::new(move || {
                    if let Some(f) = weak.upgrade() {
                        let mut st = lock(&f.state);
                        st.kicked = true;
                        f.notify(st);
                    }
                }));
            }
        }
        let any_inline = fns.iter().any(|f| f.inline.is_some());
        let shared = Arc::new(Shared {
            session: Mutex::new(Session {
                group: config.group,
                host: None,
                channel: PCIE_CHANNEL,
                peers: HashMap::new(),
            }),
            fns,
            counters,
            timeout: config.completion_timeout,
            ticker_stop: Mutex::new(false),
            ticker_wake: Condvar::new(),
            flush_due: AtomicBool::new(false),
            run_due: AtomicBool::new(false),
            sender: OnceLock::new(),
            run_to_completion: config.runtime.threads == ThreadMode::RunToCompletion,
        });
        let mut rc = config.runtime.clone();
        rc.transport.group = config.group;
        rc.transport.heartbeat.enabled = true;
        rc.transport.heartbeat.role = Role::Device;
        rc.transport.heartbeat.name = config.name.clone();
        let handler = DevHandler { shared: shared.clone() };
        let runtime =
            Runtime::start(port, rc, Box::new(handler)).map_err(|e| BridgeError::Start(e.to_string()))?;
        let mut bridge = DeviceBridge { runtime: Some(runtime), shared: shared.clone(), workers: Vec::new() };
        let _ = shared.sender.set(bridge.sender());
        for f in &shared.fns {
            if let Some(inl) = &f.inline {
                // Weak: the waker lives inside the bridge it wakes.
                let weak = Arc::downgrade(&shared);
                lock(inl).hosted.set_waker(Waker::new(move || {
                    if let Some(sh) = weak.upgrade() {
                        // Release pairs with the Acquire swap in `DevHandler::poll`.
                        sh.run_due.store(true, Ordering::Release);
                        if let Some(sender) = sh.sender.get() {
                            sender.wake_handler();
                        }
                    }
                }));
            }
        }
        for i in workers {
            let sender = bridge.sender();
            let shared = shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("{}-fn{i}", config.name))
                .spawn(move || worker(i, shared, sender))
                .map_err(|e| BridgeError::Start(e.to_string()))?;
            bridge.workers.push(h);
        }
        if any_inline {
            let sender = bridge.sender();
            let shared = shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("{}-tick", config.name))
                .spawn(move || ticker(shared, sender))
                .map_err(|e| BridgeError::Start(e.to_string()))?;
            bridge.workers.push(h);
        }
        Ok(bridge)
    }

    fn sender(&self) -> Sender {
        self.runtime.as_ref().expect("running").sender()
    }

    /// Our MAC address.
    pub fn local_mac(&self) -> MacAddr {
        self.runtime.as_ref().expect("running").local_mac()
    }

    /// The group we serve now.
    pub fn group(&self) -> u16 {
        lock(&self.shared.session).group
    }

    /// The host we serve now, if any.
    pub fn host(&self) -> Option<MacAddr> {
        lock(&self.shared.session).host
    }

    /// Moves the bridge to group `group`: the next heartbeat announces it (the old host sees its
    /// device leave, a host of the new group enumerates it); DMA in flight toward the old host
    /// fails at once. Refused for a group the port cannot carry (a VLAN ID above 4094).
    pub fn set_group(&self, group: u16) -> Result<(), String> {
        if let Some(r) = self.runtime.as_ref() {
            r.set_group(group)?;
        }
        let mut s = lock(&self.shared.session);
        if s.group == group {
            return Ok(());
        }
        s.group = group;
        self.shared.lose_host(&mut s);
        Ok(())
    }

    /// The counters.
    pub fn stats(&self) -> DeviceBridgeStats {
        let c = &self.shared.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DeviceBridgeStats {
            tlps_received: g(&c.tlps_received),
            foreign_requests: g(&c.foreign_requests),
            other_channel: g(&c.other_channel),
            malformed: g(&c.malformed),
            ur_sent: g(&c.ur_sent),
            unclaimed_writes: g(&c.unclaimed_writes),
            unexpected_completions: g(&c.unexpected_completions),
            dma_reads: g(&c.dma_reads),
            dma_read_failures: g(&c.dma_read_failures),
            dma_writes: g(&c.dma_writes),
            dma_writes_dropped: g(&c.dma_writes_dropped),
            host_changes: g(&c.host_changes),
            served_inline: g(&c.served_inline),
            prefetched_reads: g(&c.prefetched_reads),
            prefetches_used: g(&c.prefetches_used),
            payload_bytes_copied: g(&c.payload_bytes_copied),
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

    /// Stops the workers and the runtime.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        for f in &self.shared.fns {
            lock(&f.state).stop = true;
            f.wake.notify_all();
        }
        *lock(&self.shared.ticker_stop) = true;
        self.shared.ticker_wake.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
        if let Some(r) = self.runtime.take() {
            r.shutdown();
        }
    }
}

impl Drop for DeviceBridge {
    fn drop(&mut self) {
        self.stop();
    }
}
