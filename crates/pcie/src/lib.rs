//! PCIe for lanbus: the engine layer's view of PCI Express transactions.
//!
//! - [`tlp`]: the [`Tlp`] representation of every TLP lanbus carries (memory, I/O and
//!   configuration requests, completions), parsed from and emitted into
//!   [`lanbus_wire::tlp::Packet`] views.
//! - [`request`]: requests from a byte address and length (byte enables, DW length), split by
//!   max payload size / max read request size without crossing 4 KiB; completions for a read split
//!   by max payload size and read completion boundary.
//! - [`reassembly`]: [`ReadReassembly`] puts a read's completions back together and distrusts them.
//! - [`requester`]: [`requester::Requester`], the requester side as a sans-IO state machine
//!   (reads of any length, configuration reads/writes, posted writes; tags, reassembly, timeouts).
//! - [`tags`]: [`TagAllocator`], 10-bit tags with a completion timeout (sans-IO: `now` comes in).
//! - [`config`]: a type 0 configuration space with BARs, the PCI Express and MSI-X capabilities,
//!   and the MSI-X table/PBA model.
//! - [`device`]: the [`device::DeviceModel`] trait and the [`device::Function`] that hosts a
//!   model (configuration space, BAR routing, MSI-X, DMA toward the host), for the device bridge.
//! - [`blocking`]: [`blocking::BlockingDevice`], models with synchronous DMA, and the
//!   [`blocking::BlockingFunction`] that hosts one.
//! - [`dma_engine`]: a DMA engine device model (copies host memory, raises MSI-X).
//! - `json` (feature `json`): the JSON schema of the TLP test vectors, used by `lanbus tlp`.
//!
//! Everything here is sans-IO and deterministic: no threads, clocks or sockets (the bridges that
//! carry TLPs over the fabric are the `lanbus-bridge` crate). Bytes from a peer never panic: they give an
//! [`Error`].
//!
//! A read of 300 bytes at an odd address, answered by a completer with max payload size 128 and
//! read completion boundary 64, and put back together by the requester:
//!
//! ```
//! use lanbus_pcie::request::{completions_for_read, read_requests};
//! use lanbus_pcie::{Bdf, ReadReassembly, Tag, TagAllocator, Tlp};
//! use lanbus_wire::time::Instant;
//!
//! let host_memory: Vec<u8> = (0..8192u32).map(|i| i as u8).collect();
//! let me: Bdf = "01:00.0".parse()?;
//! let mut tags = TagAllocator::new(1024, std::time::Duration::from_millis(50));
//! let now = Instant::ZERO;
//! let no_tag = || lanbus_pcie::Error::BadRequest("all tags in flight".into());
//! let reqs = read_requests(me, 0x1003, 300, 512, || tags.allocate(now).ok_or_else(no_tag))?;
//! assert_eq!(reqs.len(), 1);
//! let (chunk, request) = &reqs[0];
//! let wire = request.encode()?; // ... over the fabric ...
//! let at_completer = Tlp::decode(&wire)?;
//! let completions = completions_for_read(&at_completer, Bdf(0), 128, 64, |address, buf| {
//!     buf.copy_from_slice(&host_memory[address as usize..address as usize + buf.len()]);
//!     Ok(())
//! })?;
//! assert_eq!(completions.len(), 3);
//! let mut read = ReadReassembly::new(me, request.tag, chunk.address, chunk.len)?;
//! for c in &completions {
//!     let _ = read.handle_completion(&Tlp::decode(&c.encode()?)?)?;
//! }
//! assert!(tags.complete(request.tag));
//! assert_eq!(read.into_data()?, &host_memory[0x1003..0x1003 + 300]);
//! # Ok::<(), lanbus_pcie::Error>(())
//! ```
#![deny(unsafe_code)]
#![deny(missing_docs)]

pub mod blocking;
pub mod config;
pub mod device;
pub mod dma_engine;
#[cfg(feature = "json")]
pub mod json;
pub mod reassembly;
pub mod request;
pub mod requester;
pub mod tags;
pub mod tlp;

pub use reassembly::{Progress, ReadReassembly};
pub use tags::TagAllocator;
pub use tlp::{Attr, Bdf, CompletionHeader, ConfigHeader, CplStatus, Header, MemHeader, Tag, Tlp, TlpKind};

