//! The engine: one endpoint's sends, receives, matching and rendezvous state.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use lanbus_wire::MacAddr;

use crate::wire::{Record, Route, DATA_HEADER, EAGER_HEADER};

/// An engine's address: its node's MAC and its id on that node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Addr {
    /// The node (the transport endpoint the records travel through).
    pub mac: MacAddr,
    /// The engine on that node.
    pub id: u16,
}

/// Settings of an engine.
#[derive(Debug, Clone)]
pub struct Config {
    /// Messages of at most this many bytes go eagerly (whole, at once); longer ones by
    /// rendezvous. At most [`Config::MAX_EAGER`].
    pub eager_limit: usize,
    /// Bytes of a rendezvous message per DATA record. At most [`Config::MAX_CHUNK`].
    pub data_chunk: usize,
}

impl Config {
    /// The largest eager message: one transport message holds the record.
    pub const MAX_EAGER: usize = lanbus_wire::frame::MAX_MESSAGE_LEN - EAGER_HEADER;
    /// The largest DATA chunk: one transport message holds the record.
    pub const MAX_CHUNK: usize = lanbus_wire::frame::MAX_MESSAGE_LEN - DATA_HEADER;
}

impl Default for Config {
    fn default() -> Self {
        // The MPI-over-DPDK paper finds eager ahead up to about 13 KB and rendezvous from about
        // 26 KB. Here, through Open MPI on the rank's own thread, eager stays ahead up to 32 KiB
        // (52.5 against 57.9 us at 32 KiB, MTU 1500; by 20% in the engine's own rows), and a
        // larger message cannot go eagerly in one transport message anyway (64 KiB).
        Config { eager_limit: 32 << 10, data_chunk: Config::MAX_CHUNK }
    }
}

/// How many buffers of records handed on an engine keeps for its next records.
const SPARE_RECORDS: usize = 8;

/// Memory a send reads its message from, lent to the engine until the send completes (a
/// rendezvous message goes out from it, a chunk at a time, once the receiver asks for it; with
/// [`Engine::transmit_lending`] the transport's frames read it too, until they are
/// acknowledged). `Vec<u8>` is one; a layer whose caller keeps ownership of the message
/// (libfabric's) lends the caller's memory instead of copying it. It is the transport's
/// [`Lend`](lanbus_transport::Lend): read only, from any thread, while lent.
pub use lanbus_transport::Lend as SendBuf;
use lanbus_transport::LentSlice;

/// Memory a receive's bytes land in, lent to the engine until the receive completes: what
/// arrives is written straight there (no buffer of the engine's own, no copy afterwards).
/// Its length is the receive's capacity.
pub trait RecvBuf: Send + 'static {
    /// The memory.
    fn bytes_mut(&mut self) -> &mut [u8];
}

/// The sources a receive takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Any sender (MPI_ANY_SOURCE).
    Any,
    /// Only this one.
    Only(Addr),
}

/// What a receive (or a probe) matches: a message from `source` in `context` (any context when
/// `None`: a layer that carries other data in the context field, such as libfabric's remote CQ
/// data, matches on the tag alone) whose tag equals `tag` in every bit that `ignore` leaves clear
/// (`ignore = !0`: any tag).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Match {
    /// Sender.
    pub source: Source,
    /// Context (an MPI communicator); `None`: any.
    pub context: Option<u32>,
    /// Tag.
    pub tag: u64,
    /// Tag bits that do not matter.
    pub ignore: u64,
}

impl Match {
    /// A message from `source` in `context` with exactly `tag`.
    pub fn exact(source: Source, context: u32, tag: u64) -> Match {
        Match { source, context: Some(context), tag, ignore: 0 }
    }

    /// Any tag from `source` in `context`.
    pub fn any_tag(source: Source, context: u32) -> Match {
        Match { source, context: Some(context), tag: 0, ignore: !0 }
    }

    fn takes(&self, from: Addr, context: u32, tag: u64) -> bool {
        let source_ok = match self.source {
            Source::Any => true,
            Source::Only(a) => a == from,
        };
        source_ok && self.context.is_none_or(|c| c == context) && (tag ^ self.tag) & !self.ignore == 0
    }
}

/// A send or receive, named when it is started and in its completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// A map keyed by request: an engine hands request ids out in sequence (nothing from outside
/// picks them), so they are hashed by one multiply ([`lanbus_wire::hash::IdHasher`]).
pub type RequestMap<V> = HashMap<RequestId, V, lanbus_wire::hash::BuildIdHasher>;

/// A message as matching sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status {
    /// Who sent it.
    pub source: Addr,
    /// Its context.
    pub context: u32,
    /// Its tag.
    pub tag: u64,
    /// Its length as sent.
    pub len: u64,
}

/// Why a request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The peer went down (its transport said so) before the request finished.
    PeerDown(MacAddr),
    /// The peer engine went away for good (its node said so) before the request finished.
    EndpointGone(Addr),
}

/// How a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The message left: its buffer is no longer needed.
    Sent,
    /// A message arrived. `data` holds at most the receive's capacity; `truncated` says the
    /// message was longer (`status.len` is its length as sent). A receive into lent memory
    /// ([`Engine::post_recv_into`]) has an empty `data`: its first `min(status.len, capacity)`
    /// bytes of that memory hold the message.
    Received {
        /// The message as matched.
        status: Status,
        /// Its bytes.
        data: Vec<u8>,
        /// Whether bytes past the capacity were dropped.
        truncated: bool,
        /// When the receive was matched, counting this engine's matches from 1. MPI's ordering
        /// rule is about this order: a rendezvous receive completes after its data, so eager
        /// receives matched after it may complete first.
        matched: u64,
    },
    /// A receive cancelled before anything matched it.
    Cancelled,
    /// The request cannot finish.
    Failed(Failure),
}

/// A finished request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The request.
    pub id: RequestId,
    /// How it ended.
    pub outcome: Outcome,
}

/// A record to hand to the transport: to node `dest`, on the messaging channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    /// The node.
    pub dest: MacAddr,
    /// The record.
    pub bytes: Vec<u8>,
}

/// A message taken out of the unexpected queue by [`Engine::claim`], to be received with
/// [`Engine::recv_claimed`] (MPI_Mprobe and MPI_Mrecv).
#[derive(Debug, PartialEq, Eq)]
pub struct Claim(u64);

/// What an engine counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Messages sent eagerly.
    pub eager_sent: u64,
    /// Messages sent by rendezvous.
    pub rendezvous_sent: u64,
    /// Messages received (completed receives).
    pub received: u64,
    /// Messages that arrived before a receive matched them.
    pub unexpected: u64,
    /// Receives whose message was longer than their capacity.
    pub truncated: u64,
    /// Records that did not parse (dropped).
    pub bad_records: u64,
    /// Records for another engine id (dropped).
    pub misrouted: u64,
    /// CTS or DATA records naming no request of this engine, or out of its bounds (dropped).
    pub stray: u64,
}

enum Arrival {
    Eager(Vec<u8>),
    Rts { len: u64, send_id: u32 },
}

