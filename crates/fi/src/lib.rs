//! The lanbus libfabric provider: tagged messages for MPI libraries that speak libfabric (Open
//! MPI's ofi MTL), over lanbus messaging.
//!
//! Layer: on top of `lanbus_node::msg` (direct mode: the process owns a port) and
//! `lanbus_node::msgd` (daemon mode: the process attaches to `lanbus msgd`). libfabric's objects,
//! its tables of function pointers and its entry point `fi_prov_ini` are in `c/provider.c`,
//! written against libfabric's own headers; it calls the functions below, which hold one
//! endpoint's messaging state. Nothing here knows libfabric's constants: the C side says which
//! flags a completion carries and turns [`ErrKind`] into libfabric's error numbers.
//!
//! Configuration, read when an endpoint opens (the environment of an MPI job's processes):
//!
//! - `LANBUS_FI_DAEMON=SOCKET[,SOCKET...]`: attach to `lanbus msgd` (daemon mode; the default,
//!   at `/tmp/lanbus-msgd.sock`).
//! - `LANBUS_FI_PORT=SPEC[;SPEC...]`: own a port instead (direct mode; the port's privileges);
//!   `;` separates specs, which have commas of their own.
//! - With several sockets or specs, a process takes the one at its rank modulo their number
//!   (`OMPI_COMM_WORLD_RANK`, `PMIX_RANK` or `PMI_RANK`): a job on one machine spreads over
//!   several daemons as if over several machines.
//! - `LANBUS_FI_EAGER_LIMIT=BYTES`: messages up to this size go eagerly (default 32 KiB).
//! - `LANBUS_FI_KEY=FILE` (direct mode): the fabric key file (`lanbus keygen`) the port's frames
//!   are sealed under, as the daemons' `--key`; `LANBUS_FI_ENCRYPT=1` encrypts payloads too. In
//!   daemon mode the daemon holds the key and the process never does.
//!
//! Progress is manual: reading the completion queue moves the records, through the daemon's
//! rings (daemon mode) or through the port itself, whose runtime runs its turns on the reading
//! thread (direct mode; a helper thread runs them when nobody has read for a millisecond, and
//! looks in less often, every 16 ms at most, while the reads go on).
//!
//! The engine works in the application's own memory, which libfabric lends the provider until
//! an operation's completion: a rendezvous send goes out from the send buffer (in direct mode
//! the transport's frames read it there until their ACK, and the send completes after the last;
//! in daemon mode it is copied into the ring to the daemon) and a
//! receive's bytes land in its buffer as they arrive (from the port's frames, or from the ring).
//! Injects, and sends without a context, are copied at once (their buffer is the application's
//! again when the call returns).

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use lanbus_msg::{
    Addr, Claim, Config, Failure, Match, Outcome, RecvBuf, RequestId, RequestMap, SendBuf, Source, Status,
};
use lanbus_node::msg::{MsgError, MsgNode};
use lanbus_node::msgd::MsgClient;
use lanbus_wire::MacAddr;

/// Bytes of an endpoint's address (its node's MAC and its engine id, little-endian).
pub const ADDR_LEN: usize = 8;

/// The default daemon socket (that of `lanbus msgd`).
pub const DEFAULT_DAEMON: &str = "/tmp/lanbus-msgd.sock";

/// Why an operation ended in error; the C side maps these to libfabric's error numbers.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrKind {
    /// No error.
    None = 0,
    /// The message was longer than the receive buffer (FI_ETRUNC).
    Truncated = 1,
    /// The receive was cancelled (FI_ECANCELED).
    Cancelled = 2,
    /// A peek found no message (FI_ENOMSG).
    NoMessage = 3,
    /// The peer went down, restarted or went away (FI_EHOSTUNREACH).
    PeerGone = 4,
    /// The daemon went away (FI_EIO).
    DaemonGone = 5,
}

/// One completion as the C side turns it into libfabric's entries.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct LbCompletion {
    /// The application's context of the operation.
    pub context: *mut c_void,
    /// The entry's flags (given by the C side when the operation started).
    pub flags: u64,
    /// Bytes received (or, for a peek, the message's length).
    pub len: usize,
    /// The receive buffer.
    pub buf: *mut c_void,
    /// The message's tag.
    pub tag: u64,
    /// The sender's remote CQ data (4 bytes, carried in the message's context field).
    pub data: u64,
    /// Bytes that did not fit (truncation).
    pub olen: usize,
    /// [`ErrKind`] as a number.
    pub err: u32,
}

