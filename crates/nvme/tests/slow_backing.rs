//! A backing store whose flush takes longer than the host's heartbeat patience: the Flush runs
//! on the device bridge's worker, never on the thread that sends heartbeats and ACKs, so the host
//! keeps the device, whether the drive's queues live in host memory or in its memory buffer
//! (where plain reads and writes run on the receive thread).

use std::io;
use std::sync::Arc;
use std::time::Duration;

use lanbus_nvme::pcie::{attach, NvmeFunction};
use lanbus_nvme::{Backing, Controller, ControllerConfig, DriverConfig, HostRegion, RamBacking};
use lanbus_pcie::bridge::{DeviceBridge, DeviceBridgeConfig, HostBridge, HostBridgeConfig};
use lanbus_port::{SimWire, SimWireConfig};
use lanbus_runtime::RuntimeConfig;
use lanbus_wire::{Clock, MacAddr, MonotonicClock};

/// Twice the time the host waits for heartbeats by default (3 missed 100 ms intervals).
const FLUSH_TAKES: Duration = Duration::from_millis(600);

struct SlowFlush(RamBacking);

impl Backing for SlowFlush {
    fn len(&self) -> u64 {
        self.0.len()
    }
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.0.read_at(offset, buf)
    }
    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.0.write_at(offset, data)
    }
    fn flush(&mut self) -> io::Result<()> {
        std::thread::sleep(FLUSH_TAKES);
        Ok(())
    }
}

fn runtime(name: &str) -> RuntimeConfig {
    let mut c = RuntimeConfig { name: name.into(), ..RuntimeConfig::default() };
    c.transport.rate.enabled = false;
    c
}

fn flush_keeps_the_device(cmb_bytes: u64, seed: u8) {
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let macs = [MacAddr([2, 0, 0, 0, seed, 1]), MacAddr([2, 0, 0, 0, seed, 2])];
    let (a, b) = SimWire::pair_realtime(SimWireConfig::default(), clock, macs).unwrap();
    let hc = HostBridgeConfig {
        group: 3,
        name: "host".into(),
        runtime: runtime("h"),
        completion_timeout: Duration::from_secs(5),
        mps: 4096,
        mrrs: 4096,
        ..HostBridgeConfig::default()
    };
    let host = Arc::new(HostBridge::start(Box::new(a), hc).unwrap());
    let cfg = ControllerConfig { lba_size: 512, cmb_bytes, ..ControllerConfig::default() };
    let ctrl = Controller::new(cfg, Box::new(SlowFlush(RamBacking::new(16 << 20)))).unwrap();
    let (f, _stats) = NvmeFunction::hosted(ctrl).unwrap();
    let dc = DeviceBridgeConfig {
        group: 3,
        name: "iobox".into(),
        runtime: runtime("d"),
        completion_timeout: Duration::from_secs(5),
        ..DeviceBridgeConfig::default()
    };
    let dev = DeviceBridge::start(Box::new(b), dc, vec![f]).unwrap();
    let devs = host.wait_devices(1, Duration::from_secs(10));
    assert_eq!(devs.len(), 1);
    let region = Arc::new(HostRegion::new(0x4_0000_0000, 2048));
    let dcfg = DriverConfig { io_queues: 1, io_timeout: Duration::from_secs(5), ..DriverConfig::default() };
    let drv = attach(&host, &devs[0], region, dcfg).unwrap();
    assert_eq!(drv.cmb_in_use().is_some(), cmb_bytes > 0);
    drv.write_at(0, &[7u8; 4096], false).unwrap();
    drv.flush().unwrap();
    drv.write_at(4096, &[9u8; 4096], true).unwrap(); // FUA: a flush too
    let mut back = vec![0u8; 8192];
    drv.read_at(0, &mut back).unwrap();
    assert!(back[..4096].iter().all(|&b| b == 7) && back[4096..].iter().all(|&b| b == 9));
    assert_eq!(host.stats().device_gone, 0, "cmb {cmb_bytes}: {:?}", host.stats());
    if cmb_bytes > 0 {
        assert!(dev.stats().served_inline > 0);
    }
}

#[test]
fn a_slow_flush_runs_on_the_worker_and_the_host_keeps_the_device() {
    flush_keeps_the_device(0, 0x71);
    flush_keeps_the_device(4 << 20, 0x72);
}
