//! A [`BlockDevice`] (in lanbus: the remote NVMe namespace) as a vhost-user-blk backend, so a
//! VMM such as QEMU gives it to its guest as a virtio-blk disk:
//!
//! ```text
//! qemu-system-x86_64 -object memory-backend-memfd,id=mem,size=256M,share=on -numa node,memdev=mem \
//!   -chardev socket,id=c0,path=/run/lanbus/vda.sock,reconnect=1 \
//!   -device vhost-user-blk-pci,chardev=c0,num-queues=2 ...
//! ```
//!
//! Layer: frontend, beside the NBD server; it depends on `lanbus-nbd` only for the
//! [`BlockDevice`] trait. [`serve_blk`] listens on a Unix socket and serves one frontend at a time
//! on its own threads (an accept thread, the vhost-user message thread, one thread per queue);
//! when a frontend disconnects, or sends something the protocol does not allow, its connection
//! ends and the next one gets a fresh device, so QEMU's `reconnect=` can start over against it.
//! The vhost-user protocol is the rust-vmm crates' (`vhost`, `vhost-user-backend`); the
//! virtio-blk requests are [`blk`]'s.

#![deny(missing_docs)]
#![deny(unsafe_code)]

pub mod backend;
pub mod blk;

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use lanbus_nbd::BlockDevice;
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

pub use blk::{BlkStats, DeviceInfo};

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The options are not usable (local misuse).
    #[error("bad vhost-user-blk options: {0}")]
    Options(String),
    /// The socket could not be set up.
    #[error("vhost-user-blk socket {path}: {source}")]
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
    path: PathBuf,
    stop: Arc<AtomicBool>,
    current: Arc<Mutex<Option<ShutdownHandle>>>,
    stats: Arc<BlkStats>,
    thread: Option<JoinHandle<()>>,
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
    let socket_error = |source| Error::Socket { path: path.to_path_buf(), source };
    if std::fs::symlink_metadata(path).is_ok_and(|m| {
        use std::os::unix::fs::FileTypeExt;
        m.file_type().is_socket()
    }) {
        std::fs::remove_file(path).map_err(socket_error)?;
    }
    let listener = UnixListener::bind(path).map_err(socket_error)?;
    let epoll = Epoll::new().map_err(socket_error)?;
    epoll
        .ctl(ControlOperation::Add, listener.as_raw_fd(), EpollEvent::new(EventSet::IN, 0))
        .map_err(socket_error)?;
    let stop = Arc::new(AtomicBool::new(false));
    let current: Arc<Mutex<Option<ShutdownHandle>>> = Arc::new(Mutex::new(None));
    let stats = Arc::new(BlkStats::default());
    let thread = {
        let (stop, current, stats) = (stop.clone(), current.clone(), stats.clone());
        let name = format!("vhost-blk {}", path.display());
        std::thread::Builder::new()
            .name("vhost-blk-accept".into())
            .spawn(move || accept_loop(&listener, &epoll, &name, &dev, &info, &stop, &current, &stats))
            .map_err(socket_error)?
    };
    Ok(BlkServer { path: path.to_path_buf(), stop, current, stats, thread: Some(thread) })
}

#[allow(clippy::too_many_arguments)]
fn accept_loop(
    listener: &UnixListener,
    epoll: &Epoll,
    name: &str,
    dev: &Arc<dyn BlockDevice>,
    info: &DeviceInfo,
    stop: &AtomicBool,
    current: &Mutex<Option<ShutdownHandle>>,
    stats: &Arc<BlkStats>,
) {
    let mut events = [EpollEvent::default(); 1];
    // Acquire: pairs with the Release store in `stop`, so the wake-up connection is seen after it.
    while !stop.load(Ordering::Acquire) {
        match epoll.wait(200, &mut events) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::error!("{name}: waiting for a connection: {e}");
                return;
            }
        }
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::<()>::new());
        let backend =
            Arc::new(backend::BlkBackend::new(dev.clone(), info.clone(), mem.clone(), stats.clone()));
        let mut daemon = match VhostUserDaemon::new(name.to_string(), backend, mem) {
            Ok(d) => d,
            Err(e) => {
                tracing::error!("{name}: cannot set up a device for a connection: {e}");
                std::thread::sleep(std::time::Duration::from_millis(200));
                continue;
            }
        };
        let mut l = match listener.try_clone() {
            // Built from a listener it does not own the path of, so dropping it unlinks nothing.
            Ok(l) => Listener::from(l),
            Err(e) => {
                tracing::error!("{name}: {e}");
                return;
            }
        };
        if let Err(e) = daemon.start(&mut l) {
            tracing::warn!("{name}: connection not started: {e}");
            continue;
        }
        // Relaxed: a counter.
        stats.connections.fetch_add(1, Ordering::Relaxed);
        *current.lock().unwrap_or_else(|e| e.into_inner()) = daemon.shutdown_handle();
        if stop.load(Ordering::Acquire) {
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
                stats.protocol_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!("{name}: connection ended: {e}");
            }
        }
        *current.lock().unwrap_or_else(|e| e.into_inner()) = None;
        // Dropping the daemon stops its queue threads (after the request each is in finishes).
        drop(daemon);
    }
}

impl BlkServer {
    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The counters.
    pub fn stats(&self) -> &Arc<BlkStats> {
        &self.stats
    }

    /// Disconnects the frontend (requests in progress finish first), stops accepting and removes
    /// the socket file.
    pub fn stop(mut self) {
        self.shutdown();
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

impl Drop for BlkServer {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.shutdown();
        }
    }
}
