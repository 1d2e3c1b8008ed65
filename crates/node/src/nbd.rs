//! An NBD server of a local file or RAM disk: what `lanbus nbd serve` runs, for checking NBD
//! clients and as a drive's local baseline.
//!
//! Layer: assembly, over `lanbus-nbd`. Every listener is bound before any is served, so that once
//! one answers all do; [`LocalExport::stop`] stops accepting, finishes the requests in flight,
//! flushes the device and removes the Unix socket file.

use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;

use lanbus_nbd::{BlockDevice, Export, FileDevice, MemDevice, Server, Stats};

use crate::{Error, Result};

/// What backs a local export.
#[derive(Debug, Clone)]
pub enum Backing {
    /// An existing file or block device.
    File(PathBuf),
    /// A RAM disk of this many bytes.
    Ram(u64),
}

/// A local export's settings.
#[derive(Debug, Clone)]
pub struct LocalOptions {
    /// The blocks.
    pub backing: Backing,
    /// The export's name (also the default export).
    pub name: String,
    /// Refuse writes.
    pub read_only: bool,
    /// Minimum block size in bytes (a power of two).
    pub block_size: u32,
    /// Worker threads per connection.
    pub workers: usize,
    /// A Unix socket path to listen on (a stale socket file there is replaced).
    pub socket: Option<PathBuf>,
    /// A TCP address to listen on.
    pub tcp: Option<SocketAddr>,
}

/// A running local export.
pub struct LocalExport {
    server: Server,
    socket: Option<PathBuf>,
    uris: Vec<String>,
    size: u64,
}

impl LocalExport {
    /// Opens the backing, binds every listener, then serves them all.
    pub fn start(o: LocalOptions) -> Result<LocalExport> {
        let io = |what: String| move |source| Error::Io { what, source };
        let device: Arc<dyn BlockDevice> = match &o.backing {
            Backing::File(path) => {
                let file = std::fs::OpenOptions::new()
                    .read(true)
                    .write(!o.read_only)
                    .open(path)
                    .map_err(io(format!("opening {}", path.display())))?;
                let size = file.metadata().map_err(io(format!("reading {}", path.display())))?.len();
                Arc::new(
                    FileDevice::from_file(file, size, o.block_size, o.read_only)
                        .map_err(|e| Error::BadSpec(format!("{}: {e}", path.display())))?,
                )
            }
            Backing::Ram(size) => {
                let dev = MemDevice::with_block_size(*size, o.block_size)
                    .map_err(|e| Error::BadSpec(format!("a RAM disk of {size} bytes: {e}")))?;
                Arc::new(if o.read_only { dev.into_read_only() } else { dev })
            }
        };
        let size = device.size_bytes();
        if size == 0 {
            return Err(Error::BadSpec(format!(
                "the export would be empty (size below one {}-byte block)",
                o.block_size
            )));
        }
        if o.socket.is_none() && o.tcp.is_none() {
            return Err(Error::BadSpec("give a Unix socket path or a TCP address to listen on".into()));
        }
        let server = Server::builder()
            .export(
                Export::new(o.name.clone(), device).read_only(o.read_only).description("lanbus nbd serve"),
            )
            .workers_per_connection(o.workers)
            .build()
            .map_err(|e| Error::Export(format!("the NBD server: {e}")))?;
        let mut listeners: Vec<(lanbus_nbd::Listener, String)> = Vec::new();
        if let Some(path) = &o.socket {
            if path.exists() {
                let meta =
                    std::fs::symlink_metadata(path).map_err(io(format!("reading {}", path.display())))?;
                if !meta.file_type().is_socket() {
                    return Err(Error::InUse(format!("{} exists and is not a socket", path.display())));
                }
                std::fs::remove_file(path).map_err(io(format!("removing stale {}", path.display())))?;
            }
            let l = UnixListener::bind(path).map_err(io(format!("binding {}", path.display())))?;
            listeners.push((l.into(), format!("nbd+unix:///{}?socket={}", o.name, path.display())));
        }
        if let Some(addr) = o.tcp {
            let l = TcpListener::bind(addr).map_err(io(format!("binding {addr}")))?;
            let local = l.local_addr().map_err(io(format!("binding {addr}")))?;
            listeners.push((l.into(), format!("nbd://{local}/{}", o.name)));
        }
        let mut uris = Vec::new();
        for (l, uri) in listeners {
            server.serve(l).map_err(|e| Error::Export(format!("serving {uri}: {e}")))?;
            uris.push(uri);
        }
        Ok(LocalExport { server, socket: o.socket, uris, size })
    }

    /// Where clients reach it.
    pub fn uris(&self) -> &[String] {
        &self.uris
    }

    /// The export's size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.size
    }

    /// Stops accepting, finishes the requests in flight, flushes; returns the server's counters.
    pub fn stop(self) -> Result<Stats> {
        let stats =
            self.server.shutdown().map_err(|e| Error::Export(format!("stopping the NBD server: {e}")))?;
        if let Some(path) = &self.socket {
            let _ = std::fs::remove_file(path);
        }
        Ok(stats)
    }
}
