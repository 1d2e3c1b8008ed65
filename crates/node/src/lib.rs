//! A lanbus node as a library: the pieces that make a host or an I/O box out of the bridges, the
//! device models and the frontends, so a program can run one without the `lanbus` command line.
//!
//! Layer: assembly, above `lanbus-bridge`, `lanbus-nvme`, `lanbus-block` and `lanbus-nbd`; the
//! `lanbus` binary's daemons, `lanbus demo` and `lanbus bench` are built on it.
//!
//! - [`config`]: the runtime and bridge settings every node uses, and the daemons' files.
//! - [`control`]: a daemon's control socket, its server and its client.
//! - [`device`]: the I/O box: a device bridge with its drive, NIC and DMA engine.
//! - [`drive`]: the remote NVMe drive: the controller model as a device bridge's function, the
//!   driver on a host bridge, the namespace as a block device (for NBD and vhost-user-blk).
//! - [`fabric`]: a host and an I/O box in one process over a simulated wire or two real ports.
//! - [`host`]: the host: a host bridge that exports its group's drive and NIC as they come and go.
//! - [`lspci`]: remote functions described like `lspci -v`.
//! - [`metrics`]: a daemon's counters in the Prometheus text format, served over HTTP.
//! - [`msg`]: a messaging endpoint (the MPI engine) over a runtime on a port it owns.
//! - [`msgd`]: the messaging daemon that owns the port, and the processes that attach to it
//!   over shared memory.
//! - [`nbd`]: an NBD server of a local file or RAM disk.
//! - [`nic`]: the remote NIC (a virtio-net function whose wire is a TAP in the I/O box).
//! - [`process`]: a daemon's signals and helper processes that end with it.
//! - [`security`]: a daemon's fabric key, the layer that seals its frames, and their status.
//! - [`stackd`]: the TCP/IP stack server on its port, with its control socket.
//!
//! A remote drive over the simulated wire, written and read back through the NVMe driver
//! (`examples/remote_drive.rs` exports it over NBD too):
//!
//! ```
//! use lanbus_node::drive::{controller, NvmeBacking};
//! use lanbus_node::fabric::SimFabric;
//!
//! let ctrl = controller(&NvmeBacking::Ram(4 << 20), 512)?;
//! let fabric = SimFabric::start(ctrl, 0.0, 1)?;
//! fabric.driver.write_at(4096, &[7; 512], false).expect("write");
//! let mut back = [0; 512];
//! fabric.driver.read_at(4096, &mut back).expect("read");
//! assert_eq!(back, [7; 512]);
//! # fabric.driver.shutdown().expect("shutdown");
//! # Ok::<(), lanbus_node::Error>(())
//! ```
#![deny(unsafe_code)]
#![deny(missing_docs)]

use std::path::PathBuf;
use std::time::Duration;

use lanbus_pcie::Bdf;

pub mod config;
pub mod control;
pub mod device;
pub mod drive;
pub mod fabric;
pub mod host;
pub mod lspci;
pub mod metrics;
pub mod msg;
pub mod msgd;
pub mod nbd;
pub mod nic;
pub mod process;
pub mod security;
pub mod stackd;

/// What went wrong assembling or running a node.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A spec, size or address given by the user that does not parse.
    #[error("{0}")]
    BadSpec(String),
    /// A configuration file that cannot be read or does not describe a daemon.
    #[error("{}: {why}", path.display())]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// The drive's backing file cannot be opened or created.
    #[error("opening {}{hint}: {source}", path.display())]
    Backing {
        /// The file.
        path: PathBuf,
        /// What the user may do about it.
        hint: &'static str,
        /// The system's error.
        source: std::io::Error,
    },
    /// The NVMe controller model or its function refused the configuration.
    #[error("NVMe controller: {0}")]
    Nvme(String),
    /// The NVMe driver did not start on the function.
    #[error("starting the driver on {bdf}: {source}")]
    Driver {
        /// The function.
        bdf: Bdf,
        /// Why.
        source: lanbus_nvme::pcie::AttachError,
    },
    /// A bridge failed to start or to reach its device.
    #[error(transparent)]
    Bridge(#[from] lanbus_bridge::BridgeError),
    /// A port could not be opened.
    #[error(transparent)]
    Port(#[from] lanbus_port::PortError),
    /// No device appeared on the host bridge in time.
    #[error("the host bridge enumerated nothing in {0:?}")]
    NoDevice(Duration),
    /// A system call on a file, socket or thread failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The system's error.
        source: std::io::Error,
    },
    /// A socket or interface another daemon holds.
    #[error("{0}")]
    InUse(String),
    /// An export (NBD, vhost-user, vfio-user, TAP) could not be set up.
    #[error("{0}")]
    Export(String),
    /// The TCP/IP stack server did not start.
    #[error("starting the stack server: {0}")]
    Stack(String),
    /// The fabric key file cannot be used.
    #[error(transparent)]
    Key(#[from] lanbus_secure::KeyError),
}

/// Result of the assembly.
pub type Result<T> = core::result::Result<T, Error>;

/// Parses a size: `4096`, `64K`, `1M`, `2G`, `1T` (binary units).
pub fn parse_size(s: &str) -> Result<u64> {
    let s = s.trim();
    let (digits, shift) = match s.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 10),
        Some('M') => (&s[..s.len() - 1], 20),
        Some('G') => (&s[..s.len() - 1], 30),
        Some('T') => (&s[..s.len() - 1], 40),
        _ => (s, 0),
    };
    let n: u64 =
        digits.parse().map_err(|_| Error::BadSpec(format!("size {s:?} is not a number with K/M/G/T")))?;
    n.checked_mul(1 << shift).ok_or_else(|| Error::BadSpec(format!("size {s:?} is too large")))
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes() {
        assert_eq!(super::parse_size("4096").unwrap(), 4096);
        assert_eq!(super::parse_size("64k").unwrap(), 64 << 10);
        assert_eq!(super::parse_size("1G").unwrap(), 1 << 30);
        assert!(super::parse_size("x").is_err());
        assert!(super::parse_size("99999999999T").is_err());
    }
}