/// How an operation's completion is reported.
#[derive(Debug, Clone, Copy)]
struct Report {
    context: usize,
    flags: u64,
    /// Whether a successful completion is written (errors always are, but for injects).
    wanted: bool,
}

/// An operation under way.
#[derive(Debug)]
struct Op {
    report: Report,
    /// Receive buffer and its size (0 for sends).
    buf: usize,
    cap: usize,
    /// The message is received and dropped (FI_DISCARD): no bytes land, no truncation.
    discard: bool,
    /// A receive (cancellable).
    recv: bool,
    /// The engine writes into `buf` itself (a lent receive): nothing is left to copy.
    lent: bool,
}

/// Application memory lent to the engine for the length of one operation. libfabric's contract
/// makes a send's or receive's buffer the provider's until the operation completes; the engine
/// drops this when it finishes the operation (completed, failed or cancelled), before the
/// completion is reported, and never touches the memory after. A rendezvous send's memory is
/// lent on to the transport, whose frames read it until they are acknowledged; the send
/// completes only after the last of them has let go.
pub struct Lent {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the memory is the provider's until the operation completes (libfabric's contract);
// the endpoint's lock serializes every write to it (a receive's), and a send's is only read.
unsafe impl Send for Lent {}
// SAFETY: shared references only read (`SendBuf::bytes`), and a send's memory is not written
// by anyone while it is lent; a receive's is written only through `&mut` (`RecvBuf`).
unsafe impl Sync for Lent {}

impl Lent {
    /// Lends `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr` is valid for reads (and, for a receive, writes) of `len` bytes, is not null, and
    /// stays so until the engine drops this.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Lent {
        Lent { ptr, len }
    }
}

impl SendBuf for Lent {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `Lent::new`'s contract.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl RecvBuf for Lent {
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `Lent::new`'s contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// A send's message: the application's memory, read before the call returns or until the send
/// completes.
pub enum Payload<'a> {
    /// Read before the call returns (an inject, or a send nobody will hear of).
    Copied(&'a [u8]),
    /// Read until the send completes.
    Lent(Lent),
}

enum Link {
    Direct(MsgNode),
    Daemon(Box<MsgClient>),
}

struct Inner {
    link: Link,
    addr: Addr,
    ops: RequestMap<Op>,
    /// Finished requests being turned into completions (kept: no allocation per poll).
    finished: Vec<(RequestId, Outcome)>,
    /// Messages claimed by a peek, by the context that claimed them.
    claims: HashMap<usize, Claim>,
    ready: VecDeque<LbCompletion>,
    /// Set once the daemon went away: everything fails from then on.
    broken: bool,
    /// When an empty read last gave the core away.
    last_yield: Instant,
    /// Empty reads so far (the clock is read on every 32nd).
    empty_reads: u32,
}

/// How long empty completion-queue reads spin before one gives the core away (see
/// [`Endpoint::read`]). Through Open MPI on two cores, 1 KiB one way in direct mode took 4.2 µs
/// yielding every 2 µs and 3.3-3.5 µs every 50 µs to 1 ms; daemon mode (whose threads share the
/// cores with the ranks) went from 20-24 µs to 13-17 µs.
const YIELD_EVERY: Duration = Duration::from_micros(200);

/// [`YIELD_EVERY`] in daemon mode, where what the process waits for is the daemon's threads'
/// work: without a yield of Open MPI's own (`mpi_yield_when_idle`), a rank spinning 200 µs
/// between yields held each message up by as much on two cores.
const DAEMON_YIELD_EVERY: Duration = Duration::ZERO;

/// One libfabric endpoint's messaging state.
pub struct Endpoint {
    inner: Mutex<Inner>,
}

/// What `LANBUS_FI_*` asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// Attach to the daemon at this socket.
    Daemon(String),
    /// Own this port.
    Direct(String),
}

