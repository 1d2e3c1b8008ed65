//! The daemons: `lanbus device` (the I/O box: a device bridge hosting an NVMe drive) and
//! `lanbus host` (a host bridge that enumerates the drive, starts the NVMe driver and exports the
//! namespace over NBD), and `lanbus status`, which asks either one over its control socket.
//!
//! Layer: frontend (processes, sockets, signals) over [`crate::fabric`].
//!
//! Lifecycle of the host's export: when a device bridge of our group appears and its function is
//! an NVMe controller, the driver starts and the NBD server listens; when the device goes (its
//! heartbeats stop, or it leaves the group) the server stops and its socket file is removed:
//! requests in flight fail with an error (the bridge answers at once for a device it no longer
//! has), new clients find no socket. SIGINT/SIGTERM: stop accepting, finish the requests in
//! flight, NVMe Flush (the NBD server flushes its device), NVMe shutdown notification, exit 0.
//!
//! Control socket protocol (a Unix stream socket, one request per connection): the client writes
//! one line, `status` (answer: one JSON object) or, on a device, `group N` (moves the bridge to
//! group N; answer: a JSON object with the new group).

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use lanbus_bridge::{DeviceBridge, HostBridge, HostEvent, HostedFunction, RemoteFunction};
use lanbus_nbd::{Export, Server};
use lanbus_nvme::pcie::FunctionStats;
use lanbus_nvme::NvmeDriver;
use lanbus_pcie::dma_engine::DmaEngine;
use serde_json::{json, Value};

use lanbus_node::config::{self, DeviceFile, ExportSpec, HostFile};
use lanbus_node::drive::{self, NvmeBacking, NvmeBlock};
use lanbus_node::metrics::{self, Sample};
use lanbus_node::nic::NicSpec;
use lanbus_vhost::{
    serve_blk, serve_net, serve_vfio_user, BlkOptions, BlkServer, NetLink, NetServer, VfioUserServer,
};
use lanbus_vnet::driver::NetDriver;
use lanbus_vnet::pcie::TapExport;
use lanbus_vnet::tap::Tap;

/// Default control socket of `lanbus device`.
pub const DEVICE_CONTROL: &str = "/tmp/lanbus-device.sock";
/// Default control socket of `lanbus host`.
pub const HOST_CONTROL: &str = "/tmp/lanbus-host.sock";

/// `lanbus device` options (each may come from `--config FILE` instead; the command line wins).
#[derive(Debug, Args)]
pub struct DeviceArgs {
    /// A TOML file with the same keys: port, group, nvme, nic, lba_size, control, name, state,
    /// metrics.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The port (see PORT SPECS in `lanbus --help`).
    #[arg(long)]
    port: Option<lanbus_port::PortSpec>,
    /// The group whose host this I/O box serves.
    #[arg(long)]
    group: Option<u16>,
    /// The NVMe drive's blocks: file=PATH[,size=SIZE] or ram=SIZE.
    #[arg(long)]
    nvme: Option<String>,
    /// A remote NIC: tap=NAME[,mac=MAC][,mtu=BYTES]. A virtio-net function whose wire is the TAP
    /// interface NAME on this machine (created if missing, brought up; bridge it to a real
    /// interface or route through it). Default MAC: derived from NAME; default MTU 1500.
    #[arg(long)]
    nic: Option<String>,
    /// Logical block size of the namespace: 512 or 4096.
    #[arg(long)]
    lba_size: Option<u32>,
    /// Also host the DMA engine (function 1 after an NVMe drive, else function 0).
    #[arg(long)]
    dma_engine: bool,
    /// Thread model of the transport.
    #[arg(long, value_enum, default_value = "rtc")]
    mode: crate::pcie::Mode,
    /// Control socket for `lanbus status` and `lanbus device-ctl` (default
    /// /tmp/lanbus-device.sock).
    #[arg(long)]
    control: Option<PathBuf>,
    /// Where a group set at run time (`lanbus device-ctl PATH group N`) is kept, so that a
    /// restart serves the same group unless --group itself changed (default: the control
    /// socket's path with `.state` added).
    #[arg(long)]
    state: Option<PathBuf>,
    /// Serve the counters (transport, bridge, drive) in the Prometheus text format over HTTP at
    /// this local address, e.g. 127.0.0.1:9466 (`GET /metrics`).
    #[arg(long)]
    metrics: Option<std::net::SocketAddr>,
    /// Name announced in heartbeats.
    #[arg(long)]
    name: Option<String>,
}

