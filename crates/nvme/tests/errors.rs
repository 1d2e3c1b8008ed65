//! Every bad command gets the status the NVMe specification names, never a crash or a silent
//! success; register access rules; DMA failures (Data Transfer Error, CSTS.CFS); driver timeouts.

mod common;
use common::*;

use lanbus_bridge::dma::BusError;
use lanbus_nvme::command::{admin_opcode as a, feature, nvm_opcode as n, Completion, Sqe};
use lanbus_nvme::controller::{reg, BAR0_SIZE, MSIX_TABLE_OFFSET};
use lanbus_nvme::local::ProcessMode;
use lanbus_nvme::{DriverConfig, DriverError, NvmeDriver, Status};
use std::time::Duration;

fn admin(d: &NvmeDriver, sqe: Sqe) -> Completion {
    d.submit_admin_raw(sqe).unwrap()
}

fn io(d: &NvmeDriver, sqe: Sqe) -> Completion {
    d.submit_io_raw(0, sqe).unwrap()
}

fn expect(c: Completion, want: Status, what: &str) {
    assert!(c.status.same_code(want), "{what}: got {}, want {}", c.status, want);
    assert_eq!(c.status.dnr, want.dnr, "{what}: DNR");
}

/// A page of DMA memory for data pointers.
fn page(d: &NvmeDriver) -> u64 {
    d.dma().alloc(1).unwrap()
}

