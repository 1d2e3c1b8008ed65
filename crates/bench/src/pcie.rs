//! `lanbus bench pcie`: DMA engine throughput and 4-byte MMIO read latency through the PCIe
//! bridges, over the simulated wire and real ports, against the same device in-process (`local`,
//! no fabric) as the ceiling.
//!
//! Each configuration (port, max payload size, thread mode) starts a host bridge and a device
//! bridge with the DMA engine, waits for enumeration, lends the device two host buffers, and
//! copies between them in transfers of each size (bytes checked after every size), then times
//! MMIO reads of the engine's status register. Rate control is off: one host, one device, no
//! congestion to control.
//!
//! Ports: `sim` (the simulated wire), and over a veth pair between two namespaces when root:
//! `udp`, `afpacket` and `afxdp` (each end's port opened on a thread inside its namespace);
//! without root, `udp` over loopback only. Each throughput value is the median of [`RUNS`] runs;
//! the `ratio` rows divide `afxdp` by `udp` at 4 KiB for each max payload size and thread mode
//! (the goal is 3x, the paper's +298%).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use lanbus_bridge::{
    DeviceBridge, DeviceBridgeConfig, DmaBuffer, HostBridge, HostBridgeConfig, HostedFunction, LocalBus,
    RemoteFunction,
};
use lanbus_pcie::dma_engine::{regs, DmaEngine};
use lanbus_port::{Port, SimWire, SimWireConfig};
use lanbus_runtime::ThreadMode;
use lanbus_wire::{Clock, MacAddr, MonotonicClock};

use super::report::{median, Report, Row};

/// Throughput runs per size; the median is reported.
const RUNS: usize = 3;

/// `lanbus bench pcie`.
#[derive(Debug, Args)]
pub struct PcieArgs {
    /// Fewer sizes, fewer repetitions, MPS 256 only.
    #[arg(long)]
    quick: bool,
    /// Write the rows as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

const SRC: u64 = 0x1_0000_0000;
const DST: u64 = 0x2_0000_0000;
const MAX: usize = 1 << 20;

fn mode_name(m: ThreadMode) -> &'static str {
    match m {
        ThreadMode::RunToCompletion => "rtc",
        ThreadMode::Pipeline => "pipeline",
        ThreadMode::Caller => "caller",
    }
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[2]).collect()
}

/// Something the DMA engine can be driven through.
trait Bus {
    /// Writes `data` at `offset` of BAR 0 in one request.
    fn write(&mut self, offset: u64, data: &[u8]) -> anyhow::Result<()>;
    fn read32(&mut self, offset: u64) -> anyhow::Result<u32>;
    /// Waits for the `n`-th interrupt.
    fn wait_irq(&mut self, n: u64) -> anyhow::Result<()>;
}

struct Remote<'a> {
    host: &'a HostBridge,
    f: RemoteFunction,
    bar0: u64,
}

impl Bus for Remote<'_> {
    fn write(&mut self, offset: u64, data: &[u8]) -> anyhow::Result<()> {
        Ok(self.host.mmio_write(self.f.bdf, self.bar0 + offset, data)?)
    }
    fn read32(&mut self, offset: u64) -> anyhow::Result<u32> {
        Ok(self.host.mmio_read32(self.f.bdf, self.bar0 + offset)?)
    }
    fn wait_irq(&mut self, n: u64) -> anyhow::Result<()> {
        if self.host.wait_interrupts(self.f.bdf, 0, n, Duration::from_secs(20)) < n {
            bail!("interrupt {n} did not arrive");
        }
        Ok(())
    }
}

struct Local {
    bus: LocalBus,
    bar0: u64,
}

