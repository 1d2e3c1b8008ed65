//! `lanbus device` and `lanbus host`: argument parsing and printing over [`lanbus_node::device`]
//! and [`lanbus_node::host`].
//!
//! SIGINT/SIGTERM: the host stops accepting, finishes the requests in flight, flushes (NVMe
//! Flush, then the shutdown notification) and exits 0; the I/O box stops its bridge and fsyncs
//! its drive's file.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;

use lanbus_node::config::{self, DeviceFile, ExportSpec, HostFile};
use lanbus_node::control::{self, Endpoints, DEVICE_CONTROL, HOST_CONTROL};
use lanbus_node::device::{Device, DeviceOptions};
use lanbus_node::host::{Host, HostOptions};
use lanbus_node::metrics::MetricsServer;

use crate::keys;

/// `lanbus device` options (each may come from `--config FILE` instead; the command line wins).
#[derive(Debug, Args)]
pub struct DeviceArgs {
    /// A TOML file with the same keys: port, group, nvme, nic, lba_size, control, name, state,
    /// metrics, key, encrypt, dup_acks.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The port (see PORT SPECS in `lanbus --help`). Give it once per link to use several
    /// paths: frames spread over the links that are up, and a link lost costs no I/O.
    #[arg(long)]
    port: Vec<lanbus_port::PortSpec>,
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
    /// Duplicate ACKs (ACKs acknowledging nothing new) that count a frame lost, as a fast
    /// retransmit (the transport's default, 2, if unset; the retransmission paper's rule, two
    /// ACKs with the same number in a row, is 1).
    #[arg(long, value_name = "N")]
    dup_acks: Option<u32>,
    #[command(flatten)]
    keys: crate::keys::KeyArgs,
}

/// `lanbus host` options (each may come from `--config FILE` instead; the command line wins).
#[derive(Debug, Args)]
pub struct HostArgs {
    /// A TOML file with the same keys: port, group, export (one spec or a list), control, name,
    /// metrics, key, encrypt, dup_acks.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The port (see PORT SPECS in `lanbus --help`). Give it once per link to use several
    /// paths: frames spread over the links that are up, and a link lost costs no I/O.
    #[arg(long)]
    port: Vec<lanbus_port::PortSpec>,
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
    /// Duplicate ACKs (ACKs acknowledging nothing new) that count a frame lost, as a fast
    /// retransmit (the transport's default, 2, if unset; the retransmission paper's rule, two
    /// ACKs with the same number in a row, is 1).
    #[arg(long, value_name = "N")]
    dup_acks: Option<u32>,
    #[command(flatten)]
    keys: crate::keys::KeyArgs,
}

/// The metrics address (the command line's, else the file's), bound now.
fn bind_metrics(
    arg: Option<std::net::SocketAddr>,
    file: Option<&str>,
) -> anyhow::Result<Option<std::net::TcpListener>> {
    let addr = match (arg, file) {
        (Some(a), _) => a,
        (None, Some(f)) => f.parse().with_context(|| format!("metrics = {f:?}: not IP:PORT"))?,
        (None, None) => return Ok(None),
    };
    let l = MetricsServer::bind(addr)?;
    eprintln!("lanbus: metrics at http://{addr}/metrics");
    Ok(Some(l))
}

/// The duplicate-ACK threshold (the command line's, else the file's), checked.
pub(crate) fn dup_acks(arg: Option<u32>, file: Option<u32>) -> anyhow::Result<Option<u32>> {
    match arg.or(file) {
        Some(0) => bail!("dup_acks = 0: a fast retransmit needs at least one duplicate ACK"),
        n => Ok(n),
    }
}

