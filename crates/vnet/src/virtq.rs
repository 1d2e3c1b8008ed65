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
//! Sans-IO: the device reads and writes the areas by DMA and hands the bytes here. Per batch:
//! the available index (skipped when the driver's notification carried it), then one read of
//! the ring entries and, where the driver put the available ring right after the descriptor
//! table (as this crate's driver and legacy layouts do), the table in the same read.

use lanbus_pcie::device::DmaError;
use lanbus_pcie::CplStatus;

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

    /// How many entries the driver made available up to its available index `idx`; an index
    /// further ahead than the queue holds breaks the queue.
    pub fn available(&self, idx: u16) -> Result<u16, QueueError> {
        let ahead = idx.wrapping_sub(self.last_avail);
        if ahead > self.size {
            return broken(format!(
                "available index {idx} is {ahead} entries ahead of a {}-entry queue",
                self.size
            ));
        }
        Ok(ahead)
    }

    /// Bytes of the descriptor table.
    pub fn table_len(&self) -> usize {
        usize::from(self.size) * 16
    }

    /// Bytes of the available ring (flags, index, entries).
    pub fn ring_len(&self) -> usize {
        4 + 2 * usize::from(self.size)
    }

    /// Whether the available ring follows the descriptor table (as this crate's driver and legacy
    /// layouts put them): then one read fetches both.
    pub fn ring_follows_table(&self) -> bool {
        self.desc.checked_add(self.table_len() as u64) == Some(self.driver)
    }

    /// Takes the next `n` chains the driver made available (`n` from [`Queue::available`]) out of
    /// copies of the descriptor table and the available ring, read after the index (read
    /// together with it, a descriptor could be older than it). `want_write`: the buffers must be
    /// device-writable (receive) or device-readable (transmit). Returns the chains and whether
    /// the driver asked for no interrupt.
    pub fn take(
        &mut self,
        table: &[u8],
        ring: &[u8],
        n: usize,
        want_write: bool,
    ) -> Result<(Vec<Chain>, bool), QueueError> {
        if table.len() < self.table_len() || ring.len() < self.ring_len() {
            return Err(QueueError::Bus(DmaError::Completion(CplStatus::CompleterAbort)));
        }
        let flags = u16::from_le_bytes([ring[0], ring[1]]);
        let mut chains = Vec::with_capacity(n);
        for k in 0..n {
            let slot = usize::from(self.last_avail.wrapping_add(k as u16) % self.size);
            let head = u16::from_le_bytes([ring[4 + 2 * slot], ring[5 + 2 * slot]]);
            chains.push(self.chain(table, head, want_write)?);
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

    /// Returns `used` (head, bytes written) to the driver: the posted writes to make, in order
    /// (the entries, up to the ring's end in one write, then the index).
    pub fn put_used(&mut self, used: &[(u16, u32)]) -> Vec<(u64, Vec<u8>)> {
        let size = self.size;
        let mut writes = Vec::with_capacity(2);
        let mut k = 0;
        while k < used.len() {
            let slot = self.used_idx.wrapping_add(k as u16) % size;
            let run = (used.len() - k).min(usize::from(size - slot));
            let mut bytes = Vec::with_capacity(run * 8);
            for &(id, len) in &used[k..k + run] {
                bytes.extend_from_slice(&u32::from(id).to_le_bytes());
                bytes.extend_from_slice(&len.to_le_bytes());
            }
            writes.push((self.device + 4 + 8 * u64::from(slot), bytes));
            k += run;
        }
        self.used_idx = self.used_idx.wrapping_add(used.len() as u16);
        writes.push((self.device + 2, self.used_idx.to_le_bytes().to_vec()));
        writes
    }
}
