//! The host: a host bridge that enumerates its group's functions and exports them as they come
//! and go.
//!
//! Layer: assembly, over `lanbus-bridge`, the NVMe and virtio-net drivers and the frontends (NBD,
//! vhost-user-blk, vhost-user-net, vfio-user, TAP). `lanbus host` is argument parsing over
//! [`Host`]; `lanbus demo` starts the same type.
//!
//! Lifecycle of an export: when a device bridge of our group appears with an NVMe controller,
//! the driver starts and the drive is exported (NBD, vhost-user-blk), or the raw function is
//! given to vfio-user clients; a virtio-net function becomes the TAP's carrier or a
//! vhost-user-net backend. When the device goes (its heartbeats stop, or it leaves the group) the
//! export stops and its socket file is removed: requests in flight fail with an error (the
//! bridge answers at once for a device it no longer has), new clients find no socket.
//! [`Host::shutdown`]: stop accepting, finish the requests in flight, NVMe Flush, NVMe shutdown
//! notification.
//!
//! One thread of the host's own watches the bridge's events; lifecycle notices ("exporting ...",
//! "unexported ...") go to the host's `notice` callback, which the daemon prints.

use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use lanbus_bridge::{HostBridge, HostEvent, RemoteFunction};
use lanbus_nbd::{Export, Server};
use lanbus_nvme::NvmeDriver;
use lanbus_port::Port;
use lanbus_runtime::ThreadMode;
use lanbus_vhost::{
    serve_blk, serve_net, serve_vfio_user, BlkOptions, BlkServer, NetLink, NetServer, VfioUserServer,
};
use lanbus_vnet::driver::NetDriver;
use lanbus_vnet::pcie::TapExport;
use lanbus_vnet::tap::Tap;
use serde_json::{json, Value};

use crate::config::{self, ExportSpec};
use crate::drive::{self, NvmeBlock};
use crate::metrics::{self, Sample};
use crate::{Error, Result};

/// Where a host's lifecycle notices go.
pub type Notice = dyn Fn(&str) + Send + Sync;

/// What a host exports, and how it runs.
#[derive(Debug, Clone)]
pub struct HostOptions {
    /// Our group: we use the devices that announce it.
    pub group: u16,
    /// The name announced in heartbeats.
    pub name: String,
    /// Thread model of the transport.
    pub threads: ThreadMode,
    /// What to export (at least one).
    pub exports: Vec<ExportSpec>,
    /// The authentication layer's report, where the port is keyed (shown in status).
    pub security: Option<lanbus_secure::SecurityView>,
    /// Duplicate ACKs that count a frame lost (the transport's default if unset; the
    /// retransmission paper's rule is 1).
    pub dup_acks: Option<u32>,
}

impl HostOptions {
    /// A host of `group` exporting `exports`, run to completion.
    pub fn new(group: u16, name: &str, exports: Vec<ExportSpec>) -> HostOptions {
        HostOptions {
            group,
            name: name.into(),
            threads: ThreadMode::RunToCompletion,
            exports,
            security: None,
            dup_acks: None,
        }
    }
}

/// The exports asked for, checked against each other.
struct Plan {
    /// The drive's namespace over NBD and/or vhost-user-blk.
    drive: Option<Vec<ExportSpec>>,
    /// The raw NVMe function to vfio-user clients.
    raw: Option<PathBuf>,
    /// Where the NIC goes.
    nic: Option<NicTarget>,
}