/// Runs `lanbus device`.
pub fn device(args: DeviceArgs) -> anyhow::Result<()> {
    let file: DeviceFile = config::read_toml(args.config.as_deref())?;
    let port_specs = keys::port_specs(args.port, file.port)?;
    let control = args.control.or(file.control).unwrap_or_else(|| DEVICE_CONTROL.into());
    let state = args.state.or(file.state).unwrap_or_else(|| {
        let mut p = control.clone().into_os_string();
        p.push(".state");
        p.into()
    });
    let mut options = DeviceOptions::new(
        args.group.or(file.group).unwrap_or(0),
        &args.name.or(file.name).unwrap_or_else(|| "lanbus-device".into()),
    );
    options.nvme = args.nvme.or(file.nvme).as_deref().map(str::parse).transpose()?;
    options.nic = args.nic.or(file.nic).as_deref().map(str::parse).transpose()?;
    options.lba_size = args.lba_size.or(file.lba_size).unwrap_or(512);
    options.dma_engine = args.dma_engine;
    options.threads = args.mode.into();
    options.state = Some(state.clone());
    let configured = options.group;
    let name = options.name.clone();
    // Before any thread starts, so that every thread inherits the blocked mask.
    let signals = lanbus_node::process::Blocked::termination()?;
    let metrics = bind_metrics(args.metrics, file.metrics.as_deref())?;
    let keyed = keys::keyed(&args.keys, file.key, file.encrypt, "lanbus device")?;
    let port = keys::open_ports(keyed.as_ref(), &port_specs)?;
    options.security = keyed.as_ref().and_then(|k| k.view());
    options.dup_acks = keys::multipath_dup_acks(dup_acks(args.dup_acks, file.dup_acks)?, &port_specs);
    let listener = control::bind(&control)?;
    let device = Arc::new(Device::start(port, options)?);
    let group = device.group();
    if device.resumed_group() {
        eprintln!(
            "lanbus device: serving group {group}, set at run time before the restart (configured \
             {configured}; {} keeps it)",
            state.display()
        );
    }
    eprintln!(
        "lanbus device: {name} ({}) group {group} on {}: {}; control {}",
        device.bridge().local_mac(),
        keys::describe_ports(&port_specs),
        device.describe(),
        control.display()
    );
    let endpoints = Endpoints::open(device.clone(), listener, &control, metrics)?;
    let sig = signals.wait();
    eprintln!("lanbus device: signal {sig}, stopping");
    endpoints.close();
    let device = Arc::into_inner(device).context("the device is still in use")?;
    device.shutdown()?;
    eprintln!("lanbus device: stopped, data flushed");
    Ok(())
}

/// Runs `lanbus host`.
pub fn host(args: HostArgs) -> anyhow::Result<()> {
    let file: HostFile = config::read_toml(args.config.as_deref())?;
    let port_specs = keys::port_specs(args.port, file.port)?;
    let texts = if args.export.is_empty() {
        file.export.map(|e| e.into_vec()).unwrap_or_default()
    } else {
        args.export
    };
    let exports: Vec<ExportSpec> = texts.iter().map(|t| t.parse()).collect::<Result<_, _>>()?;
    let mut options = HostOptions::new(
        args.group.or(file.group).unwrap_or(0),
        &args.name.or(file.name).unwrap_or_else(|| "lanbus-host".into()),
        exports,
    );
    options.threads = args.mode.into();
    let (name, group) = (options.name.clone(), options.group);
    let control = args.control.or(file.control).unwrap_or_else(|| HOST_CONTROL.into());
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).context("installing signal handlers")?;
    }
    let metrics = bind_metrics(args.metrics, file.metrics.as_deref())?;
    let keyed = keys::keyed(&args.keys, file.key, file.encrypt, "lanbus host")?;
    let port = keys::open_ports(keyed.as_ref(), &port_specs)?;
    options.security = keyed.as_ref().and_then(|k| k.view());
    options.dup_acks = keys::multipath_dup_acks(dup_acks(args.dup_acks, file.dup_acks)?, &port_specs);
    let listener = control::bind(&control)?;
    let host = Arc::new(Host::start(port, options, Box::new(|line| eprintln!("lanbus host: {line}")))?);
    eprintln!(
        "lanbus host: {name} ({}) group {group} on {}; waiting for {}; control {}",
        host.bridge().local_mac(),
        keys::describe_ports(&port_specs),
        host.waiting_for(),
        control.display()
    );
    let endpoints = Endpoints::open(host.clone(), listener, &control, metrics)?;
    // Relaxed: set by the signal handler, polled here.
    while !stop.load(Ordering::Relaxed) && host.running() {
        std::thread::sleep(Duration::from_millis(50));
    }
    endpoints.close();
    let failure = host.failure();
    let host = Arc::into_inner(host).context("the host is still in use")?;
    host.shutdown();
    if let Some(why) = failure {
        bail!("{why}");
    }
    eprintln!("lanbus host: stopped");
    Ok(())
}
