//! `liblanbus_sock.so`: unmodified programs' IP sockets through the lanbus TCP/IP stack server.
//!
//! Layer: stack (the program's side, below its libc calls). Loaded with
//! `LD_PRELOAD=liblanbus_sock.so`, it takes the socket calls of a program: an `AF_INET` or
//! `AF_INET6` stream or datagram socket goes to `lanbus stackd` (at `$LANBUS_STACK_SOCKET`, default
//! `/tmp/lanbus-stackd.sock`) unless it is bound or connected to a loopback address, which stays
//! with the kernel; every other socket and descriptor goes to libc untouched.
//!
//! How descriptors stay honest: each lanbus socket is backed by a real descriptor, a
//! placeholder, so its number is the kernel's to give and `poll`, `select` and `epoll` work
//! across mixed descriptors without being intercepted. The placeholder is one end of a Unix
//! stream socket pair whose other end is the library's. It is readable exactly when the socket
//! has data, a connection to accept, a datagram, its end or an error (a byte waits in it from the
//! library's end; the client library's reader thread signals arrivals; each read re-checks). It
//! is writable exactly when a write would take bytes: while a stream has no send credit left,
//! the library fills the placeholder's small send buffer, and when credit returns it drains it,
//! which wakes `EPOLLOUT` waiters, level- and edge-triggered. A socket is decided at its first
//! `bind` or `connect`: to a loopback address the placeholder is replaced (`dup2`) by a kernel
//! socket with the options set so far.
//!
//! Semantics kept: blocking and non-blocking (`O_NONBLOCK`, `SOCK_NONBLOCK`, `FIONBIO`,
//! `MSG_DONTWAIT`) reads give `EAGAIN`; a non-blocking write takes what the send credit allows
//! (a short count) or gives `EAGAIN`, and a blocking one waits for credit without holding the
//! socket (another thread may read or close it meanwhile); a non-blocking `connect` completes
//! before it returns (0); errors are Linux's (`ECONNREFUSED`, `ECONNRESET`, `EPIPE`,
//! `ETIMEDOUT`, `EADDRINUSE`).
//! `dup`, `dup2`, `dup3` and `F_DUPFD` share the socket.
//!
//! Sockets survive `fork` as the kernel's do: the child holds every lanbus socket the parent
//! held, and a socket ends (FIN for a connection) only when the last process holding it closes
//! it or exits. `fork` is taken over for this: the parent first asks the server for a fork
//! ticket, which holds one more reference to each of its sockets; the child, on its first call
//! on a lanbus socket (any call, `close` and `epoll_ctl` too), attaches anew (the parent's rings stay the
//! parent's) and claims the ticket with its secret, which only the parent and its child know. A
//! child that never touches its lanbus sockets keeps them until it ends. A connection shared by
//! several processes works in whichever uses it: its data goes to the process that last waited
//! to read it (bytes that had reached a process before are that process's to read); a shared
//! listener hands each connection to exactly one process waiting in `accept` (a process that
//! does not accept takes none). Not inherited: zero-copy connections (not made by this
//! library), and sockets across `exec`: the new program cannot use them, close-on-exec or not,
//! so the process lets go of them at the `exec` (`execve`, `execv`, `execvp` and `execvpe` are
//! taken over for this; a program that execs by other means keeps them until it ends).
//! Options: those the stack does already (`SO_REUSEADDR`, `SO_KEEPALIVE`, `TCP_NODELAY`,
//! `TCP_CORK` on a connection) or that are hints with no effect on what a program reads or
//! writes (buffer sizes, `TCP_DEFER_ACCEPT`, keep-alive timings, `IP_TOS`) are taken; one asking for behaviour the
//! stack lacks (`IPV6_V6ONLY`, `SO_LINGER` on, `SO_RCVTIMEO`/`SO_SNDTIMEO` non-zero,
//! `SO_BROADCAST`) fails with `EOPNOTSUPP`, and any other with `ENOPROTOOPT`, each named once
//! per process on stderr (`getsockopt` answers what Linux would for a default socket). So do
//! `recv` flags it cannot honour (`MSG_PEEK`, `MSG_OOB`).
//! An `AF_INET6` socket is dual-stack as Linux's are by default: it reaches IPv4 peers through
//! IPv4-mapped addresses (`::ffff:a.b.c.d`), and a listener on `::` takes both families
//! (`IPV6_V6ONLY` set to 1 is refused). IPv6 needs an IPv6 address on the server
//! (`lanbus stackd --ip6`); without one, connecting to an IPv6 peer fails with `ENETUNREACH`.
//!
//! The exported functions take variadic arguments in two cases (`fcntl`, `ioctl`): they are
//! declared with one fixed third argument, which is where the x86-64 System V convention puts the
//! first variadic integer argument.
#![allow(clippy::missing_safety_doc)]

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

use lanbus_stack::client::{StackClient, TcpListener, TcpStream, UdpSocket};
use lanbus_stack::CopyUnit;
use libc::{c_int, c_void, size_t, sockaddr, socklen_t, ssize_t};

/// Descriptors below this are tracked in the bitmap; above it, nothing is ours.
const MAX_FD: usize = 1 << 16;

/// Whether descriptor n is a lanbus socket: the fast path of every call.
static MARK: [AtomicBool; MAX_FD] = [const { AtomicBool::new(false) }; MAX_FD];

fn is_ours(fd: c_int) -> bool {
    // Relaxed: set before the descriptor number is returned to the program, which is the only
    // way another thread can learn it.
    usize::try_from(fd).ok().and_then(|i| MARK.get(i)).is_some_and(|m| m.load(Ordering::Relaxed))
}

fn mark(fd: c_int, on: bool) {
    if let Some(m) = usize::try_from(fd).ok().and_then(|i| MARK.get(i)) {
        m.store(on, Ordering::Relaxed);
    }
}

/// libc's own functions, found behind this library.
macro_rules! real {
    ($name:ident: fn($($arg:ty),*) -> $ret:ty) => {{
        static F: OnceLock<usize> = OnceLock::new();
        let addr = *F.get_or_init(|| lookup(concat!(stringify!($name), "\0")));
        #[allow(unused_unsafe)]
        // SAFETY: dlsym returned libc's function of this name, whose C signature this is.
        let f = unsafe { std::mem::transmute::<usize, unsafe extern "C" fn($($arg),*) -> $ret>(addr) };
        f
    }};
}

/// The address of the next definition of `name` (NUL-terminated) after this library's.
fn lookup(name: &str) -> usize {
    // SAFETY: a NUL-terminated name; RTLD_NEXT finds the next definition after ours.
    let addr = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr().cast()) } as usize;
    assert!(addr != 0, "libc has no {name}");
    addr
}

fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno.
    unsafe { *libc::__errno_location() = e };
}

fn fail<T: From<i8>>(e: c_int) -> T {
    set_errno(e);
    T::from(-1)
}

fn io_fail<T: From<i8>>(e: &std::io::Error) -> T {
    fail(match e.raw_os_error() {
        Some(n) => n,
        None if e.kind() == std::io::ErrorKind::WouldBlock => libc::EAGAIN,
        None if e.kind() == std::io::ErrorKind::TimedOut => libc::ETIMEDOUT,
        None => libc::EIO,
    })
}

/// A socket's state behind a mutex that knows which thread holds it, so that a path that would
/// take it a second time on the same thread (and deadlock in the futex) is caught: in debug
/// builds by an assertion, and in every build by the structure of the calls, each of which takes
/// the lock once per look and drops it before waiting or calling back into the library.
struct StateLock {
    state: Mutex<State>,
    /// The id of the thread holding `state` (0: none).
    owner: AtomicU64,
}

struct StateGuard<'a> {
    guard: MutexGuard<'a, State>,
    owner: &'a AtomicU64,
}

/// A number for this thread, never 0.
fn thread_number() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local!(static ME: u64 = NEXT.fetch_add(1, Ordering::Relaxed));
    ME.with(|n| *n)
}

impl StateLock {
    fn new(state: State) -> StateLock {
        StateLock { state: Mutex::new(state), owner: AtomicU64::new(0) }
    }

    /// The state, unless another thread holds it (one that held it at a `fork` never lets go
    /// in the child).
    fn try_lock(&self) -> Option<StateGuard<'_>> {
        let guard = match self.state.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        // Relaxed: as in `lock`.
        self.owner.store(thread_number(), Ordering::Relaxed);
        Some(StateGuard { guard, owner: &self.owner })
    }

    fn lock(&self) -> StateGuard<'_> {
        let me = thread_number();
        // Relaxed: only this thread ever stores its own number, so reading it back needs no order.
        debug_assert_ne!(
            self.owner.load(Ordering::Relaxed),
            me,
            "liblanbus_sock: a socket's state locked twice on one thread"
        );
        let guard = lock(&self.state);
        // Relaxed: the mutex orders everything the guard protects; this is a debugging aid.
        self.owner.store(me, Ordering::Relaxed);
        StateGuard { guard, owner: &self.owner }
    }
}

impl Drop for StateGuard<'_> {
    fn drop(&mut self) {
        // Relaxed: as in `lock`; cleared while the mutex is still held.
        self.owner.store(0, Ordering::Relaxed);
    }
}

impl std::ops::Deref for StateGuard<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        &self.guard
    }
}

impl std::ops::DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.guard
    }
}

enum State {
    /// Made, not yet bound or connected.
    Fresh {
        stream: bool,
        bound: Option<SocketAddr>,
        opts: Vec<(c_int, c_int, Vec<u8>)>,
    },
    Listening(TcpListener),
    Connected(TcpStream),
    Udp {
        sock: UdpSocket,
        peer: Option<SocketAddr>,
    },
}

