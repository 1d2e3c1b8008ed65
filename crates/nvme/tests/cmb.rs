//! The Controller Memory Buffer (NVMe 1.4 section 4.7): its registers, and the driver keeping its
//! submission queues, PRP lists and write data there, joined in-process.

mod common;
use common::*;

use lanbus_nvme::command::nvm_opcode;
use lanbus_nvme::controller::{cmb, reg};
use lanbus_nvme::local::{LocalNvme, ProcessMode, LOCAL_CMB_ADDRESS};
use lanbus_nvme::{CompletionMode, ControllerConfig, DriverConfig, Status};

const CMB: u64 = 1 << 20;

fn with_cmb(bytes: u64, mode: ProcessMode) -> LocalNvme {
    let cfg = ControllerConfig { cmb_bytes: bytes, ..ControllerConfig::default() };
    LocalNvme::new(controller(512, 32 * MIB, cfg), 8192, mode)
}

fn read32(c: &mut lanbus_nvme::Controller, offset: u64) -> u32 {
    let mut b = [0u8; 4];
    c.bar0_read(offset, &mut b).unwrap();
    u32::from_le_bytes(b)
}

#[test]
fn registers_read_zero_until_enabled_and_a_bad_base_is_flagged() {
    let mut c = controller(512, MIB, ControllerConfig { cmb_bytes: 64 << 10, ..ControllerConfig::default() });
    assert_ne!(c.cap() & cmb::CAP_CMBS, 0);
    assert_eq!(c.pci_info().cmb_bar_size, 64 << 10);
    assert_eq!(read32(&mut c, reg::CMBLOC), 0);
    assert_eq!(read32(&mut c, reg::CMBSZ), 0);
    c.bar0_write(reg::CMBMSC, &cmb::CRE.to_le_bytes()).unwrap();
    assert_eq!(read32(&mut c, reg::CMBLOC), u32::from(cmb::BIR));
    assert_eq!(read32(&mut c, reg::CMBSZ), cmb::SQS | cmb::LISTS | cmb::WDS | 16 << 12);
    // Enabled at address 0: invalid.
    c.bar0_write(reg::CMBMSC, &(cmb::CRE | cmb::CMSE).to_le_bytes()).unwrap();
    assert_eq!(read32(&mut c, reg::CMBSTS), cmb::CBAI);
    c.bar0_write(reg::CMBMSC, &(0xfe00_0000 | cmb::CRE | cmb::CMSE).to_le_bytes()).unwrap();
    assert_eq!(read32(&mut c, reg::CMBSTS), 0);
    let mut b = [0u8; 8];
    c.bar0_read(reg::CMBMSC, &mut b).unwrap();
    assert_eq!(u64::from_le_bytes(b), 0xfe00_0000 | cmb::CRE | cmb::CMSE);
    // BAR2 accesses land in the buffer; beyond it they fail.
    c.cmb_write(100, b"abc").unwrap();
    let mut back = [0u8; 3];
    c.cmb_read(100, &mut back).unwrap();
    assert_eq!(&back, b"abc");
    assert!(c.cmb_write((64 << 10) - 2, b"abc").is_err());

    // Without a buffer: no capability, no BAR2, CMBMSC ignored.
    let mut c = controller(512, MIB, ControllerConfig::default());
    assert_eq!(c.cap() & cmb::CAP_CMBS, 0);
    assert_eq!(c.pci_info().cmb_bar_size, 0);
    c.bar0_write(reg::CMBMSC, &cmb::CRE.to_le_bytes()).unwrap();
    assert_eq!(read32(&mut c, reg::CMBSZ), 0);
    assert!(c.cmb_write(0, b"x").is_err());
    let bad = ControllerConfig { cmb_bytes: 1000, ..ControllerConfig::default() };
    assert!(lanbus_nvme::Controller::new(bad, Box::new(lanbus_nvme::RamBacking::new(MIB))).is_err());
}

#[test]
fn the_driver_puts_queues_lists_and_write_data_in_the_buffer() {
    let modes = [
        (ProcessMode::Inline, CompletionMode::Interrupt),
        (ProcessMode::Thread, CompletionMode::Interrupt),
        (ProcessMode::Thread, CompletionMode::Poll),
    ];
    for (mode, completion) in modes {
        let l = with_cmb(CMB, mode);
        let d = l.driver(DriverConfig { completion, ..DriverConfig::default() }).unwrap();
        let used = d.cmb_in_use().expect("the driver maps the buffer");
        assert!(used.submission_queues && used.prp_lists && used.write_data);
        assert_eq!(used.bytes, CMB);
        let queues_pages = used.pages_in_use;
        assert_eq!(queues_pages, 4 * 4, "four I/O SQs of 256 64-byte entries");
        // Every PRP shape, and 2 MiB writes whose 1 MiB commands do not fit next to the queues
        // (they fall back to host memory).
        for (i, len) in
            [512usize, 4096, 8192, 12288, 65536, 300 * 512, 1 << 20, 2 << 20].into_iter().enumerate()
        {
            let data = pattern(i as u64 + 1, len);
            let lba = 4096 * i as u64;
            d.write(lba, &data, false).unwrap();
            let mut back = vec![0u8; len];
            d.read(lba, &mut back).unwrap();
            assert!(back == data, "{len} bytes, {mode:?}/{completion:?}");
        }
        assert_eq!(d.cmb_in_use().unwrap().pages_in_use, queues_pages, "buffers freed");
        assert_eq!(l.controller().stats().error_completions, 0);
        drop(d);
        // What went through the buffer reached the namespace: a driver without it reads it back.
        let d = l.driver(DriverConfig { use_cmb: false, ..DriverConfig::default() }).unwrap();
        assert!(d.cmb_in_use().is_none());
        let mut back = vec![0u8; 65536];
        d.read(4096 * 4, &mut back).unwrap();
        assert!(back == pattern(5, 65536));
        drop(d);
        assert_eq!(l.region().pages_in_use(), 0);
    }
}

