//! `lanbus bench msg`: MPI-style ping-pong latency through the messaging engine, the
//! measurement of the MPI-over-DPDK paper (osu_latency against Open MPI's tcp BTL), with
//! NetPIPE's TCP ping-pong (`NPtcp`, Debian package netpipe-tcp) over the same veth as the peer.
//!
//! Two network namespaces joined by a veth pair (root). Each lanbus row runs two messaging
//! endpoints over a port of that kind (udp, afpacket, afxdp), one in each namespace, each owning
//! its port (`mode=direct`) or attached over shared memory to a messaging daemon that owns it
//! (`mode=daemon`, the `lanbus msgd` design): one sends a message of each size and waits for it to come back,
//! in three trials after a warm-up; the figure is half the mean round trip of the best trial,
//! which is what NetPIPE reports (osu_latency reports the mean of one trial). `--protocols
//! auto,eager,rendezvous` adds a row per protocol (the engine's choice, every message eager,
//! every message by rendezvous), which shows where the two cross; `--bandwidth` adds osu_bw's
//! streaming pattern (a window of messages back to back, then one short answer; the best of
//! three trials) against NetPIPE's one-way streaming (`NPtcp -s`, `bw_vs_nptcp`). Messages up to 32 KiB go eagerly, longer ones by rendezvous
//! (RTS, CTS, then the data). The peer runs NPtcp's receiver in one namespace and its transmitter
//! in the other over the same sizes. Runs go in turns (each lanbus kind, then the peer) and a
//! figure is the median of its runs; `latency_vs_nptcp` divides lanbus's by NetPIPE's (below 1:
//! lanbus is faster). `--mpi` adds rows measured through Open MPI itself (see `msg_mpi`): the
//! lanbus libfabric provider against Open MPI's tcp BTL on the same veth, in the same turns;
//! with `rendezvous` among `--protocols`, the tcp BTL also with its eager limit lowered to 64
//! bytes (`protocol=rendezvous`), the MPI-over-DPDK paper's TCP rendezvous curve.
//! With daemon rows, each run also measures `raw:relay` (see `msg_relay`): what a message's two
//! extra hand-offs between polling threads cost on this machine with every lanbus layer taken
//! out; `latency_vs_direct` divides each daemon row by its direct row, and `floor_vs_direct`
//! the direct row plus that relay time by the direct row (the least daemon mode can cost here).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use lanbus_msg::{Addr, Config, Match, Outcome, RequestId, Source, Status};
use lanbus_node::msg::MsgNode;
use lanbus_node::msgd::{MsgClient, MsgDaemon};
use lanbus_node::process::end_with_parent;
use lanbus_port::netns::VethPair;
use lanbus_runtime::ThreadMode;

use super::msg_mpi::{Program, Transport};
use super::plot::{write_png, Plot, Series};
use super::report::{median, Report, Row};

/// Options of `lanbus bench msg`.
#[derive(Debug, Args)]
pub struct MsgArgs {
    /// Write the results in the common JSON format to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// One short run with fewer round trips (a smoke test, not a measurement).
    #[arg(long)]
    quick: bool,
    /// Runs per figure; the median is reported (default 5, 1 with --quick).
    #[arg(long)]
    runs: Option<usize>,
    /// Port kinds to measure (comma-separated: udp, afpacket, afxdp).
    #[arg(long, value_delimiter = ',', default_value = "udp,afpacket")]
    ports: Vec<String>,
    /// Message sizes in bytes (comma-separated); NetPIPE measures powers of two, so those
    /// compare.
    #[arg(long, value_delimiter = ',', default_value = "1,64,1024,4096,16384,65536,262144,1048576")]
    sizes: Vec<usize>,
    /// MTU of the veth pair.
    #[arg(long, default_value_t = 1500)]
    mtu: usize,
    /// Skip the NetPIPE peer.
    #[arg(long)]
    no_peer: bool,
    /// How messages travel (comma-separated): the engine's choice, all eager (up to 65,516
    /// bytes), all by rendezvous. One row each.
    #[arg(long, value_delimiter = ',', default_value = "auto")]
    protocols: Vec<Protocol>,
    /// Also measure streaming bandwidth (osu_bw's pattern: a window of messages back to back,
    /// then one short answer), against NetPIPE's one-way streaming (`NPtcp -s`).
    #[arg(long)]
    bandwidth: bool,
    /// Messages per window of the bandwidth measurement.
    #[arg(long, default_value_t = 64)]
    window: usize,
    /// Where the engines run (comma-separated): each process owning its port (direct), or
    /// behind a `lanbus msgd` daemon on each side that owns it (daemon). One row each.
    #[arg(long, value_delimiter = ',', default_value = "direct,daemon")]
    modes: Vec<Mode>,
    /// Also measure through Open MPI: a ping-pong program built with mpicc and NetPIPE's
    /// NPopenmpi under mpirun, their two ranks in the two namespaces, over the lanbus libfabric
    /// provider (each port kind and mode) and, as the peer, over Open MPI's tcp BTL across the
    /// same veth (`latency_vs_ompi_tcp`, `bw_vs_ompi_tcp`). Needs Debian's openmpi-bin,
    /// libopenmpi-dev and netpipe-openmpi.
    #[arg(long)]
    mpi: bool,
    /// The keyed fabric's settings of the engine's rows (comma-separated, measured in turns):
    /// `off` (no key), `auth` (every frame authenticated under a key of this run) or `encrypt`
    /// (and its payload encrypted). With `auth` or `encrypt`, `crypto:` rows give the AEAD's own
    /// rate per core on 64 KiB frames. The Open MPI rows run without a key.
    #[arg(long, value_delimiter = ',', default_value = "off", value_parser = ["off", "auth", "encrypt"])]
    security: Vec<String>,
    /// Write the plots as PREFIX-latency.png and PREFIX-bandwidth.png (latency and bandwidth by
    /// size, a line per row).
    #[arg(long, default_value = "bench-msg")]
    png: String,
    /// The folder holding liblanbus-fi.so for --mpi (default: the one cargo built next to this
    /// binary, else /usr/local/lib/lanbus/libfabric, where scripts/install-fi-provider puts it).
    #[arg(long)]
    fi_provider: Option<PathBuf>,
}