/// `lanbus host` options (each may come from `--config FILE` instead; the command line wins).
#[derive(Debug, Args)]
pub struct HostArgs {
    /// A TOML file with the same keys: port, group, export (one spec or a list), control, name,
    /// metrics.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The port (see PORT SPECS in `lanbus --help`).
    #[arg(long)]
    port: Option<lanbus_port::PortSpec>,
    /// Our group: we use the devices that announce it.
    #[arg(long)]
    group: Option<u16>,
    /// What to export (repeatable): the NVMe namespace as nbd:PATH (Unix socket) or
    /// nbd:tcp:ADDR, and as vhost-user-blk:PATH[,ro][,queues=N] (a vhost-user-blk backend on a
    /// Unix socket for QEMU's vhost-user-blk-pci; N request queues, default 1; ro: read-only);
    /// the remote NIC as tap:NAME (a TAP interface created now, with its carrier on while the NIC
    /// is there; give it an address with `ip addr add`) or as vhost-user-net:PATH (a
    /// vhost-user-net backend on a Unix socket for QEMU's virtio-net-pci, there while the NIC is);
    /// the NVMe function itself as vfio-user:PATH (a vfio-user server on a Unix socket: a VMM
    /// with a vfio-user client, QEMU 10.1 or later, gives it to its guest, whose own nvme driver
    /// runs it; instead of nbd and vhost-user-blk, which need the function for this host's
    /// driver).
    #[arg(long)]
    export: Vec<String>,
    /// Thread model of the transport.
    #[arg(long, value_enum, default_value = "rtc")]
    mode: crate::pcie::Mode,
    /// Control socket for `lanbus status` (default /tmp/lanbus-host.sock).
    #[arg(long)]
    control: Option<PathBuf>,
    /// Serve the counters (transport, bridge, export) in the Prometheus text format over HTTP at
    /// this local address, e.g. 127.0.0.1:9467 (`GET /metrics`).
    #[arg(long)]
    metrics: Option<std::net::SocketAddr>,
    /// Name announced in heartbeats.
    #[arg(long)]
    name: Option<String>,
}

/// `lanbus status` options.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The daemon's control socket (default: both default sockets that exist).
    #[arg(long)]
    control: Option<PathBuf>,
    /// Print the raw JSON.
    #[arg(long)]
    json: bool,
}

/// Binds the metrics address (the command line's, else the file's), if any.
fn bind_metrics(
    arg: Option<std::net::SocketAddr>,
    file: Option<&str>,
) -> anyhow::Result<Option<TcpListener>> {
    let addr = match (arg, file) {
        (Some(a), _) => a,
        (None, Some(f)) => f.parse().with_context(|| format!("metrics = {f:?}: not IP:PORT"))?,
        (None, None) => return Ok(None),
    };
    let l = TcpListener::bind(addr).with_context(|| format!("binding the metrics address {addr}"))?;
    eprintln!("lanbus: metrics at http://{addr}/metrics");
    Ok(Some(l))
}

/// The same samples the metrics endpoint serves, as one JSON object (series name: value), for
/// `lanbus status`.
fn metrics_json(samples: &[Sample]) -> Value {
    Value::Object(samples.iter().map(|s| (s.series(), json!(s.value))).collect())
}

/// SIGINT/SIGTERM set the returned flag.
fn stop_flag() -> anyhow::Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).context("installing signal handlers")?;
    }
    Ok(stop)
}

/// Binds a control socket, replacing a stale one (refusing one a live daemon answers on).
pub(crate) fn bind_control(path: &Path) -> anyhow::Result<UnixListener> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            bail!("{} is in use by another daemon: give this one --control PATH", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("removing stale {}", path.display()))?;
    }
    let l = UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    l.set_nonblocking(true)?;
    Ok(l)
}

