//! Host memory that devices may reach by DMA, and the map from bus addresses to it.
//!
//! Layer: pcie engine, host side. A [`DmaRegion`] is a span of bytes a user lends the host
//! bridge at a bus address ([`crate::HostBridge::add_region`]); device memory reads are
//! served from it and device memory writes land in it. [`DmaBuffer`] is the plain in-memory one.
//!
//! Invariants: regions never overlap; an access is served only when it lies wholly inside one
//! region (a device's address is distrusted: anything else is an Unsupported Request).

use std::sync::{Arc, Mutex};

use crate::lock;

/// Bytes a device may read and write by DMA. Offsets are from the region's start; callers stay
/// inside `0..len()`.
pub trait DmaRegion: Send + Sync {
    /// Length in bytes.
    fn len(&self) -> u64;
    /// Whether the region is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `buf.len()` bytes at `offset` into `buf`.
    fn read(&self, offset: u64, buf: &mut [u8]);
    /// Copies `data` to `offset`.
    fn write(&self, offset: u64, data: &[u8]);
    /// Appends `len` bytes at `offset` to `out` (a region that can copies them straight in,
    /// without zero-filling `out` first: the default does, then reads over it).
    fn append(&self, offset: u64, len: usize, out: &mut Vec<u8>) {
        let start = out.len();
        out.resize(start + len, 0);
        self.read(offset, &mut out[start..]);
    }
}

/// A [`DmaRegion`] in ordinary memory, behind a mutex.
#[derive(Debug, Default)]
pub struct DmaBuffer {
    bytes: Mutex<Vec<u8>>,
}

impl DmaBuffer {
    /// `len` zero bytes.
    pub fn new(len: usize) -> Arc<DmaBuffer> {
        Arc::new(DmaBuffer { bytes: Mutex::new(vec![0; len]) })
    }

    /// A buffer holding `bytes`.
    pub fn from_vec(bytes: Vec<u8>) -> Arc<DmaBuffer> {
        Arc::new(DmaBuffer { bytes: Mutex::new(bytes) })
    }

    /// A copy of `len` bytes at `offset` (clipped to the buffer).
    pub fn read_vec(&self, offset: usize, len: usize) -> Vec<u8> {
        let b = lock(&self.bytes);
        let start = offset.min(b.len());
        b[start..offset.saturating_add(len).min(b.len())].to_vec()
    }

    /// Copies `data` to `offset` (clipped to the buffer).
    pub fn write_at(&self, offset: usize, data: &[u8]) {
        let mut b = lock(&self.bytes);
        let start = offset.min(b.len());
        let end = offset.saturating_add(data.len()).min(b.len());
        b[start..end].copy_from_slice(&data[..end - start]);
    }

    /// Runs `f` on the whole buffer.
    pub fn with<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> R {
        f(&mut lock(&self.bytes))
    }
}

impl DmaRegion for DmaBuffer {
    fn len(&self) -> u64 {
        lock(&self.bytes).len() as u64
    }

    fn read(&self, offset: u64, buf: &mut [u8]) {
        let b = lock(&self.bytes);
        let start = usize::try_from(offset).unwrap_or(usize::MAX).min(b.len());
        let n = buf.len().min(b.len() - start);
        buf[..n].copy_from_slice(&b[start..start + n]);
        buf[n..].fill(0);
    }

    fn write(&self, offset: u64, data: &[u8]) {
        let mut b = lock(&self.bytes);
        let start = usize::try_from(offset).unwrap_or(usize::MAX).min(b.len());
        let n = data.len().min(b.len() - start);
        b[start..start + n].copy_from_slice(&data[..n]);
    }
}

/// The regions devices reach: the shared map, and the private maps of functions given their own
/// DMA domain (as an IOMMU gives a passed-through function only its VM's memory).
#[derive(Default)]
pub(crate) struct Domains {
    pub(crate) shared: RegionMap,
    pub(crate) private: std::collections::HashMap<lanbus_pcie::Bdf, RegionMap>,
}

impl Domains {
    /// The map a memory request from `requester` is served from.
    pub(crate) fn of(&self, requester: lanbus_pcie::Bdf) -> &RegionMap {
        self.private.get(&requester).unwrap_or(&self.shared)
    }
}

/// Regions by bus address.
#[derive(Default, Clone)]
pub(crate) struct RegionMap {
    /// (bus address, length, region), sorted by address, never overlapping.
    regions: Vec<(u64, u64, Arc<dyn DmaRegion>)>,
}