/// An arrival as it comes off the wire: an eager message's bytes are copied only where they
/// end up (a receive's memory, or the unexpected queue).
enum Arriving<'a> {
    Eager(&'a [u8]),
    Rts { len: u64, send_id: u32 },
}

impl Arriving<'_> {
    fn owned(self) -> Arrival {
        match self {
            Arriving::Eager(d) => Arrival::Eager(d.to_vec()),
            Arriving::Rts { len, send_id } => Arrival::Rts { len, send_id },
        }
    }
}

/// Where a receive's bytes go.
enum Landing {
    /// A buffer of the engine's, handed over in the completion.
    Owned(usize),
    /// Memory lent by the caller.
    Lent(Box<dyn RecvBuf>),
}

impl Landing {
    fn capacity(&mut self) -> usize {
        match self {
            Landing::Owned(n) => *n,
            Landing::Lent(b) => b.bytes_mut().len(),
        }
    }
}

/// The bytes of a rendezvous receive under way.
enum Filling {
    Owned(Vec<u8>),
    Lent(Box<dyn RecvBuf>, usize),
}

impl Filling {
    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Filling::Owned(v) => v,
            Filling::Lent(b, n) => &mut b.bytes_mut()[..*n],
        }
    }

    fn len(&self) -> usize {
        match self {
            Filling::Owned(v) => v.len(),
            Filling::Lent(_, n) => *n,
        }
    }

    fn into_data(self) -> Vec<u8> {
        match self {
            Filling::Owned(v) => v,
            Filling::Lent(..) => Vec::new(),
        }
    }
}

struct Unexpected {
    from: Addr,
    context: u32,
    tag: u64,
    arrival: Arrival,
}

struct Posted {
    id: RequestId,
    m: Match,
    landing: Landing,
}

/// A rendezvous send waiting for its CTS.
struct Announced {
    id: RequestId,
    dest: Addr,
    data: Arc<dyn SendBuf>,
}

/// A rendezvous send whose DATA is going out.
struct Stream {
    id: RequestId,
    dest: Addr,
    data: Arc<dyn SendBuf>,
    recv_id: u32,
    granted: usize,
    offset: usize,
}

/// A rendezvous send waiting for the transport to let go of its memory.
struct Lending {
    id: RequestId,
    dest: Addr,
    data: Arc<dyn SendBuf>,
    outcome: Outcome,
}

/// A record [`Engine::transmit_lending`] hands on.
pub enum Out<'a> {
    /// A record in pieces, to send as one message (copied where it goes).
    Parts(&'a [&'a [u8]]),
    /// A DATA record: its header, then bytes of the message being sent, lent (the transport
    /// may read them where they are until it lets go of the slice).
    Lent(&'a [u8], LentSlice),
}

/// A rendezvous receive whose DATA is coming in.
struct Incoming {
    id: RequestId,
    matched: u64,
    status: Status,
    buf: Filling,
    got: usize,
}

/// One endpoint of tagged messaging (sans-IO). Records come in through
/// [`Engine::handle_message`] and go out through [`Engine::poll_transmit`]; finished requests
/// come out of [`Engine::poll_completion`]. The transport under it must deliver each node pair's
/// records reliably and in order (one lanbus channel does): that is what keeps MPI's rule that
/// messages from one sender matching one receive are received in the order they were sent.
pub struct Engine {
    me: Addr,
    cfg: Config,
    next_request: u64,
    next_wire_id: u32,
    posted: VecDeque<Posted>,
    unexpected: VecDeque<Unexpected>,
    /// Claimed messages; `Err(why)` when their rendezvous data can no longer come.
    claimed: HashMap<u64, Result<Unexpected, Failure>>,
    announced: HashMap<u32, Announced>,
    streams: VecDeque<Stream>,
    /// Rendezvous sends whose last DATA went out lent ([`Engine::transmit_lending`]): each
    /// completes, with the outcome kept here, once the transport has let go of its memory.
    lending: Vec<Lending>,
    incoming: HashMap<u32, Incoming>,
    control: VecDeque<Outgoing>,
    /// Buffers of records handed on, kept for the next ones (no allocation per message).
    spare: Vec<Vec<u8>>,
    /// Where each DATA record's header is written before it is handed on with its slice of
    /// the message (one frame's worth of bytes a record: kept, not allocated each time).
    data_head: Vec<u8>,
    done: VecDeque<Completion>,
    matches: u64,
    counters: Counters,
}

impl Engine {
    /// An engine at address `me`. Limits above the maximums are lowered to them.
    pub fn new(me: Addr, mut cfg: Config) -> Engine {
        cfg.eager_limit = cfg.eager_limit.min(Config::MAX_EAGER);
        cfg.data_chunk = cfg.data_chunk.clamp(1, Config::MAX_CHUNK);
        Engine {
            me,
            cfg,
            next_request: 0,
            next_wire_id: 0,
            posted: VecDeque::new(),
            unexpected: VecDeque::new(),
            claimed: HashMap::new(),
            announced: HashMap::new(),
            streams: VecDeque::new(),
            lending: Vec::new(),
            incoming: HashMap::new(),
            control: VecDeque::new(),
            spare: Vec::new(),
            data_head: Vec::with_capacity(DATA_HEADER),
            done: VecDeque::new(),
            matches: 0,
            counters: Counters::default(),
        }
    }

    /// This engine's address.
    pub fn addr(&self) -> Addr {
        self.me
    }

    /// A snapshot of the counters.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Messages waiting for a receive, and the bytes the eager ones hold.
    pub fn unexpected(&self) -> (usize, usize) {
        let bytes = self
            .unexpected
            .iter()
            .map(|u| match &u.arrival {
                Arrival::Eager(d) => d.len(),
                Arrival::Rts { .. } => 0,
            })
            .sum();
        (self.unexpected.len(), bytes)
    }

    fn request(&mut self) -> RequestId {
        self.next_request += 1;
        RequestId(self.next_request)
    }

    fn wire_id(&mut self) -> u32 {
        self.next_wire_id = self.next_wire_id.wrapping_add(1);
        self.next_wire_id
    }

    fn complete(&mut self, id: RequestId, outcome: Outcome) {
        self.done.push_back(Completion { id, outcome });
    }

    fn record(&mut self, dest: Addr, record: Record<'_>) {
        let mut bytes = self.spare.pop().unwrap_or_default();
        bytes.clear();
        record.emit(Route { src: self.me.id, dst: dest.id }, &mut bytes);
        self.control.push_back(Outgoing { dest: dest.mac, bytes });
    }

    /// Sends `data` to `dest` in `context` with `tag`. Completes with [`Outcome::Sent`] once
    /// the data is handed on (at once for an eager message or one to this engine itself; for
    /// rendezvous, once the receiver asked for it and the last DATA record went out, or with
    /// [`Engine::transmit_lending`] once the transport let go of the last): until then the
    /// engine (and the transport it lends `data` to) reads from `data`.
    pub fn send(&mut self, dest: Addr, context: u32, tag: u64, data: impl SendBuf) -> RequestId {
        if let Some(id) = self.send_eager(dest, context, tag, data.bytes()) {
            return id;
        }
        let id = self.request();
        self.counters.rendezvous_sent += 1;
        let send_id = self.wire_id();
        let len = data.bytes().len() as u64;
        self.record(dest, Record::Rts { context, tag, len, send_id });
        self.announced.insert(send_id, Announced { id, dest, data: Arc::new(data) });
        id
    }

