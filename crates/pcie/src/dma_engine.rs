//! A DMA engine device model: copies host memory to host memory, then raises MSI-X.
//!
//! Layer: pcie engine, a [`DeviceModel`] for tests and measurement (`lanbus bench pcie`). Not a real
//! device's register set; its own, little-endian, in BAR 0 (4 KiB, 32-bit memory):
//!
//! | offset | register | access |
//! |---|---|---|
//! | 0x00 | source address, low/high DW (0x00, 0x04) | RW |
//! | 0x08 | destination address, low/high DW (0x08, 0x0c) | RW |
//! | 0x10 | length in bytes | RW |
//! | 0x14 | doorbell: any write starts a transfer (ignored, and ERROR set, while busy) | WO |
//! | 0x18 | status: bit 0 BUSY (RO), bit 1 DONE, bit 2 ERROR (write 1 to clear) | RW1C |
//! | 0x1c | transfers completed (successfully or not) | RO |
//!
//! BAR 2 (4 KiB) holds the MSI-X table (offset 0, [`MSIX_VECTORS`] vectors) and PBA (0x800).
//! Vector 0 is raised at the end of every transfer, after its last write (ordering: posted
//! writes stay in order, so the data is in host memory when the interrupt arrives).
//!
//! Invariants: at most [`MAX_OUTSTANDING_READS`] reads (or the number
//! [`DmaEngine::with_outstanding_reads`] set) of at most [`CHUNK_LEN`] bytes (never crossing 4
//! KiB) are in flight; a result for a read the engine did not issue, or of the wrong
//! length, fails the transfer (ERROR) instead of corrupting memory.

use std::collections::BTreeMap;

use crate::config::{Bar, BarKind, ConfigSpec, MsixSpec};
use crate::device::{CompleterAbort, DeviceIo, DeviceModel, DmaError, DmaId};
use crate::request::{split, Chunk};

/// Vendor ID of lanbus test devices (0x4c42, "LB"; not assigned by the PCI-SIG: test use only).
pub const VENDOR_ID: u16 = 0x4c42;
/// Device ID of the DMA engine.
pub const DEVICE_ID: u16 = 0x0001;
/// Class code: base class 08h (system peripheral), subclass 80h (other).
pub const CLASS_CODE: u32 = 0x08_80_00;
/// MSI-X vectors.
pub const MSIX_VECTORS: u16 = 4;
/// Bytes per DMA read the engine issues.
pub const CHUNK_LEN: usize = 4096;
/// Reads the engine keeps in flight.
pub const MAX_OUTSTANDING_READS: usize = 16;

/// Register offsets in BAR 0.
pub mod regs {
    /// Source address (64-bit, two DWs).
    pub const SRC: u64 = 0x00;
    /// Destination address (64-bit, two DWs).
    pub const DST: u64 = 0x08;
    /// Length in bytes.
    pub const LEN: u64 = 0x10;
    /// Doorbell.
    pub const DOORBELL: u64 = 0x14;
    /// Status.
    pub const STATUS: u64 = 0x18;
    /// Completed transfers.
    pub const COMPLETED: u64 = 0x1c;
    /// Status: a transfer is running.
    pub const STATUS_BUSY: u32 = 1;
    /// Status: the last transfer finished.
    pub const STATUS_DONE: u32 = 2;
    /// Status: a transfer failed or a doorbell came while busy.
    pub const STATUS_ERROR: u32 = 4;
}

/// The register writes (BAR0 offset, 32-bit value) that start one transfer of `len` bytes from
/// host address `src` to `dst`, in order, the doorbell last: what a driver of this device does.
pub fn transfer_writes(src: u64, dst: u64, len: u32) -> [(u64, u32); 6] {
    [
        (regs::SRC, src as u32),
        (regs::SRC + 4, (src >> 32) as u32),
        (regs::DST, dst as u32),
        (regs::DST + 4, (dst >> 32) as u32),
        (regs::LEN, len),
        (regs::DOORBELL, 1),
    ]
}

#[derive(Debug, Clone, Default)]
struct Transfer {
    dst: u64,
    /// Chunks not yet read.
    todo: Vec<Chunk>,
    /// Reads in flight: id -> chunk.
    inflight: BTreeMap<DmaId, Chunk>,
    failed: bool,
}