struct Sock {
    /// Dropped only by the process that holds the socket: in a child that could not adopt it,
    /// its objects belong to the parent's attachment and are left alone.
    state: ManuallyDrop<StateLock>,
    /// `AF_INET` or `AF_INET6`: how addresses are shown to the program.
    domain: c_int,
    nonblock: AtomicBool,
    /// A descriptor of the placeholder of our own (the program may close its numbers): one end
    /// of a Unix stream socket pair.
    signal: RawFd,
    /// The pair's other end, the library's alone.
    peer: RawFd,
    /// The placeholder is kept from polling writable (no send credit).
    out_blocked: AtomicBool,
    /// Something arrived since the readiness was last computed.
    pending: AtomicBool,
    /// Serialises recomputing the readiness.
    sync: Mutex<()>,
    /// The process whose attachment the socket's objects belong to.
    pid: AtomicU32,
    /// Other processes may hold the socket too (it went through a `fork`): waits tell the server.
    shared: AtomicBool,
    /// A non-blocking call told the server this process waits, and nothing arrived since.
    wanted: AtomicBool,
}

impl Drop for Sock {
    fn drop(&mut self) {
        if self.pid.load(Ordering::Relaxed) == std::process::id() {
            // SAFETY: dropped once, here, and never used after.
            unsafe { ManuallyDrop::drop(&mut self.state) };
        }
        // SAFETY: our own descriptors, closed once.
        unsafe {
            real!(close: fn(c_int) -> c_int)(self.signal);
            real!(close: fn(c_int) -> c_int)(self.peer);
        }
    }
}

struct Global {
    client: Mutex<Option<StackClient>>,
    socks: Mutex<HashMap<c_int, Arc<Sock>>>,
    by_handle: Mutex<HashMap<u32, Weak<Sock>>>,
}

fn global() -> &'static Global {
    static G: OnceLock<Global> = OnceLock::new();
    G.get_or_init(|| Global {
        client: Mutex::new(None),
        socks: Mutex::new(HashMap::new()),
        by_handle: Mutex::new(HashMap::new()),
    })
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The process's attachment to the stack server, made on first use (and anew after `fork`).
fn client() -> Result<StackClient, c_int> {
    let g = global();
    let mut c = lock(&g.client);
    if let Some(client) = c.as_ref().filter(|_| attached_pid() == std::process::id()) {
        return Ok(client.clone());
    }
    if let Some(parents) = c.take() {
        // Inherited through a fork: its socket is the parent's to close (the server sees the
        // parent's end by it), and its state may be locked for good.
        parents.abandon_in_child();
    }
    let (path, unit) = settings();
    let client = StackClient::attach(std::path::Path::new(path), *unit).map_err(|e| {
        eprintln!("liblanbus_sock: cannot attach to the stack server at {}: {e}", path.to_string_lossy());
        libc::ENETDOWN
    })?;
    client.set_notify(|h| {
        let sock = lock(&global().by_handle).get(&h).and_then(Weak::upgrade);
        if let Some(sock) = sock {
            sock.wanted.store(false, Ordering::Relaxed);
            sock.pending.store(true, Ordering::Release);
            sock.signal(true);
        }
    });
    client.set_credit_notify(|h| {
        let sock = lock(&global().by_handle).get(&h).and_then(Weak::upgrade);
        // Credit came back (how much, this function cannot look: it runs with the client's lock
        // held): a writer that found none tries again, and finds out.
        // SeqCst: pairs with the store in `Sock::sync_with`.
        if let Some(sock) = sock.filter(|s| s.out_blocked.load(Ordering::SeqCst)) {
            sock.set_writable(true);
        }
    });
    client.spawn_reader().map_err(|_| libc::ENOMEM)?;
    set_attached_pid(std::process::id());
    *c = Some(client.clone());
    Ok(client)
}

/// Where the stack server is and the copy unit, read from the environment once: a forked child
/// attaches where its parent did even if the program emptied its environment before forking
/// (nginx's master does for its workers).
fn settings() -> &'static (std::ffi::OsString, CopyUnit) {
    static SETTINGS: OnceLock<(std::ffi::OsString, CopyUnit)> = OnceLock::new();
    SETTINGS.get_or_init(|| {
        let path =
            std::env::var_os("LANBUS_STACK_SOCKET").unwrap_or_else(|| "/tmp/lanbus-stackd.sock".into());
        let unit =
            std::env::var("LANBUS_STACK_UNIT").ok().and_then(|u| u.parse().ok()).unwrap_or(CopyUnit::DEFAULT);
        (path, unit)
    })
}

/// Reads the settings as the library loads, before the program can change its environment.
#[used]
#[link_section = ".init_array"]
static READ_SETTINGS: extern "C" fn() = {
    extern "C" fn read_settings() {
        settings();
    }
    read_settings
};

static ATTACHED_PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

fn attached_pid() -> u32 {
    ATTACHED_PID.load(Ordering::Relaxed)
}

fn set_attached_pid(pid: u32) {
    ATTACHED_PID.store(pid, Ordering::Relaxed);
}

/// Reads `fd` (non-blocking) until it has nothing more.
fn drain(fd: RawFd) {
    let mut buf = [0u8; 4096];
    // SAFETY: reads into a live buffer of its length.
    while unsafe { real!(read: fn(c_int, *mut c_void, size_t) -> ssize_t)(fd, buf.as_mut_ptr().cast(), 4096) }
        > 0
    {}
}

impl Sock {
    /// Makes the placeholder readable (`on`) or not: a byte from the library's end of the pair
    /// waits in the placeholder's receive queue exactly while it should poll readable.
    fn signal(&self, on: bool) {
        if on {
            let b = 1u8;
            // SAFETY: writes one byte from a live u8 to our end (non-blocking: a full queue is
            // readable already).
            unsafe {
                real!(write: fn(c_int, *const c_void, size_t) -> ssize_t)(
                    self.peer,
                    (&b as *const u8).cast(),
                    1,
                )
            };
        } else {
            drain(self.signal);
        }
    }

    /// Makes the placeholder writable (`on`) or not. The placeholder's own sends go to the
    /// library's end and stay there: while they fill its (small) send buffer it polls not
    /// writable, and reading them back out makes it writable, which wakes `EPOLLOUT` waiters,
    /// level- and edge-triggered alike.
    fn set_writable(&self, on: bool) {
        if on {
            drain(self.peer);
        } else {
            let filler = [0u8; 4096];
            // SAFETY: writes from a live buffer of its length to our non-blocking placeholder.
            while unsafe {
                real!(write: fn(c_int, *const c_void, size_t) -> ssize_t)(
                    self.signal,
                    filler.as_ptr().cast(),
                    4096,
                )
            } > 0
            {}
        }
    }

    /// Recomputes whether the placeholder should poll readable and writable.
    fn sync(&self) {
        self.sync_with(false);
    }

    /// After a write found no send credit: as `sync`, but the placeholder stops polling
    /// writable even if credit came back meanwhile, and starts again at once if so; an
    /// edge-triggered waiter is woken by every return of room after an `EAGAIN`.
    fn sync_blocked(&self) {
        self.sync_with(true);
    }

    fn sync_with(&self, blocked: bool) {
        let _g = lock(&self.sync);
        self.pending.store(false, Ordering::Release);
        let (ready, writable) = match &*self.state.lock() {
            State::Fresh { .. } => (false, true),
            State::Listening(l) => (l.ready() || l.pending(), true),
            State::Connected(s) => (s.readiness().1, s.writable()),
            State::Udp { sock, .. } => (sock.ready(), true),
        };
        if ready {
            self.signal(true);
        } else {
            self.signal(false);
            // An arrival between the check and the drain: make it readable again.
            if self.pending.load(Ordering::Acquire) {
                self.signal(true);
            }
        }
        if !writable || blocked {
            // SeqCst: ordered before the fill and the second look below, against the load in
            // the notify function, which runs after the credit it reports was counted: either
            // this second look sees the credit, or that function sees the flag and makes the
            // placeholder writable after the fill.
            self.out_blocked.store(true, Ordering::SeqCst);
            self.set_writable(false);
            let writable = match &*self.state.lock() {
                State::Connected(s) => s.writable(),
                _ => true,
            };
            if writable {
                self.out_blocked.store(false, Ordering::SeqCst);
                self.set_writable(true);
            }
        } else if self.out_blocked.swap(false, Ordering::SeqCst) {
            self.set_writable(true);
        }
    }

    fn register(self: &Arc<Self>, handle: u32) {
        lock(&global().by_handle).insert(handle, Arc::downgrade(self));
    }
}

fn sock_of(fd: c_int) -> Option<Arc<Sock>> {
    if !is_ours(fd) {
        return None;
    }
    adopt_inherited();
    let s = lock(&global().socks).get(&fd).cloned()?;
    Some(s)
}

impl Sock {
    /// Before this process waits on a socket (or tells the program to): if other processes
    /// hold it too, the server is told to send its arrivals here. A non-blocking caller says so
    /// once until something arrives; a blocking one at each look.
    fn should_want(&self, blocking: bool) -> bool {
        self.shared.load(Ordering::Relaxed) && (blocking || !self.wanted.swap(true, Ordering::Relaxed))
    }
}

