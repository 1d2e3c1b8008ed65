//! A host and an I/O box in one process: a device bridge with the NVMe drive and a host bridge
//! with its driver, joined by the simulated wire on the real clock or by two real ports.
//!
//! Layer: assembly. `lanbus demo`, `lanbus bench nvme` and the real-client tests run the drive
//! this way.

use std::sync::Arc;
use std::time::Duration;

use lanbus_bridge::{DeviceBridge, HostBridge, RemoteFunction};
use lanbus_nvme::pcie::FunctionStats;
use lanbus_nvme::{Controller, DriverConfig, NvmeDriver};
use lanbus_port::{Port, SimWire, SimWireConfig};
use lanbus_runtime::ThreadMode;
use lanbus_wire::{Clock, MacAddr, MonotonicClock};

use crate::config::{device_config, host_config};
use crate::drive::{driver_config, nvme_function, start_driver_with};
use crate::{Error, Result};

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
    pub fn start(ctrl: Controller, loss: f64, seed: u64) -> Result<SimFabric> {
        let (a, b) = SimFabric::sim_ports(loss, seed)?;
        SimFabric::over(ctrl, a, b)
    }

    /// The two ends of a simulated wire (10 Gbit/s) losing `loss` of frames each way.
    pub fn sim_ports(loss: f64, seed: u64) -> Result<(Box<dyn Port>, Box<dyn Port>)> {
        let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
        let wire = SimWireConfig { loss, seed, ..SimWireConfig::default() };
        let macs = [MacAddr([2, 0x6c, 0x62, 0, 0, 1]), MacAddr([2, 0x6c, 0x62, 0, 0, 2])];
        let (a, b) = SimWire::pair_realtime(wire, clock, macs)?;
        Ok((Box::new(a), Box::new(b)))
    }

    /// The host bridge on `host_port`, the device bridge with the drive on `device_port`,
    /// enumeration, and the driver.
    pub fn over(ctrl: Controller, host_port: Box<dyn Port>, device_port: Box<dyn Port>) -> Result<SimFabric> {
        SimFabric::over_with(ctrl, host_port, device_port, driver_config())
    }

    /// As [`SimFabric::over`], with driver settings `dcfg`.
    pub fn over_with(
        ctrl: Controller,
        host_port: Box<dyn Port>,
        device_port: Box<dyn Port>,
        dcfg: DriverConfig,
    ) -> Result<SimFabric> {
        let mode = ThreadMode::RunToCompletion;
        let host = Arc::new(HostBridge::start(host_port, host_config(1, "fabric-host", mode))?);
        let (function, controller_stats) = nvme_function(ctrl)?;
        let device =
            DeviceBridge::start(device_port, device_config(1, "fabric-iobox", mode), vec![function])?;
        let wait = Duration::from_secs(10);
        let function = host.wait_devices(1, wait).into_iter().next().ok_or(Error::NoDevice(wait))?;
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
    use crate::drive::{controller, NvmeBacking, NvmeBlock};

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

    fn fio_verify(uri: &str, dir: &Path, bs: &str, iodepth: u32) {
        let out = Command::new("fio")
            .args(["--name=verify", "--ioengine=nbd", "--rw=randwrite", "--verify=crc32c", "--do_verify=1"])
            .args(["--verify_fatal=1", "--size=8M", "--numjobs=1"])
            .arg(format!("--iodepth={iodepth}"))
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
            fio_verify(&e.uri, &e.dir, "4k", 1);
            fio_verify(&e.uri, &e.dir, "128k", 1);
        });
        assert!(r.is_ok(), "{}", diag(&e));
        let rt = e.fabric.host.runtime_stats();
        assert!(rt.transport.retransmitted_frames > 0, "the wire lost frames and the transport resent them");
    }

    /// The same with the driver's queues and write data in host memory (the drive reads each
    /// command and each write's data across the fabric, several at once) and many requests in
    /// flight.
    #[test]
    fn fio_verify_at_depth_with_the_queues_in_host_memory_over_a_lossy_wire() {
        if !have("fio", "--version") {
            return;
        }
        let ctrl = controller(&NvmeBacking::Ram(32 << 20), 512).unwrap();
        let (host_port, device_port) = SimFabric::sim_ports(0.005, 5).unwrap();
        let dcfg = DriverConfig { use_cmb: false, ..driver_config() };
        let e =
            export_fabric("fio-hostmem", SimFabric::over_with(ctrl, host_port, device_port, dcfg).unwrap());
        let r = std::panic::catch_unwind(|| {
            fio_verify(&e.uri, &e.dir, "4k", 16);
            fio_verify(&e.uri, &e.dir, "128k", 16);
        });
        assert!(
            r.is_ok(),
            "host bridge {:?}, controller {:?}",
            e.fabric.host.stats(),
            e.fabric.controller_stats.get()
        );
        let (c, _) = e.fabric.controller_stats.get();
        assert!(c.sq_fetches > 0, "the drive fetched its commands from host memory: {c:?}");
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
            move || -> core::result::Result<Box<dyn Port>, String> {
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
        fio_verify(&e.uri, &e.dir, "4k", 1);
        fio_verify(&e.uri, &e.dir, "128k", 1);
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
