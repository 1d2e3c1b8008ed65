//! End to end: a host bridge and device bridges over the simulated wire (1% loss) and an
//! in-process switch, in both thread modes. Seeds are fixed; every wait is bounded.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lanbus_bridge::{
    BridgeError, DeviceBridge, DeviceBridgeConfig, DmaBuffer, HostBridge, HostBridgeConfig, HostEvent,
    HostedFunction, RemoteFunction,
};
use lanbus_pcie::blocking::{BlockingDevice, HostAccess};
use lanbus_pcie::config::{cap_id, Bar, BarKind, ConfigSpec, MsixSpec};
use lanbus_pcie::device::{CompleterAbort, DmaError};
use lanbus_pcie::dma_engine::{self, regs, transfer_writes, DmaEngine};
use lanbus_pcie::{Bdf, CplStatus};
use lanbus_port::{Hub, HubConfig, Port, SimWire, SimWireConfig};
use lanbus_runtime::{RuntimeConfig, ThreadMode};
use lanbus_wire::{Clock, MacAddr, MonotonicClock};
use rand::{Rng, SeedableRng};

const SRC: u64 = 0x1_0000_0000;
const DST: u64 = 0x2_0000_0000;
const WAIT: Duration = Duration::from_secs(10);

fn mac(n: u8) -> MacAddr {
    MacAddr([2, 0, 0, 0, 0x50, n])
}

fn runtime(mode: ThreadMode, name: &str) -> RuntimeConfig {
    let mut c = RuntimeConfig { threads: mode, name: name.into(), ..RuntimeConfig::default() };
    // The wire is not congested; delay-based rate control would read the scheduling delays of a
    // loaded 2-core machine as queueing and pace down to its floor.
    c.transport.rate.enabled = false;
    // A loaded 2-core machine (load 8-10 while these tests were written) stalls threads for
    // hundreds of ms: a peer is down after 1 s without heartbeats.
    c.transport.heartbeat.missed_limit = 10;
    c
}

fn host_config(mode: ThreadMode, group: u16) -> HostBridgeConfig {
    HostBridgeConfig {
        group,
        name: format!("host{group}"),
        runtime: runtime(mode, &format!("h{group}")),
        completion_timeout: Duration::from_secs(2),
        ..HostBridgeConfig::default()
    }
}

fn device_config(mode: ThreadMode, group: u16) -> DeviceBridgeConfig {
    DeviceBridgeConfig {
        group,
        name: "iobox".into(),
        runtime: runtime(mode, "dev"),
        completion_timeout: Duration::from_secs(2),
        ..DeviceBridgeConfig::default()
    }
}

/// A host and a device bridge with `functions` over a simulated wire losing `loss` of frames.
fn over_sim(
    mode: ThreadMode,
    loss: f64,
    seed: u64,
    host: HostBridgeConfig,
    functions: Vec<HostedFunction>,
) -> (HostBridge, DeviceBridge) {
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let wire = SimWireConfig { loss, seed, ..SimWireConfig::default() };
    let (a, b) = SimWire::pair_realtime(wire, clock, [mac(1), mac(2)]).unwrap();
    let group = host.group;
    let h = HostBridge::start(Box::new(a), host).unwrap();
    let d = DeviceBridge::start(Box::new(b), device_config(mode, group), functions).unwrap();
    (h, d)
}

fn dma_engine() -> Vec<HostedFunction> {
    vec![HostedFunction::model(DmaEngine::new()).unwrap()]
}

fn one_device(h: &HostBridge) -> RemoteFunction {
    let devs = h.wait_devices(1, WAIT);
    assert_eq!(devs.len(), 1, "one function enumerated: {devs:?}");
    devs[0].clone()
}

fn checksum(b: &[u8]) -> u64 {
    // FNV-1a: any changed, missing or moved byte changes it.
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3))
}

/// Runs one DMA engine transfer and waits for its interrupt (the `n`-th).
fn transfer(h: &HostBridge, f: &RemoteFunction, src: u64, dst: u64, len: u32, n: u64) -> u32 {
    let bar0 = f.bar(0).unwrap().address;
    for (off, v) in transfer_writes(src, dst, len) {
        h.mmio_write32(f.bdf, bar0 + off, v).unwrap();
    }
    let got = h.wait_interrupts(f.bdf, 0, n, WAIT);
    if got != n {
        let st = h.mmio_read32(f.bdf, bar0 + regs::STATUS);
        let done = h.mmio_read32(f.bdf, bar0 + regs::COMPLETED);
        panic!(
            "interrupt {n} did not arrive (got {got}); status {st:?} completed {done:?}\nhost {:?}\n{:?}",
            h.stats(),
            h.runtime_stats()
        );
    }
    h.mmio_read32(f.bdf, bar0 + regs::STATUS).unwrap()
}

