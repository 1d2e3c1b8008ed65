//! The virtio-blk device: feature bits, configuration space and the requests, over a
//! [`BlockDevice`] and guest memory.
//!
//! Layer: device logic, below the vhost-user plumbing in [`crate::backend`]. No threads, sockets
//! or clocks here: a request is a list of guest buffers ([`Segment`]s) and the memory they lie in;
//! [`handle_request`] executes it against the device and writes the status byte. Virtio 1.2,
//! section 5.2: a request is a 16-byte header (type, reserved, sector) and data in the
//! device-readable buffers, then data and one status byte in the device-writable ones. With
//! `VIRTIO_F_VERSION_1` (which implies `VIRTIO_F_ANY_LAYOUT`) the split into descriptors carries no
//! meaning, so the buffers are read as one byte stream each way.
//!
//! Everything here comes from the guest and is distrusted: segment addresses and lengths, the
//! header, discard ranges. A request that cannot be executed gets `VIRTIO_BLK_S_IOERR` or
//! `VIRTIO_BLK_S_UNSUPP`; one without a writable byte for the status is completed with nothing
//! written. Nothing a guest sends panics.

use std::sync::atomic::{AtomicU64, Ordering};

use lanbus_block::{BlockDevice, DeviceError};
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use vm_memory::{Bytes, GuestAddress, GuestMemory};

/// Sector size of virtio-blk addresses and lengths, whatever the device's block size.
pub const SECTOR_BYTES: u64 = 512;
/// The largest data transfer of one request (bigger ones get `IOERR`): bounds the bounce buffer a
/// guest can make the backend allocate. Linux sends at most `max_sectors_kb` (1280 KiB by
/// default) per request.
pub const MAX_DATA_BYTES: u64 = 32 << 20;
/// Segments per request the guest may use (`seg_max`): a 128-entry queue less header and status.
pub const SEG_MAX: u32 = 126;
/// Ranges in one DISCARD or WRITE_ZEROES request (`max_discard_seg`, `max_write_zeroes_seg`).
pub const MAX_RANGES: u32 = 16;
/// Sectors in one DISCARD or WRITE_ZEROES range: 64 MiB.
pub const MAX_RANGE_SECTORS: u32 = 1 << 17;
/// Length of the GET_ID answer (`VIRTIO_BLK_ID_BYTES`).
pub const ID_BYTES: usize = VIRTIO_BLK_ID_BYTES as usize;
/// Size of the configuration space we answer from: `struct virtio_blk_config` up to the zoned
/// fields (QEMU asks for its own `sizeof`, which may be more; the rest reads as zero).
pub const CONFIG_BYTES: usize = 96;

/// Byte ranges of `struct virtio_blk_config` (virtio 1.2, 5.2.4), little-endian.
mod field {
    use std::ops::Range;
    pub const CAPACITY: Range<usize> = 0..8;
    pub const SEG_MAX: Range<usize> = 12..16;
    pub const BLK_SIZE: Range<usize> = 20..24;
    pub const MIN_IO_SIZE: Range<usize> = 26..28;
    pub const OPT_IO_SIZE: Range<usize> = 28..32;
    pub const NUM_QUEUES: Range<usize> = 34..36;
    pub const MAX_DISCARD_SECTORS: Range<usize> = 36..40;
    pub const MAX_DISCARD_SEG: Range<usize> = 40..44;
    pub const DISCARD_SECTOR_ALIGNMENT: Range<usize> = 44..48;
    pub const MAX_WRITE_ZEROES_SECTORS: Range<usize> = 48..52;
    pub const MAX_WRITE_ZEROES_SEG: Range<usize> = 52..56;
    pub const WRITE_ZEROES_MAY_UNMAP: usize = 56;
}

/// What the guest is told about the device, fixed for a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Size in bytes (a multiple of [`SECTOR_BYTES`]).
    pub size_bytes: u64,
    /// The device's block size (512 or 4096): requests must be aligned to it.
    pub block_size: u32,
    /// Writes, discards and write-zeroes are refused.
    pub read_only: bool,
    /// Request queues.
    pub queues: u16,
    /// The GET_ID answer (at most [`ID_BYTES`]; shorter ones are padded with NULs).
    pub serial: String,
}