/// The tag that ends the echo side.
const STOP: u64 = u64::MAX;
/// The tag of a streamed message (bandwidth) the echo side only takes.
const STREAM: u64 = u64::MAX - 1;
/// The tag of a window's last streamed message: the echo side answers with [`ACK`].
const STREAM_LAST: u64 = u64::MAX - 2;
/// The tag of the echo side's answer to a window.
const ACK: u64 = u64::MAX - 3;

/// How messages travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Protocol {
    /// The engine's choice: eager up to its limit (32 KiB), rendezvous above.
    Auto,
    /// Every message eagerly (up to the largest eager message, 65,516 bytes).
    Eager,
    /// Every message by rendezvous (RTS, CTS, then the data).
    Rendezvous,
}

impl Protocol {
    fn config(self) -> Config {
        match self {
            Protocol::Auto => Config::default(),
            Protocol::Eager => Config { eager_limit: Config::MAX_EAGER, ..Config::default() },
            Protocol::Rendezvous => Config { eager_limit: 0, ..Config::default() },
        }
    }

    fn name(self) -> &'static str {
        match self {
            Protocol::Auto => "auto",
            Protocol::Eager => "eager",
            Protocol::Rendezvous => "rendezvous",
        }
    }

    fn carries(self, size: usize) -> bool {
        self != Protocol::Eager || size <= Config::MAX_EAGER
    }

    /// The libfabric provider's eager limit for this protocol (`None`: its default).
    fn provider_eager_limit(self) -> Option<usize> {
        (self != Protocol::Auto).then(|| self.config().eager_limit)
    }
}

/// Round trips per trial at `size` (after a tenth as many warm-up ones).
fn iterations(size: usize, quick: bool) -> usize {
    let n = ((64usize << 20) / size.max(1)).clamp(50, 2000);
    if quick {
        (n / 10).max(10)
    } else {
        n
    }
}

/// Windows per trial of the streaming measurement at `size` (`window` messages each).
fn windows(size: usize, window: usize, quick: bool) -> usize {
    let n = ((256usize << 20) / (size.max(1) * window)).clamp(4, 200);
    if quick {
        (n / 4).max(2)
    } else {
        n
    }
}

/// What one lanbus row measured: per size, the one-way latency (µs) and, if asked, the
/// streaming bandwidth (MB/s).
struct Measured {
    latency_us: Vec<Option<f64>>,
    bw_mb_per_s: Vec<Option<f64>>,
}

/// Where the messaging engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Each process owns its port.
    Direct,
    /// A `lanbus msgd` daemon owns each side's port; the processes attach to it over shared
    /// memory.
    Daemon,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Direct => "direct",
            Mode::Daemon => "daemon",
        }
    }
}

/// How long any one request may take.
const TIMEOUT: Duration = Duration::from_secs(10);

/// A messaging endpoint as the bench drives it, in either mode (context 0 throughout).
trait Ep: Send {
    fn addr(&self) -> Addr;
    fn isend(&mut self, dest: Addr, tag: u64, data: Vec<u8>) -> anyhow::Result<RequestId>;
    fn irecv(&mut self, m: Match, capacity: usize) -> anyhow::Result<RequestId>;
    fn wait(&mut self, id: RequestId) -> anyhow::Result<Outcome>;
    fn cancel(&mut self, id: RequestId) -> bool;

    fn send(&mut self, dest: Addr, tag: u64, data: Vec<u8>) -> anyhow::Result<()> {
        let id = self.isend(dest, tag, data)?;
        self.wait(id).map(|_| ())
    }

    fn recv(&mut self, m: Match, capacity: usize) -> anyhow::Result<(Status, Vec<u8>)> {
        let id = self.irecv(m, capacity)?;
        match self.wait(id)? {
            Outcome::Received { status, data, .. } => Ok((status, data)),
            other => bail!("a receive ended as {other:?}"),
        }
    }
}

impl Ep for MsgNode {
    fn addr(&self) -> Addr {
        MsgNode::addr(self)
    }
    fn isend(&mut self, dest: Addr, tag: u64, data: Vec<u8>) -> anyhow::Result<RequestId> {
        Ok(MsgNode::isend(self, dest, 0, tag, data))
    }
    fn irecv(&mut self, m: Match, capacity: usize) -> anyhow::Result<RequestId> {
        Ok(MsgNode::irecv(self, m, capacity))
    }
    fn wait(&mut self, id: RequestId) -> anyhow::Result<Outcome> {
        Ok(MsgNode::wait(self, id, TIMEOUT)?)
    }
    fn cancel(&mut self, id: RequestId) -> bool {
        MsgNode::cancel(self, id)
    }
}