fn enumerate_and_copy(mode: ThreadMode, total_bytes: usize) {
    let loss = std::env::var("LOSS").ok().and_then(|s| s.parse().ok()).unwrap_or(0.01);
    let (h, d) = over_sim(mode, loss, 11, host_config(mode, 7), dma_engine());
    let f = one_device(&h);
    assert_eq!(
        (f.vendor_id, f.device_id, f.class_code),
        (dma_engine::VENDOR_ID, dma_engine::DEVICE_ID, 0x088000)
    );
    assert_eq!(f.mac, d.local_mac());
    assert_eq!(f.group, 7);
    let bars: Vec<(usize, u64)> = f.bars.iter().map(|b| (b.index, b.size)).collect();
    assert_eq!(bars, vec![(0, 4096), (2, 4096)]);
    for b in &f.bars {
        assert_eq!(b.address % b.size, 0, "BAR aligned to its size");
        assert_eq!(b.kind, BarKind::Memory32 { prefetchable: false });
    }
    assert_eq!(f.msix_vectors(), dma_engine::MSIX_VECTORS);
    let caps: Vec<u8> = f.capabilities.iter().map(|c| c.0).collect();
    assert!(caps.contains(&cap_id::PCI_EXPRESS) && caps.contains(&cap_id::MSIX), "{caps:?}");
    assert_eq!(d.host(), Some(h.local_mac()));

    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let src_bytes: Vec<u8> = (0..2 << 20).map(|_| rng.random()).collect();
    let src = DmaBuffer::from_vec(src_bytes.clone());
    let dst = DmaBuffer::new(1 << 20);
    h.add_region(SRC, src).unwrap();
    h.add_region(DST, dst.clone()).unwrap();
    let efd = h.interrupt_eventfd(f.bdf, 0).unwrap();
    let called = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (c2, bdf) = (called.clone(), f.bdf);
    h.on_interrupt(move |b, v| {
        if b == bdf && v == 0 {
            c2.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    });

    let sizes = [4096usize, 8192, 16384, 32768, 65536, 131072, 262144, 524288, 1 << 20];
    let (mut copied, mut n) = (0usize, 0u64);
    let start = Instant::now();
    while copied < total_bytes {
        for &len in &sizes {
            n += 1;
            let off = rng.random_range(0..(1 << 20) / 4) * 4;
            dst.with(|b| b[..len].fill(0));
            let status = transfer(&h, &f, SRC + off as u64, DST, len as u32, n);
            assert_eq!(status & (regs::STATUS_DONE | regs::STATUS_ERROR), regs::STATUS_DONE, "transfer {n}");
            let got = dst.read_vec(0, len);
            assert_eq!(checksum(&got), checksum(&src_bytes[off..off + len]), "transfer {n} of {len} bytes");
            copied += len;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "{mode:?}: {} MiB in {n} transfers, {secs:.2} s, {:.1} MB/s",
        copied >> 20,
        copied as f64 / secs / 1e6
    );
    // Exactly one interrupt per transfer: none extra arrives later.
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(h.interrupt_count(f.bdf, 0), n);
    assert_eq!(efd.take(), n, "the eventfd counted every interrupt");
    assert_eq!(called.load(std::sync::atomic::Ordering::Relaxed), n, "the callback saw every interrupt");
    let hs = h.stats();
    assert_eq!((hs.unknown_address_reads, hs.spurious_interrupts, hs.timeouts), (0, 0, 0));
    let ds = d.stats();
    assert_eq!(ds.dma_read_failures, 0);
    assert!(h.runtime_stats().transport.frames_received > 0);
}

#[test]
fn enumeration_and_dma_copies_run_to_completion() {
    enumerate_and_copy(ThreadMode::RunToCompletion, 64 << 20);
}

#[test]
fn enumeration_and_dma_copies_pipeline() {
    enumerate_and_copy(ThreadMode::Pipeline, 64 << 20);
}

fn unknown_addresses(mode: ThreadMode) {
    let (h, d) = over_sim(mode, 0.01, 12, host_config(mode, 3), dma_engine());
    let f = one_device(&h);
    let bar0 = f.bar(0).unwrap().address;
    // An address no BAR decodes: the device bridge answers UR.
    let mut b = [0u8; 4];
    let r = h.mmio_read(f.bdf, bar0 + 0x10_0000, &mut b);
    assert_eq!(r, Err(BridgeError::Completion(CplStatus::UnsupportedRequest)));
    assert!(d.stats().ur_sent >= 1);
    // A function that does not exist.
    let absent = Bdf::new(f.bdf.bus(), 0, 5).unwrap();
    assert_eq!(h.config_read(absent, 0), Err(BridgeError::Completion(CplStatus::UnsupportedRequest)));
    // The device reads host memory nobody lent: the host answers UR, the transfer fails, and
    // the interrupt still says it ended.
    h.add_region(DST, DmaBuffer::new(8192)).unwrap();
    let status = transfer(&h, &f, 0x7_0000_0000, DST, 8192, 1);
    assert_ne!(status & regs::STATUS_ERROR, 0);
    assert!(h.stats().unknown_address_reads >= 1);
    assert!(h.stats().ur_sent >= 1);
    // The device works on afterwards.
    h.add_region(SRC, DmaBuffer::from_vec(vec![0xa5; 8192])).unwrap();
    let status = transfer(&h, &f, SRC, DST, 8192, 2);
    assert_eq!(status & regs::STATUS_ERROR, 0);
}

/// A function given a DMA domain of its own reaches only the regions lent to it there (its
/// requester ID picks the domain), not the shared ones; without the domain it is back to them.
#[test]
fn a_dma_domain_confines_a_function_to_its_own_regions() {
    let mode = ThreadMode::RunToCompletion;
    let (h, _d) = over_sim(mode, 0.0, 7, host_config(mode, 3), dma_engine());
    let f = one_device(&h);
    h.add_region(SRC, DmaBuffer::from_vec(vec![0x11; 4096])).unwrap();
    let dst = DmaBuffer::new(4096);
    h.add_region(DST, dst.clone()).unwrap();
    h.set_dma_domain(f.bdf, true);
    let status = transfer(&h, &f, SRC, DST, 4096, 1);
    assert_ne!(status & regs::STATUS_ERROR, 0, "the shared regions are out of reach");
    assert_eq!(dst.read_vec(0, 4096), vec![0; 4096]);
    let own_dst = DmaBuffer::new(4096);
    h.add_domain_region(f.bdf, SRC, DmaBuffer::from_vec(vec![0x22; 4096])).unwrap();
    h.add_domain_region(f.bdf, DST, own_dst.clone()).unwrap();
    assert!(h.add_domain_region(f.bdf, DST + 4096 - 8, DmaBuffer::new(64)).is_err(), "overlap refused");
    let status = transfer(&h, &f, SRC, DST, 4096, 2);
    assert_eq!(status & regs::STATUS_ERROR, 0);
    assert_eq!(own_dst.read_vec(0, 4096), vec![0x22; 4096]);
    assert_eq!(dst.read_vec(0, 4096), vec![0; 4096], "the shared region untouched");
    assert!(h.remove_domain_region(f.bdf, SRC));
    h.set_dma_domain(f.bdf, false);
    assert!(h.add_domain_region(f.bdf, SRC, DmaBuffer::new(64)).is_err(), "no domain any more");
    let status = transfer(&h, &f, SRC, DST, 4096, 3);
    assert_eq!(status & regs::STATUS_ERROR, 0);
    assert_eq!(dst.read_vec(0, 4096), vec![0x11; 4096], "back to the shared regions");
}

/// A device bridge with two functions says so in function 0's header type, so the host probes
/// past function 0 and enumerates both (a lone function does not set the bit).
#[test]
fn every_function_of_a_multi_function_device_is_enumerated() {
    let mode = ThreadMode::RunToCompletion;
    let two = vec![
        HostedFunction::model(DmaEngine::new()).unwrap(),
        HostedFunction::model(DmaEngine::new()).unwrap(),
    ];
    let (h, _d) = over_sim(mode, 0.0, 5, host_config(mode, 4), two);
    let devs = h.wait_devices(2, WAIT);
    assert_eq!(devs.len(), 2, "both functions enumerated: {devs:?}");
    assert_eq!(devs.iter().map(|f| f.bdf.function()).collect::<Vec<_>>(), [0, 1]);
    assert!(devs.iter().all(|f| f.header_type & 0x80 != 0));
    let (h1, _d1) = over_sim(mode, 0.0, 6, host_config(mode, 4), dma_engine());
    assert_eq!(one_device(&h1).header_type & 0x80, 0);
}

#[test]
fn unknown_addresses_get_unsupported_request() {
    unknown_addresses(ThreadMode::RunToCompletion);
    unknown_addresses(ThreadMode::Pipeline);
}

/// A blocking model: a copier whose DMA waits for its data (as the NVMe controller's does), and a
/// register that takes its time to read.
struct Copier {
    regs: [u32; 8],
    pending: bool,
    copies: u32,
    /// Pause before the DMA (ms), and what the last read returned.
    delay_ms: u64,
    last: Arc<std::sync::Mutex<Option<Result<(), DmaError>>>>,
}

impl BlockingDevice for Copier {
    fn config_spec(&self) -> ConfigSpec {
        ConfigSpec::new(0x4c42, 0x00b1, 0x018000)
            .with_bar(0, Bar { kind: BarKind::Memory64 { prefetchable: true }, size: 16384 })
            .with_bar(2, Bar { kind: BarKind::Memory32 { prefetchable: false }, size: 4096 })
            .with_msix(MsixSpec {
                table_size: 2,
                table_bar: 2,
                table_offset: 0,
                pba_bar: 2,
                pba_offset: 0x800,
            })
    }

    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) -> Result<(), CompleterAbort> {
        if bar != 0 || offset >= 0x40 {
            return Err(CompleterAbort);
        }
        if offset == 0x20 {
            // The slow register.
            std::thread::sleep(Duration::from_millis(800));
        }
        let i = (offset / 4) as usize % 8;
        let v = if offset == 0x1c { self.copies } else { self.regs[i] };
        for (k, b) in data.iter_mut().enumerate() {
            *b = v.to_le_bytes()[(k + offset as usize) % 4];
        }
        Ok(())
    }

    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
        if bar == 0 && offset < 0x20 && data.len() == 4 {
            self.regs[(offset / 4) as usize] = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
            if offset == 0x14 {
                self.pending = true;
            }
        }
    }

    fn has_work(&self) -> bool {
        self.pending
    }

    fn process(&mut self, host: &mut dyn HostAccess) -> usize {
        self.pending = false;
        let src = u64::from(self.regs[0]) | u64::from(self.regs[1]) << 32;
        let dst = u64::from(self.regs[2]) | u64::from(self.regs[3]) << 32;
        let mut buf = vec![0u8; self.regs[4] as usize];
        std::thread::sleep(Duration::from_millis(self.delay_ms));
        let read = host.read(src, &mut buf);
        *self.last.lock().unwrap() = Some(read);
        let ok = read.is_ok() && host.write(dst, &buf).is_ok();
        self.copies += u32::from(ok);
        host.signal_msix(1);
        1
    }
}