#[test]
fn a_write_into_the_buffer_goes_in_commands_of_the_pipelined_size() {
    for (mode, split, use_cmb, commands) in [
        (ProcessMode::Inline, 256 << 10, true, 4),
        (ProcessMode::Thread, 256 << 10, true, 4),
        (ProcessMode::Thread, 100_000, true, 11), // 195 blocks of 512 bytes each
        (ProcessMode::Thread, 0, true, 1),
        (ProcessMode::Thread, 256 << 10, false, 1), // data in host memory: one MDTS command
    ] {
        let l = with_cmb(4 * CMB, mode);
        let cfg = DriverConfig { pipelined_write_bytes: split, use_cmb, ..DriverConfig::default() };
        let d = l.driver(cfg).unwrap();
        let data = pattern(split as u64 + 7, 1 << 20);
        let before = l.controller().stats().io_commands;
        d.write(2048, &data, false).unwrap();
        let ran = l.controller().stats().io_commands - before;
        assert_eq!(ran, commands, "split {split}, buffer {use_cmb}, {mode:?}");
        let mut back = vec![0u8; data.len()];
        d.read(2048, &mut back).unwrap();
        assert!(back == data, "split {split}, buffer {use_cmb}, {mode:?}");
        assert_eq!(l.controller().stats().error_completions, 0);
    }
}

#[test]
fn a_transfer_straddling_the_buffer_edge_is_invalid_cmb_use() {
    let l = with_cmb(CMB, ProcessMode::Inline);
    let d = l.driver(DriverConfig::default()).unwrap();
    // 8 KiB whose first page is the buffer's last and second lies just beyond it: one run of
    // adjacent pages that crosses the edge.
    let end = LOCAL_CMB_ADDRESS + CMB;
    let sqe = sqe(nvm_opcode::WRITE, 1, [0, 0, 15, 0, 0, 0]);
    let sqe = lanbus_nvme::Sqe { prp1: end - 4096, prp2: end, ..sqe };
    let c = d.submit_io_raw(0, sqe).unwrap();
    assert_eq!(c.status, Status::INVALID_CMB_USE);
    // Wholly inside the buffer is fine.
    let sqe = lanbus_nvme::Sqe { prp1: end - 8192, prp2: end - 4096, ..sqe };
    assert_eq!(d.submit_io_raw(0, sqe).unwrap().status, Status::SUCCESS);
}

/// Host memory that must only be written (what `process_posted` may touch).
struct WriteOnly<'a>(&'a lanbus_bridge::dma::HostRegion);

impl lanbus_nvme::HostMemory for WriteOnly<'_> {
    fn read(&mut self, addr: u64, _: &mut [u8]) -> Result<(), lanbus_bridge::dma::BusError> {
        panic!("process_posted read host memory at {addr:#x}");
    }
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), lanbus_bridge::dma::BusError> {
        let mut region = self.0;
        lanbus_nvme::HostMemory::write(&mut region, addr, data)
    }
}

struct Irqs(usize);

impl lanbus_nvme::InterruptSink for Irqs {
    fn signal_msix(&mut self, _: u16) {
        self.0 += 1;
    }
}

#[test]
fn posted_processing_runs_what_reads_no_host_memory_and_leaves_the_rest() {
    use lanbus_bridge::dma::HostRegion;
    use lanbus_nvme::command::{Sqe, SQE_LEN};
    const CMB_AT: u64 = 0xfe00_0000;
    let (iocq, data) = (IOCQ, HOST + 0x10000);
    let mem = HostRegion::new(HOST, 64);
    let mut c = controller(512, MIB, ControllerConfig { cmb_bytes: 64 << 10, ..ControllerConfig::default() });
    c.bar0_write(reg::CMBMSC, &(CMB_AT | cmb::CRE | cmb::CMSE).to_le_bytes()).unwrap();
    // The I/O SQ lives in the buffer.
    let mut irqs = with_io_queues(&mut c, &mem, 64, CMB_AT);

    let write_data = pattern(7, 4096);
    c.cmb_write(0x8000, &write_data).unwrap();
    // A PRP list of 3 entries in host memory, for a 12 KiB read.
    let list: Vec<u8> = [data + 0x1000, data + 0x2000].iter().flat_map(|a| a.to_le_bytes()).collect();
    lanbus_nvme::HostMemory::write(&mut &mem, HOST + 0x3000, &list).unwrap();
    let rw = |opcode, cid, slba: u32, nlb: u32, prp1, prp2| Sqe {
        opcode,
        cid,
        nsid: 1,
        prp1,
        prp2,
        cdw: [slba, 0, nlb - 1, 0, 0, 0],
        ..Sqe::default()
    };
    let cmds = [
        // Write from the buffer, read it back to host memory: both run.
        rw(nvm_opcode::WRITE, 1, 0, 8, CMB_AT + 0x8000, 0),
        rw(nvm_opcode::READ, 2, 0, 8, data, 0),
        // A failing command needs no transfer: it runs.
        rw(nvm_opcode::READ, 3, u32::MAX, 1, data, 0),
        // A Flush may take a disk's time: posted processing stops here...
        Sqe { opcode: nvm_opcode::FLUSH, cid: 4, nsid: 1, ..Sqe::default() },
        // ...so a write from host memory (it needs a read) and a read whose PRP list lies in
        // host memory wait for it too.
        rw(nvm_opcode::WRITE, 5, 8, 8, data, 0),
        rw(nvm_opcode::READ, 6, 0, 24, data + 0x4000, HOST + 0x3000),
    ];
    for (i, s) in cmds.iter().enumerate() {
        c.cmb_write((i * SQE_LEN) as u64, &s.to_bytes()).unwrap();
    }
    c.bar0_write(reg::sq_tail(1), &(cmds.len() as u32).to_le_bytes()).unwrap();
    irqs.0 = 0;
    assert_eq!(c.process_posted(&mut WriteOnly(&mem), &mut irqs), 3);
    assert_eq!(irqs.0, 1, "one interrupt for the batch");
    let done = cqes(&mem, iocq, 4);
    assert_eq!(
        done.iter().take(3).map(|c| (c.cid, c.phase)).collect::<Vec<_>>(),
        [(1, true), (2, true), (3, true)]
    );
    assert!(done[0].status.is_success() && done[1].status.is_success());
    assert_eq!(done[2].status, Status::LBA_OUT_OF_RANGE);
    assert!(!done[3].phase, "the flush waits");
    let mut back = vec![0u8; 4096];
    lanbus_nvme::HostMemory::read(&mut &mem, data, &mut back).unwrap();
    assert!(back == write_data);
    assert!(c.has_work());
    assert_eq!(c.process_posted(&mut WriteOnly(&mem), &mut irqs), 0, "nothing more it may do");
    while c.process(&mut &mem, &mut irqs) > 0 {}
    let done = cqes(&mem, iocq, 6);
    assert_eq!(done.iter().map(|c| c.cid).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6]);
    assert!(done[3..].iter().all(|c| c.status.is_success()));
    assert_eq!(done[5].sq_head, 6);
    assert!(!c.has_work());
}