#[test]
fn admin_command_errors() {
    let (_l, d) =
        pair(512, 4 * MIB, ProcessMode::Inline, DriverConfig { io_queues: 2, ..DriverConfig::default() });
    let buf = page(&d);
    let q = |op, c10: u32, c11: u32, prp1: u64| Sqe {
        opcode: op,
        prp1,
        cdw: [c10, c11, 0, 0, 0, 0],
        ..Sqe::default()
    };
    let size = |entries: u32, qid: u32| (entries - 1) << 16 | qid;

    expect(admin(&d, q(0x7F, 0, 0, 0)), Status::INVALID_OPCODE, "unknown admin opcode");
    expect(admin(&d, Sqe { fuse: 1, ..q(a::IDENTIFY, 1, 0, buf) }), Status::INVALID_FIELD, "fused");
    expect(admin(&d, Sqe { psdt: 1, ..q(a::IDENTIFY, 1, 0, buf) }), Status::INVALID_FIELD, "SGL");
    // Identify.
    expect(admin(&d, q(a::IDENTIFY, 0x55, 0, buf)), Status::INVALID_FIELD, "unknown CNS");
    expect(
        admin(&d, Sqe { nsid: 2, ..q(a::IDENTIFY, 0, 0, buf) }),
        Status::INVALID_NAMESPACE,
        "CNS 0 nsid 2",
    );
    expect(
        admin(&d, Sqe { nsid: 0, ..q(a::IDENTIFY, 0, 0, buf) }),
        Status::INVALID_NAMESPACE,
        "CNS 0 nsid 0",
    );
    expect(
        admin(&d, Sqe { nsid: 0xFFFF_FFFF, ..q(a::IDENTIFY, 2, 0, buf) }),
        Status::INVALID_NAMESPACE,
        "CNS 2",
    );
    expect(admin(&d, q(a::IDENTIFY, 1, 0, buf + 2)), Status::PRP_OFFSET_INVALID, "PRP1 not dword aligned");
    expect(admin(&d, q(a::IDENTIFY, 1, 0, 0xdead_0000)), Status::DATA_TRANSFER_ERROR, "PRP1 unmapped");
    expect(
        admin(&d, Sqe { prp2: 0x1234, ..q(a::IDENTIFY, 1, 0, buf + 8) }),
        Status::PRP_OFFSET_INVALID,
        "PRP2 offset",
    );
    let ok = admin(&d, Sqe { nsid: 1, ..q(a::IDENTIFY, 0, 0, buf) });
    assert!(ok.status.is_success());

    // Create I/O CQ: queue id range, existing, size, contiguity, vector, alignment.
    let cq = page(&d);
    expect(admin(&d, q(a::CREATE_CQ, size(16, 0), 1, cq)), Status::INVALID_QUEUE_ID, "CQ qid 0");
    expect(
        admin(&d, q(a::CREATE_CQ, size(16, 3), 1, cq)),
        Status::INVALID_QUEUE_ID,
        "CQ qid beyond allocated",
    );
    expect(admin(&d, q(a::CREATE_CQ, size(16, 1), 1, cq)), Status::INVALID_QUEUE_ID, "CQ qid in use");
    let free = |qid| {
        // Driver queues are 1..=2; delete pair 2 to have a free id.
        admin(&d, q(a::DELETE_SQ, qid, 0, 0));
        admin(&d, q(a::DELETE_CQ, qid, 0, 0))
    };
    assert!(free(2).status.is_success());
    expect(admin(&d, q(a::CREATE_CQ, 2, 1, cq)), Status::INVALID_QUEUE_SIZE, "CQ of 1 entry");
    expect(admin(&d, q(a::CREATE_CQ, size(1025, 2), 1, cq)), Status::INVALID_QUEUE_SIZE, "CQ above MQES");
    expect(admin(&d, q(a::CREATE_CQ, size(16, 2), 0, cq)), Status::INVALID_FIELD, "CQ not contiguous");
    expect(
        admin(&d, q(a::CREATE_CQ, size(16, 2), 1 | 17 << 16, cq)),
        Status::INVALID_VECTOR,
        "vector 17 of 17",
    );
    expect(admin(&d, q(a::CREATE_CQ, size(16, 2), 1, cq + 64)), Status::PRP_OFFSET_INVALID, "CQ base offset");
    assert!(admin(&d, q(a::CREATE_CQ, size(16, 2), 3 | 16 << 16, cq)).status.is_success());

    // Create I/O SQ.
    let sq = page(&d);
    expect(admin(&d, q(a::CREATE_SQ, size(16, 2), 1, sq)), Status::CQ_INVALID, "SQ on CQ 0");
    expect(admin(&d, q(a::CREATE_SQ, size(16, 2), 1 | 9 << 16, sq)), Status::CQ_INVALID, "SQ on missing CQ");
    expect(admin(&d, q(a::CREATE_SQ, size(16, 0), 1 | 2 << 16, sq)), Status::INVALID_QUEUE_ID, "SQ qid 0");
    expect(
        admin(&d, q(a::CREATE_SQ, size(16, 1), 1 | 2 << 16, sq)),
        Status::INVALID_QUEUE_ID,
        "SQ qid in use",
    );
    expect(
        admin(&d, q(a::CREATE_SQ, size(16, 7), 1 | 2 << 16, sq)),
        Status::INVALID_QUEUE_ID,
        "SQ qid too big",
    );
    expect(admin(&d, q(a::CREATE_SQ, size(2000, 2), 1 | 2 << 16, sq)), Status::INVALID_QUEUE_SIZE, "SQ size");
    expect(admin(&d, q(a::CREATE_SQ, size(16, 2), 2 << 16, sq)), Status::INVALID_FIELD, "SQ not contiguous");
    assert!(admin(&d, q(a::CREATE_SQ, size(16, 2), 1 | 2 << 16, sq)).status.is_success());

    // Delete.
    expect(admin(&d, q(a::DELETE_CQ, 2, 0, 0)), Status::INVALID_QUEUE_DELETION, "CQ with SQ attached");
    expect(admin(&d, q(a::DELETE_SQ, 0, 0, 0)), Status::INVALID_QUEUE_ID, "delete admin SQ");
    expect(admin(&d, q(a::DELETE_CQ, 0, 0, 0)), Status::INVALID_QUEUE_ID, "delete admin CQ");
    expect(admin(&d, q(a::DELETE_SQ, 9, 0, 0)), Status::INVALID_QUEUE_ID, "delete missing SQ");
    expect(admin(&d, q(a::DELETE_CQ, 60000, 0, 0)), Status::INVALID_QUEUE_ID, "delete CQ out of range");
    assert!(free(2).status.is_success());
    expect(admin(&d, q(a::DELETE_SQ, 2, 0, 0)), Status::INVALID_QUEUE_ID, "delete SQ twice");

    // Features.
    let nq = u32::from(feature::NUMBER_OF_QUEUES);
    expect(
        admin(&d, q(a::SET_FEATURES, nq, 3 | 3 << 16, 0)),
        Status::COMMAND_SEQUENCE_ERROR,
        "NoQ with queues",
    );
    expect(admin(&d, q(a::SET_FEATURES, 0x77, 0, 0)), Status::INVALID_FIELD, "unknown feature");
    expect(admin(&d, q(a::SET_FEATURES, 0x06 | 1 << 31, 1, 0)), Status::FEATURE_NOT_SAVEABLE, "save");
    expect(admin(&d, q(a::GET_FEATURES, 0x77, 0, 0)), Status::INVALID_FIELD, "get unknown feature");
    expect(admin(&d, q(a::GET_FEATURES, 0x06 | 4 << 8, 0, 0)), Status::INVALID_FIELD, "select 4");
    let got = admin(&d, q(a::GET_FEATURES, nq, 0, 0));
    assert_eq!((got.status, got.dw0), (Status::SUCCESS, 1 | 1 << 16));
    assert!(admin(&d, q(a::SET_FEATURES, 0x06, 0, 0)).status.is_success());
    assert_eq!(admin(&d, q(a::GET_FEATURES, 0x06, 0, 0)).dw0, 0);
    assert_eq!(admin(&d, q(a::GET_FEATURES, 0x06 | 1 << 8, 0, 0)).dw0, 1, "default");

    // Abort: reported as not aborted.
    let c = admin(&d, q(a::ABORT, 1 | 5 << 16, 0, 0));
    assert_eq!((c.status, c.dw0 & 1), (Status::SUCCESS, 1));
    expect(admin(&d, q(a::ABORT, 77, 0, 0)), Status::INVALID_QUEUE_ID, "abort on missing SQ");

    // Get Log Page.
    expect(admin(&d, q(a::GET_LOG_PAGE, 0x70 | 127 << 16, 0, buf)), Status::INVALID_LOG_PAGE, "log 0x70");
    let c = admin(&d, q(a::GET_LOG_PAGE, 0x02 | 127 << 16, 0, buf));
    assert!(c.status.is_success());
    let mut smart = [0u8; 4];
    d.dma().read(buf, &mut smart).unwrap();
    assert_eq!(u16::from_le_bytes([smart[1], smart[2]]), 300);

    // The driver still works afterwards on its remaining queue.
    let mut b = vec![0u8; 512];
    d.read(0, &mut b).unwrap();
}

