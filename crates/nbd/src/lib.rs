//! `lanbus-nbd`: exports a block device over the Network Block Device protocol, so that fio
//! (`--ioengine=nbd`), `qemu-img`, `qemu-io`, QEMU, `nbdinfo` and the kernel's `nbd-client` can use
//! it, over a Unix socket or TCP.
//!
//! Layers, bottom up: the block device it exports (`lanbus_block::BlockDevice`, with RAM and file
//! implementations there; [`Errno::of`] is what a client is told of a device's failure),
//! [`proto`] (wire format and per-request checks: pure functions over bytes, fuzzed),
//! [`handshake`] (the fixed newstyle negotiation over any reader and writer), [`server`] (sockets,
//! threads, shutdown, counters) and [`client`] (a small blocking client for tests, demos and
//! benchmarks).
//!
//! Spec: the NBD protocol, NetworkBlockDevice/nbd `doc/proto.md`: fixed newstyle handshake with
//! `NO_ZEROES`; options `EXPORT_NAME`, `LIST`, `INFO`, `GO` (`NBD_INFO_EXPORT`, `NAME`,
//! `DESCRIPTION`, `BLOCK_SIZE`), `ABORT`; simple replies only; commands READ, WRITE, FLUSH, TRIM,
//! WRITE_ZEROES, DISC, with FUA. READ/WRITE payloads are limited to [`proto::MAX_PAYLOAD_BYTES`]
//! (32 MiB).
//!
//! ```
//! use std::sync::Arc;
//! use lanbus_block::MemDevice;
//! use lanbus_nbd::{Client, Export, Server};
//!
//! let dir = std::env::temp_dir().join(format!("nbd-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! let socket = dir.join("nbd.sock");
//! let server = Server::builder()
//!     .export(Export::new("export", Arc::new(MemDevice::new(1 << 20))))
//!     .build()
//!     .unwrap();
//! server.serve(std::os::unix::net::UnixListener::bind(&socket).unwrap()).unwrap();
//! let mut client = Client::connect_unix(&socket, "export").unwrap();
//! client.write(4096, &[7u8; 512], false).unwrap();
//! let mut back = [0u8; 512];
//! client.read(4096, &mut back).unwrap();
//! assert_eq!(back, [7u8; 512]);
//! client.disconnect().unwrap();
//! server.shutdown().unwrap();
//! std::fs::remove_dir_all(&dir).unwrap();
//! ```
#![deny(unsafe_code)]
#![deny(missing_docs)]

pub mod client;
pub mod handshake;
pub mod proto;
pub mod server;

pub use client::{Client, ClientError, Completion};
#[cfg(any(test, fuzzing))]
pub use handshake::fuzz_handshake;
pub use proto::Errno;
#[cfg(any(test, fuzzing))]
pub use proto::{fuzz_option, fuzz_request};
pub use server::{Export, Listener, Server, ServerBuilder, Stats, Stream};

/// Errors of setting up or stopping a server.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The server's configuration is unusable.
    #[error("NBD server configuration: {0}")]
    Config(String),
    /// A socket or thread could not be set up.
    #[error("NBD server I/O: {0}")]
    Io(#[from] std::io::Error),
    /// Flushing an export's device failed at shutdown.
    #[error("flushing export {0:?} failed: {1}")]
    Flush(String, lanbus_block::DeviceError),
}
