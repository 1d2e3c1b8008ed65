//! Messaging on a node that owns its port (direct mode): one messaging engine over a runtime.
//!
//! The engine ([`lanbus_msg::Engine`]) is sans-IO; here the runtime's handler feeds it the
//! records of [`MSG_CHANNEL`] and sends what it produces, while user threads start sends and
//! receives and wait for them. Every record the engine produces goes out from the handler's
//! thread (a user call wakes it), so records leave in the order the engine made them. A peer
//! that goes down or restarts fails the requests that need it.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use lanbus_msg::{
    Addr, Claim, Config, Engine, Match, Out, Outcome, RecvBuf, RequestId, RequestMap, SendBuf, Status,
    MSG_CHANNEL,
};
use lanbus_port::Port;
use lanbus_runtime::{Handler, Outbox, Runtime, RuntimeConfig, Sender};
use lanbus_transport::{Event, Message};

/// Why a messaging call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MsgError {
    /// The request did not finish in time (it stays under way).
    #[error("request {0:?} did not finish within {1:?}")]
    Timeout(RequestId, Duration),
    /// The request failed (its peer went down or restarted).
    #[error("request {id:?} failed: {why:?}")]
    Failed {
        /// The request.
        id: RequestId,
        /// Why.
        why: lanbus_msg::Failure,
    },
    /// A receive was cancelled.
    #[error("request {0:?} was cancelled")]
    Cancelled(RequestId),
    /// The runtime could not start.
    #[error("starting the node's runtime: {0}")]
    Start(std::io::Error),
    /// Attaching to a messaging daemon failed; the message says why.
    #[error("attaching to the messaging daemon at {0}")]
    Attach(String),
    /// The messaging daemon went away: nothing more can be sent or received through it.
    #[error("the messaging daemon went away")]
    DaemonGone,
}

struct Shared {
    engine: Mutex<Engine>,
    finished: Mutex<RequestMap<Outcome>>,
    done: Condvar,
    /// Threads asleep on `done` (changed under `finished`'s lock): a wake-up is a system call,
    /// which a busy-polling user would otherwise pay for every message.
    sleepers: AtomicUsize,
    /// The engine holds records no flush has handed to the transport yet (written under the
    /// engine's lock): a turn with nothing to send then takes no lock.
    unsent: AtomicBool,
    /// `finished` holds requests (written under its lock): a poll that finds none takes no
    /// lock.
    any_finished: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// Moves the engine's finished requests where waiters find them.
    fn settle(&self, engine: &mut Engine) {
        if !engine.has_completions() {
            return;
        }
        let mut any = false;
        let mut finished = lock(&self.finished);
        while let Some(c) = engine.poll_completion() {
            finished.insert(c.id, c.outcome);
            any = true;
        }
        if any {
            // Release pairs with the Acquire in `take_finished_into`.
            self.any_finished.store(true, Ordering::Release);
        }
        // Read under the lock: a waiter counts itself before it releases the lock to sleep.
        let sleepers = self.sleepers.load(Ordering::Relaxed);
        drop(finished);
        if any && sleepers > 0 {
            self.done.notify_all();
        }
    }

    /// Sends what the engine has while the transport has room (a rendezvous message's DATA is
    /// lent to the transport, whose frames read it from the sender's memory where the outbox
    /// can, and copied once into them where it cannot) and settles what finished; returns the
    /// records sent.
    fn flush(&self, out: &mut dyn Outbox) -> usize {
        self.flush_locked(&mut lock(&self.engine), out)
    }

    /// [`Shared::flush`] with the engine's lock held.
    fn flush_locked(&self, engine: &mut Engine, out: &mut dyn Outbox) -> usize {
        let n = engine.transmit_lending(&mut |dest, record| match record {
            Out::Parts(parts) => out.try_send_parts(dest, MSG_CHANNEL, parts),
            Out::Lent(head, body) => out.try_send_lent(dest, MSG_CHANNEL, head, body),
        });
        self.settle(engine);
        // Sends whose memory is lent complete on a later flush: keep the turns coming.
        self.unsent.store(engine.has_records() || engine.has_lent(), Ordering::Relaxed);
        n
    }
}

struct MsgHandler {
    shared: Arc<Shared>,
}