#[test]
fn number_of_queues_before_creation() {
    let l = local(512, MIB, ProcessMode::Inline);
    let d = l.driver(DriverConfig { io_queues: 64, ..DriverConfig::default() }).unwrap();
    // The controller supports 16 pairs: the driver got 16.
    assert_eq!(d.io_queue_count(), 16);
    drop(d);
    let d = l.driver(DriverConfig { io_queues: 3, ..DriverConfig::default() }).unwrap();
    assert_eq!(d.io_queue_count(), 3);
    // 0xFFFF requested is invalid.
    for qid in 1..=3u32 {
        admin(&d, Sqe { opcode: a::DELETE_SQ, cdw: [qid, 0, 0, 0, 0, 0], ..Sqe::default() });
        admin(&d, Sqe { opcode: a::DELETE_CQ, cdw: [qid, 0, 0, 0, 0, 0], ..Sqe::default() });
    }
    let c = admin(&d, sqe(a::SET_FEATURES, 0, [u32::from(feature::NUMBER_OF_QUEUES), 0xFFFF, 0, 0, 0, 0]));
    expect(c, Status::INVALID_FIELD, "NSQR 0xFFFF");
    let c =
        admin(&d, sqe(a::SET_FEATURES, 0, [u32::from(feature::NUMBER_OF_QUEUES), 1 | 1 << 16, 0, 0, 0, 0]));
    assert_eq!((c.status, c.dw0), (Status::SUCCESS, 1 | 1 << 16));
    std::mem::forget(d); // its queues are gone: skip the orderly shutdown
}