    /// Sends a copy of `data`, as [`Engine::send`] does: an eager message (or one to this
    /// engine itself) is copied straight into its record, and only a rendezvous message, read
    /// after this call returns, takes a copy of its own.
    pub fn send_copy(&mut self, dest: Addr, context: u32, tag: u64, data: &[u8]) -> RequestId {
        if let Some(id) = self.send_eager(dest, context, tag, data) {
            return id;
        }
        self.send(dest, context, tag, data.to_vec())
    }

    /// Sends a copy of `data` whose completion nobody waits for (libfabric's inject): as
    /// [`Engine::send_copy`], but a message that goes at once (eagerly, or to this engine
    /// itself) reports no completion and returns `None`; a rendezvous message returns its
    /// request, which completes (or fails) as usual.
    pub fn send_copy_unreported(
        &mut self,
        dest: Addr,
        context: u32,
        tag: u64,
        data: &[u8],
    ) -> Option<RequestId> {
        if self.send_now(dest, context, tag, data) {
            return None;
        }
        Some(self.send(dest, context, tag, data.to_vec()))
    }

    /// Sends `data` at once, a finished request, if it goes eagerly or to this engine itself;
    /// `None` (nothing done) if it needs a rendezvous.
    fn send_eager(&mut self, dest: Addr, context: u32, tag: u64, data: &[u8]) -> Option<RequestId> {
        if !self.send_now(dest, context, tag, data) {
            return None;
        }
        let id = self.request();
        self.complete(id, Outcome::Sent);
        Some(id)
    }

    /// Sends `data` eagerly (or to this engine itself) and returns true, or returns false and
    /// does nothing if it needs a rendezvous.
    fn send_now(&mut self, dest: Addr, context: u32, tag: u64, data: &[u8]) -> bool {
        if dest != self.me && data.len() > self.cfg.eager_limit {
            return false;
        }
        self.counters.eager_sent += 1;
        if dest == self.me {
            self.arrive(self.me, context, tag, Arriving::Eager(data));
        } else {
            self.record(dest, Record::Eager { context, tag, data });
        }
        true
    }

    /// Posts a receive of at most `capacity` bytes for the first message `m` takes: one waiting
    /// already (oldest first), else the next to arrive.
    pub fn post_recv(&mut self, m: Match, capacity: usize) -> RequestId {
        self.post(m, Landing::Owned(capacity))
    }

    /// Posts a receive as [`Engine::post_recv`] does, into `buf` (its length is the capacity):
    /// the bytes land there as they arrive, and the engine keeps `buf` until the receive
    /// completes (or fails, or is cancelled), then drops it.
    pub fn post_recv_into(&mut self, m: Match, buf: Box<dyn RecvBuf>) -> RequestId {
        self.post(m, Landing::Lent(buf))
    }

    fn post(&mut self, m: Match, landing: Landing) -> RequestId {
        let id = self.request();
        match self.unexpected.iter().position(|u| m.takes(u.from, u.context, u.tag)) {
            Some(i) => {
                let u = self.unexpected.remove(i).expect("found");
                self.deliver(id, landing, u.from, u.context, u.tag, arriving(&u.arrival));
            }
            None => self.posted.push_back(Posted { id, m, landing }),
        }
        id
    }

    /// Cancels a posted receive that nothing matched yet (it completes with
    /// [`Outcome::Cancelled`]); false if it is not waiting (matched, finished or unknown).
    pub fn cancel(&mut self, id: RequestId) -> bool {
        match self.posted.iter().position(|p| p.id == id) {
            Some(i) => {
                self.posted.remove(i);
                self.complete(id, Outcome::Cancelled);
                true
            }
            None => false,
        }
    }

    /// The first waiting message `m` takes, if any (MPI_Iprobe); it stays waiting.
    pub fn probe(&self, m: Match) -> Option<Status> {
        self.unexpected.iter().find(|u| m.takes(u.from, u.context, u.tag)).map(status_of)
    }

    /// Takes the first waiting message `m` takes out of matching (MPI_Improbe): no receive
    /// matches it any more; [`Engine::recv_claimed`] receives it.
    pub fn claim(&mut self, m: Match) -> Option<(Claim, Status)> {
        let i = self.unexpected.iter().position(|u| m.takes(u.from, u.context, u.tag))?;
        let u = self.unexpected.remove(i).expect("found");
        let status = status_of(&u);
        self.next_request += 1;
        self.claimed.insert(self.next_request, Ok(u));
        Some((Claim(self.next_request), status))
    }

    /// Receives a claimed message into at most `capacity` bytes (MPI_Mrecv); `None` if the
    /// claim is not this engine's.
    pub fn recv_claimed(&mut self, claim: Claim, capacity: usize) -> Option<RequestId> {
        let claimed = self.claimed.remove(&claim.0)?;
        let id = self.request();
        match claimed {
            Ok(u) => {
                self.deliver(id, Landing::Owned(capacity), u.from, u.context, u.tag, arriving(&u.arrival))
            }
            Err(why) => self.complete(id, Outcome::Failed(why)),
        }
        Some(id)
    }

    /// A message arrived from `from` (or from this engine itself): to the first posted receive
    /// that takes it, else waiting (its bytes copied then, not before).
    fn arrive(&mut self, from: Addr, context: u32, tag: u64, arrival: Arriving<'_>) {
        match self.posted.iter().position(|p| p.m.takes(from, context, tag)) {
            Some(i) => {
                let p = self.posted.remove(i).expect("found");
                self.deliver(p.id, p.landing, from, context, tag, arrival);
            }
            None => {
                self.counters.unexpected += 1;
                self.unexpected.push_back(Unexpected { from, context, tag, arrival: arrival.owned() });
            }
        }
    }

    /// Receive `id` landing in `landing` takes a message from `from`.
    fn deliver(
        &mut self,
        id: RequestId,
        mut landing: Landing,
        from: Addr,
        context: u32,
        tag: u64,
        arrival: Arriving<'_>,
    ) {
        let len = match arrival {
            Arriving::Eager(d) => d.len() as u64,
            Arriving::Rts { len, .. } => len,
        };
        let status = Status { source: from, context, tag, len };
        self.matches += 1;
        let matched = self.matches;
        let capacity = landing.capacity();
        match arrival {
            Arriving::Eager(data) => {
                let n = data.len().min(capacity);
                let truncated = data.len() > capacity;
                let data = match landing {
                    Landing::Owned(_) => data[..n].to_vec(),
                    Landing::Lent(mut buf) => {
                        buf.bytes_mut()[..n].copy_from_slice(&data[..n]);
                        Vec::new()
                    }
                };
                self.received(id, status, data, truncated, matched);
            }
            Arriving::Rts { len, send_id } => {
                let granted = len.min(capacity as u64);
                let recv_id = self.wire_id();
                self.record(from, Record::Cts { send_id, recv_id, granted });
                if granted == 0 {
                    self.received(id, status, Vec::new(), len > 0, matched);
                } else {
                    let buf = match landing {
                        Landing::Owned(_) => Filling::Owned(vec![0; granted as usize]),
                        Landing::Lent(b) => Filling::Lent(b, granted as usize),
                    };
                    self.incoming.insert(recv_id, Incoming { id, matched, status, buf, got: 0 });
                }
            }
        }
    }

