//! `lanbus bench stack`: the rump-kernel networking study's Figs. 2, 5, 6 and 7, throughput by the
//! application's buffer size, sending and receiving, through the TCP/IP stack server and through
//! Linux.
//!
//! Two network namespaces joined by a veth pair at MTU 1500. In the first, `lanbus stackd` runs
//! on the veth (its own address, 10.91.0.1) and the application is this process, attached to the
//! server through the client library with one copy unit per row (`--units`: the study's baseline,
//! one 2 KiB cluster per request over the Unix socket, then CLUSTER_BYTESxCLUSTERS over shared
//! memory). The peer row, `linux`, is the same application on Linux's own TCP over the same veth
//! (the kernel has a second address there, 10.91.0.3). In the other namespace Linux's TCP is the
//! far end for every row: a sink for `send` (the application writes with its buffer size) and a
//! source for `recv` (the application reads with it). The `stack:zero-copy` row sends through a
//! zero-copy connection: the application's bytes are made in the connection's shared send buffer
//! (reserve, then commit a buffer's worth), which the stack transmits from in place; like the
//! other rows' buffers, they are not rewritten between calls. Each test runs `--seconds`; the figure is
//! bytes the receiving side got over the time from connect to its end of stream, in Gbit/s.
//! `--offloads default,off` runs everything with the veth's default offloads (TSO, GSO, GRO: 64 KiB
//! segments cross) and with segmentation offloads off (every segment a frame). Also iperf3 (TCP,
//! `--seconds` rounded up) through the preload library (`iperf3:stack`, needs
//! `liblanbus_sock.so` next to this program) against the same iperf3 on Linux (`iperf3:linux`),
//! both ways (`recv` is `-R`). Runs go in turns
//! (`--runs`, default 5); a figure is the median; each stack row carries `ratio_vs_linux`. Also
//! `idle:stackd`, the CPU an idle server uses, and `raw:afpacket`, the floor under sending: the
//! bare packet socket's one-way rate with MTU frames across the same veth (whole frames, and as
//! TCP payload against Linux's best sending figure). Also real servers (`--servers`, with the first
//! offload setting; see `stack_servers`): nginx's small page under wrk, kept alive and one request
//! per connection (with p99), and memcached's gets under memcslap, through the preload library
//! against the same server on Linux's TCP. Table, JSON (`--json`), PNG per direction and offload
//! setting (`--png` prefix).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use lanbus_port::netns::VethPair;
use lanbus_stack::client::StackClient;
use lanbus_stack::CopyUnit;

use super::interrupt::KillOnDrop;
use super::report::{median, Report, Row};
use crate::plot::{write_png, Plot, Series};

/// `lanbus bench stack` options.
#[derive(Debug, Args)]
pub struct StackBenchArgs {
    /// Write the common JSON report here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write plots as PREFIX-DIRECTION-OFFLOADS.png.
    #[arg(long, default_value = "bench-stack")]
    png: String,
    /// Copy units of the stack rows (CLUSTER_BYTESxCLUSTERS[,socket]), comma separated.
    #[arg(long, default_value = "2048x1,socket;2048x1;2048x16;4096x16;2048x32", value_delimiter = ';')]
    units: Vec<CopyUnit>,
    /// Application buffer sizes in bytes (K and M suffixes), comma separated.
    #[arg(long, default_value = "1K,4K,64K,1M,4M")]
    buffers: String,
    /// Veth offload settings to run: default, off (segmentation offloads off), or both.
    #[arg(long, default_value = "default,off")]
    offloads: String,
    /// Also a `stack:zero-copy` row (sending only).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    zero_copy: bool,
    /// Runs of every row, in turns; a figure is their median.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Seconds of each test.
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Also the server rows (nginx under wrk, memcached under memcslap, through the preload
    /// library and on Linux), with the first offload setting.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    servers: bool,
}

const STACK_IP: Ipv4Addr = Ipv4Addr::new(10, 91, 0, 1);
const PEER_IP: Ipv4Addr = Ipv4Addr::new(10, 91, 0, 2);
const LINUX_IP: Ipv4Addr = Ipv4Addr::new(10, 91, 0, 3);

fn parse_size(s: &str) -> anyhow::Result<usize> {
    let s = s.trim();
    let (n, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1024),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        _ => (s, 1),
    };
    let n: usize = n.parse().with_context(|| format!("{s:?}: a size like 64K"))?;
    if n == 0 || n * mult > 64 << 20 {
        bail!("{s:?}: buffers are 1 byte to 64 MiB");
    }
    Ok(n * mult)
}

