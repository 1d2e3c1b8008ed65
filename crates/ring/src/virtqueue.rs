//! Packed virtqueue in the style of virtio 1.1 (VIRTIO 1.1, section 2.7 "Packed Virtqueues").
//!
//! Layer: rings. One descriptor array serves both directions: the **driver** (owner of the
//! buffers) makes a descriptor available, the **device** takes it, uses the buffer and writes a used
//! descriptor back into the same array. There is no shared index at all: each descriptor's flags
//! say whose it is, with the avail/used wrap counters of section 2.7.1:
//!
//! - available: `AVAIL == driver's avail wrap counter` and `USED != it`;
//! - used: `AVAIL == USED == the used wrap counter` of the reader.
//!
//! Both counters start at 1 and flip each time an index wraps past the queue size. Unlike virtio,
//! a descriptor names a buffer of a [`crate::Pool`] by id with an offset and length (no guest
//! addresses), and buffer metadata lives here, not in a header inside the buffer (the vhost-user
//! cache-efficiency study, factor (d)). Descriptors are 16 bytes, four per cache line.
//!
//! Layout at `offset` in a region: a config line (magic, size), a device-wait line, a driver-wait
//! line, then `size` descriptors. Distrust: each side keeps its indices and wrap counters privately
//! and reads from shared memory only descriptors, each once (volatile) after an Acquire load of its
//! flags. A device that sees more available descriptors than the queue holds, or a driver that sees
//! a used descriptor with nothing in flight, reports [`Error::Corrupt`]; buffer ids, offsets and
//! lengths are checked by the pool ([`crate::Pool::check`]) before any byte is touched.

use std::sync::Arc;

use crate::sync::{fence, AtomicU16, AtomicU32, Ordering};
use crate::{Error, Pod, Result};

/// The magic number in a virtqueue's config line ("LBVQ").
pub const VQ_MAGIC: u32 = 0x4c42_5651;

/// Flag bit: the descriptor's avail bit (VIRTQ_DESC_F_AVAIL, bit 7).
pub const DESC_F_AVAIL: u16 = 1 << 7;
/// Flag bit: the descriptor's used bit (VIRTQ_DESC_F_USED, bit 15).
pub const DESC_F_USED: u16 = 1 << 15;
/// Flag bits free for the queue's user (carried from avail to used unless the device changes them).
pub const DESC_F_USER_MASK: u16 = !(DESC_F_AVAIL | DESC_F_USED);

/// A descriptor: which buffer, where in it, how long, and flags.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C, align(16))]
pub struct Desc {
    /// Buffer id in the pool.
    pub buffer: u32,
    /// Offset of the data inside the buffer.
    pub offset: u32,
    /// Data length in bytes (driver: bytes offered; device: bytes written or consumed).
    pub len: u32,
    /// Free for the user (virtio's buffer id field); carried unchanged by a device that does not set it.
    pub user: u16,
    /// Flags; only the [`DESC_F_USER_MASK`] bits are the user's, the queue sets AVAIL and USED.
    pub flags: u16,
}

// SAFETY: four u32-sized fields of integers and no padding (4+4+4+2+2 = 16): every bit pattern is
// a valid `Desc`.
unsafe impl Pod for Desc {}

#[cfg(not(loom))]
const FLAGS_OFFSET: usize = 14;
const HEADER: usize = 192;

/// Bytes a virtqueue of `size` descriptors occupies in a region (a multiple of 64).
pub fn bytes_needed(size: u16) -> usize {
    HEADER + size as usize * 16
}

fn check_size(size: u16) -> Result<()> {
    if size.is_power_of_two() && size >= 2 {
        Ok(())
    } else {
        Err(Error::Misuse("virtqueue size must be a power of two, at least 2"))
    }
}

#[cfg(not(loom))]
mod storage {
    use super::*;

    pub(crate) type Keep = Arc<crate::Region>;

    /// The descriptor table and the two wait flags, as raw pointers into a region.
    pub(crate) struct Table {
        descs: *mut Desc,
        pub(crate) device_waiting: *const AtomicU32,
        pub(crate) driver_waiting: *const AtomicU32,
    }