fn blocking_model(mode: ThreadMode) {
    let mut hc = host_config(mode, 4);
    hc.completion_timeout = Duration::from_millis(300);
    let copier = Copier { regs: [0; 8], pending: false, copies: 0, delay_ms: 0, last: Default::default() };
    let (h, _d) = over_sim(mode, 0.01, 13, hc, vec![HostedFunction::blocking(copier).unwrap()]);
    let f = one_device(&h);
    assert_eq!(f.bar(0).map(|b| (b.size, b.kind)), Some((16384, BarKind::Memory64 { prefetchable: true })));
    assert_eq!(f.msix_vectors(), 2);
    let bar0 = f.bar(0).unwrap().address;
    // The slow register: the completion timeout gives an error, not a hang.
    let t = Instant::now();
    let mut b = [0u8; 4];
    assert_eq!(
        h.mmio_read(f.bdf, bar0 + 0x20, &mut b),
        Err(BridgeError::Timeout(Duration::from_millis(300)))
    );
    assert!(t.elapsed() < Duration::from_secs(1), "timed out in {:?}", t.elapsed());
    std::thread::sleep(Duration::from_millis(600));
    // Its late completion is dropped; the function works on, and its DMA waits for its data.
    let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
    h.add_region(SRC, DmaBuffer::from_vec(data.clone())).unwrap();
    let dst = DmaBuffer::new(10_000);
    h.add_region(DST, dst.clone()).unwrap();
    for (off, v) in [(0u64, SRC as u32), (4, 1), (8, DST as u32), (12, 2), (16, 9_999), (0x14, 1)] {
        h.mmio_write32(f.bdf, bar0 + off, v).unwrap();
    }
    assert_eq!(h.wait_interrupts(f.bdf, 1, 1, WAIT), 1);
    assert_eq!(h.mmio_read32(f.bdf, bar0 + 0x1c).unwrap(), 1);
    assert_eq!(dst.read_vec(0, 9_999), data[..9_999]);
    assert!(h.stats().timeouts >= 1);
}

