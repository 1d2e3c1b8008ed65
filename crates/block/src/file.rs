//! [`FileDevice`]: a regular file or a host block device through `pread`/`pwrite`.
//!
//! Layer: a device below the storage interface. Invariants: `flush` and FUA are `fdatasync`; a
//! read-only device never writes to its file (and [`FileDevice::open`] opens it without write
//! access); OS errors come back whole as [`DeviceError::Io`].

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::device::{check_block_size, check_range, BlockDevice};
use crate::error::DeviceError;

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
    use crate::device::tests::exercise;

    #[test]
    fn file_device() {
        let dir = std::env::temp_dir().join(format!("lanbus-block-dev-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("disk.img");
        let dev = FileDevice::create(&path, 5 << 20).unwrap();
        exercise(&dev);
        drop(dev);
        let ro = FileDevice::open(&path, true).unwrap();
        assert_eq!(ro.size_bytes(), 5 << 20);
        assert!(matches!(ro.write_at(0, &[0; 512], false), Err(DeviceError::ReadOnly)));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(matches!(FileDevice::open(&path, true), Err(DeviceError::Io(_))));
    }
}
