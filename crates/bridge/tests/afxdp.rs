//! End to end over a real link: a device bridge with the DMA engine on one end of a veth pair and
//! a host bridge on the other, each over an `afxdp:` port (AF_XDP with the native XDP program)
//! opened inside its end's network namespace, in both thread modes; at least 64 MiB copied per
//! mode. Root only: without root the tests print why and return. Every wait is bounded; the
//! source bytes come from a fixed seed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lanbus_bridge::{
    DeviceBridge, DeviceBridgeConfig, DmaBuffer, HostBridge, HostBridgeConfig, HostedFunction, RemoteFunction,
};
use lanbus_pcie::config::{cap_id, BarKind};
use lanbus_pcie::dma_engine::{self, regs, transfer_writes, DmaEngine};
use lanbus_port::netns::{VethEnd, VethPair};
use lanbus_port::Port;
use lanbus_runtime::{RuntimeConfig, ThreadMode};
use rand::{Rng, SeedableRng};

const SRC: u64 = 0x1_0000_0000;
const DST: u64 = 0x2_0000_0000;
const WAIT: Duration = Duration::from_secs(10);

fn runtime(mode: ThreadMode, name: &str) -> RuntimeConfig {
    let mut c = RuntimeConfig { threads: mode, name: name.into(), ..RuntimeConfig::default() };
    // One host, one device, an uncongested link: delay-based rate control would only read the
    // scheduling delays of a loaded shared machine as queueing.
    c.transport.rate.enabled = false;
    // A loaded 2-core machine stalls threads for hundreds of ms: down after 1 s of silence.
    c.transport.heartbeat.missed_limit = 10;
    c
}

/// Opens `afxdp:IFACE` on a thread inside `end`'s namespace and hands the port out.
fn open_afxdp(end: &VethEnd) -> Box<dyn Port> {
    let spec = format!("afxdp:{}", end.ifname);
    let s = spec.clone();
    end.netns
        .run(move || s.parse::<lanbus_port::PortSpec>().and_then(|s| s.open()).map_err(|e| e.to_string()))
        .expect("a thread in the namespace")
        .unwrap_or_else(|e| panic!("open {spec}: {e}"))
}

fn checksum(b: &[u8]) -> u64 {
    // FNV-1a: any changed, missing or moved byte changes it.
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3))
}

/// Runs one DMA engine transfer and waits for its interrupt (the `n`-th); returns the status.
fn transfer(h: &HostBridge, f: &RemoteFunction, src: u64, dst: u64, len: u32, n: u64) -> u32 {
    let bar0 = f.bar(0).unwrap().address;
    for (off, v) in transfer_writes(src, dst, len) {
        h.mmio_write32(f.bdf, bar0 + off, v).unwrap();
    }
    let got = h.wait_interrupts(f.bdf, 0, n, WAIT);
    if got != n {
        panic!(
            "interrupt {n} did not arrive (got {got}); status {:?}\nhost {:?}\n{:?}",
            h.mmio_read32(f.bdf, bar0 + regs::STATUS),
            h.stats(),
            h.runtime_stats()
        );
    }
    h.mmio_read32(f.bdf, bar0 + regs::STATUS).unwrap()
}