impl DeviceInfo {
    /// The virtio feature bits offered (the vhost-user bits are added by the backend).
    pub fn features(&self) -> u64 {
        let mut f = [
            VIRTIO_F_VERSION_1,
            VIRTIO_RING_F_EVENT_IDX,
            VIRTIO_RING_F_INDIRECT_DESC,
            VIRTIO_BLK_F_SEG_MAX,
            VIRTIO_BLK_F_BLK_SIZE,
            VIRTIO_BLK_F_FLUSH,
            VIRTIO_BLK_F_MQ,
            VIRTIO_BLK_F_DISCARD,
            VIRTIO_BLK_F_WRITE_ZEROES,
        ]
        .iter()
        .fold(0u64, |acc, bit| acc | 1 << bit);
        if self.read_only {
            f |= 1 << VIRTIO_BLK_F_RO;
        }
        f
    }

    /// The configuration space, [`CONFIG_BYTES`] long.
    pub fn config(&self) -> [u8; CONFIG_BYTES] {
        let mut c = [0u8; CONFIG_BYTES];
        let block = self.block_size.max(SECTOR_BYTES as u32);
        let sectors_per_block = block / SECTOR_BYTES as u32;
        c[field::CAPACITY].copy_from_slice(&(self.size_bytes / SECTOR_BYTES).to_le_bytes());
        c[field::SEG_MAX].copy_from_slice(&SEG_MAX.to_le_bytes());
        c[field::BLK_SIZE].copy_from_slice(&block.to_le_bytes());
        // In logical blocks.
        c[field::MIN_IO_SIZE].copy_from_slice(&1u16.to_le_bytes());
        c[field::OPT_IO_SIZE].copy_from_slice(&(65536 / block).to_le_bytes());
        c[field::NUM_QUEUES].copy_from_slice(&self.queues.to_le_bytes());
        c[field::MAX_DISCARD_SECTORS].copy_from_slice(&MAX_RANGE_SECTORS.to_le_bytes());
        c[field::MAX_DISCARD_SEG].copy_from_slice(&MAX_RANGES.to_le_bytes());
        c[field::DISCARD_SECTOR_ALIGNMENT].copy_from_slice(&sectors_per_block.to_le_bytes());
        c[field::MAX_WRITE_ZEROES_SECTORS].copy_from_slice(&MAX_RANGE_SECTORS.to_le_bytes());
        c[field::MAX_WRITE_ZEROES_SEG].copy_from_slice(&MAX_RANGES.to_le_bytes());
        c[field::WRITE_ZEROES_MAY_UNMAP] = 1;
        c
    }

    /// `size` bytes of the configuration space from `offset`, zero past its end (never panics).
    pub fn config_slice(&self, offset: u32, size: u32) -> Vec<u8> {
        let c = self.config();
        (u64::from(offset)..u64::from(offset) + u64::from(size))
            .map(|i| usize::try_from(i).ok().and_then(|i| c.get(i).copied()).unwrap_or(0))
            .collect()
    }
}

/// One guest buffer of a request, as its descriptor says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Guest physical address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// Device-writable (`VIRTQ_DESC_F_WRITE`).
    pub write: bool,
}

/// Counters of a backend, shared by its queues and connections.
#[derive(Debug, Default)]
pub struct BlkStats {
    /// Requests completed (whatever their status).
    pub requests: AtomicU64,
    /// Bytes read from the device for the guest.
    pub read_bytes: AtomicU64,
    /// Bytes written to the device from the guest.
    pub written_bytes: AtomicU64,
    /// DISCARD requests.
    pub discards: AtomicU64,
    /// WRITE_ZEROES requests.
    pub write_zeroes: AtomicU64,
    /// Requests answered `IOERR` (bad requests and device errors).
    pub io_errors: AtomicU64,
    /// Requests answered `UNSUPP`.
    pub unsupported: AtomicU64,
    /// Requests with nowhere to put a status: completed with nothing written.
    pub malformed: AtomicU64,
    /// Connections accepted.
    pub connections: AtomicU64,
    /// The virtio features the last frontend acknowledged.
    pub acked_features: AtomicU64,
    /// Connections that ended with a protocol error (a frontend sending something wrong).
    pub protocol_errors: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    // Relaxed: counters only, read for display.
    c.fetch_add(n, Ordering::Relaxed);
}