impl Plan {
    fn new(specs: &[ExportSpec]) -> Result<Plan> {
        let bad = |s: &str| Err(Error::BadSpec(s.into()));
        if specs.is_empty() {
            return bad(
                "give --export nbd:PATH, nbd:tcp:ADDR, vhost-user-blk:PATH, vfio-user:PATH, tap:NAME or \
                        vhost-user-net:PATH",
            );
        }
        let nbd_count = specs.iter().filter(|s| s.is_nbd()).count();
        let vhost_count = specs.iter().filter(|s| matches!(s, ExportSpec::VhostUserBlk { .. })).count();
        let nic_specs: Vec<&ExportSpec> = specs.iter().filter(|s| s.is_nic()).collect();
        if nbd_count > 1 || vhost_count > 1 {
            return bad("one export of each kind at most: nbd:... and vhost-user-blk:...");
        }
        if nic_specs.len() > 1 {
            return bad("the NIC goes to one place: tap:NAME or vhost-user-net:PATH, once");
        }
        let drive: Vec<ExportSpec> = specs.iter().filter(|s| s.is_drive()).cloned().collect();
        let raw =
            match specs.iter().filter(|s| s.is_raw()).collect::<Vec<_>>()[..] {
                [] => None,
                [ExportSpec::VfioUser(p)] if drive.is_empty() => Some(p.clone()),
                [_] => return bad(
                    "vfio-user gives the whole NVMe function to a VMM: it cannot be combined with nbd or \
                            vhost-user-blk, which run this host's driver on it",
                ),
                _ => return bad("one vfio-user export at most"),
            };
        // A TAP exists from the start, its carrier off until a NIC appears; a vhost-user-net
        // socket only while the NIC is there.
        let nic = match nic_specs.first() {
            Some(ExportSpec::Tap(n)) => {
                let fail = |e: std::io::Error| Error::Io { what: format!("creating TAP {n}"), source: e };
                let t = Tap::open(n).map_err(fail)?;
                t.set_carrier(false).map_err(fail)?;
                t.configure(None, None, true).map_err(fail)?;
                Some(NicTarget::Tap(Arc::new(t)))
            }
            Some(ExportSpec::VhostUserNet(path)) => Some(NicTarget::Vhost(path.clone())),
            _ => None,
        };
        Ok(Plan { drive: (!drive.is_empty()).then_some(drive), raw, nic })
    }

    fn waiting_for(&self) -> &'static str {
        match (self.drive.is_some() || self.raw.is_some(), self.nic.is_some()) {
            (true, true) => "an NVMe device and a NIC",
            (true, false) => "an NVMe device",
            _ => "a NIC",
        }
    }
}

/// A running host.
pub struct Host {
    shared: Arc<Shared>,
    watcher: Option<JoinHandle<()>>,
}

/// What the host's watcher thread and its callers share.
struct Shared {
    bridge: Arc<HostBridge>,
    options: HostOptions,
    plan: Plan,
    drive: Mutex<Option<Exported>>,
    nic: Mutex<Option<NicExported>>,
    raw: Mutex<Option<(RemoteFunction, VfioUserServer)>>,
    stop: AtomicBool,
    /// Why the watcher ended early (the bridge stopped).
    failed: Mutex<Option<String>>,
    notice: Box<Notice>,
}

