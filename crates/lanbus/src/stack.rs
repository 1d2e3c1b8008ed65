//! `lanbus stackd`, the TCP/IP stack server, and `lanbus stack`, programs that use it (send and
//! receive like `nc`, through the client library).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use lanbus_node::process::Blocked;
use lanbus_port::afpacket::AfPacketConfig;
use lanbus_port::{PortKind, PortSpec};
use lanbus_stack::client::StackClient;
use lanbus_stack::server::{Server, ServerConfig, ServerStatus};
use lanbus_stack::CopyUnit;
use serde_json::{json, Value};

/// Where `lanbus stackd` serves programs by default.
pub const STACK_SOCKET: &str = "/tmp/lanbus-stackd.sock";
/// Where `lanbus stackd` answers `lanbus status` by default.
pub const STACK_CONTROL: &str = "/tmp/lanbus-stackd.ctl";

/// Options of `lanbus stackd`.
#[derive(Debug, clap::Args)]
pub struct StackdArgs {
    /// The port: afpacket:IFACE (the server adds ethertypes=all). The interface must have no
    /// kernel IP address: the kernel would answer the stack's TCP segments with resets.
    #[arg(long)]
    port: lanbus_port::PortSpec,
    /// The stack's address and prefix length, e.g. 10.0.0.1/24.
    #[arg(long)]
    ip: String,
    /// The default route.
    #[arg(long)]
    gateway: Option<Ipv4Addr>,
    /// An IPv6 address and prefix length too, e.g. fd00::1/64 (without it the stack speaks IPv4
    /// only).
    #[arg(long)]
    ip6: Option<String>,
    /// The IPv6 default route.
    #[arg(long, requires = "ip6")]
    gateway6: Option<Ipv6Addr>,
    /// The Unix socket programs attach at (root, this daemon's user and its group may).
    #[arg(long, default_value = STACK_SOCKET)]
    socket: PathBuf,
    /// The control socket `lanbus status --control PATH` asks.
    #[arg(long, default_value = STACK_CONTROL)]
    control: PathBuf,
    /// Bytes of each TCP connection's receive and of its send buffer. The receive window is at
    /// most this; the port's receive ring holds 512 frames, so larger windows of single
    /// segments can overflow it.
    #[arg(long, default_value_t = 512 << 10)]
    tcp_buffer: usize,
    /// Seconds a connection waits for a silent peer (handshake or unacknowledged data) before it
    /// fails with ETIMEDOUT.
    #[arg(long, default_value_t = 30)]
    tcp_timeout: u64,
}

/// Parses `A.B.C.D/LEN`.
fn parse_cidr(s: &str) -> anyhow::Result<(Ipv4Addr, u8)> {
    let (ip, len) =
        s.split_once('/').with_context(|| format!("{s:?}: write ADDRESS/PREFIX, e.g. 10.0.0.1/24"))?;
    let ip: Ipv4Addr = ip.parse().with_context(|| format!("{ip:?} is not an IPv4 address"))?;
    let len: u8 = len
        .parse()
        .ok()
        .filter(|l| (1..=32).contains(l))
        .with_context(|| format!("/{len}: a prefix is 1 to 32"))?;
    if ip.is_unspecified() || ip.is_multicast() || ip.is_broadcast() {
        bail!("{ip} cannot be a host's address");
    }
    Ok((ip, len))
}

/// Parses `IPV6/LEN`.
fn parse_cidr6(s: &str) -> anyhow::Result<(Ipv6Addr, u8)> {
    let (ip, len) =
        s.split_once('/').with_context(|| format!("{s:?}: write ADDRESS/PREFIX, e.g. fd00::1/64"))?;
    let ip: Ipv6Addr = ip.parse().with_context(|| format!("{ip:?} is not an IPv6 address"))?;
    let len: u8 = len
        .parse()
        .ok()
        .filter(|l| (1..=128).contains(l))
        .with_context(|| format!("/{len}: a prefix is 1 to 128"))?;
    if ip.is_unspecified() || ip.is_multicast() || ip.is_loopback() || ip.to_ipv4_mapped().is_some() {
        bail!("{ip} cannot be a host's address");
    }
    Ok((ip, len))
}