impl RegionMap {
    /// Adds `region` at `bus_addr`; fails if it overlaps one already there or wraps.
    pub(crate) fn add(&mut self, bus_addr: u64, region: Arc<dyn DmaRegion>) -> Result<(), String> {
        let len = region.len();
        let end = bus_addr.checked_add(len).ok_or_else(|| format!("region at {bus_addr:#x} wraps"))?;
        if let Some((a, l, _)) = self.regions.iter().find(|(a, l, _)| bus_addr < a + l && *a < end) {
            return Err(format!("region {bus_addr:#x}+{len:#x} overlaps {a:#x}+{l:#x}"));
        }
        let at = self.regions.partition_point(|(a, _, _)| *a < bus_addr);
        self.regions.insert(at, (bus_addr, len, region));
        Ok(())
    }

    /// Removes the region at `bus_addr`; whether there was one.
    pub(crate) fn remove(&mut self, bus_addr: u64) -> bool {
        let before = self.regions.len();
        self.regions.retain(|(a, _, _)| *a != bus_addr);
        before != self.regions.len()
    }

    /// The region holding `address..address+len` wholly, and the offset in it.
    pub(crate) fn find(&self, address: u64, len: u64) -> Option<(&Arc<dyn DmaRegion>, u64)> {
        let i = self.regions.partition_point(|(a, _, _)| *a <= address).checked_sub(1)?;
        let (a, l, r) = &self.regions[i];
        let off = address - a;
        (off.checked_add(len)? <= *l).then_some((r, off))
    }

    /// [`RegionMap::read_dws`] appending the `len` bytes at `address` to `out` instead (the
    /// transport's frame, say): the same bytes, copied once.
    pub(crate) fn append_dws(
        &self,
        want: u64,
        want_len: u64,
        address: u64,
        len: usize,
        out: &mut Vec<u8>,
    ) -> Option<()> {
        let (r, off) = self.find(want, want_len.max(1))?;
        let base = want - off;
        let end = address + len as u64;
        let (lo, hi) = (address.max(base), end.min(base + r.len()));
        if hi <= lo {
            out.resize(out.len() + len, 0);
            return Some(());
        }
        out.resize(out.len() + (lo - address) as usize, 0);
        r.append(lo - base, (hi - lo) as usize, out);
        out.resize(out.len() + (end - hi) as usize, 0);
        Some(())
    }

    /// Reads bytes at `address` for a completion: the DW-aligned range may stick out of the
    /// region by up to 3 bytes at each end (bytes the request did not enable); those read as
    /// zero. `None` if the enabled bytes `want..want+want_len` are not inside one region.
    pub(crate) fn read_dws(&self, want: u64, want_len: u64, address: u64, buf: &mut [u8]) -> Option<()> {
        let (r, off) = self.find(want, want_len.max(1))?;
        let base = want - off;
        let lo = address.max(base);
        let hi = (address + buf.len() as u64).min(base + r.len());
        if hi <= lo {
            buf.fill(0);
            return Some(());
        }
        // Zeros only around what the region holds (a read usually lies wholly inside it).
        let (s, e) = ((lo - address) as usize, (hi - address) as usize);
        buf[..s].fill(0);
        buf[e..].fill(0);
        r.read(lo - base, &mut buf[s..e]);
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_completion_read_zeroes_only_what_sticks_out_of_the_region() {
        let mut map = RegionMap::default();
        let bytes: Vec<u8> = (1..=16).collect();
        map.add(0x1002, DmaBuffer::from_vec(bytes.clone())).unwrap();
        // The DWs around all 16 bytes: two bytes stick out before, two after.
        let mut buf = [0xffu8; 20];
        map.read_dws(0x1002, 16, 0x1000, &mut buf).unwrap();
        assert_eq!(&buf[..2], &[0, 0]);
        assert_eq!(&buf[2..18], &bytes[..]);
        assert_eq!(&buf[18..], &[0, 0]);
        // Wholly inside: every byte from the region.
        let mut inner = [0xffu8; 8];
        map.read_dws(0x1002, 16, 0x1004, &mut inner).unwrap();
        assert_eq!(&inner[..], &bytes[2..10]);
        // Enabled bytes outside any region: refused.
        assert!(map.read_dws(0x2000, 4, 0x2000, &mut inner).is_none());
        // Appended, any piece of it: the same bytes after what the buffer held.
        for (at, n) in [(0x1000u64, 20usize), (0x1001, 5), (0x1004, 8), (0x1010, 4), (0x1013, 1)] {
            let mut want = vec![0u8; n];
            map.read_dws(0x1002, 16, at, &mut want).unwrap();
            let mut out = vec![9u8; 3];
            map.append_dws(0x1002, 16, at, n, &mut out).unwrap();
            assert_eq!(&out[..3], &[9, 9, 9]);
            assert_eq!(&out[3..], &want[..], "{at:#x} {n}");
        }
    }
}
