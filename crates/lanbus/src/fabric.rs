//! The remote NVMe drive as the `lanbus` binary assembles it: the controller model hosted by a
//! device bridge, the user-space driver on a host bridge, and the namespace as an NBD
//! [`BlockDevice`].
//!
//! Layer: frontend glue (above `lanbus_nvme::pcie`, `lanbus_bridge` and `lanbus_nbd`). The
//! daemons, `lanbus demo`, `lanbus bench nvme` and the real-client tests all build the drive
//! through the functions here, so they measure and test the same path.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use lanbus_bridge::{
    DeviceBridge, DeviceBridgeConfig, HostBridge, HostBridgeConfig, HostedFunction, RemoteFunction,
};
use lanbus_nbd::{BlockDevice, DeviceError, Errno};
use lanbus_nvme::pcie::{attach, FunctionStats, NvmeFunction};
use lanbus_nvme::{
    Backing, CompletionMode, Controller, ControllerConfig, DriverConfig, DriverError, FileBacking,
    HostRegion, NvmeDriver, RamBacking,
};
use lanbus_port::{Port, SimWire, SimWireConfig};
use lanbus_runtime::{RuntimeConfig, ThreadMode};
use lanbus_wire::{Clock, MacAddr, MonotonicClock};

/// Bus address of the host memory region the driver's queues and buffers live in.
pub const DMA_REGION_BASE: u64 = 0x10_0000_0000;
/// Pages (4 KiB) of that region: 64 MiB, room for many NBD requests of the driver's window.
pub const DMA_REGION_PAGES: usize = 16 * 1024;

/// The namespace of an NVMe driver as an NBD block device.
pub struct NvmeBlock {
    drv: Arc<NvmeDriver>,
}

impl NvmeBlock {
    /// Exports `drv`'s namespace.
    pub fn new(drv: Arc<NvmeDriver>) -> NvmeBlock {
        NvmeBlock { drv }
    }
}

fn nbd_error(e: DriverError) -> DeviceError {
    let errno = match e.errno() {
        22 => Errno::Inval,
        12 => Errno::NoMem,
        95 => Errno::NotSup,
        _ => Errno::Io,
    };
    DeviceError::Device { errno, message: e.to_string() }
}

impl BlockDevice for NvmeBlock {
    fn size_bytes(&self) -> u64 {
        self.drv.size_bytes()
    }
    fn block_size(&self) -> u32 {
        self.drv.block_size()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        self.drv.read_at(offset, buf).map_err(nbd_error)
    }
    fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError> {
        self.drv.write_at(offset, data, fua).map_err(nbd_error)
    }
    fn flush(&self) -> Result<(), DeviceError> {
        self.drv.flush().map_err(nbd_error)
    }
    fn trim(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        self.drv.trim_at(offset, len).map_err(nbd_error)
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool) -> Result<(), DeviceError> {
        self.drv.write_zeroes_at(offset, len, may_trim).map_err(nbd_error)
    }
}

/// Where the namespace's blocks live: `file=PATH[,size=SIZE]` or `ram=SIZE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NvmeBacking {
    /// A file (created with `size` if given and missing or shorter; else used whole).
    File {
        /// The file.
        path: PathBuf,
        /// Its size, if given.
        size: Option<u64>,
    },
    /// RAM of this many bytes.
    Ram(u64),
}

impl std::str::FromStr for NvmeBacking {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<NvmeBacking> {
        let mut parts = s.split(',');
        let first = parts.next().unwrap_or("");
        let (kind, value) = first.split_once('=').context("expected file=PATH[,size=SIZE] or ram=SIZE")?;
        let mut size = None;
        for p in parts {
            match p.split_once('=') {
                Some(("size", v)) => size = Some(crate::nbd::parse_size(v)?),
                _ => bail!("unknown option {p:?} in {s:?}: expected size=SIZE"),
            }
        }
        match kind {
            "file" if !value.is_empty() => Ok(NvmeBacking::File { path: value.into(), size }),
            "ram" if size.is_none() => Ok(NvmeBacking::Ram(crate::nbd::parse_size(value)?)),
            _ => bail!("{s:?}: expected file=PATH[,size=SIZE] or ram=SIZE"),
        }
    }
}

/// Size of the controller's memory buffer (BAR2): the driver puts its submission queues, PRP
/// lists and write data there (8 requests of the driver's 2 MiB window), so commands and write
/// data reach the drive with posted writes rather than by the drive reading them.
pub const CMB_BYTES: u64 = 16 << 20;

