//! Block devices the server exports: the [`BlockDevice`] trait and RAM and file implementations.
//!
//! Layer: storage, below the NBD server. The server checks every request against the export's
//! size and block size before it calls a device, but implementations still check and answer
//! [`DeviceError::OutOfRange`] rather than panic. Devices are called from several worker threads
//! at once: concurrent requests to disjoint ranges must not interfere; overlapping concurrent
//! requests may interleave (NBD gives no atomicity between in-flight requests).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::RwLock;

use crate::proto::Errno;

/// Why a device operation failed; [`DeviceError::errno`] is the value the client sees.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// The range is outside the device (`EINVAL`).
    #[error("range {offset}+{len} outside a device of {size} bytes")]
    OutOfRange {
        /// Byte offset.
        offset: u64,
        /// Byte length.
        len: u64,
        /// Device size.
        size: u64,
    },
    /// Offset or length not a multiple of the block size (`EINVAL`).
    #[error("range {offset}+{len} not aligned to {block} bytes")]
    Misaligned {
        /// Byte offset.
        offset: u64,
        /// Byte length.
        len: u64,
        /// Block size.
        block: u32,
    },
    /// The device is read-only (`EPERM`).
    #[error("device is read-only")]
    ReadOnly,
    /// No space left (`ENOSPC`).
    #[error("no space left on the device")]
    NoSpace,
    /// The operation is not supported (`ENOTSUP`).
    #[error("not supported: {0}")]
    Unsupported(&'static str),
    /// A host I/O error (`EIO`, or the errno NBD defines for it).
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The device itself reported a failure (for example an NVMe status), with the errno to send.
    #[error("device error ({errno}): {message}")]
    Device {
        /// What the client is told.
        errno: Errno,
        /// What went wrong, for the log.
        message: String,
    },
}

impl DeviceError {
    /// The NBD error value for this failure.
    pub fn errno(&self) -> Errno {
        match self {
            DeviceError::OutOfRange { .. } | DeviceError::Misaligned { .. } => Errno::Inval,
            DeviceError::ReadOnly => Errno::Perm,
            DeviceError::NoSpace => Errno::NoSpc,
            DeviceError::Unsupported(_) => Errno::NotSup,
            DeviceError::Io(e) => match e.raw_os_error() {
                Some(28) => Errno::NoSpc,
                Some(1) | Some(30) => Errno::Perm, // EPERM, EROFS
                Some(12) => Errno::NoMem,
                _ => Errno::Io,
            },
            DeviceError::Device { errno, .. } => *errno,
        }
    }
}

/// A byte-addressed block device shared by all connections of a server.
///
/// Offsets and lengths the server passes are multiples of [`BlockDevice::block_size`] and lie
/// inside [`BlockDevice::size_bytes`]; READ/WRITE buffers are at most 32 MiB. Methods take `&self`
/// and are called concurrently from several threads.
pub trait BlockDevice: Send + Sync {
    /// Size in bytes (a multiple of the block size).
    fn size_bytes(&self) -> u64;

    /// Minimum I/O size and alignment in bytes (a power of two, at most 64 KiB). Advertised as
    /// NBD's minimum block size; misaligned requests are refused with `EINVAL`.
    fn block_size(&self) -> u32 {
        512
    }

    /// Preferred I/O size in bytes (a power of two, at least the block size).
    fn preferred_block_size(&self) -> u32 {
        self.block_size().max(4096)
    }

    /// Writes are refused with `EPERM` and the export is advertised read-only.
    fn read_only(&self) -> bool {
        false
    }

    /// `flush` makes every write that completed before it durable, whichever connection issued
    /// it (true for one shared backing store); advertised as `NBD_FLAG_CAN_MULTI_CONN`.
    fn flush_covers_all_connections(&self) -> bool {
        true
    }

    /// Fills `buf` from `offset`.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError>;