/// The fork ticket this process (a child) has not claimed yet: 0 when none.
static PENDING_TICKET: AtomicU64 = AtomicU64::new(0);
/// The process `PENDING_TICKET` is for: a `vfork` child sees the parent's memory, ticket and
/// all, and must not claim it (nor attach in the parent's memory).
static PENDING_PID: AtomicU32 = AtomicU32::new(0);

/// In a forked child, on its first call on a lanbus socket: attaches anew and takes over the
/// sockets the parent's fork ticket holds for it. A socket whose state another thread of the
/// parent held at the fork, or all of them when the claim fails, answer `EBADF` from then on.
fn adopt_inherited() {
    // Acquire: pairs with the store in `fork`, made before the child runs anything else.
    if PENDING_TICKET.load(Ordering::Acquire) == 0
        || PENDING_PID.load(Ordering::Relaxed) != std::process::id()
    {
        return;
    }
    static ADOPTING: Mutex<()> = Mutex::new(());
    let _one = lock(&ADOPTING);
    let token = PENDING_TICKET.swap(0, Ordering::AcqRel);
    if token == 0 {
        return;
    }
    let me = std::process::id();
    let mut socks: Vec<Arc<Sock>> = Vec::new();
    for s in lock(&global().socks).values() {
        if !socks.iter().any(|x| Arc::ptr_eq(x, s)) {
            socks.push(s.clone());
        }
    }
    let conns: Vec<u32> = socks
        .iter()
        .filter_map(|s| match &*s.state.try_lock()? {
            State::Connected(c) => Some(c.handle()),
            _ => None,
        })
        .collect();
    let claimed = client().ok().and_then(|c| c.adopt(token, &conns).ok().map(|_| c));
    if claimed.is_none() {
        eprintln!("liblanbus_sock: the sockets inherited through fork could not be taken over");
    }
    for sock in socks {
        let Some(mut st) = sock.state.try_lock() else { continue };
        let new = match (&*st, &claimed) {
            (State::Fresh { .. }, _) => None,
            (State::Connected(c), Some(client)) => {
                Some(State::Connected(client.adopted_stream(c.handle(), c.local_addr(), c.peer_addr())))
            }
            (State::Listening(l), Some(client)) => {
                Some(State::Listening(client.adopted_listener(l.handle(), l.local_addr())))
            }
            (State::Udp { sock: u, peer }, Some(client)) => {
                Some(State::Udp { sock: client.adopted_udp(u.handle(), u.local_addr()), peer: *peer })
            }
            // Not taken over: the socket stays the parent's (EBADF here).
            (_, None) => continue,
        };
        if let Some(new) = new {
            // The parent's objects: dropping them would use the parent's rings.
            std::mem::forget(std::mem::replace(&mut *st, new));
        }
        drop(st);
        sock.pid.store(me, Ordering::Relaxed);
        sock.shared.store(true, Ordering::Relaxed);
        sock.sync();
    }
}

/// A new placeholder descriptor and its socket.
fn new_sock(domain: c_int, stream: bool, flags: c_int) -> c_int {
    let mut pair = [-1; 2];
    let cloexec = if flags & libc::SOCK_CLOEXEC != 0 { libc::SOCK_CLOEXEC } else { 0 };
    // SAFETY: socketpair writes two descriptors into the live array.
    let rc = unsafe {
        real!(socketpair: fn(c_int, c_int, c_int, *mut c_int) -> c_int)(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | cloexec,
            0,
            pair.as_mut_ptr(),
        )
    };
    if rc < 0 {
        return -1;
    }
    let [fd, peer] = pair;
    // The smallest send buffer the kernel allows: a few writes fill it (see `set_writable`).
    let small: c_int = 1;
    // SAFETY: an int option from a live int, on our own socket.
    unsafe {
        real!(setsockopt: fn(c_int, c_int, c_int, *const c_void, socklen_t) -> c_int)(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&small as *const c_int).cast(),
            4,
        )
    };
    // SAFETY: duplicating our fresh descriptors (the library's end close-on-exec too).
    let (signal, peer) = unsafe {
        let signal = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0);
        let p = libc::fcntl(peer, libc::F_DUPFD_CLOEXEC, 0);
        real!(close: fn(c_int) -> c_int)(peer);
        (signal, p)
    };
    if signal < 0 || peer < 0 || fd as usize >= MAX_FD {
        // SAFETY: closing what we just made.
        unsafe {
            for d in [fd, signal, peer] {
                if d >= 0 {
                    real!(close: fn(c_int) -> c_int)(d);
                }
            }
        }
        return fail(libc::EMFILE);
    }
    let sock = Arc::new(Sock {
        state: ManuallyDrop::new(StateLock::new(State::Fresh { stream, bound: None, opts: Vec::new() })),
        domain,
        nonblock: AtomicBool::new(flags & libc::SOCK_NONBLOCK != 0),
        signal,
        peer,
        out_blocked: AtomicBool::new(false),
        pending: AtomicBool::new(false),
        sync: Mutex::new(()),
        pid: AtomicU32::new(std::process::id()),
        shared: AtomicBool::new(false),
        wanted: AtomicBool::new(false),
    });
    lock(&global().socks).insert(fd, sock);
    mark(fd, true);
    fd
}

/// The address a program gave: `sockaddr_in`, or `sockaddr_in6` (an IPv4-mapped one as the IPv4
/// address it stands for).
unsafe fn addr_in(addr: *const sockaddr, len: socklen_t) -> Option<SocketAddr> {
    if addr.is_null() || (len as usize) < std::mem::size_of::<libc::sa_family_t>() {
        return None;
    }
    // SAFETY: the caller's buffer holds at least the family (checked above).
    let family = c_int::from(unsafe { (*addr).sa_family });
    match family {
        libc::AF_INET if len as usize >= std::mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: the buffer holds a sockaddr_in (checked).
            let a = unsafe { &*(addr as *const libc::sockaddr_in) };
            let ip = Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
            Some(SocketAddr::V4(SocketAddrV4::new(ip, u16::from_be(a.sin_port))))
        }
        libc::AF_INET6 if len as usize >= std::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: the buffer holds a sockaddr_in6 (checked).
            let a = unsafe { &*(addr as *const libc::sockaddr_in6) };
            let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
            let port = u16::from_be(a.sin6_port);
            Some(match ip.to_ipv4_mapped() {
                Some(v4) => SocketAddr::V4(SocketAddrV4::new(v4, port)),
                None => SocketAddr::V6(SocketAddrV6::new(ip, port, a.sin6_flowinfo, a.sin6_scope_id)),
            })
        }
        _ => None,
    }
}

/// Writes `a` for a socket of `domain`: an `AF_INET6` socket sees IPv4 peers as IPv4-mapped.
unsafe fn put_addr(domain: c_int, a: SocketAddr, addr: *mut sockaddr, len: *mut socklen_t) {
    if addr.is_null() || len.is_null() {
        return;
    }
    let copy = |bytes: &[u8]| {
        // SAFETY: the caller gave `*len` bytes at `addr`; we copy at most that many, and say how
        // long the whole address is, as the kernel does.
        unsafe {
            let n = (*len as usize).min(bytes.len());
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), addr.cast::<u8>(), n);
            *len = bytes.len() as socklen_t;
        }
    };
    if domain == libc::AF_INET6 {
        let (ip, flowinfo, scope) = match a {
            SocketAddr::V4(v4) => (v4.ip().to_ipv6_mapped(), 0, 0),
            SocketAddr::V6(v6) => (*v6.ip(), v6.flowinfo(), v6.scope_id()),
        };
        let sin6 = libc::sockaddr_in6 {
            sin6_family: libc::AF_INET6 as u16,
            sin6_port: a.port().to_be(),
            sin6_flowinfo: flowinfo,
            sin6_addr: libc::in6_addr { s6_addr: ip.octets() },
            sin6_scope_id: scope,
        };
        // SAFETY: viewing a plain C struct as its bytes.
        copy(unsafe {
            std::slice::from_raw_parts(
                (&sin6 as *const libc::sockaddr_in6).cast::<u8>(),
                std::mem::size_of::<libc::sockaddr_in6>(),
            )
        });
    } else {
        let ip = match a.ip() {
            IpAddr::V4(v4) => v4,
            IpAddr::V6(v6) => v6.to_ipv4_mapped().unwrap_or(Ipv4Addr::UNSPECIFIED),
        };
        let sin = libc::sockaddr_in {
            sin_family: libc::AF_INET as u16,
            sin_port: a.port().to_be(),
            sin_addr: libc::in_addr { s_addr: u32::from(ip).to_be() },
            sin_zero: [0; 8],
        };
        // SAFETY: viewing a plain C struct as its bytes.
        copy(unsafe {
            std::slice::from_raw_parts(
                (&sin as *const libc::sockaddr_in).cast::<u8>(),
                std::mem::size_of::<libc::sockaddr_in>(),
            )
        });
    }
}

/// "No address" in a socket's family (shown as `0.0.0.0:0` or `[::]:0`).
fn nowhere(domain: c_int) -> SocketAddr {
    if domain == libc::AF_INET6 {
        SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, 0, 0, 0))
    } else {
        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))
    }
}