/// The process's rank in its job, from the variables MPI launchers set (0 if none).
fn rank() -> usize {
    ["OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
        .unwrap_or(0)
}

/// The entry of a list (separated by `sep`) this rank takes.
fn pick(list: &str, sep: char, rank: usize) -> Option<String> {
    let items: Vec<&str> = list.split(sep).map(str::trim).filter(|s| !s.is_empty()).collect();
    (!items.is_empty()).then(|| items[rank % items.len()].to_string())
}

/// Reads the configuration from variable values (`port`, `daemon`) and the rank.
pub fn mode_from(port: Option<&str>, daemon: Option<&str>, rank: usize) -> Result<Mode, String> {
    match (port, daemon) {
        (Some(_), Some(_)) => Err("set LANBUS_FI_PORT (direct mode) or LANBUS_FI_DAEMON, not both".into()),
        (Some(p), None) => {
            pick(p, ';', rank).map(Mode::Direct).ok_or_else(|| "LANBUS_FI_PORT is empty".into())
        }
        (None, Some(d)) => {
            pick(d, ',', rank).map(Mode::Daemon).ok_or_else(|| "LANBUS_FI_DAEMON is empty".into())
        }
        (None, None) => Ok(Mode::Daemon(DEFAULT_DAEMON.into())),
    }
}

fn engine_config() -> Result<Config, String> {
    let mut cfg = Config::default();
    if let Ok(v) = std::env::var("LANBUS_FI_EAGER_LIMIT") {
        cfg.eager_limit =
            v.parse().map_err(|_| format!("LANBUS_FI_EAGER_LIMIT={v:?}: expected a number of bytes"))?;
    }
    Ok(cfg)
}

fn lock(m: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn addr_from(b: &[u8; ADDR_LEN]) -> Addr {
    Addr { mac: MacAddr(b[..6].try_into().expect("6 bytes")), id: u16::from_le_bytes([b[6], b[7]]) }
}

/// An address as libfabric carries it.
pub fn addr_bytes(a: Addr) -> [u8; ADDR_LEN] {
    let mut b = [0u8; ADDR_LEN];
    b[..6].copy_from_slice(&a.mac.0);
    b[6..].copy_from_slice(&a.id.to_le_bytes());
    b
}

impl Endpoint {
    /// Opens an endpoint as the environment says.
    pub fn open() -> Result<Endpoint, String> {
        let port = std::env::var("LANBUS_FI_PORT").ok();
        let daemon = std::env::var("LANBUS_FI_DAEMON").ok();
        Endpoint::open_mode(mode_from(port.as_deref(), daemon.as_deref(), rank())?, engine_config()?)
    }

    /// Opens an endpoint in `mode`.
    pub fn open_mode(mode: Mode, cfg: Config) -> Result<Endpoint, String> {
        let link = match &mode {
            Mode::Daemon(socket) => {
                let client = MsgClient::connect(Path::new(socket), cfg).map_err(|e| {
                    format!("{e}: is `lanbus msgd` running there? (LANBUS_FI_DAEMON names its socket)")
                })?;
                Link::Daemon(Box::new(client))
            }
            Mode::Direct(spec) => {
                let port = spec
                    .parse::<lanbus_port::PortSpec>()
                    .and_then(|s| s.open())
                    .map_err(|e| format!("opening port {spec}: {e}"))?;
                let port = match std::env::var_os("LANBUS_FI_KEY") {
                    Some(path) => {
                        let encrypt = std::env::var("LANBUS_FI_ENCRYPT").is_ok_and(|v| v == "1");
                        lanbus_node::security::Keyed::open(Path::new(&path), encrypt)
                            .map_err(|e| format!("LANBUS_FI_KEY: {e}"))?
                            .wrap(port)
                    }
                    None => port,
                };
                // The rank's own thread moves its messages as it polls the completion queue:
                // no second thread to wake, nor to share the cores with.
                let rc = lanbus_node::config::msg_runtime_config("fi", lanbus_runtime::ThreadMode::Caller);
                Link::Direct(MsgNode::start(port, 1, rc, cfg).map_err(|e| e.to_string())?)
            }
        };
        let addr = match &link {
            Link::Direct(n) => n.addr(),
            Link::Daemon(c) => c.addr(),
        };
        let inner = Inner {
            link,
            addr,
            ops: RequestMap::default(),
            finished: Vec::new(),
            claims: HashMap::new(),
            ready: VecDeque::new(),
            broken: false,
            last_yield: Instant::now(),
            empty_reads: 0,
        };
        Ok(Endpoint { inner: Mutex::new(inner) })
    }

    /// This endpoint's address.
    pub fn addr(&self) -> Addr {
        lock(&self.inner).addr
    }
}

impl Inner {
    /// Moves records (daemon mode) and turns finished requests into completions.
    /// Returns whether anything moved.
    fn progress(&mut self) -> bool {
        let mut moved = false;
        let mut finished = std::mem::take(&mut self.finished);
        match &mut self.link {
            Link::Direct(n) => {
                moved = n.poll() > 0;
                n.take_finished_into(&mut finished);
            }
            Link::Daemon(c) => {
                if !self.broken {
                    match c.progress() {
                        Ok(m) => moved = m,
                        Err(MsgError::DaemonGone) => self.broken = true,
                        Err(_) => {}
                    }
                }
                c.take_finished_into(&mut finished);
            }
        }
        for (id, outcome) in finished.drain(..) {
            if let Some(op) = self.ops.remove(&id) {
                self.finish(op, outcome);
            }
        }
        self.finished = finished;
        if self.broken {
            for (_, op) in std::mem::take(&mut self.ops) {
                self.fail(op.report, ErrKind::DaemonGone);
            }
        }
        moved
    }

    fn finish(&mut self, op: Op, outcome: Outcome) {
        match outcome {
            Outcome::Sent => self.succeed(op.report, 0, std::ptr::null_mut(), 0, 0),
            Outcome::Received { status, data, truncated, .. } => {
                let cq_data = u64::from(status.context);
                if op.discard {
                    return self.succeed(op.report, 0, std::ptr::null_mut(), status.tag, cq_data);
                }
                let n = if op.lent { (status.len as usize).min(op.cap) } else { data.len().min(op.cap) };
                if n > 0 && !op.lent {
                    // SAFETY: libfabric's contract: the receive buffer of `cap` bytes stays the
                    // application's to lend until the operation's completion is read, which is now.
                    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), op.buf as *mut u8, n) };
                }
                let buf = op.buf as *mut c_void;
                if truncated {
                    let olen = (status.len as usize).saturating_sub(n);
                    let mut e = entry(op.report, n, buf, status.tag, olen, ErrKind::Truncated);
                    e.data = cq_data;
                    self.ready.push_back(e);
                } else {
                    self.succeed(op.report, n, buf, status.tag, cq_data);
                }
            }
            Outcome::Cancelled => self.fail(op.report, ErrKind::Cancelled),
            Outcome::Failed(Failure::PeerDown(_) | Failure::EndpointGone(_)) => {
                self.fail(op.report, ErrKind::PeerGone)
            }
        }
    }

    fn succeed(&mut self, r: Report, len: usize, buf: *mut c_void, tag: u64, data: u64) {
        if r.wanted {
            let mut e = entry(r, len, buf, tag, 0, ErrKind::None);
            e.data = data;
            self.ready.push_back(e);
        }
    }

    fn fail(&mut self, r: Report, why: ErrKind) {
        // An operation without a context (an inject) has no one to tell.
        if r.context != 0 {
            self.ready.push_back(entry(r, 0, std::ptr::null_mut(), 0, 0, why));
        }
    }

    /// Tracks request `id`; without one (the daemon went away) the operation fails.
    fn start(&mut self, id: Option<RequestId>, op: Op) {
        match id {
            Some(id) => {
                self.ops.insert(id, op);
            }
            None => {
                self.broken = true;
                self.fail(op.report, ErrKind::DaemonGone);
            }
        }
        self.progress();
    }
}

