//! The controller driven by hand (no driver): SQ fetch batching, a full CQ stalling its SQ,
//! MSI-X per CQ with the IEN flag. Property test: random submission queue entries sent to a live controller (admin and I/O
//! queues) never panic it, never make it fatal, and each gets exactly one completion carrying its
//! command identifier and the right SQ head. The harness drives the controller's registers and
//! queues by hand (no driver), so nothing filters what the controller sees. Another: a write
//! and a read of up to 256 KiB through PRP lists of pages in any order land every byte where
//! they point.

use lanbus_bridge::dma::{DmaMemory, HostRegion};
use lanbus_nvme::command::{admin_opcode as a, nvm_opcode as n, Completion, Sqe, CQE_LEN, SQE_LEN};
use lanbus_nvme::controller::reg;
use lanbus_nvme::{Controller, ControllerConfig, InterruptSink, RamBacking};
use proptest::prelude::*;

const BASE: u64 = 0x1000_0000;
const PAGE: u64 = 4096;
const ASQ: u64 = BASE;
const ACQ: u64 = BASE + PAGE;
const IOSQ: u64 = BASE + 2 * PAGE;
const IOCQ: u64 = BASE + 3 * PAGE;
const DATA: u64 = BASE + 4 * PAGE;
const PAGES: usize = 160;
/// The pages data pointers of the transfer property take theirs from (the queues use lower ones).
const SPARE_PAGES: std::ops::Range<u64> = 32..160;

struct Count(Vec<u16>);
impl InterruptSink for Count {
    fn signal_msix(&mut self, vector: u16) {
        self.0.push(vector);
    }
}

struct Queue {
    qid: u16,
    sq: u64,
    cq: u64,
    sq_entries: u32,
    cq_entries: u32,
    tail: u32,
    head: u32,
    phase: bool,
}

struct Harness {
    ctrl: Controller,
    mem: HostRegion,
    irq: Count,
    admin: Queue,
    io: Queue,
}

impl Harness {
    fn new() -> Harness {
        let ctrl = Controller::new(
            ControllerConfig { max_queue_entries: 256, ..ControllerConfig::default() },
            Box::new(RamBacking::new(1 << 20)),
        )
        .unwrap();
        let mut h = Harness {
            ctrl,
            mem: HostRegion::new(BASE, PAGES),
            irq: Count(Vec::new()),
            admin: Queue {
                qid: 0,
                sq: ASQ,
                cq: ACQ,
                sq_entries: 16,
                cq_entries: 16,
                tail: 0,
                head: 0,
                phase: true,
            },
            io: Queue {
                qid: 1,
                sq: IOSQ,
                cq: IOCQ,
                sq_entries: 64,
                cq_entries: 256,
                tail: 0,
                head: 0,
                phase: true,
            },
        };
        h.ctrl.bar0_write(reg::AQA, &(15u32 | 15 << 16).to_le_bytes()).unwrap();
        h.ctrl.bar0_write(reg::ASQ, &ASQ.to_le_bytes()).unwrap();
        h.ctrl.bar0_write(reg::ACQ, &ACQ.to_le_bytes()).unwrap();
        h.ctrl.bar0_write(reg::CC, &(1u32 | 6 << 16 | 4 << 20).to_le_bytes()).unwrap();
        let cq = Sqe {
            opcode: a::CREATE_CQ,
            prp1: IOCQ,
            cdw: [255 << 16 | 1, 3 | 1 << 16, 0, 0, 0, 0],
            ..Sqe::default()
        };
        assert!(h.submit(true, cq).status.is_success());
        let sq = Sqe {
            opcode: a::CREATE_SQ,
            prp1: IOSQ,
            cdw: [63 << 16 | 1, 1 | 1 << 16, 0, 0, 0, 0],
            ..Sqe::default()
        };
        assert!(h.submit(true, sq).status.is_success());
        h
    }

