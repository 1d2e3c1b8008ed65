//! `lanbus-block`: block devices as the frontends of lanbus see them. The NBD server
//! (`lanbus-nbd`), the vhost-user-blk backend (`lanbus-vhost`) and the NVMe namespace adapter
//! (`lanbus-node`) all speak these traits, so a frontend serves any device and a device serves any
//! frontend.
//!
//! Layer: storage interface, below the frontends and beside the engines; it depends on nothing of
//! lanbus. Each frontend maps [`DeviceError`] onto its own protocol's error values (NBD errnos,
//! virtio-blk status bytes); each device says what went wrong with a variant of it, never with a
//! bare number.
//!
//! - [`device`]: the [`BlockDevice`] trait (calls from many threads) and the [`BlockQueue`] trait
//!   (many requests in flight, driven by one thread).
//! - [`error`]: [`DeviceError`], why an operation failed.
//! - [`mem`]: [`MemDevice`], a RAM disk (for tests, demos and measurements).
//! - [`file`]: [`FileDevice`], a regular file or a host block device.
//!
//! ```
//! use lanbus_block::{BlockDevice, DeviceError, MemDevice};
//!
//! let dev = MemDevice::new(1 << 20);
//! dev.write_at(4096, &[7u8; 512], false).unwrap();
//! let mut back = [0u8; 512];
//! dev.read_at(4096, &mut back).unwrap();
//! assert_eq!(back, [7u8; 512]);
//! let e = dev.read_at(1 << 20, &mut back).unwrap_err();
//! assert!(matches!(e, DeviceError::OutOfRange { .. }));
//! ```
#![deny(unsafe_code)]
#![deny(missing_docs)]

pub mod device;
pub mod error;
pub mod file;
pub mod mem;

pub use device::{check_range, BlockDevice, BlockQueue, Reaped};
pub use error::DeviceError;
pub use file::FileDevice;
pub use mem::MemDevice;