/// Host memory of the posted-processing tests: admin queues at its start, I/O CQ 1 after them.
const HOST: u64 = 0x1000_0000;
const IOCQ: u64 = HOST + 0x2000;

/// Enables `c` with its admin queues in `mem` and creates I/O CQ 1 (`cq_entries` entries) and
/// I/O SQ 1 (16 entries at `sq_base`). Posted processing leaves the admin commands alone: it
/// neither runs nor prefetches them (they read host memory).
fn with_io_queues(
    c: &mut lanbus_nvme::Controller,
    mem: &lanbus_bridge::dma::HostRegion,
    cq_entries: u32,
    sq_base: u64,
) -> Irqs {
    use lanbus_nvme::command::{admin_opcode, Sqe, SQE_LEN};
    let (asq, acq) = (HOST, HOST + 0x1000);
    c.bar0_write(reg::AQA, &(15u32 | 15 << 16).to_le_bytes()).unwrap();
    c.bar0_write(reg::ASQ, &asq.to_le_bytes()).unwrap();
    c.bar0_write(reg::ACQ, &acq.to_le_bytes()).unwrap();
    c.bar0_write(reg::CC, &(1u32 | 6 << 16 | 4 << 20).to_le_bytes()).unwrap();
    let mut irqs = Irqs(0);
    let create_cq = Sqe {
        opcode: admin_opcode::CREATE_CQ,
        prp1: IOCQ,
        cdw: [(cq_entries - 1) << 16 | 1, 3, 0, 0, 0, 0],
        ..Sqe::default()
    };
    let create_sq = Sqe {
        opcode: admin_opcode::CREATE_SQ,
        prp1: sq_base,
        cdw: [15 << 16 | 1, 1 | 1 << 16, 0, 0, 0, 0],
        ..Sqe::default()
    };
    for (i, s) in [create_cq, create_sq].iter().enumerate() {
        lanbus_nvme::HostMemory::write(&mut &*mem, asq + (i * SQE_LEN) as u64, &s.to_bytes()).unwrap();
    }
    c.bar0_write(reg::sq_tail(0), &2u32.to_le_bytes()).unwrap();
    let mut rec = Recording::new(mem, true, Vec::new());
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 0);
    assert!(rec.reads.is_empty() && rec.prefetches.is_empty(), "admin commands wait for the full run");
    assert!(c.has_work());
    while c.process(&mut &*mem, &mut irqs) > 0 {}
    irqs
}

/// The first `n` entries of the completion queue at `cq`.
fn cqes(mem: &lanbus_bridge::dma::HostRegion, cq: u64, n: usize) -> Vec<lanbus_nvme::Completion> {
    use lanbus_nvme::command::{Completion, CQE_LEN};
    (0..n)
        .map(|i| {
            let mut b = [0u8; CQE_LEN];
            lanbus_nvme::HostMemory::read(&mut &*mem, cq + (i * CQE_LEN) as u64, &mut b).unwrap();
            Completion::parse(&b)
        })
        .collect()
}

/// (command id, success) of the first `n` entries of the completion queue at `cq`.
fn completions(mem: &lanbus_bridge::dma::HostRegion, cq: u64, n: usize) -> Vec<(u16, bool)> {
    cqes(mem, cq, n).iter().map(|c| (c.cid, c.status.is_success())).collect()
}

/// Host memory that records the reads and prefetches made of it. Where nothing may wait
/// (`posted`), only the ranges in `ready` (prefetches that ended) can be read, once each.
struct Recording<'a> {
    mem: &'a lanbus_bridge::dma::HostRegion,
    posted: bool,
    ready: Vec<(u64, usize)>,
    reads: Vec<(u64, usize)>,
    prefetches: Vec<(u64, usize)>,
}

impl<'a> Recording<'a> {
    fn new(mem: &'a lanbus_bridge::dma::HostRegion, posted: bool, ready: Vec<(u64, usize)>) -> Self {
        Recording { mem, posted, ready, reads: Vec::new(), prefetches: Vec::new() }
    }
}

