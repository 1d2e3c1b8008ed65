//! The device side of a split virtqueue (VIRTIO 1.2 section 2.7), reached only by DMA.
//!
//! Layer: device model. The queue's three areas live in host memory: the descriptor table (16
//! bytes per entry: le64 addr, le32 len, le16 flags, le16 next), the driver area (available
//! ring: le16 flags, le16 idx, le16 ring[size]) and the device area (used ring: le16 flags, le16
//! idx, {le32 id, le32 len}[size]). The device keeps its own `last_avail` and used index and
//! trusts nothing it reads: an available index more than `size` ahead, a head or `next` out of
//! range, a chain longer than the queue, a buffer of the wrong direction or an indirect
//! descriptor (not negotiated) is a [`QueueError::Broken`], after which the device needs a reset.
//!
//! DMA per batch: the available index (skipped when the driver's notification carried it), then
//! one read of the ring entries and, where the driver put the available ring right after the
//! descriptor table (as this crate's driver and legacy layouts do), the table in the same read.

use lanbus_pcie::blocking::HostAccess;
use lanbus_pcie::device::DmaError;

/// Descriptor flag: the chain continues at `next`.
pub const DESC_F_NEXT: u16 = 1;
/// Descriptor flag: the buffer is device-writable.
pub const DESC_F_WRITE: u16 = 2;
/// Descriptor flag: the buffer holds a table of indirect descriptors.
pub const DESC_F_INDIRECT: u16 = 4;
/// Available ring flag: the driver wants no interrupt when buffers are used.
pub const AVAIL_F_NO_INTERRUPT: u16 = 1;
/// The largest queue the device accepts.
pub const MAX_SIZE: u16 = 1024;

/// Why a queue could not be served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueueError {
    /// Host memory could not be reached (the host went away, a timeout, an address it refused).
    #[error("DMA failed: {0}")]
    Bus(#[from] DmaError),
    /// The driver broke the queue's rules; the device needs a reset.
    #[error("the driver broke the virtqueue: {0}")]
    Broken(String),
}

fn broken<T>(why: impl Into<String>) -> Result<T, QueueError> {
    Err(QueueError::Broken(why.into()))
}

/// One buffer of a chain: bus address and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Bus address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
}

/// A descriptor chain the driver made available.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    /// Its head descriptor's index (the id the used ring gives back).
    pub head: u16,
    /// Its buffers in order.
    pub segments: Vec<Segment>,
}

impl Chain {
    /// Total bytes of its buffers.
    pub fn len(&self) -> u64 {
        self.segments.iter().map(|s| u64::from(s.len)).sum()
    }
}

/// One queue's registers and the device's private indices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Queue {
    /// Entries (a power of two, at most [`MAX_SIZE`]).
    pub size: u16,
    /// Descriptor table address.
    pub desc: u64,
    /// Driver area (available ring) address.
    pub driver: u64,
    /// Device area (used ring) address.
    pub device: u64,
    /// MSI-X vector for used buffers (`NO_VECTOR`: none).
    pub msix: u16,
    /// Whether the driver enabled it.
    pub enabled: bool,
    last_avail: u16,
    used_idx: u16,
}

impl Queue {
    /// A queue in its reset state with `size` entries offered.
    pub fn new(size: u16) -> Queue {
        Queue {
            size,
            desc: 0,
            driver: 0,
            device: 0,
            msix: crate::common::NO_VECTOR,
            enabled: false,
            last_avail: 0,
            used_idx: 0,
        }
    }

    /// Whether the driver's settings are usable (checked when it enables the queue).
    pub fn check(&self) -> Result<(), QueueError> {
        if self.size == 0 || !self.size.is_power_of_two() || self.size > MAX_SIZE {
            return broken(format!("queue size {}", self.size));
        }
        if !self.desc.is_multiple_of(16) || !self.driver.is_multiple_of(2) || !self.device.is_multiple_of(4) {
            return broken("misaligned queue areas");
        }
        Ok(())
    }

