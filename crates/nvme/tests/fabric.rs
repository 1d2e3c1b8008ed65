//! The NVMe controller on a device bridge, the driver on a host bridge, joined by the simulated
//! wire with loss: every command fetch, PRP list, data transfer, completion and interrupt is a
//! TLP in a lanbus frame. Seeds fixed; every wait bounded.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lanbus_bridge::dma::HostRegion;
use lanbus_bridge::{DeviceBridge, DeviceBridgeConfig, HostBridge, HostBridgeConfig};
use lanbus_nvme::pcie::{attach, NvmeFunction};
use lanbus_nvme::{Backing, Controller, ControllerConfig, DriverConfig, RamBacking};
use lanbus_port::{SimWire, SimWireConfig};
use lanbus_runtime::RuntimeConfig;
use lanbus_wire::{Clock, MacAddr, MonotonicClock};
use rand::{Rng, SeedableRng};

fn runtime(name: &str) -> RuntimeConfig {
    let mut c = RuntimeConfig { name: name.into(), ..RuntimeConfig::default() };
    // An uncongested wire: delay-based rate control would take a loaded machine's scheduling
    // delays for queueing.
    c.transport.rate.enabled = false;
    c
}

/// A host bridge and a device bridge with an NVMe drive on `backing` over a simulated wire;
/// `cmb_bytes` of Controller Memory Buffer and max payload size `mps` (the daemons' drive: 16 MiB
/// and 4096).
fn fabric(
    loss: f64,
    seed: u64,
    lba: u32,
    backing: Box<dyn Backing>,
    cmb_bytes: u64,
    mps: usize,
) -> (Arc<HostBridge>, DeviceBridge) {
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let wire = SimWireConfig { loss, seed, ..SimWireConfig::default() };
    let macs = [MacAddr([2, 0, 0, 0, 0x60, 1]), MacAddr([2, 0, 0, 0, 0x60, 2])];
    let (a, b) = SimWire::pair_realtime(wire, clock, macs).unwrap();
    let hc = HostBridgeConfig {
        group: 3,
        name: "host".into(),
        runtime: runtime("h"),
        completion_timeout: Duration::from_secs(2),
        mps,
        mrrs: mps,
        ..HostBridgeConfig::default()
    };
    let host = Arc::new(HostBridge::start(Box::new(a), hc).unwrap());
    let ctrl = Controller::new(
        ControllerConfig { lba_size: lba, cmb_bytes, ..ControllerConfig::default() },
        backing,
    )
    .unwrap();
    let (f, _stats) = NvmeFunction::hosted(ctrl).unwrap();
    let dc = DeviceBridgeConfig {
        group: 3,
        name: "iobox".into(),
        runtime: runtime("d"),
        completion_timeout: Duration::from_secs(2),
        ..DeviceBridgeConfig::default()
    };
    let dev = DeviceBridge::start(Box::new(b), dc, vec![f]).unwrap();
    (host, dev)
}

fn driver_config() -> DriverConfig {
    DriverConfig { io_queues: 2, io_timeout: Duration::from_secs(5), ..DriverConfig::default() }
}

#[test]
fn random_io_over_a_lossy_wire_reads_back() {
    let (host, dev) = fabric(0.01, 7, 512, Box::new(RamBacking::new(16 << 20)), 0, 256);
    random_io_reads_back(host, dev, false);
}

/// As the daemons run it: queues, PRP lists and write data in the buffer, 4 KiB TLPs, and the
/// controller run on the device bridge's receive thread for every command that reads nothing
/// from the host.
#[test]
fn random_io_through_the_buffer_with_4k_payloads_over_a_lossy_wire_reads_back() {
    let (host, dev) = fabric(0.01, 8, 512, Box::new(RamBacking::new(16 << 20)), 4 << 20, 4096);
    random_io_reads_back(host, dev, true);
}

