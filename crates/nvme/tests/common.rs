//! Shared helpers of the integration tests: a controller joined in-process with a driver.
#![allow(dead_code)]

use lanbus_nvme::command::Sqe;
use lanbus_nvme::local::{LocalNvme, ProcessMode};
use lanbus_nvme::{Controller, ControllerConfig, DriverConfig, NvmeDriver, RamBacking};

pub const MIB: u64 = 1 << 20;

pub fn controller(lba_size: u32, bytes: u64, cfg: ControllerConfig) -> Controller {
    Controller::new(ControllerConfig { lba_size, ..cfg }, Box::new(RamBacking::new(bytes))).unwrap()
}

pub fn local(lba_size: u32, bytes: u64, mode: ProcessMode) -> LocalNvme {
    LocalNvme::new(controller(lba_size, bytes, ControllerConfig::default()), 8192, mode)
}

pub fn pair(lba_size: u32, bytes: u64, mode: ProcessMode, dcfg: DriverConfig) -> (LocalNvme, NvmeDriver) {
    let l = local(lba_size, bytes, mode);
    let d = l.driver(dcfg).unwrap();
    (l, d)
}

pub fn sqe(opcode: u8, nsid: u32, cdw: [u32; 6]) -> Sqe {
    Sqe { opcode, nsid, cdw, ..Sqe::default() }
}

pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