    fn submit(&mut self, admin: bool, sqe: Sqe) -> Completion {
        let q = if admin { &mut self.admin } else { &mut self.io };
        DmaMemory::write(&self.mem, q.sq + u64::from(q.tail) * SQE_LEN as u64, &sqe.to_bytes()).unwrap();
        q.tail = (q.tail + 1) % q.sq_entries;
        self.ctrl.bar0_write(reg::sq_tail(q.qid), &q.tail.to_le_bytes()).unwrap();
        let mut mem = &self.mem;
        while self.ctrl.process(&mut mem, &mut self.irq) > 0 {}
        let read = |head: u32| {
            let mut b = [0u8; CQE_LEN];
            DmaMemory::read(&self.mem, q.cq + u64::from(head) * CQE_LEN as u64, &mut b).unwrap();
            Completion::parse(&b)
        };
        let c = read(q.head);
        assert_eq!(c.phase, q.phase, "no completion for {sqe:?}");
        q.head += 1;
        if q.head == q.cq_entries {
            q.head = 0;
            q.phase = !q.phase;
        }
        assert_ne!(read(q.head).phase, q.phase, "a second completion for {sqe:?}");
        self.ctrl.bar0_write(reg::cq_head(q.qid), &q.head.to_le_bytes()).unwrap();
        assert_eq!(c.cid, sqe.cid);
        assert_eq!(c.sq_id, q.qid);
        assert_eq!(u32::from(c.sq_head), q.tail);
        c
    }
}

fn read_cmd(cid: u16, slba: u32, prp1: u64) -> Sqe {
    Sqe { opcode: n::READ, cid, nsid: 1, prp1, cdw: [slba, 0, 0, 0, 0, 0], ..Sqe::default() }
}

impl Harness {
    fn create_pair(&mut self, qid: u16, sq_entries: u32, cq_entries: u32, irq: Option<u16>) -> Queue {
        let (sq, cq) = (BASE + u64::from(qid) * 8 * PAGE, BASE + u64::from(qid) * 8 * PAGE + 4 * PAGE);
        let flags = 1 | irq.map_or(0, |v| 2 | u32::from(v) << 16);
        let c = Sqe {
            opcode: a::CREATE_CQ,
            prp1: cq,
            cdw: [(cq_entries - 1) << 16 | u32::from(qid), flags, 0, 0, 0, 0],
            ..Sqe::default()
        };
        assert!(self.submit(true, c).status.is_success());
        let c = Sqe {
            opcode: a::CREATE_SQ,
            prp1: sq,
            cdw: [(sq_entries - 1) << 16 | u32::from(qid), 1 | u32::from(qid) << 16, 0, 0, 0, 0],
            ..Sqe::default()
        };
        assert!(self.submit(true, c).status.is_success());
        Queue { qid, sq, cq, sq_entries, cq_entries, tail: 0, head: 0, phase: true }
    }

    /// Writes `sqes` into `q` and rings its doorbell once.
    fn post(&mut self, q: &mut Queue, sqes: &[Sqe]) {
        for s in sqes {
            DmaMemory::write(&self.mem, q.sq + u64::from(q.tail) * SQE_LEN as u64, &s.to_bytes()).unwrap();
            q.tail = (q.tail + 1) % q.sq_entries;
        }
        self.ctrl.bar0_write(reg::sq_tail(q.qid), &q.tail.to_le_bytes()).unwrap();
    }

    fn run(&mut self) -> usize {
        let mut mem = &self.mem;
        let mut total = 0;
        loop {
            let n = self.ctrl.process(&mut mem, &mut self.irq);
            if n == 0 {
                return total;
            }
            total += n;
        }
    }

    /// Reaps every posted completion of `q` (without ringing its head doorbell).
    fn reap(&self, q: &mut Queue) -> Vec<Completion> {
        let mut out = Vec::new();
        loop {
            let mut b = [0u8; CQE_LEN];
            DmaMemory::read(&self.mem, q.cq + u64::from(q.head) * CQE_LEN as u64, &mut b).unwrap();
            let c = Completion::parse(&b);
            if c.phase != q.phase {
                return out;
            }
            out.push(c);
            q.head += 1;
            if q.head == q.cq_entries {
                q.head = 0;
                q.phase = !q.phase;
            }
        }
    }
}