    /// Reads `len` bytes at `offset` and lends them to `reply` where they lie, in order, as
    /// slices, instead of copying them into a buffer of the caller's: a device whose reads land
    /// in memory of its own (a DMA buffer) saves a copy of every byte. `reply` is called once,
    /// and only when the read succeeded. `None` (the default) when the device does not lend this
    /// read: the caller uses [`BlockDevice::read_at`].
    fn read_lent(
        &self,
        offset: u64,
        len: usize,
        reply: &mut dyn FnMut(&[&[u8]]),
    ) -> Option<Result<(), DeviceError>> {
        let _ = (offset, len, reply);
        None
    }

    /// Writes `data` at `offset`; with `fua` the data is durable before this returns.
    fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError>;

    /// Makes every completed write durable.
    fn flush(&self) -> Result<(), DeviceError>;

    /// Discards `len` bytes at `offset`. Advisory: the default does nothing, so later reads may
    /// return the old data, which NBD allows.
    fn trim(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        check_range(self.size_bytes(), offset, len)
    }

    /// A queue of this connection's own for many requests in flight at once, driven by one
    /// thread (see [`BlockQueue`]); `None` (the default) when the device has none to give. The
    /// server then runs requests on worker threads through the calls above.
    fn queue(&self) -> Option<Box<dyn BlockQueue + '_>> {
        None
    }

    /// Writes `len` zero bytes at `offset`; with `may_trim` the device may deallocate the range
    /// instead as long as it reads back as zeroes. The default writes zeroes in 1 MiB pieces.
    fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool) -> Result<(), DeviceError> {
        let _ = may_trim;
        check_range(self.size_bytes(), offset, len)?;
        let zeroes = vec![0u8; len.min(1 << 20) as usize];
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(zeroes.len() as u64);
            self.write_at(offset + done, &zeroes[..n as usize], false)?;
            done += n;
        }
        Ok(())
    }
}

