//! The backing store of a namespace: what the controller model's logical blocks live in. The
//! controller addresses it in bytes (LBA times the LBA data size) and never beyond `len()`.
//!
//! [`RamBacking`] keeps the blocks in memory; [`FileBacking`] in a regular file (positional reads
//! and writes, `fdatasync` for Flush and FUA), so data written before a Flush survives a restart.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Storage for a namespace's blocks. Offsets and lengths passed by the controller are within
/// `0..len()`.
pub trait Backing: Send {
    /// Size in bytes.
    fn len(&self) -> u64;
    /// True if the store has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Fills `buf` from `offset`.
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Writes `data` at `offset`.
    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()>;
    /// Makes every write so far durable.
    fn flush(&mut self) -> io::Result<()>;
    /// Sets `len` bytes at `offset` to zero.
    fn write_zeroes(&mut self, offset: u64, len: u64) -> io::Result<()> {
        let zeroes = vec![0u8; len.min(1 << 20) as usize];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(zeroes.len() as u64) as usize;
            self.write_at(offset + done, &zeroes[..n])?;
            done += n as u64;
        }
        Ok(())
    }
    /// Deallocates `len` bytes at `offset`; they read back as zeroes afterwards (the namespace
    /// reports DLFEAT "deallocated blocks read as zero").
    fn deallocate(&mut self, offset: u64, len: u64) -> io::Result<()> {
        self.write_zeroes(offset, len)
    }
}

/// Blocks in memory.
#[derive(Debug, Clone)]
pub struct RamBacking {
    bytes: Vec<u8>,
}

impl RamBacking {
    /// A zero-filled store of `len` bytes.
    pub fn new(len: u64) -> RamBacking {
        RamBacking { bytes: vec![0; len as usize] }
    }

    /// The bytes (for tests and checks).
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

fn range(offset: u64, len: usize, total: usize) -> io::Result<std::ops::Range<usize>> {
    let start = usize::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    match start.checked_add(len) {
        Some(end) if end <= total => Ok(start..end),
        _ => Err(io::Error::new(io::ErrorKind::InvalidInput, "access beyond the end of the backing store")),
    }
}

impl Backing for RamBacking {
    fn len(&self) -> u64 {
        self.bytes.len() as u64
    }
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let r = range(offset, buf.len(), self.bytes.len())?;
        buf.copy_from_slice(&self.bytes[r]);
        Ok(())
    }
    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        let r = range(offset, data.len(), self.bytes.len())?;
        self.bytes[r].copy_from_slice(data);
        Ok(())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
    fn write_zeroes(&mut self, offset: u64, len: u64) -> io::Result<()> {
        let len = usize::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let r = range(offset, len, self.bytes.len())?;
        self.bytes[r].fill(0);
        Ok(())
    }
}

/// Blocks in a regular file.
#[derive(Debug)]
pub struct FileBacking {
    file: File,
    len: u64,
}

impl FileBacking {
    /// Opens (creating if needed) `path` with `len` bytes: a shorter file is extended with
    /// zeroes, a longer one is used up to `len`.
    pub fn open(path: impl AsRef<Path>, len: u64) -> io::Result<FileBacking> {
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path)?;
        if file.metadata()?.len() < len {
            file.set_len(len)?;
        }
        Ok(FileBacking { file, len })
    }

    /// Opens an existing file and uses all of it.
    pub fn open_existing(path: impl AsRef<Path>) -> io::Result<FileBacking> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let len = file.metadata()?.len();
        Ok(FileBacking { file, len })
    }
}

impl Backing for FileBacking {
    fn len(&self) -> u64 {
        self.len
    }
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }
    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.file.write_all_at(data, offset)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.file.sync_data()
    }
}

/// Time a backing store spent in reads and writes, nanoseconds, and the bytes they moved (see
/// [`Timed`]).
#[derive(Debug, Default)]
pub struct BackingTime {
    read_ns: AtomicU64,
    write_ns: AtomicU64,
    bytes: AtomicU64,
}