    impl Table {
        pub(crate) fn new(base: *mut u8) -> Table {
            Table {
                // The pointers stay inside the region (checked by the caller), so `wrapping_add`
                // computes the same address as `add` without needing unsafe.
                descs: base.wrapping_add(HEADER).cast(),
                device_waiting: base.wrapping_add(64).cast(),
                driver_waiting: base.wrapping_add(128).cast(),
            }
        }

        #[inline(always)]
        fn flags_atomic(&self, i: usize) -> &AtomicU16 {
            // SAFETY: i < size (callers mask), the descriptor is inside the region and 16-aligned,
            // so its flags at +14 are a 2-aligned u16, which AtomicU16 may view.
            unsafe { &*self.descs.add(i).cast::<u8>().add(FLAGS_OFFSET).cast::<AtomicU16>() }
        }

        #[inline(always)]
        pub(crate) fn load_flags(&self, i: usize, order: Ordering) -> u16 {
            self.flags_atomic(i).load(order)
        }

        #[inline(always)]
        pub(crate) fn store_flags(&self, i: usize, v: u16, order: Ordering) {
            self.flags_atomic(i).store(v, order)
        }

        /// Reads buffer, offset, len and user of descriptor `i` (flags come from `load_flags`).
        #[inline(always)]
        pub(crate) fn read_body(&self, i: usize) -> Desc {
            // SAFETY: i < size; volatile so each field is fetched exactly once even if a faulty
            // peer rewrites it meanwhile; every bit pattern is a valid value.
            unsafe {
                let d = self.descs.add(i);
                Desc {
                    buffer: core::ptr::addr_of!((*d).buffer).read_volatile(),
                    offset: core::ptr::addr_of!((*d).offset).read_volatile(),
                    len: core::ptr::addr_of!((*d).len).read_volatile(),
                    user: core::ptr::addr_of!((*d).user).read_volatile(),
                    flags: 0,
                }
            }
        }

        /// Writes everything but the flags of descriptor `i`.
        #[inline(always)]
        pub(crate) fn write_body(&self, i: usize, d: &Desc) {
            // SAFETY: i < size; the protocol gives this side the descriptor until it stores the
            // flags (Release) afterwards.
            unsafe {
                let p = self.descs.add(i);
                core::ptr::addr_of_mut!((*p).buffer).write(d.buffer);
                core::ptr::addr_of_mut!((*p).offset).write(d.offset);
                core::ptr::addr_of_mut!((*p).len).write(d.len);
                core::ptr::addr_of_mut!((*p).user).write(d.user);
            }
        }

        pub(crate) fn device_waiting(&self) -> &AtomicU32 {
            // SAFETY: inside the region's header, 64-aligned.
            unsafe { &*self.device_waiting }
        }

        pub(crate) fn driver_waiting(&self) -> &AtomicU32 {
            // SAFETY: inside the region's header, 64-aligned.
            unsafe { &*self.driver_waiting }
        }
    }
}

#[cfg(loom)]
mod storage {
    use super::*;
    use loom::cell::UnsafeCell;

    pub(crate) struct LoomDesc {
        body: UnsafeCell<Desc>,
        flags: AtomicU16,
    }

    pub(crate) struct Shared {
        descs: Vec<LoomDesc>,
        device_waiting: AtomicU32,
        driver_waiting: AtomicU32,
    }

    pub(crate) type Keep = Arc<Shared>;

    pub(crate) struct Table {
        shared: Arc<Shared>,
    }