/// Replaces the placeholder `fd` by a kernel socket (for loopback), replaying the options.
fn to_kernel(fd: c_int, sock: &Sock, stream: bool, opts: &[(c_int, c_int, Vec<u8>)]) -> Result<(), c_int> {
    let ty = if stream { libc::SOCK_STREAM } else { libc::SOCK_DGRAM };
    // SAFETY: plain socket(2).
    let k =
        unsafe { real!(socket: fn(c_int, c_int, c_int) -> c_int)(sock.domain, ty | libc::SOCK_CLOEXEC, 0) };
    if k < 0 {
        // SAFETY: reading errno.
        return Err(unsafe { *libc::__errno_location() });
    }
    for (level, name, value) in opts {
        // SAFETY: the option bytes the program gave, with their length.
        unsafe {
            real!(setsockopt: fn(c_int, c_int, c_int, *const c_void, socklen_t) -> c_int)(
                k,
                *level,
                *name,
                value.as_ptr().cast(),
                value.len() as socklen_t,
            )
        };
    }
    if sock.nonblock.load(Ordering::Relaxed) {
        // SAFETY: fcntl on our new socket.
        unsafe {
            real!(fcntl: fn(c_int, c_int, libc::c_ulong) -> c_int)(k, libc::F_SETFL, libc::O_NONBLOCK as _)
        };
    }
    // SAFETY: the placeholder number now names the kernel socket; CLOEXEC as the placeholder had.
    let cloexec = unsafe { real!(fcntl: fn(c_int, c_int, libc::c_ulong) -> c_int)(fd, libc::F_GETFD, 0) };
    let flags = if cloexec > 0 && cloexec & libc::FD_CLOEXEC != 0 { libc::O_CLOEXEC } else { 0 };
    // SAFETY: dup3 of our descriptor onto the program's number, then closing ours.
    unsafe {
        if real!(dup3: fn(c_int, c_int, c_int) -> c_int)(k, fd, flags) < 0 {
            let e = *libc::__errno_location();
            real!(close: fn(c_int) -> c_int)(k);
            return Err(e);
        }
        real!(close: fn(c_int) -> c_int)(k);
    }
    mark(fd, false);
    lock(&global().socks).remove(&fd);
    Ok(())
}

fn usable(sock: &Sock) -> Result<(), c_int> {
    if sock.pid.load(Ordering::Relaxed) != std::process::id() {
        return Err(libc::EBADF);
    }
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn socket(domain: c_int, ty: c_int, protocol: c_int) -> c_int {
    let kind = ty & !(libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC);
    let ok_proto = |p: c_int| protocol == 0 || protocol == p;
    if (domain == libc::AF_INET || domain == libc::AF_INET6)
        && ((kind == libc::SOCK_STREAM && ok_proto(libc::IPPROTO_TCP))
            || (kind == libc::SOCK_DGRAM && ok_proto(libc::IPPROTO_UDP)))
    {
        return new_sock(domain, kind == libc::SOCK_STREAM, ty);
    }
    // SAFETY: passing the program's arguments through.
    unsafe { real!(socket: fn(c_int, c_int, c_int) -> c_int)(domain, ty, protocol) }
}

#[no_mangle]
pub unsafe extern "C" fn bind(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    let Some(sock) = sock_of(fd) else {
        // SAFETY: passing through.
        return unsafe { real!(bind: fn(c_int, *const sockaddr, socklen_t) -> c_int)(fd, addr, len) };
    };
    if let Err(e) = usable(&sock) {
        return fail(e);
    }
    // SAFETY: the program's address and length.
    let Some(a) = (unsafe { addr_in(addr, len) }) else { return fail(libc::EINVAL) };
    let mut st = sock.state.lock();
    let State::Fresh { stream, bound, opts } = &mut *st else { return fail(libc::EINVAL) };
    if a.ip().is_loopback() {
        let (stream, opts) = (*stream, std::mem::take(opts));
        drop(st);
        if let Err(e) = to_kernel(fd, &sock, stream, &opts) {
            return fail(e);
        }
        // SAFETY: now a kernel socket.
        return unsafe { real!(bind: fn(c_int, *const sockaddr, socklen_t) -> c_int)(fd, addr, len) };
    }
    if !*stream {
        let client = match client() {
            Ok(c) => c,
            Err(e) => return fail(e),
        };
        match client.bind_udp(a.port()) {
            Ok(u) => {
                let h = u.handle();
                *st = State::Udp { sock: u, peer: None };
                drop(st);
                sock.register(h);
                return 0;
            }
            Err(e) => return io_fail(&e),
        }
    }
    *bound = Some(a);
    0
}

#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    let Some(sock) = sock_of(fd) else {
        // SAFETY: passing through.
        return unsafe { real!(listen: fn(c_int, c_int) -> c_int)(fd, backlog) };
    };
    if let Err(e) = usable(&sock) {
        return fail(e);
    }
    let mut st = sock.state.lock();
    if let State::Listening(_) = &*st {
        // Listening already: Linux takes a second `listen` as a new backlog (nginx gives its
        // configured one so), and the stack's listener keeps the backlog it has.
        return 0;
    }
    let State::Fresh { stream: true, bound, .. } = &*st else { return fail(libc::EOPNOTSUPP) };
    let port = bound.map_or(0, |b| b.port());
    let client = match client() {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    match client.listen(port, backlog.clamp(1, 128) as u16) {
        Ok(l) => {
            let h = l.handle();
            *st = State::Listening(l);
            drop(st);
            sock.register(h);
            sock.sync();
            0
        }
        Err(e) => io_fail(&e),
    }
}

#[no_mangle]
pub unsafe extern "C" fn accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int {
    let Some(sock) = sock_of(fd) else {
        // SAFETY: passing through.
        return unsafe {
            real!(accept4: fn(c_int, *mut sockaddr, *mut socklen_t, c_int) -> c_int)(fd, addr, len, flags)
        };
    };
    if let Err(e) = usable(&sock) {
        return fail(e);
    }
    let nonblock = sock.nonblock.load(Ordering::Relaxed);
    // The state lock is taken once per look and never held across a wait: a blocking accept
    // lets another thread close the listener meanwhile.
    // A listener owes a connection per want: a blocking accept asks once (it takes the
    // connection its want brings), lest a want left over hand a connection to a process that
    // has stopped accepting.
    let mut asked = false;
    let result = loop {
        let st = sock.state.lock();
        let State::Listening(l) = &*st else {
            return fail(libc::EINVAL);
        };
        if l.ready() {
            let r = l.accept_timeout(Some(Duration::ZERO));
            // An event loop accepts again when the listener polls readable: asking for the
            // next connection now lets it come straight here, rather than be announced first.
            if nonblock && !l.ready() && !sock.wanted.swap(true, Ordering::Relaxed) {
                let _ = l.want();
            }
            break r;
        }
        // The server hands a listener's connections only to processes that ask: a blocking
        // accept asks once per call; a non-blocking one once until something arrives, and
        // again whenever the server announces one waiting (an earlier want may have been
        // served to an earlier accept).
        let ask = !nonblock || l.pending() || !sock.wanted.swap(true, Ordering::Relaxed);
        if !asked && ask {
            let _ = l.want();
            asked = true;
        }
        drop(st);
        if nonblock {
            sock.sync();
            return fail(libc::EAGAIN);
        }
        wait_readable(sock.signal);
    };
    sock.sync();
    match result {
        Ok((stream, peer)) => {
            let nfd = new_sock(sock.domain, true, flags);
            if nfd < 0 {
                return -1;
            }
            let new = sock_of(nfd).expect("just made");
            let h = stream.handle();
            *new.state.lock() = State::Connected(stream);
            new.register(h);
            new.sync();
            // SAFETY: the program's address buffer.
            unsafe { put_addr(sock.domain, peer, addr, len) };
            nfd
        }
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => fail(libc::EAGAIN),
        Err(e) => io_fail(&e),
    }
}

#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: same contract.
    unsafe { accept4(fd, addr, len, 0) }
}

/// Blocks until the placeholder polls writable (at most 100 ms: the caller looks again).
fn wait_writable(fd: RawFd) {
    let mut p = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
    // SAFETY: one live pollfd.
    unsafe { libc::poll(&mut p, 1, 100) };
}

/// Blocks until the placeholder polls readable.
fn wait_readable(fd: RawFd) {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one live pollfd.
    unsafe { libc::poll(&mut p, 1, 100) };
}

#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    let Some(sock) = sock_of(fd) else {
        // SAFETY: passing through.
        return unsafe { real!(connect: fn(c_int, *const sockaddr, socklen_t) -> c_int)(fd, addr, len) };
    };
    if let Err(e) = usable(&sock) {
        return fail(e);
    }
    // SAFETY: the program's address.
    let Some(to) = (unsafe { addr_in(addr, len) }) else { return fail(libc::EAFNOSUPPORT) };
    let mut st = sock.state.lock();
    match &mut *st {
        State::Fresh { stream, opts, .. } => {
            if to.ip().is_loopback() {
                let (stream, opts) = (*stream, std::mem::take(opts));
                drop(st);
                if let Err(e) = to_kernel(fd, &sock, stream, &opts) {
                    return fail(e);
                }
                // SAFETY: now a kernel socket.
                return unsafe {
                    real!(connect: fn(c_int, *const sockaddr, socklen_t) -> c_int)(fd, addr, len)
                };
            }
            let client = match client() {
                Ok(c) => c,
                Err(e) => return fail(e),
            };
            if !*stream {
                return match client.bind_udp(0) {
                    Ok(u) => {
                        let h = u.handle();
                        *st = State::Udp { sock: u, peer: Some(to) };
                        drop(st);
                        sock.register(h);
                        0
                    }
                    Err(e) => io_fail(&e),
                };
            }
            match client.connect(to) {
                Ok(s) => {
                    let h = s.handle();
                    *st = State::Connected(s);
                    drop(st);
                    sock.register(h);
                    sock.sync();
                    0
                }
                Err(e) => io_fail(&e),
            }
        }
        State::Udp { peer, .. } => {
            *peer = Some(to);
            0
        }
        State::Connected(_) => fail(libc::EISCONN),
        _ => fail(libc::EINVAL),
    }
}