impl BackingTime {
    /// Nanoseconds spent in reads so far.
    pub fn read_ns(&self) -> u64 {
        // Relaxed: a statistic, read as a snapshot.
        self.read_ns.load(Ordering::Relaxed)
    }

    /// Nanoseconds spent in writes so far.
    pub fn write_ns(&self) -> u64 {
        // Relaxed: as above.
        self.write_ns.load(Ordering::Relaxed)
    }

    /// Bytes read and written so far (each copied once between the caller's buffer and the
    /// store: for a file, by the kernel, to or from its page cache).
    pub fn bytes(&self) -> u64 {
        // Relaxed: as above.
        self.bytes.load(Ordering::Relaxed)
    }

    fn moved(&self, n: usize) {
        // Relaxed: a statistic.
        self.bytes.fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// A backing store that counts the time its reads and writes take, for measurements that say
/// where a command's time goes.
pub struct Timed<B> {
    inner: B,
    time: Arc<BackingTime>,
}

impl<B: Backing> Timed<B> {
    /// Wraps `inner`; the returned handle reads the times while the store is in use.
    pub fn new(inner: B) -> (Timed<B>, Arc<BackingTime>) {
        let time = Arc::new(BackingTime::default());
        (Timed { inner, time: time.clone() }, time)
    }
}

fn timed<T>(counter: &AtomicU64, f: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let r = f();
    // Relaxed: a statistic.
    counter.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    r
}

impl<B: Backing> Backing for Timed<B> {
    fn len(&self) -> u64 {
        self.inner.len()
    }
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let n = buf.len();
        timed(&self.time.read_ns, || self.inner.read_at(offset, buf)).inspect(|()| self.time.moved(n))
    }
    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        timed(&self.time.write_ns, || self.inner.write_at(offset, data))
            .inspect(|()| self.time.moved(data.len()))
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
    fn write_zeroes(&mut self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.write_zeroes(offset, len)
    }
    fn deallocate(&mut self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.deallocate(offset, len)
    }
}

impl Backing for Box<dyn Backing> {
    fn len(&self) -> u64 {
        (**self).len()
    }
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        (**self).read_at(offset, buf)
    }
    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        (**self).write_at(offset, data)
    }
    fn flush(&mut self) -> io::Result<()> {
        (**self).flush()
    }
    fn write_zeroes(&mut self, offset: u64, len: u64) -> io::Result<()> {
        (**self).write_zeroes(offset, len)
    }
    fn deallocate(&mut self, offset: u64, len: u64) -> io::Result<()> {
        (**self).deallocate(offset, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timed_stores_count_their_time_and_pass_everything_on() {
        let (mut t, time) = Timed::new(RamBacking::new(8192));
        t.write_at(4096, &[7; 4096]).unwrap();
        let mut b = [0u8; 4096];
        t.read_at(4096, &mut b).unwrap();
        assert_eq!(b, [7; 4096]);
        assert_eq!(t.len(), 8192);
        assert!(time.read_ns() > 0 && time.write_ns() > 0);
        assert_eq!(time.bytes(), 8192);
        assert!(t.read_at(8000, &mut b).is_err(), "errors pass through");
        assert_eq!(time.bytes(), 8192, "a failed read moved nothing");
    }

    #[test]
    fn ram_bounds() {
        let mut r = RamBacking::new(4096);
        r.write_at(4000, &[1; 96]).unwrap();
        assert!(r.write_at(4000, &[1; 97]).is_err());
        assert!(r.read_at(u64::MAX, &mut [0; 1]).is_err());
        r.write_zeroes(4000, 50).unwrap();
        let mut b = [9u8; 96];
        r.read_at(4000, &mut b).unwrap();
        assert_eq!(&b[..50], &[0; 50][..]);
        assert_eq!(&b[50..], &[1; 46][..]);
    }
}
