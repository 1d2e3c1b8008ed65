//! A [`BlockDevice`] (in lanbus: the remote NVMe namespace) as a vhost-user-blk backend, so a
//! VMM such as QEMU gives it to its guest as a virtio-blk disk:
//!
//! ```text
//! qemu-system-x86_64 -object memory-backend-memfd,id=mem,size=256M,share=on -numa node,memdev=mem \
//!   -chardev socket,id=c0,path=/run/lanbus/vda.sock,reconnect=1 \
//!   -device vhost-user-blk-pci,chardev=c0,num-queues=2 ...
//! ```
//!
//! Layer: frontend, beside the NBD server; both serve a `lanbus-block` [`BlockDevice`].
//! [`serve_blk`] listens on a Unix socket and serves one frontend at a time on its own threads (an
//! accept thread, the vhost-user message thread, one thread per queue); when a frontend
//! disconnects, or sends something the protocol does not allow, its connection ends and the next
//! one gets a fresh device, so QEMU's `reconnect=` can start over against it.
//! The vhost-user protocol is the rust-vmm crates' (`vhost`, `vhost-user-backend`); the
//! virtio-blk requests are [`blk`]'s.
//!
//! [`serve_net`] does the same for a network link (in lanbus: the remote NIC's driver) as a
//! vhost-user-net backend, which QEMU gives its guest as a virtio-net interface:
//!
//! ```text
//! qemu-system-x86_64 ... -chardev socket,id=n0,path=/run/lanbus/net.sock,reconnect=1 \
//!   -netdev vhost-user,id=net0,chardev=n0 -device virtio-net-pci,netdev=net0,mac=MAC,vectors=0 ...
//! ```
//!
//! (`vectors=0` for QEMU 7.2, whose vhost-user-net crashes setting up MSI-X notifiers without
//! KVM.) Its queues' frames are [`net`]'s; a relay sits between the VMM and the protocol handler
//! (see `relay.rs`: QEMU enables rings before it sets the features).
//!
//! [`vfio_user`] gives a raw PCIe function of the I/O box (the NVMe controller) to a VMM with a
//! vfio-user client, whose guest runs its own driver on it across the fabric.

#![deny(missing_docs)]
#![deny(unsafe_code)]

pub mod backend;
pub mod blk;
pub mod net;
#[allow(unsafe_code)]
mod relay;
pub mod vfio_user;

use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use lanbus_block::BlockDevice;
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserBackend, VhostUserDaemon, VringRwLock};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

pub use blk::{BlkStats, DeviceInfo};
pub use net::{NetBackendStats, NetLink};
pub use vfio_user::{serve_vfio_user, VfioUserServer, VfioUserStats};

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The options are not usable (local misuse).
    #[error("bad options: {0}")]
    Options(String),
    /// The socket could not be set up.
    #[error("socket {path}: {source}")]
    Socket {
        /// The socket path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// How a device is offered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlkOptions {
    /// Offer the device read-only (`VIRTIO_BLK_F_RO`) and refuse writes.
    pub read_only: bool,
    /// Request queues (`VIRTIO_BLK_F_MQ`), 1 to 64; QEMU's `num-queues` may be this or fewer.
    pub queues: u16,
    /// What GET_ID answers (the guest's `/sys/block/vda/serial`), at most 20 bytes used.
    pub serial: String,
}

impl Default for BlkOptions {
    fn default() -> Self {
        BlkOptions { read_only: false, queues: 1, serial: "lanbus".into() }
    }
}

/// A running vhost-user-blk backend; [`BlkServer::stop`] (or dropping it) ends it.
pub struct BlkServer {
    server: Server,
    stats: Arc<BlkStats>,
}