    fn received(&mut self, id: RequestId, status: Status, data: Vec<u8>, truncated: bool, matched: u64) {
        self.counters.received += 1;
        self.counters.truncated += u64::from(truncated);
        self.complete(id, Outcome::Received { status, data, truncated, matched });
    }

    /// Takes one record that arrived from node `from` (the transport's message on the messaging
    /// channel). Records that do not parse, are for another engine, or name no request of this
    /// one are counted and dropped.
    pub fn handle_message(&mut self, from: MacAddr, bytes: &[u8]) {
        let Ok((route, record)) = Record::parse(bytes) else {
            self.counters.bad_records += 1;
            return;
        };
        let from = Addr { mac: from, id: route.src };
        if record == Record::Gone && (route.dst == 0 || route.dst == self.me.id) {
            self.endpoint_gone(from);
            return;
        }
        if route.dst != self.me.id {
            self.counters.misrouted += 1;
            return;
        }
        match record {
            Record::Eager { context, tag, data } => self.arrive(from, context, tag, Arriving::Eager(data)),
            Record::Rts { context, tag, len, send_id } => {
                self.arrive(from, context, tag, Arriving::Rts { len, send_id })
            }
            Record::Cts { send_id, recv_id, granted } => {
                let fits = self
                    .announced
                    .get(&send_id)
                    .is_some_and(|a| a.dest == from && granted <= a.data.bytes().len() as u64);
                if !fits {
                    self.counters.stray += 1;
                    return;
                }
                let a = self.announced.remove(&send_id).expect("checked");
                if granted == 0 {
                    self.complete(a.id, Outcome::Sent);
                } else {
                    let s = Stream {
                        id: a.id,
                        dest: a.dest,
                        data: a.data,
                        recv_id,
                        granted: granted as usize,
                        offset: 0,
                    };
                    self.streams.push_back(s);
                }
            }
            Record::Data { recv_id, offset, data } => {
                let fits = self.incoming.get(&recv_id).is_some_and(|i| {
                    i.status.source == from
                        && offset.checked_add(data.len() as u64).is_some_and(|end| end <= i.buf.len() as u64)
                });
                if !fits {
                    self.counters.stray += 1;
                    return;
                }
                let i = self.incoming.get_mut(&recv_id).expect("checked");
                let at = offset as usize;
                i.buf.bytes_mut()[at..at + data.len()].copy_from_slice(data);
                i.got += data.len();
                if i.got >= i.buf.len() {
                    let i = self.incoming.remove(&recv_id).expect("there");
                    let truncated = i.status.len > i.buf.len() as u64;
                    self.received(i.id, i.status, i.buf.into_data(), truncated, i.matched);
                }
            }
            Record::Gone => unreachable!("handled above"),
        }
    }

    /// The next record to hand to the transport: control records (eager messages, RTS, CTS)
    /// first, in order, then DATA of the rendezvous sends under way, a chunk each in turn. If the
    /// transport cannot take it now, keep it and offer it again before anything else.
    pub fn poll_transmit(&mut self) -> Option<Outgoing> {
        let mut taken = None;
        self.transmit_one(false, &mut |dest, out| {
            let Out::Parts(parts) = out else { unreachable!("nothing is lent") };
            taken = Some(Outgoing { dest, bytes: parts.concat() });
            true
        });
        taken
    }

