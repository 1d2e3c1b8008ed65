//! The runtime layer: drives a sans-IO transport [`Endpoint`] over a [`Port`] on real threads and
//! hands delivered messages to an engine (a PCIe bridge, the messaging layer...).
//!
//! Three thread models, chosen by [`ThreadMode`], pass the same tests:
//!
//! - **Run to completion**: one thread receives a burst, feeds the endpoint, runs the engine's
//!   [`Handler`] on every delivered message, queues what other threads asked to send, transmits,
//!   and waits when idle.
//! - **Caller**: the same turns as run to completion, run by the node's user on its own thread
//!   through [`Runtime::poll`] (a process that polls a completion queue anyway, as an MPI rank
//!   does, then needs no second thread and no wake-up between the two); a helper thread runs them
//!   whenever the user has not for a millisecond, so the peer's frames, ACKs and timers are
//!   served while the user computes. The helper looks less often while the user keeps polling
//!   (every [`CALLER_LAPSE_MAX`] at most): each look is a timer's wake-up, which on a loaded
//!   machine takes a core from the user.
//! - **Pipeline** (Software ExpEther's design): a TX thread owns the [`SendHalf`] (segmentation,
//!   window, pacing, retransmission, ACK and heartbeat transmission) and an RX thread owns the
//!   [`ReceiveHalf`] (ordering, ACK generation, delivery to the handler, peer table). The RX
//!   thread passes [`Feedback`] (ACKs received, ACKs to send) and the handler's replies to the TX
//!   thread through queues and wakes it. The paper's bridge threads are the engine's own threads,
//!   which send through a [`Sender`]; its timer thread is the halves' own timers, which each
//!   thread serves from `poll_timeout`.
//!
//! Polling is adaptive by default: a thread spins while there is work and for a short while
//! after, then blocks in poll(2) on the port's readiness descriptor and its own wake-up eventfd,
//! with the transport's next timeout as the limit, so an idle node costs almost nothing and two
//! busy nodes still share a 2-core machine. [`Polling::Busy`] never blocks.
//!
//! Invariants: the endpoint (or each half) is touched by exactly one thread; the port is shared
//! by the two pipeline threads under a mutex held only for one burst; nothing a local thread asks
//! to send is dropped (a full transport queue keeps it in the runtime's queue until there is room).
#![deny(missing_docs)]

mod wake;

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use lanbus_port::{Port, PortCounters};
use lanbus_transport::{
    Config, Counters, Endpoint, Event, Feedback, FrameRef, Gathered, LentSlice, Message, MessageSource,
    ReceiveHalf, SendError, SendHalf,
};
use lanbus_wire::{Clock, Instant, MacAddr, MonotonicClock};

use wake::Waker;

/// Which threads run the transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ThreadMode {
    /// One thread does everything.
    #[default]
    RunToCompletion,
    /// A TX thread and an RX thread, joined by queues.
    Pipeline,
    /// The user's thread runs the turns through [`Runtime::poll`]; a helper thread runs them
    /// when the user has not for [`CALLER_LAPSE`].
    Caller,
}

/// In [`ThreadMode::Caller`], how long the user may leave the node unpolled before the helper
/// thread runs its turns.
pub const CALLER_LAPSE: Duration = Duration::from_millis(1);

/// In [`ThreadMode::Caller`], the longest the helper thread sleeps between two looks. Each look
/// that finds the user polling doubles the sleep, up to this; the first that finds the user
/// away brings it back to [`CALLER_LAPSE`]. So a user that polls all the time is interrupted
/// about sixty times a second instead of a thousand (on two busy cores each wake-up stalled the
/// round trip under way by about 100 µs), and a user that stops leaves the node unserved for at
/// most this long, well inside the transport's liveness limits (heartbeats are 100 ms apart).
pub const CALLER_LAPSE_MAX: Duration = Duration::from_millis(16);

/// When caller mode's helper thread looks next (see [`CALLER_LAPSE_MAX`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LapseSchedule {
    sleep: Duration,
}

impl LapseSchedule {
    fn new() -> LapseSchedule {
        LapseSchedule { sleep: CALLER_LAPSE }
    }

    /// How long to sleep before the next look, given whether this look found the user polling.
    fn after_look(&mut self, user_polled: bool) -> Duration {
        self.sleep = if user_polled { (self.sleep * 2).min(CALLER_LAPSE_MAX) } else { CALLER_LAPSE };
        self.sleep
    }
}

/// How an idle thread waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Polling {
    /// Poll forever, never blocking (yielding the core to other runnable threads every couple of
    /// microseconds of empty polls): lowest latency, one core per thread.
    Busy,
    /// Spin for `spin` after the last work, then block until a frame, a local send or a timer.
    Adaptive {
        /// How long to keep spinning after the last work.
        spin: Duration,
    },
}

impl Default for Polling {
    fn default() -> Self {
        Polling::Adaptive { spin: Duration::from_micros(50) }
    }
}

/// When a frame stamped `stamp_ns` by its port (wall-clock ns) reached this host, on the
/// runtime's clock, read at `now` when the wall clock said `real_now_ns`. A stamp from the future
/// or more than a second old (a wall clock stepped, or another clock) counts as `now`.
fn arrival(now: Instant, real_now_ns: u64, stamp_ns: u64) -> Instant {
    match real_now_ns.checked_sub(stamp_ns) {
        Some(ago) if ago < 1_000_000_000 => Instant::from_nanos(now.as_nanos().saturating_sub(ago)),
        _ => now,
    }
}

/// How to run a node.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// The transport's settings.
    pub transport: Config,
    /// Thread model.
    pub threads: ThreadMode,
    /// How idle threads wait.
    pub polling: Polling,
    /// Frames per rx/tx burst.
    pub burst: usize,
    /// Prefix of the threads' names.
    pub name: String,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            transport: Config::default(),
            threads: ThreadMode::default(),
            polling: Polling::default(),
            burst: 32,
            name: "lanbus".into(),
        }
    }
}

/// Where a handler puts replies. Sending never fails and never drops: if the transport's queue is
/// full the message waits in the runtime until there is room.
pub trait Outbox {
    /// Queues `data` for `peer` on `channel`.
    fn send(&mut self, peer: MacAddr, channel: u16, data: &[u8]);

    /// Queues the message made of `parts` (one after the other) for `peer` on `channel`, as
    /// [`send`](Self::send) does with one slice: a message built of a header and a payload from
    /// elsewhere is copied once, not first assembled.
    fn send_parts(&mut self, peer: MacAddr, channel: u16, parts: &[&[u8]]) {
        self.send(peer, channel, &parts.concat());
    }