/// The DMA engine.
#[derive(Debug, Clone)]
pub struct DmaEngine {
    /// Reads in flight at most.
    outstanding: usize,
    src: u64,
    dst: u64,
    len: u32,
    status: u32,
    completed: u32,
    transfer: Option<Transfer>,
}

impl Default for DmaEngine {
    fn default() -> Self {
        DmaEngine::new()
    }
}

impl DmaEngine {
    /// An idle engine with [`MAX_OUTSTANDING_READS`] reads in flight at most.
    pub fn new() -> DmaEngine {
        DmaEngine::with_outstanding_reads(MAX_OUTSTANDING_READS)
    }

    /// An idle engine with up to `reads` (at least 1) reads in flight: with 256, a 1 MiB
    /// transfer asks for all its data at once, as a storage controller does.
    pub fn with_outstanding_reads(reads: usize) -> DmaEngine {
        DmaEngine {
            outstanding: reads.max(1),
            src: 0,
            dst: 0,
            len: 0,
            status: 0,
            completed: 0,
            transfer: None,
        }
    }

    /// The status register.
    pub fn status(&self) -> u32 {
        self.status
    }

    fn reg_read(&self, offset: u64) -> u32 {
        match offset {
            0x00 => self.src as u32,
            0x04 => (self.src >> 32) as u32,
            0x08 => self.dst as u32,
            0x0c => (self.dst >> 32) as u32,
            regs::LEN => self.len,
            regs::STATUS => self.status,
            regs::COMPLETED => self.completed,
            _ => 0,
        }
    }

    fn reg_write(&mut self, offset: u64, v: u32, io: &mut DeviceIo) {
        let set_lo = |r: &mut u64| *r = (*r & !0xffff_ffff) | u64::from(v);
        let set_hi = |r: &mut u64| *r = (*r & 0xffff_ffff) | u64::from(v) << 32;
        match offset {
            0x00 => set_lo(&mut self.src),
            0x04 => set_hi(&mut self.src),
            0x08 => set_lo(&mut self.dst),
            0x0c => set_hi(&mut self.dst),
            regs::LEN => self.len = v,
            regs::DOORBELL => self.start(io),
            regs::STATUS => self.status &= !(v & (regs::STATUS_DONE | regs::STATUS_ERROR)),
            _ => {}
        }
    }

    fn start(&mut self, io: &mut DeviceIo) {
        if self.transfer.is_some() {
            self.status |= regs::STATUS_ERROR;
            return;
        }
        self.status = (self.status | regs::STATUS_BUSY) & !(regs::STATUS_DONE | regs::STATUS_ERROR);
        let dst_ok = self.dst.checked_add(u64::from(self.len)).is_some();
        let todo = match split(self.src, self.len as usize, CHUNK_LEN) {
            Ok(_) if self.len == 0 => Vec::new(),
            Ok(mut c) if dst_ok => {
                c.reverse();
                c
            }
            _ => {
                self.transfer = Some(Transfer { failed: true, ..Transfer::default() });
                self.finish(io);
                return;
            }
        };
        self.transfer = Some(Transfer { dst: self.dst, todo, inflight: BTreeMap::new(), failed: false });
        self.pump(io);
    }

    /// Issues reads up to the limit, and finishes the transfer when nothing is left.
    fn pump(&mut self, io: &mut DeviceIo) {
        let Some(t) = self.transfer.as_mut() else { return };
        while !t.failed && t.inflight.len() < self.outstanding {
            let Some(c) = t.todo.pop() else { break };
            let id = io.dma_read(c.address, c.len);
            t.inflight.insert(id, c);
        }
        if t.inflight.is_empty() && (t.todo.is_empty() || t.failed) {
            self.finish(io);
        }
    }

    fn finish(&mut self, io: &mut DeviceIo) {
        let failed = self.transfer.take().is_some_and(|t| t.failed);
        self.status &= !regs::STATUS_BUSY;
        self.status |= if failed { regs::STATUS_ERROR } else { regs::STATUS_DONE };
        self.completed = self.completed.wrapping_add(1);
        io.signal_msix(0);
    }
}