    /// Hands records to `out` in [`Engine::poll_transmit`]'s order until it refuses one or none
    /// is left; returns how many it took. `out` gets the destination node and the record in
    /// parts to send as one message: a DATA record is its header and a slice of the message
    /// being sent, so its bytes are copied only where `out` puts them. A refused record stays
    /// first in line.
    pub fn transmit(&mut self, out: &mut dyn FnMut(MacAddr, &[&[u8]]) -> bool) -> usize {
        let mut n = 0;
        let mut out = |dest, o: Out<'_>| {
            let Out::Parts(parts) = o else { unreachable!("nothing is lent") };
            out(dest, parts)
        };
        while self.transmit_one(false, &mut out) == Some(true) {
            n += 1;
        }
        n
    }

    /// As [`Engine::transmit`], but a DATA record's bytes are lent to `out` ([`Out::Lent`])
    /// rather than offered for copying, and a rendezvous send completes only once `out`'s side
    /// has let go of every slice of its message (the engine holds the last reference to it
    /// again); each call first completes the sends that are let go. The transport's frames then
    /// read the message where the sender keeps it: one copy of each byte fewer. While sends
    /// wait for that ([`Engine::has_lent`]), the caller calls this on every turn.
    pub fn transmit_lending(&mut self, out: &mut dyn FnMut(MacAddr, Out<'_>) -> bool) -> usize {
        self.reap_lent();
        let mut n = 0;
        while self.transmit_one(true, out) == Some(true) {
            n += 1;
        }
        n
    }

    /// Completes the sends whose memory nobody but the engine holds any more.
    fn reap_lent(&mut self) {
        let mut i = 0;
        while i < self.lending.len() {
            if Arc::strong_count(&self.lending[i].data) == 1 {
                let l = self.lending.swap_remove(i);
                self.complete(l.id, l.outcome);
            } else {
                i += 1;
            }
        }
    }

    /// Whether rendezvous sends wait for the transport to let go of their memory
    /// ([`Engine::transmit_lending`]).
    pub fn has_lent(&self) -> bool {
        !self.lending.is_empty()
    }

    /// Offers the next record to `out` (a DATA record lent if `lend`): `None` when there is
    /// none, else whether `out` took it.
    fn transmit_one(&mut self, lend: bool, out: &mut dyn FnMut(MacAddr, Out<'_>) -> bool) -> Option<bool> {
        if let Some(o) = self.control.front() {
            let took = out(o.dest, Out::Parts(&[&o.bytes]));
            if took {
                let o = self.control.pop_front().expect("front");
                if self.spare.len() < SPARE_RECORDS {
                    self.spare.push(o.bytes);
                }
            }
            return Some(took);
        }
        let s = self.streams.front_mut()?;
        let n = self.cfg.data_chunk.min(s.granted - s.offset);
        let head = &mut self.data_head;
        head.clear();
        Record::Data { recv_id: s.recv_id, offset: s.offset as u64, data: &[] }
            .emit(Route { src: self.me.id, dst: s.dest.id }, head);
        let range = s.offset..s.offset + n;
        let took = if lend {
            out(s.dest.mac, Out::Lent(head, LentSlice::new(Arc::clone(&s.data), range)))
        } else {
            out(s.dest.mac, Out::Parts(&[head, &s.data.bytes()[range]]))
        };
        if !took {
            return Some(false);
        }
        s.offset += n;
        let s = self.streams.pop_front().expect("front");
        if s.offset == s.granted && lend {
            // The last of its bytes went out lent: complete once they are let go.
            self.lending.push(Lending { id: s.id, dest: s.dest, data: s.data, outcome: Outcome::Sent });
        } else if s.offset == s.granted {
            // The last of its bytes went out: the sender's memory is free again.
            self.complete(s.id, Outcome::Sent);
        } else {
            self.streams.push_back(s);
        }
        Some(true)
    }

    /// Whether records wait to be handed to the transport ([`Engine::transmit`]).
    pub fn has_records(&self) -> bool {
        !self.control.is_empty() || !self.streams.is_empty()
    }

    /// Whether finished requests wait to be taken ([`Engine::poll_completion`]).
    pub fn has_completions(&self) -> bool {
        !self.done.is_empty()
    }

    /// The next finished request.
    pub fn poll_completion(&mut self) -> Option<Completion> {
        self.done.pop_front()
    }

    /// Node `mac` went down (its transport said so): every request that needs it fails, and
    /// rendezvous announcements from it are forgotten (their data will not come).
    pub fn peer_down(&mut self, mac: MacAddr) {
        self.fail_where(|a| a.mac == mac, Failure::PeerDown(mac));
        self.control.retain(|o| o.dest != mac);
    }

    /// Engine `addr` went away for good (its node said so): as [`Engine::peer_down`] for that
    /// one engine.
    pub fn endpoint_gone(&mut self, addr: Addr) {
        self.fail_where(|a| a == addr, Failure::EndpointGone(addr));
    }

    /// Fails every request that needs an engine `gone` picks, and forgets announcements from
    /// them.
    fn fail_where(&mut self, gone: impl Fn(Addr) -> bool, why: Failure) {
        let mut ids = Vec::new();
        self.announced.retain(|_, a| {
            let keep = !gone(a.dest);
            if !keep {
                ids.push(a.id);
            }
            keep
        });
        self.streams.retain(|s| {
            let keep = !gone(s.dest);
            if !keep {
                ids.push(s.id);
            }
            keep
        });
        // Their memory may still be lent: they fail once it is let go (the caller has the
        // transport drop what it queued for a peer that is gone).
        for l in self.lending.iter_mut().filter(|l| gone(l.dest)) {
            l.outcome = Outcome::Failed(why);
        }
        self.incoming.retain(|_, i| {
            let keep = !gone(i.status.source);
            if !keep {
                ids.push(i.id);
            }
            keep
        });
        self.posted.retain(|p| {
            let keep = !matches!(p.m.source, Source::Only(a) if gone(a));
            if !keep {
                ids.push(p.id);
            }
            keep
        });
        let lost = |u: &Unexpected| gone(u.from) && matches!(u.arrival, Arrival::Rts { .. });
        self.unexpected.retain(|u| !lost(u));
        for c in self.claimed.values_mut() {
            if c.as_ref().is_ok_and(lost) {
                *c = Err(why);
            }
        }
        ids.sort();
        for id in ids {
            self.complete(id, Outcome::Failed(why));
        }
    }
}

fn arriving(a: &Arrival) -> Arriving<'_> {
    match a {
        Arrival::Eager(d) => Arriving::Eager(d),
        Arrival::Rts { len, send_id } => Arriving::Rts { len: *len, send_id: *send_id },
    }
}