#[test]
fn blocking_model_dma_and_completion_timeout() {
    blocking_model(ThreadMode::RunToCompletion);
    blocking_model(ThreadMode::Pipeline);
}

fn hub_node(hub: &Hub, n: u8) -> Box<dyn Port> {
    Box::new(hub.port(mac(n)))
}

fn groups_move_devices(mode: ThreadMode) {
    let hub = Hub::new(HubConfig { loss: 0.01, seed: 21, ..HubConfig::default() }).unwrap();
    let h1 = HostBridge::start(hub_node(&hub, 1), host_config(mode, 1)).unwrap();
    let h2 = HostBridge::start(hub_node(&hub, 2), host_config(mode, 2)).unwrap();
    let h3 = HostBridge::start(hub_node(&hub, 3), host_config(mode, 3)).unwrap();
    let (e1, e2, e3) = (h1.subscribe(), h2.subscribe(), h3.subscribe());
    let d = DeviceBridge::start(hub_node(&hub, 9), device_config(mode, 1), dma_engine()).unwrap();
    let f1 = one_device(&h1);
    assert!(matches!(e1.recv_timeout(WAIT), Ok(HostEvent::DeviceAdded(ref f)) if f.bdf == f1.bdf));
    assert!(h2.devices().is_empty());
    // Host 1 uses it.
    h1.add_region(SRC, DmaBuffer::from_vec(vec![1; 4096])).unwrap();
    let dst1 = DmaBuffer::new(4096);
    h1.add_region(DST, dst1.clone()).unwrap();
    assert_eq!(transfer(&h1, &f1, SRC, DST, 4096, 1) & regs::STATUS_ERROR, 0);
    assert_eq!(dst1.read_vec(0, 4096), vec![1; 4096]);

    // Move it to group 2: host 1 sees it leave, host 2 enumerates it.
    d.set_group(2).unwrap();
    assert!(h1.wait_gone(d.local_mac(), WAIT));
    assert!(
        matches!(e1.recv_timeout(WAIT), Ok(HostEvent::DeviceRemoved { mac, .. }) if mac == d.local_mac())
    );
    let f2 = one_device(&h2);
    assert!(matches!(e2.recv_timeout(WAIT), Ok(HostEvent::DeviceAdded(_))));
    assert_eq!(f2.group, 2);
    assert_eq!(h1.mmio_read32(f1.bdf, f1.bar(0).unwrap().address), Err(BridgeError::NoSuchDevice(f1.bdf)));
    h2.add_region(SRC, DmaBuffer::from_vec(vec![2; 8192])).unwrap();
    let dst2 = DmaBuffer::new(8192);
    h2.add_region(DST, dst2.clone()).unwrap();
    // The engine counts transfers across hosts; interrupts are per host.
    let status = transfer(&h2, &f2, SRC, DST, 8192, 1);
    assert_eq!(status & regs::STATUS_ERROR, 0);
    assert_eq!(dst2.read_vec(0, 8192), vec![2; 8192]);
    assert_eq!(d.host(), Some(h2.local_mac()));
    // Host 1 gets it back.
    d.set_group(1).unwrap();
    assert!(h2.wait_gone(d.local_mac(), WAIT));
    let f1b = one_device(&h1);
    assert_eq!(transfer(&h1, &f1b, SRC, DST, 4096, 2) & regs::STATUS_ERROR, 0);
    // Host 3 (group 3) never saw anything.
    assert!(h3.devices().is_empty());
    assert!(e3.try_recv().is_err());
    assert_eq!(h3.stats().tlps_received, 0);
}

