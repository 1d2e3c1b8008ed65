//! Atomics shim: `std` atomics normally, loom's model atomics under `--cfg loom`.
//!
//! Layer: rings (internal). Every lock-free type in this crate takes its atomics and its
//! cross-thread cells from here, so the loom tests (`tests/loom.rs`) check the very code that runs.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU16, AtomicU32, Ordering};

#[cfg(not(loom))]
pub(crate) use core::sync::atomic::{fence, AtomicU16, AtomicU32, Ordering};

/// A cache line: the unit two cores fight over. 64 bytes on every x86-64 and most arm64 parts.
pub const CACHE_LINE: usize = 64;

/// Pads and aligns `T` to its own cache line (so a neighbour's writes never invalidate it).
#[derive(Debug, Default)]
#[repr(C, align(64))]
pub struct CacheAligned<T>(pub T);

impl<T> core::ops::Deref for CacheAligned<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}