#[test]
fn one_fetch_for_a_batch_and_one_interrupt() {
    let mut h = Harness::new();
    let mut q = h.create_pair(2, 32, 64, Some(5));
    let fetches = h.ctrl.stats().sq_fetches;
    h.irq.0.clear();
    let cmds: Vec<Sqe> = (0..10).map(|i| read_cmd(i, u32::from(i), DATA)).collect();
    h.post(&mut q, &cmds);
    assert_eq!(h.run(), 10);
    assert_eq!(h.ctrl.stats().sq_fetches, fetches + 1, "ten entries in one DMA read");
    assert_eq!(h.irq.0, vec![5], "one MSI-X message on the CQ's vector");
    let done = h.reap(&mut q);
    assert_eq!(done.iter().map(|c| c.cid).collect::<Vec<_>>(), (0..10).collect::<Vec<_>>());
    assert_eq!(done.iter().map(|c| c.sq_head).collect::<Vec<_>>(), (1..=10).collect::<Vec<_>>());
    assert!(done.iter().all(|c| c.status.is_success() && c.sq_id == 2));
    // Across the end of the SQ: two fetches (the entries are not contiguous in memory).
    h.ctrl.bar0_write(reg::cq_head(2), &q.head.to_le_bytes()).unwrap();
    let cmds: Vec<Sqe> = (10..40).map(|i| read_cmd(i, 0, DATA)).collect();
    h.post(&mut q, &cmds);
    assert_eq!(h.run(), 30);
    assert_eq!(h.ctrl.stats().sq_fetches, fetches + 3);
    assert_eq!(h.reap(&mut q).len(), 30);
}

#[test]
fn full_cq_stalls_until_the_host_frees_entries() {
    let mut h = Harness::new();
    let mut q = h.create_pair(2, 16, 4, None);
    let cmds: Vec<Sqe> = (0..10).map(|i| read_cmd(i, 0, DATA)).collect();
    h.post(&mut q, &cmds);
    assert_eq!(h.run(), 3, "a CQ of 4 entries holds 3");
    assert!(!h.ctrl.has_work());
    let mut seen = h.reap(&mut q);
    assert_eq!(seen.len(), 3);
    while seen.len() < 10 {
        h.ctrl.bar0_write(reg::cq_head(2), &q.head.to_le_bytes()).unwrap();
        assert!(h.ctrl.has_work());
        h.run();
        seen.extend(h.reap(&mut q));
    }
    assert_eq!(seen.iter().map(|c| c.cid).collect::<Vec<_>>(), (0..10).collect::<Vec<_>>());
    // IEN clear: no interrupts for this CQ (only the admin CQ's vector 0 fired).
    assert!(h.irq.0.iter().all(|&v| v == 0));
}

#[test]
fn deleting_an_sq_completes_what_was_submitted_first() {
    let mut h = Harness::new();
    let mut q = h.create_pair(2, 16, 16, None);
    let cmds: Vec<Sqe> = (0..5).map(|i| read_cmd(i, 0, DATA)).collect();
    h.post(&mut q, &cmds);
    // Admin runs first in `process`: the deletion must drain the SQ before completing.
    let del = Sqe { opcode: a::DELETE_SQ, cdw: [2, 0, 0, 0, 0, 0], ..Sqe::default() };
    assert!(h.submit(true, del).status.is_success());
    assert_eq!(h.reap(&mut q).len(), 5);
    let del = Sqe { opcode: a::DELETE_CQ, cdw: [2, 0, 0, 0, 0, 0], ..Sqe::default() };
    assert!(h.submit(true, del).status.is_success());
    assert_eq!(h.ctrl.stats().dropped_on_deletion, 0);
}

const ADMIN_OPS: [u8; 8] = [
    a::CREATE_CQ,
    a::CREATE_SQ,
    a::IDENTIFY,
    a::ABORT,
    a::SET_FEATURES,
    a::GET_FEATURES,
    a::GET_LOG_PAGE,
    0x7F,
];
const IO_OPS: [u8; 6] = [n::READ, n::WRITE, n::FLUSH, n::WRITE_ZEROES, n::DATASET_MANAGEMENT, 0x55];