impl Bus for Local {
    fn write(&mut self, offset: u64, data: &[u8]) -> anyhow::Result<()> {
        Ok(self.bus.mmio_write(0, self.bar0 + offset, data)?)
    }
    fn read32(&mut self, offset: u64) -> anyhow::Result<u32> {
        let mut b = [0u8; 4];
        self.bus.mmio_read(0, self.bar0 + offset, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }
    fn wait_irq(&mut self, n: u64) -> anyhow::Result<()> {
        if self.bus.interrupt_count(0, 0) < n {
            bail!("interrupt {n} did not arrive");
        }
        Ok(())
    }
}

/// Copies `len` bytes `reps` times, or fewer (at least 2) once `budget` is spent; returns MB/s.
fn throughput(
    bus: &mut dyn Bus,
    irqs: &mut u64,
    len: usize,
    reps: usize,
    budget: Duration,
) -> anyhow::Result<f64> {
    let start = Instant::now();
    let mut done = 0;
    while done < reps && (done < 2 || start.elapsed() < budget) {
        done += 1;
        *irqs += 1;
        // Source, destination, length and doorbell are consecutive registers: one 24-byte
        // write, as a driver posting a descriptor would (the engine takes its DWs in order).
        let mut descriptor = [0u8; 24];
        descriptor[0..8].copy_from_slice(&SRC.to_le_bytes());
        descriptor[8..16].copy_from_slice(&DST.to_le_bytes());
        descriptor[16..20].copy_from_slice(&(len as u32).to_le_bytes());
        descriptor[20..24].copy_from_slice(&1u32.to_le_bytes());
        bus.write(regs::SRC, &descriptor)?;
        bus.wait_irq(*irqs)?;
    }
    let secs = start.elapsed().as_secs_f64();
    let status = bus.read32(regs::STATUS)?;
    if status & regs::STATUS_ERROR != 0 {
        bail!("the DMA engine reports an error (status {status:#x})");
    }
    Ok((len * done) as f64 / secs / 1e6)
}

/// p50 and p99 of `n` 4-byte MMIO reads, in microseconds.
fn latency(bus: &mut dyn Bus, n: usize) -> anyhow::Result<(f64, f64)> {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        bus.read32(regs::STATUS)?;
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Ok((v[n / 2], v[(n * 99 / 100).min(n - 1)]))
}

struct Plan {
    sizes: Vec<usize>,
    /// Time spent on one size at most (beyond two transfers).
    budget: Duration,
    bytes_per_size: usize,
    reads: usize,
}

fn measure(
    report: &mut Report,
    name: &str,
    mps: usize,
    mode: &str,
    bus: &mut dyn Bus,
    dst: &DmaBuffer,
    plan: &Plan,
) -> anyhow::Result<()> {
    let src = pattern(MAX);
    let mut irqs = 0;
    for &size in &plan.sizes {
        dst.with(|b| b[..size].fill(0));
        let reps = (plan.bytes_per_size / size / RUNS).clamp(2, 2000);
        let mut runs = Vec::with_capacity(RUNS);
        for _ in 0..RUNS {
            runs.push(throughput(bus, &mut irqs, size, reps, plan.budget / RUNS as u32)?);
        }
        let mbs = median(&runs).context("no runs")?;
        if dst.read_vec(0, size) != src[..size] {
            bail!("{name}: {size}-byte transfer arrived corrupted");
        }
        report.push(
            Row::new(name, "mb_per_s", mbs)
                .with("mps", mps as u64)
                .with("mode", mode)
                .with("size_bytes", size as u64)
                .with("runs", RUNS as u64),
        );
    }
    let (p50, p99) = latency(bus, plan.reads)?;
    for (metric, v) in [("p50_us", p50), ("p99_us", p99)] {
        report.push(
            Row::new(name, metric, v).with("mps", mps as u64).with("mode", mode).with("size_bytes", 4u64),
        );
    }
    Ok(())
}

fn over_fabric(
    report: &mut Report,
    name: &str,
    ports: (Box<dyn Port>, Box<dyn Port>),
    mps: usize,
    mode: ThreadMode,
    plan: &Plan,
) -> anyhow::Result<()> {
    // No false "device down" under load while measuring: 2 s without heartbeats.
    let mut host_rt = lanbus_node::config::runtime_config("bench-host", mode);
    host_rt.transport.heartbeat.missed_limit = 20;
    let mut dev_rt = lanbus_node::config::runtime_config("bench-dev", mode);
    dev_rt.transport.heartbeat.missed_limit = 20;
    let hc = HostBridgeConfig {
        group: 1,
        mps,
        runtime: host_rt,
        completion_timeout: Duration::from_secs(5),
        ..HostBridgeConfig::default()
    };
    let dc = DeviceBridgeConfig {
        group: 1,
        runtime: dev_rt,
        completion_timeout: Duration::from_secs(5),
        ..DeviceBridgeConfig::default()
    };
    let host = HostBridge::start(ports.0, hc)?;
    let dev = DeviceBridge::start(ports.1, dc, vec![HostedFunction::model(DmaEngine::new())?])?;
    let devs = host.wait_devices(1, Duration::from_secs(10));
    let f = devs.first().cloned().with_context(|| format!("{name}: the device was not enumerated"))?;
    let dst = DmaBuffer::new(MAX);
    host.add_region(SRC, DmaBuffer::from_vec(pattern(MAX)))?;
    host.add_region(DST, dst.clone())?;
    let bar0 = f.bar(0).context("BAR0")?.address;
    let mut bus = Remote { host: &host, f, bar0 };
    let r = measure(report, name, mps, mode_name(mode), &mut bus, &dst, plan);
    drop(bus);
    dev.shutdown();
    host.shutdown();
    r
}

fn local(report: &mut Report, mps: usize, plan: &Plan) -> anyhow::Result<()> {
    let mut bus =
        LocalBus::new(vec![HostedFunction::model(DmaEngine::new())?], 0xe000_0000, 0xfee0_0000, mps, 512)?;
    let dst = DmaBuffer::new(MAX);
    bus.add_region(SRC, DmaBuffer::from_vec(pattern(MAX)))?;
    bus.add_region(DST, dst.clone())?;
    let bar0 = bus.bar_address(0, 0).context("BAR0")?;
    let mut b = Local { bus, bar0 };
    measure(report, "local", mps, "inline", &mut b, &dst, plan)
}

fn sim_ports() -> anyhow::Result<(Box<dyn Port>, Box<dyn Port>)> {
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let macs = [MacAddr([2, 0, 0, 0, 0x51, 1]), MacAddr([2, 0, 0, 0, 0x51, 2])];
    let (a, b) = SimWire::pair_realtime(SimWireConfig::default(), clock, macs)?;
    Ok((Box::new(a), Box::new(b)))
}

/// Runs the benchmark.
pub fn run(args: PcieArgs) -> anyhow::Result<()> {
    let plan = if args.quick {
        Plan {
            sizes: vec![4096, 65536, 1 << 20],
            budget: Duration::from_millis(500),
            bytes_per_size: 4 << 20,
            reads: 300,
        }
    } else {
        Plan {
            sizes: vec![4096, 16384, 65536, 262144, 1 << 20],
            budget: Duration::from_secs(2),
            bytes_per_size: 16 << 20,
            reads: 2000,
        }
    };
    let mpss: &[usize] = if args.quick { &[256] } else { &[128, 256, 512] };
    let modes = [ThreadMode::RunToCompletion, ThreadMode::Pipeline];
    let mut report = Report::new("pcie");
    let veth = match lanbus_port::netns::VethPair::create() {
        Ok(v) => Some(v),
        Err(skip) => {
            eprintln!("afpacket: {skip}; udp runs over loopback instead of a veth pair");
            None
        }
    };
    let mut kinds = vec!["udp"];
    if veth.is_some() {
        kinds.extend(["afpacket", "afxdp"]);
    }
    for &mps in mpss {
        local(&mut report, mps, &plan)?;
        for mode in modes {
            over_fabric(&mut report, "sim", sim_ports()?, mps, mode, &plan)?;
            for kind in &kinds {
                match super::port_pair(kind, veth.as_ref()) {
                    Ok(ports) => {
                        if let Err(e) = over_fabric(&mut report, kind, ports, mps, mode, &plan) {
                            eprintln!("{kind} mps {mps} {}: {e:#}", mode_name(mode));
                        }
                    }
                    Err(e) => eprintln!("{kind}: cannot open ({e:#}); skipped"),
                }
            }
        }
    }
    for &mps in mpss {
        for mode in modes {
            let at_4k = |name: &str| {
                report.rows.iter().find(|r| {
                    r.name == name
                        && r.metric == "mb_per_s"
                        && r.params.get("mps") == Some(&(mps as u64).into())
                        && r.params.get("mode") == Some(&mode_name(mode).into())
                        && r.params.get("size_bytes") == Some(&4096u64.into())
                })
            };
            match (at_4k("afxdp").map(|r| r.value), at_4k("udp").map(|r| r.value)) {
                (Some(x), Some(u)) if u > 0.0 => {
                    eprintln!("afxdp / udp at 4 KiB, mps {mps} {}: {:.2}x (goal 3x)", mode_name(mode), x / u);
                    report.push(
                        Row::new("ratio", "afxdp_over_udp", x / u)
                            .with("mps", mps as u64)
                            .with("mode", mode_name(mode))
                            .with("size_bytes", 4096u64),
                    );
                }
                _ => eprintln!("afxdp / udp at 4 KiB, mps {mps} {}: not measured", mode_name(mode)),
            }
        }
    }
    report.finish(args.json.as_deref())?;
    Ok(())
}