    impl Table {
        pub(crate) fn new_loom(size: u16) -> (Table, Table) {
            let descs = (0..size)
                .map(|_| LoomDesc { body: UnsafeCell::new(Desc::default()), flags: AtomicU16::new(0) })
                .collect();
            let shared = Arc::new(Shared {
                descs,
                device_waiting: AtomicU32::new(0),
                driver_waiting: AtomicU32::new(0),
            });
            (Table { shared: shared.clone() }, Table { shared })
        }
        pub(crate) fn keep(&self) -> Keep {
            self.shared.clone()
        }
        pub(crate) fn load_flags(&self, i: usize, order: Ordering) -> u16 {
            self.shared.descs[i].flags.load(order)
        }
        pub(crate) fn store_flags(&self, i: usize, v: u16, order: Ordering) {
            self.shared.descs[i].flags.store(v, order)
        }
        pub(crate) fn read_body(&self, i: usize) -> Desc {
            // SAFETY: loom checks the access is ordered after the peer's write by the flags protocol.
            self.shared.descs[i].body.with(|p| unsafe { *p })
        }
        pub(crate) fn write_body(&self, i: usize, d: &Desc) {
            // SAFETY: loom checks no other access is concurrent with this write.
            self.shared.descs[i].body.with_mut(|p| unsafe { *p = *d })
        }
        pub(crate) fn device_waiting(&self) -> &AtomicU32 {
            &self.shared.device_waiting
        }
        pub(crate) fn driver_waiting(&self) -> &AtomicU32 {
            &self.shared.driver_waiting
        }
    }
}

use storage::{Keep, Table};

/// Private position in the ring: index and wrap counter.
#[derive(Debug, Clone, Copy)]
struct Cursor {
    index: u16,
    wrap: bool,
}

impl Cursor {
    const START: Cursor = Cursor { index: 0, wrap: true };

    #[inline(always)]
    fn advance(&mut self, size: u16) {
        self.index += 1;
        if self.index == size {
            self.index = 0;
            self.wrap = !self.wrap;
        }
    }
}

/// The driver side: offers buffers, collects them back used.
pub struct Driver {
    table: Table,
    size: u16,
    next_avail: Cursor,
    next_used: Cursor,
    in_flight: u16,
    _keep: Keep,
}

/// The device side: takes offered buffers, hands them back used.
pub struct Device {
    table: Table,
    size: u16,
    next_avail: Cursor,
    next_used: Cursor,
    outstanding: u16,
    _keep: Keep,
}

// SAFETY: each half accesses the shared table only through atomics and descriptors the flags
// protocol hands to it; `_keep` keeps the memory alive.
unsafe impl Send for Driver {}
// SAFETY: as for Driver.
unsafe impl Send for Device {}

impl core::fmt::Debug for Driver {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Driver").field("size", &self.size).field("in_flight", &self.in_flight).finish()
    }
}

impl core::fmt::Debug for Device {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Device").field("size", &self.size).field("outstanding", &self.outstanding).finish()
    }
}

/// Creates an in-process virtqueue of `size` descriptors (a power of two, at least 2).
pub fn virtqueue(size: u16) -> Result<(Driver, Device)> {
    check_size(size)?;
    #[cfg(not(loom))]
    {
        let region = Arc::new(crate::Region::anonymous(bytes_needed(size))?);
        format(&region, 0, size)?;
        Ok((Driver::attach(region.clone(), 0)?, Device::attach(region, 0)?))
    }
    #[cfg(loom)]
    {
        let (a, b) = Table::new_loom(size);
        let (ka, kb) = (a.keep(), b.keep());
        Ok((
            Driver {
                table: a,
                size,
                next_avail: Cursor::START,
                next_used: Cursor::START,
                in_flight: 0,
                _keep: ka,
            },
            Device {
                table: b,
                size,
                next_avail: Cursor::START,
                next_used: Cursor::START,
                outstanding: 0,
                _keep: kb,
            },
        ))
    }
}

/// Writes an empty virtqueue of `size` descriptors at `offset` (64-aligned, [`bytes_needed`] long).
#[cfg(not(loom))]
pub fn format(region: &crate::Region, offset: usize, size: u16) -> Result<()> {
    check_size(size)?;
    let base = region.range(offset, bytes_needed(size), 64)?;
    // SAFETY: inside the region (checked); nobody is attached yet.
    unsafe {
        core::ptr::write_bytes(base, 0, bytes_needed(size));
        base.cast::<u32>().write(VQ_MAGIC);
        base.cast::<u32>().add(1).write(size as u32);
    }
    Ok(())
}