impl lanbus_nvme::HostMemory for Recording<'_> {
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), lanbus_bridge::dma::BusError> {
        if self.posted {
            let i = self.ready.iter().position(|&r| r == (addr, buf.len()));
            let Some(i) = i else { return Err(lanbus_bridge::dma::BusError::NotReady) };
            self.ready.remove(i);
        }
        self.reads.push((addr, buf.len()));
        let mut region = self.mem;
        lanbus_nvme::HostMemory::read(&mut region, addr, buf)
    }
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), lanbus_bridge::dma::BusError> {
        let mut region = self.mem;
        lanbus_nvme::HostMemory::write(&mut region, addr, data)
    }
    fn prefetch(&mut self, addr: u64, len: usize) {
        self.prefetches.push((addr, len));
    }
}

/// Writes queued together with their data in host memory: the one that waits for its data has
/// the data of those behind it named too, so their round trips overlap; data that arrives for a
/// later one is kept, and once the first one's comes, all run in one call, each page read once.
/// A command other than a read or write stops the look ahead.
#[test]
fn posted_processing_names_the_data_behind_a_waiting_write_and_the_entries_rung_meanwhile() {
    use lanbus_bridge::dma::HostRegion;
    use lanbus_nvme::command::{Sqe, SQE_LEN};
    let (iocq, iosq, data) = (IOCQ, HOST + 0x3000, HOST + 0x10000);
    let mem = HostRegion::new(HOST, 64);
    let mut c = controller(512, MIB, ControllerConfig::default());
    let mut irqs = with_io_queues(&mut c, &mem, 16, iosq);
    let write = |cid: u16, opcode| Sqe {
        opcode,
        cid,
        nsid: 1,
        prp1: data + (u64::from(cid) << 12),
        cdw: [u32::from(cid) * 8, 0, 7, 0, 0, 0],
        ..Sqe::default()
    };
    let payload = pattern(6, 8 << 12);
    lanbus_nvme::HostMemory::write(&mut &mem, data, &payload).unwrap();
    for cid in 0..8u16 {
        let at = iosq + u64::from(cid) * SQE_LEN as u64;
        lanbus_nvme::HostMemory::write(&mut &mem, at, &write(cid, nvm_opcode::WRITE).to_bytes()).unwrap();
    }
    c.bar0_write(reg::sq_tail(1), &8u32.to_le_bytes()).unwrap();
    let entries = (iosq, 8 * SQE_LEN);
    let pages: Vec<(u64, usize)> = (0..8).map(|i| (data + (i << 12), 4096)).collect();

    let mut rec = Recording::new(&mem, true, vec![entries]);
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 0);
    assert_eq!(rec.prefetches, pages, "every write's data is named at once");
    // The later half arrives first: kept, and only the rest named again.
    let mut rec = Recording::new(&mem, true, pages[4..].to_vec());
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 0);
    assert_eq!(rec.prefetches, pages[..4]);
    let mut rec = Recording::new(&mem, true, pages[..4].to_vec());
    irqs.0 = 0;
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 8);
    assert_eq!(irqs.0, 1, "one interrupt for the eight");
    assert!(rec.prefetches.is_empty());
    assert!(!c.has_work());
    let done = completions(&mem, iocq, 8);
    assert!(done.iter().enumerate().all(|(i, &(cid, ok))| usize::from(cid) == i && ok), "{done:?}");
    let mut rec = Recording::new(&mem, false, Vec::new());
    let reads: Vec<Sqe> = (0..8u16).map(|cid| write(cid, nvm_opcode::READ)).collect();
    for (i, s) in reads.iter().enumerate() {
        let mut s = *s;
        s.prp1 = data + 0x10000 + ((i as u64) << 12);
        lanbus_nvme::HostMemory::write(&mut &mem, iosq + ((8 + i) * SQE_LEN) as u64, &s.to_bytes()).unwrap();
    }
    c.bar0_write(reg::cq_head(1), &8u32.to_le_bytes()).unwrap();
    c.bar0_write(reg::sq_tail(1), &0u32.to_le_bytes()).unwrap();
    while c.process(&mut rec, &mut irqs) > 0 {}
    let mut back = vec![0u8; 8 << 12];
    lanbus_nvme::HostMemory::read(&mut &mem, data + 0x10000, &mut back).unwrap();
    assert!(back == payload, "the eight writes read back");

    // Two writes wait for their data while two reads are rung behind them: once the writes
    // ran, the reads' entries are named for fetching here, not left to the full run.
    let cmds = [write(1, nvm_opcode::WRITE), write(2, nvm_opcode::WRITE)];
    for (i, s) in cmds.iter().enumerate() {
        lanbus_nvme::HostMemory::write(&mut &mem, iosq + (i * SQE_LEN) as u64, &s.to_bytes()).unwrap();
    }
    c.bar0_write(reg::cq_head(1), &0u32.to_le_bytes()).unwrap();
    c.bar0_write(reg::sq_tail(1), &2u32.to_le_bytes()).unwrap();
    let mut rec = Recording::new(&mem, true, vec![(iosq, 2 * SQE_LEN)]);
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 0);
    assert_eq!(rec.prefetches, pages[1..3]);
    for (i, s) in reads[..2].iter().enumerate() {
        lanbus_nvme::HostMemory::write(&mut &mem, iosq + ((2 + i) * SQE_LEN) as u64, &s.to_bytes()).unwrap();
    }
    c.bar0_write(reg::sq_tail(1), &4u32.to_le_bytes()).unwrap();
    let mut rec = Recording::new(&mem, true, pages[1..3].to_vec());
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 2);
    assert_eq!(rec.prefetches, [(iosq + 2 * SQE_LEN as u64, 2 * SQE_LEN)]);
    let mut rec = Recording::new(&mem, true, vec![(iosq + 2 * SQE_LEN as u64, 2 * SQE_LEN)]);
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 2);
    assert!(!c.has_work());

    // A write, a flush and a write: only the first write's data is named.
    let cmds = [write(1, nvm_opcode::WRITE), write(2, nvm_opcode::FLUSH), write(3, nvm_opcode::WRITE)];
    for (i, s) in cmds.iter().enumerate() {
        lanbus_nvme::HostMemory::write(&mut &mem, iosq + ((4 + i) * SQE_LEN) as u64, &s.to_bytes()).unwrap();
    }
    c.bar0_write(reg::cq_head(1), &4u32.to_le_bytes()).unwrap();
    c.bar0_write(reg::sq_tail(1), &7u32.to_le_bytes()).unwrap();
    let mut rec = Recording::new(&mem, true, vec![(iosq + 4 * SQE_LEN as u64, 3 * SQE_LEN)]);
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 0);
    assert_eq!(rec.prefetches, [pages[1]]);
}