impl Handler for MsgHandler {
    fn on_message(&mut self, message: Message<'_>, out: &mut dyn Outbox) {
        if message.channel != MSG_CHANNEL {
            return;
        }
        let mut engine = lock(&self.shared.engine);
        engine.handle_message(message.peer, message.data);
        self.shared.flush_locked(&mut engine, out);
    }

    fn on_event(&mut self, event: &Event, out: &mut dyn Outbox) {
        match event {
            Event::PeerDown { peer } | Event::PeerRestarted { peer, .. } => {
                let mut engine = lock(&self.shared.engine);
                engine.peer_down(*peer);
                // What is queued for it would be sent for ever, and may read memory lent by
                // sends that can complete (failed) only once it is let go.
                out.abandon(*peer);
                self.shared.flush_locked(&mut engine, out);
            }
            _ => {}
        }
    }

    fn poll(&mut self, out: &mut dyn Outbox) -> usize {
        // Acquire pairs with the Release in `with_engine`; a user call rings the handler after
        // it, so a record made meanwhile is seen on the next turn.
        if !self.shared.unsent.load(Ordering::Acquire) {
            return 0;
        }
        self.shared.flush(out)
    }
}

/// How long a caller-mode wait polls before it gives its core away for a moment (as the
/// libfabric provider's empty completion-queue reads do).
const CALLER_YIELD_EVERY: Duration = Duration::from_micros(200);

/// A messaging endpoint that owns its port.
pub struct MsgNode {
    shared: Arc<Shared>,
    sender: Sender,
    addr: Addr,
    runtime: Option<Runtime>,
    /// How long [`MsgNode::wait`] polls (yielding its core) before it sleeps.
    spin: Duration,
}

impl MsgNode {
    /// Starts the node on `port` with engine id `id`.
    pub fn start(
        port: Box<dyn Port>,
        id: u16,
        runtime: RuntimeConfig,
        mut cfg: Config,
    ) -> Result<MsgNode, MsgError> {
        let addr = Addr { mac: port.mac(), id };
        // A DATA record that fits one frame lands in the receive's memory straight from the
        // port's (a longer one is first reassembled in the transport's buffer): on 64 KB frames
        // a stream of 1 MiB messages went 20-25% faster with it, on 9 KB frames as fast.
        let mut transport = runtime.transport.clone();
        transport.mtu = transport.mtu.min(port.mtu());
        cfg.data_chunk = cfg
            .data_chunk
            .min(transport.max_single_frame_message().saturating_sub(lanbus_msg::wire::DATA_HEADER));
        let shared = Arc::new(Shared {
            engine: Mutex::new(Engine::new(addr, cfg)),
            finished: Mutex::new(RequestMap::default()),
            done: Condvar::new(),
            sleepers: AtomicUsize::new(0),
            unsent: AtomicBool::new(false),
            any_finished: AtomicBool::new(false),
        });
        let handler = MsgHandler { shared: shared.clone() };
        let runtime = Runtime::start(port, runtime, Box::new(handler)).map_err(MsgError::Start)?;
        let sender = runtime.sender();
        // Waiting threads spin only when a core is to spare: on two cores a spinning waiter
        // holds off the runtime's threads that would deliver what it waits for.
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let spin = if cpus >= 4 { Duration::from_micros(50) } else { Duration::ZERO };
        Ok(MsgNode { shared, sender, addr, runtime: Some(runtime), spin })
    }

    /// This endpoint's address.
    pub fn addr(&self) -> Addr {
        self.addr
    }

    /// Sets how long [`MsgNode::wait`] spins before sleeping (0: sleep at once).
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// Runs `f` on the engine, then has the handler send what it made.
    fn with_engine<T>(&self, f: impl FnOnce(&mut Engine) -> T) -> T {
        let mut engine = lock(&self.shared.engine);
        let r = f(&mut engine);
        self.shared.settle(&mut engine);
        if engine.has_records() {
            self.shared.unsent.store(true, Ordering::Release);
        }
        drop(engine);
        self.sender.wake_handler();
        r
    }

    /// Starts sending `data` to `dest` in `context` with `tag` (read until the send completes).
    pub fn isend(&self, dest: Addr, context: u32, tag: u64, data: impl SendBuf) -> RequestId {
        self.with_engine(|e| e.send(dest, context, tag, data))
    }

