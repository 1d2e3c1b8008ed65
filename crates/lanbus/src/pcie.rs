//! `lanbus lspci` and `lanbus device-ctl`: a host bridge that lists the remote functions of its
//! group like `lspci -v`, and the client of a device daemon's control socket (the daemon itself,
//! with the DMA engine and the NVMe drive, is [`lanbus_node::device`]).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use lanbus_runtime::ThreadMode;

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
    let wait = Duration::from_secs_f64(args.wait.max(0.0));
    let devices = lanbus_node::lspci::enumerate(port, args.group, wait, args.mode.into())?;
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

fn send_control(path: &std::path::Path, line: &str) -> anyhow::Result<String> {
    Ok(lanbus_node::control::ask(path, line)?)
}