/// Without the buffer, posted processing runs nothing but names the read of the queue's new
/// entries, which is exactly the first read the full run makes.
#[test]
fn posted_processing_prefetches_the_new_entries_of_a_queue_in_host_memory() {
    use lanbus_bridge::dma::HostRegion;
    use lanbus_nvme::command::{Sqe, SQE_LEN};
    let (iosq, data) = (HOST + 0x3000, HOST + 0x10000);
    let mem = HostRegion::new(HOST, 64);
    for cmb_bytes in [0, 64 << 10] {
        let mut c = controller(512, MIB, ControllerConfig { cmb_bytes, ..ControllerConfig::default() });
        let mut irqs = with_io_queues(&mut c, &mem, 16, iosq);

        // Three reads from slot 14 on: they wrap, so the first fetch takes slots 14 and 15.
        let read = |cid: u16| Sqe { opcode: nvm_opcode::READ, cid, nsid: 1, prp1: data, ..Sqe::default() };
        for round in 0..2u16 {
            let slots: Vec<u16> = if round == 0 { (0..14).collect() } else { vec![14, 15, 0] };
            for &slot in &slots {
                let at = iosq + u64::from(slot) * SQE_LEN as u64;
                lanbus_nvme::HostMemory::write(&mut &mem, at, &read(slot).to_bytes()).unwrap();
            }
            let tail = (slots.last().unwrap() + 1) % 16;
            c.bar0_write(reg::sq_tail(1), &u32::from(tail).to_le_bytes()).unwrap();
            let mut rec = Recording::new(&mem, true, Vec::new());
            assert_eq!(c.process_posted(&mut rec, &mut irqs), 0, "buffer {cmb_bytes}: nothing runs");
            let first = slots[0];
            let fetched = slots.iter().take_while(|&&s| s >= first).count();
            let want = (iosq + u64::from(first) * SQE_LEN as u64, fetched * SQE_LEN);
            assert_eq!(rec.prefetches, [want], "buffer {cmb_bytes}, round {round}");
            let mut rec = Recording::new(&mem, false, Vec::new());
            while c.process(&mut rec, &mut irqs) > 0 {}
            assert_eq!(rec.reads.first(), Some(&want), "the run's first read is the prefetched one");
            // Completions free the slots: CQ head follows.
            let head = if round == 0 { 14u32 } else { 1 };
            c.bar0_write(reg::cq_head(1), &head.to_le_bytes()).unwrap();
        }
    }
}

