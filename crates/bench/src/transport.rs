//! `lanbus bench transport`: the reliable transport on real ports over a veth pair between two
//! network namespaces, one process per namespace, with the kernel's own tools as peers.
//!
//! For each port (udp, afpacket with its default TPACKET_V2 receive ring, afpacket with the
//! TPACKET_V3 ring (`afpacket-v3`), afxdp) and each polling mode (busy, adaptive) it measures:
//!
//! - ping-pong latency (p50, p99 of the round trip, in microseconds) for 64 B and 1 KiB messages:
//!   the client's handler sends the next message from the reply's delivery, so a round is one
//!   transport message each way and nothing else;
//! - reliable streaming goodput (messages/s and Gbit/s of message bytes delivered in order) for
//!   64 B, 1 KiB and 8 KiB messages: the sink returns a credit every so many messages and the
//!   sender's handler tops its window up from each credit, so all the work is on the runtime
//!   threads and the clock stops when the last message is known delivered;
//! - with adaptive polling only, the CPU an idle lanbus process uses (heartbeats on), from
//!   `/proc/PID/stat` utime + stime;
//! - the bare port's round trip (`raw:PORT` rows, busy only): the same port opened the same way,
//!   frames as long as the ping-pong's bounced straight back, no transport; run right after each
//!   busy lanbus run of the same size, so the difference between the two is what the transport
//!   adds in the same minute, and the raw ratio to sockperf is what the port and kernel leave.
//!
//! The peers run in the same invocation on the same veth: sockperf UDP ping-pong blocking
//! (`peer:sockperf-udp`) and with `--nonblocked` on both ends (`peer:sockperf-udp-busy`), both
//! reporting full round trips (`--full-rtt`), and iperf3 TCP and UDP at maximum rate. Ratios
//! compare like with like: busy lanbus rows against sockperf busy, adaptive against blocking; and
//! afxdp goodput against udp's. Latency is measured in pairs: each run takes sockperf's figure and
//! every port's right after one another (see [`measure_latency`]), and a latency ratio is the
//! median of the runs' ratios.
//!
//! Transport settings: point to point (no heartbeats), default window (128 frames), checksums and
//! packing on, and the delay-based rate control on, as in the daemons (`--rate-control off` on
//! the peer turns it off).
//!
//! Processes: the bench re-executes this binary inside each namespace (`ip netns exec`, hidden
//! subcommand `lanbus bench transport-peer`): a server (echo, sink, idle or raw-echo) in namespace b
//! that prints `ready` once its port is open, and a client (ping, stream or raw-ping) in namespace
//! a that prints one JSON line of results. Every figure is the median of several runs (`--quick`:
//! one short run).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read as _, Write as _};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use clap::{Args, ValueEnum};
use lanbus_port::netns::{Netns, VethPair};
use lanbus_runtime::{Handler, Outbox, Polling, Runtime, RuntimeConfig, ThreadMode};
use lanbus_transport::{Config, Message};
use lanbus_wire::MacAddr;
use serde_json::{json, Value};

use super::report::{median, Report, Row};
use lanbus_node::process::end_with_parent;

pub(crate) mod peer;
/// Every port the bench knows, in table order.
const PORTS: &[&str] = &["udp", "afpacket", "afpacket-v3", "afxdp"];
/// Ping-pong message sizes.
const PING_SIZES: &[usize] = &[64, 1024];
/// Streaming message sizes.
const STREAM_SIZES: &[usize] = &[64, 1024, 8192];
/// The channel the bench's messages use.
const CHANNEL: u16 = 1;

/// Options of `lanbus bench transport`.
#[derive(Debug, Args)]
pub struct TransportArgs {
    /// Write the results in the common JSON format to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// One short run per figure (a smoke test, not a measurement).
    #[arg(long)]
    quick: bool,
    /// Runs per figure; the median is reported (default 3, 1 with --quick).
    #[arg(long)]
    runs: Option<usize>,
    /// The ports to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "udp,afpacket,afpacket-v3,afxdp")]
    ports: Vec<String>,
    /// MTU of the veth pair (every row crosses it, the peers too; lanbus frames are as large as
    /// it). 9000 is the usual jumbo frame.
    #[arg(long, default_value_t = 1500, value_parser = clap::value_parser!(u32).range(576..=65_000))]
    mtu: u32,
}

