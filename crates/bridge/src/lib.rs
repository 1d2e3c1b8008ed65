//! The PCIe bridges over the lanbus fabric: a device bridge that hosts PCIe functions in an
//! "I/O box", and a host bridge that enumerates them and lets local users reach them.
//!
//! Layer: bridges, the threaded part of PCIe over Ethernet (the PCIe logic itself, TLPs, the
//! requester, configuration space and device models, is the sans-IO `lanbus-pcie`). Both bridges
//! ride a [`lanbus_runtime::Runtime`]: one TLP per transport message on a channel of
//! [`PCIE_CHANNELS`], between a host and the devices of its group (heartbeats carry role, name and
//! group; the transport drops DATA of other groups).
//!
//! Channels: the host bridge opens each device session (every time a device appears, and again
//! for a retried enumeration) on the next of [`PCIE_CHANNELS`] in turn, and only the current
//! session's channel counts on either side: the device bridge answers and issues its DMA on the
//! channel its host's configuration requests last came on, and the host drops what arrives on
//! another, so a late completion or DMA request of an earlier session is never taken for the
//! current one's. A peer that restarted is the transport's business: it tells the new incarnation
//! from the old by their epochs and starts its channels afresh.
//!
//! Thread rule (what keeps this free of deadlock): the runtime's receive thread never waits for a
//! device model or a user. On the device side a sans-IO model, which never blocks, runs inline on
//! the receive thread (served, fed its completions and run where its TLPs arrive); a blocking
//! model has a worker thread that owns it: configuration and memory requests are queued to it,
//! completions for its DMA reads go into its completion table (keyed by tag), and its blocking DMA
//! read waits there, on the worker, never on the receive thread. On the host
//! side the receive handler serves device memory reads from host memory regions, applies memory
//! writes and MSI-X, and hands completions to the user threads that wait for them; enumeration
//! runs on a configuration thread.
//!
//! Every non-posted request goes through `lanbus_pcie::requester::Requester`, driven with this
//! crate's clock: it carries a tag and a deadline and ends with its completions, a clear error
//! when its peer goes down or leaves the group, or a timeout. Nothing waits forever.
//!
//! - [`device`]: [`DeviceBridge`] and [`HostedFunction`].
//! - [`host`]: [`HostBridge`], [`RemoteFunction`], interrupts and events.
//! - [`region`]: [`DmaRegion`] and [`DmaBuffer`], host memory that devices may reach.
//! - [`local`]: [`LocalBus`], the same functions driven in-process with no fabric (the ceiling).

#![deny(missing_docs)]

mod counters;
pub mod device;
mod eventfd;
pub mod host;
mod hosted;
mod inline;
pub mod local;
mod reads;
pub mod region;

use core::time::Duration;

use lanbus_wire::MacAddr;

use lanbus_pcie::device::DmaError;
use lanbus_pcie::{Bdf, CplStatus, Tag, Tlp};

pub use device::{DeviceBridge, DeviceBridgeConfig, DeviceBridgeStats};
pub use eventfd::EventFd;
pub use host::{
    HostBridge, HostBridgeConfig, HostBridgeStats, HostEvent, RemoteBar, RemoteFunction, RemoteMsix,
};
pub use hosted::HostedFunction;
/// Bytes shared with the bridge's thread ([`HostBridge::mmio_write_shared`]).
pub use lanbus_transport::{Lend, LentSlice};
pub use local::LocalBus;
pub use region::{DmaBuffer, DmaRegion};

/// The first transport channel PCIe TLPs ride, one TLP per message.
pub const PCIE_CHANNEL: u16 = 0x5000;

/// The channels PCIe sessions use: [`PCIE_CHANNEL`] and the 255 after it.
pub const PCIE_CHANNELS: core::ops::Range<u16> = PCIE_CHANNEL..PCIE_CHANNEL + 0x100;

/// How long a thread that waits for the fabric (a user for its completions or an interrupt, a
/// device worker for its requests) looks again, yielding the core, before it sleeps.
///
/// Spinning pays only with a core to spare: the runtime threads of a busy node spin already (one
/// in run-to-completion mode, two in pipeline mode), and a third spinner on a 2-core machine takes
/// the core the thread bringing the news needs: on 2 cores MMIO reads got slower the longer users
/// spun, over every port and in both thread modes (`docs/architecture.md`, "Threads"). So:
/// no spin below 4 CPUs, 50 us from 4 on.
pub(crate) fn spin_budget() -> Duration {
    static BUDGET: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *BUDGET.get_or_init(|| {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        if cpus >= 4 {
            Duration::from_micros(50)
        } else {
            Duration::ZERO
        }
    })
}