fn guard<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Host {
    /// Checks the exports, starts the host bridge on `port` and the thread that exports what
    /// appears; `notice` receives each lifecycle notice as one line.
    pub fn start(port: Box<dyn Port>, options: HostOptions, notice: Box<Notice>) -> Result<Host> {
        let plan = Plan::new(&options.exports)?;
        let mut config = config::host_config(options.group, &options.name, options.threads);
        if let Some(n) = options.dup_acks {
            config.runtime.transport.dup_ack_threshold = n;
        }
        let bridge = Arc::new(HostBridge::start(port, config)?);
        let events = bridge.subscribe();
        let shared = Arc::new(Shared {
            bridge,
            options,
            plan,
            drive: Mutex::new(None),
            nic: Mutex::new(None),
            raw: Mutex::new(None),
            stop: AtomicBool::new(false),
            failed: Mutex::new(None),
            notice,
        });
        let s = shared.clone();
        let watcher = std::thread::Builder::new()
            .name("lanbus-host".into())
            .spawn(move || s.watch(events))
            .map_err(|e| Error::Io { what: "starting the host's thread".into(), source: e })?;
        Ok(Host { shared, watcher: Some(watcher) })
    }

    /// The host bridge.
    pub fn bridge(&self) -> &Arc<HostBridge> {
        &self.shared.bridge
    }

    /// What the host waits for: "an NVMe device", "a NIC" or both.
    pub fn waiting_for(&self) -> &'static str {
        self.shared.plan.waiting_for()
    }

    /// Whether the host still runs; when not, [`Host::failure`] says why.
    pub fn running(&self) -> bool {
        self.watcher.as_ref().is_some_and(|w| !w.is_finished())
    }

    /// Why the host stopped by itself, if it did.
    pub fn failure(&self) -> Option<String> {
        guard(&self.shared.failed).clone()
    }

    /// The drive's NVMe driver while the drive is exported.
    pub fn driver(&self) -> Option<Arc<NvmeDriver>> {
        guard(&self.shared.drive).as_ref().map(|e| e.driver.clone())
    }

    /// The drive's export addresses (NBD URIs, vhost-user-blk sockets) while it is exported.
    pub fn export_uris(&self) -> Vec<String> {
        guard(&self.shared.drive).as_ref().map(|e| e.uris.clone()).unwrap_or_default()
    }

    /// The NBD server's counters while the drive is exported over NBD.
    pub fn nbd_stats(&self) -> Option<lanbus_nbd::Stats> {
        guard(&self.shared.drive).as_ref().and_then(|e| e.server.as_ref()).map(|s| s.stats())
    }

    /// Waits up to `timeout` for the drive to be exported; returns its driver.
    pub fn wait_exported(&self, timeout: Duration) -> Option<Arc<NvmeDriver>> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(d) = self.driver() {
                return Some(d);
            }
            if std::time::Instant::now() >= deadline || !self.running() {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Every counter, as the metrics endpoint serves them.
    pub fn samples(&self) -> Vec<Sample> {
        self.shared.samples()
    }

    /// The state `lanbus status` shows.
    pub fn status(&self) -> Value {
        self.shared.status()
    }

    /// Answers one control line: `status` or `status json`.
    pub fn answer(&self, line: &str) -> String {
        if line != "status" && line != "status json" {
            return format!("error: unknown command {line:?} (want `status`)");
        }
        self.status().to_string()
    }

    /// Stops exporting (requests in flight finish, the drive is flushed and told of the
    /// shutdown), then stops the bridge.
    pub fn shutdown(mut self) {
        self.stop_watcher();
        let s = &self.shared;
        (s.notice)("stopping: finishing requests in flight, flushing");
        let e = guard(&s.drive).take();
        if let (Some(e), Some(spec)) = (e, &s.plan.drive) {
            s.unexport(e, spec, "shutting down");
        }
        if let Some((_, server)) = guard(&s.raw).take() {
            server.stop();
        }
        if let Some(n) = guard(&s.nic).take() {
            n.stop(true);
        }
        match Arc::try_unwrap(self.shared.bridge.clone()) {
            Ok(h) => h.shutdown(),
            Err(h) => drop(h),
        }
    }

    fn stop_watcher(&mut self) {
        // Relaxed: the flag only asks the watcher to end; the join orders the rest.
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(w) = self.watcher.take() {
            let _ = w.join();
        }
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.stop_watcher();
    }
}

impl Shared {
    fn notice(&self, line: &str) {
        (self.notice)(line)
    }