    /// Queues the message made of `parts` (one after the other) for `peer` on `channel` if the
    /// transport has room for it now, copying it once; false (nothing queued) when it has not,
    /// and the caller offers it again on a later turn. A handler that streams more than the
    /// transport holds keeps the rest itself this way instead of piling copies up here.
    fn try_send_parts(&mut self, peer: MacAddr, channel: u16, parts: &[&[u8]]) -> bool {
        self.send(peer, channel, &parts.concat());
        true
    }

    /// Queues the message of `head` followed by `body` for `peer` on `channel` if the transport
    /// has room for it now, as [`try_send_parts`](Self::try_send_parts) does, but without copying
    /// `body` where the outbox can: the transport's frames then read it where it lies, and hold
    /// a reference to it until they are acknowledged or dropped. The default copies it.
    fn try_send_lent(&mut self, peer: MacAddr, channel: u16, head: &[u8], body: LentSlice) -> bool {
        self.try_send_parts(peer, channel, &[head, body.bytes()])
    }

    /// Drops every message queued or in flight to `peer` (a peer that went down, whose messages
    /// nobody waits for any more) and starts its channels afresh, as when it restarts. Frames
    /// holding lent memory let go of it. The default does nothing.
    fn abandon(&mut self, _peer: MacAddr) {}

    /// Queues the message whose bytes `data` appends itself for `peer` on `channel`, as
    /// [`send`](Self::send) does: bytes that live elsewhere (memory behind locks) are copied
    /// once, straight into the transport, where the outbox can. The default assembles them first.
    fn send_from(&mut self, peer: MacAddr, channel: u16, data: &mut dyn MessageSource) {
        let mut v = Vec::with_capacity(data.len());
        let n = data.len();
        data.append_to(&mut v, 0, n);
        self.send(peer, channel, &v);
    }
}

/// An engine's receive side, run on the thread that owns reception.
pub trait Handler: Send + 'static {
    /// A message arrived, in order for its channel.
    fn on_message(&mut self, message: Message<'_>, out: &mut dyn Outbox);

    /// A peer event (up, down, group change).
    fn on_event(&mut self, event: &Event, out: &mut dyn Outbox) {
        let _ = (event, out);
    }

    /// Called on the handler's thread once per loop iteration, after the messages and events of
    /// the iteration: sends what the engine's other threads left for the handler to send, so
    /// that it goes out in order with the handler's replies (what goes through a [`Sender`]
    /// may be overtaken by them). Another thread asks for a call soon with
    /// [`Sender::wake_handler`]. Returns the units of work done (0: nothing to do, the default).
    fn poll(&mut self, out: &mut dyn Outbox) -> usize {
        let _ = out;
        0
    }

    /// Called on the handler's thread just before it sleeps (adaptive polling, once its spin ran
    /// out with nothing to do). A handler whose [`Handler::poll`] watches something of its own,
    /// such as another process's ring, hands that watch here to a thread that calls
    /// [`Sender::wake_handler`] when work arrives. Not called in caller mode (the caller's
    /// thread never sleeps here) nor with busy polling (the thread never sleeps).
    fn parking(&mut self) {}
}

/// Counters of a running node.
#[derive(Debug, Clone, Copy, Default)]
pub struct Stats {
    /// The transport's counters (both halves).
    pub transport: Counters,
    /// The port's counters.
    pub port: PortCounters,
    /// Messages local threads queued that wait for room in the transport.
    pub backlog_messages: usize,
}

struct Outgoing {
    peer: MacAddr,
    channel: u16,
    data: Body,
}

/// A queued message's bytes: its own, or a head of its own, bytes it shares with the thread
/// that queued it and zeros (see [`Sender::send_shared`]).
enum Body {
    Owned(Vec<u8>),
    Shared { head: Vec<u8>, body: LentSlice, zeros: usize },
}

impl From<Vec<u8>> for Body {
    fn from(v: Vec<u8>) -> Body {
        Body::Owned(v)
    }
}

impl Outgoing {
    /// Hands the message to the transport; false if its queue is full (the message was not
    /// read and stays queued).
    fn send_to(&self, tx: &mut SendHalf, now: Instant) -> bool {
        match &self.data {
            Body::Owned(v) => tx.send(now, self.peer, self.channel, v).is_ok(),
            Body::Shared { head, body, zeros } => {
                let mut g = Gathered { head, gap: 0, body: body.bytes(), tail: *zeros };
                tx.send_from(now, self.peer, self.channel, &mut g).is_ok()
            }
        }
    }
}

enum Control {
    SetGroup(u16),
}

/// State shared by the node's threads and its handles.
struct Shared {
    stop: AtomicBool,
    /// Messages from other threads (and, in pipeline mode, the handler) for the sending side.
    outgoing: Mutex<VecDeque<Outgoing>>,
    /// Pipeline mode: feedback from the RX thread to the TX thread.
    feedback: Mutex<VecDeque<Feedback>>,
    /// Requests for the sending thread (the only thread in run-to-completion mode)...
    control_tx: Mutex<VecDeque<Control>>,
    /// ...and for the RX thread in pipeline mode.
    control_rx: Mutex<VecDeque<Control>>,
    mode: ThreadMode,
    /// Wakes the sending thread (the only thread in run-to-completion mode).
    tx_waker: Waker,
    /// Wakes the RX thread in pipeline mode (for control requests and shutdown).
    rx_waker: Waker,
    /// Latest counter snapshots, published by the threads.
    tx_counters: Mutex<Counters>,
    rx_counters: Mutex<Counters>,
    port_counters: Mutex<PortCounters>,
    paths: Mutex<Vec<lanbus_port::PathReport>>,
    /// Whether the sending side has nothing unacknowledged and nothing queued.
    idle: AtomicBool,
    /// Set after something was queued in `outgoing` or `control_tx`: the run-to-completion loop
    /// takes those locks only when it is (an empty poll then touches no lock at all).
    posted: AtomicBool,
    local_mac: MacAddr,
    /// The port's VLAN handle, where it carries the group as an 802.1Q VLAN ID.
    vlan: Option<lanbus_port::vlan::VlanId>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic on another thread leaves plain data behind; keep going with it.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn push_outgoing(&self, peer: MacAddr, channel: u16, data: &[u8]) {
        lock(&self.outgoing).push_back(Outgoing { peer, channel, data: data.to_vec().into() });
        self.posted_work();
    }

    /// After queueing in `outgoing` or `control_tx`: marks the node busy, flags the queues and
    /// wakes the sending thread.
    fn posted_work(&self) {
        // Relaxed is enough for `idle`: the queue's mutex orders the data.
        self.idle.store(false, Ordering::Relaxed);
        // Release pairs with the loop's Acquire swap; the data itself is ordered by the mutex.
        self.posted.store(true, Ordering::Release);
        self.tx_waker.wake();
    }
}