fn status_of(u: &Unexpected) -> Status {
    let len = match &u.arrival {
        Arrival::Eager(d) => d.len() as u64,
        Arrival::Rts { len, .. } => *len,
    };
    Status { source: u.from, context: u.context, tag: u.tag, len }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(node: u8, id: u16) -> Addr {
        Addr { mac: MacAddr::local(node.into()), id }
    }

    /// Engines exchanging records directly (a perfect wire); returns the completions seen.
    struct Net {
        engines: Vec<Engine>,
        done: Vec<(usize, Completion)>,
    }

    impl Net {
        fn new(addrs: &[Addr], cfg: Config) -> Net {
            Net { engines: addrs.iter().map(|&a| Engine::new(a, cfg.clone())).collect(), done: Vec::new() }
        }

        fn pump(&mut self) {
            loop {
                let mut moved = false;
                for i in 0..self.engines.len() {
                    while let Some(o) = self.engines[i].poll_transmit() {
                        moved = true;
                        let from = self.engines[i].addr().mac;
                        let dst = crate::wire::destination(&o.bytes).unwrap();
                        let to = self
                            .engines
                            .iter()
                            .position(|e| e.addr() == Addr { mac: o.dest, id: dst })
                            .unwrap();
                        self.engines[to].handle_message(from, &o.bytes);
                    }
                }
                for (i, e) in self.engines.iter_mut().enumerate() {
                    while let Some(c) = e.poll_completion() {
                        moved = true;
                        self.done.push((i, c));
                    }
                }
                if !moved {
                    return;
                }
            }
        }

        fn outcome(&self, engine: usize, id: RequestId) -> Option<&Outcome> {
            self.done.iter().find(|(i, c)| *i == engine && c.id == id).map(|(_, c)| &c.outcome)
        }

        fn data(&self, engine: usize, id: RequestId) -> (Status, Vec<u8>, bool) {
            match self.outcome(engine, id) {
                Some(Outcome::Received { status, data, truncated, .. }) => {
                    (*status, data.clone(), *truncated)
                }
                other => panic!("receive {id:?} on {engine}: {other:?}"),
            }
        }
    }

    fn bytes(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
    }

    #[test]
    fn eager_and_rendezvous_before_and_after_the_receive() {
        let (a, b) = (addr(1, 1), addr(2, 7));
        let mut net = Net::new(&[a, b], Config { eager_limit: 1000, data_chunk: 300 });
        // Receive posted first, then the messages; then messages first, receives after.
        let r1 = net.engines[1].post_recv(Match::exact(Source::Only(a), 0, 5), 10_000);
        let r2 = net.engines[1].post_recv(Match::exact(Source::Only(a), 0, 5), 10_000);
        let s1 = net.engines[0].send(b, 0, 5, bytes(100, 1));
        let s2 = net.engines[0].send(b, 0, 5, bytes(5000, 2));
        net.engines[0].send(b, 0, 6, bytes(2500, 3));
        net.engines[0].send(b, 0, 6, bytes(10, 4));
        net.pump();
        assert_eq!(net.data(1, r1).1, bytes(100, 1));
        assert_eq!(net.data(1, r2).1, bytes(5000, 2));
        assert_eq!(net.outcome(0, s1), Some(&Outcome::Sent));
        assert_eq!(net.outcome(0, s2), Some(&Outcome::Sent));
        assert_eq!(net.engines[1].unexpected().0, 2);
        let r3 = net.engines[1].post_recv(Match::exact(Source::Any, 0, 6), 10_000);
        let r4 = net.engines[1].post_recv(Match::exact(Source::Any, 0, 6), 10_000);
        net.pump();
        let (status, data, truncated) = net.data(1, r3);
        assert_eq!((status.source, status.tag, status.len, truncated), (a, 6, 2500, false));
        assert_eq!(data, bytes(2500, 3));
        assert_eq!(net.data(1, r4).1, bytes(10, 4));
        let c = net.engines[0].counters();
        assert_eq!((c.eager_sent, c.rendezvous_sent), (2, 2));
        assert_eq!(net.engines[1].counters().unexpected, 2);
    }

    #[test]
    fn copied_sends_go_eagerly_by_rendezvous_and_to_self() {
        let (a, b) = (addr(1, 1), addr(2, 7));
        let mut net = Net::new(&[a, b], Config { eager_limit: 1000, data_chunk: 300 });
        let mut message = bytes(100, 1);
        let s1 = net.engines[0].send_copy(b, 0, 5, &message);
        // The caller's memory is its own again at return: change it before anything moves.
        message.fill(0);
        let big = bytes(5000, 2);
        let s2 = net.engines[0].send_copy(b, 0, 5, &big);
        let to_self = net.engines[0].send_copy(a, 0, 9, &bytes(3000, 3));
        assert_eq!(net.engines[0].counters().eager_sent, 2);
        assert_eq!(net.engines[0].counters().rendezvous_sent, 1);
        // A receive on engine `e` of what `a` sends with `tag`.
        let post = |net: &mut Net, e: usize, tag| {
            net.engines[e].post_recv(Match::exact(Source::Only(a), 0, tag), 10_000)
        };
        let (r1, r2, r3) = (post(&mut net, 1, 5), post(&mut net, 1, 5), post(&mut net, 0, 9));
        net.pump();
        assert_eq!(net.data(1, r1).1, bytes(100, 1));
        assert_eq!(net.data(1, r2).1, big);
        assert_eq!(net.data(0, r3).1, bytes(3000, 3));
        for s in [s1, s2, to_self] {
            assert_eq!(net.outcome(0, s), Some(&Outcome::Sent));
        }
        // Unreported: only a rendezvous message has a request, and it completes as usual.
        let completions = net.done.len();
        assert_eq!(net.engines[0].send_copy_unreported(b, 0, 6, &bytes(10, 4)), None);
        assert_eq!(net.engines[0].send_copy_unreported(a, 0, 6, &bytes(20, 5)), None);
        let s3 = net.engines[0].send_copy_unreported(b, 0, 6, &big).expect("a rendezvous request");
        let (r4, r5, r6) = (post(&mut net, 1, 6), post(&mut net, 1, 6), post(&mut net, 0, 6));
        net.pump();
        assert_eq!(net.data(1, r4).1, bytes(10, 4));
        assert_eq!(net.data(1, r5).1, big);
        assert_eq!(net.data(0, r6).1, bytes(20, 5));
        assert_eq!(net.outcome(0, s3), Some(&Outcome::Sent));
        assert_eq!(net.done.len(), completions + 4, "three receives and the rendezvous send");
    }

    #[test]
    fn a_gone_record_fails_only_what_needs_that_engine() {
        let (a1, a2, b) = (addr(1, 1), addr(1, 2), addr(2, 1));
        let mut net = Net::new(&[a1, a2, b], Config { eager_limit: 100, data_chunk: 100 });
        // b announces a rendezvous message to a1 and waits for a1 and for a2.
        let to_a1 = net.engines[2].send(a1, 0, 1, bytes(1000, 1));
        let from_a1 = net.engines[2].post_recv(Match::any_tag(Source::Only(a1), 0), 10);
        let from_a2 = net.engines[2].post_recv(Match::any_tag(Source::Only(a2), 0), 10);
        let from_any = net.engines[2].post_recv(Match::any_tag(Source::Any, 0), 10);
        net.pump();
        // a1's node says a1 is gone, to every engine of b's node (destination 0).
        let mut gone = Vec::new();
        Record::Gone.emit(Route { src: a1.id, dst: 0 }, &mut gone);
        net.engines[2].handle_message(a1.mac, &gone);
        net.pump();
        let failed = Some(&Outcome::Failed(Failure::EndpointGone(a1)));
        assert_eq!(net.outcome(2, to_a1), failed);
        assert_eq!(net.outcome(2, from_a1), failed);
        assert_eq!(net.outcome(2, from_a2), None, "a2 is still there");
        assert_eq!(net.outcome(2, from_any), None);
        net.engines[1].send(b, 0, 9, bytes(5, 2));
        net.pump();
        assert_eq!(net.data(2, from_a2).1, bytes(5, 2));
    }

    #[test]
    fn wildcards_take_the_oldest_match_and_the_mask_ignores_bits() {
        let (a1, a2, b) = (addr(1, 1), addr(1, 2), addr(2, 1));
        let mut net = Net::new(&[a1, a2, b], Config::default());
        net.engines[1].send(b, 3, 0x100 | 7, bytes(4, 1));
        net.pump();
        net.engines[0].send(b, 3, 0x200 | 7, bytes(4, 2));
        net.engines[0].send(b, 4, 0x200 | 7, bytes(4, 3));
        net.pump();
        // Low byte 7, any high bits, context 3: the oldest (from a2) first.
        let m = Match { source: Source::Any, context: Some(3), tag: 7, ignore: !0xff };
        let r1 = net.engines[2].post_recv(m, 64);
        let r2 = net.engines[2].post_recv(m, 64);
        let r3 = net.engines[2].post_recv(m, 64);
        net.pump();
        assert_eq!(net.data(2, r1).0.source, a2);
        assert_eq!(net.data(2, r2).0.source, a1);
        assert!(net.outcome(2, r3).is_none(), "context 4 does not match context 3");
        assert!(net.engines[2].cancel(r3));
        assert!(!net.engines[2].cancel(r3));
        net.pump();
        assert_eq!(net.outcome(2, r3), Some(&Outcome::Cancelled));
        let r4 = net.engines[2].post_recv(Match::any_tag(Source::Only(a1), 4), 64);
        net.pump();
        assert_eq!(net.data(2, r4).1, bytes(4, 3));
    }

    #[test]
    fn long_messages_are_truncated_never_overrun() {
        let (a, b) = (addr(1, 1), addr(2, 1));
        let mut net = Net::new(&[a, b], Config { eager_limit: 100, data_chunk: 64 });
        let m = Match::any_tag(Source::Any, 0);
        let r1 = net.engines[1].post_recv(m, 50);
        let r2 = net.engines[1].post_recv(m, 300);
        let r3 = net.engines[1].post_recv(m, 0);
        let s1 = net.engines[0].send(b, 0, 1, bytes(80, 1));
        let s2 = net.engines[0].send(b, 0, 2, bytes(1000, 2));
        let s3 = net.engines[0].send(b, 0, 3, bytes(1000, 3));
        net.pump();
        let (st, d, t) = net.data(1, r1);
        assert_eq!((st.len, d, t), (80, bytes(50, 1), true));
        let (st, d, t) = net.data(1, r2);
        assert_eq!((st.len, d, t), (1000, bytes(300, 2), true));
        let (st, d, t) = net.data(1, r3);
        assert_eq!((st.len, d.len(), t), (1000, 0, true));
        for s in [s1, s2, s3] {
            assert_eq!(net.outcome(0, s), Some(&Outcome::Sent));
        }
        assert_eq!(net.engines[1].counters().truncated, 3);
    }

    #[test]
    fn probe_claim_and_sends_to_self() {
        let a = addr(1, 1);
        let mut net = Net::new(&[a], Config { eager_limit: 8, data_chunk: 8 });
        let m = Match::exact(Source::Only(a), 9, 1);
        assert_eq!(net.engines[0].probe(m), None);
        let s = net.engines[0].send(a, 9, 1, bytes(100, 5));
        net.engines[0].send(a, 9, 1, bytes(3, 6));
        net.pump();
        assert_eq!(net.outcome(0, s), Some(&Outcome::Sent), "a send to self completes at once");
        let p = net.engines[0].probe(m).unwrap();
        assert_eq!((p.source, p.len), (a, 100));
        let (claim, status) = net.engines[0].claim(m).unwrap();
        assert_eq!(status, p);
        // The claimed message is out of matching: a receive now takes the second one.
        let r = net.engines[0].post_recv(m, 100);
        net.pump();
        assert_eq!(net.data(0, r).1, bytes(3, 6));
        let rc = net.engines[0].recv_claimed(claim, 100).unwrap();
        net.pump();
        assert_eq!(net.data(0, rc).1, bytes(100, 5));
    }

    #[test]
    fn bad_stray_and_misrouted_records_are_counted_and_dropped() {
        let (a, b) = (addr(1, 1), addr(2, 1));
        let mut e = Engine::new(b, Config::default());
        e.handle_message(a.mac, &[1, 2, 3]);
        let mut rec = Vec::new();
        Record::Eager { context: 0, tag: 0, data: b"x" }.emit(Route { src: 1, dst: 2 }, &mut rec);
        e.handle_message(a.mac, &rec);
        rec.clear();
        Record::Cts { send_id: 77, recv_id: 1, granted: 1 }.emit(Route { src: 1, dst: 1 }, &mut rec);
        e.handle_message(a.mac, &rec);
        rec.clear();
        Record::Data { recv_id: 5, offset: 0, data: b"zz" }.emit(Route { src: 1, dst: 1 }, &mut rec);
        e.handle_message(a.mac, &rec);
        // An RTS matched by a receive of 4 bytes: DATA past 4, or from someone else, is stray.
        rec.clear();
        Record::Rts { context: 0, tag: 0, len: 10, send_id: 1 }.emit(Route { src: 1, dst: 1 }, &mut rec);
        e.handle_message(a.mac, &rec);
        let r = e.post_recv(Match::any_tag(Source::Any, 0), 4);
        let cts = e.poll_transmit().unwrap();
        let Ok((_, Record::Cts { recv_id, granted, .. })) = Record::parse(&cts.bytes) else { panic!() };
        assert_eq!(granted, 4);
        for (mac, offset, data) in
            [(a.mac, 2u64, &b"abc"[..]), (MacAddr::local(9), 0, b"ab"), (a.mac, u64::MAX, b"a")]
        {
            rec.clear();
            Record::Data { recv_id, offset, data }.emit(Route { src: 1, dst: 1 }, &mut rec);
            e.handle_message(mac, &rec);
        }
        assert!(e.poll_completion().is_none());
        rec.clear();
        Record::Data { recv_id, offset: 0, data: b"abcd" }.emit(Route { src: 1, dst: 1 }, &mut rec);
        e.handle_message(a.mac, &rec);
        let c = e.poll_completion().unwrap();
        assert_eq!(c.id, r);
        assert!(matches!(c.outcome, Outcome::Received { ref data, truncated: true, .. } if data == b"abcd"));
        let n = e.counters();
        assert_eq!((n.bad_records, n.misrouted, n.stray), (1, 1, 5));
    }

    /// Hands `from`'s records to `to`, DATA lent: the lent slices are kept in `held` (as a
    /// transport's unacknowledged frames would) and their bytes delivered at once.
    fn pump_lending(from: &mut Engine, to: &mut Engine, held: &mut Vec<LentSlice>) -> usize {
        let src = from.addr().mac;
        let mut records = Vec::new();
        let n = from.transmit_lending(&mut |_, out| {
            match out {
                Out::Parts(parts) => records.push(parts.concat()),
                Out::Lent(head, body) => {
                    records.push([head, body.bytes()].concat());
                    held.push(body);
                }
            }
            true
        });
        for r in &records {
            to.handle_message(src, r);
        }
        n
    }

    #[test]
    fn a_lent_rendezvous_send_completes_once_its_memory_is_let_go() {
        let (a, b) = (addr(1, 1), addr(2, 1));
        let cfg = Config { eager_limit: 10, data_chunk: 100 };
        let (mut ea, mut eb) = (Engine::new(a, cfg.clone()), Engine::new(b, cfg));
        let r = eb.post_recv(Match::any_tag(Source::Any, 0), 1000);
        let s = ea.send(b, 0, 1, bytes(250, 9));
        let mut held = Vec::new();
        for _ in 0..4 {
            pump_lending(&mut ea, &mut eb, &mut held);
            pump_lending(&mut eb, &mut ea, &mut Vec::new());
        }
        assert_eq!(held.len(), 3, "250 bytes in DATA of 100");
        assert!(
            matches!(eb.poll_completion(), Some(Completion { id, outcome: Outcome::Received { ref data, .. } }) if id == r && *data == bytes(250, 9))
        );
        // Every record went, but the transport still holds the memory: not complete yet.
        assert!(!ea.has_records() && ea.has_lent());
        pump_lending(&mut ea, &mut eb, &mut held);
        assert!(ea.poll_completion().is_none());
        held.pop();
        pump_lending(&mut ea, &mut eb, &mut held);
        assert!(ea.poll_completion().is_none(), "two slices still held");
        held.clear();
        pump_lending(&mut ea, &mut eb, &mut held);
        assert_eq!(ea.poll_completion(), Some(Completion { id: s, outcome: Outcome::Sent }));
        assert!(!ea.has_lent());

        // A peer that goes down fails the send, but only once its memory is let go.
        let r = eb.post_recv(Match::any_tag(Source::Any, 0), 1000);
        let s = ea.send(b, 0, 2, bytes(150, 3));
        for _ in 0..4 {
            pump_lending(&mut ea, &mut eb, &mut held);
            pump_lending(&mut eb, &mut ea, &mut Vec::new());
        }
        assert!(matches!(eb.poll_completion(), Some(Completion { id, .. }) if id == r));
        ea.peer_down(b.mac);
        pump_lending(&mut ea, &mut eb, &mut held);
        assert!(ea.poll_completion().is_none());
        held.clear();
        pump_lending(&mut ea, &mut eb, &mut held);
        assert_eq!(
            ea.poll_completion(),
            Some(Completion { id: s, outcome: Outcome::Failed(Failure::PeerDown(b.mac)) })
        );
    }

    /// Memory lent to an engine: its bytes show in `back` once the engine gives it back (drops it).
    struct Loan {
        mem: Vec<u8>,
        back: std::sync::Arc<std::sync::Mutex<Option<Vec<u8>>>>,
    }

    impl RecvBuf for Loan {
        fn bytes_mut(&mut self) -> &mut [u8] {
            &mut self.mem
        }
    }

    impl Drop for Loan {
        fn drop(&mut self) {
            *self.back.lock().unwrap() = Some(std::mem::take(&mut self.mem));
        }
    }

    type Back = std::sync::Arc<std::sync::Mutex<Option<Vec<u8>>>>;

    fn lend(cap: usize) -> (Box<dyn RecvBuf>, Back) {
        let back = Back::default();
        (Box::new(Loan { mem: vec![0xee; cap], back: back.clone() }), back)
    }

    fn given_back(back: &Back) -> Option<Vec<u8>> {
        back.lock().unwrap().clone()
    }

    /// A message the engine reads in place, counting the loans still out.
    struct Borrowed {
        message: Vec<u8>,
        /// Held only to be counted.
        _loan: std::sync::Arc<()>,
    }

    impl SendBuf for Borrowed {
        fn bytes(&self) -> &[u8] {
            &self.message
        }
    }

    #[test]
    fn lent_memory_takes_eager_and_rendezvous_bytes_in_place_and_is_given_back() {
        let (a, b) = (addr(1, 1), addr(2, 1));
        let mut net = Net::new(&[a, b], Config { eager_limit: 100, data_chunk: 64 });
        let m = Match::any_tag(Source::Any, 0);
        // Posted before (eager, rendezvous, truncated rendezvous), and after the arrival.
        let (r1, back1) = lend(80);
        let (r2, back2) = lend(1000);
        let (r3, back3) = lend(300);
        let r1 = net.engines[1].post_recv_into(m, r1);
        let r2 = net.engines[1].post_recv_into(m, r2);
        let r3 = net.engines[1].post_recv_into(m, r3);
        let sent_loan = std::sync::Arc::new(());
        let s2 = net.engines[0].send(b, 0, 2, Borrowed { message: bytes(1000, 2), _loan: sent_loan.clone() });
        net.engines[0].send(b, 0, 1, bytes(60, 1));
        net.engines[0].send(b, 0, 3, bytes(1000, 3));
        net.engines[0].send(b, 0, 4, bytes(7, 4));
        assert_eq!(std::sync::Arc::strong_count(&sent_loan), 2, "the engine reads the message in place");
        assert!(given_back(&back1).is_none());
        net.pump();
        assert_eq!(net.outcome(0, s2), Some(&Outcome::Sent));
        assert_eq!(std::sync::Arc::strong_count(&sent_loan), 1, "a completed send gives its memory back");
        // The RTS went first: r1 took it (truncated to 80), r2 the eager message, r3 the next.
        for (r, back, tag, len, want) in [
            (r1, &back1, 2, 1000, bytes(80, 2)),
            (r2, &back2, 1, 60, bytes(60, 1)),
            (r3, &back3, 3, 1000, bytes(300, 3)),
        ] {
            let (status, data, truncated) = net.data(1, r);
            assert_eq!((status.tag, status.len, truncated), (tag, len, len as usize > want.len()));
            assert!(data.is_empty(), "the bytes are in the lent memory, not in the outcome");
            let mem = given_back(back).expect("a finished receive gives its memory back");
            assert_eq!(&mem[..want.len()], &want[..]);
        }
        // A message waiting already lands at once; a cancelled receive's memory comes back
        // untouched.
        let (r4, back4) = lend(10);
        let r4 = net.engines[1].post_recv_into(m, r4);
        net.pump();
        assert_eq!(net.data(1, r4).0.len, 7);
        assert_eq!(given_back(&back4).unwrap(), [&bytes(7, 4)[..], &[0xee; 3]].concat());
        let (r5, back5) = lend(10);
        let r5 = net.engines[1].post_recv_into(m, r5);
        assert!(net.engines[1].cancel(r5));
        assert_eq!(given_back(&back5).unwrap(), vec![0xee; 10]);
    }

    #[test]
    fn a_refused_record_stays_first_in_line() {
        let (a, b) = (addr(1, 1), addr(2, 1));
        let cfg = Config { eager_limit: 10, data_chunk: 100 };
        let (mut ea, mut eb) = (Engine::new(a, cfg.clone()), Engine::new(b, cfg));
        let r = eb.post_recv(Match::any_tag(Source::Any, 0), 1000);
        let s = ea.send(b, 0, 1, bytes(250, 9));
        ea.send(b, 0, 2, bytes(5, 1));
        // Hands on what `from` offers while `room` lasts.
        let turn = |from: &mut Engine, to: &mut Engine, mut room: usize| {
            let mut records = Vec::new();
            let took = from.transmit(&mut |_, parts| {
                if room == 0 {
                    return false;
                }
                room -= 1;
                records.push(parts.concat());
                true
            });
            assert_eq!(took, records.len());
            let src = from.addr().mac;
            for rec in &records {
                to.handle_message(src, rec);
            }
            records.len()
        };
        assert_eq!(turn(&mut ea, &mut eb, 0), 0, "nothing goes when the transport has no room");
        assert_eq!(turn(&mut ea, &mut eb, 1), 1, "the RTS");
        assert_eq!(turn(&mut ea, &mut eb, 1), 1, "then the eager message, in order");
        assert_eq!(turn(&mut eb, &mut ea, 5), 1, "the CTS");
        // One record a turn: three DATA records of 100, 100 and 50 bytes, in order.
        for i in 0..3 {
            assert!(ea.poll_completion().is_none_or(|c| c.id != s), "sent before DATA {i}");
            assert_eq!(turn(&mut ea, &mut eb, 1), 1);
        }
        assert_eq!(turn(&mut ea, &mut eb, 1), 0);
        assert!(std::iter::from_fn(|| ea.poll_completion())
            .any(|c| c == Completion { id: s, outcome: Outcome::Sent }));
        let got = std::iter::from_fn(|| eb.poll_completion()).find(|c| c.id == r).unwrap();
        assert!(matches!(got.outcome, Outcome::Received { ref data, .. } if *data == bytes(250, 9)));
    }

    #[test]
    fn a_peer_down_fails_what_needs_it() {
        let (a, b) = (addr(1, 1), addr(2, 1));
        let mut e = Engine::new(a, Config { eager_limit: 10, data_chunk: 10 });
        let s = e.send(b, 0, 0, bytes(100, 1));
        let r = e.post_recv(Match::exact(Source::Only(b), 0, 0), 10);
        let other = e.post_recv(Match::exact(Source::Any, 0, 0), 10);
        e.peer_down(b.mac);
        assert!(e.poll_transmit().is_none(), "nothing more goes to a node that is down");
        let failed = Outcome::Failed(Failure::PeerDown(b.mac));
        assert_eq!(e.poll_completion(), Some(Completion { id: s, outcome: failed.clone() }));
        assert_eq!(e.poll_completion(), Some(Completion { id: r, outcome: failed }));
        assert_eq!(e.poll_completion(), None);
        assert!(e.cancel(other), "a receive from any source still waits");
    }
}