    /// The watcher: exports what appears, unexports what goes, until stopped.
    fn watch(&self, events: Receiver<HostEvent>) {
        let mut pending: Vec<RemoteFunction> = self.bridge.devices();
        // Relaxed: polled; `Host::stop_watcher` only sets it.
        while !self.stop.load(Ordering::Relaxed) {
            for f in pending.drain(..) {
                self.appeared(&f);
            }
            match events.recv_timeout(Duration::from_millis(100)) {
                Ok(HostEvent::DeviceAdded(f)) => pending.push(f),
                Ok(HostEvent::DeviceRemoved { bdf, mac, reason }) => {
                    let same = |f: &RemoteFunction| f.bdf == bdf && f.mac == mac;
                    let e = { guard(&self.drive).take_if(|e| same(&e.function)) };
                    if let (Some(e), Some(spec)) = (e, &self.plan.drive) {
                        self.unexport(e, spec, &format!("device {bdf} removed: {reason}"));
                    }
                    let r = { guard(&self.raw).take_if(|(f, _)| same(f)) };
                    if let Some((_, server)) = r {
                        server.stop();
                        self.notice(&format!("{bdf} removed ({reason}); vfio-user socket gone"));
                    }
                    let n = { guard(&self.nic).take_if(|n| same(&n.function)) };
                    if let Some(n) = n {
                        n.stop(false);
                        self.notice(&format!("NIC {bdf} removed ({reason}); unexported"));
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    *guard(&self.failed) = Some("the host bridge stopped".into());
                    return;
                }
            }
        }
    }

    /// Exports a function that appeared, if it is one we want and have not exported yet.
    fn appeared(&self, f: &RemoteFunction) {
        let found = || self.notice(&format!("found\n{}", crate::lspci::describe(f).trim_end()));
        if let (Some(spec), true) = (&self.plan.drive, drive::is_nvme(f)) {
            if guard(&self.drive).is_none() {
                found();
                match export(&self.bridge, f, spec) {
                    Ok(e) => {
                        self.notice(&format!("exporting {} as {}", f.bdf, e.uris.join(" and ")));
                        *guard(&self.drive) = Some(e);
                    }
                    Err(err) => self.notice(&format!("cannot export {}: {err}", f.bdf)),
                }
            }
        }
        if let (Some(path), true) = (&self.plan.raw, drive::is_nvme(f)) {
            if guard(&self.raw).is_none() {
                found();
                match serve_vfio_user(path, self.bridge.clone(), f.clone()) {
                    Ok(server) => {
                        self.notice(&format!("giving {} to vfio-user clients at {}", f.bdf, path.display()));
                        *guard(&self.raw) = Some((f.clone(), server));
                    }
                    Err(err) => self.notice(&format!("cannot serve {} over vfio-user: {err}", f.bdf)),
                }
            }
        }
        if let (Some(t), true) = (&self.plan.nic, lanbus_vnet::pcie::is_nic(f)) {
            if guard(&self.nic).is_none() {
                found();
                match export_nic(&self.bridge, f, t) {
                    Ok(n) => {
                        let d = n.driver();
                        self.notice(&format!(
                            "NIC {} is {} ({}, MTU {}), features {:#x}",
                            f.bdf,
                            t.name(),
                            lanbus_wire::MacAddr(d.mac()),
                            d.mtu(),
                            d.features()
                        ));
                        *guard(&self.nic) = Some(n);
                    }
                    Err(err) => self.notice(&format!("cannot use NIC {}: {err}", f.bdf)),
                }
            }
        }
    }

    fn samples(&self) -> Vec<Sample> {
        let mut out = Vec::new();
        metrics::runtime_samples(&self.bridge.runtime_stats(), &mut out);
        metrics::path_samples(&self.bridge.paths(), &mut out);
        metrics::host_bridge_samples(&self.bridge, &mut out);
        let drive = guard(&self.drive);
        if let Some(e) = drive.as_ref() {
            out.push(Sample::counter(
                "nvme_driver_bytes_copied_total",
                "Bytes the NVMe driver copied into and out of its DMA memory.",
                e.driver.stats().copy_bytes.load(Ordering::Relaxed),
            ));
        }
        let exported = drive.is_some() || guard(&self.raw).is_some();
        drop(drive);
        out.push(Sample::gauge("exported", "1 while the drive is exported.", f64::from(u8::from(exported))));
        let nic = guard(&self.nic);
        if let Some(n) = nic.as_ref() {
            metrics::nic_driver_samples(n.driver(), &mut out);
        }
        out.push(Sample::gauge(
            "nic_up",
            "1 while the remote NIC is exported.",
            f64::from(u8::from(nic.is_some())),
        ));
        out
    }

    fn status(&self) -> Value {
        // Before the exports' locks below: collecting takes them too.
        let metrics = metrics::json(&self.samples());
        let devices = self.bridge.devices();
        let mut peers: Vec<Value> = Vec::new();
        for f in &devices {
            let p = json!({"mac": f.mac.to_string(), "name": f.name, "role": "device", "group": f.group});
            if !peers.contains(&p) {
                peers.push(p);
            }
        }
        let nic_name = self.plan.nic.as_ref().map(NicTarget::name).unwrap_or_default();
        let nic_status = guard(&self.nic).as_ref().map(|n| nic_json(n, &nic_name));
        let raw_status = guard(&self.raw).as_ref().map(|(f, server)| vfio_json(f, server));
        let cur = guard(&self.drive);
        let hb = self.bridge.stats();
        let export = cur
            .as_ref()
            .map(|e| e.uris.join(" "))
            .or_else(|| raw_status.as_ref().and_then(|r| r["export"].as_str().map(String::from)));
        json!({
            "role": "host",
            "name": self.options.name,
            "mac": self.bridge.local_mac().to_string(),
            "group": self.options.group,
            "vlan": self.bridge.vlan(),
            "peers": peers,
            "devices": devices.iter().map(crate::lspci::describe).collect::<Vec<_>>(),
            "export": export,
            "queues": cur.as_ref().map(|e| json!({
                "io_queue_pairs": e.driver.io_queue_count(),
                "commands": e.driver.stats().commands.load(Ordering::Relaxed),
                "interrupts": e.driver.stats().interrupts.load(Ordering::Relaxed),
                "stray_completions": e.driver.stats().stray_completions.load(Ordering::Relaxed),
            })),
            "nbd": cur.as_ref().and_then(|e| e.server.as_ref()).map(|s| format!("{:?}", s.stats())),
            "vhost_user_blk": cur.as_ref().and_then(|e| e.vhost.as_ref()).map(vhost_json),
            "vfio_user": raw_status,
            "nic": nic_status,
            "completion_timeouts": hb.timeouts,
            "bridge": format!("{hb:?}"),
            "paths": metrics::paths_json(&self.bridge.paths()),
            "security": crate::security::status_json(self.options.security.as_ref()),
            "metrics": metrics,
        })
    }

    /// Stops exporting: new clients find no socket, requests in flight finish or fail, then
    /// flush (if the device is still there) and NVMe shutdown.
    fn unexport(&self, e: Exported, specs: &[ExportSpec], why: &str) {
        let uris = e.uris.join(", ");
        let had_vhost = e.vhost.is_some();
        if let Some(v) = e.vhost {
            // Disconnects the VMM after the requests in progress; its guest sees the disk stall
            // until the VMM reconnects to a new export.
            v.stop();
        }
        // The NBD server wakes its accept thread by connecting to the socket: remove the file after.
        let result = e.server.map(|s| s.shutdown());
        for spec in specs {
            if let ExportSpec::Unix(path) = spec {
                let _ = std::fs::remove_file(path);
            }
        }
        match result {
            Some(Err(err)) => self.notice(&format!("unexported {uris} ({why}): {err}")),
            Some(Ok(stats)) => self.notice(&format!("unexported {uris} ({why}); {stats:?}")),
            None => self.notice(&format!("unexported {uris} ({why})")),
        }
        // The NBD server flushed at its shutdown; a vhost-user-blk guest's writes are flushed here
        // (if the device is still there) before the shutdown notification.
        if had_vhost {
            match e.driver.flush() {
                Ok(()) => self.notice(&format!("flushed {}", e.function.bdf)),
                Err(err) => self.notice(&format!("NVMe flush of {}: {err}", e.function.bdf)),
            }
        }
        if let Err(err) = e.driver.shutdown() {
            self.notice(&format!("NVMe shutdown of {}: {err}", e.function.bdf));
        }
    }
}

/// The exported drive: one NVMe driver, over NBD, vhost-user-blk or both.
struct Exported {
    function: RemoteFunction,
    driver: Arc<NvmeDriver>,
    server: Option<Server>,
    vhost: Option<BlkServer>,
    uris: Vec<String>,
}

fn failed(what: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.to_string();
    move |source| Error::Io { what, source }
}

fn export(host: &Arc<HostBridge>, f: &RemoteFunction, specs: &[ExportSpec]) -> Result<Exported> {
    let driver = drive::start_driver(host, f)?;
    let block = Arc::new(NvmeBlock::new(driver.clone()));
    let mut e = Exported { function: f.clone(), driver, server: None, vhost: None, uris: Vec::new() };
    for spec in specs {
        if let Err(err) = export_one(&mut e, &block, spec) {
            // What was exported already goes again; the driver is shut down.
            let (server, vhost) = (e.server.take(), e.vhost.take());
            if let Some(v) = vhost {
                v.stop();
            }
            if let Some(s) = server {
                let _ = s.shutdown();
            }
            for spec in specs {
                if let ExportSpec::Unix(path) = spec {
                    let _ = std::fs::remove_file(path);
                }
            }
            let _ = e.driver.shutdown();
            return Err(err);
        }
    }
    Ok(e)
}

fn export_one(e: &mut Exported, block: &Arc<NvmeBlock>, spec: &ExportSpec) -> Result<()> {
    let f = &e.function;
    match spec {
        ExportSpec::Unix(_) | ExportSpec::Tcp(_) => {
            let server = Server::builder()
                .export(
                    Export::new("nvme0", block.clone())
                        .description(format!("lanbus NVMe {} on {} \"{}\"", f.bdf, f.mac, f.name)),
                )
                .build()
                .map_err(|err| Error::Export(format!("the NBD server: {err}")))?;
            let uri = match spec {
                ExportSpec::Unix(path) => {
                    if path.exists() {
                        std::fs::remove_file(path)
                            .map_err(failed(format!("removing stale {}", path.display())))?;
                    }
                    let l =
                        UnixListener::bind(path).map_err(failed(format!("binding {}", path.display())))?;
                    server.serve(l).map_err(|err| Error::Export(format!("serving NBD: {err}")))?;
                    format!("nbd+unix:///nvme0?socket={}", path.display())
                }
                _ => {
                    let ExportSpec::Tcp(addr) = spec else { unreachable!("matched above") };
                    let l = TcpListener::bind(addr).map_err(failed(format!("binding {addr}")))?;
                    let uri = format!("nbd://{}/nvme0", l.local_addr().map_err(failed("the NBD address"))?);
                    server.serve(l).map_err(|err| Error::Export(format!("serving NBD: {err}")))?;
                    uri
                }
            };
            e.server = Some(server);
            e.uris.push(uri);
        }
        ExportSpec::VhostUserBlk { path, read_only, queues } => {
            let options = BlkOptions {
                read_only: *read_only,
                queues: *queues,
                serial: format!("lanbus-{}", f.bdf).chars().filter(|c| c.is_ascii_graphic()).collect(),
            };
            let server = serve_blk(path, block.clone(), options)
                .map_err(|err| Error::Export(format!("vhost-user-blk at {}: {err}", path.display())))?;
            e.vhost = Some(server);
            e.uris.push(format!("vhost-user-blk:{}", path.display()));
        }
        ExportSpec::Tap(_) | ExportSpec::VhostUserNet(_) | ExportSpec::VfioUser(_) => {
            return Err(Error::BadSpec(format!("{spec:?} does not export the drive's namespace")));
        }
    }
    Ok(())
}

fn vfio_json(f: &RemoteFunction, server: &VfioUserServer) -> Value {
    let s = server.stats();
    let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    json!({
        "export": format!("vfio-user:{}", server.path().display()),
        "function": f.bdf.to_string(),
        "connections": g(&s.connections),
        "refused": g(&s.refused),
        "messages": g(&s.messages),
        "errors": g(&s.errors),
        "protocol_errors": g(&s.protocol_errors),
        "dma_maps": g(&s.dma_maps),
        "dma_maps_unbacked": g(&s.dma_maps_unbacked),
        "region_accesses": g(&s.region_accesses),
    })
}

fn vhost_json(v: &BlkServer) -> Value {
    let s = v.stats();
    let c = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    json!({
        "socket": v.path().display().to_string(),
        "connections": c(&s.connections),
        "acked_features": format!("{:#x}", c(&s.acked_features)),
        "protocol_errors": c(&s.protocol_errors),
        "requests": c(&s.requests),
        "read_bytes": c(&s.read_bytes),
        "written_bytes": c(&s.written_bytes),
        "discards": c(&s.discards),
        "write_zeroes": c(&s.write_zeroes),
        "io_errors": c(&s.io_errors),
        "unsupported": c(&s.unsupported),
        "malformed": c(&s.malformed),
    })
}

/// The exported NIC.
struct NicExported {
    function: RemoteFunction,
    export: NicExport,
}

/// Who drives the remote NIC's frames on the host.
enum NicExport {
    /// The host's kernel, through a TAP.
    Tap(TapExport),
    /// A VM's guest, through a vhost-user-net backend.
    Vhost { driver: Arc<NetDriver>, server: NetServer },
}

/// Where the remote NIC goes on the host.
enum NicTarget {
    Tap(Arc<Tap>),
    Vhost(PathBuf),
}

impl NicTarget {
    fn name(&self) -> String {
        match self {
            NicTarget::Tap(t) => t.name().to_string(),
            NicTarget::Vhost(p) => format!("vhost-user-net:{}", p.display()),
        }
    }
}

impl NicExported {
    fn driver(&self) -> &Arc<NetDriver> {
        match &self.export {
            NicExport::Tap(t) => t.driver(),
            NicExport::Vhost { driver, .. } => driver,
        }
    }