/// A handle other threads use to send messages through the node. Cheap to clone.
#[derive(Clone)]
pub struct Sender {
    shared: Arc<Shared>,
}

impl Sender {
    /// Queues `data` for `peer` on `channel` (copied; never dropped). Costs a system call only
    /// when the sending thread is parked.
    pub fn send(&self, peer: MacAddr, channel: u16, data: &[u8]) {
        self.shared.push_outgoing(peer, channel, data);
    }

    /// Queues every message of `messages` for `peer` on `channel`, in order, under one lock and
    /// with at most one wake-up of the sending thread.
    pub fn send_all<'a>(&self, peer: MacAddr, channel: u16, messages: impl IntoIterator<Item = &'a [u8]>) {
        self.send_owned(peer, channel, messages.into_iter().map(<[u8]>::to_vec));
    }

    /// [`Sender::send_all`] for messages the caller built in buffers of their own: they are
    /// queued as they are, not copied. The iterator runs under the queue's lock: pass buffers
    /// already built, and never send through a `Sender` from inside it.
    pub fn send_owned(&self, peer: MacAddr, channel: u16, messages: impl IntoIterator<Item = Vec<u8>>) {
        let mut q = lock(&self.shared.outgoing);
        let before = q.len();
        q.extend(messages.into_iter().map(|data| Outgoing { peer, channel, data: data.into() }));
        let any = q.len() > before;
        drop(q);
        if any {
            self.shared.posted_work();
        }
    }

    /// Queues messages for `peer` on `channel`, in order, under one lock and with at most one
    /// wake-up, each made of a head of its own, then bytes shared with the caller, then zero
    /// bytes: `(head, body, zeros)`. The sending thread copies the shared bytes straight into
    /// the transport's frames and lets go of each `body` once its message is in them.
    pub fn send_shared(
        &self,
        peer: MacAddr,
        channel: u16,
        messages: impl IntoIterator<Item = (Vec<u8>, LentSlice, usize)>,
    ) {
        let mut q = lock(&self.shared.outgoing);
        let before = q.len();
        q.extend(messages.into_iter().map(|(head, body, zeros)| Outgoing {
            peer,
            channel,
            data: Body::Shared { head, body, zeros },
        }));
        let any = q.len() > before;
        drop(q);
        if any {
            self.shared.posted_work();
        }
    }

    /// Whether no message sent through a `Sender` waits for the transport. On the handler's
    /// thread in run-to-completion mode, while nothing else can send, this means an [`Outbox`]
    /// send now goes out after every message sent before.
    pub fn is_drained(&self) -> bool {
        lock(&self.shared.outgoing).is_empty()
    }

    /// Wakes the thread that runs the handler, so that it calls [`Handler::poll`] soon even if
    /// no frame arrives.
    pub fn wake_handler(&self) {
        // In caller mode the user's own thread runs the next turn, and the helper thread
        // sleeps on a timer: nothing waits on a waker (each wake is a locked instruction on
        // the path of every message the caller starts).
        if self.shared.mode == ThreadMode::Caller {
            return;
        }
        // Run to completion waits on the TX waker, the pipeline's RX thread on the RX one.
        self.shared.tx_waker.wake();
        self.shared.rx_waker.wake();
    }

    /// The node's own MAC address.
    pub fn local_mac(&self) -> MacAddr {
        self.shared.local_mac
    }
}

/// A running node: a port, a transport endpoint and a handler on their threads. Dropping it stops
/// the threads.
pub struct Runtime {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    /// Caller mode: the node's turns, and when one last ran (the clock's ns).
    caller: Option<(Arc<Mutex<Rtc>>, Arc<AtomicU64>)>,
}

/// A nonzero epoch for a new incarnation: the wall clock, the process and a counter mixed (not
/// cryptographic; two incarnations of one MAC only need to differ, which they do unless they
/// start in the same nanosecond).
fn draw_epoch() -> u32 {
    use std::sync::atomic::AtomicU64;
    static STARTS: AtomicU64 = AtomicU64::new(0);
    // Relaxed: only distinctness of the values matters.
    let n = STARTS.fetch_add(1, Ordering::Relaxed);
    let t =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let mut x = t ^ (u64::from(std::process::id()) << 32) ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 31;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 29;
    (x as u32).max(1)
}