/// The guest buffers of one direction seen as one byte stream.
struct Stream<'a> {
    segs: Vec<&'a Segment>,
    len: u64,
}

impl<'a> Stream<'a> {
    fn new(segs: impl Iterator<Item = &'a Segment>) -> Stream<'a> {
        let segs: Vec<&Segment> = segs.collect();
        let len = segs.iter().map(|s| u64::from(s.len)).sum();
        Stream { segs, len }
    }

    /// Calls `f(guest_address, range_in_buf)` for each piece of `[offset, offset + len)`.
    fn walk(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(GuestAddress, std::ops::Range<usize>) -> bool,
    ) -> bool {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return false;
        }
        let (mut skip, mut left, mut done) = (offset, len, 0usize);
        for s in &self.segs {
            if left == 0 {
                break;
            }
            let seg_len = u64::from(s.len);
            if skip >= seg_len {
                skip -= seg_len;
                continue;
            }
            let n = (seg_len - skip).min(left);
            let Some(addr) = s.addr.checked_add(skip) else { return false };
            if !f(GuestAddress(addr), done..done + n as usize) {
                return false;
            }
            done += n as usize;
            left -= n;
            skip = 0;
        }
        left == 0
    }

    fn read<M: GuestMemory>(&self, mem: &M, offset: u64, buf: &mut [u8]) -> bool {
        self.walk(offset, buf.len() as u64, |a, r| mem.read_slice(&mut buf[r], a).is_ok())
    }

    fn write<M: GuestMemory>(&self, mem: &M, offset: u64, data: &[u8]) -> bool {
        self.walk(offset, data.len() as u64, |a, r| mem.write_slice(&data[r], a).is_ok())
    }
}

/// A request's outcome before its status is written.
enum Outcome {
    /// `VIRTIO_BLK_S_OK`, with this many bytes written into the guest's data buffers.
    Ok(u64),
    /// `VIRTIO_BLK_S_IOERR`.
    IoErr(String),
    /// `VIRTIO_BLK_S_UNSUPP`.
    Unsupp(String),
}

/// The virtio-blk status of a device's failure: `VIRTIO_BLK_S_UNSUPP` for an operation the device
/// does not support, `VIRTIO_BLK_S_IOERR` for everything else (virtio-blk has no finer status).
fn device_outcome(e: DeviceError) -> Outcome {
    match e {
        DeviceError::Unsupported(what) => Outcome::Unsupp(what.to_string()),
        e => Outcome::IoErr(e.to_string()),
    }
}

/// Executes one request: reads its header and data from guest memory, calls the device, writes
/// data and the status byte back. Returns the used length: bytes written into the guest's
/// buffers (data and status), 0 when there was no writable byte for the status.
pub fn handle_request<M: GuestMemory>(
    mem: &M,
    segments: &[Segment],
    dev: &dyn BlockDevice,
    info: &DeviceInfo,
    stats: &BlkStats,
) -> u32 {
    bump(&stats.requests, 1);
    let readable = Stream::new(segments.iter().filter(|s| !s.write));
    let writable = Stream::new(segments.iter().filter(|s| s.write));
    if writable.len == 0 {
        bump(&stats.malformed, 1);
        tracing::debug!("virtio-blk: a request without a status byte");
        return 0;
    }
    let status_at = writable.len - 1;
    let outcome = execute(mem, &readable, &writable, status_at, dev, info, stats);
    let (status, data) = match outcome {
        Outcome::Ok(n) => (VIRTIO_BLK_S_OK, n),
        Outcome::IoErr(why) => {
            bump(&stats.io_errors, 1);
            tracing::debug!("virtio-blk: IOERR: {why}");
            (VIRTIO_BLK_S_IOERR, 0)
        }
        Outcome::Unsupp(why) => {
            bump(&stats.unsupported, 1);
            tracing::debug!("virtio-blk: UNSUPP: {why}");
            (VIRTIO_BLK_S_UNSUPP, 0)
        }
    };
    if !writable.write(mem, status_at, &[status as u8]) {
        bump(&stats.malformed, 1);
        return 0;
    }
    // data <= status_at < writable.len, and writable.len fits: each segment is u32 and a chain
    // holds at most a queue's worth of them; saturate rather than trust that.
    u32::try_from(data + 1).unwrap_or(u32::MAX)
}