/// Once the prefetched entries are here, posted processing runs what needs nothing more from the
/// host (reads into host memory) and stops at a write whose data lies there; the full run goes
/// on from the entries already fetched, reading only that data.
#[test]
fn posted_processing_runs_prefetched_commands_and_the_worker_goes_on_without_fetching_again() {
    use lanbus_bridge::dma::HostRegion;
    use lanbus_nvme::command::{Sqe, SQE_LEN};
    let (iocq, iosq, data) = (IOCQ, HOST + 0x3000, HOST + 0x10000);
    let mem = HostRegion::new(HOST, 64);
    let mut c = controller(512, MIB, ControllerConfig::default());
    let mut irqs = with_io_queues(&mut c, &mem, 16, iosq);

    let payload = pattern(3, 4096);
    lanbus_nvme::HostMemory::write(&mut &mem, data, &payload).unwrap();
    let rw = |opcode, cid: u16, slba: u32, prp1| Sqe {
        opcode,
        cid,
        nsid: 1,
        prp1,
        cdw: [slba, 0, 7, 0, 0, 0],
        ..Sqe::default()
    };
    let cmds = [
        rw(nvm_opcode::READ, 1, 16, data + 0x1000),
        rw(nvm_opcode::READ, 2, 24, data + 0x2000),
        rw(nvm_opcode::WRITE, 3, 0, data),
        rw(nvm_opcode::READ, 4, 0, data + 0x3000),
    ];
    for (i, s) in cmds.iter().enumerate() {
        lanbus_nvme::HostMemory::write(&mut &mem, iosq + (i * SQE_LEN) as u64, &s.to_bytes()).unwrap();
    }
    c.bar0_write(reg::sq_tail(1), &(cmds.len() as u32).to_le_bytes()).unwrap();
    let entries = (iosq, cmds.len() * SQE_LEN);
    // The doorbell: nothing here yet, so the entries are named for prefetching.
    let mut rec = Recording::new(&mem, true, Vec::new());
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 0);
    assert_eq!(rec.prefetches, [entries]);
    // The prefetch ended: the two reads run; the write needs its data from the host.
    let mut rec = Recording::new(&mem, true, vec![entries]);
    irqs.0 = 0;
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 2);
    assert_eq!(rec.reads, [entries]);
    assert_eq!(rec.prefetches, [(data, 4096)], "the write's data is named for prefetching");
    assert_eq!(irqs.0, 1);
    assert!(c.has_work());
    // The full run starts from the fetched entries: its only read is the write's data.
    let mut rec = Recording::new(&mem, false, Vec::new());
    while c.process(&mut rec, &mut irqs) > 0 {}
    assert_eq!(rec.reads, [(data, 4096)]);
    assert_eq!(completions(&mem, iocq, 4), [(1, true), (2, true), (3, true), (4, true)]);
    let mut back = vec![0u8; 4096];
    lanbus_nvme::HostMemory::read(&mut &mem, data + 0x3000, &mut back).unwrap();
    assert!(back == payload, "the write's data read back");
    assert!(!c.has_work());

    // Again, and this time the write's data arrives too: everything runs where nothing waits.
    let payload = pattern(4, 4096);
    lanbus_nvme::HostMemory::write(&mut &mem, data + 0x4000, &payload).unwrap();
    let cmds = [rw(nvm_opcode::WRITE, 5, 40, data + 0x4000), rw(nvm_opcode::READ, 6, 40, data + 0x5000)];
    for (i, s) in cmds.iter().enumerate() {
        lanbus_nvme::HostMemory::write(&mut &mem, iosq + ((4 + i) * SQE_LEN) as u64, &s.to_bytes()).unwrap();
    }
    c.bar0_write(reg::cq_head(1), &4u32.to_le_bytes()).unwrap();
    c.bar0_write(reg::sq_tail(1), &6u32.to_le_bytes()).unwrap();
    let entries = (iosq + 4 * SQE_LEN as u64, 2 * SQE_LEN);
    let mut rec = Recording::new(&mem, true, vec![entries]);
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 0);
    assert_eq!(rec.prefetches, [(data + 0x4000, 4096)]);
    let mut rec = Recording::new(&mem, true, vec![(data + 0x4000, 4096)]);
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 2);
    assert_eq!(rec.reads, [(data + 0x4000, 4096)], "the entries were fetched already");
    assert!(!c.has_work());
    // The first write's data was read by the full run; this one's, read ahead, went to the
    // store from where it lay.
    assert_eq!(c.stats().writes_in_place, 1);
    lanbus_nvme::HostMemory::read(&mut &mem, data + 0x5000, &mut back).unwrap();
    assert!(back == payload, "the second write's data read back");

    // A 12 KiB write and a 12 KiB read, each with a PRP list in host memory: the lists are named
    // first (the read's too, behind the waiting write), then the write's three pages; each piece
    // is read once.
    let (wlist, rlist) = (HOST + 0x5000, HOST + 0x5800);
    let entries_of = |pages: [u64; 2]| -> Vec<u8> { pages.iter().flat_map(|a| a.to_le_bytes()).collect() };
    lanbus_nvme::HostMemory::write(&mut &mem, wlist, &entries_of([data + 0xc000, data + 0xe000])).unwrap();
    lanbus_nvme::HostMemory::write(&mut &mem, rlist, &entries_of([data + 0xa000, data + 0xb000])).unwrap();
    let payload = pattern(5, 12 << 10);
    for (i, page) in [0x6000u64, 0xc000, 0xe000].into_iter().enumerate() {
        lanbus_nvme::HostMemory::write(&mut &mem, data + page, &payload[i << 12..(i + 1) << 12]).unwrap();
    }
    let long = |opcode, cid: u16, prp1, prp2| Sqe {
        opcode,
        cid,
        nsid: 1,
        prp1,
        prp2,
        cdw: [64, 0, 23, 0, 0, 0],
        ..Sqe::default()
    };
    let cmds =
        [long(nvm_opcode::WRITE, 7, data + 0x6000, wlist), long(nvm_opcode::READ, 8, data + 0x9000, rlist)];
    for (i, s) in cmds.iter().enumerate() {
        lanbus_nvme::HostMemory::write(&mut &mem, iosq + ((6 + i) * SQE_LEN) as u64, &s.to_bytes()).unwrap();
    }
    c.bar0_write(reg::cq_head(1), &6u32.to_le_bytes()).unwrap();
    c.bar0_write(reg::sq_tail(1), &8u32.to_le_bytes()).unwrap();
    let entries = (iosq + 6 * SQE_LEN as u64, 2 * SQE_LEN);
    let pages = [(data + 0x6000, 4096), (data + 0xc000, 4096), (data + 0xe000, 4096)];
    let mut rec = Recording::new(&mem, true, vec![entries]);
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 0);
    assert_eq!(rec.prefetches, [(wlist, 16), (rlist, 16)]);
    let mut rec = Recording::new(&mem, true, vec![(wlist, 16), (rlist, 16)]);
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 0);
    assert_eq!(rec.prefetches, pages, "the read's list is here: it waits for nothing more");
    // Two of the three pages: still waiting, and nothing read is read again.
    let mut rec = Recording::new(&mem, true, pages[..2].to_vec());
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 0);
    assert_eq!(rec.prefetches, [pages[2]]);
    let mut rec = Recording::new(&mem, true, vec![pages[2]]);
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 2, "the write runs, and the read from its staged list");
    assert!(rec.prefetches.is_empty());
    assert!(!c.has_work());
    let mut back = vec![0u8; 12 << 10];
    lanbus_nvme::HostMemory::read(&mut &mem, data + 0x9000, &mut back[..4096]).unwrap();
    lanbus_nvme::HostMemory::read(&mut &mem, data + 0xa000, &mut back[4096..8192]).unwrap();
    lanbus_nvme::HostMemory::read(&mut &mem, data + 0xb000, &mut back[8192..]).unwrap();
    assert!(back == payload, "the 12 KiB read back through its list");
    assert_eq!(c.stats().writes_in_place, 1, "three pages apart are copied together");

    // A 12 KiB write whose list names one page twice (legal in NVMe): the page is fetched once
    // and its bytes go to both blocks.
    let twice = HOST + 0x6000;
    lanbus_nvme::HostMemory::write(&mut &mem, twice, &entries_of([data + 0xc000, data + 0xc000])).unwrap();
    let cmd = long(nvm_opcode::WRITE, 9, data + 0x6000, twice);
    lanbus_nvme::HostMemory::write(&mut &mem, iosq + (8 * SQE_LEN) as u64, &cmd.to_bytes()).unwrap();
    c.bar0_write(reg::cq_head(1), &8u32.to_le_bytes()).unwrap();
    c.bar0_write(reg::sq_tail(1), &9u32.to_le_bytes()).unwrap();
    let mut rec = Recording::new(&mem, true, vec![(iosq + 8 * SQE_LEN as u64, SQE_LEN)]);
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 0);
    assert_eq!(rec.prefetches, [(twice, 16)]);
    let mut rec = Recording::new(&mem, true, vec![(twice, 16)]);
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 0);
    assert_eq!(rec.prefetches, pages[..2], "the page named twice is fetched once");
    let mut rec = Recording::new(&mem, true, pages[..2].to_vec());
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 1);
    assert_eq!(rec.reads, pages[..2]);
    assert!(!c.has_work());
    let mut expected = payload[..4096].to_vec();
    expected.extend_from_slice(&payload[4096..8192]);
    expected.extend_from_slice(&payload[4096..8192]);
    let read = |c: &mut lanbus_nvme::Controller| {
        let mut rec = Recording::new(&mem, false, Vec::new());
        let cmd = long(nvm_opcode::READ, 10, data + 0x9000, rlist);
        lanbus_nvme::HostMemory::write(&mut &mem, iosq + (9 * SQE_LEN) as u64, &cmd.to_bytes()).unwrap();
        c.bar0_write(reg::cq_head(1), &9u32.to_le_bytes()).unwrap();
        c.bar0_write(reg::sq_tail(1), &10u32.to_le_bytes()).unwrap();
        while c.process(&mut rec, &mut Irqs(0)) > 0 {}
    };
    read(&mut c);
    let mut back = vec![0u8; 12 << 10];
    lanbus_nvme::HostMemory::read(&mut &mem, data + 0x9000, &mut back[..4096]).unwrap();
    lanbus_nvme::HostMemory::read(&mut &mem, data + 0xa000, &mut back[4096..8192]).unwrap();
    lanbus_nvme::HostMemory::read(&mut &mem, data + 0xb000, &mut back[8192..]).unwrap();
    assert!(back == expected, "both blocks of the page named twice hold its bytes");
}