/// What a peer process does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Role {
    /// Server: echo every message back.
    Echo,
    /// Server: check and count messages, return credits.
    Sink,
    /// Server: a node with heartbeats on and nothing to do (for the idle CPU figure).
    Idle,
    /// Client: ping-pong rounds against an echo server.
    Ping,
    /// Client: stream to a sink.
    Stream,
    /// Server: bounce every raw message straight back through the port, addresses swapped, with
    /// no transport (the bare port's half of a round trip); a message of several frames once all
    /// of them came.
    RawEcho,
    /// Client: the raw frames a lanbus message of `--size` bytes takes, sent in one burst when
    /// the last came back from a raw echo server: the bare port's round trip.
    RawPing,
}

/// How the peer's runtime polls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Spin forever.
    Busy,
    /// Spin briefly after work, then block in poll(2).
    Adaptive,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Busy => "busy",
            Mode::Adaptive => "adaptive",
        }
    }
}

pub use peer::{run_peer, PeerArgs};

// ---------------------------------------------------------------------------------------------
// The orchestrating process.
// ---------------------------------------------------------------------------------------------

/// How long each client measures, and how many runs make a figure.
struct Plan {
    runs: usize,
    seconds: f64,
    idle_seconds: f64,
}

/// The port specs of one kind on both ends.
pub(crate) struct PortSpecs {
    pub(crate) a: String,
    pub(crate) b: String,
}

pub(crate) fn port_specs(pair: &VethPair, kind: &str) -> anyhow::Result<PortSpecs> {
    let (a, b) = (&pair.a, &pair.b);
    let (sa, sb) = match kind {
        // Datagrams as large as the link takes, as the other ports' frames are.
        "udp" => {
            let mtu = pair.mtu()? - super::UDP_IPV4_HEADERS;
            (
                format!("udp:{}:7000,mac={},peer={}@{}:7000,mtu={mtu}", a.ipv4, a.mac, b.mac, b.ipv4),
                format!("udp:{}:7000,mac={},peer={}@{}:7000,mtu={mtu}", b.ipv4, b.mac, a.mac, a.ipv4),
            )
        }
        "afpacket" => (format!("afpacket:{}", a.ifname), format!("afpacket:{}", b.ifname)),
        "afpacket-v3" => (format!("afpacket:{},rx=v3", a.ifname), format!("afpacket:{},rx=v3", b.ifname)),
        "afxdp" => (format!("afxdp:{}", a.ifname), format!("afxdp:{}", b.ifname)),
        other => bail!("unknown port {other:?}; one of {}", PORTS.join(", ")),
    };
    Ok(PortSpecs { a: sa, b: sb })
}

/// A server process in a namespace, stopped (stdin closed, then killed if need be) on drop.
pub(crate) struct Server {
    child: Child,
}

impl Server {
    /// Starts `command` and waits for its `ready` line.
    pub(crate) fn start(mut command: Command, what: &str) -> anyhow::Result<Server> {
        command.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = command.spawn().with_context(|| format!("starting {what}"))?;
        let mut line = String::new();
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let _ = reader.read_line(&mut line);
            let _ = tx.send(line);
            // Keep reading so the server never blocks on a full pipe.
            let _ = std::io::copy(&mut reader, &mut std::io::sink());
        });
        let line = rx.recv_timeout(Duration::from_secs(20)).unwrap_or_default();
        if line.trim() != "ready" {
            let _ = child.kill();
            let _ = child.wait();
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = e.read_to_string(&mut err);
            }
            bail!("{what} did not start: {}", err.trim());
        }
        Ok(Server { child })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs a client command to completion and parses its JSON line.