fn execute<M: GuestMemory>(
    mem: &M,
    readable: &Stream,
    writable: &Stream,
    status_at: u64,
    dev: &dyn BlockDevice,
    info: &DeviceInfo,
    stats: &BlkStats,
) -> Outcome {
    let mut header = [0u8; 16];
    if readable.len < 16 || !readable.read(mem, 0, &mut header) {
        return Outcome::IoErr(format!("no readable 16-byte header ({} readable bytes)", readable.len));
    }
    let kind = u32::from_le_bytes(header[0..4].try_into().unwrap_or_default());
    let sector = u64::from_le_bytes(header[8..16].try_into().unwrap_or_default());
    let out_len = readable.len - 16;
    let in_len = status_at;
    let range_ok = |len: u64| -> Result<u64, Outcome> {
        let offset = sector
            .checked_mul(SECTOR_BYTES)
            .ok_or_else(|| Outcome::IoErr(format!("sector {sector} overflows")))?;
        let end = offset.checked_add(len).ok_or_else(|| Outcome::IoErr("range overflows".into()))?;
        if end > info.size_bytes {
            return Err(Outcome::IoErr(format!("{offset}+{len} beyond {} bytes", info.size_bytes)));
        }
        let block = u64::from(info.block_size.max(1));
        if !offset.is_multiple_of(block) || !len.is_multiple_of(block) {
            return Err(Outcome::IoErr(format!("{offset}+{len} not aligned to {block}")));
        }
        if len > MAX_DATA_BYTES {
            return Err(Outcome::IoErr(format!("{len} bytes in one request (at most {MAX_DATA_BYTES})")));
        }
        Ok(offset)
    };
    match kind {
        VIRTIO_BLK_T_IN => {
            let offset = match range_ok(in_len) {
                Ok(o) => o,
                Err(e) => return e,
            };
            let mut buf = vec![0u8; in_len as usize];
            if let Err(e) = dev.read_at(offset, &mut buf) {
                return device_outcome(e);
            }
            if !writable.write(mem, 0, &buf) {
                return Outcome::IoErr("data buffers outside guest memory".into());
            }
            bump(&stats.read_bytes, in_len);
            Outcome::Ok(in_len)
        }
        VIRTIO_BLK_T_OUT => {
            if info.read_only {
                return Outcome::IoErr("write to a read-only device".into());
            }
            let offset = match range_ok(out_len) {
                Ok(o) => o,
                Err(e) => return e,
            };
            let mut buf = vec![0u8; out_len as usize];
            if !readable.read(mem, 16, &mut buf) {
                return Outcome::IoErr("data buffers outside guest memory".into());
            }
            if let Err(e) = dev.write_at(offset, &buf, false) {
                return device_outcome(e);
            }
            bump(&stats.written_bytes, out_len);
            Outcome::Ok(0)
        }
        VIRTIO_BLK_T_FLUSH => match dev.flush() {
            Ok(()) => Outcome::Ok(0),
            Err(e) => device_outcome(e),
        },
        VIRTIO_BLK_T_GET_ID => {
            let mut id = [0u8; ID_BYTES];
            let s = info.serial.as_bytes();
            let n = s.len().min(ID_BYTES);
            id[..n].copy_from_slice(&s[..n]);
            let n = (in_len as usize).min(ID_BYTES);
            if !writable.write(mem, 0, &id[..n]) {
                return Outcome::IoErr("ID buffer outside guest memory".into());
            }
            Outcome::Ok(n as u64)
        }
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
            bump(if kind == VIRTIO_BLK_T_DISCARD { &stats.discards } else { &stats.write_zeroes }, 1);
            if info.read_only {
                return Outcome::IoErr("discard or write-zeroes on a read-only device".into());
            }
            ranges(mem, readable, out_len, kind == VIRTIO_BLK_T_DISCARD, dev, info)
        }
        other => Outcome::Unsupp(format!("request type {other}")),
    }
}