/// The completion timeout both bridges use unless told otherwise (PCIe's default range A is
/// 50 us .. 10 ms for silicon; a fabric with retransmission needs more).
pub const DEFAULT_COMPLETION_TIMEOUT: Duration = Duration::from_millis(500);

/// Why a bridge operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BridgeError {
    /// No function with that address is known (never enumerated, or removed).
    #[error("no device {0} on this host bridge")]
    NoSuchDevice(Bdf),
    /// The device went down (heartbeats stopped) or left our group while the request was
    /// outstanding.
    #[error("device {bdf} ({mac}) is gone: it stopped heartbeating or left the group")]
    DeviceGone {
        /// The function.
        bdf: Bdf,
        /// Its device bridge.
        mac: MacAddr,
    },
    /// The completions did not arrive within the completion timeout.
    #[error("completion timeout after {0:?}")]
    Timeout(Duration),
    /// The completer answered with a status other than Successful Completion.
    #[error("completer answered {0}")]
    Completion(CplStatus),
    /// The completions did not add up to the request (a peer's mistake).
    #[error("bad completion: {0}")]
    BadCompletion(lanbus_pcie::Error),
    /// The request cannot be built (length, alignment, 4 KiB crossing...): a local mistake.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// Enumeration or resource assignment failed.
    #[error("enumeration of {mac}: {why}")]
    Enumeration {
        /// The device bridge.
        mac: MacAddr,
        /// What went wrong.
        why: String,
    },
    /// A DMA of a device model failed.
    #[error("DMA: {0}")]
    Dma(DmaError),
    /// The runtime could not start (thread or eventfd creation).
    #[error("cannot start the bridge: {0}")]
    Start(String),
    /// The bridge is shutting down.
    #[error("the bridge is shutting down")]
    Shutdown,
}

/// Result of the bridges.
pub type BridgeResult<T> = core::result::Result<T, BridgeError>;

/// Locks a mutex, going on with the data if a panicking thread poisoned it (the bridges' state is
/// consistent between statements that could panic).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What to do with bytes that are not a TLP this codec models: for a non-posted request, the
/// Unsupported Request completion to send back (requester and tag read from the raw header);
/// `None` for posted requests, completions and garbage (count and drop those).
pub(crate) fn ur_for_raw(bytes: &[u8], completer: Bdf) -> Option<Tlp> {
    if bytes.len() < 8 {
        return None;
    }
    let fmt = bytes[0] >> 5;
    let ty = bytes[0] & 0x1f;
    let is_message = ty & 0x18 == 0x10;
    let is_completion = ty == 0x0a || ty == 0x0b;
    let is_write = ty == 0 && fmt & 2 != 0;
    if is_message || is_completion || is_write || fmt > 3 {
        return None;
    }
    let p = lanbus_wire::tlp::Packet::new_unchecked(bytes);
    let tag = Tag::new(p.tag())?;
    Some(ur_completion(completer, Bdf(p.requester_id()), tag))
}

/// An Unsupported Request completion (no data; byte count 4 as for a 1 DW request).
pub(crate) fn ur_completion(completer: Bdf, requester: Bdf, tag: Tag) -> Tlp {
    Tlp::completion(completer, requester, tag, CplStatus::UnsupportedRequest, 4, 0, Vec::new())
}

/// Whether a TLP kind is a non-posted request (one that must be answered).
pub(crate) fn is_non_posted(tlp: &Tlp) -> bool {
    use lanbus_pcie::TlpKind::*;
    matches!(tlp.kind, MRd32 | MRd64 | IORd | IOWr | CfgRd0 | CfgWr0 | CfgRd1 | CfgWr1)
}

/// Encodes `tlps` and queues them for `peer` on `channel` in order, with one wake-up of the
/// sending thread; nothing is sent if one does not encode.
pub(crate) fn send_tlps(
    sender: &lanbus_runtime::Sender,
    peer: MacAddr,
    channel: u16,
    tlps: &[Tlp],
) -> BridgeResult<()> {
    let encoded = tlps
        .iter()
        .map(|t| t.encode().map_err(|e| BridgeError::BadRequest(e.to_string())))
        .collect::<BridgeResult<Vec<Vec<u8>>>>()?;
    sender.send_all(peer, channel, encoded.iter().map(|b| b.as_slice()));
    Ok(())
}