#[test]
fn io_command_errors() {
    let (_l, d) = pair(512, 4 * MIB, ProcessMode::Inline, DriverConfig::default());
    let blocks = d.identity().blocks as u32;
    let buf = d.dma().alloc(2).unwrap();
    let rw = |op: u8, nsid: u32, slba: u64, nlb: u32, prp1: u64, prp2: u64| Sqe {
        opcode: op,
        nsid,
        prp1,
        prp2,
        cdw: [slba as u32, (slba >> 32) as u32, nlb - 1, 0, 0, 0],
        ..Sqe::default()
    };
    expect(io(&d, rw(0x7E, 1, 0, 1, buf, 0)), Status::INVALID_OPCODE, "unknown NVM opcode");
    expect(io(&d, rw(n::READ, 2, 0, 1, buf, 0)), Status::INVALID_NAMESPACE, "nsid 2");
    expect(io(&d, rw(n::READ, 0, 0, 1, buf, 0)), Status::INVALID_NAMESPACE, "nsid 0");
    expect(io(&d, rw(n::WRITE, 0xFFFF_FFFF, 0, 1, buf, 0)), Status::INVALID_NAMESPACE, "broadcast nsid");
    expect(io(&d, rw(n::READ, 1, u64::from(blocks), 1, buf, 0)), Status::LBA_OUT_OF_RANGE, "past the end");
    expect(
        io(&d, rw(n::READ, 1, u64::from(blocks) - 1, 2, buf, 0)),
        Status::LBA_OUT_OF_RANGE,
        "across the end",
    );
    expect(io(&d, rw(n::WRITE, 1, u64::MAX, 1, buf, 0)), Status::LBA_OUT_OF_RANGE, "slba overflow");
    // 1 MiB MDTS: 2049 blocks of 512 is beyond it.
    expect(io(&d, rw(n::READ, 1, 0, 2049, buf, buf + 4096)), Status::INVALID_FIELD, "beyond MDTS");
    expect(io(&d, rw(n::READ, 1, 0, 1, buf + 1, 0)), Status::PRP_OFFSET_INVALID, "PRP1 odd");
    expect(
        io(&d, rw(n::READ, 1, 0, 8, buf + 512, buf + 4096 + 512)),
        Status::PRP_OFFSET_INVALID,
        "PRP2 offset",
    );
    // Three pages from an offset: PRP2 is a list pointer (offsets allowed) whose entry 0 is 0.
    expect(
        io(&d, rw(n::READ, 1, 0, 16, buf + 512, buf + 4096 + 512)),
        Status::DATA_TRANSFER_ERROR,
        "zero entry",
    );
    expect(io(&d, rw(n::READ, 1, 0, 1, 0x10, 0)), Status::DATA_TRANSFER_ERROR, "PRP1 outside host memory");
    expect(
        io(&d, rw(n::WRITE, 1, 0, 24, buf, 0x7000_0000)),
        Status::DATA_TRANSFER_ERROR,
        "PRP list unmapped",
    );
    let mut prinfo = rw(n::READ, 1, 0, 1, buf, 0);
    prinfo.cdw[2] |= 1 << 26;
    expect(io(&d, prinfo), Status::INVALID_FIELD, "PRINFO without protection information");
    expect(io(&d, sqe(n::FLUSH, 3, [0; 6])), Status::INVALID_NAMESPACE, "flush nsid 3");
    assert!(io(&d, sqe(n::FLUSH, 0xFFFF_FFFF, [0; 6])).status.is_success());
    let wz = |slba: u32, nlb: u32| sqe(n::WRITE_ZEROES, 1, [slba, 0, nlb - 1, 0, 0, 0]);
    expect(io(&d, wz(blocks - 2, 3)), Status::LBA_OUT_OF_RANGE, "write zeroes past the end");
    // Dataset Management: a range past the end.
    let ranges = d.dma().alloc(1).unwrap();
    let mut r = [0u8; 32];
    r[4..8].copy_from_slice(&8u32.to_le_bytes());
    r[16 + 4..16 + 8].copy_from_slice(&8u32.to_le_bytes());
    r[16 + 8..16 + 16].copy_from_slice(&u64::from(blocks - 4).to_le_bytes());
    d.dma().write(ranges, &r).unwrap();
    let dsm = Sqe { prp1: ranges, ..sqe(n::DATASET_MANAGEMENT, 1, [1, 4, 0, 0, 0, 0]) };
    expect(io(&d, dsm), Status::LBA_OUT_OF_RANGE, "DSM range past the end");
    let dsm = Sqe { prp1: 0x30, ..sqe(n::DATASET_MANAGEMENT, 1, [0, 4, 0, 0, 0, 0]) };
    expect(io(&d, dsm), Status::DATA_TRANSFER_ERROR, "DSM ranges unmapped");
    // And the driver's errors carry the status.
    let e = d.read(u64::from(blocks), &mut [0u8; 512]).unwrap_err();
    assert!(matches!(e, DriverError::InvalidArgument(_)), "{e}");
    let sq = Sqe { nsid: 1, ..rw(n::READ, 1, u64::from(blocks), 1, buf, 0) };
    let c = io(&d, sq);
    let text = format!("{}", DriverError::Status { status: c.status, opcode: n::READ, qid: 1 });
    assert_eq!(text, "NVMe command 0x02 on queue 1 failed: LBA Out of Range (SCT 0x0, SC 0x80, DNR)");
}

