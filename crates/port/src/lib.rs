//! Ports: poll-mode packet I/O, the layer between the transport and a wire.
//!
//! A [`Port`] moves whole Ethernet frames (destination MAC first, no FCS) in bursts. It knows
//! nothing of the lanbus transport above it: it only carries bytes, counts them, and lets an idle
//! driver block until there is something to receive. Every implementation (the simulated wire,
//! kernel UDP, AF_PACKET, AF_XDP, shared memory, DPDK) has the same shape, so the transport driver
//! is one loop:
//!
//! ```text
//! loop {
//!     port.rx_burst(32, &mut |frame| core.handle_frame(now, frame))?;
//!     port.tx_burst(32, &mut |buf| core.poll_transmit(now, buf))?;
//!     if idle { port.wait(core.poll_timeout() - now)?; }
//! }
//! ```
//!
//! Buffers are lent, not moved: `rx_burst` hands each frame to a callback as a borrowed slice
//! (zero-copy where the port maps its rings), and `tx_burst` hands the caller a transmit buffer to
//! fill. That keeps the hot path free of allocation and lets kernel-bypass ports avoid copies.
#![deny(missing_docs)]

use core::time::Duration;

use lanbus_wire::MacAddr;

pub mod afpacket;
pub mod afxdp;
mod cache;
pub mod check;
pub mod csum;
#[cfg(feature = "dpdk")]
pub mod dpdk;
pub mod fault;
pub mod hub;
pub mod layer;
pub mod multi;
pub mod netns;
pub mod shm;
pub mod sim;
pub mod spec;
pub mod udp;
pub mod vlan;

pub use hub::{Hub, HubConfig, HubPort, HubStats};
pub use layer::Layer;
pub use multi::{MultiConfig, MultiPort, PathReport};
pub use sim::{SimPort, SimWire, SimWireConfig, SimWireStats};
pub use spec::{LossSpec, PortKind, PortSpec, SPEC_HELP};

/// What a port counts. Counters only grow; read them with [`Port::counters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PortCounters {
    /// Frames handed to the receive callback.
    pub rx_frames: u64,
    /// Bytes in those frames.
    pub rx_bytes: u64,
    /// Frames accepted for transmission.
    pub tx_frames: u64,
    /// Bytes in those frames.
    pub tx_bytes: u64,
    /// Frames the port received but dropped (malformed, too long, not for lanbus, ring full).
    pub rx_dropped: u64,
    /// Frames the caller filled that could not be sent (too long, no buffer, device error).
    pub tx_dropped: u64,
    /// Received frames that were not for this node's VLAN (groups as VLANs: another VLAN's, or
    /// untagged), filtered out.
    pub rx_filtered: u64,
}

/// Why a port could not be opened or used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PortError {
    /// The port spec string is malformed; the message says what was expected.
    #[error("bad port spec {spec:?}: {why}")]
    BadSpec {
        /// The spec as given.
        spec: String,
        /// What is wrong and what a valid spec looks like.
        why: String,
    },
    /// The port needs something this machine or process lacks (root, a kernel feature, an
    /// interface, a cargo feature); the message says what and how to get it.
    #[error("port {spec:?} is unavailable: {why}")]
    Unavailable {
        /// The spec as given.
        spec: String,
        /// What is missing and how to fix it.
        why: String,
    },
    /// The caller broke the port's contract (a frame longer than the MTU, say).
    #[error("misuse: {0}")]
    Misuse(String),
    /// The operating system refused an operation.
    #[error("{op}: {source}")]
    Io {
        /// The operation that failed.
        op: &'static str,
        /// The operating system's error.
        source: std::io::Error,
    },
}

impl PortError {
    /// Wraps an I/O error with the name of the operation that failed.
    pub fn io(op: &'static str, source: std::io::Error) -> Self {
        PortError::Io { op, source }
    }
}

/// Result of a port operation.
pub type Result<T> = core::result::Result<T, PortError>;

/// The clock receive timestamps are in: nanoseconds since the Unix epoch (`CLOCK_REALTIME`).
pub fn realtime_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// A poll-mode port: bursts of Ethernet frames in and out.
///
/// Call order: any interleaving of `rx_burst`, `tx_burst` and `wait` from one thread. A port that
/// can be split into receive and transmit halves for different threads says so in its own docs.
pub trait Port: Send {
    /// Receives up to `max` frames, calling `on_frame` once per frame with its bytes (Ethernet
    /// header first). Returns how many frames were delivered; 0 means nothing is waiting. The slice
    /// is valid only during the call.
    fn rx_burst(&mut self, max: usize, on_frame: &mut dyn FnMut(&[u8])) -> Result<usize>;