/// With an SGL, a 12 KiB write fetches no list: the data block is named for prefetching as soon
/// as the command arrives, and the command runs where nothing waits when it comes. A Last
/// Segment in host memory is fetched first, as a PRP list is.
#[test]
fn posted_processing_runs_sgl_commands_without_a_list_round_trip() {
    use lanbus_bridge::dma::HostRegion;
    use lanbus_nvme::command::{Sqe, SQE_LEN};
    use lanbus_nvme::sgl;
    let (iocq, iosq, data) = (IOCQ, HOST + 0x3000, HOST + 0x10000);
    let mem = HostRegion::new(HOST, 64);
    let mut c = controller(512, MIB, ControllerConfig::default());
    let mut irqs = with_io_queues(&mut c, &mem, 16, iosq);
    let payload = pattern(6, 12 << 10);
    lanbus_nvme::HostMemory::write(&mut &mem, data, &payload).unwrap();
    let sgl_cmd = |opcode, cid: u16, (prp1, prp2): (u64, u64)| Sqe {
        opcode,
        cid,
        nsid: 1,
        psdt: 1,
        prp1,
        prp2,
        cdw: [64, 0, 23, 0, 0, 0],
        ..Sqe::default()
    };
    let cmd = sgl_cmd(nvm_opcode::WRITE, 1, sgl::data_block(data, 12 << 10));
    lanbus_nvme::HostMemory::write(&mut &mem, iosq, &cmd.to_bytes()).unwrap();
    c.bar0_write(reg::sq_tail(1), &1u32.to_le_bytes()).unwrap();
    let entry = (iosq, SQE_LEN);
    let mut rec = Recording::new(&mem, true, vec![entry]);
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 0);
    assert_eq!(rec.prefetches, [(data, 12 << 10)], "the data block at once, no list before it");
    let mut rec = Recording::new(&mem, true, vec![(data, 12 << 10)]);
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 1);
    assert!(!c.has_work());

    // A read whose SGL is a Last Segment of two blocks in host memory: the segment is named for
    // prefetching, then the command runs and writes the blocks.
    let seg = HOST + 0x5000;
    let mut list = Vec::new();
    for (addr, len) in [(data + 0x8000, 4096u32), (data + 0xa000, 8192)] {
        list.extend_from_slice(&addr.to_le_bytes());
        list.extend_from_slice(&len.to_le_bytes());
        list.extend_from_slice(&[0; 4]);
    }
    lanbus_nvme::HostMemory::write(&mut &mem, seg, &list).unwrap();
    let cmd = sgl_cmd(nvm_opcode::READ, 2, (seg, 32 | 0x30 << 56));
    lanbus_nvme::HostMemory::write(&mut &mem, iosq + SQE_LEN as u64, &cmd.to_bytes()).unwrap();
    c.bar0_write(reg::sq_tail(1), &2u32.to_le_bytes()).unwrap();
    let mut rec = Recording::new(&mem, true, vec![(iosq + SQE_LEN as u64, SQE_LEN)]);
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 0);
    assert_eq!(rec.prefetches, [(seg, 32)]);
    let mut rec = Recording::new(&mem, true, vec![(seg, 32)]);
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 1);
    let mut back = vec![0u8; 12 << 10];
    lanbus_nvme::HostMemory::read(&mut &mem, data + 0x8000, &mut back[..4096]).unwrap();
    lanbus_nvme::HostMemory::read(&mut &mem, data + 0xa000, &mut back[4096..]).unwrap();
    assert!(back == payload, "the write's bytes read back into the two blocks");
    assert_eq!(completions(&mem, iocq, 2), [(1, true), (2, true)]);
}