/// The port spec stackd opens: afpacket with every EtherType.
fn stack_port_spec(spec: &PortSpec) -> anyhow::Result<PortSpec> {
    match &spec.kind {
        PortKind::AfPacket(config) => {
            let config = AfPacketConfig { all_ethertypes: true, ..config.clone() };
            Ok(PortSpec { kind: PortKind::AfPacket(config), ..spec.clone() })
        }
        PortKind::AfXdp { .. } => bail!(
            "{spec}: the afxdp port's XDP program passes only lanbus frames to the socket; use afpacket:IFACE"
        ),
        PortKind::Udp(_) | PortKind::Shm { .. } | PortKind::Sim => {
            bail!("{spec}: a TCP/IP stack needs raw Ethernet; use afpacket:IFACE")
        }
        _ => bail!("{spec}: use afpacket:IFACE"),
    }
}

pub(crate) fn status_json(s: &ServerStatus) -> Value {
    let c = &s.counters;
    json!({
        "clients": s.clients,
        "listening": s.listening,
        "connections": s.connections.iter().map(|c| json!({
            "local": c.local.map(|a| a.to_string()),
            "remote": c.remote.map(|a| a.to_string()),
            "state": c.state,
            "pid": c.pid,
        })).collect::<Vec<_>>(),
        "counters": {
            "clients_attached": c.clients_attached,
            "clients_broken": c.clients_broken,
            "clients_refused": c.clients_refused,
            "connections_opened": c.connections_opened,
            "connections_freed": c.connections_freed,
            "rx_frames": c.rx_frames,
            "tx_frames": c.tx_frames,
            "tx_offloaded": c.tx_offloaded,
            "rx_dropped": c.rx_dropped,
            "tx_dropped": c.tx_dropped,
            "bytes_from_clients": c.tx_bytes,
            "bytes_to_clients": c.rx_bytes,
            "zero_copy_bytes": c.zero_copy_bytes,
            "zero_copy_moved_bytes": c.zero_copy_moved_bytes,
        },
    })
}

/// Runs the stack server until SIGINT or SIGTERM.
pub fn stackd(args: StackdArgs) -> anyhow::Result<()> {
    let signals = Blocked::termination().context("blocking SIGINT and SIGTERM")?;
    let (ip, prefix) = parse_cidr(&args.ip)?;
    let spec = stack_port_spec(&args.port)?;
    let port = spec.open()?;
    let mac = port.mac();
    let mtu = port.mtu();
    let mut config = ServerConfig::new(ip, prefix, &args.socket);
    config.gateway = args.gateway;
    config.ip6 = args.ip6.as_deref().map(parse_cidr6).transpose()?;
    config.gateway6 = args.gateway6;
    config.tcp_buffer_bytes = args.tcp_buffer.clamp(4096, 64 << 20);
    config.timeout = Duration::from_secs(args.tcp_timeout.max(1));
    let server = Arc::new(
        Server::start(port, config)
            .with_context(|| format!("starting the server at {}", args.socket.display()))?,
    );
    let control = crate::daemon::bind_control(&args.control)?;
    let stop = Arc::new(AtomicBool::new(false));
    let (s2, stop2) = (server.clone(), stop.clone());
    let control_thread = std::thread::spawn(move || {
        crate::daemon::serve_control(&control, &stop2, &|line| match line {
            "status" | "status json" => status_json(&s2.status()).to_string(),
            other => json!({ "error": format!("unknown command {other:?}; ask `status`") }).to_string(),
        });
    });
    let v6 = args.ip6.as_deref().map(|a| format!(" and {a}")).unwrap_or_default();
    eprintln!(
        "lanbus stackd: {ip}/{prefix}{v6} on {spec} (MAC {mac}, MTU {mtu}); programs attach at {}, status at {}",
        args.socket.display(),
        args.control.display()
    );
    let sig = signals.wait();
    eprintln!("lanbus stackd: signal {sig}: stopping ({} clients attached)", server.status().clients);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = control_thread.join();
    let _ = std::fs::remove_file(&args.control);
    drop(server);
    eprintln!("lanbus stackd: stopped");
    Ok(())
}