fn random_io_reads_back(host: Arc<HostBridge>, dev: DeviceBridge, cmb: bool) {
    let devs = host.wait_devices(1, Duration::from_secs(10));
    assert_eq!(devs.len(), 1);
    let f = &devs[0];
    assert_eq!((f.vendor_id, f.device_id, f.class_code), (0x1b36, 0x0010, 0x010802));
    assert_eq!(f.bar(0).map(|b| b.size), Some(0x4000));
    let region = Arc::new(HostRegion::new(0x4_0000_0000, 2048));
    let drv = Arc::new(attach(&host, f, region, driver_config()).unwrap());
    assert_eq!(drv.size_bytes(), 16 << 20);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let mut shadow = vec![0u8; 16 << 20];
    for &size in &[512usize, 4096, 12 * 1024, 128 * 1024, 1 << 20] {
        for _ in 0..4 {
            let off = rng.random_range(0..(shadow.len() - size) / 512) * 512;
            let data: Vec<u8> = (0..size).map(|_| rng.random()).collect();
            drv.write_at(off as u64, &data, false).unwrap();
            shadow[off..off + size].copy_from_slice(&data);
            let mut back = vec![0u8; size];
            drv.read_at(off as u64, &mut back).unwrap();
            assert!(back == data, "read back {size} bytes at {off}");
        }
    }
    drv.flush().unwrap();
    // Two threads at once on their own queue pairs.
    let handles: Vec<_> = (0..2u64)
        .map(|t| {
            let drv = drv.clone();
            std::thread::spawn(move || {
                let data = vec![t as u8 + 1; 64 * 1024];
                for i in 0..8u64 {
                    let off = (t * 8 + i) * 64 * 1024;
                    drv.write_at(off, &data, false).unwrap();
                    let mut back = vec![0u8; data.len()];
                    drv.read_at(off, &mut back).unwrap();
                    assert!(back == data);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let rt = host.runtime_stats();
    assert!(rt.transport.retransmitted_frames > 0, "1% loss and no retransmission: {rt:?}");
    assert_eq!(drv.cmb_in_use().is_some(), cmb);
    let ds = dev.stats();
    assert!(ds.served_inline > 0, "{ds:?}");
    if cmb {
        // Only the admin commands (queue creation) read host memory; every I/O ran inline.
        assert!(ds.dma_reads < 20, "{ds:?}");
        assert_eq!(ds.prefetched_reads, 0, "{ds:?}");
    } else {
        // The receive thread fetched the commands the doorbells announced, and the worker used
        // those reads (the data read back above is the proof they were the right ones).
        assert!(ds.prefetches_used > 0 && ds.prefetches_used <= ds.prefetched_reads, "{ds:?}");
    }
    // The device goes away: requests fail with an error, within the timeouts, not a hang.
    dev.shutdown();
    let t = Instant::now();
    let mut buf = vec![0u8; 4096];
    assert!(drv.read_at(0, &mut buf).is_err());
    assert!(t.elapsed() < Duration::from_secs(15), "failed after {:?}", t.elapsed());
}

/// A backing store whose flush takes twice the host's heartbeat patience (3 missed 100 ms
/// intervals).
struct SlowFlush(RamBacking);

impl Backing for SlowFlush {
    fn len(&self) -> u64 {
        self.0.len()
    }
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.0.read_at(offset, buf)
    }
    fn write_at(&mut self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.0.write_at(offset, data)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        std::thread::sleep(Duration::from_millis(600));
        Ok(())
    }
}

/// A Flush (and a FUA write) runs on the device bridge's worker, never on the thread that sends
/// heartbeats and ACKs, so the host keeps the device, whether the drive's queues live in host
/// memory or in its memory buffer (where plain reads and writes run on the receive thread).
#[test]
fn a_slow_flush_runs_on_the_worker_and_the_host_keeps_the_device() {
    for (cmb_bytes, mps) in [(0, 256), (4 << 20, 4096)] {
        let (host, dev) = fabric(0.0, 9, 512, Box::new(SlowFlush(RamBacking::new(16 << 20))), cmb_bytes, mps);
        let devs = host.wait_devices(1, Duration::from_secs(10));
        assert_eq!(devs.len(), 1);
        let region = Arc::new(HostRegion::new(0x4_0000_0000, 2048));
        let drv = attach(&host, &devs[0], region, driver_config()).unwrap();
        assert_eq!(drv.cmb_in_use().is_some(), cmb_bytes > 0);
        drv.write_at(0, &[7u8; 4096], false).unwrap();
        drv.flush().unwrap();
        drv.write_at(4096, &[9u8; 4096], true).unwrap(); // FUA: a flush too
        let mut back = vec![0u8; 8192];
        drv.read_at(0, &mut back).unwrap();
        assert!(back[..4096].iter().all(|&b| b == 7) && back[4096..].iter().all(|&b| b == 9));
        assert_eq!(host.stats().device_gone, 0, "cmb {cmb_bytes}: {:?}", host.stats());
        // Doorbells are served on the receive thread in both setups; the flushes were not.
        assert!(dev.stats().served_inline > 0, "{:?}", dev.stats());
    }
}
