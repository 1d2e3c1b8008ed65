//! `lanbus stackd`: argument parsing over [`lanbus_node::stackd`], the TCP/IP stack server on
//! its port, until SIGINT or SIGTERM.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use lanbus_node::config::{self, StackdFile};
use lanbus_node::control::STACK_CONTROL;
use lanbus_node::process::Blocked;
use lanbus_node::stackd::{self, StackDaemon};
use lanbus_stack::server::ServerConfig;

use crate::stack::STACK_SOCKET;

/// Options of `lanbus stackd` (each may come from `--config FILE` instead; the command line
/// wins).
#[derive(Debug, clap::Args)]
pub struct StackdArgs {
    /// A TOML file with the same keys: port, ip, gateway, ip6, gateway6, socket, control,
    /// tcp_buffer, tcp_timeout.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The port: afpacket:IFACE (the server adds ethertypes=all). The interface must have no
    /// kernel IP address: the kernel would answer the stack's TCP segments with resets.
    #[arg(long)]
    port: Option<lanbus_port::PortSpec>,
    /// The stack's address and prefix length, e.g. 10.0.0.1/24.
    #[arg(long)]
    ip: Option<String>,
    /// The default route.
    #[arg(long)]
    gateway: Option<Ipv4Addr>,
    /// An IPv6 address and prefix length too, e.g. fd00::1/64 (without it the stack speaks IPv4
    /// only).
    #[arg(long)]
    ip6: Option<String>,
    /// The IPv6 default route (with an IPv6 address).
    #[arg(long)]
    gateway6: Option<Ipv6Addr>,
    /// The Unix socket programs attach at (root, this daemon's user and its group may; default
    /// /tmp/lanbus-stackd.sock).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// The control socket `lanbus status --control PATH` asks (default /tmp/lanbus-stackd.ctl).
    #[arg(long)]
    control: Option<PathBuf>,
    /// Bytes of each TCP connection's receive and of its send buffer (default 512 KiB). The
    /// receive window is at most this; the port's receive ring holds 512 frames, so larger
    /// windows of single segments can overflow it.
    #[arg(long)]
    tcp_buffer: Option<usize>,
    /// Seconds a connection waits for a silent peer (handshake or unacknowledged data) before it
    /// fails with ETIMEDOUT (default 30).
    #[arg(long)]
    tcp_timeout: Option<u64>,
}

/// Runs the stack server until SIGINT or SIGTERM.
pub fn run(args: StackdArgs) -> anyhow::Result<()> {
    let file: StackdFile = config::read_toml(args.config.as_deref())?;
    let port =
        args.port.or(file.port).context("give --port afpacket:IFACE (or port = \"...\" in --config)")?;
    let ip = args.ip.or(file.ip).context("give --ip ADDRESS/PREFIX (or ip = \"...\" in --config)")?;
    let ip6 = args.ip6.or(file.ip6);
    let gateway6 = args.gateway6.or(file.gateway6);
    if gateway6.is_some() && ip6.is_none() {
        bail!("an IPv6 gateway needs an IPv6 address: give --ip6 too");
    }
    let socket = args.socket.or(file.socket).unwrap_or_else(|| STACK_SOCKET.into());
    let control = args.control.or(file.control).unwrap_or_else(|| STACK_CONTROL.into());
    let signals = Blocked::termination().context("blocking SIGINT and SIGTERM")?;
    let (addr, prefix) = stackd::host_address_v4(&ip)?;
    let mut config = ServerConfig::new(addr, prefix, &socket);
    config.gateway = args.gateway.or(file.gateway);
    config.ip6 = ip6.as_deref().map(stackd::host_address_v6).transpose()?;
    config.gateway6 = gateway6;
    config.tcp_buffer_bytes = args.tcp_buffer.or(file.tcp_buffer).unwrap_or(512 << 10).clamp(4096, 64 << 20);
    config.timeout = Duration::from_secs(args.tcp_timeout.or(file.tcp_timeout).unwrap_or(30).max(1));
    let daemon = StackDaemon::start(&port, config, &control)?;
    let v6 = ip6.as_deref().map(|a| format!(" and {a}")).unwrap_or_default();
    eprintln!(
        "lanbus stackd: {addr}/{prefix}{v6} on {} (MAC {}, MTU {}); programs attach at {}, status at {}",
        stackd::port_spec(&port)?,
        daemon.mac(),
        daemon.mtu(),
        socket.display(),
        control.display()
    );
    let sig = signals.wait();
    eprintln!(
        "lanbus stackd: signal {sig}: stopping ({} clients attached)",
        daemon.server().status().clients
    );
    daemon.stop();
    eprintln!("lanbus stackd: stopped");
    Ok(())
}