/// Reads into `buf` from a lanbus socket; `from` gets a datagram's sender.
fn sock_read(sock: &Sock, buf: &mut [u8], flags: c_int, from: Option<&mut SocketAddr>) -> ssize_t {
    if let Err(e) = usable(sock) {
        return fail(e);
    }
    if flags & libc::MSG_PEEK != 0 {
        return unsupported("recv with MSG_PEEK", libc::EOPNOTSUPP);
    }
    if flags & libc::MSG_OOB != 0 {
        return unsupported("recv with MSG_OOB", libc::EOPNOTSUPP);
    }
    let nonblock = sock.nonblock.load(Ordering::Relaxed) || flags & libc::MSG_DONTWAIT != 0;
    let result = loop {
        let mut st = sock.state.lock();
        let r = match &mut *st {
            State::Connected(s) => {
                let (_, ready) = s.readiness();
                if !ready && sock.should_want(!nonblock) {
                    let _ = s.want();
                }
                if !ready && !nonblock {
                    drop(st);
                    wait_readable(sock.signal);
                    continue;
                }
                s.set_read_timeout(Some(Duration::ZERO));
                std::io::Read::read(s, buf).map(|n| (n, None))
            }
            State::Udp { sock: u, .. } => {
                let ready = u.ready();
                if !ready && sock.should_want(!nonblock) {
                    let _ = u.want();
                }
                if !ready && !nonblock {
                    drop(st);
                    wait_readable(sock.signal);
                    continue;
                }
                u.recv_from(buf, Some(Duration::ZERO)).map(|(n, a)| (n, Some(a)))
            }
            _ => Err(std::io::Error::from_raw_os_error(libc::ENOTCONN)),
        };
        break r;
    };
    sock.sync();
    match result {
        Ok((n, a)) => {
            if let (Some(out), Some(a)) = (from, a) {
                *out = a;
            }
            n as ssize_t
        }
        Err(e) => io_fail(&e),
    }
}