/// Serves `dev` as a vhost-user-blk backend on the Unix socket `path` (a stale socket file there
/// is replaced), one frontend at a time, until stopped.
pub fn serve_blk(path: &Path, dev: Arc<dyn BlockDevice>, options: BlkOptions) -> Result<BlkServer, Error> {
    if !(1..=64).contains(&options.queues) {
        return Err(Error::Options(format!("{} queues (1 to 64)", options.queues)));
    }
    let block_size = dev.block_size();
    let size_bytes = dev.size_bytes();
    if !size_bytes.is_multiple_of(blk::SECTOR_BYTES) || !block_size.is_power_of_two() {
        return Err(Error::Options(format!(
            "device of {size_bytes} bytes in blocks of {block_size}: not whole 512-byte sectors"
        )));
    }
    let info = DeviceInfo {
        size_bytes,
        block_size,
        read_only: options.read_only || dev.read_only(),
        queues: options.queues,
        serial: options.serial,
    };
    let stats = Arc::new(BlkStats::default());
    let counters: Arc<dyn ConnectionCounters> = stats.clone();
    let st = stats.clone();
    let make = move |mem: backend::Memory| {
        Ok(Arc::new(backend::BlkBackend::new(dev.clone(), info.clone(), mem, st.clone())))
    };
    let server = Server::start(path, "vhost-blk", false, counters, make, |_, _| Ok(None))?;
    Ok(BlkServer { server, stats })
}

impl BlkServer {
    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.server.path
    }

    /// The counters.
    pub fn stats(&self) -> &Arc<BlkStats> {
        &self.stats
    }

    /// Disconnects the frontend (requests in progress finish first), stops accepting and removes
    /// the socket file.
    pub fn stop(mut self) {
        self.server.shutdown();
    }
}

/// A running vhost-user-net backend; [`NetServer::stop`] (or dropping it) ends it.
pub struct NetServer {
    server: Server,
    stats: Arc<NetBackendStats>,
}

/// Serves `link` as a vhost-user-net backend on the Unix socket `path` (a stale socket file there
/// is replaced), one frontend at a time, until stopped. While a frontend is connected a thread
/// moves what the link receives toward the guest.
pub fn serve_net(path: &Path, link: Arc<dyn NetLink>) -> Result<NetServer, Error> {
    let stats = Arc::new(NetBackendStats::default());
    let counters: Arc<dyn ConnectionCounters> = stats.clone();
    let st = stats.clone();
    let make = move |mem: backend::Memory| Ok(Arc::new(net::NetBackend::new(link.clone(), mem, st.clone())?));
    let session = |daemon: &VhostUserDaemon<Arc<net::NetBackend>>, b: &Arc<net::NetBackend>| {
        use std::os::fd::AsRawFd;
        let handlers = daemon.get_epoll_handlers();
        let handler = handlers.first().ok_or_else(|| std::io::Error::other("no queue thread"))?;
        handler.register_listener(b.wake_fd().as_raw_fd(), EventSet::IN, net::NetBackend::wake_event())?;
        let stop = Arc::new(AtomicBool::new(false));
        let (b, s) = (b.clone(), stop.clone());
        let thread =
            std::thread::Builder::new().name("vhost-net-rx".into()).spawn(move || b.receive_loop(&s))?;
        let end: Box<dyn FnOnce() + Send> = Box::new(move || {
            stop.store(true, Ordering::Relaxed);
            let _ = thread.join();
        });
        Ok(Some(end))
    };
    let server = Server::start(path, "vhost-net", true, counters, make, session)?;
    Ok(NetServer { server, stats })
}

impl NetServer {
    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.server.path
    }

    /// The counters.
    pub fn stats(&self) -> &Arc<NetBackendStats> {
        &self.stats
    }

    /// Disconnects the frontend, stops accepting and removes the socket file.
    pub fn stop(mut self) {
        self.server.shutdown();
    }
}

/// Where a server counts its connections and the ones that ended in a protocol error.
trait ConnectionCounters: Send + Sync + 'static {
    fn connected(&self);
    fn protocol_error(&self);
}

impl ConnectionCounters for BlkStats {
    fn connected(&self) {
        // Relaxed: counters.
        self.connections.fetch_add(1, Ordering::Relaxed);
    }
    fn protocol_error(&self) {
        self.protocol_errors.fetch_add(1, Ordering::Relaxed);
    }
}