impl Ep for MsgClient {
    fn addr(&self) -> Addr {
        MsgClient::addr(self)
    }
    fn isend(&mut self, dest: Addr, tag: u64, data: Vec<u8>) -> anyhow::Result<RequestId> {
        Ok(MsgClient::isend(self, dest, 0, tag, data)?)
    }
    fn irecv(&mut self, m: Match, capacity: usize) -> anyhow::Result<RequestId> {
        Ok(MsgClient::irecv(self, m, capacity)?)
    }
    fn wait(&mut self, id: RequestId) -> anyhow::Result<Outcome> {
        Ok(MsgClient::wait(self, id, TIMEOUT)?)
    }
    fn cancel(&mut self, id: RequestId) -> bool {
        MsgClient::cancel(self, id)
    }
}

/// Half the mean round trip of `count` ping-pongs of `data`, µs.
fn round_trips(a: &mut dyn Ep, to_b: Addr, data: &[u8], count: usize) -> anyhow::Result<f64> {
    let size = data.len();
    let start = Instant::now();
    for _ in 0..count {
        a.send(to_b, size as u64, data.to_vec())?;
        let (_, back) = a.recv(Match::exact(Source::Only(to_b), 0, size as u64), size)?;
        if back.len() != size {
            bail!("{size} bytes sent, {} came back", back.len());
        }
    }
    Ok(start.elapsed().as_secs_f64() * 1e6 / count as f64 / 2.0)
}

/// MB/s of `count` windows of `window` messages of `data` sent back to back, each answered once.
fn stream(a: &mut dyn Ep, to_b: Addr, data: &[u8], window: usize, count: usize) -> anyhow::Result<f64> {
    let start = Instant::now();
    for _ in 0..count {
        let mut ids = Vec::with_capacity(window);
        for i in 0..window {
            let tag = if i + 1 == window { STREAM_LAST } else { STREAM };
            ids.push(a.isend(to_b, tag, data.to_vec())?);
        }
        for id in ids {
            a.wait(id)?;
        }
        a.recv(Match::exact(Source::Only(to_b), 0, ACK), 0)?;
    }
    Ok((data.len() * window * count) as f64 / start.elapsed().as_secs_f64() / 1e6)
}

/// The echo side: keeps `posted` receives posted (as osu_bw's receiver does) and takes them in
/// order: it echoes a ping, drops a streamed message, answers a window's last one.
fn echo(mut b: Box<dyn Ep>, posted: usize, largest: usize) -> anyhow::Result<()> {
    let any = Match::any_tag(Source::Any, 0);
    let mut waiting = std::collections::VecDeque::new();
    for _ in 0..posted {
        waiting.push_back(b.irecv(any, largest)?);
    }
    loop {
        let id = waiting.pop_front().expect("always some posted");
        let Outcome::Received { status, data, .. } = b.wait(id)? else {
            bail!("a receive ended without a message");
        };
        match status.tag {
            STOP => {
                for id in waiting {
                    b.cancel(id);
                }
                return Ok(());
            }
            STREAM => {}
            STREAM_LAST => b.send(status.source, ACK, Vec::new())?,
            tag => b.send(status.source, tag, data)?,
        }
        waiting.push_back(b.irecv(any, largest)?);
    }
}

/// Through the messaging engine over `kind` with `protocol`, in `mode`: per size, half the mean
/// round trip of the best of three trials (µs), and with `window` osu_bw's pattern: `window`
/// messages sent back to back, answered by one short message once all arrived, the best of
/// three trials (MB/s). Sizes the protocol cannot carry are `None`.
#[allow(clippy::too_many_arguments)]
fn lanbus_row(
    kind: &str,
    veth: &VethPair,
    mode: Mode,
    protocol: Protocol,
    security: &str,
    sizes: &[usize],
    window: Option<usize>,
    quick: bool,
    dir: &Path,
) -> anyhow::Result<Measured> {
    let (pa, pb) = crate::secured(super::port_pair(kind, Some(veth))?, security);
    let rc = |name: &str, threads: ThreadMode| {
        let mut c = lanbus_node::config::msg_runtime_config(name, threads);
        // Two endpoints that know each other's address: no discovery needed.
        c.transport.heartbeat.enabled = false;
        c
    };
    // The daemons (daemon mode) live as long as the row.
    let mut daemons = Vec::new();
    let (mut a, b): (Box<dyn Ep>, Box<dyn Ep>) = match mode {
        // As an MPI rank over the libfabric provider runs: its own thread moves its messages
        // while it waits (caller mode), no second thread per endpoint.
        Mode::Direct => (
            Box::new(MsgNode::start(pa, 1, rc("msg-a", ThreadMode::Caller), protocol.config())?),
            Box::new(MsgNode::start(pb, 1, rc("msg-b", ThreadMode::Caller), protocol.config())?),
        ),
        Mode::Daemon => {
            let (sa, sb) = (dir.join("msgd-a.sock"), dir.join("msgd-b.sock"));
            let rc = |name: &str| {
                let mut c = lanbus_node::config::msgd_runtime_config(name);
                c.transport.heartbeat.enabled = false;
                c
            };
            daemons.push(MsgDaemon::start(pa, &sa, rc("msgd-a"))?);
            daemons.push(MsgDaemon::start(pb, &sb, rc("msgd-b"))?);
            (
                Box::new(MsgClient::connect(&sa, protocol.config())?),
                Box::new(MsgClient::connect(&sb, protocol.config())?),
            )
        }
    };
    let (to_b, largest) = (b.addr(), sizes.iter().copied().max().unwrap_or(0));
    let posted = window.unwrap_or(1).max(1);
    let echo = std::thread::spawn(move || echo(b, posted, largest));
    let mut measured = Measured { latency_us: Vec::new(), bw_mb_per_s: Vec::new() };
    let mut run = || -> anyhow::Result<()> {
        for &size in sizes {
            if !protocol.carries(size) {
                measured.latency_us.push(None);
                measured.bw_mb_per_s.push(None);
                continue;
            }
            let data = vec![0x5a; size];
            let n = iterations(size, quick);
            round_trips(&mut *a, to_b, &data, n / 10)?;
            let mut best = f64::INFINITY;
            for _ in 0..3 {
                best = best.min(round_trips(&mut *a, to_b, &data, n)?);
            }
            measured.latency_us.push(Some(best));
            let Some(window) = window else {
                measured.bw_mb_per_s.push(None);
                continue;
            };
            let w = windows(size, window, quick);
            stream(&mut *a, to_b, &data, window, 1)?;
            let mut best: f64 = 0.0;
            for _ in 0..3 {
                best = best.max(stream(&mut *a, to_b, &data, window, w)?);
            }
            measured.bw_mb_per_s.push(Some(best));
        }
        Ok(())
    };
    let result = run();
    // Stop the echo side whatever happened (it times out by itself otherwise).
    let _ = a.send(to_b, STOP, Vec::new());
    match echo.join() {
        Ok(r) => r.context("the echo side")?,
        Err(_) => bail!("the echo side panicked"),
    }
    result?;
    drop(a);
    drop(daemons);
    Ok(measured)
}