    /// Reads what the driver made available since the last call: the chains, and whether it asked
    /// for no interrupt. `notified` is the available index a notification carried, if any (then
    /// the index is not read). `want_write`: the buffers must be device-writable (receive) or
    /// device-readable (transmit). At most `limit` chains are taken; the rest stay available.
    pub fn take(
        &mut self,
        host: &mut dyn HostAccess,
        notified: Option<u16>,
        want_write: bool,
        limit: usize,
    ) -> Result<(Vec<Chain>, bool), QueueError> {
        // The index first (unless the notification carried it), then the entries and
        // descriptors: read together with the index, a descriptor could be older than it.
        let idx = match notified {
            Some(n) => n,
            None => {
                let mut head = [0u8; 4];
                host.read(self.driver, &mut head)?;
                u16::from_le_bytes([head[2], head[3]])
            }
        };
        let ahead = idx.wrapping_sub(self.last_avail);
        if ahead > self.size {
            return broken(format!(
                "available index {idx} is {ahead} entries ahead of a {}-entry queue",
                self.size
            ));
        }
        let n = usize::from(ahead).min(limit);
        if n == 0 {
            return Ok((Vec::new(), false));
        }
        let size = usize::from(self.size);
        let table_len = size * 16;
        let ring_len = 4 + 2 * size;
        // One read when the ring follows the table; else two.
        let (table, ring) = if self.driver == self.desc + table_len as u64 {
            let mut both = vec![0u8; table_len + ring_len];
            host.read(self.desc, &mut both)?;
            let ring = both.split_off(table_len);
            (both, ring)
        } else {
            let mut table = vec![0u8; table_len];
            host.read(self.desc, &mut table)?;
            let mut ring = vec![0u8; ring_len];
            host.read(self.driver, &mut ring)?;
            (table, ring)
        };
        let flags = u16::from_le_bytes([ring[0], ring[1]]);
        let mut chains = Vec::with_capacity(n);
        for k in 0..n {
            let slot = usize::from(self.last_avail.wrapping_add(k as u16) % self.size);
            let head = u16::from_le_bytes([ring[4 + 2 * slot], ring[5 + 2 * slot]]);
            chains.push(self.chain(&table, head, want_write)?);
        }
        self.last_avail = self.last_avail.wrapping_add(n as u16);
        Ok((chains, flags & AVAIL_F_NO_INTERRUPT != 0))
    }

    /// Follows the chain at `head` in a copy of the descriptor table.
    fn chain(&self, table: &[u8], head: u16, want_write: bool) -> Result<Chain, QueueError> {
        let mut segments = Vec::new();
        let mut i = head;
        loop {
            if i >= self.size {
                return broken(format!("descriptor index {i} in a {}-entry queue", self.size));
            }
            if segments.len() >= usize::from(self.size) {
                return broken(format!("the chain at {head} loops"));
            }
            let d = &table[usize::from(i) * 16..usize::from(i) * 16 + 16];
            let addr = u64::from_le_bytes(d[0..8].try_into().unwrap_or_default());
            let len = u32::from_le_bytes(d[8..12].try_into().unwrap_or_default());
            let flags = u16::from_le_bytes([d[12], d[13]]);
            let next = u16::from_le_bytes([d[14], d[15]]);
            if flags & DESC_F_INDIRECT != 0 {
                return broken("indirect descriptor (not negotiated)");
            }
            if (flags & DESC_F_WRITE != 0) != want_write {
                let dir = if want_write {
                    "device-readable buffer on the receive queue"
                } else {
                    "device-writable buffer on the transmit queue"
                };
                return broken(dir);
            }
            if addr.checked_add(u64::from(len)).is_none() {
                return broken(format!("buffer at {addr:#x} of {len} bytes wraps"));
            }
            segments.push(Segment { addr, len });
            if flags & DESC_F_NEXT == 0 {
                return Ok(Chain { head, segments });
            }
            i = next;
        }
    }

    /// Returns `used` (head, bytes written) to the driver: the entries, then the index.
    pub fn put_used(&mut self, host: &mut dyn HostAccess, used: &[(u16, u32)]) -> Result<(), QueueError> {
        let size = self.size;
        let mut k = 0;
        while k < used.len() {
            // Entries up to the ring's end in one write.
            let slot = self.used_idx.wrapping_add(k as u16) % size;
            let run = (used.len() - k).min(usize::from(size - slot));
            let mut bytes = Vec::with_capacity(run * 8);
            for &(id, len) in &used[k..k + run] {
                bytes.extend_from_slice(&u32::from(id).to_le_bytes());
                bytes.extend_from_slice(&len.to_le_bytes());
            }
            host.write(self.device + 4 + 8 * u64::from(slot), &bytes)?;
            k += run;
        }
        self.used_idx = self.used_idx.wrapping_add(used.len() as u16);
        host.write(self.device + 2, &self.used_idx.to_le_bytes())?;
        Ok(())
    }
}