fn entry(r: Report, len: usize, buf: *mut c_void, tag: u64, olen: usize, err: ErrKind) -> LbCompletion {
    LbCompletion {
        context: r.context as *mut c_void,
        flags: r.flags,
        len,
        buf,
        tag,
        data: 0,
        olen,
        err: err as u32,
    }
}

/// What a receive does besides receiving (libfabric's FI_PEEK, FI_CLAIM, FI_DISCARD).
pub const RECV_PEEK: u32 = 1;
/// See [`RECV_PEEK`].
pub const RECV_CLAIM: u32 = 2;
/// See [`RECV_PEEK`].
pub const RECV_DISCARD: u32 = 4;

impl Endpoint {
    /// Starts a send of `data` to `dest` with remote CQ data `cq_data`.
    #[allow(clippy::too_many_arguments)]
    pub fn send(
        &self,
        dest: Addr,
        data: Payload<'_>,
        tag: u64,
        cq_data: u32,
        context: usize,
        flags: u64,
        wanted: bool,
    ) {
        let mut g = lock(&self.inner);
        let report = Report { context, flags, wanted };
        let op = Op { report, buf: 0, cap: 0, discard: false, recv: false, lent: false };
        if g.broken {
            return g.fail(report, ErrKind::DaemonGone);
        }
        let id = match (&mut g.link, data) {
            (Link::Direct(n), Payload::Copied(v)) if !wanted => {
                match n.isend_copy_unreported(dest, cq_data, tag, v) {
                    Some(id) => Some(id),
                    // Gone at once, and nobody is to hear of it: only move it on.
                    None => {
                        g.progress();
                        return;
                    }
                }
            }
            (Link::Direct(n), Payload::Copied(v)) => Some(n.isend_copy(dest, cq_data, tag, v)),
            (Link::Direct(n), Payload::Lent(l)) => Some(n.isend(dest, cq_data, tag, l)),
            (Link::Daemon(c), Payload::Copied(v)) => c.isend(dest, cq_data, tag, v.to_vec()).ok(),
            (Link::Daemon(c), Payload::Lent(l)) => c.isend(dest, cq_data, tag, l).ok(),
        };
        g.start(id, op);
    }