/// Serves the control socket until `stop`: `answer(line)` gives the reply.
pub(crate) fn serve_control(l: &UnixListener, stop: &AtomicBool, answer: &dyn Fn(&str) -> String) {
    // Relaxed: a flag polled every 50 ms; nothing else is published through it.
    while !stop.load(Ordering::Relaxed) {
        match l.accept() {
            Ok((s, _)) => {
                let _ = s.set_nonblocking(false);
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let mut line = String::new();
                let mut r = BufReader::new(&s);
                if r.read_line(&mut line).is_ok() {
                    let v = answer(line.trim());
                    let _ = (&s).write_all(format!("{}\n", v.trim_end()).as_bytes());
                }
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

fn transport_json(rt: &lanbus_runtime::Stats) -> Value {
    let t = &rt.transport;
    let drops = t.drops();
    json!({
        "frames_sent": t.frames_sent,
        "frames_received": t.frames_received,
        "retransmitted_frames": t.retransmitted_frames,
        "fast_retransmits": t.fast_retransmits,
        "tail_loss_probes": t.tail_loss_probes,
        "peer_restarts": t.peer_restarts,
        "retransmission_timeouts": t.timeouts,
        "drops": drops,
        "drops_out_of_order": t.drop_out_of_order,
        "frames_held": t.frames_held,
        "drops_bad_checksum": t.drop_bad_checksum,
        "messages_sent": t.messages_sent,
        "messages_delivered": t.messages_delivered,
        "rtt_avg_us": t.rtt_sum_ns.checked_div(t.rtt_samples).unwrap_or(0) / 1000,
        "fabric_rtt_avg_us": t.fabric_rtt_sum_ns.checked_div(t.rtt_samples).unwrap_or(0) / 1000,
        "rate_decreases": t.rate_decreases,
        "port": format!("{:?}", rt.port),
    })
}

fn controller_json(stats: &FunctionStats) -> Value {
    let (c, refused) = stats.get();
    json!({
        "io_commands": c.io_commands,
        "admin_commands": c.admin_commands,
        "error_completions": c.error_completions,
        "bytes_read": c.bytes_read,
        "bytes_written": c.bytes_written,
        "writes_in_place": c.writes_in_place,
        "dma_errors": c.dma_errors,
        "interrupts": c.interrupts,
        "invalid_doorbells": c.invalid_doorbells,
        "refused_bar_accesses": refused,
    })
}

/// Runs `lanbus device`.
pub fn device(args: DeviceArgs) -> anyhow::Result<()> {
    let file: DeviceFile = config::read_toml(args.config.as_deref())?;
    let port_spec = args.port.or(file.port).context("give --port SPEC (or port = \"...\" in --config)")?;
    let configured_group = args.group.or(file.group).unwrap_or(0);
    let nvme = args.nvme.or(file.nvme);
    let nic: Option<NicSpec> = args.nic.or(file.nic).as_deref().map(str::parse).transpose()?;
    if nvme.is_none() && nic.is_none() && !args.dma_engine {
        bail!(
            "no device to host: give --nvme file=PATH[,size=SIZE]|ram=SIZE, --nic tap=NAME and/or \
             --dma-engine"
        );
    }
    let lba = args.lba_size.or(file.lba_size).unwrap_or(512);
    if lba != 512 && lba != 4096 {
        bail!("--lba-size {lba}: 512 or 4096");
    }
    let control = args.control.or(file.control).unwrap_or_else(|| DEVICE_CONTROL.into());
    let name = args.name.or(file.name).unwrap_or_else(|| "lanbus-device".into());
    let state_path = args.state.or(file.state).unwrap_or_else(|| {
        let mut p = control.clone().into_os_string();
        p.push(".state");
        p.into()
    });
    let state = config::DeviceState::resume(&state_path, configured_group)?;
    state.store(&state_path)?;
    let group = state.current_group;
    if group != configured_group {
        eprintln!(
            "lanbus device: serving group {group}, set at run time before the restart (configured \
             {configured_group}; {} keeps it)",
            state_path.display()
        );
    }
    let backing: Option<NvmeBacking> = nvme.as_deref().map(str::parse).transpose()?;
    // Before any thread starts, so that every thread inherits the blocked mask.
    let signals = lanbus_node::process::Blocked::termination()?;
    let mut functions = Vec::new();
    let mut nvme_info = None;
    if let Some(b) = &backing {
        let ctrl = drive::controller(b, lba)?;
        let blocks = ctrl.namespace_blocks();
        let (f, stats) = drive::nvme_function(ctrl)?;
        functions.push(f);
        nvme_info = Some((blocks, stats));
    }
    let mut nic_info = None;
    if let Some(spec) = &nic {
        let (f, info) = lanbus_node::nic::nic_function(spec)?;
        functions.push(f);
        nic_info = Some(info);
    }
    if args.dma_engine {
        functions.push(HostedFunction::model(DmaEngine::new())?);
    }
    let metrics_listener = bind_metrics(args.metrics, file.metrics.as_deref())?;
    let port = port_spec.open()?;
    let listener = bind_control(&control)?;
    let config = config::device_config(group, &name, args.mode.into());
    let bridge = DeviceBridge::start(port, config, functions)?;
    let what = match (&nvme, &nvme_info) {
        (Some(n), Some((blocks, _))) => format!("NVMe {n}, {blocks} x {lba} bytes"),
        _ => String::new(),
    };
    let dma = if args.dma_engine { " + the DMA engine" } else { "" };
    let nic_what = nic_info.as_ref().map_or(String::new(), |n| {
        let m = lanbus_wire::MacAddr(n.spec.mac);
        format!(" + virtio-net {m} on TAP {} (MTU {})", n.spec.tap, n.spec.mtu)
    });
    eprintln!(
        "lanbus device: {name} ({}) group {group} on {port_spec}: {what}{nic_what}{dma}; control {}",
        bridge.local_mac(),
        control.display()
    );
    let collect = || {
        let mut out = Vec::new();
        metrics::runtime_samples(&bridge.runtime_stats(), &mut out);
        let b = bridge.stats();
        let c = Sample::counter;
        out.extend([
            c("bridge_tlps_received_total", "TLPs the device bridge received.", b.tlps_received),
            c("bridge_dma_reads_total", "DMA reads the functions issued.", b.dma_reads),
            c("bridge_dma_read_failures_total", "DMA reads that failed.", b.dma_read_failures),
            c("bridge_dma_writes_total", "DMA writes the functions issued.", b.dma_writes),
            c(
                "bridge_prefetched_reads_total",
                "DMA reads started before a function's work asked for them (an NVMe command, its PRP list, a write's data).",
                b.prefetched_reads,
            ),
            c("bridge_prefetches_used_total", "Prefetched DMA reads used.", b.prefetches_used),
            c("bridge_foreign_requests_total", "Requests from hosts not ours.", b.foreign_requests),
            c("bridge_host_changes_total", "Times the bridge took up or lost its host.", b.host_changes),
            c(
                "bridge_payload_bytes_copied_total",
                "Payload bytes the bridge copied out of received TLPs or into completions.",
                b.payload_bytes_copied,
            ),
        ]);
        out.push(Sample::gauge("group", "The group the I/O box serves.", f64::from(bridge.group())));
        out.push(Sample::gauge(
            "host_present",
            "1 while a host of the group is served.",
            f64::from(u8::from(bridge.host().is_some())),
        ));
        if let Some((_, st)) = &nvme_info {
            let (n, _) = st.get();
            out.extend([
                c("nvme_io_commands_total", "NVMe I/O commands the drive ran.", n.io_commands),
                c("nvme_bytes_read_total", "Bytes the drive read for hosts.", n.bytes_read),
                c("nvme_bytes_written_total", "Bytes the drive wrote for hosts.", n.bytes_written),
                c(
                    "nvme_error_completions_total",
                    "NVMe commands completed with an error.",
                    n.error_completions,
                ),
                c(
                    "nvme_bytes_copied_total",
                    "Bytes the drive copied: host writes into its memory buffer, a command's data into its own buffer.",
                    n.bytes_copied,
                ),
            ]);
        }
        if let Some(n) = &nic_info {
            let v = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
            let st = &n.stats;
            out.extend([
                c("nic_tx_frames_total", "Frames the host sent out through the NIC.", v(&st.tx_frames)),
                c("nic_tx_bytes_total", "Bytes the host sent out through the NIC.", v(&st.tx_bytes)),
                c("nic_rx_frames_total", "Frames the NIC received for the host.", v(&st.rx_frames)),
                c("nic_rx_bytes_total", "Bytes the NIC received for the host.", v(&st.rx_bytes)),
                c("nic_rx_dropped_total", "Frames dropped: the host took none.", v(&st.rx_dropped)),
                c("nic_rx_too_big_total", "Frames larger than the host's buffers.", v(&st.rx_too_big)),
                c("nic_broken_total", "Times the host's driver broke a queue.", v(&st.broken)),
            ]);
        }
        out
    };
    let answer = |line: &str| -> String {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["status"] => {
                let s = bridge.stats();
                let rt = bridge.runtime_stats();
                format!(
                    "mac {} group {} host {} tlps {} dma_reads {} dma_writes {} foreign {} ur {} frames_rx {} frames_tx {} retransmitted {}",
                    bridge.local_mac(),
                    bridge.group(),
                    bridge.host().map_or("none".to_string(), |m| m.to_string()),
                    s.tlps_received,
                    s.dma_reads,
                    s.dma_writes,
                    s.foreign_requests,
                    s.ur_sent,
                    rt.port.rx_frames,
                    rt.port.tx_frames,
                    rt.transport.retransmitted_frames,
                )
            }
            ["status", "json"] => {
                let mut devices = Vec::new();
                if let (Some(n), Some((blocks, _))) = (&nvme, &nvme_info) {
                    devices.push(json!({"function": "00.0", "kind": "NVMe", "backing": n, "blocks": blocks, "lba_size": lba}));
                }
                if let Some(n) = &nic_info {
                    devices.push(json!({
                        "function": format!("00.{}", devices.len()),
                        "kind": "virtio-net",
                        "tap": n.spec.tap,
                        "mac": lanbus_wire::MacAddr(n.spec.mac).to_string(),
                        "mtu": n.spec.mtu,
                        "last_error": n.last_error.lock().unwrap_or_else(|e| e.into_inner()).clone(),
                    }));
                }
                if args.dma_engine {
                    devices.push(json!({"function": format!("00.{}", devices.len()), "kind": "DMA engine"}));
                }
                json!({
                    "role": "device",
                    "name": name,
                    "mac": bridge.local_mac().to_string(),
                    "group": bridge.group(),
                    "vlan": bridge.vlan(),
                    "peers": bridge.host().map(|h| vec![json!({"mac": h.to_string(), "role": "host"})]).unwrap_or_default(),
                    "devices": devices,
                    "controller": nvme_info.as_ref().map(|(_, st)| controller_json(st)),
                    "completion_timeouts": bridge.stats().dma_read_failures,
                    "bridge": format!("{:?}", bridge.stats()),
                    "transport": transport_json(&bridge.runtime_stats()),
                    "metrics": metrics_json(&collect()),
                })
                .to_string()
            }
            ["group", n] => match n.parse::<u16>() {
                Ok(g) => {
                    if let Err(why) = bridge.set_group(g) {
                        return format!("error: {why}");
                    }
                    eprintln!("lanbus device: moved to group {g}");
                    let kept = config::DeviceState { configured_group, current_group: g };
                    match kept.store(&state_path) {
                        Ok(()) => format!("ok group {g}"),
                        Err(e) => format!("ok group {g} (not kept across a restart: {e})"),
                    }
                }
                Err(_) => format!("error: bad group {n:?} (0..=65535)"),
            },
            _ => format!("error: unknown command {line:?} (want `group N`, `status` or `status json`)"),
        }
    };
    let control_stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| serve_control(&listener, &control_stop, &answer));
        if let Some(l) = &metrics_listener {
            s.spawn(|| metrics::serve(l, &control_stop, &collect));
        }
        let sig = signals.wait();
        eprintln!("lanbus device: signal {sig}, stopping");
        // Relaxed: the flag only asks the loop to end.
        control_stop.store(true, Ordering::Relaxed);
    });
    bridge.shutdown();
    if let Some(NvmeBacking::File { path, .. }) = &backing {
        // The controller wrote through its own handle; any handle's fsync flushes the file.
        std::fs::File::open(path)?.sync_all().with_context(|| format!("syncing {}", path.display()))?;
    }
    let _ = std::fs::remove_file(&control);
    eprintln!("lanbus device: stopped, data flushed");
    Ok(())
}