    /// Starts sending a copy of `data` (see [`Engine::send_copy`]): the caller's memory is its
    /// own again at return, and an eager message is copied once, straight into its record.
    pub fn isend_copy(&self, dest: Addr, context: u32, tag: u64, data: &[u8]) -> RequestId {
        self.with_engine(|e| e.send_copy(dest, context, tag, data))
    }

    /// Starts sending a copy of `data` whose completion nobody waits for (see
    /// [`Engine::send_copy_unreported`]): `None` when it went at once, else the rendezvous
    /// request.
    pub fn isend_copy_unreported(
        &self,
        dest: Addr,
        context: u32,
        tag: u64,
        data: &[u8],
    ) -> Option<RequestId> {
        self.with_engine(|e| e.send_copy_unreported(dest, context, tag, data))
    }

    /// Posts a receive of at most `capacity` bytes.
    pub fn irecv(&self, m: Match, capacity: usize) -> RequestId {
        self.with_engine(|e| e.post_recv(m, capacity))
    }

    /// Posts a receive into `buf` (see [`Engine::post_recv_into`]).
    pub fn irecv_into(&self, m: Match, buf: Box<dyn RecvBuf>) -> RequestId {
        self.with_engine(|e| e.post_recv_into(m, buf))
    }

    /// The first waiting message `m` takes, if any.
    pub fn probe(&self, m: Match) -> Option<Status> {
        lock(&self.shared.engine).probe(m)
    }

    /// Cancels a posted receive nothing matched yet.
    pub fn cancel(&self, id: RequestId) -> bool {
        self.with_engine(|e| e.cancel(id))
    }

    /// Takes the first waiting message `m` takes out of matching (MPI_Mprobe).
    pub fn claim(&self, m: Match) -> Option<(Claim, Status)> {
        self.with_engine(|e| e.claim(m))
    }

    /// Receives a claimed message into at most `capacity` bytes (MPI_Mrecv).
    pub fn recv_claimed(&self, claim: Claim, capacity: usize) -> Option<RequestId> {
        self.with_engine(|e| e.recv_claimed(claim, capacity))
    }

    /// Runs one turn of the node's runtime on this thread when it runs in
    /// [`lanbus_runtime::ThreadMode::Caller`] (messages move while the caller polls); returns
    /// the work done (0 in the other modes, whose threads move them).
    pub fn poll(&self) -> usize {
        self.runtime.as_ref().map_or(0, Runtime::poll)
    }

    /// Every finished request not yet waited for or taken, in no particular order.
    pub fn take_finished(&self) -> Vec<(RequestId, Outcome)> {
        let mut out = Vec::new();
        self.take_finished_into(&mut out);
        out
    }

    /// Appends every finished request not yet waited for or taken to `out` (a caller that
    /// polls reuses one vector: no allocation per poll).
    pub fn take_finished_into(&self, out: &mut Vec<(RequestId, Outcome)>) {
        if !self.shared.any_finished.load(Ordering::Acquire) {
            return;
        }
        let mut finished = lock(&self.shared.finished);
        out.extend(finished.drain());
        self.shared.any_finished.store(false, Ordering::Relaxed);
    }

    /// The outcome of request `id` if it finished (taken: a second call says `None`).
    pub fn test(&self, id: RequestId) -> Option<Outcome> {
        lock(&self.shared.finished).remove(&id)
    }