/// Two queues, each with a write waiting for its data: what posted processing fetched and
/// staged for one stays while the other runs, so a write whose data arrives first runs then,
/// without fetching its entry or its data again.
#[test]
fn posted_processing_keeps_each_queues_fetched_command_apart() {
    use lanbus_bridge::dma::HostRegion;
    use lanbus_nvme::command::{admin_opcode, Sqe, SQE_LEN};
    let (iosq1, iosq2, data) = (HOST + 0x3000, HOST + 0x4000, HOST + 0x10000);
    let mem = HostRegion::new(HOST, 64);
    let mut c = controller(512, MIB, ControllerConfig::default());
    let mut irqs = with_io_queues(&mut c, &mem, 16, iosq1);
    // A second submission queue on the same completion queue.
    let create_sq2 = Sqe {
        opcode: admin_opcode::CREATE_SQ,
        prp1: iosq2,
        cdw: [15 << 16 | 2, 1 | 1 << 16, 0, 0, 0, 0],
        ..Sqe::default()
    };
    lanbus_nvme::HostMemory::write(&mut &mem, HOST + 2 * SQE_LEN as u64, &create_sq2.to_bytes()).unwrap();
    c.bar0_write(reg::sq_tail(0), &3u32.to_le_bytes()).unwrap();
    while c.process(&mut &mem, &mut irqs) > 0 {}

    // Each write's two pages lie apart, so each is a range of its own.
    let (d1, d2) = ((data, 8192usize), (data + 0x8000, 8192usize));
    let pages = |(a, _): (u64, usize)| [(a, 4096), (a + 0x2000, 4096)];
    let (p1, p2) = (pattern(11, 8192), pattern(12, 8192));
    for (d, p) in [(d1, &p1), (d2, &p2)] {
        for (i, (at, _)) in pages(d).into_iter().enumerate() {
            lanbus_nvme::HostMemory::write(&mut &mem, at, &p[i << 12..(i + 1) << 12]).unwrap();
        }
    }
    let write = |cid: u16, slba: u32, (prp1, _): (u64, usize)| Sqe {
        opcode: nvm_opcode::WRITE,
        cid,
        nsid: 1,
        prp1,
        prp2: prp1 + 0x2000,
        cdw: [slba, 0, 15, 0, 0, 0],
        ..Sqe::default()
    };
    lanbus_nvme::HostMemory::write(&mut &mem, iosq1, &write(1, 0, d1).to_bytes()).unwrap();
    lanbus_nvme::HostMemory::write(&mut &mem, iosq2, &write(2, 16, d2).to_bytes()).unwrap();
    c.bar0_write(reg::sq_tail(1), &1u32.to_le_bytes()).unwrap();
    c.bar0_write(reg::sq_tail(2), &1u32.to_le_bytes()).unwrap();
    let (e1, e2) = ((iosq1, SQE_LEN), (iosq2, SQE_LEN));

    // Both entries arrive: each write names its two pages.
    let mut rec = Recording::new(&mem, true, vec![e1, e2]);
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 0);
    let mut named = rec.prefetches.clone();
    named.sort_unstable();
    let mut want = [pages(d1), pages(d2)].concat();
    want.sort_unstable();
    assert_eq!(named, want);
    // A page of each arrives: neither write runs yet, and both pages are kept.
    let mut rec = Recording::new(&mem, true, vec![pages(d1)[0], pages(d2)[0]]);
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 0);
    assert_eq!(rec.reads.len(), 2);
    // The first write's other page: it runs, without its entry or first page fetched again.
    let mut rec = Recording::new(&mem, true, vec![pages(d1)[1]]);
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 1, "the first queue's write runs");
    assert_eq!(rec.reads, [pages(d1)[1]], "nothing fetched again");
    let of_d2 = |named: &[(u64, usize)]| named.iter().all(|p| *p == pages(d2)[1]);
    assert!(of_d2(&rec.prefetches), "no entry named again: {:?}", rec.prefetches);
    // The second write's other page: it runs too, its first page still staged.
    let mut rec = Recording::new(&mem, true, vec![pages(d2)[1]]);
    assert_eq!(c.process_posted(&mut rec, &mut irqs), 1, "the second queue's write runs");
    assert_eq!(rec.reads, [pages(d2)[1]], "the page that came first was kept");
    assert!(!c.has_work());
    assert_eq!(completions(&mem, IOCQ, 2), [(1, true), (2, true)]);
    // Both reached the namespace.
    let mut back = vec![0u8; 8192];
    c.backing_mut().read_at(0, &mut back).unwrap();
    assert!(back == p1);
    c.backing_mut().read_at(16 * 512, &mut back).unwrap();
    assert!(back == p2);
}