    /// [`Port::rx_burst`], also giving each frame's receive timestamp where the port has one:
    /// when the frame reached this host's kernel, in nanoseconds since the Unix epoch
    /// (`CLOCK_REALTIME`, compare with [`realtime_ns`]). The time between that and when the frame
    /// is read is this host's (its threads waiting for a core, a ring's block timeout), not the
    /// network's. The default gives `None` for every frame.
    fn rx_burst_stamped(
        &mut self,
        max: usize,
        on_frame: &mut dyn FnMut(&[u8], Option<u64>),
    ) -> Result<usize> {
        self.rx_burst(max, &mut |frame| on_frame(frame, None))
    }

    /// Transmits up to `max` frames. For each, `fill` is given a buffer of at least
    /// [`Port::frame_capacity`] bytes; it writes one frame at the start and returns its length, or
    /// returns `None` when it has nothing more to send. Returns the number of frames sent. A port
    /// whose transmit queue is full stops asking early; the caller keeps its frames and tries again.
    fn tx_burst(&mut self, max: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> Result<usize>;

    /// Whether [`Port::tx_borrowed`] sends frames from the caller's memory, without first copying
    /// them into the port's own buffers. A caller that keeps its frames anyway (a transport
    /// keeps each until it is acknowledged) then hands them over where they lie, and each byte
    /// is copied once fewer. The default: no.
    fn borrows_frames(&self) -> bool {
        false
    }

    /// Transmits `frames` (whole Ethernet frames) from the caller's memory where the port
    /// [borrows frames](Port::borrows_frames), else through [`Port::tx_burst`]. Returns how many
    /// the port took: a port that borrows takes them all, counting those it could not send
    /// (a full socket buffer, a frame longer than [`Port::frame_capacity`]) as dropped, as a
    /// wire would lose them; one that copies stops where its queue is full.
    fn tx_borrowed(&mut self, frames: &[&[u8]]) -> Result<usize> {
        self.send_frames(frames)
    }

    /// [`Port::tx_borrowed`] for frames that each lie in two pieces, the first followed by the
    /// second (a transport's headers and then a message's body where its sender keeps it; the
    /// second piece is often empty). A port that borrows frames gathers the pieces as it sends;
    /// the default copies them into its buffers through [`Port::tx_burst`].
    fn tx_borrowed_parts(&mut self, frames: &[[&[u8]; 2]]) -> Result<usize> {
        copy_parts(self, frames)
    }

    /// Blocks until a frame may be waiting to be received or `timeout` passes (`None`: no limit).
    /// Spurious wake-ups are allowed; a missed wake-up is not.
    fn wait(&mut self, timeout: Option<Duration>) -> Result<()>;

    /// The largest Ethernet payload (lanbus header and data, without the 14-byte Ethernet header)
    /// the link carries.
    fn mtu(&self) -> usize;

    /// The largest whole frame `tx_burst` accepts: `mtu() + 14`.
    fn frame_capacity(&self) -> usize {
        self.mtu() + lanbus_wire::ethernet::HEADER_LEN
    }

    /// A file descriptor that polls readable when a frame may be waiting, for drivers that wait
    /// on several things at once (the port and a wake-up eventfd) with poll(2) instead of
    /// [`Port::wait`]. `None` (the default) means the port has no such descriptor: use `wait`.
    fn readiness_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }

    /// Before a driver sleeps on [`Port::readiness_fd`]: a port whose descriptor is a doorbell
    /// the peer rings only on request (shared memory) asks for it here. Returns false when a
    /// frame is waiting already: do not sleep. Either way, call [`Port::disarm_readiness`] after.
    /// The default (a socket's descriptor needs no asking) returns true.
    fn arm_readiness(&mut self) -> bool {
        true
    }

    /// After the sleep on [`Port::readiness_fd`] (or a false [`Port::arm_readiness`]): the port
    /// stops asking for its doorbell and clears it. The default does nothing.
    fn disarm_readiness(&mut self) {}

