//! `lanbus lspci` and `lanbus device-ctl`: a host bridge that lists the remote functions of its
//! group like `lspci -v`, and the client of a device daemon's control socket (the daemon itself,
//! with the DMA engine and the NVMe drive, is `crate::daemon`).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use lanbus_bridge::{HostBridge, HostBridgeConfig};
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
    lanbus_node::config::runtime_config(name, mode)
}

/// `lanbus lspci`.
#[derive(Debug, Args)]
pub struct LspciArgs {
    /// The port to reach the device bridges through (see `lanbus --help` for specs).
    #[arg(long)]
    port: lanbus_port::PortSpec,
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

/// Runs `lanbus lspci`.
pub fn lspci(args: LspciArgs) -> anyhow::Result<()> {
    let port = args.port.open().with_context(|| format!("opening {}", args.port))?;
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
        println!("{}", lanbus_node::lspci::describe(f));
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