/// Validates the config line at `offset`; returns the table and size.
#[cfg(not(loom))]
fn attach(region: &crate::Region, offset: usize) -> Result<(Table, u16)> {
    let base = region.range(offset, HEADER, 64)?;
    // SAFETY: inside the region (checked); volatile: fetched once, validated below.
    let (magic, size) =
        unsafe { (base.cast::<u32>().read_volatile(), base.cast::<u32>().add(1).read_volatile()) };
    if magic != VQ_MAGIC {
        return Err(Error::Corrupt("virtqueue magic missing"));
    }
    let size = u16::try_from(size).map_err(|_| Error::Corrupt("virtqueue size too large"))?;
    check_size(size).map_err(|_| Error::Corrupt("virtqueue size not a power of two"))?;
    region.range(offset, bytes_needed(size), 64)?;
    Ok((Table::new(base), size))
}

impl Driver {
    /// Attaches the driver to a freshly formatted virtqueue at `offset` in `region`.
    #[cfg(not(loom))]
    pub fn attach(region: Arc<crate::Region>, offset: usize) -> Result<Driver> {
        let (table, size) = attach(&region, offset)?;
        Ok(Driver {
            table,
            size,
            next_avail: Cursor::START,
            next_used: Cursor::START,
            in_flight: 0,
            _keep: region,
        })
    }

    /// The number of descriptors.
    pub fn size(&self) -> u16 {
        self.size
    }

    /// Descriptors offered and not yet collected back.
    pub fn in_flight(&self) -> u16 {
        self.in_flight
    }

    /// Offers `desc` to the device. `Ok(false)` if every descriptor is in flight.
    #[inline]
    pub fn add_avail(&mut self, desc: &Desc) -> Result<bool> {
        if self.in_flight == self.size {
            return Ok(false);
        }
        let i = self.next_avail.index as usize;
        self.table.write_body(i, desc);
        let wrap = self.next_avail.wrap;
        let flags = (desc.flags & DESC_F_USER_MASK)
            | if wrap { DESC_F_AVAIL } else { 0 }
            | if wrap { 0 } else { DESC_F_USED };
        // Release, pairing with the device's Acquire load of the flags in `poll_avail`: the body
        // written above is visible before the descriptor becomes available.
        self.table.store_flags(i, flags, Ordering::Release);
        self.next_avail.advance(self.size);
        self.in_flight += 1;
        Ok(true)
    }

    /// Collects one used descriptor, if the device has returned one.
    #[inline]
    pub fn poll_used(&mut self) -> Result<Option<Desc>> {
        let i = self.next_used.index as usize;
        // Acquire, pairing with the device's Release store in `push_used`: the used body is
        // visible once the flags say used.
        let flags = self.table.load_flags(i, Ordering::Acquire);
        let w = self.next_used.wrap;
        let avail = flags & DESC_F_AVAIL != 0;
        let used = flags & DESC_F_USED != 0;
        if !(avail == w && used == w) {
            return Ok(None);
        }
        if self.in_flight == 0 {
            return Err(Error::Corrupt("device returned a descriptor that was never offered"));
        }
        let mut d = self.table.read_body(i);
        d.flags = flags & DESC_F_USER_MASK;
        self.next_used.advance(self.size);
        self.in_flight -= 1;
        Ok(Some(d))
    }

    /// Whether the device announced it is about to sleep (write its eventfd). Call after
    /// `add_avail`; pairs with [`Device::prepare_wait`] (both sides: store, SeqCst fence, load).
    pub fn device_wake_needed(&self) -> bool {
        // SeqCst fence, pairing with the one in Device::prepare_wait: store-load ordering.
        fence(Ordering::SeqCst);
        // Relaxed: ordered by the fence.
        self.table.device_waiting().load(Ordering::Relaxed) != 0
    }