/// The longest one NPtcp ping-pong run may take (a quarter of it with `--quick`); a whole run
/// to 1 MiB takes 15-30 s on the veth.
const NPTCP_LIMIT: Duration = Duration::from_secs(180);

/// The longest one NPtcp streaming run may take (a quarter of it with `--quick`): a whole run to
/// 1 MiB takes about 10 s, and one that stalls (NetPIPE's streaming mode now and then does) is
/// ended and tried once more rather than waited for.
const NPTCP_STREAM_LIMIT: Duration = Duration::from_secs(60);

/// NetPIPE over TCP for every size it measured from 1 byte to `upto` (NPtcp without
/// perturbations: powers of two and the sizes between): ping-pong, its one-way time (µs); with
/// `stream`, one-way streaming (`-s`), its throughput (MB/s).
fn nptcp(
    veth: &VethPair,
    upto: usize,
    stream: bool,
    quick: bool,
    dir: &Path,
) -> anyhow::Result<Vec<(usize, f64)>> {
    let limit = if stream { NPTCP_STREAM_LIMIT } else { NPTCP_LIMIT };
    let limit = if quick { limit / 4 } else { limit };
    let upper = upto.max(1).to_string();
    let mut opts = vec!["-l", "1", "-u", &upper, "-p", "0"];
    if stream {
        opts.push("-s");
    }
    let file = dir.join("np.out");
    let tries = if stream { 2 } else { 1 };
    for attempt in 1..=tries {
        if nptcp_once(veth, &opts, &file, limit)? {
            break;
        }
        if attempt == tries {
            bail!("NPtcp did not finish within {limit:?} ({tries} tries)");
        }
        eprintln!("bench msg: NPtcp stalled for {limit:?}; trying once more");
    }
    let text = std::fs::read_to_string(&file)?;
    let _ = std::fs::remove_file(&file);
    let mut rows = Vec::new();
    for line in text.lines() {
        let mut f = line.split_whitespace();
        let (Some(bytes), Some(mbps), Some(secs)) = (f.next(), f.next(), f.next()) else { continue };
        if let (Ok(b), Ok(mbps), Ok(s)) = (bytes.parse::<usize>(), mbps.parse::<f64>(), secs.parse::<f64>()) {
            rows.push((b, if stream { mbps / 8.0 } else { s * 1e6 }));
        }
    }
    if rows.is_empty() {
        bail!("NPtcp wrote no figures");
    }
    Ok(rows)
}

