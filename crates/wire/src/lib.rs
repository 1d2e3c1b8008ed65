//! The bottom layer of lanbus: byte views of frames and the logical time every core runs on.
//!
//! Views follow the smoltcp pattern: a `Packet<T: AsRef<[u8]>>` wraps a buffer, a private `field`
//! module names the byte ranges, `new_checked` validates lengths once so that every accessor after
//! it is infallible, and `Repr` types `parse` from a view and `emit` into one. Nothing here panics on
//! bytes from the network once `new_checked` has succeeded.
//!
//! All multi-byte fields are big-endian (network order), as on Ethernet and PCIe links.
#![deny(unsafe_code)]
#![deny(missing_docs)]

mod crc;
pub mod ethernet;
pub mod frame;
pub mod hash;
pub mod time;
pub mod tlp;

pub use ethernet::{EtherType, EthernetFrame, EthernetRepr, MacAddr};
pub use time::{Clock, Instant, ManualClock, MonotonicClock};

/// Why a view or representation could not be built from bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The buffer is shorter than the header (or the length it declares).
    #[error("truncated: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes the structure needs.
        need: usize,
        /// Bytes the buffer has.
        have: usize,
    },
    /// A field holds a value this implementation does not accept.
    #[error("malformed {what}")]
    Malformed {
        /// The field or structure that is malformed.
        what: &'static str,
    },
}

/// Result of parsing untrusted bytes.
pub type Result<T> = core::result::Result<T, Error>;
