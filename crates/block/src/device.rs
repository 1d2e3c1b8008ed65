//! The block-device traits: [`BlockDevice`], which frontends call from many threads at once, and
//! [`BlockQueue`], a connection's own queue of many requests in flight driven by one thread.
//!
//! Layer: storage interface, between the frontends (NBD, vhost-user-blk) and the devices (RAM,
//! file, the NVMe namespace). Frontends check every request against the device's size and block
//! size before they call it, but devices still check and answer [`DeviceError::OutOfRange`]
//! rather than panic. Concurrent requests to disjoint ranges must not interfere; overlapping
//! concurrent requests may interleave (neither NBD nor virtio-blk gives atomicity between
//! requests in flight).

use crate::error::DeviceError;

/// A byte-addressed block device shared by all connections of a frontend.
///
/// Offsets and lengths a frontend passes are multiples of [`BlockDevice::block_size`] and lie
/// inside [`BlockDevice::size_bytes`] (the NBD server's READ/WRITE buffers are at most 32 MiB).
/// Methods take `&self` and are called concurrently from several threads.
pub trait BlockDevice: Send + Sync {
    /// Size in bytes (a multiple of the block size).
    fn size_bytes(&self) -> u64;

    /// Minimum I/O size and alignment in bytes (a power of two, at most 64 KiB). Frontends
    /// advertise it (NBD's minimum block size, virtio-blk's `blk_size`) and refuse misaligned
    /// requests.
    fn block_size(&self) -> u32 {
        512
    }

    /// Preferred I/O size in bytes (a power of two, at least the block size).
    fn preferred_block_size(&self) -> u32 {
        self.block_size().max(4096)
    }

    /// Writes are refused ([`DeviceError::ReadOnly`]) and frontends advertise the device
    /// read-only.
    fn read_only(&self) -> bool {
        false
    }

    /// `flush` makes every write that completed before it durable, whichever connection issued
    /// it (true for one shared backing store); the NBD server advertises it as
    /// `NBD_FLAG_CAN_MULTI_CONN`.
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
    /// return the old data, which NBD and virtio-blk allow.
    fn trim(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        check_range(self.size_bytes(), offset, len)
    }

    /// A queue of this connection's own for many requests in flight at once, driven by one
    /// thread (see [`BlockQueue`]); `None` (the default) when the device has none to give. The
    /// frontend then runs requests on worker threads through the calls above.
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
/// Ranges are checked by the frontend as for [`BlockDevice`]; tags are the caller's and unique
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

/// Checks that a block size is a power of two of at most 64 KiB.
pub(crate) fn check_block_size(block_size: u32) -> Result<(), DeviceError> {
    if !block_size.is_power_of_two() || block_size > 1 << 16 {
        return Err(DeviceError::InvalidArgument(format!(
            "block size {block_size} is not a power of two up to 64 KiB"
        )));
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Reads, writes, zeroes, trims and range checks that every device must get right.
    pub(crate) fn exercise(dev: &dyn BlockDevice) {
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
        assert!(matches!(dev.write_zeroes(size, 512, false), Err(DeviceError::OutOfRange { .. })));
    }

    #[test]
    fn ranges_are_checked_without_overflow() {
        assert!(check_range(1024, 512, 512).is_ok());
        assert!(matches!(
            check_range(1024, 513, 512),
            Err(DeviceError::OutOfRange { offset: 513, len: 512, size: 1024 })
        ));
        assert!(matches!(check_range(1024, u64::MAX, 2), Err(DeviceError::OutOfRange { .. })));
    }
}