/// What went wrong in the PCIe layer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The bytes are not a well-formed TLP (truncated, or an undefined Fmt/Type).
    #[error("TLP: {0}")]
    Wire(lanbus_wire::Error),
    /// A well-formed TLP of a type this codec does not model (messages, atomics, locked reads).
    #[error("unsupported TLP type (fmt {fmt:#x}, type {ty:#x})")]
    Unsupported {
        /// Raw Fmt.
        fmt: u8,
        /// Raw Type.
        ty: u8,
    },
    /// A TLP whose fields break a rule of the spec (for example a configuration request longer
    /// than 1 DW).
    #[error("malformed TLP: {0}")]
    Malformed(&'static str),
    /// Bytes follow the TLP that its header does not account for.
    #[error("{0} bytes after the end of the TLP")]
    TrailingBytes(usize),
    /// A TLP representation that cannot be encoded (a local mistake, not a peer's).
    #[error("cannot encode TLP: {0}")]
    Invalid(String),
    /// A request that cannot be built as asked (length, alignment or boundary).
    #[error("bad request: {0}")]
    BadRequest(String),
    /// A completion that does not belong to the read it was given to (wrong kind, requester or
    /// tag, or the read is already complete).
    #[error("unexpected completion: {0}")]
    UnexpectedCompletion(&'static str),
    /// A completion whose byte count, lower address or length contradicts the read so far.
    #[error("inconsistent completion: {0}")]
    InconsistentCompletion(&'static str),
    /// The completer ended the read with a status other than Successful Completion.
    #[error("completion status {0}")]
    CompletionStatus(CplStatus),
    /// A configuration space specification that cannot be built (BAR sizes or placement,
    /// MSI-X structures outside a memory BAR): a local mistake.
    #[error("bad configuration space: {0}")]
    BadConfig(String),
    /// Text that is not a `bb:dd.f` requester/completer ID.
    #[error("bad bus:device.function {0}")]
    BadId(String),
    /// A non-posted request's completions did not arrive before its timeout.
    #[error("completion timeout")]
    CompletionTimeout,
    /// The completer is gone (heartbeats stopped, or it moved to another group).
    #[error("completer unreachable: {0}")]
    Unreachable(String),
    /// JSON that does not describe a TLP in the vector schema.
    #[error("JSON: {0}")]
    Json(String),
}

// Not `#[from]`: that would make the wire error the source too, and error chains would print it
// twice.
impl From<lanbus_wire::Error> for Error {
    fn from(e: lanbus_wire::Error) -> Self {
        Error::Wire(e)
    }
}

/// Result of the PCIe layer.
pub type Result<T> = core::result::Result<T, Error>;

/// The fuzz target's body: decodes arbitrary bytes as a TLP; a TLP that decodes must encode,
/// and its encoding must decode to the same TLP (reserved bits are not kept, so the bytes may
/// differ there). Panics only if that invariant breaks.
#[cfg(any(test, fuzzing))]
pub fn fuzz_tlp(data: &[u8]) {
    #[cfg(fuzzing)]
    lanbus_wire::tlp::fuzz_view(data);
    if let Ok(tlp) = Tlp::decode(data) {
        let bytes = tlp.encode().expect("a decoded TLP encodes");
        assert_eq!(bytes.len(), data.len(), "TLP changes length");
        assert_eq!(Tlp::decode(&bytes).as_ref(), Ok(&tlp), "TLP does not round-trip");
        #[cfg(feature = "json")]
        {
            let text = json::to_json(&tlp);
            let back = json::from_json(&text).expect("decoder output is valid encoder input");
            assert_eq!(back, tlp, "JSON does not round-trip");
        }
    }
}

/// The committed seed corpus of the `tlp` fuzz target runs through the same body on stable Rust:
/// every seed but the deliberately broken ones decodes, and none panics.
#[cfg(test)]
mod fuzz_corpus {
    #[test]
    fn corpus_seeds() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/tlp");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            let bytes = std::fs::read(&path).unwrap();
            super::fuzz_tlp(&bytes);
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            assert_eq!(super::Tlp::decode(&bytes).is_ok(), !name.starts_with("truncated"), "{name}");
            n += 1;
        }
        assert!(n >= 12, "only {n} seeds");
    }
}