    /// Waits until request `id` finishes, at most `timeout`. In caller mode the waiting thread
    /// moves the messages itself (turn after turn, giving its core away now and then).
    pub fn wait(&self, id: RequestId, timeout: Duration) -> Result<Outcome, MsgError> {
        let start = Instant::now();
        if self.runtime.as_ref().is_some_and(Runtime::is_caller) {
            let mut last_yield = start;
            let mut turn = 0u32;
            loop {
                turn = turn.wrapping_add(1);
                let work = self.poll();
                if let Some(o) = self.test(id) {
                    return check(id, o);
                }
                // The clock now and then: read on every turn it would be a good part of one.
                if !turn.is_multiple_of(32) {
                    continue;
                }
                let now = Instant::now();
                if now - start >= timeout {
                    return Err(MsgError::Timeout(id, timeout));
                }
                if work == 0 && now - last_yield >= CALLER_YIELD_EVERY {
                    last_yield = now;
                    std::thread::yield_now();
                }
            }
        }
        while start.elapsed() < self.spin {
            if let Some(o) = self.test(id) {
                return check(id, o);
            }
            std::thread::yield_now();
        }
        let mut finished = lock(&self.shared.finished);
        loop {
            if let Some(o) = finished.remove(&id) {
                return check(id, o);
            }
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(MsgError::Timeout(id, timeout));
            }
            self.shared.sleepers.fetch_add(1, Ordering::Relaxed);
            finished = self.shared.done.wait_timeout(finished, left).unwrap_or_else(|p| p.into_inner()).0;
            self.shared.sleepers.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Sends and waits until the data is handed on.
    pub fn send(
        &self,
        dest: Addr,
        context: u32,
        tag: u64,
        data: Vec<u8>,
        timeout: Duration,
    ) -> Result<(), MsgError> {
        let id = self.isend(dest, context, tag, data);
        self.wait(id, timeout).map(|_| ())
    }

    /// Receives the next message `m` takes (at most `capacity` bytes); returns its status, its
    /// bytes and whether it was truncated.
    pub fn recv(
        &self,
        m: Match,
        capacity: usize,
        timeout: Duration,
    ) -> Result<(Status, Vec<u8>, bool), MsgError> {
        let id = self.irecv(m, capacity);
        match self.wait(id, timeout)? {
            Outcome::Received { status, data, truncated, .. } => Ok((status, data, truncated)),
            // `wait` turns Failed and Cancelled into errors; the engine never ends a receive Sent.
            other => unreachable!("a receive ends received, failed or cancelled, not {other:?}"),
        }
    }

    /// The engine's counters.
    pub fn counters(&self) -> lanbus_msg::Counters {
        lock(&self.shared.engine).counters()
    }

    /// The runtime's counters.
    pub fn runtime_stats(&self) -> lanbus_runtime::Stats {
        self.runtime.as_ref().map(Runtime::stats).unwrap_or_default()
    }
}

fn check(id: RequestId, o: Outcome) -> Result<Outcome, MsgError> {
    match o {
        Outcome::Failed(why) => Err(MsgError::Failed { id, why }),
        Outcome::Cancelled => Err(MsgError::Cancelled(id)),
        o => Ok(o),
    }
}

impl Drop for MsgNode {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            // Let what was sent reach the peer before the threads stop.
            rt.wait_idle(Duration::from_secs(2));
            rt.shutdown();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lanbus_msg::Source;

    fn pair() -> (MsgNode, MsgNode) {
        let (a, b) = crate::fabric::SimFabric::sim_ports(0.01, 5).unwrap();
        let rc =
            RuntimeConfig { transport: lanbus_transport::Config::point_to_point(), ..Default::default() };
        let a = MsgNode::start(a, 1, rc.clone(), Config::default()).unwrap();
        let b = MsgNode::start(b, 1, rc, Config::default()).unwrap();
        (a, b)
    }

    #[test]
    fn ping_pong_eager_and_rendezvous_between_two_nodes() {
        let (a, b) = pair();
        let t = Duration::from_secs(10);
        let (aa, ba) = (a.addr(), b.addr());
        let echo = std::thread::spawn(move || {
            for _ in 0..4 {
                let (st, data, truncated) = b.recv(Match::any_tag(Source::Any, 0), 1 << 20, t).unwrap();
                assert!(!truncated);
                b.send(st.source, 0, st.tag + 1, data, t).unwrap();
            }
            b
        });
        for (i, len) in [0usize, 100, 16 << 10, 300 << 10].into_iter().enumerate() {
            let data: Vec<u8> = (0..len).map(|j| (j * 7 + i) as u8).collect();
            a.send(ba, 0, i as u64 * 10, data.clone(), t).unwrap();
            let (st, back, _) =
                a.recv(Match::exact(Source::Only(ba), 0, i as u64 * 10 + 1), 1 << 20, t).unwrap();
            assert_eq!((st.source, st.len as usize), (ba, len));
            assert!(back == data, "{len} bytes came back intact");
        }
        let b = echo.join().unwrap();
        assert_eq!(a.counters().rendezvous_sent, 1);
        assert_eq!(b.counters().received, 4);
        assert_eq!(aa.id, 1);
    }