    /// Sends one TCP segment larger than the MTU for the kernel (or the device) to cut into
    /// `gso.segment_bytes` pieces and checksum, as a NIC with segmentation offload does (the
    /// frame's TCP checksum field holds the pseudo-header sum). `Ok(false)` when the port cannot:
    /// the caller then sends the segments itself. An error leaves the frame with the caller (a
    /// full queue among them: try again later). The default cannot.
    fn tx_gso(&mut self, frame: &[u8], gso: Gso) -> Result<bool> {
        let _ = (frame, gso);
        Ok(false)
    }

    /// This port's own MAC address (source of the frames it sends).
    fn mac(&self) -> MacAddr;

    /// Whether every frame this port delivers was authenticated (a keyed layer verified its tag):
    /// a transport above it then needs no checksum of its own. The default: no.
    fn authenticates(&self) -> bool {
        false
    }

    /// Where the port carries the node's group as an 802.1Q VLAN ID ([`vlan::VlanPort`]), the
    /// handle the runtime sets it with; `None` (the default) for untagged ports.
    fn vlan(&self) -> Option<vlan::VlanId> {
        None
    }

    /// A snapshot of the counters.
    fn counters(&self) -> PortCounters;

    /// A peer node one of whose paths this port has just found failed, for the transport to send
    /// it every frame in flight again at once (some went by the failed path); `None` when there
    /// is none. Only a port with several paths ([`multi::MultiPort`]) has any; the default: none.
    fn take_failed_peer(&mut self) -> Option<MacAddr> {
        None
    }

    /// Each path to each peer node, for a port with several ([`multi::MultiPort`]); empty (the
    /// default) for a port with one link.
    fn paths(&self) -> Vec<PathReport> {
        Vec::new()
    }

    /// Sends the given frames, a convenience over [`Port::tx_burst`] for tests and control traffic.
    /// Returns how many frames the port took; a frame longer than [`Port::frame_capacity`] is
    /// skipped (it is not counted in the return value).
    fn send_frames(&mut self, frames: &[&[u8]]) -> Result<usize> {
        copy_frames(self, frames)
    }
}

/// Sends whole frames through `port`'s [`Port::tx_burst`], copying each into the port's buffer
/// (what [`Port::send_frames`] does by default); returns how many frames the port took. A frame
/// longer than [`Port::frame_capacity`] is skipped (it is not counted in the return value).
pub fn copy_frames<P: Port + ?Sized>(port: &mut P, frames: &[&[u8]]) -> Result<usize> {
    let mut next = 0;
    port.tx_burst(frames.len(), &mut |buf: &mut [u8]| loop {
        let frame = frames.get(next)?;
        next += 1;
        if frame.len() <= buf.len() {
            buf[..frame.len()].copy_from_slice(frame);
            return Some(frame.len());
        }
    })
}

/// Sends frames in two pieces each through `port`'s [`Port::tx_burst`], joining each frame's
/// pieces in the port's buffer; returns how many frames the port took. A frame longer than
/// [`Port::frame_capacity`] is skipped (it is not counted in the return value).
pub fn copy_parts<P: Port + ?Sized>(port: &mut P, frames: &[[&[u8]; 2]]) -> Result<usize> {
    let mut next = 0;
    port.tx_burst(frames.len(), &mut |buf: &mut [u8]| loop {
        let [head, body] = frames.get(next)?;
        next += 1;
        let len = head.len() + body.len();
        if len <= buf.len() {
            buf[..head.len()].copy_from_slice(head);
            buf[head.len()..len].copy_from_slice(body);
            return Some(len);
        }
    })
}

/// How to segment a frame handed to [`Port::tx_gso`] (the fields of a `virtio_net_hdr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gso {
    /// TCP payload bytes per segment (the MSS).
    pub segment_bytes: u16,
    /// Offset of the TCP header in the frame.
    pub csum_start: u16,
    /// Offset of the checksum field from `csum_start` (16 for TCP).
    pub csum_offset: u16,
    /// Bytes of headers (Ethernet, IP, TCP) in front of the payload.
    pub header_bytes: u16,
    /// IPv6 rather than IPv4.
    pub ipv6: bool,
}

// A box is a layer that changes nothing: every method forwards to the boxed port.
impl<P: Port + ?Sized> Layer for Box<P> {
    type Inner = P;
    fn inner(&self) -> &P {
        self
    }
    fn inner_mut(&mut self) -> &mut P {
        self
    }
}