    /// Starts a receive (or a peek, or the receive of a claimed message) into `cap` bytes at
    /// `buf`. `how` is a set of `RECV_*`. Returns false for a claimed receive whose context
    /// claimed nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn recv(
        &self,
        source: Option<Addr>,
        buf: usize,
        cap: usize,
        tag: u64,
        ignore: u64,
        context: usize,
        flags: u64,
        wanted: bool,
        how: u32,
    ) -> bool {
        let mut g = lock(&self.inner);
        let report = Report { context, flags, wanted };
        if g.broken {
            g.fail(report, ErrKind::DaemonGone);
            return true;
        }
        // The context field carries remote CQ data: matching is on source and tag alone.
        let m = Match { source: source.map_or(Source::Any, Source::Only), context: None, tag, ignore };
        let discard = how & RECV_DISCARD != 0;
        let mut op = Op { report, buf, cap, discard, recv: true, lent: false };
        if how & RECV_PEEK != 0 {
            g.progress();
            let found: Option<Status> = if how & (RECV_CLAIM | RECV_DISCARD) != 0 {
                let claimed = match &mut g.link {
                    Link::Direct(n) => n.claim(m),
                    Link::Daemon(c) => c.claim(m).ok().flatten(),
                };
                claimed.map(|(claim, status)| {
                    if discard {
                        let id = recv_claimed(&mut g.link, claim, 0);
                        let quiet = Report { context: 0, flags, wanted: false };
                        let op = Op { report: quiet, buf: 0, cap: 0, discard: true, recv: true, lent: false };
                        g.start(id, op);
                    } else {
                        g.claims.insert(context, claim);
                    }
                    status
                })
            } else {
                match &mut g.link {
                    Link::Direct(n) => n.probe(m),
                    Link::Daemon(c) => c.probe(m).ok().flatten(),
                }
            };
            match found {
                Some(st) => {
                    let mut e =
                        entry(report, st.len as usize, std::ptr::null_mut(), st.tag, 0, ErrKind::None);
                    e.data = u64::from(st.context);
                    g.ready.push_back(e);
                }
                None => g.fail(report, ErrKind::NoMessage),
            }
            return true;
        }
        if how & RECV_CLAIM != 0 {
            let Some(claim) = g.claims.remove(&context) else { return false };
            let id = recv_claimed(&mut g.link, claim, if discard { 0 } else { cap });
            g.start(id, op);
            return true;
        }
        let id = if cap > 0 && buf != 0 {
            op.lent = true;
            // SAFETY: libfabric lends the receive buffer until the completion, and the engine
            // drops the loan when the receive finishes, before that.
            let lent = Box::new(unsafe { Lent::new(buf as *mut u8, cap) });
            match &mut g.link {
                Link::Direct(n) => Some(n.irecv_into(m, lent)),
                Link::Daemon(c) => c.irecv_into(m, lent).ok(),
            }
        } else {
            match &mut g.link {
                Link::Direct(n) => Some(n.irecv(m, cap)),
                Link::Daemon(c) => c.irecv(m, cap).ok(),
            }
        };
        g.start(id, op);
        true
    }

    /// Cancels the receive started with `context`; true if it will complete as cancelled.
    pub fn cancel(&self, context: usize) -> bool {
        let mut g = lock(&self.inner);
        let found = g.ops.iter().find(|(_, op)| op.recv && op.report.context == context).map(|(id, _)| *id);
        let Some(id) = found else { return false };
        let done = match &mut g.link {
            Link::Direct(n) => n.cancel(id),
            Link::Daemon(c) => c.cancel(id),
        };
        g.progress();
        done
    }

    /// Moves up to `out.len()` successful completions into `out`. Returns how many, or `None`
    /// when the next completion is an error (read it with [`Endpoint::read_error`]).
    pub fn read(&self, out: &mut [LbCompletion]) -> Option<usize> {
        let mut g = lock(&self.inner);
        let moved = g.progress();
        if g.ready.is_empty() {
            // MPI libraries poll the CQ in a tight loop. Where the daemon's threads (or the
            // port's helper thread) share the cores with the polling processes, spinning
            // without a pause starves them and a message takes milliseconds (measured on 2
            // cores: 3 ms one-way, 8 µs with the yield). But a yield is a system call and a
            // pass through the scheduler, and after every empty read it made each poll several
            // times longer (a frame that arrives waits for it to return): empty reads spin for
            // a while between two yields. A read that moved something goes on at once: the
            // messages under way are this thread's to move.
            // The clock only every few reads: read every time it would be a good part of one.
            g.empty_reads = g.empty_reads.wrapping_add(1);
            let every = match g.link {
                Link::Direct(_) => YIELD_EVERY,
                Link::Daemon(_) => DAEMON_YIELD_EVERY,
            };
            let pause = !moved && g.empty_reads.is_multiple_of(32) && g.last_yield.elapsed() >= every;
            drop(g);
            if pause {
                std::thread::yield_now();
                lock(&self.inner).last_yield = Instant::now();
            }
            return Some(0);
        }
        let mut n = 0;
        while n < out.len() {
            match g.ready.front() {
                Some(c) if c.err == ErrKind::None as u32 => {
                    out[n] = g.ready.pop_front().expect("there");
                    n += 1;
                }
                Some(_) if n == 0 => return None,
                _ => break,
            }
        }
        Some(n)
    }

    /// Takes the error completion at the head of the queue, if that is one.
    pub fn read_error(&self) -> Option<LbCompletion> {
        let mut g = lock(&self.inner);
        match g.ready.front() {
            Some(c) if c.err != ErrKind::None as u32 => g.ready.pop_front(),
            _ => None,
        }
    }
}

