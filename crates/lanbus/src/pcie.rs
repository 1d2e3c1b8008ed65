//! `lanbus lspci` and `lanbus device-ctl`: a host bridge that lists the remote functions of its
//! group like `lspci -v`, and the client of a device daemon's control socket (the daemon itself,
//! with the DMA engine and the NVMe drive, is `crate::daemon`).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use lanbus_bridge::{HostBridge, HostBridgeConfig, RemoteFunction};
use lanbus_pcie::config::{cap_id, BarKind};
use lanbus_runtime::{RuntimeConfig, ThreadMode};

/// Thread model on the command line.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Mode {
    /// One thread runs the transport.
    Rtc,
    /// TX and RX threads.
    Pipeline,
}

impl From<Mode> for ThreadMode {
    fn from(m: Mode) -> ThreadMode {
        match m {
            Mode::Rtc => ThreadMode::RunToCompletion,
            Mode::Pipeline => ThreadMode::Pipeline,
        }
    }
}

/// The runtime settings of the PCIe commands: the same as the daemons' ([`crate::fabric::runtime_config`]).
pub fn runtime_for(mode: ThreadMode, name: &str) -> RuntimeConfig {
    crate::fabric::runtime_config(name, mode)
}

/// `lanbus lspci`.
#[derive(Debug, Args)]
pub struct LspciArgs {
    /// The port to reach the device bridges through (see `lanbus --help` for specs).
    #[arg(long)]
    port: String,
    /// Our group: only device bridges of this group are listed.
    #[arg(long, default_value_t = 0)]
    group: u16,
    /// Seconds to wait for devices to announce themselves and be enumerated.
    #[arg(long, default_value_t = 2.0)]
    wait: f64,
    /// Thread model.
    #[arg(long, value_enum, default_value = "rtc")]
    mode: Mode,
}

fn class_name(class: u32) -> &'static str {
    match class >> 16 {
        0x01 => "Mass storage controller",
        0x02 => "Network controller",
        0x03 => "Display controller",
        0x04 => "Multimedia controller",
        0x05 => "Memory controller",
        0x06 => "Bridge",
        0x07 => "Communication controller",
        0x08 => "System peripheral",
        0x0c => "Serial bus controller",
        0x12 => "Processing accelerators",
        _ => "Unclassified device",
    }
}

fn size_text(size: u64) -> String {
    match size {
        s if s >= 1 << 30 && s % (1 << 30) == 0 => format!("{}G", s >> 30),
        s if s >= 1 << 20 && s % (1 << 20) == 0 => format!("{}M", s >> 20),
        s if s >= 1 << 10 && s % (1 << 10) == 0 => format!("{}K", s >> 10),
        s => format!("{s}"),
    }
}

/// One function as `lspci -v` would show it.
pub fn format_function(f: &RemoteFunction) -> String {
    let mut s = format!(
        "{} {} [{:04x}]: Device {:04x}:{:04x} (rev {:02x})\n",
        f.bdf,
        class_name(f.class_code),
        f.class_code >> 8,
        f.vendor_id,
        f.device_id,
        f.revision_id
    );
    s += &format!("\tSubsystem: Device {:04x}:{:04x}\n", f.subsystem_vendor_id, f.subsystem_id);
    s += &format!("\tDevice bridge: {} \"{}\", group {}\n", f.mac, f.name, f.group);
    s += "\tFlags: bus master, fast devsel\n";
    for b in &f.bars {
        match b.kind {
            BarKind::Io => s += &format!("\tI/O ports [disabled] [size={}]\n", size_text(b.size)),
            BarKind::Memory32 { prefetchable } | BarKind::Memory64 { prefetchable } => {
                let bits = if matches!(b.kind, BarKind::Memory64 { .. }) { 64 } else { 32 };
                let p = if prefetchable { "prefetchable" } else { "non-prefetchable" };
                s += &format!(
                    "\tMemory at {:x} ({bits}-bit, {p}) [size={}] (BAR{})\n",
                    b.address,
                    size_text(b.size),
                    b.index
                );
            }
        }
    }
    for (id, off) in &f.capabilities {
        match *id {
            cap_id::PCI_EXPRESS => {
                s += &format!(
                "\tCapabilities: [{off:02x}] Express Endpoint, MaxPayload {} bytes, MaxReadReq {} bytes\n",
                f.mps, f.mrrs
            )
            }
            cap_id::MSIX => {
                if let Some(m) = f.msix {
                    s += &format!("\tCapabilities: [{off:02x}] MSI-X: Enable+ Count={} Masked-\n", m.vectors);
                    s += &format!("\t\tVector table: BAR={} offset={:08x}\n", m.table_bar, m.table_offset);
                    s += &format!("\t\tPBA: BAR={} offset={:08x}\n", m.pba_bar, m.pba_offset);
                }
            }
            other => s += &format!("\tCapabilities: [{off:02x}] ID {other:02x}\n"),
        }
    }
    s
}

/// Runs `lanbus lspci`.
pub fn lspci(args: LspciArgs) -> anyhow::Result<()> {
    let port = lanbus_port::open(&args.port).with_context(|| format!("opening {}", args.port))?;
    let config = HostBridgeConfig {
        group: args.group,
        name: "lanbus-lspci".into(),
        runtime: runtime_for(args.mode.into(), "lspci"),
        ..HostBridgeConfig::default()
    };
    let host = HostBridge::start(port, config)?;
    let wait = Duration::from_secs_f64(args.wait.max(0.0));
    // Devices announce themselves every heartbeat interval; enumeration follows at once.
    std::thread::sleep(wait.min(Duration::from_millis(300)));
    let mut devices = host.wait_devices(1, wait.saturating_sub(Duration::from_millis(300)));
    // Let the enumerations already under way finish.
    let settle = std::time::Instant::now();
    while settle.elapsed() < Duration::from_millis(300) {
        std::thread::sleep(Duration::from_millis(50));
        devices = host.devices();
    }
    host.shutdown();
    if devices.is_empty() {
        eprintln!("no device bridge of group {} answered within {:.1} s", args.group, args.wait);
    }
    for f in &devices {
        println!("{}", format_function(f));
    }
    Ok(())
}

/// `lanbus device-ctl PATH group N` / `lanbus device-ctl PATH status`.
#[derive(Debug, Args)]
pub struct DeviceCtlArgs {
    /// The device's control socket.
    path: PathBuf,
    /// The command: `group N` or `status`.
    #[arg(required = true, num_args = 1..)]
    command: Vec<String>,
}

/// Sends one control line and prints the answer.
pub fn device_ctl(args: DeviceCtlArgs) -> anyhow::Result<()> {
    let reply = send_control(&args.path, &args.command.join(" "))?;
    println!("{reply}");
    if reply.starts_with("error") {
        bail!("the device refused the command");
    }
    Ok(())
}

fn send_control(path: &Path, line: &str) -> anyhow::Result<String> {
    let mut s = UnixStream::connect(path).with_context(|| format!("connecting to {}", path.display()))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    writeln!(s, "{line}")?;
    let mut reply = String::new();
    BufReader::new(s).read_line(&mut reply)?;
    Ok(reply.trim().to_string())
}