    #[test]
    fn callers_threads_move_the_messages_they_wait_for() {
        let (a, b) = crate::fabric::SimFabric::sim_ports(0.01, 6).unwrap();
        let rc = RuntimeConfig {
            transport: lanbus_transport::Config::point_to_point(),
            threads: lanbus_runtime::ThreadMode::Caller,
            ..Default::default()
        };
        let a = MsgNode::start(a, 1, rc.clone(), Config::default()).unwrap();
        let b = MsgNode::start(b, 1, rc, Config::default()).unwrap();
        let (ba, t) = (b.addr(), Duration::from_secs(10));
        let echo = std::thread::spawn(move || {
            for _ in 0..40 {
                let (st, data, _) = b.recv(Match::any_tag(Source::Any, 0), 1 << 20, t).unwrap();
                b.send(st.source, 0, st.tag, data, t).unwrap();
            }
        });
        for i in 0..40u64 {
            let data: Vec<u8> = (0..(i as usize * 7919) % 200_000).map(|j| (j as u64 ^ i) as u8).collect();
            a.send(ba, 0, i, data.clone(), t).unwrap();
            let (_, back, _) = a.recv(Match::exact(Source::Only(ba), 0, i), 1 << 20, t).unwrap();
            assert!(back == data, "message {i} came back intact");
        }
        echo.join().unwrap();
        assert!(a.counters().rendezvous_sent > 0);
    }

    /// Over a keyed fabric, in both thread models: the handshake needs no heartbeats, and a
    /// node that has sent nothing yet answers it.
    #[test]
    fn messages_flow_over_a_keyed_fabric() {
        for (threads, udp) in [
            (lanbus_runtime::ThreadMode::Caller, true),
            (lanbus_runtime::ThreadMode::Caller, false),
            (lanbus_runtime::ThreadMode::RunToCompletion, false),
        ] {
            let (a, b) = if udp {
                let free = || std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
                let (pa, pb) = (free(), free());
                let open = |x: u16, y: u16| {
                    format!("udp:127.0.0.1:{x},peer=127.0.0.1:{y}")
                        .parse::<lanbus_port::PortSpec>()
                        .unwrap()
                        .open()
                        .unwrap()
                };
                (open(pa, pb), open(pb, pa))
            } else {
                crate::fabric::SimFabric::sim_ports(0.01, 7).unwrap()
            };
            let ring = lanbus_secure::KeyRing::new(lanbus_secure::FabricKey::generate(), []);
            let (ka, kb) = (
                crate::security::Keyed::in_memory(ring.clone(), true),
                crate::security::Keyed::in_memory(ring, true),
            );
            let rc = RuntimeConfig {
                transport: lanbus_transport::Config::point_to_point(),
                threads,
                ..Default::default()
            };
            let a = MsgNode::start(ka.wrap(a), 1, rc.clone(), Config::default()).unwrap();
            let b = MsgNode::start(kb.wrap(b), 1, rc, Config::default()).unwrap();
            let (ba, t) = (b.addr(), Duration::from_secs(10));
            let echo = std::thread::spawn(move || {
                for _ in 0..4 {
                    let (st, data, _) = b.recv(Match::any_tag(Source::Any, 0), 1 << 20, t).unwrap();
                    b.send(st.source, 0, st.tag, data, t).unwrap();
                }
            });
            for (i, len) in [10usize, 5000, 70_000, 300_000].into_iter().enumerate() {
                let data: Vec<u8> = (0..len).map(|j| (j * 3 + i) as u8).collect();
                a.send(ba, 0, i as u64, data.clone(), t).unwrap();
                let (_, back, _) = a.recv(Match::exact(Source::Only(ba), 0, i as u64), 1 << 20, t).unwrap();
                assert!(back == data, "{threads:?}: message {i} came back intact");
            }
            echo.join().unwrap();
        }
    }

    #[test]
    fn waits_time_out_and_cancelled_receives_say_so() {
        let (a, _b) = pair();
        let id = a.irecv(Match::any_tag(Source::Any, 0), 16);
        assert!(matches!(a.wait(id, Duration::from_millis(20)), Err(MsgError::Timeout(..))));
        assert!(a.cancel(id));
        assert!(matches!(a.wait(id, Duration::from_secs(1)), Err(MsgError::Cancelled(_))));
    }
}