/// How a [`BlockQueue`] reports a finished request: its tag and, on success, a read's data
/// where it lies (a write's is empty).
pub type Reaped<'a> = Result<&'a [&'a [u8]], DeviceError>;

/// Reads and writes in flight at once on one connection, submitted, started and reaped by one
/// thread: a request goes in without waiting for the ones before it, the requests submitted
/// together start at once ([`BlockQueue::start`]), and every request that finished is taken in
/// one pass ([`BlockQueue::reap`]). What a device with deep queues of its own (NVMe) offers, so
/// that a connection at depth 32 needs one thread rather than 32.
///
/// Ranges are checked by the server as for [`BlockDevice`]; tags are the caller's and unique
/// among the requests in flight.
pub trait BlockQueue {
    /// The largest request this queue takes; larger ones go through [`BlockDevice`]'s calls.
    fn max_request_bytes(&self) -> usize;

    /// Requests submitted and not yet reaped.
    fn in_flight(&self) -> usize;

    /// Submits a read of `len` bytes at `offset`. `Ok(false)`: no room now, submit it again
    /// once requests in flight have been reaped.
    fn submit_read(&mut self, tag: u64, offset: u64, len: usize) -> Result<bool, DeviceError>;

    /// Submits a write of `data` at `offset` (durable when it finishes, with `fua`). `Ok(false)`
    /// as for [`BlockQueue::submit_read`].
    fn submit_write(&mut self, tag: u64, offset: u64, data: &[u8], fua: bool) -> Result<bool, DeviceError>;

    /// [`BlockQueue::submit_write`] of a buffer the caller shares: a queue whose writes leave
    /// from another thread may hold `data` until they have (the caller takes it back for its next
    /// request once it is the only holder again) instead of copying it now. The default copies.
    fn submit_write_shared(
        &mut self,
        tag: u64,
        offset: u64,
        data: &std::sync::Arc<Vec<u8>>,
        fua: bool,
    ) -> Result<bool, DeviceError> {
        self.submit_write(tag, offset, data, fua)
    }

    /// Submits a write of `len` bytes at `offset` whose data `fill` puts straight where the
    /// device reads it (no copy of the caller's): `fill` is called with the device's memory as
    /// slices, in order, one or more times until the `len` bytes are in (each call fills all
    /// its slices), and returns `false` when the data cannot be had (the write then fails).
    /// The bytes `fill` was not called for are the caller's to dispose of. `Some(Ok(false))`
    /// as for [`BlockQueue::submit_read`], without calling `fill`; `None` (the default) when the
    /// queue does not take writes this way: use [`BlockQueue::submit_write`].
    fn submit_write_filled(
        &mut self,
        tag: u64,
        offset: u64,
        len: usize,
        fua: bool,
        fill: &mut dyn FnMut(&mut [&mut [u8]]) -> bool,
    ) -> Option<Result<bool, DeviceError>> {
        let _ = (tag, offset, len, fua, fill);
        None
    }

    /// The piece size of a write submitted as its data arrives, if the device stores writes
    /// sooner that way: a write longer than this may be submitted in pieces of this size, each
    /// a request of its own and started at once, while the rest of its data still comes in
    /// (a device that stores one piece while the next crosses the bus). `None` (the default),
    /// or 0: whole writes.
    fn write_piece_bytes(&self) -> Option<usize> {
        None
    }

    /// Starts every request submitted since the last call.
    fn start(&mut self) -> Result<(), DeviceError>;

    /// Calls `done` for every request that has finished, without waiting: its tag and, on
    /// success, a read's data where it lies (a write's is empty). Returns how many finished.
    fn reap(&mut self, done: &mut dyn FnMut(u64, Reaped<'_>)) -> Result<usize, DeviceError>;

    /// Waits at most `timeout` for a request in flight to finish (returns at once when none
    /// is in flight; may return early).
    fn wait(&mut self, timeout: std::time::Duration);
}

/// Checks that `offset..offset+len` lies inside a device of `size` bytes.
pub fn check_range(size: u64, offset: u64, len: u64) -> Result<(), DeviceError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(DeviceError::OutOfRange { offset, len, size }),
    }
}

fn check_block_size(block_size: u32) -> Result<(), DeviceError> {
    if !block_size.is_power_of_two() || block_size > 1 << 16 {
        return Err(DeviceError::Device {
            errno: Errno::Inval,
            message: format!("block size {block_size} is not a power of two up to 64 KiB"),
        });
    }
    Ok(())
}

/// Bytes per lazily allocated chunk of a [`MemDevice`].
const MEM_CHUNK_BYTES: usize = 1 << 20;

/// A RAM disk. Memory is allocated per 1 MiB chunk on first write, so a large device costs only
/// what is written; trimming or zeroing a whole chunk frees it. Each chunk has its own lock, so
/// requests to different chunks run in parallel.
pub struct MemDevice {
    size_bytes: u64,
    block_size: u32,
    read_only: bool,
    chunks: Vec<RwLock<Option<Box<[u8]>>>>,
}

impl MemDevice {
    /// A zero-filled RAM disk of `size_bytes` (rounded down to 512-byte blocks).
    pub fn new(size_bytes: u64) -> Self {
        Self::with_block_size(size_bytes, 512).expect("512 is a valid block size")
    }

    /// A zero-filled RAM disk with the given block size; the size is rounded down to whole blocks.
    pub fn with_block_size(size_bytes: u64, block_size: u32) -> Result<Self, DeviceError> {
        check_block_size(block_size)?;
        let size_bytes = size_bytes - size_bytes % u64::from(block_size);
        let n = size_bytes.div_ceil(MEM_CHUNK_BYTES as u64) as usize;
        let chunks = (0..n).map(|_| RwLock::new(None)).collect();
        Ok(MemDevice { size_bytes, block_size, read_only: false, chunks })
    }

    /// Makes the device read-only (writes get `EPERM`).
    pub fn into_read_only(mut self) -> Self {
        self.read_only = true;
        self
    }

    /// Calls `f(chunk index, offset in chunk, range in the request)` for each chunk of a range.
    fn for_chunks(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(usize, usize, core::ops::Range<usize>) -> Result<(), DeviceError>,
    ) -> Result<(), DeviceError> {
        check_range(self.size_bytes, offset, len)?;
        let mut done = 0u64;
        while done < len {
            let at = offset + done;
            let index = (at / MEM_CHUNK_BYTES as u64) as usize;
            let within = (at % MEM_CHUNK_BYTES as u64) as usize;
            let n = (len - done).min((MEM_CHUNK_BYTES - within) as u64) as usize;
            f(index, within, done as usize..done as usize + n)?;
            done += n as u64;
        }
        Ok(())
    }

    fn chunk_len(&self, index: usize) -> usize {
        let start = index as u64 * MEM_CHUNK_BYTES as u64;
        (self.size_bytes - start).min(MEM_CHUNK_BYTES as u64) as usize
    }

    fn zero(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        self.for_chunks(offset, len, |index, within, r| {
            let mut chunk = self.chunks[index].write().unwrap_or_else(|p| p.into_inner());
            if within == 0 && r.len() == self.chunk_len(index) {
                *chunk = None;
            } else if let Some(data) = chunk.as_mut() {
                data[within..within + r.len()].fill(0);
            }
            Ok(())
        })
    }
}

impl BlockDevice for MemDevice {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }
    fn block_size(&self) -> u32 {
        self.block_size
    }
    fn read_only(&self) -> bool {
        self.read_only
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        self.for_chunks(offset, buf.len() as u64, |index, within, r| {
            // A poisoned lock only means another request panicked mid-copy; the bytes are still
            // memory, so carry on rather than fail every later request.
            let chunk = self.chunks[index].read().unwrap_or_else(|p| p.into_inner());
            match chunk.as_ref() {
                Some(data) => buf[r.clone()].copy_from_slice(&data[within..within + r.len()]),
                None => buf[r].fill(0),
            }
            Ok(())
        })
    }

    fn write_at(&self, offset: u64, data: &[u8], _fua: bool) -> Result<(), DeviceError> {
        if self.read_only {
            return Err(DeviceError::ReadOnly);
        }
        self.for_chunks(offset, data.len() as u64, |index, within, r| {
            let mut chunk = self.chunks[index].write().unwrap_or_else(|p| p.into_inner());
            let len = self.chunk_len(index);
            let bytes = chunk.get_or_insert_with(|| vec![0u8; len].into_boxed_slice());
            bytes[within..within + r.len()].copy_from_slice(&data[r]);
            Ok(())
        })
    }

    fn flush(&self) -> Result<(), DeviceError> {
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        if self.read_only {
            return Err(DeviceError::ReadOnly);
        }
        self.zero(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64, _may_trim: bool) -> Result<(), DeviceError> {
        if self.read_only {
            return Err(DeviceError::ReadOnly);
        }
        self.zero(offset, len)
    }
}

/// A regular file (or a host block device) through `pread`/`pwrite`. `flush` and FUA are
/// `fdatasync`; trim and zeroing write zeroes (the file keeps its blocks).
pub struct FileDevice {
    file: File,
    size_bytes: u64,
    block_size: u32,
    read_only: bool,
}

impl FileDevice {
    /// Opens an existing file; its size, rounded down to 512-byte blocks, is the device size.
    pub fn open(path: &Path, read_only: bool) -> Result<Self, DeviceError> {
        let file = std::fs::OpenOptions::new().read(true).write(!read_only).open(path)?;
        let size = file.metadata()?.len();
        Self::from_file(file, size, 512, read_only)
    }

    /// Creates (or truncates) a file of `size_bytes`, zero-filled and sparse.
    pub fn create(path: &Path, size_bytes: u64) -> Result<Self, DeviceError> {
        let file =
            std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path)?;
        file.set_len(size_bytes)?;
        Self::from_file(file, size_bytes, 512, false)
    }

    /// Wraps an open file whose first `size_bytes` (rounded down to whole blocks) are the device.
    pub fn from_file(
        file: File,
        size_bytes: u64,
        block_size: u32,
        read_only: bool,
    ) -> Result<Self, DeviceError> {
        check_block_size(block_size)?;
        let size_bytes = size_bytes - size_bytes % u64::from(block_size);
        Ok(FileDevice { file, size_bytes, block_size, read_only })
    }
}