fn recv_claimed(link: &mut Link, claim: Claim, cap: usize) -> Option<RequestId> {
    match link {
        Link::Direct(n) => n.recv_claimed(claim, cap),
        Link::Daemon(c) => c.recv_claimed(claim, cap).ok().flatten(),
    }
}

// ---- The functions `c/provider.c` calls. Each catches panics: none may unwind into C. ----

fn guard<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(fallback)
}

/// # Safety
/// `ep` is null or an endpoint from [`lanbus_fi_ep_open`] not yet closed.
unsafe fn ep_ref<'a>(ep: *const Endpoint) -> Option<&'a Endpoint> {
    // SAFETY: the caller's contract.
    unsafe { ep.as_ref() }
}

/// Opens an endpoint; on failure returns null and writes why (NUL-terminated) into `err`.
///
/// # Safety
/// `err` points to `err_len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn lanbus_fi_ep_open(err: *mut c_char, err_len: usize) -> *mut Endpoint {
    let r = guard(Err("the provider panicked opening the endpoint".to_string()), Endpoint::open);
    match r {
        Ok(ep) => Box::into_raw(Box::new(ep)),
        Err(why) => {
            if !err.is_null() && err_len > 0 {
                let n = why.len().min(err_len - 1);
                // SAFETY: the caller's contract; n + 1 <= err_len.
                unsafe {
                    std::ptr::copy_nonoverlapping(why.as_ptr(), err as *mut u8, n);
                    *err.add(n) = 0;
                }
            }
            std::ptr::null_mut()
        }
    }
}