impl ConnectionCounters for NetBackendStats {
    fn connected(&self) {
        self.connections.fetch_add(1, Ordering::Relaxed);
    }
    fn protocol_error(&self) {
        self.protocol_errors.fetch_add(1, Ordering::Relaxed);
    }
}

/// What runs beside a connection: made when it starts, ended (the closure) when it ends.
type SessionEnd = Box<dyn FnOnce() + Send>;
/// Starts what runs beside a connection, once its daemon is up.
type Session<B> = dyn Fn(&VhostUserDaemon<Arc<B>>, &Arc<B>) -> std::io::Result<Option<SessionEnd>>;

/// The socket, its accept thread and the connection being served: what every backend shares.
struct Server {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    current: Arc<Mutex<Option<ShutdownHandle>>>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    /// Listens on `path` and serves one frontend at a time, each with a fresh backend from `make`
    /// and whatever `session` starts beside it.
    fn start<B>(
        path: &Path,
        kind: &str,
        relay: bool,
        counters: Arc<dyn ConnectionCounters>,
        make: impl Fn(backend::Memory) -> std::io::Result<Arc<B>> + Send + 'static,
        session: impl Fn(&VhostUserDaemon<Arc<B>>, &Arc<B>) -> std::io::Result<Option<SessionEnd>>
            + Send
            + 'static,
    ) -> Result<Server, Error>
    where
        B: VhostUserBackend<Bitmap = (), Vring = VringRwLock<backend::Memory>> + 'static,
    {
        let socket_error = |source| Error::Socket { path: path.to_path_buf(), source };
        let (listener, epoll) = listen(path).map_err(socket_error)?;
        let stop = Arc::new(AtomicBool::new(false));
        let current: Arc<Mutex<Option<ShutdownHandle>>> = Arc::new(Mutex::new(None));
        let thread = {
            let (stop, current) = (stop.clone(), current.clone());
            let name = format!("{kind} {}", path.display());
            std::thread::Builder::new()
                .name(format!("{kind}-accept"))
                .spawn(move || {
                    let loop_ =
                        AcceptLoop { listener: &listener, relay, epoll: &epoll, name: &name, stop: &stop };
                    loop_.run(&current, &*counters, &make, &session)
                })
                .map_err(socket_error)?
        };
        Ok(Server { path: path.to_path_buf(), stop, current, thread: Some(thread) })
    }

    fn shutdown(&mut self) {
        // Release: pairs with the accept loop's Acquire loads.
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.current.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            h.shutdown();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.shutdown();
        }
    }
}

/// Listens on the Unix socket `path` (replacing a stale socket file there, never another kind of
/// file) and returns the listener with an epoll set that reports it readable (data 0).
fn listen(path: &Path) -> std::io::Result<(UnixListener, Epoll)> {
    if std::fs::symlink_metadata(path).is_ok_and(|m| {
        use std::os::unix::fs::FileTypeExt;
        m.file_type().is_socket()
    }) {
        std::fs::remove_file(path)?;
    }
    let listener = UnixListener::bind(path)?;
    let epoll = Epoll::new()?;
    epoll.ctl(ControlOperation::Add, listener.as_raw_fd(), EpollEvent::new(EventSet::IN, 0))?;
    Ok((listener, epoll))
}

/// Accepts the VMM's connection on `public` and connects a fresh private listener (in the
/// abstract namespace, gone with its last descriptor) to the relay's end: (the listener the daemon
/// accepts from, the VMM's end, the relay's end toward the daemon).
fn private_pair(public: &UnixListener) -> std::io::Result<(Listener, UnixStream, UnixStream)> {
    use std::os::linux::net::SocketAddrExt;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let (front, _) = public.accept()?;
    // Relaxed: a counter that only has to differ between calls.
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(format!(
        "lanbus-vhost-{}-{n}",
        std::process::id()
    ))?;
    let private = UnixListener::bind_addr(&addr)?;
    let back = UnixStream::connect_addr(&addr)?;
    Ok((Listener::from(private), front, back))
}