impl Runtime {
    /// Starts the node's threads.
    pub fn start(
        port: Box<dyn Port>,
        config: RuntimeConfig,
        handler: Box<dyn Handler>,
    ) -> std::io::Result<Runtime> {
        let clock = MonotonicClock::new();
        let local_mac = port.mac();
        let mut transport = config.transport.clone();
        // The transport never writes frames larger than the port carries.
        transport.mtu = transport.mtu.min(port.mtu());
        // A keyed port's tag covers every frame it delivers: a CRC beside it adds nothing.
        if port.authenticates() {
            transport.checksum = false;
        }
        if transport.epoch == 0 {
            transport.epoch = draw_epoch();
        }
        let vlan = port.vlan();
        if let Some(v) = &vlan {
            v.set(transport.group).map_err(std::io::Error::other)?;
        }
        let endpoint = Endpoint::new(transport, local_mac, clock.now());
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            outgoing: Mutex::new(VecDeque::new()),
            feedback: Mutex::new(VecDeque::new()),
            control_tx: Mutex::new(VecDeque::new()),
            control_rx: Mutex::new(VecDeque::new()),
            mode: config.threads,
            tx_waker: Waker::new()?,
            rx_waker: Waker::new()?,
            tx_counters: Mutex::new(Counters::default()),
            rx_counters: Mutex::new(Counters::default()),
            port_counters: Mutex::new(PortCounters::default()),
            paths: Mutex::new(Vec::new()),
            idle: AtomicBool::new(true),
            posted: AtomicBool::new(false),
            local_mac,
            vlan,
        });
        let mut threads = Vec::new();
        let mut caller = None;
        let spawn =
            |name: String, f: Box<dyn FnOnce() + Send>| std::thread::Builder::new().name(name).spawn(f);
        match config.threads {
            ThreadMode::RunToCompletion => {
                let worker = Worker::new(&config, shared.clone(), clock, port);
                let mut rtc = Rtc::new(worker, endpoint, handler);
                threads.push(spawn(format!("{}-rtc", config.name), Box::new(move || rtc.run()))?);
            }
            ThreadMode::Caller => {
                let mut worker = Worker::new(&config, shared.clone(), clock, port);
                // The caller polls as often as it likes and the thread never waits here: publish
                // counters on the millisecond, not each time a turn finds nothing (reading a
                // port's counters may be a system call, on the path of the next frame).
                worker.polling = Polling::Busy;
                let rtc = Arc::new(Mutex::new(Rtc::new(worker, endpoint, handler)));
                let last = Arc::new(AtomicU64::new(clock.now().as_nanos()));
                let (r, l, sh) = (rtc.clone(), last.clone(), shared.clone());
                threads.push(spawn(
                    format!("{}-lapse", config.name),
                    Box::new(move || serve_lapses(&r, &l, &sh, clock)),
                )?);
                caller = Some((rtc, last));
            }
            ThreadMode::Pipeline => {
                let (tx_half, rx_half) = endpoint.split();
                let port = Arc::new(Mutex::new(port));
                let mut tx = PipeTx {
                    worker: Worker::shared_port(&config, shared.clone(), clock, port.clone()),
                    half: tx_half,
                };
                let mut rx = PipeRx {
                    worker: Worker::shared_port(&config, shared.clone(), clock, port),
                    half: rx_half,
                    handler,
                };
                threads.push(spawn(format!("{}-tx", config.name), Box::new(move || tx.run()))?);
                threads.push(spawn(format!("{}-rx", config.name), Box::new(move || rx.run()))?);
            }
        }
        Ok(Runtime { shared, threads, caller })
    }

    /// Caller mode: runs one turn of the node on this thread (receive a burst, hand what it
    /// delivers to the handler, serve due timers, send what is queued) and returns the work done;
    /// never blocks (0 at once while the helper thread runs a turn). Other modes: 0.
    pub fn poll(&self) -> usize {
        let Some((rtc, last)) = &self.caller else { return 0 };
        let Ok(mut rtc) = rtc.try_lock() else { return 0 };
        let (now, work) = rtc.turn();
        // Relaxed: a hint for the helper thread, which takes the lock before it acts on it.
        last.store(now.as_nanos(), Ordering::Relaxed);
        work
    }

    /// Whether the node runs in [`ThreadMode::Caller`] (its user's thread moves its messages
    /// by calling [`Runtime::poll`]).
    pub fn is_caller(&self) -> bool {
        self.caller.is_some()
    }

    /// A handle for sending from other threads.
    pub fn sender(&self) -> Sender {
        Sender { shared: self.shared.clone() }
    }

    /// The node's MAC address (its port's).
    pub fn local_mac(&self) -> MacAddr {
        self.shared.local_mac
    }

    /// The 802.1Q VLAN the node's frames carry, where its port carries the group as one.
    pub fn vlan(&self) -> Option<u16> {
        self.shared.vlan.as_ref().map(|v| v.get())
    }

    /// Changes the node's group (announced in the next heartbeat; frames of other groups are
    /// dropped from then on; on a port that carries the group as a VLAN, the node moves to that
    /// VLAN). Refused, with nothing changed, for a group that cannot be a VLAN ID there.
    pub fn set_group(&self, group: u16) -> Result<(), String> {
        if let Some(v) = &self.shared.vlan {
            v.set(group)?;
        }
        lock(&self.shared.control_tx).push_back(Control::SetGroup(group));
        self.shared.posted_work();
        if self.shared.mode == ThreadMode::Pipeline {
            lock(&self.shared.control_rx).push_back(Control::SetGroup(group));
            self.shared.rx_waker.wake();
        }
        Ok(())
    }

    /// The latest counters (published by the threads at least every millisecond, and with
    /// adaptive polling whenever they go idle).
    pub fn stats(&self) -> Stats {
        let mut transport = *lock(&self.shared.tx_counters);
        transport.merge(&lock(&self.shared.rx_counters));
        Stats {
            transport,
            port: *lock(&self.shared.port_counters),
            backlog_messages: lock(&self.shared.outgoing).len(),
        }
    }

    /// Each path to each peer node, where the port has several ([`Port::paths`]; published with
    /// the counters).
    pub fn paths(&self) -> Vec<lanbus_port::PathReport> {
        lock(&self.shared.paths).clone()
    }

    /// Waits until everything sent so far is acknowledged, or `timeout` passes. Returns whether
    /// the node went idle.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            // Acquire pairs with the Release store of the sending thread after its last check.
            if self.shared.idle.load(Ordering::Acquire) && lock(&self.shared.outgoing).is_empty() {
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Stops the threads and waits for them.
    pub fn shutdown(mut self) {
        self.stop_threads();
    }

    fn stop_threads(&mut self) {
        // Release pairs with the Acquire loads in the loops: they see every send queued before.
        self.shared.stop.store(true, Ordering::Release);
        self.shared.tx_waker.wake();
        self.shared.rx_waker.wake();
        for t in self.threads.drain(..) {
            // Caller mode's helper sleeps parked: end its sleep at once.
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.stop_threads();
    }
}

/// How long a busy-polling thread polls between two yields of its core (see
/// [`Worker::spin_or_yield`]).
const SPIN_YIELD_EVERY: Duration = Duration::from_micros(2);

/// How a worker reaches the port: owned (run to completion) or shared by the pipeline threads.
enum PortAccess {
    Owned(Box<dyn Port>),
    Shared(Arc<Mutex<Box<dyn Port>>>),
}

/// What every runtime thread has: the clock, the shared state, the port, the idle policy.
struct Worker {
    shared: Arc<Shared>,
    clock: MonotonicClock,
    port: PortAccess,
    readiness_fd: Option<RawFd>,
    polling: Polling,
    burst: usize,
    /// Whether the port sends the transport's frames where they lie ([`Port::borrows_frames`]).
    borrows: bool,
    last_work: Instant,
    last_publish: Instant,
    /// Whether the counters were published since the thread last did work.
    published_idle: bool,
    /// When the thread, spinning, last yielded its core.
    last_yield: Instant,
    /// The wall clock less the runtime's clock, ns, and when it was read (see
    /// [`Worker::rx_burst`]).
    real_offset: Option<(u64, Instant)>,
}

/// How long [`Worker::rx_burst`] converts port stamps with one reading of the wall clock's
/// offset from the runtime's clock. Between two readings the two clocks drift apart only as fast
/// as NTP slews the wall clock (at most 500 ppm: half a microsecond in this time).
const REAL_OFFSET_FOR: Duration = Duration::from_millis(1);

impl Worker {
    fn new(
        config: &RuntimeConfig,
        shared: Arc<Shared>,
        clock: MonotonicClock,
        port: Box<dyn Port>,
    ) -> Worker {
        let readiness_fd = port.readiness_fd();
        Worker::with(config, shared, clock, PortAccess::Owned(port), readiness_fd)
    }

    fn shared_port(
        config: &RuntimeConfig,
        shared: Arc<Shared>,
        clock: MonotonicClock,
        port: Arc<Mutex<Box<dyn Port>>>,
    ) -> Worker {
        let readiness_fd = lock(&port).readiness_fd();
        Worker::with(config, shared, clock, PortAccess::Shared(port), readiness_fd)
    }

    fn with(
        config: &RuntimeConfig,
        shared: Arc<Shared>,
        clock: MonotonicClock,
        port: PortAccess,
        readiness_fd: Option<RawFd>,
    ) -> Worker {
        let now = clock.now();
        let borrows = match &port {
            PortAccess::Owned(p) => p.borrows_frames(),
            PortAccess::Shared(p) => lock(p).borrows_frames(),
        };
        Worker {
            shared,
            clock,
            port,
            readiness_fd,
            polling: config.polling,
            burst: config.burst.max(1),
            borrows,
            last_work: now,
            last_publish: now,
            published_idle: false,
            last_yield: now,
            real_offset: None,
        }
    }

    fn stopping(&self) -> bool {
        self.shared.stop.load(Ordering::Acquire)
    }

    /// Peer nodes one of whose paths the port found failed since the last call: the transport
    /// sends each every frame in flight again ([`Port::take_failed_peer`]).
    fn failed_peers(&mut self, on_peer: &mut dyn FnMut(MacAddr)) {
        self.with_port(|p| {
            while let Some(peer) = p.take_failed_peer() {
                on_peer(peer);
            }
        });
    }

    fn with_port<R>(&mut self, f: impl FnOnce(&mut dyn Port) -> R) -> R {
        match &mut self.port {
            PortAccess::Owned(p) => f(&mut **p),
            PortAccess::Shared(p) => f(&mut **lock(p)),
        }
    }

    /// Receives one burst, feeding each frame to `on_frame` with when it reached this host (the
    /// port's receive timestamp on this clock, else `now`). Port errors are transient here (an
    /// interface flap, a full socket buffer): they are reported once a second and retried.
    fn rx_burst(&mut self, now: Instant, on_frame: &mut dyn FnMut(Instant, &[u8])) -> usize {
        let burst = self.burst;
        // The port's stamps are wall-clock time. The wall clock is read when a stamp comes and
        // the last reading of its offset is older than `REAL_OFFSET_FOR`: a clock read is a good
        // part of the turn that takes a message.
        let mut real_offset = self.real_offset;
        let r = self.with_port(|p| {
            p.rx_burst_stamped(burst, &mut |frame, stamp| {
                let arrived = stamp.map_or(now, |s| {
                    let offset = match real_offset {
                        Some((offset, at)) if now - at < REAL_OFFSET_FOR => offset,
                        _ => {
                            let offset = lanbus_port::realtime_ns().wrapping_sub(now.as_nanos());
                            real_offset = Some((offset, now));
                            offset
                        }
                    };
                    arrival(now, now.as_nanos().wrapping_add(offset), s)
                });
                on_frame(arrived, frame)
            })
        });
        self.real_offset = real_offset;
        self.count_port_result(r)
    }

    fn tx_burst(&mut self, fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> usize {
        let burst = self.burst;
        let r = self.with_port(|p| p.tx_burst(burst, fill));
        self.count_port_result(r)
    }

    /// Sends one burst of the transport's frames; returns how many it wrote. A port that
    /// borrows frames gets them where the transport keeps them (ACKs in its own buffers); any
    /// other port gets them copied into its buffers.
    fn transmit(&mut self, from: &mut impl Transmit, now: Instant) -> usize {
        if !self.borrows {
            return self.tx_burst(&mut |buf| from.poll_into(now, buf));
        }
        // Most turns have nothing to send, and most that send (small messages) send one frame:
        // neither fills an array.
        let Some(first) = from.poll_ref(now) else { return 0 };
        let second = if self.burst > 1 { from.poll_ref(now) } else { None };
        let Some(second) = second else {
            let r = self.with_port(|p| p.tx_borrowed_parts(&[from.frame(first)]));
            self.count_port_result(r);
            return 1;
        };
        let mut refs = [first; BORROWED_BURST];
        refs[1] = second;
        let mut n = 2;
        while n < self.burst.min(BORROWED_BURST) {
            let Some(at) = from.poll_ref(now) else { break };
            refs[n] = at;
            n += 1;
        }
        let mut frames: [[&[u8]; 2]; BORROWED_BURST] = [[&[], &[]]; BORROWED_BURST];
        for (frame, at) in frames.iter_mut().zip(&refs[..n]) {
            *frame = from.frame(*at);
        }
        let r = self.with_port(|p| p.tx_borrowed_parts(&frames[..n]));
        self.count_port_result(r);
        // Written, so gone for the transport whatever the port did: one it could not send is
        // lost as on a wire, and sent again.
        n
    }

    fn count_port_result(&mut self, r: lanbus_port::Result<usize>) -> usize {
        match r {
            Ok(n) => n,
            Err(e) => {
                if self.clock.now() - self.last_publish >= Duration::from_secs(1) {
                    tracing::warn!("port error (retrying): {e}");
                }
                0
            }
        }
    }

    /// Publishes port counters now and then; returns true when it is time to publish the
    /// thread's transport counters too: every millisecond, and with adaptive polling once when
    /// the thread goes idle. Never on every empty poll: reading a port's counters may be a system
    /// call (AF_XDP's XDP_STATISTICS), which a busy-polling loop would pay between every two
    /// frames.
    fn publish_due(&mut self, now: Instant, idle: bool) -> bool {
        if !idle {
            self.published_idle = false;
        }
        let going_idle = idle && !self.published_idle && self.polling != Polling::Busy;
        if !going_idle && now - self.last_publish < Duration::from_millis(1) {
            return false;
        }
        self.published_idle = idle;
        self.last_publish = now;
        let (counters, paths) = self.with_port(|p| (p.counters(), p.paths()));
        *lock(&self.shared.port_counters) = counters;
        if !paths.is_empty() {
            *lock(&self.shared.paths) = paths;
        }
        true
    }

    /// One empty poll of a busy-polling thread. It lets a runnable thread on this core have it
    /// now and then: with fewer free cores than spinning threads (a busy pair plus anything else
    /// on 2 cores) the peer this thread waits for (the other end of a ping-pong, the other
    /// pipeline thread) may be runnable on this very core, and a pure spin holds it off for a
    /// whole time slice. Not after every empty poll, though: sched_yield is a system call that,
    /// alone on a core, makes each poll several times longer (a frame that arrives waits for it
    /// to return), and under load hands the core to another task between every two frames (a
    /// busy echo server then spends much of its time in task switches). Yielding every couple of
    /// microseconds keeps both costs small.
    fn spin_or_yield(&mut self, now: Instant) {
        if now - self.last_yield < SPIN_YIELD_EVERY {
            core::hint::spin_loop();
        } else {
            std::thread::yield_now();
            self.last_yield = self.clock.now();
        }
    }

    /// Called after an iteration that began at `now` and did `work` units; blocks if the thread
    /// has been idle long enough, until a frame (when `watch_port`), a wake-up, or `deadline`.
    /// A busy poll reads no clock here: the iteration's own `now` is close enough to count spin
    /// time, and an empty poll is a few hundred nanoseconds.
    fn idle(
        &mut self,
        now: Instant,
        work: usize,
        deadline: Option<Instant>,
        watch_port: bool,
        waker: &Waker,
        parking: &mut dyn FnMut(),
    ) {
        if work > 0 {
            // Adaptive polling spins for `spin` after the work ended, not after it began (a long
            // burst must not use up the spin).
            self.last_work = if self.polling == Polling::Busy { now } else { self.clock.now() };
            return;
        }
        let spin = match self.polling {
            Polling::Busy => {
                self.spin_or_yield(now);
                return;
            }
            Polling::Adaptive { spin } => spin,
        };
        let now = self.clock.now();
        if now - self.last_work < spin {
            // Yield after every empty poll here (busy polling yields less often, see
            // `spin_or_yield`): an adaptive node may run more spinning threads than there are
            // cores (the pipeline's two per node), and the peer this thread waits for (the other
            // end of a ping-pong, the other pipeline thread) may be queued on this very core.
            // Yielding only every couple of microseconds here made the pipeline veth tests much
            // slower, and a pure spin made each round trip wait out the spin time.
            std::thread::yield_now();
            return;
        }
        let timeout = deadline.map(|d| d - now);
        if timeout == Some(Duration::ZERO) {
            return;
        }
        parking();
        match (watch_port, self.readiness_fd) {
            (true, Some(fd)) => {
                // A doorbell port rings only when asked; a waiting frame means no sleep.
                if self.with_port(|p| p.arm_readiness()) {
                    waker.wait(Some(fd), timeout);
                }
                self.with_port(|p| p.disarm_readiness());
            }
            (true, None) => {
                // The port has no descriptor: wait on it briefly so local sends are not delayed
                // by more than that.
                let cap = Duration::from_micros(200);
                let t = Some(timeout.map_or(cap, |t| t.min(cap)));
                let r = self.with_port(|p| p.wait(t));
                if let Err(e) = r {
                    tracing::warn!("port wait failed: {e}");
                    std::thread::sleep(cap);
                }
                waker.drain();
            }
            (false, _) => waker.wait(None, timeout),
        }
    }
}

/// One thread's run-to-completion state: the worker, the whole endpoint, the handler and what
/// waits for room in the transport.
struct Rtc {
    worker: Worker,
    endpoint: Endpoint,
    handler: Box<dyn Handler>,
    backlog: VecDeque<Outgoing>,
    /// Whether the transport refused part of the shared queue last time.
    left_queued: bool,
    /// The earliest timer as computed at the end of the previous turn, for both the wait and the
    /// next turn's timer check: what changes the timers in between (frames, sends, ACKs) only
    /// arms them later than now, so nothing due is missed, and a received frame does not wait
    /// for a second walk over the channels before its answer goes out. The pipeline threads do
    /// the same.
    deadline: Option<Instant>,
}

impl Rtc {
    fn new(worker: Worker, endpoint: Endpoint, handler: Box<dyn Handler>) -> Rtc {
        let deadline = endpoint.poll_timeout();
        Rtc { worker, endpoint, handler, backlog: VecDeque::new(), left_queued: false, deadline }
    }

    fn run(&mut self) {
        let shared = self.worker.shared.clone();
        while !self.worker.stopping() {
            let (now, work) = self.turn();
            let handler = &mut self.handler;
            self.worker.idle(now, work, self.deadline, true, &shared.tx_waker, &mut || handler.parking());
        }
        *lock(&shared.tx_counters) = self.endpoint.counters();
    }

    /// One turn: receive a burst, serve due timers, deliver, let the handler poll, queue what
    /// other threads asked to send, transmit. Returns when it began and the work done.
    fn turn(&mut self) -> (Instant, usize) {
        let Rtc { worker, endpoint, handler, backlog, left_queued, deadline } = self;
        let shared = worker.shared.clone();
        let now = worker.clock.now();
        let queued_before = endpoint.messages_queued();
        // Messages go to the handler straight from the port's buffer where order allows.
        let mut work = worker.rx_burst(now, &mut |arrived, frame| {
            endpoint.handle_frame_delivering_at(now, arrived, frame, &mut |m, tx| {
                handler.on_message(m, &mut Direct { tx, backlog: &mut *backlog, now });
            });
        });
        worker.failed_peers(&mut |peer| endpoint.resend_in_flight(peer));
        let timed_out = deadline.is_some_and(|t| t <= now);
        if timed_out {
            endpoint.handle_timeout(now);
        }
        work += deliver_rtc(endpoint, &mut **handler, backlog, now);
        work += handler.poll(&mut Direct { tx: endpoint.send_half_mut(), backlog: &mut *backlog, now });
        // Acquire pairs with `posted_work`; a queue the transport left messages in is looked
        // at again whatever the flag says.
        // Loaded before it is swapped: most turns find it clear, and a load costs no locked
        // instruction.
        let posted = (shared.posted.load(Ordering::Relaxed) && shared.posted.swap(false, Ordering::Acquire))
            || *left_queued;
        if posted {
            let requests: Vec<Control> = lock(&shared.control_tx).drain(..).collect();
            for c in requests {
                match c {
                    Control::SetGroup(g) => endpoint.set_group(g, now),
                }
            }
        }
        let (fed, left) = feed(backlog, &shared, posted, |o| o.send_to(endpoint.send_half_mut(), now));
        work += fed;
        *left_queued = left;
        // Frames are stamped when they are written, not when this turn began: the turn's
        // receiving and handling came first, and a stale stamp would count them as the
        // fabric's delay (rate control reads it) and shorten the hold an ACK reports. A turn
        // that did nothing yet is a few dozen nanoseconds old: its start will do (a clock read
        // is a good part of an empty turn, whose length is how late a frame is seen), and so
        // will it for a turn with nothing to send (the one that takes a message, mostly).
        let sent_at = if work == 0 || !endpoint.may_transmit(now) { now } else { worker.clock.now() };
        let sent = worker.transmit(endpoint, sent_at);
        if sent > 0 {
            endpoint.frames_left(worker.clock.now());
        }
        work += sent;
        let idle = endpoint.is_idle() && backlog.is_empty();
        if worker.publish_due(now, work == 0) {
            *lock(&shared.tx_counters) = endpoint.counters();
        }
        // Release pairs with the Acquire in `wait_idle`. Stored only when it changes: other
        // threads read the line, and a turn that stores into it every time takes it from them.
        if shared.idle.load(Ordering::Relaxed) != idle {
            shared.idle.store(idle, Ordering::Release);
        }
        // A turn that received, sent, queued and fired nothing left every timer as it was (a
        // handler that queued a message but counted no work is caught by the transport's count).
        if work > 0 || timed_out || posted || endpoint.messages_queued() != queued_before {
            *deadline = endpoint.poll_timeout();
        }
        (now, work)
    }
}

/// The most frames one burst hands a port that borrows them.
const BORROWED_BURST: usize = 32;

/// What a runtime thread transmits from: a whole endpoint or a pipeline's sending half.
trait Transmit {
    /// The next frame, copied into `buf`.
    fn poll_into(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize>;
    /// The next frame, written where it lies.
    fn poll_ref(&mut self, now: Instant) -> Option<FrameRef>;
    /// A frame `poll_ref` wrote, in two pieces (see [`SendHalf::frame`]).
    fn frame(&self, at: FrameRef) -> [&[u8]; 2];
}

impl Transmit for Endpoint {
    fn poll_into(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        self.poll_transmit(now, buf)
    }
    fn poll_ref(&mut self, now: Instant) -> Option<FrameRef> {
        self.poll_transmit_ref(now)
    }
    fn frame(&self, at: FrameRef) -> [&[u8]; 2] {
        Endpoint::frame(self, at)
    }
}

impl Transmit for SendHalf {
    fn poll_into(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        self.poll_transmit(now, buf)
    }
    fn poll_ref(&mut self, now: Instant) -> Option<FrameRef> {
        self.poll_transmit_ref(now)
    }
    fn frame(&self, at: FrameRef) -> [&[u8]; 2] {
        SendHalf::frame(self, at)
    }
}

/// Caller mode's helper thread: at each look (see [`LapseSchedule`]), if the user ran no turn for
/// [`CALLER_LAPSE`], runs turns until there is no work left.
fn serve_lapses(rtc: &Mutex<Rtc>, last: &AtomicU64, shared: &Shared, clock: MonotonicClock) {
    let mut schedule = LapseSchedule::new();
    while !shared.stop.load(Ordering::Acquire) {
        // Parked, not asleep: stopping the runtime unparks it (an early return only looks early).
        std::thread::park_timeout(schedule.sleep);
        if shared.stop.load(Ordering::Acquire) {
            break;
        }
        let idle_for = clock.now().as_nanos().saturating_sub(last.load(Ordering::Relaxed));
        let user_polled = idle_for < CALLER_LAPSE.as_nanos() as u64;
        schedule.after_look(user_polled);
        if user_polled {
            continue;
        }
        let mut rtc = lock(rtc);
        loop {
            let (now, work) = rtc.turn();
            last.store(now.as_nanos(), Ordering::Relaxed);
            if work == 0 || shared.stop.load(Ordering::Acquire) {
                break;
            }
        }
    }
    let rtc = lock(rtc);
    *lock(&shared.tx_counters) = rtc.endpoint.counters();
}

/// Drains delivered messages and events into the handler (run-to-completion mode), whose replies
/// go straight into the endpoint or, when its queue is full, into `backlog`.
fn deliver_rtc(
    endpoint: &mut Endpoint,
    handler: &mut dyn Handler,
    backlog: &mut VecDeque<Outgoing>,
    now: Instant,
) -> usize {
    let mut n = 0;
    while let Some((m, tx)) = endpoint.poll_message_with_sender() {
        handler.on_message(m, &mut Direct { tx, backlog: &mut *backlog, now });
        n += 1;
    }
    while let Some(ev) = endpoint.poll_event() {
        handler.on_event(&ev, &mut Direct { tx: endpoint.send_half_mut(), backlog: &mut *backlog, now });
        n += 1;
    }
    n
}

/// The run-to-completion handler's outbox: replies go into the sending half at once, behind
/// whatever already waits in the backlog (order is kept), and into the backlog when the
/// transport's queue is full.
struct Direct<'a> {
    tx: &'a mut SendHalf,
    backlog: &'a mut VecDeque<Outgoing>,
    now: Instant,
}

impl Outbox for Direct<'_> {
    fn send(&mut self, peer: MacAddr, channel: u16, data: &[u8]) {
        if !self.backlog.is_empty() || self.tx.send(self.now, peer, channel, data).is_err() {
            self.backlog.push_back(Outgoing { peer, channel, data: data.to_vec().into() });
        }
    }

    fn send_parts(&mut self, peer: MacAddr, channel: u16, parts: &[&[u8]]) {
        if !self.try_send_parts(peer, channel, parts) {
            self.backlog.push_back(Outgoing { peer, channel, data: parts.concat().into() });
        }
    }

    fn send_from(&mut self, peer: MacAddr, channel: u16, data: &mut dyn MessageSource) {
        let queued = self.backlog.is_empty()
            && match self.tx.send_from(self.now, peer, channel, data) {
                Ok(()) => true,
                Err(SendError::QueueFull) => false,
                Err(e) => {
                    tracing::warn!("dropping a message for {peer} on channel {channel}: {e}");
                    true
                }
            };
        if !queued {
            // Refused whole: `data` was not read, it goes to the backlog as bytes.
            let mut v = Vec::with_capacity(data.len());
            let n = data.len();
            data.append_to(&mut v, 0, n);
            self.backlog.push_back(Outgoing { peer, channel, data: v.into() });
        }
    }

    fn abandon(&mut self, peer: MacAddr) {
        self.tx.abandon_peer(peer);
        self.backlog.retain(|o| o.peer != peer);
    }

    fn try_send_lent(&mut self, peer: MacAddr, channel: u16, head: &[u8], body: LentSlice) -> bool {
        if !self.backlog.is_empty() {
            return false;
        }
        match self.tx.send_lent(self.now, peer, channel, head, body) {
            Ok(()) => true,
            Err(SendError::QueueFull) => false,
            Err(e) => {
                tracing::warn!("dropping a message for {peer} on channel {channel}: {e}");
                true
            }
        }
    }

    fn try_send_parts(&mut self, peer: MacAddr, channel: u16, parts: &[&[u8]]) -> bool {
        if !self.backlog.is_empty() {
            return false;
        }
        match self.tx.send_parts(self.now, peer, channel, parts) {
            Ok(()) => true,
            Err(SendError::QueueFull) => false,
            // Never fits (too large, not unicast): the backlog would refuse it for ever too.
            Err(e) => {
                tracing::warn!("dropping a message for {peer} on channel {channel}: {e}");
                true
            }
        }
    }
}

/// Moves queued messages into the transport in order while it accepts them: first the thread's
/// own backlog, then (when `look_shared`) the shared queue. Returns how many went in, and whether
/// messages the transport refused are left in the shared queue.
fn feed(
    backlog: &mut VecDeque<Outgoing>,
    shared: &Shared,
    look_shared: bool,
    mut send: impl FnMut(&Outgoing) -> bool,
) -> (usize, bool) {
    let mut n = 0;
    while let Some(o) = backlog.front() {
        if !send(o) {
            // The shared queue waits behind the backlog: look at it again next time.
            return (n, look_shared);
        }
        backlog.pop_front();
        n += 1;
    }
    if !look_shared {
        return (n, false);
    }
    let mut queue = lock(&shared.outgoing);
    while let Some(o) = queue.front() {
        if !send(o) {
            // Keep the rest where it is, in order.
            return (n, true);
        }
        queue.pop_front();
        n += 1;
    }
    (n, false)
}

/// The pipeline's sending thread.
struct PipeTx {
    worker: Worker,
    half: SendHalf,
}

impl PipeTx {
    fn run(&mut self) {
        let shared = self.worker.shared.clone();
        let mut backlog: VecDeque<Outgoing> = VecDeque::new();
        let mut feedback: Vec<Feedback> = Vec::new();
        let mut deadline = self.half.poll_timeout();
        while !self.worker.stopping() {
            let now = self.worker.clock.now();
            feedback.extend(lock(&shared.feedback).drain(..));
            let mut work = feedback.len();
            for f in feedback.drain(..) {
                self.half.handle_feedback(now, f);
            }
            let requests: Vec<Control> = lock(&shared.control_tx).drain(..).collect();
            for c in requests {
                match c {
                    Control::SetGroup(g) => self.half.set_group(g, now),
                }
            }
            let half = &mut self.half;
            self.worker.failed_peers(&mut |peer| half.resend_in_flight(peer));
            if deadline.is_some_and(|t| t <= now) {
                self.half.handle_timeout(now);
            }
            let half = &mut self.half;
            work += feed(&mut backlog, &shared, true, |o| o.send_to(half, now)).0;
            let half = &mut self.half;
            // Stamped when written, as in the run-to-completion loop.
            let sent_at = self.worker.clock.now();
            let sent = self.worker.transmit(half, sent_at);
            if sent > 0 {
                self.half.frames_left(self.worker.clock.now());
            }
            work += sent;
            let idle = self.half.is_idle() && backlog.is_empty();
            if self.worker.publish_due(now, work == 0) {
                *lock(&shared.tx_counters) = self.half.counters();
            }
            shared.idle.store(idle, Ordering::Release);
            deadline = self.half.poll_timeout();
            self.worker.idle(now, work, deadline, false, &shared.tx_waker, &mut || {});
        }
        *lock(&shared.tx_counters) = self.half.counters();
    }
}

/// The pipeline's receiving thread; the handler runs here.
struct PipeRx {
    worker: Worker,
    half: ReceiveHalf,
    handler: Box<dyn Handler>,
}

/// One reply collected by [`Replies`]: its bytes are `bytes[start..start + len]`.
struct Reply {
    peer: MacAddr,
    channel: u16,
    start: usize,
    len: usize,
}

/// Pipeline mode: the handler's replies of one burst, collected in one byte arena reused from
/// burst to burst (a reply costs no allocation once the arena has grown) and handed to the TX
/// thread together by [`Shared::push_replies`].
#[derive(Default)]
struct Replies {
    bytes: Vec<u8>,
    items: Vec<Reply>,
}

impl Replies {
    fn clear(&mut self) {
        self.bytes.clear();
        self.items.clear();
    }
}

impl Outbox for Replies {
    fn send(&mut self, peer: MacAddr, channel: u16, data: &[u8]) {
        self.send_parts(peer, channel, &[data]);
    }

    fn send_parts(&mut self, peer: MacAddr, channel: u16, parts: &[&[u8]]) {
        let start = self.bytes.len();
        for p in parts {
            self.bytes.extend_from_slice(p);
        }
        self.items.push(Reply { peer, channel, start, len: self.bytes.len() - start });
    }
}

impl Shared {
    /// Pipeline mode: moves the handler's replies of one burst to the TX thread's queue under one
    /// lock, with one wake-up.
    fn push_replies(&self, replies: &mut Replies) {
        if replies.items.is_empty() {
            return;
        }
        let mut q = lock(&self.outgoing);
        for r in &replies.items {
            let data = replies.bytes[r.start..r.start + r.len].to_vec();
            q.push_back(Outgoing { peer: r.peer, channel: r.channel, data: data.into() });
        }
        drop(q);
        replies.clear();
        self.posted_work();
    }
}

impl PipeRx {
    fn run(&mut self) {
        let shared = self.worker.shared.clone();
        // The handler's replies of one burst, handed to the TX thread together.
        let mut out = Replies::default();
        let mut deadline = self.half.poll_timeout();
        while !self.worker.stopping() {
            let now = self.worker.clock.now();
            let half = &mut self.half;
            let mut work =
                self.worker.rx_burst(now, &mut |arrived, frame| half.handle_frame_at(now, arrived, frame));
            let requests: Vec<Control> = lock(&shared.control_rx).drain(..).collect();
            for c in requests {
                // The TX thread gets the same request in its own queue.
                match c {
                    Control::SetGroup(g) => self.half.set_group(g),
                }
            }
            if deadline.is_some_and(|t| t <= now) {
                self.half.handle_timeout(now);
            }
            let mut fed = false;
            if let Some(first) = self.half.poll_feedback() {
                // One lock for the whole batch (an owed ACK per DATA frame makes it long).
                let mut queue = lock(&shared.feedback);
                queue.push_back(first);
                while let Some(f) = self.half.poll_feedback() {
                    queue.push_back(f);
                }
                fed = true;
            }
            if fed {
                shared.tx_waker.wake();
                work += 1;
            }
            while let Some(m) = self.half.poll_message() {
                self.handler.on_message(m, &mut out);
                work += 1;
            }
            while let Some(ev) = self.half.poll_event() {
                self.handler.on_event(&ev, &mut out);
                work += 1;
            }
            work += self.handler.poll(&mut out);
            shared.push_replies(&mut out);
            if self.worker.publish_due(now, work == 0) {
                *lock(&shared.rx_counters) = self.half.counters();
            }
            deadline = self.half.poll_timeout();
            let handler = &mut self.handler;
            self.worker.idle(now, work, deadline, true, &shared.rx_waker, &mut || handler.parking());
        }
        *lock(&shared.rx_counters) = self.half.counters();
    }
}

#[cfg(test)]
mod tests;