/// Closes an endpoint (what it sent is given a moment to leave).
///
/// # Safety
/// `ep` came from [`lanbus_fi_ep_open`] and is not used again.
#[no_mangle]
pub unsafe extern "C" fn lanbus_fi_ep_close(ep: *mut Endpoint) {
    if !ep.is_null() {
        // SAFETY: the caller's contract.
        guard((), || drop(unsafe { Box::from_raw(ep) }));
    }
}

/// Writes the endpoint's [`ADDR_LEN`]-byte address to `out`.
///
/// # Safety
/// `ep` is an open endpoint; `out` points to [`ADDR_LEN`] writable bytes.
#[no_mangle]
pub unsafe extern "C" fn lanbus_fi_ep_name(ep: *const Endpoint, out: *mut u8) {
    // SAFETY: the caller's contract.
    let Some(ep) = (unsafe { ep_ref(ep) }) else { return };
    let b = addr_bytes(ep.addr());
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), out, ADDR_LEN) };
}

/// Starts a send of `len` bytes at `buf` with remote CQ data `cq_data` to the endpoint whose
/// address is at `dest`. Without a `context` (an inject) the bytes are copied before this
/// returns; with one, the endpoint reads them from `buf` until the send completes.
/// Returns 0, or -1 for a bad argument.
///
/// # Safety
/// `ep` is an open endpoint; `dest` points to [`ADDR_LEN`] bytes; `buf` to `len` bytes, which
/// stay valid until the send's completion when `context` is not null.
#[no_mangle]
pub unsafe extern "C" fn lanbus_fi_send(
    ep: *const Endpoint,
    dest: *const u8,
    buf: *const c_void,
    len: usize,
    tag: u64,
    cq_data: u64,
    context: *mut c_void,
    flags: u64,
    wanted: bool,
) -> c_int {
    // SAFETY: the caller's contract.
    let Some(ep) = (unsafe { ep_ref(ep) }) else { return -1 };
    if dest.is_null() || (buf.is_null() && len > 0) {
        return -1;
    }
    // SAFETY: the caller's contract.
    let dest = addr_from(unsafe { &*(dest as *const [u8; ADDR_LEN]) });
    let data = if len == 0 {
        Payload::Copied(&[])
    } else if context.is_null() {
        // An inject (or a send nobody will hear of): the buffer is the caller's again at return.
        // SAFETY: the caller's contract.
        Payload::Copied(unsafe { std::slice::from_raw_parts(buf as *const u8, len) })
    } else {
        // SAFETY: the caller's contract: the buffer stays valid until the send completes.
        Payload::Lent(unsafe { Lent::new(buf as *mut u8, len) })
    };
    guard(-1, || {
        // Remote CQ data is 4 bytes (the domain's cq_data_size).
        ep.send(dest, data, tag, cq_data as u32, context as usize, flags, wanted);
        0
    })
}

/// Starts a receive; `src` is null for any source. Returns 0, or -1 for a bad argument or a
/// claimed receive whose context claimed nothing.
///
/// # Safety
/// `ep` is an open endpoint; `src` null or [`ADDR_LEN`] bytes; `buf` `len` writable bytes that
/// stay valid until the receive's completion is read.
#[no_mangle]
pub unsafe extern "C" fn lanbus_fi_recv(
    ep: *const Endpoint,
    src: *const u8,
    buf: *mut c_void,
    len: usize,
    tag: u64,
    ignore: u64,
    context: *mut c_void,
    flags: u64,
    wanted: bool,
    how: u32,
) -> c_int {
    // SAFETY: the caller's contract.
    let Some(ep) = (unsafe { ep_ref(ep) }) else { return -1 };
    if buf.is_null() && len > 0 {
        return -1;
    }
    // SAFETY: the caller's contract.
    let source = (!src.is_null()).then(|| addr_from(unsafe { &*(src as *const [u8; ADDR_LEN]) }));
    let ok = guard(false, || {
        ep.recv(source, buf as usize, len, tag, ignore, context as usize, flags, wanted, how)
    });
    if ok {
        0
    } else {
        -1
    }
}