/// The exported drive of a host daemon: one NVMe driver, over NBD, vhost-user-blk or both.
struct Exported {
    function: RemoteFunction,
    driver: Arc<NvmeDriver>,
    server: Option<Server>,
    vhost: Option<BlkServer>,
    uris: Vec<String>,
}

fn export(host: &Arc<HostBridge>, f: &RemoteFunction, specs: &[ExportSpec]) -> anyhow::Result<Exported> {
    let driver = drive::start_driver(host, f)?;
    let block = Arc::new(NvmeBlock::new(driver.clone()));
    let mut e = Exported { function: f.clone(), driver, server: None, vhost: None, uris: Vec::new() };
    let result = (|| -> anyhow::Result<()> {
        for spec in specs {
            match spec {
                ExportSpec::Unix(_) | ExportSpec::Tcp(_) => {
                    let server = Server::builder()
                        .export(
                            Export::new("nvme0", block.clone())
                                .description(format!("lanbus NVMe {} on {} \"{}\"", f.bdf, f.mac, f.name)),
                        )
                        .build()?;
                    let uri = match spec {
                        ExportSpec::Unix(path) => {
                            if path.exists() {
                                std::fs::remove_file(path)
                                    .with_context(|| format!("removing stale {}", path.display()))?;
                            }
                            let l = UnixListener::bind(path)
                                .with_context(|| format!("binding {}", path.display()))?;
                            server.serve(l)?;
                            format!("nbd+unix:///nvme0?socket={}", path.display())
                        }
                        _ => {
                            let ExportSpec::Tcp(addr) = spec else { unreachable!("matched above") };
                            let l = std::net::TcpListener::bind(addr)
                                .with_context(|| format!("binding {addr}"))?;
                            let uri = format!("nbd://{}/nvme0", l.local_addr()?);
                            server.serve(l)?;
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
                        serial: format!("lanbus-{}", f.bdf)
                            .chars()
                            .filter(|c| c.is_ascii_graphic())
                            .collect(),
                    };
                    e.vhost = Some(serve_blk(path, block.clone(), options)?);
                    e.uris.push(format!("vhost-user-blk:{}", path.display()));
                }
                ExportSpec::Tap(_) | ExportSpec::VhostUserNet(_) | ExportSpec::VfioUser(_) => {
                    bail!("{spec:?} does not export the drive's namespace")
                }
            }
        }
        Ok(())
    })();
    match result {
        Ok(()) => Ok(e),
        Err(err) => {
            unexport(e, specs, "could not export it all");
            Err(err)
        }
    }
}

/// Stops exporting: new clients find no socket, requests in flight finish or fail, then flush
/// (if the device is still there) and NVMe shutdown.
fn unexport(e: Exported, specs: &[ExportSpec], why: &str) {
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
        Some(Err(err)) => eprintln!("lanbus host: unexported {uris} ({why}): {err}"),
        Some(Ok(stats)) => eprintln!("lanbus host: unexported {uris} ({why}); {stats:?}"),
        None => eprintln!("lanbus host: unexported {uris} ({why})"),
    }
    // The NBD server flushed at its shutdown; a vhost-user-blk guest's writes are flushed here
    // (if the device is still there) before the shutdown notification.
    if had_vhost {
        match e.driver.flush() {
            Ok(()) => eprintln!("lanbus host: flushed {}", e.function.bdf),
            Err(err) => eprintln!("lanbus host: NVMe flush of {}: {err}", e.function.bdf),
        }
    }
    if let Err(err) = e.driver.shutdown() {
        eprintln!("lanbus host: NVMe shutdown of {}: {err}", e.function.bdf);
    }
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

/// The exported NIC of a host daemon.
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

fn export_nic(host: &Arc<HostBridge>, f: &RemoteFunction, target: &NicTarget) -> anyhow::Result<NicExported> {
    let driver = Arc::new(lanbus_vnet::pcie::attach(host, f, lanbus_vnet::driver::DriverConfig::default())?);
    let export = match target {
        NicTarget::Tap(tap) => NicExport::Tap(
            TapExport::start(driver, tap.clone())
                .with_context(|| format!("setting up TAP {}", tap.name()))?,
        ),
        NicTarget::Vhost(path) => {
            let server = match serve_net(path, Arc::new(DriverLink(driver.clone()))) {
                Ok(s) => s,
                Err(e) => {
                    let _ = driver.stop();
                    return Err(e.into());
                }
            };
            NicExport::Vhost { driver, server }
        }
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

/// Runs `lanbus host`.
pub fn host(args: HostArgs) -> anyhow::Result<()> {
    let file: HostFile = config::read_toml(args.config.as_deref())?;
    let port_spec = args.port.or(file.port).context("give --port SPEC (or port = \"...\" in --config)")?;
    let group = args.group.or(file.group).unwrap_or(0);
    let texts = if args.export.is_empty() {
        file.export.map(|e| e.into_vec()).unwrap_or_default()
    } else {
        args.export
    };
    if texts.is_empty() {
        bail!(
            "give --export nbd:PATH, nbd:tcp:ADDR, vhost-user-blk:PATH, vfio-user:PATH, tap:NAME or \
             vhost-user-net:PATH"
        );
    }
    let specs: Vec<ExportSpec> = texts.iter().map(|t| t.parse()).collect::<Result<_, _>>()?;
    let nbd_count = specs.iter().filter(|s| s.is_nbd()).count();
    let vhost_count = specs.iter().filter(|s| matches!(s, ExportSpec::VhostUserBlk { .. })).count();
    let nic_specs: Vec<&ExportSpec> = specs.iter().filter(|s| s.is_nic()).collect();
    if nbd_count > 1 || vhost_count > 1 {
        bail!("one export of each kind at most: nbd:... and vhost-user-blk:...");
    }
    if nic_specs.len() > 1 {
        bail!("the NIC goes to one place: tap:NAME or vhost-user-net:PATH, once");
    }
    let drive_specs: Vec<ExportSpec> = specs.iter().filter(|s| s.is_drive()).cloned().collect();
    let raw_path: Option<PathBuf> = match specs.iter().filter(|s| s.is_raw()).collect::<Vec<_>>()[..] {
        [] => None,
        [ExportSpec::VfioUser(p)] if drive_specs.is_empty() => Some(p.clone()),
        [_] => bail!(
            "vfio-user gives the whole NVMe function to a VMM: it cannot be combined with nbd or \
             vhost-user-blk, which run this host's driver on it"
        ),
        _ => bail!("one vfio-user export at most"),
    };
    let spec = (!drive_specs.is_empty()).then_some(drive_specs);
    let control = args.control.or(file.control).unwrap_or_else(|| HOST_CONTROL.into());
    let name = args.name.or(file.name).unwrap_or_else(|| "lanbus-host".into());
    let stop = stop_flag()?;
    let metrics_listener = bind_metrics(args.metrics, file.metrics.as_deref())?;
    // A TAP exists from the start, its carrier off until a NIC appears; a vhost-user-net socket
    // only while the NIC is there.
    let nic_target = match nic_specs.first() {
        Some(ExportSpec::Tap(n)) => {
            let t = Tap::open(n).with_context(|| format!("creating TAP {n}"))?;
            t.set_carrier(false)?;
            t.configure(None, None, true)?;
            Some(NicTarget::Tap(Arc::new(t)))
        }
        Some(ExportSpec::VhostUserNet(path)) => Some(NicTarget::Vhost(path.clone())),
        _ => None,
    };
    let port = port_spec.open()?;
    let listener = bind_control(&control)?;
    let host = Arc::new(HostBridge::start(port, config::host_config(group, &name, args.mode.into()))?);
    let events = host.subscribe();
    let wants_drive = spec.is_some() || raw_path.is_some();
    let waiting = match (wants_drive, &nic_target) {
        (true, Some(_)) => "an NVMe device and a NIC",
        (true, None) => "an NVMe device",
        _ => "a NIC",
    };
    eprintln!(
        "lanbus host: {name} ({}) group {group} on {port_spec}; waiting for {waiting}; control {}",
        host.local_mac(),
        control.display()
    );
    let current: Mutex<Option<Exported>> = Mutex::new(None);
    let lock = || current.lock().unwrap_or_else(|e| e.into_inner());
    let nic: Mutex<Option<NicExported>> = Mutex::new(None);
    let lock_nic = || nic.lock().unwrap_or_else(|e| e.into_inner());
    let raw: Mutex<Option<(RemoteFunction, VfioUserServer)>> = Mutex::new(None);
    let lock_raw = || raw.lock().unwrap_or_else(|e| e.into_inner());
    let collect = || {
        let mut out = Vec::new();
        metrics::runtime_samples(&host.runtime_stats(), &mut out);
        let b = host.stats();
        let c = Sample::counter;
        out.extend([
            c("bridge_tlps_received_total", "TLPs the host bridge received.", b.tlps_received),
            c(
                "bridge_dma_reads_served_total",
                "Device DMA reads served from host memory.",
                b.dma_reads_served,
            ),
            c(
                "bridge_dma_reads_deferred_total",
                "Device DMA reads served in a later turn than they arrived (a large read in parts).",
                b.dma_reads_deferred,
            ),
            c(
                "bridge_dma_writes_applied_total",
                "Device DMA writes applied to host memory.",
                b.dma_writes_applied,
            ),
            c("bridge_interrupts_total", "MSI-X interrupts delivered.", b.interrupts),
            c("bridge_completion_timeouts_total", "Requests that timed out.", b.timeouts),
            c("bridge_device_gone_total", "Requests failed because their device went.", b.device_gone),
            c(
                "bridge_payload_bytes_copied_total",
                "Payload bytes the bridge copied: device writes into host memory, completions of device reads.",
                b.payload_bytes_copied,
            ),
        ]);
        if let Some(e) = lock().as_ref() {
            let s = e.driver.stats();
            out.push(c(
                "nvme_driver_bytes_copied_total",
                "Bytes the NVMe driver copied into and out of its DMA memory.",
                s.copy_bytes.load(Ordering::Relaxed),
            ));
        }
        out.push(Sample::gauge("devices", "Remote functions enumerated.", host.devices().len() as f64));
        out.push(Sample::gauge(
            "exported",
            "1 while the drive is exported.",
            f64::from(u8::from(lock().is_some() || lock_raw().is_some())),
        ));
        if let Some(n) = lock_nic().as_ref() {
            let s = n.driver().stats();
            let v = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
            out.extend([
                c("nic_tx_frames_total", "Frames sent through the remote NIC.", v(&s.tx_frames)),
                c("nic_tx_bytes_total", "Bytes sent through the remote NIC.", v(&s.tx_bytes)),
                c("nic_rx_frames_total", "Frames received through the remote NIC.", v(&s.rx_frames)),
                c("nic_rx_bytes_total", "Bytes received through the remote NIC.", v(&s.rx_bytes)),
            ]);
        }
        out.push(Sample::gauge(
            "nic_up",
            "1 while the remote NIC is exported.",
            f64::from(u8::from(lock_nic().is_some())),
        ));
        out
    };
    let answer = |line: &str| -> String {
        if line != "status" && line != "status json" {
            return format!("error: unknown command {line:?} (want `status`)");
        }
        // Before the export's lock below: collecting takes it too.
        let metrics = metrics_json(&collect());
        let devices = host.devices();
        let mut peers: Vec<Value> = Vec::new();
        for f in &devices {
            let p = json!({"mac": f.mac.to_string(), "name": f.name, "role": "device", "group": f.group});
            if !peers.contains(&p) {
                peers.push(p);
            }
        }
        let nic_status = lock_nic()
            .as_ref()
            .map(|n| nic_json(n, &nic_target.as_ref().map(NicTarget::name).unwrap_or_default()));
        let raw_status = lock_raw().as_ref().map(|(f, server)| vfio_json(f, server));
        let cur = lock();
        let hb = host.stats();
        json!({
            "role": "host",
            "name": name,
            "mac": host.local_mac().to_string(),
            "group": group,
            "vlan": host.vlan(),
            "peers": peers,
            "devices": devices.iter().map(lanbus_node::lspci::describe).collect::<Vec<_>>(),
            "export": cur.as_ref().map(|e| e.uris.join(" ")).or_else(|| raw_status.as_ref().and_then(|r| r["export"].as_str().map(String::from))),
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
            "transport": transport_json(&host.runtime_stats()),
            "metrics": metrics,
        })
        .to_string()
    };
    let control_stop = AtomicBool::new(false);
    std::thread::scope(|s| -> anyhow::Result<()> {
        s.spawn(|| serve_control(&listener, &control_stop, &answer));
        if let Some(l) = &metrics_listener {
            s.spawn(|| metrics::serve(l, &control_stop, &collect));
        }
        let result = (|| -> anyhow::Result<()> {
            let mut pending: Vec<RemoteFunction> = host.devices();
            // Relaxed: polled; the handler only sets it.
            while !stop.load(Ordering::Relaxed) {
                for f in pending.drain(..) {
                    if let (Some(spec), true) = (&spec, drive::is_nvme(&f)) {
                        if lock().is_some() {
                            continue;
                        }
                        eprint!("lanbus host: found\n{}", lanbus_node::lspci::describe(&f));
                        match export(&host, &f, spec) {
                            Ok(e) => {
                                eprintln!("lanbus host: exporting {} as {}", f.bdf, e.uris.join(" and "));
                                *lock() = Some(e);
                            }
                            Err(err) => eprintln!("lanbus host: cannot export {}: {err:#}", f.bdf),
                        }
                    }
                    if let (Some(path), true) = (&raw_path, drive::is_nvme(&f)) {
                        if lock_raw().is_some() {
                            continue;
                        }
                        eprint!("lanbus host: found\n{}", lanbus_node::lspci::describe(&f));
                        match serve_vfio_user(path, host.clone(), f.clone()) {
                            Ok(server) => {
                                eprintln!(
                                    "lanbus host: giving {} to vfio-user clients at {}",
                                    f.bdf,
                                    path.display()
                                );
                                *lock_raw() = Some((f.clone(), server));
                            }
                            Err(err) => {
                                eprintln!("lanbus host: cannot serve {} over vfio-user: {err:#}", f.bdf)
                            }
                        }
                    }
                    if let (Some(t), true) = (&nic_target, lanbus_vnet::pcie::is_nic(&f)) {
                        if lock_nic().is_some() {
                            continue;
                        }
                        eprint!("lanbus host: found\n{}", lanbus_node::lspci::describe(&f));
                        match export_nic(&host, &f, t) {
                            Ok(n) => {
                                let d = n.driver();
                                eprintln!(
                                    "lanbus host: NIC {} is {} ({}, MTU {}), features {:#x}",
                                    f.bdf,
                                    t.name(),
                                    lanbus_wire::MacAddr(d.mac()),
                                    d.mtu(),
                                    d.features()
                                );
                                *lock_nic() = Some(n);
                            }
                            Err(err) => eprintln!("lanbus host: cannot use NIC {}: {err:#}", f.bdf),
                        }
                    }
                }
                match events.recv_timeout(Duration::from_millis(100)) {
                    Ok(HostEvent::DeviceAdded(f)) => pending.push(f),
                    Ok(HostEvent::DeviceRemoved { bdf, mac, reason }) => {
                        let e = { lock().take_if(|e| e.function.bdf == bdf && e.function.mac == mac) };
                        if let (Some(e), Some(spec)) = (e, &spec) {
                            unexport(e, spec, &format!("device {bdf} removed: {reason}"));
                        }
                        let r = { lock_raw().take_if(|(f, _)| f.bdf == bdf && f.mac == mac) };
                        if let Some((_, server)) = r {
                            server.stop();
                            eprintln!("lanbus host: {bdf} removed ({reason}); vfio-user socket gone");
                        }
                        let n = { lock_nic().take_if(|n| n.function.bdf == bdf && n.function.mac == mac) };
                        if let Some(n) = n {
                            n.stop(false);
                            eprintln!("lanbus host: NIC {bdf} removed ({reason}); unexported");
                        }
                    }
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => bail!("the host bridge stopped"),
                }
            }
            Ok(())
        })();
        control_stop.store(true, Ordering::Relaxed);
        result
    })?;
    eprintln!("lanbus host: stopping: finishing requests in flight, flushing");
    let e = lock().take();
    if let (Some(e), Some(spec)) = (e, &spec) {
        unexport(e, spec, "shutting down");
    }
    if let Some((_, server)) = lock_raw().take() {
        server.stop();
    }
    if let Some(n) = lock_nic().take() {
        n.stop(true);
    }
    let _ = std::fs::remove_file(&control);
    match Arc::try_unwrap(host) {
        Ok(h) => h.shutdown(),
        Err(h) => drop(h),
    }
    eprintln!("lanbus host: stopped");
    Ok(())
}

fn ask(path: &Path, line: &str) -> anyhow::Result<Value> {
    let mut s = UnixStream::connect(path).with_context(|| format!("connecting {}", path.display()))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(format!("{line}\n").as_bytes())?;
    let mut reply = String::new();
    BufReader::new(&s).read_line(&mut reply)?;
    serde_json::from_str(&reply).with_context(|| format!("bad reply from {}", path.display()))
}

fn print_value(v: &Value, indent: usize) {
    let pad = " ".repeat(indent);
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                match v {
                    Value::Object(_) | Value::Array(_) => {
                        println!("{pad}{k}:");
                        print_value(v, indent + 2);
                    }
                    _ => println!("{pad}{k}: {}", scalar(v)),
                }
            }
        }
        Value::Array(a) => {
            for v in a {
                match v {
                    Value::Object(_) | Value::Array(_) => {
                        println!("{pad}-");
                        print_value(v, indent + 2);
                    }
                    _ => {
                        for (i, l) in scalar(v).lines().enumerate() {
                            println!("{pad}{}{l}", if i == 0 { "- " } else { "  " });
                        }
                    }
                }
            }
        }
        _ => println!("{pad}{}", scalar(v)),
    }
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

/// Runs `lanbus status`.
pub fn status(args: StatusArgs) -> anyhow::Result<()> {
    let paths: Vec<PathBuf> = match args.control {
        Some(p) => vec![p],
        None => [HOST_CONTROL, DEVICE_CONTROL, crate::stack::STACK_CONTROL]
            .iter()
            .map(PathBuf::from)
            .filter(|p| p.exists())
            .collect(),
    };
    if paths.is_empty() {
        bail!(
            "no daemon control socket at {HOST_CONTROL}, {DEVICE_CONTROL} or {}; give --control PATH",
            crate::stack::STACK_CONTROL
        );
    }
    for p in paths {
        let v = ask(&p, "status json")?;
        if args.json {
            println!("{v}");
        } else {
            println!("{}:", p.display());
            print_value(&v, 2);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_specs() {
        assert_eq!("nbd:/tmp/a.sock".parse::<ExportSpec>().unwrap(), ExportSpec::Unix("/tmp/a.sock".into()));
        assert_eq!(
            "nbd:tcp:127.0.0.1:10809".parse::<ExportSpec>().unwrap(),
            ExportSpec::Tcp("127.0.0.1:10809".parse().unwrap())
        );
        assert!("nbd:".parse::<ExportSpec>().is_err());
        assert!("tcp:1.2.3.4:5".parse::<ExportSpec>().is_err());
        assert!("nbd:tcp:nothing".parse::<ExportSpec>().is_err());
    }

    #[test]
    fn config_files() {
        let d: DeviceFile =
            toml::from_str("port = \"udp:127.0.0.1:7000\"\ngroup = 7\nnvme = \"ram=64M\"\nlba_size = 4096\n")
                .unwrap();
        assert_eq!((d.group, d.lba_size, d.nvme.as_deref()), (Some(7), Some(4096), Some("ram=64M")));
        assert!(toml::from_str::<DeviceFile>("colour = 1\n").is_err());
        let h: HostFile = toml::from_str("port = \"x\"\nexport = \"nbd:/tmp/s\"\n").unwrap();
        assert_eq!(h.export.unwrap().into_vec(), ["nbd:/tmp/s"]);
        let h: HostFile = toml::from_str("port = \"x\"\nexport = [\"nbd:/tmp/s\", \"tap:lb0\"]\n").unwrap();
        assert_eq!(h.export.unwrap().into_vec(), ["nbd:/tmp/s", "tap:lb0"]);
    }

    #[test]
    fn backings() {
        assert_eq!("ram=1M".parse::<NvmeBacking>().unwrap(), NvmeBacking::Ram(1 << 20));
        assert_eq!(
            "file=/x,size=2G".parse::<NvmeBacking>().unwrap(),
            NvmeBacking::File { path: "/x".into(), size: Some(2 << 30) }
        );
        assert!("disk=/x".parse::<NvmeBacking>().is_err());
        assert!("ram=1M,size=2".parse::<NvmeBacking>().is_err());
    }
}