/// DISCARD and WRITE_ZEROES: `struct virtio_blk_discard_write_zeroes` ranges (sector u64,
/// num_sectors u32, flags u32; flag bit 0 is `unmap`, allowed for WRITE_ZEROES only).
fn ranges<M: GuestMemory>(
    mem: &M,
    readable: &Stream,
    len: u64,
    discard: bool,
    dev: &dyn BlockDevice,
    info: &DeviceInfo,
) -> Outcome {
    if len == 0 || !len.is_multiple_of(16) || len / 16 > u64::from(MAX_RANGES) {
        return Outcome::IoErr(format!("{len} bytes of ranges (1 to {MAX_RANGES} of 16 bytes)"));
    }
    let mut raw = vec![0u8; len as usize];
    if !readable.read(mem, 16, &mut raw) {
        return Outcome::IoErr("ranges outside guest memory".into());
    }
    let block = u64::from(info.block_size.max(1));
    for r in raw.chunks_exact(16) {
        let sector = u64::from_le_bytes(r[0..8].try_into().unwrap_or_default());
        let sectors = u32::from_le_bytes(r[8..12].try_into().unwrap_or_default());
        let flags = u32::from_le_bytes(r[12..16].try_into().unwrap_or_default());
        if (discard && flags != 0) || (!discard && flags & !1 != 0) {
            return Outcome::Unsupp(format!("range flags {flags:#x}"));
        }
        if sectors > MAX_RANGE_SECTORS {
            return Outcome::IoErr(format!("{sectors} sectors in one range (at most {MAX_RANGE_SECTORS})"));
        }
        let (Some(offset), n) = (sector.checked_mul(SECTOR_BYTES), u64::from(sectors) * SECTOR_BYTES) else {
            return Outcome::IoErr(format!("sector {sector} overflows"));
        };
        if offset.checked_add(n).is_none_or(|end| end > info.size_bytes) {
            return Outcome::IoErr(format!("{offset}+{n} beyond {} bytes", info.size_bytes));
        }
        if !offset.is_multiple_of(block) || !n.is_multiple_of(block) {
            return Outcome::IoErr(format!("{offset}+{n} not aligned to {block}"));
        }
        if n == 0 {
            continue;
        }
        let r = if discard { dev.trim(offset, n) } else { dev.write_zeroes(offset, n, flags & 1 != 0) };
        if let Err(e) = r {
            return device_outcome(e);
        }
    }
    Outcome::Ok(0)
}

/// The fuzz target's body: `data` is a hostile guest's request. Byte 0 says read-only (bit 0)
/// and how many segments follow (bits 4-7, at most 15), each 13 bytes (address u64, length u32,
/// writable u8, little-endian); the rest fills 64 KiB of guest memory at 0x1000. The request
/// runs against a 1 MiB RAM disk: it must complete without a panic and never report more bytes
/// used than the guest made writable.
#[cfg(any(test, fuzzing))]
pub fn fuzz_request(data: &[u8]) {
    use vm_memory::GuestMemoryMmap;
    let Some((&first, mut rest)) = data.split_first() else { return };
    let mut segments = Vec::new();
    for _ in 0..first >> 4 {
        let Some((s, r)) = rest.split_first_chunk::<13>() else { return };
        segments.push(Segment {
            addr: u64::from_le_bytes(s[0..8].try_into().unwrap_or_default()),
            len: u32::from_le_bytes(s[8..12].try_into().unwrap_or_default()),
            write: s[12] & 1 == 1,
        });
        rest = r;
    }
    let Ok(mem) = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0x1000), 64 << 10)]) else { return };
    let _ = mem.write_slice(&rest[..rest.len().min(64 << 10)], GuestAddress(0x1000));
    let dev = lanbus_block::MemDevice::new(1 << 20);
    let info = DeviceInfo {
        size_bytes: 1 << 20,
        block_size: 512,
        read_only: first & 1 == 1,
        queues: 1,
        serial: "fuzz".into(),
    };
    let writable: u64 = segments.iter().filter(|s| s.write).map(|s| u64::from(s.len)).sum();
    let used = handle_request(&mem, &segments, &dev, &info, &BlkStats::default());
    assert!(u64::from(used) <= writable, "used {used} of {writable} writable bytes");
}