/// Cancels the receive started with `context`: 0 if it completes as cancelled, -1 if there is
/// none to cancel.
///
/// # Safety
/// `ep` is an open endpoint.
#[no_mangle]
pub unsafe extern "C" fn lanbus_fi_cancel(ep: *const Endpoint, context: *mut c_void) -> c_int {
    // SAFETY: the caller's contract.
    let Some(ep) = (unsafe { ep_ref(ep) }) else { return -1 };
    if guard(false, || ep.cancel(context as usize)) {
        0
    } else {
        -1
    }
}

/// Makes progress and moves up to `max` successful completions to `out`: their number, or -1
/// when the next completion is an error.
///
/// # Safety
/// `ep` is an open endpoint; `out` points to `max` writable entries.
#[no_mangle]
pub unsafe extern "C" fn lanbus_fi_read(ep: *const Endpoint, out: *mut LbCompletion, max: usize) -> isize {
    // SAFETY: the caller's contract.
    let Some(ep) = (unsafe { ep_ref(ep) }) else { return 0 };
    if out.is_null() || max == 0 {
        return 0;
    }
    // SAFETY: the caller's contract.
    let out = unsafe { std::slice::from_raw_parts_mut(out, max) };
    match guard(Some(0), || ep.read(out)) {
        Some(n) => n as isize,
        None => -1,
    }
}

/// Moves the error completion at the head of the queue to `out`: 1, or 0 if there is none.
///
/// # Safety
/// `ep` is an open endpoint; `out` points to a writable entry.
#[no_mangle]
pub unsafe extern "C" fn lanbus_fi_read_error(ep: *const Endpoint, out: *mut LbCompletion) -> c_int {
    // SAFETY: the caller's contract.
    let Some(ep) = (unsafe { ep_ref(ep) }) else { return 0 };
    match guard(None, || ep.read_error()) {
        Some(c) if !out.is_null() => {
            // SAFETY: the caller's contract.
            unsafe { out.write(c) };
            1
        }
        _ => 0,
    }
}

#[cfg(libfabric)]
extern "C" {
    fn lanbus_fi_provider() -> *mut c_void;
}

/// libfabric's entry point for a provider it loads from `FI_PROVIDER_PATH` (exported from
/// Rust so that the library exports it; the provider itself is in `c/provider.c`).
#[cfg(libfabric)]
#[no_mangle]
pub extern "C" fn fi_prov_ini() -> *mut c_void {
    // SAFETY: a C function without arguments returning a pointer to a static.
    unsafe { lanbus_fi_provider() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rank_picks_a_socket_or_port() {
        assert_eq!(mode_from(None, None, 3), Ok(Mode::Daemon(DEFAULT_DAEMON.into())));
        assert_eq!(mode_from(None, Some("/a,/b"), 3), Ok(Mode::Daemon("/b".into())));
        assert_eq!(mode_from(Some("afpacket:eth1"), None, 3), Ok(Mode::Direct("afpacket:eth1".into())));
        assert_eq!(
            mode_from(Some("afpacket:a,rx=v2;afpacket:b,rx=v2"), None, 3),
            Ok(Mode::Direct("afpacket:b,rx=v2".into()))
        );
        assert!(mode_from(Some("x"), Some("y"), 0).unwrap_err().contains("not both"));
        assert!(mode_from(None, Some(" , "), 0).unwrap_err().contains("empty"));
    }

    #[test]
    fn addresses_round_trip() {
        let a = Addr { mac: MacAddr([2, 0, 0, 0, 0, 9]), id: 513 };
        assert_eq!(addr_from(&addr_bytes(a)), a);
    }
}