impl DeviceModel for DmaEngine {
    fn config_spec(&self) -> ConfigSpec {
        ConfigSpec::new(VENDOR_ID, DEVICE_ID, CLASS_CODE)
            .with_bar(0, Bar { kind: BarKind::Memory32 { prefetchable: false }, size: 4096 })
            .with_bar(2, Bar { kind: BarKind::Memory32 { prefetchable: false }, size: 4096 })
            .with_msix(MsixSpec {
                table_size: MSIX_VECTORS,
                table_bar: 2,
                table_offset: 0,
                pba_bar: 2,
                pba_offset: 0x800,
            })
    }

    fn bar_read(
        &mut self,
        bar: usize,
        offset: u64,
        data: &mut [u8],
        _io: &mut DeviceIo,
    ) -> Result<(), CompleterAbort> {
        // Registers are DWs: a read returns the bytes of the DWs it covers.
        for (i, b) in data.iter_mut().enumerate() {
            let a = offset + i as u64;
            *b = if bar == 0 { self.reg_read(a & !3).to_le_bytes()[(a & 3) as usize] } else { 0 };
        }
        Ok(())
    }

    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8], io: &mut DeviceIo) {
        // Only whole, aligned DWs reach the registers; anything else is ignored.
        if bar != 0 || !offset.is_multiple_of(4) || !data.len().is_multiple_of(4) {
            return;
        }
        for (i, dw) in data.chunks_exact(4).enumerate() {
            let v = u32::from_le_bytes([dw[0], dw[1], dw[2], dw[3]]);
            self.reg_write(offset + 4 * i as u64, v, io);
        }
    }

    fn dma_read_done(&mut self, id: DmaId, result: Result<&[u8], DmaError>, io: &mut DeviceIo) {
        let Some(t) = self.transfer.as_mut() else { return };
        let Some(c) = t.inflight.remove(&id) else { return };
        match result {
            Ok(data) if data.len() == c.len && !t.failed => {
                io.dma_write(t.dst + c.offset as u64, data.to_vec())
            }
            _ => t.failed = true,
        }
        self.pump(io);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{command, reg, MSIX_CAP_OFFSET, MSIX_ENABLE};
    use crate::device::{Function, HostRequest};
    use crate::tlp::{Bdf, CplStatus, Header, Tag, Tlp, TlpKind};
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};

    const BAR0: u64 = 0xfe00_0000;
    const BAR2: u64 = 0xfe10_0000;
    const MSI_ADDR: u64 = 0xfee0_0000;
    const HOST_BASE: u64 = 0x1_0000_0000;

    /// Host memory and what arrived at the MSI address.
    struct Host {
        mem: Vec<u8>,
        interrupts: Vec<u32>,
    }

    impl Host {
        fn new(seed: u64) -> Host {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            Host { mem: (0..1 << 20).map(|_| rng.random()).collect(), interrupts: vec![] }
        }

        fn slice(&mut self, address: u64, len: usize) -> Option<&mut [u8]> {
            let off = usize::try_from(address.checked_sub(HOST_BASE)?).ok()?;
            self.mem.get_mut(off..off.checked_add(len)?)
        }

        /// Runs the function's requests to quiescence; reads are answered in a shuffled order
        /// (as they may come back over the fabric), those outside memory with UR.
        fn run(&mut self, f: &mut Function<DmaEngine>, rng: &mut impl Rng) {
            loop {
                let mut reads = vec![];
                while let Some(r) = f.poll_host_request() {
                    match r {
                        HostRequest::Read { id, address, len } => reads.push((id, address, len)),
                        HostRequest::Write { address, data } if address == MSI_ADDR => {
                            self.interrupts.push(u32::from_le_bytes(data.try_into().unwrap()))
                        }
                        HostRequest::Write { address, data } => self
                            .slice(address, data.len())
                            .expect("write inside host memory")
                            .copy_from_slice(&data),
                    }
                }
                if reads.is_empty() {
                    return;
                }
                reads.shuffle(rng);
                for (id, address, len) in reads {
                    match self.slice(address, len) {
                        Some(s) => {
                            let d = s.to_vec();
                            f.dma_read_done(id, Ok(&d));
                        }
                        None => f.dma_read_done(
                            id,
                            Err(DmaError::Completion(crate::CplStatus::UnsupportedRequest)),
                        ),
                    }
                }
            }
        }
    }

    /// A function enumerated as a host bridge would: BARs, memory space, bus master, MSI-X
    /// vector 0 programmed and unmasked (unless `masked`).
    fn enumerated(masked: bool) -> Function<DmaEngine> {
        let mut f = Function::new(DmaEngine::new()).unwrap();
        f.config_write(reg::BAR0, 0xf, (BAR0 as u32).to_le_bytes());
        f.config_write(reg::BAR0 + 8, 0xf, (BAR2 as u32).to_le_bytes());
        let cmd = (command::MEMORY_SPACE | command::BUS_MASTER).to_le_bytes();
        f.config_write(reg::COMMAND, 0b11, [cmd[0], cmd[1], 0, 0]);
        f.config_write(MSIX_CAP_OFFSET, 0b1100, [0, 0, 0, (MSIX_ENABLE >> 8) as u8]);
        f.memory_write(BAR2, &(MSI_ADDR as u32).to_le_bytes()).unwrap();
        f.memory_write(BAR2 + 4, &0u32.to_le_bytes()).unwrap();
        f.memory_write(BAR2 + 8, &0x55u32.to_le_bytes()).unwrap();
        f.memory_write(BAR2 + 12, &u32::from(masked).to_le_bytes()).unwrap();
        f
    }

    fn reg32(f: &mut Function<DmaEngine>, r: u64) -> u32 {
        let mut b = [0u8; 4];
        f.memory_read(BAR0 + r, &mut b).unwrap();
        u32::from_le_bytes(b)
    }

    fn program(f: &mut Function<DmaEngine>, src: u64, dst: u64, len: u32) {
        let mut regs = vec![];
        for v in [src as u32, (src >> 32) as u32, dst as u32, (dst >> 32) as u32, len] {
            regs.extend(v.to_le_bytes());
        }
        f.memory_write(BAR0, &regs).unwrap();
        f.memory_write(BAR0 + regs::DOORBELL, &1u32.to_le_bytes()).unwrap();
    }

    /// The request as it crosses the wire, and the answers likewise.
    fn over_wire(f: &mut Function<DmaEngine>, req: Tlp) -> Vec<Tlp> {
        let req = Tlp::decode(&req.encode().unwrap()).unwrap();
        let out = f.handle_request(&req).unwrap();
        out.iter().map(|c| Tlp::decode(&c.encode().unwrap()).unwrap()).collect()
    }

    fn status_of(c: &Tlp) -> CplStatus {
        match c.header {
            Header::Completion(h) => h.status,
            _ => panic!("not a completion: {c:?}"),
        }
    }

    #[test]
    fn answers_tlps() {
        let host: Bdf = "00:00.0".parse().unwrap();
        let me: Bdf = "03:00.0".parse().unwrap();
        let t = Tag::new(77).unwrap();
        let mut f = Function::new(DmaEngine::new()).unwrap();
        // Enumeration by configuration TLPs: IDs, BAR sizing, BAR assignment, enable.
        let c = over_wire(&mut f, Tlp::cfg_read(false, host, t, me, 0, 0xf));
        assert_eq!((c.len(), c[0].kind, c[0].data.clone()), (1, TlpKind::CplD, vec![0x42, 0x4c, 0x01, 0x00]));
        let c = over_wire(&mut f, Tlp::cfg_write(false, host, t, me, 0x10, 0xf, [0xff; 4]));
        assert_eq!((c[0].kind, status_of(&c[0])), (TlpKind::Cpl, CplStatus::Success));
        assert_eq!(f.id(), me, "the ID is captured from the write");
        let c = over_wire(&mut f, Tlp::cfg_read(false, host, t, me, 0x10, 0xf));
        assert_eq!(c[0].data, 0xffff_f000u32.to_le_bytes());
        over_wire(&mut f, Tlp::cfg_write(false, host, t, me, 0x10, 0xf, (BAR0 as u32).to_le_bytes()));
        assert_eq!(
            status_of(&over_wire(&mut f, Tlp::mem_read(host, t, BAR0, 1, 0xf, 0))[0]),
            CplStatus::UnsupportedRequest
        );
        over_wire(&mut f, Tlp::cfg_write(false, host, t, me, 0x04, 0x3, [0x06, 0, 0, 0]));
        // Registers through memory TLPs: write SRC and DST in one 4 DW write, read them back
        // with partial byte enables.
        let regs: Vec<u8> =
            [0x1111_2222u32, 0x3, 0x4444_5555, 0x6].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert!(over_wire(&mut f, Tlp::mem_write(host, BAR0, 0xf, 0xf, regs.clone())).is_empty());
        let c = over_wire(&mut f, Tlp::mem_read(host, t, BAR0, 4, 0xf, 0xf));
        assert_eq!((c.len(), &c[0].data), (1, &regs));
        let Header::Completion(h) = c[0].header else { panic!() };
        assert_eq!((h.completer_id, h.requester_id, h.byte_count, h.lower_address), (me, host, 16, 0));
        let c = over_wire(&mut f, Tlp::mem_read(host, t, BAR0, 2, 0xc, 0x1));
        let Header::Completion(h) = c[0].header else { panic!() };
        assert_eq!((h.byte_count, h.lower_address, &c[0].data[2..5]), (3, 2, &regs[2..5]));
        // A write with a hole in its byte enables leaves the hole alone.
        over_wire(&mut f, Tlp::mem_write(host, BAR0 + 0x10, 0xf, 0, 100u32.to_le_bytes().to_vec()));
        assert_eq!(reg32(&mut f, regs::LEN), 100);
        // Zero-length read, unsupported kinds and addresses.
        let c = over_wire(&mut f, Tlp::mem_read(host, t, BAR0 + 0x40, 1, 0, 0));
        assert_eq!((c[0].kind, status_of(&c[0]), c[0].length_dw), (TlpKind::CplD, CplStatus::Success, 1));
        let c = over_wire(&mut f, Tlp::mem_read(host, t, BAR0 + 0x1000 - 8, 4, 0xf, 0xf));
        assert_eq!(status_of(&c[0]), CplStatus::UnsupportedRequest, "runs past the BAR");
        let c = over_wire(&mut f, Tlp::cfg_read(true, host, t, me, 0, 0xf));
        assert_eq!(status_of(&c[0]), CplStatus::UnsupportedRequest);
        let mut io = Tlp::mem_read(host, t, 0x100, 1, 0xf, 0);
        io.kind = TlpKind::IORd;
        assert_eq!(status_of(&over_wire(&mut f, io)[0]), CplStatus::UnsupportedRequest);
        assert!(over_wire(&mut f, Tlp::mem_write(host, 0x1234_0000, 0xf, 0, vec![0; 4])).is_empty());
        let mut poisoned = Tlp::mem_write(host, BAR0 + 0x10, 0xf, 0, 7u32.to_le_bytes().to_vec());
        poisoned.ep = true;
        over_wire(&mut f, poisoned);
        assert_eq!(reg32(&mut f, regs::LEN), 100);
        let cnt = f.counters();
        assert_eq!((cnt.refused_requests, cnt.unsupported_writes, cnt.poisoned_writes), (4, 1, 1));
        let cpl = Tlp::completion(host, me, t, CplStatus::Success, 4, 0, vec![]);
        assert!(f.handle_request(&cpl).is_err());
    }

    #[test]
    fn identity_and_bars() {
        let mut f = Function::new(DmaEngine::new()).unwrap();
        assert_eq!(f.config_read(0, 0xf), [0x42, 0x4c, 0x01, 0x00]);
        f.config_write(reg::BAR0, 0xf, [0xff; 4]);
        assert_eq!(u32::from_le_bytes(f.config_read(reg::BAR0, 0xf)), 0xffff_f000);
        let mut b = [0u8; 4];
        assert_eq!(f.memory_read(BAR0, &mut b), Err(crate::device::MmioError::Unsupported));
        let mut f = enumerated(false);
        assert_eq!(f.memory_read(BAR0 + 0x2000, &mut b), Err(crate::device::MmioError::Unsupported));
        assert_eq!(reg32(&mut f, regs::STATUS), 0);
    }

    #[test]
    fn copies_and_interrupts_once_per_transfer() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let mut host = Host::new(1);
        let mut f = enumerated(false);
        let cases = [
            (0u64, 0x80000u64, 4096u32),
            (0x10, 0x90003, 1),
            (0x1ffd, 0xa0001, 300_000),
            (0x3000, 0x7000, 0),
        ];
        for (n, (src, dst, len)) in cases.into_iter().enumerate() {
            let want = host.mem[src as usize..(src + u64::from(len)) as usize].to_vec();
            program(&mut f, HOST_BASE + src, HOST_BASE + dst, len);
            assert_eq!(reg32(&mut f, regs::STATUS) & regs::STATUS_BUSY, u32::from(len > 0));
            host.run(&mut f, &mut rng);
            assert_eq!(&host.mem[dst as usize..(dst + u64::from(len)) as usize], &want[..], "transfer {n}");
            assert_eq!(reg32(&mut f, regs::STATUS), regs::STATUS_DONE);
            assert_eq!(reg32(&mut f, regs::COMPLETED), n as u32 + 1);
            assert_eq!(host.interrupts, vec![0x55; n + 1], "one interrupt per transfer");
            f.memory_write(BAR0 + regs::STATUS, &regs::STATUS_DONE.to_le_bytes()).unwrap();
        }
        assert_eq!(f.counters().interrupts_sent, 4);
    }

    #[test]
    fn masked_vector_pends_until_unmasked() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(12);
        let mut host = Host::new(2);
        let mut f = enumerated(true);
        program(&mut f, HOST_BASE, HOST_BASE + 0x8000, 64);
        host.run(&mut f, &mut rng);
        assert!(host.interrupts.is_empty());
        let mut pba = [0u8; 8];
        f.memory_read(BAR2 + 0x800, &mut pba).unwrap();
        assert_eq!(pba[0], 1, "vector 0 pending");
        f.memory_write(BAR2 + 12, &0u32.to_le_bytes()).unwrap();
        host.run(&mut f, &mut rng);
        assert_eq!(host.interrupts, vec![0x55]);
        f.memory_read(BAR2 + 0x800, &mut pba).unwrap();
        assert_eq!(pba[0], 0);
        assert_eq!((f.counters().interrupts_pended, f.counters().interrupts_sent), (1, 1));
    }

    #[test]
    fn failures_set_error_and_still_interrupt() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(13);
        let mut host = Host::new(3);
        // The host answers UR for memory it does not have.
        let mut f = enumerated(false);
        program(&mut f, HOST_BASE + (1 << 20) - 4096, HOST_BASE, 64 * 1024);
        host.run(&mut f, &mut rng);
        assert_eq!(reg32(&mut f, regs::STATUS), regs::STATUS_ERROR);
        assert_eq!(host.interrupts.len(), 1);
        // A doorbell while busy.
        program(&mut f, HOST_BASE, HOST_BASE + 0x10000, 8192);
        f.memory_write(BAR0 + regs::DOORBELL, &1u32.to_le_bytes()).unwrap();
        assert_eq!(reg32(&mut f, regs::STATUS), regs::STATUS_BUSY | regs::STATUS_ERROR);
        host.run(&mut f, &mut rng);
        assert_eq!(&host.mem[0x10000..0x12000], &host.mem[..0x2000].to_vec()[..]);
        // Bus mastering off: reads are refused at once, the interrupt is dropped.
        f.config_write(reg::COMMAND, 0b11, [command::MEMORY_SPACE as u8, 0, 0, 0]);
        program(&mut f, HOST_BASE, HOST_BASE + 0x20000, 100);
        assert_eq!(f.poll_host_request(), None);
        assert_eq!(reg32(&mut f, regs::STATUS) & regs::STATUS_ERROR, regs::STATUS_ERROR);
        assert_eq!((f.counters().reads_refused, f.counters().interrupts_dropped), (1, 1));
        // A stray read result is ignored.
        f.dma_read_done(DmaId(999), Ok(&[0; 4]));
        assert_eq!(f.poll_host_request(), None);
    }
}