#[cfg(test)]
mod tests {
    use super::*;
    use lanbus_block::MemDevice;
    use vm_memory::GuestMemoryMmap;

    const MEM_BASE: u64 = 0x1000;
    const MEM_BYTES: usize = 1 << 20;

    fn setup(size: u64) -> (GuestMemoryMmap, MemDevice, DeviceInfo, BlkStats) {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(MEM_BASE), MEM_BYTES)]).unwrap();
        let dev = MemDevice::new(size);
        let info = DeviceInfo {
            size_bytes: size,
            block_size: 512,
            read_only: false,
            queues: 2,
            serial: "lanbus-test".into(),
        };
        (mem, dev, info, BlkStats::default())
    }

    fn header(mem: &GuestMemoryMmap, at: u64, kind: u32, sector: u64) -> Segment {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        mem.write_slice(&h, GuestAddress(at)).unwrap();
        Segment { addr: at, len: 16, write: false }
    }

    fn status(mem: &GuestMemoryMmap, at: u64) -> u8 {
        let mut b = [0xffu8];
        mem.read_slice(&mut b, GuestAddress(at)).unwrap();
        b[0]
    }

    const STATUS: u64 = MEM_BASE + 0x100;

    fn st() -> Segment {
        Segment { addr: STATUS, len: 1, write: true }
    }

    #[test]
    fn write_then_read_across_split_buffers() {
        let (mem, dev, info, stats) = setup(1 << 20);
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        mem.write_slice(&data[..1000], GuestAddress(MEM_BASE + 0x1000)).unwrap();
        mem.write_slice(&data[1000..], GuestAddress(MEM_BASE + 0x4000)).unwrap();
        let req = [
            header(&mem, MEM_BASE, VIRTIO_BLK_T_OUT, 8),
            Segment { addr: MEM_BASE + 0x1000, len: 1000, write: false },
            Segment { addr: MEM_BASE + 0x4000, len: 3096, write: false },
            st(),
        ];
        assert_eq!(handle_request(&mem, &req, &dev, &info, &stats), 1);
        assert_eq!(status(&mem, STATUS), VIRTIO_BLK_S_OK as u8);
        let req = [
            header(&mem, MEM_BASE, VIRTIO_BLK_T_IN, 8),
            Segment { addr: MEM_BASE + 0x8000, len: 512, write: true },
            Segment { addr: MEM_BASE + 0x9000, len: 3584, write: true },
            st(),
        ];
        assert_eq!(handle_request(&mem, &req, &dev, &info, &stats), 4097);
        assert_eq!(status(&mem, STATUS), VIRTIO_BLK_S_OK as u8);
        let mut back = vec![0u8; 4096];
        mem.read_slice(&mut back[..512], GuestAddress(MEM_BASE + 0x8000)).unwrap();
        mem.read_slice(&mut back[512..], GuestAddress(MEM_BASE + 0x9000)).unwrap();
        assert_eq!(back, data);
        let mut on_dev = vec![0u8; 4096];
        dev.read_at(8 * 512, &mut on_dev).unwrap();
        assert_eq!(on_dev, data);
    }

    #[test]
    fn bad_requests_get_an_error_status() {
        let (mem, dev, info, stats) = setup(1 << 20);
        // Each case's header and ranges at an address of their own: all are written up front.
        let at = std::cell::Cell::new(MEM_BASE + 0x20000);
        let next = || {
            at.set(at.get() + 0x100);
            at.get()
        };
        let data = Segment { addr: MEM_BASE + 0x1000, len: 4096, write: true };
        let cases: Vec<(Vec<Segment>, u32)> = vec![
            // beyond the capacity
            (vec![header(&mem, next(), VIRTIO_BLK_T_IN, 2047), data, st()], VIRTIO_BLK_S_IOERR),
            // sector overflow
            (vec![header(&mem, next(), VIRTIO_BLK_T_IN, u64::MAX / 4), data, st()], VIRTIO_BLK_S_IOERR),
            // data buffer outside guest memory
            (
                vec![
                    header(&mem, next(), VIRTIO_BLK_T_IN, 0),
                    Segment { addr: 1 << 40, len: 512, write: true },
                    st(),
                ],
                VIRTIO_BLK_S_IOERR,
            ),
            // header outside guest memory
            (vec![Segment { addr: 0, len: 16, write: false }, st()], VIRTIO_BLK_S_IOERR),
            // short header
            (vec![Segment { addr: MEM_BASE, len: 8, write: false }, st()], VIRTIO_BLK_S_IOERR),
            // unaligned length
            (
                vec![
                    header(&mem, next(), VIRTIO_BLK_T_IN, 0),
                    Segment { addr: MEM_BASE + 0x1000, len: 100, write: true },
                    st(),
                ],
                VIRTIO_BLK_S_IOERR,
            ),
            // unknown type
            (vec![header(&mem, next(), 77, 0), st()], VIRTIO_BLK_S_UNSUPP),
            // discard with the unmap flag
            (
                vec![header(&mem, next(), VIRTIO_BLK_T_DISCARD, 0), range(&mem, next(), 0, 8, 1), st()],
                VIRTIO_BLK_S_UNSUPP,
            ),
            // a range beyond the end
            (
                vec![
                    header(&mem, next(), VIRTIO_BLK_T_WRITE_ZEROES, 0),
                    range(&mem, next(), 2040, 16, 0),
                    st(),
                ],
                VIRTIO_BLK_S_IOERR,
            ),
        ];
        for (i, (req, want)) in cases.iter().enumerate() {
            assert_eq!(handle_request(&mem, req, &dev, &info, &stats), 1, "case {i}");
            assert_eq!(u32::from(status(&mem, STATUS)), *want, "case {i}");
        }
        // No writable byte at all, or the status outside memory: nothing written, no panic.
        assert_eq!(
            handle_request(&mem, &[header(&mem, next(), VIRTIO_BLK_T_FLUSH, 0)], &dev, &info, &stats),
            0
        );
        let away = Segment { addr: u64::MAX - 1, len: 16, write: true };
        assert_eq!(
            handle_request(&mem, &[header(&mem, next(), VIRTIO_BLK_T_FLUSH, 0), away], &dev, &info, &stats),
            0
        );
    }

    fn range(mem: &GuestMemoryMmap, at: u64, sector: u64, sectors: u32, flags: u32) -> Segment {
        let mut r = [0u8; 16];
        r[0..8].copy_from_slice(&sector.to_le_bytes());
        r[8..12].copy_from_slice(&sectors.to_le_bytes());
        r[12..16].copy_from_slice(&flags.to_le_bytes());
        mem.write_slice(&r, GuestAddress(at)).unwrap();
        Segment { addr: at, len: 16, write: false }
    }

    #[test]
    fn flush_get_id_write_zeroes_and_read_only() {
        let (mem, dev, mut info, stats) = setup(1 << 20);
        dev.write_at(0, &[0xaa; 4096], false).unwrap();
        let z = [
            header(&mem, MEM_BASE, VIRTIO_BLK_T_WRITE_ZEROES, 0),
            range(&mem, MEM_BASE + 0x200, 0, 4, 1),
            st(),
        ];
        assert_eq!(handle_request(&mem, &z, &dev, &info, &stats), 1);
        assert_eq!(status(&mem, STATUS), VIRTIO_BLK_S_OK as u8);
        let mut b = [0u8; 4096];
        dev.read_at(0, &mut b).unwrap();
        assert!(b[..2048].iter().all(|&x| x == 0) && b[2048..].iter().all(|&x| x == 0xaa));
        let id = [
            header(&mem, MEM_BASE, VIRTIO_BLK_T_GET_ID, 0),
            Segment { addr: MEM_BASE + 0x1000, len: 20, write: true },
            st(),
        ];
        assert_eq!(handle_request(&mem, &id, &dev, &info, &stats), 21);
        let mut got = [0u8; 20];
        mem.read_slice(&mut got, GuestAddress(MEM_BASE + 0x1000)).unwrap();
        assert_eq!(&got[..11], b"lanbus-test");
        let f = [header(&mem, MEM_BASE, VIRTIO_BLK_T_FLUSH, 0), st()];
        assert_eq!(handle_request(&mem, &f, &dev, &info, &stats), 1);
        assert_eq!(status(&mem, STATUS), VIRTIO_BLK_S_OK as u8);
        info.read_only = true;
        let w = [
            header(&mem, MEM_BASE, VIRTIO_BLK_T_OUT, 0),
            Segment { addr: MEM_BASE + 0x1000, len: 512, write: false },
            st(),
        ];
        assert_eq!(handle_request(&mem, &w, &dev, &info, &stats), 1);
        assert_eq!(status(&mem, STATUS), VIRTIO_BLK_S_IOERR as u8);
        assert_ne!(info.features() & (1 << VIRTIO_BLK_F_RO), 0);
    }

    #[test]
    fn config_space_fields() {
        let (_, _, info, _) = setup(1 << 30);
        let c = info.config();
        assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), (1 << 30) / 512);
        assert_eq!(u16::from_le_bytes(c[34..36].try_into().unwrap()), 2);
        assert_eq!(info.config_slice(0, 8), c[0..8]);
        assert_eq!(info.config_slice(90, 20).len(), 20);
        assert_eq!(info.config_slice(u32::MAX, 4), vec![0; 4]);
    }

    /// The committed seed of the fuzz target: a 512-byte write at sector 3 (header at 0x1000,
    /// data at 0x1100, status at 0x1400).
    fn fuzz_seed() -> Vec<u8> {
        let mut d = vec![3 << 4];
        for (addr, len, write) in [(0x1000u64, 16u32, 0u8), (0x1100, 512, 0), (0x1400, 1, 1)] {
            d.extend(addr.to_le_bytes());
            d.extend(len.to_le_bytes());
            d.push(write);
        }
        let mut mem = vec![0u8; 0x401];
        mem[0..4].copy_from_slice(&VIRTIO_BLK_T_OUT.to_le_bytes());
        mem[8..16].copy_from_slice(&3u64.to_le_bytes());
        d.extend(mem);
        d
    }

    #[test]
    fn the_fuzz_corpus_runs() {
        let seed = fuzz_seed();
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/vhost_blk_request");
        let committed = std::fs::read(dir.join("write")).expect("the committed seed");
        assert_eq!(committed, seed, "fuzz/corpus/vhost_blk_request/write is the seed built here");
        for entry in std::fs::read_dir(&dir).unwrap() {
            fuzz_request(&std::fs::read(entry.unwrap().path()).unwrap());
        }
    }

    proptest::proptest! {
        #[test]
        fn fuzz_request_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..400)) {
            fuzz_request(&bytes);
        }

        #[test]
        fn fuzz_request_never_panics_near_the_seed(flips in proptest::collection::vec((0usize..600, proptest::num::u8::ANY), 1..6)) {
            let mut bytes = fuzz_seed();
            for (at, v) in flips {
                let n = bytes.len();
                bytes[at % n] = v;
            }
            fuzz_request(&bytes);
        }

        // Whatever segments and header bytes a guest sends, a request completes without a panic,
        // and its used length never exceeds its writable bytes.
        #[test]
        fn any_request_completes(
            kind in proptest::prop_oneof![0u32..16, proptest::num::u32::ANY],
            sector in proptest::prop_oneof![0u64..4096, proptest::num::u64::ANY],
            segs in proptest::collection::vec((0u64..(3 << 20), 0u32..9000, proptest::bool::ANY), 0..6),
        ) {
            let (mem, dev, info, stats) = setup(1 << 20);
            let mut req = vec![header(&mem, MEM_BASE, kind, sector)];
            req.extend(segs.iter().map(|&(addr, len, write)| Segment { addr, len, write }));
            let writable: u64 = req.iter().filter(|s| s.write).map(|s| u64::from(s.len)).sum();
            let used = handle_request(&mem, &req, &dev, &info, &stats);
            proptest::prop_assert!(u64::from(used) <= writable);
        }
    }
}