impl BlockDevice for FileDevice {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }
    fn block_size(&self) -> u32 {
        self.block_size
    }
    fn read_only(&self) -> bool {
        self.read_only
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        check_range(self.size_bytes, offset, buf.len() as u64)?;
        self.file.read_exact_at(buf, offset)?;
        Ok(())
    }

    fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError> {
        if self.read_only {
            return Err(DeviceError::ReadOnly);
        }
        check_range(self.size_bytes, offset, data.len() as u64)?;
        self.file.write_all_at(data, offset)?;
        if fua {
            self.file.sync_data()?;
        }
        Ok(())
    }

    fn flush(&self) -> Result<(), DeviceError> {
        if !self.read_only {
            self.file.sync_data()?;
        }
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        self.write_zeroes(offset, len, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exercise(dev: &dyn BlockDevice) {
        let size = dev.size_bytes();
        let mut buf = vec![0xAAu8; 3 << 20];
        dev.read_at(0, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0), "fresh device reads zeroes");
        // A write straddling chunk boundaries.
        let data: Vec<u8> = (0..(2 << 20) + 1024).map(|i| (i * 7 + 3) as u8).collect();
        dev.write_at((1 << 20) - 512, &data, false).unwrap();
        let mut back = vec![0u8; data.len()];
        dev.read_at((1 << 20) - 512, &mut back).unwrap();
        assert_eq!(back, data);
        dev.write_zeroes(1 << 20, 1 << 20, true).unwrap();
        dev.read_at((1 << 20) - 512, &mut back).unwrap();
        assert_eq!(&back[..512], &data[..512]);
        assert!(back[512..512 + (1 << 20)].iter().all(|&b| b == 0));
        assert_eq!(&back[512 + (1 << 20)..], &data[512 + (1 << 20)..]);
        dev.trim(0, 4096).unwrap();
        dev.flush().unwrap();
        assert!(matches!(dev.read_at(size - 512, &mut [0u8; 1024]), Err(DeviceError::OutOfRange { .. })));
        assert!(matches!(dev.write_at(u64::MAX, &[0u8; 2], false), Err(DeviceError::OutOfRange { .. })));
        assert_eq!(dev.write_zeroes(size, 512, false).unwrap_err().errno(), Errno::Inval);
    }

    #[test]
    fn mem_device() {
        let dev = MemDevice::new((4 << 20) + 700);
        assert_eq!(dev.size_bytes(), (4 << 20) + 512);
        exercise(&dev);
        let ro = MemDevice::new(1 << 20).into_read_only();
        assert_eq!(ro.write_at(0, &[0; 512], false).unwrap_err().errno(), Errno::Perm);
        assert!(MemDevice::with_block_size(1 << 20, 3000).is_err());
    }

    #[test]
    fn file_device() {
        let dir = std::env::temp_dir().join(format!("lanbus-nbd-dev-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("disk.img");
        let dev = FileDevice::create(&path, 5 << 20).unwrap();
        exercise(&dev);
        drop(dev);
        let ro = FileDevice::open(&path, true).unwrap();
        assert_eq!(ro.size_bytes(), 5 << 20);
        assert_eq!(ro.write_at(0, &[0; 512], false).unwrap_err().errno(), Errno::Perm);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