    /// Stops moving frames; `reset` resets the device too (not when it is gone).
    fn stop(self, reset: bool) {
        match self.export {
            NicExport::Tap(t) => t.stop(reset),
            NicExport::Vhost { driver, server } => {
                server.stop();
                if reset {
                    let _ = driver.stop();
                }
            }
        }
    }
}

/// The remote NIC's driver as a vhost-user-net backend's link.
struct DriverLink(Arc<NetDriver>);

impl NetLink for DriverLink {
    fn features(&self) -> u64 {
        self.0.features()
    }
    fn mac(&self) -> [u8; 6] {
        self.0.mac()
    }
    fn mtu(&self) -> u16 {
        self.0.mtu()
    }
    fn send(&self, frame: &[u8]) -> std::io::Result<bool> {
        self.0.tx_push(frame).map_err(std::io::Error::other)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.0.tx_flush().map_err(std::io::Error::other)
    }
    fn wait_room(&self, timeout: Duration) -> std::io::Result<bool> {
        if self.0.tx_room().map_err(std::io::Error::other)? > 0 {
            return Ok(true);
        }
        self.0.tx_wait(timeout);
        Ok(self.0.tx_room().map_err(std::io::Error::other)? > 0)
    }
    fn receive(&self, f: &mut dyn FnMut(&[u8])) -> std::io::Result<usize> {
        self.0.rx_poll(f).map_err(std::io::Error::other)
    }
    fn wait_received(&self, timeout: Duration) {
        self.0.rx_wait(timeout);
    }
}

fn export_nic(host: &Arc<HostBridge>, f: &RemoteFunction, target: &NicTarget) -> Result<NicExported> {
    let config = lanbus_vnet::driver::DriverConfig::default();
    let driver = Arc::new(
        lanbus_vnet::pcie::attach(host, f, config)
            .map_err(|e| Error::Export(format!("the NIC's driver on {}: {e}", f.bdf)))?,
    );
    let export = match target {
        NicTarget::Tap(tap) => NicExport::Tap(
            TapExport::start(driver, tap.clone())
                .map_err(failed(format!("setting up TAP {}", tap.name())))?,
        ),
        NicTarget::Vhost(path) => match serve_net(path, Arc::new(DriverLink(driver.clone()))) {
            Ok(server) => NicExport::Vhost { driver, server },
            Err(e) => {
                let _ = driver.stop();
                return Err(Error::Export(format!("vhost-user-net at {}: {e}", path.display())));
            }
        },
    };
    Ok(NicExported { function: f.clone(), export })
}

fn nic_json(n: &NicExported, target: &str) -> Value {
    let d = n.driver();
    let s = d.stats();
    let v = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let (error, vhost) = match &n.export {
        NicExport::Tap(t) => (t.error(), Value::Null),
        NicExport::Vhost { server, .. } => {
            let b = server.stats();
            (
                None,
                json!({
                    "connections": v(&b.connections),
                    "acked_features": format!("{:#x}", v(&b.acked_features)),
                    "protocol_errors": v(&b.protocol_errors),
                    "tx_frames": v(&b.tx_frames),
                    "tx_bytes": v(&b.tx_bytes),
                    "tx_dropped": v(&b.tx_dropped),
                    "rx_frames": v(&b.rx_frames),
                    "rx_bytes": v(&b.rx_bytes),
                    "rx_dropped": v(&b.rx_dropped),
                }),
            )
        }
    };
    json!({
        "function": n.function.bdf.to_string(),
        "export": target,
        "mac": lanbus_wire::MacAddr(d.mac()).to_string(),
        "mtu": d.mtu(),
        "features": format!("{:#x}", d.features()),
        "tx_frames": v(&s.tx_frames),
        "tx_bytes": v(&s.tx_bytes),
        "rx_frames": v(&s.rx_frames),
        "rx_bytes": v(&s.rx_bytes),
        "notifies": v(&s.notifies),
        "vhost_user_net": vhost,
        "error": error,
    })
}

impl crate::control::Daemon for Host {
    fn answer(&self, line: &str) -> String {
        Host::answer(self, line)
    }
    fn samples(&self) -> Vec<Sample> {
        Host::samples(self)
    }
}