#[test]
fn group_reassignment_moves_the_device_between_hosts() {
    groups_move_devices(ThreadMode::RunToCompletion);
    groups_move_devices(ThreadMode::Pipeline);
}

/// A device bridge that restarts with the same MAC is a new incarnation to its host at once
/// (its epoch says so): the old session's functions go, the new ones are enumerated, and DMA
/// works again, long before the old incarnation would have expired (1 s without a frame).
fn device_restarts(mode: ThreadMode) {
    let hub = Hub::new(HubConfig { seed: 5, ..HubConfig::default() }).unwrap();
    let h = HostBridge::start(hub_node(&hub, 1), host_config(mode, 1)).unwrap();
    let events = h.subscribe();
    let d = DeviceBridge::start(hub_node(&hub, 9), device_config(mode, 1), dma_engine()).unwrap();
    let f = one_device(&h);
    assert!(matches!(events.recv_timeout(WAIT), Ok(HostEvent::DeviceAdded(_))));
    h.add_region(SRC, DmaBuffer::from_vec(vec![3; 4096])).unwrap();
    let dst = DmaBuffer::new(4096);
    h.add_region(DST, dst.clone()).unwrap();
    assert_eq!(transfer(&h, &f, SRC, DST, 4096, 1) & regs::STATUS_ERROR, 0);

    d.shutdown();
    let restarted = std::time::Instant::now();
    let d = DeviceBridge::start(hub_node(&hub, 9), device_config(mode, 1), dma_engine()).unwrap();
    let removed = events.recv_timeout(WAIT);
    assert!(
        matches!(&removed, Ok(HostEvent::DeviceRemoved { mac, reason, .. }) if *mac == d.local_mac() && reason == "restarted"),
        "{removed:?}"
    );
    assert!(matches!(events.recv_timeout(WAIT), Ok(HostEvent::DeviceAdded(_))));
    let seen_after = restarted.elapsed();
    let f = one_device(&h);
    dst.with(|b| b.fill(0));
    // The host's interrupt count for the function's vector goes on across the re-plug.
    let next = h.interrupt_count(f.bdf, 0) + 1;
    assert_eq!(transfer(&h, &f, SRC, DST, 4096, next) & regs::STATUS_ERROR, 0);
    assert!(dst.read_vec(0, 4096) == vec![3; 4096], "the new incarnation copied the buffer");
    assert!(seen_after < Duration::from_millis(900), "the restart took {seen_after:?} to be seen");
    assert!(h.runtime_stats().transport.peer_restarts >= 1);
}