/// Writes `buf` to a lanbus socket (`to`: a datagram's destination). A stream takes what its
/// send credit allows: a non-blocking write takes that much (a short count) or answers `EAGAIN`;
/// a blocking one waits for credit until all is written, with the socket's state unlocked
/// meanwhile (a reader or `close` on another thread goes on).
fn sock_write(sock: &Sock, buf: &[u8], to: Option<SocketAddr>, flags: c_int) -> ssize_t {
    if let Err(e) = usable(sock) {
        return fail(e);
    }
    let nonblock = sock.nonblock.load(Ordering::Relaxed) || flags & libc::MSG_DONTWAIT != 0;
    let mut written = 0;
    let mut st = sock.state.lock();
    match &mut *st {
        State::Connected(_) => loop {
            let State::Connected(s) = &mut *st else {
                // Closed under us by another thread (its number reused for something else).
                return if written > 0 { written as ssize_t } else { fail(libc::EBADF) };
            };
            match s.try_write(&buf[written..]) {
                Ok(n) => {
                    written += n;
                    if written == buf.len() || nonblock {
                        drop(st);
                        if written < buf.len() {
                            // Out of credit: the placeholder stops polling writable.
                            sock.sync_blocked();
                        }
                        return written as ssize_t;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    drop(st);
                    sock.sync_blocked();
                    if nonblock {
                        return if written > 0 { written as ssize_t } else { fail(libc::EAGAIN) };
                    }
                    wait_writable(sock.signal);
                    st = sock.state.lock();
                }
                Err(e) => return if written > 0 { written as ssize_t } else { io_fail(&e) },
            }
        },
        State::Udp { sock: u, peer } => match to.or(*peer) {
            Some(to) => match u.send_to(buf, to) {
                Ok(n) => n as ssize_t,
                Err(e) => io_fail(&e),
            },
            None => fail(libc::EDESTADDRREQ),
        },
        _ => fail(libc::ENOTCONN),
    }
}

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, count: size_t) -> ssize_t {
    match sock_of(fd) {
        // SAFETY: the program's buffer of `count` bytes.
        Some(s) => sock_read(&s, unsafe { std::slice::from_raw_parts_mut(buf.cast(), count) }, 0, None),
        // SAFETY: passing through.
        None => unsafe { real!(read: fn(c_int, *mut c_void, size_t) -> ssize_t)(fd, buf, count) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn __read_chk(fd: c_int, buf: *mut c_void, count: size_t, _buflen: size_t) -> ssize_t {
    // SAFETY: same contract (the fortified caller checked the length).
    unsafe { read(fd, buf, count) }
}

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, count: size_t, flags: c_int) -> ssize_t {
    match sock_of(fd) {
        // SAFETY: the program's buffer.
        Some(s) => sock_read(&s, unsafe { std::slice::from_raw_parts_mut(buf.cast(), count) }, flags, None),
        // SAFETY: passing through.
        None => unsafe {
            real!(recv: fn(c_int, *mut c_void, size_t, c_int) -> ssize_t)(fd, buf, count, flags)
        },
    }
}

#[no_mangle]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    count: size_t,
    _l: size_t,
    flags: c_int,
) -> ssize_t {
    // SAFETY: same contract.
    unsafe { recv(fd, buf, count, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    count: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    let Some(s) = sock_of(fd) else {
        // SAFETY: passing through.
        return unsafe {
            real!(recvfrom: fn(c_int, *mut c_void, size_t, c_int, *mut sockaddr, *mut socklen_t) -> ssize_t)(
                fd, buf, count, flags, addr, len,
            )
        };
    };
    let mut from = nowhere(libc::AF_INET);
    // SAFETY: the program's buffer.
    let n =
        sock_read(&s, unsafe { std::slice::from_raw_parts_mut(buf.cast(), count) }, flags, Some(&mut from));
    if n >= 0 && from.port() != 0 {
        // SAFETY: the program's address buffer.
        unsafe { put_addr(s.domain, from, addr, len) };
    }
    n
}

#[no_mangle]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    count: size_t,
    _l: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    // SAFETY: same contract.
    unsafe { recvfrom(fd, buf, count, flags, addr, len) }
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, count: size_t) -> ssize_t {
    match sock_of(fd) {
        // SAFETY: the program's buffer.
        Some(s) => sock_write(&s, unsafe { std::slice::from_raw_parts(buf.cast(), count) }, None, 0),
        // SAFETY: passing through.
        None => unsafe { real!(write: fn(c_int, *const c_void, size_t) -> ssize_t)(fd, buf, count) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, count: size_t, flags: c_int) -> ssize_t {
    match sock_of(fd) {
        // SAFETY: the program's buffer.
        Some(s) => sock_write(&s, unsafe { std::slice::from_raw_parts(buf.cast(), count) }, None, flags),
        // SAFETY: passing through.
        None => unsafe {
            real!(send: fn(c_int, *const c_void, size_t, c_int) -> ssize_t)(fd, buf, count, flags)
        },
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    count: size_t,
    flags: c_int,
    addr: *const sockaddr,
    len: socklen_t,
) -> ssize_t {
    match sock_of(fd) {
        Some(s) => {
            // SAFETY: the program's address (may be null for a connected socket).
            let to = unsafe { addr_in(addr, len) };
            // SAFETY: the program's buffer.
            sock_write(&s, unsafe { std::slice::from_raw_parts(buf.cast(), count) }, to, flags)
        }
        // SAFETY: passing through.
        None => unsafe {
            real!(sendto: fn(c_int, *const c_void, size_t, c_int, *const sockaddr, socklen_t) -> ssize_t)(
                fd, buf, count, flags, addr, len,
            )
        },
    }
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const libc::iovec, n: c_int) -> ssize_t {
    let Some(s) = sock_of(fd) else {
        // SAFETY: passing through.
        return unsafe { real!(readv: fn(c_int, *const libc::iovec, c_int) -> ssize_t)(fd, iov, n) };
    };
    // One read into the first non-empty buffer: a short read, which readv may give.
    // SAFETY: the program's iovec array of `n` entries.
    let iovs = unsafe { std::slice::from_raw_parts(iov, n.max(0) as usize) };
    match iovs.iter().find(|v| v.iov_len > 0) {
        Some(v) => {
            // SAFETY: the program's buffer of `iov_len` bytes, which readv lets us fill.
            let buf = unsafe { std::slice::from_raw_parts_mut(v.iov_base.cast(), v.iov_len) };
            sock_read(&s, buf, 0, None)
        }
        None => 0,
    }
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const libc::iovec, n: c_int) -> ssize_t {
    let Some(s) = sock_of(fd) else {
        // SAFETY: passing through.
        return unsafe { real!(writev: fn(c_int, *const libc::iovec, c_int) -> ssize_t)(fd, iov, n) };
    };
    // SAFETY: the program's iovec array.
    let iovs = unsafe { std::slice::from_raw_parts(iov, n.max(0) as usize) };
    let mut all = Vec::new();
    for v in iovs {
        // SAFETY: the program's buffers.
        all.extend_from_slice(unsafe { std::slice::from_raw_parts(v.iov_base.cast::<u8>(), v.iov_len) });
    }
    sock_write(&s, &all, None, 0)
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut libc::msghdr, flags: c_int) -> ssize_t {
    let Some(s) = sock_of(fd) else {
        // SAFETY: passing through.
        return unsafe { real!(recvmsg: fn(c_int, *mut libc::msghdr, c_int) -> ssize_t)(fd, msg, flags) };
    };
    // SAFETY: the program's msghdr.
    let m = unsafe { &mut *msg };
    // SAFETY: its iovec array.
    let iovs = unsafe { std::slice::from_raw_parts(m.msg_iov, m.msg_iovlen) };
    let Some(v) = iovs.iter().find(|v| v.iov_len > 0) else { return 0 };
    let mut from = nowhere(libc::AF_INET);
    // SAFETY: the program's buffer.
    let n = sock_read(
        &s,
        unsafe { std::slice::from_raw_parts_mut(v.iov_base.cast(), v.iov_len) },
        flags,
        Some(&mut from),
    );
    m.msg_controllen = 0;
    m.msg_flags = 0;
    if n >= 0 && from.port() != 0 && !m.msg_name.is_null() {
        // SAFETY: the program's name buffer of msg_namelen bytes.
        unsafe { put_addr(s.domain, from, m.msg_name.cast(), &mut m.msg_namelen) };
    }
    n
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const libc::msghdr, flags: c_int) -> ssize_t {
    let Some(s) = sock_of(fd) else {
        // SAFETY: passing through.
        return unsafe { real!(sendmsg: fn(c_int, *const libc::msghdr, c_int) -> ssize_t)(fd, msg, flags) };
    };
    // SAFETY: the program's msghdr and its arrays.
    let m = unsafe { &*msg };
    // SAFETY: as above.
    let to = unsafe { addr_in(m.msg_name.cast(), m.msg_namelen) };
    // SAFETY: its iovec array.
    let iovs = unsafe { std::slice::from_raw_parts(m.msg_iov, m.msg_iovlen) };
    let mut all = Vec::new();
    for v in iovs {
        // SAFETY: the program's buffers.
        all.extend_from_slice(unsafe { std::slice::from_raw_parts(v.iov_base.cast::<u8>(), v.iov_len) });
    }
    sock_write(&s, &all, to, flags)
}

/// `sendmmsg` on a lanbus socket: each message as `sendmsg` would send it, until one fails
/// (an error only when none went). The placeholder would take the bytes itself otherwise.
#[no_mangle]
pub unsafe extern "C" fn sendmmsg(
    fd: c_int,
    msgs: *mut libc::mmsghdr,
    n: libc::c_uint,
    flags: c_int,
) -> c_int {
    if !is_ours(fd) {
        // SAFETY: passing through.
        return unsafe {
            real!(sendmmsg: fn(c_int, *mut libc::mmsghdr, libc::c_uint, c_int) -> c_int)(fd, msgs, n, flags)
        };
    }
    let mut sent = 0;
    for i in 0..n as usize {
        // SAFETY: the program's array of `n` messages.
        let m = unsafe { &mut *msgs.add(i) };
        // SAFETY: one of the program's messages.
        let r = unsafe { sendmsg(fd, &m.msg_hdr, flags) };
        if r < 0 {
            return if sent > 0 { sent } else { -1 };
        }
        m.msg_len = r as libc::c_uint;
        sent += 1;
    }
    sent
}

/// `recvmmsg` on a lanbus socket: the first message as `recvmsg` would receive it, then more
/// while more wait (the timeout is not kept: the first wait is `recvmsg`'s).
#[no_mangle]
pub unsafe extern "C" fn recvmmsg(
    fd: c_int,
    msgs: *mut libc::mmsghdr,
    n: libc::c_uint,
    flags: c_int,
    timeout: *mut libc::timespec,
) -> c_int {
    if !is_ours(fd) {
        // SAFETY: passing through.
        return unsafe {
            real!(recvmmsg: fn(c_int, *mut libc::mmsghdr, libc::c_uint, c_int, *mut libc::timespec) -> c_int)(
                fd, msgs, n, flags, timeout,
            )
        };
    }
    let mut got = 0;
    for i in 0..n as usize {
        // After the first, only what is there already.
        let flags = if i == 0 { flags & !libc::MSG_WAITFORONE } else { flags | libc::MSG_DONTWAIT };
        // SAFETY: the program's array of `n` messages.
        let m = unsafe { &mut *msgs.add(i) };
        // SAFETY: one of the program's messages.
        let r = unsafe { recvmsg(fd, &mut m.msg_hdr, flags) };
        if r < 0 {
            return if got > 0 { got } else { -1 };
        }
        m.msg_len = r as libc::c_uint;
        got += 1;
    }
    got
}

/// `sendfile` to a lanbus socket: read from the file, then written as `write` would (the
/// placeholder would take the bytes itself otherwise).
#[no_mangle]
pub unsafe extern "C" fn sendfile(
    out: c_int,
    input: c_int,
    offset: *mut libc::off_t,
    count: size_t,
) -> ssize_t {
    let Some(s) = sock_of(out) else {
        // SAFETY: passing through.
        return unsafe {
            real!(sendfile: fn(c_int, c_int, *mut libc::off_t, size_t) -> ssize_t)(out, input, offset, count)
        };
    };
    let mut buf = vec![0u8; count.min(1 << 20)];
    // SAFETY: reading into our buffer; at the caller's offset (which moves) or the file's.
    let n = unsafe {
        if offset.is_null() {
            real!(read: fn(c_int, *mut c_void, size_t) -> ssize_t)(input, buf.as_mut_ptr().cast(), buf.len())
        } else {
            libc::pread(input, buf.as_mut_ptr().cast(), buf.len(), *offset)
        }
    };
    if n <= 0 {
        return n;
    }
    let w = sock_write(&s, &buf[..n as usize], None, 0);
    if w > 0 {
        if offset.is_null() {
            // What was read and not sent goes back to the file's position.
            // SAFETY: lseek on the caller's descriptor.
            unsafe { libc::lseek(input, (w - n) as libc::off_t, libc::SEEK_CUR) };
        } else {
            // SAFETY: the caller's offset.
            unsafe { *offset += w as libc::off_t };
        }
    } else if offset.is_null() {
        // SAFETY: lseek on the caller's descriptor.
        unsafe { libc::lseek(input, -(n as libc::off_t), libc::SEEK_CUR) };
    }
    w
}

#[no_mangle]
pub unsafe extern "C" fn sendfile64(
    out: c_int,
    input: c_int,
    offset: *mut libc::off_t,
    count: size_t,
) -> ssize_t {
    // SAFETY: same contract (off_t is 64 bits on this target).
    unsafe { sendfile(out, input, offset, count) }
}

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    if is_ours(fd) {
        // A child's close of an inherited socket lets go of the child's reference.
        adopt_inherited();
        mark(fd, false);
        lock(&global().socks).remove(&fd);
    }
    // SAFETY: passing through (the placeholder, or any other descriptor).
    unsafe { real!(close: fn(c_int) -> c_int)(fd) }
}

#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    let Some(s) = sock_of(fd) else {
        // SAFETY: passing through.
        return unsafe { real!(shutdown: fn(c_int, c_int) -> c_int)(fd, how) };
    };
    let st = s.state.lock();
    match &*st {
        State::Connected(c) if how == libc::SHUT_WR || how == libc::SHUT_RDWR => match c.shutdown_write() {
            Ok(()) => 0,
            Err(e) => io_fail(&e),
        },
        State::Connected(_) => 0,
        _ => fail(libc::ENOTCONN),
    }
}

/// What the library does with a socket option set on one of its sockets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OptionSupport {
    /// Taken: the stack does it already, or it is a hint the stack may ignore without a
    /// program seeing a difference in what it reads or writes.
    Taken,
    /// Known, but this value asks for behaviour the stack does not have: `EOPNOTSUPP`.
    Refused(&'static str),
    /// Not an option the library knows: `ENOPROTOOPT`.
    Unknown,
}

/// The int an option's value starts with (0 when shorter than an int).
fn option_int(value: &[u8]) -> c_int {
    value.get(..4).map_or(0, |b| c_int::from_ne_bytes(b.try_into().expect("4 bytes")))
}

/// Whether socket option `name` at `level`, set to `value`, is honoured.
fn option_support(level: c_int, name: c_int, value: &[u8]) -> OptionSupport {
    use OptionSupport::*;
    let on = option_int(value) != 0;
    match (level, name) {
        // Port reuse is checked at bind (EADDRINUSE); keep-alive, buffer sizes and priority are
        // the stack's own.
        (libc::SOL_SOCKET, libc::SO_REUSEADDR | libc::SO_REUSEPORT | libc::SO_KEEPALIVE) => Taken,
        (libc::SOL_SOCKET, libc::SO_RCVBUF | libc::SO_SNDBUF | libc::SO_RCVLOWAT) => Taken,
        (libc::SOL_SOCKET, libc::SO_LINGER) => {
            if on {
                Refused("SO_LINGER")
            } else {
                Taken
            }
        }
        (libc::SOL_SOCKET, libc::SO_RCVTIMEO | libc::SO_SNDTIMEO) => {
            if value.iter().any(|&b| b != 0) {
                Refused(if name == libc::SO_RCVTIMEO { "SO_RCVTIMEO" } else { "SO_SNDTIMEO" })
            } else {
                Taken
            }
        }
        (libc::SOL_SOCKET, libc::SO_BROADCAST) => {
            if on {
                Refused("SO_BROADCAST")
            } else {
                Taken
            }
        }
        // Segments go out at once already (Nagle is off); deferred accepts, quick ACKs,
        // segment sizes and keep-alive timings are hints. Corking is passed on to the stack
        // (`setsockopt`).
        (
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY
            | libc::TCP_CORK
            | libc::TCP_QUICKACK
            | libc::TCP_DEFER_ACCEPT
            | libc::TCP_MAXSEG
            | libc::TCP_KEEPIDLE
            | libc::TCP_KEEPINTVL
            | libc::TCP_KEEPCNT
            | libc::TCP_USER_TIMEOUT,
        ) => Taken,
        (libc::IPPROTO_IP, libc::IP_TOS | libc::IP_BIND_ADDRESS_NO_PORT) => Taken,
        (libc::IPPROTO_IPV6, libc::IPV6_TCLASS) => Taken,
        // Dual-stack is what every AF_INET6 socket is; a v6-only one is not to be had.
        (libc::IPPROTO_IPV6, libc::IPV6_V6ONLY) => {
            if on {
                Refused("IPV6_V6ONLY")
            } else {
                Taken
            }
        }
        _ => Unknown,
    }
}

/// A readable name for an option the library does not know.
fn option_name(level: c_int, name: c_int) -> String {
    let level = match level {
        libc::SOL_SOCKET => "SOL_SOCKET".to_string(),
        libc::IPPROTO_IP => "IPPROTO_IP".to_string(),
        libc::IPPROTO_IPV6 => "IPPROTO_IPV6".to_string(),
        libc::IPPROTO_TCP => "IPPROTO_TCP".to_string(),
        libc::IPPROTO_UDP => "IPPROTO_UDP".to_string(),
        other => format!("level {other}"),
    };
    format!("option {name} at {level}")
}

/// Says once per process on stderr that `what` is not supported, then fails with `errno`.
fn unsupported<T: From<i8>>(what: &str, errno: c_int) -> T {
    static SAID: Mutex<Option<std::collections::HashSet<String>>> = Mutex::new(None);
    let first = lock(&SAID).get_or_insert_with(Default::default).insert(what.to_string());
    if first {
        let name = if errno == libc::ENOPROTOOPT { "ENOPROTOOPT" } else { "EOPNOTSUPP" };
        eprintln!("liblanbus_sock: {what} is not supported on the stack server's sockets ({name})");
    }
    fail(errno)
}

#[no_mangle]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    let Some(s) = sock_of(fd) else {
        // SAFETY: passing through.
        return unsafe {
            real!(setsockopt: fn(c_int, c_int, c_int, *const c_void, socklen_t) -> c_int)(
                fd, level, name, val, len,
            )
        };
    };
    if val.is_null() {
        return fail(libc::EFAULT);
    }
    // SAFETY: the program's option of `len` bytes.
    let value = unsafe { std::slice::from_raw_parts(val.cast::<u8>(), len as usize) };
    match option_support(level, name, value) {
        OptionSupport::Taken => {}
        OptionSupport::Refused(what) => {
            return unsupported(&format!("setsockopt {what} on"), libc::EOPNOTSUPP)
        }
        OptionSupport::Unknown => {
            return unsupported(&format!("setsockopt {}", option_name(level, name)), libc::ENOPROTOOPT)
        }
    }
    match &mut *s.state.lock() {
        // Kept for a socket that may still turn out to be the kernel's (loopback).
        State::Fresh { opts, .. } => opts.push((level, name, value.to_vec())),
        // Corking holds a response back until the program closes or uncorks (nginx corks a
        // header and its file): the response and the FIN then leave together, and the peer
        // sees the end before it has read the response, as from Linux.
        State::Connected(stream) if (level, name) == (libc::IPPROTO_TCP, libc::TCP_CORK) => {
            if let Err(e) = stream.set_cork(value.iter().any(|&b| b != 0)) {
                return io_fail(&e);
            }
        }
        _ => {}
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    let Some(s) = sock_of(fd) else {
        // SAFETY: passing through.
        return unsafe {
            real!(getsockopt: fn(c_int, c_int, c_int, *mut c_void, *mut socklen_t) -> c_int)(
                fd, level, name, val, len,
            )
        };
    };
    if val.is_null() || len.is_null() {
        return fail(libc::EFAULT);
    }
    let stream = !matches!(&*s.state.lock(), State::Udp { .. } | State::Fresh { stream: false, .. });
    let value: c_int = match (level, name) {
        (libc::SOL_SOCKET, libc::SO_TYPE) => {
            if stream {
                libc::SOCK_STREAM
            } else {
                libc::SOCK_DGRAM
            }
        }
        (libc::SOL_SOCKET, libc::SO_RCVBUF | libc::SO_SNDBUF) => 512 << 10,
        (libc::IPPROTO_TCP, libc::TCP_MAXSEG) => 1460,
        (libc::SOL_SOCKET, libc::SO_DOMAIN) => s.domain,
        _ => 0,
    };
    // SAFETY: the program's buffer of `*len` bytes: zeroed (TCP_INFO and the like read as a
    // default socket's), then the int where one is asked for.
    unsafe {
        let n = *len as usize;
        std::ptr::write_bytes(val.cast::<u8>(), 0, n);
        if n >= 4 {
            *(val as *mut c_int) = value;
        }
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn getsockname(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    let Some(s) = sock_of(fd) else {
        // SAFETY: passing through.
        return unsafe {
            real!(getsockname: fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int)(fd, addr, len)
        };
    };
    let a = match &*s.state.lock() {
        State::Fresh { bound, .. } => bound.unwrap_or(nowhere(s.domain)),
        State::Listening(l) => l.local_addr(),
        State::Connected(c) => c.local_addr(),
        State::Udp { sock, .. } => sock.local_addr(),
    };
    // SAFETY: the program's buffer.
    unsafe { put_addr(s.domain, a, addr, len) };
    0
}

#[no_mangle]
pub unsafe extern "C" fn getpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    let Some(s) = sock_of(fd) else {
        // SAFETY: passing through.
        return unsafe {
            real!(getpeername: fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int)(fd, addr, len)
        };
    };
    let a = match &*s.state.lock() {
        State::Connected(c) => c.peer_addr(),
        State::Udp { peer: Some(p), .. } => *p,
        _ => return fail(libc::ENOTCONN),
    };
    // SAFETY: the program's buffer.
    unsafe { put_addr(s.domain, a, addr, len) };
    0
}

/// The fork ticket for a child, asked for before the fork: only when this process is attached
/// and has lanbus sockets.
fn fork_ticket() -> Option<(StackClient, u64)> {
    // A child that forks before calling on its inherited sockets takes them over first, so that
    // its own child can inherit them in turn.
    adopt_inherited();
    if attached_pid() != std::process::id() || lock(&global().socks).is_empty() {
        return None;
    }
    let client = lock(&global().client).clone()?;
    match client.fork_ticket() {
        Ok(token) => Some((client, token)),
        Err(e) => {
            eprintln!("liblanbus_sock: the child will not inherit this process's sockets: {e}");
            None
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn fork() -> libc::pid_t {
    let ticket = fork_ticket();
    let g = global();
    // Held across the fork so that the child's copies are consistent (no other thread of the
    // parent was half-way through changing them); each is taken alone everywhere else.
    let guards = (lock(&g.client), lock(&g.socks), lock(&g.by_handle));
    // SAFETY: plain fork(2) through libc (which runs its own handlers).
    let pid = unsafe { real!(fork: fn() -> libc::pid_t)() };
    if pid == 0 {
        own_placeholders(&guards.1);
    }
    drop(guards);
    let Some((client, token)) = ticket else { return pid };
    if pid == 0 {
        // The parent's attachment: never dropped here (see `StackClient::abandon_in_child`).
        std::mem::forget(client);
        PENDING_PID.store(std::process::id(), Ordering::Relaxed);
        // Release: pairs with the load in `adopt_inherited`.
        PENDING_TICKET.store(token, Ordering::Release);
        return 0;
    }
    let _ = client.forked(token, u32::try_from(pid).ok().filter(|_| pid > 0));
    if pid > 0 {
        for s in lock(&g.socks).values() {
            s.shared.store(true, Ordering::Relaxed);
        }
    }
    pid
}

/// In a forked child, before the program runs on: each lanbus socket gets placeholders of its
/// own under the same descriptor numbers. The inherited ones are the parent's too (one kernel
/// socket pair), and a socket's readiness is each process's own: what arrives for the parent
/// must not wake the child, nor the child's reads drain the parent's signal. System calls on
/// the library's own descriptors, and no lock another thread of the parent may have held.
fn own_placeholders(socks: &HashMap<c_int, Arc<Sock>>) {
    let mut done: Vec<*const Sock> = Vec::new();
    for sock in socks.values() {
        if done.contains(&Arc::as_ptr(sock)) {
            continue;
        }
        done.push(Arc::as_ptr(sock));
        let mut pair = [-1; 2];
        // SAFETY: socketpair writes two descriptors into the live array; the rest are plain
        // calls on descriptors this process holds.
        unsafe {
            if real!(socketpair: fn(c_int, c_int, c_int, *mut c_int) -> c_int)(
                libc::AF_UNIX,
                libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
                pair.as_mut_ptr(),
            ) < 0
            {
                // The parent's placeholders stay: readiness is shared, calls still work.
                continue;
            }
            let small: c_int = 1;
            real!(setsockopt: fn(c_int, c_int, c_int, *const c_void, socklen_t) -> c_int)(
                pair[0],
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                (&small as *const c_int).cast(),
                4,
            );
            let numbers = socks.iter().filter(|(_, s)| Arc::ptr_eq(s, sock)).map(|(fd, _)| *fd);
            for fd in numbers.chain([sock.signal]) {
                let fd_flags = real!(fcntl: fn(c_int, c_int, libc::c_ulong) -> c_int)(fd, libc::F_GETFD, 0);
                let cloexec =
                    if fd_flags > 0 && fd_flags & libc::FD_CLOEXEC != 0 { libc::O_CLOEXEC } else { 0 };
                real!(dup3: fn(c_int, c_int, c_int) -> c_int)(pair[0], fd, cloexec);
            }
            real!(dup3: fn(c_int, c_int, c_int) -> c_int)(pair[1], sock.peer, libc::O_CLOEXEC);
            real!(close: fn(c_int) -> c_int)(pair[0]);
            real!(close: fn(c_int) -> c_int)(pair[1]);
        }
        sock.out_blocked.store(false, Ordering::Relaxed);
    }
}

/// `epoll_ctl` on a lanbus socket: a forked child takes over its inherited sockets first, so
/// that an event loop waiting on them hears what the server sends it (a child that only waits
/// would otherwise never tell the server it holds them).
#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    event: *mut libc::epoll_event,
) -> c_int {
    if is_ours(fd) {
        adopt_inherited();
    }
    // SAFETY: passing the program's arguments through.
    unsafe { real!(epoll_ctl: fn(c_int, c_int, c_int, *mut libc::epoll_event) -> c_int)(epfd, op, fd, event) }
}

/// Before an `exec`: a child that has not claimed the sockets it inherited claims them now, on
/// an attachment whose socket closes at the exec, so that the server lets go of them then
/// (the new program cannot use them) rather than when the exec'd process ends.
fn before_exec() {
    adopt_inherited();
}

#[no_mangle]
pub unsafe extern "C" fn execve(
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) -> c_int {
    before_exec();
    // SAFETY: passing the program's arguments through.
    unsafe {
        real!(execve: fn(*const libc::c_char, *const *const libc::c_char, *const *const libc::c_char) -> c_int)(
            path, argv, envp,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn execv(path: *const libc::c_char, argv: *const *const libc::c_char) -> c_int {
    before_exec();
    // SAFETY: passing the program's arguments through.
    unsafe { real!(execv: fn(*const libc::c_char, *const *const libc::c_char) -> c_int)(path, argv) }
}

#[no_mangle]
pub unsafe extern "C" fn execvp(file: *const libc::c_char, argv: *const *const libc::c_char) -> c_int {
    before_exec();
    // SAFETY: passing the program's arguments through.
    unsafe { real!(execvp: fn(*const libc::c_char, *const *const libc::c_char) -> c_int)(file, argv) }
}

#[no_mangle]
pub unsafe extern "C" fn execvpe(
    file: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) -> c_int {
    before_exec();
    // SAFETY: passing the program's arguments through.
    unsafe {
        real!(execvpe: fn(*const libc::c_char, *const *const libc::c_char, *const *const libc::c_char) -> c_int)(
            file, argv, envp,
        )
    }
}

/// Shares socket `fd`'s state with a new descriptor number `nfd` (a dup of the placeholder).
fn share(fd: c_int, nfd: c_int) -> c_int {
    if nfd >= 0 {
        if let Some(s) = sock_of(fd) {
            lock(&global().socks).insert(nfd, s);
            mark(nfd, true);
        }
    }
    nfd
}

#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: libc::c_ulong) -> c_int {
    // SAFETY: passing through with the one argument every command takes at most.
    let pass = || unsafe { real!(fcntl: fn(c_int, c_int, libc::c_ulong) -> c_int)(fd, cmd, arg) };
    let Some(s) = sock_of(fd) else { return pass() };
    match cmd {
        libc::F_GETFL => libc::O_RDWR | if s.nonblock.load(Ordering::Relaxed) { libc::O_NONBLOCK } else { 0 },
        libc::F_SETFL => {
            s.nonblock.store(arg as c_int & libc::O_NONBLOCK != 0, Ordering::Relaxed);
            0
        }
        libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => {
            if is_ours(fd) && sock_of(fd).is_some() {
                // A close of the new number must not be mistaken for the old socket's.
                if arg as usize >= MAX_FD {
                    return fail(libc::EINVAL);
                }
            }
            share(fd, pass())
        }
        _ => pass(),
    }
}

#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: libc::c_ulong) -> c_int {
    // SAFETY: same contract.
    unsafe { fcntl(fd, cmd, arg) }
}

#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, request: libc::c_ulong, arg: *mut c_void) -> c_int {
    let Some(s) = sock_of(fd) else {
        // SAFETY: passing through.
        return unsafe { real!(ioctl: fn(c_int, libc::c_ulong, *mut c_void) -> c_int)(fd, request, arg) };
    };
    match request {
        libc::FIONBIO => {
            // SAFETY: FIONBIO's argument is a pointer to int.
            let on = !arg.is_null() && unsafe { *(arg as *const c_int) } != 0;
            s.nonblock.store(on, Ordering::Relaxed);
            0
        }
        libc::FIONREAD => {
            let n = match &*s.state.lock() {
                State::Connected(c) => c.readiness().0,
                _ => 0,
            };
            if !arg.is_null() {
                // SAFETY: FIONREAD's argument is a pointer to int.
                unsafe { *(arg as *mut c_int) = n.min(c_int::MAX as usize) as c_int };
            }
            0
        }
        _ => fail(libc::ENOTTY),
    }
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // SAFETY: passing through.
    share(fd, unsafe { real!(dup: fn(c_int) -> c_int)(fd) })
}

#[no_mangle]
pub unsafe extern "C" fn dup2(fd: c_int, nfd: c_int) -> c_int {
    if fd != nfd && is_ours(nfd) {
        mark(nfd, false);
        lock(&global().socks).remove(&nfd);
    }
    // SAFETY: passing through.
    share(fd, unsafe { real!(dup2: fn(c_int, c_int) -> c_int)(fd, nfd) })
}

#[no_mangle]
pub unsafe extern "C" fn dup3(fd: c_int, nfd: c_int, flags: c_int) -> c_int {
    if fd != nfd && is_ours(nfd) {
        mark(nfd, false);
        lock(&global().socks).remove(&nfd);
    }
    // SAFETY: passing through.
    share(fd, unsafe { real!(dup3: fn(c_int, c_int, c_int) -> c_int)(fd, nfd, flags) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn int(v: c_int) -> Vec<u8> {
        v.to_ne_bytes().to_vec()
    }

    #[test]
    fn options_the_stack_does_or_may_ignore_are_taken() {
        for (level, name) in [
            (libc::SOL_SOCKET, libc::SO_REUSEADDR),
            (libc::SOL_SOCKET, libc::SO_KEEPALIVE),
            (libc::SOL_SOCKET, libc::SO_SNDBUF),
            (libc::IPPROTO_TCP, libc::TCP_NODELAY),
            (libc::IPPROTO_TCP, libc::TCP_CORK),
            (libc::IPPROTO_TCP, libc::TCP_DEFER_ACCEPT),
            (libc::IPPROTO_IP, libc::IP_TOS),
        ] {
            for v in [0, 1] {
                assert_eq!(option_support(level, name, &int(v)), OptionSupport::Taken, "{level} {name} {v}");
            }
        }
        // The default a program may set explicitly.
        assert_eq!(option_support(libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, &int(0)), OptionSupport::Taken);
        let off = [0u8; std::mem::size_of::<libc::linger>()];
        assert_eq!(option_support(libc::SOL_SOCKET, libc::SO_LINGER, &off), OptionSupport::Taken);
        assert_eq!(option_support(libc::SOL_SOCKET, libc::SO_RCVTIMEO, &[0; 16]), OptionSupport::Taken);
    }

    #[test]
    fn options_asking_for_what_the_stack_lacks_are_refused_by_name() {
        assert_eq!(
            option_support(libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, &int(1)),
            OptionSupport::Refused("IPV6_V6ONLY")
        );
        let linger = libc::linger { l_onoff: 1, l_linger: 0 };
        // SAFETY: viewing a plain C struct as its bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&linger as *const libc::linger).cast::<u8>(),
                std::mem::size_of::<libc::linger>(),
            )
        };
        assert_eq!(
            option_support(libc::SOL_SOCKET, libc::SO_LINGER, bytes),
            OptionSupport::Refused("SO_LINGER")
        );
        let mut timeout = [0u8; 16];
        timeout[0] = 5;
        assert_eq!(
            option_support(libc::SOL_SOCKET, libc::SO_SNDTIMEO, &timeout),
            OptionSupport::Refused("SO_SNDTIMEO")
        );
        assert_eq!(
            option_support(libc::SOL_SOCKET, libc::SO_BROADCAST, &int(1)),
            OptionSupport::Refused("SO_BROADCAST")
        );
    }

    #[test]
    fn options_the_library_does_not_know_are_unknown() {
        for (level, name) in [
            (libc::SOL_SOCKET, libc::SO_MARK),
            (libc::SOL_SOCKET, libc::SO_BINDTODEVICE),
            (libc::IPPROTO_TCP, libc::TCP_FASTOPEN),
            (libc::IPPROTO_TCP, libc::TCP_CONGESTION),
            (libc::IPPROTO_IP, libc::IP_ADD_MEMBERSHIP),
            (12345, 1),
        ] {
            assert_eq!(option_support(level, name, &int(1)), OptionSupport::Unknown, "{level} {name}");
        }
        // A short value reads as 0, never past its end.
        assert_eq!(option_support(libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, &[1]), OptionSupport::Taken);
        assert_eq!(option_name(libc::IPPROTO_TCP, 23), "option 23 at IPPROTO_TCP");
    }
}