/// A controller model over `backing` with `lba_size`-byte blocks (512 or 4096).
pub fn controller(backing: &NvmeBacking, lba_size: u32) -> anyhow::Result<Controller> {
    let store: Box<dyn Backing> = match backing {
        NvmeBacking::Ram(n) => Box::new(RamBacking::new(*n)),
        NvmeBacking::File { path, size: Some(n) } => {
            Box::new(FileBacking::open(path, *n).with_context(|| format!("opening {}", path.display()))?)
        }
        NvmeBacking::File { path, size: None } => Box::new(
            FileBacking::open_existing(path)
                .with_context(|| format!("opening {} (give size=SIZE to create it)", path.display()))?,
        ),
    };
    if store.len() < u64::from(lba_size) {
        bail!("the backing store is smaller than one {lba_size}-byte block");
    }
    let cfg = ControllerConfig { lba_size, cmb_bytes: CMB_BYTES, ..ControllerConfig::default() };
    Controller::new(cfg, store).map_err(|e| anyhow::anyhow!("NVMe controller: {e}"))
}

/// The controller as a function for a device bridge.
pub fn nvme_function(ctrl: Controller) -> anyhow::Result<(HostedFunction, Arc<FunctionStats>)> {
    NvmeFunction::hosted(ctrl).map_err(|e| anyhow::anyhow!("NVMe function: {e}"))
}

/// The runtime settings the daemons use on a port of this spec.
pub fn runtime_config(name: &str, threads: ThreadMode) -> RuntimeConfig {
    let mut c = RuntimeConfig { name: name.into(), threads, ..RuntimeConfig::default() };
    // Delay-based rate control reads a busy machine's scheduling delays as queueing and paces
    // down to its floor; one host and one device on a link do not need it.
    c.transport.rate.enabled = false;
    // A peer is down after 1 s without heartbeats (10 intervals), not 300 ms: on a loaded machine
    // a starved thread can miss three 100 ms beats, and a device that loses its host fails the
    // DMA of the command it is running (the controller then reports a fatal status).
    c.transport.heartbeat.missed_limit = 10;
    // Retransmission timeouts below a few milliseconds fire spuriously on a machine whose
    // threads are descheduled for that long (measured on the 2-core bench VM: every frame the
    // device resent after a timeout had arrived, and Go-Back-N resent its whole window each
    // time). A real loss in the middle of a burst is still repaired by fast retransmit.
    c.transport.min_rto = Duration::from_millis(5);
    // Frames as large as the port's link takes (the runtime lowers this to the port's MTU): a
    // 4 KiB TLP then needs two frames instead of three on a 3500-byte veth, one on jumbo frames.
    c.transport.mtu = 65_535;
    c
}

/// Host bridge settings for `group`.
pub fn host_config(group: u16, name: &str, threads: ThreadMode) -> HostBridgeConfig {
    HostBridgeConfig {
        group,
        name: name.into(),
        runtime: runtime_config(name, threads),
        completion_timeout: Duration::from_secs(2),
        // The largest payload PCIe allows (the drive supports it): a software bridge pays per
        // TLP, not per byte, so a 1 MiB transfer is 256 TLPs instead of 4,096 at 256 bytes
        // (`lanbus bench nvme`, afxdp, 64 KiB reads: 261 -> 407 MB/s, writes 165 -> 350).
        mps: 4096,
        mrrs: 4096,
        ..HostBridgeConfig::default()
    }
}

/// Device bridge settings for `group`.
pub fn device_config(group: u16, name: &str, threads: ThreadMode) -> DeviceBridgeConfig {
    DeviceBridgeConfig {
        group,
        name: name.into(),
        runtime: runtime_config(name, threads),
        completion_timeout: Duration::from_secs(2),
        ..DeviceBridgeConfig::default()
    }
}

/// How the daemons' driver learns of completions: polling the completion queue for a short
/// while, then sleeping on MSI-X (the fastest of the two in `lanbus bench nvme`: a completion
/// that arrives while the driver polls costs no wake-up).
pub const COMPLETION: CompletionMode = CompletionMode::Poll;

/// The driver settings the daemons use.
pub fn driver_config() -> DriverConfig {
    DriverConfig {
        io_queues: 4,
        io_timeout: Duration::from_secs(10),
        max_inflight_bytes: 2 << 20,
        completion: COMPLETION,
        ..DriverConfig::default()
    }
}

/// Starts the NVMe driver on function `f` of `host`.
pub fn start_driver(host: &Arc<HostBridge>, f: &RemoteFunction) -> anyhow::Result<Arc<NvmeDriver>> {
    start_driver_with(host, f, driver_config())
}

/// Starts the NVMe driver on function `f` of `host` with settings `cfg`.
pub fn start_driver_with(
    host: &Arc<HostBridge>,
    f: &RemoteFunction,
    cfg: DriverConfig,
) -> anyhow::Result<Arc<NvmeDriver>> {
    let region = Arc::new(HostRegion::new(DMA_REGION_BASE, DMA_REGION_PAGES));
    let drv = attach(host, f, region, cfg).with_context(|| format!("starting the driver on {}", f.bdf))?;
    Ok(Arc::new(drv))
}