fn enumerate_and_copy_over_afxdp(mode: ThreadMode, test: &str) {
    let pair = match VethPair::create() {
        Ok(p) => p,
        Err(skip) => {
            eprintln!("{test}: {skip}");
            return;
        }
    };
    let (dev_port, host_port) = (open_afxdp(&pair.a), open_afxdp(&pair.b));
    assert_eq!(dev_port.mac(), pair.a.mac);
    assert_eq!(host_port.mac(), pair.b.mac);
    let dc = DeviceBridgeConfig {
        group: 4,
        name: "iobox-xdp".into(),
        runtime: runtime(mode, "dev"),
        completion_timeout: Duration::from_secs(2),
        ..DeviceBridgeConfig::default()
    };
    let hc = HostBridgeConfig {
        group: 4,
        name: "host-xdp".into(),
        runtime: runtime(mode, "host"),
        completion_timeout: Duration::from_secs(2),
        ..HostBridgeConfig::default()
    };
    let d =
        DeviceBridge::start(dev_port, dc, vec![HostedFunction::model(DmaEngine::new()).unwrap()]).unwrap();
    let h = HostBridge::start(host_port, hc).unwrap();

    // Enumeration through configuration TLPs over the link.
    let devs = h.wait_devices(1, WAIT);
    assert_eq!(devs.len(), 1, "one function enumerated: {devs:?}");
    let f = devs[0].clone();
    assert_eq!(
        (f.vendor_id, f.device_id, f.class_code),
        (dma_engine::VENDOR_ID, dma_engine::DEVICE_ID, 0x088000)
    );
    assert_eq!(f.mac, pair.a.mac, "the function is on the device bridge's end");
    assert_eq!(f.group, 4);
    let bars: Vec<(usize, u64)> = f.bars.iter().map(|b| (b.index, b.size)).collect();
    assert_eq!(bars, vec![(0, 4096), (2, 4096)]);
    for b in &f.bars {
        assert_eq!(b.address % b.size, 0, "BAR aligned to its size");
        assert_eq!(b.kind, BarKind::Memory32 { prefetchable: false });
    }
    assert_eq!(f.msix_vectors(), dma_engine::MSIX_VECTORS);
    let caps: Vec<u8> = f.capabilities.iter().map(|c| c.0).collect();
    assert!(caps.contains(&cap_id::PCI_EXPRESS) && caps.contains(&cap_id::MSIX), "{caps:?}");
    assert_eq!(d.host(), Some(pair.b.mac), "the device serves the host on the other end");

    // Copies of 4 KiB ... 1 MiB from random offsets of a seeded 2 MiB source.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(29);
    let src_bytes: Vec<u8> = (0..2 << 20).map(|_| rng.random()).collect();
    h.add_region(SRC, DmaBuffer::from_vec(src_bytes.clone())).unwrap();
    let dst = DmaBuffer::new(1 << 20);
    h.add_region(DST, dst.clone()).unwrap();
    let efd = h.interrupt_eventfd(f.bdf, 0).unwrap();
    let called = Arc::new(AtomicU64::new(0));
    let (c2, bdf) = (called.clone(), f.bdf);
    h.on_interrupt(move |b, v| {
        if b == bdf && v == 0 {
            // Relaxed: a counter read after the bridge's interrupt count says all arrived.
            c2.fetch_add(1, Ordering::Relaxed);
        }
    });
    let sizes = [4096usize, 8192, 16384, 32768, 65536, 131072, 262144, 524288, 1 << 20];
    let (mut copied, mut n) = (0usize, 0u64);
    let start = Instant::now();
    // The 64 MiB, in rounds of every size (about 2 MiB each).
    while copied < 64 << 20 {
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
        "{test}: {:.1} MiB in {n} transfers, {secs:.2} s, {:.1} MB/s",
        copied as f64 / f64::from(1 << 20),
        copied as f64 / secs / 1e6
    );
    // Exactly one MSI-X per transfer: none extra arrives later.
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(h.interrupt_count(f.bdf, 0), n);
    assert_eq!(efd.take(), n, "the eventfd counted every interrupt");
    assert_eq!(called.load(Ordering::Relaxed), n, "the callback saw every interrupt");
    let hs = h.stats();
    assert_eq!((hs.unknown_address_reads, hs.spurious_interrupts, hs.timeouts), (0, 0, 0));
    assert_eq!(d.stats().dma_read_failures, 0);
    let rt = h.runtime_stats();
    assert!(rt.port.rx_frames > 0 && rt.port.tx_frames > 0, "frames went through the AF_XDP port: {rt:?}");
    d.shutdown();
    h.shutdown();
}

#[test]
fn afxdp_enumeration_and_dma_copies_run_to_completion() {
    enumerate_and_copy_over_afxdp(
        ThreadMode::RunToCompletion,
        "afxdp_enumeration_and_dma_copies_run_to_completion",
    );
}

#[test]
fn afxdp_enumeration_and_dma_copies_pipeline() {
    enumerate_and_copy_over_afxdp(ThreadMode::Pipeline, "afxdp_enumeration_and_dma_copies_pipeline");
}