#[test]
fn a_device_bridge_restarted_with_the_same_mac_is_enumerated_again_at_once() {
    device_restarts(ThreadMode::RunToCompletion);
}

fn device_goes_down(mode: ThreadMode) {
    let hub = Hub::new(HubConfig { seed: 31, ..HubConfig::default() }).unwrap();
    let mut hc = host_config(mode, 5);
    hc.completion_timeout = Duration::from_secs(5);
    let h = HostBridge::start(hub_node(&hub, 1), hc).unwrap();
    let events = h.subscribe();
    let d = DeviceBridge::start(hub_node(&hub, 9), device_config(mode, 5), dma_engine()).unwrap();
    let f = one_device(&h);
    let _ = events.recv_timeout(WAIT);
    let bar0 = f.bar(0).unwrap().address;
    assert!(h.mmio_read32(f.bdf, bar0).is_ok());
    // Pull the cable: the request in flight fails as soon as the heartbeats are missed, well
    // before its 5 s completion timeout.
    hub.set_link(d.local_mac(), false);
    let t = Instant::now();
    let r = h.mmio_read32(f.bdf, bar0);
    assert_eq!(r, Err(BridgeError::DeviceGone { bdf: f.bdf, mac: d.local_mac() }));
    assert!(t.elapsed() < Duration::from_secs(2), "failed after {:?}", t.elapsed());
    assert!(matches!(events.recv_timeout(WAIT), Ok(HostEvent::DeviceRemoved { .. })));
    assert!(h.devices().is_empty());
    assert!(h.stats().device_gone >= 1);
    // And the device sees its host go.
    let t = Instant::now();
    while d.host().is_some() && t.elapsed() < WAIT {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(d.host(), None);
}

#[test]
fn a_device_that_stops_heartbeating_fails_its_users() {
    device_goes_down(ThreadMode::RunToCompletion);
    device_goes_down(ThreadMode::Pipeline);
}

fn many_small_transfers(mode: ThreadMode, mps: usize, count: u64) {
    let mut hc = host_config(mode, 6);
    hc.mps = mps;
    let (h, d) = over_sim(mode, 0.0, 14, hc, dma_engine());
    let f = one_device(&h);
    let data: Vec<u8> = (0..16384u32).map(|i| (i * 13) as u8).collect();
    h.add_region(SRC, DmaBuffer::from_vec(data.clone())).unwrap();
    let dst = DmaBuffer::new(16384);
    h.add_region(DST, dst.clone()).unwrap();
    for n in 1..=count {
        let len = if n % 2 == 0 { 4096 } else { 16384 };
        let status = transfer(&h, &f, SRC, DST, len, n);
        assert_eq!(status & regs::STATUS_ERROR, 0, "transfer {n}: {:?} {:?}", h.stats(), d.stats());
    }
    assert_eq!(dst.read_vec(0, 16384), data);
}

/// A device that asks for 1 MiB at once (256 reads of 4 KiB in flight, as a storage
/// controller reads a write's data) is served in parts over several turns of the host's loop,
/// and every byte arrives where it belongs, over a lossy wire.
fn large_reads_at_once(mode: ThreadMode) {
    let engine = vec![HostedFunction::model(DmaEngine::with_outstanding_reads(256)).unwrap()];
    // Reads of 4 KiB: 32 of them (under a kilobyte of requests) ask for a turn's share.
    let mut hc = host_config(mode, 8);
    (hc.mps, hc.mrrs) = (4096, 4096);
    let (h, d) = over_sim(mode, 0.01, 15, hc, engine);
    let f = one_device(&h);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(15);
    let src: Vec<u8> = (0..4 << 20).map(|_| rng.random()).collect();
    h.add_region(SRC, DmaBuffer::from_vec(src.clone())).unwrap();
    let dst = DmaBuffer::new(2 << 20);
    h.add_region(DST, dst.clone()).unwrap();
    for (n, len) in [1usize << 20, 2 << 20, 512 << 10, 1 << 20].into_iter().enumerate() {
        let off = rng.random_range(0..(4 << 20) - len) / 4 * 4;
        dst.with(|b| b.fill(0));
        let status = transfer(&h, &f, SRC + off as u64, DST, len as u32, n as u64 + 1);
        assert_eq!(status & (regs::STATUS_DONE | regs::STATUS_ERROR), regs::STATUS_DONE, "transfer {n}");
        assert_eq!(
            checksum(&dst.read_vec(0, len)),
            checksum(&src[off..off + len]),
            "transfer {n} of {len} bytes"
        );
    }
    let hs = h.stats();
    assert!(hs.dma_reads_deferred > 0, "no read waited for a later turn: {hs:?}");
    assert_eq!((hs.unknown_address_reads, hs.timeouts), (0, 0));
    assert_eq!(d.stats().dma_read_failures, 0);
}

#[test]
fn a_device_reading_a_megabyte_at_once_is_served_in_turns() {
    large_reads_at_once(ThreadMode::RunToCompletion);
    large_reads_at_once(ThreadMode::Pipeline);
}

#[test]
fn many_small_transfers_in_a_row() {
    let count = std::env::var("TRANSFERS").ok().and_then(|s| s.parse().ok()).unwrap_or(300);
    many_small_transfers(ThreadMode::RunToCompletion, 128, count);
    many_small_transfers(ThreadMode::Pipeline, 512, count);
}

#[test]
fn a_second_host_of_the_group_is_ignored_and_counted() {
    let mode = ThreadMode::RunToCompletion;
    let hub = Hub::new(HubConfig { seed: 41, ..HubConfig::default() }).unwrap();
    let first = HostBridge::start(hub_node(&hub, 1), host_config(mode, 1)).unwrap();
    let d = DeviceBridge::start(hub_node(&hub, 9), device_config(mode, 1), dma_engine()).unwrap();
    let f = one_device(&first);
    assert_eq!(d.host(), Some(first.local_mac()));
    // A second host of the same group: the device serves only its current host.
    let mut hc = host_config(mode, 1);
    hc.completion_timeout = Duration::from_millis(200);
    let second = HostBridge::start(hub_node(&hub, 2), hc).unwrap();
    let t = Instant::now();
    while second.stats().enumeration_failures < 3 && t.elapsed() < WAIT {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(second.stats().enumeration_failures, 3, "three attempts, all ignored");
    assert!(second.devices().is_empty());
    assert!(d.stats().foreign_requests >= 3);
    // The first host still has it.
    assert_eq!(d.host(), Some(first.local_mac()));
    assert!(first.mmio_read32(f.bdf, f.bar(0).unwrap().address + regs::STATUS).is_ok());
}

#[test]
fn a_device_dma_read_without_completions_times_out() {
    let mode = ThreadMode::Pipeline;
    let hub = Hub::new(HubConfig { seed: 51, ..HubConfig::default() }).unwrap();
    let h = HostBridge::start(hub_node(&hub, 1), host_config(mode, 2)).unwrap();
    let last = Arc::new(std::sync::Mutex::new(None));
    let copier = Copier { regs: [0; 8], pending: false, copies: 0, delay_ms: 200, last: last.clone() };
    let mut dc = device_config(mode, 2);
    dc.completion_timeout = Duration::from_millis(150);
    let d =
        DeviceBridge::start(hub_node(&hub, 9), dc, vec![HostedFunction::blocking(copier).unwrap()]).unwrap();
    let f = one_device(&h);
    h.add_region(SRC, DmaBuffer::new(4096)).unwrap();
    h.add_region(DST, DmaBuffer::new(4096)).unwrap();
    let bar0 = f.bar(0).unwrap().address;
    let before = d.stats().tlps_received;
    for (off, v) in [(0u64, SRC as u32), (4, 1), (8, DST as u32), (12, 2), (16, 4096), (0x14, 1)] {
        h.mmio_write32(f.bdf, bar0 + off, v).unwrap();
    }
    // Once the doorbell is in, nothing reaches the device any more (its own frames still
    // leave), so the completions of the read it makes 200 ms later never come.
    wait_received(&d, before + 6);
    hub.set_receive(d.local_mac(), false);
    let t = Instant::now();
    while last.lock().unwrap().is_none() && t.elapsed() < WAIT {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(*last.lock().unwrap(), Some(Err(DmaError::Timeout)));
    assert!(t.elapsed() < Duration::from_secs(1), "timed out after {:?}", t.elapsed());
    assert!(d.stats().dma_read_failures >= 1);
    // The interrupt still reaches the host: the device is not wedged.
    assert_eq!(h.wait_interrupts(f.bdf, 1, 1, WAIT), 1);
}

#[test]
fn device_dma_fails_at_once_when_its_host_goes_down() {
    let mode = ThreadMode::RunToCompletion;
    let hub = Hub::new(HubConfig { seed: 61, ..HubConfig::default() }).unwrap();
    let h = HostBridge::start(hub_node(&hub, 1), host_config(mode, 2)).unwrap();
    let last = Arc::new(std::sync::Mutex::new(None));
    let copier = Copier { regs: [0; 8], pending: false, copies: 0, delay_ms: 200, last: last.clone() };
    let mut dc = device_config(mode, 2);
    dc.completion_timeout = Duration::from_secs(10);
    let d =
        DeviceBridge::start(hub_node(&hub, 9), dc, vec![HostedFunction::blocking(copier).unwrap()]).unwrap();
    let f = one_device(&h);
    h.add_region(SRC, DmaBuffer::new(4096)).unwrap();
    let bar0 = f.bar(0).unwrap().address;
    let before = d.stats().tlps_received;
    for (off, v) in [(0u64, SRC as u32), (4, 1), (8, DST as u32), (12, 2), (16, 4096), (0x14, 1)] {
        h.mmio_write32(f.bdf, bar0 + off, v).unwrap();
    }
    wait_received(&d, before + 6);
    // The host vanishes while the device's read is outstanding (its completion timeout is 10 s):
    // the read fails as soon as the host's heartbeats are missed.
    hub.set_link(h.local_mac(), false);
    let t = Instant::now();
    while last.lock().unwrap().is_none() && t.elapsed() < WAIT {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(*last.lock().unwrap(), Some(Err(DmaError::HostUnreachable)));
    assert!(t.elapsed() < Duration::from_secs(3), "failed after {:?}", t.elapsed());
    assert_eq!(d.host(), None);
}

/// Waits until the device bridge has received `n` TLPs.
fn wait_received(d: &DeviceBridge, n: u64) {
    let t = Instant::now();
    while d.stats().tlps_received < n && t.elapsed() < WAIT {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(d.stats().tlps_received >= n);
}

/// An inline function's DMA read fails on its completion timeout while its host hears nothing:
/// the timer thread leaves the model's reaction (error status, MSI-X) for the receive thread to
/// send in order with the function's other TLPs, and wakes it to do so.
fn inline_read_times_out_and_still_interrupts(mode: ThreadMode, seed: u64) {
    let hub = Hub::new(HubConfig { seed, ..HubConfig::default() }).unwrap();
    let h = HostBridge::start(hub_node(&hub, 1), host_config(mode, 4)).unwrap();
    let mut dc = device_config(mode, 4);
    dc.completion_timeout = Duration::from_millis(150);
    let d = DeviceBridge::start(hub_node(&hub, 9), dc, dma_engine()).unwrap();
    let f = one_device(&h);
    h.add_region(SRC, DmaBuffer::new(4096)).unwrap();
    h.add_region(DST, DmaBuffer::new(4096)).unwrap();
    assert_eq!(transfer(&h, &f, SRC, DST, 4096, 1) & regs::STATUS_ERROR, 0);
    let bar0 = f.bar(0).unwrap().address;
    let before = d.stats().tlps_received;
    // From here the host receives nothing (its own frames still leave): the device's read of the
    // next transfer gets no completion.
    hub.set_receive(h.local_mac(), false);
    for (off, v) in transfer_writes(SRC, DST, 4096) {
        h.mmio_write32(f.bdf, bar0 + off, v).unwrap();
    }
    wait_received(&d, before + 6);
    let t = Instant::now();
    while d.stats().dma_read_failures == 0 && t.elapsed() < WAIT {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(d.stats().dma_read_failures, 1);
    assert!(t.elapsed() < Duration::from_secs(1), "timed out after {:?}", t.elapsed());
    // The host hears again: the device's retransmissions bring the read (its late completion is
    // unexpected) and the failed transfer's interrupt.
    hub.set_receive(h.local_mac(), true);
    assert_eq!(h.wait_interrupts(f.bdf, 0, 2, WAIT), 2, "the failed transfer's interrupt");
    let st = h.mmio_read32(f.bdf, bar0 + regs::STATUS).unwrap();
    assert_eq!(st & regs::STATUS_ERROR, regs::STATUS_ERROR, "status {st:#x}");
    // The device works on.
    assert_eq!(transfer(&h, &f, SRC, DST, 4096, 3) & regs::STATUS_ERROR, 0);
}

#[test]
fn an_inline_read_without_completions_times_out_and_still_interrupts() {
    inline_read_times_out_and_still_interrupts(ThreadMode::RunToCompletion, 71);
    inline_read_times_out_and_still_interrupts(ThreadMode::Pipeline, 72);
}
