//! [`MemDevice`]: a RAM disk, for tests, demos and measurements.
//!
//! Layer: a device below the storage interface. Invariants: memory is allocated per 1 MiB chunk
//! on first write and freed when a whole chunk is trimmed or zeroed; each chunk has its own lock,
//! so requests to different chunks run in parallel and a panic mid-copy poisons nothing that
//! later requests need.

use std::sync::RwLock;

use crate::device::{check_block_size, check_range, BlockDevice};
use crate::error::DeviceError;

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

    /// Makes the device read-only (writes fail with [`DeviceError::ReadOnly`]).
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::tests::exercise;

    #[test]
    fn mem_device() {
        let dev = MemDevice::new((4 << 20) + 700);
        assert_eq!(dev.size_bytes(), (4 << 20) + 512);
        exercise(&dev);
        let ro = MemDevice::new(1 << 20).into_read_only();
        assert!(matches!(ro.write_at(0, &[0; 512], false), Err(DeviceError::ReadOnly)));
        assert!(matches!(ro.trim(0, 512), Err(DeviceError::ReadOnly)));
        assert!(matches!(MemDevice::with_block_size(1 << 20, 3000), Err(DeviceError::InvalidArgument(_))));
    }
}