/// Programs that use a running `lanbus stackd`.
#[derive(Debug, clap::Subcommand)]
pub enum StackCommand {
    /// Connects to IP:PORT through the stack, sends standard input (or --bytes of a pattern),
    /// shuts its side down, and writes what the peer sends to standard output until the peer
    /// closes (like `nc -N`).
    Send(SendArgs),
    /// Listens on PORT through the stack, accepts one connection and writes what arrives to
    /// standard output (or counts it with --discard), then prints what it received.
    Recv(RecvArgs),
}

/// Options every `lanbus stack` program takes.
#[derive(Debug, clap::Args)]
pub struct ClientArgs {
    /// The stack server's socket.
    #[arg(long, default_value = STACK_SOCKET)]
    socket: PathBuf,
    /// The copy unit: CLUSTER_BYTESxCLUSTERS[,socket] (e.g. 2048x16; `2048x1,socket` is the
    /// rump-kernel study's baseline: one 2 KiB cluster per request over the Unix socket).
    #[arg(long, default_value_t = CopyUnit::DEFAULT)]
    unit: CopyUnit,
    /// Bytes per read or write call of the program.
    #[arg(long, default_value_t = 128 * 1024)]
    buffer: usize,
}

/// Options of `lanbus stack send`.
#[derive(Debug, clap::Args)]
pub struct SendArgs {
    /// Where to connect: IP:PORT (an IPv6 address in brackets: [fd00::2]:80).
    to: SocketAddr,
    #[command(flatten)]
    client: ClientArgs,
    /// Send this many bytes of a fixed pattern (byte k of the stream is k mod 251) instead of
    /// standard input.
    #[arg(long)]
    bytes: Option<u64>,
    /// Send through a zero-copy connection: the bytes are read (or made) straight into the
    /// connection's send buffer, shared with the stack server, which sends them from there.
    #[arg(long)]
    zero_copy: bool,
}

/// Where `lanbus stack send` puts its bytes: `fill` writes at most the slice's length and says
/// how many it wrote (0: the end).
trait Sink {
    fn put(&mut self, fill: &mut dyn FnMut(&mut [u8]) -> std::io::Result<usize>) -> std::io::Result<usize>;
}

/// The copying path: through the program's own buffer.
struct Copying<'a> {
    stream: &'a mut lanbus_stack::client::TcpStream,
    buf: Vec<u8>,
}

impl Sink for Copying<'_> {
    fn put(&mut self, fill: &mut dyn FnMut(&mut [u8]) -> std::io::Result<usize>) -> std::io::Result<usize> {
        let n = fill(&mut self.buf)?;
        self.stream.write_all(&self.buf[..n])?;
        Ok(n)
    }
}

/// The zero-copy path: straight into the shared send buffer.
impl Sink for lanbus_stack::client::ZeroCopyStream {
    fn put(&mut self, fill: &mut dyn FnMut(&mut [u8]) -> std::io::Result<usize>) -> std::io::Result<usize> {
        let room = self.reserve()?;
        let n = fill(room)?;
        self.commit(n)?;
        Ok(n)
    }
}

/// Sends standard input, or `bytes` of the pattern, through `sink`; returns the bytes sent.
fn send_all(sink: &mut dyn Sink, bytes: Option<u64>, max: usize) -> std::io::Result<u64> {
    let mut sent = 0u64;
    match bytes {
        Some(total) => {
            let pattern: Vec<u8> = (0..max + 251).map(|i| (i % 251) as u8).collect();
            while sent < total {
                let at = (sent % 251) as usize;
                sent += sink.put(&mut |buf| {
                    let n = ((total - sent) as usize).min(buf.len()).min(max);
                    buf[..n].copy_from_slice(&pattern[at..at + n]);
                    Ok(n)
                })? as u64;
            }
        }
        None => {
            let mut stdin = std::io::stdin().lock();
            loop {
                let n = sink.put(&mut |buf| loop {
                    let len = buf.len().min(max);
                    match stdin.read(&mut buf[..len]) {
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        other => return other,
                    }
                })?;
                if n == 0 {
                    break;
                }
                sent += n as u64;
            }
        }
    }
    Ok(sent)
}