struct AcceptLoop<'a> {
    listener: &'a UnixListener,
    /// Put [`relay`] between the VMM and the daemon.
    relay: bool,
    epoll: &'a Epoll,
    name: &'a str,
    stop: &'a AtomicBool,
}

impl AcceptLoop<'_> {
    fn run<B>(
        &self,
        current: &Mutex<Option<ShutdownHandle>>,
        counters: &dyn ConnectionCounters,
        make: &dyn Fn(backend::Memory) -> std::io::Result<Arc<B>>,
        session: &Session<B>,
    ) where
        B: VhostUserBackend<Bitmap = (), Vring = VringRwLock<backend::Memory>> + 'static,
    {
        let name = self.name;
        let mut events = [EpollEvent::default(); 1];
        // Acquire: pairs with the Release store in `shutdown`, so the wake-up connection is seen
        // after it.
        while !self.stop.load(Ordering::Acquire) {
            match self.epoll.wait(200, &mut events) {
                Ok(0) => continue,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!("{name}: waiting for a connection: {e}");
                    return;
                }
            }
            let mem = GuestMemoryAtomic::new(GuestMemoryMmap::<()>::new());
            let made = make(mem.clone()).and_then(|backend| {
                let daemon = VhostUserDaemon::new(name.to_string(), backend.clone(), mem)
                    .map_err(|e| std::io::Error::other(e.to_string()))?;
                Ok((backend, daemon))
            });
            let (backend, mut daemon) = match made {
                Ok(d) => d,
                Err(e) => {
                    tracing::error!("{name}: cannot set up a device for a connection: {e}");
                    std::thread::sleep(std::time::Duration::from_millis(200));
                    continue;
                }
            };
            let (mut l, relayed) = if self.relay {
                // The VMM's connection goes through the relay; the daemon takes the relay's end
                // on a private listener.
                match private_pair(self.listener) {
                    Ok((l, front, back)) => (l, Some((front, back))),
                    Err(e) => {
                        tracing::warn!("{name}: connection not relayed: {e}");
                        continue;
                    }
                }
            } else {
                match self.listener.try_clone() {
                    // Built from a listener it does not own the path of, so dropping it unlinks
                    // nothing.
                    Ok(l) => (Listener::from(l), None),
                    Err(e) => {
                        tracing::error!("{name}: {e}");
                        return;
                    }
                }
            };
            if let Err(e) = daemon.start(&mut l) {
                tracing::warn!("{name}: connection not started: {e}");
                continue;
            }
            let relay_threads = match relayed.map(|(front, back)| relay::start(front, back)) {
                Some(Ok(threads)) => threads.into_iter().collect(),
                Some(Err(e)) => {
                    tracing::error!("{name}: cannot relay the connection: {e}");
                    daemon.request_shutdown();
                    let _ = daemon.wait();
                    continue;
                }
                None => Vec::new(),
            };
            let end = match session(&daemon, &backend) {
                Ok(end) => end,
                Err(e) => {
                    tracing::error!("{name}: cannot serve the connection: {e}");
                    daemon.request_shutdown();
                    let _ = daemon.wait();
                    continue;
                }
            };
            counters.connected();
            *current.lock().unwrap_or_else(|e| e.into_inner()) = daemon.shutdown_handle();
            if self.stop.load(Ordering::Acquire) {
                daemon.request_shutdown();
            }
            tracing::info!("{name}: frontend connected");
            match daemon.wait() {
                // A VMM that exits or is killed just hangs up, mid-message or not.
                Ok(())
                | Err(vhost_user_backend::Error::HandleRequest(
                    vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage,
                )) => tracing::info!("{name}: frontend disconnected"),
                Err(e) => {
                    counters.protocol_error();
                    tracing::warn!("{name}: connection ended: {e}");
                }
            }
            *current.lock().unwrap_or_else(|e| e.into_inner()) = None;
            if let Some(end) = end {
                end();
            }
            // The daemon's end is closed by now, which ends the relay.
            for t in relay_threads {
                let _ = t.join();
            }
            // Dropping the daemon stops its queue threads (after the request each is in finishes).
            drop(daemon);
        }
    }
}
