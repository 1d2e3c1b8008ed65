//! `lanbus msgd`: the messaging poller daemon. It owns the port; the node's processes attach to
//! it over a Unix socket and shared memory (`lanbus_node::msgd`) and need neither the port nor
//! its privileges.

use std::path::PathBuf;

use anyhow::Context;
use lanbus_node::msgd::MsgDaemon;
use lanbus_node::process::Blocked;

/// Options of `lanbus msgd`.
#[derive(Debug, clap::Args)]
pub struct MsgdArgs {
    /// The port (see PORT SPECS in `lanbus --help`).
    #[arg(long)]
    port: lanbus_port::PortSpec,
    /// The Unix socket processes attach at. Root, this daemon's user and members of its group
    /// may attach (checked with SO_PEERCRED).
    #[arg(long, default_value = "/tmp/lanbus-msgd.sock")]
    socket: PathBuf,
    /// The fabric group: daemons exchange messages only within their group.
    #[arg(long, default_value_t = 0)]
    group: u16,
}

/// Runs the daemon until SIGINT or SIGTERM.
pub fn run(args: MsgdArgs) -> anyhow::Result<()> {
    let signals = Blocked::termination().context("blocking SIGINT and SIGTERM")?;
    let port = args.port.open()?;
    let mut rc = lanbus_node::config::msgd_runtime_config("msgd");
    rc.transport.group = args.group;
    let daemon = MsgDaemon::start(port, &args.socket, rc)
        .with_context(|| format!("starting the daemon at {}", args.socket.display()))?;
    eprintln!(
        "lanbus msgd: node {} (group {}) serving processes at {}",
        daemon.mac(),
        args.group,
        args.socket.display()
    );
    let sig = signals.wait();
    eprintln!("lanbus msgd: signal {sig}: stopping ({} processes attached)", daemon.clients());
    drop(daemon);
    eprintln!("lanbus msgd: stopped");
    Ok(())
}