#[test]
fn register_access_rules() {
    let l = local(512, MIB, ProcessMode::Inline);
    let bar = l.bar();
    let info = l.controller().pci_info();
    assert_eq!(
        (info.vendor_id, info.class_code, info.bar0_size, info.msix_vectors),
        (0x1b36, 0x010802, 0x4000, 17)
    );
    assert!(info.msix_table_offset + 16 * u64::from(info.msix_vectors) <= info.msix_pba_offset);
    let cap = bar.read64(reg::CAP).unwrap();
    assert_eq!(cap & 0xFFFF, 1023, "MQES");
    assert_eq!((cap >> 16) & 1, 1, "CQR");
    assert_eq!((cap >> 24) & 0xFF, 10, "TO");
    assert_eq!((cap >> 32) & 0xF, 0, "DSTRD");
    assert_eq!((cap >> 37) & 1, 1, "CSS NVM");
    assert_eq!((cap >> 48) & 0xF, 0, "MPSMIN");
    assert_eq!((cap >> 52) & 0xF, 4, "MPSMAX");
    assert_eq!(bar.read32(reg::CAP).unwrap(), cap as u32);
    assert_eq!(bar.read32(reg::CAP + 4).unwrap(), (cap >> 32) as u32);
    assert_eq!(bar.read32(reg::VS).unwrap(), 0x0001_0400);
    let mut ctrl = l.controller();
    let mut b2 = [0u8; 2];
    assert!(matches!(ctrl.bar0_read(reg::VS, &mut b2), Err(BusError::Rejected(_))));
    assert!(matches!(ctrl.bar0_read(reg::CC + 1, &mut [0u8; 4]), Err(BusError::Rejected(_))));
    assert!(matches!(ctrl.bar0_read(reg::CC, &mut [0u8; 8]), Err(BusError::Rejected(_))));
    assert!(matches!(ctrl.bar0_write(reg::CC, &[1u8]), Err(BusError::Rejected(_))));
    assert!(matches!(ctrl.bar0_write(MSIX_TABLE_OFFSET, &[0u8; 4]), Err(BusError::Unsupported { .. })));
    assert!(ctrl.bar0_read(BAR0_SIZE + 4, &mut [0u8; 4]).is_err());
    assert_eq!(ctrl.stats().rejected_accesses, 4);
    // Read-only registers ignore writes.
    ctrl.bar0_write(reg::VS, &[0xFF; 4]).unwrap();
    ctrl.bar0_write(reg::CSTS, &[0xFF; 4]).unwrap();
    let mut b = [0u8; 4];
    ctrl.bar0_read(reg::CSTS, &mut b).unwrap();
    assert_eq!(u32::from_le_bytes(b), 0);
    // Enabling with a bad memory page size (above MPSMAX) sets CFS, not RDY.
    ctrl.bar0_write(reg::AQA, &(15u32 | 15 << 16).to_le_bytes()).unwrap();
    ctrl.bar0_write(reg::ASQ, &0x1_0000_0000u64.to_le_bytes()).unwrap();
    ctrl.bar0_write(reg::ACQ, &0x1_0000_1000u64.to_le_bytes()).unwrap();
    ctrl.bar0_write(reg::CC, &(1u32 | 5 << 7).to_le_bytes()).unwrap();
    ctrl.bar0_read(reg::CSTS, &mut b).unwrap();
    assert_eq!(u32::from_le_bytes(b) & 3, 2);
    // Disabling resets; a good enable then gets RDY; doorbells beyond the queues are ignored.
    ctrl.bar0_write(reg::CC, &0u32.to_le_bytes()).unwrap();
    ctrl.bar0_read(reg::CSTS, &mut b).unwrap();
    assert_eq!(u32::from_le_bytes(b), 0);
    ctrl.bar0_write(reg::CC, &(1u32 | 6 << 16 | 4 << 20).to_le_bytes()).unwrap();
    ctrl.bar0_read(reg::CSTS, &mut b).unwrap();
    assert_eq!(u32::from_le_bytes(b) & 3, 1);
    let before = ctrl.stats().invalid_doorbells;
    ctrl.bar0_write(reg::sq_tail(5), &1u32.to_le_bytes()).unwrap();
    ctrl.bar0_write(reg::sq_tail(0), &16u32.to_le_bytes()).unwrap(); // value >= entries
    ctrl.bar0_write(reg::cq_head(0), &3u32.to_le_bytes()).unwrap(); // beyond what was posted
    assert_eq!(ctrl.stats().invalid_doorbells, before + 3);
    assert!(!ctrl.has_work());
}