    /// Announces that the driver is about to block waiting for used descriptors; re-check
    /// `poll_used` before sleeping, and call [`Driver::finish_wait`] after.
    pub fn prepare_wait(&self) {
        // Relaxed store ordered by the SeqCst fence, pairing with Device::driver_wake_needed.
        self.table.driver_waiting().store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// Clears the driver's wait flag.
    pub fn finish_wait(&self) {
        // Relaxed: a stale 1 only costs the device a spurious wake-up.
        self.table.driver_waiting().store(0, Ordering::Relaxed);
    }
}

impl Device {
    /// Attaches the device to a freshly formatted virtqueue at `offset` in `region`.
    #[cfg(not(loom))]
    pub fn attach(region: Arc<crate::Region>, offset: usize) -> Result<Device> {
        let (table, size) = attach(&region, offset)?;
        Ok(Device {
            table,
            size,
            next_avail: Cursor::START,
            next_used: Cursor::START,
            outstanding: 0,
            _keep: region,
        })
    }

    /// The number of descriptors.
    pub fn size(&self) -> u16 {
        self.size
    }

    /// Takes one available descriptor, if the driver has offered one.
    #[inline]
    pub fn poll_avail(&mut self) -> Result<Option<Desc>> {
        let i = self.next_avail.index as usize;
        // Acquire, pairing with the driver's Release store in `add_avail`.
        let flags = self.table.load_flags(i, Ordering::Acquire);
        let w = self.next_avail.wrap;
        let avail = flags & DESC_F_AVAIL != 0;
        let used = flags & DESC_F_USED != 0;
        if !(avail == w && used != w) {
            return Ok(None);
        }
        if self.outstanding == self.size {
            return Err(Error::Corrupt("driver offered more descriptors than the queue holds"));
        }
        let mut d = self.table.read_body(i);
        d.flags = flags & DESC_F_USER_MASK;
        self.next_avail.advance(self.size);
        self.outstanding += 1;
        Ok(Some(d))
    }

    /// Whether a descriptor is available now, without taking it (for the re-check after arming).
    pub fn has_avail(&self) -> bool {
        // Acquire, pairing with the driver's Release store in `add_avail` (as in poll_avail).
        let flags = self.table.load_flags(self.next_avail.index as usize, Ordering::Acquire);
        let w = self.next_avail.wrap;
        (flags & DESC_F_AVAIL != 0) == w && (flags & DESC_F_USED != 0) != w
    }

    /// Returns a descriptor to the driver as used (the oldest outstanding slot is overwritten).
    #[inline]
    pub fn push_used(&mut self, desc: &Desc) -> Result<()> {
        if self.outstanding == 0 {
            return Err(Error::Misuse("push_used without an outstanding descriptor"));
        }
        let i = self.next_used.index as usize;
        self.table.write_body(i, desc);
        let flags = (desc.flags & DESC_F_USER_MASK)
            | if self.next_used.wrap { DESC_F_AVAIL | DESC_F_USED } else { 0 };
        // Release, pairing with the driver's Acquire load in `poll_used`.
        self.table.store_flags(i, flags, Ordering::Release);
        self.next_used.advance(self.size);
        self.outstanding -= 1;
        Ok(())
    }

    /// Whether the driver announced it is about to sleep waiting for used descriptors.
    pub fn driver_wake_needed(&self) -> bool {
        // SeqCst fence, pairing with the one in Driver::prepare_wait.
        fence(Ordering::SeqCst);
        // Relaxed: ordered by the fence.
        self.table.driver_waiting().load(Ordering::Relaxed) != 0
    }

    /// Announces that the device is about to block; re-check `poll_avail` before sleeping and
    /// call [`Device::finish_wait`] after.
    pub fn prepare_wait(&self) {
        // Relaxed store ordered by the SeqCst fence, pairing with Driver::device_wake_needed.
        self.table.device_waiting().store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// Clears the device's wait flag.
    pub fn finish_wait(&self) {
        // Relaxed: a stale 1 only costs the driver a spurious wake-up.
        self.table.device_waiting().store(0, Ordering::Relaxed);
    }
}
