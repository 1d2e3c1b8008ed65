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