fn command() -> impl Strategy<Value = (bool, Vec<u8>, u8, u8, u16, u16)> {
    (
        any::<bool>(),
        proptest::collection::vec(any::<u8>(), SQE_LEN),
        any::<u8>(),
        0u8..8,
        0u16..(60 * 1024 / 4),
        0u16..3000,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn random_sqes_each_get_one_completion(cmds in proptest::collection::vec(command(), 1..48)) {
        let mut h = Harness::new();
        for (i, (admin, bytes, op, shape, data_dw, nlb)) in cmds.into_iter().enumerate() {
            let mut raw = [0u8; SQE_LEN];
            raw.copy_from_slice(&bytes);
            let mut sqe = Sqe::parse(&raw);
            sqe.cid = i as u16;
            // Mostly meaningful opcodes, namespaces, small transfers and data pointers into
            // the data pages; sometimes all random.
            if shape < 6 {
                sqe.opcode = if admin { ADMIN_OPS[usize::from(op) % 8] } else { IO_OPS[usize::from(op) % 6] };
                if shape < 4 { sqe.fuse = 0; sqe.psdt = 0; sqe.nsid = 1; }
                if shape < 3 {
                    sqe.prp1 = DATA + u64::from(data_dw) * 4;
                    sqe.prp2 = DATA + ((u64::from(data_dw) * 4) & !(PAGE - 1));
                    sqe.cdw[2] = (sqe.cdw[2] & !0xFFFF & !(0xF << 26)) | u32::from(nlb % 40);
                    sqe.cdw[0] %= 4096;
                    sqe.cdw[1] = 0;
                }
            }
            if admin && matches!(sqe.opcode, a::DELETE_SQ | a::DELETE_CQ | a::ASYNC_EVENT_REQUEST) {
                // Deleting the harness's own queue or holding an AER outstanding are legitimate
                // outcomes without a (single, immediate) completion: not part of this property.
                sqe.opcode = 0x7F;
            }
            h.submit(admin, sqe);
            let mut csts = [0u8; 4];
            h.ctrl.bar0_read(reg::CSTS, &mut csts).unwrap();
            prop_assert_eq!(u32::from_le_bytes(csts) & 3, 1, "controller not ready or fatal");
        }
    }
}

/// CC.MPS = 2 (16 KiB memory pages): queue bases and PRP entries follow the larger page.
#[test]
fn sixteen_kib_memory_pages() {
    let page: u64 = 16384;
    let mut ctrl = Controller::new(ControllerConfig::default(), Box::new(RamBacking::new(1 << 20))).unwrap();
    let mem = HostRegion::new(BASE, 64);
    let (asq, acq, data) = (BASE, BASE + page, BASE + 4 * page);
    ctrl.bar0_write(reg::AQA, &(3u32 | 3 << 16).to_le_bytes()).unwrap();
    ctrl.bar0_write(reg::ASQ, &asq.to_le_bytes()).unwrap();
    ctrl.bar0_write(reg::ACQ, &acq.to_le_bytes()).unwrap();
    ctrl.bar0_write(reg::CC, &(1u32 | 2 << 7 | 6 << 16 | 4 << 20).to_le_bytes()).unwrap();
    let mut irq = Count(Vec::new());
    let mut run = |ctrl: &mut Controller, slot: u32, sqe: Sqe| {
        DmaMemory::write(&mem, asq + u64::from(slot) * 64, &sqe.to_bytes()).unwrap();
        ctrl.bar0_write(reg::sq_tail(0), &(slot + 1).to_le_bytes()).unwrap();
        let mut m = &mem;
        while ctrl.process(&mut m, &mut irq) > 0 {}
        let mut b = [0u8; CQE_LEN];
        DmaMemory::read(&mem, acq + u64::from(slot) * 16, &mut b).unwrap();
        Completion::parse(&b).status
    };
    // Identify into a buffer 12 KiB into a 16 KiB page: 4 KiB fit, no PRP2 needed.
    let id = Sqe { opcode: a::IDENTIFY, prp1: data + 12288, cdw: [1, 0, 0, 0, 0, 0], ..Sqe::default() };
    assert!(run(&mut ctrl, 0, id).is_success());
    let mut vid = [0u8; 2];
    DmaMemory::read(&mem, data + 12288, &mut vid).unwrap();
    assert_eq!(u16::from_le_bytes(vid), 0x1b36);
    // 14 KiB into the page: the rest goes to PRP2, which must be 16 KiB aligned.
    let id = Sqe {
        opcode: a::IDENTIFY,
        prp1: data + 14336,
        prp2: data + 4096 * 5,
        cdw: [1, 0, 0, 0, 0, 0],
        ..Sqe::default()
    };
    assert!(run(&mut ctrl, 1, id).same_code(lanbus_nvme::Status::PRP_OFFSET_INVALID));
    // A CQ base aligned to 4 KiB but not to the 16 KiB page.
    let cq =
        Sqe { opcode: a::CREATE_CQ, prp1: data + 4096, cdw: [3 << 16 | 1, 1, 0, 0, 0, 0], ..Sqe::default() };
    assert!(run(&mut ctrl, 2, cq).same_code(lanbus_nvme::Status::PRP_OFFSET_INVALID));
}

/// The data pointer of a transfer of `len` bytes starting `offset` bytes into the first of
/// `pages` (spare page numbers, in the order the transfer takes them; one more than it needs for
/// the PRP list), with the list written to host memory.
fn prp(h: &Harness, pages: &[u64], offset: u64, len: u64) -> (u64, u64) {
    let at = |p: u64| BASE + p * PAGE;
    let spanned = (offset + len).div_ceil(PAGE) as usize;
    let prp1 = at(pages[0]) + offset;
    let prp2 = match spanned {
        1 => 0,
        2 => at(pages[1]),
        _ => {
            let list = at(pages[spanned]);
            let entries: Vec<u8> = pages[1..spanned].iter().flat_map(|&p| at(p).to_le_bytes()).collect();
            DmaMemory::write(&h.mem, list, &entries).unwrap();
            list
        }
    };
    (prp1, prp2)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn transfers_land_where_their_prps_point(
        blocks in 1u64..=512,
        slba in 0u64..1024,
        offsets in (0u64..1024, 0u64..1024),
        orders in (Just(SPARE_PAGES.collect::<Vec<u64>>()).prop_shuffle(),
                   Just(SPARE_PAGES.collect::<Vec<u64>>()).prop_shuffle()),
        seed in any::<u64>(),
    ) {
        let mut h = Harness::new();
        let len = blocks * 512;
        let data: Vec<u8> = (0..len).map(|i| (seed.wrapping_mul(i + 1) >> 24) as u8).collect();
        // The write's data in its pages, in the order its PRPs take them.
        let (wo, ro) = (offsets.0 * 4, offsets.1 * 4);
        let mut at = 0u64;
        for (k, &p) in orders.0.iter().enumerate() {
            let start = if k == 0 { wo } else { 0 };
            let n = (PAGE - start).min(len - at);
            DmaMemory::write(&h.mem, BASE + p * PAGE + start, &data[at as usize..(at + n) as usize]).unwrap();
            at += n;
            if at == len {
                break;
            }
        }
        let (prp1, prp2) = prp(&h, &orders.0, wo, len);
        let cdw = [slba as u32, 0, (blocks - 1) as u32, 0, 0, 0];
        let write = Sqe { opcode: n::WRITE, cid: 1, nsid: 1, prp1, prp2, cdw, ..Sqe::default() };
        prop_assert!(h.submit(false, write).status.is_success());
        // Other bytes through the controller in between (blocks 1536.., past the first write).
        for &p in &orders.1 {
            DmaMemory::write(&h.mem, BASE + p * PAGE, &[0xA5; PAGE as usize]).unwrap();
        }
        let (prp1, prp2) = prp(&h, &orders.1, 0, 512 * 512);
        let cdw_decoy = [1536, 0, 511, 0, 0, 0];
        let decoy = Sqe { opcode: n::WRITE, cid: 3, nsid: 1, prp1, prp2, cdw: cdw_decoy, ..Sqe::default() };
        prop_assert!(h.submit(false, decoy).status.is_success());
        for &p in &orders.1 {
            DmaMemory::write(&h.mem, BASE + p * PAGE, &[0u8; PAGE as usize]).unwrap();
        }
        let (prp1, prp2) = prp(&h, &orders.1, ro, len);
        let read = Sqe { opcode: n::READ, cid: 2, nsid: 1, prp1, prp2, cdw, ..Sqe::default() };
        prop_assert!(h.submit(false, read).status.is_success());
        let mut at = 0u64;
        for (k, &p) in orders.1.iter().enumerate() {
            let start = if k == 0 { ro } else { 0 };
            let n = (PAGE - start).min(len - at);
            let mut got = vec![0u8; n as usize];
            DmaMemory::read(&h.mem, BASE + p * PAGE + start, &mut got).unwrap();
            prop_assert_eq!(&got[..], &data[at as usize..(at + n) as usize], "page {} of the read", k);
            at += n;
            if at == len {
                break;
            }
        }
    }
}