#[test]
fn command_fetch_failure_sets_cfs() {
    let (l, d) =
        pair(512, MIB, ProcessMode::Inline, DriverConfig { io_queues: 1, ..DriverConfig::default() });
    // A queue pair whose SQ lies outside host memory: fetching from it fails.
    let cq = d.dma().alloc(1).unwrap();
    let c = admin(&d, sqe(a::CREATE_CQ, 0, [15 << 16 | 2, 1, 0, 0, 0, 0]));
    expect(c, Status::INVALID_QUEUE_ID, "NoQ gave the driver exactly one pair");
    // Use queue 1's ids instead: delete the driver's pair 1 and recreate it badly.
    admin(&d, sqe(a::DELETE_SQ, 0, [1, 0, 0, 0, 0, 0]));
    admin(&d, sqe(a::DELETE_CQ, 0, [1, 0, 0, 0, 0, 0]));
    assert!(admin(&d, Sqe { prp1: cq, ..sqe(a::CREATE_CQ, 0, [15 << 16 | 1, 1, 0, 0, 0, 0]) })
        .status
        .is_success());
    let c = admin(
        &d,
        Sqe { prp1: 0x7_0000_0000, ..sqe(a::CREATE_SQ, 0, [15 << 16 | 1, 1 | 1 << 16, 0, 0, 0, 0]) },
    );
    assert!(c.status.is_success());
    l.bar().write32(reg::sq_tail(1), 1).unwrap();
    assert_eq!(l.bar().read32(reg::CSTS).unwrap() & 3, 3, "RDY and CFS");
    assert_eq!(l.controller().stats().dma_errors, 1);
    // The driver reports the fatal status instead of hanging.
    let e = d.submit_admin_raw(sqe(a::IDENTIFY, 0, [1, 0, 0, 0, 0, 0])).unwrap_err();
    assert_eq!(e, DriverError::ControllerFatal);
    std::mem::forget(d);
    // A new driver resets the controller and works again.
    let d = l.driver(DriverConfig::default()).unwrap();
    d.write(0, &[5u8; 512], false).unwrap();
}

#[test]
fn driver_times_out_and_recovers() {
    for mode in [ProcessMode::Inline, ProcessMode::Thread] {
        let l = local(512, MIB, mode);
        let d = l
            .driver(DriverConfig {
                io_timeout: Duration::from_millis(50),
                io_queues: 1,
                ..DriverConfig::default()
            })
            .unwrap();
        d.write(0, &[7u8; 4096], false).unwrap();
        l.pause(true);
        let e = d.read(0, &mut [0u8; 4096]).unwrap_err();
        assert!(matches!(e, DriverError::Timeout(_)), "{e}");
        // The buffer the late completion may still write to is never reused.
        assert_eq!(d.stats().quarantined_pages.load(std::sync::atomic::Ordering::Relaxed), 1);
        l.pause(false);
        // The late completion is dropped as stray; the next request works.
        let mut b = [0u8; 4096];
        d.read(0, &mut b).unwrap();
        assert_eq!(b, [7u8; 4096]);
        assert_eq!(d.stats().stray_completions.load(std::sync::atomic::Ordering::Relaxed), 1);
    }
}