/// Options of `lanbus stack recv`.
#[derive(Debug, clap::Args)]
pub struct RecvArgs {
    /// The TCP port to listen on.
    port: u16,
    #[command(flatten)]
    client: ClientArgs,
    /// Count the bytes instead of writing them out.
    #[arg(long)]
    discard: bool,
    /// Give up if no connection arrives within this many seconds.
    #[arg(long, default_value_t = 60)]
    accept_timeout: u64,
}

fn rate(bytes: u64, t: Duration) -> String {
    format!(
        "{bytes} bytes in {:.3} s ({:.1} Mbit/s)",
        t.as_secs_f64(),
        bytes as f64 * 8.0 / t.as_secs_f64().max(1e-9) / 1e6
    )
}

/// Runs a `lanbus stack` program.
pub fn run(cmd: StackCommand) -> anyhow::Result<()> {
    match cmd {
        StackCommand::Send(a) => {
            let client = StackClient::attach(&a.client.socket, a.client.unit)?;
            let max = a.client.buffer.max(1);
            let start = Instant::now();
            let connecting = || format!("connecting to {}", a.to);
            let (sent, mut reader): (u64, Box<dyn Read>) = if a.zero_copy {
                let mut stream = client.connect_zero_copy(a.to).with_context(connecting)?;
                let sent = send_all(&mut stream, a.bytes, max).context("sending")?;
                stream.shutdown_write()?;
                (sent, Box::new(stream))
            } else {
                let mut stream = client.connect(a.to).with_context(connecting)?;
                let mut sink = Copying { stream: &mut stream, buf: vec![0u8; max] };
                let sent = send_all(&mut sink, a.bytes, max).context("sending")?;
                stream.shutdown_write()?;
                (sent, Box::new(stream))
            };
            // Until the peer's close: the bytes are then delivered, not merely queued.
            let mut buf = vec![0u8; max];
            let mut out = std::io::stdout().lock();
            let mut got = 0u64;
            loop {
                let n = reader.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                out.write_all(&buf[..n])?;
                got += n as u64;
            }
            out.flush()?;
            eprintln!("lanbus stack send: sent {}; received {got} bytes", rate(sent, start.elapsed()));
            Ok(())
        }
        StackCommand::Recv(a) => {
            let client = StackClient::attach(&a.client.socket, a.client.unit)?;
            let listener =
                client.listen(a.port, 1).with_context(|| format!("listening on port {}", a.port))?;
            let (mut stream, peer) =
                listener.accept_timeout(Some(Duration::from_secs(a.accept_timeout))).with_context(|| {
                    format!("waiting {} s for a connection on port {}", a.accept_timeout, a.port)
                })?;
            drop(listener);
            let mut buf = vec![0u8; a.client.buffer.max(1)];
            let start = Instant::now();
            let mut got = 0u64;
            let mut out = std::io::stdout().lock();
            loop {
                let n = stream.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                if !a.discard {
                    out.write_all(&buf[..n])?;
                }
                got += n as u64;
            }
            out.flush()?;
            eprintln!("lanbus stack recv: from {peer}: {}", rate(got, start.elapsed()));
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs_and_port_specs() {
        assert_eq!(parse_cidr("10.0.0.1/24").unwrap(), (Ipv4Addr::new(10, 0, 0, 1), 24));
        assert!(parse_cidr("10.0.0.1").is_err());
        assert_eq!(parse_cidr6("fd00::1/64").unwrap(), ("fd00::1".parse().unwrap(), 64));
        assert!(parse_cidr6("fd00::1/129").is_err());
        assert!(parse_cidr6("::1/128").is_err());
        assert!(parse_cidr6("10.0.0.1/24").is_err());
        assert!(parse_cidr("10.0.0.1/33").is_err());
        assert!(parse_cidr("0.0.0.0/8").is_err());
        let stack = |s: &str| stack_port_spec(&s.parse().unwrap()).map(|s| s.to_string());
        assert_eq!(stack("afpacket:veth0").unwrap(), "afpacket:veth0,ethertypes=all");
        assert_eq!(stack("afpacket:veth0,ethertypes=all").unwrap(), "afpacket:veth0,ethertypes=all");
        assert!(stack("udp:127.0.0.1:7000").is_err());
        assert!(stack("afxdp:veth0").is_err());
    }
}
