//! Why a block-device operation failed.
//!
//! Layer: storage interface. Invariant: a variant says what went wrong, in terms every frontend
//! can map onto its own error values (the NBD server onto errnos, vhost-user-blk onto virtio
//! status bytes); an OS error travels whole in [`DeviceError::Io`], so its errno stays readable.

/// Why a device operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// The range lies outside the device.
    #[error("range {offset}+{len} outside a device of {size} bytes")]
    OutOfRange {
        /// Byte offset.
        offset: u64,
        /// Byte length.
        len: u64,
        /// Device size.
        size: u64,
    },
    /// The offset or length is not a multiple of the block size.
    #[error("range {offset}+{len} not aligned to {block} bytes")]
    Misaligned {
        /// Byte offset.
        offset: u64,
        /// Byte length.
        len: u64,
        /// Block size.
        block: u32,
    },
    /// The device refused an argument or setting as invalid (a block size that is not a power of
    /// two, a field of a command the device rejects).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The device is read-only.
    #[error("device is read-only")]
    ReadOnly,
    /// No space left on the device.
    #[error("no space left on the device")]
    NoSpace,
    /// The device has no memory for the request now (its DMA buffers are used up).
    #[error("out of memory: {0}")]
    NoMemory(String),
    /// The device does not support the operation.
    #[error("not supported: {0}")]
    Unsupported(String),
    /// The device did not finish the request in time.
    #[error("timed out: {0}")]
    TimedOut(String),
    /// A host I/O error, with the OS error (and so its errno, when it has one).
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The device failed the request: a media or internal error, a failed bus transfer, a
    /// controller that must be reset.
    #[error("device failure: {0}")]
    Failed(String),
}