/// Whether `f` is an NVMe controller.
pub fn is_nvme(f: &RemoteFunction) -> bool {
    f.class_code == 0x01_08_02
}

/// `lspci -v`-like lines for a remote function.
pub fn lspci(f: &RemoteFunction) -> String {
    crate::pcie::format_function(f)
}

/// A device bridge with one NVMe drive and a host bridge with its driver, in this process, joined
/// by the simulated wire on the real clock or by two real ports.
pub struct SimFabric {
    /// The host bridge.
    pub host: Arc<HostBridge>,
    /// The device bridge (taken by [`SimFabric::unplug`]).
    pub device: Option<DeviceBridge>,
    /// The enumerated function.
    pub function: RemoteFunction,
    /// The driver.
    pub driver: Arc<NvmeDriver>,
    /// The controller's counters.
    pub controller_stats: Arc<FunctionStats>,
}

impl SimFabric {
    /// Starts both bridges over a wire losing `loss` of frames each way (seeded), waits for
    /// enumeration and starts the driver.
    pub fn start(ctrl: Controller, loss: f64, seed: u64) -> anyhow::Result<SimFabric> {
        let (a, b) = SimFabric::sim_ports(loss, seed)?;
        SimFabric::over(ctrl, a, b)
    }

    /// The two ends of a simulated wire (10 Gbit/s) losing `loss` of frames each way.
    pub fn sim_ports(loss: f64, seed: u64) -> anyhow::Result<(Box<dyn Port>, Box<dyn Port>)> {
        let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
        let wire = SimWireConfig { loss, seed, ..SimWireConfig::default() };
        let macs = [MacAddr([2, 0x6c, 0x62, 0, 0, 1]), MacAddr([2, 0x6c, 0x62, 0, 0, 2])];
        let (a, b) = SimWire::pair_realtime(wire, clock, macs)?;
        Ok((Box::new(a), Box::new(b)))
    }

    /// The host bridge on `host_port`, the device bridge with the drive on `device_port`,
    /// enumeration, and the driver.
    pub fn over(
        ctrl: Controller,
        host_port: Box<dyn Port>,
        device_port: Box<dyn Port>,
    ) -> anyhow::Result<SimFabric> {
        SimFabric::over_with(ctrl, host_port, device_port, driver_config())
    }

    /// As [`SimFabric::over`], with driver settings `dcfg`.
    pub fn over_with(
        ctrl: Controller,
        host_port: Box<dyn Port>,
        device_port: Box<dyn Port>,
        dcfg: DriverConfig,
    ) -> anyhow::Result<SimFabric> {
        let mode = ThreadMode::RunToCompletion;
        let host = Arc::new(HostBridge::start(host_port, host_config(1, "fabric-host", mode))?);
        let (function, controller_stats) = nvme_function(ctrl)?;
        let device =
            DeviceBridge::start(device_port, device_config(1, "fabric-iobox", mode), vec![function])?;
        let devs = host.wait_devices(1, Duration::from_secs(10));
        let function = devs.into_iter().next().context("the host bridge enumerated nothing in 10 s")?;
        let driver = start_driver_with(&host, &function, dcfg)?;
        Ok(SimFabric { host, device: Some(device), function, driver, controller_stats })
    }

    /// Stops the device bridge (as if the I/O box went away).
    pub fn unplug(&mut self) {
        if let Some(d) = self.device.take() {
            d.shutdown();
        }
    }
}

/// Real clients (fio, qemu-img: `scripts/setup` installs them) against the drive over the
/// simulated wire with loss, through the NBD export. Without the tools a test says so and passes
/// nothing else off as checked.
#[cfg(test)]
mod real_clients {
    use std::path::{Path, PathBuf};
    use std::process::Command;

    use lanbus_nbd::{Export, Server};
    use rand::SeedableRng;

    use super::*;

    struct Exported {
        fabric: SimFabric,
        server: Server,
        dir: PathBuf,
        uri: String,
    }