pub(crate) fn run_client(mut command: Command, what: &str) -> anyhow::Result<Value> {
    let out = command.stdin(Stdio::null()).output().with_context(|| format!("starting {what}"))?;
    if !out.status.success() {
        bail!("{what} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or("");
    serde_json::from_str(line).with_context(|| format!("{what} printed {line:?}"))
}

pub(crate) fn peer_command(
    ns: &Netns,
    exe: &str,
    spec: &str,
    peer: MacAddr,
    role: &str,
    mode: Mode,
) -> Command {
    let mut c = ns.command(exe);
    c.args(["bench", "transport-peer", "--port", spec, "--peer", &peer.to_string(), "--role", role]);
    c.args(["--polling", mode.name()]);
    c
}

/// The row name and mode sockperf's figures carry when compared with lanbus in `mode`.
fn sockperf_row(mode: Mode) -> (&'static str, &'static str) {
    match mode {
        Mode::Busy => ("peer:sockperf-udp-busy", "busy"),
        Mode::Adaptive => ("peer:sockperf-udp", "blocking"),
    }
}

/// The runs of one ping-pong figure: (run, p50, p99) each, microseconds.
type Runs = Vec<(usize, f64, f64)>;

/// Ping-pong latency of every port and of sockperf, in pairs: each run measures every figure of
/// every port next to sockperf's (sockperf first in even runs, last in odd ones, so that over the
/// runs every port is as near it on average), and a figure's ratio is the median of its runs'
/// ratios. On a shared VM the cost of a kernel path drifts by tens of percent within minutes;
/// measured one after the other (all of lanbus, then all of sockperf), single runs of the
/// afpacket 1 KiB ratio ranged from 0.52 to 0.97. A port (or sockperf) that fails stops being
/// measured, with a note saying where; what it measured before is reported. Returns the ports
/// that never failed, for the streaming rows.
fn measure_latency(
    pair: &VethPair,
    exe: &str,
    ports: &[String],
    plan: &Plan,
    report: &mut Report,
    notes: &mut Vec<String>,
) -> Vec<(String, PortSpecs)> {
    let mut alive = Vec::new();
    for kind in ports {
        match port_specs(pair, kind) {
            Ok(specs) => alive.push((kind.clone(), specs)),
            Err(e) => notes.push(format!("{kind}: skipped: {e:#}")),
        }
    }
    let mut sockperf = have("sockperf");
    if !sockperf {
        notes.push(
            "peer:sockperf-udp rows skipped: sockperf is not installed (apt-get install sockperf)".into(),
        );
    }
    let mut runs: BTreeMap<(String, &'static str, usize), Runs> = BTreeMap::new();
    let mut raw_off: Vec<String> = Vec::new();
    for run in 0..plan.runs {
        for mode in [Mode::Busy, Mode::Adaptive] {
            for &size in PING_SIZES {
                let peer_first = run % 2 == 0;
                if peer_first && sockperf {
                    sockperf = sockperf_sample(pair, plan, mode, size, run, &mut runs, notes);
                }
                alive.retain(|(kind, specs)| {
                    match ping_once(pair, exe, kind, specs, plan, Trip::Lanbus(mode), size, run) {
                        Ok((p50, p99)) => {
                            runs.entry((kind.clone(), mode.name(), size)).or_default().push((run, p50, p99));
                            if mode == Mode::Busy {
                                let at = (size, run);
                                raw_sample(pair, exe, kind, specs, plan, at, &mut runs, &mut raw_off, notes);
                            }
                            true
                        }
                        Err(e) => {
                            let why = format!(
                                "{kind}: stopped at {} ping-pong {size} B, run {}: {e:#} (figures measured \
                                 before are reported, from the runs they had; its streaming rows are missing)",
                                mode.name(),
                                run + 1
                            );
                            eprintln!("bench transport: {why}");
                            notes.push(why);
                            false
                        }
                    }
                });
                if !peer_first && sockperf {
                    sockperf = sockperf_sample(pair, plan, mode, size, run, &mut runs, notes);
                }
            }
        }
    }
    // In table order: each port busy then adaptive, the bare ports, then sockperf busy then
    // blocking. Whatever was measured is reported, also of a port or a sockperf that failed later.
    let mut rows: Vec<(String, &'static str)> = Vec::new();
    for kind in ports {
        rows.extend([Mode::Busy, Mode::Adaptive].map(|m| (kind.clone(), m.name())));
    }
    rows.extend(ports.iter().map(|kind| (raw_row(kind), "busy")));
    rows.extend([Mode::Busy, Mode::Adaptive].map(sockperf_row).map(|(name, mode)| (name.to_string(), mode)));
    for (name, mode) in &rows {
        let (name, mode) = (name.as_str(), *mode);
        for &size in PING_SIZES {
            let Some(r) = runs.get(&(name.to_string(), mode, size)) else { continue };
            let p50: Vec<f64> = r.iter().map(|s| s.1).collect();
            let p99: Vec<f64> = r.iter().map(|s| s.2).collect();
            for (metric, values) in [("p50_us", &p50), ("p99_us", &p99)] {
                if let Some(m) = median(values) {
                    report.push(Row::new(name, metric, m).with("size_bytes", size).with("mode", mode));
                }
            }
        }
    }
    let raw_rows: Vec<String> = ports.iter().map(|kind| raw_row(kind)).collect();
    for kind in ports.iter().chain(&raw_rows) {
        for mode in [Mode::Busy, Mode::Adaptive] {
            let (peer, peer_mode) = sockperf_row(mode);
            for &size in PING_SIZES {
                let ours = runs.get(&(kind.clone(), mode.name(), size));
                let theirs = runs.get(&(peer.to_string(), peer_mode, size));
                if let Some(r) = ours.zip(theirs).and_then(|(a, b)| paired_ratio(a, b)) {
                    report.push(
                        Row::new(kind.as_str(), "p50_vs_sockperf", r)
                            .with("size_bytes", size)
                            .with("mode", mode.name()),
                    );
                }
            }
        }
    }
    alive
}

/// The median over runs of `ours / theirs` (p50s of the same run); `None` when no run has both.
fn paired_ratio(ours: &Runs, theirs: &Runs) -> Option<f64> {
    let ratios: Vec<f64> = ours
        .iter()
        .filter_map(|&(run, p50, _)| theirs.iter().find(|t| t.0 == run).map(|t| p50 / t.1))
        .collect();
    median(&ratios)
}

/// One sockperf run into `runs`; false (with a note) when sockperf failed.
fn sockperf_sample(
    pair: &VethPair,
    plan: &Plan,
    mode: Mode,
    size: usize,
    run: usize,
    runs: &mut BTreeMap<(String, &'static str, usize), Runs>,
    notes: &mut Vec<String>,
) -> bool {
    let (name, peer_mode) = sockperf_row(mode);
    eprintln!("bench transport: {name} {size} B, run {}", run + 1);
    match sockperf_once(pair, plan, mode == Mode::Busy, size) {
        Ok((p50, p99)) => {
            eprintln!("bench transport:   p50 {p50:.2} us, p99 {p99:.2} us");
            runs.entry((name.to_string(), peer_mode, size)).or_default().push((run, p50, p99));
            true
        }
        Err(e) => {
            let why = format!(
                "sockperf: stopped at {name} {size} B, run {}: {e:#} (figures measured before are \
                 reported, from the runs they had)",
                run + 1
            );
            eprintln!("bench transport: {why}");
            notes.push(why);
            false
        }
    }
}

/// What one ping-pong run measures.
#[derive(Clone, Copy)]
enum Trip {
    /// lanbus's round trip (echo server and ping client) with this polling.
    Lanbus(Mode),
    /// The bare port's (raw echo server and raw ping client, busy, no transport).
    Raw,
}

/// One ping-pong run of `kind`: (p50, p99) in microseconds.
#[allow(clippy::too_many_arguments)]
fn ping_once(
    pair: &VethPair,
    exe: &str,
    kind: &str,
    specs: &PortSpecs,
    plan: &Plan,
    trip: Trip,
    size: usize,
    run: usize,
) -> anyhow::Result<(f64, f64)> {
    let (label, mode, (server_role, client_role)) = match trip {
        Trip::Lanbus(mode) => (format!("{kind} {}", mode.name()), mode, ("echo", "ping")),
        Trip::Raw => (raw_row(kind), Mode::Busy, ("raw-echo", "raw-ping")),
    };
    eprintln!("bench transport: {label} ping-pong {size} B, run {}", run + 1);
    let server = peer_command(&pair.b.netns, exe, &specs.b, pair.a.mac, server_role, mode);
    let _server = Server::start(server, &format!("{kind} {server_role} server"))?;
    let mut client = peer_command(&pair.a.netns, exe, &specs.a, pair.b.mac, client_role, mode);
    client.args(["--size", &size.to_string(), "--seconds", &plan.seconds.to_string()]);
    let v = run_client(client, &format!("{kind} {client_role} client"))?;
    let (p50, p99) = (v["p50_us"].as_f64().unwrap_or(f64::NAN), v["p99_us"].as_f64().unwrap_or(f64::NAN));
    eprintln!("bench transport:   p50 {p50:.2} us, p99 {p99:.2} us");
    Ok((p50, p99))
}

/// The row of a port's bare round trip.
fn raw_row(kind: &str) -> String {
    format!("raw:{kind}")
}

/// One bare round-trip run of `kind` at `(size, run)` into `runs`, unless an earlier one failed;
/// a failure is noted and stops the port's raw rows only. Run right after the port's busy lanbus
/// run of the same size: what the port and the kernel take of the round trip in the same minute;
/// the rest of lanbus's figure is the transport's.
#[allow(clippy::too_many_arguments)]
fn raw_sample(
    pair: &VethPair,
    exe: &str,
    kind: &str,
    specs: &PortSpecs,
    plan: &Plan,
    (size, run): (usize, usize),
    runs: &mut BTreeMap<(String, &'static str, usize), Runs>,
    failed: &mut Vec<String>,
    notes: &mut Vec<String>,
) {
    let raw = raw_row(kind);
    if failed.contains(&raw) {
        return;
    }
    match ping_once(pair, exe, kind, specs, plan, Trip::Raw, size, run) {
        Ok((p50, p99)) => runs.entry((raw, "busy", size)).or_default().push((run, p50, p99)),
        Err(e) => {
            let why = format!("{raw}: stopped at {size} B, run {}: {e:#}", run + 1);
            eprintln!("bench transport: {why}");
            notes.push(why);
            failed.push(raw);
        }
    }
}

/// The streaming and idle rows of one port.
fn measure_streaming(
    pair: &VethPair,
    exe: &str,
    kind: &str,
    specs: &PortSpecs,
    plan: &Plan,
    report: &mut Report,
) -> anyhow::Result<()> {
    let secs = plan.seconds.to_string();
    for mode in [Mode::Busy, Mode::Adaptive] {
        for &size in STREAM_SIZES {
            let (mut msgs, mut gbit) = (Vec::new(), Vec::new());
            for run in 0..plan.runs {
                eprintln!("bench transport: {kind} {} streaming {size} B, run {}", mode.name(), run + 1);
                let mut server = peer_command(&pair.b.netns, exe, &specs.b, pair.a.mac, "sink", mode);
                server.args(["--size", &size.to_string()]);
                let _server = Server::start(server, &format!("{kind} sink"))?;
                let mut client = peer_command(&pair.a.netns, exe, &specs.a, pair.b.mac, "stream", mode);
                client.args(["--size", &size.to_string(), "--seconds", &secs]);
                let v = run_client(client, &format!("{kind} stream client"))?;
                msgs.push(v["msgs_per_s"].as_f64().unwrap_or(f64::NAN));
                gbit.push(v["gbit_per_s"].as_f64().unwrap_or(f64::NAN));
            }
            for (metric, values) in [("msgs_per_s", &msgs), ("gbit_per_s", &gbit)] {
                if let Some(m) = median(values) {
                    report.push(Row::new(kind, metric, m).with("size_bytes", size).with("mode", mode.name()));
                }
            }
        }
    }
    // An idle node with adaptive polling and heartbeats on.
    eprintln!("bench transport: {kind} idle CPU ({} s)", plan.idle_seconds);
    let server = peer_command(&pair.b.netns, exe, &specs.b, pair.a.mac, "idle", Mode::Adaptive);
    let server = Server::start(server, &format!("{kind} idle node"))?;
    std::thread::sleep(Duration::from_millis(300));
    let before = cpu_ticks(server.pid())?;
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(plan.idle_seconds));
    let after = cpu_ticks(server.pid())?;
    let percent = (after - before) as f64 / clock_ticks_per_second() / t.elapsed().as_secs_f64() * 100.0;
    report.push(Row::new(kind, "idle_cpu_percent", percent).with("mode", "adaptive"));
    Ok(())
}

/// utime + stime of a process, in clock ticks (`/proc/PID/stat` fields 14 and 15).
fn cpu_ticks(pid: u32) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) may contain spaces; the fields after it follow its ')'.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).ok_or_else(|| anyhow!("odd /proc/{pid}/stat"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state): utime is field 14, stime field 15.
    let utime: u64 = fields.get(11).and_then(|f| f.parse().ok()).ok_or_else(|| anyhow!("no utime"))?;
    let stime: u64 = fields.get(12).and_then(|f| f.parse().ok()).ok_or_else(|| anyhow!("no stime"))?;
    Ok(utime + stime)
}

/// `getconf CLK_TCK` (100 on Linux unless configured otherwise).
fn clock_ticks_per_second() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

fn have(program: &str) -> bool {
    Command::new(program).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok()
}

/// Starts a peer tool's server in namespace b and gives it a moment to bind.
fn start_tool_server(ns: &Netns, program: &str, args: &[&str]) -> anyhow::Result<Child> {
    let child = end_with_parent(&mut ns.command(program))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {program} server"))?;
    std::thread::sleep(Duration::from_millis(300));
    Ok(child)
}

fn stop(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// The value after `percentile P =` in sockperf's output.
fn sockperf_percentile(text: &str, p: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.contains(&format!("percentile {p} =")))
        .and_then(|l| l.rsplit('=').next())
        .and_then(|v| v.trim().parse().ok())
}

/// One sockperf UDP ping-pong run, blocking or busy (`--nonblocked` on both ends), full round
/// trips: (p50, p99) in microseconds.
fn sockperf_once(pair: &VethPair, plan: &Plan, busy: bool, size: usize) -> anyhow::Result<(f64, f64)> {
    let b_ip = pair.b.ipv4.to_string();
    let secs = (plan.seconds.ceil() as u64).max(1).to_string();
    let mut server_args = vec!["server", "-i", &b_ip, "-p", "11111"];
    if busy {
        server_args.push("--nonblocked");
    }
    let server = start_tool_server(&pair.b.netns, "sockperf", &server_args)?;
    let size_s = size.to_string();
    let mut args = vec!["ping-pong", "-i", &b_ip, "-p", "11111", "-m", &size_s, "-t", &secs, "--full-rtt"];
    if busy {
        args.push("--nonblocked");
    }
    let out = pair.a.netns.exec("sockperf", &args);
    stop(server);
    let out = out?;
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    match (sockperf_percentile(&text, "50.000"), sockperf_percentile(&text, "99.000")) {
        (Some(a), Some(b)) => Ok((a, b)),
        _ => bail!("could not read sockperf's percentiles from: {}", text.trim()),
    }
}

/// iperf3 TCP and UDP (`-b 0`: as fast as it goes) from a to b; receiver-side figures.
fn measure_iperf3(pair: &VethPair, plan: &Plan, report: &mut Report) -> anyhow::Result<()> {
    let b_ip = pair.b.ipv4.to_string();
    let secs = (plan.seconds.ceil() as u64).max(1).to_string();
    let cases: &[(&str, Option<usize>)] =
        &[("peer:iperf3-tcp", None), ("peer:iperf3-udp", Some(64)), ("peer:iperf3-udp", Some(1024))];
    for &(name, udp_size) in cases {
        let (mut msgs, mut gbit) = (Vec::new(), Vec::new());
        for run in 0..plan.runs {
            eprintln!("bench transport: {name} {udp_size:?}, run {}", run + 1);
            let server =
                start_tool_server(&pair.b.netns, "iperf3", &["-s", "-1", "-B", &b_ip, "-p", "5211"])?;
            let mut args = vec![
                "-c".to_string(),
                b_ip.clone(),
                "-p".into(),
                "5211".into(),
                "-t".into(),
                secs.clone(),
                "-J".into(),
            ];
            if let Some(size) = udp_size {
                args.extend(["-u".into(), "-b".into(), "0".into(), "-l".into(), size.to_string()]);
            }
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            let out = pair.a.netns.exec("iperf3", &refs);
            stop(server);
            let out = out?;
            let v: Value = serde_json::from_slice(&out.stdout)
                .with_context(|| format!("iperf3 printed {}", String::from_utf8_lossy(&out.stdout)))?;
            if let Some(e) = v.get("error") {
                bail!("iperf3: {e}");
            }
            let end = &v["end"];
            match udp_size {
                None => {
                    let bps = end["sum_received"]["bits_per_second"].as_f64().unwrap_or(f64::NAN);
                    gbit.push(bps / 1e9);
                }
                Some(size) => {
                    // The receiver's view: datagrams that arrived.
                    let sum = &end["sum"];
                    let packets = sum["packets"].as_f64().unwrap_or(f64::NAN);
                    let lost = sum["lost_packets"].as_f64().unwrap_or(0.0);
                    let seconds = sum["seconds"].as_f64().unwrap_or(f64::NAN);
                    let rate = (packets - lost) / seconds;
                    msgs.push(rate);
                    gbit.push(rate * size as f64 * 8.0 / 1e9);
                }
            }
        }
        let size = udp_size.unwrap_or(131_072);
        if let Some(m) = median(&msgs) {
            report.push(Row::new(name, "msgs_per_s", m).with("size_bytes", size));
        }
        if let Some(m) = median(&gbit) {
            report.push(Row::new(name, "gbit_per_s", m).with("size_bytes", size));
        }
    }
    Ok(())
}

fn find(report: &Report, name: &str, metric: &str, size: usize, mode: &str) -> Option<f64> {
    report
        .rows
        .iter()
        .find(|r| {
            r.name == name
                && r.metric == metric
                && r.params.get("size_bytes").and_then(Value::as_u64) == Some(size as u64)
                && r.params.get("mode").and_then(Value::as_str) == Some(mode)
        })
        .map(|r| r.value)
}

/// Goodput of afxdp against udp (the latency ratios come from [`measure_latency`]).
fn goodput_ratios(report: &mut Report) {
    let mut rows = Vec::new();
    for mode in ["busy", "adaptive"] {
        for &size in STREAM_SIZES {
            if let (Some(x), Some(u)) = (
                find(report, "afxdp", "msgs_per_s", size, mode),
                find(report, "udp", "msgs_per_s", size, mode),
            ) {
                rows.push(
                    Row::new("afxdp", "goodput_vs_udp", x / u).with("size_bytes", size).with("mode", mode),
                );
            }
        }
    }
    for r in rows {
        report.push(r);
    }
}

/// Runs the whole benchmark.
pub fn run(args: TransportArgs) -> anyhow::Result<()> {
    for p in &args.ports {
        if !PORTS.contains(&p.as_str()) {
            bail!("unknown port {p:?} in --ports; one of {}", PORTS.join(","));
        }
    }
    let plan = if args.quick {
        Plan { runs: args.runs.unwrap_or(1), seconds: 0.3, idle_seconds: 1.0 }
    } else {
        Plan { runs: args.runs.unwrap_or(3).max(1), seconds: 1.5, idle_seconds: 5.0 }
    };
    let pair = VethPair::create().map_err(|skip| anyhow!("bench transport needs a veth pair: {skip}"))?;
    pair.set_mtu(args.mtu as usize).with_context(|| format!("setting the veth's MTU to {}", args.mtu))?;
    let exe = std::env::current_exe().context("finding this program")?;
    let exe = exe.to_string_lossy().to_string();
    let mut report = Report::new("transport");
    let mut notes = Vec::new();
    let alive = measure_latency(&pair, &exe, &args.ports, &plan, &mut report, &mut notes);
    for (kind, specs) in &alive {
        if let Err(e) = measure_streaming(&pair, &exe, kind, specs, &plan, &mut report) {
            eprintln!("bench transport: {kind} streaming skipped: {e:#}");
            notes.push(format!("{kind}: streaming skipped: {e:#}"));
        }
    }
    if have("iperf3") {
        if let Err(e) = measure_iperf3(&pair, &plan, &mut report) {
            notes.push(format!("iperf3: {e:#}"));
        }
    } else {
        notes.push("peer:iperf3 rows skipped: iperf3 is not installed (apt-get install iperf3)".into());
    }
    goodput_ratios(&mut report);
    for row in &mut report.rows {
        row.params.insert("mtu".into(), args.mtu.into());
    }
    report.finish(args.json.as_deref())?;
    for n in &notes {
        println!("note: {n}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::peer::{fill_message, index_of, is_message, percentile};
    use super::*;

    #[test]
    fn messages_carry_their_index_and_sockperf_output_parses() {
        let mut buf = Vec::new();
        fill_message(&mut buf, 77, 64);
        assert_eq!((buf.len(), index_of(&buf)), (64, Some(77)));
        assert!(buf[8..].iter().enumerate().all(|(k, &b)| b == (77 + 8 + k) as u8));
        assert!(is_message(&buf, 77) && !is_message(&buf, 78) && !is_message(&buf[..7], 77));
        buf[40] ^= 1;
        assert!(!is_message(&buf, 77));
        fill_message(&mut buf, 300, 8192);
        assert!(is_message(&buf, 300));
        let text =
            "sockperf: ---> percentile 99.000 =   31.234\nsockperf: ---> percentile 50.000 =   12.500\n";
        assert_eq!(sockperf_percentile(text, "50.000"), Some(12.5));
        assert_eq!(sockperf_percentile(text, "99.000"), Some(31.234));
        assert_eq!(sockperf_percentile(text, "90.000"), None);
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 0.5), 2.0);
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 0.99), 4.0);
    }

    #[test]
    fn latency_ratios_pair_runs() {
        // Run 1 of the port is missing; run 2 of sockperf is: only runs 0 and 3 pair up.
        let ours: Runs = vec![(0, 2.0, 0.0), (2, 9.0, 0.0), (3, 3.0, 0.0)];
        let theirs: Runs = vec![(0, 4.0, 0.0), (1, 1.0, 0.0), (3, 4.0, 0.0)];
        assert_eq!(paired_ratio(&ours, &theirs), Some(0.625));
        // A slow period hits both rows of its run, not the ratio: the median of the runs' ratios
        // is 0.5 where the ratio of the medians would be 0.625.
        let ours: Runs = vec![(0, 2.0, 0.0), (1, 6.0, 0.0), (2, 2.5, 0.0)];
        let theirs: Runs = vec![(0, 4.0, 0.0), (1, 12.0, 0.0), (2, 3.3, 0.0)];
        assert_eq!(paired_ratio(&ours, &theirs), Some(0.5));
        assert_eq!(paired_ratio(&ours, &Vec::new()), None);
    }
}
