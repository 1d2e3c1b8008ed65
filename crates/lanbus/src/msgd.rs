//! `lanbus msgd`: the messaging poller daemon. It owns the port; the node's processes attach to
//! it over a Unix socket and shared memory (`lanbus_node::msgd`) and need neither the port nor
//! its privileges.

use std::path::PathBuf;

use anyhow::Context;
use lanbus_node::config::{self, MsgdFile};
use lanbus_node::msgd::MsgDaemon;
use lanbus_node::process::Blocked;

/// Options of `lanbus msgd` (each may come from `--config FILE` instead; the command line wins).
#[derive(Debug, clap::Args)]
pub struct MsgdArgs {
    /// A TOML file with the same keys: port, socket, group, key, encrypt, dup_acks.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The port (see PORT SPECS in `lanbus --help`). Give it once per link to use several
    /// paths: frames spread over the links that are up, and a link lost costs no I/O.
    #[arg(long)]
    port: Vec<lanbus_port::PortSpec>,
    /// The Unix socket processes attach at (default /tmp/lanbus-msgd.sock). Root, this daemon's
    /// user and members of its group may attach (checked with SO_PEERCRED).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// The fabric group: daemons exchange messages only within their group (default 0).
    #[arg(long)]
    group: Option<u16>,
    /// Duplicate ACKs (ACKs acknowledging nothing new) that count a frame lost, as a fast
    /// retransmit (the transport's default, 2, if unset; the retransmission paper's rule, two
    /// ACKs with the same number in a row, is 1).
    #[arg(long, value_name = "N")]
    dup_acks: Option<u32>,
    #[command(flatten)]
    keys: crate::keys::KeyArgs,
}

/// Runs the daemon until SIGINT or SIGTERM.
pub fn run(args: MsgdArgs) -> anyhow::Result<()> {
    let file: MsgdFile = config::read_toml(args.config.as_deref())?;
    let specs = crate::keys::port_specs(args.port, file.port)?;
    let socket = args.socket.or(file.socket).unwrap_or_else(|| "/tmp/lanbus-msgd.sock".into());
    let group = args.group.or(file.group).unwrap_or(0);
    let signals = Blocked::termination().context("blocking SIGINT and SIGTERM")?;
    let keyed = crate::keys::keyed(&args.keys, file.key, file.encrypt, "lanbus msgd")?;
    let port = crate::keys::open_ports(keyed.as_ref(), &specs)?;
    let mut rc = config::msgd_runtime_config("msgd");
    rc.transport.group = group;
    let dup_acks = crate::daemon::dup_acks(args.dup_acks, file.dup_acks)?;
    if let Some(n) = crate::keys::multipath_dup_acks(dup_acks, &specs) {
        rc.transport.dup_ack_threshold = n;
    }
    let daemon = MsgDaemon::start(port, &socket, rc)
        .with_context(|| format!("starting the daemon at {}", socket.display()))?;
    eprintln!(
        "lanbus msgd: node {} (group {}) serving processes at {}",
        daemon.mac(),
        group,
        socket.display()
    );
    let sig = signals.wait();
    eprintln!("lanbus msgd: signal {sig}: stopping ({} processes attached)", daemon.clients());
    drop(daemon);
    eprintln!("lanbus msgd: stopped");
    Ok(())
}