    impl Drop for Exported {
        fn drop(&mut self) {
            let _ = self.server.shutdown();
            let _ = self.fabric.driver.shutdown();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn export(name: &str, size: u64, loss: f64, seed: u64) -> Exported {
        let ctrl = controller(&NvmeBacking::Ram(size), 512).unwrap();
        export_fabric(name, SimFabric::start(ctrl, loss, seed).unwrap())
    }

    fn export_fabric(name: &str, fabric: SimFabric) -> Exported {
        let dir = std::env::temp_dir().join(format!("lanbus-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let server = Server::builder()
            .export(Export::new("nvme0", Arc::new(NvmeBlock::new(fabric.driver.clone()))))
            .log(true)
            .build()
            .unwrap();
        let socket = dir.join("nvme0.sock");
        server.serve(std::os::unix::net::UnixListener::bind(&socket).unwrap()).unwrap();
        let uri = format!("nbd+unix:///nvme0?socket={}", socket.display());
        Exported { fabric, server, dir, uri }
    }

    fn have(tool: &str, arg: &str) -> bool {
        let ok = Command::new(tool).arg(arg).output().is_ok_and(|o| o.status.success());
        if !ok {
            eprintln!("SKIPPED: {tool} is not installed (scripts/setup installs it)");
        }
        ok
    }

    fn fio_verify(uri: &str, dir: &Path, bs: &str) {
        let out = Command::new("fio")
            .args(["--name=verify", "--ioengine=nbd", "--rw=randwrite", "--verify=crc32c", "--do_verify=1"])
            .args(["--verify_fatal=1", "--size=8M", "--iodepth=1", "--numjobs=1"])
            .arg(format!("--bs={bs}"))
            .arg(format!("--uri={uri}"))
            .current_dir(dir)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "fio {bs}: {text}\n{}", String::from_utf8_lossy(&out.stderr));
        assert!(text.contains("err= 0"), "fio {bs}: {text}");
    }

    #[test]
    fn fio_random_write_then_verify_at_4k_and_128k_over_a_lossy_wire() {
        if !have("fio", "--version") {
            return;
        }
        let e = export("fio", 32 << 20, 0.005, 3);
        let diag = |e: &Exported| {
            format!(
                "host bridge {:?}, controller {:?}",
                e.fabric.host.stats(),
                e.fabric.controller_stats.get()
            )
        };
        let r = std::panic::catch_unwind(|| {
            fio_verify(&e.uri, &e.dir, "4k");
            fio_verify(&e.uri, &e.dir, "128k");
        });
        assert!(r.is_ok(), "{}", diag(&e));
        let rt = e.fabric.host.runtime_stats();
        assert!(rt.transport.retransmitted_frames > 0, "the wire lost frames and the transport resent them");
    }

    #[test]
    fn qemu_img_convert_then_compare_64_mib_over_a_lossy_wire() {
        if !have("qemu-img", "--version") {
            return;
        }
        qemu_img_round_trip(&export("qemu", 64 << 20, 0.005, 4));
    }

    /// fio and qemu-img over AF_XDP sockets on a veth pair between two network namespaces.
    #[test]
    fn fio_and_qemu_img_over_afxdp_on_a_veth_pair() {
        if !have("fio", "--version") || !have("qemu-img", "--version") {
            return;
        }
        let veth = match lanbus_port::netns::VethPair::create() {
            Ok(v) => v,
            Err(skip) => {
                eprintln!("SKIPPED: {skip}");
                return;
            }
        };
        let open = |i: String| {
            move || -> Result<Box<dyn Port>, String> {
                let o = lanbus_port::afxdp::AfXdpOptions::default();
                lanbus_port::afxdp::open(&i, 0, &o)
                    .map(|p| Box::new(p) as Box<dyn Port>)
                    .map_err(|e| e.to_string())
            }
        };
        let a = veth.a.netns.run(open(veth.a.ifname.clone())).unwrap();
        let b = veth.b.netns.run(open(veth.b.ifname.clone())).unwrap();
        let (a, b) = match (a, b) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("SKIPPED: AF_XDP unavailable here: {e}");
                return;
            }
        };
        let ctrl = controller(&NvmeBacking::Ram(64 << 20), 512).unwrap();
        let e = export_fabric("afxdp", SimFabric::over(ctrl, a, b).unwrap());
        fio_verify(&e.uri, &e.dir, "4k");
        fio_verify(&e.uri, &e.dir, "128k");
        qemu_img_round_trip(&e);
        assert!(e.fabric.host.runtime_stats().port.rx_frames > 1000);
    }

    fn qemu_img_round_trip(e: &Exported) {
        let image = e.dir.join("random.img");
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let mut data = vec![0u8; 64 << 20];
        rand::RngCore::fill_bytes(&mut rng, &mut data);
        std::fs::write(&image, &data).unwrap();
        let run = |args: &[&str]| {
            let out = Command::new("qemu-img").args(args).output().unwrap();
            let all =
                format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert!(out.status.success(), "qemu-img {args:?}: {all}");
            all
        };
        let img = image.to_str().unwrap();
        run(&["convert", "-n", "-f", "raw", "-O", "raw", img, &e.uri]);
        let out = run(&["compare", "-f", "raw", "-F", "raw", img, &e.uri]);
        assert!(out.contains("identical"), "{out}");
        // And a change is seen: compare must be able to fail.
        data[12345] ^= 0xff;
        std::fs::write(&image, &data).unwrap();
        let out = Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw", img, &e.uri])
            .output()
            .unwrap();
        assert!(!out.status.success(), "a changed byte is found");
    }
}