/// One NPtcp run with `opts` (a receiver in the second namespace, the transmitter in the first,
/// writing its table to `file`); false when the transmitter did not finish within `limit`.
fn nptcp_once(veth: &VethPair, opts: &[&str], file: &Path, limit: Duration) -> anyhow::Result<bool> {
    let mut receiver = end_with_parent(veth.b.netns.command("NPtcp").args(opts))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting NPtcp (Debian package netpipe-tcp)")?;
    let _ = std::fs::remove_file(file);
    let host = veth.b.ipv4.to_string();
    let file_s = file.display().to_string();
    let mut finished = None;
    // The receiver may take a moment to listen: the transmitter fails at once if it does not.
    for _ in 0..50 {
        let mut tx = end_with_parent(veth.a.netns.command("NPtcp").args(["-h", &host]).args(opts))
            .args(["-o", &file_s])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("running NPtcp")?;
        let start = Instant::now();
        let status = loop {
            if let Some(status) = tx.try_wait()? {
                break Some(status);
            }
            if start.elapsed() > limit {
                let _ = tx.kill();
                let _ = tx.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        match status {
            Some(s) if s.success() && file.exists() => {
                finished = Some(true);
                break;
            }
            Some(_) => std::thread::sleep(Duration::from_millis(100)),
            None => {
                finished = Some(false);
                break;
            }
        }
    }
    let _ = receiver.kill();
    let _ = receiver.wait();
    finished.ok_or_else(|| anyhow::anyhow!("NPtcp's transmitter could not reach its receiver at {host}"))
}

/// A lanbus row's port kind, mode and protocol.
type LanbusRow<'a> = (&'a str, Mode, Protocol);

/// An Open MPI row: over lanbus, or over Open MPI's tcp BTL at its own eager limit (`Auto`) or
/// with the limit lowered so that every message longer than a few bytes goes by its rendezvous
/// (`Rendezvous`: the MPI-over-DPDK paper's "TCP rendezvous" curve).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MpiRow<'a> {
    Lanbus(LanbusRow<'a>),
    Tcp(Protocol),
}

/// The tcp BTL's eager limit (and first rendezvous fragment) of its rendezvous row, bytes with
/// the BTL's header: longer messages go by rendezvous.
const TCP_RENDEZVOUS_LIMIT: usize = 64;

/// The most frames a bare round trip sends for one message: a floor for messages of a few
/// frames (a 2 KiB message on plain Ethernet frames), where it says what the frames alone cost;
/// larger messages have the bandwidth floor.
const RAW_MAX_FRAMES: usize = 8;

/// How many frames a bare round trip of a `size`-byte message sends on a `kind` port over a link
/// of `mtu`: as many as its lanbus headers, record header and bytes need.
fn raw_frames(kind: &str, size: usize, mtu: usize) -> usize {
    let udp = if kind == "udp" { super::UDP_IPV4_HEADERS } else { 0 };
    super::transport::peer::raw_frame_lengths(size, mtu.saturating_sub(udp)).len()
}

/// The floor under a row's latency (`raw:KIND latency_us`): half the median round trip of the
/// bare frames a message takes (one as long as the message's frame, or as many full frames as a
/// longer one needs, sent in one burst and answered once all arrived), sent by a process in
/// namespace a and bounced by one in namespace b, both busy polling the same kind of port on the
/// same veth, with no transport, engine or MPI above them.
fn raw_latency_us(veth: &VethPair, kind: &str, size: usize, quick: bool) -> anyhow::Result<f64> {
    use super::transport::{peer_command, run_client, Mode as Polling, Server};
    let exe = std::env::current_exe().context("finding this program")?;
    let exe = exe.to_string_lossy();
    // The bench transport's specs: over udp, they name each end's MAC, which the raw frames carry.
    let specs = super::transport::port_specs(veth, kind)?;
    let (sa, sb) = (specs.a, specs.b);
    let echo = peer_command(&veth.b.netns, &exe, &sb, veth.a.mac, "raw-echo", Polling::Busy);
    let _echo = Server::start(echo, &format!("{kind} raw echo"))?;
    let mut ping = peer_command(&veth.a.netns, &exe, &sa, veth.b.mac, "raw-ping", Polling::Busy);
    let seconds = if quick { "0.2" } else { "1" };
    ping.args(["--size", &size.to_string(), "--seconds", seconds]);
    let v = run_client(ping, &format!("{kind} raw ping"))?;
    let p50 = v["p50_us"].as_f64().context("the raw ping gave no p50_us")?;
    Ok(p50 / 2.0)
}

/// The floor under a row's bandwidth (`raw:KIND bw_mb_per_s`): the bare port's one-way rate in
/// frames of the link's MTU, MB/s.
fn raw_bw_mb_per_s(veth: &VethPair, kind: &str, quick: bool) -> anyhow::Result<f64> {
    let gbit = super::nvme::raw_one_way(kind, Some(veth), if quick { 0.5 } else { 2.0 })?;
    Ok(gbit * 1e3 / 8.0)
}

fn row_of(name: &str, metric: &str, v: f64, size: usize, mtu: usize) -> Row {
    Row::new(name, metric, v).with("size_bytes", size as u64).with("mtu", mtu as u64)
}

/// Runs the benchmark.
pub fn run(args: MsgArgs) -> anyhow::Result<()> {
    if args.sizes.is_empty() || args.sizes.contains(&0) {
        bail!("--sizes takes sizes of at least 1 byte");
    }
    if let Some(k) = args.ports.iter().find(|k| !["udp", "afpacket", "afxdp"].contains(&k.as_str())) {
        bail!("--ports: unknown kind {k:?} (udp, afpacket, afxdp)");
    }
    if args.protocols.is_empty() || args.modes.is_empty() {
        bail!("--protocols and --modes take at least one value each");
    }
    let window = args.bandwidth.then_some(args.window.max(1));
    let veth =
        VethPair::create().map_err(|skip| anyhow::anyhow!("bench msg needs two namespaces: {skip}"))?;
    veth.set_mtu(args.mtu).with_context(|| format!("setting the veth's MTU to {}", args.mtu))?;
    let peer = !args.no_peer;
    if peer && Command::new("NPtcp").arg("-h").output().is_err() {
        bail!("NPtcp is not installed (Debian package netpipe-tcp), or pass --no-peer");
    }
    let dir = std::env::temp_dir().join(format!("lanbus-bench-msg-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let runs = args.runs.unwrap_or(if args.quick { 1 } else { 5 }).max(1);
    let largest = *args.sizes.iter().max().expect("checked");
    let n = args.sizes.len();
    // Per (port, protocol): per size, the runs' latencies and bandwidths.
    let mut rows: Vec<(&str, Mode, Protocol, &str)> = Vec::new();
    for kind in &args.ports {
        for &mode in &args.modes {
            for &protocol in &args.protocols {
                for security in crate::SECURITY.into_iter().filter(|s| args.security.iter().any(|a| a == s)) {
                    rows.push((kind.as_str(), mode, protocol, security));
                }
            }
        }
    }
    let mut lat: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); n]; rows.len()];
    let mut bw: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); n]; rows.len()];
    let (mut np_lat, mut np_bw): (Vec<Vec<f64>>, Vec<Vec<f64>>) = (vec![Vec::new(); n], vec![Vec::new(); n]);
    // Open MPI rows: per program, (kind, mode, protocol), then the tcp BTL (`None`). NetPIPE
    // runs with the provider's own choice only.
    let mpi =
        if args.mpi { Some(super::msg_mpi::Mpi::prepare(&dir, args.fi_provider.as_deref())?) } else { None };
    let mut mpi_rows: Vec<(MpiRow<'_>, Program)> = Vec::new();
    if mpi.is_some() {
        for program in [Program::PingPong, Program::NetPipe] {
            for kind in &args.ports {
                for &mode in &args.modes {
                    for &protocol in &args.protocols {
                        if program == Program::PingPong || protocol == Protocol::Auto {
                            mpi_rows.push((MpiRow::Lanbus((kind.as_str(), mode, protocol)), program));
                        }
                    }
                }
            }
            if peer {
                mpi_rows.push((MpiRow::Tcp(Protocol::Auto), program));
                if program == Program::PingPong && args.protocols.contains(&Protocol::Rendezvous) {
                    mpi_rows.push((MpiRow::Tcp(Protocol::Rendezvous), program));
                }
            }
        }
    }
    let mut mpi_lat: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); n]; mpi_rows.len()];
    let mut mpi_bw: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); n]; mpi_rows.len()];
    let mut mpi_bytes: Vec<Vec<f64>> = vec![Vec::new(); mpi_rows.len()];
    // The bare ports' floors, per kind: per size, the runs' one-way latencies; the runs' one-way
    // rates. A kind whose floor failed once is not measured again (said on stderr).
    let mut raw_lat: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); n]; args.ports.len()];
    let mut raw_bw: Vec<Vec<f64>> = vec![Vec::new(); args.ports.len()];
    let mut raw_failed = vec![false; args.ports.len()];
    // Daemon mode's floor: the extra one-way time of its two hand-offs, once per run.
    let mut relay: Vec<f64> = Vec::new();
    let daemon = args.modes.contains(&Mode::Daemon);
    let mpi_limit = if args.quick { Duration::from_secs(60) } else { Duration::from_secs(240) };
    for r in 0..runs {
        for (k, &(kind, mode, protocol, security)) in rows.iter().enumerate() {
            let what = format!("{kind} {} {} security {security}", mode.name(), protocol.name());
            eprintln!("bench msg: run {}/{runs}: {what}", r + 1);
            let m = lanbus_row(kind, &veth, mode, protocol, security, &args.sizes, window, args.quick, &dir)
                .with_context(|| format!("{what} row"))?;
            for i in 0..n {
                lat[k][i].extend(m.latency_us[i]);
                bw[k][i].extend(m.bw_mb_per_s[i]);
            }
        }
        for (p, kind) in args.ports.iter().enumerate() {
            if raw_failed[p] {
                continue;
            }
            eprintln!("bench msg: run {}/{runs}: raw:{kind} (the bare port's floor)", r + 1);
            let measured = (|| -> anyhow::Result<()> {
                for (i, &size) in args.sizes.iter().enumerate() {
                    if raw_frames(kind, size, args.mtu) <= RAW_MAX_FRAMES {
                        raw_lat[p][i].push(raw_latency_us(&veth, kind, size, args.quick)?);
                    }
                }
                if window.is_some() {
                    raw_bw[p].push(raw_bw_mb_per_s(&veth, kind, args.quick)?);
                }
                Ok(())
            })();
            if let Err(e) = measured {
                eprintln!("bench msg: raw:{kind}, run {}: {e:#} (no more floors of {kind})", r + 1);
                raw_failed[p] = true;
            }
        }
        if daemon {
            eprintln!("bench msg: run {}/{runs}: raw:relay (daemon mode's two hand-offs alone)", r + 1);
            relay.push(super::msg_relay::extra_one_way_us(args.quick)?);
        }
        if peer {
            eprintln!("bench msg: run {}/{runs}: NPtcp", r + 1);
            let pick = |np: &[(usize, f64)], out: &mut Vec<Vec<f64>>| {
                for (i, &size) in args.sizes.iter().enumerate() {
                    out[i].extend(np.iter().find(|(b, _)| *b == size).map(|&(_, v)| v));
                }
            };
            match nptcp(&veth, largest, false, args.quick, &dir) {
                Ok(np) => pick(&np, &mut np_lat),
                Err(e) => eprintln!("bench msg: NPtcp ping-pong, run {}: {e:#}", r + 1),
            }
            if window.is_some() {
                match nptcp(&veth, largest, true, args.quick, &dir) {
                    Ok(np) => pick(&np, &mut np_bw),
                    Err(e) => eprintln!("bench msg: NPtcp streaming, run {}: {e:#}", r + 1),
                }
            }
        }
        if let Some(mpi) = &mpi {
            for (k, &(row, program)) in mpi_rows.iter().enumerate() {
                let (what, transport, limit) = match row {
                    MpiRow::Lanbus((kind, mode, protocol)) => (
                        format!("Open MPI over lanbus {kind} {} {}", mode.name(), protocol.name()),
                        match mode {
                            Mode::Direct => Transport::Direct(kind),
                            Mode::Daemon => Transport::Daemon(kind),
                        },
                        protocol.provider_eager_limit(),
                    ),
                    MpiRow::Tcp(Protocol::Rendezvous) => (
                        "Open MPI tcp BTL rendezvous".to_string(),
                        Transport::Tcp,
                        Some(TCP_RENDEZVOUS_LIMIT),
                    ),
                    MpiRow::Tcp(_) => ("Open MPI tcp BTL".to_string(), Transport::Tcp, None),
                };
                let what = format!("{what}, {}", program.name());
                eprintln!("bench msg: run {}/{runs}: {what}", r + 1);
                let (sizes, w) = (&args.sizes, window.unwrap_or(0));
                match mpi.job(&veth, transport, limit, program, sizes, w, mpi_limit) {
                    Ok(job) => {
                        for (i, &(us, mbs)) in
                            job.figures.iter().enumerate().filter_map(|(i, f)| Some((i, f.as_ref()?)))
                        {
                            mpi_lat[k][i].push(us);
                            if mbs > 0.0 {
                                mpi_bw[k][i].push(mbs);
                            }
                        }
                        mpi_bytes[k].push(job.veth_bytes as f64);
                    }
                    // A stalled or failed job counts as none (said here), as NetPIPE's do.
                    Err(e) => eprintln!("bench msg: {what}, run {}: {e:#}", r + 1),
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let mut report = Report::new("msg");
    for row in crate::crypto_rows(&args.security, runs) {
        report.push(row);
    }
    let row = |name: &str, metric: &str, v: f64, size: usize| {
        Row::new(name, metric, v).with("size_bytes", size as u64).with("mtu", args.mtu as u64)
    };
    let mut ratios = Vec::new();
    for (i, &size) in args.sizes.iter().enumerate() {
        let (peer_lat, peer_bw) = (median(&np_lat[i]), median(&np_bw[i]));
        if let Some(us) = peer_lat {
            report.push(row("peer:NPtcp", "latency_us", us, size));
        }
        if let Some(mbs) = peer_bw {
            report.push(row("peer:NPtcp", "bw_mb_per_s", mbs, size));
        }
        for (k, &(kind, mode, protocol, security)) in rows.iter().enumerate() {
            let with = |r: Row| {
                r.with("protocol", protocol.name()).with("mode", mode.name()).with("security", security)
            };
            if let Some(us) = median(&lat[k][i]) {
                report.push(with(row(kind, "latency_us", us, size)));
                if let Some(p) = peer_lat {
                    ratios.push(with(row(kind, "latency_vs_nptcp", us / p, size)));
                }
            }
            if let Some(mbs) = median(&bw[k][i]) {
                report.push(with(row(kind, "bw_mb_per_s", mbs, size)));
                if let Some(p) = peer_bw {
                    ratios.push(with(row(kind, "bw_vs_nptcp", mbs / p, size)));
                }
            }
        }
    }
    // The floors, beside the rows they bound; against Open MPI's tcp BTL (its ping-pong program)
    // when it ran: a ratio above the goal's says the goal is under the bare port's own figure.
    let tcp = mpi_rows.iter().position(|&(r, p)| r == MpiRow::Tcp(Protocol::Auto) && p == Program::PingPong);
    for (p, kind) in args.ports.iter().enumerate() {
        let name = format!("raw:{kind}");
        for (i, &size) in args.sizes.iter().enumerate() {
            if let Some(us) = median(&raw_lat[p][i]) {
                report.push(row(&name, "latency_us", us, size));
                if let Some(t) = tcp.and_then(|t| median(&mpi_lat[t][i])) {
                    ratios.push(row(&name, "latency_vs_ompi_tcp", us / t, size));
                }
            }
            if let (Some(mbs), Some(t)) = (median(&raw_bw[p]), tcp.and_then(|t| median(&mpi_bw[t][i]))) {
                ratios.push(row(&name, "bw_vs_ompi_tcp", mbs / t, size));
            }
        }
        if let Some(mbs) = median(&raw_bw[p]) {
            let frame = args.mtu as u64;
            report.push(Row::new(&name, "bw_mb_per_s", mbs).with("frame_bytes", frame).with("mtu", frame));
        }
    }
    // Daemon mode's floor beside its goal (within 1.5x of direct mode): each daemon row's time
    // against its direct row's, and the direct row's time plus the relay's extra against the
    // same: a floor ratio above the goal's says the goal is under what the hand-offs cost here.
    let relay_us = median(&relay);
    if let Some(extra) = relay_us {
        report.push(row("raw:relay", "latency_us", extra, super::msg_relay::RECORD));
    }
    let vs_direct = |daemon_us: &[Vec<f64>],
                     direct_us: &[Vec<f64>],
                     with: &dyn Fn(Row) -> Row,
                     name: &str| {
        let mut out = Vec::new();
        for (i, &size) in args.sizes.iter().enumerate() {
            let (Some(d), Some(direct)) = (median(&daemon_us[i]), median(&direct_us[i])) else { continue };
            out.push(with(row_of(name, "latency_vs_direct", d / direct, size, args.mtu)));
            if let Some(extra) = relay_us {
                out.push(with(row_of(name, "floor_vs_direct", (direct + extra) / direct, size, args.mtu)));
            }
        }
        out
    };
    for (k, &(kind, mode, protocol, security)) in rows.iter().enumerate() {
        let direct = rows
            .iter()
            .position(|&(kd, m, p, s)| kd == kind && m == Mode::Direct && p == protocol && s == security);
        if let (Mode::Daemon, Some(d)) = (mode, direct) {
            let with = |r: Row| {
                r.with("protocol", protocol.name()).with("mode", mode.name()).with("security", security)
            };
            ratios.extend(vs_direct(&lat[k], &lat[d], &with, kind));
        }
    }
    for (k, &(row, program)) in mpi_rows.iter().enumerate() {
        let MpiRow::Lanbus((kind, Mode::Daemon, protocol)) = row else { continue };
        let direct = mpi_rows
            .iter()
            .position(|&(r, p)| r == MpiRow::Lanbus((kind, Mode::Direct, protocol)) && p == program);
        if let Some(d) = direct {
            let with = |r: Row| {
                r.with("launcher", "mpirun")
                    .with("program", program.name())
                    .with("mode", "daemon")
                    .with("protocol", protocol.name())
            };
            ratios.extend(vs_direct(&mpi_lat[k], &mpi_lat[d], &with, &format!("mpi:lanbus-{kind}")));
        }
    }
    for (k, &(row, program)) in mpi_rows.iter().enumerate() {
        let name = match row {
            MpiRow::Lanbus((kind, ..)) => format!("mpi:lanbus-{kind}"),
            MpiRow::Tcp(_) => "peer:ompi-tcp".to_string(),
        };
        let with = |r: Row| {
            let r = r.with("launcher", "mpirun").with("program", program.name());
            match row {
                MpiRow::Lanbus((_, mode, protocol)) => {
                    r.with("mode", mode.name()).with("protocol", protocol.name())
                }
                MpiRow::Tcp(Protocol::Auto) => r,
                MpiRow::Tcp(protocol) => {
                    r.with("protocol", protocol.name()).with("tcp_eager_limit", TCP_RENDEZVOUS_LIMIT)
                }
            }
        };
        // Ratios against the tcp BTL at its own settings, for the lanbus rows.
        let peer_k = mpi_rows
            .iter()
            .position(|&(r, p)| r == MpiRow::Tcp(Protocol::Auto) && p == program)
            .filter(|_| matches!(row, MpiRow::Lanbus(_)));
        for (i, &size) in args.sizes.iter().enumerate() {
            if matches!(row, MpiRow::Lanbus((_, _, protocol)) if !protocol.carries(size)) {
                continue;
            }
            if let Some(us) = median(&mpi_lat[k][i]) {
                report.push(with(row_of(&name, "latency_us", us, size, args.mtu)));
                if let Some(p) = peer_k.filter(|&p| p != k).and_then(|p| median(&mpi_lat[p][i])) {
                    ratios.push(with(row_of(&name, "latency_vs_ompi_tcp", us / p, size, args.mtu)));
                }
            }
            if let Some(mbs) = median(&mpi_bw[k][i]) {
                report.push(with(row_of(&name, "bw_mb_per_s", mbs, size, args.mtu)));
                if let Some(p) = peer_k.filter(|&p| p != k).and_then(|p| median(&mpi_bw[p][i])) {
                    ratios.push(with(row_of(&name, "bw_vs_ompi_tcp", mbs / p, size, args.mtu)));
                }
            }
        }
        // Proof that the job crossed the veth: its bytes (both ways) during the job.
        if let Some(b) = median(&mpi_bytes[k]) {
            report.push(with(Row::new(&name, "veth_bytes", b).with("mtu", args.mtu as u64)));
        }
    }
    write_plots(&report.rows, &args.png)?;
    report.rows.extend(ratios);
    crate::versus_security_off(&mut report, "latency_us", false, Some(|us| us));
    crate::versus_security_off(&mut report, "bw_mb_per_s", true, None);
    report.finish(args.json.as_deref())?;
    Ok(())
}

/// Latency and bandwidth by size, a line per row (its name, mode and protocol).
fn write_plots(rows: &[Row], prefix: &str) -> anyhow::Result<()> {
    for (metric, file, y_label) in
        [("latency_us", "latency", "one-way latency (µs)"), ("bw_mb_per_s", "bandwidth", "MB/s")]
    {
        let mut series: Vec<Series> = Vec::new();
        for r in rows.iter().filter(|r| r.metric == metric) {
            let Some(size) = r.params.get("size_bytes").and_then(|v| v.as_f64()) else { continue };
            let param = |k: &str| r.params.get(k).and_then(|v| v.as_str()).map(|s| format!(" {s}"));
            let name = format!(
                "{}{}{}{}",
                r.name,
                param("mode").unwrap_or_default(),
                param("protocol").unwrap_or_default(),
                param("program").unwrap_or_default()
            );
            match series.iter_mut().find(|s| s.name == name) {
                Some(s) => s.points.push((size, r.value)),
                None => series.push(Series { name, points: vec![(size, r.value)] }),
            }
        }
        series.retain(|s| s.points.iter().all(|&(_, v)| v > 0.0));
        if series.is_empty() {
            continue;
        }
        for s in &mut series {
            s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        let plot = Plot {
            title: format!("lanbus messaging, {file} by message size"),
            x_label: "message size (bytes)".into(),
            y_label: y_label.into(),
            x_log: true,
            y_log: true,
            legend_right: metric == "bw_mb_per_s",
            series,
        };
        let path = PathBuf::from(format!("{prefix}-{file}.png"));
        write_png(&plot, &path)?;
        eprintln!("bench msg: plot {}", path.display());
    }
    Ok(())
}