fn label(bytes: usize) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{}M", bytes >> 20)
    } else if bytes >= 1024 && bytes.is_multiple_of(1024) {
        format!("{}K", bytes >> 10)
    } else {
        bytes.to_string()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    Send,
    Recv,
}

impl Direction {
    fn name(self) -> &'static str {
        match self {
            Direction::Send => "send",
            Direction::Recv => "recv",
        }
    }
}

/// The far end in the peer namespace: a sink (the application sends) or a source (it receives).
/// Returns (bytes, seconds) as the receiving side saw them when this side receives.
fn far_end(
    ns: String,
    port: u16,
    dir: Direction,
    seconds: f64,
) -> anyhow::Result<std::thread::JoinHandle<(u64, f64)>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        let setup = (|| -> anyhow::Result<TcpListener> {
            lanbus_port::netns::enter(&ns)?;
            Ok(TcpListener::bind((PEER_IP, port))?)
        })();
        let l = match setup {
            Ok(l) => {
                let _ = tx.send(Ok(()));
                l
            }
            Err(e) => {
                let _ = tx.send(Err(e));
                return (0, 0.0);
            }
        };
        let Ok((s, _)) = l.accept() else { return (0, 0.0) };
        // The far end does the other half: it reads when the application sends.
        let theirs = match dir {
            Direction::Send => Direction::Recv,
            Direction::Recv => Direction::Send,
        };
        drive(s, theirs, 256 * 1024, seconds)
    });
    rx.recv_timeout(Duration::from_secs(10)).context("the far end did not start")??;
    Ok(t)
}

/// What one row's application sends and receives through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Through {
    /// Linux's own TCP.
    Linux,
    /// The stack server with a copy unit.
    Copy(CopyUnit),
    /// The stack server's zero-copy connection.
    ZeroCopy,
}

/// The application's half on a zero-copy connection: `buffer` bytes committed per call.
fn drive_zero_copy(mut s: lanbus_stack::client::ZeroCopyStream, buffer: usize, seconds: f64) {
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    while Instant::now() < until {
        let mut left = buffer;
        while left > 0 {
            let Ok(room) = s.reserve() else { return };
            let n = room.len().min(left);
            if s.commit(n).is_err() {
                return;
            }
            left -= n;
        }
    }
}

/// The application's half: a connected stream, written or read with `buffer`-sized calls.
fn drive(mut s: impl Read + Write, dir: Direction, buffer: usize, seconds: f64) -> (u64, f64) {
    let mut buf = vec![0x5au8; buffer];
    let start = Instant::now();
    match dir {
        Direction::Send => {
            let until = start + Duration::from_secs_f64(seconds);
            while Instant::now() < until {
                if s.write_all(&buf).is_err() {
                    break;
                }
            }
            (0, 0.0)
        }
        Direction::Recv => {
            let mut got = 0u64;
            while let Ok(n) = s.read(&mut buf) {
                if n == 0 {
                    break;
                }
                got += n as u64;
            }
            (got, start.elapsed().as_secs_f64())
        }
    }
}

struct Bench {
    veth: VethPair,
    dir: PathBuf,
    socket: PathBuf,
    next_port: u16,
}

impl Bench {
    fn set_offloads(&self, on: bool) -> anyhow::Result<()> {
        let v = if on { "on" } else { "off" };
        for end in [&self.veth.a, &self.veth.b] {
            let out = end
                .netns
                .command("ethtool")
                .args(["-K", &end.ifname, "tso", v, "gso", v, "gro", v])
                .output()
                .context("ethtool (Debian package ethtool; scripts/setup installs it)")?;
            if !out.status.success() {
                bail!("ethtool -K {}: {}", end.ifname, String::from_utf8_lossy(&out.stderr));
            }
        }
        Ok(())
    }

