//! lanbus's TCP/IP stack server: a user-level stack on a lanbus port, serving programs over
//! shared memory.
//!
//! Layer: stack (above ports and rings; beside the PCIe and messaging layers). The design follows
//! the rump-kernel networking study (a TCP/IP stack as a server process, applications its clients)
//! and fixes what made it slow there: each copy request carries a *copy unit* of many clusters
//! rather than one, and the bytes cross in shared-memory rings rather than a Unix socket.
//!
//! - [`server`]: the server. It owns a port that receives every EtherType
//!   (`afpacket:IFACE,ethertypes=all`), runs smoltcp over it ([`device`]: ARP, ICMP echo, TCP with
//!   window scaling, timestamps, CUBIC, keep-alive and timeouts; UDP), and serves clients that
//!   attach to its Unix socket: each gets a memfd with two frame pipes (the ring crate's, one per
//!   direction) and two doorbells, or, in the baseline mode, uses the Unix socket itself.
//! - [`client`]: the client library: TCP streams and listeners and UDP sockets through the server,
//!   with `std::io::Read`/`Write` on streams.
//! - [`proto`]: the messages between the two; credits bound what either side may have in flight
//!   per connection, so a slow reader stalls only its own connection (TCP's window closes).
//! - `share`: who holds each socket. A program that forks hands its sockets to the child as the
//!   kernel does: the server keeps a reference count per socket across attachments, and a fork
//!   ticket holds the child's references until the child, attached anew, claims them.
//!
//! The stack owns its address: the interface it uses must have no kernel IP address (AF_PACKET
//! does not take frames away from the kernel, whose TCP would answer the stack's segments with
//! resets).
#![deny(missing_docs)]

mod buffers;
pub mod client;
pub mod device;
#[cfg(any(fuzzing, test))]
pub mod fuzz;
pub mod proto;
pub mod server;
mod share;

#[cfg(test)]
mod tests;

/// Whether a CPU is spare for a thread to poll on: fewer threads runnable in the whole system
/// than CPUs, by the kernel's count in `/proc/loadavg` (which includes the caller). A thread
/// that waits for work polls only then: where every CPU has a runnable thread, a polling one
/// takes CPU time from the thread whose work it waits for (nginx's workers, the load and the
/// server on two CPUs kept the server off its CPU for half of each second).
pub(crate) fn spare_cpu() -> bool {
    static CPUS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let cpus = *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let Ok(text) = std::fs::read_to_string("/proc/loadavg") else { return true };
    // "0.50 0.40 0.30 RUNNABLE/THREADS LAST_PID"
    let runnable = text.split_whitespace().nth(3).and_then(|f| f.split('/').next()?.parse::<usize>().ok());
    runnable.is_none_or(|n| n < cpus)
}

/// How a client's bytes cross to the server: the copy unit and the channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyUnit {
    /// Bytes per cluster (the paper's MCLBYTES: 2048, 4096, ...).
    pub cluster_bytes: u32,
    /// Clusters per copy request (the paper's MCLNUM: 1, 4, 8, 16, ...).
    pub clusters: u32,
    /// The channel.
    pub channel: Channel,
}

/// The channel a client's requests cross.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Channel {
    /// Shared-memory rings (memfd) with doorbells: the default.
    SharedMemory,
    /// The Unix socket itself, one message per copy request: the paper's baseline.
    UnixSocket,
}

impl CopyUnit {
    /// The default: 64 KiB copy requests (32 clusters of 2 KiB) over shared memory.
    pub const DEFAULT: CopyUnit =
        CopyUnit { cluster_bytes: 2048, clusters: 32, channel: Channel::SharedMemory };
    /// The paper's baseline: one 2 KiB cluster per request over the Unix socket.
    pub const BASELINE: CopyUnit =
        CopyUnit { cluster_bytes: 2048, clusters: 1, channel: Channel::UnixSocket };

    /// Bytes of data per copy request.
    pub fn bytes(&self) -> usize {
        self.cluster_bytes as usize * self.clusters as usize
    }

    /// Checks the unit is one the server accepts: clusters of 512 B to 64 KiB, requests of at most
    /// [`proto::MAX_PAYLOAD`].
    pub fn check(&self) -> Result<(), String> {
        if !(512..=65536).contains(&self.cluster_bytes) {
            return Err(format!("cluster size {} is outside 512..=65536 bytes", self.cluster_bytes));
        }
        if self.clusters == 0 || self.bytes() > proto::MAX_PAYLOAD {
            return Err(format!(
                "{} clusters of {} bytes: a copy request carries 1 cluster to {} bytes",
                self.clusters,
                self.cluster_bytes,
                proto::MAX_PAYLOAD
            ));
        }
        Ok(())
    }
}

impl Default for CopyUnit {
    fn default() -> Self {
        CopyUnit::DEFAULT
    }
}

impl std::str::FromStr for CopyUnit {
    type Err = String;
    /// `BYTESxCOUNT[,socket]`, e.g. `2048x16` or `2048x1,socket` (the baseline).
    fn from_str(s: &str) -> Result<CopyUnit, String> {
        let (unit, channel) = match s.split_once(',') {
            Some((u, "socket")) => (u, Channel::UnixSocket),
            Some((u, "shm")) => (u, Channel::SharedMemory),
            Some((_, other)) => return Err(format!("{other:?}: the channel is shm (default) or socket")),
            None => (s, Channel::SharedMemory),
        };
        let bad = || format!("{s:?}: write CLUSTER_BYTESxCLUSTERS[,socket], e.g. 2048x16");
        let (b, n) = unit.split_once('x').ok_or_else(bad)?;
        let unit = CopyUnit {
            cluster_bytes: b.trim().parse().map_err(|_| bad())?,
            clusters: n.trim().parse().map_err(|_| bad())?,
            channel,
        };
        unit.check()?;
        Ok(unit)
    }
}

impl std::fmt::Display for CopyUnit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.cluster_bytes, self.clusters)?;
        if self.channel == Channel::UnixSocket {
            write!(f, ",socket")?;
        }
        Ok(())
    }
}

/// The first bytes a client writes: magic, channel, cluster bytes, clusters.
pub(crate) mod hello {
    /// Magic and version.
    pub const MAGIC: &[u8; 8] = b"LBSTACK\x01";
    /// Bytes of the client's hello.
    pub const LEN: usize = 20;
    /// Bytes of the server's answer: magic, status (0 ok, else an errno), the server's IPv4
    /// address, the prefix length.
    pub const ANSWER_LEN: usize = 20;
}

/// Pipe shape for a copy unit: one message (header and a unit of data) per buffer, about 4 MiB
/// per direction.
pub(crate) fn pipe_config(unit: usize) -> lanbus_ring::pipe::PipeConfig {
    let buf_size = (proto::HEADER_LEN + unit).next_multiple_of(64);
    let count = ((4usize << 20) / buf_size).clamp(8, 256).next_power_of_two().min(256);
    lanbus_ring::pipe::PipeConfig { slots: count as u16, buffers: count as u32, buf_size: buf_size as u32 }
}

/// Offset of pipe `k` (0: server to client, 1: client to server) in a client's region.
pub(crate) fn pipe_offset(unit: usize, k: usize) -> usize {
    k * pipe_config(unit).bytes_needed().next_multiple_of(4096)
}
