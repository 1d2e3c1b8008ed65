//! A pool of fixed-size buffers in a region; buffers are named by id, metadata lives in descriptors.
//!
//! Layer: rings. Layout at `offset`: a config line (magic, count, buffer size), then `count`
//! buffers of `buf_size` bytes (a multiple of 64, so every buffer starts on a cache line and
//! non-temporal stores can fill it). There is no per-buffer header: length, offset and flags travel
//! in the [`crate::Desc`] (the vhost-user cache-efficiency study, factor (d): a 128 B header written
//! per packet cost a third of the throughput).
//!
//! Which side owns which buffer is the job of the protocol on top ([`crate::pipe`]). The pool only
//! guarantees bounds: [`Pool::check`] validates a peer-supplied descriptor before any byte is
//! touched, and every accessor re-checks, so no id, offset or length can reach outside the pool.

#[cfg(not(loom))]
use std::sync::Arc;

#[cfg(not(loom))]
use crate::copy::{copy_bytes, CopyMode};
use crate::{Desc, Error, Result};

/// The magic number in a pool's config line ("LBPL").
pub const POOL_MAGIC: u32 = 0x4c42_504c;

/// Bytes a pool of `count` buffers of `buf_size` bytes occupies.
pub fn bytes_needed(count: u32, buf_size: u32) -> usize {
    64 + count as usize * buf_size as usize
}

/// A view of a buffer pool in a region.
#[cfg(not(loom))]
#[derive(Debug, Clone)]
pub struct Pool {
    base: *mut u8,
    count: u32,
    buf_size: u32,
    _keep: Arc<crate::Region>,
}

// SAFETY: the pool only hands out bounds-checked pointers into memory `_keep` keeps alive; which
// thread may touch which buffer is the owning protocol's business (see the unsafe accessors).
#[cfg(not(loom))]
unsafe impl Send for Pool {}

#[cfg(not(loom))]
fn check_params(count: u32, buf_size: u32) -> Result<()> {
    if count == 0
        || buf_size == 0
        || !buf_size.is_multiple_of(64)
        || (count as u64) * (buf_size as u64) > 1 << 36
    {
        return Err(Error::Misuse(
            "pool needs count > 0 and a buffer size that is a non-zero multiple of 64",
        ));
    }
    Ok(())
}

#[cfg(not(loom))]
impl Pool {
    /// Writes an empty pool's config at `offset` (64-aligned, [`bytes_needed`] long).
    pub fn format(region: &crate::Region, offset: usize, count: u32, buf_size: u32) -> Result<()> {
        check_params(count, buf_size)?;
        let base = region.range(offset, bytes_needed(count, buf_size), 64)?;
        // SAFETY: inside the region (checked); nobody is attached yet.
        unsafe {
            base.cast::<u32>().write(POOL_MAGIC);
            base.cast::<u32>().add(1).write(count);
            base.cast::<u32>().add(2).write(buf_size);
        }
        Ok(())
    }

    /// Attaches to a pool at `offset`, validating its config against the region's bounds.
    pub fn attach(region: Arc<crate::Region>, offset: usize) -> Result<Pool> {
        let base = region.range(offset, 64, 64)?;
        // SAFETY: inside the region (checked); volatile: fetched once, validated below.
        let (magic, count, buf_size) = unsafe {
            let p = base.cast::<u32>();
            (p.read_volatile(), p.add(1).read_volatile(), p.add(2).read_volatile())
        };
        if magic != POOL_MAGIC {
            return Err(Error::Corrupt("pool magic missing"));
        }
        check_params(count, buf_size).map_err(|_| Error::Corrupt("pool config invalid"))?;
        region.range(offset, bytes_needed(count, buf_size), 64)?;
        // SAFETY: base + 64 is inside the region (bytes_needed >= 64 + buf_size checked above).
        let base = unsafe { base.add(64) };
        Ok(Pool { base, count, buf_size, _keep: region })
    }

    /// Number of buffers.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// Size of each buffer in bytes.
    pub fn buf_size(&self) -> u32 {
        self.buf_size
    }

    /// Checks that `desc` names a buffer of this pool and a byte range inside it.
    #[inline]
    pub fn check(&self, desc: &Desc) -> Result<()> {
        if desc.buffer >= self.count {
            return Err(Error::Corrupt("descriptor names a buffer outside the pool"));
        }
        if (desc.offset as u64) + (desc.len as u64) > self.buf_size as u64 {
            return Err(Error::Corrupt("descriptor range runs past the end of its buffer"));
        }
        Ok(())
    }

    /// Pointer to byte `offset` of buffer `buffer`, with `len` bytes after it in the buffer.
    #[inline]
    fn ptr(&self, buffer: u32, offset: u32, len: usize) -> Result<*mut u8> {
        let d = Desc { buffer, offset, len: u32::try_from(len).unwrap_or(u32::MAX), ..Desc::default() };
        self.check(&d)?;
        // SAFETY: checked: buffer < count and offset + len <= buf_size, so the pointer and the
        // `len` bytes after it are inside the pool.
        Ok(unsafe { self.base.add(buffer as usize * self.buf_size as usize + offset as usize) })
    }

    /// Copies `src` into buffer `buffer` at `offset` with the given copy mode.
    pub fn write(&self, buffer: u32, offset: u32, src: &[u8], mode: CopyMode) -> Result<()> {
        let dst = self.ptr(buffer, offset, src.len())?;
        // SAFETY: `dst..dst+len` is inside the pool (checked) and disjoint from `src` (a Rust
        // slice cannot alias shared pool memory the caller is writing through the pool).
        unsafe { copy_bytes(mode, dst, src.as_ptr(), src.len()) };
        Ok(())
    }

    /// Copies `dst.len()` bytes from buffer `buffer` at `offset` into `dst`.
    pub fn read(&self, buffer: u32, offset: u32, dst: &mut [u8]) -> Result<()> {
        let src = self.ptr(buffer, offset, dst.len())?;
        // SAFETY: in bounds (checked); `dst` is private memory.
        unsafe { core::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// The bytes `desc` names, borrowed in place.
    ///
    /// # Safety
    /// The caller owns the buffer under its protocol for the lifetime of the slice, and the peer
    /// does not write it meanwhile (a faulty peer could: then the bytes may change under the reader,
    /// which is a data race; use [`Pool::read`] when the peer is not trusted that far).
    pub unsafe fn slice(&self, desc: &Desc) -> Result<&[u8]> {
        let p = self.ptr(desc.buffer, desc.offset, desc.len as usize)?;
        // SAFETY: in bounds (checked); exclusivity is the caller's contract.
        Ok(unsafe { core::slice::from_raw_parts(p, desc.len as usize) })
    }

    /// The whole of buffer `buffer` from `offset`, borrowed mutably in place.
    ///
    /// # Safety
    /// The caller owns the buffer under its protocol for the lifetime of the slice, nobody else
    /// (in this or the peer process) accesses it meanwhile, and no other slice of it is alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, buffer: u32, offset: u32) -> Result<&mut [u8]> {
        let len = self.buf_size.checked_sub(offset).ok_or(Error::Misuse("offset past the buffer's end"))?;
        let p = self.ptr(buffer, offset, len as usize)?;
        // SAFETY: in bounds (checked); exclusivity is the caller's contract.
        Ok(unsafe { core::slice::from_raw_parts_mut(p, len as usize) })
    }
}