    fn start_stackd(&self) -> anyhow::Result<KillOnDrop> {
        let exe = std::env::current_exe().context("finding this program")?;
        let _ = std::fs::remove_file(&self.socket);
        let child = self
            .veth
            .a
            .netns
            .command(&exe.to_string_lossy())
            .args(["stackd", "--port", &format!("afpacket:{}", self.veth.a.ifname)])
            .args(["--ip", &format!("{STACK_IP}/24"), "--socket"])
            .arg(&self.socket)
            .arg("--control")
            .arg(self.dir.join("stackd.ctl"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.dir.join("stackd.log"))?)
            .spawn()?;
        let child = KillOnDrop(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.socket.exists() {
            if Instant::now() > deadline {
                bail!("lanbus stackd did not start (see {})", self.dir.join("stackd.log").display());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(child)
    }

    /// One test: Gbit/s.
    fn once(&mut self, row: &Through, dir: Direction, buffer: usize, seconds: f64) -> anyhow::Result<f64> {
        self.next_port = if self.next_port >= 60000 { 20000 } else { self.next_port + 1 };
        let port = self.next_port;
        let far = far_end(self.veth.b.netns.name().to_string(), port, dir, seconds)?;
        let to = SocketAddrV4::new(PEER_IP, port);
        let mine = match row {
            Through::Copy(unit) => {
                let client = StackClient::attach(&self.socket, *unit)?;
                let s =
                    client.connect(to).with_context(|| format!("connecting to {to} through the stack"))?;
                drive(s, dir, buffer, seconds)
            }
            Through::ZeroCopy => {
                let client = StackClient::attach(&self.socket, CopyUnit::DEFAULT)?;
                let s = client
                    .connect_zero_copy(to)
                    .with_context(|| format!("connecting to {to} through the stack, zero copy"))?;
                drive_zero_copy(s, buffer, seconds);
                (0, 0.0)
            }
            Through::Linux => {
                let ns = self.veth.a.netns.name().to_string();
                std::thread::spawn(move || -> anyhow::Result<(u64, f64)> {
                    lanbus_port::netns::enter(&ns)?;
                    let sock = socket2_bind_connect(LINUX_IP, to)?;
                    Ok(drive(sock, dir, buffer, seconds))
                })
                .join()
                .map_err(|_| anyhow::anyhow!("the Linux application panicked"))??
            }
        };
        let theirs = far.join().map_err(|_| anyhow::anyhow!("the far end panicked"))?;
        let (bytes, secs) = if dir == Direction::Send { theirs } else { mine };
        if secs <= 0.0 {
            bail!("nothing arrived");
        }
        Ok(bytes as f64 * 8.0 / secs / 1e9)
    }
}

/// A kernel TCP connection from `local` to `to`.
fn socket2_bind_connect(local: Ipv4Addr, to: SocketAddrV4) -> anyhow::Result<TcpStream> {
    use std::os::fd::FromRawFd;
    // SAFETY: socket() has no memory preconditions; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    let sa = |a: SocketAddrV4| libc::sockaddr_in {
        sin_family: libc::AF_INET as u16,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as u32;
    let bind = sa(SocketAddrV4::new(local, 0));
    // SAFETY: bind/connect with a valid sockaddr_in of the given length.
    if unsafe { libc::bind(fd, (&bind as *const libc::sockaddr_in).cast(), len) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    let peer = sa(to);
    // SAFETY: as above.
    if unsafe { libc::connect(fd, (&peer as *const libc::sockaddr_in).cast(), len) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(stream)
}

/// The preload library next to this program (`cargo build --release -p lanbus-sock`).
fn preload_library() -> Option<PathBuf> {
    let lib = std::env::current_exe().ok()?.parent()?.join("liblanbus_sock.so");
    lib.exists().then_some(lib)
}

impl Bench {
    /// iperf3 for `seconds` from the first namespace to `iperf3 -s` in the other: through the
    /// preload library (`lib`) or on Linux's TCP from its address there. Gbit/s received.
    fn iperf3(&self, lib: Option<&Path>, reverse: bool, seconds: f64) -> anyhow::Result<f64> {
        let srv = self
            .veth
            .b
            .netns
            .command("iperf3")
            .args(["-s", "-1", "-B", &PEER_IP.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("iperf3 (Debian package iperf3; scripts/setup installs it)")?;
        let _srv = KillOnDrop(srv);
        std::thread::sleep(Duration::from_millis(300));
        let secs = format!("{}", seconds.ceil().max(1.0) as u64);
        let mut cmd = match lib {
            Some(lib) => {
                let mut c = std::process::Command::new("iperf3");
                c.env("LD_PRELOAD", lib).env("LANBUS_STACK_SOCKET", &self.socket);
                c
            }
            None => {
                let mut c = self.veth.a.netns.command("iperf3");
                c.args(["-B", &LINUX_IP.to_string()]);
                c
            }
        };
        cmd.args(["-c", &PEER_IP.to_string(), "-t", &secs, "--json", "--connect-timeout", "5000"]);
        if reverse {
            cmd.arg("-R");
        }
        let out = cmd.output()?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("iperf3's JSON")?;
        if let Some(e) = v["error"].as_str() {
            bail!("iperf3: {e}");
        }
        Ok(v["end"]["sum_received"]["bits_per_second"].as_f64().context("iperf3's received rate")? / 1e9)
    }
}

/// CPU use of process `pid` over `window`, in percent of one core.
fn cpu_percent(pid: u32, window: Duration) -> anyhow::Result<f64> {
    let ticks = || -> anyhow::Result<u64> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
        let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
        Ok(fields.get(11).and_then(|u| u.parse::<u64>().ok()).unwrap_or(0)
            + fields.get(12).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0))
    };
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let before = ticks()?;
    std::thread::sleep(window);
    Ok((ticks()? - before) as f64 / hz / window.as_secs_f64() * 100.0)
}

fn row_name(row: &Through) -> String {
    match row {
        Through::Linux => "linux".into(),
        Through::Copy(u) if *u == CopyUnit::BASELINE => "stack:baseline".into(),
        Through::Copy(u) => format!("stack:{u}"),
        Through::ZeroCopy => "stack:zero-copy".into(),
    }
}

/// Runs `lanbus bench stack`.
pub fn run(args: StackBenchArgs) -> anyhow::Result<()> {
    let buffers: Vec<usize> = args.buffers.split(',').map(parse_size).collect::<anyhow::Result<_>>()?;
    let offloads: Vec<bool> = args
        .offloads
        .split(',')
        .map(|s| match s.trim() {
            "default" => Ok(true),
            "off" => Ok(false),
            other => bail!("--offloads: {other:?} is not default or off"),
        })
        .collect::<anyhow::Result<_>>()?;
    if args.runs == 0 || args.seconds <= 0.0 || buffers.is_empty() || offloads.is_empty() {
        bail!("--runs, --seconds, --buffers and --offloads must not be empty or zero");
    }
    let veth = VethPair::create().map_err(|s| anyhow::anyhow!("bench stack needs root: {s}"))?;
    veth.set_mtu(1500)?;
    let add = |end: &lanbus_port::netns::VethEnd, ip: Ipv4Addr| {
        end.netns.ip(&["addr", "add", &format!("{ip}/24"), "dev", &end.ifname]).map(|_| ())
    };
    add(&veth.b, PEER_IP)?;
    add(&veth.a, LINUX_IP)?;
    let dir = std::env::temp_dir().join(format!("lanbus-bench-stack-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let socket = dir.join("stackd.sock");
    let mut bench = Bench { veth, dir: dir.clone(), socket, next_port: 20000 };
    let rows: Vec<Through> = std::iter::once(Through::Linux)
        .chain(args.units.iter().copied().map(Through::Copy))
        .chain(args.zero_copy.then_some(Through::ZeroCopy))
        .collect();
    let mut samples: std::collections::BTreeMap<(bool, &str, String, usize), Vec<f64>> = Default::default();
    let mut idle = Vec::new();
    let mut server_samples: std::collections::BTreeMap<(String, &str), Vec<f64>> = Default::default();
    let sends_only = usize::from(args.zero_copy);
    let total = offloads.len() * args.runs * (rows.len() * 2 - sends_only) * buffers.len();
    let mut done = 0;
    let lib = preload_library();
    if lib.is_none() {
        eprintln!("bench stack: no liblanbus_sock.so next to this program (cargo build --release -p lanbus-sock): no iperf3:stack rows");
    }
    for &on in &offloads {
        bench.set_offloads(on)?;
        let stackd = bench.start_stackd()?;
        // The kernel's neighbours and the stack's ARP settle before the first figure.
        std::thread::sleep(Duration::from_millis(300));
        if idle.is_empty() {
            idle.push(cpu_percent(stackd.0.id(), Duration::from_secs(2)).unwrap_or(f64::NAN));
        }
        for run in 0..args.runs {
            // The floor under per-packet sending: the bare packet socket's one-way rate with
            // MTU frames from the stack's side of the veth to a packet socket on the other.
            match super::nvme::raw_one_way("afpacket", Some(&bench.veth), args.seconds) {
                Ok(g) => samples.entry((on, "send", "raw:afpacket".to_string(), 0)).or_default().push(g),
                Err(e) => eprintln!("\nbench stack: raw:afpacket: {e:#}"),
            }
            if let (true, true, Some(lib)) = (args.servers, on == offloads[0], lib.as_deref()) {
                eprint!("\rbench stack: servers, run {}   ", run + 1);
                let servers = super::stack_servers::Servers {
                    near: &bench.veth.a.netns,
                    far: &bench.veth.b.netns,
                    stack_ip: STACK_IP,
                    linux_ip: LINUX_IP,
                    socket: &bench.socket,
                    lib,
                    dir: &bench.dir,
                    seconds: args.seconds,
                };
                bench.next_port = if bench.next_port >= 60000 { 20000 } else { bench.next_port + 2 };
                match servers.run(bench.next_port) {
                    Ok(figures) => {
                        for (row, metric, v) in figures {
                            server_samples.entry((row, metric)).or_default().push(v);
                        }
                    }
                    Err(e) => eprintln!("\nbench stack: servers: {e:#}"),
                }
            }
            for (name, lib) in [("iperf3:linux", None), ("iperf3:stack", lib.as_deref())] {
                if name == "iperf3:stack" && lib.is_none() {
                    continue;
                }
                for dir in [Direction::Send, Direction::Recv] {
                    match bench.iperf3(lib, dir == Direction::Recv, args.seconds) {
                        Ok(g) => samples.entry((on, dir.name(), name.to_string(), 0)).or_default().push(g),
                        Err(e) => eprintln!("\nbench stack: {name} {}: {e:#}", dir.name()),
                    }
                }
            }
            for row in &rows {
                for dir in [Direction::Send, Direction::Recv] {
                    if *row == Through::ZeroCopy && dir == Direction::Recv {
                        continue;
                    }
                    for &b in &buffers {
                        done += 1;
                        eprint!(
                            "\rbench stack: {done}/{total} offloads {} run {} {} {} {:>4}   ",
                            if on { "default" } else { "off" },
                            run + 1,
                            row_name(row),
                            dir.name(),
                            label(b)
                        );
                        match bench.once(row, dir, b, args.seconds) {
                            Ok(g) => samples.entry((on, dir.name(), row_name(row), b)).or_default().push(g),
                            Err(e) => eprintln!(
                                "\nbench stack: {} {} {}: {e:#}",
                                row_name(row),
                                dir.name(),
                                label(b)
                            ),
                        }
                    }
                }
            }
        }
        drop(stackd);
    }
    eprintln!();
    let mut report = Report::new("stack");
    for &on in &offloads {
        let off_name = if on { "default" } else { "off" };
        for dir in [Direction::Send, Direction::Recv] {
            let mut series = Vec::new();
            for row in &rows {
                let name = row_name(row);
                let mut points = Vec::new();
                for &b in &buffers {
                    let Some(v) = samples.get(&(on, dir.name(), name.clone(), b)) else { continue };
                    let g = median(v).unwrap_or(0.0);
                    points.push((b as f64, g));
                    let mut r = Row::new(&name, "gbit_per_s", g)
                        .with("direction", dir.name())
                        .with("buffer_bytes", b)
                        .with("offloads", off_name)
                        .with("mtu", 1500)
                        .with("runs", v.len());
                    if *row != Through::Linux {
                        if let Some(p) = samples.get(&(on, dir.name(), "linux".to_string(), b)) {
                            r = r.with("ratio_vs_linux", g / median(p).unwrap_or(0.0).max(1e-9));
                        }
                    }
                    report.push(r);
                }
                series.push(Series { name, points });
            }
            if let Some(v) = samples.get(&(on, dir.name(), "raw:afpacket".to_string(), 0)) {
                // Whole 1514-byte frames; a TCP segment of them carries 1448 bytes of data.
                let g = median(v).unwrap_or(0.0);
                let payload = g * 1448.0 / 1514.0;
                let mut r = Row::new("raw:afpacket", "gbit_per_s_one_way", g)
                    .with("direction", dir.name())
                    .with("offloads", off_name)
                    .with("mtu", 1500)
                    .with("tcp_payload_gbit_per_s", payload)
                    .with("runs", v.len());
                let best = buffers.iter().filter_map(|&b| {
                    samples.get(&(on, dir.name(), "linux".to_string(), b)).and_then(|p| median(p))
                });
                if let Some(linux) = best.fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x)))) {
                    r = r.with("payload_ratio_vs_linux", payload / linux.max(1e-9));
                }
                report.push(r);
            }
            let peer = samples.get(&(on, dir.name(), "iperf3:linux".to_string(), 0)).and_then(|v| median(v));
            for name in ["iperf3:linux", "iperf3:stack"] {
                let Some(v) = samples.get(&(on, dir.name(), name.to_string(), 0)) else { continue };
                let g = median(v).unwrap_or(0.0);
                let mut r = Row::new(name, "gbit_per_s", g)
                    .with("direction", dir.name())
                    .with("offloads", off_name)
                    .with("mtu", 1500)
                    .with("runs", v.len());
                if let Some(p) = peer.filter(|_| name == "iperf3:stack") {
                    r = r.with("ratio_vs_linux", g / p.max(1e-9));
                }
                report.push(r);
            }
            let plot = Plot {
                title: format!(
                    "{} through the stack server and Linux (MTU 1500, offloads {off_name})",
                    dir.name()
                ),
                x_label: "application buffer (bytes)".into(),
                y_label: "Gbit/s".into(),
                x_log: true,
                y_log: false,
                legend_right: false,
                series,
            };
            let png = PathBuf::from(format!("{}-{}-{off_name}.png", args.png, dir.name()));
            if let Err(e) = write_png(&plot, &png) {
                eprintln!("bench stack: plot: {e:#}");
            }
        }
    }
    for ((row, metric), v) in &server_samples {
        let value = median(v).unwrap_or(0.0);
        let mut r = Row::new(row, *metric, value)
            .with("offloads", if offloads[0] { "default" } else { "off" })
            .with("connections", if row.starts_with("memcached") { 8 } else { 64 })
            .with("runs", v.len());
        if let Some(linux) = row.strip_suffix(":stack").map(|base| format!("{base}:linux")) {
            if let Some(p) = server_samples.get(&(linux, *metric)).and_then(|p| median(p)) {
                r = r.with("ratio_vs_linux", value / p.max(1e-9));
            }
        }
        report.push(r);
    }
    report.push(
        Row::new("idle:stackd", "cpu_percent", idle.first().copied().unwrap_or(f64::NAN)).with("seconds", 2),
    );
    let _ = std::fs::remove_dir_all(&dir);
    report.finish(args.json.as_deref())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("64K").unwrap(), 65536);
        assert_eq!(parse_size("4M").unwrap(), 4 << 20);
        assert_eq!(parse_size("1000").unwrap(), 1000);
        assert!(parse_size("0").is_err());
        assert!(parse_size("1G").is_err());
        assert_eq!(label(65536), "64K");
        assert_eq!(label(1 << 20), "1M");
    }
}
